"""The run's records: log lines, metrics.jsonl, and experiment tracking behind one seam (Weights & Biases with
--wandb, a null object without), so the loop calls ``tracker.log(record)`` and never asks which it holds
(nanochat's DummyWandb). wandb gets metrics.jsonl's records, with the same keys and steps.

    python train.py --config small --wandb    # online if wandb finds an API key, else offline: never a prompt

wandb never blocks or crashes a run:
  - mode: WANDB_MODE if it is set; otherwise online when wandb finds an API key (WANDB_API_KEY, .netrc or its
    settings file) without prompting (``wandb.login(prompt=False)``, wandb 0.31's replacement of the deprecated
    ``wandb.api.api_key``), offline when it finds none. An offline run says in one line where it was written and
    the ``wandb sync`` command to upload it.
  - online, it first says it is checking the server and asks it once (reachable_mode, PROBE_TIMEOUT): a server
    that does not answer means offline at once, with that line; and wandb.init may take INIT_TIMEOUT seconds,
    not wandb's silent 90.
  - a wandb that cannot start is a ConfigError before the first step (exit 2), not a traceback.
  - ``--resume`` continues the same wandb run: its id is kept in out_dir/wandb_id. The steps a killed run logged
    after its last.pt are redone on resume; the run already holds them and wandb's steps only grow, so they are
    not sent again. The chart keeps the first values: the same losses (resume is bit-exact), other timings.
    Offline, each process writes its own folder under out_dir/wandb; ``wandb sync`` uploads them, in order,
    into the one run.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from config import TrainConfig, as_dict, settings_line, unused_given
from training.checkpoint import dtype_name
from training.optim import HOST_SYNCING
from process import distributed
from process.errors import ConfigError, install_hint
from process.files import atomic_write_text
from training.runtime import device_peak, mfu, threads_text

PROBE_TIMEOUT = 5.0  # seconds the wandb server may take to answer before an online run goes offline
INIT_TIMEOUT = 15.0  # seconds wandb.init may take (wandb's default: 90) before the run stops with one line
NO_WANDB = f"--wandb needs the wandb package: {install_hint('wandb')}"


class NullTracker:
    """Tracking off: every call does nothing, so the training loop needs no ``if wandb:``."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker:
    """Sends each record to a wandb run at its own step, skipping the steps the run already holds."""

    def __init__(self, run, logged_through: int | None = None):
        self.run = run
        self.logged_through = -1 if logged_through is None else logged_through

    def log(self, record: dict[str, Any]) -> None:
        if record["step"] > self.logged_through:  # wandb would refuse (and warn about) a step it has
            self.run.log(record, step=record["step"])

    def finish(self) -> None:
        self.run.finish()


def check_wandb(cfg: TrainConfig) -> None:
    """--wandb without the wandb package: ConfigError before the run's folder, data and metrics.jsonl are made.
    find_spec looks for the package without the seconds its import takes (start() imports it)."""
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(NO_WANDB)


def start(cfg: TrainConfig, out_dir: Path, logged_through: int | None = None) -> NullTracker | WandbTracker:
    """The tracker the config asks for. ``logged_through``: the last step a killed run had logged
    (MetricsLog), not sent again when the run resumes."""
    if not cfg.wandb:
        return NullTracker()
    try:
        import wandb
    except ImportError:
        raise ConfigError(NO_WANDB) from None
    id_file = out_dir / "wandb_id"  # the wandb run a --resume continues
    run_id = (id_file.read_text().strip() or None) if cfg.resume and id_file.is_file() else None
    mode = reachable_mode(wandb, choose_mode(wandb))
    # wandb waits 90 s for its server by default, silently; WANDB_INIT_TIMEOUT, if set, is the user's to choose.
    timeout = {} if os.environ.get("WANDB_INIT_TIMEOUT") else {"init_timeout": INIT_TIMEOUT}
    try:
        run = wandb.init(project=cfg.wandb_project, config=as_dict(cfg), dir=out_dir, id=run_id,
                         resume="allow" if run_id else None, mode=mode,
                         settings=wandb.Settings(console="off", disable_git=True, save_code=False, silent=True,
                                                 **timeout))
    except Exception as err:  # noqa: BLE001 - any failure of a side concern: one line, before training
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"wandb could not start ({reason}); run without --wandb, or with WANDB_MODE=offline "
                          "to log locally and `wandb sync` later") from None
    id_file.write_text(run.id + "\n")
    if run.settings.mode == "online":
        print(f"wandb: logging online to {run.url}", flush=True)
    elif run.offline:
        every_segment = out_dir / "wandb" / f"offline-run-*-{run.id}"  # one folder per (resumed) process
        print(f"wandb: offline run {run.id} written to {run.settings.sync_dir}; upload it later with "
              f"`wandb sync {every_segment}`", flush=True)
    return WandbTracker(run, logged_through if run_id else None)


