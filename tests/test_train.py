"""The training loop: schedule, accumulation, evaluation, checkpoints, end to end (resume: test_resume.py)."""
from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import metrics, read_metrics, run_main, run_script, tiny_args, tiny_model
from fault_injection import step_clock

import logs
import train
from checkpoint import REQUIRED_KEYS, from_checkpoint, load_checkpoint
from config import make_config


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


@pytest.mark.parametrize("seconds, shown", [(0, "0:00"), (83.9, "1:23"), (180, "3:00"), (3599.5, "59:59"),
                                             (3600, "1:00:00"), (3725, "1:02:05")])
def test_clock_is_minutes_and_seconds_then_hours(seconds, shown):
    assert logs.clock(seconds) == shown


@pytest.mark.parametrize("budget, shown", [
    (dict(max_time=60), ["0:30 of 1:00", "1:00 of 1:00"]),  # max_time comes first: it ends the run
    (dict(max_time=3600), ["0:30 of ~1:30", "1:00 of ~1:30", "1:30 of ~1:30"]),  # max_iters does, at 30 s a step
    (dict(), ["0:30 of ~1:30", "1:00 of ~1:30", "1:30 of ~1:30"]),  # a step schedule: where max_iters ends it
    (dict(max_iters=6, eval_interval=2, eval_s=30), ["0:30 of ~3:00", "1:00 of ~3:00", "2:00 of ~4:00",
                                                     "2:30 of ~3:45", "3:30 of ~4:12", "4:00 of ~4:00"]),  # evals too
], ids=["max_time first", "max_iters first", "no max_time", "evals count"])
def test_step_lines_show_the_run_time_against_its_end(tmp_path, text_file, capsys, monkeypatch, budget, shown):
    """Bug caught: a step-schedule run's lines said nothing of its total or the time left, where a time budget's
    said `0:41 of 3:00`; and a budget that max_iters beats was shown as the end."""
    settings = dict(max_iters=3) | budget
    step_clock(monkeypatch, step_s=30, eval_s=settings.pop("eval_s", 0))
    step_line = re.compile(r"^step +\d+ \| loss .*")
    assert run_main(tiny_args(tmp_path / "run", text_file, **settings)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if step_line.match(line)]
    assert [line.rsplit(" | ", 1)[1] for line in lines] == shown


def test_an_eval_that_spends_the_budget_is_the_final_one(tmp_path, text_file, monkeypatch):
    """Before: the loop checked the clock only after a step, so an eval that crossed max_time was
    followed by one more step and a second, redundant full eval (11 s each on `small`, 2-core CPU)."""
    step_clock(monkeypatch, step_s=0.25, eval_s=1.5)  # steps 1-3 spend 0.75 s, the eval at step 3 the rest
    out = tmp_path / "run"
    assert run_main(tiny_args(out, text_file, max_time=1, max_iters=1000, eval_interval=3)) == 0
    train_records, val_records = metrics(out)
    assert [r["step"] for r in val_records] == [3]
    assert train_records[-1]["step"] == 3 and load_checkpoint(out / "last.pt")["step"] == 3


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


def split_and_whole(batches: list, **options) -> list[tuple[train.StepLosses, list[torch.Tensor]]]:
    """One step's losses and gradients over ``batches``, and over the same rows as one batch."""
    scaler, cpu, results = torch.amp.GradScaler("cpu", enabled=False), torch.device("cpu"), []
    for parts in (batches, [(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))]):
        model = tiny_model(**options)
        results.append((train.accumulate_gradients(model, parts, scaler, cpu, torch.float32), grads_of(model)))
    return results


def test_the_z_loss_is_its_weight_times_log_z_squared_summed_over_the_targets():
    x, y = make_batches([20])[0]  # 20 of 32 positions are targets
    out = tiny_model(z_loss=0.5)(x, y)
    log_z = out.logits.reshape(32, -1).logsumexp(dim=-1)[y.reshape(32) != -1]  # (20,)
    assert out.n_targets.item() == 20 and torch.equal(out.aux["z_loss"], 0.5 * log_z.square().sum())
    assert dict(tiny_model()(x, y).aux) == {}  # z_loss 0: no term at all


def test_an_objective_term_weighs_the_same_however_the_batch_is_split():
    """z_loss, summed over the targets as the cross-entropy is: one step over micro-batches of uneven target counts
    has the loss, the gradient and the logged per-target term of the same rows as one batch."""
    (split, split_grads), (whole, whole_grads) = split_and_whole(make_batches([32, 5, 17]), z_loss=0.5)
    assert split.n_targets.item() == whole.n_targets.item() == 54
    assert split.loss_sum.grad_fn is None and not split.loss_sum.requires_grad  # the running loss keeps no graph
    torch.testing.assert_close(split.loss_sum, whole.loss_sum, rtol=1e-6, atol=1e-5)
    per_target = [(losses.aux["z_loss"] / losses.n_targets).item() for losses in (split, whole)]
    assert per_target[0] == pytest.approx(per_target[1], rel=1e-6) and per_target[1] > 1  # 0.5 x ~ln(50)^2
    for g_split, g_whole in zip(split_grads, whole_grads):  # a per-micro-batch mean: test_guards.py
        torch.testing.assert_close(g_split, g_whole, rtol=1e-5, atol=1e-7)


