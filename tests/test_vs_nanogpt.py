"""dev/vs_nanogpt.py reads both logs right: ours as train.py prints it today, nanoGPT's as its
train.py prints it (that script is not in this repo, so its line format is pinned here)."""
from __future__ import annotations

import pytest

from dev import vs_nanogpt
from conftest import run_main, tiny_args


@pytest.fixture(scope="module")
def vs():
    return vs_nanogpt


def test_our_step_times_are_read_from_train_py_log(vs, tmp_path, text_file, capsys):
    assert run_main(tiny_args(tmp_path / "out", text_file, max_iters=6)) == 0
    times = [float(ms) for ms in vs.OURS_MS.findall(capsys.readouterr().out)]
    assert len(times) == 6 and all(ms > 0 for ms in times)  # one per logged step, none from the val lines


def test_nanogpt_step_times_and_the_ratio(vs, capsys):
    log = ("step 0: train loss 4.4, val loss 4.4\n"  # its eval line: no step time
           "iter 0: loss 4.4000, time 900.00ms, mfu -100.00%\n"
           "iter 1: loss 4.3000, time 30.00ms, mfu -100.00%\n"
           "iter 2: loss 4.2000, time 32.00ms, mfu 0.50%\n")
    assert [float(ms) for _, ms in vs.THEIRS_MS.findall(log)] == [900.0, 30.0, 32.0]
    nano = vs.summary("nanoGPT", [[900.0, 30.0, 32.0], [800.0, 31.0, 29.0]], skip=1)  # pooled median 30.5
    assert nano == pytest.approx(30.5)
    assert "round medians 31.00, 30.00 ms" in capsys.readouterr().out


def test_a_folder_that_is_not_nanogpt_is_refused_in_one_line(vs, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        vs.main(["--nanogpt", str(tmp_path)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and "not a nanoGPT checkout" in err
