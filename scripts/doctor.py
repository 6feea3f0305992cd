"""The doctor: the "my loss won't go down" checklist, run on your real config and data.

    python -m scripts.doctor --config small              # same config and overrides as train.py
    python -m scripts.doctor --config small --dropout 0.1
    python -m scripts.doctor --config chat_small         # a fine-tune: on its base's tokenizer and weights (init_from)

One line per check (PASS or FAIL, the measured figure, what it means; docs/doctor.md), exit 1 if any fails. Each
check takes what it needs and returns a ``Check``, so tests can call it on broken variants; they run on the run
train.py builds (train.build_run) and go through its own code paths, so a bug there shows up here.
"""
from __future__ import annotations

import sys

if not __package__:  # run as a file, `python scripts/doctor.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.doctor", file=sys.stderr)
    sys.exit(2)

import contextlib
import copy
import dataclasses
import io
import json
import math
import tempfile
import time
from collections import Counter
from itertools import groupby
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import finetune
import train
from checkpoint import load_checkpoint, start_from
from config import TinyGPTError, TrainConfig, exit_on, parse_args
from data import PackedDocuments
from model import GPT
from optim import NonFiniteGuard
from runtime import RunStopped, choose_runtime, compile_for_step, dtype_name, summary
from tokenizer import tokenizer_from_meta

# Allowed gap between the first loss and ln(vocab), as a fraction of ln(vocab). A 0.02-std init gives
# logits of variance ~0.02² · n_embd, which adds about half that: 0.03 nats for small, 0.15 for gpt2.
INIT_LOSS_TOLERANCE = 0.03
CAUSAL_TOLERANCE = 1e-5  # max |change| of a past logit when the future changes (fp32 round-off)
OVERFIT_SEQUENCES = 1  # sequences in the batch to memorise
FEW_SEQUENCES = 4  # batch for the gradient, causal and dropout checks: every position, less time
OVERFIT_STEPS = 200  # step budget for memorising it (small needs ~30, tiny ~70)
OVERFIT_THRESHOLD = 0.1  # nats; memorised means the loss fell below this
# The overfit check's lr for a random init of GPT-2 small's width (768): GPT-3's 125M model's (Brown et al.
# 2020, table 2.1) and the gpt2 preset's. It scales as 1/width (muP's rule for Adam, Yang et al. 2022),
# up to the tiny preset's 3e-3 (tiny memorises its batch at it in ~70 steps, a 32-wide GPT-2-vocab model in ~130).
RANDOM_INIT_LR, RANDOM_INIT_WIDTH, RANDOM_INIT_LR_MAX = 6e-4, 768, 3e-3
FORCED_DROPOUT = 0.1  # dropout used on a copy of the model when the config has none
SAMPLE_TOKENS = 4096  # tokens of val text for the tokenizer round trip
SHORT_RUN_STEPS = 3  # steps of the short run (lr schedule, master weights): a mis-count shows from step 2
SHORT_RUN_ACCUM = 2  # micro-batches per step in that run, so counting them instead of steps goes wrong


@dataclasses.dataclass
class Check:
    """The verdict of one check."""
    name: str
    passed: bool
    measured: str  # the figure the verdict rests on
    meaning: str  # one line: what a pass shows, or where a failure points


def verdict(name: str, passed: bool, measured: str, shows: str, points_to: str) -> Check:
    """The Check, its meaning ``shows`` (what a pass shows) or ``points_to`` (where a failure points)."""
    return Check(name, passed, measured, shows if passed else points_to)


