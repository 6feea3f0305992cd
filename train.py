"""Train a GPT: the textbook loop, done right.

    python train.py --config small              # char-level Shakespeare on a laptop CPU, minutes
    python train.py --config small --resume     # continue exactly where the last run stopped
    python train.py --help                      # every config field with its default
    torchrun --nproc_per_node=8 train.py --config gpt2 --grad_accum 4   # 8 GPUs, same batch (README)

Reads top to bottom: one optimizer step (train_step) -> evaluation -> build_run -> the loop (train_in_owned_folder).
Side concerns: checkpoint.py (the lock, saves, resume, --init_from), optim.py (optimizers, lr, NaN guard), runtime.py
(device, DDP), logs.py (the lines it prints, metrics.jsonl), cli.py (errors and exit codes, signals).
"""
import signal

# Ctrl-C while torch imports (seconds) ends the process, not in an import traceback; an ignored one stays ignored
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import data
import runtime
from checkpoint import Checkpointer, check_same_run, claim, start_from
from cli import ConfigError, StopOnSignal, exit_for, fail, interrupt_until_the_loop, run_error
from config import TrainConfig, model_config, parse_args
from logs import MetricsLog, check_wandb, describe_run
from model import GPT
from optim import NonFiniteGuard, build_optimizer, lr_at
from runtime import Runtime, choose_runtime, compile_for_step, refuse_what_cannot_fit, seed_everything
from tokenizer import token_byte_lengths, tokenizer_from_meta

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs and targets, (B, T) each
get_lr = lr_at  # (step from 0, cfg, time_s) -> the lr: warmup, then the lr_decay curve down to min_lr (optim.py)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every param group to lr times its lr_scale (1 for AdamW; muon_lr / learning_rate for Muon)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]


class StepLosses(NamedTuple):
    """One optimizer step's losses, summed over every micro-batch of this rank, as device tensors."""
    loss_sum: torch.Tensor  # cross-entropy: the metric, logged as "loss"
    n_targets: torch.Tensor  # targets of the whole step, every rank's: the divisor of each sum
    aux: dict[str, torch.Tensor]  # the model's auxiliary losses (ModelOutput.aux), summed alike, logged by name


def accumulate_gradients(model: torch.nn.Module, batches: list[Batch], scaler: torch.amp.GradScaler,
                         device: torch.device, dtype: torch.dtype, world_size: int = 1) -> StepLosses:
    """Forward and backward over the micro-batches of one optimizer step; returns the step's sums (no host sync).

    Each micro-batch's *summed* objective is divided by the target count of the whole step, so the accumulated
    gradient equals one big batch's even when micro-batches count different numbers of targets. DDP *averages*
    the W ranks' gradients: rank r backpropagates L_r / (N / W), so the synced gradient is grad(sum_r L_r) / N.
    """
    n_step = sum((y != -1).sum() for _, y in batches)  # this rank's targets
    if dist.is_initialized():
        dist.all_reduce(n_step)  # every rank's
    divisor = n_step / world_size
    loss_step, aux_step = torch.zeros((), device=device), {}
    for i, (x, y) in enumerate(batches):
        accumulating = isinstance(model, DistributedDataParallel) and i < len(batches) - 1
        with model.no_sync() if accumulating else contextlib.nullcontext():
            # Mixed precision for the forward only; a no-op in fp32. Weights and optimizer state stay fp32.
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                _, loss_sum, _, aux = model(x, y)
            scaler.scale((loss_sum + sum(aux.values())) / divisor).backward()  # objective: cross-entropy + aux terms
        loss_step += loss_sum.detach()  # detached: keeping the graph would hold every activation
        for name, term in aux.items():
            aux_step[name] = aux_step.get(name, 0) + term.detach()
    return StepLosses(loss_step, n_step, aux_step)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, guard: NonFiniteGuard,
                   params: list[torch.Tensor], max_norm: float, step: int, objective: torch.Tensor) -> torch.Tensor:
    """Unscale (fp16), clip, update, zero the gradients; a non-finite step is recorded. Returns the pre-clip norm."""
    scaler.unscale_(optimizer)  # no-op unless fp16; clipping must see the true gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # pre-clip norm
    guard.check(step, objective, grad_norm)  # recorded on the device; the loop stops at its next sync
    scaler.step(optimizer)  # optimizer.step(); fp16: skipped when the gradients overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)  # set_to_none: the next backward writes, not adds
    return grad_norm


