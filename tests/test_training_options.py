"""Tests generated from the training options' declarations (resume rules, optim.py's tables, USED_ONLY_UNDER), so a
new entry is tested unasked; docs/experiments.md's training recipes are applied to a copy of the repo."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (copy_of_the_repo, docs_snippet, make_text, read_metrics, run_main, run_script, run_tests_in,
                      tiny_args, tiny_model)
from fault_injection import assert_same_training_state, capture_run

import config
import optim
import train
from checkpoint import load_checkpoint, save_checkpoint
from config import (DEFAULTS, FIELD_TYPES, RANGES, RESUME, RESUME_RULES, USED_ONLY_UNDER, TrainConfig, choices,
                    make_config, model_config, unused_fields)
from data import LOADERS, corpus_for
from logs import unused_given
from model import GPT, GPTConfig
from optim import DECAYS, OPTIMIZERS, MuonAdamW, lr_at


# ----------------------------------------------------------------------------- every field has a rule
def test_every_field_declares_its_resume_rule():
    """A TrainConfig field without fixed(...), warned(...) or free(...) fails here; a model option is fixed, or
    warned if it acts only while training."""
    for f in config.OPTIONS:
        rule = f.metadata.get("resume") if f.name not in GPTConfig.__dataclass_fields__ else RESUME[f.name]
        assert rule in RESUME_RULES, f"TrainConfig.{f.name} declares no resume rule"
    assert set(RESUME) == set(DEFAULTS) == {f.name for f in dataclasses.fields(TrainConfig)} - {"given"}
    assert set(GPTConfig.TRAINING_ONLY) == {name for name in config.MODEL_OPTIONS if RESUME[name] == "warned"}
    # What changes the meaning of best_val_loss, or what the weights compute, cannot change on resume.
    for name in ("eval_tokens", "seed", "tokenizer", "optimizer", "lr_decay", "n_embd", "pos_emb"):
        assert RESUME[name] == "fixed", name


def test_a_resume_warns_only_of_a_changed_field_it_reads(tmp_path, text_file, capsys):
    """muon_lr changed on an AdamW run does nothing, so saying it applies from here on would be false. (A changed fixed
    field is refused: test_resume.py's cases, test_model_options.py's and this file's per choice, by the rule above.)"""
    out = tmp_path / "run"
    assert run_main(tiny_args(out, text_file, max_iters=3, eval_interval=3)) == 0
    assert run_main(tiny_args(out, text_file, max_iters=4, eval_interval=3, resume="true", muon_lr=0.5,
                              learning_rate=1e-3, bpe_vocab_size=512)) == 0  # a fixed field, unread under char
    out_text = capsys.readouterr().out
    assert "WARNING: resuming with changed settings (learning_rate: checkpoint 0.003 vs now 0.001)" in out_text
    assert "muon_lr: checkpoint" not in out_text and "bpe_vocab_size: checkpoint" not in out_text


# ----------------------------------------------------------------------------- say what runs
def test_the_start_up_lines_name_every_changed_setting_and_warn_of_a_set_one_the_run_does_not_read(
        tmp_path, text_file, capsys):
    cfg = make_config("tiny", muon_lr=0.01, wsd_fraction=0.3)
    assert unused_fields(cfg) >= {"muon_lr", "wsd_fraction"}
    assert unused_given(cfg) == ["WARNING: muon_lr is set (0.01) but unused: optimizer=adamw does not read it "
                                 "(optimizer=muon does)", "WARNING: wsd_fraction is set (0.3) but unused: "
                                 "lr_decay=cosine does not read it (lr_decay=wsd does)"]
    assert unused_given(make_config("tiny", optimizer="muon", muon_lr=0.01)) == []
    assert run_main(tiny_args(tmp_path / "run", text_file, max_iters=2, lr_decay="wsd", wsd_fraction=0.5,
                              beta1=0.8, muon_lr=0.01)) == 0
    lines = capsys.readouterr().out.splitlines()
    settings = next(line for line in lines if line.startswith("settings: "))
    assert settings.startswith("settings: optimizer adamw, lr_decay wsd, schedule steps, max_iters 2, ")
    assert "beta1 0.8" in settings and "wsd_fraction 0.5" in settings and "out_dir" not in settings
    assert "muon_lr" not in settings and unused_given(cfg)[0] in lines


def test_the_thread_count_is_a_field_and_the_start_up_line_says_it(tmp_path, text_file, capsys, monkeypatch):
    """Two jobs on 2 cores with torch's default threads ran tiny at 418 ms/step, not 5; nothing said why."""
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


def curve_faults(name: str, curve: list[float], cfg: TrainConfig) -> list[str]:
    """What is wrong with ``curve``, each naming its (1-based) step: a warmup rises every step to the peak; then the
    lr stays in [min_lr, peak], moves no more than a warmup step (but up at a warm restart, which only a decay in
    WARM_RESTARTS may make), and is min_lr from the decay's end on."""
    peak, floor, rise, restarts = cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, name in optim.WARM_RESTARTS
    faults = [f"the warmup does not rise at step {i + 1}" for i in range(1, rise) if curve[i] <= curve[i - 1]]
    faults += [f"the decay starts at {curve[rise]:.4g}, not at the peak {peak:g}"] if curve[rise] != peak else []
    for i in range(rise + 1, len(curve)):
        move, where = curve[i] - curve[i - 1], f"at step {i + 1} ({curve[i - 1]:.4g} -> {curve[i]:.4g})"
        if move > 0 and not restarts:
            faults.append(f"it rises {where}; if {name} restarts on purpose, add it to optim.py's "
                          "WARM_RESTARTS and it is checked as a schedule with restarts")
        elif abs(move) > peak / WARMUP + 1e-12 and not (restarts and move > 0):
            faults.append(f"it jumps {where}, more than a warmup step: a cliff")
        if not floor <= curve[i] <= peak:
            faults.append(f"it leaves [min_lr, peak] = [{floor:g}, {peak:g}] {where}")
    end = cfg.lr_decay_iters
    faults += [f"it is not min_lr at step {i + 1}, after lr_decay_iters" for i in range(end, len(curve))
               if curve[i] != floor]
    return faults


@pytest.mark.parametrize("warmup_iters", [WARMUP, 0], ids=["warmup", "no-warmup"])
@pytest.mark.parametrize("name", list(DECAYS))
def test_each_lr_schedule_draws_a_curve_of_its_kind(name, warmup_iters):
    cfg, curve = curve_of(name, warmup_iters)
    faults = curve_faults(name, curve, cfg)
    assert not faults, f"lr_decay {name}: " + "; ".join(faults[:3])


def test_the_curve_check_names_the_step_of_a_rise_a_cliff_and_a_restart(monkeypatch):
    """The check above, on broken curves: each fault is found and named by its step."""
    cfg, cosine_curve = curve_of("cosine", WARMUP)
    cliff = cosine_curve[:500] + [cfg.min_lr] * (len(cosine_curve) - 500)
    assert curve_faults("cosine", cliff, cfg)[0].startswith("it jumps at step 501 (")
    halves = [(i - WARMUP) / 500 - (i >= 600) for i in range(WARMUP, 1100)]  # two cosines, 0 -> 1 each
    restarted = cosine_curve[:WARMUP] + [cfg.min_lr + (1 + math.cos(math.pi * p)) / 2 * (1 - cfg.min_lr)
                                         for p in halves] + cosine_curve[1100:]
    assert curve_faults("cosine", restarted, cfg)[0].startswith("it rises at step 601 (")
    assert "add it to optim.py's WARM_RESTARTS" in curve_faults("cosine", restarted, cfg)[0]
    monkeypatch.setattr(optim, "WARM_RESTARTS", frozenset({"cosine"}))
    assert curve_faults("cosine", restarted, cfg) == []  # declared: its restart is allowed, the rest still checked
    assert curve_faults("cosine", [cfg.min_lr / 2] * len(restarted), cfg)


def test_each_lr_schedule_draws_its_own_curve():
    curves = {name: curve_of(name, WARMUP)[1] for name in DECAYS}
    for a, b in itertools.combinations(curves, 2):
        assert curves[a] != curves[b], f"lr_decay {a} and {b} draw the same curve"


# ----------------------------------------------------------------------------- the names, and what each choice reads
@pytest.mark.parametrize("field", ["optimizer", "lr_decay", "loader"])
def test_the_names_the_config_accepts_are_its_tables_keys(field):
    """config imports neither optim.py nor data.py: its Literals must name exactly the tables' rows, in order."""
    assert choices(field) == tuple({"optimizer": OPTIMIZERS, "lr_decay": DECAYS, "loader": LOADERS}[field])


NUMERIC = [name for name, kind in FIELD_TYPES.items() if kind in (int, float)]
READ_CASE = dict(warmup_iters=10, lr_decay_iters=60, max_iters=80, max_time=40)  # each end inside 100 steps
RUN_CHOICES = ("optimizer", "lr_decay", "schedule")  # what chooses the optimizer and the lr curve
# The curve reads max_iters and max_time under schedule=time only, a loader may read grad_accum (to count steps), an
# optimizer batch_size; the loop (and every loader) reads all four, always: no choice can leave them unused.
READ_BY_THE_LOOP = {"max_iters", "max_time", "grad_accum", "batch_size"}


def perturbed(cfg: TrainConfig, name: str) -> TrainConfig:
    """``cfg`` with one numeric field moved a little, inside config.RANGES and GPTConfig's checks (an optimizer may
    raise on an invalid value)."""
    value = getattr(cfg, name)
    moves = (value + 1, value - 1) if isinstance(value, int) else (value * 0.75 + 0.01, value * 1.25, value - 1)
    for moved in moves:
        if moved == value or not all(ok(moved) for _, ok, names in RANGES if name in names):
            continue
        try:
            model_config(dataclasses.replace(cfg, **{name: moved}), vocab_size=1)
        except ValueError:
            continue
        return dataclasses.replace(cfg, **{name: moved})
    raise AssertionError(f"{name}={value}: no move of {moves} stays inside its range (config.RANGES); widen the moves")


@functools.cache
def throwaway_model() -> GPT:
    """A one-layer model to build optimizers on: what they make of the config is compared, not the weights."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=8, block_size=4))


def made_by_the_run(cfg: TrainConfig) -> object:
    """What a run's optimizer and lr decay make of ``cfg``: param groups, defaults, the optimizer's plain settings (a
    period the loop's hook reads), the lr over 100 steps at 0.5 s and 0.125 s a step (schedule=time's two clocks)."""
    built = OPTIMIZERS[cfg.optimizer](throwaway_model(), cfg, torch.device("cpu"), torch.float32)
    groups = [{k: v for k, v in group.items() if k != "params"} for group in built.param_groups]
    own = {k: v for k, v in vars(built).items() if isinstance(v, (bool, int, float, str))}
    return groups, built.defaults, own, [lr_at(step, cfg, step * step_s) for step_s in (0.5, 0.125)
                                         for step in range(100)]


def made_by_the_tokenizer(cfg: TrainConfig) -> object:
    corpus = corpus_for(cfg)
    return corpus.meta["tokenizer"], np.asarray(corpus.train).tobytes(), np.asarray(corpus.val).tobytes()


def readers(choice_fields: tuple[str, ...], made, combinations=None, **case) -> dict[tuple, set[str]]:
    """Per combination of ``choice_fields``' values: the numeric fields whose change changes what ``made`` makes."""
    read = {}
    for values in combinations or itertools.product(*map(choices, choice_fields)):
        cfg = make_config(None, **dict(zip(choice_fields, values)), **case)
        unchanged = made(cfg)
        read[values] = {name for name in NUMERIC if made(perturbed(cfg, name)) != unchanged}
    return read


def table_errors(table: dict[str, tuple[str, str]], choice_fields: tuple[str, ...], read: dict[tuple, set[str]]):
    """Where ``table`` (USED_ONLY_UNDER's shape) disagrees with ``read`` (readers'), in words: a row that is wrong
    either way, or a missing row (a field some choices read and others not)."""
    errors = []
    for values, changed in read.items():
        chosen = dict(zip(choice_fields, values))
        used = {name: chosen[field] in readers for name, (field, readers) in table.items() if field in chosen}
        errors += [f"{name} is unused under {values} by the table, but changes what it makes"
                   for name, is_used in used.items() if not is_used and name in changed]
        errors += [f"{name} is read under {values} by the table, but changes nothing"
                   for name, is_used in used.items() if is_used and name not in changed]
    sometimes = set.union(*read.values()) - set.intersection(*read.values()) - set(table) - READ_BY_THE_LOOP
    return errors + [f"{name} changes what some choices make and not others: add its row to USED_ONLY_UNDER"
                     for name in sorted(sometimes)]


@pytest.fixture(scope="module")
def run_readers() -> dict[tuple, set[str]]:
    return readers(RUN_CHOICES, made_by_the_run, **READ_CASE)


@pytest.fixture(scope="module")
def tokenizer_readers(tmp_path_factory):
    """tokenizer name -> what it reads (readers'), each found once for the module."""
    root = tmp_path_factory.mktemp("tokenizers")
    (root / "corpus.txt").write_text(make_text())
    case = dict(data_path=str(root / "corpus.txt"), data_dir=str(root / "data"), bpe_vocab_size=300)
    return functools.cache(lambda name: readers(("tokenizer",), made_by_the_tokenizer, [(name,)], **case)[(name,)])


def test_the_fields_only_one_choice_reads_are_the_table_under_every_optimizer_decay_and_clock(run_readers):
    """USED_ONLY_UNDER drives the unused warnings, the settings line and a resume's warnings: every numeric field is
    perturbed in turn under every optimizer x lr_decay x schedule, and what it changes must be what the table says."""
    assert all(choices(field) for field, _ in USED_ONLY_UNDER.values())  # a chooser is a Literal field
    assert table_errors(USED_ONLY_UNDER, RUN_CHOICES, run_readers) == []


def made_by_the_loader(cfg: TrainConfig) -> object:
    """The first 120 micro-batches ``cfg``'s loader draws from a corpus of documents, as bytes with their shapes."""
    lengths = np.random.default_rng(0).integers(2, 40, size=200)
    tokens = np.concatenate([np.r_[0, np.full(n - 1, n)] for n in lengths]).astype(np.uint16)  # document: 0 n n ...
    stream = LOADERS[cfg.loader](tokens, cfg, cfg.seed, torch.device("cpu"), 0)
    return [(x.shape, x.numpy().tobytes(), y.numpy().tobytes()) for x, y in (stream.next() for _ in range(120))]


def test_the_fields_only_one_loader_reads_are_the_table():
    """The same under every loader (a loader reads its options from the config it is given), for its batches."""
    read = readers(("loader",), made_by_the_loader, batch_size=8, block_size=64)  # rows enough for a ramp
    assert table_errors(USED_ONLY_UNDER, ("loader",), read) == []


# gpt2's case downloads GPT-2's ranks into a fresh data_dir (~20 s, test_bpe_data.py): network, and slow.
TOKENIZERS = [pytest.param(name, marks=[pytest.mark.network, pytest.mark.slow] if name == "gpt2" else [])
              for name in choices("tokenizer")]


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_the_fields_only_one_tokenizer_reads_are_the_table(tokenizer, tokenizer_readers):
    """The same under every tokenizer, for its tokenizer and both splits."""
    read = {(name,): tokenizer_readers(name) for name in ("char", tokenizer)}
    assert "val_fraction" in read[(tokenizer,)] and ("bpe_vocab_size" in read[(tokenizer,)]) == (tokenizer == "bpe")
    assert table_errors(USED_ONLY_UNDER, ("tokenizer",), read) == []


def test_the_table_check_catches_a_row_missing_a_row_too_many_and_a_wrong_choice(run_readers, tokenizer_readers):
    """The teeth of the two tests above."""
    missing = {name: row for name, row in USED_ONLY_UNDER.items() if name != "wsd_fraction"}
    assert table_errors(missing, RUN_CHOICES, run_readers) == [
        "wsd_fraction changes what some choices make and not others: add its row to USED_ONLY_UNDER"]
    too_many = {**USED_ONLY_UNDER, "beta1": ("optimizer", ("muon",))}  # AdamW reads beta1 too
    assert table_errors(too_many, RUN_CHOICES, run_readers) == [
        f"beta1 is unused under {values} by the table, but changes what it makes" for values in run_readers
        if values[0] == "adamw"]
    wrong = {**USED_ONLY_UNDER, "bpe_vocab_size": ("tokenizer", ("char",))}
    read = {(name,): tokenizer_readers(name) for name in ("char", "bpe")}
    assert table_errors(wrong, ("tokenizer",), read) == [
        "bpe_vocab_size is read under ('char',) by the table, but changes nothing",
        "bpe_vocab_size is unused under ('bpe',) by the table, but changes what it makes"]


def test_wsd_is_flat_then_linear_over_its_final_fraction():
    cfg = make_config(None, lr_decay="wsd", wsd_fraction=0.25, learning_rate=1.0, min_lr=0.0, warmup_iters=0,
                      lr_decay_iters=100)
    table = {0: 1.0, 74: 1.0, 75: 1.0, 80: 0.8, 90: 0.4, 99: 0.04, 100: 0.0}  # decay: steps 75 to 100
    for step, lr in table.items():
        assert train.get_lr(step, cfg) == pytest.approx(lr, abs=1e-12), step


@pytest.mark.parametrize("field, choice", [("optimizer", name) for name in OPTIMIZERS]
                         + [("lr_decay", name) for name in DECAYS])
def test_each_choice_resumes_exactly_and_is_refused_under_another(tmp_path, text_file, capsys, field, choice):
    """Straight and split in the middle; an optimizer with a ``period`` (Sophia's Hessian every k steps) trains
    2 periods + 4 steps, so the split crosses its periodic work: a counter outside state_dict shows there."""
    own = made_by_the_run(make_config("tiny", **{field: choice}))[2]  # the optimizer's plain settings
    steps = max(6, 2 * own.get("period", 1) + 4)
    run = dict(max_iters=steps, eval_interval=steps // 2, grad_accum=2, lr_decay_iters=steps, warmup_iters=2,
               **{field: choice})
    assert run_main(tiny_args(tmp_path / "straight", text_file, **run)) == 0
    assert run_main(tiny_args(tmp_path / "split", text_file, **{**run, "max_iters": steps // 2})) == 0
    other = next(name for name in (OPTIMIZERS if field == "optimizer" else DECAYS) if name != choice)
    capsys.readouterr()
    assert run_main(tiny_args(tmp_path / "split", text_file, **{**run, field: other}, resume="true")) == 2
    assert f"{field}: checkpoint {choice!r} vs now {other!r}" in capsys.readouterr().err
    assert run_main(tiny_args(tmp_path / "split", text_file, **run, resume="true")) == 0
    assert_same_training_state(load_checkpoint(tmp_path / "straight" / "last.pt"),
                               load_checkpoint(tmp_path / "split" / "last.pt"))


# ----------------------------------------------------------------------------- Muon + AdamW, one Optimizer
def test_muon_with_adamw_is_one_torch_optimizer_and_an_old_two_part_state_is_refused_in_one_line(
        tmp_path, text_file, monkeypatch, capsys):
    run = dict(max_iters=3, eval_interval=3, optimizer="muon")
    captured = capture_run(monkeypatch)
    assert run_main(tiny_args(tmp_path / "old", text_file, **run)) == 0
    optimizer = captured["optimizer"]
    assert isinstance(optimizer, torch.optim.Optimizer) and isinstance(optimizer, MuonAdamW)
    assert [g["kind"] for g in optimizer.param_groups] == ["adamw", "adamw", "muon"]
    state = load_checkpoint(tmp_path / "old" / "last.pt")
    old_pair = {kind: {"state": {}, "param_groups": []} for kind in ("adamw", "muon")}  # the state before: two parts
    save_checkpoint({**state, "optimizer": old_pair}, tmp_path / "old" / "last.pt")
    capsys.readouterr()
    assert run_main(tiny_args(tmp_path / "old", text_file, **{**run, "max_iters": 6}, resume="true")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the checkpoint's optimizer state is not one Muon + AdamW")


# ----------------------------------------------------------------------------- a fork, end to end
# The headings of docs/experiments.md's python blocks ("Adding a training option"), each applied as it says.
SGD = "# optim.py, replacing the OPTIMIZERS line:\n"
LINEAR = "# optim.py, replacing the DECAYS line:\n"
NAMES = "# config/__init__.py, in TrainConfig: the new names in the Literals (the rest of each line unchanged)\n"
FIELDS = "# config/__init__.py, in TrainConfig, after wandb_project:\n"
ROWS = "# config/__init__.py, in USED_ONLY_UNDER:\n"


def recipe(name: str, table: str) -> tuple[str, ...]:
    """The headings of a recipe's blocks: its function or class, its name, its fields, their USED_ONLY_UNDER rows."""
    return (f"# optim.py, replacing the {table} line ({name}):\n",
            f"# config/__init__.py, in TrainConfig: the new name in the Literal ({name}; the rest of the line "
            "unchanged)\n",
            f"# config/__init__.py, in TrainConfig, after wandb_project ({name}):\n",
            f"# config/__init__.py, in USED_ONLY_UNDER ({name}):\n")


FIELD_ANCHOR = '    wandb_project: str = free("tinygpt", "wandb project name")\n'


def apply_snippet(fork: Path, heading: str) -> None:
    body = docs_snippet(heading)
    config_file = fork / "config" / "__init__.py"
    if ", replacing the " in heading:  # "# FILE, replacing the TABLE line": its new function or class, its new row
        file = heading.removeprefix("# ").split(", ")[0]
        table = heading.split("replacing the ")[1].split(" line")[0]
        source = (fork / file).read_text()
        lines = re.findall(rf"^{table}\b.* = .*\n", source, re.M)
        assert len(lines) == 1, f"update the fork test: {file} declares {table} on one line"
        (fork / file).write_text(source.replace(lines[0], body))
        return
    source = config_file.read_text()
    if "in the Literal" in heading:  # `    optimizer: Literal[...]`: the field's new type
        for line in body.splitlines():
            name, literal = line.strip().split(": ", 1)
            old = re.findall(rf"^    {name}: Literal\[[^\]]*\]", source, re.M)
            assert len(old) == 1, f"update the fork test: config/__init__.py declares {name} with a Literal"
            source = source.replace(old[0], f"    {name}: {literal}")
    else:
        field = heading.startswith(FIELDS.rstrip(":\n"))
        anchor = FIELD_ANCHOR if field else "USED_ONLY_UNDER = {"
        assert source.count(anchor) == 1, f"update the fork test's anchor {anchor!r} to config/__init__.py"
        source = source.replace(anchor, anchor + ("" if field else "\n") + body)
    config_file.write_text(source)


def fork_of_the_repo(root: Path, snippets: tuple[str, ...] = (SGD, LINEAR, NAMES, FIELDS, ROWS),
                     tests: bool = False) -> Path:
    """A copy of the repo (with its tests, if ``tests``) with the page's blocks ``snippets`` applied as they say."""
    fork = copy_of_the_repo(root, tests)
    for heading in snippets:
        apply_snippet(fork, heading)
    return fork


FORK_SCRIPT = '''
import json, sys
from pathlib import Path
import pytest
import train
from checkpoint import load_checkpoint
from config import make_config
from cli import StopOnSignal
from logs import unused_given
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
linear = ["--lr_decay", "linear", "--learning_rate", "0.1", "--min_lr", "0"]
assert main("--out_dir", str(out / "sgd"), "--max_iters", "4", "--optimizer", "sgd", "--sgd_momentum", "0.8",
            "--label_smoothing", "0.1", *linear) == 0
state = load_checkpoint(out / "sgd" / "last.pt")
saved = {k: state["config"][k] for k in ("optimizer", "sgd_momentum", "lr_decay", "label_smoothing")}
assert saved == {"optimizer": "sgd", "sgd_momentum": 0.8, "lr_decay": "linear", "label_smoothing": 0.1}, saved
# SGD's own state: not AdamW under another name
assert sorted({k for s in state["optimizer"]["state"].values() for k in s}) == ["momentum_buffer"]
lrs = [json.loads(l)["lr"] for l in (out / "sgd" / "metrics.jsonl").read_text().splitlines() if '"lr"' in l]
assert lrs[1:] == pytest.approx([0.1 * (1 - p) for p in (0, 1 / 3, 2 / 3)]), lrs  # linear after warmup
assert main("--out_dir", str(out / "sgd"), "--max_iters", "5", "--optimizer", "adamw", "--label_smoothing", "0.1",
            *linear, "--resume") == 2
assert main("--out_dir", str(out / "sgd"), "--max_iters", "5", "--optimizer", "sgd", "--sgd_momentum", "0.7",
            "--label_smoothing", "0.2", *linear, "--resume") == 0
summary = compare.compare(["--config", "tiny", "--steps", "4", "--seeds", "2", "--out", str(out / "exp"), "--set",
                           f"data_path={corpus},data_dir={out / 'data'},device=cpu", "base:",
                           "sgd:optimizer=sgd,learning_rate=0.1,min_lr=0,lr_decay=linear,label_smoothing=0.1"],
                          StopOnSignal(install=False))
assert [v["name"] for v in summary["variants"]] == ["base", "sgd"]
print(unused_given(make_config("tiny", sgd_momentum=0.5)))
assert main("--help") == 0
'''


@pytest.mark.slow  # ~10-14 s: a copy of the repo and five runs in it
def test_a_forked_optimizer_decay_and_field_are_honoured_end_to_end(tmp_path, text_file):
    """Flag, start-up line, checkpoint, resume rule, unused warning and compare.py variant, from the page's blocks;
    and the copy's generated table test passes with the page's rows (was: SGD reads no beta, and no row could say)."""
    fork = fork_of_the_repo(tmp_path, tests=True)
    copy_tests(fork, tmp_path / "generated", "fields_only_one_choice_reads_are_the_table")
    result = run_script("-c", FORK_SCRIPT, str(text_file), str(tmp_path / "o"), cwd=fork)
    out = result.stdout
    assert "settings: optimizer sgd, lr_decay linear, schedule steps, max_iters 4, " in out
    assert "label_smoothing 0.1" in out and "sgd_momentum 0.8" in out
    assert "optimizer: checkpoint 'sgd' vs now 'adamw'" in result.stderr
    assert "resuming with changed settings (sgd_momentum: checkpoint 0.8 vs now 0.7; " in out
    assert "label_smoothing: checkpoint 0.1 vs now 0.2" in out
    assert "WARNING: beta1" not in out  # beta1 is the preset's default: nothing given, nothing to warn about
    assert "WARNING: sgd_momentum is set (0.5) but unused: optimizer=adamw" in out
    help_text = out.split("usage: ", 1)[1]
    assert "--sgd_momentum" in help_text and "--label_smoothing" in help_text
    assert "--optimizer {adamw,muon,sgd}" in help_text and "--lr_decay {cosine,wsd,linear}" in help_text


def copy_tests(fork: Path, basetemp: Path, k: str, returncode: int = 0, path: str = "test_training_options.py") -> str:
    """The copy's tests in tests/``path`` selected by ``k``: they exit ``returncode``; their output."""
    result = run_tests_in(fork, basetemp, f"tests/{path}", "-k", k)
    assert result.returncode == returncode, result.stdout[-4000:]
    return result.stdout


def generated_tests_pass(fork: Path, basetemp: Path, name: str) -> None:
    """The copy's tests generated for a new optimizer ``name``: its name, the table, its own state, its exact resume."""
    generated = copy_tests(fork, basetemp, f"{name} or own_kind_of_state or tables_keys or under_every_optimizer")
    for test in ("test_each_optimizer_keeps_its_own_kind_of_state",
                 "test_the_names_the_config_accepts_are_its_tables_keys[optimizer]",
                 "test_the_fields_only_one_choice_reads_are_the_table_under_every_optimizer_decay_and_clock",
                 f"test_each_choice_resumes_exactly_and_is_refused_under_another[optimizer-{name}]"):
        assert f"PASSED tests/test_training_options.py::{test}" in generated, test


@pytest.mark.slow
def test_the_lion_recipe_forks_the_repo_end_to_end(tmp_path):
    """docs/experiments.md's Lion recipe in a copy of the repo: its generated tests pass, and so do the reliability
    tests generated for every optimizer (NaN guard, no host sync), which Lion's plain step() passes unedited."""
    fork = fork_of_the_repo(tmp_path, snippets=recipe("Lion", "OPTIMIZERS")[:2], tests=True)
    generated_tests_pass(fork, tmp_path / "generated", "lion")
    assert "4 passed" in copy_tests(fork, tmp_path / "reliability", "lion", path="test_reliability.py")


@pytest.mark.slow
def test_the_sgdr_recipe_forks_the_repo_end_to_end(tmp_path, text_file):
    """docs/experiments.md's SGDR recipe in a copy of the repo: it trains and restarts, and the copy's generated tests
    check it as a schedule with restarts; without its WARM_RESTARTS block they name the step where it rises."""
    sgdr = recipe("SGDR", "DECAYS")
    fork = fork_of_the_repo(tmp_path / "declared", snippets=(*sgdr, "# optim.py, replacing the WARM_RESTARTS line:\n"),
                            tests=True)
    out = tmp_path / "run"
    run_script("train.py", *tiny_args(out, text_file, max_iters=9, eval_interval=9, warmup_iters=1, lr_decay_iters=9,
                                      lr_decay="sgdr", sgdr_cycles=2), cwd=fork)
    lrs = [record["lr"] for record in read_metrics(out) if "lr" in record]
    assert lrs[1] == lrs[5] == 3e-3 > lrs[4]  # a warm restart at the peak after the first of two cycles
    assert "PASSED tests/test_training_options.py::test_each_lr_schedule_draws_a_curve_of_its_kind[sgdr-warmup]" \
        in copy_tests(fork, tmp_path / "generated", "sgdr or curve")

    undeclared = fork_of_the_repo(tmp_path / "undeclared", snippets=sgdr, tests=True)
    refused = copy_tests(undeclared, tmp_path / "refused", "curve_of_its_kind", returncode=1)
    assert ("lr_decay sgdr: it rises at step 351 (0.1 -> 1); if sgdr restarts on purpose, add it to "
            "optim.py's WARM_RESTARTS") in " ".join(refused.split())


@pytest.mark.slow  # a copy of the repo, its generated tests twice and a run in it: ~60 s
def test_the_sophia_recipe_forks_the_repo_end_to_end(tmp_path, text_file):
    """docs/experiments.md's Sophia: the copy's generated tests pass for it (its resume crosses a Hessian estimate;
    its fields are read under it alone), it trains; a step counter of its own fails the resume."""
    fork = fork_of_the_repo(tmp_path, snippets=recipe("Sophia", "OPTIMIZERS"), tests=True)
    generated_tests_pass(fork, tmp_path / "generated", "sophia")
    out = tmp_path / "run"
    trained = run_script("train.py", *tiny_args(out, text_file, max_iters=12, eval_interval=12, optimizer="sophia"),
                         cwd=fork)
    assert "settings: optimizer sophia, " in trained.stdout
    state = load_checkpoint(out / "last.pt")["optimizer"]["state"]
    assert all(sorted(s) == ["hessian", "momentum"] and s["hessian"].any() for s in state.values())
    # The teeth: the period counted by the optimizer, outside state_dict, restarts at 0 on a resume.
    period = "        if (step - 1) % self.period:"
    source = (fork / "optim.py").read_text()
    assert source.count(period) == 1
    (fork / "optim.py").write_text(source.replace(period, "        self.calls = getattr(self, 'calls', 0) + 1\n"
                                                          "        if (self.calls - 1) % self.period:"))
    broken = copy_tests(fork, tmp_path / "broken", "resumes_exactly and sophia", returncode=1)
    assert "1 failed" in broken.strip().splitlines()[-1], broken[-2000:]
