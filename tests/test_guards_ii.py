"""Guards II (issue 15): eight silent bugs that left every other test green, each caught here.

Each test asserts what a user would see: the grad norm and lr in metrics.jsonl, the exit code and
the weights after a fault, the dtypes in last.pt, the autograd state while sampling, and the batches
and weights of a compiled run. Each test names, in its docstring, the bug it was seen to fail on
(the issue lists the edit and the failure line). Where the doctor can see the bug too, its check is
tested in test_doctor.py.
"""
from __future__ import annotations

import contextlib
import functools
import math
import warnings
from pathlib import Path

import pytest
import torch

import runtime
import sample
import train
from checkpoint import load_checkpoint
from conftest import make_optimizer, tiny_model
from fault_injection import (assert_nested_equal, assert_same_training_state, call_of, capture_run, metrics,
                             on_training_forward, run_main, tiny_args)
from faults import NonFiniteGuard

CPU = torch.device("cpu")


def random_batch(vocab_size: int = 50, batch_size: int = 4, block_size: int = 16,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets cut from random token rows."""
    rows = torch.randint(vocab_size, (batch_size, block_size + 1), generator=torch.Generator().manual_seed(seed))
    return rows[:, :-1], rows[:, 1:]  # (B, T) each


def floating_tensors(value) -> list[torch.Tensor]:
    """Every floating-point tensor in a nested dict/list (a state dict, a checkpoint)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in floating_tensors(item)]
    return []


def record_optimizer_steps(monkeypatch) -> list[dict]:
    """Wrap train.optimizer_step: per call, the lr the optimizer holds, the hand-computed pre-clip
    gradient norm, and the norm the step returned (what the loop logs)."""
    calls: list[dict] = []
    real = train.optimizer_step

    def optimizer_step(optimizer, scaler, guard, params, max_norm, step, loss_step):
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
        lrs = {group["lr"] / group["lr_scale"] for group in optimizer.param_groups}
        returned = real(optimizer, scaler, guard, params, max_norm, step, loss_step)
        calls.append({"step": step, "lrs": lrs, "hand_norm": norm, "returned": returned.item()})
        return returned

    monkeypatch.setattr(train, "optimizer_step", optimizer_step)
    return calls


# ----------------------------------------------------------------------------- 1. fp16: unscale, then clip
def one_step_norm(fp16_scaler: bool, dtype: torch.dtype = torch.float32) -> float:
    """The pre-clip norm train.optimizer_step returns for one step of a fresh tiny model on one batch."""
    model = tiny_model()
    optimizer = make_optimizer(model, 0.1, 1e-3, (0.9, 0.99))
    scaler = torch.amp.GradScaler("cpu", enabled=fp16_scaler)  # works on CPU: scale 65536
    guard = NonFiniteGuard(optimizer, scaler, max_skipped=20, device=CPU)
    loss_sum, _ = train.accumulate_gradients(model, [random_batch()], scaler, CPU, dtype)
    return train.optimizer_step(optimizer, scaler, guard, list(model.parameters()), 1.0, 1, loss_sum).item()


def test_fp16_step_clips_and_reports_the_unscaled_norm():
    """Bug caught: clip_grad_norm_ before scaler.unscale_ (it sees grads x 65536: norm ~2e4, not ~1)."""
    fp32 = one_step_norm(fp16_scaler=False)
    # Autocast off: the scaled gradients differ from the fp32 ones by the power-of-two scale only.
    assert one_step_norm(fp16_scaler=True) == pytest.approx(fp32, rel=1e-5)
    # Real fp16 autocast rounds the activations: the same norm to within 1%.
    assert one_step_norm(fp16_scaler=True, dtype=torch.float16) == pytest.approx(fp32, rel=1e-2)


def test_fp16_run_logs_the_same_grad_norm_as_fp32(tmp_path, text_file):
    """What the user reads: step 1's logged grad norm of an fp16 run is the fp32 run's (within 1%)."""
    norms = {}
    for dtype in ("float32", "float16"):
        args = tiny_args(tmp_path / dtype, text_file, dtype=dtype, batch_size=2, max_iters=1, eval_interval=100)
        assert run_main(args) == 0
        norms[dtype] = metrics(tmp_path / dtype)[0][0]["grad_norm"]
    assert 0.1 < norms["float32"] < 10  # an O(1) norm, so a loss-scale factor cannot hide in the tolerance
    assert norms["float16"] == pytest.approx(norms["float32"], rel=1e-2)


