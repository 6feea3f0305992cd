"""Every error tinygpt reports to the user, each with the exit code it ends the process with.

The exit codes, the one place they are defined (docs/reliability.md and the README's "What survives a
crash" repeat them):

    code  cause                                                  what is on disk afterwards
    0     finished; or resumed a finished run (0 steps done)      last.pt of the final step
    2     bad config, data or checkpoint (caught before training); nothing written or overwritten
          out_dir or data_dir not a writable folder, or out_dir
          owned by another live run (process/rundir.py)
    3     non-finite loss or gradient; in fp16, max_skipped_steps  last.pt of the last save; no
          overflowed steps in a row                                non-finite value in any checkpoint
    74    a checkpoint could not be written (disk full, I/O), or   the previous last.pt/best.pt, intact
          out_dir/data_dir failed its write probe with an I/O error
    75    under torchrun: another rank died without a word         the last save, intact; --resume
          (SIGKILL, a crash), so this one stops too
    130   SIGINT (Ctrl-C): the current step finished, then saved   last.pt of that step; resume is exact
    143   SIGTERM (e.g. preemption): the same                      last.pt of that step; resume is exact

130 and 143 follow the shell's 128 + signal-number convention, so schedulers that requeue preempted
jobs recognise them; 74 is EX_IOERR and 75 EX_TEMPFAIL ("try again later") from sysexits.h. Under
torchrun, a rank that stops because another rank failed prints nothing and exits with that rank's
code (PeerFailed, raised by distributed.stop_together).

Each error class carries its code (``exit_code``), so one failure has one code at every entry point:
each entry point ends an error through ``exit_for`` (its line, its code, the rank that prints it) and
``fail`` (print and exit), usually both at once with ``exit_on``. This module is the bottom layer of
the import graph: it imports nothing of the project, so any module may import it.
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn

EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_WRITE_FAILED = 74
EXIT_PEER_LOST = 75
EXIT_INTERRUPTED = 130  # 128 + SIGINT; a SIGTERM's 143 is 128 + its number too (faults.StopOnSignal)


class TinyGPTError(Exception):
    """An error the user can act on: str() is one line that names the fix, ``exit_code`` the process's code
    (the class's, unless given). Every error below is one, so an entry point catches this class alone and hands
    it to exit_on."""
    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(TinyGPTError, ValueError):
    """A configuration mistake the user can fix; the message says how."""


class DataError(TinyGPTError, ValueError):
    """Bad or missing input data; the message names the file and what is wrong."""


class CheckpointError(TinyGPTError, RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


class CheckpointWriteError(TinyGPTError, OSError):
    """A checkpoint could not be written (disk full, I/O error); the previous file is intact."""
    exit_code = EXIT_WRITE_FAILED


class PathError(ConfigError):
    """A folder the run cannot use. exit_code: 2 for a path to change (a file in the way, read-only, in use by
    another run), 74 (EX_IOERR) for an I/O failure under a good path."""


class HFError(ConfigError):
    """Weights or a config that do not fit this model; the message names the key and the fix."""


class RunStopped(TinyGPTError):
    """Training stopped early on purpose (a signal, a non-finite step, a lost peer), with that stop's exit code."""


class PeerFailed(TinyGPTError):
    """Another rank failed and prints why; this one stops too, silently, with that rank's exit code."""

    def __init__(self, exit_code: int):
        super().__init__(f"another rank failed (exit code {exit_code})", exit_code)


# ----------------------------------------------------------------------------- optional packages
# Each package a feature imports only when it is used: its pin, and the requirements file that installs it. The one
# source of every "needs X: pip install ..." line (install_hint); tests/test_errors.py checks it against those files.
OPTIONAL_PACKAGES = {
    "rustbpe": ("rustbpe==0.1.0", "requirements.txt"),  # --tokenizer bpe
    "scipy": ("scipy==1.17.1", "requirements-dev.txt"),  # scripts/compare.py's t-test
    "pyarrow": ("pyarrow==26.0.1", "requirements-dev.txt"),  # .parquet corpora
    "gguf": ("gguf==0.19.0", "requirements-interop.txt"),  # scripts/export_gguf.py
    "lm_eval": ("lm_eval==0.4.13", "requirements-interop.txt"),  # scripts/harness.py
    "wandb": ("wandb==0.31.0", "requirements-interop.txt"),  # --wandb
}


def install_hint(package: str) -> str:
    """How to install an optional package: its pinned version alone, or the requirements file that holds it."""
    pin, requirements = OPTIONAL_PACKAGES[package]
    return f"pip install {pin} (or pip install -r {requirements})"


# ----------------------------------------------------------------------------- the one way out
def reporting_rank(err: BaseException | None) -> int | None:
    """This rank's number if it must print ``err``; None if rank 0 prints the same error for the job.

    Rank 0 prints its errors. Another rank prints only an error that distributed.stop_together found on it
    and on no lower rank (a file missing on its node only), which carries that rank as ``reporting_rank``;
    any other is one every rank raises alike (bad arguments or config, a stop the ranks agreed on). RANK is
    torchrun's (0 without torchrun), so this is readable before distributed.setup().
    """
    rank = int(os.environ.get("RANK", "0"))
    return rank if rank == 0 or getattr(err, "reporting_rank", None) == rank else None


def exit_for(err: BaseException) -> tuple[str, int, int | None] | None:
    """How the process ends on ``err``: (its one line, the exit code, the rank that prints it, None for
    none), or None for an error that is a bug, whose traceback is the report."""
    if isinstance(err, PeerFailed):  # another rank failed and prints why: this one stops silently
        return "", err.exit_code, None
    if isinstance(err, TinyGPTError):
        return str(err), err.exit_code, reporting_rank(err)
    return None


def fail(message: str, code: int = EXIT_BAD_INPUT, rank: int | None = 0) -> NoReturn:
    """Print a one-line error for the user and exit; no traceback. Under torchrun, ``rank`` is the rank printing
    it: a rank other than 0 names itself, and None exits silently (rank 0 prints it for the job)."""
    if rank is not None:
        print(f"rank {rank}: error: {message}" if rank else f"error: {message}", file=sys.stderr)
    sys.exit(code)


def exit_on(err: BaseException) -> NoReturn:
    """End the process on ``err`` as exit_for says: its line and its code; a bug is raised again, traceback
    and all. What every entry point's main() calls with the errors it catches."""
    ending = exit_for(err)
    if ending is None:
        raise err
    fail(*ending)
