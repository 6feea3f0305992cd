"""A tokenized corpus on disk: ``train.bin`` and ``val.bin`` (flat token ids, uint16 or uint32) and ``meta.json``.

meta.json says what the ids mean (tokenizer, vocab_size, dtype) and, for a corpus this repo prepared, how the
files were made, their token counts and fingerprints. A folder that anyone's script wrote, with a small meta.json
(dtype, vocab_size, tokenizer), is one too: its counts come from the files (docs/data.md). Every open checks the
files against meta.json (``open_verified``, called by data.load_corpus): a damaged corpus is refused, never
trained on. ``is_val`` is the one rule that puts a document or a conversation in the val split.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

from process.errors import DataError

SPLITS = ("train", "val")
TOKENIZED_FILES = ("train.bin", "val.bin", "meta.json")  # any prepare.py's output, nanoGPT's layout
PREPARED_ONLY = ("train_tokens", "val_tokens", "val_fraction", "fingerprint")  # meta.json keys only ours write
TOKEN_DTYPES = ("uint16", "uint32")
FULL_SCAN_TOKENS = 200_000_000  # splits up to this size are checked id by id on every start
SPOT_CHECK = 10_000_000  # tokens checked at each end of larger splits
# What a prepared corpus's meta.json must hold, and of which type, for its files to be checked against it.
META_TYPES = {"tokenizer": dict, "vocab_size": int, "dtype": str, "val_fraction": (int, float),
              "train_tokens": int, "val_tokens": int, "fingerprint": dict}


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
    # were made by prepare() with the same tokenizer, so their ends are spot-checked only.
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
