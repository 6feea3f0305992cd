"""Train a GPT: the textbook loop, done right.

    python train.py --config small              # char-level Shakespeare on a laptop CPU, minutes
    python train.py --config small --resume     # continue exactly where the last run stopped
    python train.py --help                      # every config field with its default

Reads top to bottom: config -> data -> model -> optimizer -> (resume) -> loop -> final eval.
Side concerns live in helpers: checkpoint.py (atomic save / verified load / RNG state),
runtime.py (device, precision, compile), data.py (corpus, batches), MetricsLog below.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from checkpoint import (CheckpointError, capture_rng, library_versions, load_checkpoint,
                        remove_stale_temp_files, restore_rng, save_checkpoint, FORMAT_VERSION)
from config import ConfigError, TrainConfig, as_dict, changed_model_fields, parse_args
from data import DataError, get_batch, iterate_windows, load_corpus, prepare, val_windows
from model import GPT, GPTConfig
from runtime import autocast, compile_or_eager, fail, pick_device, pick_dtype, seed_everything, want_compile


def get_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to learning_rate, cosine down to min_lr at lr_decay_iters, then flat.

    A pure function of the step, so a resumed run follows exactly the same schedule.
    """
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / cfg.warmup_iters
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)  # 0 -> 1
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def model_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x_val: torch.Tensor, y_val: torch.Tensor, batch_size: int,
             device: torch.device, dtype: torch.dtype) -> float:
    """Token-weighted mean loss over the fixed val windows, in eval mode; train mode restored after.

    Dropout is off in eval mode, so evaluation draws from no random stream at all.
    """
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), torch.zeros((), device=device, dtype=torch.long)
    for x, y in iterate_windows(x_val, y_val, batch_size, device):
        with autocast(device, dtype):
            _, loss_sum, n = model(x, y)
        total += loss_sum.float()
        count += n
    model.train(was_training)
    return (total / count).item()


class MetricsLog:
    """Prints log lines and appends JSON records to out_dir/metrics.jsonl (and wandb if enabled)."""

    def __init__(self, out_dir: Path, cfg: TrainConfig):
        self.file = open(out_dir / "metrics.jsonl", "a", buffering=1)
        self.wandb = start_wandb(cfg) if cfg.wandb else None

    def log(self, record: dict[str, Any], line: str) -> None:
        print(line, flush=True)
        self.file.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def start_wandb(cfg: TrainConfig):
    try:
        import wandb
    except ImportError:
        raise ConfigError("--wandb needs the wandb package: pip install wandb") from None
    if not os.environ.get("WANDB_API_KEY") and not wandb.api.api_key:
        os.environ.setdefault("WANDB_MODE", "offline")  # never block on a login prompt
    return wandb.init(project=cfg.wandb_project, config=as_dict(cfg), dir=cfg.out_dir)


def checkpoint_state(model: GPT, optimizer, scaler, step: int, best_val: float, cfg: TrainConfig,
                     tokenizer_meta: dict, data_gen: torch.Generator) -> dict[str, Any]:
    """Everything a resume needs; built from the uncompiled model so keys carry no _orig_mod."""
    return {"format_version": FORMAT_VERSION, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "step": step,
            "best_val_loss": best_val, "config": as_dict(cfg), "tokenizer": tokenizer_meta,
            "rng": capture_rng(data_gen), "versions": library_versions()}


def resume(path: Path, cfg: TrainConfig, tokenizer_meta: dict, model: GPT, optimizer, scaler,
           data_gen: torch.Generator) -> tuple[int, float]:
    """Load last.pt into the run; refuse a checkpoint of another shape or tokenizer."""
    state = load_checkpoint(path)
    differences = changed_model_fields(state["config"], cfg)
    if state["tokenizer"] != tokenizer_meta:
        differences.append("tokenizer vocabulary differs from the current corpus")
    if differences:
        raise CheckpointError(f"{path} was trained with a different model: " + "; ".join(differences)
                              + ". Use the same settings or a new --out_dir")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    restore_rng(state["rng"], data_gen)
    print(f"resumed from {path} at step {state['step']} (best val loss {state['best_val_loss']:.4f})")
    return state["step"], state["best_val_loss"]


