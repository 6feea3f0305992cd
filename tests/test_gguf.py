"""The GGUF export as llama.cpp's gguf package reads it; then (slow) llama.cpp itself: our ids, logits, text."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, make_text, tiny_model, tiny_run, write_chats

import sample
import train
from checkpoint import from_checkpoint
from cli import HFError
from config import make_config
from model import GPT, GPTConfig
from scripts import export_gguf
from scripts.export_hf import BYTE_TEXT, chat_template
from tokenizer import BEGIN, END, MARKERS, CharTokenizer, GPT2Tokenizer, chat_tokenizer, train_bpe

pytestmark = pytest.mark.interop  # gguf, and llama.cpp for the slow ones (requirements-llama.txt)
gguf = pytest.importorskip("gguf", reason="pip install -r requirements-interop.txt (gguf, llama.cpp's writer)")

# Characters of 1 to 4 UTF-8 bytes, a tab and a newline: a char vocabulary llama.cpp must join byte by byte.
UNICODE_LINE = "Café — naïve’s 🚀 東京\ttab\n"
# llama.cpp's GELU is the tanh form from an fp16 table, ours exact erf: seen max |Δ logit| 3.1e-4 (char) in f32.
LOGIT_TOLERANCE = 2e-3
ABC = CharTokenizer("".join(chr(65 + i) for i in range(50)))  # 50 characters


def field(reader, key: str):
    return reader.fields[key].contents()


def write(tmp_path: Path, model, tokenizer, dtype: str = "f32") -> "gguf.GGUFReader":
    path = tmp_path / f"model-{dtype}.gguf"
    export_gguf.export_gguf(model, tokenizer, path, dtype)
    return gguf.GGUFReader(path)


def test_a_char_gguf_holds_the_context_length_byte_level_names_merges_and_weights(tmp_path):
    chars = "".join(sorted(set(make_text(30) + UNICODE_LINE)))
    tokenizer = CharTokenizer(chars)
    model = tiny_model(vocab_size=len(chars), block_size=24, bias=False)
    reader = write(tmp_path, model, tokenizer)
    assert field(reader, "general.architecture") == "gpt2"
    assert field(reader, "gpt2.context_length") == export_gguf.CONTEXT_ROWS and field(reader, "gpt2.block_count") == 2
    assert (field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre")) == ("gpt2", "gpt-2")
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens[chars.index("\n")] == "Ċ" and tokens[chars.index(" ")] == "Ġ" and tokens[chars.index("é")] == "Ã©"
    types = field(reader, "tokenizer.ggml.token_type")
    assert tokens[len(chars):] == ["<|endoftext|>"] and types[len(chars):] == [gguf.TokenType.CONTROL]  # no text's
    assert set(types[:len(chars)]) == {gguf.TokenType.NORMAL}
    rocket = [BYTE_TEXT[b] for b in "🚀".encode()]  # 4 bytes: three merges, each from the lead byte on
    merges = field(reader, "tokenizer.ggml.merges")
    assert [f"{rocket[0]} {rocket[1]}", f"{''.join(rocket[:2])} {rocket[2]}", f"{''.join(rocket[:3])} {rocket[3]}"] \
        == [m for m in merges if m.startswith(rocket[0])]
    assert len(merges) == sum(len(ch.encode()) - 1 for ch in chars) - 1  # — and ’ share their first merge (E2 80)
    ends = field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id")
    assert ends == (chars.index("\n"), len(chars))  # an empty prompt starts at a newline; only <|endoftext|> ends
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    assert list(tensors["token_embd.weight"].shape) == [32, len(chars) + 1]  # ggml's ne: (C, V + 1), unpadded
    assert list(tensors["blk.1.attn_qkv.weight"].shape) == [32, 96]
    state = model.state_dict()
    wte, wpe = state["transformer.wte.weight"], state["transformer.wpe.weight"]  # (padded V, C), (24, C)
    token_embd = tensors["token_embd.weight"].data  # (V + 1, C)
    assert np.array_equal(token_embd[:-1], wte[:len(chars)].numpy()) and not token_embd[-1].any()  # its logit: 0
    positions = tensors["position_embd.weight"].data  # (CONTEXT_ROWS, C): the trained 24 rows, then again in turn
    assert positions.shape == (2048, 32) and np.array_equal(positions, wpe[torch.arange(2048) % 24].numpy())
    assert np.array_equal(tensors["blk.0.ffn_up.weight"].data, state["transformer.h.0.mlp.c_fc.weight"].numpy())
    assert not tensors["blk.0.ffn_up.bias"].data.any() and len(tensors) == 4 + 12 * 2  # bias=False: zeros


def test_a_model_whose_layers_heads_and_width_all_differ_writes_each_in_its_own_field(tmp_path):
    """A tiny model has n_layer == n_head: a writer that swapped them would pass every other test."""
    model = GPT(GPTConfig(vocab_size=50, block_size=2560, n_layer=3, n_head=4, n_embd=48))  # past CONTEXT_ROWS
    reader = write(tmp_path, model, ABC)
    keys = ("block_count", "attention.head_count", "embedding_length", "feed_forward_length", "context_length")
    assert [field(reader, f"gpt2.{key}") for key in keys] == [3, 4, 48, 4 * 48, 2560]
    assert field(reader, "tokenizer.ggml.add_bos_token") is field(reader, "tokenizer.ggml.add_eos_token") is False
    # Bug caught: an all-ASCII char vocabulary wrote no merges and llama.cpp refused the file. Two NULs: never apply.
    assert field(reader, "tokenizer.ggml.merges") == [f"{BYTE_TEXT[0]} {BYTE_TEXT[0]}"]


@pytest.mark.parametrize("block_size, rows", [(24, 2048), (2048, 2048), (2049, 2304), (4096, 4096)])
def test_the_declared_context_is_the_position_tables_rows_and_never_less_than_llama_cpps_rounded_context(
        tmp_path, block_size, rows):
    """llama.cpp aborts past the position table: it holds every declared position, at least CONTEXT_ROWS."""
    model = GPT(GPTConfig(vocab_size=8, block_size=block_size, n_layer=1, n_head=1, n_embd=8))
    reader = write(tmp_path, model, CharTokenizer("abcdefgh"))
    table = next(t for t in reader.tensors if t.name == "position_embd.weight").data
    assert field(reader, "gpt2.context_length") == len(table) == rows == export_gguf.context_rows(block_size)


def test_a_bpe_gguf_has_its_merges_in_rank_order_and_its_end_token_control(tmp_path):
    tokenizer = train_bpe([make_text(200)], 300, "test")
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=16)
    reader = write(tmp_path, model, tokenizer)
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    names = ["".join(BYTE_TEXT[b] for b in tokenizer.enc.decode_single_token_bytes(i)) for i in range(299)]
    assert tokens[:299] == names  # id = rank, named by its bytes
    assert tokens[-1] == "<|endoftext|>" and types[-1] == gguf.TokenType.CONTROL
    assert set(types[:-1]) == {gguf.TokenType.NORMAL}
    merges = field(reader, "tokenizer.ggml.merges")
    assert len(merges) == 300 - 257  # one per token past the bytes
    for rank in (256, 298):  # the merge made the token of that rank: its two parts, joined, are its name
        assert merges[rank - 256].replace(" ", "") == tokens[rank]
    assert field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eot_token == 299


def base_tokenizer(kind: str, cache: Path):
    if kind == "char":
        return CharTokenizer("".join(sorted(set(make_text(30) + UNICODE_LINE))))
    return GPT2Tokenizer(cache) if kind == "gpt2" else train_bpe([make_text(200)], 300, "test")


@pytest.mark.parametrize("kind", ["char", "bpe", pytest.param("gpt2", marks=pytest.mark.network)])
def test_a_chat_gguf_holds_the_base_vocabulary_the_markers_as_control_tokens_the_end_of_turn_and_the_template(
        tmp_path, kind):
    """The base's tokens and merges, then the markers as CONTROL tokens; <|end|> ends a reply; the template."""
    base = base_tokenizer(kind, tmp_path / "cache")
    tokenizer = chat_tokenizer(base)
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=16)
    reader = write(tmp_path, model, tokenizer)
    (tmp_path / "base").mkdir()
    plain = write(tmp_path / "base", tiny_model(vocab_size=base.vocab_size, block_size=16), base)
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert tokens == field(plain, "tokenizer.ggml.tokens")[:base.vocab_size] + list(MARKERS)  # <|end|> ends it
    assert field(reader, "tokenizer.ggml.merges") == field(plain, "tokenizer.ggml.merges")
    assert [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL] == sorted(tokenizer.special_ids)
    assert field(reader, "tokenizer.ggml.eos_token_id") == field(reader, "tokenizer.ggml.eot_token_id") \
        == tokenizer.marker_ids[END]
    assert field(reader, "tokenizer.ggml.bos_token_id") == tokenizer.marker_ids[BEGIN]  # as the HF export's
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    assert field(reader, "tokenizer.chat_template") == chat_template()
    assert "tokenizer.chat_template" not in plain.fields and "tokenizer.ggml.eot_token_id" not in plain.fields


