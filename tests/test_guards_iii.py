"""Guards III (issue 25): promises of the README and docs that no test held, each pinned here.

Every test below was seen to fail with a one-line bug put into the code it guards (the docstring
names the bug), and passes on the code as it is. Sampling, resume, checkpoints, data, signals,
GPT-2 interop and tracking run in process on the tiny preset; the one torchrun test is slow-marked.
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hf
import train
from checkpoint import save_checkpoint
from conftest import make_text, run_script, tiny_model
from data import CharTokenizer, DataError, prepare, split_fingerprint
from fault_injection import call_of, on_training_forward, run_main, tiny_args
from sample import filter_logits, next_token_probs, pick_next


# ----------------------------------------------------------------------------- sampling: temperature
LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])  # (1, 5): distinct values, no ties


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0, 4.0])
def test_the_sampling_distribution_at_temperature_t_is_softmax_of_logits_over_t(temperature):
    """Bug caught: pick_next multiplies the logits by T instead of dividing (wrong at every T but 1)."""
    assert torch.equal(next_token_probs(LOGITS, temperature), F.softmax(LOGITS / temperature, dim=-1))


def test_low_temperature_sharpens_and_high_temperature_flattens():
    """Bug caught: logits multiplied by T (T < 1 would flatten, T > 1 sharpen)."""
    temperatures = [0.25, 0.5, 1.0, 2.0, 4.0]
    probs = [next_token_probs(LOGITS, t)[0] for t in temperatures]
    top = [p.max().item() for p in probs]
    entropy = [-(p * p.log()).sum().item() for p in probs]
    assert top == sorted(top, reverse=True) and len(set(top)) == len(top)  # colder: the top token gains
    assert entropy == sorted(entropy) and len(set(entropy)) == len(entropy)  # hotter: closer to uniform
    assert probs[0].argmax() == probs[-1].argmax() == 0  # the ranking itself never changes


def test_draws_follow_the_tempered_distribution():
    """Bug caught: logits multiplied by T. 40000 draws with a fixed generator: each token's frequency
    lies within 5 standard deviations (< 0.013) of softmax(logits / T); T = 0.5 against T = 2 moves
    the top token's probability by ~0.3."""
    n, temperature = 40_000, 0.5
    draws = pick_next(LOGITS.repeat(n, 1), temperature, generator=torch.Generator().manual_seed(0))  # (n, 1)
    frequency = torch.bincount(draws.flatten(), minlength=5).double() / n  # (5,)
    expected = F.softmax(LOGITS[0].double() / temperature, dim=-1)  # (5,)
    tolerance = 5 * (expected * (1 - expected) / n).sqrt()
    assert ((frequency - expected).abs() < tolerance).all(), (frequency.tolist(), expected.tolist())


# ----------------------------------------------------------------------------- sampling: top-p boundary
SORTED_PROBS = (0.5, 0.25, 0.125, 0.0625, 0.0625)  # dyadic: softmax and cumsum are exact in float32


@pytest.mark.parametrize("top_p, n_kept", [(0.5, 1), (0.75, 2), (0.875, 3), (0.5 + 1e-6, 2), (0.75 - 1e-6, 2)])
def test_top_p_stops_where_the_mass_reaches_p_exactly(top_p, n_kept):
    """Bug caught: `above <= top_p` in filter_logits (a token is kept although the ones above it
    already reach p). docs/sampling.md: the smallest set whose probability *reaches* P."""
    logits = torch.tensor([[math.log(p) for p in SORTED_PROBS]])  # (1, 5)
    assert F.softmax(logits, dim=-1).cumsum(-1)[0].tolist() == [0.5, 0.75, 0.875, 0.9375, 1.0]  # the premise: exact
    kept = filter_logits(logits, top_p=top_p)[0].isfinite().tolist()
    assert kept == [True] * n_kept + [False] * (5 - n_kept)


# ----------------------------------------------------------------------------- resume: every random stream
def draw_from_global_streams(monkeypatch) -> list[tuple]:
    """Each micro-batch also draws from python's, numpy's and torch's global RNGs, as user code in the
    loop would (an augmentation, a sampler); the list of draws, in order."""
    draws: list[tuple] = []
    real_get_batch = train.get_batch

    def get_batch(*args, **kwargs):
        cuda = (torch.rand(1, device="cuda").item(),) if torch.cuda.is_available() else ()
        draws.append((random.random(), float(np.random.random()), torch.rand(1).item(), *cuda))
        return real_get_batch(*args, **kwargs)

    monkeypatch.setattr(train, "get_batch", get_batch)
    return draws