# ----------------------------------------------------------------------------- data checks
def window_starts(data: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Every position at which ``window`` occurs in ``data``."""
    starts = np.flatnonzero(data[: len(data) - len(window) + 1] == window[0])
    for offset in range(1, len(window)):
        starts = starts[data[starts + offset] == window[offset]]  # keep the starts that still match
    return starts


def stretches_of(stream) -> Callable[[np.ndarray], list[np.ndarray]]:
    """The parts of a training row (T + 1,) read straight from the split: packed documents one per document (the
    row cut before each separator after its first token); a random window or a conversation is one."""
    if type(stream) is PackedDocuments:
        return lambda row: np.split(row, np.flatnonzero(row[1:] == stream.separator) + 1)
    return lambda row: [row]


def check_batch(x: torch.Tensor, y: torch.Tensor, data: np.ndarray, tokenizer,
                stretches: Callable[[np.ndarray], list[np.ndarray]] = lambda row: [row]) -> Check:
    """Targets are the inputs shifted left by one, and the window really occurs in the data: each of its
    ``stretches`` (the stream's: a random window is one, a row of packed documents one per document). A target of -1
    is masked (a chat's prompt and padding: the loss skips it): the shift is checked where a learned target follows a
    learned one (past a row's last, inputs may be padding), and a row up to its last learned target."""
    x, y = x.cpu(), y.cpu()
    learned = y != -1  # (B, T)
    both = learned[:, :-1] & learned[:, 1:]  # positions t whose x[:, t + 1] is surely the row's own token
    shifted = bool(both.any()) and torch.equal(x[:, 1:][both], y[:, :-1][both])  # y[:, t] must be x[:, t + 1]
    i = int(learned.any(dim=1).int().argmax())  # the first row that learns anything
    at = learned[i].nonzero().flatten().tolist() or [x.shape[1] - 1]  # the positions it learns
    row = np.append(x[i, : at[-1] + 1].numpy(), y[i, at[-1]].item())  # its tokens through its last target
    in_data = shifted and all(window_starts(data, piece).size > 0 for piece in stretches(row))
    shown = slice(at[0], at[0] + 24)  # from the first learned target: a chat's reply, not its masked prompt
    text_x = tokenizer.decode(x[i, shown].tolist())[:24]
    text_y = tokenizer.decode([t for t in y[i, shown].tolist() if t != -1])[:24]
    masked = "" if learned.all() else f"; {learned.float().mean().item():.0%} of targets learned, the rest -1 (masked)"
    meaning = ("y[t] is the token after x[t], read straight from the corpus" if in_data else
               "targets are not the inputs shifted by one: the model is taught the wrong task"
               if not shifted else "the window does not occur in the corpus: batches are garbled")
    return Check("batch", in_data, f"x {text_x!r} -> y {text_y!r}{masked}", meaning)


def check_token_range(splits: dict[str, np.ndarray], vocab_size: int) -> Check:
    """Every token id is below the model's vocab size (padded rows would hide a bad id)."""
    top = {name: int(ids.max()) for name, ids in splits.items()}
    worst = max(top, key=top.get)
    return verdict("token ids", top[worst] < vocab_size, f"max id {top[worst]} ({worst}) vs vocab {vocab_size}",
                   "every id has its own embedding row and logit",
                   "ids past the vocab hit padding rows or crash the loss: re-prepare the data with this tokenizer")


def check_round_trip(tokenizer, ids: np.ndarray) -> Check:
    """encode(decode(ids)) gives back the same ids, so what the model learns is what it will emit.

    Cut at newlines, so that a BPE merge cut in half at either end cannot fail a correct tokenizer; each stretch
    between special tokens (no text: decoded, one reads as its name) makes the trip alone, as it was encoded."""
    ids = [int(i) for i in ids]
    newline = tokenizer.encode("\n") if "\n" in tokenizer.decode(ids) else []
    if len(newline) == 1 and ids.count(newline[0]) >= 2:  # from after the first newline through the last
        at = [i for i, token in enumerate(ids) if token == newline[0]]
        ids = ids[at[0] + 1: at[-1] + 1]
    special = tokenizer.special_ids.__contains__
    runs = [list(run) if is_special else tokenizer.decode(list(run)) for is_special, run in groupby(ids, special)]
    again = [i for run in runs for i in (tokenizer.encode(run) if isinstance(run, str) else run)]  # specials kept
    passed, n_texts = again == ids, 1 + sum(map(special, ids))  # stretches of text around the special tokens
    n_chars = sum(len(run) for run in runs if isinstance(run, str))
    first_diff = next((i for i, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))
    stretches = f" in {n_texts} stretches between special tokens" if n_texts > 1 else ""
    measured = f"{len(ids):,} tokens{stretches} -> {n_chars:,} chars -> " + (
        f"the same {len(ids):,} tokens" if passed else f"{len(again):,} tokens, first differs at {first_diff}")
    return verdict("round trip", passed, measured, "the tokenizer loses nothing: samples decode to what was trained on",
                   "decode or encode loses or changes text: the model learns one thing and you read another")


# ----------------------------------------------------------------------------- model checks
def check_init_loss(model: GPT, x: torch.Tensor, y: torch.Tensor,
                    tolerance: float = INIT_LOSS_TOLERANCE) -> Check:
    """A fresh model should be equally unsure of every token: loss ~ ln(vocab_size), within a fraction."""
    with torch.no_grad():
        _, loss_sum, n, _ = model(x, y)
    loss, expected = (loss_sum / n).item(), math.log(model.config.vocab_size)
    allowed = tolerance * expected
    return verdict("init loss", abs(loss - expected) <= allowed,
                   f"{loss:.4f} vs ln({model.config.vocab_size}) = {expected:.4f} ± {allowed:.3f}",
                   "a fresh model spreads its bets evenly over the vocabulary",
                   "init too large (over-confident), wrong vocab size, or a mis-reduced loss (shapes, sum vs mean)")


def graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor that requires grad and that ``loss`` depends on, found by walking the autograd graph."""
    leaves, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # an AccumulateGrad node: the gradient lands in this leaf
            leaves.append(node.variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def check_gradients(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Check:
    """Every trained parameter gets a finite, non-zero gradient and sits in exactly one optimizer group; a frozen one
    (LoRA's base) in none."""
    model.zero_grad(set_to_none=True)
    _, loss_sum, n, _ = model(x, y)
    loss = loss_sum / n
    registered = {id(p) for p in model.parameters()}
    # A tensor the loss uses but the model does not register (a layer in a plain list) is never
    # moved, saved or trained: find it through the graph, since parameters() cannot see it.
    problems = [f"unregistered tensor {tuple(t.shape)}" for t in graph_leaves(loss) if id(t) not in registered]
    loss.backward()
    groups = Counter(id(p) for group in optimizer.param_groups for p in group["params"])
    frozen = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            frozen += 1
            if groups[id(p)]:
                problems.append(f"{name}: frozen, in {groups[id(p)]} optimizer groups")
            continue
        if p.grad is None:
            problems.append(f"{name}: no grad")
        elif not torch.isfinite(p.grad).all():
            problems.append(f"{name}: non-finite grad")
        elif not p.grad.any() and ".lora_A." not in name:  # LoRA's A: none at step 1, by design (B = 0)
            problems.append(f"{name}: zero grad")
        if groups[id(p)] != 1:
            problems.append(f"{name}: in {groups[id(p)]} optimizer groups")
    model.zero_grad(set_to_none=True)
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    trained = f"{len(registered) - frozen} tensors, all finite, non-zero, 1 group each"
    return verdict("gradients", not problems, shown or trained + (f"; {frozen} frozen, in none" if frozen else ""),
                   "every weight learns, and the optimizer updates each exactly once",
                   "these weights never train (or train twice): check ModuleList, freezing, optimizer groups")


def check_causal(model: GPT, x: torch.Tensor, tolerance: float = CAUSAL_TOLERANCE) -> Check:
    """Changing the future tokens leaves the logits of the past untouched."""
    model.eval()
    cut = x.shape[1] // 2
    changed = torch.cat([x[:, :cut], (x[:, cut:] + 1) % model.config.vocab_size], dim=1)  # every future token differs
    with torch.no_grad():
        diff = (model(x)[0][:, :cut] - model(changed)[0][:, :cut]).abs().max().item()  # logits (B, cut, vocab)
    model.train()
    return verdict("causal", diff <= tolerance, f"max |Δ past logit| {diff:.1e} (limit {tolerance:.0e})",
                   "position t sees only tokens 0..t",
                   "the attention mask leaks the future: train loss drops, generation is garbage")


def check_overfit(run: train.Run, x: torch.Tensor, y: torch.Tensor, lr: float, steps: int = OVERFIT_STEPS,
                  threshold: float = OVERFIT_THRESHOLD) -> Check:
    """train.py's step (train.train_step), repeated on one small batch at ``lr``, gets its loss below ``threshold``."""
    first = loss = math.nan
    for step in range(1, steps + 1):
        losses, _ = train.train_step(run, run.model, [(x, y)], step, lr)
        loss = (losses.loss_sum / losses.n_targets).item()  # the loss before this step's update
        first = loss if step == 1 else first
        if loss < threshold:
            break
    return verdict("overfit", loss < threshold,
                   f"{first:.3f} -> {loss:.3f} in {step} steps at lr {lr:.1e} (need < {threshold} within {steps})",
                   "model, loss and optimizer step can learn",
                   "cannot even memorise one batch: check the lr, zero_grad, the loss and the optimizer groups")


def overfit_run(cfg: TrainConfig, rt, steps: int = OVERFIT_STEPS, pretrained=None) -> train.Run:
    """The run train.py builds (train.build_run: model, optimizer, scaler, guard; init_from: on ``pretrained``, the
    base's weights), at the overfit check's lr, with a guard that stops only after ``steps`` fp16 skips in a row."""
    run = train.build_run(dataclasses.replace(cfg, learning_rate=overfit_lr(cfg)), rt, pretrained=pretrained)
    return dataclasses.replace(run, guard=NonFiniteGuard(run.scaler, steps, rt.device))


def overfit_lr(cfg: TrainConfig) -> float:
    """The config's own lr (one too small to learn is a finding), unless it fine-tunes (init_from): a fine-tuning lr
    is made to move good weights little (and a random base barely), too slowly to memorise a batch in OVERFIT_STEPS;
    the question here is whether the step learns, so the lr a random init of this width learns at."""
    if not cfg.init_from:
        return cfg.learning_rate
    return min(RANDOM_INIT_LR_MAX, RANDOM_INIT_LR * RANDOM_INIT_WIDTH / cfg.n_embd)


def check_grad_norm(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                    device: torch.device, dtype: torch.dtype) -> Check:
    """train.py's step reports the true pre-clip gradient norm, with fp16's loss scaling undone: a step under a
    GradScaler (whatever the dtype), clipped at a tenth of the norm, against the norm measured by hand."""
    scaler = torch.amp.GradScaler(device.type, enabled=True)
    guard = NonFiniteGuard(scaler, max_skipped=1, device=device)
    params = list(model.parameters())
    loss_sum, _, _ = train.accumulate_gradients(model, [(x, y)], scaler, device, dtype)
    scale = scaler.get_scale()  # a power of two: dividing by it is exact
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]).item() / scale
    max_norm = true_norm / 10
    reported = train.optimizer_step(optimizer, scaler, guard, params, max_norm, 1, loss_sum).item()
    return verdict("grad norm", math.isclose(reported, true_norm, rel_tol=1e-3),
                   f"reported {reported:.4g} vs true pre-clip {true_norm:.4g} (loss scale {scale:g}, clip at "
                   f"{max_norm:.3g})", "the logged grad norm is the gradient's own, before clipping",
                   "clipping before scaler.unscale_ (fp16 clips ~scale times too hard) or the norm taken after "
                   "clipping")


def check_nonfinite_gradient(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                             max_norm: float, device: torch.device, dtype: torch.dtype) -> Check:
    """A step whose loss is finite but whose gradient holds a NaN must stop the run at the loop's next sync, before
    anything is saved: train.py's step and NonFiniteGuard, with the configured optimizer and precision."""
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    guard = NonFiniteGuard(scaler, max_skipped=1, device=device)  # fp16: the first skip stops
    params = list(model.parameters())
    loss_sum, n, _ = train.accumulate_gradients(model, [(x, y)], scaler, device, dtype)
    poisoned = next(p for p in reversed(params) if p.grad is not None)
    poisoned.grad.view(-1)[0] = math.nan  # one bad element, as an overflow in one layer's backward gives
    try:
        train.optimizer_step(optimizer, scaler, guard, params, max_norm, 1, loss_sum)
        guard.raise_if_tripped()  # where the loop would next sync
        stopped = False
    except RunStopped:
        stopped = True
    measured = f"loss {(loss_sum / n).item():.3f}, one NaN gradient: " + ("stopped" if stopped else "NOT stopped")
    return verdict("nan guard", stopped, measured,
                   "a NaN gradient stops the run before anything is saved, even under a finite loss",
                   "the non-finite guard checks the loss only (or not at all): the run goes on with NaN weights")


def check_dropout_modes(model: GPT, x: torch.Tensor) -> Check:
    """Eval mode is deterministic; train mode with dropout is not (``model`` must have dropout > 0)."""
    with torch.no_grad():
        model.eval()
        eval_diff = (model(x)[0] - model(x)[0]).abs().max().item()
        model.train()
        train_diff = (model(x)[0] - model(x)[0]).abs().max().item()
    return verdict("train/eval", eval_diff == 0 and train_diff > 0,
                   f"eval max|Δ| {eval_diff:.1e}, train max|Δ| {train_diff:.1e} (dropout {model.config.dropout})",
                   "dropout is on in train mode and off in eval mode",
                   "dropout ignores the mode (a functional dropout without training=self.training?)")


def check_evaluate(evaluate: Callable[..., train.EvalResult], model: GPT, x_val: torch.Tensor, y_val: torch.Tensor,
                   batch_size: int, device: torch.device, dtype: torch.dtype) -> Check:
    """``evaluate`` runs in eval mode, builds no graph, draws no random numbers and restores train mode
    (``model`` with dropout > 0, so that a missing model.eval() changes the answer)."""
    calls = []  # (training flag, loss carries a graph) for every forward pass evaluate makes

    def rng_states() -> list[torch.Tensor]:  # the global random streams that dropout on ``device`` draws from
        return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])

    def record(module, args, output):
        calls.append((module.training, output[1] is not None and output[1].requires_grad))

    model.train()
    hook = model.register_forward_hook(record)
    rng = rng_states()
    try:
        first = evaluate(model, x_val, y_val, batch_size, device, dtype).loss
        second = evaluate(model, x_val, y_val, batch_size, device, dtype).loss
    finally:
        hook.remove()
    problems = [problem for found, problem in [
        (any(training for training, _ in calls), "ran in train mode (model.eval() missing)"),
        (any(graph for _, graph in calls), "built an autograd graph (no torch.no_grad(); a running total keeps every "
                                           "graph alive)"),
        (first != second, f"two runs differ ({first:.4f} vs {second:.4f})"),
        (not all(map(torch.equal, rng, rng_states())), "drew from the global RNG (shifts dropout and data after every "
                                                       "eval)"),
        (not model.training, "left the model in eval mode")] if found]
    return verdict("evaluate", not problems, "; ".join(problems) or f"val loss {first:.4f} twice over {len(calls)} "
                   "forward passes", "eval mode, no graph, no RNG used, train mode restored",
                   "val loss is noisy, leaks memory or disturbs training")


def check_tied(model: torch.nn.Module) -> Check:
    """Token embedding and output head are one Parameter with one storage (after .to() and compile)."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile keeps the real module here
    wte, head = inner.transformer.wte, inner.lm_head
    if isinstance(wte, finetune.TrainedRows):  # LoRA's trained rows (a chat's markers) wrap the frozen tied weight
        wte, head = wte.embedding, head.rows.head
    wte, head = wte.weight, head.weight
    same_param, same_storage = wte is head, wte.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    measured = (f"{'one Parameter' if same_param else 'two Parameters'}, "
                f"{'one storage' if same_storage else 'two storages'} on {wte.device}"
                + (", compiled" if inner is not model else ""))
    return verdict("tied weights", same_param and same_storage, measured, "embedding and head train as one matrix",
                   "tying came apart (or was done by sharing .data): a move or cast gives two matrices")


def check_probe_grads(model: torch.nn.Module, probe_ran: bool) -> Check:
    """After compile_or_eager, no parameter holds a gradient: the compile probe's backward must not
    add itself to the first real step's gradient (backward accumulates into .grad)."""
    left = [name for name, p in model.named_parameters() if p.grad is not None]
    n_params = len(list(model.parameters()))
    measured = (f"{len(left)} of {n_params} tensors hold a gradient ({left[0]}, ...)" if left else
                f"no gradient on any of {n_params} tensors after the compile probe" if probe_ran else
                "compile off: no probe ran, no gradient left")
    return verdict("probe grads", not left, measured, "step 1 gets the gradient of its own batch only",
                   "the compile probe's gradients leak into step 1: clear them (p.grad = None) after the probe")


def short_run(cfg: TrainConfig, dtype: torch.dtype) -> tuple[TrainConfig, list[dict], dict]:
    """(config, metrics.jsonl records, last.pt) of train.train on ``cfg`` for a few accumulated steps of one sequence,
    warmup longer than the run (every step's lr differs), in a temporary folder, its output hidden: shrunk to a
    1-layer, 16-wide model, or with init_from the base's own (its weights fix the shape, its tokenizer the data).
    Reseeds the global RNG."""
    shrunk = {} if cfg.init_from else dict(n_layer=1, n_head=1, n_embd=16)
    with tempfile.TemporaryDirectory() as out_dir:
        small = dataclasses.replace(cfg, out_dir=out_dir, resume=False, compile="off", dtype=dtype_name(dtype),
                                    wandb=False, dropout=0.0, batch_size=1, grad_accum=SHORT_RUN_ACCUM,
                                    max_iters=SHORT_RUN_STEPS, warmup_iters=SHORT_RUN_STEPS + 1, schedule="steps",
                                    max_time=0.0, log_interval=1, eval_interval=SHORT_RUN_STEPS, ckpt_interval=0,
                                    eval_tokens=cfg.block_size, **shrunk)
        with contextlib.redirect_stdout(io.StringIO()):
            train.train(small)
        records = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
        return small, records, load_checkpoint(Path(out_dir) / "last.pt")


def check_lr_schedule(small: TrainConfig, records: list[dict], schedule: Callable[[int, TrainConfig], float]) -> Check:
    """The short run (grad_accum > 1) set get_lr(step) per *optimizer* step, not per micro-batch. ``schedule`` is
    the reference (train.get_lr), an argument so that a test can break the loop's use of it."""
    used = [r["lr"] for r in records if "lr" in r]  # the lr the loop set on the optimizer, per step
    expected = [schedule(step, small) for step in range(small.max_iters)]
    passed = len(used) == len(expected) and all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(used, expected))
    shown = ", ".join(f"{lr:.2e}" for lr in used)
    measured = (f"steps 1-{small.max_iters} x {small.grad_accum} micro-batches: lr {shown}"
                + (" = get_lr(step)" if passed else f" vs get_lr {', '.join(f'{lr:.2e}' for lr in expected)}"))
    return verdict("lr schedule", passed, measured, "warmup and decay advance once per optimizer step, as get_lr says",
                   "the loop's step count is not get_lr's (micro-batches counted?): warmup and decay end too early")


