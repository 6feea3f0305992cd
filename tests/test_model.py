"""The model: shapes, causality, initialisation, loss bookkeeping, attention masks and the KV cache's paths."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_optimizer, randomized, run_main, tiny_args, tiny_model

import model as model_module
import train
from model import Rotary
from sample import KVCache


def test_padded_vocab_and_a_summed_loss_that_ignores_minus_one():
    model = tiny_model(vocab_size=50)
    idx, targets = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    targets[1, 10:] = -1
    assert model(idx).loss_sum is None and model(idx).n_targets is None
    logits, loss_sum, n, _ = model(idx, targets)
    assert logits.shape == (2, 16, 50)  # the padded rows never leave the model
    assert model.lm_head.weight.shape == (64, 32)  # 50 padded up to a multiple of 64
    mask = targets != -1
    assert n.item() == 26
    torch.testing.assert_close(loss_sum, F.cross_entropy(logits[mask], targets[mask], reduction="sum"))


def test_init_follows_gpt2():
    model = tiny_model(seed=0)
    n_layer = model.config.n_layer
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h])
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * n_layer)) < 0.002
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002
    assert model.transformer.wte.weight is model.lm_head.weight  # tied


def test_set_lr_gives_muons_group_its_own_lr_as_a_scale():
    """(Which group each parameter trains in, and its decay: test_optim.py's table.)"""
    optimizer = make_optimizer(tiny_model(bias=True), 0.1, 1e-3, (0.9, 0.99), muon_lr=0.02)
    assert [g["lr_scale"] for g in optimizer.param_groups] == [1.0, 1.0, 20.0]
    train.set_lr(optimizer, 5e-4)
    assert [g["lr"] for g in optimizer.param_groups] == [5e-4, 5e-4, 5e-4 * 20.0]


def test_flops_per_token_measured_is_palms_count_for_the_default_model_on_every_attention_path():
    """FlopCounterMode's count of one step: 6 per matrix weight plus attention's 12·L·T·C (PaLM app. B), on SDPA or
    the CPU-bf16 matmuls; it leaves the random streams and the gradients as they were."""
    for dropout in (0.0, 0.2):  # SDPA's fused CPU kernel without dropout (FlopCounterMode counts it as 0), math with
        model = tiny_model(dropout=dropout, bias=True)  # 2 layers, C = 32, T = 16
        matrices = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        rng = torch.get_rng_state()
        assert model.flops_per_token() == 6 * matrices + 12 * 2 * 16 * 32
        with torch.autocast("cpu", dtype=torch.bfloat16):  # attention() takes its plain matmuls
            assert model.flops_per_token() == 6 * matrices + 12 * 2 * 16 * 32
        assert model.flops_per_token(seq_len=8) == 6 * matrices + 12 * 2 * 8 * 32
        assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())
        assert model.training


def test_flops_per_token_follows_what_the_forward_runs(monkeypatch):
    """A change to what runs (every MLP on half of the tokens, as a top-1 router might) moves the count."""
    dense = tiny_model().flops_per_token()

    def half_the_tokens(self, x):
        T = x.size(1) // 2
        return torch.cat([self.c_proj(self.act(self.c_fc(x[:, :T]))), torch.zeros_like(x[:, T:])], dim=1)

    monkeypatch.setattr(model_module.MLP, "forward", half_the_tokens)
    assert dense - tiny_model().flops_per_token() == 6 * 2 * (2 * 32 * 4 * 32) // 2  # L · c_fc and c_proj, halved


def test_the_parameter_count_includes_the_position_table_only_where_there_is_one():
    learned, rope = tiny_model(), tiny_model(pos_emb="rope")  # 16 positions x 32 channels
    assert learned.num_params(non_embedding=False) - rope.num_params(non_embedding=False) == 16 * 32
    assert learned.num_params() == rope.num_params() == rope.num_params(non_embedding=False)


# ----------------------------------------------------------------------------- the variants' own maths
def test_rotary_scores_depend_on_the_distance_between_positions_only():
    rotary = Rotary(head_size=8, block_size=32)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 8, generator=gen)  # (1, 1, 1, 8) each: one head, one position

    def score(m: int, n: int) -> float:  # q at position m against k at position n
        return (rotary(q, m) * rotary(k, n)).sum().item()

    assert score(3, 1) == pytest.approx(score(12, 10), abs=1e-5) == pytest.approx(score(29, 27), abs=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)
    torch.testing.assert_close(rotary(q, 5).norm(), q.norm())  # a rotation: lengths are kept
    torch.testing.assert_close(rotary(q, 0), q)  # position 0 is not turned


def test_squared_relu_is_relu_squared_and_rmsnorm_has_no_mean_or_bias():
    model = tiny_model(activation="relu2", norm="rmsnorm", bias=True)
    x = torch.linspace(-2, 2, 9)
    torch.testing.assert_close(model.transformer.h[0].mlp.act(x), F.relu(x) ** 2, rtol=0, atol=0)
    ln = model.transformer.ln_f
    assert isinstance(ln, torch.nn.RMSNorm) and [n for n, _ in ln.named_parameters()] == ["weight"]
    h = torch.randn(3, 32) + 5.0  # a mean RMSNorm keeps (LayerNorm would remove it)
    torch.testing.assert_close(ln(h), h / h.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt())


