"""Prepare a corpus into token files without training: train.py's own preparation, cached in data_dir, and the one
for a corpus of documents (a folder of .txt or .parquet files, a .jsonl, a .parquet), streamed in threads. Its corpus
flags are train.py's (config.CORPUS_OPTIONS), so train.py finds the folder it writes.

    python -m scripts.prepare                          # the built-in Shakespeare corpus (cached in data/)
    python -m scripts.prepare --data_path web.jsonl --tokenizer gpt2 --num_proc 8
"""
import sys

if not __package__:  # run as a file, `python scripts/prepare.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.prepare", file=sys.stderr)
    sys.exit(2)

import collections
import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

import prepare
from checkpoint import start_from
from cli import CommandLine, DataError, exit_on_errors, install_hint, run_tool
from config import CORPUS_OPTIONS, add_flags, make_config
from data import corpus_for
from prepare import (DEFAULT_TEXT_COLUMN, check_split_lengths, corpus_files, is_val, jsonl_lines, new_tokenizer,
                     read_text_file, token_dtype, write_meta, write_splits)
from runtime import STAGING, check_writable, staged_folder
from tokenizer import tokenizer_from_meta


def prepare_corpus(*args, num_proc: int = 0, **kwargs) -> Path:
    """prepare.prepare_corpus, a corpus of documents too (prepare_documents, in num_proc threads: 0 = one per core)."""
    return prepare.prepare_corpus(*args, **kwargs, documents=functools.partial(prepare_documents, num_proc=num_proc))


def prepare_documents(path: Path, folder: Path, tokenizer: str, data_dir: Path, val_fraction: float, block_size: int,
                      text_column: str, bpe_vocab_size: int, base: dict | None = None, num_proc: int = 0) -> Path:
    """Tokenize a document corpus into folder/ (in the ``base`` tokenizer if given), streaming; document i is val."""
    check_writable(data_dir, "--data_dir", f"{STAGING}probe")
    if (folder / "meta.json").exists():  # prepare_corpus found it unreadable: no finished prepare
        print(f"{folder / 'meta.json'}: unreadable; preparing {folder} again from its source", flush=True)
    num_proc, files = num_proc or os.cpu_count() or 1, corpus_files(path)
    for file in (file for file in files if file.suffix == ".parquet"):  # each shard's footer: refused now, not hours in
        open_parquet(file, text_column)
    texts = tqdm(document_texts(path, text_column), desc=f"reading {path.name}", unit="doc", mininterval=1.0,
                 disable=tokenizer == "gpt2")
    train_texts = (text for index, text in enumerate(texts) if not is_val(index, val_fraction))
    tok = tokenizer_from_meta(base, data_dir) if base else new_tokenizer(tokenizer, texts, train_texts, data_dir,
                                                                          bpe_vocab_size, str(path), chars="\n")
    with staged_folder(folder) as staging:
        documents = tqdm(encoded(document_texts(path, text_column), tok, num_proc),
                         desc=f"tokenizing {path.name}", unit="doc", mininterval=1.0)
        counts, docs = write_splits(documents, staging, val_fraction)
        if not docs["train"]:  # one document (or a few): the first is val, so is the whole corpus
            raise DataError(f"{path}: no documents" if not docs["val"] else f"{path}: its {docs['val']} document(s) "
                            f"all go to val (document 0 is val, then one in {round(1 / val_fraction)}); add documents, "
                            "or pass one text file, whose tail is val")
        check_split_lengths(str(path), counts, block_size)  # streamed, so known only now: staging is dropped
        rule = ("document i is val when ceil((i+1)*val_fraction) > ceil(i*val_fraction); "
                f"{'a newline' if tokenizer == 'char' else '<|endoftext|>'} before each document")
        write_meta(staging, tok, str(path), val_fraction, counts, documents=sum(docs.values()),
                   val_documents=docs["val"], val_split=rule,
                   **({"text_column": text_column} if files[0].suffix != ".txt" else {}))
    print(f"prepared {path}: {sum(docs.values()):,} documents ({docs['val']:,} val), {counts['train']:,} train + "
          f"{counts['val']:,} val tokens, vocab {tok.vocab_size} -> {folder}")
    return folder


# ----------------------------------------------------------------------------- documents, streamed
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: a few MB of web text, whatever the row group size
IN_FLIGHT = 4  # texts queued per tokenizer thread


