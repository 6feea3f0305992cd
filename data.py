"""Data: a corpus tokenized once, its tokenizer, and the batches a training step draws.

    python data.py                      # prepare the built-in Shakespeare corpus (cached in data/)
    python data.py --data_path my.txt   # prepare any UTF-8 text file, folder, .jsonl or .parquet (--help)

Preparing (``corpus_for``) turns a corpus into a folder, once, cached in data_dir: ``train.bin`` and
``val.bin`` (flat token ids) and ``meta.json`` (the tokenizer and how the files were made). The
machinery for that (the built-in corpus's download, document formats, worker pools, staging, the
checks) is machinery/corpora.py and machinery/tokenfiles.py, a second read. What a step touches is
here: the splits, memory-mapped (``load_corpus``); random training windows drawn from their own
``torch.Generator`` (``get_batch``); fixed validation windows, so every eval scores the same tokens
(``val_windows``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from machinery.tokenfiles import DataError, open_verified


def read_text_file(path: Path, flag: str = "--data_path") -> str:
    """The file's text; errors name ``flag``, the option the user gave the path with."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass an existing UTF-8 text file with {flag}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


class CharTokenizer:
    """One id per character, the vocabulary being the sorted set of characters of the corpus."""

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.eot_token = self.stoi.get("\n", 0)  # a newline is the natural "start" of char text
        self.special_ids = frozenset()  # every id is a character of text

    def encode(self, text: str) -> list[int]:
        missing = sorted(set(text) - self.stoi.keys())
        if missing:
            raise DataError(f"characters not in the model's vocabulary: {''.join(missing)!r}")
        return [self.stoi[ch] for ch in text]

    def encode_array(self, text: str) -> np.ndarray:
        """Fast vectorised encode for whole corpora."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # sorted, since chars is
        ids = np.searchsorted(table, codes)
        if len(codes) and (ids.max() >= len(table) or not np.array_equal(table[ids], codes)):
            return np.array(self.encode(text), dtype=np.int64)  # raises with the missing chars
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def decode_bytes(self, ids: list[int]) -> bytes:
        """UTF-8 bytes of decode(ids); every tokenizer has this, so streaming code needs one path."""
        return self.decode(ids).encode("utf-8")

    def meta(self) -> dict:
        return {"kind": "char", "chars": self.chars}


def special_tokens(tokenizer) -> set[int]:
    """Ids that mark structure rather than text: GPT-2's <|endoftext|> (a char vocabulary has none)."""
    return set(tokenizer.special_ids)


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """UTF-8 bytes each id decodes to, (vocab_size,) int64: the denominator of bits per byte.

    Special tokens (GPT-2's <|endoftext|>) count 0 bytes: they mark where documents meet and are no
    text, so bits per byte measures the corpus's own bytes (their cost stays in the numerator).
    Built once per run, not per eval: 50257 lookups for GPT-2.
    """
    special = special_tokens(tokenizer)
    return torch.tensor([0 if i in special else len(tokenizer.decode_bytes([i]))
                         for i in range(tokenizer.vocab_size)], dtype=torch.long)


def tokenizer_from_meta(meta: dict, cache: Path = Path("data")):
    """Rebuild the tokenizer a corpus or checkpoint was made with."""
    if meta["kind"] == "char":
        return CharTokenizer(meta["chars"])
    if meta["kind"] in ("gpt2", "bpe"):
        from machinery.tokenizers import BPETokenizer, GPT2Tokenizer  # tiktoken: only runs that use it

        return GPT2Tokenizer(cache) if meta["kind"] == "gpt2" else BPETokenizer(meta)
    raise DataError(f"unknown tokenizer kind {meta['kind']!r}")


@dataclass
class Corpus:
    """A prepared corpus: memory-mapped splits plus the tokenizer that made them."""
    folder: Path
    meta: dict
    train: np.memmap
    val: np.memmap
    fingerprint: dict[str, str]  # split -> split_fingerprint of its file, verified against meta.json

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    def record(self) -> dict:
        """What a checkpoint keeps of the data it trained on, so that a resume on other data is refused."""
        return {"source": self.meta.get("source", str(self.folder)), "val_fraction": self.meta["val_fraction"],
                "fingerprint": dict(self.fingerprint)}


def load_corpus(folder: Path, block_size: int) -> Corpus:
    """Open a prepared corpus, every file verified against its meta.json (machinery/tokenfiles.py), and
    check it can feed a model with this context length: a damaged corpus is a one-line DataError, never
    a run. The splits are memory-mapped: a window reads only its own tokens."""
    meta, splits, fingerprints = open_verified(folder, block_size)
    return Corpus(folder, meta, splits["train"], splits["val"], fingerprints)


def corpus_for(cfg) -> Corpus:
    """The corpus a TrainConfig names, tokenized once into cfg.data_dir (cached), then opened."""
    from machinery.corpora import prepare  # downloads, formats, worker pools: imported when a run needs them

    folder = prepare(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction,
                     block_size=cfg.block_size, text_column=cfg.text_column, bpe_vocab_size=cfg.bpe_vocab_size)
    return load_corpus(folder, cfg.block_size)


def get_batch(data: np.ndarray, batch_size: int, block_size: int, generator: torch.Generator,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows; targets are the inputs shifted left by one. Draws only from ``generator``."""
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)  # (B,)
    windows = np.stack([data[s: s + block_size + 1] for s in starts.tolist()]).astype(np.int64)
    windows = torch.from_numpy(windows)  # (B, T + 1)
    x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each: y[:, t] is the token after x[:, t]
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def val_windows(data: np.ndarray, block_size: int, max_targets: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed, non-overlapping windows covering every val target exactly once.

    The last window is padded (inputs with 0, targets with -1, which the loss ignores), so the
    token-weighted mean over all windows is the mean over the split. ``max_targets`` > 0 keeps
    only the first that many targets.
    """
    n_targets = len(data) - 1 if max_targets <= 0 else min(max_targets, len(data) - 1)
    n_windows = -(-n_targets // block_size)  # ceil
    tokens = torch.from_numpy(np.asarray(data[: n_targets + 1]).astype(np.int64))  # (n_targets + 1,)
    x = torch.zeros(n_windows * block_size, dtype=torch.long)
    y = torch.full((n_windows * block_size,), -1, dtype=torch.long)
    x[:n_targets] = tokens[:-1]
    y[:n_targets] = tokens[1:]
    return x.view(n_windows, block_size), y.view(n_windows, block_size)  # (N, T) each


def iterate_windows(x: torch.Tensor, y: torch.Tensor, batch_size: int,
                    device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for i in range(0, len(x), batch_size):
        yield x[i: i + batch_size].to(device), y[i: i + batch_size].to(device)


def main(argv: list[str] | None = None) -> None:
    """python data.py: prepare a corpus without training (the command line of machinery/corpora.py)."""
    from machinery.corpora import main as prepare_command

    prepare_command(argv)


if __name__ == "__main__":
    main()
