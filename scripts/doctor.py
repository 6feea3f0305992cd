"""The doctor: the "my loss won't go down" checklist, run on your real config and data.

    python -m scripts.doctor --config small              # same config and overrides as train.py
    python -m scripts.doctor --config small --dropout 0.1

Prints one line per check: PASS or FAIL, the measured figure, and what it means. Exit status 1 if
any check fails. Each check is a small function taking what it needs (a model, a batch, a
tokenizer) and returning a ``Check``, so tests can call it on deliberately broken variants. The
checks go through the repo's own code paths (the training stream, ``train.build_optimizer``,
``train.accumulate_gradients``, ``train.optimizer_step``, ``NonFiniteGuard``, ``train.evaluate``,
``compile_or_eager``, and a few steps of ``train.train`` itself), so a bug there shows up here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import train
from training.checkpoint import dtype_name, load_checkpoint
from config import TrainConfig, model_config, parse_args
from data import corpus_for, special_tokens, training_stream, val_windows
from training.faults import NonFiniteGuard, RunStopped
from model import GPT
from training.runtime import choose_runtime, compile_for_step
from prepare.tokenizers import tokenizer_from_meta
from process.errors import TinyGPTError, exit_on
from weights.loading import start_from

REPO = Path(__file__).resolve().parent.parent

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


@dataclass
class Check:
    """The verdict of one check."""
    name: str
    passed: bool
    measured: str  # the figure the verdict rests on
    meaning: str  # one line: what a pass shows, or where a failure points


# ----------------------------------------------------------------------------- data checks
def window_starts(data: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Every position at which ``window`` occurs in ``data``."""
    starts = np.flatnonzero(data[: len(data) - len(window) + 1] == window[0])
    for offset in range(1, len(window)):
        starts = starts[data[starts + offset] == window[offset]]  # keep the starts that still match
    return starts


def check_batch(x: torch.Tensor, y: torch.Tensor, data: np.ndarray, tokenizer,
                stretches: Callable[[np.ndarray], list[np.ndarray]] = lambda row: [row]) -> Check:
    """Targets are the inputs shifted left by one, and the window really occurs in the data: each of its
    ``stretches`` (the stream's: a random window is one, a row of packed documents one per document)."""
    x, y = x.cpu(), y.cpu()
    shifted = torch.equal(x[:, 1:], y[:, :-1])  # y[:, t] must be x[:, t + 1]
    row = np.append(x[0].numpy(), y[0, -1].item())  # the T + 1 tokens the first window spans
    in_data = shifted and all(window_starts(data, piece).size > 0 for piece in stretches(row))
    text_x = tokenizer.decode(x[0, :24].tolist())[:24]
    text_y = tokenizer.decode(y[0, :24].tolist())[:24]
    meaning = ("y[t] is the token after x[t], read straight from the corpus" if in_data else
               "targets are not the inputs shifted by one: the model is taught the wrong task"
               if not shifted else "the window does not occur in the corpus: batches are garbled")
    return Check("batch", in_data, f"x {text_x!r} -> y {text_y!r}", meaning)


def check_token_range(splits: dict[str, np.ndarray], vocab_size: int) -> Check:
    """Every token id is below the model's vocab size (padded rows would hide a bad id)."""
    top = {name: int(ids.max()) for name, ids in splits.items()}
    worst = max(top, key=top.get)
    passed = top[worst] < vocab_size
    meaning = ("every id has its own embedding row and logit" if passed else
               "ids past the vocab hit padding rows or crash the loss: re-prepare the data with this tokenizer")
    return Check("token ids", passed, f"max id {top[worst]} ({worst}) vs vocab {vocab_size}", meaning)