def floating_dtypes(value) -> Counter:
    """How many floating-point tensors of each dtype a nested dict/list holds (a state dict)."""
    if isinstance(value, torch.Tensor):
        return Counter([dtype_name(value.dtype)] if value.is_floating_point() else [])
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return sum((floating_dtypes(item) for item in items), Counter())


def check_master_weights(state: dict) -> Check:
    """After the short run in the configured precision, the weights and the optimizer's moments are all
    fp32: autocast computes in bf16/fp16, but the updates must land on fp32 copies."""
    found = {part: floating_dtypes(state[part]) for part in ("model", "optimizer")}
    measured = f"after {state['step']} steps in {state['precision']}: " + "; ".join(
        f"{part} " + ", ".join(f"{n} {dtype}" for dtype, n in sorted(counts.items())) for part, counts in found.items())
    return verdict("master weights", all(set(counts) == {"float32"} for counts in found.values()), measured,
                   "weights and moments stay fp32; autocast does the low-precision maths",
                   "the model was cast to low precision: small updates round away (no fp32 master copy)")


# ----------------------------------------------------------------------------- running them all
def run_checks(cfg: TrainConfig) -> list[Check]:
    """Every check, on the run train.py builds for ``cfg`` (train.build_run: its data, tokenizer, training stream and
    model; with init_from, the base's tokenizer and weights), each check of a step on a copy of its model; the init,
    dropout and evaluation on a fresh init of its shape and vocabulary."""
    cfg, pretrained = start_from(cfg)  # init_from: the base's weights, and the config with the options they fix
    rt = choose_runtime(cfg)  # train.py's device, threads, precision and compile
    device, dtype = rt.device, rt.dtype
    run = train.build_run(cfg, rt, pretrained=pretrained)
    corpus, stream, gpt_config = run.corpus, run.stream, run.model.config
    tokenizer = tokenizer_from_meta(corpus.meta["tokenizer"], Path(cfg.data_dir))
    x, y = stream.first_batch()  # (B, T) each: the run's first batch; no random stream moves
    x_val, y_val = run.x_val[:2], run.y_val[:2]  # the first two val windows (a chat's: conversations)
    print(f"doctor: {corpus.folder} on {device} ({dtype_name(dtype)}), batch {cfg.batch_size}; model: "
          f"{summary(run.model)}")

    def fresh(dropout: float = cfg.dropout) -> GPT:  # a new random init, for checks of the model's code alone
        torch.manual_seed(cfg.seed)
        return GPT(dataclasses.replace(gpt_config, dropout=dropout)).to(device)

    def trainable() -> tuple[GPT, torch.optim.Optimizer]:  # made inside the call: freed after its check
        model = copy.deepcopy(run.model)  # the run's own, weights (and adapters) as it starts
        return model, train.build_optimizer(model, cfg, device, dtype)

    dropout, few_x, few_y = cfg.dropout or FORCED_DROPOUT, x[:FEW_SEQUENCES], y[:FEW_SEQUENCES]
    checks = [
        check_init_loss(fresh(), x, y),  # a fresh init's, under init_from too: its scale, the vocab, the loss
        check_batch(x, y, corpus.train, tokenizer, stretches_of(stream)),
        check_token_range({"train": corpus.train, "val": corpus.val}, gpt_config.vocab_size),
        check_round_trip(tokenizer, np.asarray(corpus.val[:SAMPLE_TOKENS])),
        check_gradients(*trainable(), few_x, few_y),
        check_causal(copy.deepcopy(run.model), few_x),
        check_overfit(overfit_run(cfg, rt, pretrained=pretrained), x[:OVERFIT_SEQUENCES], y[:OVERFIT_SEQUENCES],
                      overfit_lr(cfg)),
        check_grad_norm(*trainable(), few_x, few_y, device, dtype),
        check_nonfinite_gradient(*trainable(), few_x, few_y, cfg.grad_clip or math.inf, device, dtype),
        check_dropout_modes(fresh(dropout), few_x),
        check_evaluate(train.evaluate, fresh(dropout), x_val, y_val, 1, device, dtype),  # 2 batches each
    ]
    del pretrained  # its tensors now live in the models
    probe_model = copy.deepcopy(run.model)  # compiled as train.py compiles, then checked for the probe's gradients
    checks += [check_tied(compile_for_step(probe_model, stream, rt)), check_probe_grads(probe_model, rt.compile)]
    small, records, state = short_run(cfg, dtype)  # last: a training run reseeds the global RNG
    return checks + [check_lr_schedule(small, records, train.get_lr), check_master_weights(state)]


def main(argv: list[str] | None = None) -> int:
    """Run every check and print one line each; 0 if all pass, 1 if any fails; bad config or data exits as train.py."""
    t_start = time.time()
    try:
        cfg = parse_args(argv, __doc__.split("\n")[0] + " Takes train.py's flags.")
        checks = run_checks(cfg)
    except TinyGPTError as err:  # bad config or data: one line and its exit code, as in train.py
        exit_on(err)
    name_width, measured_width = (max(len(getattr(c, key)) for c in checks) for key in ("name", "measured"))
    for c in checks:  # one aligned line per check
        print(f"{'PASS' if c.passed else 'FAIL'}  {c.name:<{name_width}}  {c.measured:<{measured_width}}  {c.meaning}")
    failed = [c.name for c in checks if not c.passed]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed in {time.time() - t_start:.1f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
