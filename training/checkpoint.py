"""Checkpoints: atomic writes, verified reads, every random stream an exact resume needs, and the run's side of it:
what last.pt and best.pt hold and when (``Checkpointer``), and the resume policy.

A checkpoint holds only tensors and plain Python values, so ``torch.load(weights_only=True)`` reads it with no
allowlist and a malicious pickle cannot run code. Every load in this repo goes through ``load_checkpoint``.

Keys (``REQUIRED_KEYS``): format_version; model (state_dict; a LoRA run's holds its adapters only); optimizer;
scaler (GradScaler's, empty unless fp16); step (optimizer steps done); time_s (the run's wall clock at that step,
evals included: a resumed run continues its max_time budget and time schedule); best_val_loss; config (TrainConfig
as a dict); tokenizer (its description); rng (``RNG_STREAMS``: python, numpy, torch_cpu, torch_cuda, and data: the
training stream's state_dict, data.TrainingStream); rng_per_rank (the same for every DDP rank, in rank order; one
entry in a single process); precision (the dtype the run resolved: float32, bfloat16 or float16); versions (python,
torch, numpy, tiktoken, git commit and dirty flag); last_eval (the latest eval before the save: step, val_loss,
val_bpb; in best.pt the best one; empty until this process has run an eval); corpus (data.Corpus.record: source,
val_fraction and each split's fingerprint; a resume on other data is refused). ``LORA_KEYS``, a LoRA run's only:
lora (training/lora.record: its base, the base's fingerprint and the adapters' shape; a resume or a sample on
another base is refused). A checkpoint of an older layout is refused in one line.

On disk a checkpoint is the zip archive torch.save writes, with the archive's sha256 as its zip comment
(``tinygpt-sha256:<hex>``). Zip readers, torch.load included, ignore the comment; ``load_checkpoint`` checks it, so
a truncated, empty, foreign or bit-flipped file is refused (the zip CRCs miss flips in headers and padding, and
torch.load checks no CRC at all).
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickletools
import platform
import random
import re
import subprocess
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from config import TrainConfig, as_dict, resume_changes
from data import TrainingStream
from process import REPO, distributed
from training import lora
from process.distributed import Dist, print0
from process.errors import CheckpointError, CheckpointWriteError
from process.files import TEMP_MARK, atomic_write

FORMAT_VERSION = 2  # 2: time_s added
REQUIRED_KEYS = ("format_version", "model", "optimizer", "scaler", "step", "time_s", "best_val_loss", "config",
                 "tokenizer", "rng", "rng_per_rank", "precision", "versions", "last_eval", "corpus")
LORA_KEYS = ("lora",)  # written by a LoRA run (lora_rank > 0) only
RNG_STREAMS = ("python", "numpy", "torch_cpu", "torch_cuda", "data")

DIGEST_PREFIX = b"tinygpt-sha256:"
DIGEST_TRAILER = len(DIGEST_PREFIX) + 64  # bytes of zip comment: the prefix and a hex sha256
EOCD_SIZE = 22  # the zip end-of-central-directory record without its comment; it ends the archive


class HashingWriter:
    """The file object handed to torch.save: hashes the bytes on their way to disk (no second read)."""

    def __init__(self, file):
        self.file, self.sha256, self.tail = file, hashlib.sha256(), b""

    def write(self, data) -> int:
        self.sha256.update(data)
        self.tail = (self.tail + bytes(data[-EOCD_SIZE:]))[-EOCD_SIZE:]
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` to ``path`` atomically (files.atomic_write), its sha256 as the zip comment.

    A crash or a full disk at any moment leaves either the old file or the new one, never a mix: the temp file
    is removed, then CheckpointWriteError is raised (torch.save reports a full disk as an OSError or a
    RuntimeError, depending on where it notices).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(f) -> None:
        writer = HashingWriter(f)
        torch.save(state, writer)
        if writer.tail[:4] != b"PK\x05\x06" or writer.tail[-2:] != b"\0\0":
            raise RuntimeError("torch.save did not end its archive with an empty zip comment")
        f.seek(-2, os.SEEK_END)  # the comment's length, then the comment
        f.write(DIGEST_TRAILER.to_bytes(2, "little") + DIGEST_PREFIX + writer.sha256.hexdigest().encode())

    try:
        atomic_write(path, write)
    except (OSError, RuntimeError) as err:  # "No space left on device" where the OS said so, however wrapped
        cause = next((e for e in (err, err.__cause__, err.__context__) if isinstance(e, OSError) and e.errno), None)
        reason = os.strerror(cause.errno) if cause else (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointWriteError(f"could not write {path} ({reason[:200]}); the previous {path.name} is intact "
                                   "and no temp file is left") from err


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint safely, or raise CheckpointError naming the path and the problem.

    The sha256 in the zip comment is checked before anything is unpickled, and the unpickler only builds
    tensors and plain values (weights_only=True): a corrupt file is refused, not loaded as silently wrong
    weights, and a malicious one runs no code.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    verify_digest(path)
    try:
        with warnings.catch_warnings():  # torch warns about a pickle protocol it then refuses: the error says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(path, map_location=map_location, weights_only=True)
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


def read_config(path: Path) -> dict[str, Any] | None:
    """The config a checkpoint was saved with, read cheaply (memory-mapped, no digest check), or None if the file
    cannot be read that way. For decisions taken before the full, verified load_checkpoint."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - load_checkpoint will name the problem
        return None
    return state.get("config") if isinstance(state, dict) else None


