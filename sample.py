"""Generate text from a trained checkpoint, fast (KV cache) and exact.

    python sample.py --temp 0.8                       # newest best.pt under out/
    python sample.py --ckpt out/small --prompt "ROMEO:" --num-samples 3 --top-k 40 --top-p 0.9
    python sample.py --prompt-file prompt.txt --temp 0 --no-stream
    python sample.py --ckpt out/small --prompt "ROMEO:" --stop "\\n\\n"   # one speech: stop at a blank line
    python sample.py --init_from gpt2 --prompt "Hello, I'm a language model,"   # GPT-2 itself (checkpoint.py)

The checkpoint carries the tokenizer, so nothing else is needed (checkpoint.py loads them). Reads
top to bottom: choosing a token (filters, temperature) -> the context window and its KV cache -> the
generation loop -> streaming text and stop strings -> the command line. A conversation, or a prompt per line
with the model loaded once: python -m scripts.chat, which uses this file's generation and flags.
"""
from __future__ import annotations

import argparse
import codecs
import re
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from checkpoint import Loaded, add_weights_flags, from_flags
from config import CommandLine, DataError, TinyGPTError, exit_on, fail, field_help
from model import GPT, GPTConfig
from runtime import pick_device, use_threads


# ----------------------------------------------------------------------------- choosing a token
def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit (B, V) outside the top_k, then outside the top_p nucleus.

    top_k: keep the k largest; a token tied with the k-th is kept too, so no id is preferred over
    an equally likely one (more than k may survive). 0 = off.
    top_p (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration"): keep the smallest
    set of most likely tokens whose probability reaches top_p, renormalised after top_k; always at
    least one, and again ties with the last kept token are kept. 1.0 = off.
    """
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # (B, V)
        probs = F.softmax(sorted_logits, dim=-1)  # (B, V)
        # A token is needed while the tokens ranked above it fall short of top_p; the first always is.
        # (A shifted cumsum, not cumsum - probs: rounding could make the latter non-monotone.)
        above = F.pad(probs.cumsum(dim=-1)[..., :-1], (1, 0))  # (B, V): mass ranked above each
        n_keep = (above < top_p).sum(dim=-1, keepdim=True)  # (B, 1), >= 1
        smallest_kept = sorted_logits.gather(-1, n_keep - 1)  # (B, 1)
        logits = logits.masked_fill(logits < smallest_kept, float("-inf"))
    return logits


def pick_next(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Next ids (B, 1) from last-position logits (B, vocab): argmax at temperature 0, else a draw from
    ``generator`` alone, never the global RNG. Temperature divides the logits before the filters, so top_p sees
    the tempered distribution."""
    if temperature == 0:  # the limit T -> 0 of softmax(logits / T); dividing by 0 would give NaNs
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1); a tie goes to the lowest id
    probs = next_token_probs(logits, temperature, top_k, top_p)  # (B, vocab)
    return torch.multinomial(probs, 1, generator=generator)  # (B, 1)


