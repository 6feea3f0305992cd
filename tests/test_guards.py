"""Mutation tests for the bugs that raise no error: the real code passes, a mutant carrying the bug fails the same
check (a doctor check where the bug shows on a model or a batch, training runs compared exactly where not)."""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (final_weights, make_optimizer, make_text, metrics, random_batch, run_for, run_main, same_weights,
                      tiny_args, tiny_model)
from fault_injection import assert_nested_equal, floating_tensors

import data
import runtime
import sample
import train
from checkpoint import load_checkpoint
from config import model_config
from data import get_batch, load_corpus
from model import GPT, ModelOutput
from optim import NonFiniteGuard
from prepare import prepare_corpus
from scripts import doctor
from tokenizer import CharTokenizer

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- evaluation
def check_evaluate(evaluate) -> doctor.Check:
    """The doctor's evaluation check on a tiny model with dropout, so a missing eval() shows."""
    x_val, y_val = random_batch(batch_size=6)
    return doctor.check_evaluate(evaluate, tiny_model(dropout=0.1), x_val, y_val, batch_size=4,
                                 device=CPU, dtype=torch.float32)


REAL_EVALUATE = train.evaluate  # kept: the training-run guards below monkeypatch train.evaluate


def evaluate_on_random_windows(model, x_val, y_val, batch_size, device, dtype, *args):
    """The bug: evaluation samples its windows from the global RNG that training also uses."""
    pick = torch.randint(len(x_val), (batch_size,))
    return REAL_EVALUATE(model, x_val[pick], y_val[pick], batch_size, device, dtype, *args)


@torch.no_grad()
def evaluate_left_in_eval_mode(model, x_val, y_val, batch_size, device, dtype, *args):
    """The bug: evaluation forgets to switch back to train mode, so dropout is off for the rest of training."""
    model.eval()
    _, loss_sum, n, _ = model(x_val, y_val)
    return train.EvalResult((loss_sum / n).item(), math.nan, n.item())


@pytest.mark.parametrize("evaluate, problem", [
    pytest.param(train.evaluate, None, id="real"),
    # without its @torch.no_grad(): `total += loss_sum` then holds every batch's graph
    pytest.param(train.evaluate.__wrapped__, "autograd graph", id="no no_grad"),
    pytest.param(evaluate_on_random_windows, "global RNG", id="random windows"),
    pytest.param(evaluate_left_in_eval_mode, "left the model in eval mode", id="left in eval mode"),
    pytest.param(None, "train mode", id="missing model.eval()")])
def test_evaluate_check_names_the_problem(monkeypatch, evaluate, problem):
    if evaluate is None:  # the bug: model.eval() never happens
        monkeypatch.setattr(nn.Module, "eval", lambda self: self)
    check = check_evaluate(evaluate or train.evaluate)
    assert check.passed == (problem is None) and (problem or "") in check.measured, check.measured


# ----------------------------------------------------------------------------- the training step
def per_microbatch_mean(model, batches, scaler, device, dtype, world_size=1):
    """train.accumulate_gradients with the bug: the mean of the micro-batches' own mean losses."""
    loss_step, n_step = torch.zeros(()), torch.zeros((), dtype=torch.long)
    for x, y in batches:
        _, loss_sum, n, _ = model(x, y)
        (loss_sum / n / len(batches)).backward()  # the bug: weighs micro-batches, not tokens
        loss_step += loss_sum.detach()
        n_step += n
    return train.StepLosses(loss_step, n_step, {})


