"""A model for use, from a run's checkpoint or from pretrained weights: the one place a model comes back.

    loaded = from_checkpoint(find_checkpoint("out/small"))   # a run folder's best.pt (else last.pt), or a .pt
    loaded = from_pretrained("gpt2")                          # Hugging Face GPT-2 weights (weights/hf.py)
    loaded = load_weights(args, device)                       # whichever --ckpt / --init_from chose

Both ways give a ``Loaded``: the model in eval mode on the device asked for, its tokenizer, the
training config it belongs to, and what the run logged (step, best val loss, precision). sample.py,
scripts/eval.py, harness.py, export_hf.py, compare.py and dev/bench_sample.py load through here, and
the flags that choose the weights are declared once (add_weights_flags). ``from_checkpoint`` needs
nothing of the entry points, so training code can call it too (a run that starts from another's weights).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from config import TrainConfig, config_from_dict, model_config
from weights import hf
from training import lora
from training.checkpoint import load_checkpoint
from process.errors import CheckpointError, HFError
from weights.hf import fit_vocab
from prepare.tokenizers import NO_TOKENIZER, tokenizer_from_meta
from model import GPT, GPTConfig

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Loaded:
    """A model ready for use and what its callers need to know about it."""
    model: GPT  # in eval mode, on the device asked for
    tokenizer: Any  # prepare.tokenizers': char, GPT-2's or a BPE, from the checkpoint's description
    cfg: TrainConfig  # the run's config; pretrained weights: the defaults with the weights' shape (hf.adopt)
    precision: str  # the dtype the run trained in: float32, bfloat16, float16 (pretrained: float32)
    source: str  # the checkpoint file, or the pretrained weights as named (--init_from)
    step: int | None  # optimizer steps behind the weights; None: pretrained, no run of ours behind them
    best_val_loss: float  # as the run logged it; nan for pretrained weights


def find_checkpoint(ckpt: str) -> Path:
    """A file as given; a folder's best.pt (else last.pt); by default the newest best.pt under out/."""
    if ckpt:
        path = Path(ckpt)
        if path.is_dir():
            for name in ("best.pt", "last.pt"):
                if (path / name).is_file():
                    return path / name
            raise CheckpointError(f"{path}: no best.pt or last.pt in this folder")
        return path
    found = sorted(Path("out").glob("**/best.pt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise CheckpointError("no checkpoint found under out/; train one first: python train.py --config small")
    return found[-1]


def from_checkpoint(path: Path, device: torch.device = CPU) -> Loaded:
    """The weights, config and tokenizer of a checkpoint file (verified: checkpoint.load_checkpoint). A LoRA run's
    holds only its adapters: they go on the base it was trained from (init_from, checked by fingerprint), merged."""
    state = load_checkpoint(path)  # to CPU: the optimizer state it also holds never needs the GPU
    cfg = config_from_dict(state["config"])
    tokenizer = tokenizer_from_meta(state["tokenizer"], Path(cfg.data_dir))
    model = GPT(model_config(cfg, tokenizer.vocab_size))
    if "lora" in state:
        model.load_state_dict(base_weights(cfg).weights_for(state["tokenizer"], tokenizer.vocab_size))
        model = lora.load_adapted(state, model, str(path))
    else:
        model.load_state_dict(state["model"])
    return Loaded(model.to(device).eval(), tokenizer, cfg, state["precision"], str(path), state["step"],
                  state["best_val_loss"])


# ----------------------------------------------------------------------------- what a fine-tune starts from
RUN_FILES = ("best.pt", "last.pt")  # a run folder's weights, in order of preference


def run_checkpoint(source: str) -> Path | None:
    """The checkpoint ``source`` names if it is a run of this repo (a .pt, or a folder holding best.pt or
    last.pt), else None: a Hugging Face folder, a .safetensors file or a hub name."""
    path = Path(source)
    if path.suffix == ".pt":
        return path
    return next((path / name for name in RUN_FILES if (path / name).is_file()), None) if path.is_dir() else None


@dataclass
class RunWeights:
    """A run's weights, ready for a model of the corpus's vocabulary (weights_for), like hf.Pretrained's."""
    config: GPTConfig
    state: dict[str, torch.Tensor]
    source: str
    tokenizer: dict  # the run's tokenizer description (checkpoint["tokenizer"])

    def weights_for(self, tokenizer_meta: dict, vocab_size: int) -> dict[str, torch.Tensor]:
        return fit_vocab(self.state, self.tokenizer, tokenizer_meta, vocab_size, self.source)


def load_run(path: Path, block_size: int) -> RunWeights:
    """A run's weights, its model options and tokenizer (loading.from_checkpoint); block_size crops positions."""
    loaded = from_checkpoint(path)  # a LoRA run as a base: merged
    saved = loaded.model.config
    if block_size > saved.block_size:
        raise HFError(f"block_size {block_size} exceeds the {saved.block_size} positions of {path}; use "
                      f"--block_size {saved.block_size} or less")
    config = GPTConfig(**{**saved.__dict__, "block_size": block_size or saved.block_size})
    weights = loaded.model.state_dict()
    if "transformer.wpe.weight" in weights:
        weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][: config.block_size]  # (T, C)
    return RunWeights(config, weights, str(path), loaded.tokenizer.meta())


def base_weights(cfg: TrainConfig):
    """The weights ``cfg.init_from`` names, as a fine-tune starts from them: a run's (RunWeights) or GPT-2's
    (hf.Pretrained), each with ``weights_for(tokenizer, vocab_size)``."""
    path = run_checkpoint(cfg.init_from)
    return load_run(path, cfg.block_size) if path else hf.load_pretrained(cfg.init_from, cfg.block_size, cfg.bias)


def from_pretrained(source: str, device: torch.device = CPU, data_dir: Path = Path("data")) -> Loaded:
    """Hugging Face GPT-2 weights (a hub name, folder or .safetensors, as --init_from takes them); no run
    behind them, so the config is the defaults with the weights' shape and tokenizer, in float32."""
    pretrained = hf.load_pretrained(source)
    if pretrained.tokenizer is None:
        raise HFError(f"{source}: no tokenizer for a vocabulary of {pretrained.config.vocab_size} ({NO_TOKENIZER})")
    tokenizer = tokenizer_from_meta(pretrained.tokenizer, data_dir)
    model = GPT(pretrained.config)
    model.load_state_dict(pretrained.state)
    cfg = hf.adopt(TrainConfig(block_size=pretrained.config.block_size), pretrained.config, pretrained.tokenizer,
                   source)
    return Loaded(model.to(device).eval(), tokenizer, cfg, "float32", source, None, math.nan)


# ----------------------------------------------------------------------------- the command line
def add_weights_flags(parser: argparse.ArgumentParser) -> None:
    """--ckpt or --init_from: where the weights come from (sample.py's, scripts/eval.py's, harness.py's)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--ckpt", default="", help="checkpoint file or run folder (default: newest out/**/best.pt)")
    source.add_argument("--init_from", "--init-from", default="",
                        help="pretrained weights instead: gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a "
                             "folder / .safetensors in the Hugging Face GPT-2 layout")


def load_weights(args: argparse.Namespace, device: torch.device = CPU) -> Loaded:
    """The weights that add_weights_flags' flags chose: --init_from's, else --ckpt's checkpoint (find_checkpoint)."""
    if args.init_from:
        return from_pretrained(args.init_from, device)
    return from_checkpoint(find_checkpoint(args.ckpt), device)