def test_after_a_resume_every_global_random_stream_continues_as_in_a_straight_run(tiny_cfg, tmp_path, monkeypatch):
    """Bugs caught: restore_rng without its np.random.set_state line (or random.setstate, or
    torch.set_rng_state): the resumed run's draws are those of a freshly seeded stream."""
    draws = draw_from_global_streams(monkeypatch)
    common = dict(max_iters=4, eval_interval=2, compile="off")
    train.train(tiny_cfg(out_dir=str(tmp_path / "straight"), **common))
    straight = draws[:]
    draws.clear()
    train.train(tiny_cfg(out_dir=str(tmp_path / "split"), **{**common, "max_iters": 2}))
    assert draws == straight[:2]
    draws.clear()
    train.train(tiny_cfg(out_dir=str(tmp_path / "split"), resume=True, **common))
    assert len(draws) == 2
    for name, i in (("python", 0), ("numpy", 1), ("torch_cpu", 2), ("torch_cuda", 3))[: len(draws[0])]:
        assert [d[i] for d in draws] == [d[i] for d in straight[2:]], f"{name} stream after the resume"


# ----------------------------------------------------------------------------- checkpoint: fsync, then rename
def test_a_checkpoint_is_fsynced_before_its_rename_and_the_folder_after(tmp_path, monkeypatch):
    """Bug caught: save_checkpoint without os.fsync(f.fileno()) (a power cut after the rename could
    leave last.pt naming blocks that never reached the disk)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino, Path(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "last.pt"
    for step in (1, 2):  # a new file, then one replacing it
        events.clear()
        save_checkpoint({"step": step, "weights": torch.arange(4.0)}, path)
        written, folder = os.stat(path).st_ino, os.stat(tmp_path).st_ino
        assert events == [("fsync", written), ("replace", written, path), ("fsync", folder)]


# ----------------------------------------------------------------------------- data
def corpus_with_last_id(tiny_cfg, offset: int) -> tuple[object, int]:
    """(the tiny config, the vocab size) on a prepared char corpus whose last train id is vocab_size + offset."""
    cfg = tiny_cfg(max_iters=1, eval_interval=100)
    folder = prepare(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction)
    meta = json.loads((folder / "meta.json").read_text())
    data = np.memmap(folder / "train.bin", dtype=meta["dtype"], mode="r+")
    data[-1] = meta["vocab_size"] + offset
    data.flush()
    # Record the edit as prepared, so that the vocabulary check, not the fingerprint check, is what meets it.
    meta["fingerprint"]["train"] = split_fingerprint(folder / "train.bin")
    (folder / "meta.json").write_text(json.dumps(meta))
    return cfg, meta["vocab_size"]


def test_a_corpus_holding_the_id_vocab_size_is_refused(tiny_cfg):
    """Bug caught: load_corpus checks `top > vocab_size` (the id vocab_size would index a padding row
    of the padded embedding, silently)."""
    cfg, vocab_size = corpus_with_last_id(tiny_cfg, 0)
    with pytest.raises(DataError, match=rf"train\.bin: token id {vocab_size} >= vocab size {vocab_size}"):
        train.train(cfg)
    assert not (Path(cfg.out_dir) / "last.pt").exists()


def test_a_corpus_whose_last_id_is_vocab_size_minus_one_trains(tiny_cfg):
    """The boundary from the other side: the largest real id is accepted (`top >= vocab_size - 1` fails here)."""
    cfg, _ = corpus_with_last_id(tiny_cfg, -1)
    assert math.isfinite(train.train(cfg))


def test_preparing_a_corpus_again_leaves_only_the_new_one(tiny_cfg):
    """Bug caught: staged_folder without `shutil.rmtree(old, ...)` (every re-preparation leaves the
    replaced corpus behind under a .staging-* name: the disk fills silently)."""
    cfg = tiny_cfg()
    first = prepare(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction)
    (first / "meta.json").write_bytes(b"\xff not json")  # unreadable metadata: prepared again, in place
    again = prepare(cfg.dataset, cfg.data_path, cfg.tokenizer, cfg.data_dir, cfg.val_fraction)
    assert again == first
    assert sorted(os.listdir(cfg.data_dir)) == [first.name]
    assert json.loads((first / "meta.json").read_text())["val_fraction"] == cfg.val_fraction


# ----------------------------------------------------------------------------- signals: the first one decides
@pytest.fixture
def signal_handlers():
    """Put SIGINT's and SIGTERM's handlers back after an in-process run that a signal stopped (it leaves
    them ignored, as a process on its way out)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("first, second, code", [(signal.SIGTERM, signal.SIGINT, 143),
                                                  (signal.SIGINT, signal.SIGTERM, 130)],
                         ids=["SIGTERM then SIGINT", "SIGINT then SIGTERM"])
