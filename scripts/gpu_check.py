"""The GPU path, checked end to end in one command: train, DDP, resume, RNG on resume, sample.

    python -m scripts.gpu_check                 # a CUDA machine: gpt2 preset, bf16, compile; ~5 min
    python -m scripts.gpu_check --dry-run       # the same commands on CPU, tiny model, 2 gloo ranks; 1-2 min

Each check runs an entry point (train.py, torchrun, sample.py) in a fresh process, printing the command, and reads
what it wrote. It ends with a PASS/FAIL table (also OUT_DIR/results.json), tokens/s, MFU and peak GPU memory; exit 1 if
any check failed. The rng check uses dropout: a CUDA RNG state not restored on resume changes its masks and losses."""
import sys

if not __package__:  # run as a file, `python scripts/gpu_check.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.gpu_check", file=sys.stderr)
    sys.exit(2)

import json
import shlex
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint import load_checkpoint
from cli import CheckpointError, CommandLine, exit_on_errors, run_tool
from config import REPO
from prepare import corpus_source
from runtime import check_writable

TINY = ("--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--batch_size", "8",
        "--dtype", "float32", "--compile", "off", "--tokenizer", "char", "--device", "cpu")  # config/tiny.toml
GPU = ("--dtype", "bfloat16", "--compile", "on", "--device", "cuda")
RNG_ARGS = ("--dropout", "0.1", "--log_interval", "1")  # any p > 0: the random streams decide the masks
RUN_TIMEOUT_S = 600  # one command; a cold torch.compile of gpt2 takes about a minute
# Wraps a single-process run to print CUDA's peak allocation at exit (train.py does not log it).
PEAK_PROBE = ("import atexit, runpy, sys, torch; atexit.register(lambda: print('peak_memory_bytes', "
              "torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0, flush=True)); "
              "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str  # figures on a pass, the one-line reason on a failure
    seconds: float = 0.0


@dataclass
class Plan:
    common: list[str]  # train.py flags of every run
    out: Path  # one subfolder per run
    steps: int  # of the train and ddp runs; the resume and rng runs do steps // 2 twice
    nproc: int  # DDP ranks; below 2 the ddp check is skipped
    device: str


def run(cmd: list[str], *wrapper: str) -> subprocess.CompletedProcess:
    """Print `python CMD` as a user would type it, then run it in the repo, ``wrapper``'s python flags before it."""
    print("$ " + shlex.join(["python", *cmd]), flush=True)
    try:
        return subprocess.run([sys.executable, *wrapper, *cmd], cwd=REPO, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # a FAIL line like any other failure, not a traceback
        return subprocess.CompletedProcess(cmd, 124, "", f"killed after {RUN_TIMEOUT_S} s")


def failure(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return f"exit {result.returncode}: {lines[-1].strip() if lines else 'no output'}"[:300]


def shortfall(plan: Plan, name: str, result: subprocess.CompletedProcess) -> str:
    if result.returncode:
        return failure(result)
    last = max(losses(plan.out / name), default=None)
    return "" if last == plan.steps else f"metrics.jsonl ends at step {last}, not {plan.steps}"


def train_cmd(plan: Plan, name: str, steps: int, *extra: str) -> list[str]:
    return ["train.py", *plan.common, "--out_dir", str(plan.out / name), "--max_iters", str(steps),
            "--lr_decay_iters", str(plan.steps), "--eval_interval", str(steps), *extra]


def records(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def losses(out_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out_dir) if "loss" in r}


def throughput(out_dir: Path) -> str:
    logged = [r for r in records(out_dir) if "tokens_per_s" in r]  # a run that passed logged some
    steady = logged[1:] or logged  # the first line carries the warm-up
    tok_s = statistics.median(r["tokens_per_s"] for r in steady)
    mfus = [r["mfu"] for r in steady if r["mfu"] is not None]
    return f"{tok_s:,.0f} tok/s, MFU " + (f"{statistics.median(mfus):.1%}" if mfus else "n/a")


def check_train(plan: Plan) -> Check:
    result = run(train_cmd(plan, "train", plan.steps), "-c", PEAK_PROBE)
    if why := shortfall(plan, "train", result):
        return Check("train", "FAIL", why)
    peak = next((int(line.split()[1]) for line in result.stdout.splitlines()
                 if line.startswith("peak_memory_bytes")), 0)
    memory = f"peak GPU memory {peak / 2**30:.2f} GiB" if peak else "peak GPU memory n/a (CPU)"
    return Check("train", "PASS", f"{throughput(plan.out / 'train')}, {memory}")


def check_ddp(plan: Plan) -> Check:
    if plan.nproc < 2:
        return Check("ddp", "SKIP", f"{plan.nproc} GPU: DDP needs 2 or more")
    result = run(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={plan.nproc}",
                  *train_cmd(plan, "ddp", plan.steps)])
    if why := shortfall(plan, "ddp", result):
        return Check("ddp", "FAIL", why)
    return Check("ddp", "PASS", f"{plan.nproc} ranks, {throughput(plan.out / 'ddp')} (whole job)")


def check_resume(plan: Plan) -> Check:
    """Run N steps, then --resume to 2N: it must say it resumed at N and log each step once."""
    half = plan.steps // 2
    for steps, extra in ((half, ()), (2 * half, ("--resume",))):
        result = run(train_cmd(plan, "resumed", steps, *RNG_ARGS, *extra))
        if result.returncode != 0:
            return Check("resume", "FAIL", failure(result))
    if f"at step {half} " not in result.stdout:
        return Check("resume", "FAIL", f"the second run did not report resuming at step {half}")
    logged = [r["step"] for r in records(plan.out / "resumed") if "loss" in r]
    if logged != list(range(1, 2 * half + 1)):
        return Check("resume", "FAIL", f"logged steps {logged}, expected 1..{2 * half} once each")
    return Check("resume", "PASS", f"continued at step {half + 1}, ended at {2 * half}")


def check_rng(plan: Plan) -> Check:
    """2N steps straight must equal the resume check's N + resume + N: losses and final random streams."""
    half = plan.steps // 2
    result = run(train_cmd(plan, "straight", 2 * half, *RNG_ARGS))
    if result.returncode != 0:
        return Check("rng", "FAIL", failure(result))
    straight, resumed = losses(plan.out / "straight"), losses(plan.out / "resumed")
    try:
        rng_a, rng_b = (load_checkpoint(plan.out / name / "last.pt")["rng"] for name in ("straight", "resumed"))
    except CheckpointError as err:
        return Check("rng", "FAIL", f"{err} (the resume check must pass first)")
    if plan.device == "cuda" and not rng_a["torch_cuda"]:
        return Check("rng", "FAIL", "last.pt holds no CUDA RNG state")
    if different := [name for name in rng_a if not same(rng_a[name], rng_b[name])]:
        return Check("rng", "FAIL", f"after a resume these random streams differ from a straight run: {different}")
    after = [s for s in range(half + 1, 2 * half + 1) if straight.get(s) != resumed.get(s)]
    if not after:
        return Check("rng", "PASS", f"losses of steps {half + 1}..{2 * half} and every random stream identical")
    # Two fresh runs that already differ: the kernels are not deterministic here, the streams still decide.
    if before := [s for s in range(1, half + 1) if straight.get(s) != resumed.get(s)]:
        return Check("rng", "PASS", f"random streams identical; losses not comparable: two fresh runs already "
                                    f"differ at step {before[0]} (non-deterministic kernels)")
    return Check("rng", "FAIL", f"resumed loss differs from the straight run's at step {after[0]}: "
                                f"{resumed.get(after[0])} vs {straight.get(after[0])}")


def same(a: Any, b: Any) -> bool:
    """Exact equality of nested dicts, lists and tuples of tensors and plain values."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check_sample(plan: Plan) -> Check:
    result = run(["sample.py", "--ckpt", str(plan.out / "train"), "--max-new-tokens", "50", "--no-stream",
                  "--device", plan.device])
    if result.returncode != 0:
        return Check("sample", "FAIL", failure(result))
    if "-" * 40 not in result.stdout:
        return Check("sample", "FAIL", "no sample in the output")
    return Check("sample", "PASS", f"50 tokens: {result.stdout.splitlines()[1][:40]!r}...")


def main(argv: list[str] | None = None) -> int:
    parser = CommandLine(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", "--dry_run", action="store_true",
                        help="run the same commands on CPU with the tiny preset's shape (for CI)")
    parser.add_argument("--steps", type=int, default=20, help="steps of the train and ddp runs (even, >= 2)")
    parser.add_argument("--out_dir", "--out-dir", type=Path, default=Path("out/gpu_check"),
                        help="one subfolder per run; those subfolders are replaced")
    parser.add_argument("--data_path", "--data-path", default="", help="train.py's --data_path (empty: its own corpus)")
    parser.add_argument("--data_dir", "--data-dir", default="", help="train.py's --data_dir")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.steps % 2:
        parser.error(f"--steps must be even and >= 2, got {args.steps}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here; --dry-run runs the same commands on CPU")
    with exit_on_errors():  # one line and its exit code (cli.py)
        check_writable(args.out_dir, "--out_dir", ".gpu_check-probe")
        corpus_source("shakespeare", args.data_path)  # a corpus that is not there: once, not in every check
    common = ["--config", "gpt2", "--eval_tokens", "8192", "--grad_accum", "2", "--warmup_iters", "2",
              "--log_interval", "5"]
    common += [f"--{name}={Path(value).resolve()}" for name in ("data_path", "data_dir")  # the commands run in REPO
               if (value := getattr(args, name))]
    flags, nproc, device = (TINY, 2, "cpu") if args.dry_run else (GPU, torch.cuda.device_count(), "cuda")
    plan = Plan(common + list(flags), args.out_dir.resolve(), args.steps, nproc, device)
    marker = plan.out / ".written_by_gpu_check"  # never delete runs this script did not make
    if plan.out.is_dir() and any(plan.out.iterdir()) and not marker.is_file():
        parser.error(f"{plan.out} holds files gpu_check.py did not write; pass a new --out_dir")
    for name in ("train", "ddp", "resumed", "straight"):  # train.py refuses a folder that holds a run
        shutil.rmtree(plan.out / name, ignore_errors=True)
    plan.out.mkdir(parents=True, exist_ok=True)
    marker.touch()
    t_start, checks = time.time(), []
    for check in (check_train, check_ddp, check_resume, check_rng, check_sample):  # rng reads the resume check's run
        t0 = time.time()
        checks.append(check(plan))
        checks[-1].seconds = time.time() - t0
        print(f"{checks[-1].status} {checks[-1].name}: {checks[-1].detail}", flush=True)
    width = max(len(c.name) for c in checks)
    for c in checks:  # the table
        print(f"{c.status}  {c.name:<{width}}  {c.seconds:5.0f} s  {c.detail}")
    (plan.out / "results.json").write_text(json.dumps({c.name: c.status for c in checks}, indent=1))
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(f"{sum(c.status == 'PASS' for c in checks)}/{len(checks)} checks passed in {time.time() - t_start:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    run_tool(main)
