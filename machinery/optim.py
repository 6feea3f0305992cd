"""How the weights move: the optimizers and the shapes of the lr decay, each one entry of a table.

An entry is a builder (or a function of progress) declared together with the config fields it reads:
``uses`` names fields TrainConfig already has (shared by several entries), ``options`` declares new
ones (an ``Option``: default, help, check), which config.TrainConfig adopts as flags. The names the
config accepts for ``optimizer`` and ``lr_decay`` are these tables' keys, so a name without a builder
cannot be given, and a field that only other entries read is reported as unused (config.unused_fields).
docs/experiments.md, "Adding a training option", walks through adding one.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; Liu et al. 2025, "Muon is
Scalable for LLM Training") replaces the update of a 2-D hidden weight by the semi-orthogonal matrix
nearest its momentum (five Newton-Schulz iterations): every direction of the matrix moves at the
same rate, instead of a few dominant ones. It is meant for hidden matrices only; the embedding (tied
to the output head), the position table and the norm gains stay on AdamW. On the `small` preset it
reaches in 2600 steps the val loss AdamW reaches in 5200 (docs/performance.md, "Time to quality").
torch.optim.Muon does the maths, with one change (``Muon`` below): the Newton-Schulz iteration runs in
the precision the run computes in. torch's runs it in bf16 always, which is fast on GPUs and on CPUs
with AVX512-BF16 or AMX, but is emulated elsewhere: on a 2-core AMD EPYC without AVX-512 a bf16 matmul
ran at 1 GFLOP/s against 98 in fp32, and the `small` preset's step took 1.1 s instead of ~0.1 s.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only: config imports this module
    from config import TrainConfig
    from model import GPT


@dataclass(frozen=True)
class Option:
    """A config field that one table entry brings: becomes TrainConfig.<name>, a flag and a checkpoint key."""
    default: Any
    help: str
    valid: Callable[[Any], bool] = lambda value: True
    must: str = ""  # what ``valid`` requires, for the error: "be > 0"
    resume: str = "warned"  # how a resume treats a change (config's rules: fixed, warned, free)


@dataclass(frozen=True)
class OptimizerEntry:
    build: Callable[[GPT, TrainConfig, torch.device, torch.dtype], torch.optim.Optimizer]
    uses: tuple[str, ...]  # existing TrainConfig fields it reads, beside learning_rate
    options: dict[str, Option]  # fields of its own


@dataclass(frozen=True)
class DecayEntry:
    shape: Callable[[float, TrainConfig], float]  # progress in [0, 1] -> share of (peak - min_lr) left, 1 -> 0
    uses: tuple[str, ...]
    options: dict[str, Option] = field(default_factory=dict)


OPTIMIZERS: dict[str, OptimizerEntry] = {}
DECAYS: dict[str, DecayEntry] = {}


def optimizer(name: str, uses: tuple[str, ...] = (), **options: Option):
    """Declare an optimizer: ``@optimizer("sgd", uses=("weight_decay",), momentum=Option(0.9, "..."))``."""
    def register(build):
        OPTIMIZERS[name] = OptimizerEntry(build, uses, options)
        return build
    return register


def lr_decay(name: str, uses: tuple[str, ...] = (), **options: Option):
    """Declare a shape of the lr decay after warmup: a function of progress (0 -> 1) and the config."""
    def register(shape):
        DECAYS[name] = DecayEntry(shape, uses, options)
        return shape
    return register


# ----------------------------------------------------------------------------- optimizers
def fused_here(device: torch.device) -> bool:
    """Fused AdamW kernels exist for CPU and CUDA (torch >= 2.4); they also skip a step on the device."""
    return device.type in ("cuda", "cpu")


def adamw_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Decay on matrices and embeddings (dim >= 2) only, never on gains and biases. Every group carries
    "lr_scale", its peak lr over learning_rate, which the schedule multiplies (train.set_lr)."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay, "lr_scale": 1.0},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr_scale": 1.0}]


@optimizer("adamw", uses=("weight_decay", "beta1", "beta2"))
def build_adamw(model: GPT, cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> torch.optim.AdamW:
    """torch's AdamW (decoupled weight decay, Loshchilov & Hutter 2019), fused where it can be."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied wte/lm_head weight once
    return torch.optim.AdamW(adamw_groups(params, cfg.weight_decay), lr=cfg.learning_rate,
                             betas=(cfg.beta1, cfg.beta2), fused=fused_here(device))


@optimizer("muon", uses=("weight_decay", "beta1", "beta2"),
           muon_lr=Option(0.02, "the Muon matrices' peak lr; their lr follows learning_rate's schedule times "
                                "muon_lr / learning_rate", valid=lambda v: math.isfinite(v) and v > 0, must="be > 0"))
def build_muon(model: GPT, cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> MuonAdamW:
    """Muon for the blocks' weight matrices, AdamW (learning_rate) for the rest, as one optimizer.

    The Newton-Schulz iteration runs in bf16 only where the run's matmuls do (``dtype``, which
    pick_dtype chose by measurement on a CPU): elsewhere bf16 is emulated and ~100x slower than fp32.
    """
    hidden = model.hidden_matrices()
    on_muon = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in on_muon]
    adamw = torch.optim.AdamW(adamw_groups(rest, cfg.weight_decay), lr=cfg.learning_rate,
                              betas=(cfg.beta1, cfg.beta2), fused=fused_here(device))
    muon = Muon([{"params": hidden, "lr_scale": cfg.muon_lr / cfg.learning_rate}],
                ns_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32,
                lr=cfg.muon_lr, weight_decay=cfg.weight_decay, momentum=0.95)
    return MuonAdamW(adamw, muon)


