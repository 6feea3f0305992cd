"""Helpers that break a training run on purpose, at an exact point, and compare what survives.

Also a script, so a fresh process (or one DDP rank) can be broken the same way, from the repo root:
    python -m tests.fault_injection --signal SIGTERM --at-call 13 -- --config tiny --out_dir ...
"""
from __future__ import annotations

import argparse
import atexit
import errno
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import pytest
import torch

import checkpoint
import data
import runtime
import train
from cli import DataError, env_rank
from model import GPT

AS_A_SCRIPT = ("-m", "tests.fault_injection")  # python's arguments that run this file's main, from the repo root


def call_of(step: int, micro_batch: int, grad_accum: int) -> int:
    """The 1-based number of the training forward pass of ``micro_batch`` (1-based) in ``step``."""
    return (step - 1) * grad_accum + micro_batch


def on_training_forward(monkeypatch: pytest.MonkeyPatch,
                        hook: Callable[[int, torch.Tensor], torch.Tensor | None]) -> list[int]:
    """Call hook(call_number, loss_sum) in each training forward (a returned tensor replaces the loss); the calls."""
    real_forward = GPT.forward
    calls: list[int] = []

    def forward(self, idx, targets=None):
        if not (self.training and targets is not None):
            return real_forward(self, idx, targets)  # eval, sampling
        calls.append(len(calls) + 1)
        out = real_forward(self, idx, targets)
        replaced = hook(calls[-1], out.loss_sum)
        return out if replaced is None else out._replace(loss_sum=replaced)

    monkeypatch.setattr(GPT, "forward", forward)
    return calls


def signal_at(monkeypatch: pytest.MonkeyPatch, signum: int, call: int) -> list[int]:
    """Send ``signum`` to this process during the ``call``-th training forward pass."""
    return on_training_forward(monkeypatch, lambda n, loss: os.kill(os.getpid(), signum) if n == call else None)


def hang_at(monkeypatch: pytest.MonkeyPatch, call: int, ready: Path, timeout_s: float = 300.0) -> None:
    """In the ``call``-th training forward pass, create ``ready`` and wait (a live run, mid-step, to act on)."""
    def hook(n: int, loss_sum: torch.Tensor) -> None:
        if n == call:
            ready.touch()
            time.sleep(timeout_s)
    on_training_forward(monkeypatch, hook)


def linger_at_exit(until: Path, timeout_s: float = 60.0) -> None:
    """Hold this process in its shutdown until the file ``until`` exists: a window to send a signal into."""
    def wait() -> None:
        deadline = time.time() + timeout_s
        while not until.exists() and time.time() < deadline:
            time.sleep(0.01)

    atexit.register(wait)


def poison_loss(monkeypatch: pytest.MonkeyPatch, calls: Callable[[int], bool], value: float) -> list[int]:
    """Multiply the loss by ``value`` (nan, inf) on the training forward passes where calls(n) holds."""
    return on_training_forward(monkeypatch, lambda n, loss: loss * value if calls(n) else None)


def disk_full_from_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Checkpoint writes of ``step`` and later fail as on a full disk (ENOSPC), through the real save."""
    real_save = checkpoint.save_checkpoint

    def save(state: dict, path: Path) -> None:
        if state["step"] < step:
            return real_save(state, path)
        with mock.patch.object(torch, "save", side_effect=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))):
            real_save(state, path)

    monkeypatch.setattr(checkpoint, "save_checkpoint", save)


def corpus_unreadable_on_rank(monkeypatch: pytest.MonkeyPatch, broken: int) -> None:
    """load_corpus raises DataError on rank ``broken`` only (say, a node whose copy is damaged)."""
    real_load = data.load_corpus

    def load_corpus(folder, block_size):
        if env_rank() == broken:
            raise DataError(f"{folder}: unreadable on this rank (injected)")
        return real_load(folder, block_size)

    monkeypatch.setattr(data, "load_corpus", load_corpus)


def bf16_fast_on_rank(monkeypatch: pytest.MonkeyPatch, fast: int) -> None:
    """The dtype=auto CPU probe finds bf16 4x faster on rank ``fast`` and 4x slower on the others."""
    def matmul_gflops(m, k, n, dtype=torch.float32, **kwargs) -> float:
        if dtype == torch.float32:
            return 100.0
        return 400.0 if env_rank() == fast else 25.0

    monkeypatch.setattr(runtime, "matmul_gflops", matmul_gflops)


def record_precisions(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The precisions of this process's forward passes (the dtype train.py hands torch.autocast), filled as they run."""
    seen: set[str] = set()
    real_autocast = torch.autocast

    def autocast(device_type, dtype=None, **kwargs):
        seen.add(str(dtype).removeprefix("torch."))
        return real_autocast(device_type, dtype=dtype, **kwargs)

    monkeypatch.setattr(torch, "autocast", autocast)
    return seen


