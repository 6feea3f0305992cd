"""The repo's shape in numbers: what a reader must hold. From the repo root:

    python -m scripts.shape         # lines per file, the core's, what `import train` loads, one step's path

- lines: every .py outside tests/, per file and in all (wc -l); the five core files (model, data, train, sample,
  config/__init__) together;
- names: the project names train.py imports (at any depth: a lazy import counts);
- modules: the project modules a fresh interpreter holds after `import train` and after `import sample` (the module
  itself not counted), as sys.modules lists them;
- the step: one optimizer step of `tiny` (lr, batches, forward, loss, backward, clip, update; its third, past warmup)
  traced with sys.setprofile from train.py's loop; every project function it enters counts whole, non-blank lines.
"""
from __future__ import annotations

import sys

if not __package__:  # run as a file, `python scripts/shape.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.shape", file=sys.stderr)
    sys.exit(2)

import ast
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

from config import REPO, CommandLine, TinyGPTError, exit_on

ROOTS = ("get_lr", "train_step", "next")  # what train.py's loop calls for one step
OUTSIDE = ("tests", "out", "data")
CORE = ("model.py", "data.py", "train.py", "sample.py", "config/__init__.py")


def python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return sorted(REPO / name for name in listed if Path(name).parts[0] not in OUTSIDE and (REPO / name).is_file())


def line_counts() -> dict[str, int]:
    return {p.relative_to(REPO).as_posix(): len(p.read_text().splitlines()) for p in python_files()}


def project_modules() -> set[str]:
    """Top-level names a project import starts with: the root's .py files and its packages."""
    return {p.stem for p in REPO.glob("*.py")} | {p.parent.name for p in REPO.glob("*/__init__.py")}


def imported_names(path: Path) -> list[str]:
    """The project names ``path`` imports: ``from config import A, B`` is two, ``import train`` one."""
    ours, names = project_modules(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in ours:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names if alias.name.split(".")[0] in ours]
    return names


def modules_loaded(module: str) -> list[str]:
    """The project modules a fresh interpreter holds after ``import module``, the module itself left out."""
    code = f"import sys, {module}; print(*sorted(sys.modules))"  # in a child: this script's own imports stay out
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split()
    return [name for name in loaded if name.split(".")[0] in project_modules() and name != module]


def step_path(preset: str, optimizer: str) -> dict[str, set[tuple[str, int]]]:
    """file -> {(function, first line)} entered by one optimizer step of a ``preset`` run (its third step)."""
    import train
    from config import make_config

    train_file = str(REPO / "train.py")
    entered: dict[str, set] = defaultdict(set)
    depth, steps_done = [0], [0]

    def profile(frame, event, arg):
        code = frame.f_code
        caller = frame.f_back.f_code if frame.f_back else None
        is_root = code.co_name in ROOTS and caller is not None and caller.co_filename == train_file
        if event == "call":
            if depth[0] == 0 and is_root and steps_done[0] == 2:  # the third step: past warmup and first calls
                depth[0] = 1
            elif depth[0]:
                depth[0] += 1
            if depth[0] and code.co_filename.startswith(str(REPO)) and "/tests/" not in code.co_filename:
                entered[code.co_filename].add((code.co_name, code.co_firstlineno))
        elif event == "return":
            depth[0] = max(0, depth[0] - 1)
            if is_root and code.co_name == "train_step":
                steps_done[0] += 1

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("".join(f"line {i} of a small corpus, with words to learn.\n" for i in range(400)))
        cfg = make_config(preset, data_path=str(text), data_dir=f"{tmp}/data", out_dir=f"{tmp}/out", max_iters=4,
                          warmup_iters=1, eval_interval=1000, log_interval=1000, dtype="float32", compile="off",
                          device="cpu", optimizer=optimizer, batch_size=2, grad_accum=1)
        sys.setprofile(profile)
        try:
            train.train(cfg)
        finally:
            sys.setprofile(None)
    return entered


def function_lines(path: str, first_line: int) -> int:
    """Non-blank lines of the function that starts at ``first_line`` of ``path`` (decorators included)."""
    source = Path(path).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node.lineno <= first_line:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            if first_line in (node.lineno, start):
                lines = source.splitlines()[start - 1: node.end_lineno]
                return sum(1 for line in lines if line.strip())
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description="The repo's shape in numbers: lines, train.py's names, one step's path.")
    parser.add_argument("--preset", default="tiny", help="the preset whose step is traced")
    parser.add_argument("--optimizer", default="adamw", help="the optimizer of the traced step")
    args = parser.parse_args(argv)
    try:
        report(args.preset, args.optimizer)
    except TinyGPTError as err:
        exit_on(err)


def report(preset: str, optimizer: str) -> None:
    """Print the numbers."""
    counts = line_counts()
    for name, n in sorted(counts.items()):
        print(f"{n:6d}  {name}")
    largest = max(counts, key=counts.get)
    print(f"{sum(counts.values()):6d}  Python outside tests ({len(counts)} files; the largest: {largest})")
    print(f"{sum(counts.get(name, 0) for name in CORE):6d}  the five core files: {', '.join(CORE)}")
    for module in ("train", "sample"):
        print(f"{len(modules_loaded(module)):6d}  project modules `import {module}` loads")
    names = imported_names(REPO / "train.py")
    print(f"{len(names):6d}  project names train.py imports, from "
          f"{len({n.rsplit('.', 1)[0] for n in names})} modules")
    entered = step_path(preset, optimizer)
    total = 0
    print(f"one optimizer step ({preset}, fp32, {optimizer}) enters:")
    for path, functions in sorted(entered.items()):
        lines = sum(function_lines(path, first) for _, first in functions)
        total += lines
        names = ", ".join(sorted(name for name, _ in functions))
        print(f"{lines:6d}  {Path(path).relative_to(REPO)}: {names}")
    print(f"{total:6d}  non-blank lines in {len(entered)} files on one step's path")


if __name__ == "__main__":
    main()