def build_optimizer(model: GPT, cfg: TrainConfig, device: torch.device,
                    dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """The optimizer the config names, from the table (config refuses a name it does not hold)."""
    return OPTIMIZERS[cfg.optimizer].build(model, cfg, device, dtype)


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
    """torch.optim.Muon whose Newton-Schulz iteration runs in ``ns_dtype``, and which skips its update on
    the device when ``found_inf`` (a 0-dim tensor, set by faults.NonFiniteGuard) is 1, as fused AdamW does.
    State and param groups are torch's, so checkpoints are unchanged."""

    skips_on_found_inf = True  # faults.skips_on_device: step() honours found_inf

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
        skip = getattr(self, "found_inf", None)  # None: no guard, step as usual
        for group in self.param_groups:
            lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                new_buf = buf.lerp(p.grad, 1 - momentum)  # an EMA of the gradients
                update = p.grad.lerp(new_buf, momentum) if group["nesterov"] else new_buf
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       self.ns_dtype)
                new_p = p.mul(1 - lr * decay)  # decoupled weight decay
                # torch's "original" lr adjustment: tall matrices move by sqrt(rows / cols) more.
                new_p.add_(update, alpha=-lr * math.sqrt(max(1, p.size(0) / p.size(1))))
                keep = None if skip is None else skip.bool()  # a device tensor: no host read
                buf.copy_(new_buf if keep is None else torch.where(keep, buf, new_buf))
                p.copy_(new_p if keep is None else torch.where(keep, p, new_p))
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped as one torch Optimizer: param groups tagged "kind" ("adamw" or "muon"), one
    state, one state_dict. Each kind's maths is its torch optimizer's, which share this object's groups and
    state; ``found_inf`` (faults.NonFiniteGuard) reaches both, so a non-finite step is skipped on the device."""

    def __init__(self, adamw: torch.optim.AdamW, muon: Muon):
        self.adamw, self.muon = adamw, muon
        for part, kind in ((adamw, "adamw"), (muon, "muon")):
            for group in part.param_groups:
                group["kind"] = kind
        super().__init__(adamw.param_groups + muon.param_groups, {"fused": adamw.defaults.get("fused")})
        self.share()

    @property
    def skips_on_found_inf(self) -> bool:
        """faults.skips_on_device: both parts honour found_inf when the AdamW part is fused (on MPS it is not)."""
        return bool(getattr(self.adamw, "_step_supports_amp_scaling", False))

    def share(self) -> None:
        """Point both parts at this optimizer's groups and state (load_state_dict replaces them)."""
        self.adamw.param_groups = [g for g in self.param_groups if g["kind"] == "adamw"]
        self.muon.param_groups = [g for g in self.param_groups if g["kind"] == "muon"]
        self.adamw.state = self.muon.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        for part in (self.adamw, self.muon):
            part.found_inf = found_inf
            try:
                part.step()
            finally:
                del part.found_inf
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Also reads the two-part {"adamw": ..., "muon": ...} state that checkpoints before MuonAdamW hold."""
        if set(state_dict) == {"adamw", "muon"}:
            state_dict = merge_pair_state(state_dict["adamw"], state_dict["muon"])
        if not all("kind" in group for group in state_dict["param_groups"]):
            raise ValueError("this optimizer state is not from a Muon + AdamW run (optimizer=muon)")
        super().load_state_dict(state_dict)
        self.share()


def merge_pair_state(adamw: dict[str, Any], muon: dict[str, Any]) -> dict[str, Any]:
    """An old two-optimizer state as one Optimizer state: AdamW's params first, then Muon's, as MuonAdamW orders them."""
    offset = sum(len(group["params"]) for group in adamw["param_groups"])
    groups = [{**g, "kind": "adamw"} for g in adamw["param_groups"]]
    groups += [{**g, "kind": "muon", "params": [i + offset for i in g["params"]]} for g in muon["param_groups"]]
    state = {**adamw["state"], **{i + offset: s for i, s in muon["state"].items()}}
    return {"state": state, "param_groups": groups}


# ----------------------------------------------------------------------------- lr decay shapes
@lr_decay("cosine")
def cosine(progress: float, cfg: TrainConfig) -> float:
    """Half a cosine from the peak down to min_lr.

    Loshchilov & Hutter 2017 (SGDR), without restarts: GPT-2's and nanoGPT's schedule."""
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@lr_decay("wsd", wsd_fraction=Option(0.2, "lr_decay=wsd: the final share of the decay's span spent going "
                                          "linearly down to min_lr (flat at the peak before it)",
                                     valid=lambda v: 0 < v <= 1, must="be in (0, 1]", resume="fixed"))
def warmup_stable_decay(progress: float, cfg: TrainConfig) -> float:
    """Flat at the peak, then linear down to min_lr over the last wsd_fraction (warmup-stable-decay).

    Hu et al. 2024 (MiniCPM, arXiv:2404.06395) introduced it; Hägele et al. 2024 (arXiv:2405.18392) find a
    linear cooldown over the last ~20% matches cosine, and that the stable phase can be extended."""
    return min(1.0, (1.0 - progress) / cfg.wsd_fraction)
