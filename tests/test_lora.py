"""LoRA: the base's logits at step 0, only adapters train, merging, another base refused, PEFT."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_text, run_main, tiny_model, tiny_run

import checkpoint
import finetune
import train
from checkpoint import REQUIRED_KEYS, from_checkpoint, load_checkpoint, load_run, start_from
from cli import CheckpointError
from config import LORA_TARGETS, make_config
from data import load_corpus
from prepare import prepare_corpus
from runtime import Runtime
from scripts import export_hf, import_hf
from tokenizer import tokenizer_from_meta

CPU = Runtime(torch.device("cpu"), torch.float32, 1, False)
TARGETS = "attn.c_attn,mlp.c_proj"  # an attention and an MLP layer: PEFT must tell mlp.c_proj from attn.c_proj


def adapted(targets: str = ",".join(LORA_TARGETS), dropout: float = 0.0, seed: int = 0):
    base = tiny_model(seed=seed).eval()
    model = finetune.add_adapters(tiny_model(seed=seed), 4, 8.0, dropout, targets)
    return base, model


def randomize_adapters(model: torch.nn.Module) -> None:
    """Non-zero B matrices: as if trained, so that the update shows in the logits."""
    with torch.no_grad():
        for layer in finetune.adapters(model).values():
            layer.lora_B.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(3))


IDX = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))


# ----------------------------------------------------------------------------- the adapters
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_adapters_at_step_0_give_the_bases_logits_exactly(mode):
    base, model = adapted(dropout=0.5)  # adapter dropout too: B = 0 cancels whatever it drops
    getattr(model, mode)()
    assert len(finetune.adapters(model)) == 2 * len(LORA_TARGETS)
    assert torch.equal(model(IDX).logits, base(IDX).logits)
    randomize_adapters(model)  # the check can fail: an update that is not zero shows
    assert not torch.equal(model(IDX).logits, base(IDX).logits)


def test_an_adapted_layer_adds_alpha_over_rank_times_b_a_of_its_dropped_out_input():
    """PEFT's maths (its files load onto the base to our logits only if so): y = W x + alpha / rank * B A drop(x)."""
    layer = finetune.LoRALinear(torch.nn.Linear(8, 6), rank=4, alpha=8.0, dropout=0.5)
    randomize_adapters(layer)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    a, b = layer.lora_A.weight, layer.lora_B.weight
    with torch.no_grad():
        torch.testing.assert_close(layer.eval()(x), layer.base(x) + 2.0 * x @ a.T @ b.T)
        torch.manual_seed(0)
        trained = layer.train()(x)
        torch.manual_seed(0)
        torch.testing.assert_close(trained, layer.base(x) + 2.0 * torch.nn.functional.dropout(x, 0.5) @ a.T @ b.T)


def test_adding_adapters_freezes_every_base_weight_whose_every_change_alters_the_fingerprint():
    """Only adapters and marker rows train; each base tensor, the tied one once, counts in the fingerprint."""
    _, model = adapted(TARGETS)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(finetune.adapter_state(model)) and trainable
    assert {name.split(".", 3)[3].rsplit(".", 2)[0] for name in trainable} == set(TARGETS.split(","))
    model = finetune.add_adapters(tiny_model(bias=True), 4, 8.0, 0.0, LORA_TARGETS, rows=[48, 49])
    reference = finetune.base_fingerprint(model)
    assert reference == finetune.base_fingerprint(tiny_model(bias=True))
    counted = []
    for name, p in model.named_parameters():
        before = p.detach().clone()
        with torch.no_grad():
            p.view(-1)[0] += 1e-3
        if finetune.base_fingerprint(model) != reference:
            counted.append(name)
        with torch.no_grad():
            p.copy_(before)
    assert not any(p.requires_grad for name, p in model.named_parameters() if name in counted)  # no adapter, no row
    assert len(counted) == len(list(tiny_model(bias=True).parameters()))  # each base tensor, the tied one once


