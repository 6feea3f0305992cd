"""Tokens per second of sample.py's generator with and without the KV cache, and a check that both
give the same greedy text.

    python -m dev.bench_sample                      # block_size 256, 1000 new tokens, CPU, fp32
    python -m dev.bench_sample --block-size 64      # the speed-up at another context length
    python -m dev.bench_sample --ckpt out/small     # a trained checkpoint (file or run folder) instead

The default model is the width and depth of the `small` preset of before (n_layer 4, n_head 4, n_embd 128, char vocab 65)
with block_size 256, randomly initialised: speed does not depend on the weights. Each path runs once
to warm up, then --repeats times, alternating, and the median is reported. Exits 1 if the greedy
tokens differ or the speed-up is below the goal, so a regression fails loudly.

The goal fits the context measured. Without the cache each new token costs a forward over the whole
window (``sample.window_start``: between block_size / 2 and block_size tokens); with it, a forward over
one position that also reads the cache, so a bare one-position forward (timed too, alternating with
the others) is as fast as a cache can get. Their ratio is the most the cache can gain here: large for
a long context, little for a short or narrow one, where the fixed cost of a forward call dominates
(docs/sampling.md has the measured table). The goal asks for a quarter of that gain,
1 + (possible - 1) / 4: a working cache got about half of it or more, a broken one (recomputing the
window) none. Where the possible gain is below MIN_POSSIBLE the speed is reported but not judged:
there is nothing to detect.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable

import torch

from config import CommandLine, field_help, make_config, model_config
from model import GPT
from weights.loading import find_checkpoint, from_checkpoint
from sample import generate, window_start
from process.errors import TinyGPTError, exit_on

SHARE_OF_POSSIBLE = 0.25  # of the possible gain, the default goal; a working cache got 0.5-0.75 (docs/sampling.md)
MIN_POSSIBLE = 1.5  # below this possible speed-up the cache cannot matter, and the speed is not judged
PATHS = ("no cache", "KV cache", "bare 1-position forward")


def time_generate(model: GPT, prompt: torch.Tensor, tokens: int, use_cache: bool) -> tuple[float, torch.Tensor]:
    """Seconds for one greedy generation of `tokens` new tokens, and the tokens."""
    start = time.perf_counter()
    out = generate(model, prompt, tokens, temperature=0, use_cache=use_cache)
    return time.perf_counter() - start, out


@torch.no_grad()
def time_bare_forwards(model: GPT, prompt: torch.Tensor, tokens: int) -> tuple[float, None]:
    """Seconds for `tokens` greedy forwards over one position with nothing cached: a cache's floor."""
    start = time.perf_counter()
    for _ in range(tokens):
        logits = model(prompt[:, -1:]).logits  # (1, 1, vocab)
        logits[:, -1, :].argmax(dim=-1, keepdim=True)  # (1, 1): the pick generate makes too
    return time.perf_counter() - start, None


