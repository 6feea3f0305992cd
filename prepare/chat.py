"""Conversations: the chat template, the loss mask it implies, and a .jsonl of conversations prepared as a corpus.

One template for every tokenizer. A conversation is its markers and its turns' text, as token ids:

    <|begin|> <|system|> ... <|end|> <|user|> ... <|end|> <|assistant|> ... <|end|> <|user|> ...

The markers are special tokens after the base vocabulary (tokenizers.ChatTokenizer), never made from text.
What is learned follows from the ids alone (``learned``): a token is a target when the last marker before it
is <|assistant|>, that is an assistant's text and the <|end|> that closes it. The prompt, the other roles'
turns and the padding are targets -1, which the token-normalised loss of train.py does not count. Nothing
stores the mask, so nothing can drift from it.

A line of a .jsonl is ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`` (the
format of OpenAI fine-tuning files and Hugging Face chat datasets) or ``{"prompt": "...", "completion":
"..."}`` (one user turn, one assistant turn). Every line is checked before anything is written: a bad one
is one DataError naming its line. The val split holds whole conversations, by the documents' rule (tokenfiles.is_val).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from prepare.staging import staged_folder
from prepare.tokenfiles import SPLITS, is_val, sha256_of, token_dtype, write_meta
from prepare.tokenizers import ChatTokenizer, CharTokenizer, GPT2Tokenizer, tokenizer_from_meta, train_bpe
from process.errors import DataError
from process.files import atomic_write_text

BEGIN, SYSTEM, USER, ASSISTANT, END = MARKERS = ("<|begin|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
Message = tuple[str, str]  # (role, content)


def chat_tokenizer(base) -> ChatTokenizer:
    """``base`` with the template's markers (itself if it has them already: a chat model fine-tuned again)."""
    return base if isinstance(base, ChatTokenizer) else ChatTokenizer(base, MARKERS)


def render(tokenizer: ChatTokenizer, messages: list[Message], reply: bool = False) -> list[int]:
    """The ids of a conversation; ``reply`` ends them with <|assistant|>: the prompt of the next turn."""
    ids = tokenizer.marker_ids
    out = [ids[BEGIN]]
    for role, content in messages:
        out += [ids[ROLES[role]], *tokenizer.encode(content), ids[END]]
    return out + [ids[ASSISTANT]] if reply else out


def learned(tokens: np.ndarray, tokenizer: ChatTokenizer) -> np.ndarray:
    """(N,) bool: which tokens of a conversation are targets, those whose last marker before is <|assistant|>."""
    markers = np.array(sorted(tokenizer.marker_ids.values()))
    position = np.arange(len(tokens))
    last = np.maximum.accumulate(np.where(np.isin(tokens, markers), position, -1))  # last marker at or before
    before = np.concatenate([[-1], last[:-1]])  # the last marker strictly before each token
    return (before >= 0) & (tokens[np.maximum(before, 0)] == tokenizer.marker_ids[ASSISTANT])


# ----------------------------------------------------------------------------- conversations as rows of a batch
def check_fit(lengths: np.ndarray, block_size: int, overflow: str, source: tuple[str, list[int]]) -> None:
    """Refuse (or, truncating, count once) the conversations longer than block_size + 1 tokens."""
    long, (path, lines) = np.flatnonzero(lengths > block_size + 1), source
    if len(long) and overflow == "refuse":
        where = f"{path}:{lines[long[0]]}" if len(lines) == len(lengths) else f"{path}, conversation {long[0]}"
        raise DataError(f"{where}: a conversation of {lengths[long[0]]} tokens ({len(long)} such in all) does not fit "
                        f"block_size + 1 = {block_size + 1}; pass --chat_overflow truncate to cut them there (their "
                        "tails are not learned), a larger --block_size, or shorten them")
    if len(long):
        print(f"{path}: {len(long)} of {len(lengths)} conversations cut at block_size + 1 = {block_size + 1} tokens")


