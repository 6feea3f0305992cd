"""A corpus of documents (a folder, a .jsonl, a .parquet: prepare/formats.py) tokenized by a pool of worker
processes and streamed into train.bin and val.bin: memory holds one batch of documents, whatever the corpus size.

    python -m prepare --data_path web.jsonl --tokenizer gpt2 --num_proc 8

Each document is preceded by the tokenizer's separator (``eot_token``), so the model sees where documents
meet: GPT-2's <|endoftext|>, or for a char vocabulary a newline (see ``encode_document``). A char
vocabulary is the set of the corpus's characters, so it costs one more streaming pass first
(``corpus_chars``), and a BPE trained here one more pass over the train documents: the corpus is read
twice, fine at laptop scale. The val split is one document in every 1/val_fraction, starting with the
first (0.1: documents 0, 10, 20, ...; see ``is_val_document``): it needs no pass over the corpus in advance
and spreads val over all of it. A worker gets what every document shares (the tokenizer, the .jsonl field)
with each task, through functools.partial: no module state is set in it.
"""
from __future__ import annotations

import functools
import json
import math
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np
from tqdm import tqdm

from prepare.formats import DEFAULT_TEXT_COLUMN, Source, check_files, document_sources, document_text, has_text_column
from prepare.staging import staged_folder
from prepare.tokenfiles import check_split_lengths, corpus_meta, token_dtype, write_meta
from prepare.tokenizers import CharTokenizer, GPT2Tokenizer, TiktokenTokenizer, tokenizer_from_meta, train_bpe

BATCH_CHARS = 1 << 25  # ~32 MB of text in flight at once: what bounds memory, not the corpus size
T = TypeVar("T")


def is_val_document(index: int, val_fraction: float) -> bool:
    """Document ``index`` (0-based) goes to val when it starts a new multiple of val_fraction.

    Exactly ceil(n * val_fraction) of the first n documents are val (0.1: documents 0, 10, 20, ...);
    there is always at least one, and the split is decided without knowing n.
    """
    return math.ceil(round((index + 1) * val_fraction, 9)) > math.ceil(round(index * val_fraction, 9))


