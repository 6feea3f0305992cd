"""optim.Muon is torch.optim.Muon with the Newton-Schulz iteration in the run's precision."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import train
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
