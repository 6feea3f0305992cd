"""Training throughput: ms/step, tokens/s, where a step's time goes, model FLOP/s, peak memory.

    python -m scripts.bench --config nanogpt_cpu                      # one config
    python -m scripts.bench --config nanogpt_cpu --vs dtype=bfloat16  # two configs, interleaved, ratio
    python -m scripts.bench --config small compile=on --steps 200     # KEY=VALUE overrides any field
    python -m scripts.bench --matmul                                  # fp32 / bf16 matmul peak GFLOP/s
    python -m scripts.bench --config nanogpt_cpu dtype=float32 --vs dtype=bfloat16 --min-ratio 1.5  # a check

It times train.py's own step (train.build_run, train.train_step), a device sync after each phase, medians after the
warm-up; --vs alternates rounds, so other load falls on both configs alike. Rows: docs/notebook/performance.md."""
import sys

if not __package__:  # run as a file, `python scripts/bench.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.bench", file=sys.stderr)
    sys.exit(2)

import contextlib
import json
import math
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from checkpoint import start_from
from cli import CommandLine, PathError, exit_on_errors, require, run_tool
from config import TrainConfig, make_config
from logs import threads_text
from runtime import (atomic_write_text, check_writable, choose_runtime, compile_for_step, dtype_name, matmul_gflops,
                     pick_device, use_threads)
from train import Run, build_run, get_lr, train_step

PHASES = ("data", "step")  # drawing the batches; train.train_step (forward, backward, clip, update)


@dataclass
class Bench:
    name: str
    run: Run  # train.build_run's
    train_model: torch.nn.Module  # compiled as train.py compiles it
    compile_s: float
    times: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    losses: list[float] = field(default_factory=list)  # one per step taken
    positions: list[int] = field(default_factory=list)  # tokens each timed step processed: a loader's rows may vary
    peak_bytes: int = 0


def build(name: str, cfg: TrainConfig) -> Bench:
    """The run train.py would build for cfg (init_from: on the base's weights and tokenizer), compiled as it does."""
    cfg, pretrained = start_from(cfg)
    rt = choose_runtime(cfg)
    run = build_run(cfg, rt, pretrained=pretrained)
    t0 = time.perf_counter()
    return Bench(name, run, compile_for_step(run.model, run.stream, rt), time.perf_counter() - t0)


def synced_clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()


def timed_step(b: Bench) -> None:
    """One optimizer step of train.train_step, a synchronised timer around each phase (b.times)."""
    cfg, device, step = b.run.cfg, b.run.rt.device, len(b.losses)
    t0 = synced_clock(device)
    batches = [b.run.stream.next() for _ in range(cfg.grad_accum)]
    t1 = synced_clock(device)
    losses, _ = train_step(b.run, b.train_model, batches, step + 1, get_lr(step, cfg))
    t2 = synced_clock(device)
    b.losses.append(losses.loss_sum / losses.n_targets)  # a tensor: .item() only after timing, no sync in the step
    for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1)):
        b.times[phase].append(seconds)
    b.positions.append(sum(x.numel() for x, _ in batches))  # shapes: known on the host, no sync


# The matrix products a step runs, as the dispatcher sees them (autocast's casts done); the last two inputs multiply.
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}


