"""Hugging Face GPT-2 in and out: start from pretrained weights, hand a trained model to transformers.

    python train.py --config finetune_shakespeare           # fine-tune GPT-2 (init_from = "gpt2")
    python sample.py --init_from gpt2 --prompt "Hello"       # sample GPT-2 itself, no checkpoint
    python -m scripts.export_hf out/finetune_shakespeare hf/shakespeare   # a folder transformers loads

The whole mapping is the table NAMES below, read top to bottom and used in both directions. Our
parameter names are GPT-2's, so names map one to one; what differs is data: Hugging Face's GPT-2
stores its four big matrices in Conv1D layers, (in, out), where nn.Linear has (out, in)
(TRANSPOSED); our vocabulary is padded to a multiple of 64 (model.GPTConfig.padded_vocab_size);
our position table may be shorter than GPT-2's 1024 (cropped on import). Older files also carry
the causal-mask buffers ``attn.bias`` / ``attn.masked_bias``, which are not weights (NOT_WEIGHTS),
and ``lm_head.weight``, which is tied to ``wte`` (TIED_HEAD). Everything is checked before a weight
is copied or a file written: a key or shape that does not fit raises HFError naming it.

Weights come as a hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl, or any "owner/name"), fetched
by huggingface_hub into its cache (HF_HOME, HF_HUB_OFFLINE apply), or a local folder holding
model.safetensors (+ config.json), or a bare .safetensors file. A bare file's n_head comes from a
config.json beside it or, for the four GPT-2 sizes, from KNOWN_HEADS. transformers is never
imported here; huggingface_hub only when a hub name is used. The tokenizer's files in such a folder
(vocab.json and merges.txt, or our char list) are prepare/tokenizers.py's: tokenizer_files, read_tokenizer.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from prepare import chat
from training.checkpoint import read_config
from config import TrainConfig, config_from_dict, given_fields, model_config
from process.distributed import print0
from process.errors import HFError
from process.files import atomic_write, atomic_write_text
from prepare.tokenizers import CHARS_FILE, read_tokenizer, tokenizer_files, tokenizer_vocab_size, without_chat
from model import GPT, GPTConfig, describe

# ----------------------------------------------------------------------------- the mapping
# (our name, Hugging Face GPT2LMHeadModel name); {i} is the block index. In forward order.
NAMES = (
    ("transformer.wte.weight", "transformer.wte.weight"),  # (V, C); also our lm_head (tied)
    ("transformer.wpe.weight", "transformer.wpe.weight"),  # (block_size, C) ours, (n_positions, C) theirs
    ("transformer.h.{i}.ln_1.weight", "transformer.h.{i}.ln_1.weight"),
    ("transformer.h.{i}.ln_1.bias", "transformer.h.{i}.ln_1.bias"),
    ("transformer.h.{i}.attn.c_attn.weight", "transformer.h.{i}.attn.c_attn.weight"),  # q, k, v side by side
    ("transformer.h.{i}.attn.c_attn.bias", "transformer.h.{i}.attn.c_attn.bias"),
    ("transformer.h.{i}.attn.c_proj.weight", "transformer.h.{i}.attn.c_proj.weight"),
    ("transformer.h.{i}.attn.c_proj.bias", "transformer.h.{i}.attn.c_proj.bias"),
    ("transformer.h.{i}.ln_2.weight", "transformer.h.{i}.ln_2.weight"),
    ("transformer.h.{i}.ln_2.bias", "transformer.h.{i}.ln_2.bias"),
    ("transformer.h.{i}.mlp.c_fc.weight", "transformer.h.{i}.mlp.c_fc.weight"),
    ("transformer.h.{i}.mlp.c_fc.bias", "transformer.h.{i}.mlp.c_fc.bias"),
    ("transformer.h.{i}.mlp.c_proj.weight", "transformer.h.{i}.mlp.c_proj.weight"),
    ("transformer.h.{i}.mlp.c_proj.bias", "transformer.h.{i}.mlp.c_proj.bias"),
    ("transformer.ln_f.weight", "transformer.ln_f.weight"),
    ("transformer.ln_f.bias", "transformer.ln_f.bias"),
)
# Conv1D (Radford et al.'s original TF code, kept by transformers) computes x @ W with W (in, out).
TRANSPOSED = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers saved by older transformers
TIED_HEAD = "lm_head.weight"  # equal to wte.weight; may be absent (safetensors cannot store a shared tensor)
PREFIX = "transformer."  # GPT2LMHeadModel's files have it, GPT2Model's (the original hub gpt2) do not

HUB_NAMES = {"gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
             "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl"}
HUB_PROBE_TIMEOUT = 5.0  # seconds the hub may take to answer one request before it counts as unreachable
KNOWN_HEADS = {(12, 768): 12, (24, 1024): 16, (36, 1280): 20, (48, 1600): 25}  # (n_layer, n_embd) -> n_head
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
ANY = None  # in GPT2_OPTIONS: the GPT-2 layout holds every value of this option (as it does every training-only one)
# Each model option (model.GPTConfig) -> the values GPT-2's layout computes. An option not listed (a
# fork's new one) is GPT-2's only at its default: export and --init_from refuse any other value by
# name, so a variant is never passed off as GPT-2 nor silently dropped on import.
GPT2_OPTIONS = {
    "block_size": ANY,  # n_positions
    "n_layer": ANY, "n_head": ANY, "n_embd": ANY,
    "bias": ANY,  # bias-free models export zero biases
    "activation": ("gelu", "gelu_tanh"),  # activation_function gelu / gelu_new (see ACTIVATIONS)
}


def expand(n_layer: int) -> list[tuple[str, str]]:
    """NAMES with {i} filled in for every block."""
    rows = []
    for ours, theirs in NAMES:
        layers = range(n_layer) if "{i}" in ours else [None]
        rows += [(ours.format(i=i), theirs.format(i=i)) for i in layers]
    return rows


def is_transposed(name: str) -> bool:
    return name.endswith(TRANSPOSED)


# ----------------------------------------------------------------------------- import
@dataclass
class Pretrained:
    """Imported weights under our names, ready for ``GPT(config).load_state_dict(state)``."""
    config: GPTConfig
    state: dict[str, torch.Tensor]
    n_positions: int  # the position table's length in the file (block_size may be less)
    source: str
    tokenizer: dict | None  # {"kind": "gpt2"} or {"kind": "char", ...} if known from the files, else None

    def weights_for(self, tokenizer_meta: dict, vocab_size: int) -> dict[str, torch.Tensor]:
        """The state dict, for a corpus of this tokenizer and vocabulary (+ chat markers); HFError if they are not
        the weights'."""
        base = self.tokenizer or without_chat(tokenizer_meta)  # None: the files do not say; the corpus's, then
        check_vocab(self, base, tokenizer_vocab_size(base) or vocab_size)
        return fit_vocab(self.state, base, tokenizer_meta, vocab_size, self.source)


