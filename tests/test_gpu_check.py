"""scripts/gpu_check.py stays runnable: its --dry-run runs every check's commands on CPU and passes."""
from __future__ import annotations

import json

import pytest
from conftest import run_script


@pytest.mark.slow  # seven fresh interpreters (two are torchrun ranks): ~1 min of CPU; 2.5 min on 2 busy cores
def test_gpu_check_dry_run_passes_every_check(tmp_path, text_file):
    out = tmp_path / "out"
    result = run_script("-m", "scripts.gpu_check", "--dry-run", "--steps", "6", "--data_path", str(text_file),
                        "--data_dir", str(tmp_path / "data"), "--out_dir", str(out), check=False, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((out / "results.json").read_text()) == {
        "train": "PASS", "ddp": "PASS", "resume": "PASS", "rng": "PASS", "sample": "PASS"}
    assert (out / "train" / "best.pt").is_file() and (out / "ddp" / "last.pt").is_file()