class MatmulRecorder(TorchDispatchMode):
    """Every matrix product run under it (forward, backward, optimizer): op and its inputs' shapes, strides, dtype."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            self.calls.append((func, [(t.shape, t.stride(), t.dtype, t.device) for t in tensors],
                               2 * tensors[-2].numel() * tensors[-1].size(-1)))  # FLOPs
        return func(*args, **(kwargs or {}))


def matmul_limit(b: Bench, repeats: int = 5) -> dict:
    """The step's matmuls replayed alone at their shapes: the limit of a step whose other work costs nothing. A fused
    kernel's products (SDPA's attention) are unseen by the dispatcher: not among them."""
    with MatmulRecorder() as recorder:
        timed_step(b)
    gen = torch.Generator(device=b.run.rt.device).manual_seed(0)
    calls = [(func, [torch.empty_strided(shape, stride, dtype=dtype, device=device).normal_(generator=gen)
                     for shape, stride, dtype, device in inputs]) for func, inputs, _ in recorder.calls]
    passes = []
    for _ in range(repeats + 1):  # the first pass warms up: kernels chosen, memory touched
        start = synced_clock(b.run.rt.device)
        for func, tensors in calls:
            func(*tensors)
        passes.append(synced_clock(b.run.rt.device) - start)
    seconds, flops = statistics.median(passes[1:]), sum(f for *_, f in recorder.calls)
    return {"matmul_ms": seconds * 1000, "matmul_gflop": flops / 1e9, "matmul_gflops": flops / seconds / 1e9}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:  # Linux: writing 5 resets the peak RSS (VmHWM; proc(5), clear_refs); elsewhere it stays the lifetime's
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    status = Path("/proc/self/status")
    if status.is_file():  # Linux: VmHWM, which reset_peak_memory resets (ru_maxrss never is)
        return next(int(line.split()[1]) * 1024 for line in status.read_text().splitlines() if line[:6] == "VmHWM:")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # B / KiB


def run(benches: list[Bench], steps: int, warmup: int, rounds: int) -> list[dict]:
    """Warm each config up, then time ``steps`` steps of each in ``rounds`` alternating blocks."""
    for b in benches:
        torch.set_num_threads(b.run.rt.threads)
        for _ in range(warmup):
            timed_step(b)
        b.times, b.positions = {p: [] for p in PHASES}, []  # warm-up steps left out
    for _ in range(rounds):
        for b in benches:
            torch.set_num_threads(b.run.rt.threads)
            reset_peak_memory(b.run.rt.device)
            for _ in range(max(1, steps // rounds)):
                timed_step(b)
            b.peak_bytes = max(b.peak_bytes, peak_memory(b.run.rt.device))
    return [summarise(b) for b in benches]


# Where a CPU step's time goes: the first row an op's name starts with (self time); the rest is Python's.
CATEGORIES = (
    ("optimizer", ("Optimizer.step",)),  # everything inside the step of an optimizer, its matmuls (Muon's) too
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation", "mkldnn")),
    ("copies and casts", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::contiguous")),
    ("attention's softmax and mask", ("aten::_softmax", "aten::_softmax_backward_data", "aten::masked_fill",
                                      "aten::_scaled_dot_product", "aten::_safe_softmax")),
    ("activation", ("aten::gelu", "aten::relu", "aten::gelu_backward", "aten::threshold_backward")),
    ("layer norm", ("aten::native_layer_norm", "aten::native_layer_norm_backward", "aten::_fused_rms_norm")),
    ("loss", ("aten::_log_softmax", "aten::nll_loss", "aten::_log_softmax_backward_data")),
    ("elementwise and the rest", ("",)),
)


def category(event) -> str:
    enclosing = event
    while enclosing is not None:
        if enclosing.name.startswith("Optimizer.step"):
            return "optimizer"
        enclosing = enclosing.cpu_parent
    if not event.name.startswith(("aten::", "mkldnn")):
        return "Python and the dispatcher"
    return next(name for name, prefixes in CATEGORIES[1:] if event.name.startswith(prefixes))


def profile(b: Bench, top: int) -> str:
    """The torch profiler over 10 steps: the ``top`` ops by self time, then the step's time by CATEGORIES."""
    cuda = b.run.rt.device.type == "cuda"
    steps, start = 10, synced_clock(b.run.rt.device)
    with torch.profiler.profile() as prof:  # every activity this machine supports: the CPU's, and CUDA's if any
        for _ in range(steps):
            timed_step(b)
    wall_ms = (synced_clock(b.run.rt.device) - start) * 1000 / steps
    table = prof.key_averages().table(sort_by=f"self_{'cuda' if cuda else 'cpu'}_time_total", row_limit=top)
    spent = dict.fromkeys([name for name, _ in CATEGORIES] + ["Python and the dispatcher"], 0.0)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU:
            spent[category(event)] += event.self_cpu_time_total / 1000 / steps  # ms per step
    spent["Python and the dispatcher"] += wall_ms - sum(spent.values())  # the time between the ops
    parts = " | ".join(f"{name} {ms:.1f} ({ms / wall_ms:.0%})" for name, ms in spent.items())
    return f"{table}\n    by category, ms per step of {wall_ms:.1f} (profiled): {parts}"


