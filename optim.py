"""How the weights move: the optimizers and the lr decays, each a row of a table of functions.

``OPTIMIZERS`` maps a name to a builder (model, cfg, device, dtype) -> torch.optim.Optimizer; ``DECAYS`` maps a name to
a shape: the share of learning_rate - min_lr left as the decay's progress goes 0 -> 1, around which ``lr_at`` draws the
standard curve (warmup, the clock, min_lr at the end). The names config accepts are these keys (its Literals;
tests/test_training_options.py checks they match: a name without its row fails there). Which fields some choices read is
config.USED_ONLY_UNDER, checked by perturbing every field. docs/experiments.md, "Adding a training option", walks
through adding a row. ``NonFiniteGuard`` watches every step for a non-finite loss or gradient.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; Liu et al. 2025, "Muon is Scalable for LLM
Training") replaces the update of a 2-D hidden weight by the semi-orthogonal matrix nearest its momentum (five
Newton-Schulz iterations): every direction of the matrix moves at the same rate, instead of a few dominant ones. The
embedding (tied to the output head), the position table and the norm gains stay on AdamW (PARAMETER_KINDS).
torch.optim.Muon does the maths, with one change (``Muon`` below): the Newton-Schulz iteration runs in the run's
precision, not always in bf16, which is emulated on CPUs without AVX512-BF16 or AMX: on a 2-core AMD EPYC without
AVX-512 a bf16 matmul ran at 1 GFLOP/s against 98 in fp32 (`python -m scripts.bench --matmul`)."""
import fnmatch
import math
from typing import Any

import torch

from cli import EXIT_NONFINITE, CheckpointError, ConfigError, RunStopped
from config import TrainConfig
from model import GPT

# ----------------------------------------------------------------------------- which parameter trains how
# Every trained parameter's kind, by its name (fnmatch patterns; the first that matches wins). A "matrix" multiplies
# the activations inside a block: Muon's under optimizer=muon, else AdamW's with weight decay. A "table" is looked
# up (the token embedding, tied to the head; the position table): AdamW with weight decay. A "gain" scales or shifts
# (norms, biases): AdamW without decay. A parameter no row names stops the optimizer's build in one line, so a fork's
# new tensor gets the kind its author chose: a learned bias table is not a matrix for Muon, whatever its shape.
PARAMETER_KINDS = (
    ("*.bias", "gain"),
    ("*.ln_?.weight", "gain"),  # ln_1, ln_2, ln_f
    ("*_norm.weight", "gain"),  # qk_norm's q_norm and k_norm
    ("transformer.h.*.c_attn.weight", "matrix"),
    ("transformer.h.*.c_proj.weight", "matrix"),
    ("transformer.h.*.c_fc.weight", "matrix"),
    ("transformer.h.*.lora_?.weight", "matrix"),  # LoRA's A and B (finetune.py)
    ("transformer.wte.weight", "table"),
    ("transformer.wpe.weight", "table"),
    ("transformer.wte.lora_rows", "table"),  # a chat fine-tune's trained marker rows (finetune.TrainedRows)
)


def trained_parameters(model: GPT) -> list[tuple[str, torch.nn.Parameter]]:
    """(kind, parameter) for every parameter that trains, in the model's order (the tied wte/lm_head once)."""
    trained = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            kind = next((kind for pattern, kind in PARAMETER_KINDS if fnmatch.fnmatchcase(name, pattern)), None)
            if kind is None or kind == "matrix" and p.dim() != 2:
                raise ConfigError(f"no row of optim.PARAMETER_KINDS names the parameter {name} {tuple(p.shape)}"
                                  f"{' as a 2-D matrix' if kind else ''}: add one saying whether it is a \"matrix\" "
                                  "(2-D; Muon's under --optimizer muon), a \"table\" (AdamW, weight decay) or a "
                                  "\"gain\" (AdamW, no decay)")
            trained.append((kind, p))
    return trained


