"""How a run meets its machine: files written whole, folders (writable, staged), DDP under torchrun,
device/precision/compile, signals, and the run's records (metrics.jsonl, wandb)."""
import contextlib
import errno
import fcntl
import gc
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import statistics
import tempfile
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from config import (DEFAULTS, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_PEER_LOST, EXIT_WRITE_FAILED, FIELD_TYPES,
                    MODEL_OPTIONS, RESUME, USED_ONLY_UNDER, ConfigError, PathError, PeerFailed, RunStopped,
                    TinyGPTError, TrainConfig, as_dict, given_fields, install_hint, require, silence_stdout)
from model import step_bytes

# ----------------------------------------------------------------------------- files written whole or not at all
TEMP_MARK = ".tmp-"  # in every temp file's name (the Checkpointer removes stale ones at start)


@contextlib.contextmanager
def written_whole(path: Path) -> Iterator[Path]:
    """A temp path beside ``path`` to write: fsynced and renamed over it, or removed on any error (never half)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # the data on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:  # a full disk, a bug in the writer, Ctrl-C: no temp file outlives the write
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # fsync the folder, so the rename survives a power cut (where supported)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Replace ``path`` by what ``write`` writes to the file it is handed, or leave it as it was."""
    with written_whole(path) as tmp, open(tmp, "wb") as f:
        write(f)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ----------------------------------------------------------------------------- folders: writable, staged
# A path the user must change (exit 2), as opposed to a device failing under a good one (exit 74).
BAD_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR,
                   errno.ENAMETOOLONG, errno.ELOOP}


def os_failure(folder: Path, flag: str, err: OSError) -> PathError:
    reason = os.strerror(err.errno) if err.errno else str(err)
    if err.errno in BAD_PATH_ERRNOS:
        return PathError(f"cannot write in {folder} ({reason}); pass a writable {flag}")
    return PathError(f"could not write in {folder} ({reason}); nothing was written there", EXIT_WRITE_FAILED)


@contextlib.contextmanager
def one_line(where: Path, flag: str) -> Iterator[None]:
    """The block's OSError (a full disk, a read-only folder) as os_failure's one line: exit 74, or 2 for a bad path."""
    try:
        yield
    except OSError as err:
        raise os_failure(where, flag, err) from None


def make_folders(folder: Path, flag: str) -> list[Path]:
    """Create ``folder`` and its missing parents; returns those created, outermost first."""
    with one_line(folder, flag):  # a parent we may not even look into (EACCES)
        blocker = next((path for path in (folder, *folder.parents) if path.exists() and not path.is_dir()), None)
        missing = [path for path in (folder, *folder.parents) if not path.exists()][::-1]
    if blocker is not None:
        raise PathError(f"{flag} {folder}: {blocker} is a file, not a folder; pass another {flag}")
    created = []
    for path in missing:
        try:
            path.mkdir()
        except FileExistsError:  # made meanwhile by another process: not ours to remove
            continue
        except OSError as err:
            remove_empty(created)
            raise os_failure(path.parent, flag, err) from None
        created.append(path)
    return created


def remove_empty(created: list[Path]) -> None:
    """Remove the folders we created, innermost first, while they are empty."""
    for path in reversed(created):
        try:
            path.rmdir()
        except OSError:  # not empty, or gone: leave it and its parents
            return


