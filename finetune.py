"""Fine-tuning, imported only by a run that asks: a chat corpus's rows and loss mask, and LoRA.

A conversation's ids: <|begin|> <|system|> ... <|end|> <|user|> ... <|end|> <|assistant|> ... <|end|> ...
The mask follows from the ids alone (``learned``), so nothing stores it to drift: a token is a target when the last
marker before it is <|assistant|> (an assistant's text and its <|end|>); all else, padding too, is target -1.
"""
from __future__ import annotations

import copy
import hashlib
import math
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from config import CheckpointError, DataError
from config import parse_lora_targets as parse_targets
from model import GPT
from tokenizer import ASSISTANT, BEGIN, ChatTokenizer


def learned(tokens: np.ndarray, tokenizer: ChatTokenizer) -> np.ndarray:
    """(N,) bool: which tokens of a conversation are targets, those whose last marker before is <|assistant|>."""
    markers = np.array(sorted(tokenizer.marker_ids.values()))
    position = np.arange(len(tokens))
    last = np.maximum.accumulate(np.where(np.isin(tokens, markers), position, -1))  # last marker at or before
    before = np.concatenate([[-1], last[:-1]])  # the last marker strictly before each token
    return (before >= 0) & (tokens[np.maximum(before, 0)] == tokenizer.marker_ids[ASSISTANT])


def check_fit(lengths: np.ndarray, block_size: int, overflow: str, source: tuple[str, list[int]]) -> None:
    """Refuse (or, truncating, count once) the conversations longer than block_size + 1 tokens."""
    long, (path, lines) = np.flatnonzero(lengths > block_size + 1), source
    if len(long) and overflow == "refuse":
        where = f"{path}:{lines[long[0]]}" if len(lines) == len(lengths) else f"{path}, conversation {long[0]}"
        raise DataError(f"{where}: a conversation of {lengths[long[0]]} tokens ({len(long)} such in all) does not fit "
                        f"block_size + 1 = {block_size + 1}; pass --chat_overflow truncate to cut them there (their "
                        "tails are not learned), a larger --block_size, or shorten them")
    if len(long):
        print(f"{path}: {len(long)} of {len(lengths)} conversations cut at block_size + 1 = {block_size + 1} tokens")


def conversation_rows(rows: list[np.ndarray], tokenizer, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Conversations (each T_i + 1 tokens) -> inputs and targets, (B, width) each: a target is the next token where
    it is learned, else -1, as is the padding (inputs 0)."""
    x = torch.zeros(len(rows), width, dtype=torch.long)
    y = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        row = np.asarray(row, dtype=np.int64)
        x[i, : len(row) - 1] = torch.from_numpy(row[:-1])
        y[i, : len(row) - 1] = torch.from_numpy(np.where(learned(row, tokenizer)[1:], row[1:], -1))
    return x, y  # (B, width) each


def val_rows(corpus, tokenizer: ChatTokenizer, block_size: int, overflow: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A chat corpus's fixed val windows: one conversation a row, (N, block_size) each, padded and masked."""
    starts = np.flatnonzero(np.asarray(corpus.val) == tokenizer.marker_ids[BEGIN])
    ends = np.append(starts[1:], len(corpus.val))
    check_fit(ends - starts, block_size, overflow, (corpus.meta["source"], corpus.meta.get("lines", {}).get("val", [])))
    return conversation_rows([corpus.val[s: min(e, s + block_size + 1)] for s, e in zip(starts, ends)], tokenizer,
                             block_size)


# ----------------------------------------------------------------------------- LoRA
# Hu et al. 2021: the trained model frozen, a low-rank update B A trained beside some of its Linear layers
# (python train.py --init_from gpt2 --lora_rank 8). A checkpoint holds A and B, where the base came from and its
# fingerprint, never the base: a resume or a sample imports the base again and refuses one that differs.
ADAPTER_KEYS = (".lora_A.", ".lora_B.", ".lora_rows")  # what marks a trained weight in a state dict (A, B: PEFT's too)


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trained low-rank update: y = base(x) + alpha / rank * B(A(dropout(x))) (PEFT's)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base, self.rank, self.alpha = base, rank, alpha
        self.scale = alpha / rank  # the update's size does not grow with the rank (Hu et al., sec. 4.1)
        self.dropout = nn.Dropout(dropout)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)  # weight (rank, in)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)  # weight (out, rank)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init of A
        nn.init.zeros_(self.lora_B.weight)  # B A = 0: the base's outputs, exactly, until the first step

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., rank) -> (..., out)
        return self.base(x) + self.scale * self.lora_B(self.lora_A(self.dropout(x)))

    def delta(self) -> torch.Tensor:
        """The update as a matrix, scale * B A: (out, rank) @ (rank, in) -> (out, in), W's shape."""
        return self.scale * (self.lora_B.weight @ self.lora_A.weight)


class TrainedRows(nn.Module):
    """Rows of the frozen, tied wte / lm_head weight that train with the adapters: a chat fine-tune's new markers,
    which a frozen embedding would leave all alike. Lookups and logits both read the weight with these rows in it."""

    def __init__(self, embedding: nn.Embedding, head: nn.Linear, ids: list[int]):
        super().__init__()
        self.embedding = embedding  # frozen; embedding.weight is head.weight too
        object.__setattr__(self, "head", head)  # not a submodule: its weight is already the embedding's
        self.register_buffer("ids", torch.tensor(ids, dtype=torch.long, device=embedding.weight.device),
                             persistent=False)
        self.lora_rows = nn.Parameter(embedding.weight.detach()[self.ids].clone())  # (k, C): their start, unchanged

    def weight(self) -> torch.Tensor:
        return self.embedding.weight.index_copy(0, self.ids, self.lora_rows)  # (V_padded, C)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(idx, self.weight())  # (B, T) -> (B, T, C)