def choose_mode(wandb) -> str | None:
    """None (wandb reads WANDB_MODE) when the user set it; else online with credentials, offline without.
    ``login(prompt=False, verify=False)`` reads the environment, .netrc and settings: no prompt, and no server
    round trip to verify the key (wandb.init does that once, online)."""
    if os.environ.get("WANDB_MODE"):
        return None
    return "online" if wandb.login(prompt=False, verify=False) else "offline"


def reachable_mode(wandb, mode: str | None) -> str | None:
    """``mode``, or offline when an online run's server does not answer: say so at once, never wait on it
    (an API key and no network was ~95 s of silence, then an error). A user's own WANDB_MODE=online is kept:
    an unreachable server stops the run in one line instead."""
    forced = os.environ.get("WANDB_MODE") == "online"
    if mode != "online" and not forced:
        return mode
    base_url = wandb.setup().settings.base_url  # WANDB_BASE_URL, or the host of `wandb login --host`
    print(f"wandb: going online; checking that {base_url} answers (at most {PROBE_TIMEOUT:g} s) ...", flush=True)
    reason = server_unreachable(base_url)
    if reason is None:
        return mode
    if forced:
        raise ConfigError(f"wandb cannot reach {base_url} ({reason}) and WANDB_MODE=online; unset WANDB_MODE to "
                          "log offline and `wandb sync` later, or run without --wandb")
    print(f"wandb: cannot reach {base_url} ({reason}); logging offline instead", flush=True)
    return "offline"


