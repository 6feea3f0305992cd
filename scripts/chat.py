"""Talk to a checkpoint from the terminal, loaded once: a conversation with a chat model, else each prompt continued.

    python -m scripts.chat --ckpt out/chat_small                      # a conversation: your turn a line
    python -m scripts.chat --ckpt out/chat_small --system "Be brief." # a system prompt, kept however long the talk
    python -m scripts.chat --ckpt out/small --multiline               # a text model: a prompt ends at an empty line

A model fine-tuned on conversations has chat markers; the first line says which mode. Ctrl-D, or Ctrl-C at a prompt,
quits."""
import sys

if not __package__:  # run as a file, `python scripts/chat.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.chat", file=sys.stderr)
    sys.exit(2)

import argparse
import io

import torch

import sample
from checkpoint import from_flags
from cli import CommandLine, ConfigError, DataError, exit_on_errors, run_tool
from model import GPT
from runtime import pick_device
from tokenizer import render


def read_prompt(multiline: bool) -> str | None:
    """The next prompt on stdin: a line, or with ``multiline`` the lines up to an empty one; None: quit."""
    mark = "> " if sys.stdin.isatty() else ""  # a marker only for a person at a terminal
    lines: list[str] = []
    try:
        while True:
            line = input(mark if not lines else "")
            if not multiline:
                return line
            if line == "" and lines:
                return "\n".join(lines)
            lines.append(line)
    except EOFError:
        return "\n".join(lines) if lines else None
    except KeyboardInterrupt:
        return None


def continue_each(model: GPT, tokenizer, args: argparse.Namespace, generator: torch.Generator) -> None:
    """A text model: each prompt continued (streamed, as sample.py does), until Ctrl-D or Ctrl-C at the prompt."""
    while (text := read_prompt(args.multiline)) is not None:
        try:
            sample.sample(model, tokenizer, text, args, generator)
        except DataError as err:  # a character the vocabulary lacks: say so, ask again
            print(f"error: {err}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # Ctrl-C while generating: this continuation ends here
            print("\n" + "-" * 40, flush=True)


class Dialogue:
    """A conversation that fits block_size with ``room`` tokens for the reply: the oldest turns go first (counted in
    ``dropped``), never the system prompt; a system prompt that leaves no room is a ConfigError at once."""

    def __init__(self, tokenizer, block_size: int, room: int, system: str = ""):
        self.tokenizer, self.block_size, self.room = tokenizer, block_size, room
        self.system = [("system", system)] if system else []
        self.turns: list[tuple[str, str]] = []  # (role, text)
        self.dropped = 0
        if system:
            n = len(render(tokenizer, self.system))  # DataError: a character the vocabulary lacks
            message = len(render(tokenizer, [("user", "")], reply=True))  # = 3 markers + a token (<|begin|> is in n)
            if n > (most := block_size - room - message):
                raise ConfigError(f"the system prompt is {n} tokens with its markers, and block_size {block_size} "
                                  f"leaves room for {most} beside a message and a {room}-token reply; shorten --system")

    def prompt(self, user: str) -> list[int]:
        """The ids asking for the reply to ``user``, oldest turns dropped; a DataError leaves the turns as they were."""
        limit = self.block_size - self.room
        if len(alone := render(self.tokenizer, self.system + [("user", user)], reply=True)) > limit:
            raise DataError(f"the message makes a prompt of {len(alone)} tokens with the conversation's markers"
                            f"{' and the system prompt' if self.system else ''}, more than the {limit} the context "
                            f"leaves beside a reply; say it shorter")
        self.turns.append(("user", user))
        while len(ids := render(self.tokenizer, self.system + self.turns, reply=True)) > limit:
            self.turns.pop(0)  # ends at the last user turn at the latest: that alone fits
            self.dropped += 1
        return ids

    def reply(self, text: str) -> None:
        self.turns.append(("assistant", text))


def open_dialogue(tokenizer, block_size: int, args: argparse.Namespace) -> Dialogue:
    """The empty conversation: a reply may take up to half the context (or --max-new-tokens)."""
    return Dialogue(tokenizer, block_size, min(args.max_new_tokens, block_size // 2), args.system)


def converse(model: GPT, tokenizer, args: argparse.Namespace, generator: torch.Generator) -> None:
    """A chat model: a conversation on stdin, each reply streamed until any marker (never the user's part)."""
    block_size, warned = model.config.block_size, False
    dialogue = open_dialogue(tokenizer, block_size, args)
    while (text := read_prompt(args.multiline)) is not None:
        try:
            prompt = dialogue.prompt(text)
        except DataError as err:  # a character the vocabulary lacks, a message too long: say so, ask again
            print(f"error: {err}", file=sys.stderr, flush=True)
            continue
        if dialogue.dropped and not warned:
            stays = "; the system prompt stays" if dialogue.system else ""
            print(f"(the conversation and a {dialogue.room}-token reply no longer fit block_size {block_size}: the "
                  f"oldest turns are dropped from now on{stays})", flush=True)
            warned = True
        reply = sample.Continuations(tokenizer, 1, [], set(tokenizer.marker_ids.values()), show=True)
        # Never past the window's end: a reply that slid it would lose its own prompt.
        cap = min(args.max_new_tokens, block_size - len(prompt))
        try:
            sample.continue_into(reply, model, [prompt], cap, args, generator)
        except KeyboardInterrupt:  # Ctrl-C while it replies: the reply ends here, the conversation goes on
            reply.finish()
        print(reply.texts[0][reply.shown:], flush=True)
        dialogue.reply(reply.texts[0])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", default="", help="a chat model's system prompt, kept however long the talk")
    parser.add_argument("--multiline", action="store_true", help="a prompt is every line up to an empty line")
    return sample.sampling_args(parser, argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_errors():  # a bad checkpoint, config, device or system prompt: one line and its exit code
        loaded = from_flags(args, pick_device(args.device))
        model, tokenizer = loaded.model, loaded.tokenizer
        is_chat = hasattr(tokenizer, "marker_ids")  # a model fine-tuned on conversations
        if is_chat:  # a system prompt the vocabulary cannot write or the context cannot hold: now, not at turn 1
            open_dialogue(tokenizer, model.config.block_size, args)
            if given := [flag for flag, unset in (("--num-samples", args.num_samples == 1), ("--stop", not args.stop),
                                                  ("--no-stop-at-eot", args.stop_at_eot)) if not unset]:
                raise ConfigError(f"{given[0]} does nothing in a conversation (a reply ends at a marker); drop it")
        elif args.system:
            raise ConfigError(f"{loaded.source} has no chat markers, so no system prompt; fine-tune it on "
                              f"conversations first (docs/finetuning.md) or drop --system")
    each = "up to an empty line" if args.multiline else "a line"
    doing = (f"a conversation with {loaded.source}: your turn {each}; the oldest turns go when block_size "
             f"{model.config.block_size} fills" if is_chat else
             f"continuing each prompt with {loaded.source} (no chat markers): a prompt {each}; block_size "
             f"{model.config.block_size}: past it the window slides")
    print(f"# {doing}; Ctrl-D quits", flush=True)
    if isinstance(sys.stdin, io.TextIOWrapper):  # a byte that is not UTF-8 comes as U+FFFD, never as a traceback
        sys.stdin.reconfigure(errors="replace")
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(args.seed)
    (converse if is_chat else continue_each)(model, tokenizer, args, generator)


if __name__ == "__main__":
    run_tool(main)
