"""Training options are declared once: every TrainConfig field carries its resume rule, optimizers and lr
decays are tables (machinery/optim.py) whose names are the only ones the config accepts, and a run says what it
trains with. The tests below are generated from those declarations, so a new entry is tested unasked."""
from __future__ import annotations

import dataclasses
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from machinery.checkpoint import load_checkpoint, save_checkpoint
from config import (DEFAULTS, RESUME, RESUME_RULES, TrainConfig, make_config, settings_line, unused_fields,
                    unused_given)
from conftest import REPO, docs_snippet, make_text
from fault_injection import assert_same_training_state, capture_run, run_main, tiny_args
from machinery.optim import DECAYS, OPTIMIZERS, MuonAdamW


# ----------------------------------------------------------------------------- every field has a rule
def test_every_field_declares_its_resume_rule():
    """A field declared without fixed(...), warned(...) or free(...) fails here (and config cannot import)."""
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("resume") in RESUME_RULES, f"TrainConfig.{f.name} declares no resume rule"
    assert set(RESUME) == set(DEFAULTS)
    # What changes the meaning of best_val_loss, or what the weights compute, cannot change on resume.
    for name in ("eval_tokens", "seed", "tokenizer", "optimizer", "lr_decay", "n_embd", "pos_emb"):
        assert RESUME[name] == "fixed", name


