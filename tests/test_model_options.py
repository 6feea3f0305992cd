"""Every model option (a field of model.GPTConfig) flows end to end, with no list kept by hand.

The cases below are generated from GPTConfig's fields and types, so an option is tested here the
moment it is declared: a flag and a preset key, reaching the built model, saved in the checkpoint,
kept by a resume, refused when its value is bad, and refused by GPT-2 interop when GPT-2 cannot
compute it; and every variant stays causal and decodes from its KV cache as a full forward.
test_a_new_option_needs_no_other_edit proves all of that for an option added as docs/experiments.md says.

A model-only change's inner loop (docs/experiments.md): python -m pytest tests/test_model.py tests/test_model_options.py
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, docs_snippet, make_text, read_metrics, run_main, tiny_args

import checkpoint
import model as model_module
from checkpoint import adopt, from_checkpoint, load_checkpoint, save_checkpoint
from config import (
    DEFAULTS,
    FIELD_TYPES,
    MODEL_OPTIONS,
    ConfigError,
    HFError,
    TrainConfig,
    build_parser,
    choices,
    make_config,
    model_config,
    parse_args,
    validate,
)
from model import GPT, GPTConfig
from sample import KVCache
from scripts import export_hf

BASE = "tiny"  # the preset every case starts from
VOCAB = 40


def needs(name: str) -> dict[str, Any]:
    """The other options' values that ``name`` acts beside (``option(..., needs=...)`` in model.py): every case
    of ``name`` sets them, and so does its base, so that only ``name`` differs."""
    return next(f for f in dataclasses.fields(GPTConfig) if f.name == name).metadata["needs"]


def case(name: str, value: Any) -> dict[str, Any]:
    """The overrides of one case: ``name=value`` beside the options it needs."""
    return {**needs(name), name: value}


def accepted(name: str, value: Any) -> bool:
    try:
        make_config(BASE, **case(name, value))
    except ConfigError:
        return False
    return True


def other_values(name: str) -> list[Any]:
    """Values of an option other than the base preset's, from its type alone: every other choice of a Literal,
    the other bool, a real size for an int (twice the base, or 2 where the base is 0, which often means "off";
    else one more), another float (0.5, else twice or half the base, or one more): the first of these that the
    option's own check accepts, so a case never leaves its valid range. A plain str option has no such list."""
    base, kind = getattr(make_config(BASE), name), FIELD_TYPES[name]
    if choices(name):
        return [value for value in choices(name) if value != base]
    if kind is bool:
        return [not base]
    if kind not in (int, float):
        raise AssertionError(f"GPTConfig.{name}: declare a str option's values with Literal[...], so they are checked")
    tries = [2 * base if base else 2, base + 1] if kind is int else [0.5 if base != 0.5 else 0.25, 2 * base,
                                                                       base / 2, base + 1]
    valid = [value for value in tries if value != base and accepted(name, value)]
    assert valid, f"GPTConfig.{name}: none of {tries} is accepted beside its needs {needs(name)}; declare its needs"
    return valid[:1]


def bad_value(name: str) -> str:
    """A command-line value the option must refuse."""
    return {bool: "maybe", int: "1.5", float: "abc"}.get(FIELD_TYPES[name], "no-such-choice")


CASES = [pytest.param(name, value, id=f"{name}={value}") for name in MODEL_OPTIONS for value in other_values(name)]


def test_a_case_stays_inside_its_options_range(monkeypatch):
    """A case's value is one the option's own check accepts: n_layer capped at 3 is tried at 3, not at 2 x 2."""
    assert other_values("n_layer") == [4]
    check = GPTConfig.__post_init__

    def capped(self):
        check(self)
        if self.n_layer > 3:
            raise ValueError(f"n_layer must be at most 3, got {self.n_layer}")

    monkeypatch.setattr(GPTConfig, "__post_init__", capped)
    assert other_values("n_layer") == [3]


def toml_literal(value: Any) -> str:
    return json.dumps(value)  # true/false, numbers and quoted strings read the same in TOML


