"""Resume is exact: a run stopped at any awkward point and resumed equals the run never stopped.

Checkpoints are written only between optimizer steps, so "killed mid gradient-accumulation group"
means: a stop request that arrives during micro-batch 2 of 4 lets the step finish all four micro-batches
and its update, then saves. A checkpoint never holds a half-accumulated step.
"""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train
from machinery.checkpoint import load_checkpoint, save_checkpoint
from conftest import REPO, make_text, run_script
from fault_injection import assert_same_training_state, call_of, metrics, run_main, signal_at, tiny_args



@pytest.mark.slow  # three fresh interpreters: ~10 s idle, ~25 s on 2 busy cores
def test_killed_and_resumed_twice_in_fresh_processes_equals_straight_run(tmp_path, text_file):
    # fp16 so that the GradScaler has a state to restore; grad_accum 2 so that each signal lands mid-step.
    common = dict(dtype="float16", grad_accum=2, batch_size=4, max_iters=20, eval_interval=5)
    a_dir, b_dir = tmp_path / "A", tmp_path / "BCD"
    assert run_main(tiny_args(a_dir, text_file, **common)) == 0  # A: 20 steps straight (the reference)
    # B, C and D each run in a fresh interpreter, so nothing but the checkpoint carries over.
    driver = str(REPO / "tests" / "fault_injection.py")
    # B: SIGTERM during step 7 (its 2nd micro-batch); C: resumed, SIGTERM during step 13 (its 6th step).
    for at_call, resume, expected_step in ((call_of(7, 2, 2), "false", 7), (call_of(6, 1, 2), "true", 13)):
        result = run_script(driver, "--signal", "SIGTERM", "--at-call", str(at_call), "--",
                            *tiny_args(b_dir, text_file, resume=resume, **common), check=False)
        assert result.returncode == 143, result.stderr
        assert load_checkpoint(b_dir / "last.pt")["step"] == expected_step
    run_script("train.py", *tiny_args(b_dir, text_file, resume="true", **common))  # D: resumed to the end

    straight, resumed = load_checkpoint(a_dir / "last.pt"), load_checkpoint(b_dir / "last.pt")
    assert straight["scaler"]["_growth_tracker"] == 20  # a live scaler: 20 steps without overflow
    assert_same_training_state(straight, resumed)  # weights, Adam moments, scaler, RNG streams, step
    assert_same_training_state(load_checkpoint(a_dir / "best.pt"), load_checkpoint(b_dir / "best.pt"))
    assert metrics(a_dir) == metrics(b_dir)  # every step's loss, lr and grad norm, and every val loss
    assert [r["step"] for r in metrics(b_dir)[0]] == list(range(1, 21))


def test_sigterm_mid_accumulation_finishes_the_step_then_saves(tmp_path, text_file, monkeypatch):
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # a stop leaves both ignored
    try:
        args = dict(grad_accum=4, max_iters=10)
        calls = signal_at(monkeypatch, signal.SIGTERM, call_of(5, 2, 4))  # micro-batch 2 of 4, step 5
        assert run_main(tiny_args(tmp_path / "stopped", text_file, **args)) == 143
        assert len(calls) == call_of(5, 4, 4)  # all four micro-batches of step 5 ran, none of step 6
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert load_checkpoint(tmp_path / "stopped" / "last.pt")["step"] == 5
    assert run_main(tiny_args(tmp_path / "stopped", text_file, resume="true", **args)) == 0
    assert run_main(tiny_args(tmp_path / "straight", text_file, **args)) == 0
    assert_same_training_state(load_checkpoint(tmp_path / "straight" / "last.pt"),
                               load_checkpoint(tmp_path / "stopped" / "last.pt"))
    assert metrics(tmp_path / "straight") == metrics(tmp_path / "stopped")


def test_resume_right_after_an_eval_and_best_save(tmp_path, text_file):
    # The first run ends at step 10, an eval step, where it writes best.pt and last.pt.
    assert run_main(tiny_args(tmp_path / "split", text_file, max_iters=10, eval_interval=5)) == 0
    assert load_checkpoint(tmp_path / "split" / "best.pt")["step"] == 10
    assert run_main(tiny_args(tmp_path / "split", text_file, max_iters=20, eval_interval=5, resume="true")) == 0
    assert run_main(tiny_args(tmp_path / "straight", text_file, max_iters=20, eval_interval=5)) == 0
    for name in ("last.pt", "best.pt"):
        assert_same_training_state(load_checkpoint(tmp_path / "straight" / name),
                                   load_checkpoint(tmp_path / "split" / name))
    assert metrics(tmp_path / "straight") == metrics(tmp_path / "split")