def test_qk_norm_gives_each_head_unit_rms_queries_and_keys_at_init():
    attn = tiny_model(qk_norm=True).transformer.h[0].attn
    q = torch.randn(2, 2, 5, 16) * 7.0  # (B, nh, T, hs)
    torch.testing.assert_close(attn.q_norm(q).pow(2).mean(-1), torch.ones(2, 2, 5), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- one attention mask
CHUNKS = [(0, 5), (5, 6), (6, 7), (7, 12), (12, 16)]  # through the KV cache: prefill, decodes, chunks


def full_and_cached(model, idx: torch.Tensor, dtype: torch.dtype, chunks=CHUNKS) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of idx (B, 16) in one forward and through the KV cache in ``chunks``, in fp32 (SDPA) or CPU bf16."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        cache = KVCache(model.config, idx.size(0))
        parts = [model(idx[:, a:b], cache=cache).logits for a, b in chunks]
        return model(idx).logits.float(), torch.cat(parts, dim=1).float()  # (B, 16, 50) each


def windowed(window: int):
    """visible_keys narrowed to a sliding window, as a fork would write it (docs/experiments.md)."""
    real = model_module.visible_keys

    def visible_keys(config, tokens, T):
        mask, S = real(config, tokens, T), tokens.size(1) - T  # (T, S + T)
        query = torch.arange(S, S + T).unsqueeze(1)  # (T, 1)
        return mask & (query - torch.arange(S + T).unsqueeze(0) < window)
    return visible_keys


@pytest.mark.parametrize("built", ["built after", "built before"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["SDPA", "CPU-bf16 matmuls"])
def test_every_attention_path_follows_the_one_mask(monkeypatch, dtype, built):
    """The rule lives in visible_keys alone: change it there and the full forward and the KV cache's prefill,
    decode and chunks, in fp32 (SDPA) and bf16 (matmuls), all follow, on a model built before the change too.
    Before, a window honoured in two of three places was ignored by the cache (logits off by up to 0.43)."""
    if built == "built after":
        monkeypatch.setattr(model_module, "visible_keys", windowed(4))
    model = tiny_model(seed=0).eval()
    monkeypatch.setattr(model_module, "visible_keys", windowed(4))
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))  # (2, 16)
    older = idx.clone()
    older[:, :8] = (older[:, :8] + 1) % 50  # positions 0..7 differ
    (full, cached), (full_older, _) = full_and_cached(model, idx, dtype), full_and_cached(model, older, dtype)
    torch.testing.assert_close(cached, full, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
    # Two layers of a 4-wide window see 7 positions back: from position 15 on nothing older than 8 reaches.
    torch.testing.assert_close(full[:, 15:], full_older[:, 15:], atol=0, rtol=0)
    assert not torch.allclose(full[:, 8:11], full_older[:, 8:11])


def documents(separator: int):
    """visible_keys with docs/experiments.md's document mask: a query sees its own document only, per row."""
    real = model_module.visible_keys

    def visible_keys(config, tokens, T):
        doc = (tokens == separator).cumsum(dim=1)  # (B, S + T)
        same = doc[:, -T:].unsqueeze(2) == doc.unsqueeze(1)  # (B, T, S + T)
        return (real(config, tokens, T).to(tokens.device) & same).unsqueeze(1)  # (B, 1, T, S + T)
    return visible_keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["SDPA", "CPU-bf16 matmuls"])
def test_a_document_mask_that_reads_the_ids_reaches_every_path(monkeypatch, dtype):
    """A rule that depends on the tokens: before, visible_keys never saw them, and a mask narrowed after it was
    dropped by fp32's causal shortcut (the base model's loss to every digit) but kept in CPU bf16."""
    model = randomized(tiny_model())  # std 0.2: attention's weighting shows in the logits
    idx = torch.tensor([[5, 1, 2, 0, 3, 4, 0, 6, 7, 1, 2, 3, 0, 4, 5, 6]] * 2)  # (2, 16): documents at 3, 6, 12
    idx[1, :12] = (idx[1, :12] + 1) % 50  # row 1: other tokens before its last document (but the separators)
    idx[1, [3, 6]] = 0
    chunks = [(0, 5), (5, 6), (6, 7), (7, 13), (13, 16)]
    plain, _ = full_and_cached(model, idx, dtype, chunks)
    monkeypatch.setattr(model_module, "visible_keys", documents(0))
    full, cached = full_and_cached(model, idx, dtype, chunks)
    torch.testing.assert_close(cached, full, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
    torch.testing.assert_close(full[0, 12:], full[1, 12:], atol=0, rtol=0)  # the last document sees itself only
    assert (full[:, 3:] - plain[:, 3:]).abs().max() > 0.1  # the mask acts from the first boundary on


def alibi(slope_scale: float):
    """visible_keys with ALiBi's bias (Press et al. 2022): -slope_h * distance per head, -inf for the future."""
    def visible_keys(config, tokens, T):
        slopes = slope_scale * 2.0 ** (-8.0 * torch.arange(1, config.n_head + 1) / config.n_head)  # (nh,)
        S = tokens.size(1) - T
        distance = (torch.arange(S, S + T).unsqueeze(1) - torch.arange(S + T).unsqueeze(0)).float()  # (T, S + T)
        return (-slopes[:, None, None] * distance).masked_fill(distance < 0, float("-inf"))  # (nh, T, S + T)
    return visible_keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["SDPA", "CPU-bf16 matmuls"])
