"""Compare config variants over several seeds: equal steps, interleaved runs, a paired t-test.

    python -m scripts.compare --config small --steps 1500 --seeds 3 base: adamw:optimizer=adamw
    python -m scripts.compare --config tiny --steps 200 --seeds 3 base: low_lr:learning_rate=3e-4,min_lr=3e-5
    python -m scripts.compare --config small --time 180 --seeds 3 base: wide:n_embd=192   # equal wall time

Each (variant, seed) trains in EXP/NAME/seed-N, round by round; a rerun reuses finished runs of this code and resumes
a stopped one. Writes EXP/results.json, results.md and compare.png. Why: docs/experiments.md."""
import sys

if not __package__:  # run as a file, `python scripts/compare.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.compare", file=sys.stderr)
    sys.exit(2)

import dataclasses
import hashlib
import json
import math
import re
import shlex
import statistics
import warnings
from pathlib import Path
from typing import Any

import torch

import train
from checkpoint import from_checkpoint, git, git_state
from cli import (CommandLine, ConfigError, RunStopped, StopOnSignal, exit_on_errors, fail, install_hint, require,
                 run_tool)
from config import DEFAULTS, REPO, TrainConfig, make_config
from prepare import SHAKESPEARE_CHAT, corpus_source
from runtime import atomic_write_text, check_writable, choose_runtime, dtype_name, use_threads
from scripts.bench import parse_overrides

# Fields compare.py sets itself, and the flag that sets each: a variant changing one would not be compared.
OWNED = {"out_dir": "--out", "seed": "--seeds", "resume": "rerunning the command", "schedule": "--steps/--time",
         "max_iters": "--steps", "max_time": "--time"}
IGNORED_ON_REUSE = ("out_dir", "resume", "given")  # a moved folder, a resumed run, a setting given: the same run
RESULT = "result.json"  # a run's marker that it finished
CODE = "code.json"  # the code a run runs (code_fingerprint), written as it starts
MARKER = ".written_by_compare"  # in EXP: its runs resume; a folder without it holds files compare did not write
NOT_TRAINING_CODE = ("tests", "docs", "scripts")  # folders whose .py files a training run never imports
STEP_CAP_IN_TIME_MODE = 10**9  # --time without --steps: only the clock ends a run
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # a variant's name is a folder name


@dataclasses.dataclass(frozen=True)
class Run:
    """One (variant, seed): the preset and the overrides that make its config."""
    variant: str
    seed: int
    folder: Path
    preset: str
    overrides: dict[str, Any]

    def config(self, resume: bool = False) -> TrainConfig:
        return make_config(self.preset, **self.overrides, resume=resume)

    def made_by(self, code: dict[str, str]) -> dict[str, str]:
        """What the run is made of besides its config: the code, and the corpus as prepare.py names it ("corpus-5e1b..."
        with its file's fingerprint, or "shakespeare"): an edited --data_path is another."""
        return {**code, "corpus": corpus_name(self.config())}


def corpus_name(cfg: TrainConfig) -> str:
    """The corpus as prepare.py names it, or a DataError (a missing file, an unknown dataset) before any run."""
    if cfg.dataset == SHAKESPEARE_CHAT and not cfg.data_path:  # the built-in conversations: made at their first use
        return SHAKESPEARE_CHAT
    return corpus_source(cfg.dataset, cfg.data_path, cfg.text_column)[0]


@dataclasses.dataclass(frozen=True)
class Plan:
    folder: Path  # the experiment folder, EXP
    variants: dict[str, dict[str, str]]  # name -> its overrides as typed, the baseline first
    seeds: list[int]
    runs: list[Run]  # in running order: seed 1 of every variant, then seed 2, ...
    mode: str  # "steps" or "time"
    budget: float  # steps per run, or seconds per run
    command: str  # the command that continues this comparison


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """NAME:KEY=VALUE[,KEY=VALUE...] -> (name, overrides); nothing after the colon is the preset as it is."""
    name, colon, body = text.partition(":")
    if not colon or not NAME.fullmatch(name):
        raise ConfigError(f"variant `{text}` must look like NAME:KEY=VALUE[,KEY=VALUE], e.g. rope:pos_emb=rope, "
                          "or NAME: for the preset as it is (a name: letters, digits, _ . + -)")
    overrides = parse_overrides([body]) if body else {}
    require(not body or len(overrides) == body.count(",") + 1, f"variant `{name}` sets a key twice: {body}")
    return name, overrides