def summarise(b: Bench) -> dict:
    totals = [sum(parts) for parts in zip(*b.times.values())]
    cfg, rt, model = b.run.cfg, b.run.rt, b.run.model
    step_s, tokens = statistics.median(totals), statistics.mean(b.positions)  # what the steps really processed
    return {"name": b.name, "device": str(rt.device), "dtype": dtype_name(rt.dtype),
            "compiled": b.train_model is not model, "compile_s": b.compile_s, "steps": len(totals),
            "ms_per_step": step_s * 1000, "step_ms": [t * 1000 for t in totals], "tokens_per_s": tokens / step_s,
            "phases_ms": {p: statistics.median(v) * 1000 for p, v in b.times.items()},
            "model_gflops": model.flops_per_token(cfg.block_size) * tokens / step_s / 1e9,
            "peak_mib": b.peak_bytes / 2**20, "params": model.num_params(),
            "threads": rt.threads, "last_loss": b.losses[-1].item() if b.losses else math.nan}


def report(result: dict) -> str:
    phases = " | ".join(f"{p} {ms:.2f} ms ({ms / result['ms_per_step']:.0%})" for p, ms in result["phases_ms"].items())
    compiled = f", compiled in {result['compile_s']:.1f} s" if result["compiled"] else ""
    limit = (f"\n    its matmuls alone: {result['matmul_ms']:.1f} ms of the step ({result['matmul_gflop']:.2f} GFLOP "
             f"at {result['matmul_gflops']:.0f} GFLOP/s, the limit at its shapes on this machine); model GFLOP/s "
             f"{result['model_gflops'] / result['matmul_gflops']:.0%} of it") if "matmul_gflops" in result else ""
    return (f"[{result['name']}] {result['dtype']}, {threads_text(result['threads'])}{compiled}: "
            f"{result['ms_per_step']:.2f} ms/step, "
            f"{result['tokens_per_s']:,.0f} tokens/s, {result['model_gflops']:.0f} model GFLOP/s, "
            f"peak {'allocated' if result['device'].startswith('cuda') else 'RSS'} {result['peak_mib']:.0f} MiB "
            f"(median of {result['steps']} steps)\n    {phases}{limit}")


