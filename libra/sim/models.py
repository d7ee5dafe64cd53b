"""Transformer shapes of the models the end-to-end experiments simulate (Libra sec. 6.1, Table 1).

Shapes are data, not code: the three public Qwen3 configurations of DESIGN.md sec. 5 (hidden size,
layers, query/KV heads, head_dim, dense FFN or routed experts). Per-token linear FLOPs and parameter
counts are derived here because they depend only on the shape; *attention* FLOPs and bytes are not
computed here -- they come from :mod:`libra.workload` through the Plan cost model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from libra.workload import AttentionShape


@dataclass(frozen=True)
class ModelShape:
    """One decoder-only model.

    Attributes:
        name: registry key (``qwen3-8b`` ...).
        hidden, layers, num_q_heads, num_kv_heads, head_dim: transformer geometry.
        ffn: dense SwiGLU width (0 for MoE models).
        num_experts, top_k, expert_ffn: routed SwiGLU experts (0 experts = dense).
        vocab_size: embedding / LM-head rows.

    Raises:
        ValueError: non-positive sizes, ``hkv`` not dividing ``hq``, a model with neither a dense
            FFN nor experts, or ``top_k`` outside ``[1, num_experts]``.
    """

    name: str
    hidden: int
    layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    vocab_size: int = 151936

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "num_q_heads", "num_kv_heads", "head_dim", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape.{name} must be a positive integer, got {v!r}")
        for name in ("ffn", "num_experts", "top_k", "expert_ffn"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ModelShape.{name} must be an integer >= 0, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_q_heads={self.num_q_heads}")
        if not self.ffn and not self.num_experts:
            raise ValueError(f"model {self.name!r} needs a dense ffn or routed experts")
        if self.num_experts and not (1 <= self.top_k <= self.num_experts and self.expert_ffn > 0):
            raise ValueError(f"model {self.name!r}: top_k={self.top_k} must be in [1, {self.num_experts}] "
                             f"and expert_ffn={self.expert_ffn} > 0")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_shape(self) -> AttentionShape:
        """Head geometry the Plan cost model prices (bf16 on the wire)."""
        return AttentionShape(self.num_q_heads, self.num_kv_heads, self.head_dim, 2)

    # -- per layer, per token -----------------------------------------------------------
    @property
    def attn_proj_params(self) -> int:
        """Q, K, V and output projection weights of one layer."""
        q = self.num_q_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden

    @property
    def mlp_params(self) -> int:
        """Dense SwiGLU weights, or all experts' weights plus the router, of one layer."""
        if self.is_moe:
            return self.num_experts * 3 * self.hidden * self.expert_ffn + self.hidden * self.num_experts
        return 3 * self.hidden * self.ffn

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token of one layer outside core attention (2 per multiply-add).

        Attention projections, plus the dense MLP or the ``top_k`` activated experts and the router.
        """
        mlp = (self.top_k * 3 * self.hidden * self.expert_ffn + self.hidden * self.num_experts
               if self.is_moe else 3 * self.hidden * self.ffn)
        return 2.0 * (self.attn_proj_params + mlp)

    def head_flops_per_token(self) -> float:
        """Forward FLOPs per token of the LM head (last pipeline stage)."""
        return 2.0 * self.hidden * self.vocab_size

    def moe_dispatch_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes one token sends in one MoE all-to-all (``top_k`` copies of its hidden state)."""
        return self.top_k * self.hidden * dtype_bytes if self.is_moe else 0

    def to_dict(self) -> dict:
        return asdict(self)


MODELS: dict[str, ModelShape] = {
    m.name: m for m in (
        ModelShape("qwen3-8b", hidden=4096, layers=36, num_q_heads=32, num_kv_heads=8, head_dim=128,
                   ffn=12288),
        ModelShape("qwen3-30b-a3b", hidden=2048, layers=48, num_q_heads=32, num_kv_heads=4, head_dim=128,
                   num_experts=128, top_k=8, expert_ffn=768),
        ModelShape("qwen3-235b-a22b", hidden=4096, layers=94, num_q_heads=64, num_kv_heads=4, head_dim=128,
                   num_experts=128, top_k=8, expert_ffn=1536),
    )
}
"""Public Qwen3 configurations (DESIGN.md sec. 5)."""


def get_model(name: str) -> ModelShape:
    """Look up a model shape by name.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name]