def train_step(run: "Run", step_model: torch.nn.Module, batches: list[Batch], step: int, lr: float,
               world_size: int = 1) -> tuple[StepLosses, torch.Tensor]:
    """One optimizer step, numbered ``step`` (from 1), as the loop, scripts/bench.py and the doctor run it.

    ``step_model``: compiled or DDP-wrapped run.model. An optimizer with ``before_step(model, batches, step)`` gets the
    step's batches first (Sophia: docs/experiments.md). Returns the step's losses and pre-clip gradient norm.
    """
    set_lr(run.optimizer, lr)
    if hasattr(run.optimizer, "before_step"):  # an optimizer that reads the batch (docs/experiments.md: Sophia)
        run.optimizer.before_step(step_model, batches, step)  # its own forward/backward; leaves no gradient
    losses = accumulate_gradients(step_model, batches, run.scaler, run.rt.device, run.rt.dtype, world_size)
    max_norm = run.cfg.grad_clip if run.cfg.grad_clip > 0 else math.inf
    grad_norm = optimizer_step(run.optimizer, run.scaler, run.guard, list(run.model.parameters()), max_norm, step,
                               losses.loss_sum + sum(losses.aux.values()))  # the objective, as accumulated
    return losses, grad_norm


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: the loss training minimises and the number that compares across tokenizers."""
    loss: float  # mean nats per target token
    bpb: float  # bits per UTF-8 byte of the targets: loss * tokens / ln 2 / bytes; nan without a byte count
    tokens: int  # targets scored (all ranks)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x_val: torch.Tensor, y_val: torch.Tensor, batch_size: int,
             device: torch.device, dtype: torch.dtype, n_bytes: int = 0, progress: bool = False) -> EvalResult:
    """Token-weighted mean loss over the fixed val windows (N, T), in eval mode (no random draws); train mode after.

    ``n_bytes``: UTF-8 bytes of all ranks' targets, for bits per byte. Under DDP sums are added over the ranks' shards.
    """
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), torch.zeros((), device=device, dtype=torch.long)
    for i in tqdm(range(0, len(x_val), batch_size), desc="evaluating", unit="batch", disable=not progress):
        x, y = x_val[i: i + batch_size].to(device), y_val[i: i + batch_size].to(device)  # (B, T) each
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss_sum, n, _ = model(x, y)
        total += loss_sum.float()
        count += n
    model.train(was_training)
    nats, tokens = runtime.all_reduce_sum(total).item(), runtime.all_reduce_sum(count).item()
    bpb = nats / math.log(2) / n_bytes if n_bytes > 0 else math.nan
    return EvalResult(nats / tokens if tokens else math.nan, bpb, tokens)


def val_byte_count(y_val: torch.Tensor, tokenizer, device: torch.device) -> int:
    """UTF-8 bytes that the targets y_val (N, T; -1 counts nothing) decode to, summed over the ranks' shards."""
    lengths = token_byte_lengths(tokenizer)  # (vocab_size,)
    return int(runtime.all_reduce_sum(lengths[y_val[y_val >= 0]].sum().to(device)).item())


@dataclass
class Run:
    """Everything a training step uses, built by build_run (train.py, scripts/bench.py and the doctor)."""
    cfg: TrainConfig
    rt: Runtime  # device, threads, precision, compile
    corpus: data.Corpus
    x_val: torch.Tensor  # this rank's share of the fixed val windows, (N, T)
    y_val: torch.Tensor  # their targets, (N, T), -1 where padded
    val_bytes: int  # UTF-8 bytes of every rank's val targets: bits per byte's denominator
    stream: data.TrainingStream  # this rank's training batches (data.LOADERS); its state_dict is in every checkpoint
    model: GPT
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # active for fp16 only
    guard: NonFiniteGuard  # records a non-finite step; the loop stops at its next sync (optim.py)