def check_round_trip(tokenizer, ids: np.ndarray) -> Check:
    """encode(decode(ids)) gives back the same ids, so what the model learns is what it will emit.

    The stretch is cut just after newlines where it has two, so that a BPE merge cut in half at
    either end of the sample cannot make a correct tokenizer look wrong. A document corpus encodes
    each document on its own between special tokens (GPT-2's <|endoftext|>), which stand for no text:
    decoded, one reads as its name, which encodes as ~7 ordinary tokens. So each stretch between
    them makes the round trip on its own, as it was encoded, and the special tokens stay as they are.
    """
    ids = [int(i) for i in ids]
    newline = tokenizer.encode("\n") if "\n" in tokenizer.decode(ids) else []
    if len(newline) == 1 and ids.count(newline[0]) >= 2:
        first = ids.index(newline[0])
        last = len(ids) - 1 - ids[::-1].index(newline[0])
        ids = ids[first + 1: last + 1]
    pieces = split_at(ids, special_tokens(tokenizer))  # text, special, text, ..., special, text
    texts = [tokenizer.decode(piece) for piece in pieces[::2]]
    again = []
    for i, piece in enumerate(pieces):
        again += tokenizer.encode(texts[i // 2]) if i % 2 == 0 else piece  # a special token is no text: kept
    passed = again == ids
    n_chars = sum(len(text) for text in texts)
    first_diff = next((i for i, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))
    stretches = f" in {len(texts)} stretches between special tokens" if len(texts) > 1 else ""
    measured = (f"{len(ids):,} tokens{stretches} -> {n_chars:,} chars -> the same {len(ids):,} tokens" if passed else
                f"{len(ids):,} tokens{stretches} -> {n_chars:,} chars -> {len(again):,} tokens, first differs at "
                f"{first_diff}")
    meaning = ("the tokenizer loses nothing: samples decode to what was trained on" if passed else
               "decode or encode loses or changes text: the model learns one thing and you read another")
    return Check("round trip", passed, measured, meaning)


def split_at(ids: list[int], special: set[int]) -> list[list[int]]:
    """``ids`` cut around each special id: [text, [special], text, [special], ..., text] (texts may be [])."""
    pieces: list[list[int]] = [[]]
    for i in ids:
        if i in special:
            pieces += [[i], []]
        else:
            pieces[-1].append(i)
    return pieces


# ----------------------------------------------------------------------------- model checks
def check_init_loss(model: GPT, x: torch.Tensor, y: torch.Tensor,
                    tolerance: float = INIT_LOSS_TOLERANCE) -> Check:
    """A fresh model should be equally unsure of every token: loss ~ ln(vocab_size), within a fraction."""
    vocab_size = model.config.vocab_size
    with torch.no_grad():
        _, loss_sum, n, _ = model(x, y)
    loss = (loss_sum / n).item()
    expected = math.log(vocab_size)
    allowed = tolerance * expected
    passed = abs(loss - expected) <= allowed
    meaning = ("a fresh model spreads its bets evenly over the vocabulary" if passed else
               "init too large (over-confident), wrong vocab size, or a mis-reduced loss (shapes, sum vs mean)")
    return Check("init loss", passed, f"{loss:.4f} vs ln({vocab_size}) = {expected:.4f} ± {allowed:.3f}", meaning)


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
    """Every parameter gets a finite, non-zero gradient and sits in exactly one optimizer group."""
    model.zero_grad(set_to_none=True)
    _, loss_sum, n, _ = model(x, y)
    loss = loss_sum / n
    registered = {id(p) for p in model.parameters()}
    # A tensor the loss uses but the model does not register (a layer in a plain list) is never
    # moved, saved or trained: find it through the graph, since parameters() cannot see it.
    unregistered = [leaf for leaf in graph_leaves(loss) if id(leaf) not in registered]
    loss.backward()
    groups = Counter(id(p) for group in optimizer.param_groups for p in group["params"])
    problems = [f"unregistered tensor {tuple(t.shape)}" for t in unregistered]
    for name, p in model.named_parameters():
        if p.grad is None:
            problems.append(f"{name}: no grad")
        elif not torch.isfinite(p.grad).all():
            problems.append(f"{name}: non-finite grad")
        elif not p.grad.any():
            problems.append(f"{name}: zero grad")
        if groups[id(p)] != 1:
            problems.append(f"{name}: in {groups[id(p)]} optimizer groups")
    model.zero_grad(set_to_none=True)
    n_params = len(list(model.parameters()))
    if not problems:
        return Check("gradients", True, f"{n_params} tensors, all finite, non-zero, 1 group each",
                     "every weight learns, and the optimizer updates each exactly once")
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    return Check("gradients", False, shown,
                 "these weights never train (or train twice): check ModuleList, freezing, optimizer groups")


def check_causal(model: GPT, x: torch.Tensor, tolerance: float = CAUSAL_TOLERANCE) -> Check:
    """Changing the future tokens leaves the logits of the past untouched."""
    model.eval()
    cut = x.shape[1] // 2
    changed = x.clone()
    changed[:, cut:] = (x[:, cut:] + 1) % model.config.vocab_size  # every future token differs
    with torch.no_grad():
        past = model(x)[0][:, :cut]  # (B, cut, vocab)
        past_changed = model(changed)[0][:, :cut]
    model.train()
    diff = (past - past_changed).abs().max().item()
    passed = diff <= tolerance
    meaning = ("position t sees only tokens 0..t" if passed else
               "the attention mask leaks the future: train loss drops, generation is garbage")
    return Check("causal", passed, f"max |Δ past logit| {diff:.1e} (limit {tolerance:.0e})", meaning)


def check_overfit(run: train.Run, x: torch.Tensor, y: torch.Tensor, lr: float, steps: int = OVERFIT_STEPS,
                  threshold: float = OVERFIT_THRESHOLD) -> Check:
    """train.py's step (train.train_step), repeated on one small batch at ``lr``, must drive its loss below ``threshold``."""
    first = loss = math.nan
    for step in range(1, steps + 1):
        losses, _ = train.train_step(run, run.model, [(x, y)], step, lr)
        loss = (losses.loss_sum / losses.n_targets).item()  # the loss before this step's update
        first = loss if step == 1 else first
        if loss < threshold:
            break
    passed = loss < threshold
    meaning = ("model, loss and optimizer step can learn" if passed else
               "cannot even memorise one batch: check the lr, zero_grad, the loss and the optimizer groups")
    return Check("overfit", passed,
                 f"{first:.3f} -> {loss:.3f} in {step} steps at lr {lr:.1e} (need < {threshold} within {steps})",
                 meaning)


def overfit_run(cfg: TrainConfig, rt, steps: int = OVERFIT_STEPS) -> train.Run:
    """The run train.py builds (train.build_run: model, optimizer, scaler, guard), at the overfit check's lr, with
    a guard that stops only after ``steps`` fp16 skips in a row."""
    run = train.build_run(dataclasses.replace(cfg, learning_rate=overfit_lr(cfg)), rt)
    return dataclasses.replace(run, guard=NonFiniteGuard(run.optimizer, run.scaler, steps, rt.device))


def overfit_lr(cfg: TrainConfig) -> float:
    """The lr of the overfit check: the config's own, unless the config fine-tunes (init_from).

    The doctor runs every check on a random init. A config that trains from one is checked at its own
    lr (one too small to learn is a finding). A fine-tuning lr (finetune_shakespeare's 6e-5) is small so
    as not to erase good weights, which the doctor does not load: a random init barely moves at it,
    and the check would blame the step. So it gets an lr for a random init of its width instead.
    """
    if not cfg.init_from:
        return cfg.learning_rate
    return min(RANDOM_INIT_LR_MAX, RANDOM_INIT_LR * RANDOM_INIT_WIDTH / cfg.n_embd)


def check_grad_norm(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                    device: torch.device, dtype: torch.dtype) -> Check:
    """train.py's step reports the true pre-clip gradient norm, with fp16's loss scaling undone.

    The step runs with a GradScaler on whatever the dtype (a scaled loss is what an fp16 run
    backpropagates) and a clip threshold a tenth of the norm, so that clipping surely happens: the
    norm returned (and logged) must equal the unscaled gradient's norm, measured by hand before.
    """
    scaler = torch.amp.GradScaler(device.type, enabled=True)
    guard = NonFiniteGuard(optimizer, scaler, max_skipped=1, device=device)
    params = list(model.parameters())
    loss_sum, _, _ = train.accumulate_gradients(model, [(x, y)], scaler, device, dtype)
    scale = scaler.get_scale()  # a power of two: dividing by it is exact
    grads = [p.grad.float() for p in params if p.grad is not None]  # a missing one is the 'gradients' check's finding
    true_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item() / scale
    max_norm = true_norm / 10
    reported = train.optimizer_step(optimizer, scaler, guard, params, max_norm, 1, loss_sum).item()
    passed = math.isclose(reported, true_norm, rel_tol=1e-3)
    measured = (f"reported {reported:.4g} vs true pre-clip {true_norm:.4g} (loss scale {scale:g}, clip at "
                f"{max_norm:.3g})")
    meaning = ("the logged grad norm is the gradient's own, before clipping" if passed else
               "clipping before scaler.unscale_ (fp16 clips ~scale times too hard) or the norm taken after clipping")
    return Check("grad norm", passed, measured, meaning)


def check_nonfinite_gradient(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                             max_norm: float, device: torch.device, dtype: torch.dtype) -> Check:
    """A step whose loss is finite but whose gradient holds a NaN must leave the weights untouched and
    stop the run: train.py's step and NonFiniteGuard, with the configured optimizer and precision."""
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    guard = NonFiniteGuard(optimizer, scaler, max_skipped=1, device=device)  # fp16: the first skip stops
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    loss_sum, n, _ = train.accumulate_gradients(model, [(x, y)], scaler, device, dtype)
    poisoned = next(p for p in reversed(params) if p.grad is not None)
    poisoned.grad.view(-1)[0] = math.nan  # one bad element, as an overflow in one layer's backward gives
    try:
        train.optimizer_step(optimizer, scaler, guard, params, max_norm, 1, loss_sum)
        guard.raise_if_tripped()  # where the loop would next sync
        stopped = False
    except RunStopped:
        stopped = True
    changed = sum(not torch.equal(p, b) for p, b in zip(params, before))
    non_finite = sum(not torch.isfinite(p).all() for p in params)
    passed = stopped and changed == 0
    measured = (f"loss {(loss_sum / n).item():.3f}, one NaN gradient: "
                + ("stopped" if stopped else "NOT stopped") + f", {changed} of {len(params)} tensors changed"
                + (f" ({non_finite} non-finite)" if non_finite else ""))
    meaning = ("a NaN gradient never reaches the weights, even under a finite loss" if passed else
               "the non-finite guard checks the loss only (or not at all): NaN gradients are applied")
    return Check("nan guard", passed, measured, meaning)


def check_dropout_modes(model: GPT, x: torch.Tensor) -> Check:
    """Eval mode is deterministic; train mode with dropout is not (``model`` must have dropout > 0)."""
    with torch.no_grad():
        model.eval()
        eval_diff = (model(x)[0] - model(x)[0]).abs().max().item()
        model.train()
        train_diff = (model(x)[0] - model(x)[0]).abs().max().item()
    passed = eval_diff == 0 and train_diff > 0
    meaning = ("dropout is on in train mode and off in eval mode" if passed else
               "dropout ignores the mode (a functional dropout without training=self.training?)")
    return Check("train/eval", passed,
                 f"eval max|Δ| {eval_diff:.1e}, train max|Δ| {train_diff:.1e} (dropout {model.config.dropout})",
                 meaning)


def rng_states(device: torch.device) -> list[torch.Tensor]:
    """The global random streams that dropout on ``device`` draws from."""
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])


