"""The performance tooling: bench.py measures train.py's real step, dtype=auto decides by measurement,
the bf16 CPU attention path computes the same attention, plot.py draws its PNG."""
from __future__ import annotations

import errno
import json
import statistics

import pytest
import torch
import torch.nn.functional as F
from conftest import read_metrics, run_script, write_chats

import runtime
import train
from checkpoint import load_checkpoint
from cli import DataError, PathError
from config import make_config
from model import GPTConfig, attention, visible_keys
from scripts import bench, plot
from tokenizer import tokenizer_vocab_size


def test_bench_step_is_train_step(tiny_cfg):
    """Same seed, same config: bench's timed steps give exactly train.py's per-step losses."""
    cfg = tiny_cfg(dtype="float32", compile="off", max_iters=6, eval_interval=100)
    train.train(cfg)
    logged = read_metrics(cfg.out_dir)
    train_losses = [r["loss"] for r in logged if "val_loss" not in r]
    b = bench.build("tiny", cfg)
    for _ in range(6):
        bench.timed_step(b)
    assert [loss.item() for loss in b.losses] == train_losses


def test_bench_times_an_init_from_run_on_the_bases_weights_and_tokenizer(tiny_cfg, tmp_path):
    """chat_small's kind of run: bench builds what train.py fine-tunes (the base's weights, tokenizer, markers)."""
    base = tiny_cfg(out_dir=str(tmp_path / "base"), max_iters=2, eval_interval=2, block_size=64)
    train.train(base)
    chats = write_chats(tmp_path / "chats.jsonl")
    b = bench.build("chat", make_config("chat_small", init_from=base.out_dir, data_path=str(chats), device="cpu",
                                        data_dir=base.data_dir, dtype="float32", compile="off"))
    state = load_checkpoint(tmp_path / "base" / "best.pt")
    assert b.run.corpus.vocab_size == tokenizer_vocab_size(state["tokenizer"]) + 5  # the base's, and the markers
    blocks = {name: t for name, t in b.run.model.state_dict().items() if name.startswith("transformer.h.")}
    assert blocks and all(torch.equal(t, state["model"][name]) for name, t in blocks.items())


def test_bench_counts_the_tokens_its_steps_processed_not_the_nominal_batch(tiny_cfg, monkeypatch):
    """Rows shorter than block_size (a length curriculum, padded chats): tokens/s counts what the steps held."""
    cfg = tiny_cfg(dtype="float32", compile="off", grad_accum=2)
    b = bench.build("tiny", cfg)
    full = b.run.stream.next
    monkeypatch.setattr(b.run.stream, "next", lambda: tuple(t[:, :8] for t in full()))  # (B, 8) rows
    bench.run([b], steps=3, warmup=1, rounds=1)
    result = bench.summarise(b)
    assert b.positions == [cfg.batch_size * 8 * cfg.grad_accum] * 3
    assert result["tokens_per_s"] == pytest.approx(b.positions[0] / (result["ms_per_step"] / 1000), rel=1e-12)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_bench_replays_exactly_the_steps_matmuls_the_models_flops_and_muons_iteration(tiny_cfg, optimizer):
    """The matmul limit's FLOPs are the model's for every token, plus Muon's Newton-Schulz iteration: 5 steps of
    X X^T, A A and A X on each block matrix in its wide orientation (r <= c)."""
    cfg = tiny_cfg(dtype="bfloat16", compile="off", optimizer=optimizer)
    b = bench.build("tiny", cfg)
    limit = bench.matmul_limit(b, repeats=1)
    tokens = cfg.batch_size * cfg.block_size
    iteration = 0
    if optimizer == "muon":
        shapes = [sorted(p.shape) for p in b.run.model.transformer.h.parameters() if p.dim() == 2]
        iteration = sum(5 * (2 * r * r * c + 2 * r * r * r + 2 * r * r * c) for r, c in shapes)
    assert limit["matmul_gflop"] * 1e9 == pytest.approx(b.run.model.flops_per_token() * tokens + iteration, rel=1e-12)
    assert limit["matmul_ms"] > 0 and limit["matmul_gflops"] == pytest.approx(
        limit["matmul_gflop"] / limit["matmul_ms"] * 1000, rel=1e-9)


@pytest.mark.slow  # ~4 s, a tool's option: CI runs it
def test_bench_profiles_a_step_by_category_and_the_categories_add_up_to_its_time(tiny_cfg):
    """--profile's last line: every category (Muon's matmuls in "optimizer"), summing to the step's time."""
    b = bench.build("tiny", tiny_cfg(dtype="float32", compile="off", optimizer="muon"))
    bench.timed_step(b)
    line = bench.profile(b, top=3).splitlines()[-1]
    wall = float(line.split("ms per step of ")[1].split(" ")[0])
    parts = dict(part.rsplit(" ", 2)[:2] for part in line.split("(profiled): ")[1].split(" | "))
    assert list(parts) == [name for name, _ in bench.CATEGORIES] + ["Python and the dispatcher"]
    assert sum(map(float, parts.values())) == pytest.approx(wall, abs=0.1 * len(parts))  # each printed to 0.1 ms
    assert float(parts["optimizer"]) > 0 and float(parts["matmul"]) > 0


