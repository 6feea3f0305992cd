"""GPT-2 BPE document corpora: a folder of .txt files or a .jsonl, tokenized in parallel and streamed."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_text, read_metrics, tiny_args

import train
from cli import DataError
from data import val_windows
from prepare import is_val
import scripts.prepare as scripts_prepare
from scripts import doctor
from scripts.prepare import prepare_corpus
from scripts import eval as eval_script
from tokenizer import GPT2_EOT, GPT2Tokenizer

pytestmark = pytest.mark.network  # may download the openai-whisper sdist (once per module)
DOCS = [make_text(n_lines=8 + i, seed=i) for i in range(12)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tok(cache) -> GPT2Tokenizer:
    return GPT2Tokenizer(cache)


def write_jsonl(path: Path, docs: list[str]) -> Path:
    lines = [json.dumps({"id": i, "text": text}) + "\n" for i, text in enumerate(docs)]
    path.write_text("".join(lines[:4]) + "\n" + "".join(lines[4:]))  # a blank line is skipped, not a document
    return path


def write_folder(folder: Path, docs: list[str]) -> Path:
    for i, text in enumerate(docs):  # names sort in document order; a subfolder is searched too
        file = folder / ("sub" if i >= 8 else "") / f"{'z' if i >= 8 else 'a'}{i:02d}.txt"
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
    return folder


def test_bits_per_byte_count_the_utf8_bytes_of_bpe_targets(tok):
    ids = tok.encode("A café 😀 中文") + [GPT2_EOT] + tok.encode("B")
    assert tok.decode([ids[0]]) == "A" and len(ids) > 8  # multi-byte characters span several tokens
    _, y = val_windows(np.array(ids), 4)
    # Targets: all but "A". " café" 1+3+2, " 😀" 1+4, " 中文" 1+3+3, <|endoftext|> 0 (it is no text), "B" 1.
    assert train.val_byte_count(y, tok, torch.device("cpu")) == 6 + 5 + 7 + 0 + 1
    assert eval_script.target_chars(y, tok) == len(" café" + " 😀" + " 中文" + "B")  # not 13 for the separator


@pytest.mark.parametrize("fraction, n, val_indices", [(0.1, 25, [0, 10, 20]), (0.25, 9, [0, 4, 8]),
                                                      (0.5, 5, [0, 2, 4]), (0.3, 10, [0, 3, 6]), (0.01, 3, [0])])
def test_val_documents_are_spread_and_counted_exactly(fraction, n, val_indices):
    """The first of every ten; ceil(fraction n) val documents among the first n; at least one."""
    assert [i for i in range(n) if is_val(i, fraction)] == val_indices


def test_a_jsonl_or_a_folder_has_eot_before_each_document_and_every_tenth_in_val(tmp_path, cache, tok, monkeypatch):
    folder = prepare_corpus(data_path=str(write_jsonl(tmp_path / "web.jsonl", DOCS)), tokenizer="gpt2",
                            data_dir=str(cache), val_fraction=0.1, num_proc=2)
    expected = {"train": [], "val": []}
    for i, text in enumerate(DOCS):
        expected["val" if i in (0, 10) else "train"] += [GPT2_EOT] + tok.encode(text)
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["documents"], meta["val_documents"]) == (12, 2)
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(expected["train"]), len(expected["val"]))
    assert meta["tokenizer"] == {"kind": "gpt2"} and meta["dtype"] == "uint16"
    monkeypatch.setattr(scripts_prepare, "IN_FLIGHT", 1)
    from_folder = prepare_corpus(data_path=str(write_folder(tmp_path / "docs", DOCS)), tokenizer="gpt2",
                                 data_dir=str(cache), val_fraction=0.1, num_proc=1)  # one thread, one doc at a time
    for prepared in (folder, from_folder):
        splits = {split: np.fromfile(prepared / f"{split}.bin", dtype=np.uint16).tolist() for split in expected}
        assert splits == expected


def test_train_runs_on_a_bpe_jsonl_corpus(tmp_path, cache, tiny_cfg, monkeypatch):
    corpus = write_jsonl(tmp_path / "web.jsonl", DOCS * 3)
    monkeypatch.chdir(tmp_path)  # --data_path relative to here; scripts.prepare runs from the repo root
    cfg = tiny_cfg(data_path="web.jsonl", data_dir=str(cache), tokenizer="gpt2", max_iters=2, eval_interval=2,
                   eval_tokens=256)
    with pytest.raises(DataError, match="^web.jsonl: a corpus of documents is tokenized by its own command") as refused:
        train.train(cfg)  # minutes to hours of tokenizing: a step of its own, then found by train.py
    command = shlex.split(str(refused.value).split(" first: ")[1].removesuffix("; then this again"))
    assert command[:5] == ["python", "-m", "scripts.prepare", "--data_path", str(corpus)] and "gpt2" in command
    assert scripts_prepare.main(command[3:]) is None  # the command it names prepares what train.py then finds
    val_loss = train.train(cfg)
    assert abs(val_loss - np.log(50257)) < 1.0  # about uniform over the 50257 tokens after 2 steps
    records = read_metrics(cfg.out_dir)
    assert [r["mfu"] for r in records if "loss" in r] == [None, None]  # CPU: n/a, never a number
    (val,) = [r for r in records if "val_loss" in r]
    assert 0 < val["val_bpb"] < val["val_loss"] / np.log(2)  # BPE tokens hold several bytes each


def test_doctor_round_trips_each_document(tok):
    # <|endoftext|> before each document, as prepare writes them: it decodes to its name, 7 ordinary tokens.
    ids = np.array([i for text in DOCS[:4] for i in [GPT2_EOT] + tok.encode(text)])
    check = doctor.check_round_trip(tok, ids)
    assert check.passed, check.measured
    assert "in 4 stretches between special tokens" in check.measured  # the first <|endoftext|> is cut off


@pytest.mark.slow  # every doctor check with a 50257-token head: ~40 s on 2 cores
def test_the_doctor_passes_every_check_on_a_jsonl_corpus(tmp_path, cache, capsys):
    corpus = write_jsonl(tmp_path / "web.jsonl", DOCS * 3)
    argv = tiny_args(tmp_path / "out", corpus, tokenizer="gpt2", val_fraction=0.05, data_dir=cache)
    prepare_corpus(data_path=str(corpus), tokenizer="gpt2", data_dir=str(cache), val_fraction=0.05)  # its own step
    assert doctor.main(argv) == 0, capsys.readouterr().out
    assert re.search(r"(\d+)/\1 checks passed", capsys.readouterr().out)
