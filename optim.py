"""Muon for the blocks' weight matrices and AdamW for the rest, stepped as one optimizer.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; Liu et al. 2025, "Muon is
Scalable for LLM Training") replaces the update of a 2-D hidden weight by the semi-orthogonal matrix
nearest its momentum (five Newton-Schulz iterations): every direction of the matrix moves at the
same rate, instead of a few dominant ones. It is meant for hidden matrices only; the embedding (tied
to the output head), the position table and the norm gains stay on AdamW. On the `small` preset it
reaches in 2600 steps the val loss AdamW reaches in 5200 (README, "Time to quality").

torch.optim.Muon and torch.optim.AdamW do the maths; this class only lets train.py drive them as one:
one step(), one zero_grad(), one state_dict(), and param_groups whose "lr" the schedule sets (each
group's peak is its "lr_scale" times learning_rate). GradScaler (fp16) needs only those members.
"""
from __future__ import annotations

from typing import Any

import torch


class MuonWithAdamW:
    """Two torch optimizers behind the members of torch.optim.Optimizer that this repo uses."""

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Muon):
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
