"""Hugging Face GPT-2 in and out: start from pretrained weights, hand a trained model to transformers.

    python train.py --config finetune_shakespeare           # fine-tune GPT-2 (init_from = "gpt2")
    python sample.py --init_from gpt2 --prompt "Hello"       # sample GPT-2 itself, no checkpoint
    python -m scripts.export_hf out/finetune_shakespeare hf/shakespeare   # a folder transformers loads

The mapping is data, read top to bottom and used both ways: NAMES, GPT-2's weights (ours have the same names), and
TRANSPOSED, the four matrices transformers keeps in Conv1D layers, (in, out), where nn.Linear has (out, in). The
rest is shape: our vocabulary is padded to a multiple of 64, our position table may be shorter (cropped on import).
The hub's own gpt2 is a GPT2Model file: no ``transformer.`` prefix, and causal-mask buffers that are not weights.
Every key and shape is checked before a weight is copied or a file written; one that does not fit is an HFError
naming it. Weights come as a hub name (through huggingface_hub's cache: HF_HOME, HF_HUB_OFFLINE apply), a folder
holding model.safetensors and config.json, or a .safetensors file with config.json beside it.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from model import GPT, GPTConfig
from prepare.chat import BEGIN, END
from prepare.tokenizers import ChatTokenizer, tokenizer_vocab_size, without_chat
from process.errors import HFError, PathError
from process.files import atomic_write, atomic_write_text
from process.rundir import check_writable
from weights.hf_tokenizer import read_tokenizer, tokenizer_files

# ----------------------------------------------------------------------------- the mapping
NAMES = (  # every weight of GPT-2, in forward order: our name, which is GPT2LMHeadModel's; {i} is the block index
    "transformer.wte.weight",  # (V, C): V padded ours, the real vocabulary theirs; also lm_head (tied)
    "transformer.wpe.weight",  # (T, C): block_size rows ours, n_positions theirs
    "transformer.h.{i}.ln_1.weight", "transformer.h.{i}.ln_1.bias",
    "transformer.h.{i}.attn.c_attn.weight", "transformer.h.{i}.attn.c_attn.bias",  # q, k, v side by side
    "transformer.h.{i}.attn.c_proj.weight", "transformer.h.{i}.attn.c_proj.bias",
    "transformer.h.{i}.ln_2.weight", "transformer.h.{i}.ln_2.bias",
    "transformer.h.{i}.mlp.c_fc.weight", "transformer.h.{i}.mlp.c_fc.bias",
    "transformer.h.{i}.mlp.c_proj.weight", "transformer.h.{i}.mlp.c_proj.bias",
    "transformer.ln_f.weight", "transformer.ln_f.bias",
)
# Conv1D (Radford et al.'s original TF code, kept by transformers) computes x @ W with W (in, out).
TRANSPOSED = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
WTE, WPE, TIED_HEAD = "transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in GPT2Model's files
PREFIX = "transformer."  # GPT2LMHeadModel's keys have it, GPT2Model's (the hub's gpt2) do not

HUB_NAMES = {"gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
             "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl"}
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


def expand(n_layer: int) -> list[str]:
    """NAMES with {i} filled in for every block."""
    return [name.format(i=i) for name in NAMES for i in (range(n_layer) if "{i}" in name else [None])]


def is_transposed(name: str) -> bool:
    return name.endswith(TRANSPOSED)


def convert(name: str, value: torch.Tensor, vocab_rows: int, block_size: int) -> torch.Tensor:
    """One weight into the other layout, by the same rule both ways: a Conv1D matrix transposed, wte's rows padded
    with zeros or cut to ``vocab_rows`` (ours padded, never scored; theirs the real vocabulary), wpe's cut."""
    if is_transposed(name):
        return value.t()  # (in, out) <-> (out, in)
    if name == WTE:  # (V, C)
        return torch.cat([value, value.new_zeros(max(vocab_rows - len(value), 0), value.shape[1])])[:vocab_rows]
    return value[:block_size] if name == WPE else value  # (T, C)


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


