"""The chat demo measured: full fine-tune against LoRA from one base, at equal steps, over several seeds.

    python train.py --config small                       # the base (docs/finetuning.md names the one measured)
    python -m dev.chat_demo --base out/small --seeds 1 2 3

Each seed trains `chat_small` twice from the same base (full, and LoRA with --lora_* below), then scores both:
masked val loss (the assistant's tokens only) before and after, ms/step (median of the logged steps),
optimizer-state and last.pt bytes, and the format kept on every val conversation: the greedy reply to its
first user turn ends with <|end|> inside the window and writes no other marker (never the user's part).
Prints a markdown table of mean ± spread over the seeds.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from config import make_config, model_config
from data import corpus_for, eval_windows
from prepare.chat import ASSISTANT, BEGIN, END, USER
from training.checkpoint import load_checkpoint
from process.cli import CommandLine
from process.errors import TinyGPTError, exit_on, fail
from weights.loading import from_checkpoint, start_from
from prepare.tokenizers import tokenizer_from_meta, without_chat
from model import GPT
from sample import generate
from train import evaluate

LORA = ("--lora_rank", "8", "--lora_alpha", "16", "--lora_targets", "attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj",
        "--learning_rate", "3e-3")  # LoRA's usual larger step (Hu et al. 2021 tune it apart from full fine-tuning)


def fine_tune(base: Path, out: Path, seed: int, extra: tuple[str, ...], steps: int) -> None:
    if not (out / "last.pt").is_file():
        subprocess.run([sys.executable, "train.py", "--config", "chat_small", "--init_from", str(base), "--out_dir",
                        str(out), "--seed", str(seed), "--max_iters", str(steps), "--lr_decay_iters", str(steps),
                        "--eval_interval", str(steps), "--threads", "1", *extra], check=True)


def masked_val_loss(model: GPT, cfg, corpus, tokenizer) -> float:
    x, y = eval_windows(corpus, tokenizer, cfg.block_size)
    return evaluate(model, x, y, 64, torch.device("cpu"), torch.float32).loss


def format_kept(model: GPT, corpus, tokenizer) -> float:
    """The share of val conversations whose greedy reply to the first user turn ends with <|end|> in the window
    and writes no other marker."""
    ids, markers = tokenizer.marker_ids, set(tokenizer.marker_ids.values())
    starts = (torch.from_numpy(corpus.val.astype("int64")) == ids[BEGIN]).nonzero().flatten().tolist()
    kept = 0
    for start in starts:
        conversation = corpus.val[start: start + model.config.block_size + 1].astype("int64").tolist()
        prompt = conversation[: conversation.index(ids[END], conversation.index(ids[USER])) + 1] + [ids[ASSISTANT]]
        out = generate(model, torch.tensor([prompt]), model.config.block_size - len(prompt), temperature=0,
                       stop=lambda idx: idx[0, -1].item() in markers)[0, len(prompt):].tolist()
        kept += bool(out) and out[-1] == ids[END] and not markers & set(out[:-1])
    return kept / len(starts)


def score(run: Path) -> dict[str, float]:
    loaded = from_checkpoint(run / "best.pt")
    corpus = corpus_for(loaded.cfg, without_chat(loaded.tokenizer.meta()))  # the chat corpus, in the run's ids
    state = load_checkpoint(run / "last.pt")
    tensors = [t for s in state["optimizer"]["state"].values() for t in s.values() if torch.is_tensor(t)]
    return {"val": masked_val_loss(loaded.model, loaded.cfg, corpus, loaded.tokenizer),
            "kept": format_kept(loaded.model, corpus, loaded.tokenizer),
            "state_mb": sum(t.numel() * t.element_size() for t in tensors) / 1e6,
            "ckpt_mb": (run / "last.pt").stat().st_size / 1e6, "ms": median_ms(run, loaded.cfg.tokens_per_step())}


def median_ms(run: Path, tokens_per_step: int) -> float:
    """ms per step from the logged throughput (tokens_per_s counts block_size-wide rows, as the step's nominal size)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(1000 * tokens_per_step / r["tokens_per_s"] for r in records if "tokens_per_s" in r)


def before(base: Path) -> tuple[float, float]:
    """The masked val loss and format kept of the base itself, its markers' rows at their start (start_from)."""
    cfg, weights = start_from(make_config("chat_small", init_from=str(base)))
    corpus = corpus_for(cfg, weights.tokenizer)
    tokenizer = tokenizer_from_meta(corpus.meta["tokenizer"], Path(cfg.data_dir))
    model = GPT(model_config(cfg, corpus.vocab_size))
    model.load_state_dict(weights.weights_for(corpus.meta["tokenizer"], corpus.vocab_size))
    return masked_val_loss(model.eval(), cfg, corpus, tokenizer), format_kept(model.eval(), corpus, tokenizer)


def spread(values: list[float], digits: int) -> str:
    mean = statistics.mean(values)
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="out/small", help="the run fine-tuned (a folder or .pt)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one full and one LoRA fine-tune each")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of each fine-tune")
    parser.add_argument("--out", default="out/chat_demo", help="where the fine-tunes go (reused if there)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        fail("need --steps >= 1")
    torch.set_num_threads(1)
    try:
        base = Path(args.base)
        val0, kept0 = before(base)
        rows = {}
        for mode, extra in (("full", ()), ("LoRA r8, 4 matrices", LORA)):
            runs = [Path(args.out) / f"{mode.split()[0].lower()}-{seed}" for seed in args.seeds]
            for run, seed in zip(runs, args.seeds):
                fine_tune(base, run, seed, extra, args.steps)
            rows[mode] = [score(run) for run in runs]
    except TinyGPTError as err:
        exit_on(err)
    print(f"base {base}: masked val loss {val0:.4f}, format kept {kept0:.1%}; {args.steps} steps, seeds {args.seeds}\n")
    print("| fine-tune | masked val loss | format kept | ms/step | optimizer state | last.pt |")
    print("|---|---|---|---|---|---|")
    for mode, scores in rows.items():
        column = lambda key: [s[key] for s in scores]  # noqa: E731
        print(f"| {mode} | {spread(column('val'), 4)} | {spread([100 * k for k in column('kept')], 1)}% | "
              f"{spread(column('ms'), 0)} | {statistics.mean(column('state_mb')):.3f} MB | "
              f"{statistics.mean(column('ckpt_mb')):.3f} MB |")


if __name__ == "__main__":
    main()