@pytest.mark.parametrize("dtype, matrix_type", [("f16", "F16"), ("q8_0", "Q8_0")])
def test_smaller_dtypes_store_the_matrices_and_keep_norms_and_biases_f32(tmp_path, dtype, matrix_type):
    model = tiny_model(vocab_size=50, block_size=16, bias=True)
    reader = write(tmp_path, model, ABC, dtype)
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.attn_qkv.weight"].tensor_type.name == matrix_type
    assert tensors["blk.0.attn_qkv.bias"].tensor_type.name == tensors["output_norm.weight"].tensor_type.name == "F32"
    back = gguf.quants.dequantize(tensors["blk.0.attn_qkv.weight"].data, tensors["blk.0.attn_qkv.weight"].tensor_type)
    expected = model.state_dict()["transformer.h.0.attn.c_attn.weight"].numpy()
    assert back.shape == expected.shape and 0 < np.abs(back - expected).max() < 2e-2
    model = GPT(GPTConfig(vocab_size=50, block_size=20, n_layer=1, n_head=4, n_embd=48))  # rows of 48 or 192 values
    (tmp_path / "odd").mkdir()
    types = {t.name: t.tensor_type.name for t in write(tmp_path / "odd", model, ABC, dtype).tensors}
    assert types["blk.0.ffn_down.weight"] == matrix_type  # (out, in) = (48, 192): six blocks of 32 a row
    assert types["blk.0.ffn_up.weight"] == "F16"  # rows of 48: q8_0 needs whole blocks, falls back to f16


