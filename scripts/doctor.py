"""The doctor: the "my loss won't go down" checklist, run on your real config and data.

    python scripts/doctor.py --config small              # same config and overrides as train.py
    python scripts/doctor.py --config small --dropout 0.1

Prints one line per check: PASS or FAIL, the measured figure, and what it means. Exit status 1 if
any check fails. Each check is a small function taking what it needs (a model, a batch, a
tokenizer) and returning a ``Check``, so tests can call it on deliberately broken variants. The
checks go through the repo's own code paths (``get_batch``, ``configure_optimizer``,
``train.accumulate_gradients``, ``train.evaluate``), so a bug there shows up here.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # so that `python scripts/doctor.py` finds the repo's modules

import train  # noqa: E402
from config import ConfigError, TrainConfig, model_config, parse_args  # noqa: E402
from data import DataError, get_batch, load_corpus, prepare, tokenizer_from_meta, val_windows  # noqa: E402
from faults import NonFiniteGuard  # noqa: E402
from model import GPT  # noqa: E402
from runtime import compile_or_eager, pick_device, pick_dtype, want_compile  # noqa: E402

# Allowed gap between the first loss and ln(vocab), as a fraction of ln(vocab). A 0.02-std init gives
# logits of variance ~0.02² · n_embd, which adds about half that: 0.03 nats for small, 0.15 for gpt2.
INIT_LOSS_TOLERANCE = 0.03
CAUSAL_TOLERANCE = 1e-5  # max |change| of a past logit when the future changes (fp32 round-off)
OVERFIT_SEQUENCES = 1  # sequences in the batch to memorise
FEW_SEQUENCES = 4  # batch for the gradient, causal and dropout checks: every position, less time
OVERFIT_STEPS = 200  # step budget for memorising it (small needs ~30, tiny ~70)
OVERFIT_THRESHOLD = 0.1  # nats; memorised means the loss fell below this
FORCED_DROPOUT = 0.1  # dropout used on a copy of the model when the config has none
SAMPLE_TOKENS = 4096  # tokens of val text for the tokenizer round trip


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


def check_batch(x: torch.Tensor, y: torch.Tensor, data: np.ndarray, tokenizer) -> Check:
    """Targets are the inputs shifted left by one, and the window really occurs in the data."""
    x, y = x.cpu(), y.cpu()
    shifted = torch.equal(x[:, 1:], y[:, :-1])  # y[:, t] must be x[:, t + 1]
    row = np.append(x[0].numpy(), y[0, -1].item())  # the T + 1 tokens the first window spans
    in_data = shifted and window_starts(data, row).size > 0
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
    either end of the sample cannot make a correct tokenizer look wrong.
    """
    ids = [int(i) for i in ids]
    newline = tokenizer.encode("\n") if "\n" in tokenizer.decode(ids) else []
    if len(newline) == 1 and ids.count(newline[0]) >= 2:
        first = ids.index(newline[0])
        last = len(ids) - 1 - ids[::-1].index(newline[0])
        ids = ids[first + 1: last + 1]
    text = tokenizer.decode(ids)
    again = tokenizer.encode(text)
    passed = again == ids
    first_diff = next((i for i, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))
    measured = (f"{len(ids):,} tokens -> {len(text):,} chars -> the same {len(ids):,} tokens" if passed else
                f"{len(ids):,} tokens -> {len(text):,} chars -> {len(again):,} tokens, first differs at {first_diff}")
    meaning = ("the tokenizer loses nothing: samples decode to what was trained on" if passed else
               "decode or encode loses or changes text: the model learns one thing and you read another")
    return Check("round trip", passed, measured, meaning)


# ----------------------------------------------------------------------------- model checks
def check_init_loss(model: GPT, x: torch.Tensor, y: torch.Tensor,
                    tolerance: float = INIT_LOSS_TOLERANCE) -> Check:
    """A fresh model should be equally unsure of every token: loss ~ ln(vocab_size), within a fraction."""
    vocab_size = model.config.vocab_size
    with torch.no_grad():
        _, loss_sum, n = model(x, y)
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
    _, loss_sum, n = model(x, y)
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