def build_run(cfg: TrainConfig, rt: Runtime, ddp: runtime.Dist | None = None, pretrained=None) -> Run:
    """Seed -> data -> model -> optimizer, in this order wherever a run is built, so its numbers are the same."""
    refuse_what_cannot_fit(cfg, rt)  # a step too big for the device's memory: one line, before any is allocated
    ddp = ddp or runtime.Dist(device=rt.device)
    seed_everything(cfg.seed + ddp.rank)  # own dropout masks per rank; DDP copies rank 0's init
    with runtime.main_first(rt.device):  # rank 0 prepares the corpus, the others then read the cache
        corpus = data.corpus_for(cfg, pretrained.tokenizer if pretrained is not None else None)
    tokenizer = tokenizer_from_meta(corpus.meta["tokenizer"], Path(cfg.data_dir))
    x_val, y_val = (w.tensor_split(ddp.world_size)[ddp.rank]  # each rank scores its own shard
                    for w in data.eval_windows(corpus, tokenizer, cfg.block_size, cfg.eval_tokens, cfg.chat_overflow))
    stream = data.training_stream(cfg, corpus, tokenizer, ddp.rank, rt.device)  # draws from its own generator only
    model = GPT(model_config(cfg, corpus.vocab_size))
    if pretrained is not None:  # init_from: the imported weights, once their tokenizer is the corpus's
        model.load_state_dict(pretrained.weights_for(corpus.meta["tokenizer"], corpus.vocab_size))
    if cfg.lora_rank:  # LoRA: the base frozen, only low-rank adapters beside it train (finetune.py)
        markers = sorted(getattr(tokenizer, "marker_ids", {}).values())  # a chat corpus's: their rows train too
        from finetune import add_adapters
        add_adapters(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets, markers)
    model = model.to(rt.device)
    optimizer = build_optimizer(model, cfg, rt.device, rt.dtype)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    guard = NonFiniteGuard(scaler, cfg.max_skipped_steps, rt.device)
    return Run(cfg, rt, corpus, x_val, y_val, val_byte_count(y_val, tokenizer, rt.device), stream, model, optimizer,
               scaler, guard)


def halt_flags(cfg: TrainConfig, step: int, stop: StopOnSignal, t_start: float, ddp: runtime.Dist) -> tuple[bool, bool]:
    """(out of time, signalled) after ``step``. Every rank must stop on the same step (or the next collective hangs):
    they agree on log steps only, where the loop syncs anyway (runtime.agree); a signal to one rank stops all alike."""
    out_of_time, signum = runtime.agree((cfg.out_of_time(time.time() - t_start), stop.signum or 0), ddp,
                                        now=step % cfg.log_interval == 0 or step == cfg.max_iters)
    stop.signum = stop.signum or signum or None  # the signal another rank saw: its exit code and words here too
    return bool(out_of_time), bool(signum)


def train(cfg: TrainConfig, stop: StopOnSignal | None = None) -> float:
    """Run training as configured; returns the final val loss.

    ``stop`` (main() passes one) turns SIGINT/SIGTERM during the loop into "save after this step and raise
    RunStopped"; without it signals keep their usual meaning. The process (rank 0) owns out_dir while it runs.
    """
    check_wandb(cfg)  # --wandb without wandb: the same, not an empty metrics.jsonl left behind
    ddp = runtime.setup(cfg.device)  # a world of one on cfg.device without torchrun
    with runtime.stop_together(ddp.device):  # refused on rank 0: every rank stops here
        owner = claim(Path(cfg.out_dir), cfg.resume) if ddp.is_main else contextlib.nullcontext()
    with owner:  # released however the run ends (after a SIGKILL, by the kernel)
        return train_in_owned_folder(cfg, ddp, stop or StopOnSignal(install=False))


