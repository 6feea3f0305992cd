"""Tokenizers beyond the textbook's characters: GPT-2's byte-level BPE, through tiktoken.

data.CharTokenizer is the one to read first; every tokenizer here has its interface (vocab_size, eot_token,
special_ids, encode, encode_array, decode, decode_bytes, meta), and data.tokenizer_from_meta rebuilds any of
them from the description a corpus or checkpoint keeps. Imported only by runs that use one.
"""
from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

import numpy as np

from machinery.tokenfiles import DataError


WHISPER_SDIST = "openai-whisper==20250625"
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_EOT = 50256  # <|endoftext|>


class GPT2Tokenizer:
    """GPT-2's byte-level BPE through tiktoken, built offline when tiktoken cannot download."""

    def __init__(self, cache: Path):
        self.enc = load_gpt2_encoding(cache)
        self.vocab_size = self.enc.n_vocab  # 50257
        self.eot_token = GPT2_EOT
        self.special_ids = frozenset({GPT2_EOT})  # marks where documents meet: no text

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        return np.array(self.encode(text), dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.enc.decode_bytes(ids)

    def meta(self) -> dict:
        return {"kind": "gpt2"}


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
    return {"char": lambda: len(meta.get("chars", "")), "gpt2": lambda: GPT2_EOT + 1}.get(meta.get("kind"),
                                                                                          lambda: None)()
