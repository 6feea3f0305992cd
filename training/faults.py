"""How a training run stops when something goes wrong: signals and non-finite numbers.

A stop is an errors.RunStopped carrying its exit code (process/errors.py defines every code, the one
place they are). ``run_error`` names the two endings only a run has, Ctrl-C before its first step and a
peer rank lost mid-collective, so that train.py ends through errors.exit_for like every entry point.
"""
from __future__ import annotations

import os
import signal
import threading

import torch

from process import distributed
from process.errors import EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_PEER_LOST, RunStopped, TinyGPTError


class StopOnSignal:
    """A context manager that turns SIGINT and SIGTERM into a request to stop after the current step.

    The loop checks ``requested`` after each optimizer step, saves last.pt and raises ``error()``.
    Later signals only print a note, so a second Ctrl-C cannot interrupt the save (SIGKILL can, and
    is harmless: saves are atomic). On exit the previous handlers come back, unless a stop was
    requested: then SIGINT and SIGTERM stay ignored, because the process is on its way out with
    130/143 and a supervisor's repeated SIGTERM during shutdown (torch's teardown takes ~0.7 s) would
    otherwise kill it by the signal (-15), which reads as a crash, not a preemption. (Footgun: an
    in-process caller that carries on after a stop must put its handlers back itself.) Outside the
    main thread Python cannot install handlers, so there it does nothing. Under DDP the ranks must
    agree on the step to stop at: all-reduce ``requested`` where the loop syncs anyway.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, install: bool = True) -> None:
        self.install = install  # False: a stand-in that never sees a signal (train() as a library)
        self.signum: int | None = None
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignal:
        if self.install and threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self.handle) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        # SIG_IGN, not our Python handler: CPython resets Python handlers to SIG_DFL early in interpreter
        # shutdown (_PySignal_Fini), before the modules, torch's included, are torn down; SIG_IGN stays.
        for signum, handler in self.previous.items():
            signal.signal(signum, signal.SIG_IGN if self.requested else handler)
        self.previous = {}

    def handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        first = self.signum is None
        self.signum = self.signum or signum  # the first decides the exit code: SIGTERM then Ctrl-C is still 143
        note = "finishing this step, then saving last.pt" if first else "already stopping; wait for the save"
        os.write(2, f"\n{name}: {note}\n".encode())  # os.write: print() is not reentrant in a handler

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def error(self, step: int) -> RunStopped:
        name = signal.Signals(self.signum).name
        return RunStopped(f"stopped by {name} after step {step}; last.pt holds it, continue with --resume",
                          128 + self.signum)


class NonFiniteGuard:
    """Stops a run at its first non-finite step without a host sync per step; nothing non-finite is ever saved.

    ``check`` records on the device the first step whose loss or gradient norm is not finite (two isfinite ops);
    the host reads that record only where the loop syncs anyway (log lines, evals, saves: ``raise_if_tripped``)
    and stops the run there, naming the step. The steps in between run on (at most log_interval - 1 of them),
    so the weights in memory may hold NaN when the run stops; a save checks first, so last.pt and best.pt hold
    the last finite state. Checking every step instead would cost a sync per step on CUDA, which stalls the
    host's run-ahead (the data loading and kernel launches of the next step).

    fp16: GradScaler skips a step whose gradients overflow and halves its scale (its normal way of finding the
    scale). The guard counts consecutive skips on the device and stops the run at the next sync once
    ``max_skipped`` are reached: a scale fallen by 2**max_skipped means the model diverged.
    """

    def __init__(self, scaler: torch.amp.GradScaler, max_skipped: int, device: torch.device):
        self.scaler, self.max_skipped = scaler, max_skipped
        self.bad_step = torch.full((), -1, dtype=torch.long, device=device)  # first faulty step; -1 = none
        self.skipped = torch.zeros((), dtype=torch.long, device=device)  # fp16: consecutive skips so far

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Record on the device whether ``step`` (numbered as in the log) is faulty: no host sync."""
        if self.scaler.is_enabled():  # fp16: GradScaler decides on the (unscaled) gradients, as we do
            self.skipped = (self.skipped + 1) * ~torch.isfinite(grad_norm)  # back to 0 on a good step
            faulty = self.skipped >= self.max_skipped
        else:
            faulty = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.bad_step = torch.where((self.bad_step < 0) & faulty, step, self.bad_step)

    def raise_if_weights_not_finite(self, model: torch.nn.Module, step: int) -> None:
        """Stop before a save if any weight is not finite: an update that overflowed (a finite loss and gradient,
        times a huge lr) is the one fault check() cannot see. One host read: saves only."""
        if not torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all():
            raise RunStopped(f"the weights are not finite after step {step} (an update overflowed them); stopped "
                             "before saving, so last.pt and best.pt hold the last finite state; lower learning_rate",
                             EXIT_NONFINITE)

    def raise_if_tripped(self) -> None:
        """Stop the run if a fault was recorded. Reads one device scalar: call it where the loop syncs."""
        bad_step = int(self.bad_step)
        if bad_step < 0:
            return
        if self.scaler.is_enabled():
            raise RunStopped(f"{self.max_skipped} steps in a row skipped for non-finite fp16 gradients "
                             f"(the last at step {bad_step}); lower learning_rate or use --dtype bfloat16",
                             EXIT_NONFINITE)
        raise RunStopped(f"non-finite loss or gradient at step {bad_step}; stopped at the next log step, before "
                         "anything non-finite was saved; lower learning_rate or check the data", EXIT_NONFINITE)


def run_error(err: BaseException) -> BaseException:
    """``err`` as train.py reports it: Ctrl-C before the first step, or a collective failing because a peer
    rank died, as the RunStopped it means (errors.exit_for then gives its line and code); any other as it is.

    A dead peer cannot say why, so every rank that notices says so, each naming itself (reporting_rank).
    """
    if isinstance(err, KeyboardInterrupt):  # before the first step: nothing to save yet
        return RunStopped("interrupted before training started; nothing was saved", EXIT_INTERRUPTED)
    reason = None if isinstance(err, TinyGPTError) else distributed.lost_peer(err)  # a refusal says its own line
    if reason is None:
        return err
    stopped = RunStopped(f"another rank died without a word (killed or crashed; gloo: {reason}), so this one "
                         "stops too; the last save is intact, continue with --resume", EXIT_PEER_LOST)
    stopped.reporting_rank = distributed.env_rank()
    return stopped