def open_parquet(path: Path, text_column: str):
    """A ParquetFile whose ``text_column`` holds strings, else a DataError; pyarrow is imported only here."""
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401 - binds pa.parquet
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow: {install_hint('pyarrow')}") from None
    try:
        reader = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"{path}: not a readable Parquet file ({reason})") from None
    schema = reader.schema_arrow
    if text_column not in schema.names:
        raise DataError(f"{path}: no column {text_column!r} (its columns: {', '.join(schema.names)}); "
                        "name the one holding the text with --text_column")
    if (kind := schema.field(text_column).type) not in (pa.string(), pa.large_string(), pa.string_view()):
        raise DataError(f"{path}: column {text_column!r} holds {kind}, not strings; "
                        "name the column holding the text with --text_column")
    return reader


def parquet_texts(path: Path, text_column: str) -> Iterator[str]:
    """Each row's text, PARQUET_BATCH_ROWS rows of the one column at a time (read_table would hold the file)."""
    row = 0
    for batch in open_parquet(path, text_column).iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_column]):
        for row, text in enumerate(batch.column(0).to_pylist(), start=row + 1):
            if text is None:
                raise DataError(f"{path}:row {row}: null in column {text_column!r}; drop or fill the row")
            yield text


def jsonl_texts(path: Path, text_column: str) -> Iterator[str]:
    """Each line's ``text_column`` field."""
    for number, line in jsonl_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not JSON ({err})") from None
        if not isinstance(record, dict) or text_column not in record:
            fields = (f" (its fields: {', '.join(record)}); name the one holding the text with --text_column"
                      if isinstance(record, dict) else "")
            raise DataError(f"{path}:{number}: not a JSON object with a \"{text_column}\" field{fields}")
        if not isinstance(text := record[text_column], str):
            raise DataError(f"{path}:{number}: \"{text_column}\" is a {type(text).__name__}, not a string")
        yield text


def document_texts(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> Iterator[str]:
    """Every document of a corpus, in order, lazily."""
    for file in corpus_files(path):
        if file.suffix == ".txt":
            yield read_text_file(file)
        else:
            yield from (jsonl_texts if file.suffix == ".jsonl" else parquet_texts)(file, text_column)


def encoded(texts: Iterable[str], tok, num_proc: int) -> Iterator[np.ndarray]:
    """eot_token (a char vocabulary's newline) then each text's ids (none for an empty text), in order, from num_proc
    threads (tiktoken and numpy release the GIL), IN_FLIGHT texts a thread queued: Executor.map would read them all."""
    def encode(text: str) -> np.ndarray:
        ids = np.concatenate([[tok.eot_token], tok.encode_array(text)]) if text else np.zeros(0)
        return ids.astype(token_dtype(tok.vocab_size))
    with ThreadPoolExecutor(num_proc) as pool:
        pending = collections.deque()
        for text in texts:
            pending.append(pool.submit(encode, text))
            if len(pending) >= IN_FLIGHT * num_proc:
                yield pending.popleft().result()
        yield from (future.result() for future in pending)


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description="Prepare a corpus into token files.")
    add_flags(parser, CORPUS_OPTIONS + ("init_from",))  # train.py's flags, typed and checked by config
    parser.add_argument("--num_proc", "--num-proc", type=int, default=0,
                        help="tokenizer threads for a folder, .jsonl or .parquet; 0 = one per CPU core")
    parser.add_argument("--block_size", "--block-size", type=int, default=None,
                        help="refuse a train or val split shorter than block_size + 1 tokens (default: 1)")
    given = {name: value for name, value in vars(parser.parse_args(argv)).items() if value is not None}
    if (num_proc := given.pop("num_proc")) < 0:
        parser.error(f"--num_proc must be >= 0, got {num_proc}")
    with exit_on_errors():  # one line and its exit code (2, or 74 for a data_dir failing its probe)
        cfg, pretrained = start_from(make_config(None, **given))  # --init_from: its tokenizer; block_size only if given
        documents = functools.partial(prepare_documents, num_proc=num_proc)  # what train.py refuses to do
        checked = replace(cfg, block_size=given.get("block_size", 1))  # not shown: 2-token splits pass unless given
        folder = corpus_for(checked, pretrained.tokenizer if pretrained else None, documents).folder  # opened: checked
        print(f"ready: {folder} (train.py finds it with the same corpus flags)")  # prepared now or before


if __name__ == "__main__":
    run_tool(main)
