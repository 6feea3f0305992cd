"""Loss curves: one or more runs' metrics.jsonl -> a PNG of train and val loss against step and wall time.

    python -m scripts.plot out/small/metrics.jsonl -o out/small/loss.png
    python -m scripts.plot out/small/metrics.jsonl --ref 70:1.87 --ref 200:1.62 --ref-label nanoGPT
    python -m scripts.plot out/compare/tiny-200steps --bpb -o cmp.png  # + val bits per byte; a variant's seeds: a band
    python -m scripts.plot out/a/seed-1 out/a/seed-2 out/b/seed-1 out/b/seed-2 --labels a a b b

Runs with one label are one group: their mean with a min-max band, each final an x."""
import sys

if not __package__:  # run as a file, `python scripts/plot.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.plot", file=sys.stderr)
    sys.exit(2)

import argparse
import json
import math
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from cli import CommandLine, DataError, exit_on_errors, run_tool
from runtime import check_writable, one_line, written_whole

matplotlib.use("Agg")  # files only, no display needed; pyplot settles its backend at the first figure, not at import
# Each image carries this in its metadata (under the key its format keeps it in): one plot.py may replace.
MARK, MARK_KEYS = "tinygpt scripts.plot", {"png": "Software", "pdf": "Creator", "svg": "Creator"}


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train records, val records) of one metrics.jsonl; of a resumed run's repeats the last."""
    train, val = {}, {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a metrics.jsonl (not UTF-8 text); pass a run folder or metrics.jsonl") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise DataError(f"{path}:{number}: not a train.py metrics record (a JSON object with a \"step\")")
        values = {k: record.get(k, 0) for k in ("loss", "val_loss", "val_bpb", "time_s")}
        if bad := [k for k, v in values.items() if type(v) not in (int, float)]:
            raise DataError(f"{path}:{number}: {bad[0]} is {json.dumps(record[bad[0]])}, not a number; fix the line")
        if any(isinstance(v, float) and not math.isfinite(v) for v in values.values()):
            continue  # a diverged eval (train.py logs its NaN): not drawn; matplotlib would fail on it
        kind = val if "val_loss" in record else train if "loss" in record else {}  # anything else is not drawn
        kind[record["step"]] = record
    return sorted(train.values(), key=lambda r: r["step"]), sorted(val.values(), key=lambda r: r["step"])


def expand(arg: Path) -> list[tuple[Path, str]]:
    """(metrics file, default label) of each run an argument names: a metrics file (labelled by its run's folder, or
    VARIANT/seed-N), a run folder, or compare.py's experiment folder (every VARIANT/seed-N run, labelled VARIANT)."""
    metrics = arg if arg.is_file() else arg / "metrics.jsonl"
    run = metrics.parent
    if metrics.is_file() and metrics.name != "metrics.jsonl":
        return [(metrics, metrics.stem)]
    if metrics.is_file():
        return [(metrics, f"{run.parent.name}/{run.name}" if seed_number(metrics) else (run.name or str(metrics)))]
    results = arg / "results.json"  # compare.py's summary: its variant order puts the baseline first
    try:
        order = [v["name"] for v in json.loads(results.read_text())["variants"]] if results.is_file() else None
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{results}: not compare.py's results.json (its variants); move it away") from None
    runs = [(p, p.parent.parent.name) for p in arg.glob("*/seed-*/metrics.jsonl")]
    return sorted(((p, variant) for p, variant in runs if order is None or variant in order),
                  key=lambda run: (order.index(run[1]) if order else run[1], seed_number(run[0])))


def seed_number(metrics: Path) -> int:
    """N for the metrics of a run folder named seed-N (compare.py's layout), else 0."""
    name = metrics.parent.name
    return int(name[5:]) if name.startswith("seed-") and name[5:].isdigit() else 0


def group_runs(paths: list[Path], labels: list[str]) -> list[tuple[str, list[list[dict]], list[list[dict]]]]:
    """(label, each run's train records, each run's val records); runs sharing a label form one group."""
    groups: dict[str, list[tuple[list[dict], list[dict]]]] = {}
    for path, label in zip(paths, labels):
        groups.setdefault(label, []).append(read_metrics(path))
    return [(label, [t for t, _ in runs], [v for _, v in runs]) for label, runs in groups.items()]


def aggregate(runs: list[list[dict]], x_key: str, y_key: str) -> tuple[list[float], ...]:
    """(x, mean, min, max) of y over the runs at the steps every run logged; x is the runs' mean x_key."""
    by_step = [{r["step"]: r for r in run if y_key in r} for run in runs]
    rows = [[s[step] for s in by_step] for step in sorted(set.intersection(*map(set, by_step)))]
    xs = [sum(r[x_key] for r in row) / len(row) for row in rows]
    ys = [[r[y_key] for r in row] for row in rows]
    return xs, [sum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def draw_group(ax, label: str, color: str, train: list[list[dict]], val: list[list[dict]], x_key: str, y_key: str):
    """One run as a line; several as their mean, a min-max band/bars and each final point."""
    several = len(val) > 1
    if train:
        xs, mean, low, high = aggregate(train, x_key, "loss")
        ax.plot(xs, mean, color=color, alpha=0.45, linewidth=1, label=f"{label} train")
        if several:
            ax.fill_between(xs, low, high, color=color, alpha=0.15, linewidth=0)
    xs, mean, low, high = aggregate(val, x_key, y_key)
    name = f"{label} val" + (f" (mean of {len(val)}, min-max)" if several else "")
    bars = [[m - lo for m, lo in zip(mean, low)], [hi - m for m, hi in zip(mean, high)]] if several else None
    ax.errorbar(xs, mean, yerr=bars, color=color, marker="o", markersize=4, linewidth=1.8, capsize=3, label=name)
    finals = [run[-1] for run in val if run and y_key in run[-1]]
    if several:  # each run's last eval, also where the runs stopped at different steps (schedule=time)
        ax.plot([r[x_key] for r in finals], [r[y_key] for r in finals], "x", color=color, markersize=5)
    if xs:  # the final (mean) value, written beside its point
        ax.annotate(f"{mean[-1]:.3f}", (xs[-1], mean[-1]), textcoords="offset points", xytext=(4, 6), fontsize=8,
                    color=color)


def plot(paths: list[Path], out: Path, labels: list[str], refs: list[tuple[float, float]] = (),
         ref_label: str = "reference", title: str = "", bpb: bool = False) -> Path:
    """Write a PNG (loss vs step and wall time; ``bpb``: val bits per byte vs step); the runs of a label are a group."""
    groups = group_runs(paths, labels)
    if not any(run for _, train, val in groups for run in (*train, *val)):  # else an empty figure, said written
        raise DataError(f"no train or val records in {', '.join(map(str, paths))}: nothing to draw")
    panels = [("step", "val_loss", "loss (nats/token)"), ("time_s", "val_loss", "")]  # (x, y, y label)
    panels += [("step", "val_bpb", "val bits per byte")] if bpb else []
    fig, axes = plt.subplots(1, len(panels), figsize=(16 if bpb else 11, 4))
    ax_step, ax_time = axes[0], axes[1]
    ax_time.sharey(ax_step)
    for ax, (x_key, y_key, y_label) in zip(axes, panels):
        for i, (label, train, val) in enumerate(groups):
            draw_group(ax, label, f"C{i}", train if y_key == "val_loss" else [], val, x_key, y_key)
        ax.set(xlabel="wall time (s)" if x_key == "time_s" else "step", ylabel=y_label)
        ax.grid(alpha=0.3)
    if refs:
        ax_time.plot([t for t, _ in refs], [v for _, v in refs], "k^", markersize=6, label=f"{ref_label} val")
    ax_time.legend(fontsize=8)
    losses = [r["loss"] for _, train, _ in groups for run in train for r in run]
    losses += [r["val_loss"] for _, _, val in groups for run in val for r in run]
    if losses:  # zoom on the interesting range: the first losses (~4.4) would flatten the rest
        low = min(losses + [v for _, v in refs])
        finals = [run[-1]["val_loss"] for _, _, val in groups for run in val if run]  # every run's end stays in view
        ax_step.set_ylim(low - 0.05, max([2.6, low + 1.0] + [v + 0.05 for v in finals]))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(out) as tmp:  # a full disk leaves the old image, not half of a new one
        kind = out.suffix.lstrip(".").lower()  # tmp's name ends in another suffix
        fig.savefig(tmp, dpi=90, format=kind, metadata={MARK_KEYS[kind]: MARK})
    plt.close(fig)
    return out


def parse_ref(text: str) -> tuple[float, float]:
    try:
        seconds, loss = text.split(":")
        return float(seconds), float(loss)
    except ValueError:  # no colon, two, or no numbers: argparse would say only "invalid parse_ref value"
        raise argparse.ArgumentTypeError(f"--ref {text!r} must look like SECONDS:LOSS, e.g. 200:1.62") from None


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path,
                        help="metrics.jsonl files, run folders or compare.py experiment folders")
    parser.add_argument("-o", "--out", type=Path, default=Path("loss.png"), help="PNG to write")
    parser.add_argument("--labels", nargs="+", help="one legend label per argument (default: run folder, or "
                        "variant); equal labels are one group")
    parser.add_argument("--ref", action="append", type=parse_ref, default=[], metavar="SECONDS:LOSS",
                        help="a reference val-loss point on the wall-time panel (repeatable)")
    parser.add_argument("--ref-label", default="reference", help="legend label of the --ref points")
    parser.add_argument("--title", default="", help="figure title")
    parser.add_argument("--bpb", action="store_true", help="add a panel of val bits per byte against step")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.metrics):
        parser.error(f"{len(args.labels)} --labels for {len(args.metrics)} arguments; give one per argument")
    with exit_on_errors():  # a results.json or metrics file in the way, an -o to change: one line, its exit code
        runs = []
        for i, arg in enumerate(args.metrics):
            if not (found := expand(arg)):
                parser.error(f"{arg}: no such file, and no metrics.jsonl in it or in its */seed-*/ folders")
            runs += [(path, args.labels[i] if args.labels else label) for path, label in found]
        paths, labels = zip(*runs)
        if (kind := args.out.suffix.lower().lstrip(".")) not in MARK_KEYS:  # else refused after the work
            reason = f".{kind} is no image format plot.py writes" if kind else "no extension to name the image format"
            parser.error(f"-o {args.out}: {reason}; pass a name ending in .png (or .pdf, .svg)")
        if args.out.exists() and (not args.out.is_file() or MARK.encode() not in args.out.read_bytes()):
            parser.error(f"-o {args.out}: exists, and plot.py did not write it; pass another -o, or move it away")
        with one_line(args.out, "-o"):  # a failed write (a full disk) leaves the old image, if any, as it was
            check_writable(args.out.parent, "-o", ".plot-probe")  # before the work, not after it
            print(f"wrote {plot(paths, args.out, labels, args.ref, args.ref_label, args.title, args.bpb)}")

if __name__ == "__main__":
    run_tool(main)
