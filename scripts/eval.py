"""Score a checkpoint: val loss (nats/token) and bits per byte, with training's own evaluate().

    python -m scripts.eval --ckpt out/small                        # the val split of the run's own corpus
    python -m scripts.eval --ckpt out/small --data_path other.txt  # any UTF-8 text, all of it
    python -m scripts.eval --ckpt out/small --json                 # one JSON object, full precision
    python -m scripts.eval --init_from gpt2 --data_path other.txt  # pretrained GPT-2 weights, no checkpoint

By default it scores what training scored (the run's corpus and eval_tokens, batch size and precision) with the
same code, so best.pt's best_val_loss comes back exactly (on the device type it was trained on). A --data_path
file is scored whole, in non-overlapping windows of block_size. Bits per byte divide the same nats by the targets'
UTF-8 bytes, so they compare a char model with a BPE model. Benchmarks (HellaSwag, ...): scripts/harness.py.
"""
from __future__ import annotations

import sys

if not __package__:  # run as a file, `python scripts/eval.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.eval", file=sys.stderr)
    sys.exit(2)

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from config import CommandLine, ConfigError, field_help
import data
from data import DataError, corpus_for, val_windows
from prepare.chat import is_chat
from prepare.tokenizers import without_chat
from weights.loading import Loaded, add_weights_flags, from_flags
from training.checkpoint import dtype_name
from training.runtime import choose_runtime
from train import evaluate, val_byte_count
from prepare.texts import read_text_file
from process.errors import TinyGPTError, exit_on

PROGRESS_BATCHES = 20  # show a progress bar from this many batches on (and only in a terminal)
PRETRAINED_BATCH = 8  # windows per forward for pretrained weights, which have no run's batch_size (GPT-2's: 1,024)


def eval_windows(loaded: Loaded, data_path: str, eval_tokens: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(inputs, targets) (N, T) each, and a description: a file's text, or the run's own val split."""
    cfg = loaded.cfg
    if data_path:
        text = read_text_file(Path(data_path))
        try:
            ids = loaded.tokenizer.encode_array(text)
        except DataError as err:  # a char model meets a character it never saw
            raise DataError(f"{data_path}: {err}") from None
        if len(ids) < 2:
            raise DataError(f"{data_path}: {len(ids)} token(s); scoring needs at least 2")
        return *val_windows(ids, cfg.block_size, max(eval_tokens, 0)), data_path
    if loaded.step is None and cfg.tokenizer != "gpt2":  # a char or BPE vocabulary need not be the built-in corpus's
        raise ConfigError(f"{loaded.source} has a char vocabulary: pass the text to score with --data_path")
    corpus = corpus_for(cfg, without_chat(loaded.tokenizer.meta()))  # a chat corpus: in the model's own tokens
    if corpus.meta["tokenizer"] != loaded.tokenizer.meta():  # say, someone else's tokens at the run's data_path
        raise DataError(f"{corpus.folder} holds tokens of another tokenizer than {loaded.source}'s; "
                        "pass the text to score with --data_path")
    limit = cfg.eval_tokens if eval_tokens < 0 else eval_tokens
    x, y = data.eval_windows(corpus, loaded.tokenizer, cfg.block_size, limit, cfg.chat_overflow)
    scored = " (the assistant's tokens)" if is_chat(corpus) else f" (eval_tokens {limit:,})" if limit else ""
    return x, y, f"the val split of {corpus.folder}{scored}"


def target_chars(y: torch.Tensor, tokenizer) -> int:
    """Characters the scored targets decode to; <|endoftext|> counts none, as it counts 0 bytes."""
    targets = [t for t in y[y >= 0].tolist() if t not in tokenizer.special_ids]
    return len(tokenizer.decode_bytes(targets).decode("utf-8", errors="replace"))


def score(loaded: Loaded, x: torch.Tensor, y: torch.Tensor, data: str, batch_size: int, dtype: torch.dtype,
          device: torch.device) -> dict:
    """Evaluate exactly as train.py does, plus the counts a reader needs to trust the numbers: val_loss in nats per
    target token, val_bpb in bits per UTF-8 byte of the targets, the tokens scored, the bytes and characters they
    decode to (document separators count none). The report, in the order --json prints it."""
    n_bytes, chars = val_byte_count(y, loaded.tokenizer, device), target_chars(y, loaded.tokenizer)
    progress = sys.stderr.isatty() and -(-len(x) // batch_size) >= PROGRESS_BATCHES
    result = evaluate(loaded.model, x, y, batch_size, device, dtype, n_bytes, progress)
    return {"checkpoint": loaded.source, "step": loaded.step, "data": data, "val_loss": result.loss,
            "val_bpb": result.bpb, "tokens": result.tokens, "bytes": n_bytes, "chars": chars, "batch_size": batch_size,
            "dtype": dtype_name(dtype), "device": str(device)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    add_weights_flags(parser)
    parser.add_argument("--data_path", "--data-path", default="",
                        help="UTF-8 text file to score whole (default: the run's own val split)")
    parser.add_argument("--eval_tokens", "--eval-tokens", type=int, default=-1,
                        help="targets to score; -1 = as training did for its val split, all of a --data_path file")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=0,
                        help="windows per forward pass; 0 = the run's batch_size (the one that reproduces its numbers)")
    parser.add_argument("--device", default="auto", help=field_help()["device"])
    parser.add_argument("--threads", type=int, default=0, help=field_help()["threads"])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    for flag, value, least in (("--batch_size", args.batch_size, 0), ("--threads", args.threads, 0),
                               ("--eval_tokens", args.eval_tokens, -1)):  # -1: as training did
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        loaded = from_flags(args)  # on the CPU until the runtime is chosen
        # train.py's choice for the run's config with this --device and --threads, in the run's precision. Eager:
        # one pass over val would not repay a compile.
        rt = choose_runtime(replace(loaded.cfg, device=args.device, threads=args.threads, dtype=loaded.precision))
        loaded.model.to(rt.device)
        x, y, data = eval_windows(loaded, args.data_path, args.eval_tokens)
    except TinyGPTError as err:  # one line and its exit code (process/errors.py)
        exit_on(err)
    batch_size = args.batch_size or (loaded.cfg.batch_size if loaded.step is not None else PRETRAINED_BATCH)
    report = score(loaded, x, y, data, batch_size, rt.dtype, rt.device)
    if args.json:
        print(json.dumps(report))
        return
    logged = "" if args.data_path or args.init_from else f", logged best val loss {loaded.best_val_loss:.6f}"
    origin = f"step {report['step']}{logged}" if report["step"] is not None else "pretrained weights"
    print(f"# {report['checkpoint']} ({origin}) on {data}")
    print(f"val loss {report['val_loss']:.6f} nats/token | {report['val_bpb']:.6f} bits/byte | {report['tokens']:,} "
          f"tokens, {report['bytes']:,} bytes, {report['chars']:,} chars | batch {batch_size}, {report['dtype']}, "
          f"{rt.device}")


if __name__ == "__main__":
    main()
