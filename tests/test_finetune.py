"""init_from a run: its shape, options, tokenizer and best weights start a fresh run that resumes bit-exactly."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import make_text, metrics, read_metrics, run_main, tiny_args, tiny_run, write_chats
from fault_injection import assert_same_training_state

from checkpoint import config_from_dict, from_checkpoint, load_checkpoint, load_run, resume_changes
from cli import CheckpointError, HFError
from config import as_dict, make_config, model_config
from finetune import Pretrained, adopt
from model import GPT, GPTConfig
from prepare import prepare_corpus, read_meta, tokenizer_label
import scripts.prepare as scripts_prepare
from scripts import export_hf
from tokenizer import CharTokenizer, tokenizer_vocab_size, train_bpe


def train(text_file, out_dir, **overrides) -> int:
    return run_main(tiny_args(out_dir, text_file, **overrides))


def model_of(path):
    state = load_checkpoint(path)
    model = GPT(model_config(config_from_dict(state["config"]), tokenizer_vocab_size(state["tokenizer"])))
    model.load_state_dict(state["model"])
    return model.eval(), state


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A tiny RoPE + RMSNorm char run: options a GPT-2 import would refuse."""
    folder = tmp_path_factory.mktemp("base")
    text = folder / "corpus.txt"
    text.write_text(make_text())
    assert train(text, folder / "out", max_iters=4, eval_interval=4, pos_emb="rope", norm="rmsnorm") == 0
    return folder / "out", text


def test_a_run_folder_starts_a_chat_fine_tune_with_its_shape_options_tokenizer_and_best_weights(base_run, tmp_path,
                                                                                                capsys):
    base, text = base_run
    chats = write_chats(tmp_path / "chats.jsonl")
    out = tmp_path / "chat"
    assert train(chats, out, init_from=base, max_iters=4, eval_interval=2, chat_overflow="truncate") == 0
    assert f"init_from {base / 'best.pt'}" in capsys.readouterr().out
    tuned, state = model_of(out / "best.pt")
    assert tuned.config.pos_emb == "rope" and tuned.config.norm == "rmsnorm"  # adopted, never passed
    base_model, base_state = model_of(base / "best.pt")
    assert state["tokenizer"] == {**base_state["tokenizer"], "chat_tokens": state["tokenizer"]["chat_tokens"]}
    assert tuned.config.vocab_size == base_model.config.vocab_size + 5  # the markers, in the padded rows
    assert [r["step"] for r in read_metrics(out) if "loss" in r][0] == 1  # a fresh run, not a resume