@pytest.mark.slow  # ~8 s: two configs built and timed; the default suite checks bench's step is train.py's
def test_bench_vs_writes_both_results(tiny_cfg, tmp_path):
    cfg = tiny_cfg()
    out = tmp_path / "bench.json"
    run_script("-m", "scripts.bench", "--config", "tiny", f"data_path={cfg.data_path}", f"data_dir={cfg.data_dir}",
               "device=cpu", "dtype=float32", "--vs", "dtype=bfloat16", "--steps", "4", "--warmup", "1",
               "--rounds", "2", "--threads", "1", "--json", str(out))
    a, b = json.loads(out.read_text())["results"]
    assert (a["dtype"], b["dtype"]) == ("float32", "bfloat16") and a["threads"] == b["threads"] == 1
    for result in (a, b):
        assert result["steps"] == 4 and result["tokens_per_s"] > 0 and result["peak_mib"] > 0
        assert set(result["phases_ms"]) == set(bench.PHASES)
        # Facts, not timings a busy machine could bend: a step's time is the sum of its phases, so each
        # phase's median lies within the slowest step, and ms/step is the median of the per-step times.
        assert result["ms_per_step"] == statistics.median(result["step_ms"]) and len(result["step_ms"]) == 4
        assert all(0 < ms <= max(result["step_ms"]) for ms in result["phases_ms"].values())
    failed = run_script("-m", "scripts.bench", "--config", "tiny", f"data_path={cfg.data_path}",
                        f"data_dir={cfg.data_dir}", "device=cpu", "--vs", "batch_size=4", "--steps", "2",
                        "--warmup", "0", "--threads", "1", "--min-ratio", "1000", check=False)
    assert failed.returncode == 1 and "below --min-ratio" in failed.stderr


@pytest.mark.parametrize("bf16, fp32, expected", [(900.0, 200.0, torch.bfloat16),  # AVX512-BF16 / AMX
                                                  (150.0, 200.0, torch.float32),   # bf16 emulated
                                                  (250.0, 200.0, torch.float32)])  # too close to pay
def test_auto_dtype_on_cpu_follows_the_probe(monkeypatch, bf16, fp32, expected):
    speeds = {torch.bfloat16: bf16, torch.float32: fp32}
    monkeypatch.setattr(runtime, "matmul_gflops", lambda m, k, n, dtype: speeds[dtype])
    assert runtime.pick_dtype("auto", torch.device("cpu")) == expected
    assert runtime.pick_dtype("float32", torch.device("cpu")) == torch.float32  # explicit wins, no probe


