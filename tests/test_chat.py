"""Conversations: the template, the loss mask it implies, their preparation, and scripts/chat.py."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ctrl_c_at_the_first_call, make_text, run_main, tiny_args, tiny_model, write_chats

import prepare
import sample as sample_module
import tokenizer
from cli import ConfigError, DataError
from config import TrainConfig, make_config
from data import Conversations, corpus_for, eval_windows, load_corpus, training_stream
from finetune import BEGIN, learned, prepare_conversations, split_indices
from scripts import chat as chat_script
from scripts import export_hf
from scripts.prepare import main as prepare_main
from tokenizer import END, USER, CharTokenizer, chat_tokenizer, render, tokenizer_from_meta

CHARS = "".join(sorted(set("abcdefghijklmnopqrstuvwxyz ,.?!'\n")))


def tok():
    return chat_tokenizer(CharTokenizer(CHARS))


def conversation(user: str, reply: str, *more: str) -> list[tuple[str, str]]:
    turns = [("user", user), ("assistant", reply)]
    return turns + [("user", text) if i % 2 == 0 else ("assistant", text) for i, text in enumerate(more)]


def test_markers_are_new_ids_never_made_from_text():
    t = tok()
    assert sorted(t.marker_ids.values()) == list(range(len(CHARS), len(CHARS) + 5))
    assert t.encode("ab") == CharTokenizer(CHARS).encode("ab")
    with pytest.raises(DataError):  # "<|user|>" typed in a message is text, which these chars cannot write
        t.encode("<|user|>")
    assert t.decode(render(t, [("user", "hi")])) == f"{BEGIN}{USER}hi{END}"
    assert tokenizer_from_meta(t.meta()).marker_ids == t.marker_ids  # a checkpoint's description rebuilds it


def test_only_the_assistants_text_and_its_end_are_learned():
    t = tok()
    ids = np.array(render(t, conversation("hi", "yes", "and", "no")))
    text = [t.decode([i]) for i in ids]
    assert [s for s, keep in zip(text, learned(ids, t)) if keep] == ["y", "e", "s", END, "n", "o", END]


def test_conversations_and_documents_split_alike_at_every_two_decimal_val_fraction(tmp_path):
    docs = [np.array([i], dtype=np.uint16) for i in range(3000)]  # document i is the one token i
    for k in range(1, 100):
        prepare.write_splits(iter(docs), tmp_path, k / 100)
        val_documents = np.fromfile(tmp_path / "val.bin", dtype=np.uint16).tolist()
        assert split_indices(len(docs), k / 100)["val"] == val_documents, k / 100


def test_a_bpe_for_conversations_is_trained_on_the_train_conversations_only(tmp_path):
    """Editing a val conversation (line 1, val at 0.25) changes neither the merges nor the train ids."""
    path = write_chats(tmp_path / "chats.jsonl", n=12)
    folders = [prepare_conversations(path, tmp_path / "data", "bpe", 0.25, bpe_vocab_size=270)]
    lines = path.read_text().splitlines()
    path.write_text("\n".join([json.dumps({"prompt": "zebra quartz", "completion": "jumbo vixen"}), *lines[1:]]) + "\n")
    folders.append(prepare_conversations(path, tmp_path / "data", "bpe", 0.25, bpe_vocab_size=270))
    metas = [json.loads((folder / "meta.json").read_text()) for folder in folders]
    assert metas[0]["tokenizer"] == metas[1]["tokenizer"]
    assert (folders[0] / "train.bin").read_bytes() == (folders[1] / "train.bin").read_bytes()
    assert (folders[0] / "val.bin").read_bytes() != (folders[1] / "val.bin").read_bytes()


def test_one_file_at_two_val_fractions_makes_two_corpora_and_python_m_prepare_makes_train_pys(tmp_path):
    """Bug caught: `python -m scripts.prepare --data_path chats.jsonl` read the lines as documents (a third folder)."""
    path = write_chats(tmp_path / "chats.jsonl", n=12)
    prepare_main(["--data_path", str(path), "--data_dir", str(tmp_path / "data"), "--val_fraction", "0.25"])
    for fraction, val_lines in [(0.25, [1, 5, 9]), (0.5, [1, 3, 5, 7, 9, 11]), (0.25, [1, 5, 9])]:
        corpus = load_corpus(prepare_conversations(path, tmp_path / "data", "char", fraction), 16)
        assert corpus.meta["lines"]["val"] == val_lines and corpus.meta["format"] == "conversations"
        assert (np.asarray(corpus.val) == corpus.meta["vocab_size"] - 5).sum() == len(val_lines)  # <|begin|>s
    assert len(list((tmp_path / "data").iterdir())) == 2


@pytest.mark.parametrize("overflow", ["refuse", "truncate"])
def test_a_conversation_of_block_size_plus_one_tokens_trains_whole_and_one_more_does_not(overflow, capsys):
    """Inclusive: T + 1 tokens make one row of T inputs and T targets, the last the final <|end|>."""
    t, cpu, cfg = tok(), torch.device("cpu"), TrainConfig(batch_size=2, block_size=16, chat_overflow=overflow)
    short = render(t, conversation("hi", "ay"))
    for reply, fits in [("abcdefghij", True), ("abcdefghijk", False)]:  # 5 markers + 2 + 10 = 17 = 16 + 1 tokens
        long = render(t, conversation("hi", reply))
        tokens = np.array(short + long)
        if not fits and overflow == "refuse":
            with pytest.raises(DataError, match="a conversation of 18 tokens"):
                Conversations(tokens, cfg, 0, cpu, t)
            continue
        x, y = Conversations(tokens, cfg, 0, cpu, t).next()  # both conversations, one row each
        assert ("cut at block_size + 1" in capsys.readouterr().out) == (not fits)
        (row,) = [i for i in range(2) if x[i, 15] != 0]  # the long one's row: 16 inputs, no padding
        assert x[row].tolist() == long[:16]
        assert y[row][y[row] != -1].tolist() == t.encode(reply) + [t.marker_ids[END]] * fits  # cut: the <|end|> lost
    lost = np.array(short + render(t, conversation("h" * 14, "ay")))  # the cut leaves no target: a NaN loss, refused
    with pytest.raises(DataError, match="keeps no assistant token" if overflow == "truncate" else "of 21 tokens"):
        Conversations(lost, cfg, 0, cpu, t)


def test_a_loader_given_for_conversations_is_said_unused(tmp_path, capsys):
    """Bug caught: --loader bos_packed on a chat corpus was dropped silently (Conversations draws its own rows)."""
    cfg = make_config("tiny", data_path=str(write_chats(tmp_path / "chats.jsonl")), loader="bos_packed")
    assert prepare.source_path(cfg) == tmp_path / "chats.jsonl"
    assert "WARNING: loader 'bos_packed' set but unused: the corpus is --data_path" in capsys.readouterr().err


def test_the_built_in_chat_corpus_is_the_repos_from_any_folder(tmp_path, monkeypatch):
    """Bug caught: shakespeare_chat's file went to ./data of the folder a command ran in, not the repo's data_dir."""
    made, elsewhere = tmp_path / "repo" / "data" / "shakespeare_chat.jsonl", tmp_path / "elsewhere"
    made.parent.mkdir(parents=True)
    made.write_text('{"messages": []}\n')
    elsewhere.mkdir()
    monkeypatch.setattr(tokenizer, "REPO", tmp_path / "repo")  # data_home's: a relative data_dir is under it
    monkeypatch.setattr(prepare, "shakespeare_text", lambda data_dir: pytest.fail(f"would download into {data_dir}"))
    monkeypatch.chdir(elsewhere)
    assert prepare.source_path(make_config(dataset="shakespeare_chat", data_dir="data")) == made


def test_train_rows_hold_one_whole_conversation_and_val_windows_score_exactly_the_learned_tokens(tmp_path):
    path = write_chats(tmp_path / "chats.jsonl", n=12)
    corpus = load_corpus(prepare_conversations(path, tmp_path / "data", "char", 0.25), 16)
    t = tokenizer_from_meta(corpus.meta["tokenizer"])
    x, _ = Conversations(corpus.train, TrainConfig(batch_size=8, block_size=64), 0, torch.device("cpu"), t).next()
    assert ((x == t.marker_ids[BEGIN]).sum(1) == 1).all() and (x[:, 0] == t.marker_ids[BEGIN]).all()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    replies = [r.get("completion") or r["messages"][1]["content"] for r in records]
    begins = np.flatnonzero(np.asarray(corpus.val) == t.marker_ids[BEGIN])
    width = np.diff(np.append(begins, len(corpus.val))).max() - 1  # the longest val conversation fills its row
    x, y = eval_windows(corpus, t, int(width))
    val = [replies[line - 1] for line in corpus.meta["lines"]["val"]]  # lines 1, 5, 9: the last is the split's end
    assert [row[row != -1].tolist() for row in y] == [t.encode(reply) + [t.marker_ids[END]] for reply in val]
    assert (x[:, 0] == t.marker_ids[BEGIN]).all() and len(x) == len(val)
    first = int((y[0] != -1).sum())  # eval_tokens: whole conversations, the first ones, until that many targets
    assert [len(eval_windows(corpus, t, int(width), n)[0]) for n in (1, first, first + 1)] == [1, 1, 2]


def test_each_ddp_rank_draws_its_own_conversations_in_its_own_generators_epoch_order(tiny_cfg, tmp_path):
    cfg = tiny_cfg(data_path=str(write_chats(tmp_path / "chats.jsonl")), block_size=64)
    corpus = corpus_for(cfg)
    t = tokenizer_from_meta(corpus.meta["tokenizer"])
    torch.manual_seed(7)  # the global RNG plays no part
    streams = [training_stream(cfg, corpus, t, rank, torch.device("cpu")) for rank in (0, 1)]
    n = len(corpus.meta["lines"]["train"])  # the train conversations, never the val ones
    for rank, stream in enumerate(streams):
        expected = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + rank))
        assert stream.order.tolist() == expected.tolist()
    assert not torch.equal(streams[0].next()[0], streams[1].next()[0])


def test_a_refusal_names_a_line_of_its_own_split(tiny_cfg, tmp_path):
    """At block_size 16 some train and some val conversations are too long: each refusal names a line of its split."""
    cfg = tiny_cfg(data_path=str(write_chats(tmp_path / "chats.jsonl")), block_size=16)
    corpus = corpus_for(cfg)
    t = tokenizer_from_meta(corpus.meta["tokenizer"])
    for split, refuse in [("train", lambda: training_stream(cfg, corpus, t, 0, torch.device("cpu"))),
                          ("val", lambda: eval_windows(corpus, t, 16))]:
        with pytest.raises(DataError, match=r"chats.jsonl:\d+: a conversation") as refusal:
            refuse()
        assert int(str(refusal.value).split(":")[1]) in corpus.meta["lines"][split]
        assert "--chat_overflow truncate" in str(refusal.value)


BAD_LINES = {
    "not JSON": ("{oops", "not JSON"),
    "no messages": ('{"text": "hi"}', "expected"),
    "missing role": ('{"messages": [{"content": "hi"}]}', "message 0 has no role"),
    "unknown role": ('{"messages": [{"role": "bot", "content": "hi"}]}', "role 'bot'; use one of system, user"),
    "role not a string": ('{"messages": [{"role": ["user"], "content": "hi"}]}', "role ['user']; use one of"),
    "not learned": ('{"messages": [{"role": "assistant", "content": "a", "weight": 0}]}', "weight 0: all replies"),
    "nested thousands deep": ("[" * 100_000 + "]" * 100_000, "not JSON"),
    "content not a string": ('{"messages": [{"role": "user", "content": 3}]}', "has content int, not a string"),
    "empty assistant turn": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}',
                             "empty assistant turn"),
    "no assistant turn": ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    "prompt alone": ('{"prompt": "hi"}', 'a "prompt" needs its "completion"'),  # was: "content NoneType"
    "prompt and messages": ('{"prompt": "hi", "completion": "a", "messages": []}', 'and no "messages" beside'),
    "system not first": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}, '
                         '{"role": "assistant", "content": "y"}]}', "only the first may be"),
}


@pytest.mark.parametrize("kind", BAD_LINES)
def test_a_malformed_line_is_one_line_naming_it_exit_2_writing_nothing(tmp_path, capsys, kind):
    path = write_chats(tmp_path / "chats.jsonl", n=5)
    path.write_text(path.read_text() + BAD_LINES[kind][0] + "\n")
    assert run_main(tiny_args(tmp_path / "out", path)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:6: ") and BAD_LINES[kind][1] in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]  # no data_dir, no out_dir


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    chats = write_chats(folder / "chats.jsonl", n=60)
    assert run_main(tiny_args(folder / "out", chats, max_iters=30, eval_interval=30, block_size=64,
                              chat_overflow="truncate")) == 0
    return folder / "out"


def chat(run: Path, lines: list[str], *extra: str, monkeypatch, capsys) -> tuple[int, str, str]:
    """`python -m scripts.chat --ckpt RUN --temp 0 EXTRA` with ``lines`` typed on stdin: (exit code, out, err)."""
    typed = "".join(line + "\n" for line in lines).encode("utf-8", "surrogateescape")  # "\udcff": the byte 0xff
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(typed), encoding="utf-8"))  # a terminal's: strict
    capsys.readouterr()
    try:
        chat_script.main(["--ckpt", str(run), "--temp", "0", *extra])
        code = 0
    except SystemExit as stop:
        code = stop.code
    return code, *capsys.readouterr()


def test_bad_input_is_one_line_and_chat_holds_a_conversation_dropping_old_turns(chat_run, monkeypatch, capsys):
    """Bug caught: a byte that is not UTF-8 on stdin ended the chat in a UnicodeDecodeError traceback."""
    code, out, err = chat(chat_run, ["the \udcff king", "the king"], monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and err == "error: characters not in the model's vocabulary: '\ufffd'\n", err
    code, out, err = chat(chat_run, ["the king"], "--num-samples", "3", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and err.startswith("error: --num-samples does nothing in a conversation"), err  # was ignored
    calls = ctrl_c_at_the_first_call(monkeypatch, sample_module, "generate")  # Ctrl-C ends reply 1, the talk goes on
    code, out, err = chat(chat_run, ["the king", "sweet lord", "fair day", "love", "the night"], "--system", "the lord",
                          monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and len(calls) == 5, err
    out = out.splitlines()
    assert out[0].startswith("# a conversation")  # which of its two modes it is in
    replies = [line for line in out[1:] if not line.startswith("(")]
    assert len(replies) == 5  # one reply a turn, each ended at its <|end|> (or the window)
    assert not any("<|" in line for line in replies)  # no marker is ever printed
    assert sum(line.startswith("(") for line in out) == 1  # block_size 32: turns are dropped, said once


@pytest.mark.parametrize("markers", [True, False], ids=["too long", "no markers"])
def test_a_system_prompt_the_model_cannot_take_is_refused(chat_run, tmp_path, text_file, markers, monkeypatch, capsys):
    run, system = chat_run, "the king " * 12  # 111 tokens; block_size 64
    if not markers:
        assert run_main(tiny_args(tmp_path / "out", text_file, max_iters=2, eval_interval=2)) == 0
        run, system = tmp_path / "out", "the lord"
    code, out, err = chat(run, ["the king"], "--system", system, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1 and "--system" in err


def test_the_longest_system_prompt_accepted_is_the_room_the_refusal_names():
    t = tok()  # block_size 40, a 10-token reply: a prompt may take 30; a one-token message takes 4 of them
    dialogue = chat_script.Dialogue(t, block_size=40, room=10, system="a" * 23)  # 26 tokens with its 3 markers
    assert len(dialogue.prompt("b")) == 30
    with pytest.raises(ConfigError, match="27 tokens.* room for 26 "):
        chat_script.Dialogue(t, block_size=40, room=10, system="a" * 24)
    with pytest.raises(DataError):  # a character the vocabulary lacks
        chat_script.Dialogue(t, block_size=40, room=10, system="日本")


def test_a_dialogue_keeps_every_turn_while_its_prompt_fits_then_drops_the_oldest_never_the_system_prompt():
    turns = [("system", "be kind"), ("user", "hi"), ("assistant", "yes"), ("user", "and now")]
    full = render(tok(), turns, reply=True)
    for spare, dropped in [(0, 0), (-1, 1)]:  # the prompt exactly block_size - room long fits
        dialogue = chat_script.Dialogue(tok(), block_size=len(full) + 10 + spare, room=10, system="be kind")
        dialogue.prompt("hi")
        dialogue.reply("yes")
        assert dialogue.prompt("and now") == render(tok(), turns[:1] + turns[1 + dropped:], reply=True)
        assert dialogue.dropped == dropped
    with pytest.raises(DataError, match="say it shorter"):
        dialogue.prompt("the king " * 5)


class ScriptedModel(torch.nn.Module):
    """Answers each forward with the next id of ``script`` (then ``filler``); keeps every input it is given."""

    def __init__(self, script: list[int], filler: int, vocab_size: int, block_size: int):
        super().__init__()
        self.config = SimpleNamespace(block_size=block_size, n_layer=1, n_head=1, n_embd=4)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the device the loop puts its ids on
        self.script, self.filler, self.vocab_size, self.inputs = iter(script), filler, vocab_size, []

    def forward(self, idx, cache=None):
        self.inputs.append(idx[0].tolist())
        logits = torch.zeros(*idx.shape, self.vocab_size)  # (B, T, V)
        logits[:, -1, next(self.script, self.filler)] = 1.0
        return SimpleNamespace(logits=logits)


def test_chat_ends_a_reply_at_any_marker_keeps_the_real_reply_and_refuses_a_bad_turn_alone(monkeypatch, capsys):
    """Turns end at <|user|>, <|end|> and the window; each next prompt holds the reply as it was. An unknown
    character, then a message too long: each refused in one line, and the talk goes on whole."""
    t = tok()
    a, b, c, d = (t.encode(ch)[0] for ch in "abcd")
    script = [a, b, t.marker_ids[USER], a, c, t.marker_ids[END], d]
    model = ScriptedModel(script, filler=d, vocab_size=t.vocab_size, block_size=64)  # a prompt may take 32 tokens
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nwhat say you to 日本?\n" + "the king " * 10 + "\nyo\nx\n"))
    chat_script.converse(model, t, chat_script.parse_args(["--temp", "0"]), torch.Generator())
    turns = [("user", "hi"), ("assistant", "ab"), ("user", "yo"), ("assistant", "ac"), ("user", "x")]
    last_prompt = render(t, turns, reply=True)
    out, err = capsys.readouterr()
    assert out.splitlines() == ["ab", "ac", "d" * (64 - len(last_prompt))]  # the window full
    errors = err.splitlines()
    assert len(errors) == 2 and "日本" in errors[0] and "say it shorter" in errors[1]
    prompts = [model.inputs[0], model.inputs[3], model.inputs[6]]  # each turn's first forward
    assert t.decode(prompts[0]) == "<|begin|><|user|>hi<|end|><|assistant|>"
    assert prompts == [render(t, turns[:k], reply=True) for k in (1, 3, 5)]


@pytest.mark.interop  # transformers
@pytest.mark.parametrize("kind", ["char", "bpe", pytest.param("gpt2", marks=pytest.mark.network)])
def test_the_exported_chat_template_gives_transformers_our_ids(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    from scripts.import_hf import load_pretrained
    from tokenizer import GPT2Tokenizer, train_bpe
    bases = {"char": lambda: CharTokenizer(CHARS), "bpe": lambda: train_bpe([make_text()], 300, "test"),
             "gpt2": lambda: GPT2Tokenizer(tmp_path / "cache")}
    t = chat_tokenizer(bases[kind]())
    export_hf.export(tiny_model(vocab_size=t.vocab_size), t, tmp_path / "export")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    messages = [("system", "the lord, be fair"), ("user", "what day is it?"), ("assistant", "a sweet one,\nmy king."),
                ("user", "and the night?")]
    as_dicts = [{"role": role, "content": content} for role, content in messages]
    assert theirs.apply_chat_template(as_dicts, tokenize=True, return_dict=False) == render(t, messages)
    assert theirs.apply_chat_template(as_dicts, add_generation_prompt=True, tokenize=True, return_dict=False) == \
        render(t, messages, reply=True)
    assert theirs.decode(render(t, messages)) == t.decode(render(t, messages))  # markers decode as their text
    # Bug caught: transformers skips bos when it decodes, and a char base's bos (a newline) is text. Now <|begin|>.
    assert theirs.decode(render(t, messages), skip_special_tokens=True) == "".join(text for _, text in messages)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["eos_token_id"] == t.marker_ids[END]  # generate() stops where our chat stops
    assert config["bos_token_id"] == t.marker_ids[BEGIN] == theirs.bos_token_id
    with pytest.raises(Exception, match="role narrator is not one of system, user, assistant"):  # as prepare.py
        theirs.apply_chat_template([{"role": "narrator", "content": "hi"}], tokenize=False)
    # scripts/import_hf.py reads it back as the chat tokenizer it is, also once transformers has saved it again. Bug
    # caught: that copy's markers (tokenizer.json's added tokens, transformers 5's extra_special_tokens) were refused.
    theirs.save_pretrained(tmp_path / "saved")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").save_pretrained(tmp_path / "saved")
    ours, back = (load_pretrained(str(tmp_path / name)) for name in ("export", "saved"))
    assert ours.tokenizer == back.tokenizer == t.meta() and ours.config == back.config
    assert all(torch.equal(back.state[name], weight) for name, weight in ours.state.items())  # the same logits


def test_eval_scores_a_chat_run_on_its_assistants_tokens_as_training_did(chat_run, capsys):
    from scripts import eval as evaluate_script
    evaluate_script.main(["--ckpt", str(chat_run / "best.pt"), "--json", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    assert "the assistant's tokens" in report["data"]
    assert report["val_loss"] == pytest.approx(torch.load(chat_run / "best.pt", weights_only=True)["best_val_loss"],
                                               abs=1e-5)
