"""A GPT language model: a pre-norm causal transformer, as in GPT-2, small enough to read in one go.

Shape legend used in every comment below:
    B batch size, T sequence length, C n_embd, nh n_head, hs head size (C // nh), V vocab_size,
    S positions already in the KV cache (0 without one).

Parameter names follow GPT-2 (wte, wpe, h, ln_1, c_attn, c_proj, ln_2, c_fc, ln_f, lm_head) so that pretrained weights
map key by key. References: Radford et al. 2019 ("Language Models are Unsupervised Multitask Learners") for pre-norm and
the residual-scaled init; Vaswani et al. 2017."""
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Literal, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode


def option(default: Any, help: str, needs: Mapping[str, Any] | None = None) -> Any:
    """A GPTConfig field and its --help text. ``needs``: the other options' values without which this one acts on
    nothing (``needs={"n_experts": 4}``), set beside it by tests/test_model_options.py."""
    return field(default=default, metadata={"help": help, "needs": dict(needs or {})})


@dataclass
class GPTConfig:
    """Every option of the model, declared once: TrainConfig inherits these fields as flags and preset keys.

    A checkpoint saved before a field existed means its default, so a new option's default must be the model as it
    was (GPT-2's computation). docs/experiments.md walks through adding one."""
    vocab_size: int = option(MISSING, "real vocabulary size, set by the corpus; the embedding is padded up for speed")
    block_size: int = option(128, "context length in tokens (the longest sequence the position tables cover)")
    n_layer: int = option(4, "transformer blocks")
    n_head: int = option(4, "attention heads per block")
    n_embd: int = option(128, "residual stream width C")
    dropout: float = option(0.0, "dropout probability (attention, residual, embeddings)")
    bias: bool = option(False, "biases in Linear and LayerNorm layers")
    activation: Literal["gelu", "gelu_tanh", "relu2"] = option(
        "gelu", "MLP nonlinearity: gelu (exact, erf) | gelu_tanh (GPT-2's tanh approximation; set by init_from) | "
        "relu2 (squared ReLU, So et al. 2021)")
    pos_emb: Literal["learned", "rope"] = option(
        "learned", "positions: learned (GPT-2's table, wpe) | rope (rotary q and k, Su et al. 2021; no table)")
    norm: Literal["layernorm", "rmsnorm"] = option(
        "layernorm", "the blocks' and the final normalisation: layernorm (GPT-2) | rmsnorm (no mean, no bias)")
    qk_norm: bool = option(False, "RMS-normalise each head's queries and keys (with gains) before attention")
    z_loss: float = option(
        0.0, "weight of the z-loss, z_loss * logsumexp(logits)^2 per target (PaLM, Chowdhery et al. 2022): keeps "
        "the softmax's normaliser near 1; an objective term, never in val loss")

    # Options that act only while training, not on what the weights compute: a resume may change them.
    TRAINING_ONLY: ClassVar[tuple[str, ...]] = ("dropout", "z_loss")

    def __post_init__(self):
        if self.pos_emb == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"pos_emb rope rotates channel pairs: the head size n_embd / n_head "
                             f"({self.n_embd // self.n_head}) must be even")
        if not (math.isfinite(self.z_loss) and self.z_loss >= 0):
            raise ValueError(f"z_loss must be a finite number >= 0 (0 = off), got {self.z_loss}")

    @property
    def padded_vocab_size(self) -> int:
        """Vocab rounded up to a multiple of 64: matmuls on aligned shapes run faster."""
        return 64 * math.ceil(self.vocab_size / 64)


class ModelOutput(NamedTuple):
    """What GPT.forward returns; without targets only the logits are set."""
    logits: torch.Tensor  # (B, T, vocab_size)
    loss_sum: torch.Tensor | None = None  # summed cross-entropy over the targets: the metric
    n_targets: torch.Tensor | None = None  # targets counted (not -1)
    # The options' auxiliary losses by name (z_loss), summed like loss_sum: the objective's, never the metric's.
    aux: Mapping[str, torch.Tensor] = MappingProxyType({})


def visible_keys(config: GPTConfig, tokens: torch.Tensor, T: int) -> torch.Tensor:
    """What each query sees, the one definition every attention path (and the KV cache) gets: the queries are the
    last T of ``tokens`` (B, S + T), at positions S .. S + T - 1; the keys are all S + T.

    Either a bool rule (True = attend), (T, S + T) or per row (B, 1, T, S + T); or an additive float bias, (T, S + T),
    (nh, T, S + T) or (B, nh, T, S + T), -inf where a key is never seen (ALiBi). Built on the CPU; a rule that reads
    ``tokens`` is on their device (move the positions there)."""
    S = tokens.size(1) - T
    query = torch.arange(S, S + T).unsqueeze(1)  # (T, 1) positions
    key = torch.arange(S + T).unsqueeze(0)  # (1, S + T) positions
    return key <= query  # (T, S + T): causal, each query sees itself and the past


