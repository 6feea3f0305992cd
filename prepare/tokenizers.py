"""Every tokenizer a run uses: one id per character (CharTokenizer), GPT-2's byte-level BPE and your own, and a
chat model's role markers after any of them (ChatTokenizer).

CharTokenizer is the one to read first; every tokenizer has its interface (vocab_size, eot_token, special_ids,
encode, encode_array, decode, decode_bytes, meta), and ``tokenizer_from_meta`` rebuilds any of them from the
description a corpus or checkpoint keeps. The byte-level BPEs are encoded by tiktoken, imported only by runs
that use one. Their files for Hugging Face are weights/hf_tokenizer.py's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from process import REPO
from process.errors import DataError, install_hint


class CharTokenizer:
    """One id per character, the vocabulary being the sorted set of characters of the corpus."""

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.eot_token = self.stoi.get("\n", 0)  # a newline is the natural "start" of char text
        self.special_ids = frozenset()  # every id is a character of text

    def encode(self, text: str) -> list[int]:
        missing = sorted(set(text) - self.stoi.keys())
        if missing:
            raise DataError(f"characters not in the model's vocabulary: {''.join(missing)!r}")
        return [self.stoi[ch] for ch in text]

    def encode_array(self, text: str) -> np.ndarray:
        """Fast vectorised encode for whole corpora."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # sorted, since chars is
        ids = np.searchsorted(table, codes)
        if len(codes) and (ids.max() >= len(table) or not np.array_equal(table[ids], codes)):
            return np.array(self.encode(text), dtype=np.int64)  # raises with the missing chars
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def decode_bytes(self, ids: list[int]) -> bytes:
        """UTF-8 bytes of decode(ids); every tokenizer has this, so streaming code needs one path."""
        return self.decode(ids).encode("utf-8")

    def meta(self) -> dict:
        return {"kind": "char", "chars": self.chars}


GPT2_EOT = 50256  # <|endoftext|>
GPT2_VOCAB = GPT2_EOT + 1  # GPT-2's BPE: 50256 byte-level tokens, then <|endoftext|>


