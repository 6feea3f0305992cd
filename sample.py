"""Generate text from a trained checkpoint, fast (KV cache) and exact. The checkpoint carries its tokenizer.

    python sample.py --temp 0.8                       # the newest trained run's best.pt under out/
    python sample.py --ckpt out/small --prompt "ROMEO:" --num-samples 3 --top-k 40 --top-p 0.9
    python sample.py --ckpt out/small --prompt "ROMEO:" --stop "\\n\\n"   # one speech: stop at a blank line
    python sample.py --ckpt out/gpt2 --prompt "Hello, I'm a language model,"   # GPT-2 (python -m scripts.import_hf)
"""
import signal

# Ctrl-C while torch imports (seconds) ends the process, not in an import traceback (an ignored one stays ignored);
# cli.run_tool, main's entry below, puts Python's handler back once they are done
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import argparse
import codecs
import math
import re
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from checkpoint import add_weights_flags, from_flags
from cli import EXIT_INTERRUPTED, CommandLine, DataError, exit_on_errors, fail, run_tool
from config import FIELD_HELP
from model import GPT, GPTConfig
from runtime import pick_device, use_threads


# ----------------------------------------------------------------------------- choosing a token
def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """-inf for every logit (B, V) outside the top_k (0 = off), then outside the top_p nucleus (1.0 = off;
    Holtzman et al. 2019: the smallest set whose probability reaches top_p). Ties with the last kept stay."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # (B, V)
        # The mass ranked above each token, as a shifted cumsum: cumsum - probs could round non-monotone.
        above = F.pad(F.softmax(sorted_logits, dim=-1).cumsum(dim=-1)[..., :-1], (1, 0))  # (B, V)
        n_keep = (above < top_p).sum(dim=-1, keepdim=True)  # (B, 1), >= 1
        logits = logits.masked_fill(logits < sorted_logits.gather(-1, n_keep - 1), float("-inf"))
    return logits


def pick_next(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Next ids (B, 1): argmax at temperature 0, else a draw from ``generator``, never the global RNG; the filters
    apply after the temperature."""
    if torch.tensor(temperature).float() == 0:  # T -> 0, or below float32's least (1.4e-45): 0 / 0 gives NaNs
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1); a tie goes to the lowest id
    # Shifted so the largest is 0 before dividing: a tiny T then gives -inf, never inf - inf (a NaN).
    logits = logits.float()
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # (B, vocab), <= 0
    probs = F.softmax(filter_logits(shifted / temperature, top_k, top_p), dim=-1)  # (B, vocab)
    return torch.multinomial(probs, 1, generator=generator)  # (B, 1)


# ----------------------------------------------------------------------------- the KV cache and its window
class LayerCache:
    """One layer's keys and values so far, in buffers of block_size positions: decoding never copies the past."""

    def __init__(self, shape: tuple[int, int, int, int]):
        self.shape, self.k, self.v, self.length = shape, None, None, 0  # length: positions filled

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) after the cached positions; return all keys and values so far."""
        if self.k is None:
            self.k, self.v = k.new_zeros(self.shape), v.new_zeros(self.shape)  # (B, nh, block_size, hs)
        start, self.length = self.length, self.length + k.size(2)
        self.k[:, :, start:self.length], self.v[:, :, start:self.length] = k, v
        return self.k[:, :, :self.length], self.v[:, :, :self.length]  # (B, nh, S + T, hs) each


class KVCache:
    """Every layer's keys and values: ``model(prompt, cache=c)`` prefills, ``model(next_id, cache=c)`` decodes.
    Positions are absolute: past block_size, a fresh cache must prefill a shorter window."""

    def __init__(self, config: GPTConfig, batch_size: int):
        shape = (batch_size, config.n_head, config.block_size, config.n_embd // config.n_head)  # (B, nh, block, hs)
        self.layers = [LayerCache(shape) for _ in range(config.n_layer)]
        self.tokens = torch.zeros(batch_size, 0, dtype=torch.long)  # (B, S): the cached ids, for visible_keys

    length = property(lambda self: self.layers[0].length)

    def remember(self, idx: torch.Tensor) -> torch.Tensor:
        """Keep the ids idx (B, T) after the cached ones; return them all (B, S + T)."""
        self.tokens = torch.cat([self.tokens.to(idx.device), idx], dim=1)  # a few ids: copying them costs nothing
        return self.tokens


def window_start(start: int | None, n: int, block_size: int, keep: int) -> int:
    """Where the model's window over n tokens starts, given the last step's ``start`` (None at first): it grows until
    it would pass block_size, then restarts with the last ``keep`` (keep = block_size: the classic sliding window)."""
    if start is None:
        return max(0, n - block_size)
    return n - keep if n - start > block_size else start


class NextTokenLogits:
    """Logits (B, vocab) after idx (B, n) over window_start's window: from the cache, or (the reference) without."""

    def __init__(self, model: GPT, use_cache: bool = True, keep: int = 0):
        self.model, self.use_cache, self.block_size = model, use_cache, model.config.block_size
        self.keep = keep or max(1, self.block_size // 2)
        self.start, self.cache = None, None  # where the current window begins in idx, and its KVCache

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        start = window_start(self.start, idx.size(1), self.block_size, self.keep)
        if self.use_cache and start != self.start:  # a new window restarts at position 0: so must its keys
            self.cache = KVCache(self.model.config, idx.size(0))
        cached = self.cache.length if self.cache is not None else 0
        logits = self.model(idx[:, start + cached:], cache=self.cache).logits  # (B, n - start - cached, vocab)
        self.start = start
        return logits[:, -1, :]  # (B, vocab)


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, generator: torch.Generator | None = None, use_cache: bool = True, keep: int = 0,
             on_token: Callable[[torch.Tensor], None] = lambda next_id: None,
             stop: Callable[[torch.Tensor], bool] = lambda idx: False) -> torch.Tensor:
    """Append max_new_tokens to every row of idx (B, T) as one batch; returns (B, T + new). ``on_token`` gets each
    new column (B, 1); ``stop(idx)`` returning True ends early. Footgun: eval mode first, or dropout adds noise."""
    if idx.size(1) == 0:
        raise ValueError("generate needs at least one token to start from")
    next_logits = NextTokenLogits(model, use_cache, keep)
    for _ in range(max_new_tokens):
        next_id = pick_next(next_logits(idx), temperature, top_k, top_p, generator)  # (B, 1)
        idx = torch.cat([idx, next_id], dim=1)  # (B, T + 1)
        on_token(next_id)
        if stop(idx):
            break
    return idx


