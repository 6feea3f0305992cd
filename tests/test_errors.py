"""One failure, one exit code, at every entry point: errors are declared in config with their codes, and every
entry point's main() (found by reading the code: a new script is checked the day it is added) ends them via exit_on."""
from __future__ import annotations

import ast
import builtins
import functools
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO

import config
from config import (
    EXIT_WRITE_FAILED,
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    DataError,
    HFError,
    PathError,
    PeerFailed,
    RunStopped,
)

BROAD = {"Exception", "BaseException"}  # what catches every error of the table too


def project_files() -> list[Path]:  # not the tests, nor what runs write
    return [path for path in sorted(REPO.rglob("*.py"))
            if path.relative_to(REPO).parts[0] not in ("tests", "out", "data", "hf", "wandb")]


def entry_points() -> list[str]:
    tools = sorted(f"scripts/{path.name}" for path in (REPO / "scripts").glob("*.py") if path.name != "__init__.py")
    return ["train.py", "sample.py", *tools]


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def name_of(node: ast.expr) -> str:  # config.ConfigError -> ConfigError; '' for anything but a name
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


@functools.cache
def error_classes() -> frozenset[str]:
    """TinyGPTError and every class that refines it, in config or elsewhere (plot.py's MetricsError)."""
    names = {cls.__name__ for cls in vars(config).values()
             if isinstance(cls, type) and issubclass(cls, config.TinyGPTError)}
    classes = [(node.name, {name_of(base) for base in node.bases}) for path in project_files()
               for node in ast.walk(parsed(path)) if isinstance(node, ast.ClassDef)]
    while grown := {name for name, bases in classes if bases & names} - names:
        names |= grown
    return frozenset(names)


def caught(handler: ast.ExceptHandler) -> set[str]:
    if handler.type is None:  # a bare except:
        return {"BaseException"}
    return {name_of(node) for node in (handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type])}


def calls(node: ast.AST) -> set[str]:
    return {name_of(call.func) for call in ast.walk(node) if isinstance(call, ast.Call)}


def ends_through_the_exit_path(handler: ast.ExceptHandler, function: ast.FunctionDef) -> bool:
    """exit_on(err), or exit_for(err) and fail(...) in the same function (train.py's); no print of its own."""
    own = calls(handler)
    return ("exit_on" in own or "exit_for" in own and "fail" in calls(function)) and not {"print", "exit"} & own


def function(path: Path, name: str) -> ast.FunctionDef | None:
    return next((node for node in parsed(path).body if isinstance(node, ast.FunctionDef) and node.name == name), None)


