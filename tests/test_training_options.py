"""Training options are declared once: every TrainConfig field carries its resume rule, optimizers and lr
schedules are tables (training/optim.py) whose names are the only ones the config accepts, what each entry
reads is recorded (never declared), and a run says what it trains with. The tests below are generated from
those declarations, so a new entry is tested unasked."""
from __future__ import annotations

import ast
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
from training.checkpoint import load_checkpoint, save_checkpoint
import config
from config import (CHOOSERS, DEFAULTS, FIELD_TYPES, LOOP_FIELDS, MODEL_OPTIONS, RESUME, RESUME_RULES, TABLES,
                    ReadRecorder, TrainConfig, choice_reads, make_config, record_reads, settings_line, throwaway_model,
                    unused_fields, unused_given)
from conftest import REPO, docs_snippet, make_text, run_main, tiny_args
from fault_injection import assert_same_training_state, capture_run
from training.optim import CLOCKS, DECAYS, OPTIMIZERS, MuonAdamW


# ----------------------------------------------------------------------------- every field has a rule
def test_every_field_declares_its_resume_rule():
    """A field declared without fixed(...), warned(...) or free(...) fails here (and config cannot import)."""
    for f in config.OPTIONS:
        assert f.metadata.get("resume") in RESUME_RULES, f"TrainConfig.{f.name} declares no resume rule"
    assert set(RESUME) == set(DEFAULTS) == {f.name for f in dataclasses.fields(TrainConfig)} - {"given"}
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


SCHEDULE_CASE = dict(learning_rate=1.0, min_lr=0.1, lr_decay_iters=1100, max_iters=1500)
WARMUP = 100  # a warmup step moves the lr by peak / WARMUP: no step of any curve may move it more


def curve_of(name: str, warmup_iters: int) -> tuple[TrainConfig, list[float]]:
    cfg = make_config(None, lr_decay=name, warmup_iters=warmup_iters, **SCHEDULE_CASE)
    return cfg, [train.get_lr(step, cfg) for step in range(cfg.max_iters)]


@pytest.mark.parametrize("warmup_iters", [WARMUP, 0], ids=["warmup", "no-warmup"])
@pytest.mark.parametrize("name", list(DECAYS))
def test_each_lr_schedule_draws_a_curve_of_its_kind(name, warmup_iters):
    """Before: get_lr cut every curve to min_lr at lr_decay_iters, so a step schedule fell off a cliff there
    (inverse-sqrt: 9.51e-04 at step 199, 3.00e-04 at step 200), and this test required the cut of every entry."""
    cfg, curve = curve_of(name, warmup_iters)
    peak, floor = cfg.learning_rate, cfg.min_lr
    rise = warmup_iters if "warmup_iters" in choice_reads(cfg)[0] else 0  # a step schedule may have no warmup
    assert curve[:rise] == sorted(set(curve[:rise]))  # the warmup rises, every step
    assert curve[rise] == peak and curve[rise - 1 if rise else 0] == peak  # to the peak, where the decay starts
    assert curve[rise:] == sorted(curve[rise:], reverse=True)  # and never rises again
    assert min(curve[rise:]) >= floor  # nor falls below min_lr (a warmup may start under it)
    if DECAYS[name].clocks == CLOCKS:  # a progress decay (@lr_decay): no cliff, and the standard curve's end
        jumps = [(step, b - a) for step, (a, b) in enumerate(zip(curve, curve[1:]), start=1)]
        step, jump = max(jumps, key=lambda j: abs(j[1]))
        assert abs(jump) <= peak / WARMUP + 1e-12, f"{name} jumps by {jump:.3g} at step {step}: a cliff"
        assert curve[cfg.lr_decay_iters:] == [floor] * (cfg.max_iters - cfg.lr_decay_iters)
    # A step schedule (@lr_schedule) owns its whole curve, jumps included (a step decay has them): get_lr adds
    # none (test_get_lr_is_the_schedules_own_curve_and_cuts_nothing), and a recipe states its own shape.


