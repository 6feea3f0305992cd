"""One failure, one exit code: errors are declared in cli.py with their codes, and cli.exit_for turns them into
the one line (that every entry point says a bad input in one line: test_bad_input.py)."""
from __future__ import annotations

import ast
import builtins
import re
import signal
import sys

import pytest
from conftest import REPO, project_files, run_main

import cli
from cli import ConfigError, DataError


def name_of(node: ast.expr) -> str:  # cli.ConfigError -> ConfigError; '' for anything but a name
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def test_a_bug_keeps_its_traceback_and_under_torchrun_a_rank_reports_only_what_it_alone_met(monkeypatch):
    assert cli.exit_for(ZeroDivisionError("division by zero")) is None
    with pytest.raises(ZeroDivisionError):
        cli.exit_on(ZeroDivisionError("division by zero"))
    monkeypatch.setenv("RANK", "3")
    mine = DataError("data/x/train.bin: missing")
    mine.reporting_rank = 3
    assert cli.exit_for(mine) == ("data/x/train.bin: missing", 2, 3)
    assert cli.exit_for(ConfigError("bad")) == ("bad", 2, None)  # every rank has it: rank 0 says it
    assert cli.exit_for(PermissionError(13, "Permission denied", "t.bin"))[:2] == (  # a user's file, not a bug
        "cannot use t.bin (Permission denied); fix it or pass another path", 2)


def test_a_tool_ends_on_ctrl_c_in_one_line_and_130(capsys):
    """Bug caught: a Ctrl-C while a tool loaded a checkpoint ended in a KeyboardInterrupt traceback from torch."""
    with pytest.raises(SystemExit) as ended:  # default_int_handler: what Ctrl-C calls, raising KeyboardInterrupt
        cli.run_tool(lambda: signal.default_int_handler(signal.SIGINT, None))
    assert ended.value.code == 130 and capsys.readouterr().err == "error: interrupted\n"
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as scripts/__init__.py leaves it while torch imports
    with pytest.raises(SystemExit) as ended:  # Ctrl-C is a KeyboardInterrupt again: chat's "end the reply" needs it
        cli.run_tool(lambda: 0 if signal.getsignal(signal.SIGINT) is signal.default_int_handler else 1)
    assert ended.value.code == 0

    def write_to_a_full_disk():
        raise OSError(28, "No space left on device")  # print() with stdout on /dev/full
    with pytest.raises(SystemExit) as ended:  # was a traceback, in train.py too (exit_for)
        cli.run_tool(write_to_a_full_disk)
    assert ended.value.code == 74 and "error: no space left on the device" in capsys.readouterr().err


BUILTIN_ERRORS = {name for name, value in vars(builtins).items() if isinstance(value, type)
                  and issubclass(value, BaseException)}


def test_errors_are_declared_in_one_module():
    """An exception class elsewhere refines one of cli.py's (plot.py's MetricsError), so it carries a code."""
    elsewhere = [f"{path}: {node.name}" for path, source in project_files().items()
                 if path != "cli.py" for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.ClassDef) and {name_of(base) for base in node.bases} & BUILTIN_ERRORS]
    assert elsewhere == []


# ----------------------------------------------------------------------------- optional packages
def test_each_optional_package_is_installed_by_the_requirements_file_the_table_names():
    """Each pin of cli.OPTIONAL_PACKAGES is a line of the file it names; every `pip install X==V` in the code or the
    docs is the table's."""
    for name, (pin, requirements) in cli.OPTIONAL_PACKAGES.items():
        pins = [line.split("#")[0].strip() for line in (REPO / requirements).read_text().splitlines()]
        assert pin in pins and pin.startswith(f"{name}=="), f"{requirements} does not pin {pin}"
    pins = {pin for pin, _ in cli.OPTIONAL_PACKAGES.values()}
    texts = project_files() | {path.relative_to(REPO).as_posix(): path.read_text()
                               for path in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]}
    spelled = [(path, pin) for path, text in texts.items()
               for pin in re.findall(r"pip install ([\w.-]+==[\w.]+)", text)]
    assert [(path, pin) for path, pin in spelled if pin not in pins] == []


def test_the_gguf_export_without_gguf_names_the_file_that_installs_it(tmp_path, monkeypatch, capsys):
    """The reported advice named requirements-dev.txt, which does not hold gguf."""
    from scripts import export_gguf
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "best.pt").write_bytes(b"")  # the output checks pass; the import comes next
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    code, err = run_main([str(tmp_path / "run"), str(tmp_path / "run.gguf")], export_gguf.main), capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "pip install gguf==0.19.0" in err and "requirements-interop.txt" in err, err
