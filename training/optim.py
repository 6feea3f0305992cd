"""How the weights move: the optimizers and the lr schedules, each one entry of a table.

An entry is a builder (an optimizer) or a curve (an lr schedule), declared with the options it brings:
each ``Option`` (default, help, check) becomes a TrainConfig field, a flag and a checkpoint key. Which
config fields an entry reads is never declared: config records it, by building the optimizer and drawing
the curve through a config that notes every field read (config.choice_reads), so a warning that a field
is unused, the start-up line and the resume warnings follow the code as it is. The names the config
accepts for ``optimizer`` and ``lr_decay`` are these tables' keys, so a name without a builder cannot be
given. docs/experiments.md, "Adding a training option", walks through adding one.

An lr schedule owns its whole curve, as a function of the step. Two decorators declare one:
``@lr_decay`` gives a shape of the decay's progress (0 -> 1) the standard curve around it (warmup, the
clock, min_lr after the end: ``shaped_curve``), which either clock can drive; ``@lr_schedule`` gives a
function of the step that is the whole curve itself, which schedule=time cannot drive.

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

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only
    from model import GPT

# What an entry is given: a config.TrainConfig (or, while config records what it reads, a stand-in for one).
# Not imported: config is assembled from these tables, so it sits above this module (tests/test_layers.py).
Config = Any

CLOCKS = ("steps", "time")  # the values of TrainConfig.schedule: what measures a progress decay's progress


@dataclass(frozen=True)
class Option:
    """A config field that one table entry brings: becomes TrainConfig.<name>, a flag and a checkpoint key."""
    default: Any
    help: str
    valid: Callable[[Any], bool] = lambda value: True
    must: str = ""  # what ``valid`` requires, for the error: "be > 0"
    resume: str = "warned"  # how a resume treats a change (config's rules: fixed, warned, free)


def first_line(function: Callable) -> str:
    """What an entry is, for --help: its function's docstring's first line."""
    return (function.__doc__ or "").strip().split("\n")[0]


@dataclass(frozen=True)
class OptimizerEntry:
    build: Callable[[GPT, Config, torch.device, torch.dtype], torch.optim.Optimizer]
    options: dict[str, Option]  # fields of its own

    @property
    def doc(self) -> str:
        return first_line(self.build)


@dataclass(frozen=True)
class ScheduleEntry:
    lr: Callable[[int, Config, float], float]  # (step, config, seconds into the run) -> the lr: the whole curve
    options: dict[str, Option]  # fields of its own
    clocks: tuple[str, ...]  # the schedule values (CLOCKS) that can drive it
    declared: Callable  # the function the decorator was given (its docstring is the entry's help)

    @property
    def doc(self) -> str:
        return first_line(self.declared)


OPTIMIZERS: dict[str, OptimizerEntry] = {}
DECAYS: dict[str, ScheduleEntry] = {}  # TrainConfig.lr_decay names one: a progress decay or a step schedule


def own_options(decorator: str, name: str, options: dict[str, Any]) -> dict[str, Option]:
    """An entry's keyword arguments, each of which must be an Option (a fork written for ``uses=`` fails here)."""
    for key, option in options.items():
        if not isinstance(option, Option):
            raise TypeError(f"@{decorator}({name!r}, {key}=...): not an Option; the fields an entry reads are "
                            "recorded (config.choice_reads), never declared, so there is no uses=")
    return options


def optimizer(name: str, **options: Option):
    """Declare an optimizer: ``@optimizer("sgd", sgd_momentum=Option(0.9, "..."))`` on a builder
    (model, cfg, device, dtype) -> torch.optim.Optimizer whose every param group has an "lr_scale"."""
    def register(build):
        OPTIMIZERS[name] = OptimizerEntry(build, own_options("optimizer", name, options))
        return build
    return register


def lr_decay(name: str, **options: Option):
    """Declare a progress decay: a shape (progress 0 -> 1, cfg) -> the share of learning_rate - min_lr left,
    1 -> 0. It gets the standard curve (``shaped_curve``), which schedule=steps or schedule=time drives."""
    def register(shape):
        DECAYS[name] = ScheduleEntry(functools.partial(shaped_curve, shape), own_options("lr_decay", name, options),
                                     CLOCKS, shape)
        return shape
    return register


