"""What a run says: its start-up lines, then a line and a metrics.jsonl record per log step (its MFU among them),
and wandb's copy."""
import errno
import importlib.util
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import torch

from cli import EXIT_WRITE_FAILED, ConfigError, DataError, StopOnSignal, TinyGPTError, install_hint, silence_stdout
from config import (DEFAULTS, FIELD_TYPES, MODEL_OPTIONS, RESUME, USED_ONLY_UNDER, TrainConfig, as_dict, describe,
                    given_fields, unused_fields)
from runtime import all_reduce_sum, atomic_write, dtype_name, one_line, stop_together

# ----------------------------------------------------------------------------- the run's records
class MetricsLog:
    """Log lines and records (metrics.jsonl, the tracker), written by rank 0 (``enabled``) alone; a resume keeps the
    records through ``step``. ``model``: the plain one, whose flops_per_token is measured where a peak is known."""

    def __init__(self, out_dir: Path, cfg: TrainConfig, step: int, model, rt, world_size: int = 1,
                 enabled: bool = True, tracked: bool = True, stop: StopOnSignal | None = None):
        self.flops_per_token = model.flops_per_token() if device_peak(rt.device, rt.dtype) else 0
        self.enabled, self.cfg, self.rt, self.world_size = enabled, cfg, rt, world_size
        self.stop = stop or StopOnSignal(install=False)  # a closed stdout asks it to stop the run, as SIGPIPE
        self.step_then, self.t = step, time.time()  # the last log line's: what its speed is measured from
        self.positions, self.targets = 0, torch.zeros((), dtype=torch.long, device=rt.device)  # since the last line
        self.path = out_dir / "metrics.jsonl"
        with one_line(out_dir, "--out_dir"):  # a full disk (or no inode left) under a resume's rewrite or a new log
            logged_through = drop_records_after(self.path, step) if enabled and cfg.resume else None
            if enabled and not cfg.resume:
                self.path.unlink(missing_ok=True)
            self.file = open(self.path, "ab", buffering=0) if enabled else None  # unbuffered: on disk, or it raises
        self.tracker = start(cfg, out_dir, logged_through) if enabled and tracked else NullTracker()

    def count(self, batches: list[tuple[torch.Tensor, torch.Tensor]], n_targets: torch.Tensor) -> None:
        """Add one step's positions (host shapes, no sync) and targets (a device tensor). Every rank, every step."""
        self.positions += sum(x.numel() for x, _ in batches)  # (B, T) each
        self.targets = self.targets + n_targets  # out of place: whatever dtype the count comes in

    def step(self, step: int, losses: dict[str, torch.Tensor], lr: float, grad_norm: torch.Tensor,
             time_s: float) -> None:
        """A training record and line; ``losses``: "loss" and each auxiliary term. A collective: every rank calls it."""
        clash = set(losses) & {"step", "lr", "grad_norm", "tokens_per_s", "tokens_per_step", "targets_per_step",
                               "mfu", "time_s", "val_loss", "val_bpb"}
        if clash:  # it would overwrite that key of metrics.jsonl, silently
            raise ValueError(f"an auxiliary loss is named {sorted(clash)[0]!r}, a key of metrics.jsonl; rename it")
        values, grad_norm = {name: value.item() for name, value in losses.items()}, grad_norm.item()
        positions = all_reduce_sum(torch.tensor(self.positions, device=self.rt.device)).item()
        steps, targets = step - self.step_then, self.targets.item()
        self.positions, self.targets = 0, torch.zeros_like(self.targets)
        now = time.time()
        step_s = (now - self.t) / steps
        tokens_per_s = positions / steps / step_s
        self.step_then, self.t = step, now
        util = mfu(self.flops_per_token, tokens_per_s, self.rt.device, self.rt.dtype, self.world_size)
        self.record({"step": step, **values, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                     "tokens_per_step": positions / steps, "targets_per_step": targets / steps, "mfu": util,
                     "time_s": time_s})
        # "0:41 of 3:00" where max_time ends the run first, "0:41 of ~3:00" where max_iters does, at the pace so far
        at_max_iters, max_time = time_s / step * self.cfg.max_iters, self.cfg.max_time
        end = clock(max_time) if max_time and max_time <= at_max_iters else f"~{clock(at_max_iters)}"
        terms = "".join(f" | {name} {value:.4g}" for name, value in values.items() if name != "loss")
        self.say(f"step {step:>6} | loss {values['loss']:.4f}{terms} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
                 f"{step_s * 1000:.1f} ms/step | {tokens_per_s:,.0f} tok/s | "
                 f"mfu {'n/a' if util is None else f'{util:.1%}'} | {clock(time_s)} of {end}")

    def eval(self, step: int, loss: float, bpb: float, time_s: float) -> dict[str, float]:
        """Record an eval (before the save: a resume drops records past last.pt); returns it as checkpoints keep it."""
        result = {"step": step, "val_loss": loss, "val_bpb": bpb}
        self.record({**result, "time_s": time_s})
        return result

    def eval_line(self, step: int, loss: float, bpb: float, is_best: bool) -> None:
        """The eval's line, printed after the save: it says "saved" only once that is true."""
        best = " (best, saved best.pt)" if is_best else ""
        self.say(f"step {step:>6} | val loss {loss:.4f} | val bpb {bpb:.4f}{best}")

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (an eval, a save) out of the next line's training time."""
        self.t += seconds

    def record(self, record: dict[str, Any]) -> None:
        with stop_together(self.rt.device):  # every rank calls it: rank 0's failed write (a full disk) stops all
            if self.enabled:
                line = (json.dumps(record) + "\n").encode()
                try:
                    if self.file.write(line) != len(line):  # part of it: the disk filled mid-record
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                except OSError as err:  # one line and 74, as for a checkpoint; the last save is whole
                    raise TinyGPTError(f"could not write {self.path} ({err.strerror or err}); the last save is intact: "
                                       "free some space, then continue with --resume", EXIT_WRITE_FAILED) from None
                self.tracker.log(record)

    def say(self, line: str) -> None:
        if self.enabled:
            try:
                print(line, flush=True)
            except OSError:  # stdout closed (| head) or full: the run stops as on a signal, saving last.pt first
                silence_stdout()
                self.stop.handle(signal.SIGPIPE, None)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        self.tracker.finish()


