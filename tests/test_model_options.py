"""Every model option (a field of model.GPTConfig) flows end to end: the cases are generated from GPTConfig's fields
and types, and docs/experiments.md's model recipes are applied to a copy of the repo."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (copy_of_the_repo, docs_snippet, make_text, randomized, read_metrics, run_main, run_script,
                      run_tests_in, tiny_args)

import finetune
import model as model_module
from checkpoint import from_checkpoint, load_checkpoint, save_checkpoint
from cli import ConfigError, HFError
from config import (DEFAULTS, FIELD_TYPES, MODEL_OPTIONS, TrainConfig, choices, make_config, model_config, parse_args,
                    validate)
from finetune import adopt
from model import GPT, GPTConfig
from sample import KVCache
from scripts import export_hf

BASE = "tiny"  # the preset every case starts from
VOCAB = 40


def needs(name: str) -> dict[str, Any]:
    """The other options' values that ``name`` acts beside (its ``needs``): its cases and their base set them."""
    return next(f for f in dataclasses.fields(GPTConfig) if f.name == name).metadata["needs"]


def case(name: str, value: Any) -> dict[str, Any]:
    """The overrides of one case: ``name=value`` beside the options it needs."""
    return {**needs(name), name: value}


def other_values(name: str) -> list[Any]:
    """Values of an option other than the base preset's, from its type alone: every other choice of a Literal, the
    other bool, else the first number its own check accepts (an int 0 often means "off": 2 is tried first)."""
    base, kind = getattr(make_config(BASE), name), FIELD_TYPES[name]
    if choices(name):
        return [value for value in choices(name) if value != base]
    if kind is bool:
        return [not base]
    if kind not in (int, float):
        raise AssertionError(f"GPTConfig.{name}: declare a str option's values with Literal[...], so they are checked")
    tries = [2 * base if base else 2, base + 1] if kind is int else [0.5 if base != 0.5 else 0.25, 2 * base,
                                                                       base / 2, base + 1]
    for value in tries:
        try:
            make_config(BASE, **case(name, value))
        except ConfigError:
            continue
        if value != base:
            return [value]
    raise AssertionError(f"GPTConfig.{name}: none of {tries} is accepted beside its needs {needs(name)}; declare them")


def bad_value(name: str) -> str:
    return {bool: "maybe", int: "1.5", float: "abc"}.get(FIELD_TYPES[name], "no-such-choice")


CASES = [pytest.param(name, value, id=f"{name}={value}") for name in MODEL_OPTIONS for value in other_values(name)]


@pytest.mark.parametrize("name, value", CASES)
def test_every_option_is_a_preset_key_and_a_flag_that_refuses_a_bad_value(tmp_path, name, value):
    """A negative number too, by the option's own check: before, a negative window trained as full attention."""
    preset = tmp_path / "variant.toml"
    preset.write_text(f"{name} = {json.dumps(value)}\n")  # true/false, numbers and quoted strings: TOML's too
    assert getattr(make_config(str(preset)), name) == value
    flag_value = str(value).lower() if isinstance(value, bool) else str(value)
    assert getattr(parse_args(["--config", BASE, f"--{name}", flag_value]), name) == value
    with pytest.raises(ConfigError, match=f"^{name} must be"):
        parse_args(["--config", BASE, f"--{name}", bad_value(name)])
    if FIELD_TYPES[name] in (int, float):
        with pytest.raises(ConfigError, match=f"^{name} must be"):
            make_config(BASE, **{name: -1})
    if choices(name):  # a config built without the parser is checked too
        with pytest.raises(ConfigError, match=f"^{name} must be one of"):
            validate(TrainConfig(**{name: bad_value(name)}))


def paired_models(name: str, value: Any) -> tuple[GPT, GPT, list[str]]:
    """The base preset's model and the one with name=value, with the base's weights (std 0.2) wherever name and
    shape match; a weight the option drops counts as zero in the base. Also the names dropped."""
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


def probe(rows: int, T: int) -> torch.Tensor:
    """(rows, T) ids in 0..7 only: any of them as a document separator cuts every row, so a document mask acts."""
    return torch.randint(0, 8, (rows, T), generator=torch.Generator().manual_seed(0))


