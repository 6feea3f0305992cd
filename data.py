"""Data: a corpus tokenized once into a folder by prepare.py, opened here memory-mapped and verified (``load_corpus``),
then read by the training stream (``LOADERS``; its ``state_dict()`` lets a resume continue it exactly) and by the
fixed validation windows (``val_windows``), so every eval scores the same tokens."""
import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cli import DataError
from prepare import open_verified
from tokenizer import document_separator


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
    """Open a prepared corpus, every file verified against its meta.json, memory-mapped; a damaged corpus, or one too
    short for block_size, is a one-line DataError."""
    meta, splits, fingerprints = open_verified(folder, block_size)
    return Corpus(folder, meta, splits["train"], splits["val"], fingerprints)


def corpus_for(cfg, base_tokenizer: dict | None = None, documents=None) -> Corpus:
    """The corpus a TrainConfig names, tokenized once into cfg.data_dir (prepare.py; conversations by finetune.py;
    documents by scripts/prepare.py's ``documents``), then opened."""
    from prepare import corpus_folder, is_conversations, source_path  # preparation: imported when a run needs it
    if (path := source_path(cfg)) is not None and is_conversations(path):
        from finetune import prepare_conversations  # chat code: imported by a chat run only
        folder = prepare_conversations(path, Path(cfg.data_dir), cfg.tokenizer, cfg.val_fraction, base_tokenizer,
                                       cfg.bpe_vocab_size)
    else:
        folder = corpus_folder(cfg, base_tokenizer, documents)
    return load_corpus(folder, cfg.block_size)