def test_a_model_llama_cpp_gpt2_cannot_compute_is_refused_by_name_and_writes_nothing(tmp_path):
    model = tiny_model(vocab_size=50, block_size=16, pos_emb="rope")  # every option's refusal: test_model_options.py
    with pytest.raises(HFError, match="cannot export as GGUF: the model has pos_emb "):
        export_gguf.export_gguf(model, ABC, tmp_path / "x.gguf")
    assert list(tmp_path.iterdir()) == []


def test_the_script_exports_a_lora_chat_fine_tune_of_a_char_run_and_into_a_folder(tmp_path, tiny_cfg, capsys):
    """Bugs caught: a chat fine-tune of a char base (no .chars) and a folder as OUT were tracebacks."""
    base = tiny_cfg(max_iters=2, eval_interval=2)
    train.train(base)
    chat = make_config("tiny", **tiny_run(tmp_path / "chat", write_chats(tmp_path / "chats.jsonl", n=20)) | dict(
        init_from=base.out_dir, lora_rank=2, max_iters=2, eval_interval=2, chat_overflow="truncate"))
    train.train(chat)
    (tmp_path / "ggufs").mkdir()
    capsys.readouterr()
    export_gguf.main([chat.out_dir, str(tmp_path / "ggufs")])
    written = tmp_path / "ggufs" / "chat.gguf"
    assert sorted((tmp_path / "ggufs").iterdir()) == [written] and str(written) in capsys.readouterr().out
    reader = gguf.GGUFReader(written)
    loaded = from_checkpoint(Path(chat.out_dir) / "best.pt")
    assert field(reader, "tokenizer.ggml.tokens") == [*(BYTE_TEXT[ord(ch)] for ch in loaded.tokenizer.base.chars),
                                                      *MARKERS]  # ASCII characters: one byte each
    token_embd = next(t for t in reader.tensors if t.name == "token_embd.weight").data  # (V, C)
    assert np.array_equal(token_embd, loaded.model.state_dict()["transformer.wte.weight"][: len(token_embd)].numpy())
    export_gguf.main([chat.out_dir, str(written), "--dtype", "f16"])  # a GGUF file it wrote is replaced
    tensors = {t.name: t for t in gguf.GGUFReader(written).tensors}
    assert tensors["blk.0.attn_qkv.weight"].tensor_type.name == "F16"
    assert sorted((tmp_path / "ggufs").iterdir()) == [written]


# ----------------------------------------------------------------------------- llama.cpp itself (slow)
CORPUS = make_text(600) + UNICODE_LINE
ASCII = make_text(600)  # the default run's kind of corpus: a char vocabulary with no multi-byte character
LINES = "\n".join(ASCII.lower().split()) + "\n"  # a word a line: a greedy text that crosses newlines
RUNS = {"char": {}, "ascii": {}, "bpe": {"bpe_vocab_size": 380}, "gpt2": {}}  # ascii: a char run on ASCII text