def test_resuming_a_finished_run_does_zero_steps_and_changes_nothing(tmp_path, text_file, monkeypatch):
    out = tmp_path / "out"
    assert run_main(tiny_args(out, text_file, max_iters=6)) == 0
    before = {name: (out / name).read_bytes() for name in ("last.pt", "best.pt", "metrics.jsonl")}
    calls = signal_at(monkeypatch, signal.SIGTERM, call=-1)  # counts training forward passes only
    assert run_main(tiny_args(out, text_file, max_iters=6, resume="true")) == 0
    assert calls == []
    assert {name: (out / name).read_bytes() for name in before} == before


def test_data_order_after_resume_is_the_tail_of_the_straight_run(tmp_path, text_file, monkeypatch):
    import train
    drawn: list[torch.Tensor] = []
    real_get_batch = train.get_batch

    def recording_get_batch(*args, **kwargs):
        x, y = real_get_batch(*args, **kwargs)
        drawn.append(x.clone())
        return x, y

    monkeypatch.setattr(train, "get_batch", recording_get_batch)
    args = dict(grad_accum=2, max_iters=12, eval_interval=4)
    assert run_main(tiny_args(tmp_path / "straight", text_file, **args)) == 0
    straight, drawn[:] = list(drawn), []
    assert run_main(tiny_args(tmp_path / "split", text_file, **{**args, "max_iters": 5})) == 0
    head, drawn[:] = list(drawn), []
    assert run_main(tiny_args(tmp_path / "split", text_file, **args, resume="true")) == 0
    assert len(straight) == 24 and len(head) == 10
    assert all(torch.equal(a, b) for a, b in zip(head + drawn, straight, strict=True))


@pytest.mark.parametrize("stream", ["python", "numpy", "torch_cpu", "torch_cuda", "data"])
def test_checkpoint_missing_an_rng_stream_is_refused(tmp_path, text_file, capsys, stream):
    out = tmp_path / "out"
    assert run_main(tiny_args(out, text_file, max_iters=3)) == 0
    state = load_checkpoint(out / "last.pt")
    del state["rng"][stream]
    save_checkpoint(state, out / "last.pt")
    before = (out / "last.pt").read_bytes()
    capsys.readouterr()
    assert run_main(tiny_args(out, text_file, max_iters=6, resume="true")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out / "last.pt") in err and stream in err and "not be exact" in err
    assert (out / "last.pt").read_bytes() == before


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_from_outside_saves_the_finished_step_and_resumes_exactly(tmp_path, text_file, signum, code):
    out = tmp_path / "out"
    args = tiny_args(out, text_file, max_iters=100_000, eval_interval=100_000)
    child = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    metrics_file, deadline = out / "metrics.jsonl", time.time() + 120
    while not (metrics_file.is_file() and metrics_file.read_text().count("\n") >= 3):
        assert child.poll() is None and time.time() < deadline, "training did not start"
        time.sleep(0.05)
    child.send_signal(signum)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == code, stderr
    stopped_at = load_checkpoint(out / "last.pt")["step"]
    assert stderr.strip().splitlines()[-1] == (f"error: stopped by {signal.Signals(signum).name} after step "
                                               f"{stopped_at}; last.pt holds it, continue with --resume")
    assert metrics(out)[0][-1]["step"] == stopped_at  # the last logged step is the saved one
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    # Resume three more steps; the straight run to the same step must match exactly.
    end = stopped_at + 3
    assert run_main(tiny_args(out, text_file, max_iters=end, eval_interval=100_000, resume="true")) == 0
    assert run_main(tiny_args(tmp_path / "straight", text_file, max_iters=end, eval_interval=100_000)) == 0
    assert_same_training_state(load_checkpoint(tmp_path / "straight" / "last.pt"), load_checkpoint(out / "last.pt"))
    assert metrics(tmp_path / "straight")[0] == metrics(out)[0]


