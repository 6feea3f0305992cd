"""A tokenizer's files in a Hugging Face folder, both ways: written by the export so that transformers'
AutoTokenizer makes our ids (``tokenizer_files``), read back by --init_from from a folder (``read_tokenizer``).

A byte-level BPE (GPT-2's or one trained here) is a GPT2Tokenizer: vocab.json, merges.txt, tokenizer_config.json. A
token is named by GPT-2's printable stand-ins for its bytes (BYTE_TEXT) and its id is its rank; its merge is the pair
BPE meets just before making it (``bpe_merges``). A char vocabulary is a tokenizer.json: a BPE with one token per
character and no merges. Both ways use these names and this merge rule: a BPE read back is accepted only if its merges
are the ones ``bpe_merges`` writes for its ids. Our own description rides beside the standard files (OWN_FILES) and
is read first.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prepare.chat import ASSISTANT, BEGIN, END, MARKERS, ROLES
from prepare.tokenizers import BYTES, EOT_TEXT, GPT2_VOCAB, ChatTokenizer, bpe_pattern, tokenizer_vocab_size
from process.errors import HFError

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


def byte_text(token: bytes) -> str:
    """A token's name in vocab.json, merges.txt and a GGUF: its bytes' printable stand-ins."""
    return "".join(BYTE_TEXT[b] for b in token)


def bpe_tokens(tokenizer) -> list[bytes]:
    """A tiktoken BPE's tokens in id (= rank) order, <|endoftext|> (the last id) left out."""
    return [tokenizer.enc.decode_single_token_bytes(i) for i in range(tokenizer.eot_token)]


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


# ----------------------------------------------------------------------------- writing (export)
def tokenizer_files(tokenizer, block_size: int) -> dict[str, Any]:
    """Files AutoTokenizer loads to the same ids as ours (file name -> JSON object or text), with our own
    description beside them (OWN_FILES; GPT-2's needs none) for init_from; a chat tokenizer's markers added."""
    if isinstance(tokenizer, ChatTokenizer):
        return with_markers(tokenizer_files(tokenizer.base, block_size), tokenizer.marker_ids)
    meta = tokenizer.meta()
    if meta["kind"] == "char":
        decode = "token id i is the character chars[i]: text = ''.join(chars[i] for i in ids)"
        return {**char_files(tokenizer, block_size), CHARS_FILE: {"chars": list(tokenizer.chars), "decode": decode}}
    files = bpe_files(bpe_tokens(tokenizer), block_size)
    return files if meta["kind"] == "gpt2" else {**files, BPE_FILE: meta}


def bpe_files(tokens: list[bytes], block_size: int) -> dict[str, Any]:
    """vocab.json, merges.txt and tokenizer_config.json of a byte-level BPE's tokens (then <|endoftext|>): a
    GPT2Tokenizer, whose split pattern is the one our BPEs use (tokenizers.bpe_pattern)."""
    return {"vocab.json": {byte_text(t): i for i, t in enumerate(tokens)} | {EOT_TEXT: len(tokens)},
            "merges.txt": "#version: 0.2\n" + "\n".join(bpe_merges(tokens)) + "\n",
            "tokenizer_config.json": {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOT_TEXT,
                                      "eos_token": EOT_TEXT, "unk_token": EOT_TEXT, "add_prefix_space": False,
                                      "model_max_length": block_size}}


def char_files(tokenizer, block_size: int) -> dict[str, Any]:
    """tokenizer.json and tokenizer_config.json of a char vocabulary: a BPE with one token per character, no merges,
    no normaliser and no pre-tokeniser (spaces and newlines are characters like any other), a decoder that joins
    the tokens as they are, and CHAR_UNK, so that a character outside the vocabulary raises, never vanishes."""
    model = {"type": "BPE", "dropout": None, "unk_token": CHAR_UNK, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": {ch: i for i, ch in enumerate(tokenizer.chars)}, "merges": []}
    # bos: the newline that starts our samples (config.json's bos_token_id), which lm_eval's hf backend puts
    # before an empty context. It stays text: the vocabulary's own id, encoded and decoded as a newline.
    return {"tokenizer.json": {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                               "normalizer": None, "pre_tokenizer": None, "post_processor": None,
                               "decoder": {"type": "Fuse"}, "model": model},
            "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                      "bos_token": tokenizer.chars[tokenizer.eot_token],
                                      "clean_up_tokenization_spaces": False, "model_max_length": block_size}}


def with_markers(files: dict[str, Any], markers: dict[str, int]) -> dict[str, Any]:
    """A base tokenizer's files and a chat tokenizer's role markers, as special added tokens (never split,
    never made from text): in tokenizer.json (char) or tokenizer_config.json's added_tokens_decoder (BPE);
    and the template (chat_template), so that transformers' apply_chat_template makes our ids. The start token is
    <|begin|>: transformers skips bos when it decodes a reply, and a char base's (a newline, or a space) is text."""
    added = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for text, i in markers.items()]
    files = json.loads(json.dumps(files))  # a copy: the base's files stay as they are
    if "tokenizer.json" in files:
        files["tokenizer.json"]["added_tokens"] += added
    else:
        files["tokenizer_config.json"]["added_tokens_decoder"] = {str(token.pop("id")): token for token in added}
    files["tokenizer_config.json"]["additional_special_tokens"] = list(markers)
    files["tokenizer_config.json"]["bos_token"] = BEGIN
    files["tokenizer_config.json"]["chat_template"] = chat_template()
    return files


def chat_template() -> str:
    """prepare/chat.py's template as Jinja: apply_chat_template renders the same markers around the same texts. An
    empty conversation or a role outside ROLES raises, as the data's reading refuses them (prepare/chat.py):
    raise_exception is the error a template raises, which transformers and llama-cpp-python define (both tested)."""
    known = ", ".join(ROLES)
    roles = "".join(f"{{%- {'elif' if i else 'if'} message['role'] == '{role}' %}}{{{{ '{marker}' }}}}"
                    for i, (role, marker) in enumerate(ROLES.items()))
    return (f"{{%- if not messages %}}{{{{ raise_exception('no messages: a conversation needs a turn') }}}}"
            f"{{%- endif %}}{{{{- '{BEGIN}' }}}}{{%- for message in messages %}}{roles}{{%- else %}}"
            f"{{{{ raise_exception('role ' + message['role'] + ' is not one of {known}') }}}}{{%- endif %}}"
            f"{{{{ message['content'] + '{END}' }}}}{{%- endfor %}}"
            f"{{%- if add_generation_prompt %}}{{{{ '{ASSISTANT}' }}}}{{%- endif %}}")


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
    """prepare/chat.py's markers if the folder's tokenizer_config.json lists them as its special tokens, else []."""
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
