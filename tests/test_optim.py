"""optim.Muon is torch.optim.Muon with the Newton-Schulz iteration in the run's precision."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import optim
import train
from cli import ConfigError
from config import make_config
from optim import Muon, orthogonalize


def step_both(reference: torch.optim.Optimizer, ours: Muon, a: list, b: list, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        reference.step()
        ours.step()


def two_matrices() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(48, 16, generator=gen), torch.randn(16, 64, generator=gen)]  # tall and wide


def layers_of_matrices() -> list[torch.Tensor]:
    """A model's kind of Muon group: three layers of a tall, a wide and a square matrix, interleaved as in a model."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for _ in range(3) for shape in ((48, 16), (16, 64), (16, 16))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_batched_iteration_per_shape_gives_every_matrix_the_bits_of_its_own(dtype):
    """Muon orthogonalises the matrices of a shape as one batch (bmm); each comes out as torch.optim.Muon makes it
    alone (bf16: torch's own step) or, in fp32, as the iteration on it alone does."""
    a = [w.clone().requires_grad_() for w in layers_of_matrices()]
    b = [w.clone().requires_grad_() for w in layers_of_matrices()]
    if dtype == torch.bfloat16:
        step_both(torch.optim.Muon(a, lr=0.02, weight_decay=0.1), Muon(b, ns_dtype=dtype, lr=0.02, weight_decay=0.1),
                  a, b)
        assert all(torch.equal(p, q) for p, q in zip(a, b))
        return
    updates = [torch.randn(w.shape, generator=torch.Generator().manual_seed(i)) for i, w in enumerate(a)]
    alone = [orthogonalize(u[None], (3.4445, -4.7750, 2.0315), 5, 1e-7, dtype)[0] for u in updates]
    for shape in ((48, 16), (16, 64), (16, 16)):
        same = [i for i, u in enumerate(updates) if u.shape == shape]
        batch = orthogonalize(torch.stack([updates[i] for i in same]), (3.4445, -4.7750, 2.0315), 5, 1e-7, dtype)
        assert all(torch.equal(batch[k], alone[i]) for k, i in enumerate(same))


def test_in_fp32_the_iteration_never_drops_to_bf16(monkeypatch):
    a = [w.clone().requires_grad_() for w in two_matrices()]
    b = [w.clone().requires_grad_() for w in two_matrices()]
    step_both(torch.optim.Muon(a, lr=0.02), Muon(b, ns_dtype=torch.float32, lr=0.02), a, b, steps=1)
    # Close to torch's bf16 result (the same maths), but not equal: bf16 rounding is gone.
    assert all(torch.allclose(p, q, atol=1e-3) and not torch.equal(p, q) for p, q in zip(a, b))
    seen = []
    real_baddbmm = torch.baddbmm
    monkeypatch.setattr(torch, "baddbmm", lambda *args, **kw: seen.append(args[1].dtype) or real_baddbmm(*args, **kw))
    orthogonalize(torch.randn(1, 8, 4), (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
    assert seen and set(seen) == {torch.float32}


def test_orthogonalize_brings_singular_values_near_one():
    update = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(0)) * 1e-3  # tall, tiny scale
    singular = torch.linalg.svdvals(orthogonalize(update, (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)[0])
    assert singular.min() > 0.5 and singular.max() < 1.5  # Jordan et al.: ~U(0.5, 1.5), not exactly 1


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                             (torch.float16, torch.float32)])
def test_build_optimizer_runs_muon_in_bf16_only_where_the_run_does(tmp_path, dtype, expected):
    cfg = make_config("tiny", optimizer="muon", out_dir=str(tmp_path))
    optimizer = train.build_optimizer(tiny_model(), cfg, torch.device("cpu"), dtype)
    assert optimizer.muon.ns_dtype == expected


# ----------------------------------------------------------------------------- which parameter trains how
WHERE = [  # tiny with biases and qk_norm, layer 0 (layer 1 alike): (name, under --optimizer adamw, under muon)
    ("transformer.wte.weight", "adamw, decayed", "adamw, decayed"),  # tied to lm_head: one tensor
    ("transformer.wpe.weight", "adamw, decayed", "adamw, decayed"),
    ("transformer.h.0.ln_1.weight", "adamw", "adamw"),
    ("transformer.h.0.ln_1.bias", "adamw", "adamw"),
    ("transformer.h.0.attn.c_attn.weight", "adamw, decayed", "muon, decayed"),
    ("transformer.h.0.attn.c_attn.bias", "adamw", "adamw"),
    ("transformer.h.0.attn.c_proj.weight", "adamw, decayed", "muon, decayed"),
    ("transformer.h.0.attn.c_proj.bias", "adamw", "adamw"),
    ("transformer.h.0.attn.q_norm.weight", "adamw", "adamw"),
    ("transformer.h.0.attn.k_norm.weight", "adamw", "adamw"),
    ("transformer.h.0.ln_2.weight", "adamw", "adamw"),
    ("transformer.h.0.ln_2.bias", "adamw", "adamw"),
    ("transformer.h.0.mlp.c_fc.weight", "adamw, decayed", "muon, decayed"),
    ("transformer.h.0.mlp.c_fc.bias", "adamw", "adamw"),
    ("transformer.h.0.mlp.c_proj.weight", "adamw, decayed", "muon, decayed"),
    ("transformer.h.0.mlp.c_proj.bias", "adamw", "adamw"),
    ("transformer.ln_f.weight", "adamw", "adamw"),
    ("transformer.ln_f.bias", "adamw", "adamw"),
]


def where_each_trains(model: torch.nn.Module, optimizer: str) -> dict[str, str]:
    """Each parameter's optimizer (a group's "kind", adamw without one) and decay, by name: from the built groups."""
    built = train.build_optimizer(model, make_config("tiny", optimizer=optimizer), torch.device("cpu"))
    where = {id(p): f"{group.get('kind', 'adamw')}{', decayed' if group['weight_decay'] else ''}"
             for group in built.param_groups for p in group["params"]}
    assert len(where) == sum(len(group["params"]) for group in built.param_groups)  # each in one group only
    return {name: where[id(p)] for name, p in model.named_parameters()}


def test_every_parameter_trains_where_its_kind_says():
    model = tiny_model(bias=True, qk_norm=True)
    for column, optimizer in ((1, "adamw"), (2, "muon")):
        placed = where_each_trains(model, optimizer)
        assert {name: place for name, place in placed.items() if ".h.1." not in name} == \
            {row[0]: row[column] for row in WHERE}, optimizer
        assert all(placed[name.replace(".h.1.", ".h.0.")] == place for name, place in placed.items())


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_tensor_a_fork_adds_is_refused_until_its_kind_is_declared(monkeypatch, optimizer):
    """A T5-style bias table, nn.Embedding(32, n_head) in each attention layer: before, Muon took it (every 2-D
    tensor in the blocks), at 4x the lr of a matrix its shape, and AdamW decayed it, silently; val loss 0.92
    against 1.11 with the table where its author meant it."""
    model = tiny_model()
    for block in model.transformer.h:
        block.attn.rel_bias = torch.nn.Embedding(32, 2)
    with pytest.raises(ConfigError, match=r"^no row of optim.PARAMETER_KINDS names the parameter "
                                          r"transformer.h.0.attn.rel_bias.weight \(32, 2\)"):
        where_each_trains(model, optimizer)
    monkeypatch.setattr(optim, "PARAMETER_KINDS", (("*.rel_bias.weight", "gain"), *optim.PARAMETER_KINDS))
    assert where_each_trains(model, optimizer)["transformer.h.0.attn.rel_bias.weight"] == "adamw"
