"""How a training run stops when something goes wrong: signals and non-finite numbers.

A stop is an errors.RunStopped carrying its exit code (process/errors.py defines every code, the one
place they are). ``run_error`` names the two endings only a run has, Ctrl-C before its first step and a
peer rank lost mid-collective, so that train.py ends through errors.exit_for like every entry point.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

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


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step() honours a ``found_inf`` tensor (1.0: make this update a no-op on the device).

    torch's fused optimizers do (they say so with ``_step_supports_amp_scaling``, GradScaler's hook), and
    so do optim.Muon and optim.MuonAdamW (``skips_on_found_inf``); a plain step() does not.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False) or getattr(optimizer, "skips_on_found_inf", False))


class NonFiniteGuard:
    """Keeps NaN/inf out of the weights without a host sync per step, for any torch.optim.Optimizer.

    fp32/bf16: from the first step whose loss or gradient norm is not finite (``check``), every update
    is a no-op *on the device* (``skip_if_faulty`` around optimizer.step()). The host reads the verdict
    only where the loop syncs anyway (log lines, evals, saves) and stops there, weights and optimizer
    state being those before the bad step. Cost: two isfinite ops per step, and up to log_interval - 1
    wasted steps after a fault; checking every step instead would cost a sync per step on CUDA, which
    stalls the host's run-ahead (the data loading and kernel launches of the next step).
    How the update becomes a no-op depends on the optimizer (skips_on_device):
      - fused torch optimizers, optim.Muon and optim.MuonAdamW get the verdict as ``found_inf``, the hook
        GradScaler uses to skip a step (fused AdamW also undoes its step count);
      - any other (a plain step(): torch's SGD, a hand-written Lion, anything on MPS) steps as usual, and
        the guard then puts back copies of the weights and of the optimizer's tensor state taken just
        before, where the verdict says so (torch.where: no host read). That costs one copy of both per
        step; ``note`` says so once at start. Non-tensor state (a Python int step count) is not put back,
        nor is state that a faulty *first* update created; the run stops at the next sync regardless,
        and nothing a fault touched is ever saved (Checkpointer.save checks first).

    fp16: GradScaler skips a step whose gradients overflow and halves its scale (its normal way of
    finding the scale). The guard counts consecutive skips on the device and stops the run at the next
    sync once ``max_skipped`` are reached: a scale fallen by 2**max_skipped means the model diverged.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, max_skipped: int,
                 device: torch.device):
        self.scaler, self.max_skipped = scaler, max_skipped
        self.on_device = skips_on_device(optimizer)
        self.bad_step = torch.full((), -1, dtype=torch.long, device=device)  # first faulty step; -1 = none
        self.skipped = torch.zeros((), dtype=torch.long, device=device)  # fp16: consecutive skips so far
        self.note = None if self.on_device or scaler.is_enabled() else (
            f"note: {type(optimizer).__name__} has no found_inf hook (skips_on_device): each step keeps a copy of "
            "the weights and optimizer state to undo a non-finite update without a host sync")

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Record on the device whether ``step`` (numbered as in the log) is faulty: no host sync."""
        if self.scaler.is_enabled():  # fp16: GradScaler decides on the (unscaled) gradients, as we do
            self.skipped = (self.skipped + 1) * ~torch.isfinite(grad_norm)  # back to 0 on a good step
            self.record(step, self.skipped >= self.max_skipped)
            return
        self.record(step, ~(torch.isfinite(loss) & torch.isfinite(grad_norm)))

    @contextlib.contextmanager
    def skip_if_faulty(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Around optimizer.step(): the update is a no-op on the device once a fault has been recorded."""
        if self.scaler.is_enabled():  # fp16: GradScaler skips overflowed steps itself, and check() counts them
            yield
            return
        faulty = self.bad_step >= 0  # a device bool: never read here
        if self.on_device:
            optimizer.found_inf = faulty.float()  # 1.0 makes the update a no-op
            try:
                yield
            finally:
                del optimizer.found_inf
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        before = {p: (p.detach().clone(), {k: v.clone() for k, v in optimizer.state[p].items()
                                          if isinstance(v, torch.Tensor)}) for p in params}
        yield
        with torch.no_grad():
            for p, (weight, state) in before.items():
                p.copy_(torch.where(faulty, weight, p))
                for key, old in state.items():
                    optimizer.state[p][key] = torch.where(faulty, old, optimizer.state[p][key])

    def record(self, step: int, faulty: torch.Tensor) -> None:
        self.bad_step = torch.where((self.bad_step < 0) & faulty, step, self.bad_step)

    def raise_if_weights_not_finite(self, model: torch.nn.Module, step: int) -> None:
        """Stop before a save if any weight is not finite: an update that overflowed (a finite loss and gradient,
        times a huge lr) is the one fault check() cannot see before it is applied. One host read: saves only."""
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
        raise RunStopped(f"non-finite loss or gradient at step {bad_step}; stopped before its update, nothing "
                         "non-finite was applied or saved; lower learning_rate or check the data", EXIT_NONFINITE)


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
