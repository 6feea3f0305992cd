"""The repo's shape in numbers: what a reader must hold. From the repo root:

    python -m scripts.shape    # lines per file (wc -l), the core's, modules `import train` loads, one step's path

One step's path: one optimizer step of `tiny` (its third, past warmup) traced with sys.setprofile from train.py's
loop; every project function it enters counts whole, non-blank lines."""
import sys

if not __package__:  # run as a file, `python scripts/shape.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.shape", file=sys.stderr)
    sys.exit(2)

import ast
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

from cli import CommandLine, exit_on_errors, run_tool
from config import REPO, make_config

ROOTS = ("lr_at", "train_step", "next")  # what train.py's loop calls for one step (get_lr is lr_at)
OUTSIDE = ("tests", "out", "data")
CORE = ("model.py", "data.py", "train.py", "sample.py", "config/__init__.py")


def line_counts(tests: bool = False) -> dict[str, int]:
    """Lines of every .py file git lists (tracked or new) under tests/, or else outside OUTSIDE."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return {name: len((REPO / name).read_text().splitlines()) for name in sorted(listed)
            if (REPO / name).is_file() and ((Path(name).parts[0] == "tests") if tests else
                                            Path(name).parts[0] not in OUTSIDE)}


def modules_loaded(module: str) -> list[str]:
    """The project modules a fresh interpreter holds after ``import module``, the module itself left out."""
    ours = {p.stem for p in REPO.glob("*.py")} | {p.parent.name for p in REPO.glob("*/__init__.py")}
    code = f"import sys, {module}; print(*sorted(sys.modules))"  # in a child: this script's own imports stay out
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split()
    return [name for name in loaded if name.split(".")[0] in ours and name != module]


def step_path(preset: str, optimizer: str) -> dict[str, set[tuple[str, int]]]:
    """file -> {(function, first line)} entered by one optimizer step of a ``preset`` run (its third step)."""
    import train
    train_file, entered, depth, steps_done = str(REPO / "train.py"), defaultdict(set), [0], [0]

    def profile(frame, event, arg):
        code, caller = frame.f_code, frame.f_back.f_code if frame.f_back else None
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
            steps_done[0] += is_root and code.co_name == "train_step"

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("".join(f"line {i} of a small corpus, with words to learn.\n" for i in range(400)))
        cfg = make_config(preset, data_path=str(text), data_dir=f"{tmp}/data", out_dir=f"{tmp}/out", max_iters=4,
                          warmup_iters=1, eval_interval=1000, log_interval=1000, dtype="float32", compile="off",
                          device="cpu", optimizer=optimizer, batch_size=2, grad_accum=1,
                          tokenizer="char")  # the step is any tokenizer's: no BPE trained on 400 lines, no download
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
                return sum(1 for line in source.splitlines()[start - 1: node.end_lineno] if line.strip())
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", help="the preset whose step is traced")
    parser.add_argument("--optimizer", default="adamw", help="the optimizer of the traced step")
    args = parser.parse_args(argv)
    with exit_on_errors():
        make_config(args.preset, optimizer=args.optimizer)  # a bad preset or optimizer: refused before any output
    counts = line_counts()
    for name, n in counts.items():
        print(f"{n:6d}  {name}")
    largest = max(counts, key=counts.get)
    print(f"{sum(counts.values()):6d}  Python outside tests ({len(counts)} files; the largest: {largest})")
    print(f"{sum(counts.get(name, 0) for name in CORE):6d}  the five core files: {', '.join(CORE)}")
    for module in ("train", "sample"):
        print(f"{len(modules_loaded(module)):6d}  project modules `import {module}` loads")
    tests = line_counts(tests=True)
    print(f"{sum(tests.values()):6d}  lines of tests ({len(tests)} files)")
    with exit_on_errors():
        entered = step_path(args.preset, args.optimizer)
    total = 0
    print(f"one optimizer step ({args.preset}, fp32, {args.optimizer}) enters:")
    for path, functions in sorted(entered.items()):
        total += (lines := sum(function_lines(path, first) for _, first in functions))
        print(f"{lines:6d}  {Path(path).relative_to(REPO)}: {', '.join(sorted(name for name, _ in functions))}")
    print(f"{total:6d}  non-blank lines in {len(entered)} files on one step's path")


if __name__ == "__main__":
    run_tool(main)