def test_a_bias_reaching_attention_is_never_dropped_by_a_causal_shortcut(monkeypatch, dtype):
    """Issue 44: before, SDPA's causal shortcuts dropped ALiBi's bias on every path (the fork trained without
    positions) and the CPU-bf16 path raised on `~`. A shortcut needs what attention receives to be a bool rule."""
    model = randomized(tiny_model())  # std 0.2: attention's weighting shows in the logits
    # A float tensor is a bias, never the rule, even one torch.equal finds equal to the triangle (+1 on the past).
    assert not model_module.is_plain_causal(torch.ones(16, 16).tril())
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))  # (2, 16)
    plain = full_and_cached(model, idx, dtype)
    monkeypatch.setattr(model_module, "visible_keys", alibi(0.0))
    zero_slopes = full_and_cached(model, idx, dtype)
    monkeypatch.setattr(model_module, "visible_keys", alibi(1.0))
    full, cached = full_and_cached(model, idx, dtype)
    for zero, causal in zip(zero_slopes, plain):  # a zero bias is the causal rule (SDPA's per-head kernel rounds)
        torch.testing.assert_close(zero, causal, atol=1e-6, rtol=0)
    torch.testing.assert_close(cached, full, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
    # The bias acts, on the full forward and the cache alike (by 0.037 here; 0 when a shortcut dropped it).
    assert (full - plain[0]).abs().max() > 0.01 and (cached - plain[1]).abs().max() > 0.01


def forward_on_every_path(model) -> None:
    """Nine tokens through ``model`` whole, then through the KV cache: a prefill of 5, a decode step, a chunk of 3."""
    idx = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(0))  # (1, 9)
    cache = KVCache(model.config, 1)
    with torch.no_grad():
        model(idx)
        for a, b in [(0, 5), (5, 6), (6, 9)]:
            model(idx[:, a:b], cache=cache)


def test_what_a_query_sees_is_built_once_per_forward_never_per_layer_or_at_build(monkeypatch):
    """Issue 56: `--block_size 100000` ate 17 GB before a line was printed (a block_size² mask per layer, built to
    decide the causal shortcut). Now each forward builds visible_keys once, at its own (S, T), for every layer."""
    calls = []
    real = model_module.visible_keys

    def recording(config, tokens, T):
        calls.append((tokens.size(1) - T, T))
        return real(config, tokens, T)

    monkeypatch.setattr(model_module, "visible_keys", recording)
    model = model_module.GPT(model_module.GPTConfig(vocab_size=50, block_size=10**6, n_layer=2, n_head=2, n_embd=8))
    assert calls == []  # before: 10^12 bools per layer (the allocation fails)
    assert max(t.numel() for t in [*model.parameters(), *model.buffers()]) == 10**6 * 8  # wpe, (block_size, C)
    forward_on_every_path(model)
    assert calls == [(0, 9), (0, 5), (5, 1), (6, 3)]


def test_a_step_that_cannot_fit_in_memory_is_refused_before_anything_is_allocated(tmp_path, text_file, capsys):
    """A step whose lower bound (runtime.step_bytes) exceeds the device's memory is one line, exit 2, before the
    corpus is prepared or the model built (`--block_size 100000` once grew to 17 GB printing nothing)."""
    assert run_main(tiny_args(tmp_path / "out", text_file, block_size=10**7)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "block_size 10000000" in err and "GiB" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]  # no data_dir, no out_dir


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_forward_on_a_gpu_decides_the_causal_shortcut_without_a_sync():
    """The shortcut is decided of the mask on the CPU, then copied: a comparison on the GPU would sync each forward."""
    model = tiny_model().cuda()
    idx = torch.randint(0, 50, (2, 16), device="cuda")  # (2, 16)
    model(idx, idx).loss_sum.backward()  # the first calls may sync (the allocator, kernel choices)
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(idx, idx).loss_sum.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_default_model_gives_sdpa_the_causal_flag_not_a_mask(monkeypatch):
    """Flash attention needs the plain rule as is_causal or nothing, never a mask (but a chunk after a past)."""
    calls = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((q.size(2), k.size(2), attn_mask is None, is_causal))  # (T, S + T, no mask, is_causal)
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model = tiny_model().eval()
    forward_on_every_path(model)
    assert calls == [(9, 9, True, True)] * 2 + [(5, 5, True, True)] * 2 + [(1, 6, True, False)] * 2 + \
        [(3, 9, False, False)] * 2  # two layers each