def test_each_lr_schedule_draws_its_own_curve():
    curves = {name: curve_of(name, WARMUP)[1] for name in DECAYS}
    for a, b in itertools.combinations(curves, 2):
        assert curves[a] != curves[b], f"lr_decay {a} and {b} draw the same curve"


# ----------------------------------------------------------------------------- what an entry reads: recorded
NUMERIC = [name for name, kind in FIELD_TYPES.items() if kind in (int, float)]
READ_CASE = dict(warmup_iters=10, lr_decay_iters=60, max_iters=80, max_time=40)  # each end inside 100 steps
CHOICES = [("optimizer", name, "steps") for name in OPTIMIZERS] + [
    ("lr_decay", name, clock) for name, entry in DECAYS.items() for clock in entry.clocks]


def perturbed(cfg: TrainConfig, name: str) -> TrainConfig:
    """``cfg`` with one numeric field moved a little (kept in [0, 1) where it was there: betas, fractions)."""
    value = getattr(cfg, name)
    return dataclasses.replace(cfg, **{name: value + 1 if isinstance(value, int) else value * 0.75 + 0.01})


def made_by(field: str, name: str, cfg: TrainConfig) -> object:
    """What an entry makes of ``cfg``: an optimizer's param groups (all but the params) and defaults, or an lr
    curve over 100 steps at 0.5 s a step and at 0.125 s (under schedule=time, the clock leads the first, and
    max_iters the second: READ_CASE's 40 s are spent at step 80 or step 320)."""
    if field == "optimizer":
        built = OPTIMIZERS[name].build(throwaway_model(), cfg, torch.device("cpu"), torch.float32)
        return [{k: v for k, v in group.items() if k != "params"} for group in built.param_groups], built.defaults
    return [DECAYS[name].lr(step, cfg, step * step_s) for step_s in (0.5, 0.125) for step in range(100)]


def misread(field: str, name: str, clock: str) -> tuple[set[str], set[str]]:
    """(fields whose change changes what the entry makes but which the recording missed, fields recorded as
    read whose change changes nothing): both empty when the recording is the truth."""
    cfg = make_config(None, schedule=clock, **{field: name}, **READ_CASE)
    recorded, made = record_reads(field, name, cfg), made_by(field, name, cfg)
    changed = {f for f in NUMERIC if made_by(field, name, perturbed(cfg, f)) != made}
    return changed - recorded, (recorded & set(NUMERIC)) - changed


@pytest.mark.parametrize("field, name, clock", CHOICES, ids=[f"{f}={n}-{c}" for f, n, c in CHOICES])
def test_what_an_entry_reads_is_recorded_and_is_what_changes_it(field, name, clock):
    """uses=(...) was kept by hand: uses=("warmup_iters",) on a new decay made every cosine run warn that
    warmup_iters was unused, and a Lion entry without beta1 warned "unused" for a field it read, and let a
    resume change it without a word. Now the reads are recorded; here every numeric field is perturbed in
    turn, and the fields whose change alters the optimizer or the curve must be exactly those recorded."""
    hidden, idle = misread(field, name, clock)
    assert hidden == set(), f"{field}={name} depends on {hidden} through a read the recorder did not see"
    assert idle == set(), f"{field}={name} is recorded reading {idle}, whose change changes nothing"
    cfg = make_config(None, schedule=clock, **{field: name}, **READ_CASE)
    assert set(TABLES[field][name].options) <= record_reads(field, name, cfg), "an Option its entry never reads"


def test_a_read_around_the_recorder_and_a_recorded_read_that_does_nothing_are_both_caught(monkeypatch):
    """The teeth of the test above: a recorder blind to beta1, then a recording that claims grad_clip."""
    real_getattr = ReadRecorder.__getattr__
    monkeypatch.setattr(ReadRecorder, "__getattr__", lambda self, attr: getattr(self.wrapped, attr)
                        if attr == "beta1" else real_getattr(self, attr))
    assert misread("optimizer", "adamw", "steps") == ({"beta1"}, set())
    monkeypatch.undo()
    real_record = config.record_reads
    monkeypatch.setitem(globals(), "record_reads", lambda *args: real_record(*args) | {"grad_clip"})  # misread's
    assert misread("lr_decay", "cosine", "steps") == (set(), {"grad_clip"})


