"""Fine-tuning, imported only by a run that asks: the weights it starts from (--init_from: a run's, or GPT-2's from
Hugging Face), a chat corpus's rows and loss mask (from the ids alone: nothing stores it to drift), and LoRA."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from config import CheckpointError, DataError, HFError, TrainConfig, given_fields, model_config
from config import parse_lora_targets as parse_targets
from model import GPT, GPTConfig
from tokenizer import (ASSISTANT, BEGIN, ChatTokenizer, read_tokenizer, tokenizer_vocab_size, without_chat)


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
def adopt(cfg: TrainConfig, base: Pretrained) -> TrainConfig:
    """The config with the options and tokenizer ``base`` fixes (GPT-2's: IMPORTED); a differing given one: refused."""
    kept = ("vocab_size", "block_size", *GPTConfig.TRAINING_ONLY)  # the corpus's, the user's, how it is trained
    fixed = IMPORTED if base.gpt2 else [f.name for f in fields(GPTConfig) if f.name not in kept]
    imported = {name: getattr(base.config, name) for name in fixed}
    if base.tokenizer is not None:
        imported["tokenizer"] = base.tokenizer["kind"]
    if imported.get("tokenizer") == "bpe":  # its vocabulary too: a given other size is refused, not ignored
        imported["bpe_vocab_size"] = tokenizer_vocab_size(without_chat(base.tokenizer))
    given = given_fields(cfg)
    flag = lambda value: str(value).lower() if isinstance(value, bool) else str(value)  # noqa: E731 - false, not False
    for name, value in imported.items():
        if name in given and getattr(cfg, name) != value:
            raise HFError(f"--{name} {flag(getattr(cfg, name))} conflicts with {base.source}, whose weights have "
                          f"{name} {flag(value)}; drop --{name} (or that key from the preset): with --init_from "
                          "the weights fix the model")
    adopted = replace(cfg, **imported, block_size=cfg.block_size if "block_size" in given else base.config.block_size)
    if base.gpt2 and (refusals := gpt2_refusals(model_config(adopted, base.config.vocab_size))):
        raise HFError(f"{base.source} holds GPT-2 weights, which cannot run with {refusals[0]}; drop that option "
                      "or train from scratch without --init_from")
    return adopted


# ----------------------------------------------------------------------------- Hugging Face GPT-2: the mapping
# Used both ways (import here, export in scripts/export_hf.py). Beyond these tables the layouts differ in shape only:
# our vocabulary is padded to a multiple of 64, our position table may be cropped.
NAMES = (  # every weight of GPT-2, GPT2LMHeadModel's names; {i} is the block index
    "transformer.wte.weight",  # (V, C): V padded ours, the real vocabulary theirs; also lm_head (tied)
    "transformer.wpe.weight",  # (T, C): block_size rows ours, n_positions theirs
    *(f"transformer.h.{{i}}.{layer}.{kind}" for layer in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc",
                                                          "mlp.c_proj") for kind in ("weight", "bias")),
    "transformer.ln_f.weight", "transformer.ln_f.bias",
)
TRANSPOSED = (  # transformers' Conv1D (GPT-2's original TF code) computes x @ W, W (in, out)
    ".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
WTE, WPE, TIED_HEAD = "transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in GPT2Model's files
PREFIX = "transformer."  # GPT2LMHeadModel's keys have it, GPT2Model's (the hub's gpt2) do not

HUB_NAMES = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
HUB_PROBE_TIMEOUT = 5.0  # seconds the hub may take to answer one request before it counts as unreachable
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}  # theirs -> ours
LAYER_NORM_EPS = 1e-5  # GPT-2's epsilon, which is also nn.LayerNorm's default (model.py uses the default)
CONFIG_RULES = (  # config.json fields that change the computation: (name, GPT-2's default, what this model does)
    ("activation_function", "gelu_new", tuple(ACTIVATIONS)),
    ("layer_norm_epsilon", LAYER_NORM_EPS, (LAYER_NORM_EPS,)),
    ("n_inner", None, (None,)),  # null: the MLP is 4 * n_embd wide
    ("scale_attn_weights", True, (True,)),  # attention logits divided by sqrt(hs)
    ("scale_attn_by_inverse_layer_idx", False, (False,)),
    ("tie_word_embeddings", True, (True,)),
)
IMPORTED = ("n_layer", "n_head", "n_embd", "bias", "activation")  # the model options a GPT-2 file fixes
ANY = None  # in GPT2_OPTIONS: GPT-2's layout holds every value of this option
# Each model option -> the values GPT-2's layout computes. An option not listed (a fork's new one) is GPT-2's only at
# its default: export and --init_from refuse any other value by name, never drop it silently.
GPT2_OPTIONS = {"block_size": ANY, "n_layer": ANY, "n_head": ANY, "n_embd": ANY,  # block_size: n_positions
                "bias": ANY,  # bias-free models export zero biases
                "activation": ("gelu", "gelu_tanh")}  # activation_function gelu / gelu_new (see ACTIVATIONS)