def mean_window(block_size: int, prompt_tokens: int, new_tokens: int) -> float:
    """Mean tokens the uncached path runs a forward over per new token, by the window policy both
    paths follow (sample.window_start, default keep): the context length this run measures."""
    start, total = None, 0
    for n in range(prompt_tokens, prompt_tokens + new_tokens):
        start = window_start(start, n, block_size, max(1, block_size // 2))
        total += n - start
    return total / new_tokens


def goal_for(possible: float) -> float | None:
    """The speed-up the cache must reach when at most ``possible`` can be had; None: not judged."""
    return 1 + (possible - 1) * SHARE_OF_POSSIBLE if possible >= MIN_POSSIBLE else None


def build_model(args) -> tuple[GPT, str]:
    """The model to time and what it is: a checkpoint's (file or run folder), or a random init."""
    if args.ckpt:
        path = find_checkpoint(args.ckpt)
        return from_checkpoint(path).model, f"checkpoint {path}"
    shape = make_config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    torch.manual_seed(0)
    return GPT(model_config(shape, args.vocab_size)).eval(), "random init"


def parse_args(argv: list[str] | None):
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", default="",
                        help="benchmark this checkpoint (a file or a run folder) instead of a random init")
    helps = field_help()
    parser.add_argument("--block-size", type=int, default=256, help=helps["block_size"])
    parser.add_argument("--n-layer", type=int, default=4, help=helps["n_layer"])
    parser.add_argument("--n-head", type=int, default=4, help=helps["n_head"])
    parser.add_argument("--n-embd", type=int, default=128, help=helps["n_embd"])
    parser.add_argument("--vocab-size", type=int, default=65, help="65 = tiny-shakespeare's characters (the built-in corpus has 84; both pad to 128, so the same speed)")
    parser.add_argument("--tokens", type=int, default=1000, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per path, after one warm-up")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (0 = torch's default); one makes the numbers depend less on "
                             "other load, and matmuls this small gain little from more")
    parser.add_argument("--min-speedup", type=float, default=None,
                        help=f"exit 1 below this speed-up (default: {SHARE_OF_POSSIBLE:g} of the possible gain, "
                             f"judged from a possible {MIN_POSSIBLE:g}x)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1 or args.vocab_size < 1 or args.threads < 0:
        parser.error("need --tokens, --repeats and --vocab-size >= 1 and --threads >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, weights = build_model(args)
    except TinyGPTError as err:  # one line and its exit code (process/errors.py)
        exit_on(err)
    cfg = model.config
    prompt = torch.zeros(1, 1, dtype=torch.long)  # (1, 1): one start token, batch 1
    window = mean_window(cfg.block_size, prompt.size(1), args.tokens)
    print(f"model: n_layer {cfg.n_layer}, n_head {cfg.n_head}, n_embd {cfg.n_embd}, block_size {cfg.block_size}, "
          f"vocab {cfg.vocab_size}, {model.num_params() / 1e6:.2f}M params; {weights}")
    print(f"run: {args.tokens} new tokens, batch 1, greedy, fp32, CPU, threads {torch.get_num_threads()}, "
          f"torch {torch.__version__}, median of {args.repeats} after 1 warm-up; "
          f"loadavg before {os.getloadavg()[0]:.2f}; mean window without the cache {window:.1f} tokens")

    timers: dict[str, Callable[[], tuple[float, torch.Tensor | None]]] = {
        "no cache": lambda: time_generate(model, prompt, args.tokens, use_cache=False),
        "KV cache": lambda: time_generate(model, prompt, args.tokens, use_cache=True),
        "bare 1-position forward": lambda: time_bare_forwards(model, prompt, args.tokens)}
    outputs = {path: timer()[1] for path, timer in timers.items()}  # the warm-up
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    for _ in range(args.repeats):
        for path, timer in timers.items():  # alternate, so a burst of load hits every path alike
            times[path].append(timer()[0])

    median = {path: statistics.median(seconds) for path, seconds in times.items()}
    print("\n| path                    | median s | tokens/s | min..max tokens/s |")
    print("|-------------------------|---------:|---------:|------------------:|")
    for path in PATHS:
        rates = sorted(args.tokens / t for t in times[path])
        print(f"| {path:<23} | {median[path]:8.3f} | {args.tokens / median[path]:8.0f} | "
              f"{rates[0]:8.0f}..{rates[-1]:<8.0f} |")
    speedup, possible = median["no cache"] / median["KV cache"], median["no cache"] / median["bare 1-position forward"]
    goal = goal_for(possible) if args.min_speedup is None else args.min_speedup
    same = torch.equal(outputs["no cache"], outputs["KV cache"])
    verdict = f"goal >= {goal:.2f}x" if goal is not None else f"not judged: below {MIN_POSSIBLE:g}x possible"
    print(f"\nspeed-up {speedup:.2f}x of a possible {possible:.2f}x at a mean window of {window:.0f} ({verdict}); "
          f"greedy tokens identical: {same}; loadavg after {os.getloadavg()[0]:.2f}")
    if not same or goal is not None and speedup < goal:
        sys.exit(1)


if __name__ == "__main__":
    main()