# ----------------------------------------------------------------------------- streaming text
class Continuations:
    """Each row's new text, ended at its first stop string (excluded) or an end-of-text id; ``show`` prints row 0 as
    it grows. A token may end inside a UTF-8 character: each row's incremental decoder holds it until complete."""

    def __init__(self, tokenizer, rows: int, stops: list[str], end_ids: set[int], show: bool = False):
        self.tokenizer, self.show, self.shown = tokenizer, show, 0  # shown: characters of row 0 printed
        self.utf8 = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(rows)]
        self.texts, self.done = [""] * rows, [False] * rows
        self.stops, self.end_ids = stops, end_ids  # each non-empty (sampling_args refuses "")

    def push(self, next_ids: torch.Tensor) -> None:
        """Append each row's new token (B, 1) to its text, unless the row has ended."""
        for row, token in enumerate(next_ids[:, 0].tolist()):
            if self.done[row] or token in self.end_ids:
                self.done[row] = True  # an end-of-text token ends the row and is no text
            else:
                self.add(row, self.utf8[row].decode(self.tokenizer.decode_bytes([token])))
        if self.show:  # row 0's text less any tail that could still grow into a stop string
            text, stops = self.texts[0], [] if self.done[0] else self.stops
            held = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
            print(text[self.shown:len(text) - held], end="", flush=True)
            self.shown = len(text) - held

    def add(self, row: int, text: str) -> None:
        self.texts[row] += text
        if found := [at for at in (self.texts[row].find(stop) for stop in self.stops) if at >= 0]:
            self.texts[row], self.done[row] = self.texts[row][:min(found)], True

    def finish(self) -> None:
        """Rows still open get their held-back bytes (as U+FFFD)."""
        for row, done in enumerate(self.done):
            if not done:
                self.add(row, self.utf8[row].decode(b"", final=True))


def continue_into(texts: Continuations, model: GPT, prompts: list[list[int]], max_new_tokens: int,
                  args: argparse.Namespace, generator: torch.Generator) -> None:
    """Generate after ``prompts`` (a row each) into ``texts`` until every row has ended."""
    idx = torch.tensor(prompts, dtype=torch.long, device=next(model.parameters()).device)  # (N, T)
    generate(model, idx, max_new_tokens, args.temp, args.top_k, args.top_p, generator, use_cache=args.cache,
             on_token=texts.push, stop=lambda _: all(texts.done))
    texts.finish()