def train_mode_step(model: GPT) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Training-mode logits, objective (with every auxiliary term) and gradients on one batch, same dropout masks."""
    idx = probe(1, 17)  # (1, 17)
    torch.manual_seed(1)
    logits, loss_sum, _, aux = model(idx[:, :-1], idx[:, 1:])
    objective = loss_sum + sum(aux.values())
    objective.backward()
    return logits.detach(), objective.detach(), {k: p.grad for k, p in model.named_parameters()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float rounding (kernels may sum in another order: ~1e-6 here), never a change an option makes."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name, value", CASES)
def test_every_option_reaches_the_model_and_changes_it(name, value):
    """With the base's weights, the logits, the objective or the gradients must move: shapes alone prove nothing
    (ALiBi with zero slopes drops wpe and computes exactly the base model without its position table)."""
    assert getattr(model_config(make_config(BASE, **case(name, value)), VOCAB), name) == value
    base, variant, dropped = paired_models(name, value)
    logits_a, objective_a, grads_a = train_mode_step(base)
    logits_b, objective_b, grads_b = train_mode_step(variant)
    unused = [k for k, g in grads_b.items() if g is None]  # GPT-J's parallel block, its ln_2 built and never read
    assert not unused, f"{name}={value} builds weights it never reads ({', '.join(unused)}): build them where they act"
    # A shared weight's gradient moved, or the output depends on a weight the option adds (a zero-initialised
    # bias adds nothing yet, but its gradient is not zero).
    moved = [k for k, g in grads_b.items()
             if (not same(grads_a[k], g) if k in grads_a and grads_a[k].shape == g.shape else g.any())]
    without = f" without {', '.join(dropped)}" if dropped else ""
    assert moved or not (same(logits_a, logits_b) and same(objective_a, objective_b)), (
        f"{name}={value} computes what the base model{without} computes (logits, objective, gradients): make the "
        f"option act where the model reads config.{name} (a bias or a slope that is zero adds nothing), or, where this "
        "value is the base model beside tiny's other fields (n_kv_head 2 beside n_head 2), set them with needs=")


def weights_added(name: str, value: Any) -> list[str]:
    base, variant, _ = paired_models(name, value)
    shapes = {k: tuple(t.shape) for k, t in base.state_dict().items()}
    return [f"{k} {tuple(t.shape)}" for k, t in variant.state_dict().items() if shapes.get(k) != tuple(t.shape)]


@pytest.mark.parametrize("name, value", [case for case in CASES if case.values[0] in GPTConfig.TRAINING_ONLY])
def test_a_training_only_option_adds_no_weights(name, value):
    """A resume may change it and --init_from and export ignore it: a weight it added would break a strict load."""
    added = weights_added(name, value)
    assert not added, (f"{name}={value} adds weights ({', '.join(added)}): take it out of GPTConfig.TRAINING_ONLY, "
                       "so resume, --init_from and export hold it to the checkpoint's value")


def test_an_option_that_adds_a_head_is_named_by_the_training_only_check(monkeypatch):
    """The check's teeth: z_loss (training-only) made to add a head, as the MTP fork did."""
    real_init = GPT.__init__

    def with_a_head(self, config):
        real_init(self, config)
        if config.z_loss:
            self.mtp_head = torch.nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)

    monkeypatch.setattr(GPT, "__init__", with_a_head)
    assert weights_added("z_loss", 0.5) == ["mtp_head.weight (64, 32)"]


@pytest.mark.parametrize("name, value", CASES)
def test_every_objective_term_is_summed_over_the_targets(name, value):
    """Each auxiliary term per target is the same for a batch as for it twice over: summed over targets, as loss_sum."""
    torch.manual_seed(0)
    model = GPT(model_config(make_config(BASE, **case(name, value)), VOCAB)).eval()  # no dropout: rows repeat alike
    idx = probe(2, 17)  # (2, 17)
    with torch.no_grad():
        once, twice = (model(rows[:, :-1], rows[:, 1:]) for rows in (idx, idx.repeat(2, 1)))  # 2 rows, then 4
    for term in once.aux:
        per_target = [(out.aux[term] / out.n_targets).item() for out in (once, twice)]
        assert per_target[1] == pytest.approx(per_target[0], rel=1e-5), (
            f"{name}={value}: the auxiliary term {term!r} is {per_target[0]:.4g} per target on 2 rows but "
            f"{per_target[1]:.4g} on them twice: it is not summed over the targets; weight a mean by the target count")