def test_merged_model_is_a_plain_gpt_computing_the_adapted_logits_marker_rows_included():
    base = tiny_model().eval()
    model = finetune.add_adapters(tiny_model(), 4, 8.0, 0.0, LORA_TARGETS, rows=[46, 49]).eval()
    randomize_adapters(model)
    with torch.no_grad():
        model.transformer.wte.lora_rows.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(4))
    every_id = torch.arange(64).view(4, 16) % 50  # (4, 16): every id, the markers 46 and 49 included
    merged = finetune.merge(model).eval()
    with torch.no_grad():
        adapted_logits, merged_logits = model(every_id).logits, merged(every_id).logits
    # fp32 rounding of W + BA against W and BA apart, relative to logits up to ~12: on a CPU held to AVX2 the kernels'
    # summation order gives 1.4e-5 where AVX-512 gives < 1e-5. A wrong merge (scale, rows, transpose) is off by > 0.01.
    torch.testing.assert_close(merged_logits, adapted_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(merged.transformer.wte.weight[[46, 49]], model.transformer.wte.lora_rows)
    with torch.no_grad():  # the rows show on their inputs and in their logits: the check can fail
        assert (merged_logits[..., [46, 49]] - base(every_id).logits[..., [46, 49]]).abs().min() > 0
    assert merged.state_dict().keys() == base.state_dict().keys()  # no adapter key: loads as any GPT
    assert merged.lm_head.weight is merged.transformer.wte.weight
    assert all(p.requires_grad for p in merged.parameters())
    assert finetune.adapters(model) and not finetune.adapters(merged)  # a copy: the adapted model keeps its adapters
    assert not torch.equal(merged.transformer.h[0].attn.c_attn.weight, base.transformer.h[0].attn.c_attn.weight)


# ----------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def corpus_paths(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora_corpus")
    (root / "corpus.txt").write_text(make_text())
    return root / "corpus.txt", root / "data"


def export_base(corpus_paths: tuple[Path, Path], folder: Path, seed: int = 0) -> Path:
    """A GPT-2 base: exported to folder/hf (PEFT's), imported as the run folder/run (--init_from's), returned."""
    text, data_dir = corpus_paths
    corpus = load_corpus(prepare_corpus(data_path=str(text), tokenizer="char", data_dir=str(data_dir)), 32)
    model = tiny_model(vocab_size=corpus.vocab_size, block_size=32, seed=seed, bias=True, activation="gelu_tanh")
    with torch.no_grad():  # biases and gains too: a base whose every weight counts
        for p in model.parameters():
            p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed))
    export_hf.export(model, tokenizer_from_meta(corpus.meta["tokenizer"]), folder / "hf")
    import_hf.main([str(folder / "hf"), str(folder / "run")])
    return folder / "run"


def lora_cfg(corpus_paths, out_dir: Path, base: Path, **overrides):
    text, data_dir = corpus_paths
    values = tiny_run(out_dir, text) | dict(data_dir=str(data_dir), init_from=str(base), lora_rank=4, lora_alpha=8.0,
                                            lora_targets=TARGETS, max_iters=8, eval_interval=4, eval_tokens=512,
                                            compile="off", dropout=0.1, lora_dropout=0.1)
    return make_config("tiny", **(values | overrides))


@pytest.fixture(scope="module")
def base_run(corpus_paths, tmp_path_factory) -> Path:
    return export_base(corpus_paths, tmp_path_factory.mktemp("lora_base"))


