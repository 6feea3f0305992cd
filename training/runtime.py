"""Where and how the maths runs: device choice, threads, precision, compile, and seeding.

``choose_runtime`` is the one choice of device, threads, precision and compile that train.py,
scripts/bench.py, scripts/doctor.py, scripts/eval.py and scripts/compare.py share, so that a benchmark, a
diagnosis or an evaluation runs as training of the same config does; sample.py picks devices the same way.
"""
from __future__ import annotations

import os
import random
import re
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from model import step_bytes
from process.distributed import decide_on_main, pick_device, print0
from process.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_MIN_SPEEDUP = 1.5  # CPU autocast to bf16 only when its matmuls are at least this much faster


def pick_dtype(requested: str, device: torch.device,
               probe_shape: tuple[int, int, int] = (768, 128, 512)) -> torch.dtype:
    """bf16 on CUDA where supported, else fp16; on CPU bf16 only where a probe finds it faster; MPS fp32.

    The CPU probe times one (M, K) @ (K, N) matmul of ``probe_shape`` (run_dtype passes the model's own)
    in both precisions, ~0.2 s, and prints what it chose and why. The choice is machine dependent: pin
    --dtype where results must be reproducible.
    """
    if requested != "auto":
        return DTYPES[requested]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu":
        fp32 = matmul_gflops(*probe_shape, dtype=torch.float32)
        bf16 = matmul_gflops(*probe_shape, dtype=torch.bfloat16)
        # Autocast adds casts and its elementwise ops gain little, so the matmuls must win clearly.
        choice = torch.bfloat16 if bf16 >= BF16_MIN_SPEEDUP * fp32 else torch.float32
        print(f"dtype auto -> {str(choice).removeprefix('torch.')}: a {probe_shape[0]}x{probe_shape[1]} @ "
              f"{probe_shape[1]}x{probe_shape[2]} matmul runs at {bf16:.0f} GFLOP/s in bf16 vs {fp32:.0f} in fp32 "
              f"on this CPU (bf16 needs >= {BF16_MIN_SPEEDUP:g}x)")
        return choice
    return torch.float32


def run_dtype(cfg, device: torch.device) -> torch.dtype:
    """The precision a run of ``cfg`` computes in on ``device``, the one train.py, bench.py, the doctor and
    compare.py all use; dtype=auto on a CPU times the MLP's first matmul at the run's tokens per micro-batch, up
    to 4096 rows: as telling, and a size too big to run costs no minutes or gigabytes before it is refused."""
    rows = min(cfg.batch_size * cfg.block_size, 4096)
    return pick_dtype(cfg.dtype, device, (rows, cfg.n_embd, 4 * cfg.n_embd))


@dataclass(frozen=True)
class Runtime:
    """Where and how a run computes."""
    device: torch.device
    dtype: torch.dtype  # what autocast computes in; weights and optimizer state stay fp32
    threads: int  # torch threads in force
    compile: bool  # torch.compile wanted (compile_for_step still falls back to eager if it fails)


def choose_runtime(cfg, device: torch.device | None = None) -> Runtime:
    """cfg's device (or the one torchrun gave this rank), its threads, its precision and compile setting.

    Threads first: dtype=auto times matmuls with them, at the run's own shape (run_dtype). Under
    torchrun ranks timing side by side could disagree, so rank 0's choice is the job's.
    """
    device = device or pick_device(cfg.device)
    threads = use_threads(cfg.threads)
    dtype = decide_on_main(lambda: run_dtype(cfg, device))
    return Runtime(device, dtype, threads, want_compile(cfg.compile, device))


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory on ``device``: a GPU's own, else the machine's (None where the OS does not say)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        return None


def refuse_what_cannot_fit(cfg, rt: Runtime) -> None:
    """ConfigError, before the data or the model, when one training step of cfg's micro-batch needs more than
    rt.device's memory even by model.step_bytes' lower bound: a size that can never run is said at once, with what
    it would take, not left to the allocator's traceback or the OOM killer."""
    need = step_bytes(cfg, cfg.batch_size, cpu_bf16=rt.device.type == "cpu" and rt.dtype == torch.bfloat16)
    have = device_memory(rt.device)
    if have is not None and need > have:
        where = "the GPU" if rt.device.type == "cuda" else "this machine"
        raise ConfigError(f"batch_size {cfg.batch_size} x block_size {cfg.block_size}: one training step needs at "
                          f"least {need / 2**30:,.0f} GiB, and {where} has {have / 2**30:,.0f} GiB; lower "
                          f"block_size or batch_size")


