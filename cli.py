"""How a command meets its user: one-line errors with their exit codes, the one way out of a process, the
signals that stop a run, argparse with manners, and the install line of each optional package."""
import argparse
import contextlib
import difflib
import errno
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, Callable, Literal, NoReturn, get_origin

import torch.distributed as dist

# ----------------------------------------------------------------------------- errors and exit codes
# Each error class carries its exit code (docs/reliability.md). 74, 75: sysexits.h; 130, 143: the shell's 128 + signal.
EXIT_BAD_INPUT = 2  # bad config, data, checkpoint or folder, caught before training: nothing written
EXIT_NONFINITE = 3  # a non-finite loss or gradient; fp16: max_skipped_steps overflowed steps in a row
EXIT_WRITE_FAILED = 74  # a checkpoint or a folder's write probe failed (disk full, I/O): the previous files intact
EXIT_PEER_LOST = 75  # under torchrun another rank died without a word (SIGKILL, a crash): --resume
EXIT_INTERRUPTED = 130  # SIGINT, after the step and its save; SIGTERM's is 143
EXIT_OUTPUT_CLOSED = 141  # stdout's reader went away (| head): SIGPIPE's, as a shell reports it


class TinyGPTError(Exception):
    """An error the user can act on: str() is one line that names the fix, ``exit_code`` the process's code."""
    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(TinyGPTError, ValueError):
    """A configuration mistake the user can fix; the message says how."""