def variant_overrides(args, variants: dict[str, dict[str, str]], schedule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every variant's overrides (the schedule < --set < its own), each validated with make_config."""
    common = ({"threads": args.threads} if args.threads else {}) | parse_overrides(args.set)
    for where, overrides in [("--set", common), *((f"variant `{name}`", own) for name, own in variants.items())]:
        if owned := [key for key in overrides if key in OWNED]:
            raise ConfigError(f"{where} sets `{owned[0]}`, which compare.py sets itself (with {OWNED[owned[0]]})")
    base = schedule | common
    make_config(args.config, **base)  # a bad preset or --set is named as such, not as a variant's fault
    merged = {name: {**base, **own} for name, own in variants.items()}
    for name, overrides in merged.items():
        try:
            make_config(args.config, **overrides)
        except ConfigError as err:
            raise ConfigError(f"variant `{name}`: {err}") from None
    return merged


def check_flags(args) -> None:
    if args.steps is None and args.time is None:
        raise ConfigError("give --steps N (equal steps: the quality answer) or --time S (equal wall time)")
    for flag, value in (("--steps", args.steps), ("--time", args.time)):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be > 0, got {value:g}")
    require(args.seeds >= 2, f"--seeds {args.seeds} leaves no spread and no p-value: use --seeds 2 or more "
                             "(3+ for a claim)")
    require(args.variants, "no variants: name at least one, e.g. base: rope:pos_emb=rope")
    names = [text.partition(":")[0] for text in args.variants]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"variant name `{twice[0]}` is used twice; each variant needs its own name")
    if args.vs is not None and args.vs not in names:
        raise ConfigError(f"--vs {args.vs} names no variant; the variants are {', '.join(names)}")


def make_plan(args, command: str, code: dict[str, str] | None = None) -> Plan:
    """Validate the command and lay out its runs; writes nothing. Runs on disk of other ``code`` are retrained."""
    check_flags(args)
    variants = dict(map(parse_variant, args.variants))
    if args.time is not None:  # S seconds of wall clock (--steps a cap), or N steps
        mode, budget, label = "time", args.time, f"{args.time:g}s"
        schedule = {"schedule": "time", "max_time": args.time, "max_iters": args.steps or STEP_CAP_IN_TIME_MODE}
    else:
        mode, budget, label = "steps", args.steps, f"{args.steps}steps"
        schedule = {"schedule": "steps", "max_iters": args.steps, "lr_decay_iters": args.steps, "max_time": 0}
    folder = args.out or Path("out", "compare", f"{Path(args.config).stem}-{label}")  # a rerun finds its runs again
    check_writable(folder, "--out", MARKER + "-probe")  # a file in the way, a read-only folder: one line, now
    if folder.is_dir() and any(folder.iterdir()) and not (folder / MARKER).is_file():  # a training run's, say
        raise ConfigError(f"{folder} holds files compare.py did not write; pass a new or an empty --out")
    overrides = variant_overrides(args, variants, schedule)
    seeds = list(range(1, args.seeds + 1))
    runs = [Run(name, seed, folder / name / f"seed-{seed}", args.config, {**overrides[name], "seed": seed,
                "out_dir": str(folder / name / f"seed-{seed}")}) for seed in seeds for name in variants]
    for cfg in {(c.dataset, c.data_path, c.text_column): c for c in map(Run.config, runs)}.values():
        corpus_name(cfg)  # DataError now, not after the runs before it
    runs = pin_auto_dtype(runs)
    for run in runs:
        if code is None or not is_stale(run, code):
            check_reusable(run)
    return Plan(folder, variants, seeds, runs, mode, budget, command)