# ----------------------------------------------------------------------------- import
@dataclass
class Pretrained:
    """Weights a run starts from (--init_from), under our names: GPT-2's (load_pretrained) or a run's
    (loading.load_run)."""
    config: GPTConfig  # what the weights compute; block_size: the position table's rows, once cropped
    state: dict[str, torch.Tensor]
    source: str  # the checkpoint file, or the weights as named
    tokenizer: dict | None  # its description; None where GPT-2's files do not say (the corpus's is taken)
    n_positions: int  # the position table's rows before cropping
    gpt2: bool = False  # GPT-2's: they fix its shape (IMPORTED); every other option must be one GPT-2 computes

    def weights_for(self, tokenizer_meta: dict, vocab_size: int) -> dict[str, torch.Tensor]:
        """The state dict for a corpus of the weights' tokenizer, or of it with a chat corpus's markers, whose
        embedding rows (padded ones, or appended) start at the mean row: a fixed start, no token in particular.
        Any other tokenizer is refused: the ids would mean other text."""
        base = self.tokenizer or without_chat(tokenizer_meta)  # None: the files do not say; the corpus's, then
        base_vocab = tokenizer_vocab_size(base) or vocab_size
        if base_vocab != self.config.vocab_size:
            raise HFError(f"{self.source} has a vocabulary of {self.config.vocab_size}, the corpus {base_vocab} "
                          f"({base['kind']} tokenizer); use the weights' tokenizer")
        if without_chat(tokenizer_meta) != without_chat(base):
            raise HFError(f"{self.source} was trained with another tokenizer ({base['kind']}) than the corpus's "
                          f"({tokenizer_meta['kind']}); prepare the data with the base's (drop --tokenizer)")
        wte = self.state[WTE]  # (V_padded_base, C)
        rows = GPTConfig(vocab_size=vocab_size).padded_vocab_size
        new = torch.cat([wte, wte.new_zeros(rows - len(wte), wte.shape[1])])  # (V_padded, C), a copy
        new[base_vocab:vocab_size] = wte[:base_vocab].mean(dim=0)  # (V_new - V_base, C): the markers' rows
        return {**self.state, WTE: new, TIED_HEAD: new}


def check_positions(block_size: int, n_positions: int, source: str) -> int:
    """The block_size a model of ``n_positions`` positions is cropped to (0: all of them); more is refused."""
    if block_size > n_positions:
        raise HFError(f"block_size {block_size} exceeds the {n_positions} positions of {source}; use --block_size "
                      f"{n_positions} or less")
    return block_size or n_positions


def load_pretrained(source: str, block_size: int = 0, bias: bool = True) -> Pretrained:
    """Hugging Face GPT-2 weights (hub name, folder or .safetensors) under our names, checked before anything else.
    block_size 0 keeps every position, a smaller one crops the table; bias=False drops the biases (zeros only)."""
    weights, config_file = locate(source)
    tensors = read_weights(weights)
    shape = read_shape(config_file)  # block_size: the file's n_positions
    config = replace(shape, block_size=check_positions(block_size, shape.block_size, source), bias=bias)
    return Pretrained(config, to_ours(tensors, config, shape.block_size, source), source,
                      read_tokenizer(weights.parent, config.vocab_size), shape.block_size, gpt2=True)


def locate(source: str) -> tuple[Path, Path]:
    """(the .safetensors file, its config.json) for a folder, a file or a hub name."""
    path = Path(source)
    if path.is_dir():
        path = path / "model.safetensors"
        if not path.is_file():
            raise HFError(f"{path.parent}: no model.safetensors in this folder (the Hugging Face GPT-2 layout)")
    elif path.is_file() and path.suffix != ".safetensors":
        raise HFError(f"{path}: not a .safetensors file; pass one, a folder holding model.safetensors, "
                      f"or a hub name ({', '.join(HUB_NAMES)})")
    elif not path.is_file():
        if source in HUB_NAMES or re.fullmatch(r"[\w.-]+/[\w.-]+", source):
            return download(HUB_NAMES.get(source, source))
        raise HFError(f"{source}: no such folder or file, and not a hub name ({', '.join(HUB_NAMES)})")
    if not (path.parent / "config.json").is_file():
        raise HFError(f"{path}: no config.json beside it, which says the model's shape; put its config.json beside "
                      "the file")
    return path, path.parent / "config.json"


