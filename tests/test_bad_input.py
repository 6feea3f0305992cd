"""Bad input fails early and loudly: one line naming the problem, before anything is built or written."""
from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import pytest
from conftest import TOOLS, entry_point, interop_if, make_text, run_main, tiny_args, tiny_run, tree

import train
from config import make_config
from prepare import prepare_corpus


BAD_DATA = {  # case: (the corpus's text, None for none; words of the error). Bad token ids: test_data.py
    "missing file": (None, "no such file"), "empty file": ("", "empty"), "missing val split": ("kept", "missing"),
    "train split too short": ("To be or not to be.\n", "train split"),
    "val split too short": ("To be, or not to be, that is the question.\n" * 6, "val split"),
    "one character repeated": ("\0" * 10_000, "nothing to learn"),  # was vocab 1, loss 0.0000, saved best.pt, exit 0
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_fails_before_the_model_is_built(tmp_path, text_file, capsys, no_model, case):
    text, expected = BAD_DATA[case]
    named = text_file
    if text is None:
        text_file.unlink()
    elif text != "kept":
        text_file.write_text(text)
    else:
        named = prepare_corpus(data_path=str(text_file), data_dir=str(text_file.parent / "data")) / "val.bin"
        named.unlink()
    assert run_main(tiny_args(tmp_path / "out", text_file)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}") and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "out").exists()
    assert text == "kept" or list(tmp_path.glob("data/*")) == []  # refused from its text: no corpus prepared
    assert text == "kept" or expected == "nothing to learn" or not (tmp_path / "data").exists()  # counted first


# ----------------------------------------------------------------------------- bad input, entry point by entry point
# Mistakes users make, per entry point, that no other test refuses there: (argv, words of the one-line error). {run}
# is a trained tiny run, {corpus} its text, {data} its data_dir, {tmp} an empty folder; {run}/metrics.jsonl/x has a
# file in the way. Of train.py's config mistakes two are here: test_config.py holds every message.
TINY = ["--config", "tiny", "--data_path", "{corpus}", "--data_dir", "{tmp}/data", "--out_dir", "{tmp}/out"]
COMPARE = ["--steps", "1", "--config", "tiny", "--out", "{tmp}/exp", "--set", "data_path={corpus},data_dir={tmp}/data"]
BAD_INPUTS = {
    "train.py": [
        ([*TINY, "--learning_rate", "-1"], "learning_rate"), ([*TINY, "--n_head", "3"], "n_head"),
        ([*TINY, "--resume"], "nothing to resume in"),  # was: the corpus prepared, then "no such checkpoint"
        ([*TINY, "--wandb"],  # was: metrics.jsonl written first
         "pip install wandb==0.31.0 (or pip install -r requirements-interop.txt)"),
        (["--config", "tiny", "--dtype", "float32", "--data_path", "{run}/metrics.jsonl", "--data_dir", "{data}",
          "--out_dir", "{tmp}/out"],  # documents: a step of their own, the command spelled out
         "documents is tokenized by its own command first: python -m scripts.prepare --data_path"),
    ],
    "scripts.shape": [(["--preset", "nosuch"], "no preset `nosuch`"), (["--optimizer", "nope"], "nope"),
                      (["--preset", ""], "no preset ``")],  # was: the defaults' trace
    "sample.py": [
        (["--tmp", "0.8"], "unknown flag `--tmp`; did you mean `--temp`?"),
        (["surplus"], "unexpected argument `surplus`"),
        (["--ckpt", "{run}", "--device", "tpu"], "unknown device `tpu`"),
        (["--ckpt", "{run}", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--ckpt", "{run}", "--temp", "inf"], "--temp must be >= 0 and finite, got inf"),
        (["--ckpt", "{run}", "--top-p", "2"], "--top-p must be in (0, 1], got 2"),
        (["--ckpt", "{run}", "--threads", "-1"], "--threads must be >= 0, got -1"),
        (["--ckpt", "{run}", "--seed", "-1"], "--seed must be in [0, 2**32 - 1]"),  # was: a torch traceback
        (["--ckpt", "{run}", "--stop", ""], '--stop must be a non-empty string, got ""'),  # was: ignored
        (["--ckpt", "{run}", "--threads", "99999"], "--threads 99999: this machine has"),  # torch crashed
        (["--ckpt", "{run}", "--prompt", "KING: €"], "€"),
        (["--ckpt", "{run}", "--prompt-file", "{tmp}/no.txt"], "pass an existing UTF-8 text file with --prompt-file"),
        (["--init_from", "{tmp}"], "no best.pt or last.pt in this folder; train that run first"),
    ],
    "scripts.prepare": [
        (["--data_path", "{tmp}/missing.txt", "--data_dir", "{data}"], "no such file or folder"),
        (["--num_proc", "-1"], "--num_proc must be >= 0, got -1"),
        (["--block_size", "0"], "error: block_size must be > 0, got 0\n"),  # was: named --num_proc too
        (["--dataset", "nope"], "unknown dataset `nope`; built in: shakespeare, shakespeare_chat"),
        (["--val_fraction", "1"], "val_fraction must be in (0, 1)"),
        (["--data_path", "{tmp}", "--data_dir", "{data}"], "no .txt files and no .parquet files in this folder"),
        (["--data_path", "{corpus}", "--data_dir", "{data}", "--tokenizer", "bpe", "--bpe_vocab_size", "100000"],
         "distinct merges, not the 99743 that --bpe_vocab_size 100000 needs; use at most --bpe_vocab_size"),
        (["--data_path", "{corpus}", "--data_dir", "{tmp}/data", "--block_size", "99999"], "fewer than block_size + 1"),
    ],
    "scripts.tokenizer": [
        (["--bpe_vocab_size", "512", "100"],
         "bpe_vocab_size must be in [257, 2**32] (256 bytes, <|endoftext|>; uint32 ids), got 100"),
        (["--data_path", "{tmp}/missing.txt", "--data_dir", "{data}"], "no such file or folder"),
        (["--val_fraction", "0"], "val_fraction must be in (0, 1)"),
        (["--data_path", "{tokens}", "--data_dir", "{data}"], "compares tokenizers on text"),  # was: --tokenizer char
        (["--dataset", "shakespeare_chat"], "is conversations; tokenizers are compared on text"),
    ],
    "scripts.bench": [
        (["--steps", "0"], "need --steps and --rounds >= 1"),  # ran one step, silently
        (["--warmup", "-1"], "--warmup, --threads, --profile and --min-ratio >= 0"),
        (["n_layer"], "override `n_layer` must look like KEY=VALUE"),
        (["--json", "{run}/metrics.jsonl/x.json"], "is a file, not a folder"),
        (["--json", "{run}/best.pt"], "neither a new .json"), (["--matmul", "--json", "{tmp}/x.json"], "with --matmul"),
        (["--vs", "foo=1"], "key `foo` in the overrides; python train.py --help lists every field"),  # not bench's
        (["--min-ratio", "2"], "--min-ratio would do nothing"),
        (["--vs", ""], "override `` must look like KEY=VALUE"), (["--vs", "seed=2", "--min-ratio", "nan"], ">= 0"),
    ],
    "scripts.compare": [
        (["--steps", "0", "a:"], "--steps must be > 0"),
        (["--steps", "1", "--out", "{run}", "a:"],  # was: results and runs written into a run
         "holds files compare.py did not write"),
        (["--steps", "1", "--out", "{run}/last.pt", "a:"], "is a file, not a folder"),  # was: a traceback
        ([*COMPARE, "lr:lerning_rate=1e-3"], "variant `lr`: unknown config key `lerning_rate` in the overrides"),
        ([*COMPARE, "lr:learning_rate=fast"], "variant `lr`: learning_rate must be float, got 'fast'"),
        ([*COMPARE, "lr:learning_rate=1e-5"], "variant `lr`: min_lr (0.0003) must not exceed learning_rate (1e-05)"),
        ([*COMPARE, "a:", "a:dropout=0.1"], "variant name `a` is used twice"),
        ([*COMPARE, "rope"], "variant `rope` must look like NAME:KEY=VALUE[,KEY=VALUE]"),
        ([*COMPARE, "x:dropout"], "override `dropout` must look like KEY=VALUE"),
        ([*COMPARE, "x:dropout=0.1,dropout=0.2"], "variant `x` sets a key twice"),
        ([*COMPARE, "s:seed=7"], "variant `s` sets `seed`, which compare.py sets itself (with --seeds)"),
        ([*COMPARE, "a:", "--seeds", "1"], "--seeds 1 leaves no spread and no p-value: use --seeds 2 or more"),
        ([*COMPARE, "a:", "b:", "--vs", "c"], "--vs c names no variant; the variants are a, b"),
        ([*COMPARE, "a:", "--set", "n_layr=3"],
         "unknown config key `n_layr` in the overrides; did you mean `n_layer`?"),
        (COMPARE, "no variants"),
        ([*COMPARE[2:], "a:"], "give --steps N (equal steps: the quality answer) or --time S"),
    ],
    "scripts.doctor": [
        (["--n_head", "3"], "n_head"),
    ],
    "scripts.eval": [
        (["--ckpt", "{tmp}/missing.pt"], "no such checkpoint"),
        (["--ckpt", "{run}", "--eval_tokens", "-5"], "--eval_tokens must be >= -1, got -5"),
        (["--ckpt", "{run}", "--threads", "-1"], "--threads must be >= 0, got -1"),
        (["--ckpt", "{run}", "--data_path", "{run}/last.pt"], "not UTF-8 text"),
        (["--ckpt", "{run}", "--data_path", "{run}/metrics.jsonl"], "holds documents"),  # was read as text
    ],
    "scripts.harness": [
        (["--ckpt", "{tmp}/missing.pt", "--tasks", "tinygpt_cloze"], "no such checkpoint"),
        (["--ckpt", "{run}", "--tasks", " , "], "unknown task(s) (none given)"),
        (["--ckpt", "{run}", "--tasks", "tinygpt_clozee"], "unknown task(s) tinygpt_clozee"),  # blamed the hub
        (["--ckpt", "{run}", "--tasks", "tinygpt_cloze", "--batch_size", "0"], "need --batch_size >= 1"),
        (["--ckpt", "{run}", "--tasks", "tinygpt_cloze", "--limit", "1.5"], "a whole number of documents, got 1.5"),
        (["--ckpt", "{run}", "--tasks", "tinygpt_cloze", "--output", "{run}/best.pt"], "neither a new .json file"),
    ],
    "scripts.export_hf": [
        (["{run}", "{run}/metrics.jsonl/x"], "is a file, not a folder"),
        (["{tmp}/missing", "{tmp}/hf"], "missing: no such run folder or file"),
    ],
    "scripts.export_gguf": [
        (["{run}", "{run}/metrics.jsonl/x.gguf"], "is a file, not a folder"),
        (["{tmp}/missing", "{tmp}/x.gguf"], "missing: no such run folder or file"),
        (["{run}", ""], "OUT is empty"),  # was ./run.gguf
    ],
    "scripts.gpu_check": [
        (["--dry-run", "--steps", "3"], "--steps must be even and >= 2"),
        (["--dry-run", "--out_dir", "{run}/metrics.jsonl/x"], "is a file, not a folder"),
        (["--dry-run", "--data_path", "{tmp}/no.txt", "--out_dir", "{tmp}/out"], "no such file or folder"),  # 5 FAILs
    ],
    "scripts.plot": [
        (["{run}/metrics.jsonl", "--labels", "a", "b"], "2 --labels for 1 arguments"),
        (["{run}/last.pt"], "not a metrics.jsonl (not UTF-8 text)"),
        (["{tmp}/missing"], "no such file"),
        (["{run}", "-o", "{run}/metrics.jsonl/x.png"], "is a file, not a folder"),
        (["{run}", "-o", "{tmp}/notes.txt"], "notes.txt: .txt is no image format plot.py writes; pass a name "
                                              "ending in .png"),  # was matplotlib's traceback, after the work
        (["{run}", "-o", "{tmp}/loss"], "no extension"),  # matplotlib would write loss.png, and we say "wrote loss"
        (["{run}", "--ref", "70"], "SECONDS:LOSS"), (["{run}", "--ref", "a:b"], "SECONDS:LOSS"),
    ],
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("trained")
    corpus = root / "corpus.txt"
    corpus.write_text(make_text())
    train.train(make_config("tiny", **tiny_run(root / "run", corpus) | dict(max_iters=2, eval_interval=2)))
    tokens = next((root / "data").glob("*/meta.json")).parent  # the run's prepared corpus: a token folder
    return {"run": str(root / "run"), "corpus": str(corpus), "data": str(root / "data"), "tokens": str(tokens)}


# Every entry point but train.py and doctor.py (config parsers of their own, above), new scripts included.
REQUIRED_ARGS = {"scripts.plot": ["x.jsonl"], "scripts.export_hf": ["run", "folder"], "scripts.import_hf": ["x", "out"],
                 "scripts.export_gguf": ["run", "x.gguf"], "scripts.harness": ["--tasks", "x"]}
for script in ["sample.py"] + [tool for tool in TOOLS if tool != "scripts.doctor"]:
    BAD_INPUTS.setdefault(script, []).append((["--seeed", "1", *REQUIRED_ARGS.get(script, [])],
                                              "unknown flag `--seeed`"))


@pytest.mark.parametrize("script, argv, expected", [
    pytest.param(script, argv, expected, marks=[*interop_if(script).marks, *marks])
    for script, rows in BAD_INPUTS.items() for argv, expected, *marks in rows])
def test_bad_input_is_one_line_and_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch, trained, script, argv,
                                                             expected):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, whether it is here or not
    main = train.main if script == "train.py" else entry_point(script).main
    before = tree(tmp_path, Path(trained["run"]).parent)
    code = run_main([arg.format(tmp=tmp_path, **trained) for arg in argv], main)  # doctor.py returns its code
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert out == ""  # refused before any output (shape once printed its whole report first)
    assert tree(tmp_path, Path(trained["run"]).parent) == before  # no folder left behind, nothing written


# ----------------------------------------------------------------------------- nothing left behind, nothing replaced
@pytest.mark.parametrize("out", ["{run}/best.pt", "{run}/last.pt", "{run}/metrics.jsonl", "{tmp}/renamed.gguf",
                                 "{tmp}/theirs.gguf", "{tmp}/missing/model.gguf"])
def test_the_gguf_export_never_writes_over_a_file_it_did_not_write(tmp_path, capsys, trained, out):
    """Bug caught: `export_gguf RUN RUN/best.pt` wrote over the checkpoint it read (exit 0), a missing folder was a
    traceback. The paths are checked before gguf is imported: this runs without the interop packages."""
    from scripts import export_gguf
    (tmp_path / "renamed.gguf").write_bytes((Path(trained["run"]) / "last.pt").read_bytes())  # not a GGUF file
    (tmp_path / "theirs.gguf").write_bytes(b"GGUF\x03" + bytes(64))  # another model: not an export's to replace
    before = tree(tmp_path, Path(trained["run"]))
    path = out.format(tmp=tmp_path, **trained)
    code, err = run_main([trained["run"], path], export_gguf.main), capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {path}") and err.count("\n") == 1, err
    assert tree(tmp_path, Path(trained["run"])) == before  # every byte as it was, no folder made


@pytest.mark.parametrize("script, out, fails", [interop_if(row[0], *row) for row in  # fails: the fsync that fills
                                                [("scripts.export_hf", "hf", 3), ("scripts.export_gguf", "x.gguf", 1)]])
def test_a_full_disk_fails_in_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, trained, script, out, fails):
    monkeypatch.setattr("os.fsync", mock.Mock(side_effect=[None] * (fails - 1) + [OSError(28, "No space left")]))
    code = run_main([trained["run"], str(tmp_path / out)], entry_point(script).main)
    err = capsys.readouterr().err  # was: a traceback, and export_hf's half folder in the way of the retry
    assert (code, err.count("\n"), list(tmp_path.iterdir())) == (74, 1, []) and "could not write" in err
    monkeypatch.undo()
    assert entry_point(script).main([trained["run"], str(tmp_path / out)]) is None and (tmp_path / out).exists()
