"""Where and how the maths runs: device choice, precision, autocast, compile, and seeding.

Shared by train.py and sample.py so that both pick devices and precisions the same way.
"""
from __future__ import annotations

import contextlib
import random
import sys
import warnings
from typing import Callable

import numpy as np
import torch

from config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(requested: str = "auto") -> torch.device:
    """cuda, then mps, then cpu for "auto"; otherwise the device asked for, if it exists."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device `{requested}` asked for, but CUDA is not available; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device `{requested}` asked for, but MPS is not available; use --device cpu")
    return device


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """bf16 on CUDA where supported, else fp16; fp32 on CPU and MPS unless asked otherwise."""
    if requested != "auto":
        return DTYPES[requested]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass; a no-op in fp32. Weights stay fp32 either way."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices). The data order has its own generator."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def want_compile(setting: str, device: torch.device) -> bool:
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def compile_or_eager(model: torch.nn.Module, enabled: bool, probe: Callable[[torch.nn.Module], None]):
    """torch.compile the model and prove it works on ``probe``; on any failure warn once, run eager.

    Compilation errors surface at the first call, not at torch.compile(), hence the probe. The probe
    runs under fork_rng so that it leaves every random stream exactly where it found it.
    """
    if not enabled:
        return model
    compiled = torch.compile(model)
    try:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            probe(compiled)
    except Exception as err:  # noqa: BLE001 - any compiler failure means "fall back"
        warnings.warn(f"torch.compile failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                      "running eager", stacklevel=2)
        return model
    finally:
        for p in model.parameters():
            p.grad = None
    return compiled


def fail(message: str, code: int = 2) -> None:
    """Print a one-line error for the user and exit; no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)