def check_evaluate(evaluate: Callable[..., train.EvalResult], model: GPT, x_val: torch.Tensor, y_val: torch.Tensor,
                   batch_size: int, device: torch.device, dtype: torch.dtype) -> Check:
    """``evaluate`` runs in eval mode, builds no graph, draws no random numbers and restores train mode.

    ``model`` should have dropout > 0, so that a missing model.eval() changes the answer.
    """
    calls = []  # (training flag, loss carries a graph) for every forward pass evaluate makes

    def record(module, args, output):
        calls.append((module.training, output[1] is not None and output[1].requires_grad))

    model.train()
    hook = model.register_forward_hook(record)
    rng = rng_states(device)
    try:
        first = evaluate(model, x_val, y_val, batch_size, device, dtype).loss
        second = evaluate(model, x_val, y_val, batch_size, device, dtype).loss
    finally:
        hook.remove()
    problems = []
    if any(training for training, _ in calls):
        problems.append("ran in train mode (model.eval() missing)")
    if any(graph for _, graph in calls):
        problems.append("built an autograd graph (no torch.no_grad(); a running total keeps every graph alive)")
    if first != second:
        problems.append(f"two runs differ ({first:.4f} vs {second:.4f})")
    if not all(torch.equal(a, b) for a, b in zip(rng, rng_states(device))):
        problems.append("drew from the global RNG (shifts dropout and data after every eval)")
    if not model.training:
        problems.append("left the model in eval mode")
    measured = f"val loss {first:.4f} twice over {len(calls)} forward passes"
    if problems:
        return Check("evaluate", False, "; ".join(problems), "val loss is noisy, leaks memory or disturbs training")
    return Check("evaluate", True, measured, "eval mode, no graph, no RNG used, train mode restored")


