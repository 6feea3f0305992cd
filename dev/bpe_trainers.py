"""Seconds to train a BPE with rustbpe (what corpus preparation uses) and with Hugging Face tokenizers.

    python -m dev.bpe_trainers --bpe_vocab_size 1024 4096    # the built-in corpus's train split
    python -m dev.bpe_trainers --data_path my.txt            # your text

Both train on the same text, the train split of the corpus prepared with the smallest size (as train.py
prepares it, cached), each size twice with each library; the table gives both timings and whether the
second run repeated the first's merges. The numbers behind "Why rustbpe" in docs/data.md. Needs the
tokenizers package (transformers, a dev requirement, brings it), imported only here.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

from data import load_corpus
from prepare.tokenizers import train_bpe
from scripts.tokenizer import corpus_parser, parse_corpus_args, prepared_tokenizer, print_table

RUNS = 2  # per trainer and size: the second shows whether the merges repeat


def hf_trainer(pieces: list[str]) -> Callable[[int], str]:
    """Hugging Face tokenizers' byte-level BpeTrainer on ``pieces``: size -> the trained tokenizer as JSON."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    def train(size: int) -> str:
        trained = Tokenizer(models.BPE())
        trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trained.train_from_iterator(iter(pieces), trainers.BpeTrainer(
            vocab_size=size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        return trained.to_str()

    return train


def timed_runs(train: Callable[[int], str], size: int) -> tuple[list[float], bool]:
    """Seconds of each of RUNS trainings at ``size``, and whether every run gave the same result."""
    seconds, results = [], []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        results.append(train(size))
        seconds.append(time.perf_counter() - t0)
    return seconds, all(result == results[0] for result in results)


def compare_trainers(args: argparse.Namespace) -> str:
    """The table: a row per trainer and size."""
    tok, folder = prepared_tokenizer(args, "bpe", min(args.bpe_vocab_size))
    text = tok.decode(load_corpus(folder, 1).train.tolist())
    pieces = text.splitlines(keepends=True)
    trainers = {"rustbpe": lambda size: repr(train_bpe(pieces, size, "train").meta()["ranks"]),
                "tokenizers": hf_trainer(pieces)}
    lines = [f"# training on the train split: {len(text):,} characters",
             "| trainer | vocab | seconds, two runs | same merges |", "|---|---|---|---|"]
    for name, train in trainers.items():
        for size in sorted(set(args.bpe_vocab_size)):
            seconds, same = timed_runs(train, size)
            lines.append(f"| {name} | {size:,} | {', '.join(f'{s:.2f}' for s in seconds)} | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    print_table(compare_trainers, parse_corpus_args(corpus_parser(__doc__.split("\n\n")[0]), argv))


if __name__ == "__main__":
    main()
