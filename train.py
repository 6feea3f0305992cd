"""Train a GPT: the textbook loop, done right.

    python train.py --config small              # char-level Shakespeare on a laptop CPU, minutes
    python train.py --config small --resume     # continue exactly where the last run stopped
    python train.py --help                      # every config field with its default

Reads top to bottom: config -> data -> model -> optimizer -> (resume) -> loop -> final eval.
Side concerns live in helpers: checkpoint.py (atomic save / verified load / RNG state),
runtime.py (device, precision, compile, MFU), data.py (corpus, batches), distributed.py (DDP under
torchrun: the same loop, one process per GPU), MetricsLog below and tracking.py (wandb), and faults.py
(Ctrl-C/SIGTERM, NaN/inf, and the exit codes: 0 ok, 2 bad input, 3 non-finite, 74 write failed,
75 a DDP peer died, 130 SIGINT, 143 SIGTERM), rundir.py (one live run per out_dir; writable folders).

    torchrun --nproc_per_node=8 train.py --config gpt2 --grad_accum 4   # 8 GPUs, same batch (README)
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from checkpoint import (CheckpointError, CheckpointWriteError, capture_rng, library_versions, load_checkpoint,
                        read_config, remove_stale_temp_files, restore_rng, save_checkpoint, FORMAT_VERSION)
from config import (ConfigError, TrainConfig, as_dict, config_from_dict, given_fields, model_config, parse_args,
                    resume_changes, settings_line, unused_given)
from data import (DataError, get_batch, iterate_windows, load_corpus, prepare, token_byte_lengths, tokenizer_from_meta,
                  val_windows)
import distributed
from distributed import Dist, all_reduce_sum, print0
from faults import EXIT_BAD_INPUT, EXIT_PEER_LOST, NonFiniteGuard, RunStopped, StopOnSignal
import hf
from model import GPT, describe
from optim import DECAYS, build_optimizer
import rundir
from runtime import (autocast, compile_or_eager, fail, mfu, pick_device, pick_dtype, seed_everything, threads_text,
                     use_threads, want_compile)
import tracking


def get_lr(step: int, cfg: TrainConfig, time_s: float = 0.0) -> float:
    """Linear warmup to learning_rate over warmup_iters steps, then the lr_decay shape down to min_lr.

    The shape (optim.DECAYS: cosine, wsd, ...) is a function of the decay's progress, 0 -> 1, which the
    clock measures. schedule=steps: progress reaches 1 at lr_decay_iters (min_lr afterwards); a pure
    function of the step, so a resumed run follows exactly the same schedule. schedule=time: it reaches
    1 when ``time_s`` (the run's wall clock) reaches max_time, so a slow machine ends its budget as
    annealed as a fast one, after fewer steps (Geiping & Goldstein 2022, "Cramming", tie the schedule
    to the time budget the same way); or at max_iters, if the steps run out first.
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
    return cfg.min_lr + DECAYS[cfg.lr_decay].shape(progress, cfg) * (cfg.learning_rate - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every param group to lr times its lr_scale (1 for AdamW; muon_lr / learning_rate for Muon)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]


def accumulate_gradients(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], scaler,
                         device: torch.device, dtype: torch.dtype,
                         world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over the micro-batches of one optimizer step.

    Each micro-batch's *summed* loss is divided by the target count of the whole step, so the
    accumulated gradient equals the gradient of one big batch even when micro-batches count
    different numbers of targets (averaging per-micro-batch means would weight them wrongly).
    Under DDP the count is that of all ranks' micro-batches, the divisor compensates for DDP's
    averaging (distributed.loss_scale) and gradients are all-reduced once, on the last micro-batch.
    Returns (this rank's summed loss, global target count) of the step as tensors: no host sync.
    """
    n_step = all_reduce_sum(sum((y != -1).sum() for _, y in batches))  # every rank's targets
    divisor = distributed.loss_scale(n_step, world_size)  # n_step / world_size
    loss_step = torch.zeros((), device=device)
    for i, (x, y) in enumerate(batches):
        with distributed.sync_gradients(model, now=i == len(batches) - 1):
            with autocast(device, dtype):
                _, loss_sum, _ = model(x, y)
            scaler.scale(loss_sum / divisor).backward()
        loss_step += loss_sum.detach()  # detached: keeping the graph would hold every activation
    return loss_step, n_step


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, guard: NonFiniteGuard,
                   params: list[torch.Tensor], max_norm: float, step: int, loss_step: torch.Tensor) -> torch.Tensor:
    """Unscale (fp16), clip, update unless non-finite (no host sync), zero the gradients.

    Returns the pre-clip gradient norm as a tensor; ``step`` numbers the update as the log does.
    """
    scaler.unscale_(optimizer)  # no-op unless fp16; clipping must see the true gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # pre-clip norm
    guard.step(step, loss_step, grad_norm)  # optimizer.step(), skipped after a non-finite step
    scaler.update()
    optimizer.zero_grad(set_to_none=True)  # set_to_none: the next backward writes, not adds
    return grad_norm


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: the loss training minimises and the number that compares across tokenizers."""
    loss: float  # mean nats per target token
    bpb: float  # bits per UTF-8 byte of the targets: loss * tokens / ln 2 / bytes; nan without a byte count
    tokens: int  # targets scored (all ranks)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x_val: torch.Tensor, y_val: torch.Tensor, batch_size: int,
             device: torch.device, dtype: torch.dtype, n_bytes: int = 0, progress: bool = False) -> EvalResult:
    """Token-weighted mean loss over the fixed val windows, in eval mode; train mode restored after.

    ``n_bytes``: UTF-8 bytes of all ranks' targets (val_byte_count, counted once per corpus) for bits
    per byte. Under DDP each rank passes its own shard of the windows; sums and counts are added over
    ranks. Dropout is off in eval mode, so evaluation draws from no random stream at all.
    """
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), torch.zeros((), device=device, dtype=torch.long)
    batches = tqdm(iterate_windows(x_val, y_val, batch_size, device), total=-(-len(x_val) // batch_size),
                   desc="evaluating", unit="batch", disable=not progress)
    for x, y in batches:
        with autocast(device, dtype):
            _, loss_sum, n = model(x, y)
        total += loss_sum.float()
        count += n
    model.train(was_training)
    nats, tokens = all_reduce_sum(total).item(), all_reduce_sum(count).item()
    bpb = nats / math.log(2) / n_bytes if n_bytes > 0 else math.nan
    return EvalResult(nats / tokens if tokens else math.nan, bpb, tokens)


def val_byte_count(y_val: torch.Tensor, tokenizer, device: torch.device) -> int:
    """UTF-8 bytes that the targets y_val (N, T) decode to, summed over the ranks' shards (a collective).

    Padding (-1) counts nothing. Per-token lengths summed, never a decode of the split: cheap at any size.
    """
    lengths = token_byte_lengths(tokenizer)  # (vocab_size,)
    return int(all_reduce_sum(lengths[y_val[y_val >= 0]].sum().to(device)).item())


class MetricsLog:
    """Prints log lines and appends JSON records to out_dir/metrics.jsonl and to the tracker (tracking.py).

    Only the main process (rank 0) writes; on other ranks every method does nothing.
    """

    def __init__(self, out_dir: Path, cfg: TrainConfig, enabled: bool = True, logged_through: int | None = None,
                 tracked: bool = True):
        self.enabled = enabled
        self.file = open(out_dir / "metrics.jsonl", "a", buffering=1) if enabled else None
        # tracked=False: a resume with nothing left to do, which would open a wandb run just to log nothing.
        self.tracker = tracking.start(cfg, out_dir, logged_through) if enabled and tracked else tracking.NullTracker()

    def log(self, record: dict[str, Any], line: str) -> None:
        self.record(record)
        self.say(line)

    def record(self, record: dict[str, Any]) -> None:
        if self.enabled:
            self.file.write(json.dumps(record) + "\n")
            self.tracker.log(record)

    def say(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        self.tracker.finish()


def drop_records_after(path: Path, step: int) -> int | None:
    """Resuming redoes the steps after last.pt that a killed run had already logged: drop those.

    Returns the last step the file held before (None without a file): what a tracker already has.
    """
    if not path.is_file():
        return None
    lines = path.read_text().splitlines(keepends=True)
    steps = [json.loads(line)["step"] for line in lines if line.endswith("\n")]
    kept = [line for line, logged in zip(lines, steps) if logged <= step]
    if kept != lines:  # temp file + rename: a kill here must not lose the log
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return max(steps, default=None)


def checkpoint_state(model: GPT, optimizer, scaler, step: int, time_s: float, best_val: float, cfg: TrainConfig,
                     tokenizer_meta: dict, rng_per_rank: list[dict[str, Any]], dtype: torch.dtype) -> dict[str, Any]:
    """Everything a resume needs; built from the uncompiled model so keys carry no _orig_mod.

    ``rng_per_rank`` holds every rank's random streams (one entry in a single-process run);
    "rng" repeats rank 0's so that single-process readers need not know about ranks. "precision"
    is the dtype the run resolved (config's dtype may say "auto").
    """
    return {"format_version": FORMAT_VERSION, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "step": step,
            "time_s": time_s, "best_val_loss": best_val, "config": as_dict(cfg), "tokenizer": tokenizer_meta,
            "rng": rng_per_rank[0], "rng_per_rank": rng_per_rank, "precision": dtype_name(dtype),
            "versions": library_versions()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_probe_shape(cfg: TrainConfig) -> tuple[int, int, int]:
    """The matmul dtype=auto times on a CPU: the MLP's first, at the run's tokens per micro-batch."""
    return cfg.batch_size * cfg.block_size, cfg.n_embd, 4 * cfg.n_embd


def start_from(cfg: TrainConfig, out_dir: Path) -> tuple[TrainConfig, hf.Pretrained | None]:
    """With init_from, the config takes the pretrained model's shape; a fresh run also gets its weights.

    A resume takes the shape from last.pt's config and imports nothing: the checkpoint has the weights.
    """
    if not cfg.init_from:
        return cfg, None
    if cfg.resume:
        saved = read_config(out_dir / "last.pt") if (out_dir / "last.pt").is_file() else None
        if saved is None:  # resume() names the missing file
            return cfg, None
        shape = model_config(config_from_dict(saved), 1)
        return hf.adopt(cfg, shape, {"kind": saved["tokenizer"]}, str(out_dir / "last.pt")), None
    # GPT-2 has biases; a given bias=False imports a bias-free model's export (zero biases), refuses any other.
    bias = cfg.bias if "bias" in given_fields(cfg) else True
    pretrained = hf.load_pretrained(cfg.init_from, cfg.block_size, bias)
    cfg = hf.adopt(cfg, pretrained.config, pretrained.tokenizer, cfg.init_from)
    print0(f"init_from {cfg.init_from}: {describe(model_config(cfg, pretrained.config.vocab_size))}; "
           f"tokenizer {cfg.tokenizer}; block_size {cfg.block_size} of {pretrained.n_positions} positions")
    return cfg, pretrained


def build_model(cfg: TrainConfig, vocab_size: int, tokenizer_meta: dict, pretrained: hf.Pretrained | None) -> GPT:
    """A GPT for the corpus: randomly initialised, or holding the imported weights (init_from)."""
    model = GPT(model_config(cfg, vocab_size))
    if pretrained is not None:
        hf.check_vocab(pretrained, tokenizer_meta, vocab_size)
        model.load_state_dict(pretrained.state)
    return model


def resume(path: Path, cfg: TrainConfig, tokenizer_meta: dict, model: GPT, optimizer, scaler,
           data_gen: torch.Generator, dtype: torch.dtype, ddp: Dist = Dist(),
           corpus: dict[str, Any] | None = None) -> tuple[int, float, float]:
    """Load last.pt into the run; refuse a checkpoint of another shape, tokenizer or (``corpus``, a
    Corpus.record) other data.

    Every rank loads the same file and restores its own random streams (see rank_rng_state).
    Returns (step, wall-clock seconds the run had spent, best val loss).
    """
    state = load_checkpoint(path)
    check_resumable(path, state, cfg, tokenizer_meta, scaler.is_enabled(), dtype)
    check_same_corpus(path, state.get("corpus"), corpus)
    model.load_state_dict(state["model"])
    load_optimizer_state(optimizer, state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    rng = distributed.rank_rng_state(state, ddp)
    if rng is not None:
        try:
            restore_rng(rng, data_gen)
        except CheckpointError as err:
            raise CheckpointError(f"{path}: {err}") from None
    done = (" (max_iters reached: nothing to do)" if state["step"] >= cfg.max_iters else
            " (max_time reached: nothing to do; raise --max_time to continue)" if budget_spent(cfg, state["time_s"])
            else "")
    print0(f"resumed from {path} at step {state['step']} (best val loss {state['best_val_loss']:.4f}){done}")
    return state["step"], state["time_s"], state["best_val_loss"]


def check_resumable(path: Path, state: dict[str, Any], cfg: TrainConfig, tokenizer_meta: dict, fp16_scaler: bool,
                    dtype: torch.dtype) -> None:
    """Refuse a checkpoint this run cannot continue (shape, tokenizer, optimizer, scaler); warn where
    it can continue but not exactly as the run that was stopped."""
    changes = resume_changes(state["config"], cfg)
    differences = changes["fixed"]
    if state["tokenizer"] != tokenizer_meta:
        differences.append("tokenizer vocabulary differs from the current corpus")
    if differences:
        raise CheckpointError(f"{path} was trained with other settings: " + "; ".join(differences)
                              + ". Use the same settings or a new --out_dir")
    if bool(state["scaler"]) != fp16_scaler:  # fp16 <-> bf16/fp32: the scaler state cannot follow
        raise CheckpointError(f"{path} was trained in {state['precision']}, now {dtype_name(dtype)}; fp16 runs "
                              "carry a grad scaler, others do not: resume with --dtype " + state["precision"])
    if state["precision"] != dtype_name(dtype):
        print0(f"WARNING: {path} was trained in {state['precision']}, this run uses {dtype_name(dtype)}: "
               f"training continues but is NOT bit-exact; pass --dtype {state['precision']} for an exact resume")
    if changes["warned"]:
        print0(f"WARNING: resuming with changed settings ({'; '.join(changes['warned'])}): the new values apply "
               "from here on, so this is not the run the checkpoint started")


def check_same_corpus(path: Path, saved: dict[str, Any] | None, now: dict[str, Any] | None) -> None:
    """Refuse to resume on other data (Corpus.record of each): another train split is not the run that was
    stopped, and another val split would compare best_val_loss, and pick best.pt, across different sets.

    Checkpoints saved before the record existed carry none: they resume as before, unchecked.
    """
    if not saved or not now:
        return
    changed = [split for split in ("train", "val") if saved["fingerprint"].get(split) != now["fingerprint"][split]]
    if changed:
        raise CheckpointError(
            f"{path} was trained on {saved['source']} (val_fraction {saved['val_fraction']}), this run reads "
            f"{now['source']} (val_fraction {now['val_fraction']}): its {' and '.join(changed)} split differs. "
            "Resume with the same --data_path and --val_fraction, or start a new --out_dir")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore the moments from a checkpoint but keep this run's hyperparameters.

    load_state_dict also brings back the saved param-group settings (weight decay, betas, lr_scale);
    a resume with a new --muon_lr or --weight_decay must run with it, not silently with the old one.
    """
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, mine in zip(optimizer.param_groups, settings):
        group.update(mine)


def clock(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour on: the run's time against max_time in the step lines."""
    whole = int(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


def budget_spent(cfg: TrainConfig, time_s: float) -> bool:
    return cfg.max_time > 0 and time_s >= cfg.max_time


def halt_flags(cfg: TrainConfig, step: int, stop: StopOnSignal, t_start: float, ddp: Dist) -> tuple[bool, bool]:
    """(out of time, signalled) after ``step``: host-side flags, free in a single process.

    Under DDP every rank must stop on the same step (or the next collective hangs), so the ranks
    compare flags with one all-reduce, only on log steps where the loop syncs anyway: a signal is
    honoured within log_interval steps.
    """
    out_of_time = budget_spent(cfg, time.time() - t_start)
    if not ddp.enabled:
        return out_of_time, stop.requested
    if step % cfg.log_interval and step != cfg.max_iters:
        return False, False
    flags = all_reduce_sum(torch.tensor([out_of_time, stop.requested], dtype=torch.int32, device=ddp.device))
    return bool(flags[0]), bool(flags[1])


def train(cfg: TrainConfig, stop: StopOnSignal | None = None) -> float:
    """Run training as configured; returns the final val loss.

    ``stop`` (main() passes one) turns SIGINT/SIGTERM during the loop into "save after this step and
    raise RunStopped"; as a library, without it, signals keep their usual meaning. The process owns
    out_dir while it runs (rundir.claim, before anything is read or written): a second run there,
    fresh or --resume, is refused. Under torchrun rank 0 holds it for the job.
    """
    ddp = distributed.setup(pick_device(cfg.device))  # a world of one without torchrun
    with distributed.stop_together(ddp.device):  # refused on rank 0: every rank stops here
        owner = rundir.claim(Path(cfg.out_dir)) if ddp.is_main else contextlib.nullcontext()
    with owner:  # released however the run ends (after a SIGKILL, by the kernel)
        return train_in_owned_folder(cfg, ddp, stop or StopOnSignal(install=False))


def train_in_owned_folder(cfg: TrainConfig, ddp: Dist, stop: StopOnSignal) -> float:
    """train()'s body, once this process (rank 0 for a job) owns out_dir."""
    out_dir = Path(cfg.out_dir)
    if not cfg.resume and (out_dir / "last.pt").exists():
        raise ConfigError(f"{out_dir} already holds a run (last.pt); continue it with --resume, or start a "
                          "new one with another --out_dir (or delete the folder)")
    device = ddp.device
    threads = use_threads(cfg.threads)  # before the dtype probe, which times matmuls with them
    if ddp.enabled and cfg.schedule == "time":  # each rank's clock would give it its own lr: weights drift apart
        raise ConfigError("schedule=time follows one process's clock and cannot drive DDP ranks alike; "
                          "under torchrun pass --schedule steps --max_iters N --lr_decay_iters N")
    with distributed.main_first(device):  # rank 0 downloads pretrained weights, the others read its cache
        cfg, pretrained = start_from(cfg, out_dir)  # init_from: before anything is written
    # dtype=auto times a matmul on CPU, and ranks timing it side by side can disagree: rank 0's choice is the job's.
    dtype = distributed.decide_on_main(lambda: pick_dtype(cfg.dtype, device, dtype_probe_shape(cfg)))
    seed_everything(cfg.seed + ddp.rank)  # own dropout masks per rank; DDP copies rank 0's init
    # --- data
    with distributed.main_first(device):  # rank 0 prepares the corpus, the others then read the cache
        folder = prepare(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction,
                         block_size=cfg.block_size, text_column=cfg.text_column)
        corpus = load_corpus(folder, cfg.block_size)
    x_val, y_val = (w.tensor_split(ddp.world_size)[ddp.rank]  # each rank scores its own shard
                    for w in val_windows(corpus.val, cfg.block_size, cfg.eval_tokens))
    val_bytes = val_byte_count(y_val, tokenizer_from_meta(corpus.meta["tokenizer"], Path(cfg.data_dir)), device)
    data_gen = torch.Generator().manual_seed(cfg.seed + ddp.rank)  # the only source of this rank's data
    # --- model and optimizer
    model = build_model(cfg, corpus.vocab_size, corpus.meta["tokenizer"], pretrained).to(device)
    del pretrained  # its tensors now live in the model
    optimizer = build_optimizer(model, cfg, device, dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 only
    guard = NonFiniteGuard(optimizer, scaler, cfg.max_skipped_steps, device)  # see faults.py for the policy
    step, time_before, best_val = 0, 0.0, math.inf  # time_before: wall clock of the run before this process
    logged_through = None  # the last step a killed run had logged (its tracker already holds it)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out_dir)
    with distributed.stop_together(device):  # a rank that cannot read last.pt stops them all
        if cfg.resume:
            step, time_before, best_val = resume(out_dir / "last.pt", cfg, corpus.meta["tokenizer"], model,
                                                 optimizer, scaler, data_gen, dtype, ddp, corpus.record())
            if ddp.is_main:
                logged_through = drop_records_after(out_dir / "metrics.jsonl", step)
        elif ddp.is_main:
            (out_dir / "metrics.jsonl").unlink(missing_ok=True)

    def probe(m):  # one forward/backward at the real shape, so compile errors surface here, not mid-run
        _, loss, n = m(*get_batch(corpus.train, cfg.batch_size, cfg.block_size, torch.Generator(), device))
        (loss / n).backward()

    train_model = compile_or_eager(model, want_compile(cfg.compile, device), probe)
    step_model = distributed.wrap(train_model, ddp)  # DDP in a world of several, train_model otherwise
    tokens_per_step = cfg.tokens_per_step() * ddp.world_size  # the global batch
    print0(f"model: {model.summary()}")
    print0(settings_line(cfg))
    for warning in unused_given(cfg):
        print0(warning)
    print0(f"device {device}, {threads_text(threads)}, dtype {dtype_name(dtype)}, compile {train_model is not model}, "
           f"{tokens_per_step:,} tokens/step ({ddp.world_size} rank(s) x {cfg.tokens_per_step():,}), out_dir {out_dir}")
    with distributed.stop_together(device):  # rank 0 alone opens the log and wandb: it may fail alone
        done = step >= cfg.max_iters or budget_spent(cfg, time_before)  # a resumed run may have nothing left to do
        log = MetricsLog(out_dir, cfg, enabled=ddp.is_main, logged_through=logged_through, tracked=not done)
    params = list(model.parameters())
    flops_per_token = model.flops_per_token()  # once, not per log line: counting the parameters takes ~0.2 ms
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    t_log = time.time()
    t_start = t_log - time_before  # the run's clock: max_time and schedule=time span resumes
    step_at_log, val_loss = step, math.nan
    saved_step = step if cfg.resume else None  # the step last.pt holds
    last_eval: dict[str, float] = {}  # the latest eval, saved with each checkpoint (best.pt: the best one)

    def save(step: int, is_best: bool) -> None:
        nonlocal saved_step
        guard.raise_if_tripped()  # never save a state that a non-finite step touched
        rng_per_rank = distributed.gather_to_main(capture_rng(data_gen))  # a collective: all ranks
        saved_step = step
        with distributed.stop_together(device):  # rank 0's write failing (disk full) stops every rank here
            if ddp.is_main:
                state = checkpoint_state(model, optimizer, scaler, step, time.time() - t_start, best_val, cfg,
                                         corpus.meta["tokenizer"], rng_per_rank, dtype)
                state["last_eval"] = last_eval
                state["corpus"] = corpus.record()  # a resume on other data is refused by it
                if is_best:  # best.pt first: last.pt's best_val_loss must never name a model best.pt lacks
                    save_checkpoint(state, out_dir / "best.pt")
                save_checkpoint(state, out_dir / "last.pt")

    with stop:  # from here on Ctrl-C/SIGTERM mean: finish the step, save last.pt, exit 130/143
        signalled, out_of_time = stop.requested, budget_spent(cfg, time_before)  # a resumed run may be done
        while step < cfg.max_iters and not signalled and not out_of_time:
            lr = get_lr(step, cfg, time.time() - t_start)
            set_lr(optimizer, lr)
            batches = [get_batch(corpus.train, cfg.batch_size, cfg.block_size, data_gen, device)
                       for _ in range(cfg.grad_accum)]
            loss_step, n_step = accumulate_gradients(step_model, batches, scaler, device, dtype, ddp.world_size)
            grad_norm = optimizer_step(optimizer, scaler, guard, params, max_norm, step + 1, loss_step)
            step += 1
            out_of_time, signalled = halt_flags(cfg, step, stop, t_start, ddp)
            last = step == cfg.max_iters or out_of_time
            if step % cfg.log_interval == 0 or last:  # the only place a training step syncs
                guard.raise_if_tripped()
                loss, norm = (all_reduce_sum(loss_step) / n_step).item(), grad_norm.item()
                now = time.time()
                dt = (now - t_log) / (step - step_at_log)
                tok_s = tokens_per_step / dt
                util = mfu(flops_per_token, tok_s, device, dtype, ddp.world_size)
                t_log, step_at_log = now, step
                log.log({"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tok_s,
                         "mfu": util, "time_s": now - t_start},
                        f"step {step:>6} | loss {loss:.4f} | lr {lr:.2e} | grad norm {norm:.3f} | "
                        f"{dt * 1000:.1f} ms/step | {tok_s:,.0f} tok/s | mfu {'n/a' if util is None else f'{util:.1%}'}"
                        + (f" | {clock(now - t_start)} of {clock(cfg.max_time)}" if cfg.max_time else ""))
            if step % cfg.eval_interval == 0 or last:
                t_eval = time.time()
                guard.raise_if_tripped()
                result = evaluate(train_model, x_val, y_val, cfg.batch_size, device, dtype, val_bytes)
                val_loss, is_best = result.loss, math.isfinite(result.loss) and result.loss < best_val
                best_val = val_loss if is_best else best_val
                last_eval, t_val = {"step": step, "val_loss": val_loss, "val_bpb": result.bpb}, time.time() - t_start
                # The record before the save (a resume drops records past last.pt, so a failed save leaves
                # no trace), the line after it (it says "saved" only once that is true).
                log.record({**last_eval, "time_s": t_val})
                save(step, is_best)
                log.say(f"step {step:>6} | val loss {val_loss:.4f} | val bpb {result.bpb:.4f}"
                        + (" (best, saved best.pt)" if is_best else ""))
                t_log += time.time() - t_eval  # eval and save time is not counted as training time
                if not last:  # an eval that spends the budget is the final one: no extra step, no second eval
                    out_of_time, signalled = halt_flags(cfg, step, stop, t_start, ddp)
            elif cfg.ckpt_interval and step % cfg.ckpt_interval == 0:
                save(step, is_best=False)
            if out_of_time:
                print0(f"max_time {cfg.max_time:g}s reached at step {step}; stopped cleanly")
                break
        log.close()
        if signalled and step < cfg.max_iters:  # SIGINT/SIGTERM: save the finished step, exit 130/143
            if saved_step != step:
                save(step, is_best=False)
            raise stop.error(step)
    return val_loss


def main(argv: list[str] | None = None) -> None:
    """train.py's command line: each error is one line, printed once per job (also under torchrun)."""
    try:
        cfg = parse_args(argv)
        train(cfg, StopOnSignal())
        distributed.teardown()  # not on errors: its barrier would wait for ranks that have failed
        return
    except distributed.PeerFailed as err:  # another rank failed and prints why: this one stops silently
        message, code, rank = "", err.exit_code, None
    except (RunStopped, CheckpointWriteError, rundir.PathError) as err:  # exit codes: see faults.py
        message, code, rank = str(err), err.exit_code, distributed.reporting_rank(err)
    except (ConfigError, DataError, CheckpointError) as err:
        message, code, rank = str(err), EXIT_BAD_INPUT, distributed.reporting_rank(err)
    except RuntimeError as err:  # a peer rank died mid-collective: it cannot say why, so this rank says so
        reason = distributed.lost_peer(err)
        if reason is None:
            raise
        message, code, rank = (f"another rank died without a word (killed or crashed; gloo: {reason}), so this "
                               "one stops too; the last save is intact, continue with --resume",
                               EXIT_PEER_LOST, distributed.env_rank())
    except KeyboardInterrupt:  # Ctrl-C before the first step: nothing to save yet
        message, code = "interrupted before training started; nothing was saved", 130
        rank = distributed.reporting_rank(None)
    distributed.abandon()  # out here the traceback, which holds the DDP model, is already gone
    fail(message, code, rank)


if __name__ == "__main__":
    main()
