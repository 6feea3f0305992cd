"""Checkpoints: atomic writes, verified reads, and every random stream needed for an exact resume.

A checkpoint holds only tensors and plain Python values, so ``torch.load(weights_only=True)`` reads
it with no allowlist and a malicious pickle cannot run code. Every load in this repo goes through
``load_checkpoint`` below.
"""
from __future__ import annotations

import os
import platform
import random
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format_version", "model", "optimizer", "scaler", "step", "best_val_loss",
                 "config", "tokenizer", "rng", "versions")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` to ``path`` atomically: a temp file in the same folder, fsync, rename.

    A crash or a full disk at any moment leaves either the old file or the new one, never a mix.
    The temp file is removed if the write fails. Raises OSError or RuntimeError (torch.save
    reports a full disk as RuntimeError) after cleaning up.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """fsync a folder so that a rename inside it survives a power cut (a no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Delete temp files left by a save that was killed; returns what was removed."""
    stale = list(Path(folder).glob(".*.pt.tmp-*")) if Path(folder).is_dir() else []
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    return stale


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint safely, or raise CheckpointError naming the path and the problem.

    torch.load does not check the CRCs stored in the zip archive, so a flipped bit would load as
    silently wrong weights; zipfile.testzip() checks them first.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt: {err})") from None
    if bad is not None:
        raise CheckpointError(f"{path}: corrupt checkpoint (CRC mismatch in {bad})")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 - the unpickler raises many types; all mean "refuse"
        raise CheckpointError(f"{path}: refused to load ({unpickler_reason(err)})") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a tinygpt checkpoint (missing {', '.join(missing)})")
    return state


def unpickler_reason(err: Exception) -> str:
    """The one informative line of torch.load's long weights_only error."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:
        if "WeightsUnpickler error" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()[:300]
    return (lines[0][:300] if lines else type(err).__name__)


def capture_rng(data_generator: torch.Generator) -> dict[str, Any]:
    """Every random stream the training run reads: python, numpy, torch CPU and CUDA, the data order."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        # numpy's key array is stored as a tensor so weights_only loading accepts it.
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "data": data_generator.get_state(),
    }


RNG_STREAMS = ("python", "numpy", "torch_cpu", "torch_cuda", "data")


def restore_rng(rng: dict[str, Any], data_generator: torch.Generator) -> None:
    """Put every random stream back; refuse a checkpoint that lacks one (an inexact resume)."""
    missing = [name for name in RNG_STREAMS if name not in rng]
    if missing:
        raise CheckpointError(f"checkpoint lacks RNG state for {', '.join(missing)}; "
                              "resuming would not be exact")
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available() and rng["torch_cuda"]:
        torch.cuda.set_rng_state_all(rng["torch_cuda"])
    data_generator.set_state(rng["data"])


def library_versions() -> dict[str, Any]:
    """Versions that decide whether a run reproduces: interpreter, libraries, code commit."""
    import tiktoken
    return {"python": platform.python_version(), "torch": str(torch.__version__), "numpy": np.__version__,
            "tiktoken": tiktoken.__version__, **git_state()}


def git_state() -> dict[str, Any]:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                    capture_output=True, text=True, timeout=5).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "", "git_dirty": False}
    return {"git_commit": commit, "git_dirty": dirty}
