"""--wandb never prompts and never crashes a run: offline without a key, the same run on --resume.
No test reaches a wandb server: offline runs are read back from the run-<id>.wandb files wandb writes."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, read_metrics, run_main, tiny_args

import logs
from config import make_config

pytestmark = pytest.mark.interop  # wandb (requirements-interop.txt)
wandb = pytest.importorskip("wandb")
wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")


# ----------------------------------------------------------------------------- reading an offline run
def wandb_records(path: Path):
    """The protobuf Records of a run-<id>.wandb file: LevelDB's log format (32 KiB blocks of chunks with
    a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last) after a 7-byte ':W&B' header."""
    data, pos, payload = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos: pos + 7])
        if length == 0 and kind == 0:
            break
        payload, pos = payload + data[pos + 7: pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            yield record


def offline_run(folder: Path) -> tuple[str, list[dict]]:
    (path,) = folder.glob("run-*.wandb")
    records = list(wandb_records(path))
    (run_id,) = {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}
    rows = [{key: json.loads(item.value_json) for item in r.history.item
             if not (key := item.key or "/".join(item.nested_key)).startswith("_")}  # wandb 0.31 fills nested_key
            for r in records if r.WhichOneof("record_type") == "history"]
    return run_id, rows


def jsonl_rows(out: Path) -> list[dict]:
    """metrics.jsonl merged per step, as wandb merges a step's train and val records."""
    rows: dict[int, dict] = {}
    for record in read_metrics(out):
        rows.setdefault(record["step"], {}).update(record)
    return [rows[step] for step in sorted(rows)]


