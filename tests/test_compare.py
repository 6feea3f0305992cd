"""scripts/compare.py on tiny runs: a worse variant is significant, identical ones tie exactly, a rerun trains
nothing, a stopped comparison resumes to the same numbers, stale runs are retrained (bad input: test_bad_input.py)."""
from __future__ import annotations

import json
import math
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import REPO, make_text, read_metrics, run_main
from fault_injection import step_clock

import runtime
import train
from cli import RunStopped, StopOnSignal
from scripts import compare, plot

STEPS = 40  # tiny: ~0.5 s a run; the loss falls from ~3.9 to ~2.8 at the preset's lr, barely at 1/100 of it
SLOW = "slow:learning_rate=3e-5,min_lr=3e-6"  # 100x smaller lr (min_lr must stay below it)


def argv(corpus: Path, out: Path, *variants: str, seeds: int = 3,
         budget: tuple[str, ...] = ("--steps", str(STEPS))) -> list[str]:
    return ["--config", "tiny", *budget, "--seeds", str(seeds), "--out", str(out),
            "--set", f"data_path={corpus},data_dir={corpus.parent / 'data'},device=cpu", *variants]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, dict]:
    """One finished comparison, shared by the tests that only read it: 3 variants x 3 seeds."""
    root = tmp_path_factory.mktemp("compare")
    (root / "corpus.txt").write_text(make_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as conftest's one_thread, which a module fixture runs before
    try:
        summary = compare.compare(argv(root / "corpus.txt", root / "exp", "base:", "same:", SLOW),
                                  StopOnSignal(install=False))
    finally:
        torch.set_num_threads(threads)
    return root, summary


def row(summary: dict, name: str) -> dict:
    return next(v for v in summary["variants"] if v["name"] == name)


def per_seed(summary: dict, name: str, metric: str) -> list[float]:
    return [r[metric] for r in row(summary, name)["runs"]]


def test_a_clearly_worse_variant_is_significant_and_identical_ones_tie_exactly(finished):
    _, summary = finished
    for metric in ("val_loss", "val_bpb"):
        slow = row(summary, "slow")[metric]
        assert slow["p"] < 0.05 and 0 < slow["low"] <= slow["diff"] <= slow["high"], slow
        assert per_seed(summary, "same", metric) == per_seed(summary, "base", metric)  # bit for bit
        assert len(set(per_seed(summary, "base", metric))) == 3  # while the seeds do differ
        same = row(summary, "same")[metric]
        assert (same["diff"], same["low"], same["high"], same["p"]) == (0.0, 0.0, 0.0, 1.0)
    assert row(summary, "slow")["val_loss"]["diff"] > 0.5  # ~1.0: 40 steps at 1/100 of the lr learn little


def test_the_folder_holds_every_run_and_the_reports_plot_draws(finished, tmp_path):
    root, summary = finished
    exp = root / "exp"
    for variant in ("base", "same", "slow"):
        for seed in (1, 2, 3):
            run = exp / variant / f"seed-{seed}"
            result = json.loads((run / "result.json").read_text())
            assert (result["step"], result["config"]["seed"], result["config"]["max_iters"]) == (STEPS, seed, STEPS)
            assert result["config"]["schedule"] == "steps" and result["config"]["lr_decay_iters"] == STEPS
            assert (run / "last.pt").is_file()
    assert json.loads((exp / "results.json").read_text())["variants"][2]["val_loss"] == row(summary, "slow")["val_loss"]
    assert row(summary, "base")["speed_ratio"] == 1.0 and row(summary, "base")["params"] > 0
    assert all(math.isfinite(row(summary, v)["speed_ratio"]) for v in ("same", "slow"))
    assert "scipy.stats.ttest_rel" in (exp / "results.md").read_text()
    assert (exp / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = plot.expand(exp)
    assert [label for _, label in runs] == ["base"] * 3 + ["same"] * 3 + ["slow"] * 3  # baseline first
    assert [p.parent.name for p, _ in runs[:3]] == ["seed-1", "seed-2", "seed-3"]
    (label, _, val), *_ = plot.group_runs([p for p, _ in runs], [label for _, label in runs])
    steps, mean, low, high = plot.aggregate(val, "step", "val_loss")
    base = per_seed(summary, "base", "val_loss")
    assert (label, steps[-1], low[-1], high[-1]) == ("base", STEPS, min(base), max(base))
    assert mean[-1] == pytest.approx(row(summary, "base")["val_loss"]["mean"], rel=1e-12)
    plot.main([str(exp), "--bpb", "-o", str(tmp_path / "cmp.png")])
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rerun_trains_nothing_unless_the_code_changed(finished, tmp_path, monkeypatch, capsys):
    """Same tables, no run trained, even of runs saved before a config field (text_column) existed; --vs takes every
    difference against the named control. Edited code: each run is set aside in EXP/stale/ and trained again."""
    root, summary = finished
    shutil.copytree(root / "exp", tmp_path / "exp")  # its reports are rewritten: the shared folder's stay
    for result in (tmp_path / "exp").glob("*/seed-*/result.json"):
        record = json.loads(result.read_text())
        del record["config"]["text_column"]
        result.write_text(json.dumps(record))
    with monkeypatch.context() as patched:
        patched.setattr(train, "train", lambda *a, **k: pytest.fail("a finished run was trained again"))
        command = argv(root / "corpus.txt", tmp_path / "exp", "base:", "same:", SLOW)
        compare.compare(command, StopOnSignal(install=False))
        tables = [(folder / "results.md").read_text().split("\n", 1)[1] for folder in (tmp_path / "exp", root / "exp")]
        assert tables[0] == tables[1]  # all but the first line, the command, whose --out differs

        against_slow = compare.compare(command + ["--vs", "slow"], StopOnSignal(install=False))
    assert against_slow["baseline"] == "slow" and "p" not in row(against_slow, "slow")["val_loss"]
    assert row(against_slow, "base")["val_loss"]["diff"] == pytest.approx(-row(summary, "slow")["val_loss"]["diff"])
    assert row(against_slow, "slow")["speed_ratio"] == 1.0
    assert "Δ vs slow [95% CI]" in (tmp_path / "exp" / "results.md").read_text()

    old_code = json.loads((tmp_path / "exp" / "base" / "seed-1" / "result.json").read_text())["code"]
    corpus = old_code.pop("corpus")  # the finished runs recorded the code and the corpus that made them
    assert old_code == compare.code_fingerprint() and corpus.startswith("corpus-")
    edited = {"hash": "0123456789ab", "commit": old_code["commit"] + "+edits"}
    monkeypatch.setattr(compare, "code_fingerprint", lambda: edited)
    earlier = tmp_path / "exp" / "stale" / old_code["hash"] / "base" / "seed-1"  # set aside before: code edited
    earlier.mkdir(parents=True)  # back and forth (was: a traceback renaming onto it)
    (earlier / "metrics.jsonl").write_text("its own\n")
    capsys.readouterr()
    rerun = compare.compare(argv(root / "corpus.txt", tmp_path / "exp", "base:"), StopOnSignal(install=False))
    out = capsys.readouterr().out
    assert out.count(f"retraining: it ran code {old_code['hash']} (commit {old_code['commit']}) on {corpus}, this "
                     f"is code 0123456789ab") == 3 and "finished earlier" not in out
    for seed in (1, 2, 3):
        kept = earlier.parent / (f"seed-{seed}" if seed > 1 else "seed-1.2") / "result.json"
        assert json.loads(kept.read_text())["code"] == {**old_code, "corpus": corpus}  # kept, out of the tables
        result = tmp_path / "exp" / "base" / f"seed-{seed}" / "result.json"
        assert json.loads(result.read_text())["code"] == {**edited, "corpus": corpus}
    assert (earlier / "metrics.jsonl").read_text() == "its own\n"
    assert per_seed(rerun, "base", "val_loss") == per_seed(summary, "base", "val_loss")  # same code, in truth
    result.write_text(result.read_text().replace(corpus, "corpus-0123456789ab"))  # the file's text edited since
    compare.compare(argv(root / "corpus.txt", tmp_path / "exp", "base:"), StopOnSignal(install=False))
    out = capsys.readouterr().out
    assert out.count("finished earlier") == 2 and "ran code 0123456789ab (commit " in out and " on corpus-0123" in out
    assert [label for _, label in plot.expand(tmp_path / "exp")] == ["base"] * 3  # not the stale runs


def test_a_diverged_run_is_a_result_with_nan_in_its_tables(finished, tmp_path, monkeypatch):
    """Bug caught: statistics.stdev raised on a diverged run's nan, and its comparison never got its tables."""
    root, _ = finished
    shutil.copytree(root / "exp", tmp_path / "exp")
    result = tmp_path / "exp" / "same" / "seed-2" / "result.json"
    result.write_text(json.dumps({**json.loads(result.read_text()), "val_loss": math.nan, "diverged": "non-finite"}))
    monkeypatch.setattr(train, "train", lambda *a, **k: pytest.fail("a finished run was trained again"))
    summary = compare.compare(argv(root / "corpus.txt", tmp_path / "exp", "base:", "same:", SLOW),
                              StopOnSignal(install=False))
    assert math.isnan(row(summary, "same")["val_loss"]["sd"]) and row(summary, "base")["val_loss"]["sd"] > 0
    assert "nan: diverged (non-finite loss): same seed 2" in (tmp_path / "exp" / "results.md").read_text()


def test_a_stopped_comparison_resumes_to_the_numbers_of_one_never_stopped(finished, tmp_path, monkeypatch):
    """SIGINT at step 15 of seed 2 saves that run and exits 130; the same command resumes it, bit for bit."""
    root, unstopped = finished
    command = argv(root / "corpus.txt", tmp_path / "exp", "base:", seeds=2)
    stop, get_lr = StopOnSignal(install=False), train.get_lr

    def signal_at_step_15_of_seed_2(step, cfg, time_s=0.0):
        if cfg.seed == 2 and step == 15:
            stop.signum = signal.SIGINT  # what StopOnSignal.handle records
        return get_lr(step, cfg, time_s)

    monkeypatch.setattr(train, "get_lr", signal_at_step_15_of_seed_2)
    with pytest.raises(RunStopped) as stopped:
        compare.compare(command, stop)
    assert stopped.value.exit_code == 130
    assert "continue with the same command: python -m scripts.compare" in str(stopped.value)
    seed_2 = tmp_path / "exp" / "base" / "seed-2"
    assert (seed_2 / "last.pt").is_file() and not (seed_2 / "result.json").exists()

    monkeypatch.setattr(train, "get_lr", get_lr)
    resumed = compare.compare(command, StopOnSignal(install=False))
    for metric in ("val_loss", "val_bpb"):
        assert per_seed(resumed, "base", metric) == per_seed(unstopped, "base", metric)[:2]


def test_time_mode_gives_every_run_the_same_wall_clock(finished, tmp_path, monkeypatch):
    """--time S: every run trains until its clock (evals included) reaches S, then ends with an eval. With 0.25 s
    steps and 0.5 s evals, 2 s is steps 1-4, the eval at step 4, steps 5-6 and the final eval, for every seed."""
    root, _ = finished
    step_clock(monkeypatch, step_s=0.25, eval_s=0.5)
    command = argv(root / "corpus.txt", tmp_path / "exp", "base:", seeds=2, budget=("--time", "2"))
    summary = compare.compare(command + ["--set", "eval_interval=4,log_interval=1"], StopOnSignal(install=False))
    assert summary["mode"] == "time" and summary["budget"] == 2
    assert [r["step"] for r in row(summary, "base")["runs"]] == [6, 6]
    for seed in (1, 2):
        records = read_metrics(tmp_path / "exp" / "base" / f"seed-{seed}")
        assert [(r["step"], r["time_s"]) for r in records if "val_loss" in r] == [(4, 1.5), (6, 2.5)]
        assert [r["time_s"] for r in records if "loss" in r] == [0.25, 0.5, 0.75, 1.0, 1.75, 2.0]


def test_a_folder_holding_runs_with_other_settings_is_refused(finished, capsys):
    root, _ = finished
    before = {p: p.stat().st_mtime_ns for p in (root / "exp").rglob("*")}
    code = run_main(argv(root / "corpus.txt", root / "exp", "base:", budget=("--steps", "30")), compare.main)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "holds a run with other settings (max_iters: 40 there, 30 now;" in err, err
    assert {p: p.stat().st_mtime_ns for p in (root / "exp").rglob("*")} == before


def test_every_run_gets_the_budget_its_seed_its_folder_in_rounds_and_one_dtype(tmp_path, text_file, monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "run_dtype", lambda *a: calls.append(a) or torch.bfloat16)  # choose_runtime's
    parser = compare.build_parser()
    plan = compare.make_plan(parser.parse_args(argv(text_file, tmp_path / "e", "a:", "b:n_embd=64", seeds=2)
                                               + ["--set", "dtype=auto"]), "")
    assert [(r.variant, r.seed) for r in plan.runs] == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]  # round by round
    assert len(calls) == 1 and {r.config().dtype for r in plan.runs} == {"bfloat16"}  # dtype=auto: decided once
    cfg = plan.runs[3].config()
    assert (cfg.schedule, cfg.max_iters, cfg.lr_decay_iters, cfg.max_time, cfg.seed, cfg.n_embd) == \
        ("steps", STEPS, STEPS, 0.0, 2, 64)
    assert Path(cfg.out_dir) == tmp_path / "e" / "b" / "seed-2"
    timed = compare.make_plan(parser.parse_args(argv(text_file, tmp_path / "e", "a:", budget=("--time", "90"))), "")
    cfg = timed.runs[0].config()
    assert (cfg.schedule, cfg.max_time) == ("time", 90.0) and cfg.max_iters >= 10**9
    chat = compare.make_plan(parser.parse_args(["--config", "chat_small", "--steps", "2", "--out", str(tmp_path / "e"),
                                                "full:", "lora:lora_rank=4"]), "")  # was: "unknown dataset"
    assert chat.runs[0].made_by({}) == {"corpus": "shakespeare_chat"}  # the built-in conversations
    assert not (tmp_path / "e").exists()  # planning writes nothing


def test_the_code_fingerprint_follows_the_training_sources_and_nothing_else(tmp_path, monkeypatch):
    """Editing model.py (or adding a module train.py could import) changes it; docs and tests do not."""
    fork = tmp_path / "fork"
    shutil.copytree(REPO, fork, ignore=shutil.ignore_patterns(".git", "out", "data", "__pycache__", "wandb", "hf"))
    monkeypatch.setattr(compare, "REPO", fork)  # no .git in the copy: the files are found by walking it
    before = compare.code_fingerprint()
    assert "model.py" in compare.source_files()
    (fork / "docs" / "experiments.md").write_text("edited")
    (fork / "tests" / "test_model.py").write_text("edited")
    assert compare.code_fingerprint() == before
    (fork / "model.py").write_text((fork / "model.py").read_text() + "\n# a fork's edit\n")
    edited = compare.code_fingerprint()
    assert edited["hash"] != before["hash"]
    (fork / "swiglu.py").write_text("WIDTH = 3\n")  # a new module, not yet added to git
    assert compare.code_fingerprint()["hash"] not in (before["hash"], edited["hash"])


@pytest.mark.parametrize("state, commit", [({"git_commit": "0123456789abcdef", "git_dirty": False}, "0123456"),
                                           ({"git_commit": "0123456789abcdef", "git_dirty": True}, "0123456+edits"),
                                           ({"git_commit": "", "git_dirty": False}, "no git")])
def test_the_commit_beside_the_code_hash_is_the_one_checkpoints_record(monkeypatch, state, commit):
    monkeypatch.setattr(compare, "git_state", lambda: state)
    assert compare.code_fingerprint()["commit"] == commit
