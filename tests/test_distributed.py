"""DDP on CPU (gloo, 2 processes): equivalence with one process, exact resume, failures that stop every rank and
print once, one dtype for all ranks; MFU. The torchrun runs are shared per module (~30 s on 2 cores)."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, make_text, metrics, read_metrics, run_main, run_script, tiny_args, tiny_model
from fault_injection import AS_A_SCRIPT as FAULTS
from fault_injection import assert_same_training_state

import data
import runtime
import train
from checkpoint import claim, load_checkpoint, rank_rng_state
from logs import mfu, peak_flops
from runtime import Dist

CPU = torch.device("cpu")

STEPS, HALF = 6, 3
B = 4  # sequences per micro-batch per rank
# Measured after 6 steps (fp32, the same sums in another order): losses ~1e-7 relative, weights ~2e-8: 100x margin.
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-6


def torchrun(out_dir: Path, corpus: Path, **overrides) -> str:
    """A tiny run in two CPU processes under torchrun; two micro-batches per step exercise no_sync. Its stdout."""
    args = tiny_args(out_dir, corpus, eval_interval=HALF, grad_accum=2, batch_size=B, **overrides)
    return run_script("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *args,
                      timeout=240).stdout


def records(out_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(out_dir) if key in r}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """A straight 2-rank run of STEPS; and one stopped at HALF, saved aside, then resumed to STEPS."""
    root = tmp_path_factory.mktemp("ddp")
    corpus = root / "corpus.txt"
    corpus.write_text(make_text())
    (root / "full.out").write_text(torchrun(root / "full", corpus, max_iters=STEPS))
    torchrun(root / "resumed", corpus, max_iters=HALF)
    (root / "half").mkdir()
    shutil.copy(root / "resumed" / "last.pt", root / "half" / "last.pt")  # the state at HALF, kept
    torchrun(root / "resumed", corpus, max_iters=STEPS, resume="true")
    return root


@pytest.mark.slow  # shares ~30 s of torchrun launches (module fixture)
def test_ddp_two_ranks_equal_one_process_with_the_union_batch(ddp_runs, tiny_cfg, tmp_path, monkeypatch):
    # Rank r draws B windows per micro-batch from Generator(seed + r). One process with 2B per
    # micro-batch sees exactly their union if its get_batch draws B from each of those generators.
    cfg = tiny_cfg(data_path=str(ddp_runs / "corpus.txt"), data_dir=str(ddp_runs / "data"),
                   out_dir=str(tmp_path / "single"), batch_size=2 * B, grad_accum=2, max_iters=STEPS,
                   eval_interval=HALF)
    rank_gens = [torch.Generator().manual_seed(cfg.seed + rank) for rank in range(2)]
    real_get_batch = data.get_batch  # what the random_windows stream draws with

    def union_of_ranks(data, batch_size, block_size, generator, device):
        parts = [real_get_batch(data, batch_size // 2, block_size, g, device) for g in rank_gens]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    monkeypatch.setattr(data, "get_batch", union_of_ranks)
    train.train(cfg)

    single, ddp = Path(cfg.out_dir), ddp_runs / "full"
    for key in ("loss", "val_loss", "grad_norm"):
        a, b = records(single, key), records(ddp, key)
        assert a.keys() == b.keys() and len(a) > 0
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=LOSS_RTOL), (key, step)
    ref, got = load_checkpoint(single / "last.pt")["model"], load_checkpoint(ddp / "last.pt")["model"]
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    # Between HALF and STEPS the weights moved by far more than the tolerance: the bound means something.
    half = load_checkpoint(ddp_runs / "half" / "last.pt")["model"]
    assert max((ref[n] - half[n]).abs().max().item() for n in ref) > 1000 * WEIGHT_ATOL


@pytest.mark.slow  # shares ~30 s of torchrun launches (module fixture)
def test_ddp_kill_and_resume_is_exact_and_one_process_writes_each_metric_once(ddp_runs):
    """Bug caught: MetricsLog enabled on every rank: each record twice in metrics.jsonl, each line printed twice."""
    full, resumed = ddp_runs / "full", ddp_runs / "resumed"
    assert metrics(resumed) == metrics(full)
    got = load_checkpoint(resumed / "last.pt")
    assert_same_training_state(load_checkpoint(full / "last.pt"), got)
    # Both ranks' random streams are in the checkpoint, and they differ (each rank its own windows).
    rngs = got["rng_per_rank"]
    assert len(rngs) == 2 and not torch.equal(rngs[0]["data"]["generator"], rngs[1]["data"]["generator"])
    assert torch.equal(got["rng"]["data"]["generator"], rngs[0]["data"]["generator"])
    logged = read_metrics(full)
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, STEPS + 1))
    assert [r["step"] for r in logged if "val_loss" in r] == [HALF, STEPS]
    assert {r["tokens_per_step"] for r in logged if "loss" in r} == {2 * 2 * B * 32}  # ranks x micro-batches x rows
    printed = [line.split("|")[0].split()[1] for line in (ddp_runs / "full.out").read_text().splitlines()
               if line.lstrip().startswith("step ")]
    assert printed == [str(s) for s in range(1, STEPS + 1) for _ in range(1 + (s % HALF == 0))]  # train, val


@pytest.mark.slow  # shares ~30 s of torchrun launches (module fixture)
def test_resume_with_another_world_size_runs_and_warns(ddp_runs, tiny_cfg, tmp_path, capsys):
    out = tmp_path / "out"  # a checkpoint saved by 2 ranks at HALF, resumed here by a single process
    out.mkdir()
    shutil.copy(ddp_runs / "half" / "last.pt", out / "last.pt")
    cfg = tiny_cfg(data_path=str(ddp_runs / "corpus.txt"), data_dir=str(ddp_runs / "data"), out_dir=str(out),
                   batch_size=B, grad_accum=2, max_iters=HALF + 1, resume=True)
    train.train(cfg)
    assert "NOT bit-exact" in capsys.readouterr().out
    state = load_checkpoint(out / "last.pt")
    assert state["step"] == HALF + 1 and len(state["rng_per_rank"]) == 1


# ----------------------------------------------------------------------------- failures under DDP
def launch_ranks(tmp_path: Path, *args: str, world_size: int = 2,
                 timeout: int = 120) -> list[subprocess.CompletedProcess]:
    """``python *args`` once per rank with torchrun's environment; each rank's result. Not torchrun: it SIGTERMs
    the others when one fails, hiding whether they stop on their own. A rank alive after ``timeout`` is a hang."""
    with socket.socket() as sock:  # a free port for rank 0's rendezvous store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
                        "LOCAL_WORLD_SIZE": str(world_size)}
    logs = [(tmp_path / f"rank{r}.out", tmp_path / f"rank{r}.err") for r in range(world_size)]
    procs = []  # output goes to files: a full pipe could block a rank that its peers then wait for
    for rank, (out, err) in enumerate(logs):
        with open(out, "w") as stdout, open(err, "w") as stderr:
            procs.append(subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=stdout, stderr=stderr,
                                          env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}))
    try:
        for proc in procs:
            proc.wait(timeout=timeout)  # the ranks run side by side: one deadline is enough in practice
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise AssertionError(f"ranks still running after {timeout} s: {[p.poll() for p in procs]}") from None
    return [subprocess.CompletedProcess(args, proc.returncode, out.read_text(), err.read_text())
            for proc, (out, err) in zip(procs, logs)]


@pytest.mark.slow  # ~5 s: torchrun
def test_a_failed_checkpoint_write_on_rank_0_stops_every_rank_with_74(tmp_path, text_file):
    # Saves at steps 2 and 4; from step 4 on rank 0's disk is full: rank 1 must not wait at step 5's all-reduce.
    out = tmp_path / "out"
    ranks = launch_ranks(tmp_path, *FAULTS, "--disk-full-from-step", "4", "--",
                         *tiny_args(out, text_file, max_iters=6, eval_interval=2))
    assert [r.returncode for r in ranks] == [74, 74]
    assert re.fullmatch(r"error: could not write \S+ \(No space left on device\); the previous (best|last)\.pt "
                        r"is intact and no temp file is left\n", ranks[0].stderr), ranks[0].stderr
    assert ranks[1].stderr == ""  # rank 0 says why; rank 1 stops silently
    assert load_checkpoint(out / "last.pt")["step"] == 2  # the last good save, untouched


@pytest.mark.parametrize("script, bad, said", [
    (["train.py"], {"data_path": "/nonexistent/corpus.txt"}, 0),  # every rank finds it, after the ranks joined
    pytest.param(["train.py"], {"batch_size": 0}, 0, marks=pytest.mark.slow),  # found parsing, before any group
    ([*FAULTS, "--corpus-unreadable-on-rank", "1", "--"], {}, 1),  # only rank 1 has it: rank 0 stops silently
])
def test_an_error_is_printed_once_by_the_lowest_rank_that_has_it(tmp_path, text_file, script, bad, said):
    ranks = launch_ranks(tmp_path, *script, *tiny_args(tmp_path / "out", text_file, **bad))
    assert [r.returncode for r in ranks] == [2, 2]
    assert ranks[1 - said].stderr == ""
    prefix = "rank 1: " if said else ""
    assert re.fullmatch(rf"{prefix}error: [^\n]*\n", ranks[said].stderr), ranks[said].stderr
    assert said == 0 or "unreadable on this rank (injected)" in ranks[1].stderr


@pytest.mark.slow  # ~5 s: torchrun
def test_every_rank_trains_in_the_precision_rank_0_chose(tmp_path, text_file):
    # The dtype=auto probe favours bf16 on rank 1 only: rank 0 picks fp32, and so must rank 1.
    ranks = launch_ranks(tmp_path, *FAULTS, "--bf16-fast-on-rank", "1", "--precisions-to", str(tmp_path), "--",
                         *tiny_args(tmp_path / "out", text_file, dtype="auto", max_iters=1, eval_interval=1))
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr for r in ranks]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [["float32"]] * 2
    assert [r.stdout.count("dtype auto -> ") for r in ranks] == [1, 0]  # the choice is announced once
    assert load_checkpoint(tmp_path / "out" / "last.pt")["precision"] == "float32"


@pytest.mark.slow  # two fresh ranks: ~10 s idle, ~25 s on 2 busy cores
def test_a_busy_out_dir_stops_every_rank_before_anything_is_written(tmp_path, text_file):
    out = tmp_path / "out"
    with claim(out):  # a live run, as far as the ranks can tell
        ranks = launch_ranks(tmp_path, "train.py", *tiny_args(out, text_file))
        assert [p.name for p in out.iterdir()] == [".lock"]  # nothing written beside the owner's lock
    assert [r.returncode for r in ranks] == [2, 2]
    assert re.fullmatch(rf"error: {re.escape(str(out))} is in use by process {os.getpid()} on .*\n", ranks[0].stderr)
    assert ranks[1].stderr == ""  # rank 0 holds the lock for the job and says why; rank 1 stops with it


@pytest.mark.slow  # two fresh ranks: ~10 s idle, ~25 s on 2 busy cores
@pytest.mark.parametrize("signal_name, codes, saved, line", [
    ("SIGKILL", [75, -9], 2, r"another rank died without a word \(killed or crashed; gloo: Connection (closed|reset) "
                             r"by peer\), so this one stops too; the last save is intact, continue with --resume"),
    ("SIGTERM", [143, 143], 3, r"stopped by SIGTERM after step 3; last.pt holds it, continue with --resume")])  # rank
def test_a_rank_killed_or_stopped_mid_step_leaves_one_line(tmp_path, text_file, signal_name, codes, saved, line):
    out = tmp_path / "out"  # 0 stops with rank 1 at its signal, in its words (was: "None is not a valid Signals")
    ranks = launch_ranks(tmp_path, *FAULTS, "--signal", signal_name, "--signal-rank", "1", "--at-call", "3", "--",
                         *tiny_args(out, text_file, eval_interval=2))
    assert [r.returncode for r in ranks] == codes and ranks[1].stderr == "", ranks[1].stderr
    assert re.fullmatch(f"error: {line}\n", ranks[0].stderr), ranks[0].stderr
    assert load_checkpoint(out / "last.pt")["step"] == saved and not (out / ".lock").exists()


def test_rank_rng_state_picks_own_stream_and_drops_missing_ranks(capsys):
    state = {"rng": "r0", "rng_per_rank": ["r0", "r1"]}
    assert rank_rng_state(state, Dist(rank=1, world_size=2)) == "r1"
    assert capsys.readouterr().out == ""  # same world size: exact, no warning
    assert rank_rng_state(state, Dist(rank=0, world_size=1)) == "r0"
    assert "NOT bit-exact" in capsys.readouterr().out
    # Rank 2 of 4 did not exist in the saved run: it keeps its fresh (seed + rank) streams.
    assert rank_rng_state(state, Dist(rank=2, world_size=4)) is None


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_step_divisor_makes_ddp_average_equal_the_global_mean_gradient(world_size, monkeypatch):
    # Emulated DDP (each rank's target count all-reduced, its grads averaged) = the gradient of the global mean.
    model = tiny_model(vocab_size=50, block_size=8)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(50, (2 * world_size, 8), generator=gen)
    y = torch.randint(50, (2 * world_size, 8), generator=gen)
    y[0, :5] = -1  # ranks count different numbers of targets
    _, loss_sum, n, _ = model(x, y)
    (loss_sum / n).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    n_global = (y != -1).sum()
    monkeypatch.setattr(train.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(train.dist, "all_reduce", lambda t: t.fill_(n_global))  # every rank's count
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    per_rank = []
    for xr, yr in zip(x.chunk(world_size), y.chunk(world_size)):
        train.accumulate_gradients(model, [(xr, yr)], scaler, CPU, torch.float32, world_size)
        per_rank.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    averaged = [sum(grads) / world_size for grads in zip(*per_rank)]  # what DDP's all-reduce yields
    for got, ref in zip(averaged, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_single_process_setup_is_a_world_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ddp = runtime.setup("cpu")
    assert (ddp.rank, ddp.world_size, ddp.is_main, ddp.enabled) == (0, 1, True, False)
    model = torch.nn.Linear(2, 2)
    assert runtime.wrap(model, ddp) is model
    t = torch.tensor(3.0)
    assert runtime.all_reduce_sum(t) is t and t.item() == 3.0
    assert runtime.gather_to_main({"a": 1}) == [{"a": 1}]
    with pytest.raises(ValueError) as raised:  # no peers to tell: the error itself, nothing added
        with runtime.stop_together(ddp.device):
            raise ValueError("disk full")
    assert not hasattr(raised.value, "reporting_rank")
    with runtime.main_first(ddp.device):  # no peers to wait for
        pass


def test_gradients_are_all_reduced_once_per_step_on_the_last_micro_batch():
    # A one-process gloo group is enough to build a real DDP module and count its all-reduces.
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp_model = DistributedDataParallel(tiny_model(vocab_size=50, block_size=8))
        forwards, synced_after = [], []

        def counting_hook(state, bucket):  # called once per gradient bucket that is all-reduced
            synced_after.append(len(forwards))
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp_model.register_comm_hook(None, counting_hook)
        ddp_model.register_forward_pre_hook(lambda module, args: forwards.append(args))
        x = torch.randint(50, (2, 8))
        train.accumulate_gradients(ddp_model, [(x, x)] * 3, torch.amp.GradScaler("cpu", enabled=False), CPU,
                                   torch.float32)
        assert len(synced_after) > 0 and set(synced_after) == {3}
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- MFU
@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.5e12),  # H100 SXM
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.5e12),
    ("NVIDIA H100 NVL", torch.float16, 835.5e12),
    ("NVIDIA H200", torch.bfloat16, 989.5e12),
    ("NVIDIA A100 80GB PCIe", torch.float16, 312e12),
    ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
    ("Tesla V100-PCIE-32GB", torch.float16, 112e12),
    ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bf16 tensor cores on Volta
    ("NVIDIA H100 80GB HBM3", torch.float32, None),  # the table has 16-bit peaks only
    ("NVIDIA GeForce GTX 1080", torch.float16, None),  # unknown: no number rather than a guess
])
def test_peak_flops_table(name, dtype, peak):
    assert peak_flops(name, dtype) == peak


def test_mfu_divides_achieved_by_peak_over_all_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-40GB")
    got = mfu(flops_per_token=1e9, tokens_per_s=2e5, device=torch.device("cuda"), dtype=torch.bfloat16,
              world_size=2)
    assert got == pytest.approx(1e9 * 2e5 / (2 * 312e12))
    assert mfu(1e9, 2e5, torch.device("cpu"), torch.bfloat16) is None  # no datasheet peak for a CPU


def test_multi_gpu_page_commands_parse_and_keep_the_gpt2_batch():
    from config import parse_args
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "multi-gpu.md").read_text(), re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    commands = [shlex.split(line) for line in lines if line.startswith("torchrun")]
    assert len(commands) == 3  # one node, several nodes, CPU
    for argv in commands:
        launcher, train_args = argv[: argv.index("train.py")], argv[argv.index("train.py") + 1:]
        cfg = parse_args(train_args)  # raises on any flag that no longer exists
        flags = dict(a.lstrip("-").split("=", 1) for a in launcher if "=" in a)
        world = int(flags["nproc_per_node"]) * int(flags.get("nnodes", 1))
        if cfg.tokenizer == "gpt2":  # the page promises these keep the preset's tokens per step
            assert cfg.tokens_per_step() * world == parse_args(["--config", "gpt2"]).tokens_per_step()


def test_schedule_time_is_refused_under_ddp_before_anything_is_written(tmp_path, text_file, monkeypatch, capsys):
    """Each rank's clock would give it its own lr, and the ranks' weights would drift apart."""
    monkeypatch.setattr(runtime, "setup", lambda requested: Dist(rank=0, world_size=2))  # torchrun's rank 0
    assert run_main(tiny_args(tmp_path / "out", text_file, schedule="time", max_time=60)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: schedule=time follows one process's clock") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