class TrainedRowsHead(nn.Module):
    """lm_head reading TrainedRows' weight: (B, T, C) -> (B, T, V_padded)."""

    def __init__(self, rows: TrainedRows):
        super().__init__()
        object.__setattr__(self, "rows", rows)  # registered once, under transformer.wte

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.rows.weight())


def add_adapters(model: GPT, rank: int, alpha: float, dropout: float, targets: str | tuple[str, ...],
                 rows: list[int] | tuple[int, ...] = ()) -> GPT:
    """Freeze ``model`` and wrap each target Linear of every block in a LoRALinear, in place; the embedding ``rows``
    train too. A's init draws from the global RNG: call it at the same point of start-up every time."""
    names = parse_targets(targets) if isinstance(targets, str) else targets
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.transformer.h:
        for name in names:
            parent, attr = block.get_submodule(name.split(".")[0]), name.split(".")[1]
            setattr(parent, attr, LoRALinear(getattr(parent, attr), rank, alpha, dropout))
    if rows:
        trained = TrainedRows(model.transformer.wte, model.lm_head, sorted(rows))
        model.transformer.wte, model.lm_head = trained, TrainedRowsHead(trained)
    return model


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    """Every adapted layer of ``model`` by its module name; {} for a plain GPT."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained weights only (what a LoRA checkpoint holds as "model")."""
    return {name: t for name, t in model.state_dict().items() if any(key in name for key in ADAPTER_KEYS)}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Copy saved adapters into an adapted model; CheckpointError unless the names match exactly."""
    if odd := sorted(adapter_state(model).keys() ^ state.keys()):
        raise CheckpointError(f"{where}: its adapters do not fit this model (first mismatch: {odd[0]}); the rank or "
                              "targets differ")
    model.load_state_dict(state, strict=False)  # strict=False: the base's weights are not in ``state``


def merge(model: GPT) -> GPT:
    """A plain GPT computing what the adapted ``model`` does (each W + scale * B A); ``model`` keeps its adapters."""
    return fold(copy.deepcopy(model))


def fold(model: GPT) -> GPT:
    """merge() in place; every weight trains again."""
    for name, layer in adapters(model).items():
        parent, attr = name.rsplit(".", 1)
        with torch.no_grad():
            layer.base.weight += layer.delta()  # (out, in)
        setattr(model.get_submodule(parent), attr, layer.base)
    if isinstance(model.transformer.wte, TrainedRows):
        rows = model.transformer.wte
        with torch.no_grad():
            rows.embedding.weight[rows.ids] = rows.lora_rows  # (k, C) into (V_padded, C): lm_head's too, tied
        model.transformer.wte, model.lm_head = rows.embedding, rows.head
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def base_fingerprint(model: nn.Module) -> str:
    """sha256 of the base weights (every parameter but the adapters, as fp32): the same for the plain base and for it
    adapted, on any device."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        if not any(key in f".{name}" for key in ADAPTER_KEYS):
            tensor = p.detach().to("cpu", torch.float32).contiguous()
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(memoryview(tensor.numpy()).cast("B"))
    return digest.hexdigest()


def record(model: GPT, base: str, fingerprint: str) -> dict[str, Any]:
    """What a LoRA checkpoint says beside its adapters: the base and its fingerprint, and the adapters' shape."""
    layers = list(adapters(model).values())
    targets = tuple(dict.fromkeys(name.split(".", 3)[3] for name in adapters(model)))  # "attn.c_attn", in order
    rows = model.transformer.wte.ids.tolist() if isinstance(model.transformer.wte, TrainedRows) else []
    return {"base": base, "fingerprint": fingerprint, "rank": layers[0].rank, "alpha": layers[0].alpha,
            "dropout": layers[0].dropout.p, "targets": list(targets), "rows": rows}


def check_base(saved: dict[str, Any], fingerprint: str, where: str) -> None:
    """Refuse adapters trained on another base than the one loaded now, in one line."""
    if saved["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"{where}: its LoRA adapters were trained on base {saved['base']} (fingerprint "
            f"{saved['fingerprint'][:12]}), but the base loaded now has fingerprint {fingerprint[:12]}: pass "
            f"--init_from {saved['base']} as it was then, or train new adapters in a new --out_dir")


def load_adapted(state: dict[str, Any], base_model: GPT, where: str = "checkpoint", merged: bool = True) -> GPT:
    """A LoRA checkpoint's adapters on ``base_model`` (checked by fingerprint), merged. Footgun: ``base_model`` is
    consumed, adapted and merged in place. ``merged=False``: the adapted model, whose numbers are training's exactly
    (W x + B A x rounds otherwise than (W + B A) x: in bf16 in the 5th digit of a val loss)."""
    saved = state["lora"]
    check_base(saved, base_fingerprint(base_model), where)
    adapted = add_adapters(base_model, saved["rank"], saved["alpha"], saved["dropout"], tuple(saved["targets"]),
                           saved.get("rows", ()))
    load_adapter_state(adapted, state["model"], where)
    return fold(adapted) if merged else adapted
