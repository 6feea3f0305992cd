"""The training loop: schedule, accumulation, evaluation, checkpoints, exact resume, end to end."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from machinery import checkpoint
from machinery import tracking
import train
from machinery.checkpoint import REQUIRED_KEYS, CheckpointWriteError, load_checkpoint, save_checkpoint
from config import ConfigError, make_config
from conftest import make_optimizer, run_script, tiny_model
from fault_injection import metrics, run_main, step_clock, tiny_args


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_lr_schedule_table():
    cfg = make_config(None, learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    table = {
        0: 0.1,  # warmup starts above zero: step 0 already updates the weights
        4: 0.5,
        9: 1.0,  # the last warmup step reaches the peak
        10: 1.0,  # cosine starts at the peak
        60: 0.55,  # halfway down the cosine: min + (max - min) / 2
        110: 0.1,  # the floor at lr_decay_iters
        500: 0.1,  # and flat afterwards
    }
    for step, expected in table.items():
        assert train.get_lr(step, cfg) == pytest.approx(expected, abs=1e-12), step


def test_time_schedule_decays_over_max_time_and_warms_up_by_steps():
    cfg = make_config(None, learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110,
                      schedule="time", max_time=100, max_iters=10010)
    table = {  # (step, seconds into the run): lr
        (4, 50.0): 0.5,  # warmup still counts steps, whatever the clock says
        (10, 0.0): 1.0,
        (10, 50.0): 0.55,  # half the budget spent: halfway down the cosine, at any step
        (4000, 50.0): 0.55,
        (60, 100.0): 0.1,  # budget spent: the floor
        (60, 400.0): 0.1,
        (5010, 10.0): 0.55,  # half the steps done: whichever budget is further along sets the pace
        (10010, 10.0): 0.1,  # max_iters reached before max_time: annealed all the same
    }
    for (step, time_s), expected in table.items():
        assert train.get_lr(step, cfg, time_s) == pytest.approx(expected, abs=1e-12), (step, time_s)
    steps = make_config(None, learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_time=100)
    assert train.get_lr(60, steps, 99.0) == pytest.approx(0.55)  # schedule=steps ignores the clock


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


@pytest.mark.parametrize("seconds, shown", [(0, "0:00"), (83.9, "1:23"), (180, "3:00"), (3599.5, "59:59"),
                                             (3600, "1:00:00"), (3725, "1:02:05")])
def test_clock_is_minutes_and_seconds_then_hours(seconds, shown):
    assert tracking.clock(seconds) == shown


def test_step_lines_show_the_run_time_against_max_time(tmp_path, text_file, capsys, monkeypatch):
    step_clock(monkeypatch, step_s=30)
    step_line = re.compile(r"^step +\d+ \| loss .*")
    assert run_main(tiny_args(tmp_path / "budget", text_file, max_iters=3, max_time=3600)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if step_line.match(line)]
    assert [line.rsplit(" | ", 1)[1] for line in lines] == ["0:30 of 1:00:00", "1:00 of 1:00:00", "1:30 of 1:00:00"]
    assert run_main(tiny_args(tmp_path / "none", text_file, max_iters=2)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if step_line.match(line)]
    assert len(lines) == 2 and not any(" of " in line for line in lines)  # no budget, nothing to count down


def test_a_resume_with_nothing_left_to_do_opens_no_tracker_run(tmp_path, text_file, monkeypatch):
    """A wandb run opened to log nothing is one more (offline) run to sync, and a wait for wandb."""
    started = []  # cfg.resume of each tracker started

    def start(cfg, out_dir, logged_through=None):
        started.append(cfg.resume)
        return tracking.NullTracker()
    monkeypatch.setattr(tracking, "start", start)
    args = tiny_args(tmp_path / "run", text_file, max_iters=2, eval_interval=2, wandb="true")
    assert run_main(args) == 0 and started == [False]
    assert run_main(args + ["--resume"]) == 0 and started == [False]  # max_iters reached: nothing to log
    assert run_main(args + ["--resume", "--max_iters=3"]) == 0 and started == [False, True]  # a step to do


def test_a_resume_keeps_the_moments_but_takes_the_new_hyperparameters():
    model = tiny_model()
    old = make_optimizer(model, 0.1, 1e-3, (0.9, 0.99), muon_lr=0.02)
    _, loss_sum, n = model(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))
    (loss_sum / n).backward()
    old.step()
    new = make_optimizer(model, 0.0, 1e-3, (0.9, 0.95), muon_lr=0.01)
    checkpoint.load_optimizer_state(new, old.state_dict())
    assert [g["lr_scale"] for g in new.param_groups] == [1.0, 1.0, 10.0]  # 0.01 / 1e-3, not the saved 20
    assert all(g["weight_decay"] == 0.0 for g in new.param_groups)
    assert new.adamw.param_groups[0]["betas"] == (0.9, 0.95)
    moments = lambda opt: list(opt.state_dict()["state"].values())  # noqa: E731
    for a, b in zip(moments(old), moments(new), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_format_1_checkpoint_still_resumes_and_samples(tmp_path, text_file):
    out = tmp_path / "run"
    run_script(*train_args(text_file, out, "--max_iters", "3"))
    for name in ("last.pt", "best.pt"):  # as the previous version wrote them: no clock, no lr_scale
        state = load_checkpoint(out / name)
        del state["time_s"]
        state["format_version"] = 1
        for group in state["optimizer"]["param_groups"]:
            del group["lr_scale"]
        save_checkpoint(state, out / name)
    resumed = run_script(*train_args(text_file, out, "--max_iters", "6", "--resume"))
    assert "resumed from" in resumed.stdout and load_checkpoint(out / "last.pt")["step"] == 6
    run_script("sample.py", "--ckpt", str(out), "--max-new-tokens", "5")


def test_an_eval_that_spends_the_budget_is_the_final_one(tmp_path, text_file, monkeypatch):
    """Before: the loop checked the clock only after a step, so an eval that crossed max_time was
    followed by one more step and a second, redundant full eval (11 s each on `small`, 2-core CPU)."""
    step_clock(monkeypatch, step_s=0.25, eval_s=1.5)  # steps 1-3 spend 0.75 s, the eval at step 3 the rest
    out = tmp_path / "run"
    assert run_main(tiny_args(out, text_file, max_time=1, max_iters=1000, eval_interval=3)) == 0
    train_records, val_records = metrics(out)
    assert [r["step"] for r in val_records] == [3]
    assert train_records[-1]["step"] == 3 and load_checkpoint(out / "last.pt")["step"] == 3


def test_time_schedule_needs_max_time():
    with pytest.raises(ConfigError, match="schedule=time decays the lr over max_time: set max_time"):
        make_config(None, schedule="time")


def make_batches(counts: list[int], vocab: int = 50, T: int = 16, B: int = 2):
    """Micro-batches whose targets count the given numbers of tokens (the rest are -1)."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for count in counts:
        x = torch.randint(0, vocab, (B, T), generator=gen)
        y = torch.randint(0, vocab, (B, T), generator=gen)
        y.view(-1)[count:] = -1
        batches.append((x, y))
    return batches