def next_token_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution (B, vocab) pick_next draws from at temperature > 0: softmax(logits / T), filtered."""
    return F.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)  # (B, vocab)


# ----------------------------------------------------------------------------- the KV cache
class LayerCache:
    """One layer's keys and values for the positions seen so far, in buffers of block_size positions, allocated
    at the first append so that decoding never copies the past, with the dtype and device of the first keys
    (autocast's bf16 keys need no telling)."""

    def __init__(self, batch_size: int, n_head: int, block_size: int, head_size: int):
        self.shape = (batch_size, n_head, block_size, head_size)  # (B, nh, block_size, hs)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0  # positions filled so far

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) after the cached positions; return all keys and values so far."""
        if self.k is None:
            self.k, self.v = k.new_zeros(self.shape), v.new_zeros(self.shape)  # (B, nh, block_size, hs)
        start, end = self.length, self.length + k.size(2)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, nh, S + T, hs) each


class KVCache:
    """Keys and values of every layer, so that each new token costs one single-position forward.

    ``model(prompt, cache=cache)`` (the prefill), then ``model(next_token, cache=cache)`` (one decode step) as
    often as block_size allows. Positions are absolute (a learned table, or rotary angles, of block_size rows),
    so a full cache must be ``reset()`` and a shorter window prefilled (NextTokenLogits does so).
    """

    def __init__(self, config: GPTConfig, batch_size: int):
        hs = config.n_embd // config.n_head
        self.layers = [LayerCache(batch_size, config.n_head, config.block_size, hs)
                       for _ in range(config.n_layer)]

    @property
    def length(self) -> int:  # positions cached; every layer holds the same number
        return self.layers[0].length

    def reset(self) -> None:
        """Forget every position (the buffers are kept and overwritten)."""
        for layer in self.layers:
            layer.length = 0


# ----------------------------------------------------------------------------- the context window
def window_start(start: int | None, n: int, block_size: int, keep: int) -> int:
    """Index of the first token the model sees when predicting the token after the first n; ``start`` is the
    previous step's answer (None at the first step). The one policy of the cached and the uncached generator,
    so that they can be compared exactly: the first step sees the whole prompt, or its last block_size tokens;
    then the window grows by one token per step from the same start (the cache appends); when it would pass
    block_size, where learned positions end, it restarts with the last ``keep`` tokens at positions 0 .. keep - 1
    (for the cache: a fresh prefill). keep = block_size is the classic sliding window, a full forward every step
    past block_size; block_size // 2 (the default) re-prefills once per block_size // 2 new tokens, keeping the
    cache fast, at the price of a context that dips to ``keep`` tokens after each restart.
    """
    if start is None:
        return max(0, n - block_size)
    if n - start > block_size:
        return n - keep
    return start


class NextTokenLogits:
    """Logits (B, vocab) for the token after idx (B, n), over the window that window_start picks. With use_cache,
    a new window is prefilled into a KVCache once, then each step feeds only the tokens not yet cached; without,
    every step runs a full forward over exactly the same window: the reference the cache is tested against."""

    def __init__(self, model: GPT, batch_size: int, use_cache: bool = True, keep: int = 0):
        self.model = model
        self.block_size = model.config.block_size
        self.keep = keep or max(1, self.block_size // 2)
        self.cache = KVCache(model.config, batch_size) if use_cache else None
        self.start: int | None = None  # where the current window begins in idx

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        start = window_start(self.start, idx.size(1), self.block_size, self.keep)
        if self.cache is None:
            logits = self.model(idx[:, start:]).logits  # (B, n - start, vocab)
        else:
            if start != self.start:  # a new window: its positions restart at 0, so must its keys
                self.cache.reset()
            new = idx[:, start + self.cache.length:]  # (B, n - start - S): the tokens not yet cached
            logits = self.model(new, cache=self.cache).logits  # (B, n - start - S, vocab)
        self.start = start
        return logits[:, -1, :]  # (B, vocab)


# ----------------------------------------------------------------------------- the loop
@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None,
             use_cache: bool = True, keep: int = 0,
             on_token: Callable[[torch.Tensor], None] | None = None,
             stop: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
    """Append max_new_tokens to every row of idx (B, T), all rows as one batch; returns (B, T + new).

    temperature 0 is greedy. ``on_token`` gets each new column (B, 1) as soon as it is chosen (streaming);
    ``stop`` gets idx after each new token and ends generation by returning True. ``keep``: see window_start
    (0 = block_size // 2). Footgun: put the model in eval mode first, or dropout makes the samples noisy.
    """
    if idx.size(1) == 0:
        raise ValueError("generate needs at least one token to start from")
    next_logits = NextTokenLogits(model, idx.size(0), use_cache, keep)
    for _ in range(max_new_tokens):
        next_id = pick_next(next_logits(idx), temperature, top_k, top_p, generator)  # (B, 1)
        idx = torch.cat([idx, next_id], dim=1)  # (B, T + 1)
        if on_token is not None:
            on_token(next_id)
        if stop is not None and stop(idx):
            break
    return idx


# ----------------------------------------------------------------------------- streaming text
class Continuations:
    """Each sample's new text, ended at its first stop string (not included) or at an end-of-text token.

    Never half a character: a BPE token can end inside a multi-byte UTF-8 character (an emoji is 4 bytes, often
    two or three tokens), so each row's bytes go through an incremental decoder that holds an unfinished character
    until its last byte arrives (invalid bytes become U+FFFD, as in decode()). Rows stop on their own: a finished
    row ignores the tokens its batch still generates. ``printable`` is what streaming may show of a row now: its
    text less any tail that could still grow into a stop string, so a stop string is never printed, not even in
    part.
    """

    def __init__(self, tokenizer, rows: int, stops: list[str], end_ids: set[int]):
        self.tokenizer = tokenizer
        self.utf8 = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(rows)]
        self.texts = [""] * rows
        self.done = [False] * rows
        self.stops, self.end_ids = [s for s in stops if s], end_ids

    def push(self, next_ids: torch.Tensor) -> None:
        """Append each row's new token (B, 1) to its text, unless the row has ended."""
        for row, token in enumerate(next_ids[:, 0].tolist()):
            if self.done[row]:
                continue
            if token in self.end_ids:
                self.done[row] = True
                continue
            self.texts[row] += self.utf8[row].decode(self.tokenizer.decode_bytes([token]))
            self.cut(row)

    def cut(self, row: int) -> None:
        found = [at for at in (self.texts[row].find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.texts[row], self.done[row] = self.texts[row][:min(found)], True

    def finish(self) -> None:
        """The generation is over: rows still open get their held-back bytes (as U+FFFD)."""
        for row, done in enumerate(self.done):
            if not done:
                self.texts[row] += self.utf8[row].decode(b"", final=True)
                self.cut(row)

    def all_done(self) -> bool:
        return all(self.done)

    def printable(self, row: int) -> str:
        text = self.texts[row]
        if self.done[row]:
            return text
        held = max((k for stop in self.stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        return text[:len(text) - held]


# ----------------------------------------------------------------------------- command line
def unescape(text: str) -> str:
    """--stop's escapes, so a shell can pass a newline: \\n, \\t and \\\\ (any other character stays as it is)."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def add_sampling_flags(parser: CommandLine) -> None:
    """How to generate, sample.py's and scripts/chat.py's alike: the weights, the length, the filters, the seed."""
    add_weights_flags(parser)
    parser.add_argument("--num-samples", "--num_samples", type=int, default=1, help="samples, generated as one batch")
    parser.add_argument("--max-new-tokens", "--max_new_tokens", type=int, default=500,
                        help="tokens generated per sample; in a conversation the most a reply may take")
    parser.add_argument("--temp", "--temperature", type=float, default=0.8, help="0 = greedy argmax")
    parser.add_argument("--top-k", "--top_k", type=int, default=0, help="0 = no top-k filter")
    parser.add_argument("--top-p", "--top_p", type=float, default=1.0, help="1.0 = no nucleus filter")
    parser.add_argument("--stop", action="append", default=[], type=unescape, metavar="STR",
                        help="end a sample at the first STR, which is not printed (repeatable; \\n is a newline)")
    parser.add_argument("--stop-at-eot", "--stop_at_eot", action=argparse.BooleanOptionalAction, default=True,
                        help="end a sample at the tokenizer's end-of-text token (GPT-2's <|endoftext|>; a char "
                             "vocabulary has none)")
    parser.add_argument("--seed", type=int, default=1337, help="seeds the sampler's own torch.Generator")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                        help="print sample 1 as it is generated (default: on when stdout is a terminal); "
                             "further samples are printed when the batch is done")
    parser.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True,
                        help="KV cache; --no-cache recomputes the whole window per token (same text, slower)")
    parser.add_argument("--device", default="auto", help=field_help()["device"])
    parser.add_argument("--threads", type=int, default=0, help=field_help()["threads"])


def sampling_args(parser: CommandLine, argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line, add_sampling_flags' values checked (one line and exit 2 if out of range)."""
    args = parser.parse_args(argv)
    if not args.temp >= 0 or not 0 < args.top_p <= 1 or args.top_k < 0 or args.num_samples < 1 \
            or args.max_new_tokens < 0 or args.threads < 0:
        fail("need --temp >= 0, 0 < --top-p <= 1, --top-k >= 0, --num-samples >= 1, --max-new-tokens >= 0 and "
             "--threads >= 0")
    if args.stream is None:
        args.stream = sys.stdout.isatty()
    return args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", help="text to continue (default: a newline / <|endoftext|>)")
    prompt.add_argument("--prompt-file", "--prompt_file", default="", help="UTF-8 file whose text to continue")
    add_sampling_flags(parser)
    return sampling_args(parser, argv)


def load(args: argparse.Namespace) -> Loaded:
    """The model (eval mode, on --device) and tokenizer that --ckpt / --init_from name; a TinyGPTError if none."""
    use_threads(args.threads)  # train.py's --threads: two jobs on 2 cores, one each
    return from_flags(args, pick_device(args.device))  # checkpoint.py: a checkpoint or pretrained weights


def read_prompt_file(path: str) -> str:
    """--prompt-file's text (newlines as Path.read_text gives them); a DataError naming the flag if unreadable."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as err:
        reason = err.strerror or str(err)
    except UnicodeDecodeError as err:
        reason = f"not UTF-8 text (byte {err.start})"
    raise DataError(f"{path}: {reason}; pass an existing UTF-8 text file with --prompt-file")


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The prompt's ids; an empty prompt starts from the start token (newline / <|endoftext|>)."""
    return tokenizer.encode(text) if text else [tokenizer.eot_token]


def continue_into(texts: Continuations, model: GPT, prompts: list[list[int]], max_new_tokens: int,
                  args: argparse.Namespace, generator: torch.Generator, show: bool) -> int:
    """Generate after ``prompts`` (one a row) into ``texts`` until every row ends; ``show``: print row 0's
    printable text as it grows (N rows interleaved would be unreadable). Returns the characters it printed."""
    shown = 0

    def on_token(next_id: torch.Tensor) -> None:
        nonlocal shown
        texts.push(next_id)
        if show:
            now = texts.printable(0)
            print(now[shown:], end="", flush=True)
            shown = len(now)

    idx = torch.tensor(prompts, dtype=torch.long, device=next(model.parameters()).device)  # (N, T)
    generate(model, idx, max_new_tokens, args.temp, args.top_k, args.top_p, generator, use_cache=args.cache,
             on_token=on_token, stop=lambda _: texts.all_done())
    texts.finish()
    return shown


def sample(model: GPT, tokenizer, text: str, args: argparse.Namespace, generator: torch.Generator) -> None:
    """Continue ``text`` --num-samples times as one batch and print each (sample 1 streamed if --stream)."""
    ends = set(tokenizer.special_ids) if args.stop_at_eot else set()
    samples = Continuations(tokenizer, args.num_samples, args.stop, ends)
    if args.stream:
        print(text, end="", flush=True)
    shown = continue_into(samples, model, [prompt_ids(tokenizer, text)] * args.num_samples, args.max_new_tokens,
                          args, generator, args.stream)
    for row, continuation in enumerate(samples.texts):
        print(continuation[shown:] if args.stream and row == 0 else text + continuation)
        print("-" * 40)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        loaded = load(args)
        text = read_prompt_file(args.prompt_file) if args.prompt_file else args.prompt
        prompt_ids(loaded.tokenizer, text)  # a character the vocabulary lacks: one line now, before any output
    except TinyGPTError as err:  # a bad checkpoint, config, device or prompt: one line and its exit code
        exit_on(err)
    model = loaded.model
    print(f"# sampling from {loaded.source}; block_size {model.config.block_size}: past it the window slides",
          flush=True)
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(args.seed)
    sample(model, loaded.tokenizer, text, args, generator)


if __name__ == "__main__":
    main()