def compile_for_step(model: torch.nn.Module, stream, rt: Runtime) -> torch.nn.Module:
    """The model compiled as rt says (compile_or_eager), probed with one forward/backward of the training
    ``stream``'s first batch under the step's autocast: the graph compiled is the one the step runs (no recompile
    at step 1), and compile errors surface here, not mid-run. The probe moves no random stream (a copy of the
    stream's first batch, the global RNG forked), so a compiled run resumes as exactly as an eager one."""
    def probe(m: torch.nn.Module) -> None:
        x, y = stream.first_batch()  # (B, T) each
        with torch.autocast(rt.device.type, dtype=rt.dtype, enabled=rt.dtype != torch.float32):
            _, loss_sum, n, _ = m(x, y)
        (loss_sum / n).backward()

    return compile_or_eager(model, rt.compile, probe)


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", seconds: float = 0.1) -> float:
    """Measured GFLOP/s of an (m, k) @ (k, n) matmul: median of repeated timings after a warm-up. Its own
    generator: it never moves the global random stream."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, generator=gen, device=device).to(dtype)  # (m, k)
    b = torch.randn(k, n, generator=gen, device=device).to(dtype)  # (k, n)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(3):  # warm-up: first calls pick kernels and touch memory
        a @ b
    sync()
    times, deadline = [], time.perf_counter() + seconds
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 10_000):
        t0 = time.perf_counter()
        a @ b  # (m, n)
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(times) / 1e9


def use_threads(threads: int) -> int:
    """torch.set_num_threads(threads) unless 0 (torch's default: one per core); returns the count in force.
    Two jobs on a 2-core machine each want one: with torch's default both spin two OpenMP threads, and
    each op waits at a barrier for a thread the other job has descheduled (docs/notebook/performance.md)."""
    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def threads_text(count: int) -> str:
    return f"{count} thread" + ("" if count == 1 else "s")


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices). The data order has its own generator."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # numpy's range; config allows up to 2**32 - 1, to which DDP adds the rank
    torch.manual_seed(seed)


def want_compile(setting: str, device: torch.device) -> bool:
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def compile_or_eager(model: torch.nn.Module, enabled: bool, probe: Callable[[torch.nn.Module], None]):
    """torch.compile the model and prove it works on ``probe``; on any failure warn once, run eager.
    Compilation errors surface at the first call, not at torch.compile(), hence the probe; it runs under
    fork_rng, so it leaves every random stream exactly where it found it."""
    if not enabled:
        return model
    # The probe is where compiling happens, silently: say so first, or a long compile looks like a hang.
    print0("compiling the model (torch.compile; the first time can take minutes)")
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


# Peak dense (no structured sparsity) tensor-core FLOP/s in bf16/fp16 with fp32 accumulation, the mode autocast
# uses, from NVIDIA's datasheets; the first matching pattern wins, so more specific names come first. Where a
# datasheet gives only the "with sparsity" figure, dense is half.
PEAK_FLOPS_16BIT: tuple[tuple[str, float], ...] = (
    (r"H200 NVL", 835.5e12),  # H200 datasheet (NVL column): 1,671 TFLOPS with sparsity
    (r"H200", 989.5e12),  # H200 datasheet (SXM): 1,979 TFLOPS with sparsity
    (r"H100 NVL", 835.5e12),  # H100 datasheet (NVL): 1,671 with sparsity
    (r"H100.*PCIe", 756.5e12),  # H100 datasheet (PCIe): 1,513 with sparsity
    (r"H100", 989.5e12),  # H100 datasheet (SXM): 1,979 with sparsity
    (r"A100", 312e12),  # A100 datasheet, SXM and PCIe, 40 and 80 GB: 312 dense / 624 sparse
    (r"L40S", 362.05e12),  # L40S datasheet: 362.05 dense / 733 sparse
    (r"RTX 4090", 165.2e12),  # Ada Lovelace whitepaper, app. A: 165.2 with FP32 accumulate (330.3 with FP16)
    (r"RTX 3090", 71e12),  # Ampere GA102 whitepaper: 71 with FP32 accumulate (142 with FP16)
    (r"V100S", 130e12),  # V100S datasheet: 130 TFLOPS tensor (fp16 only: Volta has no bf16)
    (r"V100.*PCIE", 112e12),  # V100 datasheet (PCIe): 112
    (r"V100", 125e12),  # V100 datasheet (SXM2): 125
)


def peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """Datasheet peak dense FLOP/s of one GPU in ``dtype``, or None: for fp32 (the table holds 16-bit peaks only),
    for devices not in the table, and for bf16 on Volta (V100: fp16 tensor cores only, bf16 is emulated). An MFU
    against a guessed peak would be a made-up number."""
    if dtype not in (torch.bfloat16, torch.float16) or (dtype == torch.bfloat16 and "V100" in device_name):
        return None
    return next((flops for pattern, flops in PEAK_FLOPS_16BIT if re.search(pattern, device_name, re.IGNORECASE)), None)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def device_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    """The peak FLOP/s MFU divides by: a CUDA device's peak_flops; None on CPU and MPS (no datasheet peak)."""
    return peak_flops(device_name(device), dtype) if device.type == "cuda" else None


def mfu(flops_per_token: float, tokens_per_s: float, device: torch.device, dtype: torch.dtype,
        world_size: int = 1) -> float | None:
    """Model FLOPs utilisation (PaLM, Chowdhery et al. 2022, app. B): achieved / peak FLOP/s. ``tokens_per_s``
    is the whole job's, spread over ``world_size`` GPUs. None ("n/a") on CPU, MPS, unknown GPUs and fp32."""
    peak = device_peak(device, dtype)
    if peak is None:
        return None
    return flops_per_token * tokens_per_s / (peak * world_size)