def test_the_first_signal_decides_the_exit_code(tmp_path, text_file, monkeypatch, capsys, signal_handlers,
                                                first, second, code):
    """Bug caught: StopOnSignal.handle keeps the latest signal (`self.signum = signum`): a Ctrl-C after a
    scheduler's SIGTERM would turn a preemption (143, requeue) into an interrupt (130)."""
    sends = {call_of(2, 1, 2): first, call_of(2, 2, 2): second}  # both inside step 2

    def send(n: int, loss_sum: torch.Tensor) -> None:
        if n in sends:
            os.kill(os.getpid(), sends[n])

    on_training_forward(monkeypatch, send)
    assert run_main(tiny_args(tmp_path, text_file, grad_accum=2, max_iters=6, eval_interval=100)) == code
    name = signal.Signals(first).name
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: stopped by {name} after step 2; last.pt holds it, continue with --resume")


# ----------------------------------------------------------------------------- GPT-2 interop
CHARS = "".join(sorted(set(make_text())))  # a real char vocabulary: newline is the start token


def exported(folder: Path) -> Path:
    """A tiny random char model exported in the Hugging Face layout (model.safetensors, config.json)."""
    hf.export(tiny_model(vocab_size=len(CHARS), block_size=16), CharTokenizer(CHARS), folder)
    return folder


def test_an_lm_head_that_differs_from_wte_is_refused_in_one_line(tmp_path):
    """Bug caught: to_ours' tied-head check made dead (`if False:`): an untied head would be dropped
    silently and the model would compute with wte instead."""
    from safetensors.torch import load_file, save_file
    folder = exported(tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, folder / "model.safetensors")
    assert hf.load_pretrained(str(folder)).config.vocab_size == len(CHARS)  # an equal head is GPT-2's own layout
    tensors["lm_head.weight"][3, 5] += 0.5  # one weight of the head differs
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(hf.HFError, match="lm_head.weight differs from transformer.wte.weight") as error:
        hf.load_pretrained(str(folder))
    assert "\n" not in str(error.value)


# A value GPT-2's code would compute differently, for each config.json field that hf.CONFIG_RULES checks.
# A new rule fails test_every_config_rule_refuses_a_non_gpt2_value until its row is added here.
NON_GPT2_VALUES = {
    "activation_function": "relu",
    "layer_norm_epsilon": 1e-6,
    "n_inner": 64,  # the tiny model's n_embd is 32: GPT-2's MLP is 128 wide
    "scale_attn_weights": False,
    "scale_attn_by_inverse_layer_idx": True,
    "tie_word_embeddings": False,
}
RULES = {name: (default, allowed) for name, default, allowed in hf.CONFIG_RULES}


@pytest.mark.parametrize("name", sorted(NON_GPT2_VALUES.keys() | RULES.keys()))
def test_every_config_rule_refuses_a_non_gpt2_value(tmp_path, name):
    """Bug caught: a row of hf.CONFIG_RULES deleted (scale_attn_by_inverse_layer_idx: true then imports
    silently, and the model computes other attention than the file's)."""
    assert name in NON_GPT2_VALUES, f"add a non-GPT-2 value for the config rule {name!r} to NON_GPT2_VALUES"
    folder = exported(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    if name in RULES:  # GPT-2's own value, written out, is accepted
        (folder / "config.json").write_text(json.dumps({**config, name: RULES[name][0]}))
        hf.load_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, name: NON_GPT2_VALUES[name]}))
    with pytest.raises(hf.HFError, match=name) as error:
        hf.load_pretrained(str(folder))
    assert "\n" not in str(error.value)


