"""What a resume promises: a run stopped at any point (a stop mid-accumulation finishes the step first) and
resumed equals the run never stopped; and what a resume refuses."""
from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (REPO, final_weights, make_optimizer, make_text, metrics, read_metrics, run_main, run_script,
                      same_weights, tiny_args, tiny_model, tree)
from fault_injection import AS_A_SCRIPT, assert_same_training_state, call_of, signal_at, step_clock

import checkpoint
import data
import logs
import optim
import runtime
import train
from checkpoint import RNG_STREAMS, load_checkpoint, save_checkpoint
from config import make_config
from data import LOADERS


# ----------------------------------------------------------------------------- exactness
def assert_resumes_as_straight(out: Path, straight: Path, text_file: Path, **args) -> None:
    """Resume ``out`` to the end of ``args`` and train ``straight`` there in one go: the same state and log."""
    assert run_main(tiny_args(out, text_file, resume="true", **args)) == 0
    assert run_main(tiny_args(straight, text_file, **args)) == 0
    for name in ("last.pt", "best.pt"):
        assert_same_training_state(load_checkpoint(straight / name), load_checkpoint(out / name))
    assert metrics(straight) == metrics(out)


RESUME_MUTANTS = {
    "no optimizer state": lambda mp: mp.setattr(torch.optim.AdamW, "load_state_dict", lambda self, state: None),
    "no RNG state": lambda mp: mp.setattr(checkpoint, "restore_rng", lambda rng, stream: None),
    "data order only": lambda mp: mp.setattr(checkpoint, "restore_rng",
                                             lambda rng, stream: stream.load_state_dict(rng["data"])),
}


def draw_from_global_streams(monkeypatch) -> list[tuple]:
    """Each micro-batch also draws from python's, numpy's and torch's global RNGs, as user code may; the draws."""
    draws: list[tuple] = []
    real_next = data.RandomWindows.next

    def next_batch(self):
        cuda = (torch.rand(1, device="cuda").item(),) if torch.cuda.is_available() else ()
        draws.append((random.random(), float(np.random.random()), torch.rand(1).item(), *cuda))
        return real_next(self)

    monkeypatch.setattr(data.RandomWindows, "next", next_batch)
    return draws


@pytest.mark.parametrize("mutant", [None, *RESUME_MUTANTS])
def test_resume_is_exact_and_one_without_optimizer_or_rng_state_is_caught(monkeypatch, tiny_cfg, tmp_path, mutant):
    """The weights, and the draws from every global random stream, as in a straight run."""
    draws = draw_from_global_streams(monkeypatch)
    common = dict(max_iters=8, eval_interval=4, dropout=0.1, compile="off")
    train.train(tiny_cfg(out_dir=str(tmp_path / "straight"), **common))
    straight = draws[:]
    train.train(tiny_cfg(out_dir=str(tmp_path / "split"), **{**common, "max_iters": 4}))
    draws.clear()
    if mutant:
        RESUME_MUTANTS[mutant](monkeypatch)
    train.train(tiny_cfg(out_dir=str(tmp_path / "split"), resume=True, **common))
    weights = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    assert same_weights(*weights) == (mutant is None)
    assert len(straight) == 8 and (draws == straight[4:]) == (mutant in (None, "no optimizer state"))


@pytest.mark.parametrize("loader", LOADERS)
def test_each_loader_resumes_a_compiled_run_exactly_mid_stream(tmp_path, light_compile, loader):
    """A small corpus, so that bos_packed is stopped mid-epoch after a reshuffle. Bugs caught: the compile probe
    draws from the training stream (a resume probes again), or its dropout from the global RNG outside fork_rng."""
    corpus = tmp_path / "small.txt"
    corpus.write_text(make_text(n_lines=60))
    run = dict(loader=loader, compile="on", dropout=0.1, grad_accum=2, max_iters=8, eval_interval=4)
    assert run_main(tiny_args(tmp_path / "straight", corpus, **run)) == 0
    assert run_main(tiny_args(tmp_path / "split", corpus, **{**run, "max_iters": 3})) == 0
    stopped = load_checkpoint(tmp_path / "split" / "last.pt")["rng"]["data"]
    if loader == "bos_packed":
        assert stopped["epoch"] >= 1 and stopped["position"] > 0, stopped
    assert run_main(tiny_args(tmp_path / "split", corpus, **run, resume="true")) == 0
    assert_same_training_state(load_checkpoint(tmp_path / "straight" / "last.pt"),
                               load_checkpoint(tmp_path / "split" / "last.pt"))
    assert metrics(tmp_path / "straight")[0] == metrics(tmp_path / "split")[0]  # every step's loss and grad norm