def train(cfg: TrainConfig) -> float:
    """Run training as configured; returns the final val loss."""
    out_dir = Path(cfg.out_dir)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device, (cfg.batch_size * cfg.block_size, cfg.n_embd, 4 * cfg.n_embd))
    seed_everything(cfg.seed)
    # --- data
    corpus = load_corpus(prepare(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction),
                         cfg.block_size)
    x_val, y_val = val_windows(corpus.val, cfg.block_size, cfg.eval_tokens)
    data_gen = torch.Generator().manual_seed(cfg.seed)  # the only source of the data order
    # --- model and optimizer
    model = GPT(model_config(cfg, corpus.vocab_size)).to(device)
    optimizer = model.configure_optimizer(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 only
    step, best_val = 0, math.inf
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out_dir)
    if cfg.resume:
        step, best_val = resume(out_dir / "last.pt", cfg, corpus.meta["tokenizer"], model, optimizer,
                                scaler, data_gen)
    else:
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)

    def probe(m):  # one forward/backward so that compile errors surface here, not mid-run
        _, loss, n = m(*get_batch(corpus.train, 1, cfg.block_size, torch.Generator(), device))
        (loss / n).backward()

    train_model = compile_or_eager(model, want_compile(cfg.compile, device), probe)
    print(f"device {device}, dtype {str(dtype).removeprefix('torch.')}, compile {train_model is not model}, "
          f"{model.num_params() / 1e6:.2f}M params, {cfg.tokens_per_step():,} tokens/step, "
          f"vocab {corpus.vocab_size}, out_dir {out_dir}")
    log = MetricsLog(out_dir, cfg)
    params = [p for p in model.parameters()]
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    t_start = t_log = time.time()
    step_at_log, val_loss = step, math.nan

    def save(step: int, is_best: bool) -> None:
        state = checkpoint_state(model, optimizer, scaler, step, best_val, cfg, corpus.meta["tokenizer"], data_gen)
        save_checkpoint(state, out_dir / "last.pt")
        if is_best:
            save_checkpoint(state, out_dir / "best.pt")

    while step < cfg.max_iters:
        lr = get_lr(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # Normalise by the target count of the *whole* step, so the accumulated gradient equals
        # the gradient of one big batch even when micro-batches count different token numbers.
        batches = [get_batch(corpus.train, cfg.batch_size, cfg.block_size, data_gen, device)
                   for _ in range(cfg.grad_accum)]
        n_step = sum((y != -1).sum() for _, y in batches)  # tensor: no host sync
        loss_step = torch.zeros((), device=device)
        for x, y in batches:
            with autocast(device, dtype):
                _, loss_sum, _ = train_model(x, y)
            scaler.scale(loss_sum / n_step).backward()
            loss_step += loss_sum.detach()
        scaler.unscale_(optimizer)  # no-op unless fp16; clipping must see the true gradients
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # pre-clip norm, a tensor
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        out_of_time = cfg.max_time > 0 and time.time() - t_start >= cfg.max_time
        last = step == cfg.max_iters or out_of_time
        if step % cfg.log_interval == 0 or last:  # the only place a training step syncs
            loss = (loss_step / n_step).item()
            now = time.time()
            dt = (now - t_log) / (step - step_at_log)
            tok_s = cfg.tokens_per_step() / dt
            t_log, step_at_log = now, step
            log.log({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm.item(),
                     "tokens_per_s": tok_s, "time_s": now - t_start},
                    f"step {step:>6} | loss {loss:.4f} | lr {lr:.2e} | grad norm {grad_norm.item():.3f} | "
                    f"{dt * 1000:.1f} ms/step | {tok_s:,.0f} tok/s")
        if step % cfg.eval_interval == 0 or last:
            t_eval = time.time()
            val_loss = evaluate(train_model, x_val, y_val, cfg.batch_size, device, dtype)
            is_best = math.isfinite(val_loss) and val_loss < best_val
            best_val = val_loss if is_best else best_val
            log.log({"step": step, "val_loss": val_loss, "time_s": time.time() - t_start},
                    f"step {step:>6} | val loss {val_loss:.4f}" + (" (best, saved best.pt)" if is_best else ""))
            save(step, is_best)
            t_log += time.time() - t_eval  # eval and save time is not counted as training time
        if out_of_time:
            print(f"max_time {cfg.max_time:g}s reached at step {step}; stopped cleanly")
            break
    log.close()
    return val_loss


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = parse_args(argv)
        train(cfg)
    except (ConfigError, DataError, CheckpointError) as err:
        fail(str(err))


if __name__ == "__main__":
    main()
