"""The document formats: which files make a corpus of documents, and how each kind's documents are read.

    python -m prepare --data_path docs/                              # a folder of .txt files, one document each
    python -m prepare --data_path web.jsonl --tokenizer gpt2         # one JSON object per line, its "text" field
    python -m prepare --data_path fineweb/ --tokenizer gpt2          # .parquet shards, one document per row of "text"
    python -m prepare --data_path web.parquet --text_column content  # another column (or .jsonl field)

Each kind of file is one row of ``DOCUMENT_FORMATS``: a reader of its documents and what it allows;
``format_of`` is the one place a file's row is chosen, so a new format is a reader and a row. A reader
yields a ``Source`` per document, lazily and in order: cheap to pickle, so the worker processes
(prepare/documents.py) get the text from it (``document_text``), not the main process. A .jsonl line or
a Parquet row is one document, its text in the ``text_column`` field or column; Parquet is read a few rows
at a time (``parquet_sources``), with pyarrow, imported only for it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal, NamedTuple

from process.errors import DataError

DEFAULT_TEXT_COLUMN = "text"
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: a few MB of web text, whatever the file or row group size


class Source(NamedTuple):
    """One document, as sent to a worker: cheap to pickle, and enough for the worker to get its text."""
    kind: Literal["file", "jsonl", "text"]  # a .txt to read | a .jsonl line to decode | the text itself (Parquet)
    where: str  # what errors name: the .txt's path, "web.jsonl:7" or "web.parquet:row 7" (1-based)
    payload: str = ""  # "" for a file, the raw line for jsonl, the document's text for text

    def size(self) -> int:
        """Characters (or a file's bytes) of text this source stands for: what a batch is measured in."""
        return Path(self.where).stat().st_size if self.kind == "file" else len(self.payload)


# ----------------------------------------------------------------------------- the readers
def jsonl_sources(path: Path) -> Iterator[Source]:
    """A source per non-blank line, decoded from UTF-8 here (JSON is parsed by the worker)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{number}: not UTF-8 ({err.reason} at byte {err.start} of the line)") from None
            if line.strip():
                yield Source("jsonl", f"{path}:{number}", line)


def import_pyarrow(path: Path):
    """pyarrow and its parquet module, imported on first use: only Parquet corpora need it."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401 - binds pyarrow.parquet
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow==26.0.1") from None
    return pyarrow


def open_parquet(path: Path, text_column: str):
    """A ParquetFile whose ``text_column`` is a string column; DataError (one line) otherwise."""
    pa = import_pyarrow(path)
    try:
        reader = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"{path}: not a readable Parquet file ({reason})") from None
    schema = reader.schema_arrow
    if text_column not in schema.names:
        raise DataError(f"{path}: no column {text_column!r} (its columns: {', '.join(schema.names)}); "
                        "name the one holding the text with --text_column")
    kind = schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"{path}: column {text_column!r} holds {kind}, not strings; "
                        "name the column holding the text with --text_column")
    return reader


def parquet_sources(path: Path, text_column: str) -> Iterator[Source]:
    """A source per row of ``text_column``, carrying its text, read PARQUET_BATCH_ROWS rows at a time.

    iter_batches decodes one batch of the one column at a time (never read_table, which would hold the
    whole file), so memory does not grow with the file. A null row is refused: it is no document.
    """
    reader = open_parquet(path, text_column)
    row = 0
    for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_column]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise DataError(f"{path}:row {row}: null in column {text_column!r}; drop or fill the row")
            yield Source("text", f"{path}:row {row}", text)


# ----------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class DocumentFormat:
    """How to read one kind of document file: a suffix of DOCUMENT_FORMATS. A new format is a reader and a row."""
    sources: Callable[[Path, str], Iterator[Source]]  # (file, text_column) -> its documents, in order, lazily
    named_column: bool  # documents sit in a field or column that --text_column names
    in_folders: bool  # a folder of such files is a corpus
    one_per_file: bool = False  # each file is one document (so a single such file is one text, not a corpus)
    check: Callable[[Path, str], object] | None = None  # a cheap look at every file before any document is read


