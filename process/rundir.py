"""Folders a run writes: one live process per out_dir, and folders proven writable before any work.

    python train.py --config tiny --out_dir out/a &   # owns out/a until it exits
    python train.py --config tiny --out_dir out/a     # error: out/a is in use by process 4242 on HOST ...

train.py claims its out_dir first (``claim``): an exclusive ``fcntl.flock`` on ``out_dir/.lock``,
with the owner's PID and host written inside for the refusal message. The kernel drops a flock when
its process exits, however it exits (SIGKILL included), so a killed run never blocks its own
``--resume``: the file it leaves is simply locked again. A run that ends removes the file, and the
folders it created if it wrote nothing else into them (a refused run leaves no trace). Creating and
writing the lock file is also the write probe of out_dir; corpus preparation probes data_dir with
``check_writable`` before it prepares a corpus there.

Footgun: flock is advisory. It stops a second train.py, not ``rm`` or another program; and where a
filesystem cannot lock at all, the run goes on with a warning (nothing is refused then).
"""
from __future__ import annotations

import errno
import os
import socket
import time
import warnings
from pathlib import Path

try:
    import fcntl  # POSIX only
except ImportError:  # Windows: no flock; runs go on unlocked, with a warning
    fcntl = None

from process.errors import EXIT_WRITE_FAILED, PathError

LOCK_NAME = ".lock"
# A path the user must change (exit 2), as opposed to a device failing under a good one (exit 74).
BAD_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR,
                   errno.ENAMETOOLONG, errno.ELOOP}
CLAIM_ATTEMPTS = 5  # a lock file removed by its owner between our open and our flock: try the new one


def os_failure(folder: Path, flag: str, err: OSError) -> PathError:
    """One line for an OSError met while writing in ``folder``, passed with ``flag``."""
    reason = os.strerror(err.errno) if err.errno else str(err)
    if err.errno in BAD_PATH_ERRNOS:
        return PathError(f"cannot write in {folder} ({reason}); pass a writable {flag}")
    return PathError(f"could not write in {folder} ({reason}); nothing was written there", EXIT_WRITE_FAILED)


def file_in_the_way(folder: Path) -> Path | None:
    """The first of ``folder`` and its parents that exists but is not a folder, if any."""
    for path in (folder, *folder.parents):
        if path.exists():
            return None if path.is_dir() else path
    return None


def make_folders(folder: Path, flag: str) -> list[Path]:
    """Create ``folder`` and its missing parents; returns those created, outermost first."""
    try:
        blocker = file_in_the_way(folder)
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
    probe = folder / probe_name
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"probe\n")
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as err:
        raise os_failure(folder, flag, err) from None
    finally:
        remove_empty(created)


class RunLock:
    """Ownership of a run folder, from ``claim``; a context manager that releases it on exit."""

    def __init__(self, path: Path, fd: int | None, created: list[Path]):
        self.path, self.fd, self.created = path, fd, created

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no one locks a file on its way out),
        unlock, and remove the folders the claim created if nothing was written into them."""
        if self.fd is None:
            return
        try:
            if same_file(self.fd, self.path):
                self.path.unlink()
        except OSError:  # a read-only remount, say: the lock still goes with the descriptor
            pass
        os.close(self.fd)
        self.fd = None
        remove_empty(self.created)


def same_file(fd: int, path: Path) -> bool:
    """``fd`` is still the file at ``path`` (not one removed, or replaced by a new one)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def owner_line() -> bytes:
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"process {os.getpid()} on {socket.gethostname()}, since {started}\n".encode()


def read_owner(fd: int) -> str:
    """Who holds the lock, as its owner wrote it; a placeholder in the instant before it writes."""
    text = os.pread(fd, 300, 0).decode("utf-8", errors="replace").strip().splitlines()
    return text[0] if text else "another process (it has not written its PID yet)"


def claim(out_dir: Path, flag: str = "--out_dir") -> RunLock:
    """Own ``out_dir`` until the returned lock is released (or this process dies), or raise PathError:
    exit 2 if the path is unusable or another live process owns it, 74 on an I/O failure."""
    for _ in range(CLAIM_ATTEMPTS):
        created = make_folders(out_dir, flag)
        path = out_dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the folder was removed meanwhile by a run that created it: again
            continue
        except OSError as err:
            remove_empty(created)
            raise os_failure(out_dir, flag, err) from None
        if not lock(fd, out_dir, created, flag):
            continue
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, owner_line(), 0)
        except OSError as err:
            RunLock(path, fd, created).release()
            raise os_failure(out_dir, flag, err) from None
        return RunLock(path, fd, created)
    raise PathError(f"could not lock {out_dir / LOCK_NAME}: it kept being replaced; try again", EXIT_WRITE_FAILED)


def lock(fd: int, out_dir: Path, created: list[Path], flag: str) -> bool:
    """flock ``fd``: True once held on the live lock file, False to try again; PathError if in use."""
    if fcntl is None:
        warnings.warn(f"no file locking on this platform: a second run in {out_dir} would not be refused")
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # LOCK_NB: refuse now, never wait for the owner
    except BlockingIOError:
        owner = read_owner(fd)
        os.close(fd)
        remove_empty(created)
        raise PathError(f"{out_dir} is in use by {owner}: one run per folder. Wait for it to end or stop it, "
                        f"or pass another {flag}") from None
    except OSError as err:  # the filesystem cannot lock (ENOLCK, EOPNOTSUPP on some network mounts)
        warnings.warn(f"cannot lock {out_dir / LOCK_NAME} ({os.strerror(err.errno)}): a second run in "
                      f"{out_dir} would not be refused")
        return True
    if same_file(fd, out_dir / LOCK_NAME):
        return True
    os.close(fd)  # we locked a file its owner removed on its way out; lock the one there now
    return False
