"""Typed, validated training configuration and the named presets beside this file.

    python train.py --config small --max-iters 500 --learning_rate=3e-4
    python train.py --help            # every field, its default and what it does
    python -c "from config import TrainConfig; help(TrainConfig)"  # the same, and where each is declared

A preset is a TOML file in this folder (``config/small.toml``) or any path to one. Precedence:
dataclass defaults < preset < command line. Unknown keys and bad values raise ``ConfigError`` with a
one-line message before anything is written to disk.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import itertools
import math
import re
import sys
import textwrap
import tomllib
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch

from data import LOADERS, CorpusOptions
from model import GPT, GPTConfig
from process.cli import CommandLine, did_you_mean
from training import lora
from process.errors import ConfigError
from training.optim import CLOCKS, DECAYS, OPTIMIZERS

PRESET_DIR = Path(__file__).resolve().parent
CORPUS_FIELDS = ("vocab_size",)  # GPTConfig fields the corpus sets, not the config

# How a resume treats a field whose value differs from the checkpoint's, declared beside every field:
#   fixed   refused in one line: the run would not be the one that was stopped (shape, tokenizer, seed,
#           optimizer, what best_val_loss is measured on);
#   warned  applied from the resumed step on, with a warning naming it (lr, batch, ...);
#   free    applied silently: it changes nothing that was trained (paths, logging, max_iters).
RESUME_RULES = ("fixed", "warned", "free")


def rule(resume: str, default: Any, help: str, **declared: str) -> Any:
    """A config field: its default, its help (--help and help(TrainConfig) show it), its resume rule and, for one
    declared in another file, where (``declared="model.py, GPTConfig"``): dataclasses.field metadata."""
    assert resume in RESUME_RULES, resume
    return dataclasses.field(default=default, metadata={"resume": resume, "help": help, **declared})


def fixed(default: Any, help: str) -> Any:
    return rule("fixed", default, help)


def warned(default: Any, help: str) -> Any:
    return rule("warned", default, help)


def free(default: Any, help: str) -> Any:
    return rule("free", default, help)


# ----------------------------------------------------------------------------- the fields declared elsewhere
# Three groups of TrainConfig's fields are declared beside the code they configure, each with its type,
# default and help, and made here into a dataclass that TrainConfig inherits, with a resume rule:
#   ModelFields   model.py's GPTConfig (all but vocab_size): fixed, unless GPTConfig.TRAINING_ONLY (warned)
#   TableFields   the Options of training/optim.py's optimizers and lr decays: the rule each Option says
#   CorpusFields  data.py's CorpusOptions: fixed if CorpusOptions.FIXED, else free (a resume checks the corpus)
Declared = tuple[str, Any, dataclasses.Field]  # (name, type, field): what dataclasses.make_dataclass takes


def model_options() -> list[dataclasses.Field]:
    """GPTConfig's fields that a config sets (all but the vocabulary): the model's options."""
    return [f for f in fields(GPTConfig) if f.name not in CORPUS_FIELDS]


def declared_help(owner: str, option: dataclasses.Field) -> str:
    """An option's help, which its declaration must give (``option(default, help)``, process/cli.py)."""
    if not option.metadata.get("help"):
        raise TypeError(f'{owner}.{option.name} has no help: declare it as option(default, "what it does")')
    return option.metadata["help"]


def model_fields() -> list[Declared]:
    """A field for every model option, with GPTConfig's type, default and help: an option is declared once, in
    model.py, and is a flat config key like any other. A resume must keep it, unless it acts only while
    training (GPTConfig.TRAINING_ONLY)."""
    types, declared = typing.get_type_hints(GPTConfig), []
    for option in model_options():
        if option.default is dataclasses.MISSING:
            raise TypeError(f"GPTConfig.{option.name} needs a default: the model as it was before the option")
        resume = "warned" if option.name in GPTConfig.TRAINING_ONLY else "fixed"
        field = rule(resume, option.default, declared_help("GPTConfig", option), declared="model.py, GPTConfig")
        declared.append((option.name, types[option.name], field))
    return declared


def table_fields() -> list[Declared]:
    """A field for every option an optimizer or lr decay declares with itself in training/optim.py."""
    return [(name, type(option.default), rule(option.resume, option.default, option.help,
                                              declared=f"training/optim.py, {table}={entry_name}"))
            for table, entries in (("optimizer", OPTIMIZERS), ("lr_decay", DECAYS))
            for entry_name, entry in entries.items() for name, option in entry.options.items()]


