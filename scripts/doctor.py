"""The doctor: the "my loss won't go down" checklist, run on your real config and data (docs/doctor.md).

    python -m scripts.doctor --config small              # same config and overrides as train.py
    python -m scripts.doctor --config chat_small         # a fine-tune: on its base's tokenizer and weights

One line per check (PASS or FAIL, the measured figure, what it means), exit 1 if any fails. The checks use the run
train.py builds (train.build_run); each returns a ``Check``, so tests call it on broken variants."""
import sys

if not __package__:  # run as a file, `python scripts/doctor.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.doctor", file=sys.stderr)
    sys.exit(2)

import copy
import dataclasses
import math
import time
from collections import Counter
from itertools import groupby
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import finetune
import train
from checkpoint import start_from
from cli import RunStopped, exit_on_errors, run_tool
from config import TrainConfig, parse_args
from data import PackedDocuments
from logs import summary
from model import GPT
from optim import NonFiniteGuard
from runtime import choose_runtime, dtype_name
from tokenizer import tokenizer_from_meta

# Allowed gap between the first loss and ln(vocab), as a fraction of it: a 0.02-std init adds about
# 0.02² · n_embd / 2 nats (0.03 for small, 0.15 for gpt2).
INIT_LOSS_TOLERANCE = 0.03
CAUSAL_TOLERANCE = 1e-5  # max |change| of a past logit when the future changes (fp32 round-off)
FEW_SEQUENCES = 4  # batch of the gradient and causal checks
OVERFIT_STEPS = 200  # step budget for memorising one sequence (small needs ~30, tiny ~70)
OVERFIT_THRESHOLD = 0.1  # nats; memorised means the loss fell below this
# The overfit lr of a random init at GPT-2 small's width (GPT-3 125M's, Brown et al. 2020), scaled as 1/width
# (muP's rule for Adam, Yang et al. 2022) up to the tiny preset's 3e-3.
RANDOM_INIT_LR, RANDOM_INIT_WIDTH, RANDOM_INIT_LR_MAX = 6e-4, 768, 3e-3
FORCED_DROPOUT = 0.1  # dropout of the evaluate check's model when the config has none
SAMPLE_TOKENS = 4096  # tokens of val text for the tokenizer round trip


@dataclasses.dataclass
class Check:
    name: str
    passed: bool
    measured: str  # the figure the verdict rests on
    meaning: str  # one line: what a pass shows, or where a failure points


def verdict(name: str, passed: bool, measured: str, shows: str, points_to: str) -> Check:
    return Check(name, passed, measured, shows if passed else points_to)


def window_starts(data: np.ndarray, window: np.ndarray) -> np.ndarray:
    starts = np.flatnonzero(data[: len(data) - len(window) + 1] == window[0])
    for offset in range(1, len(window)):
        starts = starts[data[starts + offset] == window[offset]]  # keep the starts that still match
    return starts


def stretches_of(stream) -> Callable[[np.ndarray], list[np.ndarray]]:
    """The parts of a training row (T + 1,) read straight from the split: one per packed document, else one."""
    if type(stream) is PackedDocuments:
        return lambda row: np.split(row, np.flatnonzero(row[1:] == stream.separator) + 1)
    return lambda row: [row]


def check_batch(x: torch.Tensor, y: torch.Tensor, data: np.ndarray, tokenizer,
                stretches: Callable[[np.ndarray], list[np.ndarray]] = lambda row: [row]) -> Check:
    """Targets are the inputs shifted left by one, and each of the row's ``stretches`` occurs in the data. Targets of
    -1 (a chat's prompt and padding) are masked: the shift is checked between learned targets only."""
    x, y = x.cpu(), y.cpu()
    learned = y != -1  # (B, T)
    both = learned[:, :-1] & learned[:, 1:]  # positions t whose x[:, t + 1] is surely the row's own token
    shifted = not both.any() or torch.equal(x[:, 1:][both], y[:, :-1][both])  # y[:, t] must be x[:, t + 1]
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


