"""Checkpoints, and every way weights come back from disk: a run's checkpoint, GPT-2's weights, a Hugging Face folder.

A checkpoint is torch.save's zip archive of tensors and plain values (``torch.load(weights_only=True)`` reads it, so a
malicious pickle runs no code) with the archive's sha256 as its zip comment, checked before anything is unpickled:
torch.load checks no CRC. ``Checkpointer`` owns last.pt, best.pt and the resume; ``from_checkpoint`` / ``from_flags``
give a model for use, ``start_from`` the weights of --init_from.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import platform
import random
import re
import subprocess
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import runtime
from config import REPO, CheckpointError, CheckpointWriteError, HFError, TrainConfig, as_dict, config_from_dict
from config import given_fields, model_config, resume_changes
from model import GPT, GPTConfig
from runtime import TEMP_MARK, Dist, atomic_write, describe, dtype_name, print0
from tokenizer import NO_TOKENIZER, read_tokenizer, tokenizer_from_meta, tokenizer_vocab_size, without_chat

if TYPE_CHECKING:
    from data import TrainingStream

FORMAT_VERSION = 2  # 2: time_s added
REQUIRED_KEYS = ("format_version", "model", "optimizer", "scaler", "step", "time_s", "best_val_loss", "config",
                 "tokenizer", "rng", "rng_per_rank", "precision", "versions", "last_eval", "corpus")
LORA_KEYS = ("lora",)  # written by a LoRA run (lora_rank > 0) only
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
        raise CheckpointWriteError(f"could not write {path} ({reason[:200]}); the previous {path.name} is intact "
                                   "and no temp file is left") from err


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The state saved in ``path``, its digest checked before weights_only unpickling; else CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    verify_digest(path)
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


def read_config(path: Path) -> dict[str, Any] | None:
    """A checkpoint's config, read cheaply (memory-mapped, digest unchecked); None if it cannot be read so."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - load_checkpoint will name the problem
        return None
    return state.get("config") if isinstance(state, dict) else None