@pytest.mark.parametrize("name, value", [pytest.param(None, None, id="base"), *CASES])
def test_every_variant_is_causal_and_its_kv_cache_exact_with_or_without_the_shortcut(monkeypatch, name, value):
    """Weights of std 0.2, so each logit depends on the whole context. SDPA's own causal rule must give bit for bit
    what visible_keys' mask gives; CPU-bf16 logits agree to rounding (0.005), a dropped mask moves them by ~0.7."""
    torch.manual_seed(0)
    model = randomized(GPT(model_config(make_config(BASE, **(case(name, value) if name else {})), VOCAB)))
    T, t = model.config.block_size, 7
    idx = probe(2, T)  # (2, T)
    changed = idx.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 1) % VOCAB  # every future token

    @torch.no_grad()
    def full_and_cached() -> tuple[torch.Tensor, torch.Tensor]:
        cache, cuts = KVCache(model.config, 2), [0, 5, 6, 7, T // 2, T]  # a prefill, single steps, a chunk
        parts = [model(idx[:, a:b], cache=cache).logits for a, b in zip(cuts, cuts[1:])]
        return model(idx).logits, torch.cat(parts, dim=1)  # (2, T, V) each

    full, cached = full_and_cached()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model(idx).logits.float()
    assert (bf16 - full).abs().max() < 0.05, f"{name}={value}: fp32 and CPU-bf16 logits differ by more than rounding"
    with torch.no_grad():
        after = model(changed).logits
    torch.testing.assert_close(full[:, : t + 1], after[:, : t + 1], rtol=0, atol=1e-5)
    assert not torch.allclose(full[:, t + 1:], after[:, t + 1:])  # the future did change
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=0)
    monkeypatch.setattr(model_module, "is_plain_causal", lambda mask: False)  # always the mask
    assert all(map(torch.equal, (full, cached), full_and_cached())), (
        f"{name}={value}: SDPA's causal kernels compute something other than visible_keys' mask")


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
    assert load_checkpoint(out_dir / "last.pt")["config"][name] == value
    assert getattr(from_checkpoint(out_dir / "last.pt").model.config, name) == value
    before = (out_dir / "last.pt").read_bytes()
    code = run_main(run_args(out_dir, corpus_file, resume="true", **needs(name)))  # the base preset's value
    err = capsys.readouterr()
    if name in GPTConfig.TRAINING_ONLY:  # may change, with a warning naming it
        assert code == 0 and f"{name}: checkpoint {value!r} vs now" in err.out
    else:
        assert code == 2
        assert err.err.strip().splitlines() == [err.err.strip()] and f"{name}: checkpoint {value!r} vs now" in err.err
    assert (out_dir / "last.pt").read_bytes() == before


def test_an_old_checkpoint_resumes_a_forks_loads_with_a_warning_and_an_export_refusal_is_one_line(
        tmp_path, corpus_file, monkeypatch, capsys):
    """A checkpoint lacking an option means its default: here one with the first release's key set. A fork's
    (attn_window=8) read by code without the option loads as another model: say so."""
    out_dir = tmp_path / "old"
    assert run_main(run_args(out_dir, corpus_file)) == 0
    monkeypatch.setitem(export_hf.GPT2_OPTIONS, "activation", ("gelu_tanh",))
    code, err = run_main([str(out_dir), str(tmp_path / "hf")], export_hf.main), capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and not (tmp_path / "hf").exists()
    assert err.startswith("error: cannot export as GPT-2: the model has activation 'gelu'")
    state = load_checkpoint(out_dir / "last.pt")
    save_checkpoint({**state, "config": {**state["config"], "attn_window": 8}}, tmp_path / "fork.pt")
    capsys.readouterr()
    from_checkpoint(tmp_path / "fork.pt")
    assert capsys.readouterr().err == ("WARNING: the checkpoint's config has fields this code does not know "
                                       "(attn_window=8); they are ignored here, so a model saved by other code "
                                       "(a fork) may compute something else\n")
    first_release = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias")
    state["config"] = {k: v for k, v in state["config"].items() if k not in MODEL_OPTIONS or k in first_release}
    assert set(MODEL_OPTIONS) - set(state["config"]), "no option newer than the first release to leave out"
    save_checkpoint(state, out_dir / "last.pt")
    assert run_main(run_args(out_dir, corpus_file, resume="true", max_iters=4)) == 0
    assert load_checkpoint(out_dir / "last.pt")["step"] == 4
    model = from_checkpoint(out_dir / "last.pt").model
    assert model.config == model_config(make_config(BASE), model.config.vocab_size)