def lr_schedule(name: str, **options: Option):
    """Declare a step schedule: a function (step, cfg) -> lr that is the whole curve (its warmup or none, its
    floor, what it does past any end). It counts steps, so schedule=time cannot drive it (config refuses)."""
    def register(curve):
        DECAYS[name] = ScheduleEntry(lambda step, cfg, time_s: curve(step, cfg),
                                     own_options("lr_schedule", name, options), ("steps",), curve)
        return curve
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


@optimizer("adamw")
def build_adamw(model: GPT, cfg: Config, device: torch.device, dtype: torch.dtype) -> torch.optim.AdamW:
    """torch's AdamW (decoupled weight decay, Loshchilov & Hutter 2019), fused where it can be."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied wte/lm_head weight once
    return torch.optim.AdamW(adamw_groups(params, cfg.weight_decay), lr=cfg.learning_rate,
                             betas=(cfg.beta1, cfg.beta2), fused=fused_here(device))


@optimizer("muon", muon_lr=Option(0.02, "the Muon matrices' peak lr; their lr follows learning_rate's schedule "
                                        "times muon_lr / learning_rate",
                                  valid=lambda v: math.isfinite(v) and v > 0, must="be > 0"))
def build_muon(model: GPT, cfg: Config, device: torch.device, dtype: torch.dtype) -> MuonAdamW:
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


def build_optimizer(model: GPT, cfg: Config, device: torch.device,
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


# ----------------------------------------------------------------------------- lr schedules
def shaped_curve(shape: Callable[[float, Config], float], step: int, cfg: Config, time_s: float) -> float:
    """A progress decay's curve: linear warmup to learning_rate over warmup_iters steps, then ``shape`` from
    the peak down to min_lr as the decay's progress goes 0 -> 1, and min_lr once it is 1.

    The clock measures the progress. schedule=steps: it reaches 1 at lr_decay_iters (min_lr from there
    on, where every shape has arrived already: shape(1) = 0); a pure function of the step, so a resumed
    run follows exactly the same schedule. schedule=time: it reaches 1 when ``time_s`` (the run's wall
    clock) reaches max_time, so a slow machine ends its budget as annealed as a fast one, after fewer
    steps (Geiping & Goldstein 2022, "Cramming", tie the schedule to the time budget the same way); or at
    max_iters, if the steps run out first.
    """
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / cfg.warmup_iters
    if cfg.schedule == "time":  # whichever budget runs out first ends the decay
        by_steps = (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
        progress = min(1.0, max(time_s / cfg.max_time, by_steps))
    elif step >= cfg.lr_decay_iters:
        return cfg.min_lr
    else:
        progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)  # 0 -> 1
    return cfg.min_lr + shape(progress, cfg) * (cfg.learning_rate - cfg.min_lr)


@lr_decay("cosine")
def cosine(progress: float, cfg: Config) -> float:
    """Half a cosine from the peak down to min_lr.

    Loshchilov & Hutter 2017 (SGDR), without restarts: GPT-2's and nanoGPT's schedule."""
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@lr_decay("wsd", wsd_fraction=Option(0.2, "lr_decay=wsd: the final share of the decay's span spent going "
                                          "linearly down to min_lr (flat at the peak before it)",
                                     valid=lambda v: 0 < v <= 1, must="be in (0, 1]", resume="fixed"))
def warmup_stable_decay(progress: float, cfg: Config) -> float:
    """Flat at the peak, then linear down to min_lr over the last wsd_fraction (warmup-stable-decay).

    Hu et al. 2024 (MiniCPM, arXiv:2404.06395) introduced it; Hägele et al. 2024 (arXiv:2405.18392) find a
    linear cooldown over the last ~20% matches cosine, and that the stable phase can be extended."""
    return min(1.0, (1.0 - progress) / cfg.wsd_fraction)
