"""Nothing lost: kills during saves, full disks, corrupt files, NaNs and Ctrl-C leave a usable run."""
from __future__ import annotations

import builtins
import errno
import functools
import math
import os
import random
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, metrics, run_main, sentinel, tiny_args, write_chats
from fault_injection import (AS_A_SCRIPT, assert_nested_equal, assert_same_training_state, call_of, floating_tensors,
                             on_training_forward, poison_loss, signal_at)

import checkpoint
import cli
import logs
import optim
import prepare
import runtime
import train
from checkpoint import FORMAT_VERSION, REQUIRED_KEYS, RNG_STREAMS, load_checkpoint, save_checkpoint
from cli import CheckpointError, RunStopped
from optim import OPTIMIZERS, NonFiniteGuard


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if ".tmp-" in p.name]


# ----------------------------------------------------------------------------- checkpoint files
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_sigkill_during_checkpoint_writes_15_times(tmp_path, text_file):
    out = tmp_path / "out"
    # Two 8 MB states, made before forking (a forked child must not start torch's thread pools).
    states = [{key: {} for key in REQUIRED_KEYS} | {"format_version": FORMAT_VERSION, "step": step,
                                                     "model": {"w": torch.full((1 << 21,), float(step))}}
              for step in (1, 2)]
    save_checkpoint(states[0], out / "last.pt")
    rng, killed_mid_write = random.Random(0), 0
    for _ in range(15):
        pid = os.fork()
        if pid == 0:  # child: overwrite last.pt with alternating states until killed
            try:
                for i in range(10**9):
                    save_checkpoint(states[i % 2], out / "last.pt")
            finally:
                os._exit(1)
        deadline = time.time() + 30
        while not (out / f".last.pt.tmp-{pid}").exists():  # wait until a write is under way
            assert time.time() < deadline, "the child never started a save"
        time.sleep(rng.uniform(0, 0.02))  # then kill it at a seeded random moment of the write
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        killed_mid_write += (out / f".last.pt.tmp-{pid}").exists()
        state = load_checkpoint(out / "last.pt")  # always loads, and is one whole state, never a mix
        assert torch.equal(state["model"]["w"], states[state["step"] - 1]["model"]["w"])
    assert killed_mid_write >= 5  # most kills did land inside a write, so the test tests something
    # The next start of training in this folder removes the temp files the kills left (a fresh run: no last.pt).
    assert temp_files(out) != []
    (out / "last.pt").unlink()
    assert run_main(tiny_args(out, text_file, max_iters=1)) == 0
    assert temp_files(out) == []


def open_on_full_disk(path, mode="r", *args, full: str = ".tmp-", **kwargs):
    """open() where temp files (runtime.atomic_write), or the files named ``full``, land on /dev/full (ENOSPC)."""
    if full not in str(path):
        return builtins.open(path, mode, *args, **kwargs)
    Path(path).touch()  # the temp file exists, as on a real disk that filled up mid-write
    return builtins.open("/dev/full", mode, *args, **kwargs)


def torch_save_on_full_disk(obj, f, *args, **kwargs):
    """torch.save as it fails when it writes to a path on a full disk: part of the data, then RuntimeError."""
    f.write(b"PK\x03\x04" + bytes(1000))
    raise RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed")