# ----------------------------------------------------------------------------- the pool
def batched_sources(sources: Iterable[Source], max_chars: int) -> Iterator[list[Source]]:
    """Consecutive groups of sources holding about max_chars of text (Source.size)."""
    batch, chars = [], 0
    for source in sources:
        batch.append(source)
        chars += source.size()
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def ignore_sigint() -> None:
    """A worker's initializer: Ctrl-C is the main process's to handle, once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def map_documents(path: Path, work: Callable[[Source], T], num_proc: int,
                  text_column: str = DEFAULT_TEXT_COLUMN) -> Iterator[T]:
    """``work(source)`` of every document of ``path``, in corpus order, from a pool of ``num_proc`` workers.

    Sources go to the pool one bounded batch at a time (Pool.imap alone would read the whole input
    ahead into its task queue), so memory does not grow with the corpus.
    """
    with multiprocessing.Pool(num_proc, initializer=ignore_sigint) as pool:
        for batch in batched_sources(document_sources(path, text_column), BATCH_CHARS):
            yield from pool.imap(work, batch, chunksize=max(1, len(batch) // (4 * num_proc)))


@functools.cache
def worker_tokenizer(tokenizer_meta: str, cache: str) -> CharTokenizer | TiktokenTokenizer:
    """The tokenizer of a meta.json entry (as JSON, so hashable), built once per process and then reused:
    a worker builds it for its first document (GPT-2's ranks are read once, not once a batch)."""
    return tokenizer_from_meta(json.loads(tokenizer_meta), Path(cache))


def document_chars(source: Source, text_column: str) -> str:
    """The distinct characters of one document, in no order. In a worker (corpus_chars)."""
    return "".join(set(document_text(source, text_column)))


def encode_document(source: Source, tokenizer_meta: str, cache: str, text_column: str) -> np.ndarray:
    """The separator then the document's token ids; empty for an empty document. In a worker.

    The separator is the tokenizer's eot_token: GPT-2's <|endoftext|>, a token that is no text. A char
    vocabulary has no such token, and a reserved character would be one that no document holds, yet
    counted as a byte of the corpus in bits per byte and printed in samples. So a char corpus uses the
    newline (corpus_chars puts it in every such vocabulary, and CharTokenizer makes it eot_token): what a
    text file has between its parts. A char document corpus is then its documents joined by newlines,
    as one text file made of them would be, and an empty prompt starts a sample at a document start.
    """
    tok = worker_tokenizer(tokenizer_meta, cache)
    text = document_text(source, text_column)
    dtype = token_dtype(tok.vocab_size)
    if not text:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([[tok.eot_token], tok.encode_array(text)]).astype(dtype)


# ----------------------------------------------------------------------------- the passes over the corpus
def corpus_chars(path: Path, num_proc: int, text_column: str = DEFAULT_TEXT_COLUMN) -> str:
    """A char vocabulary for a document corpus: the sorted characters of all its documents and the newline
    that separates them (encode_document), in one streaming pass over the corpus."""
    chars = {"\n"}
    work = functools.partial(document_chars, text_column=text_column)
    for found in tqdm(map_documents(path, work, num_proc, text_column),
                      desc=f"reading the characters of {path.name}", unit="doc", mininterval=1.0):
        chars.update(found)
    return "".join(sorted(chars))


def document_tokenizer(path: Path, tokenizer: str, data_dir: Path, val_fraction: float, num_proc: int,
                       text_column: str, bpe_vocab_size: int) -> CharTokenizer | TiktokenTokenizer:
    """GPT-2's BPE, fetched or built once before the workers start; a BPE trained on the train documents
    (a first pass: val never shapes the merges); or a char vocabulary (a first pass for its characters)."""
    if tokenizer == "gpt2":
        return GPT2Tokenizer(data_dir)
    if tokenizer == "char":
        return CharTokenizer(corpus_chars(path, num_proc, text_column))
    texts = map_documents(path, functools.partial(document_text, text_column=text_column), num_proc, text_column)
    train_texts = (text for index, text in enumerate(texts) if not is_val_document(index, val_fraction))
    return train_bpe(tqdm(train_texts, desc=f"training a {bpe_vocab_size}-token BPE on {path.name}", unit="doc",
                          mininterval=1.0), bpe_vocab_size, str(path))


def write_splits(documents: Iterable[np.ndarray], staging: Path,
                 val_fraction: float) -> tuple[dict[str, int], int, int]:
    """Each document's ids appended to staging's train.bin or val.bin (is_val_document), as they come:
    (tokens per split, documents, val documents)."""
    counts, n_docs, n_val_docs = {"train": 0, "val": 0}, 0, 0
    with open(staging / "train.bin", "wb") as train_f, open(staging / "val.bin", "wb") as val_f:
        for index, ids in enumerate(documents):
            split = "val" if is_val_document(index, val_fraction) else "train"
            (val_f if split == "val" else train_f).write(ids.tobytes())
            counts[split] += len(ids)
            n_docs, n_val_docs = n_docs + 1, n_val_docs + (split == "val")
    return counts, n_docs, n_val_docs


def prepare_documents(path: Path, folder: Path, tokenizer: str, data_dir: Path, val_fraction: float,
                      num_proc: int = 0, block_size: int = 1, text_column: str = DEFAULT_TEXT_COLUMN,
                      bpe_vocab_size: int = 2048) -> Path:
    """Tokenize a document corpus (formats.is_document_corpus) into folder/, streaming; see the module docstring."""
    num_proc = num_proc or os.cpu_count() or 1
    check_files(path, text_column)
    tok = document_tokenizer(path, tokenizer, data_dir, val_fraction, num_proc, text_column, bpe_vocab_size)
    encode = functools.partial(encode_document, tokenizer_meta=json.dumps(tok.meta()), cache=str(data_dir),
                               text_column=text_column)
    with staged_folder(folder) as staging:
        documents = map_documents(path, encode, num_proc, text_column)
        progress = tqdm(documents, desc=f"tokenizing {path.name}", unit="doc", mininterval=1.0)
        counts, n_docs, n_val_docs = write_splits(progress, staging, val_fraction)
        check_split_lengths(str(path), counts, block_size)  # streamed, so known only now: staging is dropped
        separator = "a newline" if tokenizer == "char" else "<|endoftext|>"
        meta = corpus_meta(tok, str(path), val_fraction, counts, documents=n_docs, val_documents=n_val_docs,
                           val_split="document i is val when ceil((i+1)*val_fraction) > ceil(i*val_fraction); "
                                     f"{separator} before each document")
        if has_text_column(path):
            meta["text_column"] = text_column
        write_meta(staging, meta)
    kind = {"gpt2": "GPT-2 BPE", "bpe": f"a {tok.vocab_size}-token BPE"}.get(tokenizer, f"{tok.vocab_size} characters")
    print(f"prepared {path}: {n_docs:,} documents, {counts['train']:,} train + {counts['val']:,} val tokens "
          f"({n_val_docs:,} val documents), {kind} -> {folder}")
    return folder
