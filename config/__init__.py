"""Every setting of a run, one dataclass read like a form, and its presets (the .toml files beside this one).

    python train.py --config small --max-iters 500 --learning_rate=3e-4   # defaults < preset < command line
    python train.py --help            # every field, its default (the preset's, with --config) and its help
"""
import argparse
import dataclasses
import functools
import math
import re
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin, get_type_hints

from cli import CommandLine, ConfigError, did_you_mean, parse_typed, require
from model import GPTConfig

REPO = Path(__file__).resolve().parent.parent  # the checkout: its entry points, and data/ (the default data_dir)
PRESET_DIR = REPO / "config"
PRESETS = sorted(path.stem for path in PRESET_DIR.glob("*.toml"))
RESUME_RULES = ("fixed", "warned", "free")


def option(resume: str, default: Any, help: str) -> Any:
    """A field; ``resume``: a changed value is refused (fixed), applied with a warning (warned) or silently (free)."""
    return dataclasses.field(default=default, metadata={"resume": resume, "help": help})


fixed, warned, free = (functools.partial(option, rule) for rule in RESUME_RULES)
LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # what lora_targets may name
LORA_FIELDS = ("lora_alpha", "lora_dropout", "lora_targets")  # read only with lora_rank > 0


@dataclasses.dataclass
class TrainConfig(GPTConfig):
    """Every setting of a run: GPTConfig's model options, then these; each a flag, a preset and a checkpoint key."""
    vocab_size: ClassVar[None] = None  # the corpus's, not an option (model_config sets it)
    # --- the run
    out_dir: str = free("out/default", "folder for last.pt, best.pt and metrics.jsonl")
    seed: int = fixed(1337, "seeds model init, dropout and the data generator (a resume restores their streams)")
    device: str = free("auto", "auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = free("auto", "auto: GPU bf16/fp16; CPU bf16 if faster")
    compile: Literal["auto", "on", "off"] = free("auto", "torch.compile: auto (on for CUDA only) | on | off")
    threads: int = free(0, "torch threads; 0 = torch's default (one per core). Two jobs on 2 cores: 1 each")
    resume: bool = free(False, "continue exactly from out_dir/last.pt")
    init_from: str = free("", "start from trained weights (their tokenizer prepares the corpus): a run's folder or "
                          '.pt (GPT-2: python -m scripts.import_hf gpt2 out/gpt2); "" = random init')
    # free: a base may move; set or unset against the checkpoint's is another run, refused (checkpoint.resume_changes)
    # --- the corpus (python -m scripts.prepare's flags too)
    dataset: str = free("shakespeare", "built-in corpus name; ignored when data_path is set")
    data_path: str = free("", "the corpus: a .txt file, a folder of train.bin, val.bin and meta.json, or documents "
                          "(.txt/.parquet files, a .jsonl, a .parquet: tokenized by python -m scripts.prepare)")
    text_column: str = free("text", "the documents' text: a .jsonl's field or a .parquet's column (a .txt has none)")
    data_dir: str = free("data", "cache of downloaded and prepared corpora")
    tokenizer: Literal["char", "gpt2", "bpe"] = fixed("char", "char (the corpus's) | gpt2 (GPT-2's) | bpe (trained)")
    bpe_vocab_size: int = fixed(2048, "tokenizer=bpe: tokens in all (256 bytes, merges, <|endoftext|>), 257 to 2**32")
    val_fraction: float = free(0.1, "share held out for validation (the tail of a text file; every k-th document)")
    # --- the batches
    eval_tokens: int = fixed(0, "val targets scored per eval; 0 = the whole val split (best_val_loss's measure)")
    loader: Literal["random_windows", "bos_packed"] = fixed("random_windows", "how batches are drawn (docs/data.md)")
    chat_overflow: Literal["refuse", "truncate"] = fixed("refuse", "a chat over block_size + 1 tokens: refuse|truncate")
    batch_size: int = warned(32, "sequences per micro-batch")
    grad_accum: int = warned(1, "micro-batches per optimizer step")
    # --- the optimizer and the lr
    max_iters: int = free(2000, "optimizer steps in the whole run")
    optimizer: Literal["adamw", "muon"] = fixed("adamw", "muon: Muon for the blocks' matrices, AdamW for the rest")
    muon_lr: float = warned(0.02, "Muon's peak lr (its matrices' lr is the schedule's times muon_lr / learning_rate)")
    learning_rate: float = warned(1e-3, "peak lr, reached after warmup (with optimizer=muon: AdamW's share)")
    min_lr: float = warned(1e-4, "floor of the decay")
    warmup_iters: int = warned(100, "linear warmup steps")
    schedule: Literal["steps", "time"] = warned("steps", "decay's clock: steps (bit-reproducible) | time (max_time)")
    lr_decay: Literal["cosine", "wsd"] = fixed("cosine", "after warmup, to min_lr: cosine | wsd (flat, then linear)")
    wsd_fraction: float = fixed(0.2, "lr_decay=wsd: the final share of the decay spent going linearly to min_lr")
    lr_decay_iters: int = warned(2000, "schedule=steps: the step at which the decay reaches min_lr (flat afterwards)")
    weight_decay: float = warned(0.1, "decay of matrices and embeddings (AdamW's, decoupled; Muon's too), not gains")
    beta1: float = warned(0.9, "AdamW beta1")
    beta2: float = warned(0.99, "AdamW beta2")
    grad_clip: float = warned(1.0, "max global grad norm; 0 disables clipping (the norm is still logged)")
    # --- logging, evaluation and checkpoints
    log_interval: int = free(50, "steps between log lines (the only steps that sync with the device)")
    eval_interval: int = free(500, "steps between evaluations and checkpoints (and one at the end)")
    ckpt_interval: int = free(0, "also save last.pt every this many steps (bounds a SIGKILL's loss); 0 = at evals")
    max_skipped_steps: int = free(20, "fp16: stop after this many steps in a row skipped for overflowing gradients")
    max_time: float = warned(0.0, "wall-clock budget in seconds, across resumes, then eval and save; 0 = none")
    wandb: bool = free(False, "also log to Weights & Biases (offline unless logged in)")
    wandb_project: str = free("tinygpt", "wandb project name")
    # --- fine-tuning (finetune.py)
    lora_rank: int = fixed(0, "LoRA (Hu et al. 2021): train rank-R adapters beside the frozen init_from; 0 = off")
    lora_alpha: float = fixed(16.0, "LoRA's scale is lora_alpha / lora_rank")
    lora_dropout: float = warned(0.0, "dropout on the adapters' input, while training")
    lora_targets: str = fixed("attn.c_attn", "the Linear layers of every block that get adapters, comma-separated: "
                                             f"{', '.join(LORA_TARGETS)} (attn.c_attn: PEFT's GPT-2 default)")
    given: tuple[str, ...] = dataclasses.field(default=(), compare=False)  # not an option: see given_fields

    def __post_init__(self) -> None:  # GPTConfig's checks run in validate, as a ConfigError
        pass

    def tokens_per_step(self) -> int:  # the most one optimizer step reads, every row full (a rank's: ranks multiply)
        return self.batch_size * self.block_size * self.grad_accum

    def out_of_time(self, time_s: float) -> bool:  # max_time (never, when 0) is spent after time_s seconds
        return self.max_time > 0 and time_s >= self.max_time


# The fields some choices read: under another they are unused (warned about when set, not shown, not compared).
USED_ONLY_UNDER = {"muon_lr": ("optimizer", ("muon",)), "wsd_fraction": ("lr_decay", ("wsd",)),  # field: (chooser,
                   "lr_decay_iters": ("schedule", ("steps",)), "bpe_vocab_size": ("tokenizer", ("bpe",))}  # readers)
OPTIONS = tuple(f for f in dataclasses.fields(TrainConfig) if f.name != "given")  # every field a user can set
DEFAULTS = {f.name: f.default for f in OPTIONS}
FIELD_HELP = {f.name: f.metadata["help"] for f in OPTIONS}  # other scripts' flags of the same meaning borrow it
FIELD_TYPES = {name: kind for name, kind in get_type_hints(TrainConfig).items() if name in DEFAULTS}
RESUME = {f.name: f.metadata.get("resume", "warned" if f.name in GPTConfig.TRAINING_ONLY else "fixed") for f in OPTIONS}
MODEL_OPTIONS = tuple(f.name for f in dataclasses.fields(GPTConfig) if f.name != "vocab_size")
CORPUS_OPTIONS = ("dataset", "data_path", "text_column", "data_dir", "tokenizer", "bpe_vocab_size", "val_fraction")


def choices(name: str) -> tuple[Any, ...]:  # a Literal's values; () for any other field
    return get_args(FIELD_TYPES[name]) if get_origin(FIELD_TYPES[name]) is Literal else ()


def unknown_key(key: str, where: str) -> "ConfigError":
    hint = did_you_mean(key.replace("-", "_"), list(FIELD_TYPES), "python train.py --help lists every field")
    return ConfigError(f"unknown config key `{key}` in {where}{hint}")


def typed(values: dict[str, Any], where: str) -> dict[str, Any]:
    for key, value in values.items():
        require(not isinstance(value, dict), f"[{key}] in {where}: a preset's keys are top level, with no [tables]")
        if key not in FIELD_TYPES:
            raise unknown_key(key, where)
    return {key: parse_typed(key, FIELD_TYPES[key], value) for key, value in values.items()}


def load_preset(name: str) -> dict[str, Any]:  # config/NAME.toml or a path
    path = Path(name) if name.endswith(".toml") else PRESET_DIR / f"{name}.toml"
    require(path.is_file(), f"no preset `{name}` (looked for {path}); known presets: {', '.join(PRESETS)}")
    try:
        return typed(tomllib.loads(path.read_text(encoding="utf-8")), str(path))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None


def make_config(preset: str | None = None, **overrides: Any) -> TrainConfig:
    """Defaults, then the preset, then overrides, validated; it remembers which fields they set (``given``)."""
    values = {**(load_preset(preset) if preset is not None else {}), **typed(overrides, "the overrides")}
    return validate(TrainConfig(**values, given=tuple(sorted(values))))


RANGES = (  # what a field must be, whatever the choices: validate checks these first, in this order
    ("> 0", lambda v: v > 0, ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "grad_accum", "max_iters",
                              "log_interval", "eval_interval", "max_skipped_steps")),
    (">= 0", lambda v: v >= 0, ("warmup_iters", "lr_decay_iters", "eval_tokens", "ckpt_interval", "threads",
                                "lora_rank")),
    ("a finite number >= 0", lambda v: math.isfinite(v) and v >= 0,
     ("min_lr", "weight_decay", "grad_clip", "max_time")),
    ("a finite number > 0", lambda v: math.isfinite(v) and v > 0, ("learning_rate", "muon_lr", "lora_alpha")),
    ("in [0, 1)", lambda v: 0 <= v < 1, ("dropout", "beta1", "beta2", "lora_dropout")),
    ("in (0, 1)", lambda v: 0 < v < 1, ("val_fraction",)),
    ("in (0, 1]", lambda v: 0 < v <= 1, ("wsd_fraction",)),
    ("in [257, 2**32] (256 bytes, <|endoftext|>; uint32 ids)", lambda v: 257 <= v <= 2**32, ("bpe_vocab_size",)),
    ("in [0, 2**32 - 1]", lambda v: 0 <= v < 2**32, ("seed",)))  # numpy's seeds: a wider one was its traceback