def check_round_trip(tokenizer, ids: np.ndarray) -> Check:
    """encode(decode(ids)) gives back the same ids. Cut at newlines (a BPE merge cut in half at either end would
    fail a correct tokenizer); each stretch between special tokens makes the trip alone, as it was encoded."""
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


def check_init_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> Check:
    with torch.no_grad():
        _, loss_sum, n, _ = model(x, y)
    loss, expected = (loss_sum / n).item(), math.log(model.config.vocab_size)
    allowed = INIT_LOSS_TOLERANCE * expected
    return verdict("init loss", abs(loss - expected) <= allowed,
                   f"{loss:.4f} vs ln({model.config.vocab_size}) = {expected:.4f} ± {allowed:.3f}",
                   "a fresh model spreads its bets evenly over the vocabulary",
                   "init too large (over-confident), wrong vocab size, or a mis-reduced loss (shapes, sum vs mean)")


def graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
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
    model.zero_grad(set_to_none=True)
    _, loss_sum, n, _ = model(x, y)
    loss = loss_sum / n
    registered = {id(p) for p in model.parameters()}
    # A tensor the loss uses that the model does not register (a plain list) is never moved, saved or trained.
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


def check_causal(model: GPT, x: torch.Tensor) -> Check:
    model.eval()
    cut = max(1, x.shape[1] // 2)  # block_size 1: one position, no future to leak (was an empty max())
    changed = torch.cat([x[:, :cut], (x[:, cut:] + 1) % model.config.vocab_size], dim=1)  # every future token differs
    with torch.no_grad():
        diff = (model(x)[0][:, :cut] - model(changed)[0][:, :cut]).abs().max().item()  # logits (B, cut, vocab)
    model.train()
    return verdict("causal", diff <= CAUSAL_TOLERANCE, f"max |Δ past logit| {diff:.1e} (limit {CAUSAL_TOLERANCE:.0e})",
                   "position t sees only tokens 0..t",
                   "the attention mask leaks the future: train loss drops, generation is garbage")


def check_overfit(run: train.Run, x: torch.Tensor, y: torch.Tensor, lr: float, steps: int = OVERFIT_STEPS) -> Check:
    first = loss = math.nan
    for step in range(1, steps + 1):
        losses, _ = train.train_step(run, run.model, [(x, y)], step, lr)
        loss = (losses.loss_sum / losses.n_targets).item()  # the loss before this step's update
        first = loss if step == 1 else first
        if loss < OVERFIT_THRESHOLD:
            break
    measured = f"{first:.3f} -> {loss:.3f} in {step} steps at lr {lr:.1e} (need < {OVERFIT_THRESHOLD} within {steps})"
    return verdict("overfit", loss < OVERFIT_THRESHOLD, measured, "model, loss and optimizer step can learn",
                   "cannot even memorise one batch: check the lr, zero_grad, the loss and the optimizer groups")


def overfit_run(cfg: TrainConfig, rt, pretrained=None) -> train.Run:
    """train.build_run's run at the overfit lr, with a guard that stops only after OVERFIT_STEPS fp16 skips in a row."""
    run = train.build_run(dataclasses.replace(cfg, learning_rate=overfit_lr(cfg)), rt, pretrained=pretrained)
    return dataclasses.replace(run, guard=NonFiniteGuard(run.scaler, OVERFIT_STEPS, rt.device))


def overfit_lr(cfg: TrainConfig) -> float:
    """The config's lr; a fine-tune's (init_from) is too small to memorise a batch: a random init's at this width."""
    random_init_lr = min(RANDOM_INIT_LR_MAX, RANDOM_INIT_LR * RANDOM_INIT_WIDTH / cfg.n_embd)
    return random_init_lr if cfg.init_from else cfg.learning_rate


def check_nonfinite_gradient(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                             max_norm: float, device: torch.device, dtype: torch.dtype) -> Check:
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


def check_evaluate(evaluate: Callable[..., train.EvalResult], model: GPT, x_val: torch.Tensor, y_val: torch.Tensor,
                   batch_size: int, device: torch.device, dtype: torch.dtype) -> Check:
    """``model`` needs dropout > 0, so that a missing model.eval() changes the answer."""
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
    wte, head = model.transformer.wte, model.lm_head
    if isinstance(wte, finetune.TrainedRows):  # LoRA's trained rows (a chat's markers) wrap the frozen tied weight
        wte, head = wte.embedding, head.rows.head
    wte, head = wte.weight, head.weight
    same_param, same_storage = wte is head, wte.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    measured = (f"{'one Parameter' if same_param else 'two Parameters'}, "
                f"{'one storage' if same_storage else 'two storages'} on {wte.device}")
    return verdict("tied weights", same_param and same_storage, measured, "embedding and head train as one matrix",
                   "tying came apart (or was done by sharing .data): a move or cast gives two matrices")


def run_checks(cfg: TrainConfig) -> list[Check]:
    """Every check, on the run train.py builds for ``cfg`` (a step's on a copy of its model)."""
    cfg, pretrained = start_from(cfg)
    rt = choose_runtime(cfg)  # train.py's device, threads, precision and compile
    device, dtype = rt.device, rt.dtype
    run = train.build_run(cfg, rt, pretrained=pretrained)
    corpus, stream, gpt_config = run.corpus, run.stream, run.model.config
    tokenizer = tokenizer_from_meta(corpus.meta["tokenizer"], Path(cfg.data_dir))
    x, y = stream.first_batch()  # (B, T) each: the run's first batch; no random stream moves
    print(f"doctor: {corpus.folder} on {device} ({dtype_name(dtype)}), batch {cfg.batch_size}; model: "
          f"{summary(run.model)}")

    def fresh(dropout: float = cfg.dropout) -> GPT:  # a new random init, for checks of the model's code alone
        torch.manual_seed(cfg.seed)
        return GPT(dataclasses.replace(gpt_config, dropout=dropout)).to(device)

    def trainable() -> tuple[GPT, torch.optim.Optimizer]:  # the run's own model as it starts, made per check
        model = copy.deepcopy(run.model)
        return model, train.build_optimizer(model, cfg, device, dtype)

    few_x, few_y = x[:FEW_SEQUENCES], y[:FEW_SEQUENCES]
    return [
        check_init_loss(fresh(), x, y),
        check_batch(x, y, corpus.train, tokenizer, stretches_of(stream)),
        check_round_trip(tokenizer, np.asarray(corpus.val[:SAMPLE_TOKENS])),
        check_gradients(*trainable(), few_x, few_y),
        check_causal(copy.deepcopy(run.model), few_x),
        check_overfit(overfit_run(cfg, rt, pretrained=pretrained), x[:1], y[:1], overfit_lr(cfg)),
        check_nonfinite_gradient(*trainable(), few_x, few_y, cfg.grad_clip or math.inf, device, dtype),
        check_evaluate(train.evaluate, fresh(cfg.dropout or FORCED_DROPOUT), run.x_val[:2], run.y_val[:2], 1, device,
                       dtype),
        check_tied(run.model),
    ]


def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    with exit_on_errors():  # bad config or data: one line and its exit code, as in train.py
        checks = run_checks(parse_args(argv, __doc__.split("\n")[0] + " Takes train.py's flags."))
    name_width, measured_width = (max(len(getattr(c, key)) for c in checks) for key in ("name", "measured"))
    for c in checks:
        print(f"{'PASS' if c.passed else 'FAIL'}  {c.name:<{name_width}}  {c.measured:<{measured_width}}  {c.meaning}")
    failed = [c.name for c in checks if not c.passed]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed in {time.time() - t_start:.1f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    run_tool(main)
