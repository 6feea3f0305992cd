"""Train a BPE on a corpus's train split and report it, without training a model.

    python -m scripts.tokenizer                                      # the built-in corpus, bpe_vocab_size's default
    python -m scripts.tokenizer --bpe_vocab_size 512 1024 2048 4096  # several sizes, one table
    python -m scripts.tokenizer --data_path my.txt --no-gpt2         # your text; no GPT-2 column (it needs its ranks)

Each vocabulary is prepared (and cached) as train.py prepares it. The table scores every tokenizer on the BPE's val
split (never seen by its merges) against char and GPT-2's, a document corpus's val documents each on its own (their
<|endoftext|> separators are no text); then the largest BPE's longest tokens."""
import sys

if not __package__:  # run as a file, `python scripts/tokenizer.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.tokenizer", file=sys.stderr)
    sys.exit(2)

import time
import timeit
from pathlib import Path

import numpy as np

from cli import CommandLine, exit_on_errors, run_tool
from config import DEFAULTS, FIELD_HELP, TrainConfig, validate
from data import load_corpus
from prepare import SHAKESPEARE_CHAT, is_tokenized_folder
from scripts.prepare import prepare_corpus
from tokenizer import tokenizer_from_meta

LONGEST = 20  # tokens shown from the largest vocabulary
DATA_PATH_HELP = ("the text to compare the tokenizers on: a .txt file, a folder of .txt or .parquet files, a .jsonl or "
                  "a .parquet file (not a folder of tokens: those are one tokenizer's already)")


def prepared_tokenizer(args, kind: str, vocab_size: int = 0):
    """(tokenizer, folder) of the corpus prepared with this tokenizer, as train.py would prepare it."""
    folder = prepare_corpus(args.dataset, args.data_path, kind, args.data_dir, args.val_fraction,
                            text_column=args.text_column, bpe_vocab_size=vocab_size or DEFAULTS["bpe_vocab_size"])
    return tokenizer_from_meta(load_corpus(folder, 1).meta["tokenizer"], Path(args.data_dir)), folder


def val_texts(tok, folder: Path) -> list[str]:
    """The texts of a BPE folder's val split between its <|endoftext|> separators, which char cannot encode: a
    single .txt's is one text (it has none), a document corpus's one per document, as prepare encoded them."""
    eot, ids = tok.eot_token, load_corpus(folder, 1).val
    texts = [tok.decode(part[part != eot].tolist()) for part in np.split(ids, np.flatnonzero(ids == eot))]
    return [text for text in texts if text]  # the first part is empty where a separator leads the split


def report(args) -> str:
    sizes = sorted(set(args.bpe_vocab_size))
    rows, texts = [], None
    for size in sizes:  # the last, and its longest tokens below, is the largest
        t0 = time.perf_counter()
        tok, folder = prepared_tokenizer(args, "bpe", size)
        seconds = time.perf_counter() - t0
        if texts is None:  # every size splits the same characters: one val text for all
            texts = val_texts(tok, folder)
        rows.append((f"bpe {size}", tok, f"ready in {seconds:.1f} s"))  # trained and prepared, or found cached
    rows.insert(0, ("char", prepared_tokenizer(args, "char")[0], "one token per character"))
    if not args.no_gpt2:
        rows.append(("gpt2", prepared_tokenizer(args, "gpt2")[0], "GPT-2's, trained on WebText"))
    n_chars, n_bytes = sum(len(text) for text in texts), sum(len(text.encode("utf-8")) for text in texts)
    documents = f" in {len(texts):,} documents, each encoded on its own" if len(texts) > 1 else ""
    lines = [f"# the val split of the BPE folders: {n_chars:,} characters, {n_bytes:,} UTF-8 bytes{documents}",
             "| tokenizer | vocab | val tokens | bytes/token | tokens vs char | encodes at | note |",
             "|---|---|---|---|---|---|---|"]
    for name, tokenizer, note in rows:
        n = sum(len(tokenizer.encode(text)) for text in texts)
        seconds = sorted(timeit.repeat(lambda: [tokenizer.encode(text) for text in texts], number=1, repeat=3))[1]
        speed = n_bytes / seconds / 1e6  # the median's
        lines.append(f"| {name} | {tokenizer.vocab_size:,} | {n:,} | {n_bytes / n:.3f} | {n / n_chars:.3f} | "
                     f"{speed:.1f} MB/s | {note} |")
    tokens = sorted(range(tok.eot_token), key=lambda i: (-len(tok.decode_bytes([i])), i))[:LONGEST]
    lines.append(f"# the {LONGEST} longest of bpe {sizes[-1]}: "
                 + ", ".join(repr(tok.decode_bytes([i]).decode("utf-8", "replace")) for i in tokens))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bpe_vocab_size", "--bpe-vocab-size", type=int, nargs="+",
                        default=[DEFAULTS["bpe_vocab_size"]], help="one or more vocabulary sizes (257 to 2**32)")
    helps = FIELD_HELP | {"data_path": DATA_PATH_HELP}  # train.py's but data_path's: text only
    for name in ("dataset", "data_path", "text_column", "data_dir", "val_fraction"):  # train.py's, by name and help
        parser.add_argument(*dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"]), default=DEFAULTS[name],
                            type=type(DEFAULTS[name]), help=helps[name])
    parser.add_argument("--no-gpt2", action="store_true", help="leave out GPT-2's column (its ranks: PyPI, once)")
    args = parser.parse_args(argv)
    with exit_on_errors():  # a size or val_fraction that train.py would refuse: its one line, now
        for size in args.bpe_vocab_size:
            validate(TrainConfig(bpe_vocab_size=size, val_fraction=args.val_fraction))
    if args.data_path and is_tokenized_folder(Path(args.data_path)):  # one tokenizer's ids: no text to compare on
        parser.error(f"--data_path {args.data_path} is a folder of tokens (train.bin, val.bin, meta.json); this tool "
                     "compares tokenizers on text: pass the text itself (a .txt, .jsonl or .parquet file, or a folder)")
    if args.dataset == SHAKESPEARE_CHAT and not args.data_path:  # was "unknown dataset", beside its own name
        parser.error(f"--dataset {SHAKESPEARE_CHAT} is conversations; tokenizers are compared on text (--data_path)")
    with exit_on_errors():  # one line and its exit code (cli.py)
        print(report(args))


if __name__ == "__main__":
    run_tool(main)
