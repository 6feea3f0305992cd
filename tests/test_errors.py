"""One failure, one exit code, at every entry point.

Every error the user is shown is declared in process/errors.py with its exit code, and every entry point
ends an error through the same function (errors.exit_for, then fail: exit_on does both), so a bad checkpoint
or a disk that fails reads the same, one line and one code, whichever command met it.
"""
from __future__ import annotations

import ast
import builtins

import pytest

from conftest import REPO, entry_point
from process import errors
from process.errors import (EXIT_NONFINITE, EXIT_WRITE_FAILED, CheckpointError, CheckpointWriteError, ConfigError,
                              DataError, HFError, PathError, PeerFailed, RunStopped)

# Each failure kind as the code raises it, and the code it must end the process with, wherever it is met.
FAILURES = {
    "bad config": (ConfigError("n_embd (100) must be divisible by n_head (3)"), 2),
    "bad data": (DataError("corpus.txt: not UTF-8 text (invalid start byte at byte 7)"), 2),
    "bad checkpoint": (CheckpointError("last.pt: corrupt checkpoint (sha256 mismatch)"), 2),
    "weights that do not fit": (HFError("gpt2: missing key transformer.wte.weight"), 2),
    "a path to change": (PathError("--out_dir out: out is a file, not a folder; pass another --out_dir"), 2),
    "a folder failing its write probe": (PathError("could not write in out (Input/output error)", EXIT_WRITE_FAILED), 74),
    "a checkpoint that cannot be written": (CheckpointWriteError("could not write last.pt (No space left on device)"), 74),
    "a run stopped": (RunStopped("non-finite loss or gradient at step 3", EXIT_NONFINITE), 3),
    "another rank failed": (PeerFailed(74), 74),  # that rank prints why; this one exits silently with its code
}

# Where each entry point's main() is made to fail: a name it calls inside its try (``module:name`` for one of
# another module), and the arguments that get it there ({tmp}: an empty folder; {metrics}: a metrics.jsonl;
# {nanogpt}: a folder that looks like nanoGPT's checkout). A new entry point brings its row.
FAILS_AT = {
    "train.py": ("train", []),
    "sample.py": ("from_flags", []),
    "data.py": ("prepare.corpora:prepare", []),
    "bench.py": ("parse_overrides", []),
    "bench_prepare.py": ("shakespeare_text", []),
    "bench_sample.py": ("build_model", []),
    "bench_lora.py": ("build", []),
    "bpe_trainers.py": ("compare_trainers", []),
    "chat_demo.py": ("before", []),
    "compare.py": ("compare", []),
    "doctor.py": ("run_checks", []),
    "eval.py": ("load", []),
    "export_hf.py": ("check_writable", ["run", "{tmp}/hf"]),
    "export_gguf.py": ("check_writable", ["run", "{tmp}/x.gguf"]),
    "gpu_check.py": ("check_writable", ["--dry-run", "--out_dir", "{tmp}/gpu"]),
    "harness.py": ("check_hub", ["--tasks", "tinygpt_cloze"]),
    "plot.py": ("check_writable", ["{metrics}", "-o", "{tmp}/loss.png"]),
    "shape.py": ("report", []),
    "tokenizer.py": ("report", []),
    "vs_nanogpt.py": ("export_corpus", ["--nanogpt", "{nanogpt}"]),
}


def entry_points() -> list[str]:
    """Every command a user or developer runs: the core's three and each file of scripts/ (and of dev/, if any)."""
    tools = sorted(f"{folder}/{path.name}" for folder in ("scripts", "dev") for path in (REPO / folder).glob("*.py")
                   if path.name != "__init__.py")  # the packages' lists of their tools
    return ["train.py", "sample.py", "data.py", *tools]


def test_every_entry_point_has_a_row_in_the_table():
    missing = [script for script in entry_points() if script.split("/")[-1] not in FAILS_AT]
    assert not missing, f"add rows for {missing} to FAILS_AT"


@pytest.mark.parametrize("kind", FAILURES)
@pytest.mark.parametrize("script", entry_points())
def test_every_entry_point_ends_each_failure_with_its_code_and_one_line(tmp_path, monkeypatch, capsys, script, kind):
    error, code = FAILURES[kind]
    name, argv = FAILS_AT[script.split("/")[-1]]
    module = entry_point(script.removesuffix(".py").replace("/", "."))  # scripts/eval.py -> scripts.eval
    owner, _, name = name.rpartition(":")
    target = __import__(owner, fromlist=["_"]) if owner else module

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(target, name, fails)
    monkeypatch.delenv("RANK", raising=False)  # a single process: it prints its own errors
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    (tmp_path / "nano").mkdir()
    for file in ("train.py", "model.py"):
        (tmp_path / "nano" / file).write_text("")
    fields = {"tmp": tmp_path, "metrics": tmp_path / "metrics.jsonl", "nanogpt": tmp_path / "nano"}
    with pytest.raises(SystemExit) as stopped:
        module.main([arg.format(**fields) for arg in argv])
    out, err = capsys.readouterr()
    assert stopped.value.code == code == error.exit_code
    assert err == ("" if isinstance(error, PeerFailed) else f"error: {error}\n")
    assert "Traceback" not in out


def test_every_error_carries_the_code_of_the_table():
    """The codes of process/errors.py's docstring table, class by class (PathError's and RunStopped's vary)."""
    assert {cls.__name__: cls.exit_code for cls in (ConfigError, DataError, CheckpointError, HFError,
                                                     CheckpointWriteError)} == {
        "ConfigError": 2, "DataError": 2, "CheckpointError": 2, "HFError": 2, "CheckpointWriteError": 74}
    assert PathError("x").exit_code == 2 and PathError("x", EXIT_WRITE_FAILED).exit_code == 74
    assert RunStopped("x", 143).exit_code == 143 and PeerFailed(3).exit_code == 3


def test_a_bug_is_no_failure_of_the_table_and_keeps_its_traceback():
    assert errors.exit_for(ZeroDivisionError("division by zero")) is None
    with pytest.raises(ZeroDivisionError):
        errors.exit_on(ZeroDivisionError("division by zero"))


def test_under_torchrun_a_rank_reports_only_what_it_alone_met(monkeypatch):
    """Rank 0 prints the job's errors; another rank only one that stop_together found on it first."""
    monkeypatch.setenv("RANK", "3")
    mine = DataError("data/x/train.bin: missing")
    mine.reporting_rank = 3
    assert errors.exit_for(mine) == ("data/x/train.bin: missing", 2, 3)
    assert errors.exit_for(ConfigError("bad")) == ("bad", 2, None)  # every rank has it: rank 0 says it


BUILTIN_ERRORS = {name for name, value in vars(builtins).items() if isinstance(value, type)
                  and issubclass(value, BaseException)}


def test_errors_are_declared_in_one_module():
    """An exception class anywhere else in the project refines one of process/errors.py's (plot.py's
    MetricsError is a DataError), so it carries a code and every entry point ends it the same way."""
    elsewhere = []
    for path in sorted(REPO.rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative.split("/")[0] in ("tests", "out", "data") or relative == "process/errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and {getattr(base, "id", "") for base in node.bases} & BUILTIN_ERRORS:
                elsewhere.append(f"{relative}: {node.name}")
    assert elsewhere == []