def verify_digest(path: Path) -> None:
    """Raise CheckpointError unless the file ends with the sha256 save_checkpoint stored, and matches it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(0, size - DIGEST_TRAILER - EOCD_SIZE))
        end = f.read()
        eocd, comment = end[:EOCD_SIZE], end[EOCD_SIZE:]
        if (len(end) < EOCD_SIZE + DIGEST_TRAILER or eocd[:4] != b"PK\x05\x06"
                or eocd[-2:] != DIGEST_TRAILER.to_bytes(2, "little") or not comment.startswith(DIGEST_PREFIX)):
            raise CheckpointError(f"{path}: not a tinygpt checkpoint, or truncated ({size} bytes and no "
                                  "integrity digest at the end)")
        digest, remaining = hashlib.sha256(), size - DIGEST_TRAILER - 2  # the archive up to its comment length
        f.seek(0)
        while remaining > 0 and (chunk := f.read(min(1 << 24, remaining))):  # empty: shrank under us, a mismatch
            digest.update(chunk)
            remaining -= len(chunk)
        digest.update(b"\0\0")  # the comment length torch.save wrote
    if digest.hexdigest().encode() != comment[len(DIGEST_PREFIX):]:
        raise CheckpointError(f"{path}: corrupt checkpoint (sha256 mismatch: the file changed after it was saved)")


def unpickler_reason(err: Exception) -> str:
    """What torch.load rejected, in one line, never empty; an error that is no refusal (not a pickle at all) is
    named by its type. torch (2.6 to 2.13) wraps the reason in lines of advice that all mention weights_only, after
    "WeightsUnpickler error:" on the same line or a later one, or alone after a blank line (a blocked module)."""
    text = str(err)
    if not text.startswith("Weights only load failed"):
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        return f"{type(err).__name__}: {first}"[:300] if first else type(err).__name__
    lines = [line.split("WeightsUnpickler error:")[-1].removeprefix("Weights only load failed.").strip()
             for line in text.splitlines()]
    reason = next((line for line in lines if line and "weights_only" not in line
                   and not line.startswith("This file can still be loaded")), "")
    reason = re.split(r"(?<=\.)\s", reason)[0]  # the first sentence: the rest is advice to allow the global
    opcode = re.fullmatch(r"Unsupported operand (\d+)", reason)
    if opcode and chr(int(opcode[1])) in pickletools.code2op:  # a plain pickle (protocol 4 starts with FRAME)
        reason += f" (pickle opcode {pickletools.code2op[chr(int(opcode[1]))].name})"
    return reason[:300] or "the weights_only unpickler refused it; torch gave no reason"


def capture_rng(stream: TrainingStream) -> dict[str, Any]:
    """Every random stream the training run reads (RNG_STREAMS), the training stream's position included."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        # numpy's key array is stored as a tensor so weights_only loading accepts it.
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "data": stream.state_dict(),
    }


def restore_rng(rng: dict[str, Any], stream: TrainingStream) -> None:
    """Put every random stream back; refuse a checkpoint that lacks one (an inexact resume)."""
    missing = [name for name in RNG_STREAMS if name not in rng]
    if missing:
        raise CheckpointError(f"checkpoint lacks RNG state for {', '.join(missing)}; resuming would not be exact")
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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- what a run saves, and its resume
def check_resumable(path: Path, state: dict[str, Any], cfg: TrainConfig, corpus, fp16_scaler: bool,
                    dtype: torch.dtype) -> None:
    """Refuse a checkpoint this run cannot continue (shape, tokenizer, optimizer, scaler, data); warn where it
    can continue but not exactly as the run that was stopped. Other data (``corpus``, a data.Corpus) is refused:
    another train split is not the run that was stopped, and another val split would compare best_val_loss, and
    pick best.pt, across different sets."""
    changes = resume_changes(state["config"], cfg)
    differences = changes["fixed"]
    if state["tokenizer"] != corpus.meta["tokenizer"]:
        differences.append("tokenizer vocabulary differs from the current corpus")
    if differences:
        raise CheckpointError(f"{path} was trained with other settings: " + "; ".join(differences)
                              + ". Use the same settings or a new --out_dir")
    saved, now = state["corpus"], corpus.record()
    changed = [split for split in ("train", "val") if saved["fingerprint"].get(split) != now["fingerprint"][split]]
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


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore the moments from a checkpoint but keep this run's hyperparameters: load_state_dict also brings
    back the saved param-group settings (weight decay, betas, lr_scale), and a resume with a new --muon_lr or
    --weight_decay must run with it, not silently with the old one."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, mine in zip(optimizer.param_groups, settings):
        group.update(mine)


