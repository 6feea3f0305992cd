"""Score a checkpoint: val loss (nats/token) and bits per byte, with training's own evaluate().

    python -m scripts.eval --ckpt out/small                        # the val split of the run's own corpus
    python -m scripts.eval --ckpt out/small --data_path other.txt  # any UTF-8 text, all of it
    python -m scripts.eval --ckpt out/small --data_path data/F     # a prepared folder's val split
    python -m scripts.eval --ckpt out/gpt2 --data_path other.txt   # GPT-2's weights (python -m scripts.import_hf)

By default it scores what training scored (val split, eval_tokens, batch size, precision; LoRA unmerged), so best.pt's
best_val_loss comes back exactly. The split is found by the fingerprint the checkpoint records; a changed text whose
split is gone is refused, never scored in its place."""
import sys

if not __package__:  # run as a file, `python scripts/eval.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.eval", file=sys.stderr)
    sys.exit(2)

import contextlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch

import data
from checkpoint import Loaded, add_weights_flags, from_flags
from cli import CommandLine, ConfigError, DataError, exit_on_errors, run_tool
from config import FIELD_HELP
from data import Corpus, corpus_for, is_chat, load_corpus, val_windows
from prepare import is_document_corpus, is_tokenized_folder, read_meta, read_text_file, source_fingerprint
from runtime import STAGING, choose_runtime, dtype_name
from tokenizer import data_home, without_chat
from train import evaluate, val_byte_count

PROGRESS_BATCHES = 20  # show a progress bar (on stderr) from this many batches on


def prepared_splits(data_dir: str | Path, val_fingerprint: str, tokenizer: dict) -> list[Path]:
    """The prepared folders in data_dir whose val split has this fingerprint and tokenizer: a run's own, by content."""
    found = []
    for folder in sorted(path.parent for path in data_home(data_dir).glob("*/meta.json")):
        try:
            meta = read_meta(folder)
        except (DataError, OSError):  # no corpus of ours, or one half made
            continue
        if not folder.name.startswith(STAGING) and meta["fingerprint"].get("val") == val_fingerprint \
                and meta["tokenizer"] == tokenizer:
            found.append(folder)
    return found


def eval_windows(loaded: Loaded, data_path: str, eval_tokens: int) -> tuple[torch.Tensor, torch.Tensor, str, bool]:
    """(inputs, targets) (N, T) each, a description, and whether they are the run's own val split."""
    cfg = loaded.cfg
    if data_path:
        path = Path(data_path)
        if is_tokenized_folder(path):  # train.bin, val.bin, meta.json: its val split, as training scores one
            return split_windows(loaded, load_corpus(path, cfg.block_size), eval_tokens)
        if path.exists() and is_document_corpus(path):  # train.py's documents (a folder, .jsonl, .parquet)
            raise DataError(f"{path} holds documents or conversations: eval scores a text file or a prepared folder's "
                            "val split; leave out --data_path to score the run's own, or join their text into one file")
        text = read_text_file(path)
        try:
            ids = loaded.tokenizer.encode_array(text)
        except DataError as err:  # a char model meets a character it never saw
            raise DataError(f"{data_path}: {err}") from None
        if len(ids) < 2:
            raise DataError(f"{data_path}: {len(ids)} token(s); scoring needs at least 2")
        return *val_windows(ids, cfg.block_size, max(eval_tokens, 0)), data_path, False
    if loaded.corpus is None and cfg.tokenizer != "gpt2":  # a char or BPE vocabulary need not be the built-in corpus's
        raise ConfigError(f"{loaded.source} holds imported weights of their own {cfg.tokenizer} vocabulary: pass "
                          "the text to score with --data_path")
    return split_windows(loaded, run_corpus(loaded), eval_tokens)


def split_windows(loaded: Loaded, corpus: Corpus, eval_tokens: int) -> tuple[torch.Tensor, torch.Tensor, str, bool]:
    """A prepared corpus's val windows, as training makes them (eval_tokens -1: the run's)."""
    cfg = loaded.cfg
    if corpus.meta["tokenizer"] != loaded.tokenizer.meta():  # say, someone else's tokens at the run's data_path
        raise DataError(f"{corpus.folder} holds tokens of another tokenizer than {loaded.source}'s; "
                        "pass the text to score with --data_path")
    limit = cfg.eval_tokens if eval_tokens < 0 else eval_tokens
    x, y = data.eval_windows(corpus, loaded.tokenizer, cfg.block_size, limit, cfg.chat_overflow)
    terms = ["the assistant's tokens"] * is_chat(corpus) + [f"eval_tokens {limit:,}"] * bool(limit)
    runs = loaded.corpus is not None and corpus.fingerprint["val"] == loaded.corpus["fingerprint"]["val"]
    return x, y, f"the val split of {corpus.folder}" + (f" ({', '.join(terms)})" if terms else ""), runs