def test_every_option_is_typed_and_has_its_help():
    help_text = " ".join(build_parser().format_help().split())
    declared = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(GPTConfig)}
    for name in MODEL_OPTIONS:
        assert FIELD_TYPES[name] in (bool, int, float) or choices(name), name
        assert f"--{name}" in help_text and f"(default: {DEFAULTS[name]})" in help_text, name
        assert declared[name] and " ".join(declared[name].split()) in help_text, name  # model.py's words
    assert MODEL_OPTIONS == tuple(f.name for f in dataclasses.fields(GPTConfig) if f.name != "vocab_size")


@pytest.mark.parametrize("name, value", CASES)
def test_every_option_is_a_preset_key_and_a_flag(tmp_path, name, value):
    preset = tmp_path / "variant.toml"
    preset.write_text(f"{name} = {toml_literal(value)}\n")
    assert getattr(make_config(str(preset)), name) == value
    flag_value = str(value).lower() if isinstance(value, bool) else str(value)
    assert getattr(parse_args(["--config", BASE, f"--{name}", flag_value]), name) == value


@pytest.mark.parametrize("name", MODEL_OPTIONS)
def test_a_bad_value_of_every_option_is_refused(name):
    with pytest.raises(ConfigError, match=f"^{name} must be"):
        parse_args(["--config", BASE, f"--{name}", bad_value(name)])
    if choices(name):  # a config built without the parser is checked too
        with pytest.raises(ConfigError, match=f"^{name} must be one of"):
            validate(TrainConfig(**{name: bad_value(name)}))


def paired_models(name: str, value: Any) -> tuple[GPT, GPT, list[str]]:
    """The base preset's model and the one with name=value, holding the same weights wherever they can: every
    parameter of the same name and shape is the base's (std 0.2, so that small changes show above rounding); one
    the option drops counts as zero in the base (an embedding or a bias no longer added), one it adds or resizes
    keeps its own init. Also the names dropped."""
    torch.manual_seed(0)
    base = GPT(model_config(make_config(BASE, **needs(name)), VOCAB))
    torch.manual_seed(0)
    variant = GPT(model_config(make_config(BASE, **case(name, value)), VOCAB))
    own, theirs = dict(base.named_parameters()), dict(variant.named_parameters())
    dropped = [k for k in own if k not in theirs]
    with torch.no_grad():
        for p in own.values():
            p.normal_(0.0, 0.2)
        for k, p in theirs.items():
            if k in own and own[k].shape == p.shape:
                p.copy_(own[k])
        for k in dropped:
            own[k].zero_()
    return base, variant, dropped


