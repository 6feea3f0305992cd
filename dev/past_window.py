"""What llama.cpp writes past a run's window, measured on its GGUF export. From the repo root:

    python -m dev.past_window out/small        # needs gguf and llama-cpp-python (requirements-llama.txt)

Exports the run (f32) to a temporary file, asks llama.cpp for the logits of 100 val windows of 4 x block_size tokens
(one full context each, from position 0), and prints the mean cross-entropy of each block_size-long stretch: the
first is the window the model was trained on, the others run on the export's repeated position rows
(weights/gguf.py). Then how often sampling ends at a char export's <|endoftext|> (logit 0) inside the window: 200
completions of block_size - 1 tokens after a newline, at llama.cpp's default sampling and at temperature 1 unfiltered.
"""
from __future__ import annotations

import sys

if not __package__:  # run as a file, `python dev/past_window.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m dev.past_window", file=sys.stderr)
    sys.exit(2)

import tempfile
from pathlib import Path

import numpy as np

from config import CommandLine
from data import corpus_for
from process.errors import TinyGPTError, exit_on
from weights.gguf import export_gguf
from weights.loading import find_checkpoint, from_checkpoint


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per-position nats (T,) of targets (T,) under logits (T, V); columns past the model's vocabulary are kept."""
    shifted = logits - logits.max(axis=1, keepdims=True)  # (T, V)
    log_z = np.log(np.exp(shifted).sum(axis=1))  # (T,)
    return log_z - shifted[np.arange(len(targets)), targets]


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a run folder or checkpoint")
    parser.add_argument("--windows", type=int, default=100, help="val windows of 4 x block_size tokens")
    args = parser.parse_args(argv)
    from llama_cpp import Llama

    try:
        loaded = from_checkpoint(find_checkpoint(args.run))
        val = np.asarray(corpus_for(loaded.cfg).val)
    except TinyGPTError as err:  # no such run, a damaged checkpoint or corpus: one line and its exit code
        exit_on(err)
    T, vocab = loaded.model.config.block_size, loaded.tokenizer.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.gguf"
        export_gguf(loaded.model, loaded.tokenizer, path)
        llm = Llama(str(path), n_ctx=4 * T, n_threads=1, logits_all=True, verbose=False, seed=0)
        starts = np.random.default_rng(0).integers(0, len(val) - 4 * T - 1, args.windows)
        nats = []
        for start in starts:
            ids = val[start: start + 4 * T + 1].astype(np.int64)
            llm.reset()
            llm.eval(ids[:-1].tolist())
            nats.append(cross_entropy(np.asarray(llm.scores[: 4 * T]), ids[1:]))
        by_stretch = np.stack(nats).reshape(args.windows, 4, T).mean(axis=(0, 2))  # (4,)
        print(f"{args.run}: block_size {T}; llama.cpp's cross-entropy by position, {args.windows} val windows:")
        print("  " + " | ".join(f"[{k * T}, {(k + 1) * T}): {value:.3f}" for k, value in enumerate(by_stretch)))
        if llm.n_vocab() > vocab:  # a char export: its own end token, logit 0
            unfiltered = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
            for name, sampling in {"llama.cpp's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05)": {},
                                   "temperature 1, no filter": unfiltered}.items():
                ends = tokens = 0
                for seed in range(200):
                    answer = llm.create_completion("\n", max_tokens=T - 1, seed=seed, **sampling)
                    ends += answer["choices"][0]["finish_reason"] == "stop"
                    tokens += answer["usage"]["completion_tokens"]
                print(f"  {name}: {ends} of 200 completions ended at <|endoftext|> ({ends / tokens:.1e} a token)")


if __name__ == "__main__":
    main()
