"""The repo's shape: the card's top level (at most MORE_MODULES flat modules beside it), tools in scripts/ that no core
file imports, model.py on its own, and no import cycle (an import at the top, in a function or for annotations)."""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest
from conftest import REPO, project_files, repo_files


def imports_of(importer: str, source: str, files: set[str]) -> set[str]:
    """The project files ``importer`` imports: every import statement in it, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(source)):  # ast.walk reaches into functions and if-blocks alike
        if isinstance(node, ast.Import):
            candidates = [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y: relative to the importer's package
                package = Path(importer).parent.parts[: len(Path(importer).parent.parts) - node.level + 1]
                base = ".".join([*package, *filter(None, [base])])
            # `from scripts import bench` loads scripts/bench.py; `from config import X` loads config/__init__.py
            candidates = [[f"{base}.{alias.name}", base] for alias in node.names]
        else:
            continue
        for names in candidates:  # the first project file one of the names loads from the repo root
            paths = [name.replace(".", "/") + end for name in names for end in (".py", "/__init__.py")]
            target = next((path for path in paths if path in files), None)
            if target is not None and target != importer:
                found.add(target)
    return found


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """File -> the project files it imports."""
    return {path: imports_of(path, text, set(sources)) for path, text in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports as its path (a -> b -> ... -> a), or None if the graph has none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return error.args[1][::-1]  # graphlib lists each file before the one that imports it
    return None


# The top level: the card's entries, then what a repo carries beside them (guide, requirements, tool settings).
CARD = {"model.py", "data.py", "train.py", "sample.py", "config", "scripts", "tests", "README.md"}
BESIDE = {"docs", ".ci", ".gitignore", "pytest.ini", "ruff.toml", "requirements.txt", "requirements-dev.txt",
          "requirements-interop.txt", "requirements-llama.txt"}
MORE_MODULES = 8  # flat modules beside the card's four, each named for one concern
PACKAGES = {"config", "scripts"}


def rule_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a tool by the core, or by model.py of anything, and an import cycle, in words."""
    breaks = [f"{path} imports {target}" for path in sorted(graph) for target in sorted(graph[path])
              if path == "model.py" or (target.startswith("scripts/") and not path.startswith("scripts/"))]
    return breaks + ([" -> ".join(cycle)] if (cycle := find_cycle(graph)) else [])


# ----------------------------------------------------------------------------- the repo as it is
def test_the_top_level_is_the_cards():
    entries = {name.split("/")[0] for name in repo_files()}
    packages = {name for name in entries if (REPO / name / "__init__.py").is_file()}
    assert packages <= PACKAGES, f"package folders beside config/ and scripts/: {sorted(packages - PACKAGES)}"
    modules = sorted(name for name in entries - CARD if name.endswith(".py"))
    assert len(modules) <= MORE_MODULES, f"{len(modules)} modules beside the card's, at most {MORE_MODULES}: {modules}"
    others = sorted(entries - CARD - BESIDE - set(modules) - packages)
    assert not others, f"at the top level, beside the card's entries: {others}"


def test_no_core_file_imports_a_tool_model_py_imports_nothing_and_no_import_is_a_cycle():
    graph = import_graph(project_files())
    assert rule_breaks(graph) == []
    # the edges the checker must find, of every kind (a package's module, a lazy import)
    assert "scripts/bench.py" in graph["scripts/compare.py"]  # `from scripts.bench import parse_overrides`
    assert "config/__init__.py" in graph["train.py"]  # `from config import TrainConfig, ...`
    kinds = {"pkg/__init__.py": "", "pkg/mod.py": "", "low.py": "", "top.py": "from pkg import mod\ndef later():\n"
             "    import low\n"}
    assert import_graph(kinds)["top.py"] == {"pkg/mod.py", "low.py"}
    separate = {"data.py": {"scripts/x.py"}, "scripts/x.py": set(), "model.py": {"low.py"}}  # each rule, no cycle
    assert rule_breaks(separate) == ["data.py imports scripts/x.py", "model.py imports low.py"]


# ----------------------------------------------------------------------------- the checker has teeth
BACK_IMPORTS = {  # imports the core must never gain: data.py from train.py (which imports it), and from a tool
    "at the top": ("data.py", "from train import get_lr\n", "train.py"),
    "inside a function": ("data.py", "def schedule():\n    from train import get_lr\n    return get_lr\n", "train.py"),
    "for annotations only": ("data.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from train import StepLosses\n", "train.py"),
    "from a tool": ("checkpoint.py", "from scripts.bench import parse_overrides\n", "scripts/bench.py"),
    "from model.py": ("model.py", "from config import TrainConfig\n", "config/__init__.py"),
}


@pytest.mark.parametrize("where", BACK_IMPORTS)
def test_a_back_import_is_caught_wherever_it_is_written(where):
    file, line, target = BACK_IMPORTS[where]
    sources = project_files()
    breaks = rule_breaks(import_graph({**sources, file: sources[file] + "\n" + line}))
    assert breaks and all(name in " ".join(breaks) for name in (file, target)), breaks
