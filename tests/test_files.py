"""runtime.atomic_write: a file is replaced whole or left as it was, and no temp file outlives a write."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime import atomic_write, atomic_write_text


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("failure, in_rename", [(OSError(28, "No space left on device"), False),
                                                (KeyboardInterrupt(), False),
                                                (PermissionError(13, "Permission denied"), True)])
def test_a_write_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch, failure, in_rename):
    path = tmp_path / "results.md"
    path.write_text("the old results\n")
    seen = []

    def half_then_fail(f) -> None:
        f.write(b"the first half of the new res")
        seen.append(listing(tmp_path))  # the half-written bytes are in a temp file, not in results.md
        if not in_rename:
            raise failure

    def cannot_rename(src, dst):
        raise failure

    if in_rename:
        monkeypatch.setattr(os, "replace", cannot_rename)
    with pytest.raises(type(failure)):
        atomic_write(path, half_then_fail)
    assert seen == [[f".results.md.tmp-{os.getpid()}", "results.md"]]  # hidden, beside it, with TEMP_MARK
    assert path.read_text() == "the old results\n"
    assert listing(tmp_path) == ["results.md"]


def test_a_write_replaces_the_file_whole_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    atomic_write_text(path, "old\n")
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_ino)) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda src, dst: events.append(("replace", Path(dst))) or real_replace(src, dst))
    atomic_write(path, lambda f: f.write(b'{"step": 1}, longer\n'))
    assert events == [("fsync", path.stat().st_ino), ("replace", path), ("fsync", tmp_path.stat().st_ino)]
    assert path.read_bytes() == b'{"step": 1}, longer\n' and listing(tmp_path) == ["metrics.jsonl"]

