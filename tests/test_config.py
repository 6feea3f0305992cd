"""Presets, command-line overrides, errors that say what to fix, and usage lines that name the command typed."""
from __future__ import annotations

import ast
import dataclasses
import shlex
import sys
import types

import pytest
from conftest import project_files

import config
import finetune
import runtime
from checkpoint import config_from_dict
from cli import CommandLine, ConfigError
from config import (DEFAULTS, FIELD_HELP, FIELD_TYPES, LORA_TARGETS, MODEL_OPTIONS, TrainConfig, as_dict, build_parser,
                    given_fields, make_config, parse_args)
from model import GPTConfig


@pytest.mark.parametrize("preset", ["tiny", "small", "gpt2"])
def test_presets_load_and_validate(preset):
    cfg = make_config(preset)
    assert cfg.out_dir == f"out/{preset}" or (preset, cfg.out_dir) == ("gpt2", "out/gpt2-run")  # out/gpt2: OpenAI's


def test_command_line_overrides_the_preset_which_overrides_the_defaults_in_both_spellings():
    cfg = parse_args(["--config", "tiny", "--max-iters", "7", "--learning_rate=0.01", "--resume",
                      "--compile", "off", "--bias=true", "--n_layer", "3"])
    assert (cfg.max_iters, cfg.learning_rate, cfg.resume, cfg.compile, cfg.bias) == (7, 0.01, True, "off", True)
    assert (TrainConfig().n_layer, make_config("tiny").n_layer, cfg.n_layer) == (4, 2, 3)


# A command line, then what its one-line error must say (a regular expression), a row each.
BAD_COMMAND_LINES = r"""
--max_iter 5                      | did you mean `max_iters`
--learning-rat=1e-3               | did you mean `learning_rate`
--learning_rate abc               | learning_rate must be float
--n_embd 100 --n_head 3           | divisible by n_head
--device tpu                      | unknown device
--device cuda:abc                 | unknown device
--max_iters 0                     | max_iters must be > 0
--dtype float8                    | dtype must be one of
--dropout 1.5                     | dropout must be in
--config nope                     | no preset `nope`
--max_iters 2.5                   | max_iters must be int
--optimizer sgd                   | optimizer must be one of adamw, muon
--optimizer muon --muon_lr 0      | muon_lr must be a finite number > 0, got 0.0
--lr_decay linear                 | lr_decay must be one of cosine, wsd
--wsd_fraction 0                  | wsd_fraction must be in \(0, 1\], got 0.0
--text_column ''                  | text_column must name the .jsonl field or .parquet column
--threads -1                      | threads must be >= 0, got -1
--schedule time                   | schedule=time decays the lr over max_time: set max_time
--out_dir ''                      | out_dir must name a folder
--data_dir ''                     | data_dir must name a folder
--seed 4294967296                 | seed must be in \[0, 2\*\*32 - 1\], got 4294967296
--tokenizer bpe --bpe_vocab_size 256 | bpe_vocab_size must be in \[257, 2\*\*32\] \(256 bytes, .*\), got 256
--tokenizer bpe --bpe_vocab_size 10000000000 | bpe_vocab_size must be in \[257, 2\*\*32\]
--lora_rank 4                     | LoRA adapts a trained model: pass --init_from
--lora_rank 4 --init_from gpt2 --lora_targets attn.c_attn,mlp.fc | lora_targets names mlp.fc, which is not among attn
--lora_rank 4 --init_from gpt2 --lora_targets ' , ' | lora_targets is empty
--lora_rank 4 --init_from gpt2 --lora_targets attn.c_attn,attn.c_attn | lora_targets names a layer twice
--lora_targets mlp.c_fc --lora_dropout 0.1 | lora_dropout is set, but LoRA is off \(lora_rank 0\): pass --lora_rank
"""


@pytest.mark.parametrize("row", BAD_COMMAND_LINES.strip().splitlines())
def test_bad_configs_fail_with_a_helpful_message(row):
    argv, message = (part.strip() for part in row.split("|", 1))
    with pytest.raises(ConfigError, match=message):
        parse_args(shlex.split(argv))


def test_a_seed_is_refused_outside_numpys_range_and_its_ends_seed_every_rank():
    """Bug caught: --seed -1 or 2**32 passed validation and ended in numpy's ValueError traceback."""
    assert [make_config(None, seed=seed).seed for seed in (0, 2**32 - 1)] == [0, 2**32 - 1]
    runtime.seed_everything(2**32 - 1 + 7)  # the largest seed on DDP rank 7 (seed + rank): no traceback either


@pytest.mark.parametrize("text, message", [(b"n_layers = 3\n", "unknown config key `n_layers`.*did you mean `n_layer`"),
                                           (b"[model]\nn_layer = 3\n", "a preset's keys are top level"),  # was: wsd?
                                           (b"\xff\xfe", "not valid TOML")])  # was: a UnicodeDecodeError traceback
def test_a_bad_preset_file_is_refused_in_one_line(tmp_path, text, message):
    preset = tmp_path / "mine.toml"
    preset.write_bytes(text)
    with pytest.raises(ConfigError, match=message):
        make_config(str(preset))


def test_help_lists_every_field_with_its_default():
    text = " ".join(build_parser().format_help().split())  # undo argparse's line wrapping
    for name, default in DEFAULTS.items():
        assert f"--{name}" in text
        assert f"(default: {default})" in text or default == ""  # an empty default is said in words
        assert " ".join(FIELD_HELP[name].split()) in text, name  # the field's words (model.py's for its options)
    assert "--given" not in text  # a record of how the config was made, not a setting