class Checkpointer:
    """out_dir's last.pt and best.pt: what goes in them, when best.pt is written, and the resume policy.

    The loop calls ``resume()`` once and ``save(step, ...)`` where it saves; both hold collectives, so every
    rank calls them, and rank 0 alone writes. A save never writes a state that a non-finite step touched,
    and writes best.pt before last.pt, so last.pt's best_val_loss never names a model best.pt lacks.
    """

    def __init__(self, out_dir: Path, cfg: TrainConfig, run, ddp: Dist):
        """``run``: a train.Run (its model, optimizer, scaler, guard, training stream and corpus)."""
        self.out_dir, self.cfg, self.ddp = out_dir, cfg, ddp
        self.model, self.optimizer, self.scaler, self.guard = run.model, run.optimizer, run.scaler, run.guard
        self.stream, self.corpus, self.dtype = run.stream, run.corpus, run.rt.dtype
        self.saved_step: int | None = None  # the step last.pt holds, once this process knows it
        self.last_eval: dict[str, float] = {}  # the latest eval, saved with each checkpoint (best.pt: the best)
        # A LoRA run: what its checkpoints say of the base (hashed once: it is frozen) beside the adapters.
        self.lora = lora.record(self.model, cfg.init_from, lora.base_fingerprint(self.model)) if cfg.lora_rank else None
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob(f".*.pt{TEMP_MARK}*"):  # left by a save that was killed
            stale.unlink(missing_ok=True)

    def resume(self) -> tuple[int, float, float]:
        """Load last.pt into the run: (step, seconds spent, best val loss). Refuses a checkpoint of another shape,
        tokenizer or data, or (a LoRA run) adapters of another base. Every rank loads the same file and restores
        its own random streams (distributed.rank_rng_state)."""
        path, cfg = self.out_dir / "last.pt", self.cfg
        state = load_checkpoint(path)
        check_resumable(path, state, cfg, self.corpus, self.scaler.is_enabled(), self.dtype)
        if self.lora is None:
            self.model.load_state_dict(state["model"])
        else:  # the adapters, once the base imported now is the one they were trained on (its fingerprint)
            lora.check_base(state["lora"], self.lora["fingerprint"], str(path))
            lora.load_adapter_state(self.model, state["model"], str(path))
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        rng = distributed.rank_rng_state(state, self.ddp)
        if rng is not None:
            try:
                restore_rng(rng, self.stream)
            except CheckpointError as err:
                raise CheckpointError(f"{path}: {err}") from None
        done = (" (max_iters reached: nothing to do)" if state["step"] >= cfg.max_iters else
                " (max_time reached: nothing to do; raise --max_time to continue)" if cfg.out_of_time(state["time_s"])
                else "")
        print0(f"resumed from {path} at step {state['step']} (best val loss {state['best_val_loss']:.4f}){done}")
        self.saved_step = state["step"]
        return state["step"], state["time_s"], state["best_val_loss"]

    def save(self, step: int, time_s: float, best_val: float, is_best: bool = False) -> None:
        self.guard.raise_if_tripped()  # never save a state that a non-finite step touched
        self.guard.raise_if_weights_not_finite(self.model, step)  # nor one that an overflowing update made
        rng_per_rank = distributed.gather_to_main(capture_rng(self.stream))  # a collective: all ranks
        self.saved_step = step
        with distributed.stop_together(self.ddp.device):  # rank 0's write failing (disk full) stops every rank
            if self.ddp.is_main:
                state = self.state(step, time_s, best_val, rng_per_rank)
                if is_best:
                    save_checkpoint(state, self.out_dir / "best.pt")
                save_checkpoint(state, self.out_dir / "last.pt")

    def state(self, step: int, time_s: float, best_val: float, rng_per_rank: list[dict[str, Any]]) -> dict[str, Any]:
        """Everything a resume needs, from the uncompiled model so keys carry no _orig_mod. A LoRA run saves its
        adapters and lora.record, not the frozen base: the base is imported again from init_from, and the record's
        fingerprint says whether it is the same. "rng" repeats rank 0's "rng_per_rank" entry, so single-process
        readers need not know about ranks; "precision" is the dtype the run resolved (config's may say "auto")."""
        import tiktoken
        versions = {"python": platform.python_version(), "torch": str(torch.__version__), "numpy": np.__version__,
                    "tiktoken": tiktoken.__version__, **git_state()}
        weights = lora.adapter_state(self.model) if self.lora else self.model.state_dict()
        return {"format_version": FORMAT_VERSION, "model": weights, **({"lora": self.lora} if self.lora else {}),
                "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(), "step": step,
                "time_s": time_s, "best_val_loss": best_val, "config": as_dict(self.cfg),
                "tokenizer": self.corpus.meta["tokenizer"], "rng": rng_per_rank[0], "rng_per_rank": rng_per_rank,
                "precision": dtype_name(self.dtype), "versions": versions, "last_eval": self.last_eval,
                "corpus": self.corpus.record()}