def train_mode_step(model: GPT) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Training-mode logits, the objective a step minimises (cross-entropy plus every auxiliary term) and its
    gradients by name, for ``model`` on one batch, with the same dropout masks for every model."""
    idx = torch.arange(17).remainder(VOCAB).view(1, 17)  # (1, 17)
    torch.manual_seed(1)
    logits, loss_sum, _, aux = model(idx[:, :-1], idx[:, 1:])
    objective = loss_sum + sum(aux.values())
    objective.backward()
    return logits.detach(), objective.detach(), {k: p.grad for k, p in model.named_parameters()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float rounding (two kernels may sum in another order): not a change an option makes."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name, value", CASES)
def test_every_option_reaches_the_model_and_changes_it(name, value):
    """The option's own computation must act: with the base model's weights wherever the shapes allow (the ones it
    drops counting as zero), the logits, the objective (z_loss) or the gradients must move. Shapes alone prove
    nothing: ALiBi with zero slopes drops wpe and computes exactly the base model without its position table."""
    assert getattr(model_config(make_config(BASE, **case(name, value)), VOCAB), name) == value
    base, variant, dropped = paired_models(name, value)
    logits_a, objective_a, grads_a = train_mode_step(base)
    logits_b, objective_b, grads_b = train_mode_step(variant)
    # A shared weight's gradient moved, or the output depends on a weight the option adds (a zero-initialised
    # bias adds nothing yet, but its gradient is not zero).
    moved = [k for k, g in grads_b.items()
             if (not same(grads_a[k], g) if k in grads_a and grads_a[k].shape == g.shape else g.any())]
    without = f" without {', '.join(dropped)}" if dropped else ""
    assert moved or not (same(logits_a, logits_b) and same(objective_a, objective_b)), (
        f"{name}={value} computes what the base model{without} computes: the same logits, objective and gradients "
        f"with the base's weights. Make the option act where the model reads config.{name} (a bias or a slope "
        f"that is zero adds nothing)")


@pytest.mark.parametrize("name, value", CASES)
def test_every_objective_term_is_summed_over_the_targets(name, value):
    """Each auxiliary term per target is the same for a batch as for the batch twice over: summed over the targets,
    as loss_sum is, it doubles with them, and the step's division by its target count weighs it right however the
    batch is split. A mean over the batch added as a sum stays put and would end up divided by the targets."""
    torch.manual_seed(0)
    model = GPT(model_config(make_config(BASE, **case(name, value)), VOCAB)).eval()  # no dropout: rows repeat alike
    idx = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))  # (2, 17)
    with torch.no_grad():
        once, twice = (model(rows[:, :-1], rows[:, 1:]) for rows in (idx, idx.repeat(2, 1)))  # 2 rows, then 4
    for term in once.aux:
        per_target = [(out.aux[term] / out.n_targets).item() for out in (once, twice)]
        assert per_target[1] == pytest.approx(per_target[0], rel=1e-5), (
            f"{name}={value}: the auxiliary term {term!r} is {per_target[0]:.4g} per target on 2 rows but "
            f"{per_target[1]:.4g} on the same rows twice: it is not summed over the targets. Add a mean over the "
            f"micro-batch's tokens or rows with aux.add_mean (model.AuxLosses), which weights it by their count")


NUMERIC_OPTIONS = [name for name in MODEL_OPTIONS if FIELD_TYPES[name] in (int, float)]


@pytest.mark.parametrize("name", NUMERIC_OPTIONS)
def test_a_negative_value_of_every_numeric_option_is_refused_by_its_check(name):
    """A size, a probability or a weight is never negative: before, a negative window trained silently as full
    attention. The option's own check (validate, or GPTConfig.__post_init__) refuses it in one line naming it."""
    with pytest.raises(ConfigError, match=f"^{name} must be"):
        make_config(BASE, **{name: -1})


def every_value_of_every_option() -> list:
    """The base preset's model and each case's, for the properties every model must keep."""
    return [pytest.param(None, None, id="base")] + CASES


def eval_model(name: str | None, value: Any) -> GPT:
    """A model of the base preset (with name=value), weights of std 0.2 so each logit depends on the
    whole context (a leak or a cache bug then shows), in eval mode."""
    cfg = make_config(BASE, **(case(name, value) if name else {}))
    torch.manual_seed(0)
    model = GPT(model_config(cfg, VOCAB)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("name, value", every_value_of_every_option())
def test_every_variant_is_causal(name, value):
    model = eval_model(name, value)
    T, t = model.config.block_size, 7
    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))  # (2, T)
    changed = idx.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 1) % VOCAB  # change every future token
    with torch.no_grad():
        before, after = model(idx)[0], model(changed)[0]  # (2, T, V) each
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1], rtol=0, atol=1e-5)
    assert not torch.allclose(before[:, t + 1:], after[:, t + 1:])  # the future did change