def server_unreachable(url: str, timeout: float = PROBE_TIMEOUT) -> str | None:
    """Why ``url`` gives no HTTP answer within ``timeout`` seconds (refused, no DNS, timed out), or None if it
    answers: any HTTP status counts. urllib honours HTTP(S)_PROXY, as wandb does."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:  # an answer, if not a welcome one: the server is there
        return None
    except (urllib.error.URLError, OSError) as err:  # URLError wraps refused / no DNS; a timeout is an OSError
        return str(getattr(err, "reason", err)) or type(err).__name__
    return None


# ----------------------------------------------------------------------------- the run's records
class MetricsLog:
    """Prints log lines and appends JSON records to out_dir/metrics.jsonl and to the tracker (wandb or none),
    with ms/step, tokens/s and MFU over the steps since the last log line (evals and saves are not training time).

    Tokens are the positions the steps really processed (``count``: every micro-batch's x.numel(), all ranks'), not
    batch_size x block_size x grad_accum: a loader's rows may be shorter (a length curriculum) or padded to the
    batch's longest (conversations; the padding is computed, so it counts, and targets_per_step says what was scored).
    Only the main process (rank 0) writes; on other ranks every method does nothing but count.
    """

    def __init__(self, out_dir: Path, cfg: TrainConfig, step: int, model, rt, world_size: int = 1,
                 enabled: bool = True, tracked: bool = True):
        """A run starting at ``step``: a fresh run's metrics.jsonl is removed, a resumed run's keeps its records
        through ``step``. ``model``: the plain model (never the compiled or DDP wrapper: its own forward runs
        eagerly and fires no DDP hook), whose GPT.flops_per_token, measured here once, is MFU's numerator; where no
        peak is known (CPU, MPS, fp32) MFU is n/a and nothing is measured (FlopCounterMode's first use imports
        torch._dynamo: seconds). ``tracked=False``: a resume with nothing left to do (no wandb run to log nothing)."""
        self.flops_per_token = model.flops_per_token() if device_peak(rt.device, rt.dtype) else 0
        self.enabled, self.max_time, self.rt, self.world_size = enabled, cfg.max_time, rt, world_size
        self.max_iters = cfg.max_iters
        self.step_then, self.t = step, time.time()  # the last log line's: what its speed is measured from
        self.device = rt.device
        self.positions, self.targets = 0, torch.zeros((), dtype=torch.long, device=rt.device)  # since the last line
        path = out_dir / "metrics.jsonl"
        logged_through = drop_records_after(path, step) if enabled and cfg.resume else None
        if enabled and not cfg.resume:
            path.unlink(missing_ok=True)
        self.file = open(path, "a", buffering=1) if enabled else None
        self.tracker = start(cfg, out_dir, logged_through) if enabled and tracked else NullTracker()

    def count(self, batches: list[tuple[torch.Tensor, torch.Tensor]], n_targets: torch.Tensor) -> None:
        """Add one step's positions (from the batches' shapes: known on the host, no sync) and targets (every
        rank's, a device tensor: added on the device, read at the next log line). Every rank, every step."""
        self.positions += sum(x.numel() for x, _ in batches)  # (B, T) each
        self.targets = self.targets + n_targets  # out of place: whatever dtype the count comes in

    def step(self, step: int, losses: dict[str, torch.Tensor], lr: float, grad_norm: torch.Tensor,
             time_s: float) -> None:
        """A training log line: the record, and the line a person reads. ``losses`` per target: "loss" (the
        cross-entropy) and each auxiliary term of the objective by name. Reads the tensors: a host sync; sums the
        ranks' positions: a collective, so every rank calls it."""
        clash = set(losses) & {"step", "lr", "grad_norm", "tokens_per_s", "tokens_per_step", "targets_per_step",
                               "mfu", "time_s", "val_loss", "val_bpb"}
        if clash:  # it would overwrite that key of metrics.jsonl, silently
            raise ValueError(f"an auxiliary loss is named {sorted(clash)[0]!r}, a key of metrics.jsonl; rename it")
        values, grad_norm = {name: value.item() for name, value in losses.items()}, grad_norm.item()
        positions = distributed.all_reduce_sum(torch.tensor(self.positions, device=self.device)).item()
        steps, targets = step - self.step_then, self.targets.item()
        self.positions, self.targets = 0, torch.zeros_like(self.targets)
        now = time.time()
        step_s = (now - self.t) / steps
        tokens_per_s = positions / steps / step_s
        self.step_then, self.t = step, now
        util = mfu(self.flops_per_token, tokens_per_s, self.rt.device, self.rt.dtype, self.world_size)
        terms = "".join(f" | {name} {value:.4g}" for name, value in values.items() if name != "loss")
        self.record({"step": step, **values, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                     "tokens_per_step": positions / steps, "targets_per_step": targets / steps, "mfu": util,
                     "time_s": time_s})
        self.say(f"step {step:>6} | loss {values['loss']:.4f}{terms} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
                 f"{step_s * 1000:.1f} ms/step | {tokens_per_s:,.0f} tok/s | "
                 f"mfu {'n/a' if util is None else f'{util:.1%}'} | "
                 f"{run_clock(time_s, step, self.max_iters, self.max_time)}")

    def eval(self, step: int, loss: float, bpb: float, time_s: float) -> dict[str, float]:
        """An eval's record; returns it without the clock, as checkpoints keep it (last_eval). Logged before
        the save: a resume drops records past last.pt, so a failed save leaves no trace."""
        result = {"step": step, "val_loss": loss, "val_bpb": bpb}
        self.record({**result, "time_s": time_s})
        return result

    def eval_line(self, step: int, loss: float, bpb: float, is_best: bool) -> None:
        """The eval's line, printed after the save: it says "saved" only once that is true."""
        best = " (best, saved best.pt)" if is_best else ""
        self.say(f"step {step:>6} | val loss {loss:.4f} | val bpb {bpb:.4f}{best}")

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (an eval, a save) out of the training time of the next log line."""
        self.t += seconds

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
    """Resuming redoes the steps after last.pt that a killed run had already logged: drop those. Returns the
    last step the file held before (None without a file): what a tracker already has."""
    if not path.is_file():
        return None
    lines = path.read_text().splitlines(keepends=True)
    steps = [json.loads(line)["step"] for line in lines if line.endswith("\n")]
    kept = [line for line, logged in zip(lines, steps) if logged <= step]
    if kept != lines:  # written whole, then renamed: a kill here must not lose the log
        atomic_write_text(path, "".join(kept))
    return max(steps, default=None)


def run_clock(time_s: float, step: int, max_iters: int, max_time: float) -> str:
    """The run's time against its end, in the step lines: "0:41 of 3:00" where max_time comes first, "0:41 of ~3:00"
    where max_iters does, at the pace of the run so far (its evals included). Host numbers only: no device sync."""
    at_max_iters = time_s / step * max_iters  # step >= 1: a log line follows a step
    if max_time and max_time <= at_max_iters:
        return f"{clock(time_s)} of {clock(max_time)}"
    return f"{clock(time_s)} of ~{clock(at_max_iters)}"


def clock(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour on: the run's time against max_time in the step lines."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


# ----------------------------------------------------------------------------- what a run says it is
def describe(config) -> str:
    """The model in one line: its sizes (the int options that are never 0), then every other option that is not
    at its default (an int option whose default 0 means "off", like a fork's attn_window, is one of those).

    "block_size 64, n_layer 3, n_head 4, n_embd 128, vocab 65; not default: activation gelu_tanh"
    """
    def is_size(f) -> bool:
        return f.type == "int" and f.name != "vocab_size" and f.default != 0

    sizes = [f"{f.name} {getattr(config, f.name)}" for f in fields(config) if is_size(f)]
    options = [f"{f.name} {getattr(config, f.name)}" for f in fields(config)
               if not is_size(f) and f.name != "vocab_size" and getattr(config, f.name) != f.default]
    return ", ".join(sizes + [f"vocab {config.vocab_size}"]) + "; not default: " + (", ".join(options) or "none")


def summary(model) -> str:
    """describe() and the parameter count: what train.py and the doctor say they are running."""
    return (f"{describe(model.config)}; {model.num_params(non_embedding=False) / 1e6:.2f}M parameters "
            "(every weight once, embeddings included)")


def host_sync_note(cfg: TrainConfig) -> str:
    """What the settings line says of an optimizer declared in training/optim.py's HOST_SYNCING."""
    return f" ({cfg.optimizer} syncs the host every step: HOST_SYNCING)" if cfg.optimizer in HOST_SYNCING else ""


def describe_run(cfg: TrainConfig, model, rt, compiled: bool, world_size: int, full_rows: bool) -> str:
    """The start-up lines: the model, the settings (and any given but unused), where and how it computes.
    ``full_rows``: the loader's batches are always (batch_size, block_size); else the line says "up to"."""
    tokens, up_to = cfg.tokens_per_step(), "" if full_rows else "up to "
    return "\n".join([f"model: {summary(model)}", settings_line(cfg) + host_sync_note(cfg), *unused_given(cfg),
                      f"device {rt.device}, {threads_text(rt.threads)}, dtype {dtype_name(rt.dtype)}, "
                      f"compile {compiled}, {up_to}{tokens * world_size:,} tokens/step ({world_size} rank(s) x "
                      f"{tokens:,}), out_dir {cfg.out_dir}"])