# ----------------------------------------------------------------------------- a signal or a kill, then a resume
@pytest.mark.slow  # three fresh interpreters (~25 s on 2 busy cores); each optimizer's resume: test_training_options
def test_killed_and_resumed_twice_in_fresh_processes_equals_straight_run(tmp_path, text_file):
    # fp16: a GradScaler state to restore; grad_accum 2: each signal lands mid-step; dropout: RNG streams to carry.
    common = dict(dtype="float16", grad_accum=2, batch_size=4, max_iters=20, eval_interval=5, dropout=0.1)
    a_dir, b_dir = tmp_path / "A", tmp_path / "BCD"
    assert run_main(tiny_args(a_dir, text_file, **common)) == 0  # A: 20 steps straight (the reference)
    # In fresh interpreters, B: SIGTERM during step 7 (its 2nd micro-batch); C: resumed, SIGTERM in step 13.
    for at_call, resume, expected_step in ((call_of(7, 2, 2), "false", 7), (call_of(6, 1, 2), "true", 13)):
        result = run_script(*AS_A_SCRIPT, "--signal", "SIGTERM", "--at-call", str(at_call), "--",
                            *tiny_args(b_dir, text_file, resume=resume, **common), check=False)
        assert result.returncode == 143, result.stderr
        assert load_checkpoint(b_dir / "last.pt")["step"] == expected_step
    run_script("train.py", *tiny_args(b_dir, text_file, resume="true", **common))  # D: resumed to the end

    straight, resumed = load_checkpoint(a_dir / "last.pt"), load_checkpoint(b_dir / "last.pt")
    assert straight["scaler"]["_growth_tracker"] == 20  # a live scaler: 20 steps without overflow
    assert_same_training_state(straight, resumed)
    assert_same_training_state(load_checkpoint(a_dir / "best.pt"), load_checkpoint(b_dir / "best.pt"))
    assert metrics(a_dir) == metrics(b_dir)


def test_sigterm_mid_accumulation_of_a_resumed_run_finishes_the_step_then_saves(tmp_path, text_file, monkeypatch,
                                                                                 signal_handlers):
    args = dict(grad_accum=4, max_iters=10, eval_interval=3)
    assert run_main(tiny_args(tmp_path / "stopped", text_file, **args | dict(max_iters=3))) == 0
    calls = signal_at(monkeypatch, signal.SIGTERM, call_of(2, 2, 4))  # micro-batch 2 of 4, step 5 (resumed: 2nd)
    assert run_main(tiny_args(tmp_path / "stopped", text_file, resume="true", **args)) == 143
    assert len(calls) == call_of(2, 4, 4)  # all four micro-batches of step 5 ran, none of step 6
    stopped = load_checkpoint(tmp_path / "stopped" / "last.pt")
    assert stopped["step"] == 5 and stopped["last_eval"]["step"] == 3  # the resumed run's latest eval: before it
    assert_resumes_as_straight(tmp_path / "stopped", tmp_path / "straight", text_file, **args)


def training_child(out: Path, text_file: Path, logged: int, stdout=subprocess.DEVNULL, ignored=0, **args):
    """train.py training "forever" in a child, once it logged ``logged`` steps; ``ignored``: ignored, sent meanwhile."""
    args = tiny_args(out, text_file, max_iters=100_000, eval_interval=100_000, **args)
    ignore = (lambda: signal.signal(ignored, signal.SIG_IGN)) if ignored else None
    child = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, stdout=stdout, stderr=subprocess.PIPE,
                             text=True, preexec_fn=ignore)
    metrics_file, deadline = out / "metrics.jsonl", time.time() + 120
    while not (metrics_file.is_file() and metrics_file.read_text().count("\n") >= logged):
        assert child.poll() is None and time.time() < deadline, f"training ended ({child.returncode}) or never began"
        child.send_signal(ignored) if ignored else None
        time.sleep(0.05)
    return child


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143),
                                          pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow),
                                          pytest.param(signal.SIGPIPE, 141, marks=pytest.mark.slow)])  # | head
def test_signal_from_outside_saves_the_finished_step_and_resumes_exactly(tmp_path, text_file, signum, code):
    out = tmp_path / "out"
    pipe = signum == signal.SIGPIPE
    child = training_child(out, text_file, logged=3, stdout=subprocess.PIPE if pipe else subprocess.DEVNULL)
    child.stdout.close() if pipe else child.send_signal(signum)  # SIGPIPE: its reader goes
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == code, stderr
    stopped_at = load_checkpoint(out / "last.pt")["step"]
    assert stderr.strip().splitlines()[-1] == (f"error: stopped by {signal.Signals(signum).name} after step "
                                               f"{stopped_at}; last.pt holds it, continue with --resume")
    assert metrics(out)[0][-1]["step"] == stopped_at  # the last logged step is the saved one
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    assert_resumes_as_straight(out, tmp_path / "straight", text_file, max_iters=stopped_at + 3, eval_interval=100_000)


