"""A text corpus (a .txt file, or the built-in text) tokenized a piece at a time into train.bin and val.bin.

    python -m prepare --data_path my.txt                  # char or gpt2: val is the last 10% of the tokens
    python -m prepare --data_path my.txt --tokenizer bpe  # a BPE trained here: val is the last 10% of the characters

A text is read and tokenized ``CHUNK_CHARS`` characters at a time, each piece ending at a newline: memory is
bounded whatever its size. Its val split is its tail, by one of two rules, which cannot be one without changing
the tokens: char and gpt2 tokenize the whole text and cut its tokens; a BPE trained here needs the cut before
any token exists (its merges are learnt from the train part alone), so it cuts the characters, then tokenizes
each part on its own. For char the two agree.
"""
from __future__ import annotations

import codecs
import functools
import io
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Literal

from tqdm import tqdm

from prepare.staging import staged_folder
from prepare.tokenfiles import check_split_lengths, token_dtype, write_meta
from prepare.tokenizers import CharTokenizer, GPT2Tokenizer, train_bpe
from process.errors import DataError

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