def require(ok: Any, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class DataError(TinyGPTError, ValueError):
    """Bad or missing input data; the message names the file and what is wrong."""


class CheckpointError(TinyGPTError, RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


class CheckpointWriteError(TinyGPTError, OSError):
    """A checkpoint could not be written (disk full, I/O error); the previous file is intact."""
    exit_code = EXIT_WRITE_FAILED


class PathError(ConfigError):
    """A folder the run cannot use: 2 for a path to change (a file in the way, read-only, in use), 74 for I/O."""


class HFError(ConfigError):
    """Weights or a config that do not fit this model; the message names the key and the fix."""


class RunStopped(TinyGPTError):
    """Training stopped early on purpose (a signal, a non-finite step, a lost peer), with that stop's exit code."""


class PeerFailed(TinyGPTError):
    """Another rank failed and prints why; this one stops too, silently, with that rank's exit code."""

    def __init__(self, exit_code: int):
        super().__init__(f"another rank failed (exit code {exit_code})", exit_code)


# ----------------------------------------------------------------------------- optional packages
OPTIONAL_PACKAGES = {
    "rustbpe": ("rustbpe==0.1.0", "requirements.txt"),  # --tokenizer bpe
    "scipy": ("scipy==1.17.1", "requirements-dev.txt"),  # scripts/compare.py's t-test
    "pyarrow": ("pyarrow==26.0.1", "requirements-dev.txt"),  # .parquet corpora
    "gguf": ("gguf==0.19.0", "requirements-interop.txt"),  # scripts/export_gguf.py
    "lm_eval": ("lm_eval==0.4.13", "requirements-interop.txt"),  # scripts/harness.py
    "wandb": ("wandb==0.31.0", "requirements-interop.txt"),  # --wandb
}


def install_hint(package: str) -> str:
    pin, requirements = OPTIONAL_PACKAGES[package]
    return f"pip install {pin} (or pip install -r {requirements})"


# ----------------------------------------------------------------------------- the one way out
def env_rank() -> int:  # torchrun's; readable before runtime.setup()
    return int(os.environ.get("RANK", "0"))


def exit_for(err: BaseException) -> tuple[str, int, int | None] | None:
    """(its one line, the exit code, the rank that prints it or None) for ``err``; None for a bug (its traceback).
    Rank 0 prints the job's errors, another rank only one stop_together found on it first (``reporting_rank``)."""
    if isinstance(err, PeerFailed):  # another rank failed and prints why: this one stops silently
        return "", err.exit_code, None
    if isinstance(err, BrokenPipeError):  # stdout's reader is gone (| head): end quietly, as a SIGPIPE would
        return "", EXIT_OUTPUT_CLOSED, None
    if isinstance(err, OSError) and err.filename:  # a file we may not read (mode 600, a failing disk): its path
        err = PathError(f"cannot use {err.filename} ({err.strerror}); fix it or pass another path")
    elif isinstance(err, OSError) and err.errno == errno.ENOSPC:  # a write with no path: stdout on a full disk
        err = PathError("no space left on the device stdout (or a file) writes to; free some, then run again",
                        EXIT_WRITE_FAILED)
    if isinstance(err, TinyGPTError):
        rank = env_rank()
        return str(err), err.exit_code, rank if rank == 0 or getattr(err, "reporting_rank", None) == rank else None
    return None


def silence_stdout() -> None:
    """Point stdout at /dev/null once its reader is gone, so that no later print, nor Python's last flush, fails."""
    with contextlib.suppress(OSError, ValueError):  # a stdout with no file (a test's capture) stays as it is
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def fail(message: str, code: int = EXIT_BAD_INPUT, rank: int | None = 0) -> NoReturn:
    """Print a one-line error (rank 0's; another rank names itself; None prints nothing) and exit, no traceback."""
    if rank is not None:
        print(f"rank {rank}: error: {message}" if rank else f"error: {message}", file=sys.stderr)
    if code == EXIT_OUTPUT_CLOSED:
        silence_stdout()  # or Python's last flush of stdout fails, in a traceback
    sys.exit(code)


def run_tool(main: Callable[[], int | None]) -> NoReturn:
    """A tool's entry (python -m scripts.NAME): exit with main()'s code; a closed stdout (| head) ends it quietly."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:  # scripts/__init__.py's or sample.py's, as torch imported
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is a KeyboardInterrupt again (130)
    try:
        sys.exit(main())
    except OSError as err:  # stdout closed (| head) or full, a file that cannot be read: exit_for's line, or a bug's
        exit_on(err)
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's 130, not a traceback from inside torch
        fail("interrupted", EXIT_INTERRUPTED)


def exit_on(err: BaseException) -> NoReturn:
    """End the process on ``err`` as exit_for says; a bug is raised again."""
    if (ending := exit_for(err)) is None:
        raise err
    fail(*ending)


@contextlib.contextmanager
def exit_on_errors() -> Iterator[None]:
    """A tool's block whose TinyGPTError ends the process as exit_on does: its one line and exit code, no traceback."""
    try:
        yield
    except TinyGPTError as err:
        exit_on(err)


# ----------------------------------------------------------------------------- signals: how a run stops
class StopOnSignal:
    """SIGINT/SIGTERM ask to stop after this step (the loop saves last.pt, raises error()); after a stop both stay
    ignored so the save and teardown finish (footgun: an in-process caller must put its handlers back)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, install: bool = True) -> None:
        self.install = install  # False: a stand-in that never sees a signal (train() as a library)
        self.signum: int | None = None
        self.previous: dict[int, object] = {}
        self.finished = False  # the loop ended on its own: what it saved is whole

    def __enter__(self) -> "StopOnSignal":
        if self.install and threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self.handle) for signum in self.SIGNALS
                             if signal.getsignal(signum) is not signal.SIG_IGN}  # a background job's stays ignored
        return self

    def __exit__(self, *exc_info) -> None:
        self.finished = exc_info[0] is None
        # SIG_IGN, not our handler: CPython resets Python handlers to SIG_DFL early in shutdown; SIG_IGN stays.
        for signum, handler in self.previous.items():
            signal.signal(signum, signal.SIG_IGN if self.requested else handler)
        self.previous = {}

    def handle(self, signum: int, frame) -> None:
        note = ("already stopping; wait for the save" if self.requested else
                "finishing this step (and its eval, if due), then saving last.pt")
        self.signum = self.signum or signum  # the first decides the exit code: SIGTERM then Ctrl-C is still 143
        if env_rank() == 0:  # torchrun signals every rank: one says it
            os.write(2, f"\n{signal.Signals(signum).name}: {note}\n".encode())  # print() is not reentrant in a handler

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def error(self, step: int) -> RunStopped:
        return RunStopped(f"stopped by {signal.Signals(self.signum).name} after step {step}; last.pt holds it, "
                          "continue with --resume", 128 + self.signum)


@contextlib.contextmanager
def interrupt_until_the_loop() -> Iterator[None]:
    """Until StopOnSignal takes over, SIGINT and SIGTERM raise KeyboardInterrupt (with ``signum``): a SIGTERM before
    step 1 cleans up (staging, lock) as Ctrl-C does."""
    def interrupt(signum: int, frame) -> None:
        for other in StopOnSignal.SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        stop = KeyboardInterrupt(signal.Signals(signum).name)
        stop.signum = signum
        raise stop

    main_thread = threading.current_thread() is threading.main_thread()  # the only one signal.signal works in
    previous = {signum: signal.signal(signum, interrupt) for signum in StopOnSignal.SIGNALS
                if main_thread and signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is interrupt:  # not ignored by a stop meanwhile
                signal.signal(signum, handler)


# gloo's words for a peer that vanished (SIGKILL, a crash): third_party/gloo/gloo/transport/tcp/pair.cc
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def run_error(err: BaseException, finished: bool = False) -> BaseException:
    """``err`` as train.py reports it: Ctrl-C outside the loop (``finished``: after it) or a dead peer as the
    RunStopped it means; others as is."""
    if isinstance(err, KeyboardInterrupt):  # before the first step or after the last save; 143 for a SIGTERM
        code = 128 + err.signum if hasattr(err, "signum") else EXIT_INTERRUPTED
        return RunStopped("interrupted after training finished; what it saved is whole" if finished else
                          "interrupted before training started; nothing was saved", code)
    if (isinstance(err, TinyGPTError) or not isinstance(err, RuntimeError) or not dist.is_initialized()
            or (reason := next((words for words in PEER_GONE if words in str(err)), None)) is None):
        return err
    stopped = RunStopped(f"another rank died without a word (killed or crashed; gloo: {reason}), so this one "
                         "stops too; the last save is intact, continue with --resume", EXIT_PEER_LOST)
    stopped.reporting_rank = env_rank()
    return stopped


# ----------------------------------------------------------------------------- command lines
def did_you_mean(word: str, known: list[str], otherwise: str) -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f"; did you mean `{close[0]}`?" if close else f"; {otherwise}"


BOOL_WORDS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)


def parse_typed(name: str, kind: Any, raw: Any) -> Any:
    """A TOML or command-line value as the type ``kind``, or a ConfigError naming ``name``."""
    expected = "str" if get_origin(kind) is Literal else kind.__name__
    try:
        if expected == "bool":
            return raw if isinstance(raw, bool) else BOOL_WORDS[str(raw).lower()]
        if expected in ("int", "float") and isinstance(raw, bool):  # True is 1 to Python, never to a user
            raise ValueError
        if expected == "int":
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(raw.replace("_", "")) if isinstance(raw, str) else int(raw)
        return float(raw) if expected == "float" else str(raw)
    except (KeyError, ValueError):
        raise ConfigError(f"{name} must be {expected}, got {raw!r}") from None


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help unless X is None or empty."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help or "" if action.default in (None, "") else super()._get_help_string(action)


class CommandLine(argparse.ArgumentParser):
    """argparse for every entry point: a mistake is one line and exit 2; the usage names the command typed."""

    def __init__(self, **kwargs: Any):
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # python -m: argparse's eval.py runs nothing
        kwargs.setdefault("prog", f"python -m {spec.name.removesuffix('.__main__')}" if spec and spec.name
                          else os.path.basename(sys.argv[0]))  # python -m pkg runs pkg.__main__
        kwargs.setdefault("formatter_class", DefaultsOnce)
        super().__init__(allow_abbrev=False, **kwargs)  # an abbreviation that later grows ambiguous breaks scripts

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse's signature
        # intermixed: positionals may stand between flags (bench's `dtype=float32 --threads 1 compile=on`)
        parsed, unknown = self.parse_known_intermixed_args(args, namespace)
        if (flag := next((u.split("=")[0] for u in unknown if u.startswith("-")), None)) is not None:
            known = [s for action in self._actions for s in action.option_strings]
            self.error(f"unknown flag `{flag}`" + did_you_mean(flag, known, "run with --help to list every flag"))
        if unknown:
            self.error(f"unexpected argument `{unknown[0]}`; run with --help to list every flag")
        return parsed

    def error(self, message: str) -> NoReturn:  # argparse calls this for bad values and missing arguments too
        fail(message)  # exit 2, as for any bad input