def verify_digest(path: Path) -> None:
    """Raise CheckpointError unless the file ends with the sha256 save_checkpoint stored, and matches it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(0, size - len(COMMENT_START) - 64))
        if (end := f.read())[:-64] != COMMENT_START:
            raise CheckpointError(f"{path}: not a tinygpt checkpoint, or truncated ({size} bytes and no "
                                  "integrity digest at the end)")
        digest, remaining = hashlib.sha256(), size - len(end)  # the archive, up to its comment's length
        f.seek(0)
        while remaining > 0 and (chunk := f.read(min(1 << 24, remaining))):  # empty: shrank under us, a mismatch
            digest.update(chunk)
            remaining -= len(chunk)
    digest.update(b"\0\0")  # the comment's length as torch.save wrote it, which the digest covers
    if digest.hexdigest().encode() != end[-64:]:
        raise CheckpointError(f"{path}: corrupt checkpoint (sha256 mismatch: the file changed after it was saved)")


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
def capture_rng(stream: TrainingStream) -> dict[str, Any]:
    """Every random stream the training run reads (RNG_STREAMS), the training stream's position included."""
    np_state = np.random.get_state()  # its key array stored as a tensor, which weights_only loading accepts
    return {"python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
            "torch_cpu": torch.get_rng_state(),
            "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "data": stream.state_dict()}


def restore_rng(rng: dict[str, Any], stream: TrainingStream) -> None:
    """Put every random stream back (Checkpointer.resume has checked that each is there)."""
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


def check_resumable(path: Path, state: dict[str, Any], cfg: TrainConfig, corpus, fp16_scaler: bool,
                    dtype: torch.dtype) -> None:
    """Refuse a checkpoint this run cannot continue (shape, tokenizer, optimizer, scaler, data: another val split
    would pick best.pt across different sets); warn where it continues, but not exactly."""
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
    """Restore the moments, not the saved groups' settings: a resume with a new --muon_lr must run with it."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, mine in zip(optimizer.param_groups, settings):
        group.update(mine)


class Checkpointer:
    """out_dir's last.pt and best.pt and the resume. Every rank calls ``resume()`` and ``save()`` (collectives), rank
    0 alone writes; best.pt before last.pt, so last.pt's best_val_loss never names a model best.pt lacks."""

    def __init__(self, out_dir: Path, cfg: TrainConfig, run, ddp: Dist):
        """``run``: a train.Run (its model, optimizer, scaler, guard, training stream and corpus)."""
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
        for stale in out_dir.glob(f".*.pt{TEMP_MARK}*"):  # left by a save that was killed
            stale.unlink(missing_ok=True)

    def resume(self) -> tuple[int, float, float]:
        """Load last.pt into the run, each rank its own random streams: (step, seconds spent, best val loss)."""
        path, cfg = self.out_dir / "last.pt", self.cfg
        state = load_checkpoint(path)
        check_resumable(path, state, cfg, self.corpus, self.scaler.is_enabled(), self.dtype)
        if self.lora is None:
            self.model.load_state_dict(state["model"])
        else:  # the adapters, once the base imported now is the one they were trained on (its fingerprint)
            import finetune
            finetune.check_base(state["lora"], self.lora["fingerprint"], str(path))
            finetune.load_adapter_state(self.model, state["model"], str(path))
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if (rng := runtime.rank_rng_state(state, self.ddp)) is not None:
            if missing := [name for name in RNG_STREAMS if name not in rng]:
                raise CheckpointError(f"{path}: checkpoint lacks RNG state for {', '.join(missing)}; resuming would "
                                      "not be exact")
            restore_rng(rng, self.stream)
        done = (" (max_iters reached: nothing to do)" if state["step"] >= cfg.max_iters else
                " (max_time reached: nothing to do; raise --max_time to continue)" if cfg.out_of_time(state["time_s"])
                else "")
        print0(f"resumed from {path} at step {state['step']} (best val loss {state['best_val_loss']:.4f}){done}")
        self.saved_step = state["step"]
        return state["step"], state["time_s"], state["best_val_loss"]

    def save(self, step: int, time_s: float, best_val: float, is_best: bool = False) -> None:
        """Everything a resume needs (REQUIRED_KEYS), from the uncompiled model so keys carry no _orig_mod."""
        self.guard.raise_if_tripped()  # never save a state that a non-finite step touched
        self.guard.raise_if_weights_not_finite(self.model, step)  # nor one that an overflowing update made
        rng_per_rank = runtime.gather_to_main(capture_rng(self.stream))  # a collective: all ranks
        self.saved_step = step
        with runtime.stop_together(self.ddp.device):  # rank 0's write failing (disk full) stops every rank
            if not self.ddp.is_main:
                return
            import tiktoken
            versions = {"python": platform.python_version(), "torch": str(torch.__version__),
                        "numpy": np.__version__, "tiktoken": tiktoken.__version__, **git_state()}
            weights = self.model.state_dict()
            if self.lora:  # the adapters only: the frozen base comes back from init_from, checked by its fingerprint
                from finetune import adapter_state
                weights = adapter_state(self.model)
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
CPU = torch.device("cpu")
RUN_FILES = ("best.pt", "last.pt")  # a run folder's weights, in order of preference


@dataclass(frozen=True)
class Loaded:
    """A model ready for use and what its callers need to know about it."""
    model: GPT  # in eval mode, on the device asked for
    tokenizer: Any  # char, GPT-2's or a BPE, from the checkpoint's description
    cfg: TrainConfig  # the run's config; pretrained weights: the defaults with the weights' shape (adopt)
    precision: str  # the dtype the run trained in: float32, bfloat16, float16 (pretrained: float32)
    source: str  # the checkpoint file, or the pretrained weights as named (--init_from)
    step: int | None  # optimizer steps behind the weights; None: pretrained, no run of ours behind them
    best_val_loss: float  # as the run logged it; nan for pretrained weights
    corpus: dict | None = None  # the data it trained on (data.Corpus.record); None: pretrained


def find_checkpoint(ckpt: str) -> Path:
    """A file as given; a folder's best.pt (else last.pt); by default the newest best.pt under out/."""
    if ckpt:
        if (path := run_checkpoint(ckpt) if Path(ckpt).is_dir() else Path(ckpt)) is None:
            raise CheckpointError(f"{Path(ckpt)}: no best.pt or last.pt in this folder")
        return path
    found = sorted(Path("out").glob("**/best.pt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise CheckpointError("no checkpoint found under out/; train one first: python train.py --config small")
    return found[-1]


def run_checkpoint(source: str) -> Path | None:
    """A run's checkpoint: a .pt, a folder's best.pt (else last.pt); None for anything else (Hugging Face weights)."""
    path = Path(source)
    if path.is_dir():
        return next((path / name for name in RUN_FILES if (path / name).is_file()), None)
    return path if path.suffix == ".pt" else None


def from_checkpoint(path: Path, device: torch.device = CPU, merged: bool = True) -> Loaded:
    """A checkpoint's model, config and tokenizer; a LoRA run's adapters on its base, merged unless ``merged=False``."""
    state = load_checkpoint(path)  # to CPU: the optimizer state it also holds never needs the GPU
    cfg = config_from_dict(state["config"])
    tokenizer = tokenizer_from_meta(state["tokenizer"], Path(cfg.data_dir))
    model = GPT(model_config(cfg, tokenizer.vocab_size))
    if "lora" in state:
        model.load_state_dict(load_base(cfg).weights_for(state["tokenizer"], tokenizer.vocab_size))
        from finetune import load_adapted
        model = load_adapted(state, model, str(path), merged)
    else:
        model.load_state_dict(state["model"])
    return Loaded(model.to(device).eval(), tokenizer, cfg, state["precision"], str(path), state["step"],
                  state["best_val_loss"], state["corpus"])


def from_pretrained(source: str, device: torch.device = CPU) -> Loaded:
    """Hugging Face GPT-2 weights as --init_from names them; the config is the defaults with their shape."""
    pretrained = load_pretrained(source)
    if pretrained.tokenizer is None:
        raise HFError(f"{source}: no tokenizer for a vocabulary of {pretrained.config.vocab_size} ({NO_TOKENIZER})")
    model = GPT(pretrained.config)
    model.load_state_dict(pretrained.state)
    cfg = adopt(TrainConfig(block_size=pretrained.config.block_size), pretrained)
    return Loaded(model.to(device).eval(), tokenizer_from_meta(pretrained.tokenizer, Path("data")), cfg, "float32",
                  source, None, math.nan)


def add_weights_flags(parser: argparse.ArgumentParser) -> None:
    """--ckpt or --init_from: where the weights of sample.py, scripts/eval.py and harness.py come from."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--ckpt", default="", help="checkpoint file or run folder (default: newest out/**/best.pt)")
    source.add_argument("--init_from", "--init-from", default="",
                        help="pretrained weights instead: gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a "
                             "folder / .safetensors in the Hugging Face GPT-2 layout")


def from_flags(args: argparse.Namespace, device: torch.device = CPU) -> Loaded:
    """The weights add_weights_flags' flags chose."""
    if args.init_from:
        return from_pretrained(args.init_from, device)
    return from_checkpoint(find_checkpoint(args.ckpt), device)


# ----------------------------------------------------------------------------- what a run starts from
def start_from(cfg: TrainConfig, device: torch.device = CPU) -> tuple[TrainConfig, Pretrained | None]:
    """train.py's --init_from: the weights, and the config with the options they fix (adopt); else (cfg, None).
    A fresh run; its resume imports the base again. Rank 0 reads (or downloads) first, the others from its cache."""
    if not cfg.init_from:
        return cfg, None
    with runtime.main_first(device):
        pretrained = load_base(cfg)
        cfg = adopt(cfg, pretrained)
        print0(f"init_from {pretrained.source}: {describe(model_config(cfg, pretrained.config.vocab_size))}; "
               f"tokenizer {cfg.tokenizer}; block_size {cfg.block_size} of {pretrained.n_positions} positions")
    return cfg, pretrained


def load_base(cfg: TrainConfig) -> Pretrained:
    """The weights ``cfg.init_from`` names (a run's, else GPT-2's), cropped to a given block_size."""
    given, path = given_fields(cfg), run_checkpoint(cfg.init_from)
    block_size = cfg.block_size if "block_size" in given else 0  # 0: every position the weights have
    if path is not None:
        return load_run(path, block_size)
    return load_pretrained(cfg.init_from, block_size, cfg.bias if "bias" in given else True)


def load_run(path: Path, block_size: int) -> Pretrained:
    """A run's weights, model options and tokenizer (a LoRA run's merged); block_size crops."""
    loaded = from_checkpoint(path)
    saved, state = loaded.model.config, loaded.model.state_dict()
    config = replace(saved, block_size=check_positions(block_size, saved.block_size, str(path)))
    if WPE in state:  # rope has no position table
        state[WPE] = state[WPE][: config.block_size]  # (T, C)
    return Pretrained(config, state, str(path), loaded.tokenizer.meta(), saved.block_size)


def adopt(cfg: TrainConfig, base: Pretrained) -> TrainConfig:
    """The config with the options the base fixes (a run's: all but training-only ones; GPT-2's: IMPORTED, the rest
    must be one GPT-2 computes) and its tokenizer; a given field (config.given_fields) that differs is refused."""
    kept = ("vocab_size", "block_size", *GPTConfig.TRAINING_ONLY)  # the corpus's, the user's, how it is trained
    fixed = IMPORTED if base.gpt2 else [f.name for f in fields(GPTConfig) if f.name not in kept]
    imported = {name: getattr(base.config, name) for name in fixed}
    if base.tokenizer is not None:
        imported["tokenizer"] = base.tokenizer["kind"]
    given = given_fields(cfg)
    flag = lambda value: str(value).lower() if isinstance(value, bool) else str(value)  # noqa: E731 - false, not False
    for name, value in imported.items():
        if name in given and getattr(cfg, name) != value:
            raise HFError(f"--{name} {flag(getattr(cfg, name))} conflicts with {base.source}, whose weights have "
                          f"{name} {flag(value)}; drop --{name} (or that key from the preset): with --init_from "
                          "the weights fix the model")
    adopted = replace(cfg, **imported, block_size=cfg.block_size if "block_size" in given else base.config.block_size)
    if base.gpt2 and (refusals := gpt2_refusals(model_config(adopted, base.config.vocab_size))):
        raise HFError(f"{base.source} holds GPT-2 weights, which cannot run with {refusals[0]}; drop that option "
                      "or train from scratch without --init_from")
    return adopted


# ----------------------------------------------------------------------------- Hugging Face GPT-2: the mapping
# Data, used both ways (import here, export in scripts/export_hf.py): NAMES, GPT-2's weights, which ours share, and
# TRANSPOSED, the matrices transformers keeps in Conv1D layers, (in, out) where nn.Linear has (out, in). The rest is
# shape: our vocabulary is padded to a multiple of 64, our position table may be cropped.
NAMES = (  # every weight of GPT-2, GPT2LMHeadModel's names; {i} is the block index
    "transformer.wte.weight",  # (V, C): V padded ours, the real vocabulary theirs; also lm_head (tied)
    "transformer.wpe.weight",  # (T, C): block_size rows ours, n_positions theirs
    *(f"transformer.h.{{i}}.{layer}.{kind}" for layer in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc",
                                                          "mlp.c_proj") for kind in ("weight", "bias")),
    "transformer.ln_f.weight", "transformer.ln_f.bias",
)
# Conv1D (Radford et al.'s original TF code, kept by transformers) computes x @ W with W (in, out).
TRANSPOSED = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
WTE, WPE, TIED_HEAD = "transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in GPT2Model's files
PREFIX = "transformer."  # GPT2LMHeadModel's keys have it, GPT2Model's (the hub's gpt2) do not

HUB_NAMES = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
HUB_PROBE_TIMEOUT = 5.0  # seconds the hub may take to answer one request before it counts as unreachable
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}  # theirs -> ours
LAYER_NORM_EPS = 1e-5  # GPT-2's epsilon, which is also nn.LayerNorm's default (model.py uses the default)
CONFIG_RULES = (  # config.json fields that change the computation: (name, GPT-2's default, what this model does)
    ("activation_function", "gelu_new", tuple(ACTIVATIONS)),
    ("layer_norm_epsilon", LAYER_NORM_EPS, (LAYER_NORM_EPS,)),
    ("n_inner", None, (None,)),  # null: the MLP is 4 * n_embd wide
    ("scale_attn_weights", True, (True,)),  # attention logits divided by sqrt(hs)
    ("scale_attn_by_inverse_layer_idx", False, (False,)),
    ("tie_word_embeddings", True, (True,)),
)
IMPORTED = ("n_layer", "n_head", "n_embd", "bias", "activation")  # the model options a GPT-2 file fixes
ANY = None  # in GPT2_OPTIONS: the GPT-2 layout holds every value of this option (as it does every training-only one)
# Each model option (model.GPTConfig) -> the values GPT-2's layout computes. An option not listed (a fork's new one)
# is GPT-2's only at its default: export and --init_from refuse any other value by name, never drop it silently.
GPT2_OPTIONS = {"block_size": ANY, "n_layer": ANY, "n_head": ANY, "n_embd": ANY,  # block_size: n_positions
                "bias": ANY,  # bias-free models export zero biases
                "activation": ("gelu", "gelu_tanh")}  # activation_function gelu / gelu_new (see ACTIVATIONS)


def gpt2_refusals(config: GPTConfig) -> list[str]:
    """Every option of ``config`` GPT-2's layout cannot compute, as "name value (GPT-2: ...)"; [] if none."""
    refusals = []
    for option in fields(config):
        # A training-only option (dropout, z_loss) changes how the weights were trained, not what they compute.
        allowed = ANY if option.name in GPTConfig.TRAINING_ONLY else GPT2_OPTIONS.get(option.name, (option.default,))
        value = getattr(config, option.name)
        if option.name != "vocab_size" and allowed is not ANY and value not in allowed:
            refusals.append(f"{option.name} {value!r} (GPT-2 computes {' or '.join(map(repr, allowed))})")
    return refusals


def expand(n_layer: int) -> list[str]:
    """NAMES with {i} filled in for every block."""
    return [name.format(i=i) for name in NAMES for i in (range(n_layer) if "{i}" in name else [None])]


def is_transposed(name: str) -> bool:
    return name.endswith(TRANSPOSED)


def convert(name: str, value: torch.Tensor, vocab_rows: int, block_size: int) -> torch.Tensor:
    """One weight into the other layout, the same rule both ways: a Conv1D matrix transposed, wte's rows padded with
    zeros or cut to ``vocab_rows`` (ours padded, never scored; theirs the real vocabulary), wpe's cut."""
    if is_transposed(name):
        return value.t()  # (in, out) <-> (out, in)
    if name == WTE:  # (V, C)
        return torch.cat([value, value.new_zeros(max(vocab_rows - len(value), 0), value.shape[1])])[:vocab_rows]
    return value[:block_size] if name == WPE else value  # (T, C)


# ----------------------------------------------------------------------------- Hugging Face GPT-2: import
@dataclass
class Pretrained:
    """Weights a run starts from (--init_from), under our names: GPT-2's (load_pretrained) or a run's (load_run)."""
    config: GPTConfig  # what the weights compute; block_size: the position table's rows, once cropped
    state: dict[str, torch.Tensor]
    source: str  # the checkpoint file, or the weights as named
    tokenizer: dict | None  # its description; None where GPT-2's files do not say (the corpus's is taken)
    n_positions: int  # the position table's rows before cropping
    gpt2: bool = False  # GPT-2's: they fix its shape (IMPORTED); every other option must be one GPT-2 computes

    def weights_for(self, tokenizer_meta: dict, vocab_size: int) -> dict[str, torch.Tensor]:
        """The state dict for a corpus of the weights' tokenizer, or of it plus a chat corpus's markers, whose rows
        start at the mean row. Any other tokenizer is refused: the ids would mean other text."""
        base = self.tokenizer or without_chat(tokenizer_meta)  # None: the files do not say; the corpus's, then
        base_vocab = tokenizer_vocab_size(base) or vocab_size
        if base_vocab != self.config.vocab_size:
            raise HFError(f"{self.source} has a vocabulary of {self.config.vocab_size}, the corpus {base_vocab} "
                          f"({base['kind']} tokenizer); use the weights' tokenizer")
        if without_chat(tokenizer_meta) != without_chat(base):
            raise HFError(f"{self.source} was trained with another tokenizer ({base['kind']}) than the corpus's "
                          f"({tokenizer_meta['kind']}); prepare the data with the base's (drop --tokenizer)")
        wte = self.state[WTE]  # (V_padded_base, C)
        rows = GPTConfig(vocab_size=vocab_size).padded_vocab_size
        new = torch.cat([wte, wte.new_zeros(rows - len(wte), wte.shape[1])])  # (V_padded, C), a copy
        new[base_vocab:vocab_size] = wte[:base_vocab].mean(dim=0)  # (V_new - V_base, C): the markers' rows
        return {**self.state, WTE: new, TIED_HEAD: new}


def check_positions(block_size: int, n_positions: int, source: str) -> int:
    """The block_size a model of ``n_positions`` positions is cropped to (0: all of them); more is refused."""
    if block_size > n_positions:
        raise HFError(f"block_size {block_size} exceeds the {n_positions} positions of {source}; use --block_size "
                      f"{n_positions} or less")
    return block_size or n_positions


def load_pretrained(source: str, block_size: int = 0, bias: bool = True) -> Pretrained:
    """Hugging Face GPT-2 weights (hub name, folder or .safetensors) under our names, every key and shape checked;
    block_size 0 keeps every position; bias=False drops the biases (zeros only)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights, config_file = locate(source)
    try:
        raw = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        raise HFError(f"{weights}: not a readable .safetensors file ({str(err)[:160]})") from None
    tensors = {key if key.startswith(PREFIX) or key == TIED_HEAD else PREFIX + key: value.float()
               for key, value in raw.items()}  # GPT2LMHeadModel's names, in fp32
    shape = read_shape(config_file)  # block_size: the file's n_positions
    config = replace(shape, block_size=check_positions(block_size, shape.block_size, source), bias=bias)
    return Pretrained(config, to_ours(tensors, config, shape.block_size, source), source,
                      read_tokenizer(weights.parent, config.vocab_size), shape.block_size, gpt2=True)


def locate(source: str) -> tuple[Path, Path]:
    """(the .safetensors file, its config.json) for a folder, a file or a hub name. A path that is not there is refused,
    not taken for a hub repo (a paragraph about downloading): only OWNER/NAME with no such local folder is one."""
    path = Path(source)
    if path.is_dir():
        path = path / "model.safetensors"
        if not path.is_file():
            raise HFError(f"{path.parent}: no model.safetensors in this folder (the Hugging Face GPT-2 layout)")
    elif path.is_file() and path.suffix != ".safetensors":
        raise HFError(f"{path}: not a .safetensors file; pass one, a folder holding model.safetensors, "
                      f"or a hub name ({', '.join(HUB_NAMES)})")
    elif not path.is_file():
        if source in HUB_NAMES or (re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", source) and not Path(path.parts[0]).is_dir()
                                   and path.suffix not in (".pt", ".safetensors")):
            return download(HUB_NAMES.get(source, source))
        raise CheckpointError(f"{source}: no such run folder or file; pass a run folder (out/NAME), its .pt, a "
                              "folder or .safetensors in the Hugging Face GPT-2 layout, or a hub name "
                              f"({', '.join(HUB_NAMES)} or OWNER/NAME)")
    if not (path.parent / "config.json").is_file():
        raise HFError(f"{path}: no config.json beside it, which says the model's shape; put its config.json beside "
                      "the file")
    return path, path.parent / "config.json"


def download(repo_id: str) -> tuple[Path, Path]:
    """model.safetensors and config.json through huggingface_hub's cache (HF_HOME); from the cache alone if the hub
    does not answer its probe (hub_unreachable), as with HF_HUB_OFFLINE=1: a miss is one line in seconds."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError

    unreachable = None if constants.is_offline_mode() else hub_unreachable(repo_id)
    try:
        config, weights = (huggingface_hub.hf_hub_download(repo_id, name, local_files_only=bool(unreachable))
                           for name in ("config.json", "model.safetensors"))
    except (OSError, EntryNotFoundError) as err:  # offline, not cached, no such repo or file, HTTP errors
        reason = (f"cannot reach {constants.ENDPOINT}: {unreachable}" if unreachable else
                  f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:120]}")
        raise HFError(f"could not get {repo_id} from the Hugging Face hub ({reason}) nor from its cache, and there "
                      f"is no local folder or file of that name; where there is network run `hf download {repo_id} "
                      "model.safetensors config.json --local-dir DIR`, copy DIR here and pass --init_from DIR "
                      "(HF_HUB_OFFLINE=1 skips the hub when the files are in its cache)") from None
    return Path(weights), Path(config)