@pytest.mark.parametrize("name, value", every_value_of_every_option())
def test_every_variant_decodes_from_its_kv_cache_as_a_full_forward(name, value):
    model = eval_model(name, value)
    T = model.config.block_size
    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))  # (2, T)
    cache = KVCache(model.config, 2)
    with torch.no_grad():
        full = model(idx)[0]  # (2, T, V)
        cuts = [0, 5, 6, 7, T // 2, T]  # a prefill, single steps, a chunk after a cached past
        parts = [model(idx[:, a:b], cache=cache)[0] for a, b in zip(cuts, cuts[1:])]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name, value", every_value_of_every_option())
def test_every_variant_computes_the_same_without_attentions_causal_shortcut(monkeypatch, name, value):
    """attention() hands SDPA the causal rule as a flag when the mask GPT.forward built from visible_keys is the
    plain triangle (decided once per forward): bit for bit what the mask it receives gives, unless the mask was
    changed on its way (a rule narrowed after visible_keys, which that decision never saw)."""
    model = eval_model(name, value)
    idx = torch.randint(0, VOCAB, (2, model.config.block_size), generator=torch.Generator().manual_seed(2))

    def full_and_cached() -> list[torch.Tensor]:
        cache = KVCache(model.config, 2)
        with torch.no_grad():
            return [model(idx).logits, *(model(idx[:, a:b], cache=cache).logits for a, b in [(0, 5), (5, 6), (6, 9)])]

    shortcut = full_and_cached()
    real = model_module.attention
    monkeypatch.setattr(model_module, "attention", lambda q, k, v, mask, plain_causal, dropout_p:
                        real(q, k, v, mask, False, dropout_p))  # always the mask
    assert all(torch.equal(a, b) for a, b in zip(shortcut, full_and_cached())), (
        f"{'base' if name is None else f'{name}={value}'}: SDPA's causal shortcut dropped part of the mask attention "
        f"received; write what a query sees in model.visible_keys, from which the layers decide the shortcut")


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(make_text())
    return path


def run_args(out_dir: Path, corpus: Path, **overrides: Any) -> list[str]:
    """A finished-by-step-2 tiny run: resuming it trains nothing, so last.pt must stay byte-identical."""
    return tiny_args(out_dir, corpus, **{"max_iters": 2, "eval_interval": 2, "eval_tokens": 256, **overrides})


@pytest.mark.parametrize("name, value", CASES)
def test_every_option_is_saved_shown_and_kept_by_a_resume(tmp_path, corpus_file, capsys, name, value):
    out_dir = tmp_path / "run"
    assert run_main(run_args(out_dir, corpus_file, **case(name, value))) == 0
    model_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("model: "))
    shown = FIELD_TYPES[name] is int and DEFAULTS[name] != 0 or value != DEFAULTS[name]  # sizes always, others when set
    assert (f"{name} {value}" in model_line) == shown, model_line
    saved = load_checkpoint(out_dir / "last.pt")
    assert saved["config"][name] == value
    model = from_checkpoint(out_dir / "last.pt").model
    assert getattr(model.config, name) == value
    before = (out_dir / "last.pt").read_bytes()
    code = run_main(run_args(out_dir, corpus_file, resume="true", **needs(name)))  # the base preset's value
    err = capsys.readouterr()
    if name in GPTConfig.TRAINING_ONLY:  # may change, with a warning naming it
        assert code == 0 and f"{name}: checkpoint {value!r} vs now" in err.out
    else:
        assert code == 2
        assert err.err.strip().splitlines() == [err.err.strip()] and f"{name}: checkpoint {value!r} vs now" in err.err
    assert (out_dir / "last.pt").read_bytes() == before


def test_a_checkpoint_saved_before_the_newer_options_still_resumes(tmp_path, corpus_file):
    """A checkpoint lacking an option means its default: here one with the first release's key set."""
    out_dir = tmp_path / "old"
    assert run_main(run_args(out_dir, corpus_file)) == 0
    state = load_checkpoint(out_dir / "last.pt")
    first_release = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias")
    state["config"] = {k: v for k, v in state["config"].items() if k not in MODEL_OPTIONS or k in first_release}
    assert set(MODEL_OPTIONS) - set(state["config"]), "no option newer than the first release to leave out"
    save_checkpoint(state, out_dir / "last.pt")
    assert run_main(run_args(out_dir, corpus_file, resume="true", max_iters=4)) == 0
    assert load_checkpoint(out_dir / "last.pt")["step"] == 4
    model = from_checkpoint(out_dir / "last.pt").model
    assert model.config == model_config(make_config(BASE), model.config.vocab_size)