def check_tied(model: torch.nn.Module) -> Check:
    """Token embedding and output head are one Parameter with one storage (after .to() and compile)."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile keeps the real module here
    wte, head = inner.transformer.wte.weight, inner.lm_head.weight
    same_param = wte is head
    same_storage = wte.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    passed = same_param and same_storage
    measured = (f"{'one Parameter' if same_param else 'two Parameters'}, "
                f"{'one storage' if same_storage else 'two storages'} on {wte.device}"
                + (", compiled" if inner is not model else ""))
    meaning = ("embedding and head train as one matrix" if passed else
               "tying came apart (or was done by sharing .data): a move or cast gives two matrices")
    return Check("tied weights", passed, measured, meaning)


def check_probe_grads(model: torch.nn.Module, probe_ran: bool) -> Check:
    """After compile_or_eager, no parameter holds a gradient: the compile probe's backward must not
    add itself to the first real step's gradient (backward accumulates into .grad)."""
    left = [name for name, p in model.named_parameters() if p.grad is not None]
    n_params = len(list(model.parameters()))
    if left:
        return Check("probe grads", False, f"{len(left)} of {n_params} tensors hold a gradient ({left[0]}, ...)",
                     "the compile probe's gradients leak into step 1: clear them (p.grad = None) after the probe")
    measured = (f"no gradient on any of {n_params} tensors after the compile probe" if probe_ran else
                "compile off: no probe ran, no gradient left")
    return Check("probe grads", True, measured, "step 1 gets the gradient of its own batch only")