def test_a_run_that_starts_with_sigint_ignored_keeps_it_ignored(tmp_path, text_file):
    """`python train.py &` in a script starts with SIGINT ignored: the Ctrl-C meant for the script must not stop it,
    as torch imports, as the run starts nor in the loop; SIGTERM still stops it, saving last.pt."""
    child = training_child(tmp_path / "out", text_file, logged=150, ignored=signal.SIGINT)  # ~1 s in the loop
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=120) == 143


def test_sigkill_loses_at_most_ckpt_interval_steps_and_metrics_keep_no_duplicates(tmp_path, text_file):
    out = tmp_path / "out"
    child = training_child(out, text_file, logged=10, ckpt_interval=4)
    child.kill()  # SIGKILL: no handler runs, nothing is saved on the way out
    child.communicate()
    saved = load_checkpoint(out / "last.pt")["step"]
    logged = metrics(out)[0][-1]["step"]
    assert saved % 4 == 0 and saved >= 8 and logged - saved <= 4  # at most ckpt_interval steps lost
    assert_resumes_as_straight(out, tmp_path / "straight", text_file, max_iters=logged + 2, eval_interval=100_000)


# ----------------------------------------------------------------------------- what a resume refuses
def test_each_refused_resume_is_one_line_and_touches_nothing(tmp_path, text_file, capsys):
    """Another shape, dtype (fp16's scaler), corpus or val split; a lost RNG stream; an older layout: exit 2, one
    line naming last.pt, no file of the run or of its corpus touched."""
    out, last, other = tmp_path / "out", tmp_path / "out" / "last.pt", tmp_path / "other.txt"
    assert run_main(tiny_args(out, text_file, max_iters=4, eval_interval=2)) == 0
    other.write_text(make_text(seed=1))
    assert set(other.read_text()) == set(text_file.read_text())  # the same vocabulary: only the data differs
    state = load_checkpoint(last)
    rng_without = lambda s: {k: v for k, v in state["rng"].items() if k != s}  # noqa: E731
    reads = f"error: {last} was trained on {text_file} (val_fraction 0.1), this run reads "
    cases = [  # (what last.pt holds, the resume's flags, what the error says)
        (state, dict(n_embd=64, n_layer=3), f"error: {last} was trained with other settings: n_layer: checkpoint 2 vs "
                                            "now 3; n_embd: checkpoint 32 vs now 64. Use the same settings or a new "
                                            "--out_dir\n"),
        (state, dict(dtype="float16"), "resume with --dtype float32\n"),
        (state, dict(init_from=out), f"init_from: checkpoint '' vs now '{out}'"),  # was: ignored, then recorded
        (state, dict(data_path=""), f"data_path: checkpoint '{text_file}' vs now ''"),  # was: Shakespeare prepared
        (state, dict(tokenizer="bpe"), "tokenizer: checkpoint 'char' vs now 'bpe'"),  # was: a BPE trained first
        ({**state, "config": {**state["config"], "mtp": 2}}, {}, "mtp: checkpoint 2, a field this code lacks"),
        ({**state, "model": {k: v[:1] if k.endswith("c_fc.weight") else v for k, v in state["model"].items()}}, {},
         f"error: {last}: its weights do not fit the model this code builds from its config (size mismatch for "),
        (state, dict(data_path=other), reads + f"{other} (val_fraction 0.1): its train and val split differs. "
                                              "Resume with the same --data_path and --val_fraction, or start a new "
                                              "--out_dir\n"),
        (state, dict(val_fraction=0.2), "val_fraction: checkpoint 0.1 vs now 0.2. Use the same settings"),
        *[({**state, "rng": rng_without(s), "rng_per_rank": [rng_without(s)]}, {},
           f"error: {last}: checkpoint lacks RNG state for {s}; resuming would not be exact") for s in RNG_STREAMS],
        *[(older, {}, f"error: {last}: written by an older tinygpt (format ") for older in (
            {**state, "format_version": 1}, {k: v for k, v in state.items() if k != "corpus"},
            {**state, "rng": {**state["rng"], "data": state["rng"]["data"]["generator"]}})],  # before stream state
    ]
    for saved, flags, error in cases:
        save_checkpoint(saved, last)
        run = {p: p.read_bytes() for p in out.iterdir()}
        corpora = {p: p.read_bytes() for p in (tmp_path / "data").rglob("*") if p.is_file()}
        capsys.readouterr()
        assert run_main(tiny_args(out, text_file, max_iters=8, eval_interval=2, resume="true", **flags)) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and error in err, (flags, err)
        assert {p: p.read_bytes() for p in out.iterdir()} == run  # none touched, none added
        assert {p: p.read_bytes() for p in corpora} == corpora
    # each corpus in its own folder; none for what last.pt's config refuses (another --init_from, --tokenizer,
    # --val_fraction or no --data_path), which is refused before a base is read or a corpus prepared
    assert len(list((tmp_path / "data").iterdir())) == 2


