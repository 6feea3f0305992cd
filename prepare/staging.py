"""Staging: everything preparation writes goes under a staging name first and is renamed into place at the end.

    with staged_folder(Path("data/shakespeare-char-val0.1")) as staging:   # write into staging/, swapped in on exit
        ...
    remove_stale_staging(Path("data"))   # what a killed prepare left: at the start of the next one

A corpus folder, a download (prepare/downloads.py) and the GPT-2 ranks (prepare/tokenizers.py) are all
written beside their destination under a name that starts with ``staging_prefix()``, .staging-HOST-PID-,
so a killed process leaves no half file in place, only a leftover that says whose it was. The next prepare
deletes a leftover once its owner is gone (``is_stale``): a process still writing one (a concurrent
prepare, or torchrun's rank 0 while the other ranks wait) is never touched. The host is in the name
because a PID means nothing on another machine (or container) sharing the data dir; names the PID cannot
be checked for (another host's, or the old .staging-XXXXXXXX) go once nothing in them changed for a day.
Footgun: containers that share both a host name and a data dir but not their PIDs defeat the check.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator

STAGING = ".staging-"  # the start of every staging name: remove_stale_staging looks for it
STAGING_FOLDERS = (".", "downloads", "tokenizers")  # under data_dir: the corpora, sdists, GPT-2 ranks
STALE_AFTER_S = 24 * 3600  # untouched this long, a staging folder of unknown owner is abandoned


def host_name() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())  # no "-": it separates the name's fields


def staging_prefix() -> str:
    """'.staging-HOST-PID-': the start of every staging name this process creates."""
    return f"{STAGING}{host_name()}-{os.getpid()}-"


@contextlib.contextmanager
def staged_folder(folder: Path) -> Iterator[Path]:
    """Write into a staging folder and swap it in at the end, so a killed prepare leaves no half corpus.

    A corpus being replaced is renamed aside, whole, before it is deleted: a kill while deleting it
    cannot leave half of it in place. A SIGKILL leaves the staging folders behind; the next prepare
    removes them (remove_stale_staging).
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=staging_prefix()))
    staging.chmod(0o755)
    old = staging.with_name(f"{staging.name}-old")  # a staging name too, so a kill's leftover is found
    try:
        yield staging
        if folder.exists():
            folder.replace(old)
        staging.replace(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def staging_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of a staging name, or None for the old format, which had neither."""
    fields = name.split("-")  # ".staging", host, pid, mkdtemp's random part (it has no "-"), ...
    if len(fields) < 4 or not fields[2].isdigit():
        return None
    return fields[1], int(fields[2])


def process_exists(pid: int) -> bool:
    if os.name != "posix":
        return True  # on Windows os.kill(pid, 0) would terminate the process; assume it is alive
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: it only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, and belongs to another user
    return True


def last_change(path: Path) -> float:
    """The newest mtime of ``path`` and, for a folder, of its entries: a live writer updates one."""
    times = [path.stat().st_mtime]
    if path.is_dir():
        times += [entry.stat().st_mtime for entry in path.iterdir()]
    return max(times)


def is_stale(path: Path) -> bool:
    """Left by a killed prepare: its owner process is gone, or (owner unknown here) untouched for a day."""
    owner = staging_owner(path.name)
    if owner is not None and owner[0] == host_name():
        return not process_exists(owner[1])
    try:
        return time.time() - last_change(path) > STALE_AFTER_S
    except OSError:  # gone meanwhile (its owner renamed it) or unreadable: not ours to judge, keep it
        return False


def remove_stale_staging(data_dir: Path) -> list[Path]:
    """Delete staging folders and files left in data_dir by a prepare that was killed; returns what was removed.

    Never raises: what cannot be deleted (permissions) is named in a warning and left.
    """
    removed = []
    for where in (data_dir / sub for sub in STAGING_FOLDERS):
        for path in sorted(where.glob(f"{STAGING}*")) if where.is_dir() else []:
            if is_stale(path) and remove_leftover(path):
                removed.append(path)
    if removed:
        print(f"removed {len(removed)} staging leftover(s) of a killed prepare from {data_dir}")
    return removed


def remove_leftover(path: Path) -> bool:
    """Delete one leftover file or folder; False if another prepare removed it first or it cannot be deleted."""
    try:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return False  # another prepare removed it first
    except OSError as err:
        warnings.warn(f"could not remove {path}, left by a killed prepare ({err.strerror}); delete it by hand")
        return False
    return True