def validate(cfg: TrainConfig) -> TrainConfig:
    """Raise ConfigError naming the first bad value and the fix; GPTConfig's own checks come last."""
    for must, ok, names in RANGES:
        for name in names:
            require(ok(getattr(cfg, name)), f"{name} must be {must}, got {getattr(cfg, name)}")
    for name in FIELD_TYPES:
        allowed, value = choices(name), getattr(cfg, name)
        require(not allowed or value in allowed, f"{name} must be one of {', '.join(allowed)}, got `{value}`")
    lr, min_lr = cfg.learning_rate, cfg.min_lr
    require(min_lr <= lr, f"min_lr ({min_lr}) must not exceed learning_rate ({lr})")
    require(cfg.n_embd % cfg.n_head == 0, f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
    require(cfg.text_column, 'text_column must name the .jsonl field or .parquet column holding the text, got ""')
    require(cfg.out_dir, 'out_dir must name a folder (for last.pt, best.pt and metrics.jsonl), got ""')
    require(cfg.data_dir, 'data_dir must name a folder (for downloaded and prepared corpora), got ""')
    require(re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", cfg.device),
            f"unknown device `{cfg.device}`; use one of auto, cpu, cuda, cuda:N, mps")
    require(cfg.schedule != "time" or cfg.max_time > 0,
            "schedule=time decays the lr over max_time: set max_time (seconds) or use schedule=steps")
    if cfg.lora_rank:
        require(cfg.init_from, "LoRA adapts a trained model: pass --init_from (a run's folder or .pt) with "
                               "--lora_rank, or drop --lora_rank")
        parse_lora_targets(cfg.lora_targets)
    elif not cfg.resume and (off := [name for name in LORA_FIELDS if name in cfg.given]):  # a resume: its own rules
        raise ConfigError(f"{off[0]} is set, but LoRA is off (lora_rank 0): pass --lora_rank R, or drop {off[0]}")
    try:
        model_config(cfg, vocab_size=1)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return cfg


def parse_lora_targets(text: str) -> tuple[str, ...]:
    """"attn.c_attn,mlp.c_fc" -> the names (finetune.py adapts them); ConfigError naming an unknown one."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = ", ".join(name for name in names if name not in LORA_TARGETS)
    said = f"names {unknown}, which is not among" if unknown else "is empty; name one or more of"
    require(names and not unknown, f"lora_targets {said} {', '.join(LORA_TARGETS)} (comma-separated)")
    require(len(set(names)) == len(names), f"lora_targets names a layer twice ({text}); name each once")
    return names


def model_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:  # the vocabulary is the corpus's
    return GPTConfig(vocab_size=vocab_size, **{name: getattr(cfg, name) for name in MODEL_OPTIONS})


def describe(config) -> str:
    """The model in one line: "block_size 64, n_layer 3, n_head 4, n_embd 128, vocab 65; not default: ..."."""
    shown = [f for f in dataclasses.fields(config) if f.name != "vocab_size"]
    sizes = [f"{f.name} {getattr(config, f.name)}" for f in shown if f.type is int and f.default != 0]
    options = [f"{f.name} {getattr(config, f.name)}" for f in shown
               if not (f.type is int and f.default != 0) and getattr(config, f.name) != f.default]
    return ", ".join(sizes + [f"vocab {config.vocab_size}"]) + "; not default: " + (", ".join(options) or "none")


def given_fields(cfg: TrainConfig) -> frozenset[str]:
    """The fields make_config was given, whatever their value, and any off its default (init_from refuses those)."""
    return frozenset(cfg.given) | {name for name in FIELD_TYPES if getattr(cfg, name) != DEFAULTS[name]}


def unused_fields(cfg: TrainConfig) -> set[str]:  # muon_lr under adamw, and so on
    return {name for name, (chooser, readers) in USED_ONLY_UNDER.items() if getattr(cfg, chooser) not in readers}


def as_dict(cfg: TrainConfig) -> dict[str, Any]:  # a checkpoint's "config" (checkpoint.config_from_dict reads it)
    return dataclasses.asdict(cfg)


def add_flags(parser: Any, names: tuple[str, ...], preset: str | None = None) -> None:
    """``--na_me`` and ``--na-me`` per field, absent unless given; a bool may stand alone (``--resume``)."""
    from_preset = load_preset(preset) if preset else {}
    for name in names:
        shown = f"{from_preset[name]}, from {preset}; else {DEFAULTS[name]}" if name in from_preset else DEFAULTS[name]
        kind, is_bool = FIELD_TYPES[name], FIELD_TYPES[name] is bool
        parser.add_argument(f"--{name}", *([f"--{name.replace('_', '-')}"] if "_" in name else []), dest=name,
                            default=argparse.SUPPRESS, nargs="?" if is_bool else None,
                            const="true" if is_bool else None,
                            help=FIELD_HELP[name] + (f" (default: {shown})" if shown != "" else ""),
                            metavar="{" + ",".join(get_args(kind)) + "}" if get_args(kind) else kind.__name__.upper())


def build_parser(preset: str | None = None, description: str | None = None) -> "CommandLine":  # train's, the doctor's
    parser = CommandLine(description=description or "Train a tiny GPT. Every config field below is a flag.")
    parser.add_argument("--config", default=None, help=f"a preset in config/ ({', '.join(PRESETS)}) or a .toml file")
    add_flags(parser, tuple(n for n in FIELD_TYPES if n not in MODEL_OPTIONS and n not in CORPUS_OPTIONS), preset)
    corpus = parser.add_argument_group("corpus options (python -m scripts.prepare takes them too)")
    add_flags(corpus, CORPUS_OPTIONS, preset)
    add_flags(parser.add_argument_group("model options (declared in model.py's GPTConfig)"), MODEL_OPTIONS, preset)
    return parser


def parse_args(argv: list[str] | None = None, description: str | None = None) -> TrainConfig:
    """Command line to validated config; ConfigError on a mistake. --config first: --help shows its values."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--config", default=None)
    args, unknown = build_parser(early.parse_known_args(argv)[0].config, description).parse_known_args(argv)
    if unknown:
        word = next((word for word in unknown if word.startswith("-")), unknown[0])
        if not word.startswith("-"):
            raise ConfigError(f"unexpected argument `{word}`")
        raise unknown_key(word.lstrip("-").split("=")[0], "the command line")
    overrides = vars(args)
    return make_config(overrides.pop("config"), **overrides)
