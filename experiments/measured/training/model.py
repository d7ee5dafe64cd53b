"""A small Qwen3-style decoder whose core attention is a pluggable callable (Libra sec. 1, 5).

Blocks follow the public Qwen3 architecture: pre-RMSNorm, Q/K RMSNorm per head, rotary embeddings,
grouped-query attention, SwiGLU MLP, and optionally a top-k routed MoE block with normalised
top-k weights (30B-A3B / 235B-A22B style). Everything except *core attention* is token-local, so
under context parallelism the model takes this CP rank's local token slice in the pre-attention
layout (its contiguous ``S / CP`` tokens, all heads) and only the attention callable talks to
other ranks. Rotary positions restart at every sample of a packed sequence (block-diagonal
causal mask), so callers pass ``position_ids`` computed on the full packed sequence and sliced.

Core-attention callables have the signature ``attn(q, k, v) -> o`` with
``q (T_local, hq, d)``, ``k, v (T_local, hkv, d)`` and ``o (T_local, hq, d)``; they are bound to the
current microbatch (its sample lengths, Plan and process group) by the caller. See
:mod:`experiments.measured.training.attention` for the reference, Ulysses and Libra backends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from libra.workload import AttentionShape

CoreAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the small decoder (Qwen3 layout, toy sizes by default).

    Attributes:
        vocab_size, hidden, layers: embedding table size, model width, decoder blocks.
        num_q_heads, num_kv_heads, head_dim: GQA geometry; ``hkv`` must divide ``hq``.
        ffn: SwiGLU intermediate width of dense blocks.
        num_experts, top_k, expert_ffn: MoE block (``num_experts = 0`` -> dense MLP everywhere).
        rope_theta, rms_eps: rotary base and RMSNorm epsilon (Qwen3: 1e6, 1e-6).

    Raises:
        ValueError: non-positive sizes, ``hkv`` not dividing ``hq``, odd ``head_dim`` (rotary pairs),
            or ``top_k`` outside ``[1, num_experts]`` when MoE is on.
    """

    vocab_size: int = 256
    hidden: int = 64
    layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    num_experts: int = 0
    top_k: int = 2
    expert_ffn: int = 32
    rope_theta: float = 1e6
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "layers", "num_q_heads", "num_kv_heads", "head_dim", "ffn",
                     "top_k", "expert_ffn"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts must be an integer >= 0, got {self.num_experts!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_q_heads={self.num_q_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if not self.rope_theta > 0 or not self.rms_eps > 0:
            raise ValueError(f"rope_theta={self.rope_theta} and rms_eps={self.rms_eps} must be > 0")

    @property
    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.num_q_heads, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim, computed in float32 or wider."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x if dtype == torch.float64 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def packed_position_ids(sample_lengths) -> torch.Tensor:
    """int64 ``(S,)`` positions restarting at 0 at each sample of a packed sequence."""
    lengths = torch.as_tensor(list(sample_lengths), dtype=torch.long)
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return torch.arange(int(lengths.sum())) - starts


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Apply rotary embeddings (half-split layout, as Qwen3/HF) to ``x (T, heads, d)``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(x.dtype)[:, None, :]
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class Attention(nn.Module):
    """QKV projections, per-head Q/K RMSNorm, rotary, pluggable core attention, output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, hq * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, hkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, cfg.hidden, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_eps)
        self.k_norm = RMSNorm(d, cfg.rms_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: CoreAttention) -> torch.Tensor:
        t = x.shape[0]
        c = self.cfg
        q = self.q_norm(self.q_proj(x).view(t, c.num_q_heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, c.num_kv_heads, c.head_dim))
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        q, k = rotary(q, positions, c.rope_theta), rotary(k, positions, c.rope_theta)
        o = attn(q.contiguous(), k.contiguous(), v.contiguous())
        return self.o_proj(o.reshape(t, c.num_q_heads * c.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with softmax router and renormalised top-k weights (Qwen3-MoE).

    Token-local, so it needs no communication in this small model (expert parallelism is modelled
    only in :mod:`libra.sim.e2e`).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden, cfg.expert_ffn) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)
        weight, idx = torch.topk(probs, self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if len(tok):
                out = out.index_add(0, tok, expert(x[tok]) * weight[tok, slot, None])
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.mlp = MoE(cfg) if cfg.num_experts else SwiGLU(cfg.hidden, cfg.ffn)

    def forward(self, x, positions, attn):
        x = x + self.attn(self.attn_norm(x), positions, attn)
        return x + self.mlp(self.mlp_norm(x))


class Qwen3Small(nn.Module):
    """Decoder-only LM over one (local slice of a) packed sequence; mbs = 1, no batch axis.

    ``forward(input_ids (T,), position_ids (T,), attn) -> logits (T, vocab)``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def reset_parameters(self, seed: int) -> None:
        """Deterministic init from ``seed`` (normal(0, 0.02) weights, unit norms), any world size."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.02)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn: CoreAttention) -> torch.Tensor:
        if input_ids.shape != position_ids.shape or input_ids.dim() != 1:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} "
                             "must be equal 1-D shapes (T,)")
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids, attn)
        return self.lm_head(self.norm(x))


def reference_attention(sample_lengths) -> CoreAttention:
    """Single-process varlen causal attention over a whole packed sequence (block-diagonal mask).

    Returns ``attn(q (S, hq, d), k (S, hkv, d), v) -> o (S, hq, d)``; each sample attends causally
    to itself only. Uses 4-D SDPA per sample (3-D inputs take a much slower CPU path).
    """
    lengths = [int(n) for n in sample_lengths]

    def attn(q, k, v):
        if q.shape[0] != sum(lengths):
            raise ValueError(f"reference attention got {q.shape[0]} tokens, sample lengths sum to {sum(lengths)}")
        outs, start = [], 0
        for n in lengths:
            qs, ks, vs = (t[start:start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            outs.append(o.squeeze(0).transpose(0, 1))
            start += n
        return torch.cat(outs, 0)

    return attn