def corpus_fields() -> list[Declared]:
    """A field for every option of data.CorpusOptions (the corpus, its tokenizer, its split), with its type,
    default and help: declared once, in data.py, whose command line (python data.py) takes its flags from them
    too and so needs nothing of config, which is assembled from data.py."""
    types = typing.get_type_hints(CorpusOptions)
    return [(option.name, types[option.name], rule("fixed" if option.name in CorpusOptions.FIXED else "free",
                                                   option.default, declared_help("CorpusOptions", option),
                                                   declared="data.py, CorpusOptions"))
            for option in fields(CorpusOptions)]


def fields_class(name: str, doc: str, declared: list[Declared]) -> type:
    """A dataclass of fields declared elsewhere, for TrainConfig to inherit (a name declared twice, by two
    entries of training/optim.py, fails here: "Field name duplicated")."""
    return dataclasses.make_dataclass(name, declared, namespace={"__doc__": doc, "__module__": __name__})


ModelFields = fields_class("ModelFields", "n_layer, n_head, n_embd, ...: model.py's GPTConfig", model_fields())
TableFields = fields_class("TableFields", "muon_lr, wsd_fraction, ...: training/optim.py's entries", table_fields())
CorpusFields = fields_class("CorpusFields", "dataset, data_path, tokenizer, ...: data.py's CorpusOptions",
                           corpus_fields())