def test_an_entry_declared_the_old_way_with_uses_fails_at_import_saying_why():
    from training.optim import optimizer
    with pytest.raises(TypeError, match=r"@optimizer\('sgd', uses=...\): not an Option; .* there is no uses="):
        optimizer("sgd", uses=("weight_decay",))(lambda model, cfg, device, dtype: None)
    assert "sgd" not in OPTIMIZERS


def test_recording_leaves_the_random_streams_alone_and_runs_once_per_config():
    """The recording builds a model (whose init draws from the global RNG) at a run's start, after the RNG was
    seeded or restored from a checkpoint: it must not move the stream the run's dropout then draws from."""
    state, recorded = torch.get_rng_state(), config.recorded_reads.cache_info().misses
    cfg = make_config("tiny", seed=4242)
    unused_fields(cfg)
    assert config.recorded_reads.cache_info().misses == recorded + 1  # recorded here, not by an earlier test
    assert torch.equal(torch.get_rng_state(), state)
    hits = config.recorded_reads.cache_info().hits
    assert unused_fields(make_config("tiny", seed=4242)) == unused_fields(cfg)  # an equal config: from the cache
    assert config.recorded_reads.cache_info().hits == hits + 2


def cfg_reads(path: Path, skip: tuple[str, ...] = ()) -> set[str]:
    """Attribute names read as ``cfg.NAME`` in a source file, outside the functions named in ``skip``."""
    tree = ast.parse(path.read_text())
    nodes = [node for top in tree.body if not (isinstance(top, ast.FunctionDef) and top.name in skip)
             for node in ast.walk(top)]
    def is_cfg(value: ast.expr) -> bool:  # cfg, or something's .cfg (run.cfg)
        return isinstance(value, ast.Name) and value.id == "cfg" or isinstance(value, ast.Attribute) and value.attr == "cfg"
    return {node.attr for node in nodes if isinstance(node, ast.Attribute) and is_cfg(node.value)}


def test_loop_fields_are_the_fields_the_run_reads_that_only_some_choices_read():
    """A field some optimizer or schedule reads counts as unused under the others, unless the run reads it anyway
    (max_time: the loop stops on it whatever the schedule). LOOP_FIELDS names every field the run's code reads
    (train.py outside the lr curve, data.py, the folders but the tables), so a fork's entry that reads one too
    (batch_size, for a linear-scaling rule) needs no edit; it must hold at least those that some choices read
    and not every combination does, and nothing the run does not read."""
    run_code = [(REPO / "train.py", ("get_lr", "set_lr")), (REPO / "data.py", ())]
    run_code += [(path, ()) for folder in ("process", "prepare", "training", "weights")
                 for path in sorted((REPO / folder).glob("*.py")) if path.name != "optim.py"]
    run_reads = set().union(*(cfg_reads(path, skip) for path, skip in run_code))
    method_reads = {"out_of_time": {"max_time"}, "tokens_per_step": {"batch_size", "block_size", "grad_accum"}}
    assert {name for name in run_reads if callable(getattr(TrainConfig, name, None))} <= set(method_reads)
    run_reads |= {read for method, reads in method_reads.items() if method in run_reads for read in reads}
    combos = [record_reads("optimizer", opt, cfg) | record_reads("lr_decay", decay, cfg)
              for opt in OPTIMIZERS for decay, entry in DECAYS.items() for clock in entry.clocks
              for cfg in [make_config(None, optimizer=opt, lr_decay=decay, schedule=clock, **READ_CASE)]]
    some_choices = set().union(*combos) - set(CHOOSERS) - set(MODEL_OPTIONS)
    every_run = set.intersection(*map(set, combos))
    needed, read = (run_reads & some_choices) - every_run, run_reads - {"bpe_vocab_size"}  # the tokenizer's: TOKENIZER_USES
    assert needed <= set(LOOP_FIELDS), f"add {sorted(needed - set(LOOP_FIELDS))} to config.LOOP_FIELDS: the run reads them"
    assert set(LOOP_FIELDS) <= read, f"drop {sorted(set(LOOP_FIELDS) - read)} from config.LOOP_FIELDS: the run does not read them"


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
FIELD_ANCHOR = '    wandb_project: str = free("tinygpt", "wandb project name")\n'