def parse_overrides(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        for part in item.split(","):
            key, sep, value = part.partition("=")
            require(sep, f"override `{part}` must look like KEY=VALUE, e.g. dtype=bfloat16")
            overrides[key.strip().lstrip("-")] = value.strip()
    return overrides


RESULTS_KEYS = ({"load_average", "results"}, {"results", "configs", "versions"})  # bench's file, lm_eval's (harness)


def check_results_path(path: Path, flag: str) -> None:
    """Refuse, before any work, a results file that would replace another file: a folder, a checkpoint, a user's."""
    check_writable(path.parent, flag, ".results-probe")  # a read-only folder, a file in the way
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a folder, not JSON, not an object
        if path.suffix == ".json" and (not path.exists() or any(keys <= json.loads(path.read_text()).keys()
                                                                for keys in RESULTS_KEYS)):
            return  # a new name, or results this tool (or harness.py) wrote: not any JSON holding "results"
    raise PathError(f"{flag} {path}: neither a new .json file nor results written before; pass a new name ending .json")


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small", help="preset name in config/ or a .toml path")
    parser.add_argument("overrides", nargs="*", default=[], help="KEY=VALUE config overrides, e.g. dtype=float32")
    parser.add_argument("--vs", default=None, help="KEY=VALUE[,KEY=VALUE] overrides of a second config to compare")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per config")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (compile, allocator, caches)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating blocks the timed steps are split into")
    parser.add_argument("--threads", type=int, default=0, help="the threads field of both configs (as threads=N); "
                        "0 keeps torch's default. --vs threads=2 compares thread counts")
    parser.add_argument("--matmul", action="store_true", help="measure peak matmul GFLOP/s instead")
    parser.add_argument("--min-ratio", type=float, default=0.0,
                        help="with --vs: exit 1 unless B's tokens/s is at least this many times A's")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the torch profiler's top N ops over 10 steps of each config")
    args = parser.parse_args(argv)
    if min(args.steps, args.rounds) < 1 or not all(v >= 0 for v in (args.warmup, args.threads, args.profile,
                                                                         args.min_ratio)):  # nan too
        parser.error("need --steps and --rounds >= 1, and --warmup, --threads, --profile and --min-ratio >= 0")
    if args.min_ratio and not args.vs:
        parser.error("--min-ratio would do nothing without --vs (it checks B / A)")
    unused = [k for k in ("vs", "steps", "min_ratio", "json", "profile") if getattr(args, k) != parser.get_default(k)]
    if args.matmul and unused:
        parser.error(f"--{', --'.join(unused).replace('_', '-')} would do nothing with --matmul")
    with exit_on_errors():  # one line and its exit code (cli.py)
        if args.json:
            check_results_path(args.json, "--json")
        base = ({"threads": str(args.threads)} if args.threads else {}) | parse_overrides(args.overrides)
        overrides = {"A": base} | ({"B": base | parse_overrides([args.vs])} if args.vs is not None else {})
        configs = {name: make_config(args.config, out_dir="out/bench", **o) for name, o in overrides.items()}
        print(f"torch {torch.__version__}, {threads_text(torch.get_num_threads())} by default, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if args.matmul:  # peak GFLOP/s at the shapes these models use, and at a large square one
            use_threads(args.threads)
            device = pick_device(base.get("device", "auto"))
            dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [])
            for m, k, n in [(768, 128, 512), (768, 512, 128), (4096, 128, 512), (4096, 256, 1024), (1024, 1024, 1024)]:
                cells = [f"{dtype_name(d)} {matmul_gflops(m, k, n, d, device, seconds=0.5):7.0f}" for d in dtypes]
                print(f"matmul ({m:>4} x {k:>4}) @ ({k:>4} x {n:>4}): " + " | ".join(cells) + " GFLOP/s")
            return
        labels = {"A": " ".join(args.overrides), "B": " ".join(args.overrides + [args.vs or ""])}
        benches = [build(f"{name}: {args.config} {labels[name]}".strip(), cfg) for name, cfg in configs.items()]
    results = run(benches, args.steps, args.warmup, min(args.rounds, args.steps) if args.vs else 1)  # A alone: 1
    for b, result in zip(benches, results):
        torch.set_num_threads(b.run.rt.threads)
        result |= matmul_limit(b)
    if args.profile:
        for b in benches:
            print(f"[{b.name}] torch profiler, 10 steps:\n{profile(b, args.profile)}")
    print("\n".join(map(report, results)))
    if args.vs:
        ratio = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
        print(f"B / A: {ratio:.2f}x tokens/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps({"load_average": os.getloadavg(), "results": results}, indent=1))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.min_ratio and not ratio >= args.min_ratio:
        sys.exit(f"check failed: B / A = {ratio:.2f}x, below --min-ratio {args.min_ratio:g}")


if __name__ == "__main__":
    run_tool(main)