class TiktokenTokenizer:
    """A byte-level BPE encoded by tiktoken: every text has an encoding, every id list a decoding (as bytes)."""

    def __init__(self, enc):
        self.enc = enc
        self.vocab_size = enc.n_vocab
        self.eot_token = enc.eot_token  # <|endoftext|>, the last id: the separator of documents
        self.special_ids = frozenset({self.eot_token})  # marks where documents meet: no text

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)  # "<|endoftext|>" in a text is text, not the separator

    def encode_array(self, text: str) -> np.ndarray:
        return np.array(self.encode(text), dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.enc.decode_bytes(ids)


class GPT2Tokenizer(TiktokenTokenizer):
    """GPT-2's byte-level BPE through tiktoken, built offline when tiktoken cannot download."""

    def __init__(self, cache: Path):
        super().__init__(load_gpt2_encoding(cache))  # 50257 tokens

    def meta(self) -> dict:
        return {"kind": "gpt2"}


class BPETokenizer(TiktokenTokenizer):
    """A byte-level BPE trained on a corpus's train split (train_bpe), encoded by tiktoken from its ranks. Its
    description (meta) is the whole tokenizer: the split pattern and each token's bytes in rank order (hex), then
    <|endoftext|>. A checkpoint carries it, as it carries a char vocabulary."""

    def __init__(self, meta: dict):
        import tiktoken

        ranks = {bytes.fromhex(token): rank for rank, token in enumerate(meta["ranks"])}
        super().__init__(tiktoken.Encoding(name=f"tinygpt-bpe-{len(ranks) + 1}", pat_str=meta["pattern"],
                                           mergeable_ranks=ranks, special_tokens={EOT_TEXT: len(ranks)}))
        self.description = meta

    def meta(self) -> dict:
        return self.description


class ChatTokenizer:
    """A tokenizer with role markers after its vocabulary: ``base``'s ids unchanged, then one id per marker. The markers
    are special tokens: ``encode`` never makes them from text (a user who types "<|user|>" types text), only the chat
    template places them (prepare/chat.py). They take the ids base.vocab_size onwards, which a model trained on ``base``
    holds in its padded embedding rows, or in grown ones."""

    def __init__(self, base, markers: tuple[str, ...]):
        self.base, self.markers = base, markers
        self.vocab_size = base.vocab_size + len(markers)
        self.marker_ids = {text: base.vocab_size + i for i, text in enumerate(markers)}  # "<|user|>" -> id
        self.eot_token = base.eot_token
        self.special_ids = frozenset(base.special_ids | set(self.marker_ids.values()))
        self.encode, self.encode_array = base.encode, base.encode_array  # text is the base's: no marker from it

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The base's bytes, with each marker written as its text (a marker is no text, but a log shows it)."""
        out, run = [], []
        for i in ids:
            if i < self.base.vocab_size:
                run.append(i)
                continue
            out.append(self.base.decode_bytes(run))
            out.append(self.markers[i - self.base.vocab_size].encode())
            run = []
        return b"".join([*out, self.base.decode_bytes(run)])

    def meta(self) -> dict:
        return {**self.base.meta(), "chat_tokens": list(self.markers)}


EOT_TEXT = "<|endoftext|>"
BYTES = 256  # a byte-level BPE starts from every byte: its smallest vocabulary is these and <|endoftext|>


def bpe_pattern() -> str:
    """How text is split before merging: GPT-2's (letters, digits, punctuation runs, spaces kept in front),
    so that a merge never crosses a word and the export is a GPT2Tokenizer with identical ids."""
    from tiktoken_ext.openai_public import r50k_pat_str

    return r50k_pat_str


def train_bpe(texts: Iterable[str], vocab_size: int, source: str) -> BPETokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (256 bytes, vocab_size - 257 merges, <|endoftext|>)
    on ``texts`` with rustbpe: deterministic, the same texts give the same merges. DataError if the
    texts hold fewer distinct pairs to merge than asked for."""
    try:
        import rustbpe
    except ImportError:
        raise DataError(f"--tokenizer bpe trains with rustbpe: {install_hint('rustbpe')}") from None
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), vocab_size - 1, pattern=bpe_pattern())  # the last id: <|endoftext|>
    ranks = sorted(trainer.get_mergeable_ranks(), key=lambda pair: pair[1])
    if len(ranks) < vocab_size - 1:
        raise DataError(f"{source}: its train split has only {len(ranks) - BYTES} distinct merges, not the "
                        f"{vocab_size - 1 - BYTES} that --bpe_vocab_size {vocab_size} needs; use at most "
                        f"--bpe_vocab_size {len(ranks) + 1}, or more text")
    return BPETokenizer({"kind": "bpe", "pattern": bpe_pattern(), "ranks": [token.hex() for token, _ in ranks]})


def load_gpt2_encoding(cache: Path):
    """tiktoken's "gpt2"; offline, the same ranks from the file inside the openai-whisper sdist."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from prepare.downloads import GPT2_TIKTOKEN_SHA256, extract_gpt2_ranks

    ranks_file = cache / "tokenizers" / "gpt2.tiktoken"
    if not ranks_file.is_file():
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception:  # noqa: BLE001 - no internet (or no tiktoken cache): build it offline
            extract_gpt2_ranks(cache, ranks_file)
    ranks = load_tiktoken_bpe(str(ranks_file), expected_hash=GPT2_TIKTOKEN_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=bpe_pattern(), mergeable_ranks=ranks,
                             special_tokens={EOT_TEXT: GPT2_EOT}, explicit_n_vocab=GPT2_VOCAB)


def tokenizer_vocab_size(meta: dict) -> int | None:
    """The vocabulary a tokenizer description implies (None for a kind this repo does not know)."""
    sizes = {"char": lambda: len(meta.get("chars", "")), "gpt2": lambda: GPT2_VOCAB,
             "bpe": lambda: len(meta.get("ranks", [])) + 1}
    base = sizes.get(meta.get("kind"), lambda: None)()
    return None if base is None else base + len(meta.get("chat_tokens", []))


def without_chat(meta: dict) -> dict:
    """The description of a chat tokenizer's base (ChatTokenizer.base): itself for any other."""
    return {key: value for key, value in meta.items() if key != "chat_tokens"}


def data_home(data_dir: str | Path) -> Path:
    """data_dir as the folder it names: an absolute one as given, a relative one under the repo (where the
    default, data/, is), so that a command run from another folder uses the same cache, not a new ./data."""
    path = Path(data_dir).expanduser()
    return path if path.is_absolute() else REPO / path


def tokenizer_from_meta(meta: dict, cache: Path = Path("data")):
    """Rebuild the tokenizer a corpus or checkpoint was made with; GPT-2's ranks are cached in ``cache``
    (a data_dir: a relative one is under the repo, data_home)."""
    cache = data_home(cache)
    if "chat_tokens" in meta:  # a chat model: its base tokenizer, then the role markers
        return ChatTokenizer(tokenizer_from_meta(without_chat(meta), cache), tuple(meta["chat_tokens"]))
    if meta["kind"] == "char":
        return CharTokenizer(meta["chars"])
    if meta["kind"] in ("gpt2", "bpe"):  # tiktoken is imported by them: only runs that use one import it
        return GPT2Tokenizer(cache) if meta["kind"] == "gpt2" else BPETokenizer(meta)
    raise DataError(f"unknown tokenizer kind {meta['kind']!r}")


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """UTF-8 bytes each id decodes to, (vocab_size,) int64: the denominator of bits per byte. Special tokens (GPT-2's
    <|endoftext|>) count 0 bytes: they mark where documents meet and are no text, so bits per byte measures the corpus's
    own bytes (their cost stays in the numerator). Built once per run."""
    special = set(tokenizer.special_ids)
    return torch.tensor([0 if i in special else len(tokenizer.decode_bytes([i]))
                         for i in range(tokenizer.vocab_size)], dtype=torch.long)


def document_separator(tokenizer) -> int | None:
    """The id that begins each document of a prepared corpus (prepare/documents.py, encode_document): GPT-2's or a
    BPE's <|endoftext|>, a char vocabulary's newline; None for a char vocabulary without a newline."""
    eot = tokenizer.eot_token
    return eot if eot in tokenizer.special_ids or tokenizer.decode([eot]) == "\n" else None