def test_mfu_reads_the_flops_measured_at_start(tmp_path, text_file, monkeypatch):
    """Each log line's MFU is flops_per_token's measured count x tokens/s / peak (a pretend 1 TFLOP/s here)."""
    monkeypatch.setattr(logs, "device_peak", lambda device, dtype: 1e12)
    assert run_main(tiny_args(tmp_path / "run", text_file, max_iters=3)) == 0
    model = from_checkpoint(tmp_path / "run" / "last.pt").model
    counted = model.flops_per_token()
    assert counted < 6 * model.num_params() + 12 * 2 * 32 * 32  # tiny: 2 layers, T = C = 32
    steps = [record for record in read_metrics(tmp_path / "run") if "mfu" in record]
    assert len(steps) == 3
    for record in steps:
        assert record["mfu"] == pytest.approx(counted * record["tokens_per_s"] / 1e12, rel=1e-12)


def test_evaluate_is_the_token_weighted_mean_over_its_batches():
    """(Eval mode, no graph, no randomness, train mode after: test_guards.py's evaluate check.)"""
    model = tiny_model(dropout=0.2).train()
    x = torch.randint(0, 50, (5, 16))
    y = torch.randint(0, 50, (5, 16))
    y[4, 3:] = -1  # a short, padded last window
    first = train.evaluate(model, x, y, 2, torch.device("cpu"), torch.float32)  # batches of 2, 2 and 1
    model.eval()
    with torch.no_grad():
        _, loss_sum, n, _ = model(x, y)
    assert first.loss == pytest.approx(loss_sum.item() / n.item(), rel=1e-6)  # token-weighted mean
    assert first.tokens == n.item() == 4 * 16 + 3 and math.isnan(first.bpb)  # no byte count given: no bpb


def test_a_fresh_run_never_replaces_an_existing_one(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert run_main(tiny_args(out, text_file, max_iters=3)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert run_main(tiny_args(out, text_file, max_iters=3)) == 2
    assert "already holds a run (last.pt); continue it with --resume" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / "last.pt").unlink()  # best.pt alone (last.pt deleted, or a first save that filled the disk): kept too
    assert run_main(tiny_args(out, text_file, max_iters=3)) == 2 and (out / "best.pt").read_bytes() == before["best.pt"]
    assert "holds a run's best.pt (and no last.pt to resume)" in capsys.readouterr().err
    assert run_main(tiny_args(out, text_file, max_iters=3, resume="true")) == 2  # it said "drop --resume": refused
    assert "copy its best.pt to last.pt to resume from the best step" in capsys.readouterr().err
    (out / "best.pt").unlink()
    notes = "\nmy notes\n"  # not a run's log (a blank first line passed for one): was deleted by the new run
    (out / "metrics.jsonl").write_text(notes)
    assert run_main(tiny_args(out, text_file, max_iters=3)) == 2 and (out / "metrics.jsonl").read_text() == notes
    assert "metrics.jsonl is not a run's log" in capsys.readouterr().err
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.2}\n')  # a run's that saved nothing: replaced
    assert run_main(tiny_args(out, text_file, max_iters=3)) == 0


@pytest.mark.slow  # ~11 s: two fresh interpreters
def test_end_to_end_train_then_sample(tmp_path, text_file):
    out = tmp_path / "run"
    run_script("train.py", *tiny_args(out, text_file, max_iters=40, eval_interval=20, dropout=0.1, grad_accum=2))
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
    from runtime import compile_or_eager
    monkeypatch.setattr(torch, "compile", lambda model: model)  # compiling itself is not what is tested
    printed_before_probe = []
    compile_or_eager(tiny_model(), True, lambda m: printed_before_probe.append(capsys.readouterr().out))
    assert printed_before_probe == ["compiling the model (torch.compile; the first time can take minutes)\n"]
    compile_or_eager(tiny_model(), False, lambda m: pytest.fail("no probe without compile"))
    assert capsys.readouterr().out == ""  # compile off: nothing to announce


# Imported only by the call that needs them: chat and LoRA (finetune.py), GPT-2's tokenizer (tiktoken: tokenizer.py
# imports it only to build a BPE), Hugging Face interop, parquet.
NOT_AT_IMPORT = ("finetune", "tiktoken", "transformers", "huggingface_hub", "safetensors", "pyarrow")


def test_train_py_imports_no_chat_lora_or_hugging_face_code_at_module_level():
    """Chat, LoRA, GPT-2's BPE and Hugging Face's code are imported by the calls that need them."""
    probe = f"import sys, train; print(sorted(m for m in {NOT_AT_IMPORT!r} if m in sys.modules)); import finetune; "
    assert run_script("-c", probe + "print('finetune' in sys.modules)").stdout.split() == ["[]", "True"]