def short_run_config(cfg: TrainConfig, out_dir: str, dtype: torch.dtype) -> TrainConfig:
    """``cfg`` shrunk to a 1-layer, 16-wide model (the loop's schedule and precision handling do not
    depend on the model) for a few accumulated steps, with a warmup longer than the run so that every
    step's lr differs."""
    return dataclasses.replace(cfg, out_dir=out_dir, resume=False, compile="off", dtype=dtype_name(dtype),
                               wandb=False, init_from="", n_layer=1, n_head=1, n_embd=16, dropout=0.0, batch_size=1,
                               grad_accum=SHORT_RUN_ACCUM, max_iters=SHORT_RUN_STEPS, warmup_iters=SHORT_RUN_STEPS + 1,
                               schedule="steps", max_time=0.0, log_interval=1, eval_interval=SHORT_RUN_STEPS,
                               ckpt_interval=0, eval_tokens=cfg.block_size)


def short_run(cfg: TrainConfig, dtype: torch.dtype) -> tuple[TrainConfig, list[dict], dict]:
    """train.train itself on short_run_config, in a temporary folder, its output hidden.

    Returns (the config it ran, its metrics.jsonl records, its last.pt). Reseeds the global RNG.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        small = short_run_config(cfg, out_dir, dtype)
        with contextlib.redirect_stdout(io.StringIO()):
            train.train(small)
        records = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
        return small, records, load_checkpoint(Path(out_dir) / "last.pt")


def check_lr_schedule(small: TrainConfig, records: list[dict], schedule: Callable[[int, TrainConfig], float]) -> Check:
    """The short run (grad_accum > 1) set get_lr(step) per *optimizer* step, not per micro-batch.

    ``schedule`` is the reference (train.get_lr); it is an argument so that a test can break the
    loop's use of it and still compare with the real one.
    """
    used = [r["lr"] for r in records if "lr" in r]  # the lr the loop set on the optimizer, per step
    expected = [schedule(step, small) for step in range(small.max_iters)]
    passed = len(used) == len(expected) and all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(used, expected))
    shown = ", ".join(f"{lr:.2e}" for lr in used)
    measured = (f"steps 1-{small.max_iters} x {small.grad_accum} micro-batches: lr {shown}"
                + (" = get_lr(step)" if passed else f" vs get_lr {', '.join(f'{lr:.2e}' for lr in expected)}"))
    meaning = ("warmup and decay advance once per optimizer step, as get_lr says" if passed else
               "the loop's step count is not get_lr's (micro-batches counted?): warmup and decay end too early")
    return Check("lr schedule", passed, measured, meaning)


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
    passed = all(set(counts) == {"float32"} for counts in found.values())
    measured = f"after {state['step']} steps in {state['precision']}: " + "; ".join(
        f"{part} " + ", ".join(f"{n} {dtype}" for dtype, n in sorted(counts.items())) for part, counts in found.items())
    meaning = ("weights and moments stay fp32; autocast does the low-precision maths" if passed else
               "the model was cast to low precision: small updates round away (no fp32 master copy)")
    return Check("master weights", passed, measured, meaning)


# ----------------------------------------------------------------------------- running them all
def run_checks(cfg: TrainConfig) -> list[Check]:
    """Every check, on the model, data and tokenizer that ``cfg`` trains with.

    With init_from, the checks run on randomly initialised models of the imported shape (activation,
    biases, tokenizer): the doctor checks the code path, not the pretrained weights.
    """
    if cfg.init_from:
        cfg = start_from(cfg)[0]  # keeps what the user gave
    rt = choose_runtime(cfg)  # train.py's device, threads, precision and compile
    device, dtype = rt.device, rt.dtype
    corpus = corpus_for(cfg)
    tokenizer = tokenizer_from_meta(corpus.meta["tokenizer"], Path(cfg.data_dir))
    gpt_config = model_config(cfg, corpus.vocab_size)
    stream = training_stream(cfg, corpus, tokenizer, 0, device)  # rank 0's, as train.py builds it
    x, y = stream.first_batch()  # (B, T) each: the run's first batch; no random stream moves
    x_val, y_val = val_windows(corpus.val, cfg.block_size, max_targets=2 * cfg.block_size)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    with torch.device("meta"):  # shapes only, to count the parameters
        model_summary = GPT(gpt_config).summary()
    print(f"doctor: {corpus.folder} on {device} ({str(dtype).removeprefix('torch.')}), batch {cfg.batch_size}; "
          f"model: {model_summary}")

    def fresh(dropout: float | None = None) -> GPT:  # a new model per check, so no check disturbs another
        torch.manual_seed(cfg.seed)
        config = gpt_config if dropout is None else dataclasses.replace(gpt_config, dropout=dropout)
        return GPT(config).to(device)

    def optimizer_for(model: GPT, lr: float = cfg.learning_rate) -> torch.optim.Optimizer:
        return train.build_optimizer(model, dataclasses.replace(cfg, learning_rate=lr), device, dtype)

    dropout = cfg.dropout if cfg.dropout > 0 else FORCED_DROPOUT
    def trainable() -> tuple[GPT, torch.optim.Optimizer]:  # made inside the call: freed after its check
        model = fresh()
        return model, optimizer_for(model)

    grad_model = fresh()
    few_x, few_y = x[:FEW_SEQUENCES], y[:FEW_SEQUENCES]
    checks = [
        check_init_loss(fresh(), x, y),
        check_batch(x, y, corpus.train, tokenizer, stream.stretches),
        check_token_range({"train": corpus.train, "val": corpus.val}, gpt_config.vocab_size),
        check_round_trip(tokenizer, np.asarray(corpus.val[:SAMPLE_TOKENS])),
        check_gradients(grad_model, optimizer_for(grad_model), few_x, few_y),
        check_causal(fresh(), few_x),
        check_overfit(overfit_run(cfg, rt), x[:OVERFIT_SEQUENCES], y[:OVERFIT_SEQUENCES], overfit_lr(cfg)),
        check_grad_norm(*trainable(), few_x, few_y, device, dtype),
        check_nonfinite_gradient(*trainable(), few_x, few_y, max_norm, device, dtype),
        check_dropout_modes(fresh(dropout), few_x),
        check_evaluate(train.evaluate, fresh(dropout), x_val, y_val, 1, device, dtype),  # 2 batches each
    ]
    probe_model = fresh()
    compiled = compile_for_step(probe_model, stream, rt)  # as train.py compiles
    checks += [check_tied(compiled), check_probe_grads(probe_model, rt.compile)]
    small, records, state = short_run(cfg, dtype)  # last: a training run reseeds the global RNG
    return checks + [check_lr_schedule(small, records, train.get_lr), check_master_weights(state)]


def print_table(checks: list[Check]) -> None:
    """One aligned line per check: verdict, name, measured figure, meaning."""
    name_width = max(len(c.name) for c in checks)
    measured_width = max(len(c.measured) for c in checks)
    for c in checks:
        verdict = "PASS" if c.passed else "FAIL"
        print(f"{verdict}  {c.name:<{name_width}}  {c.measured:<{measured_width}}  {c.meaning}")


def main(argv: list[str] | None = None) -> int:
    """Run every check and print the table; 0 if all pass, 1 if any fails; bad config or data exits as train.py."""
    t_start = time.time()
    try:
        cfg = parse_args(argv, __doc__.split("\n")[0] + " Takes train.py's flags.")
        checks = run_checks(cfg)
    except TinyGPTError as err:  # bad config or data: one line and its exit code, as in train.py
        exit_on(err)
    print_table(checks)
    failed = [c.name for c in checks if not c.passed]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed in {time.time() - t_start:.1f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
