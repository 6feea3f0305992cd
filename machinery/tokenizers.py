"""Tokenizers beyond the textbook's characters: byte-level BPEs through tiktoken, GPT-2's and your own.

data.CharTokenizer is the one to read first; every tokenizer here has its interface (vocab_size, eot_token,
special_ids, encode, encode_array, decode, decode_bytes, meta), and data.tokenizer_from_meta rebuilds any of
them from the description a corpus or checkpoint keeps. Imported only by runs that use one.
"""
from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path
from typing import Iterable

import numpy as np

from machinery.tokenfiles import DataError


WHISPER_SDIST = "openai-whisper==20250625"
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_EOT = 50256  # <|endoftext|>


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
    """A byte-level BPE trained on a corpus's train split (train_bpe), encoded by tiktoken from its ranks.

    Its description (meta) is the whole tokenizer: the split pattern and each token's bytes in rank order
    (hex), then <|endoftext|>. A checkpoint carries it, as it carries a char vocabulary.
    """

    def __init__(self, meta: dict):
        import tiktoken

        ranks = {bytes.fromhex(token): rank for rank, token in enumerate(meta["ranks"])}
        super().__init__(tiktoken.Encoding(name=f"tinygpt-bpe-{len(ranks) + 1}", pat_str=meta["pattern"],
                                           mergeable_ranks=ranks, special_tokens={EOT_TEXT: len(ranks)}))
        self.description = meta

    def meta(self) -> dict:
        return self.description


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
        raise DataError("--tokenizer bpe trains with rustbpe: pip install rustbpe==0.1.0") from None
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
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks_file = cache / "tokenizers" / "gpt2.tiktoken"
    if not ranks_file.is_file():
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception:  # noqa: BLE001 - no internet (or no tiktoken cache): build it offline
            extract_gpt2_ranks(cache, ranks_file)
    ranks = load_tiktoken_bpe(str(ranks_file), expected_hash=GPT2_TIKTOKEN_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": GPT2_EOT}, explicit_n_vocab=GPT2_EOT + 1)


def extract_gpt2_ranks(cache: Path, ranks_file: Path) -> None:
    """gpt2.tiktoken out of the openai-whisper sdist (from PyPI, the registry reachable everywhere), checked."""
    from machinery.corpora import pip_download_sdist, staging_prefix  # downloads are corpus preparation's

    sdist = pip_download_sdist(WHISPER_SDIST, cache / "downloads", sha256=None)  # the file inside is checked
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
        payload = tar.extractfile(member).read()
    if hashlib.sha256(payload).hexdigest() != GPT2_TIKTOKEN_SHA256:
        raise DataError(f"gpt2.tiktoken inside {sdist} has the wrong sha256; refusing to use it")
    ranks_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = ranks_file.with_name(staging_prefix() + ranks_file.name)  # one per process: never shared
    tmp.write_bytes(payload)
    tmp.replace(ranks_file)


def tokenizer_vocab_size(meta: dict) -> int | None:
    """The vocabulary a tokenizer description implies (None for a kind this repo does not know)."""
    sizes = {"char": lambda: len(meta.get("chars", "")), "gpt2": lambda: GPT2_EOT + 1,
             "bpe": lambda: len(meta.get("ranks", [])) + 1}
    return sizes.get(meta.get("kind"), lambda: None)()
