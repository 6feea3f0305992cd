"""init_from: where a fresh run's weights come from. A run of this repo (its folder or a .pt) or GPT-2's weights
(weights/hf.py), then the vocabulary fitted to the corpus's: a chat corpus's role markers take new rows.

``--init_from out/small`` takes that run's shape, every option that changes what the weights compute (RoPE,
RMSNorm, ...), its tokenizer and its best weights (best.pt, else last.pt). A fresh run in another out_dir,
never a resume of that one: its optimizer, step and streams start anew. A flag the user gave that contradicts
the checkpoint is refused in one line; block_size may shrink (a learned position table is cropped).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from config import MODEL_OPTIONS, TrainConfig, config_from_dict, given_fields, model_config
from training.checkpoint import read_config
from process.distributed import print0
from process.errors import HFError
from weights.loading import load_run, run_checkpoint
from model import GPTConfig, describe

KEPT = ("block_size", *GPTConfig.TRAINING_ONLY)  # options a fine-tune chooses itself; every other is the base's


def adopt_run(cfg: TrainConfig, base: GPTConfig, tokenizer: dict, source: str) -> TrainConfig:
    """The config with the base run's model options and tokenizer; a given flag that contradicts them is refused."""
    imported = {name: getattr(base, name) for name in MODEL_OPTIONS if name not in KEPT}
    imported["tokenizer"] = tokenizer["kind"]
    given = given_fields(cfg)
    for name, value in imported.items():
        if name in given and getattr(cfg, name) != value:
            raise HFError(f"--{name} {getattr(cfg, name)} conflicts with {source}, a run with {name} {value}; drop "
                          f"--{name} (or that key from the preset): with --init_from the base fixes the model")
    block_size = cfg.block_size if "block_size" in given else base.block_size
    return dataclasses.replace(cfg, **imported, block_size=block_size)


def start_from(cfg: TrainConfig, out_dir: Path) -> tuple[TrainConfig, object]:
    """init_from for train.py: the config takes the base's shape; a fresh run also gets its weights.

    A resume takes the shape from the base again and imports nothing: last.pt has the weights (a LoRA run's
    last.pt holds only its adapters, so its resume imports the base again).
    """
    path = run_checkpoint(cfg.init_from)
    if path is None:
        from weights import hf

        return hf.start_from(cfg, out_dir)
    if cfg.resume and not cfg.lora_rank:  # last.pt has the weights; a LoRA run's only its adapters: import the base
        saved = read_config(path)
        if saved is None:
            raise HFError(f"{cfg.init_from}: cannot read the config of {path}, the base of this run")
        base = model_config(config_from_dict(saved), 1)
        return adopt_run(cfg, base, {"kind": saved["tokenizer"]}, cfg.init_from), None
    block_size = cfg.block_size if "block_size" in given_fields(cfg) else 0
    weights = load_run(path, block_size)
    cfg = adopt_run(cfg, weights.config, weights.tokenizer, str(path))
    print0(f"init_from {path}: {describe(model_config(cfg, weights.config.vocab_size))}; tokenizer {cfg.tokenizer}")
    return cfg, weights
