"""Small Qwen3-style model: packed positions, block-diagonal causality, GQA reference, MoE, errors."""

from __future__ import annotations

import pytest
import torch

from experiments.measured.training.model import (
    ModelConfig,
    Qwen3Small,
    packed_position_ids,
    reference_attention,
)


def _dense_reference(q, k, v, lengths):
    """Explicit block-diagonal causal softmax attention with GQA (float64)."""
    s = q.shape[0]
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(s)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def test_packed_positions_restart_per_sample():
    assert packed_position_ids([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]


def test_reference_attention_matches_dense_block_diagonal_gqa():
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    q = torch.randn(18, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 18, 2, 8, dtype=torch.float64)
    out = reference_attention(lengths)(q, k, v)
    torch.testing.assert_close(out, _dense_reference(q, k, v, lengths), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="got 17 tokens"):
        reference_attention(lengths)(q[:17], k[:17], v[:17])


@pytest.mark.parametrize("experts", [0, 4])
def test_model_is_causal_within_samples_and_blind_across_them(experts):
    cfg = ModelConfig(layers=2, num_experts=experts, top_k=2)
    model = Qwen3Small(cfg).double()
    model.reset_parameters(1)
    lengths = [6, 10]
    ids = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(0))
    pos = packed_position_ids(lengths)
    attn = reference_attention(lengths)
    base = model(ids, pos, attn)
    assert base.shape == (16, cfg.vocab_size)
    # changing a later token of sample 1 leaves earlier tokens and all of sample 0 unchanged
    ids2 = ids.clone()
    ids2[12] = (ids2[12] + 1) % cfg.vocab_size
    out2 = model(ids2, pos, attn)
    torch.testing.assert_close(out2[:12], base[:12], rtol=0, atol=1e-12)
    assert (out2[12:] - base[12:]).abs().max() > 1e-6
    # a sample's logits do not depend on where in the pack it sits (positions restart)
    swapped = model(torch.cat((ids[6:], ids[:6])), packed_position_ids([10, 6]), reference_attention([10, 6]))
    torch.testing.assert_close(swapped[:10], base[6:], rtol=1e-9, atol=1e-9)


def test_deterministic_init_independent_of_global_rng():
    a, b = Qwen3Small(ModelConfig()), Qwen3Small(ModelConfig())
    torch.manual_seed(123)
    a.reset_parameters(7)
    torch.manual_seed(456)
    b.reset_parameters(7)
    for (n, p), (_, r) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, r), n


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_q_heads=4, num_kv_heads=3), "num_kv_heads=3 must divide num_q_heads=4"),
    (dict(head_dim=15), "head_dim=15 must be even"),
    (dict(num_experts=2, top_k=3), "top_k=3 must be in"),
    (dict(hidden=0), "hidden must be a positive integer, got 0"),
])
def test_bad_model_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_mismatched_inputs_raise():
    model = Qwen3Small(ModelConfig())
    with pytest.raises(ValueError, match="must be equal 1-D shapes"):
        model(torch.zeros(4, dtype=torch.long), torch.zeros(5, dtype=torch.long), reference_attention([4]))
