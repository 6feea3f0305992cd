"""Loss curves: one or more runs' metrics.jsonl -> a PNG of train and val loss against step and wall time.

    python scripts/plot.py out/small/metrics.jsonl -o docs/small.png
    python scripts/plot.py out/a/metrics.jsonl out/b/metrics.jsonl --labels fp32 bf16 -o cmp.png
    python scripts/plot.py out/small/metrics.jsonl --ref 70:1.87 --ref 200:1.62 --ref-label nanoGPT
    python scripts/plot.py out/char/metrics.jsonl out/bpe/metrics.jsonl --bpb -o cmp.png   # + val bits per byte

Train loss comes from the log records (``loss``), val loss from the eval records (``val_loss``);
``time_s`` is train.py's wall clock since the first step. ``--ref`` adds fixed (seconds, val loss)
points, e.g. another project's published numbers, to the wall-time panel. ``--bpb`` adds a third
panel, val bits per byte (``val_bpb``) against step: the one that compares runs with different tokenizers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from config import CommandLine  # noqa: E402


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train records, val records) of one metrics.jsonl; a resumed run's repeats keep the last."""
    train, val = {}, {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "val_loss" in record:
            val[record["step"]] = record
        elif "loss" in record:
            train[record["step"]] = record
    return sorted(train.values(), key=lambda r: r["step"]), sorted(val.values(), key=lambda r: r["step"])


def plot(paths: list[Path], out: Path, labels: list[str] | None = None,
         refs: list[tuple[float, float]] = (), ref_label: str = "reference", title: str = "",
         bpb: bool = False) -> Path:
    """Write a PNG (loss vs step, loss vs wall time, and with ``bpb`` val bits per byte vs step); return its path."""
    labels = labels or [p.parent.name or str(p) for p in paths]
    if len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} files")
    fig, axes = plt.subplots(1, 3 if bpb else 2, figsize=(16 if bpb else 11, 4))
    ax_step, ax_time = axes[0], axes[1]
    ax_time.sharey(ax_step)
    for i, (path, label) in enumerate(zip(paths, labels)):
        train, val = read_metrics(path)
        color = f"C{i}"
        for ax, key in ((ax_step, "step"), (ax_time, "time_s")):
            ax.plot([r[key] for r in train], [r["loss"] for r in train], color=color, alpha=0.45,
                    linewidth=1, label=f"{label} train")
            ax.plot([r[key] for r in val], [r["val_loss"] for r in val], color=color, marker="o",
                    markersize=4, linewidth=1.8, label=f"{label} val")
            if val:  # the final val loss, written beside its point
                ax.annotate(f"{val[-1]['val_loss']:.3f}", (val[-1][key], val[-1]["val_loss"]),
                            textcoords="offset points", xytext=(4, 6), fontsize=8, color=color)
    if bpb:
        plot_bpb(axes[2], paths, labels)
    if refs:
        ax_time.plot([t for t, _ in refs], [v for _, v in refs], "k^", markersize=6, label=f"{ref_label} val")
    ax_step.set_xlabel("step")
    ax_time.set_xlabel("wall time (s)")
    ax_step.set_ylabel("loss (nats/token)")
    for ax in (ax_step, ax_time):
        ax.grid(alpha=0.3)
    ax_time.legend(fontsize=8)
    runs = [read_metrics(p) for p in paths]
    losses = [r["loss"] for train, _ in runs for r in train] + [r["val_loss"] for _, val in runs for r in val]
    if losses:  # zoom on the interesting range: the first losses (~4.4) would flatten the rest
        low = min(losses + [v for _, v in refs])
        ax_step.set_ylim(low - 0.05, max(2.6, low + 1.0))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot_bpb(ax, paths: list[Path], labels: list[str]) -> None:
    """Val bits per byte against step; runs logged before val_bpb existed have no points."""
    for i, (path, label) in enumerate(zip(paths, labels)):
        val = [r for r in read_metrics(path)[1] if "val_bpb" in r]
        ax.plot([r["step"] for r in val], [r["val_bpb"] for r in val], color=f"C{i}", marker="o", markersize=4,
                linewidth=1.8, label=f"{label} val")
        if val:
            ax.annotate(f"{val[-1]['val_bpb']:.3f}", (val[-1]["step"], val[-1]["val_bpb"]),
                        textcoords="offset points", xytext=(4, 6), fontsize=8, color=f"C{i}")
    ax.set_xlabel("step")
    ax.set_ylabel("val bits per byte")
    ax.grid(alpha=0.3)


def parse_ref(text: str) -> tuple[float, float]:
    seconds, sep, loss = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--ref {text!r} must look like SECONDS:LOSS, e.g. 200:1.62")
    return float(seconds), float(loss)


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl files written by train.py")
    parser.add_argument("-o", "--out", type=Path, default=Path("loss.png"), help="PNG to write")
    parser.add_argument("--labels", nargs="+", default=None, help="one legend label per file (default: folder)")
    parser.add_argument("--ref", action="append", type=parse_ref, default=[], metavar="SECONDS:LOSS",
                        help="a reference val-loss point on the wall-time panel (repeatable)")
    parser.add_argument("--ref-label", default="reference", help="legend label of the --ref points")
    parser.add_argument("--title", default="", help="figure title")
    parser.add_argument("--bpb", action="store_true", help="add a panel of val bits per byte against step")
    args = parser.parse_args(argv)
    for path in args.metrics:
        if not path.is_file():
            parser.error(f"{path}: no such file")
    print(f"wrote {plot(args.metrics, args.out, args.labels, args.ref, args.ref_label, args.title, args.bpb)}")


if __name__ == "__main__":
    main()