SGD = "# training/optim.py, after the last @optimizer entry:\n"  # the headings of the page's python blocks
LINEAR = "# training/optim.py, after the last @lr_decay entry:\n"
LION = "# training/optim.py, after the last @optimizer entry (Lion):\n"
INVERSE_SQRT = "# training/optim.py, after the last @lr_decay entry (inverse-sqrt):\n"


def fork_of_the_repo(root: Path, entries: tuple[str, ...] = (SGD, LINEAR), field: bool = True,
                     tests: bool = False) -> Path:
    """A copy of the repo's code with docs/experiments.md's declarations ("Adding a training option") added
    as it says: the blocks headed ``entries`` at the end of training/optim.py, and (``field``) its training
    field in TrainConfig. With ``tests``, the copy has the test suite too, to run there."""
    fork = root / "fork"
    ignore = shutil.ignore_patterns(*([] if tests else ["tests"]), "docs", "out", "data", ".git", "__pycache__",
                                    "wandb", "hf")
    shutil.copytree(REPO, fork, ignore=ignore)
    optim_file = fork / "training" / "optim.py"
    optim_file.write_text(optim_file.read_text() + "".join("\n\n" + docs_snippet(heading) for heading in entries))
    if field:
        config_file = fork / "config" / "__init__.py"
        assert config_file.read_text().count(FIELD_ANCHOR) == 1, "update FIELD_ANCHOR to config/__init__.py"
        declaration = docs_snippet("# config/__init__.py, in RunFields, after wandb_project:\n")
        config_file.write_text(config_file.read_text().replace(FIELD_ANCHOR, FIELD_ANCHOR + declaration))
    return fork


FORK_SCRIPT = '''
import json, sys
from pathlib import Path
import torch
import train
from training.checkpoint import load_checkpoint
from training.faults import StopOnSignal
from scripts import compare

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
    assert f"optimizer must be one of {', '.join(OPTIMIZERS)}, got `sgd`" in capsys.readouterr().err


RECIPES_SCRIPT = '''
import contextlib, io, json, sys
from pathlib import Path
import torch
import train
from config import make_config, unused_given
from training.checkpoint import load_checkpoint
from tests.conftest import read_metrics
from tests.fault_injection import assert_same_training_state

corpus, out = sys.argv[1], Path(sys.argv[2])
common = ["--config", "tiny", "--data_path", corpus, "--data_dir", str(out / "data"), "--device", "cpu",
          "--log_interval", "1", "--eval_interval", "3", "--optimizer", "lion", "--lr_decay", "inverse_sqrt",
          "--warmup_iters", "2", "--rsqrt_timescale", "50"]
def main(*args):
    """train.main on the common arguments: its exit code, and what it printed."""
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        try:
            train.main(common + list(args))
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    return {"code": code, "out": printed.getvalue(), "err": errors.getvalue()}

report = {"tiny": {step: train.get_lr(step, make_config("tiny", lr_decay="inverse_sqrt")) for step in (19, 199, 200)},
          "cosine_200": train.get_lr(200, make_config("tiny")),
          "cold": [train.get_lr(step, make_config("tiny", lr_decay="inverse_sqrt", warmup_iters=0)) for step in (0, 100)],
          "adamw_warned": unused_given(make_config("tiny", lr_decay="inverse_sqrt")),
          "lion_warned": unused_given(make_config("tiny", optimizer="lion", muon_lr=0.01))}
