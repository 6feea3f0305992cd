"""A corpus of documents (a folder of .txt or .parquet files, a .jsonl, a .parquet) tokenized by a pool of worker
processes and streamed into train.bin and val.bin: memory holds one batch of documents, whatever the corpus size.

    python -m prepare --data_path docs/                         # a folder of .txt files, one document each
    python -m prepare --data_path web.jsonl --tokenizer gpt2    # one JSON object per line, its "text" field
    python -m prepare --data_path fineweb/ --tokenizer gpt2     # .parquet shards, one document per row of "text"
    python -m prepare --data_path web.parquet --text_column content --num_proc 8   # another column (or .jsonl field)

Each kind of file is one row of ``DOCUMENT_FORMATS``: a reader that yields a ``Source`` per document, lazily and
in order, cheap to pickle, so that the workers, not the main process, get the text from it (``document_text``).
A new format is a reader and a row. Parquet is read a few rows at a time by pyarrow, imported only for it.

Each document is preceded by the tokenizer's separator (``encode_document``). A char vocabulary (the corpus's
characters) and a BPE trained here (on the train documents) each cost one more streaming pass first. The val
split is every 1/val_fraction-th document from the first (tokenfiles.is_val; 0.1: documents 0, 10, 20, ...): it
needs no pass in advance and spreads val over the corpus. A worker gets what every document shares (the
tokenizer, the column) with each task, through functools.partial: no module state is set in it.
"""
from __future__ import annotations

import functools
import json
import multiprocessing
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal, NamedTuple, TypeVar

import numpy as np
from tqdm import tqdm

from prepare.chat import jsonl_lines
from prepare.staging import staged_folder
from prepare.texts import read_text_file
from prepare.tokenfiles import check_split_lengths, is_val, token_dtype, write_meta
from prepare.tokenizers import CharTokenizer, GPT2Tokenizer, TiktokenTokenizer, tokenizer_from_meta, train_bpe
from process.errors import DataError, install_hint

DEFAULT_TEXT_COLUMN = "text"
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: a few MB of web text, whatever the file or row group size
BATCH_CHARS = 1 << 25  # ~32 MB of text in flight at once: what bounds memory, not the corpus size
T = TypeVar("T")


class Source(NamedTuple):
    """One document, as sent to a worker: cheap to pickle, and enough for the worker to get its text."""
    kind: Literal["file", "jsonl", "text"]  # a .txt to read | a .jsonl line to decode | the text itself (Parquet)
    where: str  # what errors name: the .txt's path, "web.jsonl:7" or "web.parquet:row 7" (1-based)
    payload: str = ""  # "" for a file, the raw line for jsonl, the document's text for text


# ----------------------------------------------------------------------------- the readers
def open_parquet(path: Path, text_column: str):
    """A ParquetFile whose ``text_column`` is a string column; DataError (one line) otherwise. pyarrow is imported
    here, on first use: only Parquet corpora need it."""
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401 - binds pa.parquet
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow: {install_hint('pyarrow')}") from None
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
    """A source per row of ``text_column``, carrying its text. iter_batches decodes PARQUET_BATCH_ROWS rows of the
    one column at a time (read_table would hold the whole file). A null row is refused: it is no document."""
    row = 0
    for batch in open_parquet(path, text_column).iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_column]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise DataError(f"{path}:row {row}: null in column {text_column!r}; drop or fill the row")
            yield Source("text", f"{path}:row {row}", text)


def document_text(source: Source, text_column: str = DEFAULT_TEXT_COLUMN) -> str:
    """A document's text: a .txt file's, a Parquet row's (carried), or a .jsonl line's ``text_column`` field."""
    if source.kind != "jsonl":
        return read_text_file(Path(source.where)) if source.kind == "file" else source.payload
    try:
        record = json.loads(source.payload)
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict) or text_column not in record:
        fields = (f" (its fields: {', '.join(record)}); name the one holding the text with --text_column"
                  if isinstance(record, dict) else "")
        raise DataError(f"{source.where}: not a JSON object with a \"{text_column}\" field{fields}")
    if not isinstance(text := record[text_column], str):
        raise DataError(f"{source.where}: \"{text_column}\" is a {type(text).__name__}, not a string")
    return text


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
    ".jsonl": DocumentFormat(lambda path, column: (Source("jsonl", f"{path}:{number}", line)  # JSON parsed by a worker
                                                   for number, line in jsonl_lines(path)),
                             named_column=True, in_folders=False),
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


