"""Muon for the blocks' weight matrices and AdamW for the rest, stepped as one optimizer.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; Liu et al. 2025, "Muon is
Scalable for LLM Training") replaces the update of a 2-D hidden weight by the semi-orthogonal matrix
nearest its momentum (five Newton-Schulz iterations): every direction of the matrix moves at the
same rate, instead of a few dominant ones. It is meant for hidden matrices only; the embedding (tied
to the output head), the position table and the norm gains stay on AdamW. On the `small` preset it
reaches in 2600 steps the val loss AdamW reaches in 5200 (docs/performance.md, "Time to quality").

torch.optim.AdamW and torch.optim.Muon do the maths, with one change to Muon (``Muon`` below): the
Newton-Schulz iteration runs in the precision the run computes in. torch's runs it in bf16 always,
which is fast on GPUs and on CPUs with AVX512-BF16 or AMX, but is emulated elsewhere: on a 2-core AMD
EPYC without AVX-512 a bf16 matmul ran at 1 GFLOP/s against 98 in fp32, and the `small` preset's step
took 1.1 s instead of ~0.1 s. MuonWithAdamW only lets train.py drive the two as one: one step(), one
zero_grad(), one state_dict(), and param_groups whose "lr" the schedule sets (each group's peak is
its "lr_scale" times learning_rate). GradScaler (fp16) needs only those members.
"""
from __future__ import annotations

import math
from typing import Any

import torch


def orthogonalize(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The semi-orthogonal matrix nearest ``update`` (R, C), by ``steps`` quintic Newton-Schulz iterations.

    X <- a X + (b A + c A^2) X with A = X X^T, on the wide orientation (fewer rows) so A is the small
    Gram matrix; the coefficients push every singular value towards ~1 in five steps (Jordan et al.).
    The same operations as torch.optim.Muon's, in ``dtype`` instead of always bf16.
    """
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T  # (C, R)
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T  # (rows, rows)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return x.T if tall else x  # (R, C)


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz iteration runs in ``ns_dtype`` (train.py: bf16 only where the
    run computes in bf16, else fp32). State and param groups are torch's, so checkpoints are unchanged."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.float32, **kwargs: Any):
        if kwargs.get("adjust_lr_fn") not in (None, "original"):  # step() implements torch's default only
            raise ValueError(f"adjust_lr_fn {kwargs['adjust_lr_fn']!r} is not supported here; use the default")
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - momentum)  # an EMA of the gradients
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       self.ns_dtype)
                p.mul_(1 - lr * decay)  # decoupled weight decay
                # torch's "original" lr adjustment: tall matrices move by sqrt(rows / cols) more.
                p.add_(update, alpha=-lr * math.sqrt(max(1, p.size(0) / p.size(1))))
        return loss


class MuonWithAdamW:
    """Two torch optimizers behind the members of torch.optim.Optimizer that this repo uses."""

    def __init__(self, adamw: torch.optim.AdamW, muon: Muon):
        # Muon has no found_inf hook (fused AdamW's way to skip a step on the device), so NonFiniteGuard
        # reads its flag on the host every step for this class: free on a CPU, one sync a step on a GPU.
        self.adamw, self.muon = adamw, muon

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.adamw.param_groups + self.muon.param_groups

    def step(self) -> None:
        self.adamw.step()
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none)
        self.muon.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"adamw", "muon"}:
            raise ValueError("this optimizer state is not from a Muon + AdamW run (optimizer=muon)")
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])