def train_in_owned_folder(cfg: TrainConfig, ddp: runtime.Dist, stop: StopOnSignal) -> float:
    """train()'s body, once this process (rank 0 for a job) owns out_dir."""
    out_dir = Path(cfg.out_dir)
    if ddp.enabled and cfg.schedule == "time":  # each rank's clock would give it its own lr: weights drift apart
        raise ConfigError("schedule=time follows one process's clock and cannot drive DDP ranks alike; "
                          "under torchrun pass --schedule steps --max_iters N --lr_decay_iters N --max_time 0")
    with runtime.stop_together(ddp.device):  # before a base is read or a corpus prepared: last.pt of another run
        resumed = check_same_run(cfg) if cfg.resume and ddp.is_main else ""  # refused; its precision (run_dtype)
    cfg, pretrained = start_from(cfg, ddp.device)  # init_from: before anything is written
    with runtime.stop_together(ddp.device):  # what the base fixes (shape, tokenizer), before its corpus is prepared
        if cfg.resume and cfg.init_from and ddp.is_main:
            check_same_run(cfg, adopted=True)
    rt = choose_runtime(cfg, ddp.device, resumed)  # threads, precision (dtype=auto: rank 0's choice), compile
    run = build_run(cfg, rt, ddp, pretrained)
    del pretrained  # its tensors now live in the model
    model, guard, device, dtype = run.model, run.guard, rt.device, rt.dtype
    checkpointer = Checkpointer(out_dir, cfg, run, ddp)  # out_dir made, a killed save's temp files removed
    with runtime.stop_together(device):  # a rank that cannot read last.pt stops them all
        step, time_before, best_val = checkpointer.resume() if cfg.resume else (0, 0.0, math.inf)
    train_model = compile_for_step(model, run.stream, rt)  # the model itself, unless compiled
    step_model = runtime.wrap(train_model, ddp)  # DDP in a world of several, train_model otherwise
    runtime.print0(describe_run(cfg, model, rt, train_model is not model, ddp.world_size, run.stream.full_rows))
    with runtime.stop_together(device):  # rank 0 alone opens the log and wandb: it may fail alone
        done = step >= cfg.max_iters or cfg.out_of_time(time_before)  # a resumed run may have nothing left to do
        log = MetricsLog(out_dir, cfg, step, model, rt, ddp.world_size, enabled=ddp.is_main, tracked=not done,
                         stop=stop)  # a closed stdout (| head) stops the run as a signal does
    t_start = time.time() - time_before  # the run's clock: max_time and schedule=time span resumes
    val_loss = math.nan

    with stop:  # from here on Ctrl-C/SIGTERM mean: finish the step, save last.pt, exit 130/143
        out_of_time, signalled = cfg.out_of_time(time_before), stop.requested  # a resumed run may be done
        while step < cfg.max_iters and not signalled and not out_of_time:
            lr = get_lr(step, cfg, time.time() - t_start)
            batches = [run.stream.next() for _ in range(cfg.grad_accum)]
            losses, grad_norm = train_step(run, step_model, batches, step + 1, lr, ddp.world_size)
            log.count(batches, losses.n_targets)  # what the step really processed, read at the next log line
            step += 1
            out_of_time, signalled = halt_flags(cfg, step, stop, t_start, ddp)
            last = step == cfg.max_iters or out_of_time
            if step % cfg.log_interval == 0 or last:  # the only place a training step syncs
                guard.raise_if_tripped()
                per_target = {name: runtime.all_reduce_sum(total) / losses.n_targets  # "loss", then each aux term
                              for name, total in {"loss": losses.loss_sum, **losses.aux}.items()}
                log.step(step, per_target, lr, grad_norm, time.time() - t_start)
            if step % cfg.eval_interval == 0 or last:
                t_eval = time.time()
                guard.raise_if_tripped()
                result = evaluate(train_model, run.x_val, run.y_val, cfg.batch_size, device, dtype, run.val_bytes)
                val_loss, is_best = result.loss, math.isfinite(result.loss) and result.loss < best_val
                best_val = val_loss if is_best else best_val
                checkpointer.last_eval = log.eval(step, val_loss, result.bpb, time.time() - t_start)
                checkpointer.save(step, time.time() - t_start, best_val, is_best)
                log.eval_line(step, val_loss, result.bpb, is_best)
                log.pause(time.time() - t_eval)  # out of the next line's ms/step, tok/s (max_time counts it)
                if not last:  # an eval that spends the budget is the final one: no extra step, no second eval
                    out_of_time, signalled = halt_flags(cfg, step, stop, t_start, ddp)
            elif cfg.ckpt_interval and step % cfg.ckpt_interval == 0:
                checkpointer.save(step, time.time() - t_start, best_val)
            if out_of_time:
                runtime.print0(f"max_time {cfg.max_time:g}s reached at step {step}; stopped cleanly")
                break
        log.close()
        if signalled and step < cfg.max_iters:  # SIGINT/SIGTERM: save the finished step, exit 130/143
            if checkpointer.saved_step != step:
                checkpointer.save(step, time.time() - t_start, best_val)
            raise stop.error(step)
    return val_loss


def main(argv: list[str] | None = None) -> None:
    """train.py's command line: every error one line with its exit code (cli.py), once per job."""
    stop = StopOnSignal()
    try:
        with interrupt_until_the_loop():  # SIGTERM before the first step ends as Ctrl-C does: one line, no folder
            train(parse_args(argv), stop)
        runtime.teardown(finished=True)
        return
    except (Exception, KeyboardInterrupt) as err:
        ending = exit_for(run_error(err, stop.finished))  # Ctrl-C outside the loop, a lost peer: what they mean
        if ending is None:  # a bug: its traceback is the report
            raise
    try:
        fail(*ending)  # the line first: under torchrun a lost rank's survivors get SIGTERM within ~30 ms
    finally:
        runtime.teardown(finished=False)  # out here the traceback, which holds the DDP model, is already gone


if __name__ == "__main__":
    main()