def fit_vocab(state: dict[str, torch.Tensor], base: dict, corpus: dict, vocab_size: int,
              source: str) -> dict[str, torch.Tensor]:
    """``state`` for a model of ``vocab_size``: the base's tokenizer, or the base's with the chat markers after
    it, whose embedding rows start at the mean of the base's (a fixed start, and a marker reads as no token in
    particular). Padded rows hold them where there are enough; more rows are appended. Other tokenizers are
    refused: the ids would mean other text."""
    if without_chat(corpus) != without_chat(base):
        raise HFError(f"{source} was trained with another tokenizer ({base['kind']}) than the corpus's "
                      f"({corpus['kind']}); prepare the data with the base's (drop --tokenizer)")
    base_vocab = tokenizer_vocab_size(base)
    if vocab_size != tokenizer_vocab_size(corpus):
        raise HFError(f"{source}: the corpus's vocabulary is {vocab_size}, its tokenizer's {tokenizer_vocab_size(corpus)}")
    wte = state["transformer.wte.weight"]  # (V_padded_base, C)
    rows = GPTConfig(vocab_size=vocab_size).padded_vocab_size
    new = torch.cat([wte, wte.new_zeros(rows - len(wte), wte.shape[1])])  # (V_padded, C), a copy
    new[base_vocab:vocab_size] = wte[:base_vocab].mean(dim=0)  # (V_new - V_base, C): the markers' rows
    return {**state, "transformer.wte.weight": new, "lm_head.weight": new}