def saved(folder: Path) -> dict[str, Any]:
    """{"config", "code"} of a run on disk: a finished one's result.json, a stopped one's last.pt and code.json."""
    if (folder / RESULT).is_file():
        return json.loads((folder / RESULT).read_text())
    try:  # last.pt's config, read cheaply: memory-mapped, its digest unchecked
        state = torch.load(folder / "last.pt", map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - none, or unreadable: load_checkpoint will name the problem
        state = None
    return {"config": state.get("config") if isinstance(state, dict) else None,
            "code": json.loads((folder / CODE).read_text()) if (folder / CODE).is_file() else None}


def pin_auto_dtype(runs: list[Run]) -> list[Run]:
    """dtype=auto decided once for every run: as a run on disk was, else by choose_runtime for the first."""
    if not (auto := [run for run in runs if run.config().dtype == "auto"]):
        return runs
    saved_dtypes = [cfg["dtype"] for r in auto if (cfg := saved(r.folder)["config"]) and cfg.get("dtype") != "auto"]
    dtype = saved_dtypes[0] if saved_dtypes else dtype_name(choose_runtime(auto[0].config()).dtype)
    print(f"dtype auto -> {dtype} for every run of this comparison")
    return [dataclasses.replace(r, overrides={**r.overrides, "dtype": dtype}) if r in auto else r for r in runs]


def check_reusable(run: Run) -> None:
    """Refuse a run on disk made with other settings (a field it lacks is newer: the run had its default)."""
    if (before := saved(run.folder)["config"]) is None:
        return
    planned = dataclasses.asdict(run.config())
    if changed := [f"{key}: {before.get(key, DEFAULTS[key])!r} there, {value!r} now" for key, value in planned.items()
                   if key not in IGNORED_ON_REUSE and before.get(key, DEFAULTS[key]) != value]:
        raise ConfigError(f"{run.folder} holds a run with other settings ({'; '.join(changed)}); "
                          "pass another --out or delete that folder")


def source_files() -> list[str]:
    """The repo's .py files, tracked or new (a fork's module), outside NOT_TRAINING_CODE."""
    listed = git("ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py", cwd=REPO).splitlines()
    paths = listed or [str(p.relative_to(REPO)) for p in REPO.rglob("*.py")]
    return sorted(p for p in set(paths) if p.split("/")[0] not in NOT_TRAINING_CODE and (REPO / p).is_file())


def code_fingerprint() -> dict[str, str]:
    """A hash of source_files' contents on disk (edits included) and the commit, for people to read."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.encode() + b"\0" + (REPO / path).read_bytes() + b"\0")
    state = git_state()  # what checkpoints record
    commit = state["git_commit"][:7] or "no git"
    return {"hash": digest.hexdigest()[:12], "commit": commit + ("+edits" if state["git_dirty"] else "")}


def is_stale(run: Run, code: dict[str, str]) -> bool:
    """A run on disk that other code made (or that recorded none), or made on another corpus (where recorded)."""
    ran, made = saved(run.folder).get("code"), run.made_by(code)
    return run.folder.is_dir() and any(run.folder.iterdir()) and (
        ran is None or ran["hash"] != made["hash"] or ran.get("corpus", made["corpus"]) != made["corpus"])


def set_aside_if_stale(run: Run, code: dict[str, str], where: str) -> None:
    """Move a run on disk made by other code or data to EXP/stale/HASH/, saying so."""
    if not is_stale(run, code):
        return
    old, made = saved(run.folder).get("code"), run.made_by(code)
    ran = f"code {old['hash']} (commit {old['commit']})" if old else "code this version did not record"
    home = run.folder.parents[1] / "stale" / (old["hash"] if old else "unrecorded") / run.variant
    stale, n = home / run.folder.name, 1
    while stale.exists():  # set aside before under the same code (edited back and forth): both kept
        n += 1
        stale = home / f"{run.folder.name}.{n}"
    stale.parent.mkdir(parents=True, exist_ok=True)
    run.folder.rename(stale)
    print(f"{where}: retraining: it ran {ran} on {(old or {}).get('corpus', 'its corpus')}, this is code "
          f"{code['hash']} (commit {code['commit']}) on {made['corpus']}; the old run is kept in {stale}", flush=True)


def run_all(plan: Plan, stop: StopOnSignal, code: dict[str, str]) -> None:
    """Every run in order, finished ones skipped, stopped ones resumed; a diverged run is a result, not a stop."""
    for i, run in enumerate(plan.runs, 1):
        where = f"[{i}/{len(plan.runs)}] {run.variant} seed {run.seed}"
        set_aside_if_stale(run, code, where)
        if (run.folder / RESULT).is_file():
            print(f"{where}: finished earlier, reusing {run.folder}", flush=True)
            continue
        resume = (run.folder / "last.pt").is_file()
        print(f"{where}: {'resuming' if resume else 'training'} in {run.folder}", flush=True)
        cfg = run.config(resume)
        run.folder.mkdir(parents=True, exist_ok=True)
        (plan.folder / MARKER).touch()
        atomic_write_text(run.folder / CODE, json.dumps(run.made_by(code), indent=1))  # whole: a kill leaves no half
        diverged = ""
        try:
            train.train(cfg, stop)
        except RunStopped as err:
            if stop.requested:
                raise RunStopped(f"stopped during {run.variant} seed {run.seed} (its last.pt holds the last step "
                                 f"done); continue with the same command: {plan.command}", err.exit_code) from None
            print(f"{where}: {err}; recorded as diverged", flush=True)
            diverged = str(err)
        write_result(run, cfg, run.made_by(code), diverged)


def write_result(run: Run, cfg: TrainConfig, code: dict[str, str], diverged: str = "") -> None:
    """The run's final numbers, from its metrics.jsonl and last.pt, into result.json (the marker)."""
    records = [json.loads(line) for line in (run.folder / "metrics.jsonl").read_text().splitlines()]
    last = run.folder / "last.pt"
    evals = [r for r in records if "val_loss" in r]
    logs = [r for r in records if "tokens_per_s" in r][1:]  # the first log interval is warm-up
    step_ms = [r["tokens_per_step"] / r["tokens_per_s"] * 1000 for r in logs]
    final = evals[-1] if evals and not diverged else {"step": records[-1]["step"] if records else 0}
    result = {"variant": run.variant, "seed": run.seed, "step": final["step"],
              "val_loss": final.get("val_loss", math.nan), "val_bpb": final.get("val_bpb", math.nan),
              "ms_per_step": statistics.median(step_ms) if step_ms else math.nan,
              "params": from_checkpoint(last).model.num_params(non_embedding=False) if last.is_file() else 0,
              "diverged": diverged, "threads": torch.get_num_threads(), "code": code, "config": dataclasses.asdict(cfg)}
    atomic_write_text(run.folder / RESULT, json.dumps(result, indent=1))


def t_test():
    """scipy.stats, imported only here: the rest of the repo runs without scipy."""
    try:
        from scipy import stats
    except ImportError:
        raise ConfigError(f"compare.py's paired t-test needs scipy: {install_hint('scipy')}") from None
    return stats


def paired(base: list[float], other: list[float]) -> dict[str, float]:
    """Mean of other - base over seeds, its 95% t-interval and the paired t-test's two-sided p-value."""
    diffs = [o - b for o, b in zip(other, base)]
    with warnings.catch_warnings(action="ignore", category=RuntimeWarning):  # identical seeds: nan for 0/0, warned
        test = t_test().ttest_rel(other, base)
        low, high = test.confidence_interval(0.95)
    p = float(test.pvalue) if any(diffs) else 1.0  # no difference at all on any seed: scipy's 0/0 is nan
    return {"diff": statistics.fmean(diffs), "low": float(low), "high": float(high), "p": p}


def summarise(plan: Plan, vs: str | None = None) -> dict[str, Any]:
    """results.json: per variant its runs, spread, speed and the paired test against ``vs`` (else the first)."""
    results = {(r.variant, r.seed): json.loads((r.folder / RESULT).read_text()) for r in plan.runs}
    base = vs or next(iter(plan.variants))
    rows = []
    for name, overrides in plan.variants.items():
        runs = [results[name, s] for s in plan.seeds]
        row = {"name": name, "overrides": overrides, "params": runs[0]["params"],
               "runs": [{k: r[k] for k in ("seed", "step", "val_loss", "val_bpb", "ms_per_step", "diverged")}
                        | {"folder": str(Path(name) / f"seed-{r['seed']}")} for r in runs]}
        for metric in ("val_loss", "val_bpb"):
            values = [r[metric] for r in runs]
            finite = all(map(math.isfinite, values))  # a diverged run's nan: statistics.stdev raises on it
            row[metric] = {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if finite else math.nan}
            if name != base:
                row[metric] |= paired([results[base, s][metric] for s in plan.seeds], values)
        ratios = [results[name, s]["ms_per_step"] / results[base, s]["ms_per_step"] for s in plan.seeds]
        row["ms_per_step"] = statistics.median(r["ms_per_step"] for r in runs)
        row["speed_ratio"] = statistics.median(ratios)  # per round, then the median: drift cancels
        rows.append(row)
    threads = sorted({r["threads"] for r in results.values()})  # reduction order: part of bit-exactness
    return {"command": plan.command, "mode": plan.mode, "budget": plan.budget, "seeds": plan.seeds,
            "baseline": base, "torch": torch.__version__, "threads": threads, "variants": rows}


def table(rows: list[list[str]]) -> str:
    """A Markdown table with padded columns, readable in a terminal too."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def metric_table(summary: dict[str, Any], metric: str) -> str:
    base = summary["baseline"]
    rows = [["variant", *(f"seed {s}" for s in summary["seeds"]), "mean ± sd", f"Δ vs {base} [95% CI]", "p"]]
    for row in summary["variants"]:
        m = row[metric]
        test = ([f"{m['diff']:+.4f} [{m['low']:+.4f}, {m['high']:+.4f}]", f"{m['p']:.2g}"] if "p" in m
                else ["(baseline)", ""])
        rows.append([row["name"], *(f"{r[metric]:.4f}" for r in row["runs"]), f"{m['mean']:.4f} ± {m['sd']:.4f}",
                     *test])
    return table(rows)


def speed_table(summary: dict[str, Any]) -> str:
    ratio = f"ms/step / {summary['baseline']}'s"
    rows = [["variant", "overrides", "params", "steps (mean)", "ms/step (median)", ratio]]
    for row in summary["variants"]:
        overrides = ",".join(f"{k}={v}" for k, v in row["overrides"].items()) or "(preset)"
        steps = statistics.fmean(r["step"] for r in row["runs"])
        rows.append([row["name"], overrides, f"{row['params']:,}", f"{steps:g}", f"{row['ms_per_step']:.2f}",
                     f"{row['speed_ratio']:.3f}"])
    return table(rows)


def report(summary: dict[str, Any]) -> str:
    """The tables results.md holds and the command prints."""
    n, base = len(summary["seeds"]), summary["baseline"]
    budget = (f"{summary['budget']:g} s of wall clock per run (schedule=time)" if summary["mode"] == "time"
              else f"{summary['budget']:g} steps per run (schedule=steps: bit-exact on rerun)")
    diverged = [f"{row['name']} seed {r['seed']}" for row in summary["variants"] for r in row["runs"] if r["diverged"]]
    threads = summary["threads"]
    machine = (f"torch {summary['torch']}, {threads[0]} thread(s)" if len(threads) == 1 else
               f"torch {summary['torch']}; runs made with different thread counts ({', '.join(map(str, threads))}): "
               "not bit-exact against a rerun")
    return "\n\n".join([
        f"`{summary['command']}`\n\n{budget}, seeds {', '.join(map(str, summary['seeds']))}, baseline `{base}`; "
        f"{machine}.",
        "Final val loss (nats/token):\n\n" + metric_table(summary, "val_loss"),
        "Final val bits per byte:\n\n" + metric_table(summary, "val_bpb"),
        "Speed:\n\n" + speed_table(summary),
        f"Δ: variant minus {base}, seed by seed (a seed is the same initialisation and the same batches in every "
        f"variant), mean with its 95% t-interval; p: two-sided paired t-test (scipy.stats.ttest_rel) over the {n} "
        f"seeds. ms/step / {base}'s: the median over rounds of each run's median ms/step (first log interval "
        f"left out: nan for a run that logged one) over {base}'s run of the same round."
        + (f" nan: diverged (non-finite loss): {', '.join(diverged)}." if diverged else "")])


def build_parser() -> CommandLine:
    parser = CommandLine(description=__doc__.split("\n")[0], epilog="Example: " + __doc__.split("\n")[2].strip())
    parser.add_argument("variants", nargs="*", metavar="NAME:KEY=VALUE,...",
                        help="the variants; the first is the baseline; NAME: alone is the preset as it is")
    parser.add_argument("--config", default="small", help="preset name in config/ or a .toml path")
    parser.add_argument("--steps", type=int, help="steps per run (max_iters = lr_decay_iters); with --time, a cap")
    parser.add_argument("--time", type=float, metavar="SECONDS", help="wall-clock seconds per run (schedule=time)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N per variant, run round by round")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="config overrides for every variant (repeatable); a variant's own value wins")
    parser.add_argument("--threads", type=int, default=0, help="every run's threads field (as --set threads=N); 0 "
                        "keeps torch's default. Part of what makes a rerun bit-exact (it orders the float sums)")
    parser.add_argument("--vs", metavar="NAME", help="baseline of each Δ and speed ratio (default: the first variant)")
    parser.add_argument("--out", type=Path,
                        help="experiment folder (default: out/compare/PRESET-Nsteps, or PRESET-Ss with --time)")
    return parser


def command_line(argv: list[str]) -> str:
    """The command as typed, for the line that says how to continue."""
    return shlex.join(["python", "-m", "scripts.compare", *argv])


def compare(argv: list[str], stop: StopOnSignal) -> dict[str, Any]:
    """Plan, run, summarise; returns results.json's content."""
    args = build_parser().parse_args(argv)
    t_test()  # scipy missing: say so now, not after an hour of runs
    use_threads(args.threads)  # before planning: dtype=auto's probe times matmuls with them
    code = code_fingerprint()  # once: the modules this process imported are the code its runs run
    plan = make_plan(args, command_line(argv), code)
    print(f"{len(plan.variants)} variants x {len(plan.seeds)} seeds = {len(plan.runs)} runs in {plan.folder}, "
          f"{torch.get_num_threads()} torch thread(s)", flush=True)
    print(f"code {code['hash']} (commit {code['commit']}): finished runs of other code are trained again", flush=True)
    run_all(plan, stop, code)
    summary = summarise(plan, args.vs)
    text = report(summary)
    atomic_write_text(plan.folder / "results.json", json.dumps(summary, indent=1))
    atomic_write_text(plan.folder / "results.md", text + "\n")
    from scripts import plot  # matplotlib: only once there is something to draw
    plot.plot([r.folder / "metrics.jsonl" for r in plan.runs], plan.folder / "compare.png", bpb=True,
              labels=[r.variant for r in plan.runs], title=f"{len(plan.seeds)} seeds per variant: mean, min-max band")
    print("\n" + text)
    print(f"\nwrote {plan.folder / 'results.md'}, results.json and compare.png")
    return summary


def main(argv: list[str] | None = None) -> None:
    """One line and exit 2 on bad input (nothing run); 130/143 after a signal (the run saved)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        with exit_on_errors():  # bad input (2), a run that stopped (3, 130, 143): its line and code
            compare(argv, StopOnSignal())
    except KeyboardInterrupt:  # between runs, outside train's own handler: finished runs are on disk
        fail(f"interrupted; finished runs are kept; continue with the same command: {command_line(argv)}", 130)


if __name__ == "__main__":
    run_tool(main)
