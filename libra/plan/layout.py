"""Where a pool's tokens live before attention, and the geometry every consumer derives from it.

* :class:`SequenceLayout`: one packed sequence, its samples and which worker holds which tokens.
* :class:`PoolIndex` (:func:`pool_index`): a pool's sequences laid end to end on one token axis,
  built once per pool and passed to whatever plans or checks it (Libra sec. 4.3.1).
* :func:`kv_need_start`: the KV interval of a tile (the causal prefixes of the samples it touches).
* :func:`segments`: the varlen kernel calls a placement implies -- each tile split at sample
  boundaries, with the query positions of each piece. The cost model, the runtime's worker
  programs, the kernel-time weights and the GPU checks all read this one function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from libra import jit as jit_modules
from libra.arrays import expand_counts, lexsort
from libra.plan.tables import TileTable, frozen_array
from libra.workload import attention_flops, causal_area, range_areas


@dataclass(frozen=True, eq=False)
class SequenceLayout:
    """One packed sequence of a pool and where its tokens live before attention.

    Attributes:
        seq_id: index of the packed sequence in its GBS window (stable across plans).
        dp_rank: DP replica whose CP group holds it.
        sample_lengths: int64 ``(n_samples,)`` sample lengths in packing order.
        holder_start, holder_end, holder_worker: ``(n_ranges,)`` token ranges ``[start, end)``
            and the global worker holding Q, K and V of those tokens (all heads). The ranges
            partition ``[0, num_tokens)``. Standard layout: CP contiguous equal ranges.

    Raises:
        ValueError: arrays that are not 1-D, negative sample lengths, holder columns of unequal
            length, or holder ranges that do not partition ``[0, num_tokens)`` (names the ranges).
    """

    seq_id: int
    dp_rank: int
    sample_lengths: np.ndarray
    holder_start: np.ndarray
    holder_end: np.ndarray
    holder_worker: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "sample_lengths", frozen_array(self.sample_lengths, np.int64))
        for name in ("holder_start", "holder_end"):
            object.__setattr__(self, name, frozen_array(getattr(self, name), np.int64))
        object.__setattr__(self, "holder_worker", frozen_array(self.holder_worker, np.int32))
        lengths, hs, he = self.sample_lengths, self.holder_start, self.holder_end
        if lengths.ndim != 1 or np.any(lengths < 0):
            raise ValueError(f"sequence {self.seq_id}: sample_lengths must be 1-D and >= 0")
        if not (hs.ndim == he.ndim == self.holder_worker.ndim == 1 and len(hs) == len(he) == len(self.holder_worker)):
            raise ValueError(f"sequence {self.seq_id}: holder_start/end/worker must be 1-D of equal length")
        # cached derived arrays (the layout is immutable): planning reads them per tile batch
        offsets = frozen_array(np.concatenate(([0], np.cumsum(lengths))), np.int64)
        order = frozen_array(np.argsort(hs, kind="stable"), np.int64)
        a, b, total = hs[order], he[order], int(offsets[-1])
        if len(a) == 0 or a[0] != 0 or b[-1] != total or np.any(b <= a) or np.any(a[1:] != b[:-1]):
            raise ValueError(f"sequence {self.seq_id}: holder ranges {list(zip(a.tolist(), b.tolist()))} do not "
                             f"partition its {total} tokens")
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_holder_order", order)

    @classmethod
    def contiguous(cls, seq_id: int, dp_rank: int, sample_lengths, cp: int) -> SequenceLayout:
        """The standard pre-attention layout: CP equal contiguous ranges, rank r -> worker dp*CP+r.

        Raises:
            ValueError: CP does not divide the sequence's token count.
        """
        lengths = np.asarray(sample_lengths, dtype=np.int64)
        total = int(lengths.sum())
        if total % cp:
            raise ValueError(f"CP={cp} must divide the packed sequence length {total}")
        per = total // cp
        starts = np.arange(cp, dtype=np.int64) * per
        return cls(seq_id, dp_rank, lengths, starts, starts + per,
                   dp_rank * cp + np.arange(cp, dtype=np.int32))

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    @property
    def sample_offsets(self) -> np.ndarray:
        """``[0, l_0, l_0 + l_1, ..., num_tokens]`` (read-only, cached)."""
        return self._offsets

    @property
    def holder_order(self) -> np.ndarray:
        """Indices that sort the holder ranges by start (read-only, cached)."""
        return self._holder_order

    def holder_of(self, tokens) -> np.ndarray:
        """Index into the holder ranges of each token position."""
        order = self._holder_order
        pos = np.searchsorted(self.holder_start[order], np.asarray(tokens), side="right") - 1
        return order[pos]

    def to_dict(self) -> dict:
        return {"seq_id": int(self.seq_id), "dp_rank": int(self.dp_rank),
                "sample_lengths": self.sample_lengths.tolist(),
                "holder_start": self.holder_start.tolist(), "holder_end": self.holder_end.tolist(),
                "holder_worker": self.holder_worker.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> SequenceLayout:
        return cls(**d)


class PoolIndex(NamedTuple):
    """A pool's sequences laid end to end on one global token axis (for vectorised planning).

    Attributes:
        base: ``(n_seq + 1,)`` global token offset of each sequence (last entry: total tokens).
        offs: global sample offsets: every sample start of every sequence, then the total.
        h_start, h_end, h_worker, h_seq: holder ranges in global coordinates sorted by start, with
            the holding worker and the sequence index.
    """

    base: np.ndarray
    offs: np.ndarray
    h_start: np.ndarray
    h_end: np.ndarray
    h_worker: np.ndarray
    h_seq: np.ndarray


def pool_index(sequences: Sequence[SequenceLayout]) -> PoolIndex:
    """Build the :class:`PoolIndex` of ``sequences`` (their layouts are validated on creation)."""
    n_seq = len(sequences)
    if not n_seq:
        base = np.zeros(1, dtype=np.int64)
        empty = np.zeros(0, dtype=np.int64)
        return PoolIndex(base, base.copy(), empty, empty, empty.astype(np.int32), empty)
    # every sample start of every sequence, then the total: the cumulative sum of all sample lengths
    # (a valid layout has tokens, so each sequence starts where the previous one's samples end)
    samples = np.concatenate([s.sample_lengths for s in sequences])
    offs = np.zeros(len(samples) + 1, dtype=np.int64)
    np.add.accumulate(samples, out=offs[1:])
    first = np.zeros(n_seq + 1, dtype=np.int64)
    np.add.accumulate(np.fromiter([len(s.sample_lengths) for s in sequences], np.int64, n_seq), out=first[1:])
    base = offs[first]
    n = np.fromiter([len(s.holder_start) for s in sequences], np.int64, n_seq)
    shift = base[:-1].repeat(n)
    start = np.concatenate([s.holder_start for s in sequences])
    start += shift
    end = np.concatenate([s.holder_end for s in sequences])
    end += shift
    # holder ranges are disjoint and each sequence's lie in its own [base, base + length): one sort
    # by global start orders them by (sequence, start)
    order = start.argsort()
    return PoolIndex(base, offs, start[order], end[order],
                     np.concatenate([s.holder_worker for s in sequences])[order], np.arange(n_seq).repeat(n))


def kv_need_start(sequences: Sequence[SequenceLayout], tiles: TileTable, index: PoolIndex | None = None) -> np.ndarray:
    """Start of each tile's KV interval: the first token of the sample containing ``q_start``.

    A tile with rows ``[q_start, q_end)`` needs K/V tokens ``[kv_need_start, q_end)`` (the union of
    the causal prefixes of every sample it touches). Returns an int64 ``(T,)`` array.
    """
    if len(tiles) == 0:
        return np.zeros(0, dtype=np.int64)
    idx = index if index is not None else pool_index(sequences)
    shift = idx.base[tiles.seq]
    return idx.offs[np.searchsorted(idx.offs, tiles.q_start + shift, side="right") - 1] - shift


SEGMENT_FIELDS = ("tile", "seq", "dest", "sample_start", "sample_len", "q_start", "q_len", "kv_len",
                  "heads", "area")


def segments(sequences: Sequence[SequenceLayout], tiles: TileTable,
             index: PoolIndex | None = None) -> dict[str, np.ndarray]:
    """Kernel segments of placed tiles: each tile split at sample boundaries (block-diagonal mask).

    Returns a dict of int64 ``(G,)`` arrays (:data:`SEGMENT_FIELDS`), ordered by tile, then by
    position: ``tile`` (row in ``tiles``), ``seq``, ``dest``, ``sample_start`` (token where the
    piece's sample starts in its packed sequence), ``sample_len``, ``q_start`` (token where the
    piece's queries start), ``q_len`` (query rows), ``kv_len`` (prefix keys it reads = offset of its
    last row in the sample + 1), ``heads`` (query heads) and ``area`` (causal pairs per head).
    This is what one varlen kernel call sees.
    """
    if not len(tiles):
        return {k: np.zeros(0, dtype=np.int64) for k in SEGMENT_FIELDS}
    idx = index if index is not None else pool_index(sequences)
    jit = jit_modules.select("layout", "auto")  # the same rows, compiled (libra.jit.layout)
    return _segments_numpy(tiles, idx) if jit is None else _segments_compiled(jit, tiles, idx)


def _segments_numpy(tiles: TileTable, idx: PoolIndex) -> dict[str, np.ndarray]:
    """:func:`segments` in numpy (the oracle of :func:`_segments_compiled`, and the fallback)."""
    shift = idx.base[tiles.seq]
    a, b = tiles.q_start + shift, tiles.q_end + shift  # global token axis
    first = np.searchsorted(idx.offs, a, side="right") - 1
    rep, sample = expand_counts(np.searchsorted(idx.offs, b, side="left") - first)
    sample += first[rep]
    s0 = idx.offs[sample]
    lo = np.maximum(a[rep], s0) - s0
    hi = np.minimum(b[rep], idx.offs[sample + 1]) - s0
    keep = hi > lo
    rep, sample, s0, lo, hi = rep[keep], sample[keep], s0[keep], lo[keep], hi[keep]
    start = s0 - shift[rep]
    return {"tile": rep.astype(np.int64), "seq": tiles.seq[rep].astype(np.int64),
            "dest": tiles.dest[rep].astype(np.int64), "sample_start": start,
            "sample_len": idx.offs[sample + 1] - s0, "q_start": start + lo, "q_len": hi - lo, "kv_len": hi,
            "heads": (tiles.head_end - tiles.head_start)[rep].astype(np.int64),
            "area": causal_area(lo, hi).astype(np.int64)}


def _segments_compiled(jit, tiles: TileTable, idx: PoolIndex) -> dict[str, np.ndarray]:
    """:func:`segments` by :func:`libra.jit.layout.segment_rows`."""
    i64 = np.int64
    rep, start, length, q0, ql, kv, area = jit.segment_rows(
        tiles.seq.astype(i64), tiles.q_start.astype(i64), tiles.q_end.astype(i64), idx.base, idx.offs)
    return {"tile": rep, "seq": tiles.seq[rep].astype(i64), "dest": tiles.dest[rep].astype(i64),
            "sample_start": start, "sample_len": length, "q_start": q0, "q_len": ql, "kv_len": kv,
            "heads": (tiles.head_end - tiles.head_start)[rep].astype(i64), "area": area}


def merge_pieces(seg: dict, chunk: np.ndarray, head_start: np.ndarray, head_end: np.ndarray,
                 ordered: bool = True) -> tuple[dict, np.ndarray]:
    """The kernel segments a worker runs: adjacent pieces merged (the runtime executes them, the
    cost model prices them; one rule for both).

    Pieces of one sample on one worker, in one Pipeliner chunk and with one head range, whose query
    rows are contiguous (adjacent blocks placed together; a sample that crosses a holder boundary)
    are one segment: rows ``[first q_start, last q_start + q_len)`` reading the last piece's key
    prefix once, instead of a prefix per block.

    Args:
        seg: :func:`segments` of a pool (or a subset of its rows).
        chunk: ``(G,)`` each piece's chunk (-1: a head slice in every chunk;
            :meth:`libra.tap.pipeline.ChunkSchedule.segment_calls`).
        head_start, head_end: ``(G,)`` each piece's tile head range.
        ordered: return the merged segments in the order below; ``False`` (a pricing caller)
            keeps the input order instead (a run where its first piece was) and sorts only the
            pieces of cut samples: whole-sample segments never merge, and on real corpora they are
            most of a pool's (30K of the 38K of one Wikipedia 1M pool).

    Returns:
        ``(merged, chunk)``: :data:`SEGMENT_FIELDS` of the merged segments (``tile`` the first
        piece's; ``q_len`` and ``area`` summed; ``kv_len`` the last piece's) ordered by destination,
        chunk, head range, sequence, sample and position (``ordered``), and the chunk of each.
    """
    cols = {k: np.asarray(seg[k]) for k in SEGMENT_FIELDS}
    hs, he, chunk = (np.asarray(x, dtype=np.int64) for x in (head_start, head_end, chunk))
    if not len(chunk):
        return cols, chunk
    # a whole sample has no piece to merge with: unordered, only the pieces of cut samples are sorted
    rows = np.arange(len(chunk)) if ordered else np.flatnonzero(cols["q_len"] != cols["sample_len"])
    if not len(rows):
        return cols, chunk
    k = (cols["dest"], chunk, hs, he, cols["seq"], cols["sample_start"])
    order = rows[lexsort((cols["q_start"][rows], *(x[rows] for x in reversed(k))))]
    cont = np.zeros(len(order), dtype=bool)
    q0, ql = cols["q_start"][order], cols["q_len"][order]
    cont[1:] = np.logical_and.reduce([x[order][1:] == x[order][:-1] for x in k] + [q0[1:] == q0[:-1] + ql[:-1]])
    first = np.flatnonzero(~cont)
    last = np.append(first[1:], len(order)) - 1
    if ordered:
        out = {key: v[order[first]] for key, v in cols.items()}
        out["q_len"], out["area"] = np.add.reduceat(ql, first), np.add.reduceat(cols["area"][order], first)
        out["kv_len"] = cols["kv_len"][order[last]]
        return out, chunk[order[first]]
    out = {key: (v.copy() if key in ("q_len", "area", "kv_len") else v) for key, v in cols.items()}
    head = order[first]  # each run's first piece becomes the run; the others are dropped
    out["q_len"][head], out["area"][head] = np.add.reduceat(ql, first), np.add.reduceat(cols["area"][order], first)
    out["kv_len"][head] = cols["kv_len"][order[last]]
    keep = np.ones(len(chunk), dtype=bool)
    keep[order[cont]] = False
    return {key: v[keep] for key, v in out.items()}, chunk[keep]


def tile_flops(seq: SequenceLayout, q_start, q_end, heads, head_dim: int) -> np.ndarray:
    """Forward FLOPs of query ranges ``[q_start, q_end)`` of ``seq`` over ``heads`` heads each."""
    return attention_flops(range_areas(seq.sample_offsets, q_start, q_end), 1, head_dim) * np.asarray(heads)