def document_sources(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> Iterator[Source]:
    """Every document of a corpus, in order, lazily: a folder's files, a .jsonl's lines or a .parquet's rows."""
    for file in corpus_files(path):
        yield from format_of(file).sources(file, text_column)


# ----------------------------------------------------------------------------- the pool
def batched_sources(sources: Iterable[Source], max_chars: int) -> Iterator[list[Source]]:
    """Consecutive groups of sources holding about max_chars of text (a file's bytes, a line's or row's characters)."""
    batch, chars = [], 0
    for source in sources:
        batch.append(source)
        chars += Path(source.where).stat().st_size if source.kind == "file" else len(source.payload)
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def map_documents(path: Path, work: Callable[..., T], num_proc: int, text_column: str) -> Iterator[T]:
    """``work(source, text_column=...)`` of every document of ``path``, in corpus order, from ``num_proc`` workers.
    Sources go to the pool one bounded batch at a time (Pool.imap alone would read the whole input ahead into its task
    queue), so memory does not grow with the corpus. Ctrl-C is the main process's to handle, once."""
    with multiprocessing.Pool(num_proc, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)) as pool:
        for batch in batched_sources(document_sources(path, text_column), BATCH_CHARS):
            yield from pool.imap(functools.partial(work, text_column=text_column), batch,
                                 chunksize=max(1, len(batch) // (4 * num_proc)))


@functools.cache
def worker_tokenizer(tokenizer_meta: str, cache: str) -> CharTokenizer | TiktokenTokenizer:
    """The tokenizer of a meta.json entry (as JSON, so hashable), built once per worker process: GPT-2's ranks
    are read once, not once a batch."""
    return tokenizer_from_meta(json.loads(tokenizer_meta), Path(cache))


def document_chars(source: Source, text_column: str) -> str:
    """The distinct characters of one document, in no order. In a worker (document_tokenizer)."""
    return "".join(set(document_text(source, text_column)))


def encode_document(source: Source, tokenizer_meta: str, cache: str, text_column: str) -> np.ndarray:
    """The separator then the document's token ids; empty for an empty document. In a worker. The separator is the
    tokenizer's eot_token: GPT-2's <|endoftext|>, a token that is no text. A char vocabulary has no such token (a
    reserved character would count as a byte in bits per byte and print in samples), so it uses the newline, which
    document_tokenizer puts in every char vocabulary: a char document corpus is its documents joined by newlines, as one
    text file of them would be."""
    tok, text = worker_tokenizer(tokenizer_meta, cache), document_text(source, text_column)
    ids = np.concatenate([[tok.eot_token], tok.encode_array(text)]) if text else np.zeros(0)
    return ids.astype(token_dtype(tok.vocab_size))


def document_tokenizer(path: Path, tokenizer: str, data_dir: Path, val_fraction: float, num_proc: int,
                       text_column: str, bpe_vocab_size: int) -> CharTokenizer | TiktokenTokenizer:
    """GPT-2's BPE, built once before the workers start; a char vocabulary (a first pass: the documents'
    characters and the newline that separates them); or a BPE trained on the train documents (a first pass:
    val never shapes the merges)."""
    if tokenizer == "gpt2":
        return GPT2Tokenizer(data_dir)
    if tokenizer == "char":
        chars = {"\n"}
        for found in tqdm(map_documents(path, document_chars, num_proc, text_column),
                          desc=f"reading the characters of {path.name}", unit="doc", mininterval=1.0):
            chars.update(found)
        return CharTokenizer("".join(sorted(chars)))
    texts = enumerate(map_documents(path, document_text, num_proc, text_column))
    train_texts = (text for index, text in texts if not is_val(index, val_fraction))
    return train_bpe(tqdm(train_texts, desc=f"training a {bpe_vocab_size}-token BPE on {path.name}", unit="doc",
                          mininterval=1.0), bpe_vocab_size, str(path))


def write_splits(documents: Iterable[np.ndarray], staging: Path, val_fraction: float) -> tuple[dict, dict]:
    """Each document's ids appended to staging's train.bin or val.bin (is_val), as they come: (tokens, documents)
    per split."""
    tokens, docs = {"train": 0, "val": 0}, {"train": 0, "val": 0}
    with open(staging / "train.bin", "wb") as train_f, open(staging / "val.bin", "wb") as val_f:
        for index, ids in enumerate(documents):
            split = "val" if is_val(index, val_fraction) else "train"
            (val_f if split == "val" else train_f).write(ids.tobytes())
            tokens[split], docs[split] = tokens[split] + len(ids), docs[split] + 1
    return tokens, docs


def prepare_documents(path: Path, folder: Path, tokenizer: str, data_dir: Path, val_fraction: float, num_proc: int,
                      block_size: int, text_column: str, bpe_vocab_size: int) -> Path:
    """Tokenize a document corpus (is_document_corpus) into folder/, streaming; see the module docstring."""
    num_proc = num_proc or os.cpu_count() or 1
    for file in corpus_files(path):  # every file looked at (a shard's footer): a bad one refused now, not hours in
        if (check := format_of(file).check) is not None:
            check(file, text_column)
    tok = document_tokenizer(path, tokenizer, data_dir, val_fraction, num_proc, text_column, bpe_vocab_size)
    encode = functools.partial(encode_document, tokenizer_meta=json.dumps(tok.meta()), cache=str(data_dir))
    with staged_folder(folder) as staging:
        documents = tqdm(map_documents(path, encode, num_proc, text_column), desc=f"tokenizing {path.name}",
                         unit="doc", mininterval=1.0)
        counts, docs = write_splits(documents, staging, val_fraction)
        check_split_lengths(str(path), counts, block_size)  # streamed, so known only now: staging is dropped
        rule = ("document i is val when ceil((i+1)*val_fraction) > ceil(i*val_fraction); "
                f"{'a newline' if tokenizer == 'char' else '<|endoftext|>'} before each document")
        write_meta(staging, tok, str(path), val_fraction, counts, documents=sum(docs.values()),
                   val_documents=docs["val"], val_split=rule,
                   **({"text_column": text_column} if has_text_column(path) else {}))
    kind = {"gpt2": "GPT-2 BPE", "bpe": f"a {tok.vocab_size}-token BPE"}.get(tokenizer, f"{tok.vocab_size} characters")
    print(f"prepared {path}: {sum(docs.values()):,} documents, {counts['train']:,} train + {counts['val']:,} val "
          f"tokens ({docs['val']:,} val documents), {kind} -> {folder}")
    return folder