def load_pretrained(source: str, block_size: int = 0, bias: bool = True) -> Pretrained:
    """Read Hugging Face GPT-2 weights (hub name, folder or .safetensors) into our layout.

    block_size 0 keeps every position; a smaller one crops the table, a larger one is refused.
    bias=False drops the biases, refusing any that is not zero. Raises HFError before anything else.
    """
    weights, config_file = locate(source)
    tensors = read_weights(weights)
    shape = read_shape(config_file, tensors, weights)
    block_size = block_size or shape["n_positions"]
    if block_size > shape["n_positions"]:
        raise HFError(f"block_size {block_size} exceeds the {shape['n_positions']} positions of {source}; "
                      f"use --block_size {shape['n_positions']} or less")
    config = GPTConfig(vocab_size=shape["vocab_size"], block_size=block_size, n_layer=shape["n_layer"],
                       n_head=shape["n_head"], n_embd=shape["n_embd"], bias=bias, activation=shape["activation"])
    state = to_ours(tensors, config, shape["n_positions"], source)
    return Pretrained(config, state, shape["n_positions"], source, read_tokenizer(weights.parent, config.vocab_size))


def locate(source: str) -> tuple[Path, Path | None]:
    """(the .safetensors file, its config.json or None) for a folder, a file or a hub name."""
    path = Path(source)
    if path.is_dir():
        weights = path / "model.safetensors"
        if not weights.is_file():
            raise HFError(f"{path}: no model.safetensors in this folder (the Hugging Face GPT-2 layout)")
        return weights, path / "config.json" if (path / "config.json").is_file() else None
    if path.is_file():
        if path.suffix != ".safetensors":
            raise HFError(f"{path}: not a .safetensors file; pass one, a folder holding model.safetensors, "
                          f"or a hub name ({', '.join(HUB_NAMES)})")
        beside = path.parent / "config.json"
        return path, beside if beside.is_file() else None
    if source in HUB_NAMES or re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        return download(HUB_NAMES.get(source, source))
    raise HFError(f"{source}: no such folder or file, and not a hub name ({', '.join(HUB_NAMES)})")


def download(repo_id: str) -> tuple[Path, Path]:
    """config.json and model.safetensors from the hub, through huggingface_hub's cache (HF_HOME).

    The hub is probed first (hub_unreachable); if it cannot be reached the files come from the cache
    alone, as with HF_HUB_OFFLINE=1, and a miss is the one line below within seconds.
    """
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, OfflineModeIsEnabled

    unreachable = None if constants.is_offline_mode() else hub_unreachable(repo_id)
    try:
        config = huggingface_hub.hf_hub_download(repo_id, "config.json", local_files_only=bool(unreachable))
        weights = huggingface_hub.hf_hub_download(repo_id, "model.safetensors", local_files_only=bool(unreachable))
    except (OSError, EntryNotFoundError) as err:  # offline, not cached, no such repo or file, HTTP errors
        reason = (f"cannot reach {constants.ENDPOINT}: {unreachable}" if unreachable else
                  "HF_HUB_OFFLINE=1" if isinstance(err, OfflineModeIsEnabled) or constants.is_offline_mode() else
                  "the hub did not answer" if isinstance(err, LocalEntryNotFoundError) else
                  f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:120]}")
        raise HFError(f"could not get {repo_id} from the Hugging Face hub ({reason}) nor from its cache, and there "
                      f"is no local folder or file of that name; where there is network run `hf download {repo_id} "
                      "model.safetensors config.json --local-dir DIR`, copy DIR here and pass --init_from DIR "
                      "(HF_HUB_OFFLINE=1 skips the hub when the files are in its cache)") from None
    return Path(weights), Path(config)


