"""Parquet corpora prepare to the files the same documents give as a .jsonl; bad input is one line naming the file."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from conftest import make_text

from cli import DataError
from prepare import corpus_source
import scripts.prepare as scripts_prepare
from scripts.prepare import prepare_corpus
from scripts.prepare import main as prepare_main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = [make_text(n_lines=6 + i, seed=i) for i in range(13)]
DOCS[5] = "Ça va? « oui »"  # characters no other document has: the char vocabulary is the whole corpus's
DOCS[7] = ""  # an empty document: counted, no tokens, as in a .jsonl


def write_parquet(path: Path, docs: list[str | None], column: str = "text", row_group_size: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), column: pa.array(docs, type=pa.string())})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: text}) + "\n" for i, text in enumerate(docs)))
    return path


def assert_same_splits(a: Path, b: Path) -> None:
    for split in ("train", "val"):
        assert (a / f"{split}.bin").read_bytes() == (b / f"{split}.bin").read_bytes(), split
    meta_a, meta_b = (json.loads((f / "meta.json").read_text()) for f in (a, b))
    assert {k: v for k, v in meta_a.items() if k != "source"} == {k: v for k, v in meta_b.items() if k != "source"}


def test_parquet_prepares_exactly_as_the_same_documents_in_jsonl_whatever_its_shards(tmp_path, monkeypatch):
    from_parquet = prepare_corpus(data_path=str(write_parquet(tmp_path / "web.parquet", DOCS)),
                                  data_dir=str(tmp_path / "d"), num_proc=2)
    from_jsonl = prepare_corpus(data_path=str(write_jsonl(tmp_path / "web.jsonl", DOCS)), data_dir=str(tmp_path / "d"),
                                num_proc=1)
    assert_same_splits(from_parquet, from_jsonl)  # the .jsonl's: tests/test_data.py
    meta = json.loads((from_parquet / "meta.json").read_text())
    assert (meta["documents"], meta["val_documents"], meta["text_column"]) == (13, 2, "text")
    shards = tmp_path / "shards"  # sorted by relative path: a/ before b.parquet before c/
    write_parquet(shards / "a" / "000.parquet", DOCS[:4], row_group_size=3)
    write_parquet(shards / "b.parquet", DOCS[4:9], row_group_size=2)  # row groups end mid-shard
    write_parquet(shards / "c" / "000.parquet", DOCS[9:], row_group_size=1)
    monkeypatch.setattr(scripts_prepare, "PARQUET_BATCH_ROWS", 2)  # read batches that straddle row groups
    monkeypatch.setattr(scripts_prepare, "IN_FLIGHT", 1)  # and a few documents in flight at a time
    assert_same_splits(prepare_corpus(data_path=str(shards), data_dir=str(tmp_path / "d"), num_proc=2), from_parquet)


def test_text_column_reads_another_column_or_field_and_names_another_folder(tmp_path):
    parquet = write_parquet(tmp_path / "web.parquet", DOCS, column="content")
    jsonl = write_jsonl(tmp_path / "web.jsonl", DOCS, field="content")
    folders = [prepare_corpus(data_path=str(path), data_dir=str(tmp_path / "d"), num_proc=1, text_column="content")
               for path in (parquet, jsonl)]
    assert_same_splits(*folders)
    assert json.loads((folders[0] / "meta.json").read_text())["text_column"] == "content"
    argv = ["--data_path", str(parquet), "--data_dir", str(tmp_path / "d"), "--num_proc", "1"]
    prepare_main(argv + ["--text_column", "content"])  # the flag reaches prepare: the default, "text", is not there
    for path in (parquet, jsonl):
        default, other = (corpus_source("", str(path), column)[0] for column in ("text", "content"))
        assert default != other and default == corpus_source("", str(path))[0]
    txt = tmp_path / "a.txt"
    txt.write_text("a document")
    assert corpus_source("", str(txt), "content") == corpus_source("", str(txt))  # a .txt has no column
    info = jsonl.stat()  # the default column keeps the folder names of before: prepared corpora stay cached
    before = hashlib.sha256(f"web.jsonl\0{info.st_size}\0{info.st_mtime_ns}\n".encode()).hexdigest()
    assert corpus_source("", str(jsonl), "text")[0] == f"web-{before[:12]}"


@pytest.mark.parametrize("case, expected", [
    ("missing column", r"b.parquet: no column 'text' \(its columns: id, body\); .*--text_column"),
    ("not strings", r"web.parquet: column 'text' holds int64, not strings"),
    ("null row", r"web.parquet:row 3: null in column 'text'"),
    ("not parquet", r"web.parquet: not a readable Parquet file"),
    ("mixed folder", r"mixed: holds both .txt and .parquet files; pick one kind"),
    ("jsonl field", r"web.jsonl:1: not a JSON object with a \"body\" field \(its fields: id, text\); .*--text_column"),
    ("jsonl not a string", r"web.jsonl:2: \"text\" is a int, not a string"),
    ("jsonl not UTF-8", r"web.jsonl:2: not UTF-8"),
    ("jsonl not JSON", r"web.jsonl:2: not JSON \(Expecting value"),
])
def test_bad_parquet_input_is_one_line_naming_the_file(tmp_path, monkeypatch, case, expected):
    path, column = tmp_path / "web.parquet", "text"
    if case == "missing column":  # in the last shard: found before any document is read
        write_parquet(tmp_path / "shards" / "a.parquet", DOCS[:6])
        path = write_parquet(tmp_path / "shards" / "b.parquet", DOCS[6:], column="body").parent
        monkeypatch.setattr(scripts_prepare, "document_texts", lambda *_, **__: pytest.fail("documents were read"))
    elif case == "not strings":
        pq.write_table(pa.table({"text": [1, 2, 3]}), path)
    elif case == "null row":
        write_parquet(path, ["one", "two", None, "four"], row_group_size=2)
    elif case == "not parquet":
        path.write_text('{"text": "a .jsonl by another name"}\n')
    elif case == "mixed folder":
        path = tmp_path / "mixed"
        write_parquet(path / "a.parquet", DOCS)
        (path / "b.txt").write_text("a document")
    elif case == "jsonl field":
        path, column = write_jsonl(tmp_path / "web.jsonl", DOCS), "body"
    else:
        path = tmp_path / "web.jsonl"
        second = {"jsonl not a string": b'{"text": 5}', "jsonl not JSON": b'{"text": broken'}.get(case,
                                                                                             b'{"text": "\xff"}')
        path.write_bytes(b'{"text": "fine"}\n' + second + b"\n")
    with pytest.raises(DataError, match=expected) as raised:
        prepare_corpus(data_path=str(path), data_dir=str(tmp_path / "d"), num_proc=1, text_column=column)
    assert "\n" not in str(raised.value)
    assert not list((tmp_path / "d").glob("*-char-*"))  # nothing prepared


def test_without_pyarrow_a_parquet_corpus_says_what_to_install(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "web.parquet", DOCS)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"web.parquet: reading .parquet needs pyarrow: pip install pyarrow==26.0.1"):
        prepare_corpus(data_path=str(path), data_dir=str(tmp_path / "d"), num_proc=1)


def test_rows_are_read_lazily_one_batch_at_a_time(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "many.parquet", [f"document {i}" for i in range(200)], row_group_size=10)
    batches_read = []
    original = pq.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        for batch in original(self, *args, **kwargs):
            batches_read.append(len(batch))
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counted)
    monkeypatch.setattr(scripts_prepare, "PARQUET_BATCH_ROWS", 4)
    texts = scripts_prepare.document_texts(path)
    assert iter(texts) is texts and not batches_read  # a generator: nothing read until asked
    assert next(texts) == "document 0"
    assert batches_read == [4]  # one batch of 4 rows read for the first document, not 200 rows
    assert list(texts)[-1] == "document 199" and sum(batches_read) == 200