@pytest.mark.parametrize("change", [dict(eval_tokens=0), dict(seed=7), dict(lr_decay="wsd"), dict(n_embd=64)])
def test_a_resume_that_changes_a_fixed_field_is_refused_and_writes_nothing(tmp_path, text_file, capsys, change):
    """Before: eval_tokens 4096 -> 0 compared a best val loss over 4,096 tokens with one over the whole split
    and overwrote best.pt as "best"; seed 1337 -> 7 was recorded while the restored RNG streams ignored it."""
    out = tmp_path / "run"
    assert run_main(tiny_args(out, text_file, max_iters=3, eval_interval=3)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert run_main(tiny_args(out, text_file, max_iters=6, eval_interval=3, resume="true", **change)) == 2
    err = capsys.readouterr().err
    name = next(iter(change))
    assert err.count("\n") == 1 and err.startswith("error: ") and f"{name}: checkpoint " in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # last.pt, best.pt, metrics.jsonl untouched


def test_a_changed_option_the_run_does_not_read_is_not_warned_about_on_resume(tmp_path, text_file, capsys):
    """muon_lr changed on an AdamW run does nothing, so saying it applies from here on would be false."""
    out = tmp_path / "run"
    assert run_main(tiny_args(out, text_file, max_iters=3, eval_interval=3)) == 0
    capsys.readouterr()
    assert run_main(tiny_args(out, text_file, max_iters=4, eval_interval=3, resume="true", muon_lr=0.5,
                              learning_rate=1e-3)) == 0
    out_text = capsys.readouterr().out
    assert "WARNING: resuming with changed settings (learning_rate: checkpoint 0.003 vs now 0.001)" in out_text
    assert "muon_lr: checkpoint" not in out_text


# ----------------------------------------------------------------------------- say what runs
def test_the_start_up_lines_name_the_optimizer_the_decay_and_every_changed_setting(tmp_path, text_file, capsys):
    assert run_main(tiny_args(tmp_path / "run", text_file, max_iters=2, optimizer="muon", lr_decay="wsd",
                              wsd_fraction=0.5, beta1=0.8)) == 0
    lines = capsys.readouterr().out.splitlines()
    settings = next(line for line in lines if line.startswith("settings: "))
    assert settings.startswith("settings: optimizer muon, lr_decay wsd, schedule steps, max_iters 2, ")
    assert "beta1 0.8" in settings and "wsd_fraction 0.5" in settings and "out_dir" not in settings


def test_a_set_option_that_the_chosen_optimizer_or_decay_does_not_read_is_warned_in_one_line(tmp_path, text_file,
                                                                                           capsys):
    cfg = make_config("tiny", muon_lr=0.01, wsd_fraction=0.3)
    assert unused_fields(cfg) >= {"muon_lr", "wsd_fraction"}
    assert unused_given(cfg) == [
        f"WARNING: {name} is set ({value}) but unused: optimizer=adamw, lr_decay=cosine, schedule=steps, "
        "tokenizer=char do not read it" for name, value in (("muon_lr", 0.01), ("wsd_fraction", 0.3))]
    assert "muon_lr" not in settings_line(cfg)
    assert unused_given(make_config("tiny", optimizer="muon", muon_lr=0.01)) == []
    timed = make_config("tiny", schedule="time", max_time=60)  # tiny sets lr_decay_iters, which time does not read
    assert unused_given(timed) == ["WARNING: lr_decay_iters is set (200) but unused: optimizer=adamw, "
                                   "lr_decay=cosine, schedule=time, tokenizer=char do not read it"]
    assert unused_given(make_config("tiny", bpe_vocab_size=512)) == [
        "WARNING: bpe_vocab_size is set (512) but unused: optimizer=adamw, lr_decay=cosine, schedule=steps, "
        "tokenizer=char do not read it"]
    assert unused_given(make_config("tiny", tokenizer="bpe", bpe_vocab_size=512)) == []
    assert run_main(tiny_args(tmp_path / "run", text_file, max_iters=1, muon_lr=0.01)) == 0
    assert unused_given(cfg)[0] in capsys.readouterr().out.splitlines()


def test_the_thread_count_is_a_field_and_the_start_up_line_says_it(tmp_path, text_file, capsys, monkeypatch):
    """Two jobs on 2 cores with torch's default (every core each) ran tiny at 418 ms/step against 5 ms/step
    with one thread each; nothing said how many threads ran."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    calls = []
    assert run_main(tiny_args(tmp_path / "one", text_file, max_iters=1, threads=1)) == 0
    assert calls == [1] and "device cpu, 1 thread, dtype float32" in capsys.readouterr().out
    assert run_main(tiny_args(tmp_path / "default", text_file, max_iters=1)) == 0
    assert calls == [1]  # 0: torch's default, left alone
    assert f"device cpu, {torch.get_num_threads()} thread" in capsys.readouterr().out


# ----------------------------------------------------------------------------- generated from the tables
def optimizer_state_kinds(name: str) -> frozenset:
    """The kinds of per-parameter state an optimizer keeps after one step of a tiny run."""
    cfg = make_config("tiny", optimizer=name, device="cpu")
    from conftest import tiny_model
    model = tiny_model()
    optimizer = train.build_optimizer(model, cfg, torch.device("cpu"))
    _, loss_sum, n, _ = model(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))
    (loss_sum / n).backward()
    optimizer.step()
    return frozenset(frozenset(state) for state in optimizer.state_dict()["state"].values())


def test_each_optimizer_keeps_its_own_kind_of_state():
    kinds = {name: optimizer_state_kinds(name) for name in OPTIMIZERS}
    for a, b in itertools.combinations(kinds, 2):
        assert kinds[a] != kinds[b], f"{a} and {b} keep the same state: is one of them the other under its name?"
    assert kinds["muon"] > kinds["adamw"]  # Muon's momentum beside AdamW's moments


def test_each_lr_decay_draws_its_own_curve_from_the_peak_to_min_lr():
    curves = {}
    for name in DECAYS:
        cfg = make_config(None, lr_decay=name, learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
        curves[name] = [train.get_lr(step, cfg) for step in range(120)]
        assert curves[name][9] == curves[name][10] == 1.0  # warmup ends at the peak, the decay starts there
        assert curves[name][110:] == [0.1] * 10  # min_lr from lr_decay_iters on
        assert curves[name] == sorted(curves[name][:10]) + sorted(curves[name][10:], reverse=True)
    for a, b in itertools.combinations(curves, 2):
        assert curves[a] != curves[b], f"lr_decay {a} and {b} draw the same curve"


def test_wsd_is_flat_then_linear_over_its_final_fraction():
    cfg = make_config(None, lr_decay="wsd", wsd_fraction=0.25, learning_rate=1.0, min_lr=0.0, warmup_iters=0,
                      lr_decay_iters=100)
    table = {0: 1.0, 74: 1.0, 75: 1.0, 80: 0.8, 90: 0.4, 99: 0.04, 100: 0.0}  # decay: steps 75 to 100
    for step, lr in table.items():
        assert train.get_lr(step, cfg) == pytest.approx(lr, abs=1e-12), step


@pytest.mark.parametrize("field, choice", [("optimizer", name) for name in OPTIMIZERS]
                         + [("lr_decay", name) for name in DECAYS])
def test_each_choice_resumes_exactly_and_is_refused_under_another(tmp_path, text_file, capsys, field, choice):
    run = dict(max_iters=6, eval_interval=3, grad_accum=2, lr_decay_iters=6, warmup_iters=2, **{field: choice})
    assert run_main(tiny_args(tmp_path / "straight", text_file, **run)) == 0
    assert run_main(tiny_args(tmp_path / "split", text_file, **{**run, "max_iters": 3})) == 0
    other = next(name for name in (OPTIMIZERS if field == "optimizer" else DECAYS) if name != choice)
    capsys.readouterr()
    assert run_main(tiny_args(tmp_path / "split", text_file, **{**run, field: other}, resume="true")) == 2
    assert f"{field}: checkpoint {choice!r} vs now {other!r}" in capsys.readouterr().err
    assert run_main(tiny_args(tmp_path / "split", text_file, **run, resume="true")) == 0
    assert_same_training_state(load_checkpoint(tmp_path / "straight" / "last.pt"),
                               load_checkpoint(tmp_path / "split" / "last.pt"))


# ----------------------------------------------------------------------------- Muon + AdamW, one Optimizer
def as_old_pair(state: dict) -> dict:
    """A MuonAdamW state as checkpoints before it held it: {"adamw": ..., "muon": ...}, each indexed from 0."""
    pair, index = {}, 0
    for kind in ("adamw", "muon"):
        groups = [g for g in state["param_groups"] if g["kind"] == kind]
        ids = [i for g in groups for i in g["params"]]
        pair[kind] = {"state": {i - index: state["state"][i] for i in ids if i in state["state"]},
                      "param_groups": [{k: (v if k != "params" else [i - index for i in v]) for k, v in g.items()
                                        if k != "kind"} for g in groups]}
        index += len(ids)
    return pair


def test_muon_with_adamw_is_one_torch_optimizer_and_old_checkpoints_resume(tmp_path, text_file, monkeypatch):
    run = dict(max_iters=6, eval_interval=3, optimizer="muon")
    captured = capture_run(monkeypatch)
    assert run_main(tiny_args(tmp_path / "straight", text_file, **run)) == 0
    optimizer = captured["optimizer"]
    assert isinstance(optimizer, torch.optim.Optimizer) and isinstance(optimizer, MuonAdamW)
    assert [g["kind"] for g in optimizer.param_groups] == ["adamw", "adamw", "muon"]
    assert run_main(tiny_args(tmp_path / "split", text_file, **{**run, "max_iters": 3})) == 0
    state = load_checkpoint(tmp_path / "split" / "last.pt")
    state["optimizer"] = as_old_pair(state["optimizer"])  # as the previous version saved it
    save_checkpoint(state, tmp_path / "split" / "last.pt")
    assert run_main(tiny_args(tmp_path / "split", text_file, **run, resume="true")) == 0
    assert_same_training_state(load_checkpoint(tmp_path / "straight" / "last.pt"),
                               load_checkpoint(tmp_path / "split" / "last.pt"))


# ----------------------------------------------------------------------------- a fork, end to end
FIELD_ANCHOR = '    wandb_project: str = free("tinygpt")  # wandb project name\n'


def fork_of_the_repo(root: Path) -> Path:
    """A copy of the repo's code with docs/experiments.md's three declarations ("Adding a training option")
    added as it says: an optimizer and an lr decay in machinery/optim.py, a training field in TrainConfig."""
    fork = root / "fork"
    ignore = shutil.ignore_patterns("tests", "docs", "out", "data", ".git", "__pycache__", "wandb", "hf")
    shutil.copytree(REPO, fork, ignore=ignore)
    entries = [docs_snippet(f"# machinery/optim.py, after the last @{kind} entry:\n") for kind in ("optimizer", "lr_decay")]
    (fork / "machinery" / "optim.py").write_text((fork / "machinery" / "optim.py").read_text() + "".join("\n\n" + e for e in entries))
    config = fork / "config" / "__init__.py"
    field = docs_snippet("# config/__init__.py, in TrainConfig, after wandb_project:\n")
    assert config.read_text().count(FIELD_ANCHOR) == 1, "update FIELD_ANCHOR to config/__init__.py"
    config.write_text(config.read_text().replace(FIELD_ANCHOR, FIELD_ANCHOR + field))
    return fork


FORK_SCRIPT = '''
import json, sys
from pathlib import Path
import torch
import train
from machinery.checkpoint import load_checkpoint
sys.path.insert(0, "scripts")
import compare
from machinery.faults import StopOnSignal

corpus, out = sys.argv[1], Path(sys.argv[2])
common = ["--config", "tiny", "--data_path", corpus, "--data_dir", str(out / "data"), "--device", "cpu",
          "--log_interval", "1", "--eval_interval", "4", "--lr_decay_iters", "4", "--warmup_iters", "1"]
def main(*args):
    try:
        train.main(common + list(args))
    except SystemExit as exit_:
        return exit_.code
    return 0
report = {}
report["train"] = main("--out_dir", str(out / "sgd"), "--max_iters", "4", "--optimizer", "sgd", "--sgd_momentum",
                       "0.8", "--lr_decay", "linear", "--label_smoothing", "0.1", "--learning_rate", "0.1", "--min_lr", "0")
state = load_checkpoint(out / "sgd" / "last.pt")
report["saved"] = {k: state["config"][k] for k in ("optimizer", "sgd_momentum", "lr_decay", "label_smoothing")}
report["state"] = sorted({k for s in state["optimizer"]["state"].values() for k in s})
report["lrs"] = [json.loads(l)["lr"] for l in (out / "sgd" / "metrics.jsonl").read_text().splitlines() if '"lr"' in l]
report["refused"] = main("--out_dir", str(out / "sgd"), "--max_iters", "5", "--optimizer", "adamw", "--lr_decay",
                         "linear", "--label_smoothing", "0.1", "--learning_rate", "0.1", "--min_lr", "0", "--resume")
report["warned"] = main("--out_dir", str(out / "sgd"), "--max_iters", "5", "--optimizer", "sgd", "--sgd_momentum",
                        "0.7", "--lr_decay", "linear", "--label_smoothing", "0.2", "--learning_rate", "0.1", "--min_lr", "0",
                        "--resume")
summary = compare.compare(["--config", "tiny", "--steps", "4", "--seeds", "2", "--out", str(out / "exp"), "--set",
                           f"data_path={corpus},data_dir={out / 'data'},device=cpu", "base:",
                           "sgd:optimizer=sgd,learning_rate=0.1,min_lr=0,lr_decay=linear,label_smoothing=0.1"],
                          StopOnSignal(install=False))
report["compared"] = [v["name"] for v in summary["variants"]]
print("REPORT " + json.dumps(report))
'''


def test_a_forked_optimizer_decay_and_field_each_one_declaration_are_honoured_end_to_end(tmp_path):
    """Flag, start-up line, checkpoint, resume rule and compare.py variant, with no other edit anywhere."""
    fork = fork_of_the_repo(tmp_path)
    (tmp_path / "corpus.txt").write_text(make_text())
    result = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(tmp_path / "corpus.txt"), str(tmp_path / "o")],
                            cwd=fork, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    assert report["train"] == 0 and report["refused"] == 2 and report["warned"] == 0
    assert report["saved"] == {"optimizer": "sgd", "sgd_momentum": 0.8, "lr_decay": "linear",
                               "label_smoothing": 0.1}
    assert report["state"] == ["momentum_buffer"]  # SGD's own state: not AdamW under another name
    assert report["lrs"][1:] == pytest.approx([0.1 * (1 - p) for p in (0, 1 / 3, 2 / 3)])  # linear after warmup
    assert report["compared"] == ["base", "sgd"]
    out = result.stdout
    assert "settings: optimizer sgd, lr_decay linear, schedule steps, max_iters 4, " in out
    assert "label_smoothing 0.1" in out and "sgd_momentum 0.8" in out
    assert "optimizer: checkpoint 'sgd' vs now 'adamw'" in result.stderr
    assert "resuming with changed settings (label_smoothing: checkpoint 0.1 vs now 0.2; " in out
    assert "sgd_momentum: checkpoint 0.8 vs now 0.7" in out
    assert "WARNING: beta1" not in out  # beta1 is the preset's default: nothing given, nothing to warn about
    help_text = subprocess.run([sys.executable, "train.py", "--help"], cwd=fork, capture_output=True, text=True).stdout
    assert "--sgd_momentum" in help_text and "--label_smoothing" in help_text
    assert "sgd: SGD with momentum" in re.sub(r"\s+", " ", help_text)


def test_a_name_without_a_builder_cannot_be_given(capsys):
    assert run_main(["--config", "tiny", "--optimizer", "sgd"]) == 2
    assert "optimizer must be one of adamw, muon, got `sgd`" in capsys.readouterr().err