def hub_unreachable(repo_id: str) -> str | None:
    """Why the hub cannot be reached ("connection refused"), or None if it answers: one request, no retries.

    hf_hub_download retries a refused or timed-out connection five times with backoff, ~25 s and a
    warning line each, before it looks in its cache. This probe asks once for the repo's config.json
    (huggingface_hub's own client: HF_ENDPOINT, proxies and token apply) and waits at most
    HUB_PROBE_TIMEOUT seconds, or HF_HUB_ETAG_TIMEOUT if set. Any HTTP answer, even an error, is reachable.
    """
    import httpx2  # huggingface_hub's HTTP client, installed with it
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or HUB_PROBE_TIMEOUT)
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=timeout)
    except httpx2.TransportError as err:  # no connection: refused, timed out, no DNS, proxy down
        return (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
    except HfHubHTTPError:  # the hub answered (a missing or gated repo): hf_hub_download says what
        pass
    return None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a .safetensors file in fp32, without the ``transformer.`` prefix."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        raw = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise HFError(f"{path}: not a readable .safetensors file ({str(err)[:160]})") from None
    return {key.removeprefix(PREFIX): value.float() for key, value in raw.items()}


def read_shape(config_file: Path | None, tensors: dict[str, torch.Tensor], weights: Path) -> dict[str, Any]:
    """n_layer, n_head, n_embd, n_positions, vocab_size, activation: from config.json or the shapes."""
    if config_file is None:
        if "wte.weight" not in tensors or "wpe.weight" not in tensors:
            raise HFError(f"{weights}: no {PREFIX}wte.weight / wpe.weight: not GPT-2 weights")
        n_layer = len({key.split(".")[1] for key in tensors if key.startswith("h.")})
        n_embd = tensors["wte.weight"].shape[1]
        if (n_layer, n_embd) not in KNOWN_HEADS:
            raise HFError(f"{weights}: the number of heads of a {n_layer}-layer, {n_embd}-wide model cannot be "
                          "read from its weights; put its config.json beside the file")
        return {"n_layer": n_layer, "n_head": KNOWN_HEADS[n_layer, n_embd], "n_embd": n_embd,
                "n_positions": tensors["wpe.weight"].shape[0], "vocab_size": tensors["wte.weight"].shape[0],
                "activation": "gelu_tanh"}
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise HFError(f"{config_file}: not readable JSON ({err})") from None
    if hf.get("model_type") != "gpt2":
        raise HFError(f"{config_file}: model_type {hf.get('model_type')!r}, not 'gpt2': only GPT-2's layout "
                      "maps onto this model")
    if hf.get("n_inner") == 4 * hf.get("n_embd", 0):
        hf["n_inner"] = None  # the same MLP width, written out
    for name, default, allowed in CONFIG_RULES:
        if hf.get(name, default) not in allowed:
            raise HFError(f"{config_file}: {name} is {hf.get(name, default)!r}; this model computes "
                          f"{' or '.join(map(repr, allowed))}")
    try:
        return {"n_layer": int(hf["n_layer"]), "n_head": int(hf["n_head"]), "n_embd": int(hf["n_embd"]),
                "n_positions": int(hf["n_positions"]), "vocab_size": int(hf["vocab_size"]),
                "activation": ACTIVATIONS[hf.get("activation_function", "gelu_new")]}
    except KeyError as err:
        raise HFError(f"{config_file}: no {err.args[0]}") from None


def to_ours(tensors: dict[str, torch.Tensor], config: GPTConfig, n_positions: int,
            source: str) -> dict[str, torch.Tensor]:
    """Check every key and shape against ``config``, then map, transpose, pad and crop."""
    rows = [(ours, theirs.removeprefix(PREFIX)) for ours, theirs in expand(config.n_layer)]
    given = {key for key in tensors if not key.endswith(NOT_WEIGHTS) and key != TIED_HEAD}
    for ours, theirs in rows:
        if theirs not in given:
            raise HFError(f"{source}: missing key {PREFIX}{theirs}")
    extra = sorted(given - {theirs for _, theirs in rows})
    if extra:
        raise HFError(f"{source}: unexpected key {extra[0]} for a {config.n_layer}-layer GPT-2")
    with torch.device("meta"):  # shapes only: no memory, no init time even for gpt2-xl
        expected = GPT(GPTConfig(**{**config.__dict__, "block_size": n_positions, "bias": True})).state_dict()
    state = {}
    for ours, theirs in rows:
        value, want = tensors[theirs], expected[ours].shape
        if ours == "transformer.wte.weight":
            want = (config.vocab_size, want[1])  # the file's rows are the real vocabulary, unpadded
        elif is_transposed(ours):
            want = want[::-1]
        if tuple(value.shape) != tuple(want):
            raise HFError(f"{source}: {PREFIX}{theirs} has shape {tuple(value.shape)}, expected {tuple(want)} "
                          f"for n_layer {config.n_layer}, n_head {config.n_head}, n_embd {config.n_embd}, "
                          f"vocab {config.vocab_size}")
        if ours.endswith(".bias") and not config.bias:
            if value.count_nonzero():
                raise HFError(f"{source}: {PREFIX}{theirs} is not zero (max |b| {value.abs().max():.3g}) but "
                              "the model has bias=False; import with bias=True (drop --bias false)")
            continue  # an exported bias-free model: its zero biases carry nothing
        if is_transposed(ours):
            value = value.t()  # (in, out) -> (out, in)
        elif ours == "transformer.wte.weight":
            padding = value.new_zeros(config.padded_vocab_size - config.vocab_size, value.shape[1])
            value = torch.cat([value, padding])  # (V_padded, C): the padded rows are never scored
        elif ours == "transformer.wpe.weight":
            value = value[: config.block_size]  # (block_size, C)
        state[ours] = value.contiguous()
    if TIED_HEAD in tensors and not torch.equal(tensors[TIED_HEAD], tensors["wte.weight"]):
        raise HFError(f"{source}: {TIED_HEAD} differs from {PREFIX}wte.weight; this model ties the two")
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


IMPORTED = ("n_layer", "n_head", "n_embd", "bias", "activation")  # the options a GPT-2 file fixes


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


def adopt(cfg: TrainConfig, model_cfg: GPTConfig, tokenizer: dict | None, source: str) -> TrainConfig:
    """The training config with the imported model's shape (and tokenizer, when known).

    A field the user did not give takes the imported value; one the user gave (the preset or the
    command line, even at its default: config.given_fields) with another value is a conflict the user
    must resolve (block_size is the user's: it crops the position table). Every other model option
    must be one GPT-2's weights compute (GPT2_OPTIONS), or the import is refused.
    """
    imported = {name: getattr(model_cfg, name) for name in IMPORTED}
    if tokenizer is not None:
        imported["tokenizer"] = tokenizer["kind"]
    given = given_fields(cfg)
    for name, value in imported.items():
        mine = getattr(cfg, name)
        if name in given and mine != value:
            raise HFError(f"--{name} {flag_value(mine)} conflicts with {source}, whose weights have {name} "
                          f"{flag_value(value)}; drop --{name} (or that key from the preset): with --init_from "
                          "the weights fix the model's shape")
    adopted = replace(cfg, **imported)
    refusals = gpt2_refusals(model_config(adopted, model_cfg.vocab_size))
    if refusals:
        raise HFError(f"{source} holds GPT-2 weights, which cannot run with {refusals[0]}; drop that option "
                      "or train from scratch without --init_from")
    return adopted


def flag_value(value: Any) -> str:
    """A value as it is typed on the command line: false, not False."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_vocab(pretrained: Pretrained, tokenizer_meta: dict, vocab_size: int) -> None:
    """Refuse a corpus whose tokenizer is not the one the imported weights were trained with."""
    if vocab_size != pretrained.config.vocab_size:
        raise HFError(f"{pretrained.source} has a vocabulary of {pretrained.config.vocab_size}, the corpus "
                      f"{vocab_size} ({tokenizer_meta['kind']} tokenizer); use the weights' tokenizer")
    if pretrained.tokenizer is not None and pretrained.tokenizer != tokenizer_meta:
        raise HFError(f"{pretrained.source}'s characters ({CHARS_FILE}) differ from the corpus's")


# ----------------------------------------------------------------------------- export
def to_hf(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face names: transposed, unpadded, explicit zero biases if bias=False.

    Refuses a model with an option GPT-2 cannot compute (gpt2_refusals) or weights the table does not
    map: a GPT-2 folder that loads but computes something else would be the worst export.
    """
    config, state = model.config, model.state_dict()
    refusals = gpt2_refusals(config)
    if refusals:
        raise HFError(f"cannot export as GPT-2: the model has {refusals[0]}; transformers' GPT-2 would "
                      "load it and compute another model")
    unmapped = sorted(set(state) - {ours for ours, _ in expand(config.n_layer)} - {"lm_head.weight"})
    if unmapped:
        raise HFError(f"cannot export as GPT-2: weight {unmapped[0]} has no place in GPT-2's layout")
    out = {}
    for ours, theirs in expand(config.n_layer):
        if ours in state:
            value = state[ours].detach().float()
        elif not ours.endswith(".bias"):
            raise HFError(f"cannot export as GPT-2: the model has no {ours}, which GPT-2's layout needs")
        else:  # bias=False: GPT-2 has every bias, so write zeros of the layer's output width
            value = torch.zeros(state[ours.removesuffix(".bias") + ".weight"].shape[0])
        if is_transposed(ours):
            value = value.t()  # (out, in) -> (in, out)
        elif ours == "transformer.wte.weight":
            value = value[: config.vocab_size]  # (V, C): the padded rows are not part of the vocabulary
        out[theirs] = value.contiguous().clone()  # safetensors stores each tensor once, unshared
    return out


def hf_config(config: GPTConfig, bos: int | None, eos: int | None) -> dict[str, Any]:
    """config.json for transformers' GPT2LMHeadModel with this model's shape."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.block_size, "n_ctx": config.block_size, "n_embd": config.n_embd,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
            "activation_function": {"gelu_tanh": "gelu_new", "gelu": "gelu"}[config.activation],
            "layer_norm_epsilon": LAYER_NORM_EPS, "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
            "attn_pdrop": config.dropout, "initializer_range": 0.02, "scale_attn_weights": True,
            "tie_word_embeddings": True, "use_cache": True, "bos_token_id": bos, "eos_token_id": eos,
            "dtype": "float32"}


def generation_config(block_size: int, bos: int | None, eos: int | None) -> dict[str, Any]:
    """generation_config.json: generate() stops at block_size tokens, prompt included (transformers' default,
    20, says nothing of the model), where the position table ends: past it GPT-2's code raises IndexError."""
    return {"bos_token_id": bos, "eos_token_id": eos, "max_length": block_size}


def export(model: GPT, tokenizer, folder: Path) -> list[Path]:
    """Write model.safetensors, config.json, generation_config.json and the tokenizer's files to ``folder``."""
    from safetensors.torch import save

    weights = to_hf(model)
    is_gpt2 = tokenizer.meta()["kind"] == "gpt2"
    # <|endoftext|> starts and ends GPT-2 text; a char model starts from a newline and has no end.
    bos, eos = (tokenizer.eot_token, tokenizer.eot_token) if is_gpt2 else (tokenizer.eot_token, None)
    if hasattr(tokenizer, "marker_ids"):  # a chat model: a reply ends at <|end|>, and the template travels
        eos = tokenizer.marker_ids[chat.END]
    files = {"config.json": hf_config(model.config, bos, eos), **tokenizer_files(tokenizer, model.config.block_size),
             "generation_config.json": generation_config(model.config.block_size, bos, eos)}
    if hasattr(tokenizer, "marker_ids"):
        files["tokenizer_config.json"]["chat_template"] = chat.hf_chat_template()
    if folder.exists() and any(folder.iterdir()):  # another model's tokenizer files would be loaded beside ours
        raise HFError(f"{folder} is not empty; export into a new folder (or delete this one first)")
    folder.mkdir(parents=True, exist_ok=True)
    # Each file whole or absent (files.atomic_write): a kill mid-export never leaves a truncated one to load.
    atomic_write(folder / "model.safetensors", lambda f: f.write(save(weights, metadata={"format": "pt"})))
    written = [folder / "model.safetensors"]
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=1, ensure_ascii=False) + "\n"
        atomic_write_text(folder / name, text)
        written.append(folder / name)
    return written