def check_writable(folder: Path, flag: str, probe: str) -> None:
    """Write and remove ``probe``-PID in ``folder`` or raise PathError: an unwritable path fails before any work."""
    created, probe_file = make_folders(folder, flag), folder / f"{probe}-{os.getpid()}"  # never a concurrent one
    try:
        with one_line(folder, flag):
            os.close(os.open(probe_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            probe_file.unlink()
    finally:
        remove_empty(created)


# A prepare writes into a locked .staging-* folder beside its destination and renames it into place at the end. A
# leftover of a killed prepare is a staging name whose lock can be taken; a locked one is a live prepare's.
STAGING = ".staging-"


def hold_lock(path: Path, wait: bool) -> int | None:
    """An fd of ``path`` holding its flock; None if a live process holds it, it is gone, or nothing can lock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


@contextlib.contextmanager
def staging_folder(parent: Path) -> Iterator[Path]:
    """A new .staging-* folder in ``parent``, locked while the block runs, then removed with what is left in it."""
    parent.mkdir(parents=True, exist_ok=True)
    while True:
        path = Path(tempfile.mkdtemp(dir=parent, prefix=STAGING))
        fd = hold_lock(path, wait=True)  # waits only while a cleanup that found it still unlocked removes it
        if path.is_dir():
            break
        if fd is not None:
            os.close(fd)
    try:
        path.chmod(0o755)
        yield path
    finally:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(folder: Path) -> Iterator[Path]:
    """A staging folder that replaces ``folder`` when the block ends; the old one is renamed aside whole first."""
    with staging_folder(folder.parent) as staging:
        yield staging
        old = staging.with_name(f"{staging.name}-old")  # a staging name too: a kill's leftover is found
        if folder.exists():
            folder.replace(old)
        staging.replace(folder)
        shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(data_dir: Path) -> None:
    """Delete what killed prepares left in data_dir. Never raises: what cannot go is named in a warning."""
    removed = []
    for path in sorted(p for sub in (".", "downloads", "tokenizers") for p in (data_dir / sub).glob(f"{STAGING}*")):
        if (fd := hold_lock(path, wait=False)) is None:
            continue  # a live prepare's
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass  # another prepare removed it first
        except OSError as err:
            warnings.warn(f"could not remove {path}, left by a killed prepare ({err.strerror}); delete it by hand")
        finally:
            os.close(fd)
    if removed:
        print(f"removed {len(removed)} staging leftover(s) of a killed prepare from {data_dir}")


# ----------------------------------------------------------------------------- DDP under torchrun
# Without torchrun the run is a world of one and every helper here is a no-op. Work that can fail on some ranks
# runs inside ``stop_together``, so no rank is left waiting in a collective for a failed peer.
@dataclass(frozen=True)
class Dist:
    """Who this process is in the job; the defaults are a plain single-process run."""
    rank: int = 0  # global index of this process, 0 .. world_size - 1
    world_size: int = 1  # processes in the job (all nodes)
    device: torch.device = torch.device("cpu")  # the device this rank computes on

    @property
    def is_main(self) -> bool:  # rank 0 alone writes checkpoints, logs and wandb
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup(requested: str = "auto") -> Dist:
    """Join the process group torchrun describes (NCCL on CUDA, else gloo); without torchrun, a world of one."""
    device = pick_device(requested)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Dist(device=device)
    rank, local_rank = env_rank(), int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)  # one GPU per process
        torch.cuda.set_device(device)  # NCCL and object collectives use the current device
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                **({"device_id": device} if device.type == "cuda" else {}))
    return Dist(rank=rank, world_size=world_size, device=device)


def teardown(finished: bool) -> None:
    """Leave the group: after a run that ``finished`` on every rank, once all are here (rank 0 may still be saving);
    after an error that stopped every rank, at once (ranks that failed never come; gloo may turn that to SIGABRT)."""
    if dist.is_initialized():
        gc.collect()  # free the DDP wrapper (its reducer holds gloo/NCCL work) while the group still exists
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def env_rank() -> int:  # readable before setup()
    return int(os.environ.get("RANK", "0"))


def print0(*args: Any, **kwargs: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place. A collective, as are the helpers below."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_to_main(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on rank 0 (other ranks get [])."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def agree(values: tuple[int, ...], ddp: Dist, now: bool) -> tuple[int, ...]:
    """Each value's largest on any rank (a flag: true on any). Under DDP a host sync, so only when ``now``; 0s else."""
    if not ddp.enabled:
        return values
    if not now:
        return (0,) * len(values)
    agreed = torch.tensor(values, dtype=torch.int32, device=ddp.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return tuple(agreed.tolist())


@contextlib.contextmanager
def stop_together(device: torch.device) -> Iterator[None]:
    """If the block fails on any rank, all stop: a failed one with its error, the others with PeerFailed; the lowest
    rank with that message reports it. Footgun: every rank must enter, and the block hold no collective."""
    if not dist.is_initialized():
        yield
        return
    error = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 - whatever it is, the other ranks must hear of it
        error = err
    digest = zlib.crc32(str(error).encode())  # ranks compare messages by checksum, not text
    outcomes = torch.zeros(dist.get_world_size(), 2, dtype=torch.long, device=device)  # (W, 2): code, digest
    if error is not None:  # no exit_code (a bug): the peers exit 2, as for bad input
        outcomes[dist.get_rank()] = torch.tensor([getattr(error, "exit_code", EXIT_BAD_INPUT), digest])
    dist.all_reduce(outcomes, op=dist.ReduceOp.SUM)  # rows of ranks that did not fail stay zero
    failed = [(rank, code, their_digest) for rank, (code, their_digest) in enumerate(outcomes.tolist()) if code]
    if error is not None:
        error.reporting_rank = min(rank for rank, _, their_digest in failed if their_digest == digest)
        raise error
    if failed:
        raise PeerFailed(failed[0][1])  # the lowest failing rank's code


@contextlib.contextmanager
def main_first(device: torch.device) -> Iterator[None]:
    """Rank 0 runs the block, then the others; a failure anywhere stops all. Footgun: the others wait at most the
    process-group timeout, so prepare a large corpus before torchrun."""
    main = not dist.is_initialized() or dist.get_rank() == 0  # a world of one: the block runs once
    with stop_together(device):
        if main:
            yield
    with stop_together(device):
        if not main:
            yield


def wrap(model: torch.nn.Module, ddp: Dist) -> torch.nn.Module:
    """DDP around ``model`` in a world of several (it broadcasts rank 0's weights); ``model`` itself otherwise."""
    if not ddp.enabled:
        return model
    return DistributedDataParallel(model, device_ids=[ddp.device] if ddp.device.type == "cuda" else None)


# ----------------------------------------------------------------------------- device, precision, compile, seeds
BF16_MIN_SPEEDUP = 1.5  # CPU autocast adds casts and gains little outside matmuls: these must win clearly


def pick_device(requested: str = "auto") -> torch.device:
    """cuda, then mps, then cpu for "auto"; otherwise the device asked for, if it exists."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:  # torch's message lists 20 device types, most of which tinygpt cannot run on
        raise ConfigError(f"unknown device `{requested}`; use one of auto, cpu, cuda, cuda:N, mps") from None
    count = {"cuda": torch.cuda.device_count(), "mps": int(torch.backends.mps.is_available())}.get(device.type)
    if count is not None and (device.index or 0) >= count:
        raise ConfigError(f"device `{requested}` asked for, but this machine has {count} {device.type} device(s); "
                          "use --device cpu")
    return device


def pick_dtype(requested: str, device: torch.device,
               probe_shape: tuple[int, int, int] = (768, 128, 512)) -> torch.dtype:
    """bf16 on CUDA where supported, else fp16; MPS fp32; on CPU bf16 only where a matmul of ``probe_shape`` runs
    BF16_MIN_SPEEDUP times faster in it (machine dependent: pin --dtype where results must reproduce)."""
    if requested != "auto":
        return getattr(torch, requested)  # float32, bfloat16, float16 (config's choices)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type != "cpu":
        return torch.float32
    fp32 = matmul_gflops(*probe_shape, dtype=torch.float32)
    bf16 = matmul_gflops(*probe_shape, dtype=torch.bfloat16)
    choice = torch.bfloat16 if bf16 >= BF16_MIN_SPEEDUP * fp32 else torch.float32
    print(f"dtype auto -> {dtype_name(choice)}: a {probe_shape[0]}x{probe_shape[1]} @ "
          f"{probe_shape[1]}x{probe_shape[2]} matmul runs at {bf16:.0f} GFLOP/s in bf16 vs {fp32:.0f} in fp32 "
          f"on this CPU (bf16 needs >= {BF16_MIN_SPEEDUP:g}x)")
    return choice


def run_dtype(cfg, device: torch.device, resumed: str = "") -> torch.dtype:
    """cfg's precision; dtype=auto on CPU times the MLP's first matmul at the run's micro-batch (<= 4096 rows), or
    keeps ``resumed`` (last.pt's fp32 or bf16): the timing is noisy, and a resume in another precision is not exact."""
    if cfg.dtype == "auto" and device.type == "cpu" and resumed in ("float32", "bfloat16"):
        return getattr(torch, resumed)
    return pick_dtype(cfg.dtype, device, (min(cfg.batch_size * cfg.block_size, 4096), cfg.n_embd, 4 * cfg.n_embd))


@dataclass(frozen=True)
class Runtime:
    """Where and how a run computes: choose_runtime's, shared by train.py and the tools (bench, doctor, eval)."""
    device: torch.device
    dtype: torch.dtype  # what autocast computes in; weights and optimizer state stay fp32
    threads: int  # torch threads in force
    compile: bool  # torch.compile wanted (compile_for_step falls back to eager if it fails)


def choose_runtime(cfg, device: torch.device | None = None, resumed: str = "") -> Runtime:
    """cfg's device (or this rank's), threads (first: dtype=auto times with them), precision (rank 0's) and compile."""
    device = device or pick_device(cfg.device)
    threads = use_threads(cfg.threads)
    dtype = [run_dtype(cfg, device, resumed) if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(dtype, src=0)  # NCCL: sent via the current device, set in setup()
    return Runtime(device, dtype[0], threads, want_compile(cfg.compile, device))


def refuse_what_cannot_fit(cfg, rt: Runtime) -> None:
    """ConfigError, before data or model, when one step needs more memory than rt.device has (model.step_bytes)."""
    need = step_bytes(cfg, cfg.batch_size, cpu_bf16=rt.device.type == "cpu" and rt.dtype == torch.bfloat16)
    if rt.device.type == "cuda":
        have, where = torch.cuda.get_device_properties(rt.device).total_memory, "the GPU"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine"
    require(need <= have, f"batch_size {cfg.batch_size} x block_size {cfg.block_size}: one training step needs at "
                          f"least {need / 2**30:,.0f} GiB, and {where} has {have / 2**30:,.0f} GiB; lower "
                          f"block_size or batch_size")


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", seconds: float = 0.1) -> float:
    """Measured GFLOP/s of an (m, k) @ (k, n) matmul: the median timing after a warm-up. Its own generator."""
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
    """torch.set_num_threads(threads) unless 0 (one per core); returns the count in force. More than the machine's
    cores is refused: torch slows to a crawl, and at absurd counts crashes without a word."""
    if threads > (cores := os.cpu_count() or 1):
        raise ConfigError(f"--threads {threads}: this machine has {cores} CPU cores; pass at most {cores} (0: one per "
                          "core)")
    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def threads_text(count: int) -> str:
    return f"{count} thread" + ("" if count == 1 else "s")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)  # numpy's range; config allows up to 2**32 - 1, to which DDP adds the rank
    torch.manual_seed(seed)


def want_compile(setting: str, device: torch.device) -> bool:
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def compile_or_eager(model: torch.nn.Module, enabled: bool, probe: Callable[[torch.nn.Module], None]):
    """torch.compile ``model`` and prove it on ``probe`` (random streams untouched); on any failure warn, run eager."""
    if not enabled:
        return model
    print0("compiling the model (torch.compile; the first time can take minutes)")  # or a long compile looks hung
    compiled = torch.compile(model)
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            probe(compiled)  # compile errors surface at the first call
    except Exception as err:  # noqa: BLE001 - any compiler failure means "fall back"
        warnings.warn(f"torch.compile failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                      "running eager", stacklevel=2)
        return model
    finally:
        for p in model.parameters():
            p.grad = None
    return compiled


def compile_for_step(model: torch.nn.Module, stream, rt: Runtime) -> torch.nn.Module:
    """compile_or_eager, probed with step 1's forward/backward (a copy of its batch, its autocast)."""
    def probe(m: torch.nn.Module) -> None:
        x, y = stream.first_batch()  # (B, T) each
        with torch.autocast(rt.device.type, dtype=rt.dtype, enabled=rt.dtype != torch.float32):
            _, loss_sum, n, _ = m(x, y)
        (loss_sum / n).backward()

    return compile_or_eager(model, rt.compile, probe)


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


# ----------------------------------------------------------------------------- signals: how a run stops
class StopOnSignal:
    """SIGINT/SIGTERM ask to stop after this step (the loop saves last.pt, raises error()); after a stop both stay
    ignored so the save and teardown finish (footgun: an in-process caller must put its handlers back)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, install: bool = True) -> None:
        self.install = install  # False: a stand-in that never sees a signal (train() as a library)
        self.signum: int | None = None
        self.previous: dict[int, object] = {}
        self.finished = False  # the loop ended on its own: what it saved is whole

    def __enter__(self) -> "StopOnSignal":
        if self.install and threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self.handle) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        self.finished = exc_info[0] is None
        # SIG_IGN, not our handler: CPython resets Python handlers to SIG_DFL early in shutdown; SIG_IGN stays.
        for signum, handler in self.previous.items():
            signal.signal(signum, signal.SIG_IGN if self.requested else handler)
        self.previous = {}

    def handle(self, signum: int, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum  # the first decides the exit code: SIGTERM then Ctrl-C is still 143
        note = "finishing this step, then saving last.pt" if first else "already stopping; wait for the save"
        if env_rank() == 0:  # torchrun signals every rank: one says it
            os.write(2, f"\n{signal.Signals(signum).name}: {note}\n".encode())  # print() is not reentrant in a handler

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def error(self, step: int) -> RunStopped:
        return RunStopped(f"stopped by {signal.Signals(self.signum).name} after step {step}; last.pt holds it, "
                          "continue with --resume", 128 + self.signum)


@contextlib.contextmanager
def interrupt_until_the_loop() -> Iterator[None]:
    """Until StopOnSignal takes over, SIGINT and SIGTERM raise KeyboardInterrupt (with ``signum``): a SIGTERM before
    step 1 cleans up (staging, lock) as Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame) -> None:
        for other in StopOnSignal.SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        stop = KeyboardInterrupt(signal.Signals(signum).name)
        stop.signum = signum
        raise stop

    previous = {signum: signal.signal(signum, interrupt) for signum in StopOnSignal.SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is interrupt:  # not ignored by a stop meanwhile
                signal.signal(signum, handler)


# gloo's words for a peer that vanished (SIGKILL, a crash): third_party/gloo/gloo/transport/tcp/pair.cc
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def run_error(err: BaseException, finished: bool = False) -> BaseException:
    """``err`` as train.py reports it: Ctrl-C outside the loop (``finished``: after it) or a dead peer as the
    RunStopped it means; others as is."""
    if isinstance(err, KeyboardInterrupt):  # before the first step or after the last save; 143 for a SIGTERM
        code = 128 + err.signum if hasattr(err, "signum") else EXIT_INTERRUPTED
        return RunStopped("interrupted after training finished; what it saved is whole" if finished else
                          "interrupted before training started; nothing was saved", code)
    if (isinstance(err, TinyGPTError) or not isinstance(err, RuntimeError) or not dist.is_initialized()
            or (reason := next((words for words in PEER_GONE if words in str(err)), None)) is None):
        return err
    stopped = RunStopped(f"another rank died without a word (killed or crashed; gloo: {reason}), so this one "
                         "stops too; the last save is intact, continue with --resume", EXIT_PEER_LOST)
    stopped.reporting_rank = env_rank()
    return stopped


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
    """Drop records a killed run logged after last.pt's ``step``; returns the last step the file held (or None)."""
    if not path.is_file():
        return None
    lines = path.read_text().splitlines(keepends=True)
    steps = [json.loads(line)["step"] for line in lines if line.endswith("\n")]
    kept = [line for line, logged in zip(lines, steps) if logged <= step]
    if kept != lines:  # written whole: a kill here must not lose the log
        atomic_write_text(path, "".join(kept))
    return max(steps, default=None)


def is_run_log(path: Path) -> bool:
    """No file, or one whose first line is a MetricsLog record (a run that saved nothing): a new run's to replace."""
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 16)  # a record is a short line; a user's file may be one long one
        record = json.loads(first) if first else {"step": None}  # empty: a run that stopped before its first line
    except FileNotFoundError:
        return True
    except (OSError, ValueError):  # a folder, not UTF-8, not JSON (a blank first line too)
        return False
    return isinstance(record, dict) and "step" in record


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


# ----------------------------------------------------------------------------- what a run says it is
def describe(config) -> str:
    """The model in one line: "block_size 64, n_layer 3, n_head 4, n_embd 128, vocab 65; not default: ..."."""
    shown = [f for f in fields(config) if f.name != "vocab_size"]
    sizes = [f"{f.name} {getattr(config, f.name)}" for f in shown if f.type is int and f.default != 0]
    options = [f"{f.name} {getattr(config, f.name)}" for f in shown
               if not (f.type is int and f.default != 0) and getattr(config, f.name) != f.default]
    return ", ".join(sizes + [f"vocab {config.vocab_size}"]) + "; not default: " + (", ".join(options) or "none")


def summary(model) -> str:
    return (f"{describe(model.config)}; {model.num_params(non_embedding=False) / 1e6:.2f}M parameters "
            "(every weight once, embeddings included)")


def unused_fields(cfg: TrainConfig) -> set[str]:  # muon_lr under adamw, and so on
    return {name for name, (chooser, readers) in USED_ONLY_UNDER.items() if getattr(cfg, chooser) not in readers}


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


def describe_run(cfg: TrainConfig, model, rt, compiled: bool, world_size: int, full_rows: bool) -> str:
    """The start-up lines: model, settings (and any given but unused), where and how it computes."""
    tokens, up_to = cfg.tokens_per_step(), "" if full_rows else "up to "
    return "\n".join([f"model: {summary(model)}", settings_line(cfg), *unused_given(cfg),
                      f"device {rt.device}, {threads_text(rt.threads)}, dtype {dtype_name(rt.dtype)}, "
                      f"compile {compiled}, {up_to}{tokens * world_size:,} tokens/step ({world_size} rank(s) x "
                      f"{tokens:,}), out_dir {cfg.out_dir}"])
