"""SH-tiles and their KV needs (Libra sec. 4.3.1).

An SH-Tile is one sequence block of ``B`` tokens times one head shard of ``hq / H`` query heads of
one packed sequence. It is the unit TAP places. Its *Q-home* is the worker that holds the block's
tokens in the pre-attention layout; it supplies Q and receives the output.

KV groups. A tile reads, for every sample its rows touch, the causal prefix of that sample up to the
tile's last row in it (block-diagonal causal mask). Samples are contiguous, so the union of those
prefixes is one token interval ``[kv_start, q_end)`` with ``kv_start`` the start of the sample that
contains ``q_start``. The KV heads are ``shape.kv_head_range(head_start, head_end)`` (GQA). Distinct
head shards may read the same KV heads (``H > hkv``) or partly overlapping ones, so de-duplication
works on *KV atoms*: the finest KV-head ranges induced by all tiles' KV ranges (one atom per head
shard in the usual configurations).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# PoolIndex, pool_index and kv_need_start live with the layout they index; re-exported here
from libra.plan.layout import PoolIndex, SequenceLayout, kv_need_start, pool_index
from libra.plan.tables import TileTable
from libra.workload import AttentionShape, attention_flops, range_areas

__all__ = ["PoolIndex", "kv_atoms", "kv_need_start", "make_tiles", "pool_index"]


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def make_tiles(sequences: Sequence[SequenceLayout], block_size: int, head_split: int,
               shape: AttentionShape, index: PoolIndex | None = None) -> TileTable:
    """Decompose every packed sequence into SH-tiles (Libra sec. 4.3.1); all unplaced.

    Block ``b`` of a sequence covers tokens ``[b*B, min((b+1)*B, S))``; each block is split into
    ``H`` head shards of ``hq / H`` query heads. Rows are ordered by (sequence, block, shard), so a
    tile's index is a stable tie-breaker for placement.

    Args:
        sequences: the pool's packed sequences with their pre-attention layout.
        block_size: ``B`` tokens per block.
        head_split: ``H`` head shards per block.
        shape: attention head geometry (FLOPs come from :mod:`libra.workload`).
        index: the pool's :class:`PoolIndex` when the caller already built it.

    Returns:
        A :class:`TileTable` of ``sum_s ceil(S_s / B) * H`` rows with ``dest = -1``.

    Raises:
        ValueError: non-positive ``B`` or ``H``, ``H`` not dividing ``hq``, holder ranges that do not
            partition a sequence, or a block that crosses a holder range (``B`` must divide
            ``S / CP`` in the standard layout), naming the block.
    """
    _check_positive("block size B", block_size)
    _check_positive("head split H", head_split)
    if shape.num_q_heads % head_split:
        raise ValueError(f"head split H={head_split} must divide num_q_heads={shape.num_q_heads}")
    if not len(sequences):
        return TileTable.empty()
    width = shape.num_q_heads // head_split
    idx = index if index is not None else pool_index(sequences)
    lengths = np.diff(idx.base)
    n_blocks = -(-lengths // block_size)
    seq = np.repeat(np.arange(len(sequences)), n_blocks)
    local = np.arange(int(n_blocks.sum())) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)
    starts = local * block_size
    ends = np.minimum(starts + block_size, lengths[seq])
    g_start, g_end = starts + idx.base[seq], ends + idx.base[seq]
    pos = np.searchsorted(idx.h_start, g_start, side="right") - 1
    bad = np.nonzero(g_end > idx.h_end[pos])[0]
    if len(bad):
        b = int(bad[0])
        s_idx = int(seq[b])
        raise ValueError(
            f"block {int(local[b])} [{starts[b]}, {ends[b]}) of sequence {s_idx} (seq_id "
            f"{sequences[s_idx].seq_id}) crosses a holder range: block size B={block_size} must divide "
            f"the per-worker token range (S/CP in the standard layout)")
    # one formula, one place: forward FLOPs of each block from libra.workload (global offsets work
    # because sequence boundaries are sample boundaries and no block crosses one)
    flops = attention_flops(range_areas(idx.offs, g_start, g_end), width, shape.head_dim)
    n = len(starts) * head_split
    head_start = np.tile(np.arange(head_split, dtype=np.int32) * width, len(starts))
    return TileTable(seq=np.repeat(seq, head_split), q_start=np.repeat(starts, head_split),
                     q_end=np.repeat(ends, head_split), head_start=head_start, head_end=head_start + width,
                     q_home=np.repeat(idx.h_worker[pos], head_split), dest=np.full(n, -1, dtype=np.int32),
                     flops=np.repeat(np.asarray(flops, dtype=np.float64), head_split))


def kv_atoms(shape: AttentionShape, head_start, head_end) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """KV atoms of a set of query-head ranges and the atom span of each range.

    Returns:
        ``bounds`` (A+1,) sorted KV-head boundaries (atom ``a`` = KV heads ``[bounds[a], bounds[a+1])``),
        and per range ``atom_start, atom_end`` (``(n,)`` each): the atoms its KV heads cover.
    """
    k0, k1 = shape.kv_head_range(np.asarray(head_start), np.asarray(head_end))
    # KV head indices are small (<= hkv): a bincount finds the distinct boundaries in O(n)
    bounds = np.flatnonzero(np.bincount(np.concatenate((k0, k1)), minlength=1))
    return bounds, np.searchsorted(bounds, k0), np.searchsorted(bounds, k1)
