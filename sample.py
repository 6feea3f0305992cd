"""Generate text from a trained checkpoint.

    python sample.py --temp 0.8                       # newest best.pt under out/
    python sample.py --ckpt out/small --prompt "ROMEO:" --num-samples 3 --top-k 40

The checkpoint carries the tokenizer, so nothing else is needed.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from checkpoint import CheckpointError, load_checkpoint
from config import ConfigError, config_from_dict
from data import DataError, tokenizer_from_meta
from model import GPT
from runtime import fail, pick_device
from train import model_config


def find_checkpoint(ckpt: str) -> Path:
    """A file as given; a folder's best.pt (else last.pt); by default the newest best.pt under out/."""
    if ckpt:
        path = Path(ckpt)
        if path.is_dir():
            for name in ("best.pt", "last.pt"):
                if (path / name).is_file():
                    return path / name
            raise CheckpointError(f"{path}: no best.pt or last.pt in this folder")
        return path
    found = sorted(Path("out").glob("**/best.pt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise CheckpointError("no checkpoint found under out/; train one first: python train.py --config small")
    return found[-1]


def load_model(path: Path, device: torch.device) -> tuple[GPT, object]:
    """Model in eval mode and its tokenizer, from a checkpoint."""
    state = load_checkpoint(path, map_location=device)
    cfg = config_from_dict(state["config"])
    tokenizer = tokenizer_from_meta(state["tokenizer"], Path(cfg.data_dir))
    model = GPT(model_config(cfg, tokenizer.vocab_size))
    model.load_state_dict(state["model"])
    return model.to(device).eval(), tokenizer


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Keep the top_k largest and the smallest set whose probability reaches top_p; -inf elsewhere."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = F.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocab order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Append max_new_tokens to each row of idx (B, T). temperature 0 means greedy argmax."""
    for _ in range(max_new_tokens):
        context = idx[:, -model.config.block_size:]  # (B, <= block_size): positions are learned up to it
        logits, _, _ = model(context)
        logits = logits[:, -1, :]  # (B, vocab)
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            probs = F.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
        idx = torch.cat([idx, next_id], dim=1)  # (B, T + 1)
    return idx


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ckpt", default="", help="checkpoint file or run folder (default: newest out/**/best.pt)")
    parser.add_argument("--prompt", default="", help="text to continue (default: a newline / <|endoftext|>)")
    parser.add_argument("--num-samples", "--num_samples", type=int, default=1, help="samples, generated as one batch")
    parser.add_argument("--max-new-tokens", "--max_new_tokens", type=int, default=500)
    parser.add_argument("--temp", "--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", "--top_k", type=int, default=0, help="0 = no top-k filter")
    parser.add_argument("--top-p", "--top_p", type=float, default=1.0, help="1.0 = no nucleus filter")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    if args.temp < 0 or not 0 < args.top_p <= 1 or args.top_k < 0 or args.num_samples < 1:
        fail("need --temp >= 0, 0 < --top-p <= 1, --top-k >= 0 and --num-samples >= 1")
    try:
        path = find_checkpoint(args.ckpt)
        device = pick_device(args.device)
        model, tokenizer = load_model(path, device)
        prompt = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.eot_token]
    except (CheckpointError, ConfigError, DataError) as err:
        fail(str(err))
    print(f"# sampling from {path}")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([prompt] * args.num_samples, dtype=torch.long, device=device)  # (N, T)
    out = generate(model, idx, args.max_new_tokens, args.temp, args.top_k, args.top_p, generator)
    for row in out.tolist():
        print(tokenizer.decode(row if args.prompt else row[1:]))
        print("-" * 40)


if __name__ == "__main__":
    main()