def drop_records_after(path: Path, step: int) -> int | None:
    """Drop records a killed run logged after last.pt's ``step``, and blank lines; returns the last step the file held
    (or None). A line that is no record (a damaged or edited file) stops the resume in one line, the file untouched."""
    if not path.is_file():
        return None
    text, records = path.read_bytes(), []  # (line, its step)
    *lines, cut_short = text.split(b"\n")  # the last piece: b"", or a line a kill cut short (dropped)
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append((line + b"\n", int(json.loads(line)["step"])))
            except (ValueError, KeyError, TypeError, OverflowError):  # not UTF-8, not JSON, not a record (Infinity)
                raise DataError(f"{path}, line {number}: not a record of this run's log; mend the line or move the "
                                "file away, then --resume again") from None
    kept = b"".join(line for line, logged in records if logged <= step)
    if kept != text:  # written whole: a kill here must not lose the log
        atomic_write(path, lambda f: f.write(kept))
    return max((logged for _, logged in records), default=None)


def clock(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour on."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


# Tracking behind one seam (nanochat's DummyWandb). wandb never prompts: offline without a key, one line if it cannot
# start; --resume continues the wandb run in out_dir/wandb_id without resending the steps it holds.
class NullTracker:
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
    """--wandb without the package: refused before anything is made (find_spec: no slow import)."""
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--wandb needs the wandb package: {install_hint('wandb')}")


def start(cfg: TrainConfig, out_dir: Path, logged_through: int | None = None) -> NullTracker | WandbTracker:
    """The tracker cfg asks for; ``logged_through``: the last step a killed run logged, not resent on resume."""
    if not cfg.wandb:
        return NullTracker()
    import wandb  # check_wandb made sure it is there
    id_file = out_dir / "wandb_id"
    run_id = (id_file.read_text().strip() or None) if cfg.resume and id_file.is_file() else None
    # The user's WANDB_MODE is wandb's to read; else online where wandb finds a key (no prompt, no round trip).
    mode = None if os.environ.get("WANDB_MODE") else "online" if wandb.login(prompt=False, verify=False) else "offline"
    timeout = {} if os.environ.get("WANDB_INIT_TIMEOUT") else {"init_timeout": 15.0}  # wandb's default: 90 s, silent
    try:
        settings = wandb.Settings(console="off", disable_git=True, save_code=False, silent=True, **timeout)
        run = wandb.init(project=cfg.wandb_project, config=as_dict(cfg), dir=out_dir, id=run_id,
                         resume="allow" if run_id else None, mode=mode, settings=settings)
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


# ----------------------------------------------------------------------------- model FLOPs utilisation
# Dense bf16/fp16 tensor-core FLOP/s, fp32 accumulate, from NVIDIA's datasheets; the first match wins.
PEAK_FLOPS_16BIT: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.5e12), ("H200", 989.5e12), ("H100 NVL", 835.5e12), ("H100.*PCIe", 756.5e12), ("H100", 989.5e12),
    ("A100", 312e12), ("L40S", 362.05e12), ("RTX 4090", 165.2e12), ("RTX 3090", 71e12),
    ("V100S", 130e12), ("V100.*PCIE", 112e12), ("V100", 125e12),  # Volta: fp16 only, no bf16
)


def peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """A GPU's datasheet peak in ``dtype``, or None (fp32, unknown GPUs, bf16 on Volta): never a guessed MFU."""
    if dtype not in (torch.bfloat16, torch.float16) or (dtype == torch.bfloat16 and "V100" in device_name):
        return None
    return next((flops for pattern, flops in PEAK_FLOPS_16BIT if re.search(pattern, device_name, re.IGNORECASE)), None)


def device_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    return peak_flops(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None


def mfu(flops_per_token: float, tokens_per_s: float, device: torch.device, dtype: torch.dtype,
        world_size: int = 1) -> float | None:
    """Model FLOPs utilisation (PaLM, Chowdhery et al. 2022, app. B) of the job over its GPUs; None without a peak."""
    peak = device_peak(device, dtype)
    return None if peak is None else flops_per_token * tokens_per_s / (peak * world_size)


# ----------------------------------------------------------------------------- what a run says it is
def summary(model) -> str:
    return (f"{describe(model.config)}; {model.num_params(non_embedding=False) / 1e6:.2f}M parameters "
            "(every weight once, embeddings included)")


def unused_given(cfg: TrainConfig) -> list[str]:
    return [f"WARNING: {name} is set ({getattr(cfg, name)!r}) but unused: {chooser}={getattr(cfg, chooser)} "
            f"does not read it ({chooser}={'|'.join(readers)} does)"
            for name in sorted(unused_fields(cfg) & given_fields(cfg)) for chooser, readers in [USED_ONLY_UNDER[name]]]


def settings_line(cfg: TrainConfig) -> str:
    """The choices, the step count, then the fields off their default that shape training (not free)."""
    always, unused = ("optimizer", "lr_decay", "schedule", "max_iters"), unused_fields(cfg)
    rest = [name for name in FIELD_TYPES if name not in always and name not in MODEL_OPTIONS and name not in unused
            and RESUME[name] != "free" and getattr(cfg, name) != DEFAULTS[name]]
    return "settings: " + ", ".join(f"{name} {getattr(cfg, name)}" for name in (*always, *rest))


def threads_text(count: int) -> str:
    return f"{count} thread" + ("" if count == 1 else "s")


def describe_run(cfg: TrainConfig, model, rt, compiled: bool, world_size: int, full_rows: bool) -> str:
    """The start-up lines: model, settings (and any given but unused), where and how it computes."""
    tokens, up_to = cfg.tokens_per_step(), "" if full_rows else "up to "
    return "\n".join([f"model: {summary(model)}", settings_line(cfg), *unused_given(cfg),
                      f"device {rt.device}, {threads_text(rt.threads)}, dtype {dtype_name(rt.dtype)}, "
                      f"compile {compiled}, {up_to}{tokens * world_size:,} tokens/step ({world_size} rank(s) x "
                      f"{tokens:,}), out_dir {cfg.out_dir}"])
