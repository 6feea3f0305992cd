"""A model's weights back from disk, a run's checkpoint or GPT-2's: for use, or for a new run to start from.

    loaded = from_checkpoint(find_checkpoint("out/small"))   # a run folder's best.pt (else last.pt), or a .pt
    loaded = from_pretrained("gpt2")                          # Hugging Face GPT-2 weights (weights/hf.py)
    loaded = from_flags(args, device)                         # whichever --ckpt / --init_from chose
    cfg, pretrained = start_from(cfg, device)                 # train.py's --init_from: a run (folder, .pt) or GPT-2

``Loaded``: the model in eval mode, its tokenizer, its run's config and what the run logged. ``start_from``: the
weights, with the config taking every option they fix (adopt) and the corpus's vocabulary fitted to them
(hf.Pretrained.weights_for: a chat corpus's markers take new rows). A fresh run (new optimizer, step, streams) in
its own out_dir; its resume imports the base again, so that the corpus is prepared with the base's tokenizer as the
first time, and last.pt's weights then replace the base's (a LoRA run's last.pt holds only its adapters).
"""
from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from config import TrainConfig, config_from_dict, given_fields, model_config
from model import GPT, GPTConfig
from training.tracking import describe
from prepare.tokenizers import tokenizer_from_meta
from process import distributed
from process.distributed import print0
from process.errors import CheckpointError, HFError
from training import lora
from training.checkpoint import load_checkpoint
from weights.hf_tokenizer import NO_TOKENIZER

if TYPE_CHECKING:  # GPT-2's code is imported by the calls that need it (hf's Pretrained holds a run's weights too)
    from weights.hf import Pretrained

CPU = torch.device("cpu")
RUN_FILES = ("best.pt", "last.pt")  # a run folder's weights, in order of preference


@dataclass(frozen=True)
class Loaded:
    """A model ready for use and what its callers need to know about it."""
    model: GPT  # in eval mode, on the device asked for
    tokenizer: Any  # prepare.tokenizers': char, GPT-2's or a BPE, from the checkpoint's description
    cfg: TrainConfig  # the run's config; pretrained weights: the defaults with the weights' shape (adopt)
    precision: str  # the dtype the run trained in: float32, bfloat16, float16 (pretrained: float32)
    source: str  # the checkpoint file, or the pretrained weights as named (--init_from)
    step: int | None  # optimizer steps behind the weights; None: pretrained, no run of ours behind them
    best_val_loss: float  # as the run logged it; nan for pretrained weights
    corpus: dict | None = None  # the data it trained on (data.Corpus.record: split fingerprints); None: pretrained