@pytest.fixture(scope="module")
def exported(tmp_path_factory, llama_cpp):
    """Factory: a tiny run of the tokenizer, trained once: its model, tokenizer, Llama and GGUF (f32)."""
    root = tmp_path_factory.mktemp("gguf")
    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    (root / "ascii.txt").write_text(ASCII, encoding="utf-8")
    (root / "lines.txt").write_text(LINES, encoding="utf-8")
    made = {}

    def build(kind: str, corpus: str = ""):
        """A run of ``kind`` on CORPUS (ASCII for "ascii"), or on the file ``corpus`` names ("lines")."""
        name = f"{kind}-{corpus}" if corpus else kind
        if name not in made:
            text_file = root / (f"{corpus}.txt" if corpus else "ascii.txt" if kind == "ascii" else "corpus.txt")
            cfg = make_config("tiny", **tiny_run(root / name, text_file) | dict(
                tokenizer="char" if kind == "ascii" else kind, max_iters=60, eval_interval=60, log_interval=60,
                **RUNS[kind] | ({"bpe_vocab_size": 300} if corpus and kind == "bpe" else {})))  # LINES: few words
            train.train(cfg)
            export_gguf.main([cfg.out_dir, str(root / f"{name}.gguf")])
            loaded = from_checkpoint(Path(cfg.out_dir) / "best.pt")
            model, tokenizer = loaded.model, loaded.tokenizer
            llm = llama_cpp.Llama(str(root / f"{name}.gguf"), n_ctx=model.config.block_size, n_threads=1,
                                  logits_all=True, verbose=False)
            made[name] = model, tokenizer, llm, root / f"{name}.gguf"
        return made[name]
    return build


KINDS = [pytest.param("char"), pytest.param("ascii"), pytest.param("bpe"),
         pytest.param("gpt2", marks=pytest.mark.network)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_gives_our_ids_our_logits_and_our_greedy_text(exported, kind):
    model, tokenizer, llm, _ = exported(kind)
    text = ASCII if kind == "ascii" else CORPUS
    assert llm.tokenize(text.encode()) == tokenizer.encode(text)  # llama.cpp's defaults (add_bos=True): nothing added
    assert llm.detokenize(tokenizer.encode(text)).decode() == text
    ids = tokenizer.encode(text[:400])[: model.config.block_size]
    llm.reset()
    llm.eval(ids)
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0].numpy()  # (T, V)
    theirs = np.asarray(llm.scores[: len(ids)])  # (T, V), and a char export's <|endoftext|> after the V
    diff = np.abs(theirs[:, :tokenizer.vocab_size] - ours).max()
    assert diff < LOGIT_TOLERANCE, diff
    assert not theirs[:, tokenizer.vocab_size:].any()  # the added end token's logit: exactly 0, wherever it is
    prompt = ids[:8]
    new = model.config.block_size - len(prompt)  # within the window: past it llama.cpp's text is not ours
    expected = sample.generate(model, torch.tensor([prompt]), new, temperature=0)[0, len(prompt):].tolist()
    llm.reset()
    greedy = [token for token, _ in zip(llm.generate(prompt, temp=0.0, top_k=1), range(new))]
    assert llm.detokenize(greedy) == tokenizer.decode_bytes(expected)
    assert greedy == expected


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["char", "bpe", pytest.param("gpt2", marks=pytest.mark.network)])
def test_llama_cpp_completes_our_greedy_text_across_newlines(exported, kind):
    """Bug caught: llama.cpp ended a char model's every completion at its first newline (its eos then)."""
    model, tokenizer, llm, _ = exported(kind, "lines")
    prompt = tokenizer.encode("king\n")
    new = model.config.block_size - len(prompt)
    greedy = sample.generate(model, torch.tensor([prompt]), new, temperature=0)[0, len(prompt):]  # (new,)
    ours = tokenizer.decode(greedy.tolist())
    assert ours.count("\n") >= 3, ours
    llm.reset()
    theirs = llm.create_completion("king\n", max_tokens=new, temperature=0)["choices"][0]
    assert (theirs["text"], theirs["finish_reason"]) == (ours, "length")


# A request past block_size, the issue's: learned positions ran out and llama.cpp aborted the process (SIGABRT).
PAST_THE_WINDOW = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_threads=1, verbose=False)  # llama-cpp-python's default context: 512 positions
answer = llm.create_completion("King ", max_tokens=int(sys.argv[2]), temperature=0)["choices"][0]
print(answer["finish_reason"], len(llm.tokenize(answer["text"].encode(), add_bos=False)))
llm = Llama(sys.argv[1], n_ctx=0, n_threads=1, verbose=False)  # the file's own context: every position it has
llm.eval([0] * llm.n_ctx())
print(llm.n_ctx())
"""


@pytest.mark.slow
def test_a_request_past_the_window_is_answered_and_no_context_reaches_past_the_position_table(exported):
    """Twice block_size tokens come back whole; the file's context fills (in a child: an abort is its)."""
    model, _, _, gguf_file = exported("ascii")
    new = 2 * model.config.block_size
    done = subprocess.run([sys.executable, "-c", PAST_THE_WINDOW, str(gguf_file), str(new)], cwd=REPO, text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]  # -6 (SIGABRT) before: "GGML_ASSERT(i01 >= 0 && i01 < ne01)"
    assert done.stdout.split() == ["length", str(new), str(export_gguf.CONTEXT_ROWS)]
