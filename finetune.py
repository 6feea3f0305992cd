"""Fine-tuning, imported only by a run that asks: the weights it starts from (--init_from: a run's; GPT-2's become one
with scripts/import_hf.py), a chat corpus (prepared from its .jsonl; rows and loss mask from the ids alone), LoRA."""
import copy
import hashlib
import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from cli import CheckpointError, DataError, HFError
from config import TrainConfig, given_fields, parse_lora_targets as parse_targets
from model import GPT, GPTConfig
from prepare import SPLITS, is_val, jsonl_lines, new_tokenizer, token_dtype, tokenizer_label, write_meta, write_splits
from runtime import sha256_of, staged_folder
from tokenizer import (ASSISTANT, BEGIN, ROLES, ChatTokenizer, Message, chat_tokenizer, render, tokenizer_from_meta,
                       tokenizer_vocab_size, without_chat)


def learned(tokens: np.ndarray, tokenizer: ChatTokenizer) -> np.ndarray:
    """(N,) bool: which tokens of a conversation are targets, those whose last marker before is <|assistant|>."""
    markers = np.array(sorted(tokenizer.marker_ids.values()))
    position = np.arange(len(tokens))
    last = np.maximum.accumulate(np.where(np.isin(tokens, markers), position, -1))  # last marker at or before
    before = np.concatenate([[-1], last[:-1]])  # the last marker strictly before each token
    return (before >= 0) & (tokens[np.maximum(before, 0)] == tokenizer.marker_ids[ASSISTANT])


def check_fit(tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray, tokenizer: ChatTokenizer, block_size: int,
              overflow: str, source: tuple[str, list[int]]) -> None:
    """Refuse (or, truncating, count once) conversations over block_size + 1 tokens, and any the cut leaves with no
    target (a step or val of such scores 0 / 0: a NaN loss)."""
    lengths, (path, lines) = ends - starts, source
    long = np.flatnonzero(lengths > block_size + 1)
    where = lambda i: f"{path}:{lines[i]}" if len(lines) == len(lengths) else f"{path}, conversation {i}"  # noqa: E731
    if len(long) and overflow == "refuse":
        raise DataError(f"{where(long[0])}: a conversation of {lengths[long[0]]} tokens ({len(long)} such in all) does "
                        f"not fit block_size + 1 = {block_size + 1}; pass --chat_overflow truncate to cut them there "
                        "(their tails are not learned), a larger --block_size (with --init_from, up to its "
                        "positions), or shorten them")
    cut = (np.asarray(tokens[starts[i]: starts[i] + block_size + 1]) for i in long)  # rows as training cuts them
    if empty := [i for i, row in zip(long, cut) if not learned(row, tokenizer)[1:].any()]:
        raise DataError(f"{where(empty[0])}: cut at block_size + 1 = {block_size + 1} tokens, a conversation "
                        f"({len(empty)} such in all) keeps no assistant token to learn; pass a larger --block_size, "
                        "or shorten what comes before its first reply")
    if len(long):
        print(f"{path}: {len(long)} of {len(lengths)} conversations cut at block_size + 1 = {block_size + 1} tokens")


