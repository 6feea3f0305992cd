"""Data-parallel training across processes: setup, rank-0 output, reductions, RNG bookkeeping.

    torchrun --standalone --nproc_per_node=8 train.py --config gpt2 --grad_accum 4   # one node, 8 GPUs
    python train.py --config small        # no torchrun: a world of one, nothing set up

torchrun starts one process per device and tells each who it is (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). ``setup`` reads them; without them the run is a world of one and every helper here is a no-op, so
train.py has a single code path. Backend: NCCL on CUDA, gloo otherwise.

Failures: a rank that fails alone must not leave the others waiting in their next collective (a hang until the
process-group timeout, or a gloo "Connection closed by peer" traceback). Work that can fail on some ranks only
(rank 0 writing a checkpoint, a rank reading its files) runs inside ``stop_together``, which makes every rank stop
there, each distinct error printed once. A rank that dies without a word (SIGKILL, a crash) cannot take part:
the survivors' next collective fails in gloo, and train.py turns that into one line per survivor (``lost_peer``).
"""
from __future__ import annotations

import contextlib
import gc
import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from process.errors import EXIT_BAD_INPUT, ConfigError, PeerFailed

T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    """Who this process is in the job. The defaults describe a plain single-process run."""
    rank: int = 0  # global index of this process, 0 .. world_size - 1
    world_size: int = 1  # processes in the job (all nodes)
    local_rank: int = 0  # index on this node: picks the GPU
    device: torch.device = torch.device("cpu")  # the device this rank computes on

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes checkpoints, logs and wandb."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str = "auto") -> torch.device:
    """cuda, then mps, then cpu for "auto"; otherwise the device asked for, if it exists."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:  # torch's message lists 20 device types, most of which tinygpt cannot run on
        raise ConfigError(f"unknown device `{requested}`; use one of auto, cpu, cuda, cuda:N, mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device `{requested}` asked for, but CUDA is not available; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"device `{requested}` asked for, but there are {torch.cuda.device_count()} GPUs")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device `{requested}` asked for, but MPS is not available; use --device cpu")
    return device


def setup(requested: str = "auto") -> Dist:
    """Join the process group torchrun describes; without torchrun, a world of one on the device asked for."""
    device = pick_device(requested)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Dist(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)  # one GPU per process
        torch.cuda.set_device(device)  # NCCL and object collectives use the current device
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                **({"device_id": device} if device.type == "cuda" else {}))
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def teardown() -> None:
    """After a run that finished on every rank: wait for all, then leave the process group. The barrier matters:
    rank 0 may still be writing a checkpoint, and a rank that destroys the group and exits while a peer still
    holds its connections can abort (gloo's "terminate called without an active exception")."""
    if dist.is_initialized():
        gc.collect()  # free the DDP wrapper (its reducer holds gloo/NCCL work) while the group still exists
        dist.barrier()
        dist.destroy_process_group()


def abandon() -> None:
    """After an error that stopped every rank: leave the process group without a barrier (the others may have
    exited already), but leave it: with the group alive gloo's destructor races the peers' exits and can abort
    the process, turning a clean exit code into SIGABRT."""
    if dist.is_initialized():
        gc.collect()  # as in teardown: free what still holds gloo/NCCL work while the group exists
        dist.destroy_process_group()


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args: Any, **kwargs: Any) -> None:
    """print on rank 0 only, so a run on 64 GPUs prints each line once."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, and return it (unchanged in a world of one). A collective: every
    rank must call it, in the same order, or the job hangs."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_to_main(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on rank 0 (other ranks get []). A collective."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


@contextlib.contextmanager
def main_first(device: torch.device) -> Iterator[None]:
    """Rank 0 runs the block first (prepares the corpus); the others wait, then run it. If it fails on rank 0,
    the others stop without running it; if it then fails on another rank, every rank stops (stop_together).
    Footgun: the wait is bounded by the process-group timeout (10 minutes for NCCL), so prepare a large corpus
    (python -m prepare) before torchrun."""
    main = is_main_process()  # True in a world of one: the block runs once, in the first phase
    with stop_together(device):  # rank 0 runs it; the others learn whether it worked
        if main:
            yield
    with stop_together(device):  # the others run it; rank 0 learns whether it worked
        if not main:
            yield


@contextlib.contextmanager
def stop_together(device: torch.device) -> Iterator[None]:
    """Around work that may fail on some ranks only: if it fails anywhere, every rank stops here.

    The ranks compare outcomes in one all-reduce at the end of the block (``device``: this rank's). A rank that
    failed re-raises its own error; the others raise PeerFailed. Each distinct error (same message) is printed
    once, by the lowest rank that has it, which the error carries as ``reporting_rank``. A plain block in a world
    of one. Footgun: a collective, so every rank must enter it, and the block itself must hold none.
    """
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


# gloo's words for a collective whose peer vanished mid-job (SIGKILL, a crash, a lost node): the pair's
# socket closed or reset under it (third_party/gloo/gloo/transport/tcp/pair.cc).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def lost_peer(err: BaseException) -> str | None:
    """gloo's reason if ``err`` is a collective failing because another rank died; None otherwise. Such a peer
    says nothing (it is gone), so the rank that notices must say it, in one line."""
    if not dist.is_initialized() or not isinstance(err, RuntimeError):
        return None
    return next((words for words in PEER_GONE if words in str(err)), None)


def env_rank() -> int:
    """This process's rank as torchrun sets it (0 without torchrun); readable before setup()."""
    return int(os.environ.get("RANK", "0"))


def decide_on_main(decide: Callable[[], T]) -> T:
    """``decide()`` on rank 0 alone, and its result on every rank (a picklable value). A collective, for choices
    that measure the machine (the dtype=auto probe), where ranks measuring each for itself could disagree."""
    if not dist.is_initialized():
        return decide()
    choice = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)  # NCCL: sent via the current device, set in setup()
    return choice[0]