def grads_of(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_accumulation_equals_one_big_batch_even_with_uneven_token_counts():
    batches = make_batches([32, 5, 17])  # micro-batches counting very different numbers of targets
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    cpu = torch.device("cpu")

    accumulated = tiny_model()
    loss_sum, n = train.accumulate_gradients(accumulated, batches, scaler, cpu, torch.float32)
    big = tiny_model()
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    big_loss, big_n = train.accumulate_gradients(big, [(x, y)], scaler, cpu, torch.float32)
    assert n.item() == big_n.item() == 54
    torch.testing.assert_close(loss_sum, big_loss, rtol=1e-6, atol=1e-5)
    for g_acc, g_big in zip(grads_of(accumulated), grads_of(big)):
        torch.testing.assert_close(g_acc, g_big, rtol=1e-5, atol=1e-7)

    # The teeth: averaging per-micro-batch means gives a different gradient.
    naive = tiny_model()
    for xb, yb in batches:
        _, ls, nb = naive(xb, yb)
        (ls / nb / len(batches)).backward()
    assert max((a - b).abs().max().item() for a, b in zip(grads_of(naive), grads_of(big))) > 1e-4


def test_evaluate_restores_train_mode_and_draws_no_randomness():
    model = tiny_model(dropout=0.2).train()
    x = torch.randint(0, 50, (5, 16))
    y = torch.randint(0, 50, (5, 16))
    y[4, 3:] = -1  # a short, padded last window
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = train.evaluate(model, x, y, 2, torch.device("cpu"), torch.float32)
    assert model.training
    assert torch.equal(torch.get_rng_state(), state)
    assert train.evaluate(model, x, y, 3, torch.device("cpu"), torch.float32).loss == pytest.approx(first.loss, rel=1e-6)
    model.eval()
    with torch.no_grad():
        _, loss_sum, n = model(x, y)
    assert first.loss == pytest.approx(loss_sum.item() / n.item(), rel=1e-6)  # token-weighted mean
    assert first.tokens == n.item() == 4 * 16 + 3 and math.isnan(first.bpb)  # no byte count given: no bpb


def test_an_exception_mid_save_leaves_the_previous_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"step": 1}, path)
    before = path.read_bytes()

    def broken_save(obj, f):
        f.write(b"half a checkpoint")
        raise RuntimeError("disk went away")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(CheckpointWriteError, match="disk went away.*previous last.pt is intact"):
        save_checkpoint({"step": 2}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temp file left behind


def train_args(text_file: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["train.py", "--config", "tiny", "--data_path", str(text_file), "--data_dir",
            str(out_dir.parent / "data"), "--out_dir", str(out_dir), "--device", "cpu",
            "--log_interval", "1", "--dropout", "0.1", "--grad_accum", "2", *extra]


def optimizer_tensors(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of an optimizer state_dict (AdamW's, or Muon + AdamW's nested pair), by path."""
    found = {}
    def walk(node, path):
        if isinstance(node, torch.Tensor):
            found[path] = node
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}/{key}")
    walk(state, "")
    return found


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_bit_exact_across_processes(tmp_path, text_file, optimizer):
    straight, split = tmp_path / "straight", tmp_path / "split"
    args = lambda out, *extra: train_args(text_file, out, "--optimizer", optimizer, "--eval_interval", "12", *extra)  # noqa: E731
    run_script(*args(straight, "--max_iters", "24"))
    run_script(*args(split, "--max_iters", "12"))
    run_script(*args(split, "--max_iters", "24", "--resume"))
    losses = lambda d: [(m["step"], m["loss"]) for m in read_metrics(d) if "loss" in m]  # noqa: E731
    assert losses(split) == losses(straight) and len(losses(straight)) == 24
    a, b = load_checkpoint(straight / "last.pt"), load_checkpoint(split / "last.pt")
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    moments_a, moments_b = optimizer_tensors(a["optimizer"]), optimizer_tensors(b["optimizer"])
    expected = {"adamw": ("exp_avg", "exp_avg_sq"), "muon": ("exp_avg", "momentum_buffer")}[optimizer]
    assert all(any(path.endswith(name) for path in moments_a) for name in expected)  # the moments are there
    assert moments_a.keys() == moments_b.keys()
    for path in moments_a:
        assert torch.equal(moments_a[path], moments_b[path]), path
    assert torch.equal(a["rng"]["data"], b["rng"]["data"])


@pytest.mark.parametrize("change, message", [
    (("--n_embd", "64"), "n_embd: checkpoint 32 vs now 64"),
    (("--optimizer", "muon"), "optimizer: checkpoint 'adamw' vs now 'muon'"),  # their states cannot be exchanged
])
def test_resume_refuses_another_model_or_optimizer(tmp_path, text_file, change, message):
    out = tmp_path / "run"
    run_script(*train_args(text_file, out, "--max_iters", "3"))
    before = (out / "last.pt").read_bytes()
    result = run_script(*train_args(text_file, out, "--max_iters", "6", "--resume", *change), check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr
    assert (out / "last.pt").read_bytes() == before


def test_a_fresh_run_never_replaces_an_existing_one(tmp_path, text_file):
    out = tmp_path / "run"
    run_script(*train_args(text_file, out, "--max_iters", "3"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = run_script(*train_args(text_file, out, "--max_iters", "3"), check=False)
    assert result.returncode == 2 and "already holds a run (last.pt); continue it with --resume" in result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_resume_refuses_a_dtype_change_that_drops_the_grad_scaler(tmp_path, text_file):
    out = tmp_path / "run"
    run_script(*train_args(text_file, out, "--max_iters", "3"))
    result = run_script(*train_args(text_file, out, "--max_iters", "6", "--resume", "--dtype", "float16"),
                        check=False)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("resume with --dtype float32") and "Traceback" not in result.stderr


def test_end_to_end_train_then_sample(tmp_path, text_file):
    out = tmp_path / "run"
    run_script(*train_args(text_file, out, "--max_iters", "40", "--eval_interval", "20"))
    assert {p.name for p in out.iterdir()} == {"last.pt", "best.pt", "metrics.jsonl"}
    records = read_metrics(out)
    logged = [r for r in records if "loss" in r]
    assert set(logged[0]) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s"}
    vals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in vals] == [20, 40]
    assert logged[-1]["loss"] < logged[0]["loss"]

    state = torch.load(out / "best.pt", weights_only=True)  # plain tensors and values only
    assert set(REQUIRED_KEYS) <= set(state)
    assert not any(k.startswith("_orig_mod.") for k in state["model"])
    assert state["step"] == min(vals, key=lambda r: r["val_loss"])["step"]
    assert state["best_val_loss"] == min(r["val_loss"] for r in vals)
    assert state["tokenizer"]["kind"] == "char" and state["versions"]["torch"] == torch.__version__

    sample = ["sample.py", "--ckpt", str(out), "--max-new-tokens", "60", "--seed", "7", "--num-samples", "2"]
    first, second = run_script(*sample), run_script(*sample)
    assert first.stdout == second.stdout and f"sampling from {out / 'best.pt'}" in first.stdout
    greedy = run_script(*sample[:-4], "--temp", "0", "--prompt", "KING:")
    assert greedy.stdout.split("\n", 1)[1].startswith("KING:")


def test_compiling_is_announced_before_the_probe_compiles(monkeypatch, capsys):
    """The probe is where torch.compile takes its time (100 s for gpt2 on a GPU): a line must come first."""
    from machinery.runtime import compile_or_eager
    monkeypatch.setattr(torch, "compile", lambda model: model)  # compiling itself is not what is tested
    printed_before_probe = []
    compile_or_eager(tiny_model(), True, lambda m: printed_before_probe.append(capsys.readouterr().out))
    assert printed_before_probe == ["compiling the model (torch.compile; the first time can take minutes)\n"]
    compile_or_eager(tiny_model(), False, lambda m: pytest.fail("no probe without compile"))
    assert capsys.readouterr().out == ""  # compile off: nothing to announce


def test_a_failing_compile_warns_once_and_runs_eager(monkeypatch):
    from machinery.runtime import compile_or_eager

    class Broken(torch.nn.Module):
        def forward(self, *args):
            raise RuntimeError("inductor exploded")

    monkeypatch.setattr(torch, "compile", lambda model: Broken())
    model = tiny_model()
    torch.manual_seed(0)
    state = torch.get_rng_state()

    def probe(m):
        torch.rand(3)  # the probe may draw randomness; fork_rng must hide it
        m(torch.zeros(1, 4, dtype=torch.long))

    with pytest.warns(UserWarning, match="torch.compile failed .*inductor exploded.*running eager"):
        assert compile_or_eager(model, True, probe) is model
    assert torch.equal(torch.get_rng_state(), state)
    assert compile_or_eager(model, False, probe) is model


# Imported only by the call that needs them: corpus preparation, GPT-2's tokenizer, Hugging Face interop.
NOT_AT_IMPORT = ("machinery.corpora", "machinery.tokenizers", "machinery.hf", "tiktoken", "transformers",
                 "huggingface_hub", "safetensors", "pyarrow")


def test_train_py_imports_no_corpus_preparation_or_hugging_face_code_at_module_level():
    """The textbook core loads what a step needs; preparing a corpus and init_from import their modules
    when called (data.corpus_for, train.start_from). Checked in a fresh interpreter."""
    probe = f"import sys, train; print(sorted(m for m in {NOT_AT_IMPORT!r} if m in sys.modules))"
    assert run_script("-c", probe).stdout.strip() == "[]"
    loaded = run_script("-c", probe.replace("import sys, train", "import sys, train, machinery.corpora, machinery.hf"))
    assert "machinery.corpora" in loaded.stdout and "machinery.hf" in loaded.stdout  # the probe can see them