def test_a_kill_between_best_pt_and_last_pt_leaves_best_pt_the_bar(tmp_path, text_file, capsys):
    """Bugs caught: killed after best.pt's save and before last.pt's, the resume measured its evals against last.pt's
    older best val loss, and a worse model replaced best.pt; a temp file of metrics.jsonl's rewrite stayed for good."""
    out = tmp_path / "out"
    assert run_main(tiny_args(out, text_file, max_iters=2, eval_interval=2)) == 0
    shutil.copy2(out / "last.pt", tmp_path / "last-2.pt")  # its mtime too: older than the best.pt saved after it
    assert run_main(tiny_args(out, text_file, max_iters=4, eval_interval=2, resume="true")) == 0
    best = load_checkpoint(out / "best.pt")
    shutil.copy2(tmp_path / "last-2.pt", out / "last.pt")  # as if killed between step 4's best.pt and its last.pt
    (out / ".metrics.jsonl.tmp-99").write_text("{")  # and a kill in the resume's rewrite of the log: removed too
    capsys.readouterr()
    assert best["step"] == 4 and run_main(tiny_args(out, text_file, max_iters=4, eval_interval=2, resume="true")) == 0
    assert f"at step 2 (best val loss {best['best_val_loss']:.4f})" in capsys.readouterr().out
    assert load_checkpoint(out / "best.pt")["time_s"] == best["time_s"]  # step 4 again, no better: not written
    assert not (out / ".metrics.jsonl.tmp-99").exists()


def test_a_damaged_metrics_log_is_refused_in_one_line_and_a_blank_line_dropped(tmp_path, text_file, capsys):
    """A line of metrics.jsonl that is no record (text, no UTF-8, no dict, no step): exit 2, one line naming it, the
    run's files untouched; a blank line (an editor's, `echo >>`) goes with the records the resume drops."""
    out, log, resume = tmp_path / "out", tmp_path / "out" / "metrics.jsonl", dict(max_iters=6, resume="true")
    assert run_main(tiny_args(out, text_file, max_iters=4)) == 0
    good, refusal = log.read_bytes(), f"error: {log}, line 6: not a record of this run's log; mend the line or move"
    for damage in (b"garbage\n", b"\xff\xfe\n", b"[1]\n", b"{}\n", b"{\"step\": null}\n", b"{\"step\": Infinity}\n"):
        log.write_bytes(good + damage)
        run = tree(out)
        assert run_main(tiny_args(out, text_file, **resume)) == 2 and tree(out) == run
        assert capsys.readouterr().err.startswith(refusal)
    log.unlink()
    log.mkdir()  # no file to write the log in: one line (was: IsADirectoryError)
    assert run_main(tiny_args(out, text_file, **resume)) == 2 and "(Is a directory); pass a" in capsys.readouterr().err
    log.rmdir()
    log.write_bytes(good + b"\n")
    assert run_main(tiny_args(out, text_file, **resume)) == 0
    assert [record["step"] for record in metrics(out)[0]] == list(range(1, 7))


def test_a_resume_with_dtype_auto_keeps_the_precision_last_pt_trained_in(tmp_path, text_file, monkeypatch, capsys):
    """dtype=auto times bf16 against fp32 on a CPU, a noisy probe: a resume takes last.pt's, never flips (not exact)."""
    for faster, args in (("bfloat16", {}), ("float32", dict(resume="true", max_iters=4))):  # the probe changes its mind
        monkeypatch.setattr(runtime, "matmul_gflops", lambda *shape, dtype, f=faster: 9.0 if f in str(dtype) else 1.0)
        assert run_main(tiny_args(tmp_path, text_file, dtype="auto", **{"max_iters": 2, **args})) == 0
    state = load_checkpoint(tmp_path / "last.pt")  # auto stays auto: another machine's resume probes its own CPU
    assert (state["precision"], state["config"]["dtype"]) == ("bfloat16", "auto")
    assert "NOT" not in capsys.readouterr().out