# ----------------------------------------------------------------------------- every field is read
def config_reads(source: str) -> set[str]:
    """``NAME`` of every ``cfg.NAME``, ``config.NAME``, ``self.config.NAME`` read in ``source``."""
    def config_like(node: ast.AST) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return "cfg" in name or "config" in name
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and config_like(node.value)}


def unread_fields(sources: dict[str, str], names: set[str]) -> set[str]:
    """The field names no source reads; config/__init__.py's reads (to check, list, save) are no use."""
    read = set().union(*(config_reads(text) for path, text in sources.items() if path != "config/__init__.py"))
    return names - read


def test_every_config_field_is_read_by_the_code():
    """A field no code reads would be accepted, shown, saved, compared on resume and ignored."""
    sources = project_files()
    assert {"train.py", "model.py", "optim.py", "config/__init__.py"} <= set(sources)
    assert unread_fields(sources, set(FIELD_TYPES)) == set()
    # The teeth: a field only declared, or only validated, is unread; its first use anywhere makes it read.
    declared = {"config/__init__.py": "class TrainConfig:\n    label_smoothing: float = warned(0.0)\n\n"
                                      "def validate(cfg):\n    return cfg.label_smoothing >= 0\n"}
    assert unread_fields({**sources, **declared}, {*FIELD_TYPES, "label_smoothing"}) == {"label_smoothing"}
    used = {"train.py": sources["train.py"] + "\nsmoothing = cfg.label_smoothing\n"}
    assert unread_fields({**sources, **declared, **used}, {*FIELD_TYPES, "label_smoothing"}) == set()


# ----------------------------------------------------------------------------- a config you can read
def test_every_field_is_declared_once_with_its_help_and_a_model_option_in_model_py():
    """A model option is one field of GPTConfig (TrainConfig inherits all but vocab_size) with model.py's help; every
    other field is TrainConfig's own, with its help and resume rule."""
    own = set(TrainConfig.__annotations__) - {"vocab_size"}  # the ClassVar that drops GPTConfig's vocab_size
    model = {f.name: f for f in dataclasses.fields(GPTConfig)}
    assert own.isdisjoint(model) and set(FIELD_TYPES) == (set(model) - {"vocab_size"}) | own - {"given"}
    assert MODEL_OPTIONS == tuple(name for name in model if name != "vocab_size")
    for f in config.OPTIONS:
        assert FIELD_HELP[f.name].strip(), f"{f.name} has no help"
        assert (f.name in model) != ("resume" in f.metadata), f"{f.name}: a resume rule where it is not declared"
    assert FIELD_HELP["n_layer"] == model["n_layer"].metadata["help"] == "transformer blocks"
    assert "vocab_size" not in FIELD_TYPES and "vocab_size" not in as_dict(make_config("tiny"))


def test_lora_targets_are_one_list_which_config_checks():
    assert LORA_TARGETS is config.LORA_TARGETS and finetune.parse_targets is config.parse_lora_targets
    assert config.parse_lora_targets(" attn.c_attn , mlp.c_fc") == ("attn.c_attn", "mlp.c_fc")


def test_replace_keeps_everything_a_run_needs():
    """A field given at its default (bias=False) still counts as given after dataclasses.replace, so init_from
    still refuses weights that contradict it."""
    cfg = make_config("tiny", bias=False, learning_rate=0.01)
    assert {"bias", "learning_rate", "n_layer"} <= given_fields(cfg) and cfg.bias == DEFAULTS["bias"]
    changed = dataclasses.replace(cfg, resume=True)
    for f in dataclasses.fields(TrainConfig):
        if f.name != "resume":
            assert getattr(changed, f.name) == getattr(cfg, f.name), f.name
    assert changed.resume and changed.given == cfg.given and given_fields(changed) == given_fields(cfg) | {"resume"}
    assert not hasattr(config, "replace")  # no second way to change a config


def test_a_checkpoints_config_keeps_what_was_given_and_an_old_one_still_loads(capsys):
    cfg = make_config("tiny", bias=False)
    saved = as_dict(cfg)
    assert saved["given"] == cfg.given and all(isinstance(name, str) for name in saved["given"])  # plain values
    loaded = config_from_dict({**saved, "given": list(saved["given"])})  # as a checkpoint may hold it
    assert loaded == cfg and given_fields(loaded) == given_fields(cfg) and "bias" in given_fields(loaded)
    old = config_from_dict({k: v for k, v in saved.items() if k != "given"})  # saved before given was a field
    assert old == cfg and old.given == () and "bias" not in given_fields(old)
    assert capsys.readouterr().err == ""  # "given" is no unknown key
    assert make_config("tiny") == cfg != make_config("tiny", bias=True)  # equal however their values were given


# ----------------------------------------------------------------------------- usage names the command typed
@pytest.mark.parametrize("main, argv0, shown", [
    (types.SimpleNamespace(__spec__=types.SimpleNamespace(name="scripts.eval")), "/repo/scripts/eval.py",
     "python -m scripts.eval"),
    (types.SimpleNamespace(__spec__=types.SimpleNamespace(name="pytest.__main__")), "/x/pytest/__main__.py",
     "python -m pytest"),
    (types.SimpleNamespace(__spec__=None), "/repo/train.py", "train.py"),
])
def test_usage_names_the_command_the_user_typed(monkeypatch, main, argv0, shown):
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [argv0])
    assert CommandLine().format_usage() == f"usage: {shown} [-h]\n"


def test_a_tools_positionals_may_stand_on_both_sides_of_a_flag():
    """Bug caught: `bench dtype=float32 --threads 1 compile=on` said "unexpected argument `compile=on`"."""
    parser = CommandLine()
    parser.add_argument("overrides", nargs="*", default=[])
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(["dtype=float32", "--threads", "1", "compile=on"])
    assert args.overrides == ["dtype=float32", "compile=on"] and args.threads == 1