def test_sigkill_loses_at_most_ckpt_interval_steps_and_metrics_keep_no_duplicates(tmp_path, text_file):
    out = tmp_path / "out"
    args = tiny_args(out, text_file, max_iters=100_000, eval_interval=100_000, ckpt_interval=4)
    child = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    metrics_file, deadline = out / "metrics.jsonl", time.time() + 120
    while not (metrics_file.is_file() and metrics_file.read_text().count("\n") >= 10):
        assert child.poll() is None and time.time() < deadline, "training did not start"
        time.sleep(0.05)
    child.kill()  # SIGKILL: no handler runs, nothing is saved on the way out
    child.wait()
    saved = load_checkpoint(out / "last.pt")["step"]
    logged = metrics(out)[0][-1]["step"]
    assert saved % 4 == 0 and saved >= 8 and logged - saved <= 4  # at most ckpt_interval steps lost
    end = logged + 2
    assert run_main(tiny_args(out, text_file, max_iters=end, eval_interval=100_000, resume="true")) == 0
    assert run_main(tiny_args(tmp_path / "straight", text_file, max_iters=end, eval_interval=100_000)) == 0
    assert_same_training_state(load_checkpoint(tmp_path / "straight" / "last.pt"), load_checkpoint(out / "last.pt"))
    assert metrics(tmp_path / "straight") == metrics(out)  # the redone steps are logged once


def test_a_resume_on_other_data_is_refused_and_old_checkpoints_still_resume(tmp_path, text_file, capsys):
    # Old code: both resumes below continue without a word (exit 0), the second after re-preparing
    # the shared corpus folder in place with its new split.
    out = tmp_path / "out"
    assert run_main(tiny_args(out, text_file, max_iters=2, eval_interval=2)) == 0
    (corpus_folder,) = (tmp_path / "data").iterdir()
    kept = {p: p.read_bytes() for p in [*out.iterdir(), *corpus_folder.iterdir()]}
    other = tmp_path / "other.txt"
    other.write_text(make_text(seed=1))
    assert set(other.read_text()) == set(text_file.read_text())  # the same vocabulary: only the data differs
    for change in (dict(data_path=other), dict(val_fraction=0.2)):
        capsys.readouterr()
        assert run_main(tiny_args(out, text_file, max_iters=4, resume="true", **change)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {out / 'last.pt'} was trained on {text_file} (val_fraction 0.1), this run "
                              f"reads {change.get('data_path', text_file)} (val_fraction {change.get('val_fraction', 0.1)})")
        assert err.count("\n") == 1 and "Resume with the same --data_path and --val_fraction" in err
        assert {p: p.read_bytes() for p in kept} == kept  # the run, and the corpus folder it trained on
    assert len(list((tmp_path / "data").iterdir())) == 3  # each corpus and split in its own folder
    state = load_checkpoint(out / "last.pt")  # a checkpoint from before the corpus record:
    del state["corpus"]
    save_checkpoint(state, out / "last.pt")
    assert run_main(tiny_args(out, text_file, max_iters=4, resume="true")) == 0  # resumes, unchecked
    assert load_checkpoint(out / "last.pt")["corpus"]["val_fraction"] == 0.1  # and records it from now on


# ----------------------------------------------------------------------------- resume: every random stream
def draw_from_global_streams(monkeypatch) -> list[tuple]:
    """Each micro-batch also draws from python's, numpy's and torch's global RNGs, as user code in the
    loop would (an augmentation, a sampler); the list of draws, in order."""
    draws: list[tuple] = []
    real_get_batch = train.get_batch

    def get_batch(*args, **kwargs):
        cuda = (torch.rand(1, device="cuda").item(),) if torch.cuda.is_available() else ()
        draws.append((random.random(), float(np.random.random()), torch.rand(1).item(), *cuda))
        return real_get_batch(*args, **kwargs)

    monkeypatch.setattr(train, "get_batch", get_batch)
    return draws


def test_after_a_resume_every_global_random_stream_continues_as_in_a_straight_run(tiny_cfg, tmp_path, monkeypatch):
    """Bugs caught: restore_rng without its np.random.set_state line (or random.setstate, or
    torch.set_rng_state): the resumed run's draws are those of a freshly seeded stream."""
    draws = draw_from_global_streams(monkeypatch)
    common = dict(max_iters=4, eval_interval=2, compile="off")
    train.train(tiny_cfg(out_dir=str(tmp_path / "straight"), **common))
    straight = draws[:]
    draws.clear()
    train.train(tiny_cfg(out_dir=str(tmp_path / "split"), **{**common, "max_iters": 2}))
    assert draws == straight[:2]
    draws.clear()
    train.train(tiny_cfg(out_dir=str(tmp_path / "split"), resume=True, **common))
    assert len(draws) == 2
    for name, i in (("python", 0), ("numpy", 1), ("torch_cpu", 2), ("torch_cuda", 3))[: len(draws[0])]:
        assert [d[i] for d in draws] == [d[i] for d in straight[2:]], f"{name} stream after the resume"
