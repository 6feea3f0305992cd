"""Mutation tests for the bugs that raise no error: put each bug in, show it is caught.

Every guard is a pair: the real code passes, and a mutant carrying the bug (a broken subclass, a
monkeypatch, or a one-function variant) fails the same check. A guard whose mutant slipped through
would be a test that cannot fail. The catching is done by a doctor check (scripts/doctor.py) where
the bug is visible on a model or a batch, and by training runs compared exactly where it is not.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoint
import train
from checkpoint import load_checkpoint
from config import model_config
from conftest import make_optimizer, make_text, tiny_model
from data import CharTokenizer, get_batch, load_corpus, prepare
from model import GPT
from scripts import doctor

CPU = torch.device("cpu")



def random_batch(vocab_size: int = 50, batch_size: int = 4, block_size: int = 16,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets cut from random token rows."""
    rows = torch.randint(vocab_size, (batch_size, block_size + 1), generator=torch.Generator().manual_seed(seed))
    return rows[:, :-1], rows[:, 1:]  # (B, T) each


# ----------------------------------------------------------------------------- evaluation
def check_evaluate(evaluate) -> doctor.Check:
    """The doctor's evaluation check on a tiny model with dropout, so a missing eval() shows."""
    x_val, y_val = random_batch(batch_size=6)
    return doctor.check_evaluate(evaluate, tiny_model(dropout=0.1), x_val, y_val, batch_size=4,
                                 device=CPU, dtype=torch.float32)


def test_real_evaluate_is_clean():
    check = check_evaluate(train.evaluate)
    assert check.passed, check.measured


def test_missing_model_eval_is_caught(monkeypatch):
    monkeypatch.setattr(nn.Module, "eval", lambda self: self)  # the bug: model.eval() never happens
    check = check_evaluate(train.evaluate)
    assert not check.passed
    assert "train mode" in check.measured


def test_evaluation_keeping_every_graph_alive_is_caught():
    # train.evaluate without its @torch.no_grad(): `total += loss_sum` then holds every batch's graph.
    check = check_evaluate(train.evaluate.__wrapped__)
    assert not check.passed
    assert "autograd graph" in check.measured


def test_accumulation_keeps_no_graph_in_its_running_loss():
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss_sum, n = train.accumulate_gradients(tiny_model(), [random_batch(), random_batch(seed=1)], scaler,
                                             CPU, torch.float32)
    assert loss_sum.grad_fn is None and not loss_sum.requires_grad
    assert n.item() == 2 * 4 * 16


# ----------------------------------------------------------------------------- the training step
def per_microbatch_mean(model, batches, scaler, device, dtype, world_size=1):
    """train.accumulate_gradients with the bug: the mean of the micro-batches' own mean losses."""
    loss_step, n_step = torch.zeros(()), torch.zeros((), dtype=torch.long)
    for x, y in batches:
        _, loss_sum, n = model(x, y)
        (loss_sum / n / len(batches)).backward()  # the bug: weighs micro-batches, not tokens
        loss_step += loss_sum.detach()
        n_step += n
    return loss_step, n_step


