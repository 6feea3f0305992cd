"""Configuration: presets, command-line overrides, and errors that say what to fix."""
from __future__ import annotations

import ast
import dataclasses

import pytest

from config import FIELD_TYPES, ConfigError, TrainConfig, build_parser, make_config, parse_args
from conftest import REPO, run_script


@pytest.mark.parametrize("preset", ["tiny", "small", "gpt2"])
def test_presets_load_and_validate(preset):
    cfg = make_config(preset)
    assert cfg.out_dir == f"out/{preset}"


def test_command_line_overrides_in_both_spellings():
    cfg = parse_args(["--config", "tiny", "--max-iters", "7", "--learning_rate=0.01", "--resume",
                      "--compile", "off", "--bias=true"])
    assert (cfg.max_iters, cfg.learning_rate, cfg.resume, cfg.compile, cfg.bias) == (7, 0.01, True, "off", True)


def test_precedence_is_defaults_then_preset_then_command_line():
    assert TrainConfig().n_layer == 4
    assert make_config("tiny").n_layer == 2
    assert parse_args(["--config", "tiny", "--n_layer", "3"]).n_layer == 3


@pytest.mark.parametrize("argv, message", [
    (["--max_iter", "5"], "did you mean `max_iters`"),
    (["--learning-rat=1e-3"], "did you mean `learning_rate`"),
    (["--learning_rate", "-1"], "learning_rate must be"),
    (["--learning_rate", "abc"], "learning_rate must be float"),
    (["--n_embd", "100", "--n_head", "3"], "divisible by n_head"),
    (["--device", "tpu"], "unknown device"),
    (["--device", "cuda:abc"], "unknown device"),
    (["--max_iters", "0"], "max_iters must be > 0"),
    (["--dtype", "float8"], "dtype must be one of"),
    (["--dropout", "1.5"], "dropout must be in"),
    (["--config", "nope"], "no preset `nope`"),
    (["--max_iters", "2.5"], "max_iters must be int"),
    (["--optimizer", "sgd"], "optimizer must be one of adamw, muon"),
    (["--optimizer", "muon", "--muon_lr", "0"], "muon_lr must be > 0, got 0.0"),
    (["--muon_lr", "-0.1"], "muon_lr must be > 0, got -0.1"),
    (["--lr_decay", "linear"], "lr_decay must be one of cosine, wsd"),
    (["--wsd_fraction", "0"], "wsd_fraction must be in \\(0, 1\\], got 0.0"),
    (["--text_column", ""], "text_column must name the .jsonl field or .parquet column"),
    (["--threads", "-1"], "threads must be >= 0, got -1"),
])
def test_bad_configs_fail_with_a_helpful_message(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


def test_unknown_key_in_a_preset_file_is_refused(tmp_path):
    preset = tmp_path / "mine.toml"
    preset.write_text('n_layers = 3\n')
    with pytest.raises(ConfigError, match="unknown config key `n_layers`.*did you mean `n_layer`"):
        make_config(str(preset))


def test_help_lists_every_field_with_its_default():
    text = " ".join(build_parser().format_help().split())  # undo argparse's line wrapping
    for field in dataclasses.fields(TrainConfig):
        assert f"--{field.name}" in text
        assert f"(default: {field.default})" in text or field.default == ""  # an empty default is said in words


def test_a_config_error_writes_nothing_and_prints_one_line(tmp_path):
    out_dir = tmp_path / "run"
    result = run_script("train.py", "--config", "tiny", "--out_dir", str(out_dir), "--max_iter", "5", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: unknown config key `max_iter` in the command line; "
                                                  "did you mean `max_iters`?"]
    assert not out_dir.exists()


# ----------------------------------------------------------------------------- every field is read
def config_reads(source: str) -> set[str]:
    """Attribute names read from a config in ``source``: ``NAME`` of every ``cfg.NAME``, ``config.NAME``,
    ``self.config.NAME`` (whatever object ends in a name holding "cfg" or "config")."""
    def config_like(node: ast.AST) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return "cfg" in name or "config" in name
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and config_like(node.value)}


def unread_fields(sources: dict[str, str], names: set[str]) -> set[str]:
    """The field names that no source reads. config/__init__.py does not count: it reads every field to check,
    list, save and compare it, which is not a use."""
    read = set().union(*(config_reads(text) for path, text in sources.items() if path != "config/__init__.py"))
    return names - read


def test_every_config_field_is_read_by_the_code():
    """A field declared in TrainConfig (or an Option) that no code reads would be accepted, shown, saved,
    compared on resume and ignored. Scans the repo's sources outside tests/ for attribute reads."""
    sources = {str(path.relative_to(REPO)): path.read_text() for path in REPO.rglob("*.py")
               if path.relative_to(REPO).parts[0] not in ("tests", "out", "data", "hf", "wandb")
               and not path.relative_to(REPO).parts[0].startswith(".")}
    assert {"train.py", "model.py", "machinery/optim.py", "config/__init__.py"} <= set(sources)
    assert unread_fields(sources, set(FIELD_TYPES)) == set()
    # The teeth: a field only declared, or only validated, is unread; its first use anywhere makes it read.
    declared = {"config/__init__.py": "class TrainConfig:\n    label_smoothing: float = warned(0.0)\n\n"
                                      "def validate(cfg):\n    return cfg.label_smoothing >= 0\n"}
    assert unread_fields({**sources, **declared}, {*FIELD_TYPES, "label_smoothing"}) == {"label_smoothing"}
    used = {"train.py": sources["train.py"] + "\nsmoothing = cfg.label_smoothing\n"}
    assert unread_fields({**sources, **declared, **used}, {*FIELD_TYPES, "label_smoothing"}) == set()
