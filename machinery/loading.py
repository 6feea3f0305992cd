"""A model for use, from a run's checkpoint or from pretrained weights: the one place a model comes back.

    loaded = from_checkpoint(find_checkpoint("out/small"))   # a run folder's best.pt (else last.pt), or a .pt
    loaded = from_pretrained("gpt2")                          # Hugging Face GPT-2 weights (machinery/hf.py)
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
from machinery import hf
from machinery.checkpoint import load_checkpoint
from machinery.errors import CheckpointError, HFError
from machinery.tokenizers import CHARS_FILE, GPT2_VOCAB, tokenizer_from_meta
from model import GPT

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Loaded:
    """A model ready for use and what its callers need to know about it."""
    model: GPT  # in eval mode, on the device asked for
    tokenizer: Any  # machinery.tokenizers': char, GPT-2's or a BPE, from the checkpoint's description
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
    """The weights, config and tokenizer of a checkpoint file (verified: checkpoint.load_checkpoint)."""
    state = load_checkpoint(path)  # to CPU: the optimizer state it also holds never needs the GPU
    cfg = config_from_dict(state["config"])
    tokenizer = tokenizer_from_meta(state["tokenizer"], Path(cfg.data_dir))
    model = GPT(model_config(cfg, tokenizer.vocab_size))
    model.load_state_dict(state["model"])
    return Loaded(model.to(device).eval(), tokenizer, cfg, state["precision"], str(path), state["step"],
                  state["best_val_loss"])


def from_pretrained(source: str, device: torch.device = CPU, data_dir: Path = Path("data")) -> Loaded:
    """Hugging Face GPT-2 weights (a hub name, folder or .safetensors, as --init_from takes them); no run
    behind them, so the config is the defaults with the weights' shape and tokenizer, in float32."""
    pretrained = hf.load_pretrained(source)
    if pretrained.tokenizer is None:
        raise HFError(f"{source}: no tokenizer for a vocabulary of {pretrained.config.vocab_size} (known: "
                      f"GPT-2's BPE, {GPT2_VOCAB} tokens, or a char list in {CHARS_FILE})")
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
