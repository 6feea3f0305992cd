"""Prepare a corpus into token files without training: the work train.py does first, cached in data_dir.

    python -m scripts.prepare                          # the built-in Shakespeare corpus (cached in data/)
    python -m scripts.prepare --data_path web.jsonl --tokenizer gpt2 --num_proc 8

Its corpus flags are train.py's (config.CORPUS_OPTIONS), so train.py finds the folder it writes.
"""
from __future__ import annotations

import sys

if not __package__:  # run as a file, `python scripts/prepare.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.prepare", file=sys.stderr)
    sys.exit(2)

import prepare
from config import CORPUS_OPTIONS, CommandLine, add_flags, exit_on_errors, make_config, run_tool


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description="Prepare a corpus into token files.")
    add_flags(parser, CORPUS_OPTIONS)  # --dataset, --data_path, ...: train.py's flags, typed and checked by config
    parser.add_argument("--num_proc", "--num-proc", type=int, default=0,
                        help="tokenizer threads for a folder, .jsonl or .parquet; 0 = one per CPU core")
    parser.add_argument("--block_size", "--block-size", type=int, default=1,
                        help="refuse a corpus whose train or val split is shorter than block_size + 1 tokens")
    given = vars(parser.parse_args(argv))
    num_proc, block_size = given.pop("num_proc"), given.pop("block_size")
    if num_proc < 0 or block_size < 1:
        parser.error(f"need --num_proc >= 0 and --block_size >= 1, got {num_proc} and {block_size}")
    with exit_on_errors():  # one line and its exit code (2, or 74 for a data_dir failing its probe)
        cfg = make_config(None, **given, block_size=block_size)  # config.validate's checks of the corpus fields
        folder = prepare.corpus_folder(cfg, num_proc=num_proc)  # what train.py prepares: conversations as chat
        prepare.open_verified(folder, block_size)  # as train.py opens it: a folder prepared before is checked too
        print(f"ready: {folder} (train.py finds it with the same corpus flags)")  # prepared now or before


if __name__ == "__main__":
    run_tool(main)