# ----------------------------------------------------------------------------- a model for use
def find_checkpoint(ckpt: str) -> Path:
    """A file as given; a folder's best.pt (else last.pt); by default the newest best.pt under out/."""
    if ckpt:
        path = run_checkpoint(ckpt) if Path(ckpt).is_dir() else Path(ckpt)
        if path is None:
            raise CheckpointError(f"{Path(ckpt)}: no best.pt or last.pt in this folder")
        return path
    found = sorted(Path("out").glob("**/best.pt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise CheckpointError("no checkpoint found under out/; train one first: python train.py --config small")
    return found[-1]


def from_checkpoint(path: Path, device: torch.device = CPU, merged: bool = True) -> Loaded:
    """The weights, config and tokenizer of a checkpoint file (verified: checkpoint.load_checkpoint). A LoRA run's
    holds only its adapters: they go on the base it was trained from (init_from, checked by fingerprint), merged
    unless ``merged=False`` (the adapted model training evaluated: lora.load_adapted)."""
    state = load_checkpoint(path)  # to CPU: the optimizer state it also holds never needs the GPU
    cfg = config_from_dict(state["config"])
    tokenizer = tokenizer_from_meta(state["tokenizer"], Path(cfg.data_dir))
    model = GPT(model_config(cfg, tokenizer.vocab_size))
    if "lora" in state:
        model.load_state_dict(load_base(cfg).weights_for(state["tokenizer"], tokenizer.vocab_size))
        model = lora.load_adapted(state, model, str(path), merged)
    else:
        model.load_state_dict(state["model"])
    return Loaded(model.to(device).eval(), tokenizer, cfg, state["precision"], str(path), state["step"],
                  state["best_val_loss"], state["corpus"])


def from_pretrained(source: str, device: torch.device = CPU, data_dir: Path = Path("data")) -> Loaded:
    """Hugging Face GPT-2 weights (a hub name, folder or .safetensors, as --init_from takes them); no run
    behind them, so the config is the defaults with the weights' shape and tokenizer, in float32."""
    from weights import hf

    refuse_a_missing_local_name(source, hf.HUB_NAMES)
    pretrained = hf.load_pretrained(source)
    if pretrained.tokenizer is None:
        raise HFError(f"{source}: no tokenizer for a vocabulary of {pretrained.config.vocab_size} ({NO_TOKENIZER})")
    model = GPT(pretrained.config)
    model.load_state_dict(pretrained.state)
    cfg = adopt(TrainConfig(block_size=pretrained.config.block_size), pretrained)
    return Loaded(model.to(device).eval(), tokenizer_from_meta(pretrained.tokenizer, data_dir), cfg, "float32", source,
                  None, math.nan)


def add_weights_flags(parser: argparse.ArgumentParser) -> None:
    """--ckpt or --init_from: where the weights come from (sample.py's, scripts/eval.py's, harness.py's)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--ckpt", default="", help="checkpoint file or run folder (default: newest out/**/best.pt)")
    source.add_argument("--init_from", "--init-from", default="",
                        help="pretrained weights instead: gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a "
                             "folder / .safetensors in the Hugging Face GPT-2 layout")


def from_flags(args: argparse.Namespace, device: torch.device = CPU) -> Loaded:
    """The weights that add_weights_flags' flags chose: --init_from's, else --ckpt's checkpoint (find_checkpoint)."""
    if args.init_from:
        return from_pretrained(args.init_from, device)
    return from_checkpoint(find_checkpoint(args.ckpt), device)


# ----------------------------------------------------------------------------- what a run starts from
def start_from(cfg: TrainConfig, device: torch.device = CPU) -> tuple[TrainConfig, Pretrained | None]:
    """train.py's --init_from: the weights it names, and the config with the options they fix (adopt); without
    init_from (cfg, None). Rank 0 reads (or downloads) them first, the other ranks then from its cache."""
    if not cfg.init_from:
        return cfg, None
    with distributed.main_first(device):
        pretrained = load_base(cfg)
        cfg = adopt(cfg, pretrained)
        model = describe(model_config(cfg, pretrained.config.vocab_size))
        print0(f"init_from {pretrained.source}: {model}; tokenizer {cfg.tokenizer}; block_size {cfg.block_size} of "
               f"{pretrained.n_positions} positions")
    return cfg, pretrained


def run_checkpoint(source: str) -> Path | None:
    """The checkpoint ``source`` names if it is a run of this repo: a .pt, a folder's best.pt (else last.pt); else
    None (a Hugging Face folder, a .safetensors file or a hub name)."""
    path = Path(source)
    if path.is_dir():
        return next((path / name for name in RUN_FILES if (path / name).is_file()), None)
    return path if path.suffix == ".pt" else None


def load_base(cfg: TrainConfig) -> Pretrained:
    """The weights ``cfg.init_from`` names, at the given block_size else at all their positions (one rule for a run
    and a Hugging Face folder: our export of a run is the run): a run's; or GPT-2's, with biases unless bias=False is
    given (a bias-free export's zeros)."""
    given, path = given_fields(cfg), run_checkpoint(cfg.init_from)
    block_size = cfg.block_size if "block_size" in given else 0  # 0: every position the weights have
    if path is not None:
        return load_run(path, block_size)
    from weights import hf

    refuse_a_missing_local_name(cfg.init_from, hf.HUB_NAMES)
    return hf.load_pretrained(cfg.init_from, block_size, cfg.bias if "bias" in given else True)


def refuse_a_missing_local_name(source: str, hub_names: Mapping[str, str]) -> None:
    """CheckpointError for weights named by a path that is not there: one close to a run folder ("did you mean
    out/small?"), or one that looks like a path (./x, /x, x.pt, a/b/c, out/x where out/ is here, a bare name that no
    hub name is). Anything else may be a hub repo, "owner/name": hf.locate asks the hub, whose refusal is a
    paragraph about downloading (what `out/smal`, a typo, got)."""
    path = Path(source)
    if source in hub_names or path.exists():
        return
    runs = sorted(set(run_folders(path.parent) + run_folders(Path("out"))))  # beside it, and where train.py writes
    close = difflib.get_close_matches(str(path), runs, n=1, cutoff=0.85)
    if close:
        raise CheckpointError(f"{source}: no such run folder (did you mean {close[0]}?)")
    parts = path.parts
    if (source.startswith(("/", ".", "~")) or path.suffix in (".pt", ".safetensors") or len(parts) != 2
            or Path(parts[0]).is_dir()):
        raise CheckpointError(f"{source}: no such run folder or file; pass a run folder (out/NAME), its .pt, a "
                              "folder or .safetensors in the Hugging Face GPT-2 layout, or a hub name "
                              f"({', '.join(hub_names)} or OWNER/NAME)")


def run_folders(folder: Path) -> list[str]:
    """The runs in ``folder``: each subfolder holding a checkpoint of ours or Hugging Face weights, as a path."""
    try:
        return [str(sub) for sub in sorted(folder.iterdir())
                if any((sub / name).is_file() for name in (*RUN_FILES, "model.safetensors"))]
    except OSError:  # no such folder, or one we may not read: no runs to suggest
        return []


def load_run(path: Path, block_size: int) -> Pretrained:
    """A run's weights, model options and tokenizer (from_checkpoint: a LoRA run's merged); block_size crops."""
    from weights.hf import Pretrained, check_positions

    loaded = from_checkpoint(path)
    saved, state = loaded.model.config, loaded.model.state_dict()
    config = replace(saved, block_size=check_positions(block_size, saved.block_size, str(path)))
    if "transformer.wpe.weight" in state:
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][: config.block_size]  # (T, C)
    return Pretrained(config, state, str(path), loaded.tokenizer.meta(), saved.block_size)


def adopt(cfg: TrainConfig, base: Pretrained) -> TrainConfig:
    """The config with every option the base's weights fix, and its tokenizer if known; block_size the base's unless
    given. A field the user gave (preset or command line, even at its default: config.given_fields) with another
    value is refused. A run's weights fix every option but the training-only ones; GPT-2's their shape (hf.IMPORTED),
    and every other option must be one GPT-2 computes (hf.gpt2_refusals)."""
    from weights import hf

    kept = ("vocab_size", "block_size", *GPTConfig.TRAINING_ONLY)  # the corpus's, the user's, how it is trained
    fixed = hf.IMPORTED if base.gpt2 else [f.name for f in fields(GPTConfig) if f.name not in kept]
    imported = {name: getattr(base.config, name) for name in fixed}
    if base.tokenizer is not None:
        imported["tokenizer"] = base.tokenizer["kind"]
    given = given_fields(cfg)
    for name, value in imported.items():
        if name in given and getattr(cfg, name) != value:
            raise HFError(f"--{name} {flag_value(getattr(cfg, name))} conflicts with {base.source}, whose weights have "
                          f"{name} {flag_value(value)}; drop --{name} (or that key from the preset): with --init_from "
                          "the weights fix the model")
    block_size = cfg.block_size if "block_size" in given else base.config.block_size
    adopted = replace(cfg, **imported, block_size=block_size)
    refusals = hf.gpt2_refusals(model_config(adopted, base.config.vocab_size)) if base.gpt2 else []
    if refusals:
        raise HFError(f"{base.source} holds GPT-2 weights, which cannot run with {refusals[0]}; drop that option "
                      "or train from scratch without --init_from")
    return adopted


def flag_value(value: Any) -> str:
    """A value as it is typed on the command line: false, not False."""
    return str(value).lower() if isinstance(value, bool) else str(value)
