"""How a run meets its machine: files written whole, folders (writable, staged), DDP under torchrun, and the
device, precision, compile and seeds, and whether a step fits in its memory."""
import contextlib
import errno
import fcntl
import gc
import hashlib
import json
import os
import random
import shutil
import statistics
import tempfile
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cli import EXIT_BAD_INPUT, EXIT_WRITE_FAILED, ConfigError, PathError, PeerFailed, env_rank, require
from model import GPTConfig

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
                   errno.ENAMETOOLONG, errno.ELOOP, errno.ENOENT}  # ENOENT: a dangling link, /proc


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
def staged_folder(folder: Path, flag: str = "--data_dir") -> Iterator[Path]:
    """A staging folder that replaces ``folder`` when the block ends; the old one is renamed aside whole first."""
    with one_line(folder.parent, flag), staging_folder(folder.parent) as staging:  # a full disk: one line and 74
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
    for mains_turn in (True, False):  # rank 0's turn, then the others'
        with stop_together(device):
            if main == mains_turn:
                yield


def wrap(model: torch.nn.Module, ddp: Dist) -> torch.nn.Module:
    """DDP around ``model`` in a world of several (it broadcasts rank 0's weights); ``model`` itself otherwise."""
    if not ddp.enabled:
        return model
    return DistributedDataParallel(model, device_ids=[ddp.device] if ddp.device.type == "cuda" else None)


# ----------------------------------------------------------------------------- device, dtype, compile, seeds, memory
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


def step_bytes(config: GPTConfig, batch_size: int, cpu_bf16: bool) -> int:
    """A lower bound on the bytes one step of ``batch_size`` rows holds, to refuse a size that cannot fit before
    anything is allocated: ~34 bytes per token and channel per layer (Korthikanti et al. 2022, eq. 1), the (T, T)
    rules, and on the CPU-bf16 path each layer's (B, nh, T, T) attention weights."""
    B, T = batch_size, config.block_size
    scores = B * config.n_head * T * T * 2 if cpu_bf16 else 0
    return config.n_layer * (B * T * 34 * config.n_embd + scores) + 2 * T * T


def refuse_what_cannot_fit(cfg, rt: Runtime) -> None:
    """ConfigError, before data or model, when one step needs more memory than rt.device has (step_bytes)."""
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
        first = (str(err).strip().splitlines() or [""])[0][:200]  # an inductor assert may carry no message
        warnings.warn(f"torch.compile failed ({type(err).__name__}{': ' if first else ''}{first}); running eager",
                      stacklevel=2)
        return model
    finally:
        model.zero_grad(set_to_none=True)
    return compiled


def compile_for_step(model: torch.nn.Module, stream, rt: Runtime) -> torch.nn.Module:
    """compile_or_eager, probed with step 1's forward/backward (a copy of its batch, its autocast)."""
    def probe(m: torch.nn.Module) -> None:
        x, y = stream.first_batch()  # (B, T) each
        with torch.autocast(rt.device.type, dtype=rt.dtype, enabled=rt.dtype != torch.float32):
            _, loss_sum, n, _ = m(x, y)
        (loss_sum / n).backward()

    return compile_or_eager(model, rt.compile, probe)
