"""checkpoint.py: the one place a model comes back, from a run's checkpoint (imported weights' too)."""
from __future__ import annotations

import argparse
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_text, run_main

import train
from checkpoint import (add_weights_flags, check_same_run, find_checkpoint, from_checkpoint, from_flags,
                        load_checkpoint, start_from)
from cli import CheckpointError, HFError
from config import DEFAULTS, make_config
from runtime import Runtime
from scripts import export_hf, import_hf
from scripts.export_hf import CHARS_FILE


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny run, 4 steps, evaluated at 2 and 4: best.pt and last.pt."""
    root = tmp_path_factory.mktemp("loading")
    (root / "corpus.txt").write_text(make_text())
    train.train(make_config("tiny", data_path=str(root / "corpus.txt"), data_dir=str(root / "data"),
                            out_dir=str(root / "run"), device="cpu", max_iters=4, eval_interval=2))
    return root / "run"


@pytest.fixture(scope="module")
def hf(run, tmp_path_factory) -> Path:
    trained, folder = from_checkpoint(run / "best.pt"), tmp_path_factory.mktemp("export") / "hf"
    export_hf.export(trained.model, trained.tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def imported(hf) -> Path:
    """The export brought back as a run folder, as scripts/import_hf.py brings GPT-2's."""
    import_hf.main([str(hf), str(hf.parent / "imported")])
    return hf.parent / "imported"


def test_find_checkpoint_takes_a_file_a_folders_best_else_last_pt_or_the_newest_trained_run_under_out(run, tmp_path,
                                                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_checkpoint(str(run)) == run / "best.pt" and find_checkpoint(str(run / "last.pt")) == run / "last.pt"
    with pytest.raises(CheckpointError, match="no trained run in out/; train one .*, or pass --ckpt$"):
        find_checkpoint("")
    for name, age in (("old", 100), ("new", 10), ("gpt2", 0)):  # gpt2: imported since, best.pt alone (was: taken)
        (tmp_path / "out" / name).mkdir(parents=True)
        for file in ("best.pt",) if name == "gpt2" else ("best.pt", "last.pt"):
            shutil.copy(run / file, tmp_path / "out" / name / file)
        os.utime(tmp_path / "out" / name / "best.pt", (1e9 - age, 1e9 - age))
    assert find_checkpoint("") == Path("out") / "new" / "best.pt"
    (tmp_path / "out" / "old" / "best.pt").rename(tmp_path / "out" / "old" / "last.pt")
    assert find_checkpoint("out/old") == Path("out") / "old" / "last.pt"
    (tmp_path / "out" / "old" / "last.pt").unlink()
    with pytest.raises(CheckpointError, match="old: no best.pt or last.pt in this folder"):
        find_checkpoint("out/old")


def test_a_checkpoint_loads_as_the_model_it_saved_in_eval_mode_with_what_the_run_logged(run):
    state = load_checkpoint(run / "last.pt")
    loaded = from_checkpoint(run / "last.pt")
    assert not loaded.model.training and next(loaded.model.parameters()).device.type == "cpu"
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in state["model"].items())
    assert (loaded.step, loaded.best_val_loss, loaded.precision) == (4, state["best_val_loss"], state["precision"])
    assert loaded.source == str(run / "last.pt") and loaded.cfg.max_iters == 4
    assert loaded.tokenizer.meta() == state["tokenizer"]


def test_imported_weights_load_with_a_config_of_their_shape_and_no_run_behind_them(run, imported):
    trained, loaded = from_checkpoint(run / "best.pt"), from_checkpoint(imported / "best.pt")
    assert not loaded.model.training
    assert (loaded.step, loaded.precision, loaded.corpus) == (0, "float32", None)
    assert math.isnan(loaded.best_val_loss)
    shape = ("n_layer", "n_head", "n_embd", "block_size")
    assert [getattr(loaded.cfg, k) for k in shape] == [getattr(trained.model.config, k) for k in shape]
    assert loaded.cfg.tokenizer == "char" and loaded.tokenizer.meta() == trained.tokenizer.meta()
    ids = torch.tensor([trained.tokenizer.encode("the king")])
    torch.testing.assert_close(loaded.model(ids).logits, trained.model(ids).logits)


def test_weights_without_a_known_tokenizer_are_refused_in_one_line(hf, tmp_path):
    shutil.copytree(hf, tmp_path / "hf")
    for name in (CHARS_FILE, "tokenizer.json"):  # ours and the standard one: nothing to rebuild it from
        (tmp_path / "hf" / name).unlink()
    with pytest.raises(HFError, match="no tokenizer for a vocabulary of .*tinygpt_chars.json or tinygpt_bpe.json"):
        import_hf.load_pretrained(str(tmp_path / "hf"))


