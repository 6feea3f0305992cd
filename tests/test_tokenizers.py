"""Tokenizers: char and GPT-2 round trips; a BPE trained on the train split only, deterministically, carried in the
checkpoint and exported; its bad inputs in one line. transformers' ids on the exports: tests/test_interop.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import make_text, run_main, tiny_args, tiny_model

import sample
from checkpoint import from_checkpoint
from cli import DataError, HFError
from config import parse_args
from scripts import export_hf
from scripts.export_hf import tokenizer_files
from scripts.import_hf import read_tokenizer
from scripts.prepare import prepare_corpus
from tokenizer import BPETokenizer, CharTokenizer, GPT2Tokenizer, tokenizer_from_meta, train_bpe

VOCAB = 320  # 256 bytes, 63 merges, <|endoftext|>: well within what make_text's words can merge
MIXED = "ROMEO: naïve café — 東京 🤖👍🏽\n\n\tend   of  line \n  x"  # ASCII, accents, emoji, whitespace runs


@pytest.mark.network
@pytest.mark.slow  # ~6 s
def test_gpt2_tokenizer_offline_fallback(tmp_path, monkeypatch):
    import tiktoken

    def no_internet(name):
        raise ConnectionError("no route to the tiktoken download host")

    monkeypatch.setattr(tiktoken, "get_encoding", no_internet)
    tok = GPT2Tokenizer(tmp_path)  # built from the whisper sdist's gpt2.tiktoken, checked by sha256
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eot_token == 50256
    text = "Thou art more lovely — and more temperate 🌹\n"
    assert tok.decode(tok.encode(text)) == text
    assert (tmp_path / "tokenizers" / "gpt2.tiktoken").is_file()


def test_gpt2_ranks_that_cannot_be_fetched_say_what_for_and_what_else_to_do(tmp_path, monkeypatch):
    """It said "use --data_path FILE", which the user had passed: the download is GPT-2's tokenizer file."""
    monkeypatch.setattr("tiktoken.get_encoding", lambda name: 1 / 0)  # no internet, no tiktoken cache
    monkeypatch.setattr("tokenizer.subprocess.run", lambda *a, **k: type("Failed", (), {"returncode": 1, "stderr": ""}))
    with pytest.raises(DataError, match="for GPT-2's tokenizer file it holds .* or use --tokenizer char or bpe$"):
        GPT2Tokenizer(tmp_path)


# ----------------------------------------------------------------------------- BPE
def prepared(data_path: Path, data_dir: Path, vocab: int = VOCAB) -> Path:
    return prepare_corpus(data_path=str(data_path), tokenizer="bpe", data_dir=str(data_dir), bpe_vocab_size=vocab)


def ranks_of(folder: Path) -> list[str]:
    return json.loads((folder / "meta.json").read_text())["tokenizer"]["ranks"]


def test_preparing_twice_gives_byte_identical_files(tmp_path, text_file):
    first, second = prepared(text_file, tmp_path / "a"), prepared(text_file, tmp_path / "b")
    assert first.name == second.name == f"{text_file.stem}-{first.name.split('-')[1]}-bpe{VOCAB}-val0.1"
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert len(ranks_of(first)) == VOCAB - 1  # the last id is <|endoftext|>, not a merge


def test_the_val_split_never_shapes_the_merges(tmp_path):
    """The same train part, val tails of the same length: the same merges. The second tail repeats a word the train
    part never has, so merges learnt from it would show."""
    train_part = make_text(400)
    n_val = len(train_part) // 9  # val_fraction 0.1 of the whole: the tail is 1/9 of the train part
    tails = [make_text(100, seed=1)[:n_val], ("zqxv " * n_val)[:n_val]]
    folders = []
    for i, tail in enumerate(tails):
        path = tmp_path / f"text{i}.txt"
        path.write_text(train_part + tail)
        folders.append(prepared(path, tmp_path / f"data{i}"))
    assert ranks_of(folders[0]) == ranks_of(folders[1])
    assert (folders[0] / "val.bin").read_bytes() != (folders[1] / "val.bin").read_bytes()
    seen_val = train_bpe([train_part + tails[1]], VOCAB, "whole").meta()["ranks"]  # the test can fail: val merges
    with_marker = lambda ranks: [bytes.fromhex(t) for t in ranks if b"zqx" in bytes.fromhex(t)]  # noqa: E731
    assert with_marker(seen_val) and not with_marker(ranks_of(folders[1]))