def download(repo_id: str) -> tuple[Path, Path]:
    """config.json and model.safetensors through huggingface_hub's cache (HF_HOME). If the hub does not answer its
    probe (hub_unreachable) they come from the cache alone, as with HF_HUB_OFFLINE=1: a miss is one line in seconds."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, OfflineModeIsEnabled

    unreachable = None if constants.is_offline_mode() else hub_unreachable(repo_id)
    try:
        config, weights = (huggingface_hub.hf_hub_download(repo_id, name, local_files_only=bool(unreachable))
                           for name in ("config.json", "model.safetensors"))
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
    """Why the hub cannot be reached ("connection refused"), or None if it answers (even with an HTTP error).
    hf_hub_download retries a refused or timed-out connection five times, ~25 s and a warning line each, before it looks
    in its cache. This asks once, with huggingface_hub's own client (HF_ENDPOINT, proxies and token apply), waiting at
    most HUB_PROBE_TIMEOUT seconds (HF_HUB_ETAG_TIMEOUT if set)."""
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
    """Every tensor of a .safetensors file in fp32, under GPT2LMHeadModel's names (``transformer.`` added)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        raw = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise HFError(f"{path}: not a readable .safetensors file ({str(err)[:160]})") from None
    return {key if key.startswith(PREFIX) or key == TIED_HEAD else PREFIX + key: value.float()
            for key, value in raw.items()}


def read_shape(config_file: Path) -> GPTConfig:
    """The model config.json describes (vocab_size real, block_size n_positions, bias True), if GPT-2's code
    computes it as this model does (CONFIG_RULES)."""
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
            raise HFError(f"{source}: {name} has shape {tuple(value.shape)}, expected {want} for n_layer "
                          f"{config.n_layer}, n_head {config.n_head}, n_embd {config.n_embd}, "
                          f"vocab {config.vocab_size}")
        if name.endswith(".bias") and not config.bias:
            if value.count_nonzero():
                raise HFError(f"{source}: {name} is not zero (max |b| {value.abs().max():.3g}) but the model has "
                              "bias=False; import with bias=True (drop --bias false)")
            continue  # an exported bias-free model: its zero biases carry nothing
        state[name] = convert(name, value, config.padded_vocab_size, config.block_size).contiguous()
    if TIED_HEAD in tensors and not torch.equal(tensors[TIED_HEAD], tensors[WTE]):
        raise HFError(f"{source}: {TIED_HEAD} differs from {WTE}; this model ties the two")
    return {**state, TIED_HEAD: state[WTE]}


# ----------------------------------------------------------------------------- export
# The first bytes of each file format an export writes, by the name's suffix: the one kind of file it may replace.
FILE_MAGIC = {".gguf": b"GGUF"}


def check_output(out: Path, flag: str, suffix: str = "") -> None:
    """Refuse an export's output before anything is loaded or written, where writing would lose something: a folder
    (``suffix`` "") must be new or empty (a run's checkpoints, another model's files that would load beside ours);
    a file must be named ``*suffix``, in a folder that exists, and be new or a file of that format (FILE_MAGIC),
    never a checkpoint, a log or the file the export reads. Then the folder must take a file (check_writable)."""
    folder = out.parent if suffix else out
    if not suffix and out.is_dir() and any(out.iterdir()):
        raise PathError(f"{out} is not empty; export into a new folder (or delete this one first)")
    if suffix and out.suffix != suffix:
        raise PathError(f"{out}: the export writes only *{suffix} files, never over a checkpoint or any other file; "
                        f"pass a name ending in {suffix}")
    if suffix and out.exists() and not starts_with(out, FILE_MAGIC[suffix]):
        raise PathError(f"{out} is not a {suffix} file an export wrote (a checkpoint renamed?), and only such a file "
                        "is replaced; pass a new name (or delete it first)")
    if suffix and not folder.exists():
        raise PathError(f"{out}: no folder {folder}; make it first (mkdir -p {folder}) or write into an existing one")
    check_writable(folder, flag, f".export-probe-{os.getpid()}")  # a file where the folder should be, read-only


