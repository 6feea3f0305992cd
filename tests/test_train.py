"""The training loop: schedule, accumulation, evaluation, checkpoints, exact resume, end to end."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import train
from checkpoint import REQUIRED_KEYS, CheckpointWriteError, load_checkpoint, save_checkpoint
from config import make_config
from conftest import run_script, tiny_model


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
    assert train.evaluate(model, x, y, 3, torch.device("cpu"), torch.float32) == pytest.approx(first, rel=1e-6)
    model.eval()
    with torch.no_grad():
        _, loss_sum, n = model(x, y)
    assert first == pytest.approx(loss_sum.item() / n.item(), rel=1e-6)  # token-weighted mean


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


def test_resume_is_bit_exact_across_processes(tmp_path, text_file):
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_script(*train_args(text_file, straight, "--max_iters", "24", "--eval_interval", "12"))
    run_script(*train_args(text_file, split, "--max_iters", "12", "--eval_interval", "12"))
    run_script(*train_args(text_file, split, "--max_iters", "24", "--eval_interval", "12", "--resume"))
    losses = lambda d: [(m["step"], m["loss"]) for m in read_metrics(d) if "loss" in m]  # noqa: E731
    assert losses(split) == losses(straight) and len(losses(straight)) == 24
    a, b = load_checkpoint(straight / "last.pt"), load_checkpoint(split / "last.pt")
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    assert torch.equal(a["rng"]["data"], b["rng"]["data"])


def test_resume_refuses_another_model_shape(tmp_path, text_file):
    out = tmp_path / "run"
    run_script(*train_args(text_file, out, "--max_iters", "3"))
    before = (out / "last.pt").read_bytes()
    result = run_script(*train_args(text_file, out, "--max_iters", "6", "--resume", "--n_embd", "64"),
                        check=False)
    assert result.returncode == 2
    assert "n_embd: checkpoint 32 vs now 64" in result.stderr
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


def test_a_failing_compile_warns_once_and_runs_eager(monkeypatch):
    from runtime import compile_or_eager

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