def test_a_char_export_gives_transformers_our_start_token_no_end_or_pad_token_and_the_mlp_width(tmp_path):
    """Bugs caught: export writing eos = the newline (transformers' generate would stop at every line
    end), or no eos/bos at all (transformers then reads GPT-2's 50256, outside a char vocabulary), or
    an n_inner other than null (the MLP width transformers builds must be 4 * n_embd)."""
    transformers = pytest.importorskip("transformers")
    folder = exported(tmp_path / "hf")
    written = json.loads((folder / "config.json").read_text())
    fields = ("bos_token_id", "eos_token_id", "pad_token_id", "n_inner")
    assert [written.get(key, "absent") for key in fields] == [CHARS.index("\n"), None, "absent", None]
    read = transformers.AutoConfig.from_pretrained(folder)
    assert (read.bos_token_id, read.eos_token_id, read.pad_token_id, read.n_inner) == (CHARS.index("\n"), None, None,
                                                                                        None)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder)
    assert theirs.transformer.h[0].mlp.c_fc.weight.shape == (32, 4 * 32)  # Conv1D: (in, out)
    assert (theirs.generation_config.eos_token_id, theirs.generation_config.pad_token_id) == (None, None)


# ----------------------------------------------------------------------------- tracking
def fake_wandb(monkeypatch) -> list[SimpleNamespace]:
    """wandb.init replaced by a recorder: each started run's init arguments and the steps it was sent."""
    wandb = pytest.importorskip("wandb")
    runs: list[SimpleNamespace] = []

    def init(**kwargs):
        run = SimpleNamespace(init=kwargs, id=kwargs["id"] or f"new{len(runs)}", steps=[], offline=False,
                              settings=SimpleNamespace(mode="disabled"), finish=lambda: None)
        run.log = lambda record, step: run.steps.append(step)
        runs.append(run)
        return run

    monkeypatch.setenv("WANDB_MODE", "disabled")  # tracking.choose_mode then asks wandb for no login
    monkeypatch.setattr(wandb, "init", init)
    return runs


def append_records(out: Path, steps: range) -> None:
    """metrics.jsonl records of ``steps`` as an earlier process logged them before it was killed."""
    with open(out / "metrics.jsonl", "a") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")


def test_a_fresh_run_never_continues_an_old_wandb_run(tmp_path, text_file, monkeypatch):
    """Bug caught: tracking.start reads out_dir/wandb_id without --resume (a new run appends to an old
    one's charts)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "wandb_id").write_text("oldrun\n")  # left by an earlier run here whose last.pt was deleted
    append_records(out, range(1, 9))
    runs = fake_wandb(monkeypatch)
    assert run_main(tiny_args(out, text_file, max_iters=3, eval_interval=3, wandb="true")) == 0
    (run,) = runs
    assert (run.init["id"], run.init["resume"]) == (None, None)
    assert run.steps == [1, 2, 3, 3]  # every train record, then the val record of step 3
    assert (out / "wandb_id").read_text() == "new0\n"


@pytest.mark.parametrize("first_with_wandb", [True, False], ids=["continued", "new wandb run on resume"])
def test_only_a_continued_wandb_run_skips_the_steps_it_holds(tmp_path, text_file, monkeypatch, first_with_wandb):
    """Bug caught: WandbTracker given logged_through for a wandb run that is not continued (a run first
    trained without --wandb, resumed with it, would never send the steps its killed process redid)."""
    out = tmp_path / "out"
    runs = fake_wandb(monkeypatch)
    first = dict(max_iters=3, eval_interval=3) | ({"wandb": "true"} if first_with_wandb else {})
    assert run_main(tiny_args(out, text_file, **first)) == 0
    append_records(out, range(4, 6))  # killed after step 5; last.pt holds step 3
    assert run_main(tiny_args(out, text_file, max_iters=6, eval_interval=3, wandb="true", resume="true")) == 0
    resumed = runs[-1]
    if first_with_wandb:  # the same wandb run: it already holds steps 4 and 5
        assert (resumed.init["id"], resumed.init["resume"]) == (runs[0].id, "allow")
        assert resumed.steps == [6, 6]
    else:  # a new wandb run: it holds nothing yet
        assert (resumed.init["id"], resumed.init["resume"]) == (None, None)
        assert resumed.steps == [4, 5, 6, 6]


# ----------------------------------------------------------------------------- distributed
@pytest.mark.slow  # one torchrun launch of 2 CPU ranks (~20 s on 2 cores)
def test_under_two_ranks_one_process_writes_each_metric_once(tmp_path, text_file):
    """Bug caught: train.py's MetricsLog enabled on every rank (`enabled=True`): each record twice in
    metrics.jsonl (both ranks append to it) and each log line printed twice."""
    out = tmp_path / "out"
    result = run_script("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                        *tiny_args(out, text_file, max_iters=4, eval_interval=2, batch_size=2), timeout=240)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    printed = [line for line in result.stdout.splitlines() if line.lstrip().startswith("step ")]
    assert [line.split("|")[0].split()[1] for line in printed] == ["1", "2", "2", "3", "4", "4"]  # train, val