# ----------------------------------------------------------------------------- optimizers
def adamw_groups(trained: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Two groups of trained_parameters' pairs: matrices and tables decayed, gains not. Every group carries
    "lr_scale", its peak lr over learning_rate, which the schedule multiplies (train.set_lr)."""
    return [{"params": [p for kind, p in trained if kind != "gain"], "weight_decay": weight_decay, "lr_scale": 1.0},
            {"params": [p for kind, p in trained if kind == "gain"], "weight_decay": 0.0, "lr_scale": 1.0}]


def adamw(trained: list[tuple[str, torch.nn.Parameter]], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """torch's AdamW (decoupled weight decay, Loshchilov & Hutter 2019), fused (CPU and CUDA kernels, torch >= 2.4)."""
    return torch.optim.AdamW(adamw_groups(trained, cfg.weight_decay), lr=cfg.learning_rate,
                             betas=(cfg.beta1, cfg.beta2), fused=device.type in ("cuda", "cpu"))


def build_adamw(model: GPT, cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> torch.optim.AdamW:
    return adamw(trained_parameters(model), cfg, device)


def build_muon(model: GPT, cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> "MuonAdamW":
    """Muon for the matrices, AdamW (learning_rate) for the tables and gains, as one optimizer.

    The Newton-Schulz iteration runs in bf16 only where the run's matmuls do (``dtype``, which
    pick_dtype chose by measurement on a CPU): elsewhere bf16 is emulated and ~100x slower than fp32."""
    trained = trained_parameters(model)
    matrices = [p for kind, p in trained if kind == "matrix"]
    muon = Muon([{"params": matrices, "lr_scale": cfg.muon_lr / cfg.learning_rate}],
                ns_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32,
                lr=cfg.muon_lr, weight_decay=cfg.weight_decay, momentum=0.95)
    return MuonAdamW(adamw([(kind, p) for kind, p in trained if kind != "matrix"], cfg, device), muon)


OPTIMIZERS = {"adamw": build_adamw, "muon": build_muon}  # config.TrainConfig.optimizer's values


def build_optimizer(model: GPT, cfg: TrainConfig, device: torch.device,
                    dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """The optimizer the config names, from the table (config refuses a name it does not hold)."""
    return OPTIMIZERS[cfg.optimizer](model, cfg, device, dtype)


def orthogonalize(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The semi-orthogonal matrix nearest each of ``update``'s (n, R, C): n same-shaped matrices, one batch of
    ``steps`` quintic Newton-Schulz iterations.

    X <- a X + (b A + c A^2) X with A = X X^T, on the wide orientation (fewer rows) so A is the small
    Gram matrix; the coefficients push every singular value towards ~1 in five steps (Jordan et al.).
    torch.optim.Muon's operations on each matrix, in ``dtype`` instead of always bf16, batched: one bmm for every
    matrix of a shape instead of one mm each, which gives the same bits (tests/test_optim.py) in fewer, larger calls."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT  # (n, C, R)
    norms = torch.stack(torch._foreach_norm(list(x.unbind(0))))  # (n,): each matrix's, as torch's x.norm()
    x = x / norms.clamp(min=eps)[:, None, None]  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.mT  # (n, rows, rows)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return x.mT if tall else x  # (n, R, C)


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz iteration runs in ``ns_dtype``, in bf16 batched over same-shaped matrices
    (a model's layers). State and param groups are torch's, so checkpoints are unchanged."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.float32, **kwargs: Any):
        if kwargs.get("adjust_lr_fn") not in (None, "original"):  # step() implements torch's default only
            raise ValueError(f"adjust_lr_fn {kwargs['adjust_lr_fn']!r} is not supported here; use the default")
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):  # torch's signature; MuonAdamW.step, its one caller, passes no closure
        for group in self.param_groups:
            lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad)) for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)  # an EMA of the gradients
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            torch._foreach_mul_(params, 1 - lr * decay)  # decoupled weight decay
            # Batched where the iteration runs in bf16 (1.04-1.06x the step on an AVX512-BF16 CPU); in fp32 one at a
            # time, as batches of one: MKL's fp32 bmm of these shapes made the step 8% slower on an AVX2 CPU.
            batches: dict[torch.Size | int, list[int]] = {}  # indices of params, in order of first appearance
            for i, p in enumerate(params):
                batches.setdefault(p.shape if self.ns_dtype == torch.bfloat16 else i, []).append(i)
            for members in batches.values():
                rows, cols = params[members[0]].shape
                ortho = orthogonalize(torch.stack([updates[i] for i in members]), group["ns_coefficients"],
                                      group["ns_steps"], group["eps"], self.ns_dtype)  # (n, rows, cols)
                # torch's "original" lr adjustment: tall matrices move by sqrt(rows / cols) more.
                torch._foreach_add_([params[i] for i in members], ortho.unbind(0),
                                    alpha=-lr * math.sqrt(max(1, rows / cols)))


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped as one torch Optimizer: param groups tagged "kind" ("adamw" or "muon"), one state, one
    state_dict. Each kind's maths is its torch optimizer's, which share this object's groups and state."""

    def __init__(self, adamw: torch.optim.AdamW, muon: Muon):
        self.adamw, self.muon = adamw, muon
        for part, kind in ((adamw, "adamw"), (muon, "muon")):
            for group in part.param_groups:
                group["kind"] = kind
        super().__init__(adamw.param_groups + muon.param_groups, {"fused": adamw.defaults.get("fused")})
        self.share()

    def share(self) -> None:
        """Point both parts at this optimizer's groups and state (load_state_dict replaces them)."""
        self.adamw.param_groups = [g for g in self.param_groups if g["kind"] == "adamw"]
        self.muon.param_groups = [g for g in self.param_groups if g["kind"] == "muon"]
        self.adamw.state = self.muon.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        self.adamw.step()
        self.muon.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """One state of tagged param groups, as this class saves it; refuses any other in one line."""
        if not all("kind" in group for group in state_dict.get("param_groups", [{}])):
            raise CheckpointError("the checkpoint's optimizer state is not one Muon + AdamW state (one saved before "
                                  "they were one optimizer holds two): start a new run in another --out_dir")
        super().load_state_dict(state_dict)
        self.share()


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore the moments, not the saved groups' settings: a resume with a new --muon_lr must run with it."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, mine in zip(optimizer.param_groups, settings):
        group.update(mine)


# ----------------------------------------------------------------------------- lr schedules
def lr_at(step: int, cfg: TrainConfig, time_s: float = 0.0) -> float:
    """The lr of ``step``, ``time_s`` s into the run: linear warmup to learning_rate over warmup_iters steps,
    then DECAYS[lr_decay] from the peak down to min_lr as the progress goes 0 -> 1, and min_lr once it is 1.

    The clock measures the progress. schedule=steps: it reaches 1 at lr_decay_iters (min_lr from there on, where every
    shape has arrived already: shape(1) = 0); a pure function of the step, so a resumed run follows exactly the same
    schedule. schedule=time: it reaches 1 when ``time_s`` (the run's wall clock) reaches max_time, so a slow machine
    ends its budget as annealed as a fast one, after fewer steps (Geiping & Goldstein 2022, "Cramming", tie the schedule
    to the time budget the same way); or at max_iters, if the steps run out first."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / cfg.warmup_iters
    if cfg.schedule == "time":  # whichever budget runs out first ends the decay
        by_steps = (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
        progress = min(1.0, max(time_s / cfg.max_time, by_steps))
    elif step >= cfg.lr_decay_iters:
        return cfg.min_lr
    else:
        progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)  # 0 -> 1
    return cfg.min_lr + DECAYS[cfg.lr_decay](progress, cfg) * (cfg.learning_rate - cfg.min_lr)


def cosine(progress: float, cfg: TrainConfig) -> float:
    """Half a cosine from the peak down to min_lr.

    Loshchilov & Hutter 2017 (SGDR), without restarts: GPT-2's and nanoGPT's schedule."""
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_stable_decay(progress: float, cfg: TrainConfig) -> float:
    """Flat at the peak, then linear down to min_lr over the last wsd_fraction (warmup-stable-decay).

    Hu et al. 2024 (MiniCPM, arXiv:2404.06395) introduced it; Hägele et al. 2024 (arXiv:2405.18392) find a
    linear cooldown over the last ~20% matches cosine, and that the stable phase can be extended."""
    return min(1.0, (1.0 - progress) / cfg.wsd_fraction)


DECAYS = {"cosine": cosine, "wsd": warmup_stable_decay}  # config.TrainConfig.lr_decay's values
# Those that rise again on purpose after warmup (warm restarts, as SGDR's): tests/test_training_options.py checks
# every other one never rises, and these only at their restarts.
WARM_RESTARTS: frozenset[str] = frozenset()


# ----------------------------------------------------------------------------- the guard on every step
class NonFiniteGuard:
    """Stops a run at its first non-finite step without a host sync per step; nothing non-finite is ever saved.

    ``check`` records on the device the first step whose loss or gradient norm is not finite (two isfinite ops);
    the host reads it only where the loop syncs anyway (log lines, evals, saves: ``raise_if_tripped``) and stops
    the run there, naming the step. The steps in between (at most log_interval - 1) run on, so the weights in
    memory may hold NaN when the run stops; a save checks first, so last.pt and best.pt hold the last finite
    state. A sync per step would stall the host's run-ahead on CUDA (the next step's data and kernel launches).

    fp16: GradScaler skips a step whose gradients overflow and halves its scale (its normal way of finding the
    scale); the guard counts consecutive skips and stops the run once ``max_skipped`` are reached: a scale
    fallen by 2**max_skipped means the model diverged."""

    def __init__(self, scaler: torch.amp.GradScaler, max_skipped: int, device: torch.device):
        self.scaler, self.max_skipped = scaler, max_skipped
        self.bad_step = torch.full((), -1, dtype=torch.long, device=device)  # first faulty step; -1 = none
        self.skipped = torch.zeros((), dtype=torch.long, device=device)  # fp16: consecutive skips so far

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Record on the device whether ``step`` (numbered as in the log) is faulty: no host sync."""
        if self.scaler.is_enabled():  # fp16: GradScaler decides on the (unscaled) gradients, as we do
            self.skipped = (self.skipped + 1) * ~torch.isfinite(grad_norm)  # back to 0 on a good step
            faulty = self.skipped >= self.max_skipped
        else:
            faulty = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.bad_step = torch.where((self.bad_step < 0) & faulty, step, self.bad_step)

    def raise_if_weights_not_finite(self, model: torch.nn.Module, step: int) -> None:
        """Stop before a save if any weight is not finite: an update that overflowed (a finite loss and gradient,
        times a huge lr) is the one fault check() cannot see. One host read: saves only."""
        if not torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all():
            raise RunStopped(f"the weights are not finite after step {step} (an update overflowed them); stopped "
                             "before saving, so last.pt and best.pt hold the last finite state; lower learning_rate",
                             EXIT_NONFINITE)

    def raise_if_tripped(self) -> None:
        """Stop the run if a fault was recorded. Reads one device scalar: call it where the loop syncs."""
        if (bad_step := int(self.bad_step)) < 0:
            return
        if self.scaler.is_enabled():
            raise RunStopped(f"{self.max_skipped} steps in a row skipped for non-finite fp16 gradients (the last at "
                             f"step {bad_step}); lower learning_rate or use --dtype bfloat16", EXIT_NONFINITE)
        raise RunStopped(f"non-finite loss or gradient at step {bad_step}; stopped at the next log step, before "
                         "anything non-finite was saved; lower learning_rate or check the data", EXIT_NONFINITE)