# ----------------------------------------------------------------------------- GPT-2 interop
def gpt2_computes(name: str, value: Any) -> bool:
    allowed = checkpoint.GPT2_OPTIONS.get(name, (getattr(GPTConfig, name),))
    return allowed is checkpoint.ANY or value in allowed


def pretrained_config() -> checkpoint.Pretrained:
    """What a GPT-2 file imports as: its shape; every other option at its default."""
    config = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, bias=True, activation="gelu_tanh")
    return checkpoint.Pretrained(config, {}, "gpt2-folder", None, config.block_size, gpt2=True)


@pytest.mark.parametrize("name, value", CASES)
def test_gpt2_interop_exports_what_gpt2_computes_and_refuses_the_rest_by_name(monkeypatch, name, value):
    variant = make_config(BASE, **case(name, value))
    model = GPT(model_config(variant, VOCAB))
    for other, needed in needs(name).items():  # taken as GPT-2's, so that this option's own rule is what runs
        monkeypatch.setitem(checkpoint.GPT2_OPTIONS, other, (needed,))
    if name in GPTConfig.TRAINING_ONLY:  # how the weights were trained, not what they compute: never "another model"
        assert checkpoint.gpt2_refusals(model.config) == []
        assert getattr(adopt(variant, pretrained_config()), name) == value
        if not needs(name):  # what it needs may add weights GPT-2's layout has no place for
            assert "transformer.wte.weight" in export_hf.to_hf(model)
        return
    if gpt2_computes(name, value):
        assert "transformer.wte.weight" in export_hf.to_hf(model)
        if name not in checkpoint.IMPORTED:  # an option the weights fix is checked against them (test_hf.py)
            assert getattr(adopt(variant, pretrained_config()), name) == value
        # The same refusal, as if GPT-2 computed only the base value: every option's refusal path runs.
        monkeypatch.setitem(checkpoint.GPT2_OPTIONS, name, (getattr(make_config(BASE), name),))
    message = f"{name} {value!r} \\(GPT-2 computes"
    with pytest.raises(checkpoint.HFError, match=f"cannot export as GPT-2: the model has {message}"):
        export_hf.to_hf(model)
    if name not in checkpoint.IMPORTED:
        with pytest.raises(HFError, match=f"gpt2-folder holds GPT-2 weights, which cannot run with {message}"):
            adopt(variant, pretrained_config())


