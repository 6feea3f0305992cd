"""The imports only point down: no cycle, and no module imports from a layer above its own.

The layers are the list in machinery/__init__.py's docstring, read from there, so the documentation is the
rule. Every import counts, wherever it is written: at the top of a file, inside a function (a lazy import is
a dependency all the same) or under ``if TYPE_CHECKING:`` (an annotation that names a module above is one).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO

GENERATED = ("tests", "out", "data", "hf", "wandb")  # not the project's code: its tests, and what runs write
PACKAGE_DOC = "machinery/__init__.py"  # the list itself: it imports nothing (checked), so it has no layer


def project_files(root: Path = REPO) -> dict[str, str]:
    """Every .py of the project outside tests/ and the folders runs write: repo-relative path -> source."""
    return {path.relative_to(root).as_posix(): path.read_text() for path in sorted(root.rglob("*.py"))
            if path.relative_to(root).parts[0] not in GENERATED and not path.relative_to(root).parts[0].startswith(".")}


def module_file(dotted: str, files: set[str], folder: str = "") -> str | None:
    """The project file that ``import dotted`` loads, looked for under ``folder`` ("" = the repo root), or None."""
    stem = "/".join(filter(None, [folder, *dotted.split(".")]))
    return next((name for name in (f"{stem}.py", f"{stem}/__init__.py") if name in files), None)


def resolve(dotted: str, importer: str, files: set[str]) -> str | None:
    """The file an import of ``dotted`` in ``importer`` loads. A script's own folder comes first, as for
    `python scripts/compare.py` (it finds scripts/bench.py by `import bench`); a package's files are
    imported by their full name only."""
    folder = Path(importer).parent.as_posix()
    if folder != "." and f"{folder}/__init__.py" not in files and (found := module_file(dotted, files, folder)):
        return found
    return module_file(dotted, files)


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
            # `from machinery import hf` loads machinery/hf.py; `from config import X` loads config/__init__.py
            candidates = [[f"{base}.{alias.name}", base] for alias in node.names]
        else:
            continue
        for names in candidates:
            target = next(filter(None, (resolve(name, importer, files) for name in names)), None)
            if target is not None and target != importer:
                found.add(target)
    return found


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """File -> the project files it imports."""
    return {path: imports_of(path, text, set(sources)) for path, text in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports as its path (a -> b -> ... -> a), or None if the graph has none."""
    done, path = set(), []  # path: the walk from the start to where it is now

    def walk(node: str) -> list[str] | None:
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if target in path:  # back to a file the walk is still inside: a cycle
                return path[path.index(target):] + [target]
            if target not in done and (cycle := walk(target)):
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := walk(start)):
            return cycle
    return None