def gpt2_refusals(config: GPTConfig) -> list[str]:
    """Every option of ``config`` GPT-2's layout cannot compute, as "name value (GPT-2: ...)"; [] if none."""
    refusals = []
    for option in fields(config):
        # A training-only option (dropout, z_loss) changes how the weights were trained, not what they compute.
        allowed = ANY if option.name in GPTConfig.TRAINING_ONLY else GPT2_OPTIONS.get(option.name, (option.default,))
        value = getattr(config, option.name)
        if option.name != "vocab_size" and allowed is not ANY and value not in allowed:
            refusals.append(f"{option.name} {value!r} (GPT-2 computes {' or '.join(map(repr, allowed))})")
    return refusals


def expand(n_layer: int) -> list[str]:
    """NAMES with {i} filled in for every block."""
    return [name.format(i=i) for name in NAMES for i in (range(n_layer) if "{i}" in name else [None])]


def is_transposed(name: str) -> bool:
    return name.endswith(TRANSPOSED)


def convert(name: str, value: torch.Tensor, vocab_rows: int, block_size: int) -> torch.Tensor:
    """One weight into the other layout, both ways: Conv1D transposed, wte's rows zero-padded or cut, wpe's cut."""
    if is_transposed(name):
        return value.t()  # (in, out) <-> (out, in)
    if name == WTE:  # (V, C)
        return torch.cat([value, value.new_zeros(max(vocab_rows - len(value), 0), value.shape[1])])[:vocab_rows]
    return value[:block_size] if name == WPE else value  # (T, C)


# ----------------------------------------------------------------------------- Hugging Face GPT-2: import
@dataclass
class Pretrained:
    """Weights a run starts from (--init_from), under our names: GPT-2's (load_pretrained) or a run's (load_run)."""
    config: GPTConfig  # what the weights compute; block_size: the position table's rows, once cropped
    state: dict[str, torch.Tensor]
    source: str  # the checkpoint file, or the weights as named
    tokenizer: dict | None  # its description; None where GPT-2's files do not say (the corpus's is taken)
    n_positions: int  # the position table's rows before cropping
    gpt2: bool = False  # GPT-2's: they fix its shape (IMPORTED); every other option must be one GPT-2 computes

    def weights_for(self, tokenizer_meta: dict, vocab_size: int) -> dict[str, torch.Tensor]:
        """The state dict for a corpus of the weights' tokenizer (plus a chat's markers, at the mean row)."""
        base = self.tokenizer or without_chat(tokenizer_meta)  # None: the files do not say; the corpus's, then
        base_vocab = tokenizer_vocab_size(base) or vocab_size
        if base_vocab != self.config.vocab_size:
            raise HFError(f"{self.source} has a vocabulary of {self.config.vocab_size}, the corpus {base_vocab} "
                          f"({base['kind']} tokenizer); use the weights' tokenizer")
        if without_chat(tokenizer_meta) != without_chat(base):  # text is prepared with the base's: tokens are not
            kinds = (f"another {base['kind']} vocabulary than the corpus's" if base["kind"] == tokenizer_meta["kind"]
                     else f"the {base['kind']} tokenizer, the corpus's is {tokenizer_meta['kind']}")
            raise HFError(f"{self.source} was trained with {kinds}; fine-tune on text, which --init_from prepares with "
                          "the base's tokenizer, or on tokens written with it")
        wte = self.state[WTE]  # (V_padded_base, C)
        new = convert(WTE, wte, GPTConfig(vocab_size=vocab_size).padded_vocab_size, 0)  # (V_padded, C), a copy
        new[base_vocab:vocab_size] = wte[:base_vocab].mean(dim=0)  # (V_new - V_base, C): the markers' rows
        return {**self.state, WTE: new, TIED_HEAD: new}