# ----------------------------------------------------------------------------- a run that starts from them
def start_from(cfg: TrainConfig, out_dir: Path) -> tuple[TrainConfig, Pretrained | None]:
    """With init_from, the config takes the pretrained model's shape; a fresh run also gets its weights.

    A resume takes the shape from last.pt's config and imports nothing: the checkpoint has the weights. A LoRA
    run's checkpoint holds only its adapters (training/lora.py): its resume imports the base again.
    """
    if not cfg.init_from:
        return cfg, None
    if cfg.resume and not cfg.lora_rank:
        saved = read_config(out_dir / "last.pt") if (out_dir / "last.pt").is_file() else None
        if saved is None:  # resume() names the missing file
            return cfg, None
        shape = model_config(config_from_dict(saved), 1)
        return adopt(cfg, shape, {"kind": saved["tokenizer"]}, str(out_dir / "last.pt")), None
    # GPT-2 has biases; a given bias=False imports a bias-free model's export (zero biases), refuses any other.
    bias = cfg.bias if "bias" in given_fields(cfg) else True
    pretrained = load_pretrained(cfg.init_from, cfg.block_size, bias)
    cfg = adopt(cfg, pretrained.config, pretrained.tokenizer, cfg.init_from)
    print0(f"init_from {cfg.init_from}: {describe(model_config(cfg, pretrained.config.vocab_size))}; "
           f"tokenizer {cfg.tokenizer}; block_size {cfg.block_size} of {pretrained.n_positions} positions")
    return cfg, pretrained
