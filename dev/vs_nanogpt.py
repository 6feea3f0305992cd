"""tinygpt's train.py side by side with nanoGPT's own train.py, at nanoGPT's README CPU recipe.

    python -m dev.vs_nanogpt --nanogpt ~/src/nanoGPT                     # 3 alternating rounds of 300 steps
    python -m dev.vs_nanogpt --nanogpt ~/src/nanoGPT --min-ratio 2       # a check: exit 1 below 2x

nanoGPT is not part of this repo: pass a checkout of github.com/karpathy/nanoGPT. Its train.py runs
unchanged with the flags of its README's CPU command (4 layers, 4 heads, width 128, block 64, batch
12, fp32, no compile); ours runs `--config nanogpt_cpu` (the same shapes, our defaults: dtype=auto).
Both log every step; the first --skip steps of each run (start-up, first-call costs) are dropped and
the per-step times of all rounds are pooled into one median per side. The rounds alternate, so load
from other processes falls on both alike. The only thing written into the nanoGPT checkout is
data/tinygpt_shakespeare_char/: our built-in corpus in nanoGPT's train.bin/val.bin/meta.pkl layout
(its own prepare script downloads from the internet).

With --bench each round also runs scripts/bench.py on the same config: the step it times is made of
train.py's own functions, so train.py's logged ms/step should match it (issue 14 asks within 5%); a
larger gap would be time train.py spends outside the step (logging, syncs, data) that bench hides.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from config import CommandLine
from data import load_corpus
from prepare.corpora import prepare
from process.errors import TinyGPTError, exit_on

REPO = Path(__file__).resolve().parent.parent

NANOGPT_DATASET = "tinygpt_shakespeare_char"
RECIPE = ("--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 "
          "--n_layer=4 --n_head=4 --n_embd=128 --dropout=0.0")  # nanoGPT README, "I only have a macbook"
TOKENS_PER_STEP = 12 * 64
OURS_MS = re.compile(r"\|\s*([\d.]+) ms/step")
THEIRS_MS = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", re.M)


def export_corpus(nanogpt: Path) -> None:
    """Our char-level corpus, written where nanoGPT's train.py looks for `--dataset`."""
    corpus = load_corpus(prepare(), block_size=64)
    folder = nanogpt / "data" / NANOGPT_DATASET
    folder.mkdir(parents=True, exist_ok=True)
    np.asarray(corpus.train, dtype=np.uint16).tofile(folder / "train.bin")
    np.asarray(corpus.val, dtype=np.uint16).tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": corpus.vocab_size}, f)  # all nanoGPT's train.py reads from it


def run(command: list[str], cwd: Path) -> str:
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
        sys.exit(f"error: that command failed with exit code {done.returncode}: {' '.join(tail)}")
    return done.stdout


def ours(steps: int, out_dir: Path) -> list[float]:
    out = run([sys.executable, "train.py", "--config", "nanogpt_cpu", "--max_iters", str(steps),
               "--lr_decay_iters", str(steps), "--log_interval", "1", "--eval_interval", str(steps),
               "--eval_tokens", "4096", "--out_dir", str(out_dir)], REPO)
    return [float(ms) for ms in OURS_MS.findall(out)]


def theirs(nanogpt: Path, steps: int, out_dir: Path) -> list[float]:
    out = run([sys.executable, "train.py", "config/train_shakespeare_char.py", *RECIPE.split(),
               f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--dataset={NANOGPT_DATASET}",
               f"--out_dir={out_dir}"], nanogpt)
    return [float(ms) for _, ms in THEIRS_MS.findall(out)]


def bench(steps: int, skip: int, out_dir: Path) -> list[float]:
    """scripts/bench.py's per-step times for the same config: ``skip`` warm-up steps, then the rest."""
    report = out_dir / "bench.json"
    run([sys.executable, "-m", "scripts.bench", "--config", "nanogpt_cpu", "--steps", str(steps - skip),
         "--warmup", str(skip), "--rounds", "1", "--json", str(report)], REPO)
    return json.loads(report.read_text())["results"][0]["step_ms"]


def summary(name: str, rounds: list[list[float]], skip: int) -> float:
    """The median of every round's step times after its first ``skip``, printed with each round's median."""
    per_round = [statistics.median(r[skip:]) for r in rounds]
    pooled = statistics.median([ms for r in rounds for ms in r[skip:]])
    print(f"{name:<20} median {pooled:6.2f} ms/step = {TOKENS_PER_STEP / pooled * 1000:8,.0f} tokens/s; "
          f"round medians {', '.join(f'{m:.2f}' for m in per_round)} ms")
    return pooled


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of github.com/karpathy/nanoGPT")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (one run of each per round)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=10, help="first steps of each run left out of the medians")
    parser.add_argument("--min-ratio", type=float, default=0.0, help="exit 1 unless ours is this many times faster")
    parser.add_argument("--bench", action="store_true",
                        help="also time scripts/bench.py's step each round and compare train.py with it")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if not 0 <= args.skip < args.steps:
        parser.error(f"--skip {args.skip} must be at least 0 and below --steps {args.steps}: no step would be timed")
    if not (args.nanogpt / "train.py").is_file() or not (args.nanogpt / "model.py").is_file():
        parser.error(f"{args.nanogpt} is not a nanoGPT checkout (no train.py and model.py); "
                     "clone github.com/karpathy/nanoGPT and pass its folder")
    try:
        export_corpus(args.nanogpt.resolve())
    except TinyGPTError as err:  # one line and its exit code (process/errors.py)
        exit_on(err)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    timings = {"nanoGPT train.py": [], "tinygpt train.py": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            timings["nanoGPT train.py"].append(theirs(args.nanogpt.resolve(), args.steps, Path(tmp) / f"nano{i}"))
            timings["tinygpt train.py"].append(ours(args.steps, Path(tmp) / f"ours{i}"))
            if args.bench:
                (Path(tmp) / f"bench{i}").mkdir()
                timings.setdefault("tinygpt bench.py", []).append(bench(args.steps, args.skip, Path(tmp) / f"bench{i}"))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    skips = {"tinygpt bench.py": 0}  # bench.py leaves its --warmup steps out itself
    nano, tiny, *benched = (summary(name, rounds, skips.get(name, args.skip)) for name, rounds in timings.items())
    if benched:
        print(f"tinygpt train.py / bench.py: {tiny / benched[0]:.3f}x ms/step (train.py's step should cost "
              f"within 5% of bench's)")
    ratio = nano / tiny
    print(f"tinygpt / nanoGPT: {ratio:.2f}x tokens/s ({args.rounds} rounds x {args.steps} steps, "
          f"first {args.skip} of each run left out)")
    if args.min_ratio and not ratio >= args.min_ratio:
        sys.exit(f"check failed: {ratio:.2f}x is below --min-ratio {args.min_ratio:g}")


if __name__ == "__main__":
    main()