def conversation_rows(rows: list[np.ndarray], tokenizer, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Conversations (each T_i + 1 tokens) -> inputs and targets, (B, width) each: a target is the next token where
    it is learned, else -1, as is the padding (inputs 0)."""
    x = torch.zeros(len(rows), width, dtype=torch.long)
    y = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        row = np.asarray(row, dtype=np.int64)
        x[i, : len(row) - 1] = torch.from_numpy(row[:-1])
        y[i, : len(row) - 1] = torch.from_numpy(np.where(learned(row, tokenizer)[1:], row[1:], -1))
    return x, y  # (B, width) each


def is_chat(corpus) -> bool:
    """A prepared corpus of conversations (prepare_conversations), not of text."""
    return corpus.meta.get("format") == "conversations"


def chat_source(corpus, split: str) -> tuple[str, list[int]]:
    """(the .jsonl a chat corpus was made from, each of the split's conversations' line in it)."""
    return corpus.meta["source"], corpus.meta.get("lines", {}).get(split, [])


def val_rows(corpus, tokenizer: ChatTokenizer, block_size: int, overflow: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A chat corpus's fixed val windows: one conversation a row, (N, block_size) each, padded and masked."""
    starts = np.flatnonzero(np.asarray(corpus.val) == tokenizer.marker_ids[BEGIN])
    ends = np.append(starts[1:], len(corpus.val))
    check_fit(ends - starts, block_size, overflow, chat_source(corpus, "val"))
    return conversation_rows([corpus.val[s: min(e, s + block_size + 1)] for s, e in zip(starts, ends)], tokenizer,
                             block_size)


# ----------------------------------------------------------------------------- a .jsonl of conversations
def jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(number, line) of every non-blank line of a .jsonl (documents or conversations), decoded from UTF-8 here."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{number}: not UTF-8 ({err.reason} at byte {err.start} of the line)") from None
            if line.strip():
                yield number, line


def is_conversations(path: Path) -> bool:
    """A .jsonl whose first record holds ``messages`` or ``prompt``: conversations, not documents."""
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    try:
        record = json.loads(next(jsonl_lines(path), (0, ""))[1])
    except ValueError:
        return False
    return isinstance(record, dict) and ("messages" in record or "prompt" in record)


def parse_line(text: str, where: str) -> list[Message]:
    """One line's conversation, or a DataError naming ``where`` (file:line) and what is wrong."""
    try:
        record = json.loads(text)
    except ValueError as err:
        raise DataError(f"{where}: not JSON ({err})") from None
    if isinstance(record, dict) and "messages" not in record and "prompt" in record:
        record = {"messages": [{"role": "user", "content": record["prompt"]},
                               {"role": "assistant", "content": record.get("completion")}]}
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise DataError(f"{where}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} or "
                        '{"prompt": ..., "completion": ...}')
    messages = [parse_message(m, where, i) for i, m in enumerate(record["messages"])]
    if not any(role == "assistant" for role, _ in messages):
        raise DataError(f"{where}: no assistant turn, so nothing to learn; give each conversation one or more")
    return messages


def parse_message(message, where: str, index: int) -> Message:
    if not isinstance(message, dict) or "role" not in message:
        raise DataError(f"{where}: message {index} has no role (each is {{\"role\": ..., \"content\": ...}})")
    role, content = message["role"], message.get("content")
    if role not in ROLES:
        raise DataError(f"{where}: message {index} has role {role!r}; use one of {', '.join(ROLES)}")
    if role == "system" and index:
        raise DataError(f"{where}: message {index} is a system message; only the first may be")
    if not isinstance(content, str):
        raise DataError(f"{where}: message {index} ({role}) has content {type(content).__name__}, not a string")
    if role == "assistant" and not content:
        raise DataError(f"{where}: message {index} is an empty assistant turn; it would teach the model to say "
                        "nothing")
    return role, content


def read_conversations(path: Path) -> tuple[list[list[Message]], list[int]]:
    """Every conversation of ``path`` and its line number; the whole file is checked first."""
    conversations, lines = [], []
    for number, text in jsonl_lines(path):
        conversations.append(parse_line(text, f"{path}:{number}"))
        lines.append(number)
    if not conversations:
        raise DataError(f"{path}: no conversations in the file")
    return conversations, lines


def split_indices(n: int, val_fraction: float) -> dict[str, list[int]]:
    """The indices of n conversations in each split, by the documents' rule (tokenfiles.is_val)."""
    val = [is_val(i, val_fraction) for i in range(n)]
    return {split: [i for i in range(n) if val[i] == (split == "val")] for split in SPLITS}


