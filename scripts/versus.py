"""This checkout's training step against another commit's, side by side: the two benches in alternating rounds.

    python -m scripts.versus main --config small --threads 1 --rounds 5   # tokens/s, each side's median, the ratio
    python -m scripts.versus HEAD~1 dtype=float32 --threads 1              # KEY=VALUE overrides, among the flags

Each round runs `python -m scripts.bench` in each tree, one after the other, the order swapped every round, so a
machine's drift falls on both alike; the other commit runs from a temporary `git worktree`, reading this checkout's
data/. The ratio is of the medians of the rounds' tokens/s.
"""
from __future__ import annotations

import sys

if not __package__:  # run as a file, `python scripts/versus.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.versus", file=sys.stderr)
    sys.exit(2)

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from config import REPO, CommandLine, ConfigError, TinyGPTError, exit_on


def bench(tree: Path, args, overrides: list[str], out: Path) -> dict:
    """One scripts.bench run in ``tree``; its JSON result."""
    command = [sys.executable, "-m", "scripts.bench", "--config", args.config, "--threads", str(args.threads),
               "--steps", str(args.steps), "--json", str(out), f"data_dir={REPO / 'data'}", *overrides]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, env=os.environ | {"PYTHONHASHSEED": "0"})
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"the bench in {tree} failed (exit {done.returncode}): {last}")
    return json.loads(out.read_text())["results"][0]


def alternate(args) -> dict[str, list[dict]]:
    """Each side's bench results, round by round, the other commit in a worktree of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        made = subprocess.run(["git", "worktree", "add", "--detach", str(other), args.commit], cwd=REPO,
                              capture_output=True, text=True)
        if made.returncode != 0:
            raise ConfigError(f"git worktree add {args.commit}: {made.stderr.strip()}")
        try:
            sides = {args.commit: (other, []), "this checkout": (REPO, [])}
            for round_ in range(args.rounds):
                for name in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
                    tree, results = sides[name]
                    results.append(bench(tree, args, args.overrides, Path(tmp) / "bench.json"))
                    print(f"round {round_ + 1} {name}: {results[-1]['tokens_per_s']:,.0f} tokens/s "
                          f"({results[-1]['dtype']}, {results[-1]['ms_per_step']:.2f} ms/step)", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=REPO, capture_output=True)
    return {name: results for name, (_, results) in sides.items()}


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n")[0])
    parser.add_argument("commit", help="the other side: a commit, branch or tag of this repo")
    parser.add_argument("overrides", nargs="*", default=[], help="KEY=VALUE config overrides for both benches")
    parser.add_argument("--config", default="small", help="preset of both benches")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each bench (they never overlap)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per bench run")
    parser.add_argument("--rounds", type=int, default=5, help="bench runs per side, alternating")
    args = parser.parse_args(argv)
    try:
        sides = alternate(args)
    except TinyGPTError as err:  # a commit git does not know, a bench that failed: one line and its exit code
        exit_on(err)
    medians = {}
    for name, results in sides.items():
        rates = [r["tokens_per_s"] for r in results]
        medians[name] = statistics.median(rates)
        print(f"{name}: median {medians[name]:,.0f} tokens/s (min {min(rates):,.0f}, max {max(rates):,.0f}), "
              f"{results[0]['dtype']}, {args.threads} thread(s)")
    print(f"this checkout / {args.commit}: {medians['this checkout'] / medians[args.commit]:.2f}x tokens/s")


if __name__ == "__main__":
    main()