def capture_run(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """After train() runs (or fails), holds its 'model' and 'optimizer' objects."""
    captured: dict[str, Any] = {}
    real = train.build_optimizer

    def build_optimizer(model, *args, **kwargs):
        captured["model"], captured["optimizer"] = model, real(model, *args, **kwargs)
        return captured["optimizer"]

    monkeypatch.setattr(train, "build_optimizer", build_optimizer)
    return captured


def floating_tensors(value: Any) -> list[torch.Tensor]:
    """Every floating-point tensor in a nested dict/list (a state dict, a checkpoint)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return [t for item in values for t in floating_tensors(item)]


def assert_nested_equal(a: Any, b: Any, where: str = "") -> None:
    """Exact equality of nested dicts/lists of tensors and plain values (NaN equals NaN)."""
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert_nested_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_nested_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), f"{where}: nan vs {b}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def assert_same_training_state(a: dict, b: dict) -> None:
    """Two checkpoints hold the same run state: all but the config, the versions and the wall clock."""
    ignored = ("config", "versions", "time_s")
    assert_nested_equal({k: v for k, v in a.items() if k not in ignored},
                        {k: v for k, v in b.items() if k not in ignored})


class StepClock:
    """A wall clock that moves only when the run does: ``time()`` reads it, the run's steps and evals move it."""
    now = 1_000_000.0  # a power-of-two step size keeps every reading exact: 0.25 * 12 == 3.0

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str):  # the rest of the time module as it is
        return getattr(time, name)


def step_clock(monkeypatch: pytest.MonkeyPatch, step_s: float, eval_s: float = 0.0) -> StepClock:
    """train.py's clock, where each optimizer step takes ``step_s`` seconds and each eval ``eval_s``: a time budget
    then ends at the same step on any machine (a real clock raced)."""
    clock = StepClock()
    real_step, real_evaluate = train.optimizer_step, train.evaluate

    def optimizer_step(*args, **kwargs):
        norm = real_step(*args, **kwargs)
        clock.now += step_s
        return norm

    def evaluate(*args, **kwargs):
        result = real_evaluate(*args, **kwargs)
        clock.now += eval_s
        return result

    monkeypatch.setattr(train, "time", clock)
    monkeypatch.setattr(train, "optimizer_step", optimizer_step)
    monkeypatch.setattr(train, "evaluate", evaluate)
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description="Run train.py's main with a fault injected.")
    parser.add_argument("--signal", default="SIGTERM", help="signal name")
    parser.add_argument("--at-call", type=int, help="training forward pass to send --signal in")
    parser.add_argument("--signal-rank", type=int, help="send --signal on this rank only (default: every rank)")
    parser.add_argument("--hang-at-call", type=int, help="in this training forward pass, touch --ready and wait")
    parser.add_argument("--ready", type=Path, help="the file --hang-at-call creates once it waits")
    parser.add_argument("--disk-full-from-step", type=int, help="checkpoint writes fail from this step on")
    parser.add_argument("--corpus-unreadable-on-rank", type=int, help="this rank cannot load the corpus")
    parser.add_argument("--bf16-fast-on-rank", type=int, help="the dtype=auto probe favours bf16 on this rank only")
    parser.add_argument("--precisions-to", type=Path, help="write this rank's forward precisions to DIR/rank<R>.json")
    parser.add_argument("--linger-until", type=Path, help="at exit, wait until this file exists (to signal into)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    with pytest.MonkeyPatch.context() as monkeypatch:
        if args.at_call is not None and args.signal_rank in (None, env_rank()):
            signal_at(monkeypatch, signal.Signals[args.signal], args.at_call)
        if args.hang_at_call is not None:
            hang_at(monkeypatch, args.hang_at_call, args.ready)
        if args.linger_until is not None:
            linger_at_exit(args.linger_until)
        if args.disk_full_from_step is not None:
            disk_full_from_step(monkeypatch, args.disk_full_from_step)
        if args.corpus_unreadable_on_rank is not None:
            corpus_unreadable_on_rank(monkeypatch, args.corpus_unreadable_on_rank)
        if args.bf16_fast_on_rank is not None:
            bf16_fast_on_rank(monkeypatch, args.bf16_fast_on_rank)
        precisions = record_precisions(monkeypatch) if args.precisions_to is not None else set()
        try:
            train.main([a for a in args.train_args if a != "--"])
        finally:
            if args.precisions_to is not None:
                (args.precisions_to / f"rank{env_rank()}.json").write_text(json.dumps(sorted(precisions)))


if __name__ == "__main__":
    main()