def check_overfit(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                  max_norm: float, device: torch.device, dtype: torch.dtype, steps: int = OVERFIT_STEPS,
                  threshold: float = OVERFIT_THRESHOLD) -> Check:
    """train.py's step, repeated on one small batch, must drive its loss below ``threshold``."""
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    guard = NonFiniteGuard(optimizer, scaler, max_skipped=steps, device=device)
    params = list(model.parameters())
    first = loss = math.nan
    for step in range(1, steps + 1):
        loss_sum, n = train.accumulate_gradients(model, [(x, y)], scaler, device, dtype)
        train.optimizer_step(optimizer, scaler, guard, params, max_norm, step, loss_sum)
        loss = (loss_sum / n).item()  # the loss before this step's update
        first = loss if step == 1 else first
        if loss < threshold:
            break
    passed = loss < threshold
    meaning = ("model, loss and optimizer step can learn" if passed else
               "cannot even memorise one batch: check the lr, zero_grad, the loss and the optimizer groups")
    return Check("overfit", passed,
                 f"{first:.3f} -> {loss:.3f} in {step} steps (need < {threshold} within {steps})", meaning)


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


# ----------------------------------------------------------------------------- running them all
def run_checks(cfg: TrainConfig) -> list[Check]:
    """Every check, on the model, data and tokenizer that ``cfg`` trains with."""
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    folder = prepare(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction)
    corpus = load_corpus(folder, cfg.block_size)
    tokenizer = tokenizer_from_meta(corpus.meta["tokenizer"], Path(cfg.data_dir))
    gpt_config = model_config(cfg, corpus.vocab_size)
    x, y = get_batch(corpus.train, cfg.batch_size, cfg.block_size, torch.Generator().manual_seed(cfg.seed), device)
    x_val, y_val = val_windows(corpus.val, cfg.block_size, max_targets=2 * cfg.block_size)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    print(f"doctor: {folder} on {device} ({str(dtype).removeprefix('torch.')}), vocab {corpus.vocab_size}, "
          f"{cfg.n_layer} layers x {cfg.n_embd} wide, block {cfg.block_size}, batch {cfg.batch_size}")

    def fresh(dropout: float | None = None) -> GPT:  # a new model per check, so no check disturbs another
        torch.manual_seed(cfg.seed)
        config = gpt_config if dropout is None else dataclasses.replace(gpt_config, dropout=dropout)
        return GPT(config).to(device)

    def optimizer_for(model: GPT) -> torch.optim.Optimizer:
        return train.build_optimizer(model, cfg, device)

    def probe(m: torch.nn.Module) -> None:  # as in train.py: compile errors surface on the first call
        _, loss, n = m(x[:1], y[:1])
        (loss / n).backward()

    dropout = cfg.dropout if cfg.dropout > 0 else FORCED_DROPOUT
    grad_model, fit_model = fresh(), fresh()
    few_x, few_y = x[:FEW_SEQUENCES], y[:FEW_SEQUENCES]
    return [
        check_init_loss(fresh(), x, y),
        check_batch(x, y, corpus.train, tokenizer),
        check_token_range({"train": corpus.train, "val": corpus.val}, gpt_config.vocab_size),
        check_round_trip(tokenizer, np.asarray(corpus.val[:SAMPLE_TOKENS])),
        check_gradients(grad_model, optimizer_for(grad_model), few_x, few_y),
        check_causal(fresh(), few_x),
        check_overfit(fit_model, optimizer_for(fit_model), x[:OVERFIT_SEQUENCES], y[:OVERFIT_SEQUENCES],
                      max_norm, device, dtype),
        check_dropout_modes(fresh(dropout), few_x),
        check_evaluate(train.evaluate, fresh(dropout), x_val, y_val, 1, device, dtype),  # 2 batches each
        check_tied(compile_or_eager(fresh(), want_compile(cfg.compile, device), probe)),
    ]


def print_table(checks: list[Check]) -> None:
    """One aligned line per check: verdict, name, measured figure, meaning."""
    name_width = max(len(c.name) for c in checks)
    measured_width = max(len(c.measured) for c in checks)
    for c in checks:
        verdict = "PASS" if c.passed else "FAIL"
        print(f"{verdict}  {c.name:<{name_width}}  {c.measured:<{measured_width}}  {c.meaning}")


def main(argv: list[str] | None = None) -> int:
    """Run every check and print the table; 0 if all pass, 1 if any fails, 2 on a config error."""
    t_start = time.time()
    try:
        cfg = parse_args(argv)
        checks = run_checks(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except DataError as err:
        print(f"FAIL  data  {err}")
        return 1
    print_table(checks)
    failed = [c.name for c in checks if not c.passed]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed in {time.time() - t_start:.1f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