def read_layers(doc: str, files: set[str]) -> dict[str, int]:
    """File -> its layer, from the docstring's lines ``N  name name ...: what they are``."""
    listed = doc.split("Layers, lowest first", 1)[1]
    layers = {}
    for number, names in re.findall(r"^ {4}(\d+)  ([^:\n]+):", listed, flags=re.M):
        for name in names.split():
            if name.endswith("/"):
                members = [path for path in files if path.startswith(name)]
            else:
                members = [name if name.endswith(".py") else f"machinery/{name}.py"]
            assert members and all(path in files for path in members), f"layer {number} names {name}, which is no file"
            for path in members:
                assert path not in layers, f"{path} is in layers {layers[path]} and {number}"
                layers[path] = int(number)
    return layers


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Every import of a file from a layer above its own, in words."""
    return [f"{path} (layer {layers[path]}) imports {target} (layer {layers[target]})"
            for path in sorted(graph) for target in sorted(graph[path]) if layers[target] > layers[path]]


def the_repo() -> tuple[dict[str, str], dict[str, int]]:
    sources = project_files()
    layers = read_layers(sources[PACKAGE_DOC], set(sources))
    return sources, {**layers, PACKAGE_DOC: 1}


# ----------------------------------------------------------------------------- the repo as it is
def test_every_file_of_the_project_has_a_layer():
    sources, layers = the_repo()
    missing = sorted(set(sources) - set(layers))
    assert not missing, f"add {missing} to a layer of the list in {PACKAGE_DOC}"
    assert import_graph(sources)[PACKAGE_DOC] == set(), f"{PACKAGE_DOC} is the list; it imports nothing"


def test_the_imports_form_no_cycle():
    sources, _ = the_repo()
    cycle = find_cycle(import_graph(sources))
    assert cycle is None, "an import cycle: " + " -> ".join(cycle)


def test_no_file_imports_from_a_layer_above_its_own():
    sources, layers = the_repo()
    assert upward_imports(import_graph(sources), layers) == []


def test_the_graph_sees_the_imports_that_matter():
    """The edges the checker must find, of each kind: a script's sibling, a package's module, a lazy import."""
    sources, _ = the_repo()
    graph = import_graph(sources)
    assert "scripts/bench.py" in graph["scripts/compare.py"]  # `from bench import parse_overrides`
    assert {"machinery/distributed.py", "machinery/rundir.py"} <= graph["train.py"]  # `from machinery import ...`
    assert "machinery/finetune.py" in graph["train.py"]  # imported inside start_from, only for init_from
    assert "machinery/errors.py" in graph["machinery/tokenizers.py"]  # the bottom, from everywhere
    assert graph["machinery/errors.py"] == set()


# ----------------------------------------------------------------------------- the checker has teeth
BACK_IMPORTS = {  # the import data.py must never gain, written three ways
    "at the top": "from config import TrainConfig\n",
    "inside a function": "def read_a_config():\n    from config import TrainConfig\n    return TrainConfig\n",
    "for annotations only": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from config import TrainConfig\n",
}


@pytest.mark.parametrize("where", BACK_IMPORTS)
def test_a_back_import_is_caught_wherever_it_is_written(where):
    sources, layers = the_repo()
    mutated = {**sources, "data.py": sources["data.py"] + "\n" + BACK_IMPORTS[where]}
    graph = import_graph(mutated)
    assert "data.py (layer 5) imports config/__init__.py (layer 6)" in upward_imports(graph, layers)
    cycle = find_cycle(graph)
    assert cycle is not None and {"data.py", "config/__init__.py"} <= set(cycle) and cycle[0] == cycle[-1], cycle


def test_the_old_lazy_import_of_tokenizers_from_corpora_would_be_caught():
    """Before: tokenizers.extract_gpt2_ranks imported corpora's download helpers in its body."""
    sources, layers = the_repo()
    lazy = "\ndef extract():\n    from machinery.corpora import prepare\n    return prepare\n"
    graph = import_graph({**sources, "machinery/tokenizers.py": sources["machinery/tokenizers.py"] + lazy})
    assert upward_imports(graph, layers) == ["machinery/tokenizers.py (layer 3) imports machinery/corpora.py (layer 4)"]
    assert find_cycle(graph) is not None


def test_find_cycle_returns_the_cycle_as_a_path():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond is no cycle


def test_a_file_the_list_forgets_or_names_wrongly_fails():
    sources, _ = the_repo()
    doc = sources[PACKAGE_DOC]
    with pytest.raises(AssertionError, match="names tokenfile, which is no file"):
        read_layers(doc.replace(" tokenfiles ", " tokenfile "), set(sources))
    with pytest.raises(AssertionError, match="machinery/errors.py is in layers 1 and 7"):
        read_layers(doc.replace("7  checkpoint", "7  errors checkpoint"), set(sources))
    assert "scripts/new_tool.py" not in read_layers(doc, set(sources))  # a new file: in no layer until listed


# ----------------------------------------------------------------------------- the README says the same
def test_the_readme_names_the_machinery_in_the_order_of_its_layers():
    """The README's module table names every module of machinery/ in their order in the list, lowest first."""
    sources, layers = the_repo()
    row = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `machinery/` |"))
    modules = [Path(path).stem for path in layers if path.startswith("machinery/") and path != PACKAGE_DOC]
    named = [name for name in re.findall(r"`(\w+)`", row) if name in modules]
    assert named == sorted(modules, key=lambda name: layers[f"machinery/{name}.py"]) and len(named) == len(modules), row