def is_plain_causal(mask: torch.Tensor) -> bool:
    """Whether ``mask`` is exactly the causal rule as a bool (T, S + T) on the CPU (never a float bias, however
    small): then attention() may use SDPA's own causal kernels, the same numbers without a mask."""
    if mask.dtype != torch.bool or mask.dim() != 2 or mask.device.type != "cpu":
        return False
    T, S = mask.size(0), mask.size(1) - mask.size(0)
    return torch.equal(mask, torch.ones(T, S + T, dtype=torch.bool).tril_(S))  # (T, S + T), key <= query


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              dropout_p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs) + mask) v: T queries (B, nh, T, hs) over S + T keys (B, nh, S + T, hs).

    ``mask``: GPT.visible's rule or bias, or None for the plain causal rule (SDPA's own kernels). In bf16 on CPU
    the plain matmul-softmax-matmul is ~5x faster than SDPA (scripts/bench.py --profile): a rule becomes a bias."""
    T, S = q.size(2), k.size(2) - q.size(2)
    cpu_bf16 = q.device.type == "cpu" and q.dtype == torch.bfloat16
    if mask is None and (cpu_bf16 or (T > 1 and S > 0)):  # no causal kernel for these: the plain rule itself
        mask = torch.ones(T, S + T, dtype=torch.bool, device=q.device).tril_(S)  # (T, S + T)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(q.dtype)  # a bias is added in the scores' dtype
    if cpu_bf16:
        if not mask.is_floating_point():  # the rule as a bias: 0 where a query sees the key, -inf elsewhere
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        att = (q * (1.0 / math.sqrt(k.size(-1)))) @ k.transpose(-2, -1) + mask  # (B, nh, T, S + T)
        att = F.dropout(att.softmax(dim=-1), p=dropout_p, training=dropout_p > 0)  # (B, nh, T, S + T)
        return att @ v  # (B, nh, T, hs)
    if mask is None:  # the plain rule over a square (S = 0), or one query that sees every key (T = 1)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=S == 0)  # (B, nh, T, hs)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)  # (B, nh, T, hs)


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021, "RoFormer"): each head's channel pair (i, i + hs/2) turns by the angle
    position * base^(-2i/hs), so q·k depends only on the positions' difference. The angles are buffers, not weights."""

    def __init__(self, head_size: int, block_size: int, base: float = 10000.0):
        super().__init__()
        inv_freq = base ** -(torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)  # (hs/2,)
        angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)  # (block_size, hs/2)
        self.register_buffer("cos", angles.cos(), persistent=False)  # rebuilt from the config: not saved
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x (B, nh, T, hs) at positions start .. start + T - 1, rotated; same shape out."""
        T = x.size(2)
        cos, sin = self.cos[start:start + T].to(x.dtype), self.sin[start:start + T].to(x.dtype)  # (T, hs/2)
        x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # (B, nh, T, hs)


def make_norm(config: GPTConfig) -> nn.Module:
    """The normalisation config.norm names: LayerNorm (GPT-2) or RMSNorm (Zhang & Sennrich 2019)."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=1e-5)  # LayerNorm's epsilon, so the two differ only in what they compute
    return nn.LayerNorm(config.n_embd, bias=config.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.dropout = config.dropout
        head_size = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # qk_norm bounds attention logits (Dehghani et al. 2023), gains let them sharpen; fp32 (bf16: no fused kernel)
        self.q_norm = nn.RMSNorm(head_size, eps=1e-5) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(head_size, eps=1e-5) if config.qk_norm else None
        self.rotary = Rotary(head_size, config.block_size) if config.pos_emb == "rope" else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """x (B, T, C) at positions S .. S + T - 1 (S = the cached ones); mask: GPT.visible's (None: plain causal)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        # Split the channels into heads and move the head axis forward.
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q.float()).type_as(v), self.k_norm(k.float()).type_as(v)  # (B, nh, T, hs), RMS in fp32
        if self.rotary is not None:  # new tokens start after the cached ones
            start = cache.length if cache is not None else 0
            q, k = self.rotary(q, start), self.rotary(k, start)  # (B, nh, T, hs) each
        if cache is not None:  # generation: attend over the cached past too
            k, v = cache.append(k, v)  # (B, nh, S + T, hs) each
        dropout_p = self.dropout if self.training and cache is None else 0.0  # the cache is for inference
        y = attention(q, k, v, mask, dropout_p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.activation = config.activation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 was trained with the tanh approximation of GELU (Hendrycks & Gimpel 2016, eq. 2);
        # its weights must run with it to give GPT-2's logits. New models default to the exact erf form.
        if self.activation == "relu2":  # squared ReLU (So et al. 2021, "Primer")
            return F.relu(x).square()
        return F.gelu(x, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))  # (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-norm block: normalise, transform, add back onto the residual stream."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask, cache)  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        learned_positions = config.pos_emb == "learned"  # rope rotates q and k instead: no table
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            **({"wpe": nn.Embedding(config.block_size, config.n_embd)} if learned_positions else {}),
            drop=nn.Dropout(config.dropout),
            # ModuleList, not a Python list: a plain list hides the blocks from .parameters(),
            # .to() and state_dict(), and the optimizer silently never trains them.
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=make_norm(config),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017): one matrix embeds tokens and scores them.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2 scales the init of projections into the residual stream by 1/sqrt(2 * n_layer): each block adds two.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count, the tied embedding once; non_embedding leaves out the position table, a lookup that costs
        no FLOPs (Kaplan et al. 2020's N). Every expert of a mixture counts, though a token runs through one."""
        n = sum(p.numel() for p in self.parameters())
        positions = sum(p.numel() for name, p in self.named_parameters() if name.startswith("transformer.wpe."))
        return n - positions if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token, measured: FlopCounterMode counts one forward and backward of ``seq_len`` tokens
        (block_size by default), so a fork is counted as it runs. For the default model, PaLM's 6·N + 12·n_layer·T·C
        (Chowdhery et al. 2022, app. B). SDPA's "math" backend, as the counter sees no fused CPU kernel."""
        T = seq_len or self.config.block_size
        device = next(self.parameters()).device
        idx = torch.arange(T, device=device).remainder(self.config.vocab_size).unsqueeze(0)  # (1, T): any tokens
        trained = [p for p in self.parameters() if p.requires_grad]
        was_training = self.training
        self.eval()  # dropout off: it draws random numbers (a run's would shift) and costs no FLOPs in this count
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            _, loss_sum, _, aux = self(idx, idx)
            torch.autograd.grad(loss_sum + sum(aux.values()), trained, allow_unused=True)  # a tuple, not .grad
        self.train(was_training)
        return counter.get_total_flops() // T

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache=None) -> ModelOutput:
        """Logits for every position; with targets (-1 ignored) also the *summed* cross-entropy (the metric), the
        count of targets and the objective's auxiliary terms (z_loss). Sums, not means, so that the caller can
        divide by the token count of a whole accumulated batch. With a cache (sample.py's KVCache), idx holds the
        tokens that follow the cached ones, at positions cache.length onwards."""
        B, T = idx.shape
        start = cache.length if cache is not None else 0  # S: position of idx[:, 0]
        if start + T > self.config.block_size:  # the position tables end here; never shift them silently
            raise ValueError(f"sequence length {start + T} exceeds block_size {self.config.block_size}")
        # A compiler cannot trace is_plain_causal (its answer is data): it runs as is, and the layers compile whole.
        visible = torch.compiler.disable(self.visible) if torch.compiler.is_compiling() else self.visible
        tokens = idx if cache is None else cache.remember(idx)  # (B, S + T): the cached ids, then idx
        mask = visible(tokens, T)  # None (the plain causal rule) or visible_keys' mask, for every layer
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.config.pos_emb == "learned":
            pos = torch.arange(start, start + T, device=idx.device)  # (T,)
            x = x + self.transformer.wpe(pos)  # (B, T, C) + (T, C) -> (B, T, C)
        x = self.transformer.drop(x)
        layer_caches = cache.layers if cache is not None else [None] * len(self.transformer.h)
        for block, layer_cache in zip(self.transformer.h, layer_caches):
            x = block(x, mask, layer_cache)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        # The padded vocab rows are dropped here: never sampled, never in the softmax of the loss.
        logits = self.lm_head(x)[..., : self.config.vocab_size]  # (B, T, vocab_size)
        if targets is None:
            return ModelOutput(logits)
        flat_logits, flat_targets = logits.reshape(B * T, -1).float(), targets.reshape(B * T)  # (B*T, V), (B*T,)
        loss_sum = F.cross_entropy(flat_logits, flat_targets, ignore_index=-1, reduction="sum")  # scalar
        kept, aux = flat_targets != -1, {}  # (B*T,): the targets counted
        if self.config.z_loss:  # log Z = logsumexp of the logits, pulled towards 0 (Chowdhery et al. 2022, sec. 5)
            aux["z_loss"] = self.config.z_loss * flat_logits.logsumexp(dim=-1)[kept].square().sum()
        return ModelOutput(logits, loss_sum, kept.sum(), aux)  # the count: a tensor, no host sync

    def visible(self, tokens: torch.Tensor, T: int) -> torch.Tensor | None:
        """visible_keys' mask for the last T of tokens, built once for every layer; None for the plain causal rule.
        Decided on the CPU, then copied non_blocking: a step waits for no GPU."""
        mask = visible_keys(self.config, tokens, T)
        return None if is_plain_causal(mask) else mask.to(tokens.device, non_blocking=True)