# ----------------------------------------------------------------------------- real runs, no key, no terminal
def train_without_a_key(tmp_path: Path, text_file: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """train.py --wandb on a fresh machine: no WANDB_*, an empty home, stdin closed; it must exit 0."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"))
    args = tiny_args(out, text_file, max_iters=6, eval_interval=3, dropout=0.0) + ["--wandb", *extra]
    result = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert not (home / ".netrc").exists()  # nothing asked for, nothing written
    return result


@pytest.mark.slow  # three short runs in fresh interpreters, each starting wandb: ~30 s
def test_without_a_key_the_run_goes_offline_and_resume_continues_the_same_run(tmp_path, text_file):
    out = tmp_path / "run"
    first = train_without_a_key(tmp_path, text_file, out)
    (folder,) = (out / "wandb").glob("offline-run-*")
    run_id = (out / "wandb_id").read_text().strip()
    assert f"wandb: offline run {run_id} written to {folder}; upload it later with `wandb sync " in first.stdout
    assert offline_run(folder) == (run_id, jsonl_rows(out))  # the same records: keys, steps and values
    assert {"loss", "lr", "grad_norm", "val_loss", "val_bpb"} <= set(jsonl_rows(out)[-1])

    # A killed run: it logged steps 7 and 8 (to metrics.jsonl and wandb), but last.pt still holds step 6.
    shutil.copy(out / "last.pt", tmp_path / "last6.pt")
    train_without_a_key(tmp_path, text_file, out, "--resume", "--max_iters", "8")
    shutil.copy(tmp_path / "last6.pt", out / "last.pt")
    train_without_a_key(tmp_path, text_file, out, "--resume", "--max_iters", "10")

    segments = sorted((out / "wandb").glob("offline-run-*"))  # one folder per process, names in time order
    runs = [offline_run(folder) for folder in segments]
    assert [run for run, _ in runs] == [run_id] * 3  # one wandb run across the resumes
    steps = [[row["step"] for row in rows] for _, rows in runs]
    assert steps == [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10]]  # steps 7 and 8 are never sent twice
    assert [row["step"] for row in jsonl_rows(out)] == list(range(1, 11))  # metrics.jsonl redid them once


# ----------------------------------------------------------------------------- choices, in process
def test_a_wandb_that_cannot_start_stops_the_run_in_one_line_before_training(tmp_path, text_file, monkeypatch, capsys):
    def init(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setattr(wandb, "init", init)
    out = tmp_path / "out"
    assert run_main(tiny_args(out, text_file, wandb="true")) == 2
    err = capsys.readouterr().err
    assert err == ("error: wandb could not start (No API key configured. Use `wandb login` to log in.); run without "
                   "--wandb, or with WANDB_MODE=offline to log locally and `wandb sync` later\n")
    assert not (out / "last.pt").exists()


# ----------------------------------------------------------------------------- tracking
def fake_wandb(monkeypatch) -> list[SimpleNamespace]:
    """wandb.init replaced by a recorder: each started run's init arguments and the steps it was sent."""
    runs: list[SimpleNamespace] = []

    def init(**kwargs):
        run = SimpleNamespace(init=kwargs, id=kwargs["id"] or f"new{len(runs)}", steps=[], offline=False,
                              settings=SimpleNamespace(mode="disabled"), finish=lambda: None)
        run.log = lambda record, step: run.steps.append(step)
        runs.append(run)
        return run

    monkeypatch.setenv("WANDB_MODE", "disabled")  # logs.start then asks wandb for no login
    monkeypatch.setattr(wandb, "init", init)
    return runs


@pytest.mark.parametrize("env_mode, logged_in, expected", [
    (None, True, "online"),  # a key in WANDB_API_KEY, .netrc or wandb's settings
    (None, False, "offline"),  # no key: offline, never the login prompt
    ("disabled", True, None),  # the user's own WANDB_MODE is wandb's to read
])
def test_mode_follows_the_key_unless_wandb_mode_is_set(tmp_path, monkeypatch, env_mode, logged_in, expected):
    runs, logins = fake_wandb(monkeypatch), []
    monkeypatch.setattr(wandb, "login", lambda **kwargs: logins.append(kwargs) or logged_in)
    if env_mode is None:
        monkeypatch.delenv("WANDB_MODE")
    logs.start(make_config(wandb=True, out_dir=str(tmp_path)), tmp_path)
    assert runs[0].init["mode"] == expected
    assert logins == ([] if env_mode else [{"prompt": False, "verify": False}])  # never a prompt or a round trip


def append_records(out: Path, steps: range) -> None:
    """metrics.jsonl records of ``steps`` as an earlier process logged them before it was killed."""
    with open(out / "metrics.jsonl", "a") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")


@pytest.mark.parametrize("first, sent", [
    (None, [1, 2, 3, 3]),  # a fresh run beside an old run's wandb_id: a new wandb run, sent every record
    ({"wandb": "true"}, [6, 6]),  # resumed, the same wandb run: it already holds steps 4 and 5
    ({}, [4, 5, 6, 6]),  # resumed, first trained without --wandb: a new wandb run holds nothing yet
], ids=["fresh", "continued", "new wandb run on resume"])
def test_only_a_continued_wandb_run_skips_the_steps_it_holds(tmp_path, text_file, monkeypatch, first, sent):
    """Bugs caught: logs.start read out_dir/wandb_id without --resume (a new run appended to an old one's charts);
    a wandb run not continued skipped the steps a killed process logged (and its resume redid)."""
    out, runs = tmp_path / "out", fake_wandb(monkeypatch)
    if first is None:  # left by an earlier run here whose last.pt was deleted
        out.mkdir()
        (out / "wandb_id").write_text("oldrun\n")
        append_records(out, range(1, 9))
    else:
        assert run_main(tiny_args(out, text_file, max_iters=3, eval_interval=3, **first)) == 0
        append_records(out, range(4, 6))  # killed after step 5; last.pt holds step 3
    resumed = {} if first is None else {"max_iters": 6, "resume": "true"}
    assert run_main(tiny_args(out, text_file, **{"max_iters": 3, **resumed}, eval_interval=3, wandb="true")) == 0
    run, continued = runs[-1], first == {"wandb": "true"}
    assert (run.init["id"], run.init["resume"]) == ((runs[0].id, "allow") if continued else (None, None))
    assert run.steps == sent
    assert (out / "wandb_id").read_text() == f"{run.id}\n"
