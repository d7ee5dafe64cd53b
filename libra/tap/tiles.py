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

:func:`make_tiles` runs the compiled kernel :mod:`libra.jit.tiles` when numba imports and the
numpy implementation otherwise; both build the same table (the tests compare them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from libra import jit as jit_modules

# PoolIndex, pool_index and kv_need_start live with the layout they index; re-exported here
from libra.plan.layout import PoolIndex, SequenceLayout, kv_need_start, pool_index
from libra.plan.tables import TileTable
from libra.workload import AttentionShape, attention_flops

__all__ = ["PoolIndex", "kv_atoms", "kv_need_start", "make_tiles", "pool_index", "tiles_impl", "warmup"]


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def tiles_impl() -> str:
    """The implementation ``make_tiles(impl="auto")`` runs here: ``"numba"`` or ``"numpy"``."""
    return jit_modules.impl_name("tiles")


def warmup() -> float:
    """Compile the tile kernel now (numba only; once per process) on a one-sequence pool so that
    timed calls exclude compilation; returns the seconds spent (0.0 without numba)."""
    if jit_modules.compiled("tiles") is None:
        return 0.0
    t0 = time.perf_counter()
    make_tiles([SequenceLayout.contiguous(0, 0, [3, 1], 2)], 2, 1, AttentionShape(1, 1, 1, 2), impl="numba")
    return time.perf_counter() - t0


class PoolTiles(TileTable):
    """The SH-tiles :func:`make_tiles` made for one pool, or token pieces of them, with the pool's
    sequences and :class:`~libra.plan.layout.PoolIndex` they were made from.

    Each tile lies inside one holder range of its Q-home by construction, so placement
    (:func:`libra.tap.placement.place_tiles`) skips its per-tile checks for a PoolTiles
    :meth:`made_for` the sequences it places on, and reuses the index. Any other TileTable is
    checked tile by tile.
    """

    def __init__(self, sequences: Sequence[SequenceLayout], index: PoolIndex, **columns):
        super().__init__(**columns)
        self.__dict__["sequences"] = tuple(sequences)
        self.__dict__["index"] = index

    def made_for(self, sequences: Sequence[SequenceLayout]) -> bool:
        """Whether these tiles were made for exactly ``sequences`` (the same layout objects)."""
        sequences = tuple(sequences)
        return len(sequences) == len(self.sequences) and all(a is b for a, b in zip(sequences, self.sequences))

    def pieces(self, **columns) -> PoolTiles:
        """Tiles cut from these (each a token range of one of them, same Q-home and heads): the
        same pool, so still a PoolTiles."""
        return PoolTiles(self.sequences, self.index, **columns)

    def select(self, mask_or_index) -> PoolTiles:
        return self.pieces(**{k: getattr(self, k)[mask_or_index] for k in self.FIELDS})


def make_tiles(sequences: Sequence[SequenceLayout], block_size: int, head_split: int,
               shape: AttentionShape, index: PoolIndex | None = None, *, impl: str = "auto") -> PoolTiles:
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
        impl: ``"auto"`` (the compiled kernel when numba imports, :func:`tiles_impl`), ``"numba"``
            or ``"numpy"``; both give the same table.

    Returns:
        A :class:`PoolTiles` of ``sum_s ceil(S_s / B) * H`` rows with ``dest = -1``.

    Raises:
        ValueError: non-positive ``B`` or ``H``, ``H`` not dividing ``hq``, holder ranges that do not
            partition a sequence, or a block that crosses a holder range (``B`` must divide
            ``S / CP`` in the standard layout), naming the block; or an unknown ``impl``.
        ImportError: ``impl="numba"`` without numba (``pip install -e '.[fast]'``).
    """
    if impl not in ("auto", "numba", "numpy"):
        raise ValueError(f"impl must be 'auto', 'numba' or 'numpy', got {impl!r}")
    jit = jit_modules.select("tiles", impl)
    _check_positive("block size B", block_size)
    _check_positive("head split H", head_split)
    if shape.num_q_heads % head_split:
        raise ValueError(f"head split H={head_split} must divide num_q_heads={shape.num_q_heads}")
    sequences = tuple(sequences)
    idx = index if index is not None else pool_index(sequences)
    if not len(sequences):
        return PoolTiles(sequences, idx, **{k: np.zeros(0, v) for k, v in TileTable.FIELDS.items()})
    width = shape.num_q_heads // head_split
    if jit is not None:
        bad, seq, q_start, q_end, head_start, head_end, q_home, dest, area = jit.tile_rows(
            idx.base, idx.offs, idx.h_start, idx.h_end, idx.h_worker, block_size, head_split, width)
        if bad < 0:  # else the numpy path names the offending block
            return PoolTiles(sequences, idx, seq=seq, q_start=q_start, q_end=q_end, head_start=head_start,
                             head_end=head_end,
                             q_home=q_home, dest=dest, flops=attention_flops(area, width, shape.head_dim))
    return _tiles_numpy(sequences, block_size, head_split, width, shape, idx)


def _tiles_numpy(sequences, block_size: int, head_split: int, width: int, shape: AttentionShape,
                 idx: PoolIndex) -> PoolTiles:
    """:func:`make_tiles` with numpy (after its argument checks)."""
    base = idx.base
    lengths = base[1:] - base[:-1]
    n_blocks = (lengths + (block_size - 1)) // block_size
    seq = np.arange(len(sequences), dtype=np.int32).repeat(n_blocks)
    g_base = base[:-1].repeat(n_blocks)
    # global block bounds: blocks partition every sequence and sequences lie end to end, so block i
    # spans [bounds[i], bounds[i+1]); its start inside its sequence is bounds[i] - g_base[i]
    if not (lengths % block_size).any():  # every sequence a whole number of blocks
        bounds = np.arange(0, int(base[-1]) + 1, block_size, dtype=np.int64)
    else:
        bounds = np.empty(len(seq) + 1, dtype=np.int64)
        bounds[-1] = base[-1]
        local = np.arange(len(seq)) - (np.cumsum(n_blocks) - n_blocks).repeat(n_blocks)
        np.add(local * block_size, g_base, out=bounds[:-1])
    g_start, g_end = bounds[:-1], bounds[1:]
    pos = idx.h_start.searchsorted(g_start, side="right") - 1
    if (g_end > idx.h_end[pos]).any():
        _raise_crossing(sequences, seq, g_start - g_base, g_end - g_base, g_end > idx.h_end[pos], block_size)
    # one formula, one place: forward FLOPs of each block from libra.workload (global offsets work
    # because sequence boundaries are sample boundaries and no block crosses one)
    flops = attention_flops(_block_areas(idx.offs, bounds), width, shape.head_dim).repeat(head_split)
    heads = np.empty((2, len(seq), head_split), dtype=np.int32)
    heads[0] = np.arange(0, shape.num_q_heads, width, dtype=np.int32)
    np.add(heads[0], width, out=heads[1])
    return PoolTiles(sequences, idx, seq=seq.repeat(head_split), q_start=(g_start - g_base).repeat(head_split),
                     q_end=(g_end - g_base).repeat(head_split), head_start=heads[0].reshape(-1),
                     head_end=heads[1].reshape(-1), q_home=idx.h_worker[pos].repeat(head_split),
                     dest=np.full(len(flops), -1, dtype=np.int32), flops=flops)


def _block_areas(offs: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Causal areas (:func:`libra.workload.causal_area`) of the ranges ``[bounds[i], bounds[i+1])``
    of the pool's global token axis; ``offs``: its sample offsets (total last), ``0 <= bounds <= total``.

    The cumulative area up to token ``x`` is that of the whole samples before ``x`` plus that of the
    first ``k = x - start`` rows of the sample containing ``x``, ``k (k + 1) / 2`` (the closed form
    of ``causal_area(0, k)``, exact in int64; ``>> 1`` since ``k (k + 1)`` is even): one search per
    bound instead of two per range, and no checks on these in-range values.
    """
    lengths = offs[1:] - offs[:-1]
    cum = np.zeros(len(offs), dtype=np.int64)
    np.add.accumulate((lengths * (lengths + 1)) >> 1, out=cum[1:])
    s = offs.searchsorted(bounds, side="right") - 1
    k = bounds - offs[s]
    at = cum[s] + ((k * (k + 1)) >> 1)
    return at[1:] - at[:-1]


def _raise_crossing(sequences, seq, starts, ends, bad, block_size: int):
    """The error for the first block (in tile order) that crosses a holder range."""
    b = int(np.flatnonzero(bad)[0])
    s_idx = int(seq[b])
    local = int(starts[b]) // block_size
    raise ValueError(
        f"block {local} [{starts[b]}, {ends[b]}) of sequence {s_idx} (seq_id "
        f"{sequences[s_idx].seq_id}) crosses a holder range: block size B={block_size} must divide "
        f"the per-worker token range (S/CP in the standard layout)")


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