def test_document_corpora_train_their_bpe_on_train_documents_only(tmp_path):
    """A .jsonl's val documents (0, 10, 20, ...) differ between two corpora; the merges do not."""
    docs = make_text(600).splitlines()  # a line a document
    folders = []
    for i, marker in enumerate(("", "zqxv zqxv zqxv ")):
        lines = [json.dumps({"text": (marker * 20 if k % 10 == 0 else "") + doc}) for k, doc in enumerate(docs)]
        path = tmp_path / f"web{i}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        folders.append(prepare_corpus(data_path=str(path), tokenizer="bpe", data_dir=str(tmp_path / f"d{i}"),
                                      bpe_vocab_size=VOCAB, num_proc=1))
    assert ranks_of(folders[0]) == ranks_of(folders[1])
    meta = json.loads((folders[0] / "meta.json").read_text())
    assert meta["documents"] == len(docs) and "<|endoftext|> before each document" in meta["val_split"]


def test_a_bpe_run_trains_resumes_and_samples_from_its_checkpoint_alone(tmp_path, text_file, capsys):
    """The tokenizer travels in the checkpoint: eval refuses a val split whose cached corpus now says other ids mean
    other text (never a silently different tokenizer); with data_dir gone, sample.py still encodes any Unicode."""
    out = tmp_path / "run"
    assert run_main(tiny_args(out, text_file, tokenizer="bpe", bpe_vocab_size=VOCAB, max_iters=6, eval_interval=3)) == 0
    assert run_main(tiny_args(out, text_file, tokenizer="bpe", bpe_vocab_size=VOCAB, max_iters=8, eval_interval=3,
                              resume="true")) == 0
    from scripts import eval as evaluate
    evaluate.main(["--ckpt", str(out)])  # the same tokenizer: scored
    meta_file = prepared(text_file, text_file.parent / "data") / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["tokenizer"]["ranks"][256], meta["tokenizer"]["ranks"][257] = meta["tokenizer"]["ranks"][257:255:-1]
    meta_file.write_text(json.dumps(meta))
    capsys.readouterr()
    code, err = run_main(["--ckpt", str(out)], evaluate.main), capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "holds tokens of another tokenizer" in err, err
    for folder in (text_file.parent / "data").iterdir():
        if folder.is_dir():
            for file in folder.iterdir():
                file.unlink()
    loaded = from_checkpoint(out / "best.pt")
    model, tokenizer = loaded.model, loaded.tokenizer
    assert isinstance(tokenizer, BPETokenizer) and tokenizer.vocab_size == VOCAB == model.config.vocab_size
    assert tokenizer.decode(tokenizer.encode(MIXED)) == MIXED  # byte-level: no character is out of vocabulary
    capsys.readouterr()
    sample.main(["--ckpt", str(out), "--prompt", MIXED, "--max-new-tokens", "5", "--seed", "1"])
    assert capsys.readouterr().out.splitlines()[1].startswith(MIXED.splitlines()[0])


def test_the_smallest_bpe_is_bytes_and_encodes_any_text(tmp_path, text_file):
    """Too many merges asked: test_bad_input.py's BAD_INPUTS (scripts.prepare --bpe_vocab_size 100000)."""
    parse_args(["--config", "tiny", "--tokenizer", "bpe", "--bpe_vocab_size", "257"])  # bytes alone: allowed
    tokenizer = tokenizer_from_meta(json.loads((prepared(text_file, tmp_path / "d", 257) / "meta.json").read_text())
                                    ["tokenizer"])
    assert tokenizer.encode(MIXED) == list(MIXED.encode("utf-8")) and tokenizer.eot_token == 256