def starts_with(path: Path, magic: bytes) -> bool:
    """``path`` is a file whose first bytes are ``magic`` (False for a folder, or a file it cannot read)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def check_gpt2(model: GPT) -> None:
    """HFError for a model with an option GPT-2 cannot compute or a weight NAMES lacks: a GPT-2 folder that loads but
    computes something else is the worst export."""
    config, state = model.config, model.state_dict()
    refusals = gpt2_refusals(config)
    if refusals:
        raise HFError(f"cannot export as GPT-2: the model has {refusals[0]}; transformers' GPT-2 would "
                      "load it and compute another model")
    unmapped = sorted(set(state) - set(expand(config.n_layer)) - {TIED_HEAD})
    if unmapped:
        raise HFError(f"cannot export as GPT-2: weight {unmapped[0]} has no place in GPT-2's layout")


def to_hf(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights in GPT2LMHeadModel's layout (zero biases if bias=False); check_gpt2's refusals first."""
    check_gpt2(model)
    config, state = model.config, model.state_dict()
    out = {}
    for name in expand(config.n_layer):  # bias=False: GPT-2 has every bias, so zeros of the layer's output width
        value = (state[name].detach().float() if name in state
                 else torch.zeros(len(state[name.removesuffix("bias") + "weight"])))
        out[name] = convert(name, value, config.vocab_size, config.block_size).contiguous().clone()  # unshared
    return out


def hf_config(config: GPTConfig, bos: int | None, eos: int | None) -> dict[str, Any]:
    """config.json for transformers' GPT2LMHeadModel with this model's shape."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.block_size, "n_ctx": config.block_size, "n_embd": config.n_embd,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
            "activation_function": next(theirs for theirs, ours in ACTIVATIONS.items() if ours == config.activation),
            "layer_norm_epsilon": LAYER_NORM_EPS, "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
            "attn_pdrop": config.dropout, "initializer_range": 0.02, "scale_attn_weights": True,
            "tie_word_embeddings": True, "use_cache": True, "bos_token_id": bos, "eos_token_id": eos,
            "dtype": "float32"}


def export(model: GPT, tokenizer, folder: Path) -> list[Path]:
    """Write model.safetensors, config.json, generation_config.json (generate() stops at block_size tokens, where the
    position table ends, not transformers' default 20) and the tokenizer's files to a new ``folder``."""
    from safetensors.torch import save

    weights, block_size = to_hf(model), model.config.block_size
    # <|endoftext|> starts and ends GPT-2 text; a char model starts from a newline and has no end; a chat model's
    # conversation starts at <|begin|> and its reply ends at <|end|>.
    bos, eos = tokenizer.eot_token, (tokenizer.eot_token if tokenizer.meta()["kind"] == "gpt2" else None)
    if isinstance(tokenizer, ChatTokenizer):
        bos, eos = tokenizer.marker_ids[BEGIN], tokenizer.marker_ids[END]
    files = {"config.json": hf_config(model.config, bos, eos), **tokenizer_files(tokenizer, block_size),
             "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos, "max_length": block_size}}
    check_output(folder, "output folder")  # scripts/export_hf.py asked before loading; a library caller here
    folder.mkdir(parents=True, exist_ok=True)
    # Each file whole or absent (files.atomic_write): a kill mid-export never leaves a truncated one to load.
    atomic_write(folder / "model.safetensors", lambda f: f.write(save(weights, metadata={"format": "pt"})))
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=1, ensure_ascii=False) + "\n"
        atomic_write_text(folder / name, text)
    return [folder / "model.safetensors", *(folder / name for name in files)]