# ----------------------------------------------------------------------------- GPT-2 interop
def imported_base(**options: Any) -> finetune.Pretrained:
    """What a GPT-2 file imports as (scripts/import_hf.py): its shape; every other option at its default (or given)."""
    config = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, bias=True, activation="gelu_tanh", **options)
    return finetune.Pretrained(config, {}, "gpt2-run", {"kind": "gpt2"}, config.block_size)


@pytest.mark.parametrize("name, value", CASES)
def test_gpt2_interop_exports_what_gpt2_computes_and_refuses_the_rest_by_name(monkeypatch, name, value):
    variant = make_config(BASE, **case(name, value))
    model = GPT(model_config(variant, VOCAB))
    for other, needed in needs(name).items():  # taken as GPT-2's, so that this option's own rule is what runs
        monkeypatch.setitem(export_hf.GPT2_OPTIONS, other, (needed,))
    if name in GPTConfig.TRAINING_ONLY:  # how the weights were trained, not what they compute: never "another model"
        assert export_hf.gpt2_refusals(model.config) == []
        assert getattr(adopt(variant, imported_base(**needs(name))), name) == value  # the base has what it needs
        if not needs(name):  # what it needs may add weights GPT-2's layout has no place for
            assert "transformer.wte.weight" in export_hf.to_hf(model)
        return
    if name != "block_size" and value != getattr(imported_base().config, name):  # the base's weights fix it
        with pytest.raises(HFError, match="conflicts with gpt2-run, whose weights have"):
            adopt(variant, imported_base())
    allowed = export_hf.GPT2_OPTIONS.get(name, (getattr(GPTConfig, name),))
    if allowed is export_hf.ANY or value in allowed:
        assert "transformer.wte.weight" in export_hf.to_hf(model)
        # The same refusal, as if GPT-2 computed only the base value: every option's refusal path runs.
        monkeypatch.setitem(export_hf.GPT2_OPTIONS, name, (getattr(make_config(BASE), name),))
    with pytest.raises(HFError, match=f"cannot export as GPT-2: the model has {name} {value!r} \\(GPT-2 computes"):
        export_hf.to_hf(model)


# ----------------------------------------------------------------------------- docs/experiments.md's recipes
def replace(path: Path, old: str, new: str) -> None:
    source = path.read_text()
    assert source.count(old) == 1, f"update the anchor {old!r} to {path.name}"
    path.write_text(source.replace(old, new))


def insert(path: Path, anchor: str, text: str, after: bool = False) -> None:
    replace(path, anchor, anchor + text if after else text + anchor)


FIELD_ANCHOR = "\n\n    # Options that act only while training"


def generated_tests(repo: Path, basetemp: Path, k: str, passed: int = 0) -> str:
    """The copy's tests selected by ``k``: ``passed`` pass (6 per option: flag and preset key, reaches the model,
    objective terms' scale, causal/cache/bf16, saved and kept, GPT-2), or if 0 exactly one fails. Their output."""
    result = run_tests_in(repo, basetemp, "tests/test_model_options.py", "-k", k)
    last = result.stdout.strip().splitlines()[-1]
    if passed:
        assert result.returncode == 0 and last.startswith(f"{passed} passed"), result.stdout[-3000:]
    else:
        assert result.returncode == 1 and "1 failed" in last, result.stdout[-1500:]
    return " ".join(result.stdout.split())


@pytest.mark.slow  # a fresh pytest in a copy of the repo: ~25 s
def test_a_new_option_needs_no_other_edit(tmp_path):
    repo = copy_of_the_repo(tmp_path)
    field = docs_snippet("# model.py, in GPTConfig, after the last option:\n")
    insert(repo / "model.py", FIELD_ANCHOR, "\n" + field.rstrip("\n"))
    insert(repo / "model.py", "        x = self.transformer.drop(x)\n",
           docs_snippet("# model.py, in GPT.forward, after x = self.transformer.drop(x):\n"), after=True)
    name = field.split(":")[0].strip()
    assert name not in MODEL_OPTIONS
    generated_tests(repo, tmp_path / "t", name, passed=6)


