"""How the repo's code finds itself: the tools are modules run from the repo root (`python -m scripts.eval`),
so every checkout runs its own code, with nothing installed and no file editing the module search path."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TOOLS, repo_files

# Ways a file can reach past the import system: appending to the search path, silencing the import order
# lint that such an edit needs, importing a file by its path (the tests' old way into scripts/).
PATH_EDIT = re.compile(r"sys\.path\s*(\.(insert|append|extend)\(|\[[^\]]*\]\s*=|\+?=)")
ORDER_SILENCED = re.compile(r"noqa:\s*E402")
BY_FILE_PATH = re.compile(r"spec_from_file_location\(")
# What a tool imports from the repo: the top-level modules and the packages beside scripts/ (config/).
MODULES = sorted(path.stem for path in REPO.glob("*.py"))
PACKAGES = sorted(path.parent.name for path in REPO.glob("*/__init__.py"))
CORE = (*MODULES, *(name for name in PACKAGES if name != "scripts"))


def test_no_file_edits_the_module_search_path_or_silences_the_import_order():
    found = [f"{path}:{number}: {line.strip()}" for path in repo_files() if path.endswith(".py")
             for number, line in enumerate((REPO / path).read_text().splitlines(), start=1)
             if any(pattern.search(line) for pattern in (PATH_EDIT, ORDER_SILENCED, BY_FILE_PATH))]
    assert not found, "import the repo's modules by name, run tools with python -m:\n" + "\n".join(found)


def test_the_tests_import_this_checkouts_modules():
    for name in (*CORE, "scripts"):
        importlib.import_module(name)
    loaded = {name: module for name, module in sys.modules.items()
              if name.split(".")[0] in (*CORE, "scripts") and getattr(module, "__file__", None)}
    assert set(CORE) | {"scripts"} <= set(loaded)
    elsewhere = {name: module.__file__ for name, module in loaded.items()
                 if not Path(module.__file__).resolve().is_relative_to(REPO)}
    assert not elsewhere, f"imported from outside {REPO}: {elsewhere}"


@pytest.fixture
def another_checkout(tmp_path: Path) -> Path:
    """A copy of the repo's top-level names that all fail on import: another clone's `pip install -e`, on the path."""
    other = tmp_path / "other-checkout"
    other.mkdir()
    for name in MODULES:
        (other / f"{name}.py").write_text(f"raise ImportError('the other checkout: {name}')\n")
    for package in PACKAGES:
        (other / package).mkdir()
        (other / package / "__init__.py").write_text(f"raise ImportError('the other checkout: {package}')\n")
    return other


def test_a_tool_run_as_a_module_imports_this_checkout_even_with_another_on_the_path(another_checkout):
    env = os.environ | {"PYTHONPATH": str(another_checkout)}
    result = subprocess.run([sys.executable, "-m", "scripts.eval", "--help"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "the other checkout" not in result.stderr, result.stderr
    assert result.stdout.startswith("usage: python -m scripts.eval ")  # the command typed, not eval.py


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tool_run_as_a_file_says_in_one_line_how_to_run_it(another_checkout, tool):
    """As a file (`python scripts/eval.py`) a tool's own folder leads the path and the repo root is not on it, so
    its imports would find anything else there (here another checkout) or nothing: it stops first, in one line."""
    env = os.environ | {"PYTHONPATH": str(another_checkout)}
    result = subprocess.run([sys.executable, str(REPO / (tool.replace(".", "/") + ".py")), "--help"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "the other checkout" not in result.stderr
    assert result.stderr == f"error: run it from the repo root as a module: python -m {tool}\n"