# ----------------------------------------------------------------------------- 2. the pre-clip norm is logged
def test_logged_grad_norm_is_the_pre_clip_norm(tmp_path, text_file, monkeypatch):
    """Bug caught: the norm logged is recomputed after clipping (so never above grad_clip)."""
    calls = record_optimizer_steps(monkeypatch)
    grad_clip = 0.05  # far below the ~1 norm of a fresh tiny model: every step clips
    args = tiny_args(tmp_path, text_file, grad_clip=grad_clip, max_iters=3, eval_interval=100)
    assert run_main(args) == 0
    logged = [record["grad_norm"] for record in metrics(tmp_path)[0]]
    assert len(logged) == len(calls) == 3
    for norm, call in zip(logged, calls):
        assert norm > 10 * grad_clip
        assert norm == pytest.approx(call["hand_norm"], rel=1e-5)


# ----------------------------------------------------------------------------- 3. lr per optimizer step
def test_lr_follows_the_schedule_per_optimizer_step_with_accumulation(tmp_path, text_file, monkeypatch, tiny_cfg):
    """Bug caught: the loop calls get_lr(step * grad_accum), counting micro-batches."""
    calls = record_optimizer_steps(monkeypatch)
    args = tiny_args(tmp_path, text_file, grad_accum=3, max_iters=4, eval_interval=100)
    assert run_main(args) == 0
    cfg = tiny_cfg(grad_accum=3, max_iters=4)  # the same schedule fields as the run
    expected = [train.get_lr(s, cfg) for s in range(4)]  # warmup: every step's lr is distinct
    assert [call["lrs"] for call in calls] == [{lr} for lr in expected]  # what the optimizer used
    assert [record["lr"] for record in metrics(tmp_path)[0]] == expected  # what the log says


# ----------------------------------------------------------------------------- 4. NaN gradient, finite loss
class NaNGradient(torch.autograd.Function):
    """The identity going forward, NaN coming back: a finite loss whose gradient is not."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.nan


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])  # fused found_inf path; per-step host check
def test_nan_gradient_with_a_finite_loss_stops_before_the_update(tmp_path, text_file, monkeypatch, capsys, optimizer):
    """Bug caught: the guard checks only the loss, so step 4's NaN gradients reach the weights."""
    args = dict(grad_accum=2, max_iters=20, log_interval=5, eval_interval=3, optimizer=optimizer)
    assert run_main(tiny_args(tmp_path / "reference", text_file, **{**args, "max_iters": 3})) == 0
    before_step_4 = load_checkpoint(tmp_path / "reference" / "last.pt")
    run = capture_run(monkeypatch)
    losses = []

    def poison(n: int, loss_sum: torch.Tensor) -> torch.Tensor | None:
        losses.append(loss_sum.detach())
        return NaNGradient.apply(loss_sum) if n == call_of(4, 2, 2) else None

    on_training_forward(monkeypatch, poison)
    out = tmp_path / "poisoned"
    assert run_main(tiny_args(out, text_file, **args)) == 3
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: non-finite loss or gradient at step 4;")
    assert all(torch.isfinite(loss) for loss in losses)  # only the gradient was ever non-finite
    assert_nested_equal(run["model"].state_dict(), before_step_4["model"])  # the weights in memory
    assert load_checkpoint(out / "last.pt")["step"] == 3  # nothing was saved after the fault
    for name in ("last.pt", "best.pt"):
        assert all(torch.isfinite(t).all() for t in floating_tensors(load_checkpoint(out / name)))


# ----------------------------------------------------------------------------- 5. bf16 keeps fp32 weights
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_bf16_run_keeps_fp32_weights_and_optimizer_state(tmp_path, text_file, optimizer):
    """Bug caught: the model cast to bf16 (no fp32 master copy); autocast alone is the mixed precision."""
    args = tiny_args(tmp_path, text_file, dtype="bfloat16", optimizer=optimizer, batch_size=2, max_iters=2,
                     eval_interval=100)
    assert run_main(args) == 0
    state = load_checkpoint(tmp_path / "last.pt")
    assert state["precision"] == "bfloat16"
    tensors = {"model": floating_tensors(state["model"]), "optimizer": floating_tensors(state["optimizer"])}
    assert tensors["model"] and tensors["optimizer"]  # moments exist after a step
    for part, found in tensors.items():
        assert {t.dtype for t in found} == {torch.float32}, part