def train_and_sample(repo: Path, corpus: Path, **options) -> None:
    """A 30-step run in ``repo``; sample.py --temp 0 writes the same text with and without its KV cache."""
    out = corpus.parent / "run"
    run_script("train.py", *tiny_args(out, corpus, max_iters=30, eval_interval=30, **options), cwd=repo)
    texts = [run_script("sample.py", "--ckpt", str(out), "--temp", "0", "--max-new-tokens", "80", "--no-stream",
                        *flags, cwd=repo).stdout for flags in ([], ["--no-cache"])]
    assert texts[0] == texts[1] and len(texts[0]) > 80


def fork_with_a_rule(tmp_path: Path, name: str, headings: tuple[str, str, str]) -> tuple[Path, str]:
    """A copy of the repo with the page's three edits for a rule of what a query sees (the option, its check, the
    rule in visible_keys), whose generated tests for ``name`` pass; and its model.py as it was before the rule."""
    repo = copy_of_the_repo(tmp_path)
    field, check, rule = map(docs_snippet, headings)
    insert(repo / "model.py", FIELD_ANCHOR, "\n" + field.rstrip("\n"))
    insert(repo / "model.py", "\n    @property\n    def padded_vocab_size", check)
    before_the_rule = (repo / "model.py").read_text()
    insert(repo / "model.py", "    return key <= query  # (T, S + T)", rule)
    generated_tests(repo, tmp_path / "t", name, passed=6)
    return repo, before_the_rule


@pytest.mark.slow  # two fresh pytests, a training run and two samples in a copy of the repo: ~60 s
def test_a_window_fork_is_one_mask_edit(tmp_path, text_file):
    """The page's three edits for a sliding window: the field, its check, the mask."""
    repo, _ = fork_with_a_rule(tmp_path, "attn_window", (
        "# model.py, in GPTConfig, after the last option (a window):\n",
        "# model.py, at the end of GPTConfig.__post_init__:\n", "# model.py, in visible_keys, before its return:\n"))
    train_and_sample(repo, text_file, attn_window=4)
    # The teeth: a cache that keeps its own causal mask (the bug this page once had) fails the generated test.
    insert(repo / "model.py", "        layer_caches = cache.layers if cache",
           "        mask = mask if cache is None else torch.ones_like(mask).tril(diagonal=start)  # the bug\n")
    generated_tests(repo, tmp_path / "b", "attn_window and kv_cache")


@pytest.mark.slow  # two fresh pytests, a training run and two samples in a copy of the repo: ~60 s
def test_the_alibi_recipe_forks_the_repo_end_to_end(tmp_path, text_file):
    """The page's two edits for ALiBi: pos_emb's third value, the bias in visible_keys."""
    repo = copy_of_the_repo(tmp_path)
    field = re.search(r"^    pos_emb: Literal\[.*?\n(?=    \w+: )", (repo / "model.py").read_text(), re.M | re.S)
    replace(repo / "model.py", field[0],
            docs_snippet("# model.py, in GPTConfig, replacing the pos_emb field (ALiBi):\n"))
    insert(repo / "model.py", "    return key <= query  # (T, S + T)",
           docs_snippet("# model.py, in visible_keys, before its return (ALiBi):\n"))
    generated_tests(repo, tmp_path / "t", "alibi", passed=6)
    train_and_sample(repo, text_file, pos_emb="alibi", dtype="bfloat16")  # the bias in bf16 on CPU: never `~`
    # The teeth: ALiBi with every slope zero drops wpe and computes nothing of its own.
    replace(repo / "model.py", "slopes = 2.0 **", "slopes = 0.0 * 2.0 **")
    broken = generated_tests(repo, tmp_path / "b", "alibi and reaches_the_model")
    assert "pos_emb=alibi computes what the base model without transformer.wpe.weight computes" in broken


@pytest.mark.slow  # three fresh pytests or runs, and two samples, in a copy of the repo: ~60 s
def test_the_document_mask_recipe_forks_the_repo(tmp_path, text_file):
    """The page's three edits for a document mask: the field, its check, the rule that reads the ids."""
    repo, pristine = fork_with_a_rule(tmp_path, "doc_separator", tuple(
        f"# model.py, {where} (a document mask):\n" for where in (
            "in GPTConfig, after the last option", "at the end of GPTConfig.__post_init__",
            "in visible_keys, before its return")))
    train_and_sample(repo, text_file, doc_separator=1)
    # The trap: the mask narrowed in GPT.forward, after visible_keys, where the plain rule arrives as None: the run
    # stops (fp32 once dropped it silently).
    (repo / "model.py").write_text(pristine)
    insert(repo / "model.py", "        x = self.transformer.wte(idx)  # (B, T, C)\n",
           "        doc = (tokens == self.config.doc_separator).cumsum(1)  # (B, S + T)\n"
           "        mask = mask & (doc[:, -T:].unsqueeze(2) == doc.unsqueeze(1)).unsqueeze(1)\n")
    run = run_script("train.py", *tiny_args(tmp_path / "trap", text_file, max_iters=5, doc_separator=1), cwd=repo,
                     check=False)
    assert run.returncode != 0 and "NoneType" in run.stderr, run.stderr[-2000:]


