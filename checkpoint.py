"""Checkpoints: out_dir's lock, last.pt and best.pt written whole and verified, the resume, weights for use.

A checkpoint is torch.save's zip archive (``torch.load(weights_only=True)`` reads it: a malicious pickle runs no code)
with the archive's sha256 as its zip comment, checked before anything is unpickled: torch.load checks no CRC."""
import argparse
import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import random
import re
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import runtime
from cli import CheckpointError, CheckpointWriteError, ConfigError, HFError, PathError, TinyGPTError
from config import (DEFAULTS, FIELD_TYPES, REPO, RESUME, TrainConfig, as_dict, describe, given_fields, model_config,
                    unused_fields)
from model import GPT
from runtime import TEMP_MARK, Dist, atomic_write, dtype_name, print0
from tokenizer import tokenizer_from_meta

if TYPE_CHECKING:
    import finetune
    from data import TrainingStream

FORMAT_VERSION = 2  # 2: time_s added
REQUIRED_KEYS = ("format_version", "model", "optimizer", "scaler", "step", "time_s", "best_val_loss", "config",
                 "tokenizer", "rng", "rng_per_rank", "precision", "versions", "last_eval", "corpus")
RNG_STREAMS = ("python", "numpy", "torch_cpu", "torch_cuda", "data")

DIGEST_PREFIX = b"tinygpt-sha256:"  # the zip comment: this, then the archive's sha256 in hex (64 digits)
COMMENT_START = (len(DIGEST_PREFIX) + 64).to_bytes(2, "little") + DIGEST_PREFIX  # its length, then the prefix


