"""Attention workload model: FLOPs and bytes of samples, packed sequences and tiles.

This module is the only home of the attention formulas (DESIGN.md sec. 4). Every other part of
Libra-bench (VRSP, TAP, the baselines, the simulator, the runtime's buffer sizing) calls these
functions instead of restating them.

Conventions
-----------
* A *sample* of length ``l`` occupies token positions ``0 .. l-1`` of its own causal mask.
* The causal *area* of query rows ``[a, b)`` of a sample is the number of (query, key) pairs
  those rows attend to: ``sum_{i=a}^{b-1} (i + 1) = (b(b+1) - a(a+1)) / 2`` (Libra sec. 3.1).
* Forward FLOPs = ``4 * area * heads * head_dim`` (two matmuls, 2 FLOPs per multiply-add);
  backward FLOPs = ``2.5 x`` forward (FlashAttention-2's accounting, which recomputes P).
* Bytes use the element size of ``dtype_bytes`` (bf16 = 2). A Q or O slice is
  ``tokens * heads * head_dim * dtype_bytes``; a KV fetch carries K and V:
  ``kv_tokens * kv_heads * head_dim * dtype_bytes * 2``.
* GQA: query head ``q`` reads KV head ``q // (hq / hkv)``.

All functions accept Python ints or numpy arrays (vectorised element-wise) and never import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BACKWARD_FLOPS_FACTOR = 2.5
"""Backward / forward FLOPs ratio of FlashAttention-style attention (recomputes the scores)."""

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4,
               "fp64": 8, "float64": 8}


@dataclass(frozen=True)
class AttentionShape:
    """Head geometry of one attention layer.

    Attributes:
        num_q_heads: query heads ``hq``.
        num_kv_heads: key/value heads ``hkv``; must divide ``hq`` (GQA groups are contiguous).
        head_dim: per-head width ``d``.
        dtype_bytes: element size of Q/K/V/O on the wire (2 for bf16).

    Raises:
        ValueError: non-positive sizes or ``hkv`` not dividing ``hq``.
    """

    num_q_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"AttentionShape.{name} must be a positive integer, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_q_heads={self.num_q_heads} (GQA)"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (``hq / hkv``)."""
        return self.num_q_heads // self.num_kv_heads

    def kv_head_range(self, q_head_start, q_head_end):
        """KV heads ``[start, end)`` read by query heads ``[q_head_start, q_head_end)`` (GQA).

        Ints give an ``(int, int)`` pair; arrays give two int64 arrays (element-wise).
        """
        g = self.group_size
        if np.ndim(q_head_start) or np.ndim(q_head_end):
            hs = np.asarray(q_head_start, dtype=np.int64)
            he = np.asarray(q_head_end, dtype=np.int64)
            return hs // g, -(-he // g)
        return int(q_head_start) // g, -(-int(q_head_end) // g)


def kv_heads_per_call(heads: int, group: int) -> int:
    """KV heads a call of ``heads`` contiguous, group-aligned query heads reads (GQA group ``group``).

    Raises:
        ValueError: ``heads`` neither a multiple nor a divisor of ``group`` (such a head range
            would straddle GQA groups unevenly, which no tile layout produces).
    """
    if heads < 1 or group < 1:
        raise ValueError(f"heads per call and GQA group must be >= 1, got heads={heads}, group={group}")
    if heads % group == 0:
        return heads // group
    if group % heads == 0:
        return 1
    raise ValueError(f"{heads} query heads per call neither divide nor are a multiple of the GQA group {group}")


# --------------------------------------------------------------------------------------------
# areas and FLOPs
# --------------------------------------------------------------------------------------------


def causal_area(a, b):
    """Causal (query, key) pairs of query rows ``[a, b)`` of one sample: ``(b(b+1) - a(a+1)) / 2``.

    Args:
        a, b: row offsets inside the sample (``0 <= a <= b``); ints or integer arrays.

    Returns:
        The area as int (scalar inputs) or int64 array. Exact: no floating point involved.
    """
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    if np.any(a < 0) or np.any(b < a):
        raise ValueError("causal_area needs 0 <= a <= b")
    out = (b * (b + 1) - a * (a + 1)) // 2
    return int(out) if out.ndim == 0 else out


def sample_area(lengths):
    """Full causal area of whole samples: ``l (l + 1) / 2`` each."""
    return causal_area(0, lengths)


def attention_flops(area, heads: int, head_dim: int, backward: bool = False):
    """FLOPs of ``area`` causal pairs over ``heads`` heads of width ``head_dim``.

    Forward is ``4 * area * heads * head_dim``; ``backward=True`` returns the backward FLOPs
    (``2.5x`` forward). Returned as float (or float64 array) since values exceed 2**53 rarely
    but do overflow int64 for million-token packs with many heads.
    """
    flops = 4.0 * np.asarray(area, dtype=np.float64) * heads * head_dim
    if backward:
        flops = flops * BACKWARD_FLOPS_FACTOR
    return float(flops) if np.ndim(flops) == 0 else flops