def hub_unreachable(repo_id: str) -> str | None:
    """Why the hub cannot be reached, or None if it answers (even with an HTTP error): one request, at most
    HUB_PROBE_TIMEOUT s (HF_HUB_ETAG_TIMEOUT if set), where hf_hub_download would retry for ~25 s, a warning each."""
    import httpx2  # huggingface_hub's HTTP client, installed with it
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"),
                             timeout=float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or HUB_PROBE_TIMEOUT))
    except httpx2.TransportError as err:  # no connection: refused, timed out, no DNS, proxy down
        return (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
    except HfHubHTTPError:  # the hub answered (a missing or gated repo): hf_hub_download says what
        return None


def read_shape(config_file: Path) -> GPTConfig:
    """The model config.json describes (block_size: n_positions), if GPT-2's code computes it as ours (CONFIG_RULES)."""
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise HFError(f"{config_file}: not readable JSON ({err})") from None
    if hf.get("model_type") != "gpt2":
        raise HFError(f"{config_file}: model_type {hf.get('model_type')!r}, not 'gpt2': only GPT-2's layout "
                      "maps onto this model")
    if hf.get("n_inner") == 4 * hf.get("n_embd", 0):  # the default MLP width, written out
        hf["n_inner"] = None
    for name, default, allowed in CONFIG_RULES:
        if hf.get(name, default) not in allowed:
            raise HFError(f"{config_file}: {name} is {hf.get(name, default)!r}; this model computes "
                          f"{' or '.join(map(repr, allowed))}")
    try:
        return GPTConfig(vocab_size=int(hf["vocab_size"]), block_size=int(hf["n_positions"]),
                         n_layer=int(hf["n_layer"]), n_head=int(hf["n_head"]), n_embd=int(hf["n_embd"]), bias=True,
                         activation=ACTIVATIONS[hf.get("activation_function", "gelu_new")])
    except KeyError as err:
        raise HFError(f"{config_file}: no {err.args[0]}") from None


def to_ours(tensors: dict[str, torch.Tensor], config: GPTConfig, n_positions: int,
            source: str) -> dict[str, torch.Tensor]:
    """Check every key and shape against ``config``, then transpose, pad and crop."""
    names = expand(config.n_layer)
    given = {key for key in tensors if not key.endswith(NOT_WEIGHTS) and key != TIED_HEAD}
    missing, unexpected = [name for name in names if name not in given], sorted(given - set(names))
    if missing or unexpected:
        raise HFError(f"{source}: missing key {missing[0]}" if missing else
                      f"{source}: unexpected key {unexpected[0]} for a {config.n_layer}-layer GPT-2")
    with torch.device("meta"):  # shapes only: no memory, no init time even for gpt2-xl
        expected = GPT(replace(config, block_size=n_positions, bias=True)).state_dict()
    state = {}
    for name in names:
        value, want = tensors[name], tuple(expected[name].shape)
        want = (config.vocab_size, want[1]) if name == WTE else want[::-1] if is_transposed(name) else want
        if tuple(value.shape) != want:  # the file's wte has the real vocabulary's rows, unpadded
            raise HFError(f"{source}: {name} has shape {tuple(value.shape)}, expected {want} for n_layer "
                          f"{config.n_layer}, n_head {config.n_head}, n_embd {config.n_embd}, "
                          f"vocab {config.vocab_size}")
        if name.endswith(".bias") and not config.bias:
            if value.count_nonzero():
                raise HFError(f"{source}: {name} is not zero (max |b| {value.abs().max():.3g}) but the model has "
                              "bias=False; import with bias=True (drop --bias false)")
            continue  # an exported bias-free model: its zero biases carry nothing
        state[name] = convert(name, value, config.padded_vocab_size, config.block_size).contiguous()
    if TIED_HEAD in tensors and not torch.equal(tensors[TIED_HEAD], tensors[WTE]):
        raise HFError(f"{source}: {TIED_HEAD} differs from {WTE}; this model ties the two")
    return {**state, TIED_HEAD: state[WTE]}