def test_a_resume_keeps_the_moments_but_takes_the_new_hyperparameters():
    model = tiny_model()
    old = make_optimizer(model, 0.1, 1e-3, (0.9, 0.99), muon_lr=0.02)
    _, loss_sum, n, _ = model(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))
    (loss_sum / n).backward()
    old.step()
    new = make_optimizer(model, 0.0, 1e-3, (0.9, 0.95), muon_lr=0.01)
    optim.load_optimizer_state(new, old.state_dict())
    assert [g["lr_scale"] for g in new.param_groups] == [1.0, 1.0, 10.0]  # 0.01 / 1e-3, not the saved 20
    assert all(g["weight_decay"] == 0.0 for g in new.param_groups)
    assert new.adamw.param_groups[0]["betas"] == (0.9, 0.95)
    moments = lambda opt: list(opt.state_dict()["state"].values())  # noqa: E731
    assert all(same_weights(a, b) for a, b in zip(moments(old), moments(new), strict=True))


# ----------------------------------------------------------------------------- nothing to do, the clock, the tracker
def test_max_time_stops_annealed_and_a_resume_continues_the_clock(tmp_path, text_file, monkeypatch, capsys):
    step_clock(monkeypatch, step_s=0.25)  # a clock that moves 0.25 s per step: 12 steps spend 3 s, anywhere
    out = tmp_path / "run"
    timed = dict(schedule="time", max_iters=10**6, eval_interval=10**6, warmup_iters=2, min_lr=0, dropout=0.1)
    assert run_main(tiny_args(out, text_file, max_time=3, **timed)) == 0
    records = read_metrics(out)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))  # stopped by the clock at the first step that spent it
    assert [r["time_s"] for r in steps] == [0.25 * s for s in range(1, 13)]
    assert records[-1]["val_loss"] > 0 and records[-1]["time_s"] == 3.0 and records[-1]["step"] == 12
    cfg = make_config("tiny", max_time=3, **timed)
    assert [r["lr"] for r in steps] == [train.get_lr(s - 1, cfg, 0.25 * (s - 1)) for s in range(1, 13)]
    assert steps[-1]["lr"] < 0.05 * steps[1]["lr"]  # annealed as time ran out (step 12 began 2.75 s in)
    state = load_checkpoint(out / "last.pt")
    assert state["step"] == 12 and state["time_s"] == 3.0

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert run_main(tiny_args(out, text_file, max_time=3, resume="true", **timed)) == 0
    assert "max_time reached: nothing to do; raise --max_time to continue" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no step, no file touched

    assert run_main(tiny_args(out, text_file, max_time=5, resume="true", **timed)) == 0
    assert "WARNING: resuming with changed settings (max_time: checkpoint 3.0 vs now 5.0)" in capsys.readouterr().out
    resumed = [r for r in read_metrics(out) if "loss" in r][len(steps):]
    assert [(r["step"], r["time_s"]) for r in resumed] == [(s, 0.25 * s) for s in range(13, 21)]  # the clock goes on
    longer = make_config("tiny", max_time=5, **timed)
    assert resumed[0]["lr"] == train.get_lr(12, longer, 3.0)  # the schedule picked up at 3 of 5 s, not from the top
    assert resumed[0]["lr"] < steps[1]["lr"] * 0.5


def test_resuming_a_finished_run_does_zero_steps_opens_no_tracker_run_and_changes_nothing(tmp_path, text_file,
                                                                                            monkeypatch):
    """A wandb run opened to log nothing is one more (offline) run to sync, and a wait for wandb."""
    started = []  # cfg.resume of each tracker started
    monkeypatch.setattr(logs, "start", lambda cfg, out_dir, logged_through=None:
                        started.append(cfg.resume) or logs.NullTracker())
    out = tmp_path / "run"
    args = tiny_args(out, text_file, max_iters=6, wandb="true")
    assert run_main(args) == 0 and started == [False]
    before = {name: (out / name).read_bytes() for name in ("last.pt", "best.pt", "metrics.jsonl")}
    calls = signal_at(monkeypatch, signal.SIGTERM, call=-1)  # counts training forward passes only
    assert run_main(args + ["--resume"]) == 0 and started == [False]  # max_iters reached: nothing to log
    assert calls == [] and {name: (out / name).read_bytes() for name in before} == before
    assert run_main(args + ["--resume", "--max_iters=7"]) == 0 and started == [False, True]  # a step to do