def run_corpus(loaded: Loaded) -> Corpus:
    """The corpus whose val split the run scored: the folder in data_dir with its recorded val fingerprint, else its
    source prepared again if its val split is the same. A changed source is refused, its folder removed again."""
    cfg, saved = loaded.cfg, loaded.corpus
    base = without_chat(loaded.tokenizer.meta())  # a chat corpus: in the model's own tokens
    if saved is None:  # imported weights (GPT-2's): the built-in corpus in their tokens
        return corpus_for(cfg, base)
    then, data_dir = saved["fingerprint"]["val"], data_home(cfg.data_dir)
    source = Path(cfg.data_path) if cfg.data_path else None
    gone = source is not None and not source.exists()
    if found := prepared_splits(data_dir, then, loaded.tokenizer.meta()):
        named = source is not None and not gone and not is_tokenized_folder(source)  # its hash in the folder's name
        now = source_fingerprint(source, cfg.text_column)[:12] if named else ""
        own = next((folder for folder in found if f"-{now}-" in folder.name), found[0])
        if gone:
            print(f"note: {source} is gone; scoring the run's own split, still in {own}", file=sys.stderr)
        elif named and f"-{now}-" not in own.name:  # the name holds the source's hash then: "corpus8-39cecdaf1540-"
            old = own.name.removeprefix(f"{source.name if source.is_dir() else source.stem}-")[:12]
            print(f"note: {source} changed since {loaded.source} was trained (fingerprint {old} then, {now} now): "
                  f"scoring the run's own split, still in {own}{rescore_hint(source)}", file=sys.stderr)
        return load_corpus(own, cfg.block_size)
    if gone:
        raise DataError(f"{source}, which {loaded.source} was trained on, is gone, and its prepared split (val "
                        f"fingerprint {then[:12]}) is not in {data_dir}; pass --data_path with a text file to score "
                        "(all of it) or a prepared folder (train.bin, val.bin and meta.json) for its val split")
    before = {path.name for path in data_dir.iterdir()} if data_dir.is_dir() else set()
    corpus = corpus_for(cfg, base)
    if corpus.fingerprint["val"] != then:
        made = corpus.folder.name not in before and corpus.folder.parent.resolve() == data_dir.resolve()
        if made:  # only to compare: no new folder per try
            shutil.rmtree(corpus.folder, ignore_errors=True)
        raise DataError(f"{source or 'the built-in ' + cfg.dataset} changed since {loaded.source} was trained: its "
                        f"val split's fingerprint is {corpus.fingerprint['val'][:12]} now"
                        f"{' (prepared to compare, removed again)' if made else ''}, {then[:12]} then, and the run's "
                        f"own split is no longer in {data_dir}{rescore_hint(source) if source else ''}")
    return corpus


def rescore_hint(source: Path) -> str:
    if is_tokenized_folder(source):
        return f"; pass --data_path {source} to score its val split as it is now"
    if is_document_corpus(source):  # eval takes no folder of documents, and a .jsonl is no text to score
        return ""
    return f"; pass --data_path {source} to score the text as it is now (all of it)"


def target_chars(y: torch.Tensor, tokenizer) -> int:
    """Characters the scored targets decode to; <|endoftext|> counts none, as it counts 0 bytes."""
    targets = [t for t in y[y >= 0].tolist() if t not in tokenizer.special_ids]
    return len(tokenizer.decode_bytes(targets).decode("utf-8", errors="replace"))


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    add_weights_flags(parser)
    parser.add_argument("--data_path", "--data-path", default="",
                        help="UTF-8 text file to score whole, or a prepared folder (train.bin, val.bin and "
                             "meta.json) whose val split to score (default: the run's own val split)")
    parser.add_argument("--eval_tokens", "--eval-tokens", type=int, default=-1,
                        help="targets to score; -1 = as training did for its val split, all of a --data_path file")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=0,
                        help="windows per forward pass; 0 = the run's batch_size (the one that reproduces its numbers)")
    parser.add_argument("--device", default="auto", help=FIELD_HELP["device"])
    parser.add_argument("--threads", type=int, default=0, help=FIELD_HELP["threads"])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    for flag, value, least in (("--batch_size", args.batch_size, 0), ("--threads", args.threads, 0),
                               ("--eval_tokens", args.eval_tokens, -1)):  # -1: as training did
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    with exit_on_errors(), contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):  # --json: JSON alone
        # LoRA unmerged, as training evaluated it: merged weights round, and the logged number would not come back.
        loaded = from_flags(args, merged=False)
        # train.py's choice for the run's config, in the run's precision; eager: one pass would not repay a compile.
        rt = choose_runtime(replace(loaded.cfg, device=args.device, threads=args.threads, dtype=loaded.precision))
        loaded.model.to(rt.device)
        x, y, data, runs = eval_windows(loaded, args.data_path, args.eval_tokens)
    batch_size = args.batch_size or loaded.cfg.batch_size
    if not args.json:  # what is scored, before the scoring (minutes for a large split, with its bar on stderr)
        logged = f", logged best val loss {loaded.best_val_loss:.6f}" if runs else ""
        origin = f"step {loaded.step}{logged}" if loaded.corpus is not None else "imported weights"
        print(f"# {loaded.source} ({origin}) on {data}", flush=True)
    n_bytes, chars = val_byte_count(y, loaded.tokenizer, rt.device), target_chars(y, loaded.tokenizer)
    progress = -(-len(x) // batch_size) >= PROGRESS_BATCHES  # a terminal or a log: someone waits for it
    result = evaluate(loaded.model, x, y, batch_size, rt.device, rt.dtype, n_bytes, progress)  # as train.py does
    report = {"checkpoint": loaded.source, "step": loaded.step, "data": data, "val_loss": result.loss,
              "val_bpb": result.bpb, "tokens": result.tokens, "bytes": n_bytes, "chars": chars,
              "batch_size": batch_size, "dtype": dtype_name(rt.dtype), "device": str(rt.device)}
    print(json.dumps(report) if args.json else f"val loss {report['val_loss']:.6f} nats/token | "
          f"{report['val_bpb']:.6f} bits/byte | {report['tokens']:,} tokens, {report['bytes']:,} bytes, "
          f"{report['chars']:,} chars | batch {batch_size}, {report['dtype']}, {rt.device}")


if __name__ == "__main__":
    run_tool(main)