DOCUMENT_FORMATS: dict[str, DocumentFormat] = {
    ".txt": DocumentFormat(lambda path, column: iter([Source("file", str(path))]), named_column=False,
                           in_folders=True, one_per_file=True),
    ".jsonl": DocumentFormat(lambda path, column: jsonl_sources(path), named_column=True, in_folders=False),
    ".parquet": DocumentFormat(parquet_sources, named_column=True, in_folders=True, check=open_parquet),  # the footer
}


def format_of(path: Path) -> DocumentFormat | None:
    """The row a file, or the files of a folder (folder_suffix), is read by; None for no document format."""
    return DOCUMENT_FORMATS.get(folder_suffix(path) if path.is_dir() else path.suffix)


def folder_suffixes() -> tuple[str, ...]:
    """The document formats a folder may hold (one kind per folder)."""
    return tuple(suffix for suffix, fmt in DOCUMENT_FORMATS.items() if fmt.in_folders)


def accepted_inputs() -> str:
    """What --data_path takes, in words, from DOCUMENT_FORMATS."""
    files = [suffix for suffix, fmt in DOCUMENT_FORMATS.items() if not fmt.one_per_file]
    return (f"a .txt file, a folder of {' or '.join(folder_suffixes())} files, a {' or a '.join(files)} file, "
            "or a folder of train.bin, val.bin and meta.json")


# ----------------------------------------------------------------------------- a corpus of documents
def is_document_corpus(path: Path) -> bool:
    """A folder, or a file of a document format (.jsonl, .parquet): many documents, prepared in parallel and
    streamed. A single .txt is one text instead."""
    return path.is_dir() or (fmt := format_of(path)) is not None and not fmt.one_per_file


def has_text_column(path: Path) -> bool:
    """Whether documents sit in a named field or column (.jsonl, .parquet), so text_column applies."""
    fmt = format_of(path)
    return fmt is not None and fmt.named_column


def folder_suffix(folder: Path) -> str:
    """The one kind of document file a folder holds (".txt", ".parquet", ...); DataError if none or several."""
    found = [suffix for suffix in folder_suffixes() if next(folder.rglob(f"*{suffix}"), None) is not None]
    if not found:
        raise DataError(f"{folder}: no {' files and no '.join(folder_suffixes())} files in this folder")
    if len(found) > 1:
        raise DataError(f"{folder}: holds both {' and '.join(found)} files; pick one kind (move the others out)")
    return found[0]


def corpus_files(path: Path) -> list[Path]:
    """A document corpus's files: a folder's, sorted by path (a subfolder's among them by its name), or itself."""
    return sorted(path.rglob(f"*{folder_suffix(path)}")) if path.is_dir() else [path]


def check_files(path: Path, text_column: str) -> None:
    """Every file looked at (a shard's column, from its footer), so a bad one is refused now, not hours in."""
    for file in corpus_files(path):
        if (check := format_of(file).check) is not None:
            check(file, text_column)


def document_sources(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> Iterator[Source]:
    """Every document of a corpus, in order, lazily: a folder's files, a .jsonl's lines or a .parquet's rows."""
    for file in corpus_files(path):
        yield from format_of(file).sources(file, text_column)


# ----------------------------------------------------------------------------- a document's text (in a worker)
def document_text(source: Source, text_column: str = DEFAULT_TEXT_COLUMN) -> str:
    """A document's text: a .txt file's, a .jsonl line's text_column field, or a Parquet row's (carried)."""
    if source.kind == "file":
        return read_text_file(Path(source.where))
    if source.kind == "text":
        return source.payload
    return jsonl_text(source, text_column)


def jsonl_text(source: Source, field: str) -> str:
    """The ``field`` of a .jsonl line; DataError names the file and line."""
    try:
        record = json.loads(source.payload)
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict) or field not in record:
        fields = (f" (its fields: {', '.join(record)}); name the one holding the text with --text_column"
                  if isinstance(record, dict) else "")
        raise DataError(f"{source.where}: not a JSON object with a \"{field}\" field{fields}")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{source.where}: \"{field}\" is a {type(text).__name__}, not a string")
    return text


def read_text_file(path: Path, flag: str = "--data_path") -> str:
    """The file's text; errors name ``flag``, the option the user gave the path with."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass an existing UTF-8 text file with {flag}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