@pytest.mark.parametrize("failure", ["ENOSPC from the OS", "RuntimeError from torch.save", "ENOSPC in metrics.jsonl"])
def test_disk_full_keeps_previous_checkpoints_and_exits_74(tmp_path, text_file, monkeypatch, capsys, failure):
    if failure.startswith("ENOSPC") and not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    out = tmp_path / "out"
    assert run_main(tiny_args(out, text_file, max_iters=10, eval_interval=5)) == 0
    before = {name: (out / name).read_bytes() for name in ("last.pt", "best.pt")}
    if failure.startswith("ENOSPC"):
        full = functools.partial(open_on_full_disk, full="metrics.jsonl" if "metrics" in failure else ".tmp-")
        for module in (runtime, logs):  # temp files (runtime.written_whole), metrics.jsonl (logs.MetricsLog)
            monkeypatch.setattr(module, "open", full, raising=False)
    else:
        monkeypatch.setattr(torch, "save", torch_save_on_full_disk)
    capsys.readouterr()
    assert run_main(tiny_args(out, text_file, max_iters=20, eval_interval=5, resume="true")) == 74
    err, metrics = capsys.readouterr().err, "metrics" in failure  # metrics.jsonl: the resumed run's first record
    # best.pt is written before last.pt when the val loss improved, so either may be the first to fail.
    name = "metrics.jsonl" if metrics else "best.pt" if f"could not write {out / 'best.pt'}" in err else "last.pt"
    reason = "No space left on device" if failure.startswith("ENOSPC") else "file write failed"
    kept = ("the last save is intact: free some space, then continue with --resume" if metrics  # was: a traceback
            else f"the previous {name} is intact and no temp file is left")
    assert err.count("\n") == 1 and err.startswith(f"error: could not write {out / name} (")
    assert err.endswith(f"{reason}); {kept}\n"), err
    assert {name: (out / name).read_bytes() for name in before} == before
    assert temp_files(out) == []


