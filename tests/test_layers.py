"""The repo's shape: a flat core at the top level (at most MORE_MODULES beside the card's), tools in scripts/, and
every import (at the top, inside a function, under TYPE_CHECKING) only from a file before it in LAYERS, no cycle."""
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


# The core's files and folders, lowest first, then the tools: each imports only from itself and those before it.
LAYERS = ("model.py", "config/", "runtime.py", "tokenizer.py", "prepare.py", "finetune.py", "data.py", "optim.py",
          "checkpoint.py", "train.py", "sample.py", "scripts/")
# The top level: the card's entries, then what a repo carries beside them (guide, requirements, tool settings).
CARD = {"model.py", "data.py", "train.py", "sample.py", "config", "scripts", "tests", "README.md"}
BESIDE = {"docs", ".ci", ".gitignore", "pytest.ini", "ruff.toml", "requirements.txt", "requirements-dev.txt",
          "requirements-interop.txt", "requirements-llama.txt"}
MORE_MODULES = 6  # flat modules beside the card's four, each named for one concern
PACKAGES = {"config", "scripts"}


def layer_of(path: str) -> int:
    """The index in LAYERS of the folder or core file ``path`` belongs to."""
    for number, name in enumerate(LAYERS):
        if path == name or (name.endswith("/") and path.startswith(name)):
            return number
    raise AssertionError(f"{path} is in no layer: add its file or folder to tests/test_layers.py's LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a file from a layer above its own, in words."""
    return [f"{path} imports {target}, which is above it" for path in sorted(graph) for target in sorted(graph[path])
            if layer_of(target) > layer_of(path)]


# ----------------------------------------------------------------------------- the repo as it is
def test_the_top_level_is_the_cards():
    entries = {name.split("/")[0] for name in repo_files()}
    packages = {name for name in entries if (REPO / name / "__init__.py").is_file()}
    assert packages <= PACKAGES, f"package folders beside config/ and scripts/: {sorted(packages - PACKAGES)}"
    modules = sorted(name for name in entries - CARD if name.endswith(".py"))
    assert len(modules) <= MORE_MODULES, f"{len(modules)} modules beside the card's, at most {MORE_MODULES}: {modules}"
    others = sorted(entries - CARD - BESIDE - set(modules) - packages)
    assert not others, f"at the top level, beside the card's entries: {others}"


def test_every_file_has_a_layer_and_imports_go_down_them_in_no_cycle():
    graph = import_graph(project_files())
    for path in graph:
        layer_of(path)
    assert [name for name in LAYERS if not (REPO / name).exists()] == []  # a dissolved layer leaves LAYERS with it
    assert upward_imports(graph) == []
    cycle = find_cycle(graph)
    assert cycle is None, "an import cycle: " + " -> ".join(cycle)
    # the edges the checker must find, of every kind (a package's module, a lazy import)
    assert "scripts/bench.py" in graph["scripts/compare.py"]  # `from scripts.bench import parse_overrides`
    assert "config/__init__.py" in graph["train.py"]  # `from config import TrainConfig, ...`
    kinds = {"pkg/__init__.py": "", "pkg/mod.py": "", "low.py": "", "top.py": "from pkg import mod\ndef later():\n"
             "    import low\n"}
    assert import_graph(kinds)["top.py"] == {"pkg/mod.py", "low.py"}


# ----------------------------------------------------------------------------- the checker has teeth
BACK_IMPORTS = {  # imports the core must never gain: data.py from train.py (which imports it), and from a tool
    "at the top": ("data.py", "from train import get_lr\n", "train.py"),
    "inside a function": ("data.py", "def schedule():\n    from train import get_lr\n    return get_lr\n", "train.py"),
    "for annotations only": ("data.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from train import StepLosses\n", "train.py"),
    "from a tool": ("model.py", "from scripts.bench import parse_overrides\n", "scripts/bench.py"),
}


@pytest.mark.parametrize("where", BACK_IMPORTS)
def test_a_back_import_is_caught_wherever_it_is_written(where):
    file, line, target = BACK_IMPORTS[where]
    sources = project_files()
    graph = import_graph({**sources, file: sources[file] + "\n" + line})
    assert f"{file} imports {target}, which is above it" in upward_imports(graph)
    cycle = find_cycle(graph)
    assert cycle is not None and {file, target} <= set(cycle) and cycle[0] == cycle[-1], cycle


def test_a_new_folder_needs_a_layer():
    with pytest.raises(AssertionError, match="newfolder/x.py is in no layer"):
        layer_of("newfolder/x.py")