def sample_flops(lengths, shape: AttentionShape, backward: bool = False):
    """Forward (or backward) FLOPs of whole samples with all query heads of ``shape``."""
    return attention_flops(sample_area(lengths), shape.num_q_heads, shape.head_dim, backward)


def packed_workload(sample_lengths) -> float:
    """Workload proxy of one packed sequence, ``w(S) = sum_j l_j^2`` (Libra sec. 3.1).

    This is what VRSP and the grouping strategies balance; it is proportional to attention
    FLOPs up to the linear ``l`` term, which the paper drops.
    """
    lengths = np.asarray(sample_lengths, dtype=np.float64)
    return float(np.dot(lengths, lengths))


def packed_workloads(packed_lengths) -> np.ndarray:
    """``w(S)`` for many packed sequences (a sequence of length arrays) as a float64 array."""
    return np.array([packed_workload(p) for p in packed_lengths], dtype=np.float64)


def packed_flops(sample_lengths, shape: AttentionShape, backward: bool = False) -> float:
    """Exact forward (or backward) FLOPs of one packed sequence (block-diagonal causal mask)."""
    return float(np.sum(sample_flops(np.asarray(sample_lengths, dtype=np.int64), shape, backward)))


def range_area(sample_offsets, q_start: int, q_end: int) -> int:
    """Causal area of packed-sequence query rows ``[q_start, q_end)`` under a block-diagonal mask.

    Args:
        sample_offsets: int array ``[0, l_0, l_0 + l_1, ..., S]`` (cumulative sample starts).
        q_start, q_end: token range inside the packed sequence.

    Returns:
        Sum over the samples the range touches of the area of the rows it covers in each.
    """
    offs = np.asarray(sample_offsets, dtype=np.int64)
    if not 0 <= q_start <= q_end <= offs[-1]:
        raise ValueError(f"query range [{q_start}, {q_end}) outside packed sequence of {offs[-1]} tokens")
    first = int(np.searchsorted(offs, q_start, side="right")) - 1
    last = int(np.searchsorted(offs, q_end, side="left"))
    starts = offs[first:last]
    a = np.maximum(q_start, starts) - starts
    b = np.minimum(q_end, offs[first + 1:last + 1]) - starts
    return int(np.sum(causal_area(a, np.maximum(a, b))))


def range_areas(sample_offsets, q_starts, q_ends) -> np.ndarray:
    """Vectorised :func:`range_area` for many ranges of one packed sequence.

    Uses the prefix sum of per-token areas: row ``i`` at offset ``k`` inside its sample attends
    ``k + 1`` keys, so ``area([a, b)) = C(b) - C(a)`` with ``C`` the cumulative per-token area.
    ``C`` is evaluated in closed form per sample, so cost is O(ranges * log samples).
    """
    offs = np.asarray(sample_offsets, dtype=np.int64)
    cum_full = np.concatenate(([0], np.cumsum(sample_area(np.diff(offs)))))

    def cumulative(x):
        x = np.asarray(x, dtype=np.int64)
        idx = np.clip(np.searchsorted(offs, x, side="right") - 1, 0, len(offs) - 2)
        k = x - offs[idx]
        return cum_full[idx] + k * (k + 1) // 2

    return cumulative(q_ends) - cumulative(q_starts)


# --------------------------------------------------------------------------------------------
# bytes
# --------------------------------------------------------------------------------------------


def q_bytes(tokens, heads: int, head_dim: int, dtype_bytes: int = 2):
    """Bytes of a Q (or O, dO, dQ) slice: ``tokens * heads * head_dim * dtype_bytes``."""
    out = np.asarray(tokens, dtype=np.int64) * heads * head_dim * dtype_bytes
    return int(out) if out.ndim == 0 else out


o_bytes = q_bytes
"""Output slices have the same geometry as query slices."""


def kv_bytes(kv_tokens, kv_heads: int, head_dim: int, dtype_bytes: int = 2):
    """Bytes of a K+V fetch: ``kv_tokens * kv_heads * head_dim * dtype_bytes * 2``."""
    out = np.asarray(kv_tokens, dtype=np.int64) * kv_heads * head_dim * dtype_bytes * 2
    return int(out) if out.ndim == 0 else out


def kv_heads_for_shards(shape: AttentionShape, head_split: int) -> int:
    """KV heads one head shard of ``hq / H`` query heads reads (replicated when ``H > hkv``)."""
    if shape.num_q_heads % head_split:
        raise ValueError(f"head split H={head_split} must divide num_q_heads={shape.num_q_heads}")
    lo, hi = shape.kv_head_range(0, shape.num_q_heads // head_split)
    return hi - lo