# ----------------------------------------------------------------------------- 6. sampling builds no graph
@pytest.mark.parametrize("use_cache", [True, False], ids=["kv cache", "no cache"])
def test_sampling_runs_every_forward_without_autograd(use_cache):
    """Bug caught: generate without @torch.no_grad() (every step's graph, and the cache's, kept alive)."""
    model = tiny_model().eval()
    assert all(p.requires_grad for p in model.parameters())  # a model as loaded: trainable weights
    seen = []  # (grad mode, logits require grad) at each forward

    def record(module, args, output):
        seen.append((torch.is_grad_enabled(), output[0].requires_grad))

    model.register_forward_hook(record)
    prompt = random_batch(batch_size=2)[0][:, :4]  # (B, 4)
    out = sample.generate(model, prompt, 20, temperature=1.0, generator=torch.Generator().manual_seed(0),
                          use_cache=use_cache)
    assert out.shape == (2, 24)
    assert len(seen) == 20
    assert seen == [(False, False)] * 20


# ----------------------------------------------------------------------------- 7, 8. the compile probe
@pytest.fixture
def light_compile(monkeypatch):
    """compile=on through dynamo (the graph capture), without inductor's codegen (minutes on a 2-core CPU).

    The two bugs live in the probe around torch.compile, not in the backend. Dynamo's caches are
    cleared around the test so that no earlier compile (or its recompile budget) leaks in or out.
    A fallback to eager would make the tests vacuous (eager runs no probe), so it is an error here.
    """
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch.compile failed")
        yield
    torch._dynamo.reset()


def run_for(tmp_path: Path, text_file: Path, name: str, **overrides) -> dict:
    """Train the tiny preset into tmp_path/name (4 steps, then one eval of 8 windows); its last.pt."""
    args = dict(max_iters=4, eval_interval=100, eval_tokens=256) | overrides
    assert run_main(tiny_args(tmp_path / name, text_file, **args)) == 0
    return load_checkpoint(tmp_path / name / "last.pt")


def test_compiled_run_sees_the_batches_and_gradients_of_an_eager_run(tmp_path, text_file, light_compile):
    """Bugs caught: the probe draws its batch from the training data stream (every batch shifts),
    and the probe's gradients left on the weights (step 1's gradient is off)."""
    eager = run_for(tmp_path, text_file, "eager", compile="off")
    compiled = run_for(tmp_path, text_file, "compiled", compile="on")
    eager_log, compiled_log = metrics(tmp_path / "eager")[0], metrics(tmp_path / "compiled")[0]
    # Other batches move the loss by ~1e-2 and an extra gradient the norm by ~50%; round-off is ~1e-7.
    for e, c in zip(eager_log, compiled_log, strict=True):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-5), f"loss at step {c['step']}"
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-4), f"grad norm at step {c['step']}"
    assert torch.equal(compiled["rng"]["data"], eager["rng"]["data"]), "the data stream moved on differently"


def test_compiled_run_resumed_equals_a_straight_compiled_run(tmp_path, text_file, light_compile):
    """Bug caught: the probe draws from the training data stream (a resume probes again: one more draw)."""
    straight = run_for(tmp_path, text_file, "straight", compile="on")
    run_for(tmp_path, text_file, "split", compile="on", max_iters=2)
    resumed = run_for(tmp_path, text_file, "split", compile="on", resume=True)
    assert_same_training_state(straight, resumed)


def probe_on(batch: tuple[torch.Tensor, torch.Tensor], fails: bool = False):
    """train.py's probe: one forward/backward; optionally the compiler then fails."""
    def probe(m: torch.nn.Module) -> None:
        _, loss_sum, n = m(*batch)
        (loss_sum / n).backward()
        if fails:
            raise RuntimeError("inductor exploded")
    return probe


@pytest.mark.parametrize("fails", [False, True], ids=["compiled", "compile fails"])
def test_compile_probe_leaves_no_gradient_on_the_weights(light_compile, fails):
    """Bug caught: compile_or_eager does not clear the probe's gradients (the first backward adds to them)."""
    model = tiny_model()
    with pytest.warns(UserWarning, match="running eager") if fails else contextlib.nullcontext():
        result = runtime.compile_or_eager(model, True, probe_on(random_batch(), fails))
    assert (result is model) == fails
    assert [name for name, p in model.named_parameters() if p.grad is not None] == []
