"""Every tokenizer: one id per character (CharTokenizer), GPT-2's byte-level BPE and your own, and the files
that hand each of them to Hugging Face.

CharTokenizer is the one to read first; every tokenizer has its interface (vocab_size, eot_token, special_ids,
encode, encode_array, decode, decode_bytes, meta), and ``tokenizer_from_meta`` rebuilds any of them from the
description a corpus or checkpoint keeps. The byte-level BPEs are encoded by tiktoken, imported only by runs
that use one. ``tokenizer_files`` writes what transformers' AutoTokenizer loads to the same ids (export_hf),
``read_tokenizer`` reads our own description back from such a folder (init_from).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from process import REPO
from process.errors import DataError, HFError


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


class ChatTokenizer:
    """A tokenizer with role markers after its vocabulary: ``base``'s ids unchanged, then one id per marker.

    The markers are special tokens: ``encode`` never makes them from text (a user who types "<|user|>" types
    text), only the chat template places them (prepare/chat.py). They take the ids base.vocab_size
    onwards, which a model trained on ``base`` holds in its padded embedding rows, or in grown ones.
    """

    def __init__(self, base, markers: tuple[str, ...]):
        self.base, self.markers = base, markers
        self.vocab_size = base.vocab_size + len(markers)
        self.marker_ids = {text: base.vocab_size + i for i, text in enumerate(markers)}  # "<|user|>" -> id
        self.eot_token = base.eot_token
        self.special_ids = frozenset(base.special_ids | set(self.marker_ids.values()))

    def encode(self, text: str) -> list[int]:
        return self.base.encode(text)

    def encode_array(self, text: str) -> np.ndarray:
        return self.base.encode_array(text)

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


# ----------------------------------------------------------------------------- files for Hugging Face
CHARS_FILE = "tinygpt_chars.json"  # a char model's vocabulary: token id i is chars[i]
BPE_FILE = "tinygpt_bpe.json"  # a trained BPE's description (BPETokenizer.meta): pattern and ranks


def tokenizer_files(tokenizer, block_size: int) -> dict[str, Any]:
    """Files AutoTokenizer loads to the same ids as ours: for a byte-level BPE (GPT-2's or one trained here)
    vocab.json, merges.txt and tokenizer_config.json; for a char vocabulary a tokenizer.json (a BPE
    with no merges: each character is its token). Our own description beside them, for init_from."""
    if isinstance(tokenizer, ChatTokenizer):
        return with_markers(tokenizer_files(tokenizer.base, block_size), tokenizer.marker_ids)
    kind = tokenizer.meta()["kind"]
    if kind == "gpt2":
        return bpe_tokenizer_files(tokenizer.enc, block_size)
    if kind == "bpe":
        return {**bpe_tokenizer_files(tokenizer.enc, block_size), BPE_FILE: tokenizer.meta()}
    return {**char_tokenizer_files(tokenizer.chars, block_size),
            CHARS_FILE: {"chars": list(tokenizer.chars),
                         "decode": "token id i is the character chars[i]: text = ''.join(chars[i] for i in ids)"}}


def with_markers(files: dict[str, Any], markers: dict[str, int]) -> dict[str, Any]:
    """A base tokenizer's files and a chat tokenizer's role markers, as special added tokens (never split,
    never made from text): in tokenizer.json (char) or tokenizer_config.json's added_tokens_decoder (BPE)."""
    added = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for text, i in markers.items()]
    files = json.loads(json.dumps(files))  # a copy: the base's files stay as they are
    if "tokenizer.json" in files:
        files["tokenizer.json"]["added_tokens"] += added
    else:
        files["tokenizer_config.json"]["added_tokens_decoder"] = {
            str(token.pop("id")): token for token in added}
    files["tokenizer_config.json"]["additional_special_tokens"] = list(markers)
    return files


# A char model's unknown character (one not in its vocabulary) raises, as our encode does: the tokenizers
# library drops such a character silently when the BPE has no unk_token, and raises "Unk token `...` not found
# in the vocabulary" when it names one its vocabulary lacks. So the export names this one, which no vocabulary
# holds (a token of one character each): no id is added, in-vocabulary text keeps its ids, and the error shows it.
CHAR_UNK = "<unk: a character outside this char model's vocabulary>"


