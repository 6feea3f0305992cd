"""One live run per out_dir, and folders that cannot be written fail first, in one line (checkpoint.claim)."""
from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, metrics, run_main, tiny_args, tree
from fault_injection import AS_A_SCRIPT as FAULTS

from checkpoint import claim, load_checkpoint
from cli import PathError
from prepare import prepare_corpus


def one_line_error(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- one live run per folder
def start_owner(out: Path, args: list[str], ready: Path, log: Path) -> subprocess.Popen:
    """A real run in its own process, held inside step 3 until killed."""
    with open(log, "w") as stderr:  # a file, not a pipe: a full pipe would block the owner
        owner = subprocess.Popen([sys.executable, *FAULTS, "--hang-at-call", "3", "--ready", str(ready), "--", *args],
                                 cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.time() + 120
    while not ready.exists():
        assert owner.poll() is None, log.read_text()
        assert time.time() < deadline, "the owner never reached step 3"
        time.sleep(0.05)
    return owner


@pytest.mark.parametrize("rival", ["fresh", pytest.param("resume", marks=pytest.mark.slow)])
def test_a_live_run_owns_its_folder_until_it_is_killed(tmp_path, text_file, capsys, rival):
    # The owner is held inside step 3: before its first save (a rival fresh run), or after saving step 2
    # (a rival --resume, as a requeued copy of a job that still runs).
    out = tmp_path / "out"
    run = dict(seed=1, max_iters=6, eval_interval=4 if rival == "fresh" else 2)
    owner = start_owner(out, tiny_args(out, text_file, **run), tmp_path / "ready", tmp_path / "owner.err")
    try:
        before = tree(out)
        assert out / "metrics.jsonl" in before and (out / "last.pt" in before) == (rival == "resume")
        rival_run = {**run, "seed": 2} if rival == "fresh" else {**run, "resume": "true"}
        assert run_main(tiny_args(out, text_file, **rival_run)) == 2
        assert one_line_error(capsys.readouterr().err).startswith(
            f"error: {out} is in use by process {owner.pid} on {socket.gethostname()}, since ")
        assert tree(out) == before  # refused before anything was written, deleted or cleaned up
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    # The kernel released the dead owner's lock (claim never waits: exit 0 proves no stale lock was left).
    assert run_main(tiny_args(out, text_file, **run, resume=str(rival == "resume"))) == 0
    assert load_checkpoint(out / "last.pt")["step"] == 6
    assert [r["step"] for r in metrics(out)[0]] == list(range(1, 7))  # one run's records, none lost or doubled
    assert not (out / ".lock").exists()


def test_a_claim_refuses_a_second_owner_and_a_refused_run_leaves_no_folder(tmp_path):
    out = tmp_path / "a" / "b"
    first = claim(out)
    assert (out / ".lock").read_text().startswith(f"process {os.getpid()} on {socket.gethostname()}, since ")
    with pytest.raises(PathError, match=f"in use by process {os.getpid()} ") as refused:  # a second descriptor:
        claim(out)  # flock locks open files, not processes, so even this process is refused
    assert refused.value.exit_code == 2
    first.close()
    assert list(tmp_path.iterdir()) == []  # the folders it made held nothing else: removed
    with claim(out):
        (out / "last.pt").write_bytes(b"a run's file")
    assert [p.name for p in out.iterdir()] == ["last.pt"]  # the folder stays, the lock file goes


def test_the_quick_start_says_how_to_train_again_after_the_refusal():
    """Its first line run twice stops at `already holds a run` (test_train): the README says what to do then."""
    quick_start = (REPO / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    said = " ".join(quick_start.split())  # the prose, unwrapped
    assert "`error: out/small already holds a run`" in said
    assert "--out_dir out/small2" in said and "--resume" in said


# ----------------------------------------------------------------------------- folders that cannot be written
def unwritable(monkeypatch: pytest.MonkeyPatch, folder: Path, code: int = errno.EROFS) -> None:
    """Make creating or writing anything inside ``folder`` fail with ``code`` (EROFS: a read-only mount, EIO: a
    failing disk), reads still working; as root (CI) chmod would stop no write."""
    real_open, real_mkdir = os.open, os.mkdir
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def inside(path) -> bool:
        return Path(os.path.abspath(path)).is_relative_to(folder.resolve())

    def failing_open(path, flags, *args, **kwargs):
        if flags & writes and inside(path):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    def failing_mkdir(path, *args, **kwargs):
        if inside(path):
            raise OSError(code, os.strerror(code), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing_open)
    monkeypatch.setattr(os, "mkdir", failing_mkdir)


@pytest.mark.parametrize("case, code, message", [
    ("out_dir under a file", 2, "{file} is a file, not a folder; pass another --out_dir"),
    ("out_dir is a file", 2, "{file} is a file, not a folder; pass another --out_dir"),
    ("read-only out_dir", 2, "cannot write in {out} ("),
    ("out_dir on a failing disk", 74, "could not write in {out} (Input/output error)"),
    ("out_dir under a dangling link", 2, "cannot write in {link} (No such file or directory); pass a writable"),
    ("read-only data_dir, corpus not prepared", 2, "cannot write in {data} ("),
])
def test_a_folder_that_cannot_be_written_fails_first_in_one_line(tmp_path, text_file, capsys, monkeypatch,
                                                                 no_model, case, code, message):
    file, out, data, link = tmp_path / "f", tmp_path / "out", tmp_path / "data", tmp_path / "link"
    file.write_text("a file where a folder should be")
    out = {"out_dir under a file": file / "sub", "out_dir is a file": file,
           "out_dir under a dangling link": link / "run"}.get(case, out)
    link.symlink_to(tmp_path / "gone") if case.endswith("dangling link") else None
    if case in ("read-only out_dir", "out_dir on a failing disk"):
        out.mkdir()
        unwritable(monkeypatch, out, errno.EROFS if case.startswith("read-only") else errno.EIO)
    if case.startswith("read-only data_dir"):
        data.mkdir()
        unwritable(monkeypatch, data)
    before = tree(tmp_path)
    assert run_main(tiny_args(out, text_file, data_dir=data)) == code
    err = one_line_error(capsys.readouterr().err)
    assert message.format(file=file, out=out, data=data, link=link) in err
    monkeypatch.undo()
    assert tree(tmp_path) == before  # nothing written, nothing half-written, no folder made


def test_a_read_only_data_dir_holding_the_corpus_still_trains(tmp_path, text_file, monkeypatch):
    data = tmp_path / "data"
    prepare_corpus(data_path=str(text_file), data_dir=str(data))
    unwritable(monkeypatch, data)
    assert run_main(tiny_args(tmp_path / "out", text_file, data_dir=data, max_iters=1, eval_interval=1)) == 0