@pytest.fixture(scope="module")
def trained(corpus_paths, base_run, tmp_path_factory) -> Path:
    """A LoRA run's folder: 8 steps at a high lr, so that the adapters moved visibly."""
    out = tmp_path_factory.mktemp("lora_run") / "run"
    train.train(lora_cfg(corpus_paths, out, base_run, learning_rate=2e-2, min_lr=2e-3, warmup_iters=0))
    return out


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_optimizer_sees_and_steps_only_the_adapters(corpus_paths, base_run, tmp_path, optimizer):
    cfg, pretrained = start_from(lora_cfg(corpus_paths, tmp_path / "out", base_run, optimizer=optimizer))
    run = train.build_run(cfg, CPU, pretrained=pretrained)
    adapter_params = {id(p) for layer in finetune.adapters(run.model).values()
                      for p in (layer.lora_A.weight, layer.lora_B.weight)}
    optimized = [p for group in run.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == adapter_params and len(optimized) == len(adapter_params)
    assert sum(p.numel() for p in optimized) == sum(t.numel() for t in finetune.adapter_state(run.model).values())
    before = {name: t.clone() for name, t in run.model.state_dict().items()}
    train.train_step(run, run.model, [run.stream.next()], 1, 1e-2)
    after = run.model.state_dict()
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and moved <= set(finetune.adapter_state(run.model))  # the base never moves (A's moves from step 2)
    assert {id(p) for p in run.optimizer.state} <= adapter_params and run.optimizer.state


def test_a_lora_checkpoint_holds_the_adapters_and_the_bases_fingerprint_not_the_base(trained, base_run):
    state = load_checkpoint(trained / "last.pt")
    assert sorted(state) == sorted((*REQUIRED_KEYS, "lora"))  # "lora": what a LoRA run adds
    pretrained = load_run(base_run / "best.pt", 32)
    base = tiny_model(vocab_size=pretrained.config.vocab_size, block_size=32, bias=True, activation="gelu_tanh")
    base.load_state_dict(pretrained.state)
    assert state["lora"] == {"base": str(base_run), "fingerprint": finetune.base_fingerprint(base), "rank": 4,
                             "alpha": 8.0, "dropout": 0.1, "targets": TARGETS.split(","), "rows": []}
    assert set(state["model"]) == {f"transformer.h.{i}.{target}.lora_{m}.weight" for i in range(2)
                                   for target in TARGETS.split(",") for m in "AB"}
    assert load_checkpoint(trained / "best.pt")["lora"] == state["lora"]


def test_another_base_is_refused_by_a_resume_and_by_sampling_naming_both_fingerprints(corpus_paths, trained, tmp_path,
                                                                                     monkeypatch):
    other = export_base(corpus_paths, tmp_path / "other", seed=1)
    state = load_checkpoint(trained / "last.pt")
    saved = state["lora"]["fingerprint"]
    with pytest.raises(CheckpointError, match=f"trained on base .* \\(fingerprint {saved[:12]}\\), but the base "
                                              r"loaded now has fingerprint [0-9a-f]{12}: adapters fit only") as err:
        train.train(lora_cfg(corpus_paths, trained, other, max_iters=12, resume=True))
    assert "\n" not in str(err.value)
    assert load_checkpoint(trained / "last.pt")["step"] == 8  # nothing was written
    monkeypatch.setitem(state["config"], "init_from", str(other))  # as if the base folder had been replaced
    real = checkpoint.load_checkpoint  # the bases are checkpoints too: they load as they are
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda p: state if p == trained / "last.pt" else real(p))
    with pytest.raises(CheckpointError, match="its LoRA adapters were trained on base"):
        from_checkpoint(trained / "last.pt")
    monkeypatch.setitem(state["config"], "block_size", 64)  # a shorter base: no advice of a flag sample.py lacks
    with pytest.raises(CheckpointError, match=r"\(block_size 64 exceeds the 32 positions of \S+\); they need the base"):
        from_checkpoint(trained / "last.pt")
    monkeypatch.setitem(state["config"], "init_from", str(tmp_path / "moved"))  # the base is gone: said, named
    with pytest.raises(CheckpointError, match=f"base {tmp_path / 'moved'}, which is gone.*or a symbolic link"):
        from_checkpoint(trained / "last.pt")
    with pytest.raises(CheckpointError, match="no such run folder .* trained on a base: pass --init_from where"):
        train.train(lora_cfg(corpus_paths, trained, tmp_path / "moved", max_iters=12, resume=True))