# ----------------------------------------------------------------------------- a verified file
def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` atomically, its sha256 as zip comment; a failed write (disk full): CheckpointWriteError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(f) -> None:
        digest = hashlib.sha256()  # of the bytes on their way to disk: no second read
        torch.save(state, SimpleNamespace(write=lambda data: digest.update(data) or f.write(data), flush=f.flush))
        f.seek(-2, os.SEEK_END)  # the archive ends with its comment's length, 0: now the digest's
        f.write(COMMENT_START + digest.hexdigest().encode())

    try:
        atomic_write(path, write)
    except (OSError, RuntimeError) as err:  # "No space left on device" where the OS said so, however wrapped
        cause = next((e for e in (err, err.__cause__, err.__context__) if isinstance(e, OSError) and e.errno), None)
        reason = os.strerror(cause.errno) if cause else (str(err).strip().splitlines() or [type(err).__name__])[0]
        kept = f"the previous {path.name} is intact" if path.exists() else f"no {path.name} was written"
        raise CheckpointWriteError(f"could not write {path} ({reason[:200]}); {kept} and no temp file is left") from err


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The state saved in ``path``, its digest checked before weights_only unpickling; else CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        size = path.stat().st_size  # the file must end with the sha256 save_checkpoint stored, and match it
        with open(path, "rb") as f:
            f.seek(max(0, size - len(COMMENT_START) - 64))
            if (end := f.read())[:-64] != COMMENT_START:
                raise CheckpointError(f"{path}: not a tinygpt checkpoint, or truncated ({size} bytes and no "
                                      "integrity digest at the end)")
            digest, remaining = hashlib.sha256(), size - len(end)  # the archive, up to its comment's length
            f.seek(0)
            while remaining > 0 and (chunk := f.read(min(1 << 24, remaining))):  # empty: shrank, a mismatch
                digest.update(chunk)
                remaining -= len(chunk)
    except OSError as err:  # another user's file (permissions), a failing disk
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    digest.update(b"\0\0")  # the comment's length as torch.save wrote it, which the digest covers
    if digest.hexdigest().encode() != end[-64:]:
        raise CheckpointError(f"{path}: corrupt checkpoint (sha256 mismatch: the file changed after it was saved)")
    try:
        with warnings.catch_warnings():  # torch warns about a pickle protocol it then refuses: the error says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - the unpickler raises many types; all mean "refuse"
        raise CheckpointError(f"{path}: refused to load ({unpickler_reason(err)})") from None
    if not isinstance(state, dict) or "format_version" not in state:
        raise CheckpointError(f"{path}: not a tinygpt checkpoint (no format_version)")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing or state["format_version"] != FORMAT_VERSION or isinstance(state["rng"].get("data"), torch.Tensor):
        raise CheckpointError(f"{path}: written by an older tinygpt (format {state['format_version']}"
                              + (f", no {', '.join(missing)}" if missing else "") + "); continue or sample it with "
                              "the commit that wrote it (its versions.git_commit), or start a new run")
    return state


def unpickler_reason(err: Exception) -> str:
    """What torch.load rejected, in one line: the unpickler's reason without torch's advice about weights_only (on
    its own line, or after "WeightsUnpickler error:"); for a file that is no pickle, the error's type and first line."""
    text = str(err)
    if not text.startswith("Weights only load failed"):
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        return f"{type(err).__name__}: {first}"[:300] if first else type(err).__name__
    lines = (line.split("WeightsUnpickler error:")[-1].removeprefix("Weights only load failed.").strip()
             for line in text.splitlines())
    reason = next((line for line in lines if line and "weights_only" not in line
                   and not line.startswith("This file can still be loaded")), "")
    reason = re.split(r"(?<=\.)\s", reason)[0]  # the first sentence: the rest is advice to allow the global
    return reason[:300] or "the weights_only unpickler refused it; torch gave no reason"


# ----------------------------------------------------------------------------- what a run saves, and its resume
def restore_rng(rng: dict[str, Any], stream: "TrainingStream") -> None:
    """Put every random stream back, as Checkpointer.save captured them (Checkpointer.resume has checked each)."""
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available() and rng["torch_cuda"]:
        torch.cuda.set_rng_state_all(rng["torch_cuda"])
    stream.load_state_dict(rng["data"])


def git(*args: str, cwd: Path = REPO) -> str:
    """A git command's output, or "" where there is no git, no repository or no answer in 5 s."""
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.cache  # two subprocesses: once per run is enough, not once per save
def git_state() -> dict[str, Any]:
    """The commit the running code is at and whether tracked files differ from it ("" and False without git)."""
    return {"git_commit": git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def resume_changes(saved: dict[str, Any], cfg: TrainConfig) -> dict[str, list[str]]:
    """The fields ``saved`` (a checkpoint's config) has otherwise, by rule, but those this run does not read."""
    lacked = [f"{name}: checkpoint {value!r}, a field this code lacks (the code that wrote it resumes it)"
              for name, value in saved.items() if name not in DEFAULTS and name != "given"]  # renamed or removed
    saved, unused = {**DEFAULTS, **saved}, unused_fields(cfg)
    changes: dict[str, list[str]] = {"fixed": lacked, "warned": []}
    for name, resume in RESUME.items():
        if name == "bpe_vocab_size" and cfg.init_from:  # a base's tokenizer fixes it: compared as the tokenizer
            continue
        if resume in changes and saved[name] != getattr(cfg, name) and name not in unused:
            changes[resume].append(f"{name}: checkpoint {saved[name]!r} vs now {getattr(cfg, name)!r}")
    if bool(saved["init_from"]) != bool(cfg.init_from):  # free (a moved base), but weights or none is another run
        changes["fixed"].append(f"init_from: checkpoint {saved['init_from']!r} vs now {cfg.init_from!r}")
    return changes


def other_run(path: Path, differences: list[str]) -> CheckpointError:
    return CheckpointError(f"{path} was trained with other settings: " + "; ".join(differences)
                           + ". Use the same settings or a new --out_dir")


def check_same_run(cfg: TrainConfig, adopted: bool = False) -> str:
    """--resume: refuse another run's last.pt by its config alone, before a base is read or a corpus prepared (with
    --init_from on both sides, what the base fixes is compared once ``adopted``); returns its precision."""
    path = Path(cfg.out_dir) / "last.pt"
    state = load_checkpoint(path)  # read again by the resume: not held meanwhile, as the model is built beside it
    if state["corpus"] is None:  # scripts/import_hf.py's weights: no run behind them
        raise CheckpointError(f"{path} holds imported weights, no run to resume; start from them with --init_from "
                              f"{cfg.out_dir} and another --out_dir")
    saved = state["config"]
    changed = [] if cfg.init_from and saved.get("init_from") and not adopted else resume_changes(saved, cfg)["fixed"]
    if bool(saved.get("data_path")) != bool(cfg.data_path):  # free (a moved file), but file or built-in: another run
        changed.insert(0, f"data_path: checkpoint {saved.get('data_path', '')!r} vs now {cfg.data_path!r}")
    from prepare import is_tokenized_folder  # a resume's: train.py has it loaded, sampling never does
    own_split = cfg.data_path and is_tokenized_folder(Path(cfg.data_path))  # its own split: val_fraction unused
    if saved["val_fraction"] != cfg.val_fraction and not own_split:  # free for that folder, else another val split
        changed.append(f"val_fraction: checkpoint {saved['val_fraction']!r} vs now {cfg.val_fraction!r}")
    if changed:
        raise other_run(path, changed)
    return state["precision"]


def check_resumable(path: Path, state: dict[str, Any], cfg: TrainConfig, corpus, fp16_scaler: bool,
                    dtype: torch.dtype) -> None:
    """Refuse a checkpoint this run cannot continue (shape, tokenizer, optimizer, scaler, data: another val split
    would pick best.pt across different sets); warn where it continues, but not exactly."""
    changes = resume_changes(state["config"], cfg)
    if state["tokenizer"] != corpus.meta["tokenizer"]:
        changes["fixed"].append("the corpus's tokenizer differs (another --tokenizer, or a text with other characters)")
    if changes["fixed"]:
        raise other_run(path, changes["fixed"])
    saved, now = state["corpus"], corpus.record()
    changed = [split for split in ("train", "val") if saved["fingerprint"].get(split) != now["fingerprint"][split]]
    if changed and (saved["source"], saved["val_fraction"]) == (now["source"], now["val_fraction"]):
        raise CheckpointError(f"{path} was trained on {now['source']}, whose {' and '.join(changed)} split has "
                              "changed since (rewritten or prepared again: the fingerprint differs); resume on the "
                              "tokens it trained on, or start a new --out_dir")
    if changed:
        raise CheckpointError(
            f"{path} was trained on {saved['source']} (val_fraction {saved['val_fraction']}), this run reads "
            f"{now['source']} (val_fraction {now['val_fraction']}): its {' and '.join(changed)} split differs. "
            "Resume with the same --data_path and --val_fraction, or start a new --out_dir")
    if bool(state["scaler"]) != fp16_scaler:  # fp16 <-> bf16/fp32: the scaler state cannot follow
        raise CheckpointError(f"{path} was trained in {state['precision']}, now {dtype_name(dtype)}; fp16 runs "
                              "carry a grad scaler, others do not: resume with --dtype " + state["precision"])
    if state["precision"] != dtype_name(dtype):
        print0(f"WARNING: {path} was trained in {state['precision']}, this run uses {dtype_name(dtype)}: "
               f"training continues but is NOT bit-exact; pass --dtype {state['precision']} for an exact resume")
    if changes["warned"]:
        print0(f"WARNING: resuming with changed settings ({'; '.join(changes['warned'])}): the new values apply "
               "from here on, so this is not the run the checkpoint started")


def rank_rng_state(state: dict[str, Any], ddp: Dist) -> dict[str, Any] | None:
    """This rank's saved random streams; None when this rank did not exist in the saved run."""
    if len(saved := state["rng_per_rank"]) != ddp.world_size:
        print0(f"WARNING: resuming a run saved with world size {len(saved)} on world size {ddp.world_size}: training "
               "continues but is NOT bit-exact (another global batch and summation order, new ranks' data streams "
               "fresh); resume with the same world size for an exact continuation")
    return saved[ddp.rank] if ddp.rank < len(saved) else None


def claim(out_dir: Path, resume: bool = False, flag: str = "--out_dir") -> contextlib.ExitStack:
    """Own ``out_dir`` (one live run per folder) through an flock on out_dir/.lock, dropped by the kernel when this
    process dies, or raise PathError; a fresh run is refused where last.pt exists. Footgun: flock is advisory."""
    created, path = runtime.make_folders(out_dir, flag), out_dir / ".lock"
    with contextlib.ExitStack() as lock:  # a refusal or a failed write below closes it at once
        lock.callback(runtime.remove_empty, created)
        while True:
            with runtime.one_line(out_dir, flag):
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # LOCK_NB: refuse now, never wait for the owner
            except BlockingIOError:
                owner = os.pread(fd, 300, 0).decode("utf-8", errors="replace").strip() or "another process"
                os.close(fd)
                raise PathError(f"{out_dir} is in use by {owner}: one run per folder. Wait for it to end or stop "
                                f"it, or pass another {flag}") from None
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
            os.close(fd)  # we locked a file its owner removed on its way out: lock the one there now
        lock.callback(os.close, fd)
        lock.callback(path.unlink, missing_ok=True)
        if resume and not (out_dir / "last.pt").exists():  # before the corpus is made
            best = (out_dir / "best.pt").exists()  # and no last.pt: a save that filled the disk
            raise ConfigError(f"nothing to resume in {out_dir} (no last.pt); " + ("copy its best.pt to last.pt to "
                              "resume from the best step" if best else "drop --resume to start a new run"))
        if not resume and (out_dir / "last.pt").exists():
            raise ConfigError(f"{out_dir} already holds a run (last.pt); continue it with --resume, or start a "
                              "new one with another --out_dir (or delete the folder)")
        if not resume and (out_dir / "best.pt").exists():  # a run whose last.pt is gone: a new run would replace it
            raise ConfigError(f"{out_dir} holds a run's best.pt (and no last.pt to resume); start a new run with "
                              "another --out_dir (imported weights: --init_from this folder), or copy best.pt to "
                              "last.pt and --resume from its step")
        if not resume and not runtime.is_run_log(out_dir / "metrics.jsonl"):  # a new run starts the log afresh
            raise ConfigError(f"{out_dir / 'metrics.jsonl'} is not a run's log, which a new run replaces: move it away")
        with runtime.one_line(out_dir, flag):
            os.ftruncate(fd, 0)
            who = f"process {os.getpid()} on {socket.gethostname()}, since {time.strftime('%F %T')}\n"
            os.pwrite(fd, who.encode(), 0)
        return lock.pop_all()  # close(): remove the lock file while holding it, unlock, remove empty new folders


class Checkpointer:
    """out_dir's last.pt and best.pt and the resume. Every rank calls ``resume()`` and ``save()`` (collectives), rank
    0 alone writes; best.pt before last.pt, so last.pt's best_val_loss never names a model best.pt lacks."""

    def __init__(self, out_dir: Path, cfg: TrainConfig, run, ddp: Dist):  # run: a train.Run
        self.out_dir, self.cfg, self.ddp = out_dir, cfg, ddp
        self.model, self.optimizer, self.scaler, self.guard = run.model, run.optimizer, run.scaler, run.guard
        self.stream, self.corpus, self.dtype = run.stream, run.corpus, run.rt.dtype
        self.saved_step: int | None = None  # the step last.pt holds, once this process knows it
        self.last_eval: dict[str, float] = {}  # the latest eval (step, val_loss, val_bpb), saved with each checkpoint
        self.lora = None  # a LoRA run: what its checkpoints say of the base (hashed once: it is frozen)
        if cfg.lora_rank:  # LoRA's code is imported by a LoRA run only
            import finetune
            self.lora = finetune.record(self.model, cfg.init_from, finetune.base_fingerprint(self.model))
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob(f".*{TEMP_MARK}*"):  # left by a save (or metrics.jsonl's rewrite) that was killed
            stale.unlink(missing_ok=True)

    def resume(self) -> tuple[int, float, float]:
        """Load last.pt into the run, each rank its own random streams: (step, seconds spent, best val loss)."""
        path, cfg = self.out_dir / "last.pt", self.cfg
        state = load_checkpoint(path)
        check_resumable(path, state, cfg, self.corpus, self.scaler.is_enabled(), self.dtype)
        if self.lora is None:
            load_weights(self.model, state["model"], path)
        else:  # the adapters, once the base imported now is the one they were trained on (its fingerprint)
            import finetune
            finetune.check_base(state["lora"], self.lora["fingerprint"], str(path))
            finetune.load_adapter_state(self.model, state["model"], str(path))
        from optim import load_optimizer_state  # a training run's: sampling never loads optim.py
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if (rng := rank_rng_state(state, self.ddp)) is not None:
            if missing := [name for name in RNG_STREAMS if name not in rng]:
                raise CheckpointError(f"{path}: checkpoint lacks RNG state for {', '.join(missing)}; resuming would "
                                      "not be exact")
            restore_rng(rng, self.stream)
        done = (" (max_iters reached: nothing to do)" if state["step"] >= cfg.max_iters else
                " (max_time reached: nothing to do; raise --max_time to continue)" if cfg.out_of_time(state["time_s"])
                else "")
        best, best_val = self.out_dir / "best.pt", state["best_val_loss"]
        if best.is_file() and best.stat().st_mtime_ns > path.stat().st_mtime_ns:  # killed between the two saves
            best_val = min(best_val, load_checkpoint(best)["best_val_loss"])  # the bar is best.pt's, never a worse one
        print0(f"resumed from {path} at step {state['step']} (best val loss {best_val:.4f}){done}")
        self.saved_step, self.last_eval = state["step"], state["last_eval"]  # a save before the next eval keeps it
        return state["step"], state["time_s"], best_val

    def save(self, step: int, time_s: float, best_val: float, is_best: bool = False) -> None:
        """Everything a resume needs (REQUIRED_KEYS), from the uncompiled model so keys carry no _orig_mod."""
        self.guard.raise_if_tripped()  # never save a state that a non-finite step touched
        self.guard.raise_if_weights_not_finite(self.model, step)  # nor one that an overflowing update made
        np_state = np.random.get_state()  # its key array stored as a tensor, which weights_only loading accepts
        rng = {"python": random.getstate(),  # every random stream the run reads (RNG_STREAMS), the data's position too
               "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
               "torch_cpu": torch.get_rng_state(),
               "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
               "data": self.stream.state_dict()}
        rng_per_rank = runtime.gather_to_main(rng)  # a collective: all ranks
        self.saved_step = step
        with runtime.stop_together(self.ddp.device):  # rank 0's write failing (disk full) stops every rank
            if not self.ddp.is_main:
                return
            import tiktoken
            versions = {"python": platform.python_version(), "torch": str(torch.__version__),
                        "numpy": np.__version__, "tiktoken": tiktoken.__version__, **git_state()}
            if self.lora:  # the adapters only: the frozen base comes back from init_from, checked by its fingerprint
                from finetune import adapter_state
            weights = adapter_state(self.model) if self.lora else self.model.state_dict()
            state = {"format_version": FORMAT_VERSION, "model": weights, **({"lora": self.lora} if self.lora else {}),
                     "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(), "step": step,
                     "time_s": time_s,  # the run's clock, evals included: a resume continues max_time, its schedule
                     "best_val_loss": best_val, "config": as_dict(self.cfg), "tokenizer": self.corpus.meta["tokenizer"],
                     "rng": rng_per_rank[0], "rng_per_rank": rng_per_rank,  # "rng": rank 0's, for one-process readers
                     "precision": dtype_name(self.dtype),  # the dtype the run resolved (config's may say "auto")
                     "versions": versions, "last_eval": self.last_eval, "corpus": self.corpus.record()}
            if is_best:
                save_checkpoint(state, self.out_dir / "best.pt")
            save_checkpoint(state, self.out_dir / "last.pt")


# ----------------------------------------------------------------------------- a model for use
@dataclass(frozen=True)
class Loaded:
    """A model ready for use and what its callers need to know about it."""
    model: GPT  # in eval mode, on the device asked for
    tokenizer: Any  # char, GPT-2's or a BPE, from the checkpoint's description
    cfg: TrainConfig  # the run's config; imported weights (scripts/import_hf.py): the defaults with their shape
    precision: str  # the dtype the run trained in: float32, bfloat16, float16 (imported: float32)
    source: str  # the checkpoint file
    step: int  # optimizer steps behind the weights (imported: 0)
    best_val_loss: float  # as the run logged it; nan for imported weights
    corpus: dict | None  # the data it trained on (data.Corpus.record); None: imported, no run of ours behind them


def find_checkpoint(source: str, flag: str = "--ckpt") -> Path:  # flag "": a tool's positional RUN
    """A file as given; a run folder's best.pt (else last.pt); by default the newest trained run's under out/. Anything
    else: CheckpointError naming the fix (Hugging Face weights become a run folder with scripts/import_hf.py)."""
    path = Path(source)
    if not source:  # the README's "newest": a run the user trained (last.pt), never weights imported after it
        if runs := [p for p in Path("out").glob("**/best.pt") if (p.parent / "last.pt").is_file()]:
            return max(runs, key=lambda p: p.stat().st_mtime)
        raise CheckpointError("no trained run in out/; train one (python train.py --config small), or pass --ckpt")
    if path.is_dir() and (found := next((p for p in (path / "best.pt", path / "last.pt") if p.is_file()), None)):
        return found
    named = f"{flag} {source}".strip()
    folder = path.parent if path.suffix == ".safetensors" and path.is_file() else path  # a weights file: its folder
    imports = f"python -m scripts.import_hf {folder} out/{folder.name}, then pass out/{folder.name}"
    if (folder / "model.safetensors").is_file():
        raise CheckpointError(f"{named}: Hugging Face weights; make a run folder of them first: {imports}")
    if path.is_file() or path.suffix == ".pt":  # load_checkpoint says what is wrong with it
        return path
    if path.is_dir():
        raise CheckpointError(f"{named}: no best.pt or last.pt in this folder; train that run first")
    hub = f"or for Hugging Face weights (a hub name such as gpt2): {imports}" if "/" not in source else (
        f"or make it of Hugging Face weights: python -m scripts.import_hf SOURCE {source} (a hub name or a folder)")
    raise CheckpointError(f"{named}: no such run folder or file; train that run first, {hub}")


def load_weights(model: GPT, weights: dict[str, torch.Tensor], path: Path) -> None:
    """``weights`` into ``model``, or CheckpointError: saved by other code (an option added since, its default new)."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:  # torch's first line names the model; the next, the first tensor that differs
        first = (str(err).splitlines()[1:] or [str(err)])[0].strip()
        raise CheckpointError(f"{path}: its weights do not fit the model this code builds from its config ({first}); "
                              "load it with the code that wrote it (versions.git_commit)") from None


def config_from_dict(values: dict[str, Any]) -> TrainConfig:
    """A checkpoint's config (as_dict) without the keys this code lacks (a fork's model options), warned about."""
    unknown = ", ".join(f"{k}={v!r}" for k, v in sorted(values.items()) if k not in FIELD_TYPES and k != "given")
    if unknown:
        print(f"WARNING: the checkpoint's config has fields this code does not know ({unknown}); they are ignored "
              "here, so a model saved by other code (a fork) may compute something else", file=sys.stderr)
    options = {k: v for k, v in values.items() if k in FIELD_TYPES}
    return TrainConfig(**options, given=tuple(values.get("given", ())))  # a list, where a checkpoint holds one


def from_checkpoint(path: Path, device: torch.device | str = "cpu", merged: bool = True) -> Loaded:
    """A checkpoint's model, config and tokenizer; a LoRA run's adapters on its base, merged unless ``merged=False``."""
    state = load_checkpoint(path)  # to CPU: the optimizer state it also holds never needs the GPU
    cfg = config_from_dict(state["config"])
    tokenizer = tokenizer_from_meta(state["tokenizer"], Path(cfg.data_dir))
    model = GPT(model_config(cfg, tokenizer.vocab_size))
    if "lora" in state:  # the base comes back from its init_from, as the run started
        from finetune import load_adapted
        try:
            base = load_base(cfg)
        except TinyGPTError as err:  # moved or deleted since: a base is needed to sample, export or continue
            why = f"cannot be loaded ({str(err).split('; ')[0]})" if Path(cfg.init_from).exists() else "is gone"
            raise CheckpointError(f"{path} holds LoRA adapters on the base {cfg.init_from}, which {why}; they need the "
                                  "base they were trained on there: put it back, or a symbolic link to it") from None
        model.load_state_dict(base.weights_for(state["tokenizer"], tokenizer.vocab_size))
        model = load_adapted(state, model, str(path), merged)
    else:
        load_weights(model, state["model"], path)
    return Loaded(model.to(device).eval(), tokenizer, cfg, state["precision"], str(path), state["step"],
                  state["best_val_loss"], state["corpus"])


def add_weights_flags(parser: argparse.ArgumentParser) -> None:
    """--ckpt or --init_from: where the weights of sample.py, scripts/eval.py and harness.py come from."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--ckpt", default="", help="checkpoint or run folder (default: the newest trained run in out/)")
    source.add_argument("--init_from", "--init-from", default="", help="as --ckpt, as train.py takes it")


def flags_checkpoint(args: argparse.Namespace) -> Path:  # the checkpoint add_weights_flags' flags chose
    return find_checkpoint(args.init_from, "--init_from") if args.init_from else find_checkpoint(args.ckpt)


def from_flags(args: argparse.Namespace, device: torch.device | str = "cpu", merged: bool = True) -> Loaded:
    return from_checkpoint(flags_checkpoint(args), device, merged)


# ----------------------------------------------------------------------------- what a run starts from
def start_from(cfg: TrainConfig,
               device: torch.device | str = "cpu") -> tuple[TrainConfig, "finetune.Pretrained | None"]:
    """train.py's --init_from: the weights, and the config with the options they fix (adopt); else (cfg, None). A fresh
    run; its resume loads the base again (load_base)."""
    if not cfg.init_from:
        return cfg, None
    if Path(cfg.init_from).exists():  # saved absolute, so that a LoRA run's base is found from any folder
        cfg = replace(cfg, init_from=str(Path(cfg.init_from).resolve()))
    import finetune  # fine-tuning's code: imported by a run that starts from weights
    with runtime.main_first(device):  # rank 0 reads first: a gpt2 tokenizer may fetch its ranks into the cache
        pretrained = load_base(cfg)
        cfg = finetune.adopt(cfg, pretrained)
        print0(f"init_from {pretrained.source}: {describe(model_config(cfg, pretrained.config.vocab_size))}; "
               f"tokenizer {cfg.tokenizer}; block_size {cfg.block_size} of {pretrained.n_positions} positions")
    return cfg, pretrained


def load_base(cfg: TrainConfig) -> "finetune.Pretrained":
    """The run's weights ``cfg.init_from`` names, cropped to a given block_size; a full fine-tune's resume takes its
    own last.pt's (every weight, the options adopted): the base is not read, so it may have moved or changed since."""
    block_size = cfg.block_size if "block_size" in given_fields(cfg) else 0  # 0: every position the weights have
    last = Path(cfg.out_dir) / "last.pt"
    if cfg.resume and not cfg.lora_rank and last.is_file():  # LoRA's last.pt holds the adapters alone
        return load_run(last, block_size)
    if cfg.resume and cfg.lora_rank and not Path(cfg.init_from).exists():  # its adapters need their base
        raise CheckpointError(f"--init_from {cfg.init_from}: no such run folder or file; {last} holds LoRA "
                              "adapters trained on a base: pass --init_from where that base is now")
    return load_run(find_checkpoint(cfg.init_from, "--init_from"), block_size)


def load_run(path: Path, block_size: int) -> "finetune.Pretrained":
    """A run's weights, model options and tokenizer (a LoRA run's merged); block_size crops (0: every position)."""
    import finetune
    loaded = from_checkpoint(path)
    saved, state = loaded.model.config, loaded.model.state_dict()
    if block_size > saved.block_size:
        raise HFError(f"block_size {block_size} exceeds the {saved.block_size} positions of {path}; use --block_size "
                      f"{saved.block_size} or less")
    config = replace(saved, block_size=block_size or saved.block_size)
    if finetune.WPE in state:  # rope has no position table
        state[finetune.WPE] = state[finetune.WPE][: config.block_size]  # (T, C)
    return finetune.Pretrained(config, state, str(path), loaded.tokenizer.meta(), saved.block_size)
