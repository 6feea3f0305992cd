"""Folders a run writes: one live process per out_dir, and folders proven writable before any work.

    python train.py --config tiny --out_dir out/a &   # owns out/a until it exits
    python train.py --config tiny --out_dir out/a     # error: out/a is in use by process 4242 on HOST ...

train.py claims its out_dir first (``claim``): an exclusive ``fcntl.flock`` on ``out_dir/.lock``, which holds
the owner's PID and host for the refusal message. The kernel drops a flock when its process exits, however
it exits (SIGKILL included), so a killed run never blocks its own ``--resume``. A run that ends removes the
lock file, and the folders it created if nothing else was written into them: a refused run leaves no trace.
Corpus preparation and the exports probe their folders with ``check_writable`` before any work.
Footgun: flock is advisory; it stops a second train.py, not ``rm`` or another program.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from process.errors import EXIT_WRITE_FAILED, ConfigError, PathError

# A path the user must change (exit 2), as opposed to a device failing under a good one (exit 74).
BAD_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR,
                   errno.ENAMETOOLONG, errno.ELOOP}


def os_failure(folder: Path, flag: str, err: OSError) -> PathError:
    """One line for an OSError met while writing in ``folder``, passed with ``flag``."""
    reason = os.strerror(err.errno) if err.errno else str(err)
    if err.errno in BAD_PATH_ERRNOS:
        return PathError(f"cannot write in {folder} ({reason}); pass a writable {flag}")
    return PathError(f"could not write in {folder} ({reason}); nothing was written there", EXIT_WRITE_FAILED)


def make_folders(folder: Path, flag: str) -> list[Path]:
    """Create ``folder`` and its missing parents; returns those created, outermost first."""
    try:
        blocker = next((path for path in (folder, *folder.parents) if path.exists() and not path.is_dir()), None)
        missing = [path for path in (folder, *folder.parents) if not path.exists()][::-1]
    except OSError as err:  # a parent we may not even look into (EACCES)
        raise os_failure(folder, flag, err) from None
    if blocker is not None:
        raise PathError(f"{flag} {folder}: {blocker} is a file, not a folder; pass another {flag}")
    created = []
    for path in missing:
        try:
            path.mkdir()
        except FileExistsError:  # made meanwhile by another process: not ours to remove
            continue
        except OSError as err:
            remove_empty(created)
            raise os_failure(path.parent, flag, err) from None
        created.append(path)
    return created


def remove_empty(created: list[Path]) -> None:
    """Remove the folders we created, innermost first, as long as they are empty."""
    for path in reversed(created):
        try:
            path.rmdir()
        except OSError:  # not empty (another run's files, or ours), or gone: leave it and its parents
            return


def check_writable(folder: Path, flag: str, probe_name: str) -> None:
    """Create, write and remove the file ``probe_name`` in ``folder`` (made if missing, then removed
    again), or raise PathError: a path that cannot be written fails before any work is done on it."""
    created = make_folders(folder, flag)
    try:
        os.close(os.open(folder / probe_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        (folder / probe_name).unlink()
    except OSError as err:
        raise os_failure(folder, flag, err) from None
    finally:
        remove_empty(created)


class RunLock(contextlib.AbstractContextManager):
    """Ownership of a run folder, from ``claim``; a context manager that releases it on exit."""

    def __init__(self, path: Path, fd: int, created: list[Path]):
        self.path, self.fd, self.created = path, fd, created

    def __exit__(self, *exc_info) -> None:
        self.release()

    def release(self) -> None:
        """Remove the lock file while still holding it (no one locks a file on its way out), unlock, and remove
        the folders the claim created if nothing was written into them."""
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None
        remove_empty(self.created)


def holds(fd: int, path: Path) -> bool:
    """``fd`` is still the file at ``path`` (not one removed, or replaced by a new one)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def claim(out_dir: Path, resume: bool = True, flag: str = "--out_dir") -> RunLock:
    """Own ``out_dir`` until the returned lock is released (or this process dies), or raise PathError: exit 2 if
    the path is unusable or another live process owns it, 74 on an I/O failure. A fresh run (``resume`` False)
    is refused in a folder that holds a run: continuing it is --resume's job."""
    created = make_folders(out_dir, flag)
    path = out_dir / ".lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        remove_empty(created)
        raise os_failure(out_dir, flag, err) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # LOCK_NB: refuse now, never wait for the owner
    except BlockingIOError:
        owner = os.pread(fd, 300, 0).decode("utf-8", errors="replace").strip() or "another process"
        os.close(fd)
        raise PathError(f"{out_dir} is in use by {owner}: one run per folder. Wait for it to end or stop it, "
                        f"or pass another {flag}") from None
    if not holds(fd, path):  # locked as its owner removed it on the way out: lock the file there now
        os.close(fd)
        return claim(out_dir, resume, flag)
    lock = RunLock(path, fd, created)
    if not resume and (out_dir / "last.pt").exists():
        lock.release()
        raise ConfigError(f"{out_dir} already holds a run (last.pt); continue it with --resume, or start a "
                          "new one with another --out_dir (or delete the folder)")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}, since {time.strftime('%F %T')}\n".encode(), 0)
    except OSError as err:
        lock.release()
        raise os_failure(out_dir, flag, err) from None
    return lock