def conversation_tokenizer(kind: str, base_meta: dict | None, conversations: list[list[Message]],
                           train: list[int], data_dir: Path, bpe_vocab_size: int, source: str) -> ChatTokenizer:
    """The fine-tuned model's tokenizer (base_meta), or one of ``kind`` made as from scratch: the conversations'
    characters, GPT-2's BPE, or a BPE of the ``train`` conversations; with the template's markers."""
    if base_meta is not None:
        base = tokenizer_from_meta(base_meta, data_dir)
    elif kind == "char":
        base = CharTokenizer("".join(sorted({ch for turns in conversations for _, text in turns for ch in text})))
    elif kind == "gpt2":
        base = GPT2Tokenizer(data_dir)
    else:
        base = train_bpe([text for i in train for _, text in conversations[i]], bpe_vocab_size, source)
    return chat_tokenizer(base)


def prepare_conversations(path: Path, data_dir: Path, tokenizer: str, val_fraction: float,
                          base_meta: dict | None = None, bpe_vocab_size: int = 2048) -> Path:
    """Tokenize a .jsonl of conversations once into data_dir (cached by the file's and the tokenizer's hash).
    ``base_meta``: the tokenizer of the model fine-tuned (init_from), whose ids the conversations must use; None makes
    one of kind ``tokenizer``. Each split is its conversations one after another, each starting with <|begin|>;
    meta.json's ``lines`` gives each one's line in the file."""
    conversations, lines = read_conversations(path)
    splits = split_indices(len(conversations), val_fraction)
    if not splits["val"] or not splits["train"]:
        raise DataError(f"{path}: {len(conversations)} conversation(s) cannot make both splits at val_fraction "
                        f"{val_fraction}; add conversations or change --val_fraction")
    tok = conversation_tokenizer(tokenizer, base_meta, conversations, splits["train"], data_dir, bpe_vocab_size,
                                 str(path))
    label = hashlib.sha256(json.dumps(tok.meta(), sort_keys=True).encode()).hexdigest()[:8]
    folder = data_dir / f"{path.stem}-{sha256_of(path)[:12]}-{tok.meta()['kind']}{label}-val{val_fraction!r}"
    if (folder / "meta.json").is_file():
        return folder
    encoded = []
    for conversation, line in zip(conversations, lines):
        try:
            encoded.append(np.array(render(tok, conversation), dtype=np.int64))
        except DataError as err:
            raise DataError(f"{path}:{line}: {err}; the base model's tokenizer cannot write it") from None
    counts = {split: sum(len(encoded[i]) for i in indices) for split, indices in splits.items()}
    with staged_folder(folder) as staging:
        for split, indices in splits.items():
            ids = np.concatenate([encoded[i] for i in indices])
            ids.astype(token_dtype(tok.vocab_size)).tofile(staging / f"{split}.bin")
        write_meta(staging, tok, str(path), val_fraction, counts, format="conversations",
                   lines={split: [lines[i] for i in indices] for split, indices in splits.items()},
                   val_split="conversation i is val when ceil((i+1)*val_fraction) > ceil(i*val_fraction)")
    print(f"prepared {path}: {len(splits['train']):,} train + {len(splits['val']):,} val conversations, "
          f"{counts['train']:,} + {counts['val']:,} tokens -> {folder}")
    return folder


# ----------------------------------------------------------------------------- a built-in demo: the plays' exchanges
SHAKESPEARE_CHAT = "shakespeare_chat"
SPEECH = re.compile(r"([A-Z][A-Z .'-]+)\.\n(.+)", re.S)  # "HELENA.\nWhat is your pleasure, madam?"
MAX_EXCHANGE_CHARS = 58  # both speeches, so a conversation fits small's block_size of 64 with its 6 markers


def exchanges(text: str) -> list[tuple[str, str]]:
    """Pairs of consecutive speeches by two speakers in the plays, both short: a line, and its reply."""
    speeches = [SPEECH.fullmatch(block.strip("\n")) for block in text.split("\n\n")]
    return [(a.group(2), b.group(2)) for a, b in zip(speeches, speeches[1:])
            if a and b and a.group(1) != b.group(1) and len(a.group(2)) + len(b.group(2)) <= MAX_EXCHANGE_CHARS]


def shakespeare_dialogue(data_dir: Path) -> Path:
    """data_dir/shakespeare_chat.jsonl, made once from the built-in plays: each exchange a user turn (a speech)
    and an assistant turn (the reply that follows it in the play)."""
    from prepare.downloads import shakespeare_text

    path = data_dir / f"{SHAKESPEARE_CHAT}.jsonl"
    if not path.is_file():
        lines = [json.dumps({"messages": [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]})
                 for line, reply in exchanges(shakespeare_text(data_dir))]
        atomic_write_text(path, "\n".join(lines) + "\n")  # whole or absent
    return path