report["straight"] = main("--out_dir", str(out / "straight"), "--max_iters", "6")
state = load_checkpoint(out / "straight" / "last.pt")
report["state"] = [sorted(s) for s in state["optimizer"]["state"].values()]
report["state_shapes"] = [list(s["momentum"].shape) for s in state["optimizer"]["state"].values()]
report["param_shapes"] = [list(p.shape) for name, p in state["model"].items() if name != "lm_head.weight"]  # tied
report["lrs"] = [r["lr"] for r in read_metrics(out / "straight") if "lr" in r]
report["split"] = main("--out_dir", str(out / "split"), "--max_iters", "3")
report["resumed"] = main("--out_dir", str(out / "split"), "--max_iters", "6", "--resume")
assert_same_training_state(state, load_checkpoint(out / "split" / "last.pt"))  # raises unless bit for bit
report["beta1"] = main("--out_dir", str(out / "split"), "--max_iters", "7", "--resume", "--beta1", "0.8")
report["timed"] = main("--out_dir", str(out / "timed"), "--schedule", "time", "--max_time", "60")
print("REPORT " + json.dumps(report))
'''


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.slow
def test_the_recipes_of_this_page_fork_the_repo_end_to_end(tmp_path):
    """docs/experiments.md's inverse-sqrt and Lion recipes, taken from the page, in a copy of the repo with its
    tests: flags, start-up lines, the curve with and without warmup and without a cliff, schedule=time
    refused, unused fields warned, Lion's own state, resumes (bit for bit; a changed beta1 warned), then the
    copy's own generated tests for the two entries. (Its name names neither, so the copy never runs it.)"""
    fork = fork_of_the_repo(tmp_path, entries=(SGD, LION, INVERSE_SQRT), field=False, tests=True)
    (tmp_path / "corpus.txt").write_text(make_text())
    result = subprocess.run([sys.executable, "-c", RECIPES_SCRIPT, str(tmp_path / "corpus.txt"), str(tmp_path / "o")],
                            cwd=fork, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    page = one_line((REPO / "docs" / "experiments.md").read_text())

    # The curve on tiny (warmup 20, lr 3e-3): no cliff at lr_decay_iters (200), as the page says.
    tiny = {int(step): lr for step, lr in report["tiny"].items()}
    assert tiny[19] == 3e-3 and f"{tiny[199]:.2e}" == "1.80e-03" and f"{tiny[200]:.2e}" == "1.79e-03"
    assert "the lr is 1.80e-03 at step 199 and 1.79e-03 at step 200, where a cosine is at `min_lr` already" in page
    assert report["cosine_200"] == 3e-4
    assert report["cold"] == [3e-3, pytest.approx(3e-3 / 2 ** 0.5)]  # no warmup: the peak at step 0, 1/sqrt(2) at T
    # What it does not read is warned about, in the words the page quotes.
    warned = ("WARNING: lr_decay_iters is set (200) but unused: optimizer=adamw, lr_decay=inverse_sqrt, "
              "schedule=steps, tokenizer=char do not read it")
    assert report["adamw_warned"] == [warned] and one_line(f"`{warned}`") in page
    assert report["lion_warned"] == ["WARNING: muon_lr is set (0.01) but unused: optimizer=lion, lr_decay=cosine, "
                                     "schedule=steps, tokenizer=char do not read it"]

    # A run: flags, start-up lines, the lr it logged (warmup 2, then peak / sqrt(1 + k / 50)).
    straight = report["straight"]
    assert straight["code"] == 0, straight["err"][-2000:]
    lines = straight["out"].splitlines()
    settings = next(line for line in lines if line.startswith("settings: "))
    assert settings.startswith("settings: optimizer lion, lr_decay inverse_sqrt, schedule steps, max_iters 6, ")
    assert "rsqrt_timescale 50" in settings and "lr_decay_iters" not in settings
    assert ("WARNING: lr_decay_iters is set (200) but unused: optimizer=lion, lr_decay=inverse_sqrt, "
            "schedule=steps, tokenizer=char do not read it") in lines
    assert report["lrs"] == pytest.approx([1.5e-3, 3e-3] + [3e-3 / (1 + k / 50) ** 0.5 for k in range(4)])
    # Lion's state is its own: one momentum tensor per weight.
    assert report["state"] == [["momentum"]] * len(report["state"]) and report["state_shapes"]
    assert sorted(map(tuple, report["state_shapes"])) == sorted(map(tuple, report["param_shapes"]))
    # Resumes: bit for bit (the script compared the checkpoints), and a changed beta1 warned.
    assert report["split"]["code"] == report["resumed"]["code"] == 0
    assert report["beta1"]["code"] == 0
    assert "resuming with changed settings (beta1: checkpoint 0.9 vs now 0.8)" in report["beta1"]["out"]
    assert "`beta1: checkpoint 0.9 vs now 0.8`" in page
    # schedule=time cannot drive a step schedule: one line, naming both, as the page quotes it.
    timed = report["timed"]
    refusal = ("error: lr_decay=inverse_sqrt is a function of the step, which schedule=time cannot drive; "
               "use schedule=steps, or an lr_decay that it can (cosine, wsd)")
    assert timed["code"] == 2 and timed["err"] == refusal + "\n" and one_line(f"`{refusal}`") in page
    assert not (tmp_path / "o" / "timed").exists()

    help_text = one_line(subprocess.run([sys.executable, "train.py", "--help"], cwd=fork, capture_output=True,
                                        text=True).stdout)
    assert "--rsqrt_timescale" in help_text and "lion: Lion: the sign of momentum and gradient" in help_text
    assert "inverse_sqrt: Linear warmup, then the peak / sqrt(1 + steps since warmup / rsqrt_timescale)" in help_text

    # The copy's own generated tests, for the two entries: schedule curves, recorded reads, state, resumes.
    def pytest_in_the_copy(name: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--basetemp",
                               str(tmp_path / name), *args], cwd=fork, capture_output=True, text=True, timeout=600)

    generated = pytest_in_the_copy("generated", "tests/test_training_options.py", "tests/test_config.py", "-k",
                                   "lion or inverse_sqrt or own_kind_of_state or its_own_curve or loop_fields "
                                   "or every_config_field_is_read")
    assert generated.returncode == 0, generated.stdout[-4000:]
    for test in ("test_each_optimizer_keeps_its_own_kind_of_state",
                 "test_each_lr_schedule_draws_a_curve_of_its_kind[inverse_sqrt-warmup]",
                 "test_each_lr_schedule_draws_a_curve_of_its_kind[inverse_sqrt-no-warmup]",
                 "test_what_an_entry_reads_is_recorded_and_is_what_changes_it[optimizer=lion-steps]",
                 "test_what_an_entry_reads_is_recorded_and_is_what_changes_it[lr_decay=inverse_sqrt-steps]",
                 "test_each_choice_resumes_exactly_and_is_refused_under_another[optimizer-lion]",
                 "test_each_choice_resumes_exactly_and_is_refused_under_another[lr_decay-inverse_sqrt]"):
        assert f"PASSED tests/test_training_options.py::{test}" in generated.stdout, test
    # And the reliability tests generated for every optimizer (a NaN stops the run before its update; no host
    # sync on steps that do not log), which the page's SGD and Lion, plain step()s both, pass unedited:
    # faults.NonFiniteGuard undoes their bad update on the device. (Before, it synced at step 4 and stopped
    # there: 8 forward passes, not 10; and 12 host reads, not 16.)
    reliability = pytest_in_the_copy("reliability", "tests/test_reliability.py", "-k", "lion or (sgd and not plain)")
    assert reliability.returncode == 0, reliability.stdout[-4000:]
    assert "6 passed" in reliability.stdout