def test_matmul_probe_measures_and_leaves_rng_alone():
    state = torch.get_rng_state()
    assert runtime.matmul_gflops(64, 32, 16, torch.float32, seconds=0.01) > 0
    assert torch.equal(torch.get_rng_state(), state)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """model.attention over a sequence of its own (no cache), with visible_keys' causal mask."""
    T = q.size(2)
    tokens = torch.zeros(q.size(0), T, dtype=torch.long)  # (B, T): no cache, the rule reads positions only
    return attention(q, k, v, visible_keys(GPTConfig(vocab_size=1, block_size=T), tokens, T), dropout_p)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_bf16_cpu_attention_matches_sdpa(dropout_p):
    """The explicit bf16 path computes SDPA's causal attention (to bf16 precision), forward and backward."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen, requires_grad=True) for _ in range(3))  # (B, nh, T, hs)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.sum().backward()
    want_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    got = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    got.float().sum().backward()
    for t, g in zip((q, k, v), want_grads):
        torch.testing.assert_close(t.grad, g, atol=5e-2, rtol=5e-2)
    if dropout_p:  # position 0 attends to itself alone: weight 1, so dropout leaves 0 or 1 / (1 - p)
        torch.manual_seed(0)
        y0 = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), dropout_p)[:, :, 0].float()  # (B, nh, hs)
        kept = v[:, :, 0].detach().bfloat16().float() / (1 - dropout_p)
        is_zero, is_kept = (y0 == 0).all(-1), torch.isclose(y0, kept, rtol=2e-2, atol=1e-2).all(-1)
        assert (is_zero | is_kept).all()


def test_plot_writes_png(tmp_path, monkeypatch):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    records = [{"step": s, "loss": 3.0 - s / 100, "time_s": s / 10} for s in (10, 20, 30)]
    records += [{"step": 30, "val_loss": 2.8, "time_s": 3.2}]
    metrics.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = plot.plot([metrics, metrics], tmp_path / "loss.png", labels=["a", "b"], refs=[(2.0, 2.9)])
    assert (before := out.read_bytes())[:8] == b"\x89PNG\r\n\x1a\n" and len(before) > 10_000
    train_records, val_records = plot.read_metrics(metrics)
    assert [r["step"] for r in train_records] == [10, 20, 30] and val_records[0]["val_loss"] == 2.8

    (tmp_path / "mine.png").write_bytes(b"\x89PNG\r\n\x1a\n mine")  # an image plot.py did not write: it replaced it
    with pytest.raises(SystemExit) as stopped:
        plot.main([str(metrics), "-o", str(tmp_path / "mine.png")])
    assert stopped.value.code == 2 and (tmp_path / "mine.png").read_bytes() == b"\x89PNG\r\n\x1a\n mine"

    def full_disk(fig, tmp, **kwargs):  # half an image, then ENOSPC: it once cut the old image short
        tmp.write_bytes(b"\x89PNG")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(plot.plt.Figure, "savefig", full_disk)
    with pytest.raises(SystemExit) as stopped:
        plot.main([str(metrics), "-o", str(out)])
    assert stopped.value.code == 74 and out.read_bytes() == before and len(list(tmp_path.iterdir())) == 3
    metrics.write_text('{"step": 40, "loss": null}\n')  # was: a TypeError in the drawing
    with pytest.raises(DataError, match="metrics.jsonl:1: loss is null, not a number"):
        plot.read_metrics(metrics)
    metrics.write_text('{"step": 4, "val_loss": NaN}\n{"step": 4, "loss": 3.0}\n')  # a diverged eval, as logged
    assert plot.read_metrics(metrics) == ([{"step": 4, "loss": 3.0}], [])  # not drawn (matplotlib's ValueError)
    metrics.write_text("")  # a run stopped before its first line: was an empty figure, and "wrote"
    with pytest.raises(DataError, match="no train or val records in "):
        plot.plot([metrics], out, ["a"])
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "results.json").write_text("{}")  # was: a KeyError
    with pytest.raises(DataError, match="not compare.py's results.json"):
        plot.expand(tmp_path / "exp")


@pytest.mark.parametrize("compile_wanted", [False, True], ids=["compile off", "compile on"])
def test_train_and_the_tools_get_one_runtime_and_precision_from_choose_runtime(tiny_cfg, monkeypatch, tmp_path,
                                                                                compile_wanted):
    """Device, threads, precision (dtype=auto's probe) and compile come from runtime.choose_runtime in train.py,
    bench.py, the doctor, eval.py and compare.py alike. The compiler itself is stubbed."""
    from scripts import compare, doctor
    from scripts import eval as evaluate
    made, probes, real_runtime, real_pick = [], [], runtime.Runtime, runtime.pick_dtype
    monkeypatch.setattr(runtime, "Runtime", lambda *fields: made.append(real_runtime(*fields)) or made[-1])
    monkeypatch.setattr(runtime, "pick_dtype", lambda *args: probes.append(args) or real_pick("float32", *args[1:]))
    monkeypatch.setattr(runtime, "want_compile", lambda setting, device: compile_wanted)
    monkeypatch.setattr(runtime, "compile_or_eager", lambda model, enabled, probe: model)
    cfg = tiny_cfg(dtype="auto", threads=1, max_iters=1, eval_interval=1)
    train.train(cfg)
    entry_points = {"train.py": made[-1]}
    bench.build("bench", cfg)
    entry_points["bench.py"] = made[-1]
    doctor.run_checks(cfg)
    entry_points["doctor.py"] = made[-1]
    evaluate.main(["--ckpt", cfg.out_dir, "--threads", "1"])
    entry_points["eval.py"] = made[-1]
    compare.pin_auto_dtype([compare.Run("a", 1, tmp_path / "c", "tiny", {"dtype": "auto", "device": "cpu",
                                                                        "threads": 1, "data_path": cfg.data_path})])
    assert entry_points["train.py"].compile == compile_wanted and entry_points["train.py"].threads == 1
    assert all(rt == entry_points["train.py"] for rt in entry_points.values()), entry_points
    expected = ("auto", torch.device("cpu"), (cfg.batch_size * cfg.block_size, cfg.n_embd, 4 * cfg.n_embd))
    assert [p for p in probes if p[0] == "auto"] == [expected] * 4  # train, bench, doctor, compare


def test_a_results_file_replaces_only_results_written_before(tmp_path):
    """Bug caught: bench's --json and harness's --output replaced any JSON holding "results" (a user's notes)."""
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    ours.write_text(json.dumps({"load_average": [0.5], "results": []}))
    theirs.write_text(json.dumps({"results": "Q3 sales, keep"}))
    for path in (ours, tmp_path / "new.json"):
        bench.check_results_path(path, "--json")
    with pytest.raises(PathError, match="neither a new .json file nor results written before"):
        bench.check_results_path(theirs, "--json")