def check_positions(block_size: int, n_positions: int, source: str) -> int:
    """The block_size a model of ``n_positions`` positions is cropped to (0: all of them); more is refused."""
    if block_size > n_positions:
        raise HFError(f"block_size {block_size} exceeds the {n_positions} positions of {source}; use --block_size "
                      f"{n_positions} or less")
    return block_size or n_positions


def load_pretrained(source: str, block_size: int = 0, bias: bool = True) -> Pretrained:
    """Hugging Face GPT-2 weights (hub name, folder or .safetensors) under our names, every key and shape checked."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights, config_file = locate(source)
    try:
        raw = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        raise HFError(f"{weights}: not a readable .safetensors file ({str(err)[:160]})") from None
    tensors = {key if key.startswith(PREFIX) or key == TIED_HEAD else PREFIX + key: value.float()
               for key, value in raw.items()}  # GPT2LMHeadModel's names, in fp32
    shape = read_shape(config_file)  # block_size: the file's n_positions
    config = replace(shape, block_size=check_positions(block_size, shape.block_size, source), bias=bias)
    return Pretrained(config, to_ours(tensors, config, shape.block_size, source), source,
                      read_tokenizer(weights.parent, config.vocab_size), shape.block_size, gpt2=True)


def locate(source: str) -> tuple[Path, Path]:
    """(the .safetensors file, its config.json) of a folder, a file or a hub name (OWNER/NAME, never a typo'd path)."""
    path = Path(source)
    if path.is_dir():
        path = path / "model.safetensors"
        if not path.is_file():
            raise HFError(f"{path.parent}: neither a run's best.pt or last.pt nor a Hugging Face GPT-2 "
                          "model.safetensors in this folder")
    elif path.is_file() and path.suffix != ".safetensors":
        raise HFError(f"{path}: not a .safetensors file; pass one, a folder holding model.safetensors, "
                      f"or a hub name ({', '.join(HUB_NAMES)})")
    elif not path.is_file():
        if source in HUB_NAMES or (re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", source) and not Path(path.parts[0]).is_dir()
                                   and path.suffix not in (".pt", ".safetensors")):
            return download(HUB_NAMES.get(source, source))
        raise CheckpointError(f"init_from {source}: no such run folder or file; train that run first, or pass a run "
                              "folder (out/NAME), its .pt, a folder or .safetensors in the Hugging Face GPT-2 layout, "
                              f"or a hub name ({', '.join(HUB_NAMES)} or OWNER/NAME)")
    if not (path.parent / "config.json").is_file():
        raise HFError(f"{path}: no config.json beside it, which says the model's shape; put its config.json beside "
                      "the file")
    return path, path.parent / "config.json"


def download(repo_id: str) -> tuple[Path, Path]:
    """model.safetensors and config.json via huggingface_hub's cache; the cache alone if the hub does not answer."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError

    unreachable = None if constants.is_offline_mode() else hub_unreachable(repo_id)
    try:
        config, weights = (huggingface_hub.hf_hub_download(repo_id, name, local_files_only=bool(unreachable))
                           for name in ("config.json", "model.safetensors"))
    except (OSError, EntryNotFoundError) as err:  # offline, not cached, no such repo or file, HTTP errors
        reason = (f"cannot reach {constants.ENDPOINT}: {unreachable}" if unreachable else
                  f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:120]}")
        raise HFError(f"could not get {repo_id} from the Hugging Face hub ({reason}) nor from its cache, and there "
                      f"is no local folder or file of that name; where there is network run `hf download {repo_id} "
                      "model.safetensors config.json --local-dir DIR`, copy DIR here and pass --init_from DIR "
                      "(HF_HUB_OFFLINE=1 skips the hub when the files are in its cache)") from None
    return Path(weights), Path(config)


def hub_unreachable(repo_id: str) -> str | None:
    """Why the hub cannot be reached, or None if it answers: one request, where hf_hub_download retries ~25 s."""
    import httpx2  # huggingface_hub's HTTP client, installed with it
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"),
                             timeout=float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or HUB_PROBE_TIMEOUT))
    except httpx2.TransportError as err:  # no connection: refused, timed out, no DNS, proxy down
        return (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
    except HfHubHTTPError:  # the hub answered (a missing or gated repo): hf_hub_download says what
        return None


def read_shape(config_file: Path) -> GPTConfig:
    """The model config.json describes (block_size: n_positions), if GPT-2's code computes it as ours (CONFIG_RULES)."""
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise HFError(f"{config_file}: not readable JSON ({err})") from None
    if hf.get("model_type") != "gpt2":
        raise HFError(f"{config_file}: model_type {hf.get('model_type')!r}, not 'gpt2': only GPT-2's layout "
                      "maps onto this model")
    if hf.get("n_inner") == 4 * hf.get("n_embd", 0):  # the default MLP width, written out
        hf["n_inner"] = None
    for name, default, allowed in CONFIG_RULES:
        if hf.get(name, default) not in allowed:
            raise HFError(f"{config_file}: {name} is {hf.get(name, default)!r}; this model computes "
                          f"{' or '.join(map(repr, allowed))}")
    try:
        return GPTConfig(vocab_size=int(hf["vocab_size"]), block_size=int(hf["n_positions"]),
                         n_layer=int(hf["n_layer"]), n_head=int(hf["n_head"]), n_embd=int(hf["n_embd"]), bias=True,
                         activation=ACTIVATIONS[hf.get("activation_function", "gelu_new")])
    except KeyError as err:
        raise HFError(f"{config_file}: no {err.args[0]}") from None


def to_ours(tensors: dict[str, torch.Tensor], config: GPTConfig, n_positions: int,
            source: str) -> dict[str, torch.Tensor]:
    """Check every key and shape against ``config``, then transpose, pad and crop."""
    names = expand(config.n_layer)
    given = {key for key in tensors if not key.endswith(NOT_WEIGHTS) and key != TIED_HEAD}
    missing, unexpected = [name for name in names if name not in given], sorted(given - set(names))
    if missing or unexpected:
        raise HFError(f"{source}: missing key {missing[0]}" if missing else
                      f"{source}: unexpected key {unexpected[0]} for a {config.n_layer}-layer GPT-2")
    with torch.device("meta"):  # shapes only: no memory, no init time even for gpt2-xl
        expected = GPT(replace(config, block_size=n_positions, bias=True)).state_dict()
    state = {}
    for name in names:
        value, want = tensors[name], tuple(expected[name].shape)
        want = (config.vocab_size, want[1]) if name == WTE else want[::-1] if is_transposed(name) else want
        if tuple(value.shape) != want:  # the file's wte has the real vocabulary's rows, unpadded
            raise HFError(f"{source}: {name} has shape {tuple(value.shape)}, expected {want} from its config.json")
        if name.endswith(".bias") and not config.bias:
            if value.count_nonzero():
                raise HFError(f"{source}: {name} is not zero (max |b| {value.abs().max():.3g}) but the model has "
                              "bias=False; import with bias=True (drop --bias false)")
            continue  # an exported bias-free model: its zero biases carry nothing
        state[name] = convert(name, value, config.padded_vocab_size, config.block_size).contiguous()
    if TIED_HEAD in tensors and not torch.equal(tensors[TIED_HEAD], tensors[WTE]):
        raise HFError(f"{source}: {TIED_HEAD} differs from {WTE}; this model ties the two")
    return {**state, TIED_HEAD: state[WTE]}


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


def merge(model: GPT, in_place: bool = False) -> GPT:
    """A plain GPT computing what the adapted ``model`` does (each W + scale * B A), every weight trainable."""
    model = model if in_place else copy.deepcopy(model)
    for name, layer in adapters(model).items():
        parent, attr = name.rsplit(".", 1)
        with torch.no_grad():
            layer.base.weight += layer.scale * (layer.lora_B.weight @ layer.lora_A.weight)  # (out, r) @ (r, in)
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