def conversation_rows(rows: list[np.ndarray], tokenizer, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Conversations (each T_i + 1 tokens) -> inputs and targets, (B, width) each; unlearned targets and padding -1."""
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
    check_fit(corpus.val, starts, ends, tokenizer, block_size, overflow,
              (corpus.meta["source"], corpus.meta.get("lines", {}).get("val", [])))
    return conversation_rows([corpus.val[s: min(e, s + block_size + 1)] for s, e in zip(starts, ends)], tokenizer,
                             block_size)


# ----------------------------------------------------------------------------- what a base fixes of the run
def adopt(cfg: TrainConfig, base: "Pretrained") -> TrainConfig:
    """The config with the options and tokenizer ``base`` fixes; a differing given one: refused."""
    kept = ("vocab_size", "block_size", *GPTConfig.TRAINING_ONLY)  # the corpus's, the user's, how it is trained
    fixed = [f.name for f in fields(GPTConfig) if f.name not in kept]
    imported = {name: getattr(base.config, name) for name in fixed} | {"tokenizer": base.tokenizer["kind"]}
    if imported.get("tokenizer") == "bpe":  # its vocabulary too: a given other size is refused, not ignored
        imported["bpe_vocab_size"] = tokenizer_vocab_size(without_chat(base.tokenizer))
    given = given_fields(cfg)
    flag = lambda value: str(value).lower() if isinstance(value, bool) else str(value)  # noqa: E731 - false, not False
    for name, value in imported.items():
        if name in given and getattr(cfg, name) != value:
            raise HFError(f"--{name} {flag(getattr(cfg, name))} conflicts with {base.source}, whose weights have "
                          f"{name} {flag(value)}; drop --{name} (or that key from the preset): with --init_from "
                          "the weights fix the model")
    return replace(cfg, **imported, block_size=cfg.block_size if "block_size" in given else base.config.block_size)


# ----------------------------------------------------------------------------- the weights a run starts from
# Our weights have GPT-2's names (scripts/import_hf.py brings GPT-2's own in, as a run folder).
WTE, WPE, TIED_HEAD = "transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"


def pad_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """(V, C) -> (rows, C), a copy: zero rows added, or the last cut (the export's unpadded vocabulary)."""
    return torch.cat([table, table.new_zeros(max(rows - len(table), 0), table.shape[1])])[:rows]


@dataclass
class Pretrained:
    """The weights a run starts from (--init_from): a run's (checkpoint.load_run), which fix every model option."""
    config: GPTConfig  # what the weights compute; block_size: the position table's rows, once cropped
    state: dict[str, torch.Tensor]
    source: str  # the checkpoint file
    tokenizer: dict  # its description
    n_positions: int  # the position table's rows before cropping

    def weights_for(self, tokenizer_meta: dict, vocab_size: int) -> dict[str, torch.Tensor]:
        """The state dict for a corpus of the weights' tokenizer (plus a chat's markers, at the mean row)."""
        base, base_vocab = self.tokenizer, self.config.vocab_size  # a run's model is built from its tokenizer's
        if without_chat(tokenizer_meta) != without_chat(base):  # text is prepared with the base's: tokens are not
            kinds = (f"another {base['kind']} vocabulary than the corpus's" if base["kind"] == tokenizer_meta["kind"]
                     else f"the {base['kind']} tokenizer, the corpus's is {tokenizer_meta['kind']}")
            raise HFError(f"{self.source} was trained with {kinds}; fine-tune on text, which --init_from prepares with "
                          "the base's tokenizer, or on tokens written with it")
        wte = self.state[WTE]  # (V_padded_base, C)
        new = pad_rows(wte, GPTConfig(vocab_size=vocab_size).padded_vocab_size)  # (V_padded, C)
        new[base_vocab:vocab_size] = wte[:base_vocab].mean(dim=0)  # (V_new - V_base, C): the markers' rows
        return {**self.state, WTE: new, TIED_HEAD: new}


# ----------------------------------------------------------------------------- a chat corpus, prepared once
def parse_line(text: str, where: str) -> list[Message]:
    """One line's conversation, or a DataError naming ``where`` (file:line) and what is wrong."""
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as err:  # RecursionError: JSON nested thousands deep
        raise DataError(f"{where}: not JSON ({err})") from None
    if isinstance(record, dict) and "prompt" in record:  # else a message never written, or "messages" dropped
        if "completion" not in record or "messages" in record:
            raise DataError(f'{where}: a "prompt" needs its "completion" (the reply to learn) and no "messages" beside')
        record = {"messages": [{"role": "user", "content": record["prompt"]},
                               {"role": "assistant", "content": record.get("completion")}]}
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise DataError(f"{where}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} or "
                        '{"prompt": ..., "completion": ...}')
    messages = []
    for i, message in enumerate(record["messages"]):
        if not isinstance(message, dict) or "role" not in message:
            raise DataError(f"{where}: message {i} has no role (each is {{\"role\": ..., \"content\": ...}})")
        role, content = message["role"], message.get("content")
        if not isinstance(role, str) or role not in ROLES:  # a list is unhashable: not a role either
            raise DataError(f"{where}: message {i} has role {role!r}; use one of {', '.join(ROLES)}")
        if message.get("weight", 1) != 1:  # OpenAI's "weight": 0 (not learned): here the markers alone say what is
            raise DataError(f"{where}: message {i} has weight {message['weight']!r}: all replies are learned here")
        if role == "system" and i:
            raise DataError(f"{where}: message {i} is a system message; only the first may be")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {i} ({role}) has content {type(content).__name__}, not a string")
        if role == "assistant" and not content:
            raise DataError(f"{where}: message {i} is an empty assistant turn; it would teach the model to say nothing")
        messages.append((role, content))
    if not any(role == "assistant" for role, _ in messages):
        raise DataError(f"{where}: no assistant turn, so nothing to learn; give each conversation one or more")
    return messages


def split_indices(n: int, val_fraction: float) -> dict[str, list[int]]:
    """The indices of n conversations in each split, by the documents' rule (is_val)."""
    return {split: [i for i in range(n) if is_val(i, val_fraction) == (split == "val")] for split in SPLITS}


def prepare_conversations(path: Path, data_dir: Path, tokenizer: str, val_fraction: float,
                          base_meta: dict | None = None, bpe_vocab_size: int = 2048) -> Path:
    """Tokenize a .jsonl of conversations once into data_dir, with ``base_meta`` (a fine-tuned model's tokenizer) or a
    ``tokenizer`` made here; every line is checked before anything is written."""
    numbered = [(number, parse_line(text, f"{path}:{number}")) for number, text in jsonl_lines(path)]
    splits = split_indices(len(numbered), val_fraction)
    if not splits["val"] or not splits["train"]:
        raise DataError(f"{path}: {len(numbered)} conversation(s) cannot make both splits at val_fraction "
                        f"{val_fraction}; add conversations or change --val_fraction")
    texts = (text for _, turns in numbered for _, text in turns)
    train_texts = [text for i in splits["train"] for _, text in numbered[i][1]]
    tok = chat_tokenizer(tokenizer_from_meta(base_meta, data_dir) if base_meta is not None
                         else new_tokenizer(tokenizer, texts, train_texts, data_dir, bpe_vocab_size, str(path)))
    folder = data_dir / f"{path.stem}-{sha256_of(path)[:12]}-{tokenizer_label(tok.meta())}-val{val_fraction!r}"
    if (folder / "meta.json").is_file():
        return folder
    encoded = []
    for line, conversation in numbered:
        try:
            encoded.append(np.array(render(tok, conversation), dtype=token_dtype(tok.vocab_size)))
        except DataError as err:
            raise DataError(f"{path}:{line}: {err}; the base model's tokenizer cannot write it") from None
    with staged_folder(folder) as staging:
        counts, _ = write_splits(encoded, staging, val_fraction)
        write_meta(staging, tok, str(path), val_fraction, counts, format="conversations",
                   lines={split: [numbered[i][0] for i in indices] for split, indices in splits.items()},
                   val_split="conversation i is val when ceil((i+1)*val_fraction) > ceil(i*val_fraction)")
    print(f"prepared {path}: {len(splits['train']):,} train + {len(splits['val']):,} val conversations, "
          f"{counts['train']:,} + {counts['val']:,} tokens -> {folder}")
    return folder


# ----------------------------------------------------------------------------- LoRA
# Hu et al. 2021: the model frozen, a low-rank update B A trained beside some Linear layers. A checkpoint holds A, B
# and the base's source and fingerprint, never the base: a resume or a sample imports it again, refusing another.
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


class TrainedRows(nn.Module):
    """Trained rows of the frozen, tied wte / lm_head: a chat's new markers, which frozen would stay all alike."""

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
    model.requires_grad_(False)
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


@torch.no_grad()  # weights written in place: nothing here is to be differentiated
def merge(model: GPT, in_place: bool = False) -> GPT:
    """A plain GPT computing what the adapted ``model`` does (each W + scale * B A), every weight trainable."""
    model = model if in_place else copy.deepcopy(model)
    for name, layer in adapters(model).items():
        parent, attr = name.rsplit(".", 1)
        layer.base.weight += layer.scale * (layer.lora_B.weight @ layer.lora_A.weight)  # (out, r) @ (r, in)
        setattr(model.get_submodule(parent), attr, layer.base)
    if isinstance(rows := model.transformer.wte, TrainedRows):
        rows.embedding.weight[rows.ids] = rows.lora_rows  # (k, C) into (V_padded, C): lm_head's too, tied
        model.transformer.wte, model.lm_head = rows.embedding, rows.head
    return model.requires_grad_(True)


def base_fingerprint(model: nn.Module) -> str:
    """sha256 of the base weights as fp32: the same for the plain base and for it adapted, on any device."""
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
            f"{saved['fingerprint'][:12]}), but the base loaded now has fingerprint {fingerprint[:12]}: adapters fit "
            f"only those weights; restore them at {saved['base']} (a resume may pass them with --init_from), or "
            "train new adapters in a new --out_dir")


def load_adapted(state: dict[str, Any], base_model: GPT, where: str = "checkpoint", merged: bool = True) -> GPT:
    """A LoRA checkpoint's adapters on ``base_model`` (checked by fingerprint), merged in place (a footgun); unmerged,
    the numbers are training's exactly (W x + B A x rounds otherwise than (W + B A) x)."""
    saved = state["lora"]
    check_base(saved, base_fingerprint(base_model), where)
    adapted = add_adapters(base_model, saved["rank"], saved["alpha"], saved["dropout"], tuple(saved["targets"]),
                           saved.get("rows", ()))
    load_adapter_state(adapted, state["model"], where)
    return merge(adapted, in_place=True) if merged else adapted
