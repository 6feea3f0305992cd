"""Tokens per second of sample.py's generator with and without the KV cache, and a check that both
give the same greedy text.

    python scripts/bench_sample.py                  # block_size 256, 1000 new tokens, CPU, fp32
    python scripts/bench_sample.py --ckpt out/small # a trained checkpoint instead of a random init

The default model is the width and depth of the `small` preset of before (n_layer 4, n_head 4, n_embd 128, char vocab 65)
with block_size 256, randomly initialised: speed does not depend on the weights. Each path runs once
to warm up, then --repeats times, alternating, and the median is reported. Exits 1 if the greedy
tokens differ or the speed-up is below --min-speedup, so a regression fails loudly.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from config import CommandLine  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from sample import generate, load_model  # noqa: E402


def time_generate(model: GPT, prompt: torch.Tensor, tokens: int, use_cache: bool) -> tuple[float, torch.Tensor]:
    """Seconds for one greedy generation of `tokens` new tokens, and the tokens."""
    start = time.perf_counter()
    out = generate(model, prompt, tokens, temperature=0, use_cache=use_cache)
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", default="", help="benchmark this checkpoint instead of a random init")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=65, help="65 = tiny-shakespeare's characters (the built-in corpus has 84; both pad to 128, so the same speed)")
    parser.add_argument("--tokens", type=int, default=1000, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per path, after one warm-up")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (0 = torch's default); one makes the numbers depend less on "
                             "other load, and matmuls this small gain little from more")
    parser.add_argument("--min-speedup", type=float, default=5.0, help="exit 1 below this speed-up")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ckpt:
        model, _ = load_model(Path(args.ckpt), torch.device("cpu"))
    else:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                              n_head=args.n_head, n_embd=args.n_embd)).eval()
    cfg = model.config
    prompt = torch.zeros(1, 1, dtype=torch.long)  # (1, 1): one start token, batch 1
    weights = f"checkpoint {args.ckpt}" if args.ckpt else "random init"
    print(f"model: n_layer {cfg.n_layer}, n_head {cfg.n_head}, n_embd {cfg.n_embd}, block_size {cfg.block_size}, "
          f"vocab {cfg.vocab_size}, {model.num_params() / 1e6:.2f}M params; {weights}")
    print(f"run: {args.tokens} new tokens, batch 1, greedy, fp32, CPU, threads {torch.get_num_threads()}, "
          f"torch {torch.__version__}, median of {args.repeats} after 1 warm-up; "
          f"loadavg before {os.getloadavg()[0]:.2f}")

    outputs = {use_cache: time_generate(model, prompt, args.tokens, use_cache)[1] for use_cache in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for use_cache in (False, True):  # alternate, so a burst of load hits both paths alike
            times[use_cache].append(time_generate(model, prompt, args.tokens, use_cache)[0])

    median = {k: statistics.median(v) for k, v in times.items()}
    speedup = median[False] / median[True]
    print(f"\n| path     | median s | tokens/s | min..max tokens/s |")
    print(f"|----------|---------:|---------:|------------------:|")
    for name, use_cache in (("no cache", False), ("KV cache", True)):
        rates = sorted(args.tokens / t for t in times[use_cache])
        print(f"| {name} | {median[use_cache]:8.3f} | {args.tokens / median[use_cache]:8.0f} | "
              f"{rates[0]:8.0f}..{rates[-1]:<8.0f} |")
    same = torch.equal(outputs[False], outputs[True])
    print(f"\nspeed-up {speedup:.1f}x (goal >= {args.min_speedup:g}x); greedy tokens identical: {same}; "
          f"loadavg after {os.getloadavg()[0]:.2f}")
    if not same or speedup < args.min_speedup:
        sys.exit(1)


if __name__ == "__main__":
    main()