# ----------------------------------------------------------------------------- export
def test_a_char_export_is_a_tokenizer_json_with_one_token_per_character(tmp_path):
    files = tokenizer_files(CharTokenizer(" \nab€"), 16)
    model = files["tokenizer.json"]["model"]
    assert model["vocab"] == {" ": 0, "\n": 1, "a": 2, "b": 3, "€": 4} and model["merges"] == []
    assert files["tokenizer.json"]["pre_tokenizer"] is None and files["tokenizer.json"]["normalizer"] is None


def test_an_exported_bpe_reimports_with_its_own_tokenizer(tmp_path):
    ours = train_bpe([make_text()], VOCAB, "text")
    export_hf.export(tiny_model(vocab_size=VOCAB), ours, tmp_path / "export")
    assert read_tokenizer(tmp_path / "export", VOCAB) == ours.meta()
    with pytest.raises(HFError, match="a BPE of 320 tokens for a vocabulary of 50257"):
        read_tokenizer(tmp_path / "export", 50257)


def test_the_tokenizer_report_compares_each_vocabulary_on_the_same_val_text(tmp_path, text_file, capsys):
    from scripts import tokenizer as report
    report.main(["--data_path", str(text_file), "--data_dir", str(tmp_path / "d"), "--bpe_vocab_size", "300",
                 str(VOCAB), "--no-gpt2"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines() if line.startswith("| ")}
    assert list(rows) == ["tokenizer", "char", "bpe 300", f"bpe {VOCAB}"]
    bytes_per_token = [float(rows[name][4]) for name in ("char", "bpe 300", f"bpe {VOCAB}")]
    assert bytes_per_token[0] == 1.0 and bytes_per_token[0] < bytes_per_token[1] < bytes_per_token[2]
    val = np.fromfile(next((tmp_path / "d").glob(f"*bpe{VOCAB}*")) / "val.bin", dtype=np.uint16)
    assert int(rows[f"bpe {VOCAB}"][3].replace(",", "")) == len(val)  # the table's tokens are the val split's
    assert "longest of bpe 320" in out


# ----------------------------------------------------------------------------- the report on documents
@pytest.mark.parametrize("layout", ["jsonl", "txt folder"])
def test_the_tokenizer_report_scores_a_document_corpus_between_its_separators(tmp_path, capsys, layout):
    """Bug caught: on a .jsonl or a folder of .txt files it stopped with `error: characters not in the model's
    vocabulary: '<>|'`, char asked to encode the BPE val split's <|endoftext|> separators."""
    from prepare import is_val
    from scripts import tokenizer as report
    lines = make_text().splitlines()
    documents = ["\n".join(lines[i: i + 20]) for i in range(0, len(lines), 20)]
    corpus = tmp_path / ("docs.jsonl" if layout == "jsonl" else "docs")
    if layout == "jsonl":
        corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))
    else:
        corpus.mkdir()
        for i, doc in enumerate(documents):
            (corpus / f"{i:03d}.txt").write_text(doc)
    report.main(["--data_path", str(corpus), "--data_dir", str(tmp_path / "d"), "--bpe_vocab_size", "300", "--no-gpt2"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines() if line.startswith("| ")}
    val_documents = [doc for i, doc in enumerate(documents) if is_val(i, 0.1)]
    assert int(rows["char"][3].replace(",", "")) == sum(len(doc) for doc in val_documents)  # every val text, no more
    assert f"in {len(val_documents)} documents" in out
    val = np.fromfile(next((tmp_path / "d").glob("*bpe300*")) / "val.bin", dtype=np.uint16)
    assert int(rows["bpe 300"][3].replace(",", "")) == len(val) - len(val_documents)  # less a separator each
