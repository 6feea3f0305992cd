"""Full fine-tuning against LoRA on one shape: ms/step, trainable parameters, optimizer-state and checkpoint bytes.

    python -m dev.bench_lora                                # the `small` preset, LoRA rank 8 on attn.c_attn
    python -m dev.bench_lora --rank 4 --targets attn.c_attn,mlp.c_fc --steps 60 --data_path corpus.txt

Both runs are built by train.build_run from the preset (its optimizer, precision and threads: runtime.choose_runtime),
one with lora_rank set, and step through train.train_step, in alternating blocks so that load from other
processes falls on both alike; the medians are reported. The base is the preset's model at its random init: speed
and sizes do not depend on the weights. The checkpoint is the last.pt that training/checkpoint.Checkpointer writes.
"""
from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from config import CommandLine, ConfigError, TrainConfig, make_config
from training.checkpoint import Checkpointer
from process.distributed import Dist
from process.errors import TinyGPTError, exit_on
from training.runtime import choose_runtime
from train import Run, build_run, get_lr, train_step
from training.tracking import summary

BLOCK = 5  # steps per alternating block
WARMUP = 3  # steps per run before timing: allocator and kernels warm


def build(cfg: TrainConfig) -> Run:
    """The run train.py would build (no init_from import: a random base, see the docstring)."""
    return build_run(cfg, choose_runtime(cfg))


def step_ms(run: Run, step: int) -> float:
    """One train.py step of ``run`` (numbered ``step``), in milliseconds."""
    batches = [run.stream.next() for _ in range(run.cfg.grad_accum)]
    start = time.perf_counter()
    losses, _ = train_step(run, run.model, batches, step, get_lr(step - 1, run.cfg))
    losses.loss_sum.item()  # a sync: the step has finished
    return 1000 * (time.perf_counter() - start)


def state_bytes(state: object) -> int:
    """Bytes of every tensor in a nested state_dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def checkpoint_bytes(run: Run, step: int) -> int:
    """Size of the last.pt the run's Checkpointer writes now."""
    with tempfile.TemporaryDirectory() as folder:
        Checkpointer(Path(folder), run.cfg, run, Dist(device=run.rt.device)).save(step, 0.0, math.inf)
        return (Path(folder) / "last.pt").stat().st_size


def measure(runs: dict[str, Run], steps: int) -> dict[str, list[float]]:
    """ms of each timed step per run, the runs alternating every BLOCK steps."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    done = dict.fromkeys(runs, 0)
    for name, run in runs.items():
        for _ in range(WARMUP):
            done[name] += 1
            step_ms(run, done[name])
    while any(len(t) < steps for t in times.values()):
        for name, run in runs.items():
            for _ in range(min(BLOCK, steps - len(times[name]))):
                done[name] += 1
                times[name].append(step_ms(run, done[name]))
    return times


def report(runs: dict[str, Run], times: dict[str, list[float]]) -> None:
    rt = next(iter(runs.values())).rt
    print(f"device {rt.device}, {rt.dtype}, {rt.threads} threads; {summary(next(iter(runs.values())).model)}")
    print(f"{'run':<28} {'ms/step':>8} {'trainable':>10} {'optimizer state':>16} {'last.pt':>10}")
    for name, run in runs.items():
        trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        optimizer = state_bytes(run.optimizer.state_dict()["state"])
        print(f"{name:<28} {statistics.median(times[name]):8.1f} {trainable:10,d} {optimizer / 1e6:13.3f} MB "
              f"{checkpoint_bytes(run, len(times[name])) / 1e6:7.3f} MB")


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="small",
                        help="preset (config/NAME.toml) whose shape and optimizer both runs use")
    parser.add_argument("--rank", type=int, default=8, help="lora_rank")
    parser.add_argument("--alpha", type=float, default=16.0, help="lora_alpha")
    parser.add_argument("--targets", default="attn.c_attn", help="lora_targets (comma-separated)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (after warm-up)")
    parser.add_argument("--data_path", default="", help="a text file instead of the preset's corpus")
    args = parser.parse_args(argv)
    try:
        if args.rank < 1 or args.steps < 1:
            raise ConfigError(f"need --rank and --steps >= 1, got --rank {args.rank} --steps {args.steps}")
        common = {"data_path": args.data_path} if args.data_path else {}
        lora = dict(lora_rank=args.rank, lora_alpha=args.alpha, lora_targets=args.targets, init_from="(random base)")
        configs = {"full": make_config(args.config, **common),  # both checked before either is built
                   f"lora r{args.rank} {args.targets}": make_config(args.config, **common, **lora)}
        runs = {name: build(cfg) for name, cfg in configs.items()}
        times = measure(runs, args.steps)
    except TinyGPTError as err:  # one line and its exit code (process/errors.py)
        exit_on(err)
    report(runs, times)


if __name__ == "__main__":
    main()
