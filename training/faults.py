"""How a training run stops when asked or when something goes wrong: signals, a lost peer.

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

from process import distributed
from process.errors import EXIT_INTERRUPTED, EXIT_PEER_LOST, RunStopped, TinyGPTError


class StopOnSignal:
    """A context manager that turns SIGINT and SIGTERM into a request to stop after the current step.

    The loop checks ``requested`` after each optimizer step, saves last.pt and raises ``error()``. Later signals
    only print a note, so a second Ctrl-C cannot interrupt the save (SIGKILL can, harmlessly: saves are atomic).
    On exit the previous handlers come back, unless a stop was requested: then SIGINT and SIGTERM stay ignored,
    as the process is on its way out with 130/143 and a supervisor's repeated SIGTERM during shutdown (torch's
    teardown takes ~0.7 s) would kill it by the signal (-15), which reads as a crash, not a preemption (footgun:
    an in-process caller that carries on after a stop must put its handlers back itself). Outside the main thread
    it does nothing (Python cannot install handlers there). Under DDP the ranks agree on the step to stop at
    (distributed.agree).
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


@contextlib.contextmanager
def interrupt_until_the_loop() -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM raise KeyboardInterrupt (carrying ``signum``: run_error's exit code),
    until the loop's StopOnSignal takes them (and after it, unless it stopped the run: it then leaves them ignored).
    So whatever cleans up after a Ctrl-C (a prepare's staging folder, the run folder's lock) cleans up after a SIGTERM
    alike; without it a SIGTERM before the first step, what ``timeout``, schedulers and ``docker stop`` send, killed
    the process at once: exit 143, no line, and out_dir/.lock left behind. The first signal ignores both from then
    on, as StopOnSignal's does: the process is on its way out. On exit the previous handlers come back. Outside the
    main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame) -> None:
        for other in StopOnSignal.SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        stop = KeyboardInterrupt(signal.Signals(signum).name)
        stop.signum = signum
        raise stop

    previous = {signum: signal.signal(signum, interrupt) for signum in StopOnSignal.SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is interrupt:  # not ignored by a stop meanwhile
                signal.signal(signum, handler)


def run_error(err: BaseException) -> BaseException:
    """``err`` as train.py reports it: Ctrl-C before the first step, or a collective failing because a peer
    rank died, as the RunStopped it means (errors.exit_for then gives its line and code); any other as it is.

    A dead peer cannot say why, so every rank that notices says so, each naming itself (reporting_rank).
    """
    if isinstance(err, KeyboardInterrupt):  # before the first step: nothing to save yet; 143 for a SIGTERM
        code = 128 + err.signum if hasattr(err, "signum") else EXIT_INTERRUPTED  # interrupt_until_the_loop's
        return RunStopped("interrupted before training started; nothing was saved", code)
    reason = None if isinstance(err, TinyGPTError) else distributed.lost_peer(err)  # a refusal says its own line
    if reason is None:
        return err
    stopped = RunStopped(f"another rank died without a word (killed or crashed; gloo: {reason}), so this one "
                         "stops too; the last save is intact, continue with --resume", EXIT_PEER_LOST)
    stopped.reporting_rank = distributed.env_rank()
    return stopped