def test_sampling_a_lora_run_merges_its_adapters(corpus_paths, trained, base_run, tmp_path, monkeypatch):
    state = load_checkpoint(trained / "last.pt")
    model = from_checkpoint(trained / "last.pt").model
    assert not finetune.adapters(model)
    monkeypatch.chdir(base_run.parent)  # a relative --init_from is saved absolute: the base is found from anywhere
    cfg, pretrained = start_from(lora_cfg(corpus_paths, tmp_path / "x", Path(base_run.name)))
    assert cfg.init_from == str(base_run.resolve())
    run = train.build_run(cfg, CPU, pretrained=pretrained)
    finetune.load_adapter_state(run.model, state["model"], "test")
    idx = IDX % pretrained.config.vocab_size
    with torch.no_grad():
        assert (model(idx).logits - run.model.eval()(idx).logits).abs().max() <= 1e-5


def test_eval_of_a_lora_run_gives_its_logged_best_val_loss_exactly(corpus_paths, base_run, tmp_path, capsys):
    """Bug caught: eval scored the merged W + B A, whose bf16 products round otherwise than training's."""
    from scripts import eval as eval_script
    out = tmp_path / "run"
    train.train(lora_cfg(corpus_paths, out, base_run, learning_rate=5e-2, min_lr=5e-3, warmup_iters=0,
                         dtype="bfloat16"))
    capsys.readouterr()
    for flag in ("--ckpt", "--init_from"):  # a run: --init_from takes it as --ckpt (it was sent to GPT-2's loader)
        eval_script.main([flag, str(out), "--json"])
        assert json.loads(capsys.readouterr().out)["val_loss"] == load_checkpoint(out / "best.pt")["best_val_loss"]


# ----------------------------------------------------------------------------- PEFT
@pytest.mark.interop  # peft, transformers
def test_peft_loads_the_exported_adapters_onto_the_exported_base_to_our_logits(trained, base_run, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is not installed (requirements-dev.txt): no PEFT round trip")
    transformers = pytest.importorskip("transformers")
    export_hf.main([str(trained), str(tmp_path / "merged"), "--peft", str(tmp_path / "adapters")])
    ours = from_checkpoint(trained / "best.pt").model
    idx = IDX % ours.config.vocab_size
    base = transformers.GPT2LMHeadModel.from_pretrained(base_run.parent / "hf").eval()  # as hf.export wrote it
    with torch.no_grad():
        base_logits = base(idx).logits
        peft_logits = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()(idx).logits
        merged_logits = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged").eval()(idx).logits
        our_logits = ours(idx).logits
    assert (peft_logits - our_logits).abs().max() <= 1e-5
    assert (merged_logits - our_logits).abs().max() <= 1e-5
    assert (base_logits - our_logits).abs().max() > 1e-3  # the adapters changed the model: the check can fail
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_run.parent / "hf")  # the import's source: PEFT loads it


def test_an_export_checks_every_folder_it_writes_before_writing_any(trained, tmp_path, capsys):
    """Bug caught: --peft DIR overwrote earlier adapters or a run folder, or was refused only after writing; the
    adapters' files were printed under OUT."""
    with pytest.raises(CheckpointError, match="not a LoRA run"):
        export_hf.export_peft({"model": {}}, tmp_path / "adapters")
    export_hf.main([str(trained), str(tmp_path / "hf"), "--peft", str(tmp_path / "adapters")])
    printed = dict(line.split(" -> ")[1].split(": ") for line in capsys.readouterr().out.splitlines())
    for folder in (tmp_path / "hf", tmp_path / "adapters"):  # each file printed under the folder it is in
        assert set(printed[str(folder)].split(", ")) == {p.name for p in folder.iterdir()}, printed
    refused = [(tmp_path / "hf2", tmp_path / "adapters"),  # the first export's adapters
               (tmp_path / "hf2", trained),  # a run folder
               (tmp_path / "same", tmp_path / "same"),  # OUT itself
               (tmp_path / "nest", tmp_path / "nest" / "adapters")]  # inside OUT
    for out, peft in refused:
        before = {p: p.read_bytes() for p in [*tmp_path.rglob("*"), *trained.rglob("*")] if p.is_file()}
        code, err = run_main([str(trained), str(out), "--peft", str(peft)], export_hf.main), capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert not out.exists(), err  # nothing written, no folder made
        assert {p: p.read_bytes() for p in [*tmp_path.rglob("*"), *trained.rglob("*")] if p.is_file()} == before, err
