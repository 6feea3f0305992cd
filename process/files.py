"""Files written whole or not at all: ``atomic_write`` (a temp file beside the target, fsync, rename).

    atomic_write(path, lambda f: f.write(data))          # any bytes a callable writes to a binary file
    atomic_write_text(path, json.dumps(record) + "\\n")  # text, as UTF-8

A kill, a crash or a full disk at any moment leaves the old file or the new one, never half of one:
the bytes go to ``.NAME.tmp-PID`` in the same folder (a rename is atomic only within one file
system), are fsynced, and only then renamed over NAME; the folder is fsynced after, so the rename
itself survives a power cut. On any failure the temp file is removed and the error goes on to the
caller, which names it (checkpoint.save_checkpoint: CheckpointWriteError). Checkpoints, the trimmed
metrics.jsonl, compare's records and results and the Hugging Face export are written this way.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

TEMP_MARK = ".tmp-"  # in every temp file's name: .NAME.tmp-PID (checkpoint.remove_stale_temp_files looks for it)


def temp_path(path: Path) -> Path:
    """Where ``path`` is written before its rename: hidden, beside it, named after this process."""
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Replace ``path`` by what ``write`` writes to the binary file it is handed (the temp file, open for writing
    and seekable), or leave it as it was: any exception, in ``write`` or in the fsync or rename, removes the temp
    file and is raised again unchanged."""
    with written_whole(Path(path)) as tmp:
        with open(tmp, "wb") as f:
            write(f)


@contextlib.contextmanager
def written_whole(path: Path) -> Iterator[Path]:
    """The temp path to write ``path`` at, for a writer that opens the file itself (gguf's): when the block ends
    it is fsynced and renamed over ``path``; if the block raises, it is removed and ``path`` left as it was."""
    tmp = temp_path(Path(path))
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # the data on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:  # a full disk, a bug in the writer, Ctrl-C: no temp file outlives the write
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # fsync the folder, so the rename survives a power cut (where supported)
        fd = os.open(Path(path).parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """atomic_write of ``text`` as UTF-8."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