def test_a_full_disk_under_a_corpus_or_an_unreadable_checkpoint_is_one_line(tmp_path, text_file, monkeypatch, capsys):
    """Bugs caught: tokens written to a full disk, another user's last.pt (mode 600): an OSError's traceback."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    monkeypatch.setattr(prepare, "open", functools.partial(open_on_full_disk, full="train.bin"), raising=False)
    assert run_main(tiny_args(tmp_path / "out", text_file)) == 74
    err, data = capsys.readouterr().err, tmp_path / "data"
    assert err.startswith(f"error: could not write in {data} (") and err.count("\n") == 1, err
    assert [p.name for p in data.iterdir()] == []  # the staging folder went with the failure
    assert run_main(tiny_args(tmp_path / "out", write_chats(tmp_path / "chats.jsonl"))) == 74  # conversations too
    assert capsys.readouterr().err.startswith(f"error: could not write in {data} (")
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(checkpoint, "open", denied, raising=False)
    (tmp_path / "last.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"last.pt: cannot be read \(Permission denied\)$"):
        load_checkpoint(tmp_path / "last.pt")


def corruptions(good: bytes) -> dict[str, bytes]:
    """Damaged copies of a checkpoint: empty, truncated, random, and single bits flipped in each zip part."""
    central = good.rfind(b"PK\x01\x02")  # the last central-directory entry
    end = good.rfind(b"PK\x05\x06")  # the end-of-central-directory record
    positions = {"first local header": 2, "first file name": 31, "padding of the first entry": 50,
                 "data": len(good) // 2, "central directory": central + 20, "end record": end + 10,
                 "comment length": end + 21, "stored digest": len(good) - 1}
    positions |= {f"random byte {i}": random.Random(i).randrange(len(good)) for i in range(12)}
    damaged = {"empty": b"", "truncated": good[: len(good) // 2], "truncated by 1 byte": good[:-1],
               "random bytes": random.Random(0).randbytes(len(good))}
    for name, pos in positions.items():
        flipped = bytearray(good)
        flipped[pos] ^= 1 << (pos % 8)
        damaged[f"bit flip in {name}"] = bytes(flipped)
    return damaged


def test_corrupt_checkpoints_are_refused_naming_the_file(tmp_path, text_file):
    assert run_main(tiny_args(tmp_path / "out", text_file, max_iters=2)) == 0
    good = (tmp_path / "out" / "last.pt").read_bytes()
    for name, data in corruptions(good).items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=str(path)):
            load_checkpoint(path)
    assert (tmp_path / "out" / "last.pt").read_bytes() == good and load_checkpoint(tmp_path / "out" / "last.pt")
    # Why a digest and not just the zip CRCs: these flips pass zipfile's CRC check.
    for name in ("bit flip in padding of the first entry", "bit flip in central directory"):
        assert zipfile.ZipFile(tmp_path / f"{name}.pt").testzip() is None


def test_best_pt_only_from_a_finite_improvement_and_last_pt_always_newest(tmp_path, text_file, monkeypatch):
    val_losses = iter([3.0, 2.0, math.nan, 2.5, 1.8])
    monkeypatch.setattr(train, "evaluate", lambda *args: train.EvalResult(next(val_losses), math.nan, 1))
    saves = []
    real_save = checkpoint.save_checkpoint
    monkeypatch.setattr(checkpoint, "save_checkpoint",
                        lambda state, path: (saves.append((path.name, state["step"])), real_save(state, path)))
    assert run_main(tiny_args(tmp_path, text_file, max_iters=10, eval_interval=2)) == 0
    assert [step for name, step in saves if name == "best.pt"] == [2, 4, 10]
    assert [step for name, step in saves if name == "last.pt"] == [2, 4, 6, 8, 10]
    best, last = load_checkpoint(tmp_path / "best.pt"), load_checkpoint(tmp_path / "last.pt")
    assert (best["step"], best["best_val_loss"]) == (10, 1.8)
    assert last["step"] == 10


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_checkpoint_schema_is_documented_keys_of_plain_values(tmp_path, text_file, dtype):
    assert run_main(tiny_args(tmp_path, text_file, max_iters=1, batch_size=2, dtype=dtype)) == 0
    for name in ("last.pt", "best.pt"):
        state = torch.load(tmp_path / name, weights_only=True)  # no allowlist, no safe_globals
        assert sorted(state) == sorted(REQUIRED_KEYS)
        assert sorted(state["rng"]) == sorted(RNG_STREAMS)
        assert bool(state["scaler"]) == (dtype == "float16")
        assert_nested_equal(state, load_checkpoint(tmp_path / name))


# ----------------------------------------------------------------------------- numerical faults
def nan_gradient(loss: torch.Tensor) -> torch.Tensor:
    """The identity going forward, NaN coming back: a finite loss whose gradient is not."""
    loss = loss.clone()
    loss.register_hook(lambda grad: grad * math.nan)
    return loss


POISONS = {"nan": lambda loss: loss * math.nan, "inf": lambda loss: loss * math.inf,
           "nan gradient": nan_gradient}  # a finite loss: caught a guard that checked only the loss


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("poison", POISONS)
def test_a_nonfinite_step_stops_the_run_and_never_reaches_a_checkpoint(tmp_path, text_file, monkeypatch, capsys,
                                                                       poison, optimizer):
    # Step 4 is poisoned; step 5 runs too (its log line is the first host read after); nothing after step 3 is saved.
    args = dict(grad_accum=2, max_iters=20, log_interval=5, eval_interval=3, optimizer=optimizer)
    assert run_main(tiny_args(tmp_path / "reference", text_file, **{**args, "max_iters": 3})) == 0
    before_step_4 = load_checkpoint(tmp_path / "reference" / "last.pt")
    losses = []
    on_training_forward(monkeypatch, lambda n, loss: losses.append(loss.detach()) or (
        POISONS[poison](loss) if n == call_of(4, 2, 2) else None))
    out = tmp_path / "poisoned"
    assert run_main(tiny_args(out, text_file, **args)) == 3
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: non-finite loss or gradient at step 4;")
    assert len(losses) == call_of(5, 2, 2) and all(torch.isfinite(loss) for loss in losses[: call_of(4, 2, 2)])
    assert_nested_equal(load_checkpoint(out / "last.pt")["model"], before_step_4["model"])  # step 3's, intact
    for name in ("last.pt", "best.pt"):
        assert all(torch.isfinite(t).all() for t in floating_tensors(load_checkpoint(out / name)))


def test_the_guard_names_the_first_faulty_step_and_refuses_weights_with_any_non_finite_value():
    """Of several faulty steps between two syncs, the first is named; one inf weight refuses a save."""
    guard = NonFiniteGuard(torch.amp.GradScaler("cpu", enabled=False), 3, torch.device("cpu"))
    one, nan = torch.tensor(1.0), torch.tensor(math.nan)
    guard.check(3, one, one)
    guard.raise_if_tripped()  # a finite step is no fault
    guard.check(4, one, nan)  # a finite loss, a NaN gradient
    guard.check(5, nan, one)
    with pytest.raises(RunStopped, match="non-finite loss or gradient at step 4;"):
        guard.raise_if_tripped()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    guard.raise_if_weights_not_finite(model, 6)
    with torch.no_grad():
        model[1].bias[0] = math.inf
    with pytest.raises(RunStopped, match="the weights are not finite after step 7"):
        guard.raise_if_weights_not_finite(model, 7)


def count_host_reads(monkeypatch) -> list[str]:
    """Record every tensor-to-Python conversion (what would be a device sync on a GPU)."""
    reads: list[str] = []
    for name in ("item", "__bool__", "__int__", "__float__", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _name=name: (reads.append(_name), _real(self, *a))[1])
    return reads


# A fork's optimizers whose step must read a tensor on the host (a device sync per step); any other is refused.
HOST_SYNCING: set[str] = set()


def host_sync_faults(tmp_path: Path, text_file: Path, monkeypatch, optimizer: str) -> list[str]:
    """Runs of 4 and 8 steps that log, eval and save only at the end: [] when the 4 more silent steps read
    nothing more on the host (or the optimizer is in HOST_SYNCING), else what is wrong and what to do."""
    reads = count_host_reads(monkeypatch)
    counts = []
    for n_steps in (4, 8):  # only the last step logs, evals and saves
        reads.clear()
        args = dict(max_iters=n_steps, log_interval=100, eval_interval=100, grad_accum=2, optimizer=optimizer)
        assert run_main(tiny_args(tmp_path / str(n_steps), text_file, **args)) == 0
        # get_batch reads its start offsets with tolist(): CPU data on the host, not a device sync.
        counts.append(len([r for r in reads if r != "tolist"]))
    assert counts[0] > 0  # the counter counts
    if counts[1] == counts[0] or optimizer in HOST_SYNCING:
        return []
    return [f"optimizer {optimizer} reads a tensor on the host {(counts[1] - counts[0]) / 4:g} times per step "
            f"({counts[0]} reads in 4 steps, {counts[1]} in 8): each is a device sync that stalls a GPU. Write its "
            "step without .item() or bool(tensor), as docs/experiments.md's Lion, or add "
            f"{optimizer!r} to tests/test_reliability.py's HOST_SYNCING if it must"]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))  # every optimizer of the table
def test_no_host_sync_on_steps_that_do_not_log(tmp_path, text_file, monkeypatch, optimizer):
    faults = host_sync_faults(tmp_path, text_file, monkeypatch, optimizer)
    assert not faults, faults[0]


def build_adafactor(model, cfg, device, dtype):  # torch's Adafactor: its step reads tensors on the host
    return torch.optim.Adafactor(optim.adamw_groups(optim.trained_parameters(model), cfg.weight_decay),
                                 lr=cfg.learning_rate)


def test_an_optimizer_that_syncs_the_host_is_named_with_its_count_unless_declared(tmp_path, text_file, monkeypatch):
    monkeypatch.setitem(OPTIMIZERS, "adamw", build_adafactor)  # under a name the config accepts
    faults = host_sync_faults(tmp_path / "silent", text_file, monkeypatch, "adamw")
    assert faults and "add 'adamw' to tests/test_reliability.py's HOST_SYNCING" in faults[0]
    monkeypatch.setitem(globals(), "HOST_SYNCING", {"adamw"})
    assert host_sync_faults(tmp_path / "declared", text_file, monkeypatch, "adamw") == []


def test_fp16_overflow_skips_the_step_and_training_goes_on(tmp_path, text_file, monkeypatch):
    args = dict(dtype="float16", batch_size=2, eval_interval=100)
    assert run_main(tiny_args(tmp_path / "reference", text_file, max_iters=2, **args)) == 0
    reference = load_checkpoint(tmp_path / "reference" / "last.pt")
    poison_loss(monkeypatch, lambda n: n == 3, math.inf)  # step 3 overflows
    assert run_main(tiny_args(tmp_path / "skipped", text_file, max_iters=3, **args)) == 0
    skipped = load_checkpoint(tmp_path / "skipped" / "last.pt")
    assert skipped["step"] == 3
    assert_nested_equal(skipped["model"], reference["model"])  # GradScaler skipped the update
    assert_nested_equal(skipped["optimizer"]["state"], reference["optimizer"]["state"])
    assert skipped["scaler"] == reference["scaler"] | {"scale": reference["scaler"]["scale"] / 2,
                                                       "_growth_tracker": 0}


def test_fp16_max_skipped_steps_in_a_row_abort(tmp_path, text_file, monkeypatch, capsys):
    poison_loss(monkeypatch, lambda n: n >= 2, math.inf)  # every step from step 2 on overflows
    args = dict(dtype="float16", batch_size=2, max_iters=10, eval_interval=100, max_skipped_steps=3)
    assert run_main(tiny_args(tmp_path, text_file, **args)) == 3
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: 3 steps in a row skipped for non-finite fp16 gradients (the last at step 4); "
        "lower learning_rate or use --dtype bfloat16")
    assert not (tmp_path / "last.pt").exists()


# ----------------------------------------------------------------------------- signals
def test_train_keeps_the_callers_signal_handlers_and_main_puts_them_back(tmp_path, tiny_cfg, text_file, monkeypatch,
                                                                         signal_handlers):
    """train.train() in a caller's process (a notebook, a sweep): its Ctrl-C stays the caller's."""
    seen = []
    on_training_forward(monkeypatch, lambda n, loss_sum: seen.append(signal.getsignal(signal.SIGINT)))
    train.train(tiny_cfg(max_iters=2, eval_interval=2))
    assert seen == [sentinel, sentinel]
    assert run_main(tiny_args(tmp_path / "main", text_file, max_iters=1)) == 0
    assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is sentinel


def test_second_ctrl_c_during_the_save_corrupts_nothing(tmp_path, text_file, monkeypatch, signal_handlers):
    signal_at(monkeypatch, signal.SIGINT, call_of(3, 1, 1))
    real_save = torch.save

    def save_interrupted(obj, f, *args, **kwargs):  # the impatient second Ctrl-C, inside the save
        os.kill(os.getpid(), signal.SIGINT)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_interrupted)
    assert run_main(tiny_args(tmp_path / "split", text_file, max_iters=6, eval_interval=100)) == 130
    # Stopped: the process is on its way out, so further signals stay ignored until it exits.
    assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "split" / "last.pt")["step"] == 3
    assert run_main(tiny_args(tmp_path / "split", text_file, max_iters=6, eval_interval=100, resume="true")) == 0
    assert run_main(tiny_args(tmp_path / "straight", text_file, max_iters=6, eval_interval=100)) == 0
    assert_same_training_state(load_checkpoint(tmp_path / "straight" / "last.pt"),
                               load_checkpoint(tmp_path / "split" / "last.pt"))
    assert metrics(tmp_path / "straight")[0] == metrics(tmp_path / "split")[0]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143),
                                          pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)],  # CI runs it
                         ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_during_shutdown_keeps_the_exit_code(tmp_path, text_file, signum, code):
    # A supervisor that repeats its SIGTERM while the run shuts down must see 143, not -15 (a crash to it).
    out, lingering = tmp_path / "out", tmp_path / "second signal sent"
    name = signal.Signals(signum).name
    child = subprocess.Popen([sys.executable, *AS_A_SCRIPT, "--signal", name,
                              "--at-call", "3", "--linger-until", str(lingering), "--",
                              *tiny_args(out, text_file, max_iters=10, eval_interval=100)],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    while not (lines and lines[-1].startswith("error: ")):  # the run's last line: it is shutting down
        lines.append(child.stderr.readline())
        assert lines[-1], f"exited {child.wait()} before its error line: {lines}"
    child.send_signal(signum)  # pending before the lingering process next runs, so it lands in the window
    lingering.touch()
    assert child.wait(timeout=60) == code
    assert lines[-1] == f"error: stopped by {name} after step 3; last.pt holds it, continue with --resume\n"
    assert load_checkpoint(out / "last.pt")["step"] == 3 and temp_files(out) == []


def test_under_torchrun_rank_0_alone_says_a_signals_notice(monkeypatch, capfd):
    """torchrun signals every rank; each said "SIGTERM: finishing this step ..., then saving last.pt"."""
    said_by_0 = "\nSIGTERM: finishing this step (and its eval, if due), then saving last.pt\n"
    for rank, said in (("1", ""), ("0", said_by_0)):
        monkeypatch.setenv("RANK", rank)
        cli.StopOnSignal(install=False).handle(signal.SIGTERM, None)
        assert capfd.readouterr().err == said


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_before_the_first_step_is_one_line_and_leaves_no_folder(tmp_path, text_file, monkeypatch, capsys,
                                                                         signal_handlers, signum, code):
    """Bug caught: a SIGTERM while the corpus was prepared killed the process at once (no line, a lock left)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *args: None)  # stands in for the default, so that the bug does not end pytest
    real_write = prepare.write_tokens

    def write_tokens(*args, **kwargs):  # half-way through preparing the corpus, its staging folder written into
        os.kill(os.getpid(), signum)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(prepare, "write_tokens", write_tokens)
    assert run_main(tiny_args(tmp_path / "out", text_file, max_iters=2)) == code
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "error: interrupted before training started; nothing was saved", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "data"]  # no out_dir, no lock in it
    assert list((tmp_path / "data").iterdir()) == []  # nor half a corpus: its staging folder is gone


