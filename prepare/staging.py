"""Written aside, then swapped in: a prepare writes into a staging folder beside its destination and renames it
into place at the end, so a killed prepare never leaves half a corpus (or half a download) where a run reads it.

    with staged_folder(Path("data/shakespeare-char-val0.1")) as staging:  # write into staging/, swapped in on exit
        ...
    remove_leftovers(Path("data"))  # what killed prepares left: at the start of the next one

A staging folder is named .staging-* and holds an flock while it is written, which the kernel drops when its
process ends, however it ends. So a leftover is a staging name whose lock can be taken: one still locked (a
concurrent prepare's, or torchrun's rank 0's while the other ranks wait) is never touched. Where nothing can be
locked (a file system without flock), nothing is removed.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

STAGING = ".staging-"  # the start of every staging name: remove_leftovers looks for it
STAGING_FOLDERS = (".", "downloads", "tokenizers")  # under data_dir: the corpora, sdists, GPT-2 ranks


def hold_lock(path: Path, wait: bool) -> int | None:
    """An fd of ``path`` holding its flock; None if a live process holds it, it is gone, or nothing can lock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:  # held by a live process, or a file system that cannot lock
        os.close(fd)
        return None


@contextlib.contextmanager
def staging_folder(parent: Path) -> Iterator[Path]:
    """A new .staging-* folder in ``parent``, locked while the block runs, then removed with what is left in it."""
    parent.mkdir(parents=True, exist_ok=True)
    while True:
        path = Path(tempfile.mkdtemp(dir=parent, prefix=STAGING))
        fd = hold_lock(path, wait=True)  # waits only while a cleanup that found it still unlocked removes it
        if path.is_dir():
            break
        if fd is not None:
            os.close(fd)
    try:
        path.chmod(0o755)
        yield path
    finally:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(folder: Path) -> Iterator[Path]:
    """A staging folder that replaces ``folder`` when the block ends. A corpus being replaced is renamed aside,
    whole, before it is deleted: a kill while deleting it cannot leave half of it in place."""
    with staging_folder(folder.parent) as staging:
        yield staging
        old = staging.with_name(f"{staging.name}-old")  # a staging name too: a kill's leftover is found
        if folder.exists():
            folder.replace(old)
        staging.replace(folder)
        shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(data_dir: Path) -> list[Path]:
    """Delete what killed prepares left in data_dir (each staging name whose lock can be taken); returns it.
    Never raises: what cannot be deleted (permissions) is named in a warning and left."""
    removed = []
    for path in sorted(path for sub in STAGING_FOLDERS for path in (data_dir / sub).glob(f"{STAGING}*")):
        if (fd := hold_lock(path, wait=False)) is None:
            continue  # a live prepare's
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass  # another prepare removed it first
        except OSError as err:
            warnings.warn(f"could not remove {path}, left by a killed prepare ({err.strerror}); delete it by hand")
        finally:
            os.close(fd)
    if removed:
        print(f"removed {len(removed)} staging leftover(s) of a killed prepare from {data_dir}")
    return removed