def record_steps(monkeypatch, cfg) -> list[tuple[list, list[torch.Tensor], list[torch.Tensor]]]:
    """Run train.train with uneven micro-batches (as padded ones); per step: micro-batches, weights, gradients."""
    micro_batches, snapshots = [], []
    real_next, real_clip = data.RandomWindows.next, torch.nn.utils.clip_grad_norm_

    def uneven_next(self):
        x, y = real_next(self)
        y = y.clone()
        y[:, : 4 * (len(micro_batches) % 3)] = -1
        micro_batches.append((x, y))
        return x, y

    def recording_clip(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        snapshots.append(([p.detach().clone() for p in parameters], [p.grad.clone() for p in parameters]))
        return real_clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(data.RandomWindows, "next", uneven_next)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    train.train(cfg)
    k = cfg.grad_accum
    return [(micro_batches[i * k: (i + 1) * k], weights, grads) for i, (weights, grads) in enumerate(snapshots)]


def one_batch_gradients(cfg, vocab_size: int, weights: list[torch.Tensor], micro_batches: list) -> list[torch.Tensor]:
    """The gradient of the mean loss over every target of the micro-batches, taken as one batch."""
    model = GPT(model_config(cfg, vocab_size))
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    x = torch.cat([x for x, _ in micro_batches])
    y = torch.cat([y for _, y in micro_batches])
    _, loss_sum, n, _ = model(x, y)
    (loss_sum / n).backward()
    return [p.grad for p in model.parameters()]


def step_gradient_errors(monkeypatch, cfg) -> list[float]:
    """Per step of train.train: the worst relative error of its gradient against one_batch_gradients."""
    folder = prepare_corpus(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction)
    vocab_size = load_corpus(folder, cfg.block_size).vocab_size
    errors = []
    for micro_batches, weights, grads in record_steps(monkeypatch, cfg):
        expected = one_batch_gradients(cfg, vocab_size, weights, micro_batches)
        errors.append(max(((g - e).norm() / e.norm()).item() for g, e in zip(grads, expected)))
    return errors


def no_zero_grad(self, set_to_none: bool = True) -> None:
    """The bug: optimizer.zero_grad() does nothing, so gradients pile up across steps."""


STEP_MUTANTS = {
    "real": lambda mp: None,
    "missing zero_grad": lambda mp: mp.setattr(torch.optim.AdamW, "zero_grad", no_zero_grad),
    "per-micro-batch mean": lambda mp: mp.setattr(train, "accumulate_gradients", per_microbatch_mean),
}


@pytest.mark.parametrize("mutant", STEP_MUTANTS)
def test_every_step_has_the_gradient_of_its_own_batch_and_step_mutants_are_caught(monkeypatch, tiny_cfg, mutant):
    STEP_MUTANTS[mutant](monkeypatch)
    errors = step_gradient_errors(monkeypatch, tiny_cfg(max_iters=3, grad_accum=3, eval_interval=100, compile="off"))
    assert len(errors) == 3
    assert (max(errors) < 1e-4) if mutant == "real" else (max(errors) > 1e-2), errors


# ----------------------------------------------------------------------------- model structure
class PlainListGPT(GPT):
    """The bug: the blocks live in a plain Python list, which parameters() and the optimizer never see."""

    def __init__(self, config):
        super().__init__(config)
        blocks = list(self.transformer.h)
        del self.transformer.h
        self.transformer.__dict__["h"] = blocks  # what `self.h = [Block(config) ...]` amounts to


@pytest.mark.parametrize("model_class, passes", [pytest.param(GPT, True, id="real"),
                                                  pytest.param(PlainListGPT, False, id="plain list")])
def test_layers_in_a_plain_list_are_caught(model_class, passes):
    model = model_class(tiny_model().config)
    optimizer = make_optimizer(model, 0.1, 1e-3, (0.9, 0.99))
    check = doctor.check_gradients(model, optimizer, *random_batch())
    assert check.passed == passes, check.measured
    if not passes:
        assert "unregistered tensor" in check.measured


class BroadcastLossGPT(GPT):
    """The bug: a hand-written cross-entropy where (N, 1) - (N,) broadcasts to (N, N)."""

    def forward(self, idx, targets=None):
        logits = super().forward(idx).logits
        flat = logits.reshape(-1, logits.size(-1))  # (N, V)
        log_norm = flat.logsumexp(-1, keepdim=True)  # (N, 1)
        picked = flat.gather(1, targets.reshape(-1, 1)).squeeze(1)  # (N,)
        loss_sum = (log_norm - picked).sum()  # the bug: (N, 1) - (N,) is (N, N), summed
        return ModelOutput(logits, loss_sum, (targets != -1).sum(), {})


@pytest.mark.parametrize("model_class, passes", [pytest.param(GPT, True, id="real"),
                                                  pytest.param(BroadcastLossGPT, False, id="broadcast")])
def test_broadcasting_loss_is_caught(model_class, passes):
    model = model_class(tiny_model().config)
    x, y = random_batch()
    assert doctor.check_init_loss(model, x, y).passed == passes
    logits, loss_sum, _, _ = model(x, y)
    per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")
    assert torch.allclose(loss_sum, per_token.sum(), rtol=1e-5) == passes


# ----------------------------------------------------------------------------- batches and masks
def unshifted_get_batch(data, batch_size, block_size, generator, device):
    """The bug: targets are the inputs themselves."""
    x, _ = get_batch(data, batch_size, block_size, generator, device)
    return x, x.clone()


def shifted_by_two_get_batch(data, batch_size, block_size, generator, device):
    """The bug: targets two tokens ahead instead of one."""
    x, y = get_batch(data, batch_size, block_size + 1, generator, device)
    return x[:, :-1], y[:, 1:]


@pytest.mark.parametrize("batcher, passes", [pytest.param(get_batch, True, id="real"),
                                             pytest.param(unshifted_get_batch, False, id="unshifted"),
                                             pytest.param(shifted_by_two_get_batch, False, id="shifted by two")])
def test_targets_not_shifted_are_caught(batcher, passes):
    text = make_text()
    tokenizer = CharTokenizer("".join(sorted(set(text))))
    data = tokenizer.encode_array(text).astype(np.uint16)
    x, y = batcher(data, 4, 16, torch.Generator().manual_seed(0), CPU)
    assert doctor.check_batch(x, y, data, tokenizer).passed == passes


REAL_ATTENTION = F.scaled_dot_product_attention


def attention_without_mask(q, k, v, dropout_p=0.0, is_causal=False, **kwargs):
    """The bug: no causal mask at all."""
    return REAL_ATTENTION(q, k, v, dropout_p=dropout_p)


def attention_seeing_next_token(q, k, v, dropout_p=0.0, is_causal=False, **kwargs):
    """The bug: a mask off by one, so position t also sees t + 1."""
    T = q.size(-2)
    allowed = torch.ones(T, T, dtype=torch.bool).tril(diagonal=1)  # (T, T); diagonal=0 is right
    return REAL_ATTENTION(q, k, v, attn_mask=allowed, dropout_p=dropout_p)


@pytest.mark.parametrize("attention", [REAL_ATTENTION, attention_without_mask, attention_seeing_next_token],
                         ids=["real", "no mask", "off by one"])
def test_leaky_causal_masks_are_caught(monkeypatch, attention):
    monkeypatch.setattr(F, "scaled_dot_product_attention", attention)
    check = doctor.check_causal(tiny_model(), random_batch()[0])
    assert check.passed == (attention is REAL_ATTENTION), check.measured
    assert doctor.check_causal(tiny_model(), random_batch()[0][:, :1]).passed  # block_size 1: was a traceback


# ----------------------------------------------------------------------------- tied weights
class DataTiedGPT(GPT):
    """The bug: the head is its own Parameter that merely shares the embedding's storage."""

    def __init__(self, config):
        super().__init__(config)
        self.lm_head.weight = nn.Parameter(self.transformer.wte.weight.detach())


# A cast goes through the same Module._apply as a device move, so it shows the bug on a CPU-only machine.
MOVES = [pytest.param(torch.float64, id="to float64")] + (
    [pytest.param("cuda", id="to cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("move", MOVES)
@pytest.mark.parametrize("model_class", [GPT, DataTiedGPT], ids=["real", "data tied"])
def test_tying_that_comes_apart_after_a_move_is_caught(move, model_class):
    model = model_class(tiny_model().config)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # looks tied before the move
    check = doctor.check_tied(model.to(move))
    assert check.passed == (model_class is GPT) and (check.passed or "two storages" in check.measured), check.measured


# ----------------------------------------------------------------------------- whole runs
def weights_with_eval_every(tiny_cfg, tmp_path: Path, eval_interval: int) -> dict[str, torch.Tensor]:
    cfg = tiny_cfg(out_dir=str(tmp_path / f"eval-every-{eval_interval}"), max_iters=6,
                   eval_interval=eval_interval, dropout=0.1, compile="off")
    train.train(cfg)
    return final_weights(cfg.out_dir)


EVAL_RNG_MUTANTS = {
    "real": lambda mp: None,
    "random eval windows": lambda mp: mp.setattr(train, "evaluate", evaluate_on_random_windows),
    "dropout on in eval": lambda mp: mp.setattr(nn.Module, "eval", lambda self: self),
}


@pytest.mark.parametrize("mutant", EVAL_RNG_MUTANTS)
def test_evaluation_consuming_the_training_rng_is_caught(monkeypatch, tiny_cfg, tmp_path, mutant):
    """Dropout reads the global RNG, so an eval that drew from it would change the later steps."""
    EVAL_RNG_MUTANTS[mutant](monkeypatch)
    assert same_weights(weights_with_eval_every(tiny_cfg, tmp_path, 1),
                        weights_with_eval_every(tiny_cfg, tmp_path, 6)) == (mutant == "real")


def record_optimizer_steps(monkeypatch) -> list[dict]:
    """Per call of train.optimizer_step: the lr the optimizer holds and the pre-clip gradient norm by hand."""
    calls: list[dict] = []
    real = train.optimizer_step

    def optimizer_step(optimizer, scaler, guard, params, max_norm, step, loss_step):
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
        calls.append({"lrs": {group["lr"] / group["lr_scale"] for group in optimizer.param_groups}, "hand_norm": norm})
        return real(optimizer, scaler, guard, params, max_norm, step, loss_step)

    monkeypatch.setattr(train, "optimizer_step", optimizer_step)
    return calls


# ----------------------------------------------------------------------------- what a step logs and keeps
def one_step_norm(fp16_scaler: bool, dtype: torch.dtype = torch.float32) -> float:
    """The pre-clip norm train.optimizer_step returns for one step of a fresh tiny model on one batch."""
    model = tiny_model()
    optimizer = make_optimizer(model, 0.1, 1e-3, (0.9, 0.99))
    scaler = torch.amp.GradScaler("cpu", enabled=fp16_scaler)  # works on CPU: scale 65536
    guard = NonFiniteGuard(scaler, max_skipped=20, device=CPU)
    loss_sum, _, _ = train.accumulate_gradients(model, [random_batch()], scaler, CPU, dtype)
    return train.optimizer_step(optimizer, scaler, guard, list(model.parameters()), 1.0, 1, loss_sum).item()


def test_fp16_step_clips_and_reports_the_unscaled_norm(tmp_path, text_file):
    """Bug caught: clip_grad_norm_ before scaler.unscale_ (it sees grads x 65536: norm ~2e4, not ~1), then logged."""
    fp32 = one_step_norm(fp16_scaler=False)
    # Autocast off: the scaled gradients differ from the fp32 ones by the power-of-two scale only.
    assert one_step_norm(fp16_scaler=True) == pytest.approx(fp32, rel=1e-5)
    assert one_step_norm(fp16_scaler=True, dtype=torch.float16) == pytest.approx(fp32, rel=1e-2)
    norms = {}  # a whole fp16 run logs the norm an fp32 run does
    for dtype in ("float32", "float16"):
        args = tiny_args(tmp_path / dtype, text_file, dtype=dtype, batch_size=2, max_iters=1, eval_interval=100)
        assert run_main(args) == 0
        norms[dtype] = metrics(tmp_path / dtype)[0][0]["grad_norm"]
    assert 0.1 < norms["float32"] < 10  # an O(1) norm, so a loss-scale factor cannot hide in the tolerance
    assert norms["float16"] == pytest.approx(norms["float32"], rel=1e-2)


def test_logged_grad_norm_is_the_pre_clip_norm_and_lr_follows_the_schedule_per_optimizer_step(tmp_path, text_file,
                                                                                                monkeypatch, tiny_cfg):
    """Bugs caught: the norm logged is recomputed after clipping (so never above grad_clip); the loop calls
    get_lr(step * grad_accum), counting micro-batches."""
    calls = record_optimizer_steps(monkeypatch)
    grad_clip = 0.05  # far below the ~1 norm of a fresh tiny model: every step clips
    args = tiny_args(tmp_path, text_file, grad_clip=grad_clip, grad_accum=3, max_iters=4, eval_interval=100)
    assert run_main(args) == 0
    logged = metrics(tmp_path)[0]
    assert len(logged) == len(calls) == 4
    for record, call in zip(logged, calls):
        assert record["grad_norm"] > 10 * grad_clip
        assert record["grad_norm"] == pytest.approx(call["hand_norm"], rel=1e-5)
    cfg = tiny_cfg(grad_accum=3, max_iters=4)  # the same schedule fields as the run
    expected = [train.get_lr(s, cfg) for s in range(4)]  # warmup: every step's lr is distinct
    assert [call["lrs"] for call in calls] == [{lr} for lr in expected]  # what the optimizer used
    assert [record["lr"] for record in logged] == expected  # what the log says


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


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv cache", "no cache"])
def test_sampling_runs_every_forward_without_autograd(use_cache):
    """Bug caught: generate without @torch.no_grad() (every step's graph, and the cache's, kept alive)."""
    model = tiny_model().eval()
    assert all(p.requires_grad for p in model.parameters())  # a model as loaded: trainable weights
    seen = []  # (grad mode, logits require grad) at each forward
    model.register_forward_hook(lambda module, args, out: seen.append((torch.is_grad_enabled(), out[0].requires_grad)))
    prompt = random_batch(batch_size=2)[0][:, :4]  # (B, 4)
    out = sample.generate(model, prompt, 20, temperature=1.0, generator=torch.Generator().manual_seed(0),
                          use_cache=use_cache)
    assert out.shape == (2, 24) and seen == [(False, False)] * 20


# ----------------------------------------------------------------------------- the compile probe
def test_compiled_run_sees_the_batches_and_gradients_of_an_eager_run(tmp_path, text_file, light_compile):
    """Bugs caught: the probe draws its batch from the training stream, or leaves its gradients on the weights."""
    eager = run_for(tmp_path, text_file, "eager", compile="off")
    compiled = run_for(tmp_path, text_file, "compiled", compile="on")
    eager_log, compiled_log = metrics(tmp_path / "eager")[0], metrics(tmp_path / "compiled")[0]
    # Other batches move the loss by ~1e-2 and an extra gradient the norm by ~50%; round-off is ~1e-7.
    for e, c in zip(eager_log, compiled_log, strict=True):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-5), f"loss at step {c['step']}"
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-4), f"grad norm at step {c['step']}"
    assert_nested_equal(compiled["rng"]["data"], eager["rng"]["data"])  # the data stream moved on alike


def probe_on(batch: tuple[torch.Tensor, torch.Tensor], error: Exception | None = None):
    """train.py's probe: one forward/backward, drawing randomness; optionally the compiler then fails."""
    def probe(m: torch.nn.Module) -> None:
        torch.rand(3)  # fork_rng must hide it
        _, loss_sum, n, _ = m(*batch)
        (loss_sum / n).backward()
        if error:
            raise error
    return probe


@pytest.mark.parametrize("error", [None, RuntimeError("inductor exploded\n(more)"), AssertionError()],
                         ids=["compiled", "compile fails", "an assert without a message"])
def test_compile_probe_leaves_no_gradient_on_the_weights(light_compile, error):
    """Bugs caught: compile_or_eager does not clear the probe's gradients (the first backward adds to them); a
    compiler error without a message (IndexError) ended the run instead of falling back to eager."""
    model, rng = tiny_model(), torch.get_rng_state()
    said = r"torch.compile failed \((RuntimeError: inductor exploded|AssertionError)\); running eager$"
    with pytest.warns(UserWarning, match=said) if error else contextlib.nullcontext():
        result = runtime.compile_or_eager(model, True, probe_on(random_batch(), error))
    assert (result is model) == (error is not None) and torch.equal(torch.get_rng_state(), rng)
    assert [name for name, p in model.named_parameters() if p.grad is not None] == []