def test_an_export_refusal_is_one_line_and_writes_nothing(tmp_path, corpus_file, monkeypatch, capsys):
    assert run_main(run_args(tmp_path / "run", corpus_file, activation="gelu_tanh")) == 0
    monkeypatch.setitem(checkpoint.GPT2_OPTIONS, "activation", ("gelu",))
    from scripts import export_hf
    with pytest.raises(SystemExit) as stopped:
        export_hf.main([str(tmp_path / "run"), str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: cannot export as GPT-2: the model has activation 'gelu_tanh'")
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- a new option, end to end
def add_option_as_the_docs_say(repo: Path) -> str:
    """Apply docs/experiments.md's two edits (the field, its use) to a copy; returns the option's name."""
    field = docs_snippet("# model.py, in GPTConfig, after the last option:\n")
    use = docs_snippet("# model.py, in GPT.forward, after x = self.transformer.drop(x):\n")
    model_py = repo / "model.py"
    source = model_py.read_text()
    field_anchor = "\n\n    # Options that act only while training"
    use_anchor = "        x = self.transformer.drop(x)\n"
    assert source.count(field_anchor) == 1 and source.count(use_anchor) == 1, "update the anchors to model.py"
    source = source.replace(field_anchor, "\n" + field.rstrip("\n") + field_anchor)
    model_py.write_text(source.replace(use_anchor, use_anchor + use))
    return field.split(":")[0].strip()


@pytest.mark.slow  # a fresh pytest in a copy of the repo: ~25 s
def test_a_new_option_needs_no_other_edit(tmp_path):
    repo = tmp_path / "fork"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout
    for relative in files.split():
        (repo / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / relative, repo / relative)
    name = add_option_as_the_docs_say(repo)
    assert name not in MODEL_OPTIONS
    result = subprocess.run([sys.executable, "-m", "pytest", "tests/test_model_options.py", "-q", "-k", name,
                             "-p", "no:cacheprovider"], cwd=repo, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stdout[-3000:]
    # The new option's cases: flag and preset key, reaches the model, its objective terms' scale, causal, KV cache,
    # the shortcut's numbers, saved/shown/kept, GPT-2 refusal; its bad value.
    assert summary.startswith("9 passed"), summary


# ----------------------------------------------------------------------------- a mask fork, end to end
def copy_of_the_repo(root: Path) -> Path:
    """The repo's tracked and untracked-but-not-ignored files, copied to root/fork."""
    repo = root / "fork"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout
    for relative in files.split():
        if (REPO / relative).is_file():
            (repo / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / relative, repo / relative)
    return repo


def insert(path: Path, anchor: str, text: str, after: bool = False) -> None:
    source = path.read_text()
    assert source.count(anchor) == 1, f"update the anchor {anchor!r} to {path.name}"
    path.write_text(source.replace(anchor, anchor + text if after else text + anchor))


def add_window_as_the_docs_say(repo: Path) -> None:
    """docs/experiments.md's three edits for a sliding window: the field, its check, the mask."""
    model_py = repo / "model.py"
    insert(model_py, "\n\n    # Options that act only while training",
           "\n" + docs_snippet("# model.py, in GPTConfig, after the last option (a window):\n").rstrip("\n"))
    insert(model_py, "\n    @property\n    def padded_vocab_size",
           docs_snippet("# model.py, at the end of GPTConfig.__post_init__:\n"))
    insert(model_py, "    return key <= query  # (T, start + T)",
           docs_snippet("# model.py, in visible_keys, before its return:\n"))


def pytest_in(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=repo,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # two fresh pytests, a training run and four samples in a copy of the repo: ~60 s
def test_a_window_fork_is_one_mask_edit(tmp_path):
    repo = copy_of_the_repo(tmp_path)
    add_window_as_the_docs_say(repo)
    result = pytest_in(repo, "tests/test_model_options.py", "-k", "attn_window")
    assert result.returncode == 0, result.stdout[-3000:]
    # flag and preset key, reaches the model, its objective terms' scale, its negative value, causal, KV cache,
    # the shortcut's numbers, saved/shown/kept, GPT-2 refusal, its bad value
    assert result.stdout.strip().splitlines()[-1].startswith("10 passed"), result.stdout[-500:]
    (tmp_path / "corpus.txt").write_text(make_text())
    run = subprocess.run([sys.executable, "train.py", *tiny_args(tmp_path / "run", tmp_path / "corpus.txt",
                                                                  max_iters=30, eval_interval=30, attn_window=4)],
                         cwd=repo, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    texts = [subprocess.run([sys.executable, "sample.py", "--ckpt", str(tmp_path / "run"), "--temp", "0",
                             "--max-new-tokens", "80", "--no-stream", *flags], cwd=repo, capture_output=True,
                            text=True, timeout=120).stdout for flags in ([], ["--no-cache"])]
    assert texts[0] == texts[1] and len(texts[0]) > 80
    # The teeth: a cache that keeps its own causal mask (the bug this page once had) fails the generated test.
    insert(repo / "model.py", "        layer_caches = cache.layers if cache",
           "        mask = mask if cache is None else torch.ones_like(mask).tril(diagonal=start)  # the bug\n")
    broken = pytest_in(repo, "tests/test_model_options.py", "-k", "attn_window and kv_cache")
    assert broken.returncode == 1 and "1 failed" in broken.stdout.strip().splitlines()[-1], broken.stdout[-1500:]


# ----------------------------------------------------------------------------- a bias fork, end to end
def add_alibi_as_the_docs_say(repo: Path) -> None:
    """docs/experiments.md's two edits for ALiBi: pos_emb's third value, the bias in visible_keys."""
    model_py = repo / "model.py"
    source = model_py.read_text()
    field = re.findall(r"^    pos_emb: Literal\[.*?\n(?=    \w+: )", source, re.M | re.S)
    assert len(field) == 1, "update the ALiBi fork test: model.py declares pos_emb before another field"
    model_py.write_text(source.replace(field[0], docs_snippet("# model.py, in GPTConfig, replacing the pos_emb "
                                                              "field (ALiBi):\n")))
    insert(model_py, "    return key <= query  # (T, start + T)",
           docs_snippet("# model.py, in visible_keys, before its return (ALiBi):\n"))


@pytest.mark.slow  # two fresh pytests, a training run and two samples in a copy of the repo: ~60 s
def test_the_alibi_recipe_forks_the_repo_end_to_end(tmp_path):
    repo = copy_of_the_repo(tmp_path)
    add_alibi_as_the_docs_say(repo)
    result = pytest_in(repo, "tests/test_model_options.py", "-k", "alibi")
    assert result.returncode == 0, result.stdout[-3000:]
    # flag and preset key, reaches the model and changes it, its objective terms' scale, causal, KV cache, the
    # shortcut's numbers, saved/shown/kept, GPT-2 refusal
    assert result.stdout.strip().splitlines()[-1].startswith("8 passed"), result.stdout[-500:]
    (tmp_path / "corpus.txt").write_text(make_text())
    run = subprocess.run([sys.executable, "train.py", *tiny_args(tmp_path / "run", tmp_path / "corpus.txt",
                                                                  max_iters=30, eval_interval=30, pos_emb="alibi",
                                                                  dtype="bfloat16")],
                         cwd=repo, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]  # the bias in bf16 on CPU: added, never inverted with `~`
    texts = [subprocess.run([sys.executable, "sample.py", "--ckpt", str(tmp_path / "run"), "--temp", "0",
                             "--max-new-tokens", "80", "--no-stream", *flags], cwd=repo, capture_output=True,
                            text=True, timeout=120).stdout for flags in ([], ["--no-cache"])]
    assert texts[0] == texts[1] and len(texts[0]) > 80
    # The teeth: ALiBi with every slope zero drops wpe and computes nothing of its own (issue 44, finding 2).
    source = (repo / "model.py").read_text()
    assert source.count("slopes = 2.0 **") == 1
    (repo / "model.py").write_text(source.replace("slopes = 2.0 **", "slopes = 0.0 * 2.0 **"))
    broken = pytest_in(repo, "tests/test_model_options.py", "-k", "alibi and reaches_the_model")
    assert broken.returncode == 1 and "1 failed" in broken.stdout.strip().splitlines()[-1], broken.stdout[-1500:]
    assert ("pos_emb=alibi computes what the base model without transformer.wpe.weight computes"
            in " ".join(broken.stdout.split())), broken.stdout[-1500:]


# ----------------------------------------------------------------------------- the MoE recipe, end to end
def add_moe_as_the_docs_say(repo: Path) -> None:
    """docs/experiments.md's five edits for a top-1 mixture of experts, each where its heading says."""
    model_py = repo / "model.py"
    insert(model_py, "\n\n    # Options that act only while training",
           "\n" + docs_snippet("# model.py, in GPTConfig, after the last option (MoE):\n").rstrip("\n"))
    source = model_py.read_text()
    lines = re.findall(r"^    TRAINING_ONLY: .*\n", source, re.M)
    assert len(lines) == 1, "update the MoE fork test: model.py declares TRAINING_ONLY on one line"
    model_py.write_text(source.replace(lines[0], docs_snippet("# model.py, replacing the TRAINING_ONLY line (MoE):\n")))
    insert(model_py, "\n    @property\n    def padded_vocab_size",
           docs_snippet("# model.py, at the end of GPTConfig.__post_init__ (MoE):\n"))
    insert(model_py, "class Block(nn.Module):", docs_snippet("# model.py, before class Block (MoE):\n") + "\n\n")
    mlp = "        self.mlp = MLP(config)\n"
    insert(model_py, mlp, "")
    model_py.write_text(model_py.read_text().replace(
        mlp, docs_snippet("# model.py, in Block.__init__, replacing self.mlp = MLP(config) (MoE):\n")))


MOE_FLOPS = """
import json
from model import GPT, GPTConfig
shape = dict(vocab_size=40, n_layer=2, n_head=2, n_embd=32, block_size=32)
print("FLOPS " + json.dumps([GPT(GPTConfig(**shape, n_experts=e)).flops_per_token() for e in (0, 1, 4, 8)]))
"""


@pytest.mark.slow  # two fresh pytests in a copy of the repo and a training run: ~60 s
def test_the_moe_recipe_forks_the_repo_end_to_end(tmp_path):
    """docs/experiments.md's top-1 MoE, taken from the page: the copy's generated tests for both options (the
    balance weight paired with the experts it needs), the balance term's scale in a tiny run's log, and a FLOP
    count of one expert per token; then the balance term written as a plain mean fails the scale test."""
    repo = copy_of_the_repo(tmp_path)
    add_moe_as_the_docs_say(repo)
    result = pytest_in(repo, "tests/test_model_options.py", "-k", "n_experts or moe_balance", "-rA")
    assert result.returncode == 0, result.stdout[-3000:]
    # each: flag and preset key, reaches the model, its objective term's scale, causal, KV cache, the shortcut's
    # numbers, saved/shown/kept, GPT-2 refusal, its negative and its bad value
    assert result.stdout.strip().splitlines()[-1].startswith("20 passed"), result.stdout[-800:]
    assert "PASSED tests/test_model_options.py::test_every_objective_term_is_summed_over_the_targets[moe_balance=0.5]" \
        in result.stdout

    (tmp_path / "corpus.txt").write_text(make_text())
    run = subprocess.run([sys.executable, "train.py", *tiny_args(tmp_path / "run", tmp_path / "corpus.txt",
                                                                  max_iters=8, eval_interval=8, n_experts=4)],
                         cwd=repo, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "not default: n_experts 4" in run.stdout
    balance = [record["moe_balance"] for record in read_metrics(tmp_path / "run") if "moe_balance" in record]
    # Per target, each of the 2 layers adds 0.01 x E sum_i f_i P_i, which lies in [1, E = 4]: 0.02 when even.
    assert len(balance) == 8 and all(0.02 * 0.999 < value < 0.08 for value in balance), balance

    flops = subprocess.run([sys.executable, "-c", MOE_FLOPS], cwd=repo, capture_output=True, text=True, timeout=300)
    dense, one, four, eight = json.loads(flops.stdout.split("FLOPS ", 1)[1])
    router = 6 * 2 * 32  # per token, per expert: the router's C x E matrix, forward and backward, in 2 layers
    assert (one, four, eight) == (dense + router, dense + 4 * router, dense + 8 * router)  # one expert per token

    # The teeth: the balance term as a plain mean, added as if summed (finding 6 of issue 44), fails the scale test.
    model_py = repo / "model.py"
    model_py.write_text(model_py.read_text().replace('aux.add_mean("moe_balance"', 'aux.add_sum("moe_balance"'))
    broken = pytest_in(repo, "tests/test_model_options.py", "-k", "objective_term and moe_balance")
    assert broken.returncode == 1 and "1 failed" in broken.stdout.strip().splitlines()[-1], broken.stdout[-1500:]
    assert "it is not summed over the targets" in broken.stdout and "aux.add_mean" in broken.stdout


def test_a_checkpoint_with_a_field_this_code_lacks_loads_with_a_warning_naming_it(tmp_path, corpus_file, capsys):
    """A fork's checkpoint (attn_window=8) read by code without the option loads as another model: say so."""
    out_dir = tmp_path / "run"
    assert run_main(run_args(out_dir, corpus_file)) == 0
    state = load_checkpoint(out_dir / "last.pt")
    state["config"]["attn_window"] = 8
    save_checkpoint(state, out_dir / "last.pt")
    capsys.readouterr()
    from_checkpoint(out_dir / "last.pt")
    assert capsys.readouterr().err == ("WARNING: the checkpoint's config has fields this code does not know "
                                       "(attn_window=8); they are ignored here, so a model saved by other code "
                                       "(a fork) may compute something else\n")