def agree(flags: tuple[bool, ...], ddp: Dist, now: bool) -> tuple[bool, ...]:
    """Flags every rank acts on alike (stop now, out of time): each true if it is true on any rank. In a world of
    one, the flags as they are; under DDP one all-reduce, a host sync, so only when ``now`` (the loop's log steps,
    where it syncs anyway), all False otherwise."""
    if not ddp.enabled:
        return flags
    if not now:
        return (False,) * len(flags)
    summed = all_reduce_sum(torch.tensor(flags, dtype=torch.int32, device=ddp.device))
    return tuple(bool(flag) for flag in summed.tolist())


def wrap(model: torch.nn.Module, ddp: Dist) -> torch.nn.Module:
    """DistributedDataParallel around ``model`` in a world of several, ``model`` itself otherwise. DDP broadcasts
    rank 0's parameters at construction: every rank starts from rank 0's initialisation or checkpoint."""
    if not ddp.enabled:
        return model
    return DistributedDataParallel(model, device_ids=[ddp.device] if ddp.device.type == "cuda" else None)


def rank_rng_state(state: dict[str, Any], ddp: Dist) -> dict[str, Any] | None:
    """This rank's saved random streams; None when this rank did not exist in the saved run. Resuming with
    another world size works but is not bit-exact, and says why."""
    saved = state["rng_per_rank"]
    if len(saved) != ddp.world_size:
        print0(f"WARNING: resuming a run saved with world size {len(saved)} on world size {ddp.world_size}: "
               "training continues but is NOT bit-exact. Each step now averages over "
               f"{ddp.world_size} ranks' windows instead of {len(saved)} (a different global batch and "
               "summation order), and ranks absent from the checkpoint draw fresh data streams "
               "(seed + rank). Resume with the same world size for an exact continuation.")
    return saved[ddp.rank] if ddp.rank < len(saved) else None