def test_a_ctrl_c_as_a_finished_run_exits_says_it_finished(tmp_path, text_file, monkeypatch, capsys, signal_handlers):
    """Bug caught: a Ctrl-C right after the last save said "interrupted before training started; nothing was saved"."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ctrl_c = lambda finished: finished and os.kill(os.getpid(), signal.SIGINT)  # noqa: E731 - the loop is done
    monkeypatch.setattr(runtime, "teardown", ctrl_c)
    assert run_main(tiny_args(tmp_path / "out", text_file, max_iters=2)) == 130
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "error: interrupted after training finished; what it saved is whole", err
    assert load_checkpoint(tmp_path / "out" / "last.pt")["step"] == 2


@pytest.mark.parametrize("first, second, code", [(signal.SIGTERM, signal.SIGINT, 143),
                                                  (signal.SIGINT, signal.SIGTERM, 130)],
                         ids=["SIGTERM then SIGINT", "SIGINT then SIGTERM"])
def test_the_first_signal_decides_the_exit_code(tmp_path, text_file, monkeypatch, capsys, signal_handlers,
                                                first, second, code):
    """Bug caught: the latest signal kept: a Ctrl-C after a scheduler's SIGTERM turned a preemption into 130."""
    signal_at(monkeypatch, first, call_of(2, 1, 2))  # both inside step 2
    signal_at(monkeypatch, second, call_of(2, 2, 2))
    assert run_main(tiny_args(tmp_path, text_file, grad_accum=2, max_iters=6, eval_interval=100)) == code
    name = signal.Signals(first).name
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: stopped by {name} after step 2; last.pt holds it, continue with --resume")


@pytest.mark.parametrize("eval_interval", [1, 5], ids=["a save after every step", "the first save at the end"])
def test_an_update_that_overflows_the_weights_is_never_saved(tmp_path, text_file, capsys, eval_interval):
    """A finite loss and gradient times lr 3e38 overflow the weights, unseen by the check of loss and grad norm."""
    out = tmp_path / "run"
    code = run_main(tiny_args(out, text_file, warmup_iters=0, max_iters=5, eval_interval=eval_interval,
                              learning_rate=3e38, min_lr=0))
    err = capsys.readouterr().err.strip()
    assert code == 3 and err.splitlines() == [err]
    # Saving after step 1 finds the weights; without that save, step 2's loss (of the inf weights) is the sign.
    expected = ("the weights are not finite after step 1" if eval_interval == 1
                else "non-finite loss or gradient at step 2")
    assert expected in err
    for name in ("last.pt", "best.pt"):  # none saved at all: the first save would have held step 1's
        assert not (out / name).exists()