@dataclass
class RunFields:
    """TrainConfig's own fields, declared here: the run, its evaluation, its optimisation and its logging."""
    # Each field: type = resume rule(default, help). Rules: RESUME_RULES above; the help is --help's.
    # --- run ---
    out_dir: str = free("out/default", "folder for last.pt, best.pt and metrics.jsonl")
    seed: int = fixed(1337, "seeds model init, dropout and the data generator (a resume restores their streams)")
    device: str = free("auto", "auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = free("auto", "auto (bf16/fp16 on GPU; on CPU bf16 if a matmul probe finds it faster, else fp32)")
    compile: Literal["auto", "on", "off"] = free("auto", "torch.compile: auto (on for CUDA only) | on | off")
    threads: int = free(0, "torch threads for this run's ops; 0 = torch's default (one per core). Two jobs on 2 cores: 1 each")
    resume: bool = free(False, "continue exactly from out_dir/last.pt")
    init_from: str = free("", 'start from trained weights: a run of this repo (its folder or a .pt) | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a folder or .safetensors in the Hugging Face GPT-2 layout; "" = random init (weights/finetune.py)')
    # --- data: the corpus, its tokenizer and its split are CorpusFields (a resume checks the corpus itself:
    # Corpus.record's fingerprints of both splits) ---
    eval_tokens: int = fixed(0, "val targets scored per eval; 0 = the whole val split (what best_val_loss is measured on)")
    loader: str = fixed("random_windows", 'how training batches are drawn, a name in data.LOADERS (docs/data.md, "The training stream")')
    chat_overflow: Literal["refuse", "truncate"] = fixed("refuse", "a conversation longer than block_size + 1 tokens: refuse the run (naming its line) | truncate it there")
    # --- optimisation (an optimizer's or lr decay's own options are TableFields) ---
    batch_size: int = warned(32, "sequences per micro-batch")
    grad_accum: int = warned(1, "micro-batches per optimizer step")
    max_iters: int = free(2000, "optimizer steps in the whole run")
    optimizer: str = fixed("adamw", "a name in optim.OPTIMIZERS")
    learning_rate: float = warned(1e-3, "peak learning rate, reached after warmup (with optimizer=muon: AdamW's share)")
    min_lr: float = warned(1e-4, "floor of the decay")
    warmup_iters: int = warned(100, "linear warmup steps")
    schedule: Literal[CLOCKS] = warned("steps", "a progress decay's clock: steps (bit-reproducible; over lr_decay_iters) | time (over max_time, or max_iters if the steps run out first)")
    lr_decay: str = fixed("cosine", "the lr schedule, a name in optim.DECAYS")
    lr_decay_iters: int = warned(2000, "a progress decay under schedule=steps: the step at which it reaches min_lr (flat afterwards)")
    weight_decay: float = warned(0.1, "decay of matrices and embeddings (AdamW's decoupled decay; Muon's matrices too); none on gains")
    beta1: float = warned(0.9, "AdamW beta1")
    beta2: float = warned(0.99, "AdamW beta2")
    grad_clip: float = warned(1.0, "max global grad norm; 0 disables clipping (the norm is still logged)")
    # --- logging and evaluation ---
    log_interval: int = free(50, "steps between log lines (the only steps that sync with the device)")
    eval_interval: int = free(500, "steps between evaluations and checkpoints (and one at the end)")
    ckpt_interval: int = free(0, "also save last.pt every this many steps (bounds the loss to a SIGKILL); 0 = only at evals")
    max_skipped_steps: int = free(20, "fp16: stop after this many steps in a row skipped for overflowing gradients")
    max_time: float = warned(0.0, "wall-clock budget in seconds, across resumes; 0 = none (not with schedule=time). Stops cleanly, evals, saves")
    wandb: bool = free(False, "also log to Weights & Biases (offline unless logged in)")
    wandb_project: str = free("tinygpt", "wandb project name")
    # --- fine-tuning ---
    lora_rank: int = fixed(0, "LoRA (Hu et al. 2021): freeze the init_from model, train rank-R adapters beside its lora_targets; 0 = off (train every weight). training/lora.py")
    lora_alpha: float = fixed(16.0, "LoRA's scale is lora_alpha / lora_rank")
    lora_dropout: float = warned(0.0, "dropout on the adapters' input, while training")
    lora_targets: str = fixed("attn.c_attn", "the Linear layers of every block that get adapters, comma-separated: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj (attn.c_attn: PEFT's GPT-2 default)")


def declared_once(cls: type) -> type:
    """Refuse a field declared in two of TrainConfig's groups (model.py, data.py, training/optim.py, here): under
    inheritance one declaration would silently win."""
    where: dict[str, str] = {}
    for group in (*cls.__bases__, cls):
        for name in group.__dict__.get("__annotations__", {}):
            if name in where:
                raise TypeError(f"{name} is declared twice: in {where[name]} and in {group.__name__}; keep one")
            where[name] = group.__name__
    return cls


@dataclass
@declared_once
class TrainConfig(CorpusFields, TableFields, ModelFields, RunFields):
    """Every setting of a run, one flat dataclass: RunFields (declared above) and the fields that model.py,
    training/optim.py and data.py declare (ModelFields, TableFields, CorpusFields), in that order.
    make_config builds one; each field is a flag of train.py and a key of a preset and of a checkpoint.
    """
    # Not an option (no flag, no preset key, no resume rule): the options make_config was given, by the preset
    # or the command line, whatever their value (given_fields reads it). A field, so that dataclasses.replace
    # keeps it and a checkpoint saves it; left out of ==, which compares what two configs train.
    given: tuple[str, ...] = dataclasses.field(default=(), compare=False, metadata={
        "help": "the options make_config was given, whatever their value"})

    def tokens_per_step(self) -> int:
        """Tokens consumed by one optimizer step."""
        return self.batch_size * self.block_size * self.grad_accum

    def out_of_time(self, time_s: float) -> bool:
        """max_time is spent (never, when it is 0) after ``time_s`` seconds of the run's wall clock."""
        return self.max_time > 0 and time_s >= self.max_time


RECORDS = ("given",)  # TrainConfig's fields that record how it was made: not options (no flag, key or rule)
OPTIONS = tuple(f for f in fields(TrainConfig) if f.name not in RECORDS)  # every field a user can set
FIELD_TYPES = {f.name: typing.get_type_hints(TrainConfig)[f.name] for f in OPTIONS}  # int, float, bool, str, Literal
DEFAULTS = {f.name: f.default for f in OPTIONS}
RESUME = {f.name: f.metadata["resume"] for f in OPTIONS}  # name -> fixed | warned | free
MODEL_OPTIONS = tuple(f.name for f in model_options())
CORPUS_OPTIONS = tuple(f.name for f in fields(CorpusOptions))
TABLES = {"optimizer": OPTIMIZERS, "lr_decay": DECAYS}  # fields whose values name an entry of an training/optim.py table
TOKENIZER_USES = {"char": (), "gpt2": (), "bpe": ("bpe_vocab_size",)}  # what each tokenizer reads


def choices(name: str) -> tuple[Any, ...]:
    """The values a field allows: a table's names (optimizer, lr_decay) or a Literal's; () for any other field."""
    if name in TABLES:
        return tuple(TABLES[name])
    if name == "loader":  # a loader is a class and a row of data.LOADERS
        return tuple(LOADERS)
    kind = FIELD_TYPES[name]
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else ()


# ----------------------------------------------------------------------------- what each choice reads
# Which fields an optimizer or an lr schedule (under each clock) reads is recorded, never declared: the
# optimizer is built on a throwaway model and the curve drawn at a few steps, each through a ReadRecorder
# of the config. A declared list would drift from the code, silently: a field listed by mistake was
# "unused" in every run of the other entries, a field missing was warned unused while read, and its
# change on resume applied without a word. tests/test_training_options.py checks the recording against
# perturbing each field.
CHOOSERS = (*TABLES, "schedule", "tokenizer")  # the fields that choose what reads the others: never unused
# The fields the rest of the run reads whatever the choices (the loop, the data, the checkpoint), so never
# unused even where a fork's optimizer or schedule reads one too (batch_size, for a linear-scaling rule).
# tests/test_training_options.py checks it against what that code reads (ast), in both directions.
LOOP_FIELDS = ("batch_size", "chat_overflow", "ckpt_interval", "compile", "data_dir", "data_path", "dataset", "device", "dtype",
               "eval_interval", "eval_tokens", "grad_accum", "grad_clip", "init_from", "loader", "log_interval",
               "max_iters", "max_skipped_steps", "max_time", "out_dir", "resume", "seed", "text_column", "threads",
               "val_fraction", "wandb", "wandb_project")


class ReadRecorder:
    """A stand-in for a config that records the name of every attribute read through it (``reads``).

    The config's own methods run on the recorder, so what they read is recorded too. Writes are refused:
    an entry reads its config, it does not change it. Footgun: a read that bypasses the recorder (a
    global, a config captured elsewhere) is not seen; the perturbation test catches one.
    """

    def __init__(self, cfg: Any):
        object.__setattr__(self, "wrapped", cfg)
        object.__setattr__(self, "reads", set())

    def __getattr__(self, name: str) -> Any:  # called for every name the recorder itself lacks: the fields
        self.reads.add(name)
        method = getattr(type(self.wrapped), name, None)
        if inspect.isfunction(method):
            return method.__get__(self)  # the method reads through the recorder
        return getattr(self.wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a table entry set config.{name}; entries read the config, never write it")


def throwaway_model() -> GPT:
    """A one-layer model to build optimizers on, made without touching the global RNG (a run's stream: the
    recording happens at start-up, after the seed or a checkpoint set it)."""
    with torch.random.fork_rng(devices=[]):  # the CPU generator, which init draws from, put back after
        return GPT(GPTConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=8, block_size=4))


def curve_points(cfg: TrainConfig) -> list[tuple[int, float]]:
    """(step, seconds) at which a curve is drawn to record what it reads: every side of every step and time
    a curve may branch on (warmup's end, lr_decay_iters, max_iters, max_time) and far past them."""
    ends = (cfg.warmup_iters, cfg.lr_decay_iters, cfg.max_iters)
    steps = sorted({0, 1, 2 * sum(ends) + 1} | {max(0, end + d) for end in ends for d in (-1, 0, 1)})
    seconds = (0.0, cfg.max_time / 2, cfg.max_time, 2 * cfg.max_time)
    return [(step, time_s) for step in steps for time_s in seconds]


def record_reads(field: str, name: str, cfg: TrainConfig) -> frozenset[str]:
    """The TrainConfig fields that entry ``name`` of TABLES[field] reads under ``cfg``: an optimizer while it
    builds (on CPU, in fp32), an lr schedule while its curve is drawn at curve_points under cfg.schedule."""
    recorder, entry = ReadRecorder(cfg), TABLES[field][name]
    try:
        with torch.random.fork_rng(devices=[]):  # a builder that draws from the global RNG moves no run's stream
            if field == "optimizer":
                entry.build(throwaway_model(), recorder, torch.device("cpu"), torch.float32)
            else:
                for step, time_s in curve_points(cfg):
                    entry.lr(step, recorder, time_s)
    except Exception:  # an entry that cannot build here (a CUDA-only optimizer): its own options, at least
        return frozenset(entry.options)
    return frozenset(recorder.reads & set(FIELD_TYPES))


def with_clock(cfg: TrainConfig, clock: str) -> TrainConfig:
    """``cfg`` under another schedule (a budget of 1 s where schedule=time has none: its curve divides by it)."""
    return dataclasses.replace(cfg, schedule=clock, max_time=(cfg.max_time or 1.0) if clock == "time" else cfg.max_time)


@functools.lru_cache(maxsize=512)
def recorded_reads(values: tuple[Any, ...], entries: tuple[Any, ...]) -> tuple[frozenset[str], frozenset[str]]:
    """(what the config's own optimizer and lr schedule read, what any optimizer or schedule reads under any
    clock it allows), for the config of these field values (FIELD_TYPES order): recorded once per config and
    per state of the tables (``entries``: a test may declare an entry for its duration)."""
    cfg = TrainConfig(**dict(zip(FIELD_TYPES, values)))
    own = record_reads("optimizer", cfg.optimizer, cfg) | record_reads("lr_decay", cfg.lr_decay,
                                                                       with_clock(cfg, cfg.schedule))
    anyone = {read for name in OPTIMIZERS for read in record_reads("optimizer", name, cfg)}
    anyone |= {read for name, entry in DECAYS.items() for clock in entry.clocks
               for read in record_reads("lr_decay", name, with_clock(cfg, clock))}
    return own, frozenset(anyone)


def choice_reads(cfg: TrainConfig) -> tuple[frozenset[str], frozenset[str]]:
    """(what this run's optimizer and lr schedule read, what some optimizer or schedule reads), recorded."""
    entries = tuple((field, name, id(entry)) for field, table in TABLES.items() for name, entry in table.items())
    return recorded_reads(tuple(getattr(cfg, name) for name in FIELD_TYPES), entries)


def unused_fields(cfg: TrainConfig) -> set[str]:
    """Fields that some optimizer, lr schedule, clock or tokenizer reads but this run's do not (muon_lr under
    adamw, lr_decay_iters under schedule=time). Neither the choosing fields nor the loop's are ever unused."""
    own, anyone = choice_reads(cfg)
    owned = set(anyone) | {name for uses in TOKENIZER_USES.values() for name in uses}
    return owned - own - set(TOKENIZER_USES[cfg.tokenizer]) - set(CHOOSERS) - set(MODEL_OPTIONS) - set(LOOP_FIELDS)


def unused_given(cfg: TrainConfig) -> list[str]:
    """A warning per field the user set (preset or command line) that this run does not read."""
    chosen = ", ".join([f"{name}={getattr(cfg, name)}" for name in TABLES]
                       + [f"schedule={cfg.schedule}", f"tokenizer={cfg.tokenizer}"])
    return [f"WARNING: {name} is set ({getattr(cfg, name)!r}) but unused: {chosen} do not read it"
            for name in sorted(unused_fields(cfg) & given_fields(cfg))]


def settings_line(cfg: TrainConfig) -> str:
    """The start-up line of what trains, beside the model line: the optimizer, the lr decay, its clock and the
    step count always, then every other setting that shapes training (resume rule fixed or warned) and differs
    from its default. Model options are the model line's; paths and logging are not training."""
    always = ("optimizer", *(name for name in TABLES if name != "optimizer"), "schedule", "max_iters")
    unused = unused_fields(cfg)
    rest = [name for name in FIELD_TYPES if name not in always and name not in MODEL_OPTIONS
            and RESUME[name] != "free" and getattr(cfg, name) != DEFAULTS[name] and name not in unused]
    return "settings: " + ", ".join(f"{name} {getattr(cfg, name)}" for name in (*always, *rest))


def type_name(name: str) -> str:
    """int, float, bool or str: what --help and errors call a field's type."""
    kind = FIELD_TYPES[name]
    return "str" if choices(name) else kind.__name__


def field_help() -> dict[str, str]:
    """Each option's help, as its declaration gives it (so --help never drifts); a table's field (optimizer,
    lr_decay) also lists the table's entries, each with its docstring's first line."""
    help_text = {f.name: f.metadata["help"] for f in OPTIONS}
    for table_field, table in TABLES.items():
        entries = (f"{name}: {(entry.doc or name).rstrip('.')}" for name, entry in table.items())
        help_text[table_field] += " (" + "; ".join(entries) + ")"
    return help_text


def field_doc(f: dataclasses.Field, help_text: str) -> list[str]:
    """One field in help(TrainConfig): ``n_layer: int = 4, fixed`` (a Literal's or a table's values for its
    type; given is no option), then its help, wrapped and indented."""
    if f.name in FIELD_TYPES:
        head = f"{f.name}: {' | '.join(map(str, choices(f.name))) or type_name(f.name)} = {f.default!r}, {RESUME[f.name]}"
    else:
        head = f"{f.name}: {f.type} = {f.default!r}, not an option"
    return ["    " + head, *textwrap.wrap(help_text, 100, initial_indent=" " * 8, subsequent_indent=" " * 8,
                                         break_on_hyphens=False)]


def declared_in(f: dataclasses.Field) -> str:
    """Where a field of TrainConfig is declared: the file and class its metadata names, else the class here."""
    if "declared" in f.metadata:
        return f.metadata["declared"]
    owner = next(cls for cls in TrainConfig.__mro__ if f.name in cls.__dict__.get("__annotations__", {}))
    return f"config/__init__.py, {owner.__name__}"


def fields_doc() -> str:
    """help(TrainConfig)'s list of every field, under where it is declared."""
    helps, lines = field_help(), ["Fields, by where each is declared (name: type = default, resume rule):"]
    for declared, group in itertools.groupby(fields(TrainConfig), key=declared_in):
        lines += ["", f"{declared}:"]
        for f in group:
            lines += field_doc(f, helps.get(f.name, f.metadata["help"]))
    return "\n".join(lines)


# Generated from the declarations, as --help is, so that help(TrainConfig) lists every field.
TrainConfig.__doc__ = inspect.cleandoc(TrainConfig.__doc__) + "\n\n" + fields_doc()


def parse_value(name: str, raw: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise ConfigError."""
    kind = type_name(name)
    try:
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            lowered = str(raw).lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            if isinstance(raw, bool) or isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(str(raw).replace("_", "")) if isinstance(raw, str) else int(raw)
        if kind == "float":
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        return str(raw)
    except ValueError:
        raise ConfigError(f"{name} must be {kind}, got {raw!r}") from None


def unknown_key_error(key: str, where: str) -> ConfigError:
    hint = did_you_mean(key.replace("-", "_"), list(FIELD_TYPES), "field")
    return ConfigError(f"unknown config key `{key}` in {where}{hint}")


def load_preset(name: str) -> dict[str, Any]:
    """Read a preset by name (config/NAME.toml) or path, checking its keys."""
    path = Path(name) if name.endswith(".toml") else PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.toml")))
        raise ConfigError(f"no preset `{name}` (looked for {path}); known presets: {known}")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    for key in values:
        if key not in FIELD_TYPES:
            raise unknown_key_error(key, str(path))
    return {key: parse_value(key, value) for key, value in values.items()}


def check_numbers(cfg: TrainConfig) -> None:
    """Raise ConfigError for a size, count, interval or rate out of its range."""
    positive = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "grad_accum", "max_iters",
                "log_interval", "eval_interval", "max_skipped_steps")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be > 0, got {getattr(cfg, name)}")
    for name in ("warmup_iters", "lr_decay_iters", "eval_tokens", "ckpt_interval", "threads"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    for name in ("learning_rate", "min_lr", "weight_decay", "grad_clip", "max_time"):
        value = getattr(cfg, name)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name} must be a finite number >= 0, got {value}")
    if cfg.learning_rate == 0:
        raise ConfigError("learning_rate must be > 0")
    if cfg.min_lr > cfg.learning_rate:
        raise ConfigError(f"min_lr ({cfg.min_lr}) must not exceed learning_rate ({cfg.learning_rate})")


def check_settings(cfg: TrainConfig) -> None:
    """Raise ConfigError for a model shape, data split, beta or device that cannot work."""
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"dropout must be in [0, 1), got {cfg.dropout}")
    if not 0 < cfg.val_fraction < 1:
        raise ConfigError(f"val_fraction must be in (0, 1), got {cfg.val_fraction}")
    if not cfg.text_column:
        raise ConfigError("text_column must name the .jsonl field or .parquet column holding the text, got \"\"")
    for name, beta in (("beta1", cfg.beta1), ("beta2", cfg.beta2)):
        if not 0 <= beta < 1:
            raise ConfigError(f"{name} must be in [0, 1), got {beta}")
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", cfg.device):
        raise ConfigError(f"unknown device `{cfg.device}`; use one of auto, cpu, cuda, cuda:N, mps")


def check_choices(cfg: TrainConfig) -> None:
    """Raise ConfigError for an option its table entry refuses, a value outside a field's choices, or a pair of
    choices that cannot go together; then run the model's own checks."""
    for entry in (*OPTIMIZERS.values(), *DECAYS.values()):  # the options training/optim.py declares, by their own checks
        for name, option in entry.options.items():
            if not option.valid(getattr(cfg, name)):
                raise ConfigError(f"{name} must {option.must}, got {getattr(cfg, name)}")
    if cfg.bpe_vocab_size < 257:
        raise ConfigError(f"bpe_vocab_size must be >= 257 (the 256 bytes and <|endoftext|>), got {cfg.bpe_vocab_size}")
    if cfg.schedule == "time" and cfg.max_time == 0:
        raise ConfigError("schedule=time decays the lr over max_time: set max_time (seconds) or use schedule=steps")
    for name in FIELD_TYPES:
        allowed = choices(name)
        if allowed and getattr(cfg, name) not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got `{getattr(cfg, name)}`")
    if cfg.schedule not in DECAYS[cfg.lr_decay].clocks:  # a step schedule: its curve counts steps only
        driven = ", ".join(name for name, entry in DECAYS.items() if cfg.schedule in entry.clocks)
        raise ConfigError(f"lr_decay={cfg.lr_decay} is a function of the step, which schedule={cfg.schedule} cannot "
                          f"drive; use schedule=steps, or an lr_decay that it can ({driven})")
    check_lora(cfg)
    try:
        model_config(cfg, vocab_size=1)  # the model's own checks of its options (GPTConfig.__post_init__)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def validate(cfg: TrainConfig) -> TrainConfig:
    """Raise ConfigError naming the first bad value and the fix."""
    check_numbers(cfg)
    check_settings(cfg)
    check_choices(cfg)
    return cfg


def check_lora(cfg: TrainConfig) -> None:
    """The LoRA fields' checks (training/lora.py): a base to adapt, a rank, known targets."""
    if cfg.lora_rank < 0:
        raise ConfigError(f"lora_rank must be >= 0 (0 = off), got {cfg.lora_rank}")
    if not cfg.lora_rank:
        return
    if not cfg.init_from:
        raise ConfigError("LoRA adapts a trained model: pass --init_from (gpt2, a Hugging Face folder or "
                          ".safetensors) with --lora_rank, or drop --lora_rank to train from scratch")
    if not (math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0):
        raise ConfigError(f"lora_alpha must be a finite number > 0, got {cfg.lora_alpha}")
    if not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    try:
        lora.parse_targets(cfg.lora_targets)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def make_config(preset: str | None = None, **overrides: Any) -> TrainConfig:
    """Defaults, then the preset, then overrides; validated. The one way configs are built.

    The config remembers which fields the preset and the overrides set (``given``), even to the default.
    """
    values = load_preset(preset) if preset else {}
    for key, raw in overrides.items():
        if key not in FIELD_TYPES:
            raise unknown_key_error(key, "the overrides")
        values[key] = parse_value(key, raw)
    return validate(TrainConfig(**values, given=tuple(sorted(values))))


def given_fields(cfg: TrainConfig) -> frozenset[str]:
    """The fields the user chose: those make_config was given (whatever their value), and any not at its default.

    ``dataclasses.replace`` keeps the record (``given`` is a field); a ``TrainConfig(...)`` built by hand has
    none, unless it is passed one, so there only the fields off their defaults count.
    """
    return frozenset(cfg.given) | {name for name in FIELD_TYPES if getattr(cfg, name) != DEFAULTS[name]}


def config_from_dict(values: dict[str, Any]) -> TrainConfig:
    """Rebuild a config saved in a checkpoint (as_dict), ignoring keys this version does not have, with one
    warning naming them: a checkpoint of a fork (a model option this code lacks) would otherwise load as another
    model. A checkpoint saved before ``given`` was a field has none: the record starts empty."""
    unknown = {k: v for k, v in values.items() if k not in FIELD_TYPES and k not in RECORDS}
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in sorted(unknown.items()))
        print(f"WARNING: the checkpoint's config has fields this code does not know ({listed}); they are ignored "
              "here, so a model saved by other code (a fork) may compute something else", file=sys.stderr)
    options = {k: v for k, v in values.items() if k in FIELD_TYPES}
    return TrainConfig(**options, given=tuple(values.get("given", ())))  # a list, where a checkpoint holds one


TRAIN_DESCRIPTION = "Train a tiny GPT. Every config field below can be set from the command line."


def build_parser(preset: str | None = None, description: str = TRAIN_DESCRIPTION) -> argparse.ArgumentParser:
    """train.py's command line (doctor.py's too, with its own ``description``); with a ``preset``, --help
    shows the preset's values as the defaults, since those are what a flag left out means."""
    parser = CommandLine(description=description)
    parser.add_argument("--config", default=None,
                        help="preset name in config/ (tiny, small, gpt2, nanogpt_cpu, finetune_shakespeare) or a path to a .toml file")
    data_group = parser.add_argument_group("data options (declared in data.py's CorpusOptions)")
    model_group = parser.add_argument_group("model options (declared in model.py's GPTConfig)")
    helps = field_help()
    from_preset = load_preset(preset) if preset else {}
    for f in OPTIONS:
        flags = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        is_bool = type_name(f.name) == "bool"
        metavar = "{" + ",".join(choices(f.name)) + "}" if choices(f.name) else type_name(f.name).upper()
        default = f"{from_preset[f.name]}, from {preset}; else {f.default}" if f.name in from_preset else f.default
        # nargs="?" lets booleans stand alone (--resume) or take a value (--resume false).
        group = model_group if f.name in MODEL_OPTIONS else data_group if f.name in CORPUS_OPTIONS else parser
        group.add_argument(
            *flags, dest=f.name, default=argparse.SUPPRESS, metavar=metavar, nargs="?" if is_bool else None,
            const="true" if is_bool else None,
            help=helps.get(f.name, "") + (f" (default: {default})" if default != "" else ""))  # "": said in the help
    return parser


def preset_given(argv: list[str] | None) -> str | None:
    """The --config of a command line, read ahead of the full parse (whose --help needs it)."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--config", default=None)
    return early.parse_known_args(argv)[0].config


def parse_args(argv: list[str] | None = None, description: str = TRAIN_DESCRIPTION) -> TrainConfig:
    """Command line to validated config. Raises ConfigError on a mistake (argparse exits on --help)."""
    parser = build_parser(preset_given(argv), description)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = next((u for u in unknown if u.startswith("-")), unknown[0])
        raise unknown_key_error(flag.lstrip("-").split("=")[0], "the command line") \
            if flag.startswith("-") else ConfigError(f"unexpected argument `{flag}`")
    overrides = vars(args)
    preset = overrides.pop("config")
    return make_config(preset, **overrides)


def resume_changes(saved: dict[str, Any], cfg: TrainConfig) -> dict[str, list[str]]:
    """Fields whose value differs between a checkpoint's config and ``cfg``, by resume rule, described for
    the user: {"fixed": [...], "warned": [...]} (free fields are left out, and so are warned fields this run
    does not read: a changed muon_lr under adamw changes nothing).

    A field the checkpoint lacks (saved before the field existed) meant the field's default.
    """
    saved = {**DEFAULTS, **saved}
    unused = unused_fields(cfg)
    changes: dict[str, list[str]] = {"fixed": [], "warned": []}
    for name, resume in RESUME.items():
        if resume in changes and saved[name] != getattr(cfg, name) and not (resume == "warned" and name in unused):
            changes[resume].append(f"{name}: checkpoint {saved[name]!r} vs now {getattr(cfg, name)!r}")
    return changes


def model_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    """The model part of a training config: every model option; the vocabulary comes from the corpus."""
    return GPTConfig(vocab_size=vocab_size, **{name: getattr(cfg, name) for name in MODEL_OPTIONS})


def as_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Every field, as plain values (a checkpoint's "config", wandb's); config_from_dict reads it back."""
    return dataclasses.asdict(cfg)