def get_batch(data: np.ndarray, batch_size: int, block_size: int, generator: torch.Generator,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows; targets are the inputs shifted left by one. Draws only from ``generator``."""
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)  # (B,)
    return inputs_and_targets([data[s: s + block_size + 1] for s in starts.tolist()], device)


def inputs_and_targets(rows: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """B rows of T + 1 tokens -> (x, y) on ``device``, y shifted left by one; to a GPU through pinned memory."""
    batch = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T + 1)
    x, y = batch[:, :-1], batch[:, 1:]  # (B, T) each: y[:, t] is the token after x[:, t]
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# ----------------------------------------------------------------------------- the training stream
class TrainingStream:
    """One rank's training batches: ``next()`` is one micro-batch (x, y), each (B, T) on the run's device;
    ``state_dict()`` is its place in the stream, so a resumed run draws exactly the batches the stopped one would.

    A loader is a subclass and one row of LOADERS. It draws only from its own generator, seeded ``seed``, and
    whatever of it changes as it draws is in its state_dict (tests/test_data.py checks every attribute).
    ``full_rows``: every batch is (batch_size, block_size), so a step's tokens are known before it runs."""
    full_rows = False

    def __init__(self, tokens: np.ndarray, cfg, seed: int, device: torch.device, separator: int | None):
        """``separator``: the id that begins each document (document_separator), None where there is none."""
        self.tokens, self.cfg, self.batch_size, self.block_size = tokens, cfg, cfg.batch_size, cfg.block_size
        self.seed, self.device, self.separator = seed, device, separator
        self.restart()

    def restart(self) -> None:
        """Go to the start of the stream: a generator seeded ``seed``, nothing drawn yet."""
        self.generator = torch.Generator().manual_seed(self.seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict:  # where the generator is; a loader that keeps more state saves that too
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    def first_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch a fresh stream of these settings draws first (the compile probe, the doctor), drawn by a copy:
        a probe that drew from this stream would shift every batch of the run."""
        fresh = copy.copy(self)  # shares the tokens and any index of them; restart gives it its own generator
        fresh.restart()
        return fresh.next()


class RandomWindows(TrainingStream):
    """Windows of T + 1 tokens at uniformly random offsets of the split, drawn independently (nanoGPT's
    get_batch): a row may begin anywhere, mid-document or mid-word, and run across documents."""
    full_rows = True

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(self.tokens, self.batch_size, self.block_size, self.generator, self.device)


class PackedDocuments(TrainingStream):
    """Rows that each begin at a document's separator (the BOS), filled with whole documents in an order reshuffled each
    epoch; the one that does not fit is cropped. nanochat's bos_bestfit without its best-fit search."""
    full_rows = True

    def __init__(self, tokens: np.ndarray, cfg, seed: int, device: torch.device, separator: int | None):
        self.starts = document_starts(tokens, separator)  # (D,): where each document begins
        if len(self.starts) < 2:  # one document would give every row its same first T + 1 tokens
            kind = "no document separator" if separator is None else f"separator id {separator}"
            raise DataError(f"holds {len(self.starts)} document start{'' if len(self.starts) == 1 else 's'} ({kind}), "
                            "and rows that begin at documents need two or more: prepare a folder of documents, a "
                            ".jsonl or a .parquet (docs/data.md)")
        self.ends = np.append(self.starts[1:], len(tokens))  # (D,): each ends where the next begins
        super().__init__(tokens, cfg, seed, device, separator)

    def restart(self) -> None:
        super().restart()
        self.begin_epoch(0)

    def begin_epoch(self, epoch: int) -> None:
        """Shuffle the documents for ``epoch``, keeping the generator's prior state so a resume draws the same order."""
        self.epoch, self.position = epoch, 0  # position: documents of this epoch's order already read
        self.epoch_state = self.generator.get_state()
        self.order = torch.randperm(len(self.starts), generator=self.generator).numpy()  # (D,)

    def next_document(self) -> np.ndarray:
        if self.position == len(self.order):
            self.begin_epoch(self.epoch + 1)
        doc = self.order[self.position]
        self.position += 1
        return self.tokens[self.starts[doc]: self.ends[doc]]

    def row(self) -> np.ndarray:
        """T + 1 tokens: whole documents while they fit, then the next one cropped to what is left."""
        pieces, room = [], self.block_size + 1
        while room > 0:
            pieces.append(self.next_document()[:room])
            room -= len(pieces[-1])
        return np.concatenate(pieces)  # (T + 1,)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs_and_targets([self.row() for _ in range(self.batch_size)], self.device)

    def state_dict(self) -> dict:
        return {"generator": self.epoch_state, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.begin_epoch(state["epoch"])  # draws this epoch's order again
        self.position = state["position"]


class Conversations(PackedDocuments):
    """One conversation a row, shuffled, padded to the batch's longest; the targets are the assistant's tokens only,
    -1 elsewhere. A chat corpus's stream whatever cfg.loader says; a conversation longer than block_size + 1 tokens
    is refused, or with cfg.chat_overflow="truncate" cut there."""
    full_rows = False  # padded to the batch's longest conversation

    def __init__(self, tokens: np.ndarray, cfg, seed: int, device: torch.device, tokenizer,
                 source: tuple[str, list[int]] = ("the train split", [])):
        """``source``: the file and the line of each conversation, for a refusal to name (meta.json's lines)."""
        from finetune import BEGIN, check_fit  # chat code: imported by a chat run only
        self.tokenizer = tokenizer
        super().__init__(tokens, cfg, seed, device, tokenizer.marker_ids[BEGIN])
        check_fit(tokens, self.starts, self.ends, tokenizer, cfg.block_size, cfg.chat_overflow, source)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        from finetune import conversation_rows
        rows = [self.next_document()[: self.block_size + 1] for _ in range(self.batch_size)]
        x, y = conversation_rows(rows, self.tokenizer, max(map(len, rows)) - 1)
        return x.to(self.device), y.to(self.device)


def eval_windows(corpus: Corpus, tokenizer, block_size: int, max_targets: int = 0,
                 overflow: str = "refuse") -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed val windows: val_windows over a text's tokens; for a chat corpus one conversation a row, block_size
    wide, scored on the assistant's tokens only (finetune.val_rows), ``max_targets`` > 0 rounded up to whole rows."""
    if is_chat(corpus):
        from finetune import val_rows
        x, y = val_rows(corpus, tokenizer, block_size, overflow)  # (N, block_size) each
        rows = int(torch.searchsorted((y >= 0).sum(1).cumsum(0), max_targets)) + 1 if max_targets > 0 else len(x)
        return x[:rows], y[:rows]
    return val_windows(corpus.val, block_size, max_targets)


def is_chat(corpus: Corpus) -> bool:
    """A prepared corpus of conversations (finetune.prepare_conversations), not of text."""
    return corpus.meta.get("format") == "conversations"


def document_starts(tokens: np.ndarray, separator: int | None, chunk: int = 1 << 24) -> np.ndarray:
    """Offsets (D,) of every ``separator`` in ``tokens``, read a chunk at a time: no mask as large as the split."""
    if separator is None:
        return np.zeros(0, dtype=np.int64)
    found = [start + np.flatnonzero(tokens[start: start + chunk] == separator)
             for start in range(0, len(tokens), chunk)]
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, dtype=np.int64)


# How training batches are drawn: TrainConfig.loader names a row (its allowed values are these names).
LOADERS: dict[str, type[TrainingStream]] = {"random_windows": RandomWindows, "bos_packed": PackedDocuments}


def training_stream(cfg, corpus: Corpus, tokenizer, rank: int, device: torch.device) -> TrainingStream:
    """The loader cfg.loader names, over the train split, seeded cfg.seed + rank: each DDP rank its own batches.
    A corpus the loader cannot read is a one-line DataError naming the file and the fix."""
    if is_chat(corpus):
        source = corpus.meta["source"], corpus.meta.get("lines", {}).get("train", [])  # for a refusal to name
        return Conversations(corpus.train, cfg, cfg.seed + rank, device, tokenizer, source)
    try:
        return LOADERS[cfg.loader](corpus.train, cfg, cfg.seed + rank, device, document_separator(tokenizer))
    except DataError as err:
        others = " or ".join(f"--loader {name}" for name in LOADERS if name != cfg.loader)
        raise DataError(f"{corpus.folder / 'train.bin'} {err}, or train with {others} instead of --loader "
                        f"{cfg.loader}") from None


def val_windows(data: np.ndarray, block_size: int, max_targets: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed, non-overlapping windows covering every val target exactly once, the last padded (targets -1), so the
    token-weighted mean over the windows is the split's. ``max_targets`` > 0 keeps only the first that many."""
    n_targets = len(data) - 1 if max_targets <= 0 else min(max_targets, len(data) - 1)
    n_windows = -(-n_targets // block_size)  # ceil
    tokens = torch.from_numpy(np.asarray(data[: n_targets + 1]).astype(np.int64))  # (n_targets + 1,)
    x = torch.zeros(n_windows * block_size, dtype=torch.long)
    y = torch.full((n_windows * block_size,), -1, dtype=torch.long)
    x[:n_targets], y[:n_targets] = tokens[:-1], tokens[1:]
    return x.view(n_windows, block_size), y.view(n_windows, block_size)  # (N, T) each