def test_the_flags_choose_the_weights(run, hf, imported, tmp_path):
    parser = argparse.ArgumentParser()
    add_weights_flags(parser)
    assert from_flags(parser.parse_args(["--ckpt", str(run)])).source == str(run / "best.pt")
    assert from_flags(parser.parse_args(["--init_from", str(imported)])).corpus is None
    for flag, source in (("--init_from", hf), ("--ckpt", hf), ("--ckpt", hf / "model.safetensors")):
        with pytest.raises(CheckpointError, match=f"{flag} {source}: Hugging Face weights; make a run folder of them "
                           f"first: python -m scripts.import_hf {hf} out/hf, then pass out/hf$"):
            from_flags(parser.parse_args([flag, str(source)]))
    shutil.copy(imported / "best.pt", tmp_path / "last.pt")  # imported weights in a run's place: refused, not resumed
    with pytest.raises(CheckpointError, match="holds imported weights, no run to resume; start from them with"):
        check_same_run(make_config(None, out_dir=str(tmp_path), resume=True))
    assert from_flags(parser.parse_args(["--init_from", str(run)])).source == str(run / "best.pt")  # as train.py's
    with pytest.raises(SystemExit):  # one source of weights, not two
        parser.parse_args(["--ckpt", str(run), "--init_from", "gpt2"])


def test_a_fine_tune_at_a_smaller_block_size_starts_with_the_base_logits(run, tmp_path):
    """A smaller block_size keeps the first positions: step 0 gives the base's logits; dropout may differ."""
    base = from_checkpoint(run / "best.pt").model
    common = dict(data_path=str(run.parent / "corpus.txt"), data_dir=str(run.parent / "data"), init_from=str(run),
                  out_dir=str(tmp_path / "tuned"), device="cpu", compile="off")
    assert start_from(make_config(None, **common, dropout=0.1))[0].dropout == 0.1  # GPTConfig.TRAINING_ONLY
    cfg, pretrained = start_from(make_config(None, **common, block_size=8))
    tuned = train.build_run(cfg, Runtime(torch.device("cpu"), torch.float32, 1, False), pretrained=pretrained).model
    assert tuned.config.block_size == 8
    x = torch.randint(base.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for length in (8, 3):
            assert torch.equal(tuned.eval()(x[:, :length]).logits, base(x[:, :length]).logits), length


def test_a_run_and_its_exports_import_start_a_fine_tune_at_the_same_block_size(run, imported):
    """A run and its export imported: the weights' positions unless --block_size is given (the export refused 32)."""
    for source in (str(run), str(imported)):
        assert start_from(make_config(None, init_from=source))[0].block_size == 32 != DEFAULTS["block_size"]
        assert start_from(make_config(None, init_from=source, block_size=8))[0].block_size == 8
        with pytest.raises(HFError, match="block_size 64 exceeds the 32 positions of"):
            start_from(make_config(None, init_from=source, block_size=64))


def test_a_missing_local_path_is_refused_before_the_hub_is_asked(run, tmp_path, monkeypatch):
    """Bug caught: --init_from out/smal (a typo beside out/small) was taken for a hub repo: a paragraph about it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out" / "small").mkdir(parents=True)
    asked = []

    def download(repo_id: str):
        asked.append(repo_id)
        raise LookupError(f"asked the hub for {repo_id}")

    monkeypatch.setattr(import_hf, "download", download)
    for path in ("out/smal", "./out/smal", "out/nosuch", "runs/a/b", "mine.safetensors", "/nowhere/run", "smal"):
        with pytest.raises(CheckpointError, match="no such run folder or file; train that run first") as err:
            start_from(make_config(None, init_from=path))
        assert str(err.value).startswith(f"--init_from {path}: ") and "\n" not in str(err.value)
        assert ("import_hf SOURCE " + path if "/" in path else f"import_hf {path} out/") in str(err.value)
        with pytest.raises(HFError, match="no such folder; pass a folder"):
            import_hf.load_pretrained(path)
    with pytest.raises(HFError, match="best.pt: a file; pass the folder holding it"):
        import_hf.load_pretrained(str(run / "best.pt"))
    assert run_main(["gpt2", str(run)], import_hf.main) == 2 and asked == []  # OUT not empty: refused before the hub
    with pytest.raises(LookupError):  # OWNER/NAME where no such local folder is: the hub's to answer
        import_hf.load_pretrained("someone/model")
    assert asked == ["someone/model"]
