"""Attention formulas (libra/workload.py) against brute-force counts over a dense mask."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.workload import (
    AttentionShape,
    attention_flops,
    causal_area,
    kv_bytes,
    kv_heads_for_shards,
    o_bytes,
    packed_flops,
    packed_workload,
    packed_workloads,
    q_bytes,
    range_area,
    range_areas,
    sample_area,
    sample_flops,
)


def dense_mask(lengths) -> np.ndarray:
    """Block-diagonal causal mask of a packed sequence: True where query i attends key j."""
    total = int(sum(lengths))
    seg = np.repeat(np.arange(len(lengths)), lengths)
    i, j = np.meshgrid(np.arange(total), np.arange(total), indexing="ij")
    return (seg[i] == seg[j]) & (j <= i)


lengths_st = st.lists(st.integers(1, 12), min_size=1, max_size=6)


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_st, data=st.data())
def test_range_area_matches_dense_mask(lengths, data):
    mask = dense_mask(lengths)
    total = mask.shape[0]
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    a = data.draw(st.integers(0, total))
    b = data.draw(st.integers(a, total))
    assert range_area(offsets, a, b) == int(mask[a:b].sum())
    starts = np.array([a, 0, b])
    ends = np.array([b, total, b])
    assert range_areas(offsets, starts, ends).tolist() == [int(mask[a:b].sum()), int(mask.sum()), 0]


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, hq_mult=st.integers(1, 4), hkv=st.sampled_from([1, 2, 4]), d=st.sampled_from([1, 8, 64]))
def test_flops_match_dense_count(lengths, hq_mult, hkv, d):
    shape = AttentionShape(num_q_heads=hkv * hq_mult, num_kv_heads=hkv, head_dim=d)
    pairs = int(dense_mask(lengths).sum())
    assert sum(sample_area(np.array(lengths)).tolist()) == pairs
    # two matmuls (QK^T and PV), 2 FLOPs per multiply-add, every (pair, head, dim)
    expected = 4 * pairs * shape.num_q_heads * d
    assert packed_flops(lengths, shape) == expected
    assert packed_flops(lengths, shape, backward=True) == 2.5 * expected
    assert attention_flops(pairs, shape.num_q_heads, d) == expected


def test_causal_area_rows():
    # rows [a, b) of one sample attend 1 + 2 + ... : brute force for all small ranges
    for b in range(8):
        for a in range(b + 1):
            assert causal_area(a, b) == sum(i + 1 for i in range(a, b))
    assert causal_area(np.array([0, 2]), np.array([3, 4])).tolist() == [6, 7]
    with pytest.raises(ValueError, match="0 <= a <= b"):
        causal_area(3, 2)
    with pytest.raises(ValueError, match="0 <= a <= b"):
        causal_area(-1, 2)


def test_packed_workload_proxy():
    assert packed_workload([3, 4]) == 25.0
    assert packed_workloads([[1, 2], [3]]).tolist() == [5.0, 9.0]
    assert sample_flops(4, AttentionShape(2, 1, 8)) == 4 * 10 * 2 * 8


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 1000), hkv=st.sampled_from([1, 2, 4, 8]), mult=st.sampled_from([1, 2, 4]),
       d=st.sampled_from([64, 128]), dtype_bytes=st.sampled_from([2, 4]))
def test_bytes_dtype_and_gqa(tokens, hkv, mult, d, dtype_bytes):
    shape = AttentionShape(num_q_heads=hkv * mult, num_kv_heads=hkv, head_dim=d, dtype_bytes=dtype_bytes)
    q = np.zeros((tokens, shape.num_q_heads, d), dtype=np.float16 if dtype_bytes == 2 else np.float32)
    assert q_bytes(tokens, shape.num_q_heads, d, dtype_bytes) == q.nbytes
    assert o_bytes(tokens, shape.num_q_heads, d, dtype_bytes) == q.nbytes
    k = np.zeros((tokens, hkv, d), dtype=q.dtype)
    assert kv_bytes(tokens, hkv, d, dtype_bytes) == 2 * k.nbytes
    # a head shard of hq/H query heads reads exactly the KV heads its query heads map to (q // (hq/hkv))
    for split in [h for h in (1, 2, 4, 8, 16) if shape.num_q_heads % h == 0]:
        width = shape.num_q_heads // split
        needed = {q_head // shape.group_size for q_head in range(width)}
        assert kv_heads_for_shards(shape, split) == len(needed)


def test_gqa_replicated_kv_when_split_exceeds_kv_heads():
    shape = AttentionShape(num_q_heads=32, num_kv_heads=4, head_dim=128)
    assert shape.kv_head_range(0, 8) == (0, 1)
    assert shape.kv_head_range(4, 12) == (0, 2)
    assert kv_heads_for_shards(shape, 2) == 2
    assert kv_heads_for_shards(shape, 8) == 1  # H > hkv: each of 8 shards needs a replicated KV head


@pytest.mark.parametrize("kwargs, match", [
    ({"num_q_heads": 0}, "num_q_heads must be a positive integer, got 0"),
    ({"num_kv_heads": -1}, "num_kv_heads must be a positive integer"),
    ({"head_dim": 1.5}, "head_dim must be a positive integer, got 1.5"),
    ({"num_q_heads": 6, "num_kv_heads": 4}, "num_kv_heads=4 must divide num_q_heads=6"),
])
def test_attention_shape_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionShape(**kwargs)


def test_range_bad_input_and_split_check():
    offsets = np.array([0, 3, 5])
    with pytest.raises(ValueError, match=r"query range \[2, 6\) outside packed sequence of 5 tokens"):
        range_area(offsets, 2, 6)
    with pytest.raises(ValueError, match="head split H=3 must divide num_q_heads=32"):
        kv_heads_for_shards(AttentionShape(), 3)
