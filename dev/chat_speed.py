"""Reply tokens per second of a chat run: sample.py --chat's generation (KV cache, fp32) against llama.cpp's on the
GGUF export (f32 and q8_0), greedy, one thread each, in alternating rounds (docs/finetuning.md, "Talk to it").

    python -m dev.chat_speed out/chat_small --turns 20 --rounds 3

Each engine answers the user turns of the first ``--turns`` conversations of data/shakespeare_chat.jsonl; a reply's
time includes its prompt's prefill, as a chat's does. Prints tokens/s per round and how many replies equal ours.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import sample
from prepare.chat import read_conversations, render
from weights.gguf import export_gguf
from weights.loading import from_checkpoint


def ours(model, tokenizer, conversations):
    """(reply token ids, seconds) for each conversation's prompt, through sample.generate as --chat calls it."""
    ends, block_size = set(tokenizer.marker_ids.values()), model.config.block_size
    out = []
    for messages in conversations:
        prompt = torch.tensor([render(tokenizer, messages, reply=True)])
        start = time.perf_counter()
        ids = sample.generate(model, prompt, block_size - prompt.size(1), temperature=0,
                              stop=lambda idx: idx[0, -1].item() in ends)[0, prompt.size(1):].tolist()
        out.append((ids[:-1] if ids[-1] in ends else ids, time.perf_counter() - start))
    return out


def llama(llm, tokenizer, conversations):
    """(reply token ids, seconds) from Llama.create_chat_completion on the same conversations."""
    out = []
    for messages in conversations:
        as_dicts = [{"role": role, "content": text} for role, text in messages]
        start = time.perf_counter()
        text = llm.create_chat_completion(as_dicts, temperature=0, repeat_penalty=1.0)["choices"][0]["message"]
        out.append((tokenizer.encode(text["content"]), time.perf_counter() - start))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from llama_cpp import Llama

    loaded = from_checkpoint(Path(args.run) / "best.pt")
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    chats, _ = read_conversations(Path("data/shakespeare_chat.jsonl"))
    conversations = [[turns[0]] for turns in chats[: args.turns]]  # the first user turn of each
    folder = Path(tempfile.mkdtemp())
    engines = {"sample.py --chat": lambda: ours(model, tokenizer, conversations)}
    for dtype in ("f32", "q8_0"):
        export_gguf(model, tokenizer, folder / f"{dtype}.gguf", dtype)
        llm = Llama(str(folder / f"{dtype}.gguf"), n_ctx=0, n_threads=1, n_threads_batch=1, verbose=False)
        engines[f"llama.cpp {dtype}"] = lambda llm=llm: llama(llm, tokenizer, conversations)
    rates, reference = {name: [] for name in engines}, None
    for round_ in range(args.rounds):
        for name, run in engines.items():
            replies = run()
            reference = reference or replies
            tokens, seconds = sum(len(ids) for ids, _ in replies), sum(s for _, s in replies)
            rates[name].append(tokens / seconds)
            same = sum(a[0] == b[0] for a, b in zip(replies, reference))
            print(f"round {round_ + 1} {name}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.0f} tokens/s; "
                  f"{same}/{len(replies)} replies equal sample.py's")
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):.0f} tokens/s (min {min(values):.0f}, max {max(values):.0f})")


if __name__ == "__main__":
    main()