MOE_FLOPS = """
import json
from model import GPT, GPTConfig
shape = dict(vocab_size=40, n_layer=2, n_head=2, n_embd=32, block_size=32)
print("FLOPS " + json.dumps([GPT(GPTConfig(**shape, n_experts=e)).flops_per_token() for e in (0, 1, 4, 8)]))
"""


@pytest.mark.slow  # two fresh pytests in a copy of the repo and a training run: ~60 s
def test_the_moe_recipe_forks_the_repo_end_to_end(tmp_path, text_file):
    """The copy's generated tests for both options, the balance term's scale in a tiny run's log, a FLOP count of
    one expert per token; then the balance term written as a plain mean fails the scale test."""
    repo = copy_of_the_repo(tmp_path)
    model_py = repo / "model.py"  # the page's seven edits, each where its heading says
    insert(model_py, FIELD_ANCHOR,
           "\n" + docs_snippet("# model.py, in GPTConfig, after the last option (MoE):\n").rstrip("\n"))
    training_only = re.search(r"^    TRAINING_ONLY: .*\n", model_py.read_text(), re.M)[0]
    replace(model_py, training_only, docs_snippet("# model.py, replacing the TRAINING_ONLY line (MoE):\n"))
    insert(model_py, "\n    @property\n    def padded_vocab_size",
           docs_snippet("# model.py, at the end of GPTConfig.__post_init__ (MoE):\n"))
    insert(model_py, "class Block(nn.Module):", docs_snippet("# model.py, before class Block (MoE):\n") + "\n\n")
    replace(model_py, "        self.mlp = MLP(config)\n",
            docs_snippet("# model.py, in Block.__init__, replacing self.mlp = MLP(config) (MoE):\n"))
    insert(model_py, "        return ModelOutput(logits, loss_sum, kept.sum(), aux)",
           docs_snippet("# model.py, in GPT.forward, before its last return (MoE):\n"))
    insert(repo / "optim.py", '    ("transformer.h.*.c_fc.weight", "matrix"),\n',
           docs_snippet("# optim.py, in PARAMETER_KINDS, after the c_fc row (MoE):\n"), after=True)
    passed = generated_tests(repo, tmp_path / "t", "n_experts or moe_balance", passed=13)  # moe_balance: no weights
    assert "PASSED tests/test_model_options.py::test_every_objective_term_is_summed_over_the_targets[moe_balance=0.5]" \
        in passed

    run = run_script("train.py", *tiny_args(tmp_path / "run", text_file, max_iters=8, eval_interval=8, n_experts=4),
                     cwd=repo)
    assert "not default: n_experts 4" in run.stdout
    balance = [record["moe_balance"] for record in read_metrics(tmp_path / "run") if "moe_balance" in record]
    # Per target, each of the 2 layers adds 0.01 x E sum_i f_i P_i, which lies in [1, E = 4]: 0.02 when even.
    assert len(balance) == 8 and all(0.02 * 0.999 < value < 0.08 for value in balance), balance

    flops = run_script("-c", MOE_FLOPS, cwd=repo)
    dense, one, four, eight = json.loads(flops.stdout.split("FLOPS ", 1)[1])
    router = 6 * 2 * 32  # per token, per expert: the router's C x E matrix, forward and backward, in 2 layers
    assert (one, four, eight) == (dense + router, dense + 4 * router, dense + 8 * router)  # one expert per token

    # The teeth: the balance term as a plain mean, added as if summed, fails the scale test.
    replace(model_py, 'aux["moe_balance"] = kept.sum() * sum(', 'aux["moe_balance"] = sum(')
    broken = generated_tests(repo, tmp_path / "b", "objective_term and moe_balance")
    assert "it is not summed over the targets" in broken and "weight a mean by the target count" in broken
