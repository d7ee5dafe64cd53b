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

from libra.plan import SequenceLayout, TileTable
from libra.workload import AttentionShape, attention_flops, range_areas


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def make_tiles(sequences: Sequence[SequenceLayout], block_size: int, head_split: int,
               shape: AttentionShape) -> TileTable:
    """Decompose every packed sequence into SH-tiles (Libra sec. 4.3.1); all unplaced.

    Block ``b`` of a sequence covers tokens ``[b*B, min((b+1)*B, S))``; each block is split into
    ``H`` head shards of ``hq / H`` query heads. Rows are ordered by (sequence, block, shard), so a
    tile's index is a stable tie-breaker for placement.

    Args:
        sequences: the pool's packed sequences with their pre-attention layout.
        block_size: ``B`` tokens per block.
        head_split: ``H`` head shards per block.
        shape: attention head geometry (FLOPs come from :mod:`libra.workload`).

    Returns:
        A :class:`TileTable` of ``sum_s ceil(S_s / B) * H`` rows with ``dest = -1``.

    Raises:
        ValueError: non-positive ``B`` or ``H``, ``H`` not dividing ``hq``, or a block that crosses a
            holder range (``B`` must divide ``S / CP`` in the standard layout), naming the block.
    """
    _check_positive("block size B", block_size)
    _check_positive("head split H", head_split)
    if shape.num_q_heads % head_split:
        raise ValueError(f"head split H={head_split} must divide num_q_heads={shape.num_q_heads}")
    width = shape.num_q_heads // head_split
    cols = {k: [] for k in ("seq", "q_start", "q_end", "head_start", "q_home", "flops")}
    for s_idx, seq in enumerate(sequences):
        total = seq.num_tokens
        starts = np.arange(0, total, block_size, dtype=np.int64)
        ends = np.minimum(starts + block_size, total)
        order = np.argsort(seq.holder_start, kind="stable")
        h_start, h_end = seq.holder_start[order], seq.holder_end[order]
        pos = np.searchsorted(h_start, starts, side="right") - 1
        bad = np.nonzero((pos < 0) | (ends > h_end[np.maximum(pos, 0)]))[0]
        if len(bad):
            b = int(bad[0])
            raise ValueError(
                f"block {b} [{starts[b]}, {ends[b]}) of sequence {s_idx} (seq_id {seq.seq_id}) crosses a "
                f"holder range: block size B={block_size} must divide the per-worker token range "
                f"(S/CP in the standard layout)")
        home = seq.holder_worker[order][pos]
        # one formula, one place: per-head forward FLOPs of each block from libra.workload
        block_flops = attention_flops(range_areas(seq.sample_offsets, starts, ends), width, shape.head_dim)
        n = len(starts)
        cols["seq"].append(np.full(n * head_split, s_idx, dtype=np.int32))
        cols["q_start"].append(np.repeat(starts, head_split))
        cols["q_end"].append(np.repeat(ends, head_split))
        cols["head_start"].append(np.tile(np.arange(head_split, dtype=np.int32) * width, n))
        cols["q_home"].append(np.repeat(home, head_split))
        cols["flops"].append(np.repeat(np.asarray(block_flops, dtype=np.float64), head_split))
    if not cols["seq"]:
        return TileTable.empty()
    out = {k: np.concatenate(v) for k, v in cols.items()}
    return TileTable(seq=out["seq"], q_start=out["q_start"], q_end=out["q_end"],
                     head_start=out["head_start"], head_end=out["head_start"] + width,
                     q_home=out["q_home"], dest=np.full(len(out["seq"]), -1, dtype=np.int32),
                     flops=out["flops"])


def kv_need_start(sequences: Sequence[SequenceLayout], tiles: TileTable) -> np.ndarray:
    """Start of each tile's KV interval: the first token of the sample containing ``q_start``.

    A tile with rows ``[q_start, q_end)`` needs K/V tokens ``[kv_need_start, q_end)`` (the union of
    the causal prefixes of every sample it touches). Returns an int64 ``(T,)`` array.
    """
    out = np.zeros(len(tiles), dtype=np.int64)
    for s_idx, seq in enumerate(sequences):
        rows = np.nonzero(tiles.seq == s_idx)[0]
        if len(rows):
            offs = seq.sample_offsets
            out[rows] = offs[np.searchsorted(offs, tiles.q_start[rows], side="right") - 1]
    return out


def kv_head_ranges(shape: AttentionShape, head_start, head_end) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised GQA map: KV heads ``[kv_start, kv_end)`` read by query heads ``[head_start, head_end)``."""
    g = shape.group_size
    hs = np.asarray(head_start, dtype=np.int64)
    he = np.asarray(head_end, dtype=np.int64)
    return hs // g, -(-he // g)


def kv_atoms(shape: AttentionShape, head_start, head_end) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """KV atoms of a set of query-head ranges and the atom span of each range.

    Returns:
        ``bounds`` (A+1,) sorted KV-head boundaries (atom ``a`` = KV heads ``[bounds[a], bounds[a+1])``),
        and per range ``atom_start, atom_end`` (``(n,)`` each): the atoms its KV heads cover.
    """
    k0, k1 = kv_head_ranges(shape, head_start, head_end)
    bounds = np.unique(np.concatenate((k0, k1)))
    return bounds, np.searchsorted(bounds, k0), np.searchsorted(bounds, k1)