def test_at_step_0_the_fine_tune_computes_the_bases_logits_on_the_bases_tokens(base_run, tmp_path):
    base, _ = base_run
    weights = load_run(base / "best.pt", 0)
    base_model, base_state = model_of(base / "best.pt")
    meta = {**base_state["tokenizer"], "chat_tokens": ["a", "b", "c", "d", "e"]}
    vocab = weights.config.vocab_size + 5
    model = GPT(model_config(make_config("tiny", pos_emb="rope", norm="rmsnorm"), vocab))
    model.load_state_dict(weights.weights_for(meta, vocab))
    x = torch.randint(weights.config.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(model.eval()(x).logits[..., : weights.config.vocab_size], base_model(x).logits)


def test_a_flag_that_contradicts_the_base_is_one_line(base_run, tmp_path, capsys):
    base, text = base_run
    capsys.readouterr()
    assert train(text, tmp_path / "out", init_from=base, n_layer=3) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --n_layer 3 conflicts with {base / 'best.pt'}, whose weights have n_layer 2; drop --n_layer (or that "
        "key from the preset): with --init_from the weights fix the model")


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_a_chat_fine_tune_of_a_run_resumes_bit_exactly(base_run, tmp_path, lora_rank, capsys):
    """4 steps == 2, a resume, 2 more. Bugs caught: a resume lost the base's tokenizer; a full one needed the base; a
    base of another shape in its place was refused by its corpus (conversations too long), not by last.pt (LoRA's), or
    refused at all (a full one's, as another char set was: "trained with other settings")."""
    base = shutil.copytree(base_run[0], tmp_path / "base")
    chats = write_chats(tmp_path / "chats.jsonl")
    common = dict(init_from=base, eval_interval=2, chat_overflow="truncate", lora_rank=lora_rank)
    for name, steps, resume in (("straight", 4, "false"), ("split", 2, "false"), ("split", 4, "true")):
        if resume == "true" and not lora_rank:  # a full fine-tune's last.pt holds every weight: its base may go
            shutil.rmtree(base)
        assert train(chats, tmp_path / name, max_iters=steps, resume=resume, **common) == 0
    a, b = (load_checkpoint(tmp_path / name / "last.pt") for name in ("straight", "split"))
    assert b["step"] == 4
    assert_same_training_state(a, b)  # weights or adapters (and the lora record), moments, rng, streams, last eval
    trained = sum(len(group["params"]) for group in b["optimizer"]["param_groups"])
    moments = [s[m] for s in b["optimizer"]["state"].values() for m in ("exp_avg", "exp_avg_sq")]
    assert len(moments) == 2 * trained and all(m.abs().sum() > 0 for m in moments)  # compared, and not all zero
    assert any(name.endswith("lora_rows") for name in b["model"]) == bool(lora_rank)  # the markers' rows train
    train_records, val_records = metrics(tmp_path / "split")
    assert [r["step"] for r in train_records] == [1, 2, 3, 4] and [r["step"] for r in val_records] == [2, 4]
    assert metrics(tmp_path / "straight") == (train_records, val_records)
    tuned = from_checkpoint(tmp_path / "split" / "last.pt")  # a LoRA run's adapters go on the base: merged
    assert tuned.step == 4
    if lora_rank:  # the markers' rows train from the base rows' mean, the base's rows not; PEFT's files lack them
        base_model, rows = model_of(base / "best.pt")[0], b["lora"]["rows"]
        vocab, wte = base_model.config.vocab_size, tuned.model.transformer.wte.weight
        assert rows == list(range(vocab, vocab + 5))
        assert torch.equal(wte[:vocab], base_model.transformer.wte.weight[:vocab])
        assert not any(torch.equal(row, base_model.transformer.wte.weight[:vocab].mean(0)) for row in wte[rows])
        with pytest.raises(CheckpointError, match="also trained 5 embedding rows .*drop --peft"):
            export_hf.export_peft(b, tmp_path / "peft")
    small = tmp_path / "small"  # another shape where the base was, chat_small's flags giving none: refused by
    assert train(base_run[1], small, max_iters=1, block_size=16) == 0  # last.pt, not by conversations too long
    flags = tiny_run(tmp_path / "split", chats) | common | dict(init_from=small, resume="true", max_iters=6,
                                                               eval_tokens=b["config"]["eval_tokens"])  # tiny's
    capsys.readouterr()  # a full fine-tune's resume never reads its base: one put in its place changes nothing
    assert run_main(["--config", "chat_small", *(f"--{key}={value}" for key, value in flags.items())]) == (
        2 if lora_rank else 0)
    assert ("block_size: checkpoint 32 vs now 16" in capsys.readouterr().err) == bool(lora_rank)


def test_a_few_short_conversations_fine_tune(base_run, tmp_path):
    """Bug caught: a val split under block_size + 1 tokens was refused as a text's is; a conversation is one row."""
    line = json.dumps({"messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "I."}]})
    (tmp_path / "few.jsonl").write_text((line + "\n") * 10)  # 9 + 1 conversations of a few tokens
    assert train(tmp_path / "few.jsonl", tmp_path / "out", init_from=base_run[0], max_iters=2, eval_interval=2) == 0


# ----------------------------------------------------------------------------- a run fine-tuned on another text
def another_text(tmp_path, base_text, extra: str = ""):
    """The base's lines in reverse order without "?": fewer of its characters (and ``extra``), another corpus."""
    path = tmp_path / "other.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(reversed(base_text.read_text().replace("?", ".").splitlines())) + extra + "\n")
    return path


def test_a_run_fine_tunes_on_another_text_which_its_tokenizer_prepares(base_run, tmp_path, capsys):
    """Bug caught: `error: ... was trained with another tokenizer (char) than the corpus's (char); prepare the data
    with the base's (drop --tokenizer)`: the text got a char vocabulary of its own. A character the base lacks: said."""
    base, text = base_run
    assert train(another_text(tmp_path / "more", text, extra="§"), tmp_path / "out", init_from=base) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "characters the --init_from model's char vocabulary lacks: '§'" in err, err
    docs = another_text(tmp_path / "docs", text, extra="§").parent  # a folder of documents: scripts.prepare's, alike
    with pytest.raises(SystemExit):
        scripts_prepare.main(["--data_path", str(docs), "--data_dir", str(tmp_path / "d"), "--init_from", str(base)])
    assert "characters the --init_from model's char vocabulary lacks: '§'" in capsys.readouterr().err
    other = another_text(tmp_path, text)  # scripts.prepare's line: the base's block_size, not its --block_size 1
    assert scripts_prepare.main(["--data_path", str(other), "--data_dir", str(tmp_path / "data"), "--init_from",
                                 str(base)]) is None and "; block_size 32 of 32 positions" in capsys.readouterr().out
    assert train(other, tmp_path / "tuned", init_from=base, max_iters=2, eval_interval=2) == 0
    base_tokenizer = load_checkpoint(base / "best.pt")["tokenizer"]
    assert load_checkpoint(tmp_path / "tuned" / "best.pt")["tokenizer"] == base_tokenizer
    own = prepare_corpus(data_path=str(other), data_dir=str(tmp_path / "data"))  # without --init_from: its own
    [tuned] = [folder for folder in (tmp_path / "data").iterdir() if folder != own]
    assert re.fullmatch(r"other-\w{12}-char[0-9a-f]{8}-val0\.1", tuned.name)  # which tokenizer, as chats say
    assert read_meta(tuned)["tokenizer"] == base_tokenizer != read_meta(own)["tokenizer"]


@pytest.mark.parametrize("layout", ["txt folder", "bpe"])
def test_a_document_folder_and_a_bpe_take_the_bases_tokenizer(tmp_path, text_file, layout):
    """The same for a folder of documents, and for a BPE (which would otherwise be trained anew for the corpus)."""
    data = text_file.parent / "docs"
    data.mkdir()
    for name in ("a.txt", "b.txt"):  # document 0 is val
        (data / name).write_text(text_file.read_text())
    tokenizer = CharTokenizer("\n ,.!?:;ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz").meta()
    with pytest.raises(TypeError, match="needs init_from"):  # train.py's refusal: was a command without --init_from
        prepare_corpus(data_path=str(data), data_dir=str(tmp_path / "d"), base=tokenizer)
    if layout == "bpe":
        data, tokenizer = text_file, train_bpe([make_text(seed=1)], 300, "base").meta()
    folder = scripts_prepare.prepare_corpus(data_path=str(data), data_dir=str(tmp_path / "d"),
                                            tokenizer=tokenizer["kind"], base=tokenizer)
    assert read_meta(folder)["tokenizer"] == tokenizer and folder.name.endswith(f"{tokenizer_label(tokenizer)}-val0.1")


def test_a_bpe_base_fixes_bpe_vocab_size():
    """Bug caught: --bpe_vocab_size 500 over a 300-token BPE base was ignored, and recorded as 500."""
    base = Pretrained(GPTConfig(vocab_size=300), {}, "base", train_bpe([make_text(seed=1)], 300, "base").meta(), 64)
    adopted = adopt(make_config(None, tokenizer="bpe", init_from="base"), base)
    assert adopted.bpe_vocab_size == 300  # and a fine-tune saved with the default before resumes (the tokenizer rules)
    assert resume_changes({**as_dict(adopted), "bpe_vocab_size": 2048}, adopted) == {"fixed": [], "warned": []}
    with pytest.raises(HFError, match="--bpe_vocab_size 500 conflicts with base, whose weights have bpe_vocab_size"):
        adopt(make_config(None, tokenizer="bpe", bpe_vocab_size=500), base)


def test_tokens_of_another_vocabulary_name_each_tokenizer_once_and_no_flag_not_passed(base_run):
    """Bug caught: "another tokenizer (char) than the corpus's (char) ... (drop --tokenizer)", never passed."""
    base, _ = base_run
    weights = load_run(base / "best.pt", 0)
    chars = weights.tokenizer["chars"]
    with pytest.raises(HFError) as refused:
        weights.weights_for({"kind": "char", "chars": chars[1:] + "§"}, len(chars))
    assert "another char vocabulary than the corpus's" in str(refused.value)
    assert "(char)" not in str(refused.value) and "--tokenizer" not in str(refused.value)