def sample(model: GPT, tokenizer, text: str, args: argparse.Namespace, generator: torch.Generator) -> None:
    """Continue ``text`` (empty: from the start token) --num-samples times as one batch and print each."""
    ends = set(tokenizer.special_ids) if args.stop_at_eot else set()
    samples = Continuations(tokenizer, args.num_samples, args.stop, ends, show=args.stream)
    if args.stream:
        print(text, end="", flush=True)
    ids = tokenizer.encode(text) if text else [tokenizer.eot_token]
    continue_into(samples, model, [ids] * args.num_samples, args.max_new_tokens, args, generator)
    for row, continuation in enumerate(samples.texts):
        print(continuation[samples.shown:] if args.stream and row == 0 else text + continuation, "-" * 40, sep="\n")


# ----------------------------------------------------------------------------- command line
def unescape(text: str) -> str:
    """--prompt's and --stop's escapes \\n, \\t and \\\\, so a shell can pass a newline."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def sampling_args(parser: CommandLine, argv: list[str] | None) -> argparse.Namespace:
    """Add sample.py's and scripts/chat.py's common flags to ``parser`` and parse; a bad value: one line, exit 2."""
    add_weights_flags(parser)
    add, on_off = parser.add_argument, argparse.BooleanOptionalAction
    add("--num-samples", "--num_samples", type=int, default=1, help="samples, generated as one batch")
    add("--max-new-tokens", "--max_new_tokens", type=int, default=500, help="tokens per sample (or chat reply)")
    add("--temp", "--temperature", type=float, default=0.8, help="0 = greedy argmax")
    add("--top-k", "--top_k", type=int, default=0, help="0 = no top-k filter")
    add("--top-p", "--top_p", type=float, default=1.0, help="1.0 = no nucleus filter")
    add("--stop", action="append", default=[], type=unescape, metavar="STR", help="end before STR (\\n: newline)")
    add("--stop-at-eot", "--stop_at_eot", action=on_off, default=True, help="end a sample at an end-of-text token")
    add("--seed", type=int, default=1337, help="seeds the sampler's own torch.Generator")
    add("--stream", action=on_off, default=None, help="print sample 1 as it grows (default: if stdout is a terminal)")
    add("--cache", action=on_off, default=True, help="KV cache; --no-cache: a full forward per token, same text")
    add("--device", default="auto", help=FIELD_HELP["device"])
    add("--threads", type=int, default=0, help=FIELD_HELP["threads"])
    args = parser.parse_args(argv)
    for flag, value, must, ok in (("--temp", args.temp, ">= 0 and finite", 0 <= args.temp < math.inf),
                                  ("--top-k", args.top_k, ">= 0", args.top_k >= 0),
                                  ("--top-p", args.top_p, "in (0, 1]", 0 < args.top_p <= 1),
                                  ("--num-samples", args.num_samples, ">= 1", args.num_samples >= 1),
                                  ("--max-new-tokens", args.max_new_tokens, ">= 1", args.max_new_tokens >= 1),
                                  ("--threads", args.threads, ">= 0", args.threads >= 0),
                                  ("--seed", args.seed, "in [0, 2**32 - 1]", 0 <= args.seed < 2**32),
                                  ("--stop", '""', "a non-empty string", all(args.stop))):
        if not ok:
            fail(f"{flag} must be {must}, got {value}")
    args.stream = sys.stdout.isatty() if args.stream is None else args.stream
    with exit_on_errors():  # more threads than cores
        use_threads(args.threads)
    return args


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", type=unescape,
                        help="text to continue (\\n: newline; default: a newline / <|endoftext|>)")
    prompt.add_argument("--prompt-file", "--prompt_file", default="", help="UTF-8 file whose text to continue")
    args = sampling_args(parser, argv)
    try:
        with exit_on_errors():  # a bad checkpoint, config, device or prompt: one line and its exit code
            loaded, text = from_flags(args, pick_device(args.device)), args.prompt
            if args.prompt_file:
                try:
                    text = Path(args.prompt_file).read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as err:
                    why = f"not UTF-8 text (byte {err.start})" if isinstance(err, UnicodeDecodeError) else err.strerror
                    raise DataError(f"{args.prompt_file}: {why}; pass an existing UTF-8 text file with --prompt-file")
            loaded.tokenizer.encode(text)  # a character the vocabulary lacks: one line now, before any output
            model = loaded.model
            print(f"# sampling from {loaded.source}; block_size {model.config.block_size}: past it the window slides")
            generator = torch.Generator(device=next(model.parameters()).device).manual_seed(args.seed)
            sample(model, loaded.tokenizer, text, args, generator)
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's 130, not a traceback from inside torch
        print(flush=True)
        fail("interrupted; the samples end here", EXIT_INTERRUPTED)


if __name__ == "__main__":
    run_tool(main)  # a closed stdout (| head): quietly, 141