def char_tokenizer_files(chars: str, block_size: int) -> dict[str, Any]:
    """tokenizer.json and tokenizer_config.json of a char vocabulary, for the tokenizers library: a BPE
    model with one token per character and no merges, no normaliser and no pre-tokeniser (so spaces and
    newlines are characters like any other), and a decoder that joins the tokens as they are. A character
    outside the vocabulary raises (CHAR_UNK), never vanishes."""
    model = {"type": "BPE", "dropout": None, "unk_token": CHAR_UNK, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": {ch: i for i, ch in enumerate(chars)}, "merges": []}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                 "pre_tokenizer": None, "post_processor": None, "decoder": {"type": "Fuse"}, "model": model}
    # bos: the newline that starts our samples (config.json's bos_token_id), which lm_eval's hf backend puts
    # before an empty context. It stays text: the vocabulary's own id, encoded and decoded as a newline.
    start = chars[CharTokenizer(chars).eot_token]
    return {"tokenizer.json": tokenizer,
            "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": start,
                                      "clean_up_tokenization_spaces": False, "model_max_length": block_size}}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (Radford et al.'s encoder.py): printable Latin-1
    bytes stand for themselves, the others for chr(256 + n) in byte order, so that no BPE token
    holds whitespace or control characters in vocab.json / merges.txt."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def bpe_parts(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Byte-level BPE of ``token`` using only merges ranked below the token's own rank: the two
    parts whose merge made it (tiktoken's merge loop: always the lowest-ranked adjacent pair)."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        rank, i = min((ranks.get(parts[j] + parts[j + 1], limit), j) for j in range(len(parts) - 1))
        if rank >= limit:
            break
        parts[i: i + 2] = [parts[i] + parts[i + 1]]
    return parts


def bpe_tokenizer_files(enc, block_size: int) -> dict[str, Any]:
    """vocab.json, merges.txt and tokenizer_config.json of a byte-level BPE from its tiktoken ranks (GPT-2's
    or one trained here), offline: a GPT2Tokenizer, whose split pattern is the one both use.

    A token's id is its rank; its merge is the pair BPE meets just before making it (bpe_parts).
    """
    eot = enc.eot_token
    tokens = [enc.decode_single_token_bytes(i) for i in range(eot)]  # id = rank; <|endoftext|> last
    ranks = {t: i for i, t in enumerate(tokens)}
    to_text = bytes_to_unicode()
    show = lambda t: "".join(to_text[b] for b in t)  # noqa: E731
    merges = []
    for token in tokens:
        if len(token) > 1:
            parts = bpe_parts(token, ranks)
            if len(parts) != 2:
                raise HFError(f"BPE token {ranks[token]} ({token!r}) is not the merge of two tokens")
            merges.append(f"{show(parts[0])} {show(parts[1])}")
    vocab = {show(t): i for i, t in enumerate(tokens)} | {EOT_TEXT: eot}
    return {"vocab.json": vocab, "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n",
            "tokenizer_config.json": {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOT_TEXT,
                                      "eos_token": EOT_TEXT, "unk_token": EOT_TEXT, "add_prefix_space": False,
                                      "model_max_length": block_size}}


def read_tokenizer(folder: Path, vocab_size: int) -> dict | None:
    """The tokenizer a folder's weights were trained with, if it can tell: our own description (CHARS_FILE,
    BPE_FILE), GPT-2's by its size, else rebuilt from the standard files another tool saved in their place
    (PEFT's save_pretrained, tokenizer.save_pretrained): tokenizer.json, or vocab.json + merges.txt."""
    if (folder / CHARS_FILE).is_file():
        return read_chars_file(folder / CHARS_FILE, vocab_size)
    if (folder / BPE_FILE).is_file():
        return read_bpe_file(folder / BPE_FILE, vocab_size)
    if vocab_size == GPT2_VOCAB:
        return {"kind": "gpt2"}
    standard = read_standard_files(folder)
    return None if standard is None else meta_from_standard(*standard, str(folder), vocab_size)


def read_chars_file(chars_file: Path, vocab_size: int) -> dict:
    try:
        chars = "".join(json.loads(chars_file.read_text(encoding="utf-8"))["chars"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise HFError(f"{chars_file}: not a tinygpt char list ({type(err).__name__}: {err}); "
                      'it must be JSON {"chars": [...]}') from None
    if len(chars) != vocab_size:
        raise HFError(f"{chars_file}: {len(chars)} characters for a vocabulary of {vocab_size}")
    return {"kind": "char", "chars": chars}


def read_bpe_file(bpe_file: Path, vocab_size: int) -> dict:
    try:
        meta = json.loads(bpe_file.read_text(encoding="utf-8"))
        size = len(meta["ranks"]) + 1 if meta["kind"] == "bpe" and isinstance(meta["pattern"], str) else None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise HFError(f"{bpe_file}: not a tinygpt BPE ({type(err).__name__}: {err})") from None
    if size != vocab_size:
        raise HFError(f"{bpe_file}: a BPE of {size} tokens for a vocabulary of {vocab_size}")
    return meta


def read_standard_files(folder: Path) -> tuple[dict[str, int], list[str], bool] | None:
    """(vocabulary, merges as "a b" lines, byte-level?) from tokenizer.json, else vocab.json + merges.txt
    (a GPT2Tokenizer's, byte-level by definition); None if the folder has neither."""
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
            return vocab, merges, (saved.get("pre_tokenizer") or {}).get("type") == "ByteLevel"
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
            merges = [line for line in lines if line and not line.startswith("#version")]
            return json.loads((folder / "vocab.json").read_text(encoding="utf-8")), merges, True
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise HFError(f"{folder}: its tokenizer files are not readable ({type(err).__name__}: {err})") from None
    return None


def meta_from_standard(vocab: dict[str, int], merges: list[str], byte_level: bool, source: str,
                       vocab_size: int) -> dict:
    """Our description of a tokenizer from its standard files: a char list (no merges, no pre-tokeniser, one
    character a token, sorted, as char_tokenizer_files writes it) or a byte-level BPE whose merges are the ones
    its ids imply (as bpe_tokenizer_files writes them); HFError for any other, which would encode other ids."""
    if sorted(vocab.values()) != list(range(vocab_size)):
        raise HFError(f"{source}: its tokenizer's {len(vocab)} tokens do not have the ids 0..{vocab_size - 1} "
                      "of the weights' vocabulary")
    tokens = sorted(vocab, key=vocab.__getitem__)  # in id order
    if not byte_level and not merges:
        chars = "".join(tokens)
        if len(chars) != vocab_size or chars != "".join(sorted(chars)):
            raise HFError(f"{source}: its tokenizer.json is not a char vocabulary (one character a token, sorted)")
        return {"kind": "char", "chars": chars}
    if not byte_level or tokens[-1] != EOT_TEXT:
        raise HFError(f"{source}: its tokenizer is not a byte-level BPE ending in {EOT_TEXT}, nor a char list")
    to_byte = {text: b for b, text in bytes_to_unicode().items()}
    try:
        ranks = [bytes(to_byte[ch] for ch in token) for token in tokens[:-1]]
    except KeyError:
        raise HFError(f"{source}: a token of its vocabulary is not in byte-level form") from None
    if len({token for token in ranks if len(token) == 1}) != BYTES:
        raise HFError(f"{source}: its BPE lacks some of the {BYTES} single bytes: not every text encodes")
    meta = {"kind": "bpe", "pattern": bpe_pattern(), "ranks": [token.hex() for token in ranks]}
    implied = bpe_tokenizer_files(BPETokenizer(meta).enc, 0)["merges.txt"].splitlines()[1:]
    if implied != merges:
        raise HFError(f"{source}: its merges are not the ones its ids imply (rank order): tiktoken would encode "
                      "other ids than transformers")
    return meta


NO_TOKENIZER = (f"known: GPT-2's BPE, {GPT2_VOCAB} tokens; our {CHARS_FILE} or {BPE_FILE}; or the standard "
                "tokenizer.json, or vocab.json + merges.txt, of a char list or a byte-level BPE")


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """UTF-8 bytes each id decodes to, (vocab_size,) int64: the denominator of bits per byte.

    Special tokens (GPT-2's <|endoftext|>) count 0 bytes: they mark where documents meet and are no text, so
    bits per byte measures the corpus's own bytes (their cost stays in the numerator). Built once per run.
    """
    special = set(tokenizer.special_ids)
    return torch.tensor([0 if i in special else len(tokenizer.decode_bytes([i]))
                         for i in range(tokenizer.vocab_size)], dtype=torch.long)


def document_separator(tokenizer) -> int | None:
    """The id that begins each document of a prepared corpus (prepare/documents.py, encode_document): GPT-2's or a
    BPE's <|endoftext|>, a char vocabulary's newline; None for a char vocabulary without a newline."""
    eot = tokenizer.eot_token
    return eot if eot in tokenizer.special_ids or tokenizer.decode([eot]) == "\n" else None