def record_steps(monkeypatch, cfg) -> list[tuple[list, list[torch.Tensor], list[torch.Tensor]]]:
    """Run train.train; for each step return (its micro-batches, the weights, the gradients) at clipping.

    Micro-batches ignore 0, 4 or 8 targets per row (-1), so they count different numbers of targets,
    as padded batches do: that is when a per-micro-batch mean goes wrong.
    """
    micro_batches, snapshots = [], []
    real_get_batch, real_clip = train.get_batch, torch.nn.utils.clip_grad_norm_

    def uneven_get_batch(*args, **kwargs):
        x, y = real_get_batch(*args, **kwargs)
        y = y.clone()
        y[:, : 4 * (len(micro_batches) % 3)] = -1
        micro_batches.append((x, y))
        return x, y

    def recording_clip(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        snapshots.append(([p.detach().clone() for p in parameters], [p.grad.clone() for p in parameters]))
        return real_clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(train, "get_batch", uneven_get_batch)
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
    _, loss_sum, n = model(x, y)
    (loss_sum / n).backward()
    return [p.grad for p in model.parameters()]


def step_gradient_errors(monkeypatch, cfg) -> list[float]:
    """Per step of train.train: the worst relative error of its gradient against one_batch_gradients."""
    folder = prepare(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction)
    vocab_size = load_corpus(folder, cfg.block_size).vocab_size
    errors = []
    for micro_batches, weights, grads in record_steps(monkeypatch, cfg):
        expected = one_batch_gradients(cfg, vocab_size, weights, micro_batches)
        errors.append(max(((g - e).norm() / e.norm()).item() for g, e in zip(grads, expected)))
    return errors


def no_zero_grad(self, set_to_none: bool = True) -> None:
    """The bug: optimizer.zero_grad() does nothing, so gradients pile up across steps."""


STEP_MUTANTS = {
    "missing zero_grad": lambda mp: mp.setattr(torch.optim.AdamW, "zero_grad", no_zero_grad),
    "per-micro-batch mean": lambda mp: mp.setattr(train, "accumulate_gradients", per_microbatch_mean),
}


def test_every_step_has_the_gradient_of_its_own_batch(monkeypatch, tiny_cfg):
    cfg = tiny_cfg(max_iters=3, grad_accum=3, eval_interval=100, compile="off")
    errors = step_gradient_errors(monkeypatch, cfg)
    assert len(errors) == 3
    assert max(errors) < 1e-4, errors


@pytest.mark.parametrize("mutant", STEP_MUTANTS)
def test_step_mutants_are_caught(monkeypatch, tiny_cfg, mutant):
    STEP_MUTANTS[mutant](monkeypatch)
    cfg = tiny_cfg(max_iters=3, grad_accum=3, eval_interval=100, compile="off")
    errors = step_gradient_errors(monkeypatch, cfg)
    assert max(errors) > 1e-2, errors


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
    torch.manual_seed(0)
    model = model_class(tiny_model().config)
    optimizer = make_optimizer(model, 0.1, 1e-3, (0.9, 0.99))
    check = doctor.check_gradients(model, optimizer, *random_batch())
    assert check.passed == passes, check.measured
    if not passes:
        assert "unregistered tensor" in check.measured


class BroadcastLossGPT(GPT):
    """The bug: a hand-written cross-entropy where (N, 1) - (N,) broadcasts to (N, N)."""

    def forward(self, idx, targets=None):
        logits, _, _ = super().forward(idx)
        flat = logits.reshape(-1, logits.size(-1))  # (N, V)
        log_norm = flat.logsumexp(-1, keepdim=True)  # (N, 1)
        picked = flat.gather(1, targets.reshape(-1, 1)).squeeze(1)  # (N,)
        loss_sum = (log_norm - picked).sum()  # the bug: (N, 1) - (N,) is (N, N), summed
        return logits, loss_sum, (targets != -1).sum()


@pytest.mark.parametrize("model_class, passes", [pytest.param(GPT, True, id="real"),
                                                  pytest.param(BroadcastLossGPT, False, id="broadcast")])
def test_broadcasting_loss_is_caught(model_class, passes):
    torch.manual_seed(0)
    model = model_class(tiny_model().config)
    x, y = random_batch()
    assert doctor.check_init_loss(model, x, y).passed == passes
    # And directly: the summed loss must be the sum of the per-token losses.
    logits, loss_sum, _ = model(x, y)
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


def test_real_attention_does_not_leak():
    check = doctor.check_causal(tiny_model(), random_batch()[0])
    assert check.passed, check.measured


@pytest.mark.parametrize("leaky", [attention_without_mask, attention_seeing_next_token])
def test_leaky_causal_masks_are_caught(monkeypatch, leaky):
    monkeypatch.setattr(F, "scaled_dot_product_attention", leaky)
    assert not doctor.check_causal(tiny_model(), random_batch()[0]).passed


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
def test_real_tying_survives_a_move(move):
    assert doctor.check_tied(tiny_model().to(move)).passed


@pytest.mark.parametrize("move", MOVES)
def test_tying_that_comes_apart_after_a_move_is_caught(move):
    torch.manual_seed(0)
    model = DataTiedGPT(tiny_model().config)
    head, wte = model.lm_head.weight, model.transformer.wte.weight
    assert head.data_ptr() == wte.data_ptr()  # looks tied before the move...
    check = doctor.check_tied(model.to(move))
    assert not check.passed
    assert "two storages" in check.measured  # ...and is two matrices after it


# ----------------------------------------------------------------------------- whole runs
def final_weights(out_dir: str) -> dict[str, torch.Tensor]:
    return load_checkpoint(Path(out_dir) / "last.pt")["model"]


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def straight_and_resumed(tiny_cfg, tmp_path: Path, patch_resume=None) -> tuple[dict, dict]:
    """Final weights of 8 steps in one go, and of 4 steps then a resume to 8 (patched if asked)."""
    common = dict(max_iters=8, eval_interval=4, dropout=0.1, compile="off")
    straight = tiny_cfg(out_dir=str(tmp_path / "straight"), **common)
    train.train(straight)
    split = dict(common, out_dir=str(tmp_path / "split"))
    train.train(tiny_cfg(**dict(split, max_iters=4)))
    if patch_resume:
        patch_resume()
    train.train(tiny_cfg(**split, resume=True))
    return final_weights(straight.out_dir), final_weights(split["out_dir"])


def test_resume_is_exact(tiny_cfg, tmp_path):
    assert same_weights(*straight_and_resumed(tiny_cfg, tmp_path))


RESUME_MUTANTS = {
    "no optimizer state": lambda mp: mp.setattr(torch.optim.AdamW, "load_state_dict", lambda self, state: None),
    "no RNG state": lambda mp: mp.setattr(checkpoint, "restore_rng", lambda rng, data_gen: None),
    "data order only": lambda mp: mp.setattr(checkpoint, "restore_rng",
                                             lambda rng, data_gen: data_gen.set_state(rng["data"])),
}


@pytest.mark.parametrize("mutant", RESUME_MUTANTS)
def test_resume_without_optimizer_or_rng_state_is_caught(monkeypatch, tiny_cfg, tmp_path, mutant):
    weights = straight_and_resumed(tiny_cfg, tmp_path, lambda: RESUME_MUTANTS[mutant](monkeypatch))
    assert not same_weights(*weights)


def weights_with_eval_every(tiny_cfg, tmp_path: Path, eval_interval: int) -> dict[str, torch.Tensor]:
    cfg = tiny_cfg(out_dir=str(tmp_path / f"eval-every-{eval_interval}"), max_iters=6,
                   eval_interval=eval_interval, dropout=0.1, compile="off")
    train.train(cfg)
    return final_weights(cfg.out_dir)


def test_evaluation_does_not_change_training(tiny_cfg, tmp_path):
    # Dropout reads the global RNG, so an eval that drew from it would change the later steps.
    assert same_weights(weights_with_eval_every(tiny_cfg, tmp_path, 1),
                        weights_with_eval_every(tiny_cfg, tmp_path, 6))


REAL_EVALUATE = train.evaluate


def evaluate_on_random_windows(model, x_val, y_val, batch_size, device, dtype, *args):
    """The bug: evaluation samples its windows from the global RNG that training also uses."""
    pick = torch.randint(len(x_val), (batch_size,))
    return REAL_EVALUATE(model, x_val[pick], y_val[pick], batch_size, device, dtype, *args)


EVAL_RNG_MUTANTS = {
    "random eval windows": lambda mp: mp.setattr(train, "evaluate", evaluate_on_random_windows),
    "dropout on in eval": lambda mp: mp.setattr(nn.Module, "eval", lambda self: self),
}


@pytest.mark.parametrize("mutant", EVAL_RNG_MUTANTS)
def test_evaluation_consuming_the_training_rng_is_caught(monkeypatch, tiny_cfg, tmp_path, mutant):
    EVAL_RNG_MUTANTS[mutant](monkeypatch)
    assert not same_weights(weights_with_eval_every(tiny_cfg, tmp_path, 1),
                            weights_with_eval_every(tiny_cfg, tmp_path, 6))