def delegates(path: Path, main: ast.FunctionDef) -> list[ast.FunctionDef]:
    """The project's functions main() calls by name: its module's, or another's it imports (compare.py: bench.py's)."""
    imported = {alias.asname or alias.name: node.module for node in parsed(path).body
                if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
    found = []
    for name in sorted(calls(main) - {"main"}):
        source = path
        if name in imported:
            module = REPO / imported[name].replace(".", "/")
            files = (module.with_suffix(".py"), module / "__init__.py")
            source = next((file for file in files if file.is_file()), None)
        if source and (definition := function(source, name)):
            found.append(definition)
    return found


def handlers(node: ast.AST) -> list[ast.ExceptHandler]:
    return [child for child in ast.walk(node) if isinstance(child, ast.ExceptHandler)]


@pytest.mark.parametrize("script", entry_points())
def test_every_entry_point_ends_its_errors_through_the_one_exit_path(script):
    """main() (or the project function it hands its work to) ends every error of the table through exit_on, or
    exit_for and fail; no handler in main() prints or exits on its own."""
    path = REPO / script
    main = function(path, "main")
    assert main is not None, f"{script}: no main(argv) to run"
    table = error_classes() | BROAD
    own_ways = [f"line {h.lineno}: except {', '.join(sorted(caught(h)))}" for h in handlers(main)
                if caught(h) & table and not ends_through_the_exit_path(h, main)]
    assert not own_ways, f"{script}'s main() ends an error its own way (use errors.exit_on): {own_ways}"
    ways_out = [h for f in (main, *delegates(path, main)) for h in handlers(f)
                if caught(h) & ({"TinyGPTError"} | BROAD) and ends_through_the_exit_path(h, f)]
    assert ways_out, (f"{script}: main() has no `except TinyGPTError as err: exit_on(err)`: "
                      "an error of the table would end in a traceback")


def test_the_check_finds_an_entry_point_that_prints_its_own_error(tmp_path):
    """The check above has teeth: its own line, or a narrower class than the table's, is found."""
    own = tmp_path / "own.py"
    own.write_text("def main(argv=None):\n    try:\n        run(argv)\n    except TinyGPTError as err:\n"
                   "        print(f'error: {err}', file=sys.stderr)\n        sys.exit(2)\n")
    main = function(own, "main")
    assert [ends_through_the_exit_path(h, main) for h in handlers(main)] == [False]
    narrow = tmp_path / "narrow.py"
    narrow.write_text("def main(argv=None):\n    try:\n        run(argv)\n    except ConfigError as err:\n"
                      "        exit_on(err)\n")
    main = function(narrow, "main")
    assert [caught(h) & ({"TinyGPTError"} | BROAD) for h in handlers(main)] == [set()]


def test_every_error_carries_the_code_of_the_table():
    assert {cls.__name__: cls.exit_code for cls in (ConfigError, DataError, CheckpointError, HFError,
                                                     CheckpointWriteError)} == {
        "ConfigError": 2, "DataError": 2, "CheckpointError": 2, "HFError": 2, "CheckpointWriteError": 74}
    assert PathError("x").exit_code == 2 and PathError("x", EXIT_WRITE_FAILED).exit_code == 74
    assert RunStopped("x", 143).exit_code == 143 and PeerFailed(3).exit_code == 3


def test_a_bug_keeps_its_traceback_and_under_torchrun_a_rank_reports_only_what_it_alone_met(monkeypatch):
    assert config.exit_for(ZeroDivisionError("division by zero")) is None
    with pytest.raises(ZeroDivisionError):
        config.exit_on(ZeroDivisionError("division by zero"))
    monkeypatch.setenv("RANK", "3")
    mine = DataError("data/x/train.bin: missing")
    mine.reporting_rank = 3
    assert config.exit_for(mine) == ("data/x/train.bin: missing", 2, 3)
    assert config.exit_for(ConfigError("bad")) == ("bad", 2, None)  # every rank has it: rank 0 says it


BUILTIN_ERRORS = {name for name, value in vars(builtins).items() if isinstance(value, type)
                  and issubclass(value, BaseException)}


def test_errors_are_declared_in_one_module():
    """An exception class elsewhere refines one of config's (plot.py's MetricsError), so it carries a code."""
    elsewhere = [f"{path.relative_to(REPO).as_posix()}: {node.name}" for path in project_files()
                 if path != REPO / "config" / "__init__.py" for node in ast.walk(parsed(path))
                 if isinstance(node, ast.ClassDef) and {name_of(base) for base in node.bases} & BUILTIN_ERRORS]
    assert elsewhere == []


# ----------------------------------------------------------------------------- optional packages
def test_each_optional_package_is_installed_by_the_requirements_file_the_table_names():
    """Each pin of config.OPTIONAL_PACKAGES is a line of the file it names; every `pip install X==V` in the code or the
    docs is the table's."""
    for name, (pin, requirements) in config.OPTIONAL_PACKAGES.items():
        pins = [line.split("#")[0].strip() for line in (REPO / requirements).read_text().splitlines()]
        assert pin in pins and pin.startswith(f"{name}=="), f"{requirements} does not pin {pin}"
    pins = {pin for pin, _ in config.OPTIONAL_PACKAGES.values()}
    spelled = [(path.relative_to(REPO).as_posix(), pin) for path in
               [*project_files(), *sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
               for pin in re.findall(r"pip install ([\w.-]+==[\w.]+)", path.read_text())]
    assert [(path, pin) for path, pin in spelled if pin not in pins] == []


def test_the_gguf_export_without_gguf_names_the_file_that_installs_it(tmp_path, monkeypatch, capsys):
    """The reported advice named requirements-dev.txt, which does not hold gguf."""
    from scripts import export_gguf
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "best.pt").write_bytes(b"")  # the output checks pass; the import comes next
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(SystemExit) as stopped:
        export_gguf.main([str(tmp_path / "run"), str(tmp_path / "run.gguf")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "pip install gguf==0.19.0" in err and "requirements-interop.txt" in err, err
