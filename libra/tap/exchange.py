"""Tile exchange planning: the transfers a placement implies (Libra sec. 4.3.3).

Generic for any placed :class:`~libra.plan.TileTable` and any holder layout, so the Ulysses and
WLB-LLM planners reuse it:

* **Q dispatch** ``q_home -> dest`` for every tile computed away from its Q-home (contiguous pieces
  with the same (src, dst, sequence, heads) are merged into one row).
* **KV fetch**, de-duplicated per destination: for each destination, sequence and KV atom the union
  of the prefixes its tiles need (per sample: the longest prefix any of its tiles reads), minus the
  tokens the destination holds itself, split at holder boundaries into one row per
  (holder, token range). Rows whose token range and endpoints agree on adjacent KV atoms are merged.
* **O return** ``dest -> q_home``, the mirror of Q dispatch.

Bytes come from :mod:`libra.workload`. No row ever has ``src == dst``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from libra.plan import (
    KV,
    O,
    PoolIndex,
    Q,
    SequenceLayout,
    TileTable,
    TransferTable,
    kv_need_start,
    pool_index,
)
from libra.tap.tiles import kv_atoms
from libra.workload import AttentionShape, kv_bytes, q_bytes


def merge_intervals(keys: Sequence[np.ndarray], start: np.ndarray, end: np.ndarray):
    """Merge touching or overlapping ``[start, end)`` intervals that share every key column.

    Args:
        keys: equal-length integer key arrays ``(n,)``.
        start, end: interval bounds ``(n,)`` with ``start < end``.

    Returns:
        ``(keys_out, start_out, end_out)``: one row per maximal merged interval, sorted by the keys
        (first key most significant) and then by start.
    """
    start = np.asarray(start, dtype=np.int64)
    end = np.asarray(end, dtype=np.int64)
    if len(start) == 0:
        return [np.asarray(k)[:0] for k in keys], start[:0], end[:0]
    ks = [np.asarray(k, dtype=np.int64) for k in keys]
    lows = [int(k.min()) for k in ks]
    spans = [int(k.max()) - lo + 1 for k, lo in zip(ks, lows)]
    s_lo = int(start.min())
    s_span = int(start.max()) - s_lo + 1
    if float(np.prod([float(x) for x in spans])) * s_span < 2.0**62:
        # one int64 sort key: (keys..., start) packed mixed-radix (much cheaper than a lexsort)
        group = np.zeros(len(start), dtype=np.int64)
        for k, lo, sp in zip(ks, lows, spans):
            group = group * sp + (k - lo)
        order = np.argsort(group * s_span + (start - s_lo), kind="stable")
        g = group[order]
        new_group = np.empty(len(g), dtype=bool)
        new_group[0] = True
        np.not_equal(g[1:], g[:-1], out=new_group[1:])
    else:
        order = np.lexsort((start,) + tuple(reversed(ks)))
        g = None
    ks = [k[order] for k in ks]
    st, en = start[order], end[order]
    if g is None:
        new_group = np.zeros(len(st), dtype=bool)
        new_group[0] = True
        for k in ks:
            new_group[1:] |= k[1:] != k[:-1]
    gid = np.cumsum(new_group) - 1
    # running max of ends inside each group: offset by group so one accumulate never crosses groups
    span = int(en.max()) + 2
    run = np.maximum.accumulate(gid * span + en) - gid * span
    prev = np.empty_like(run)
    prev[0] = -1
    prev[1:] = run[:-1]
    new = new_group | (st > prev)
    first = np.nonzero(new)[0]
    return ([k[first] for k in ks], st[first], np.maximum.reduceat(en, first))


def _q_like(kind: int, src, dst, tiles: TileTable, rows: np.ndarray, shape: AttentionShape) -> TransferTable:
    (s, d, seq, hs, he), lo, hi = merge_intervals(
        [src[rows], dst[rows], tiles.seq[rows], tiles.head_start[rows], tiles.head_end[rows]],
        tiles.q_start[rows], tiles.q_end[rows])
    nbytes = q_bytes(hi - lo, 1, shape.head_dim, shape.dtype_bytes) * (he - hs).astype(np.int64)
    return TransferTable(kind=np.full(len(s), kind), src=s, dst=d, seq=seq, tok_start=lo, tok_end=hi,
                         head_start=hs, head_end=he, nbytes=nbytes)


def kv_fetch_rows(sequences: Sequence[SequenceLayout], tiles: TileTable, shape: AttentionShape,
                  index: PoolIndex | None = None) -> TransferTable:
    """The de-duplicated KV-fetch rows of placed ``tiles`` (see module docstring)."""
    if len(tiles) == 0:
        return TransferTable.empty()
    idx = index if index is not None else pool_index(sequences)
    bounds, a0, a1 = kv_atoms(shape, tiles.head_start, tiles.head_end)
    cnt = a1 - a0
    rep = np.repeat(np.arange(len(tiles)), cnt)
    atom = a0[rep] + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    shift = idx.base[tiles.seq]
    lo_need = kv_need_start(sequences, tiles, idx) + shift
    # per (destination, KV atom): union of the needed intervals on the pool's global token axis
    (dst, atom), lo, hi = merge_intervals([tiles.dest[rep], atom], lo_need[rep], (tiles.q_end + shift)[rep])
    # cut at holder boundaries; pieces the destination holds itself need no transfer
    first = np.searchsorted(idx.h_start, lo, side="right") - 1
    cnt = np.searchsorted(idx.h_start, hi - 1, side="right") - first
    r = np.repeat(np.arange(len(lo)), cnt)
    j = np.repeat(first, cnt) + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    src = idx.h_worker[j]
    keep = src != dst[r]
    r, j, src = r[keep], j[keep], src[keep]
    seq = idx.h_seq[j]
    plo = np.maximum(lo[r], idx.h_start[j]) - idx.base[seq]
    phi = np.minimum(hi[r], idx.h_end[j]) - idx.base[seq]
    atom = atom[r]
    # merge adjacent KV atoms that move the same token range between the same pair
    (src, dst, seq, plo, phi), k0, k1 = merge_intervals([src, dst[r], seq, plo, phi],
                                                        bounds[atom], bounds[atom + 1])
    nbytes = kv_bytes(phi - plo, 1, shape.head_dim, shape.dtype_bytes) * (k1 - k0)
    return TransferTable(kind=np.full(len(src), KV), src=src, dst=dst, seq=seq, tok_start=plo,
                         tok_end=phi, head_start=k0, head_end=k1, nbytes=nbytes)


def build_transfers(sequences: Sequence[SequenceLayout], tiles: TileTable,
                    shape: AttentionShape, index: PoolIndex | None = None) -> TransferTable:
    """Forward transfers of a placement: Q dispatch, de-duplicated KV fetch, O return.

    Args:
        sequences: the pool's packed sequences (``tiles.seq`` indexes them) with their holders.
        tiles: placed tiles (every ``dest >= 0``).
        shape: head geometry; bytes via :func:`libra.workload.q_bytes` / ``kv_bytes``.
        index: the pool's :class:`~libra.plan.PoolIndex` when the caller already built it.

    Returns:
        A :class:`TransferTable` ordered Q rows, KV rows, O rows (each sorted by src, dst, ...).

    Raises:
        ValueError: an unplaced tile (``dest < 0``) or a tile whose sequence index is out of range.
    """
    if len(tiles) and int(tiles.dest.min()) < 0:
        raise ValueError(f"tile {int(np.argmin(tiles.dest))} is unplaced (dest = -1); place tiles first")
    if len(tiles) and not 0 <= int(tiles.seq.min()) <= int(tiles.seq.max()) < len(sequences):
        raise ValueError(f"tile sequence index out of range for {len(sequences)} sequences")
    away = np.nonzero(tiles.dest != tiles.q_home)[0]
    q = _q_like(Q, tiles.q_home, tiles.dest, tiles, away, shape)
    # O return retraces every Q dispatch in reverse (same pieces, same bytes)
    o = TransferTable(kind=np.full(len(q), O), src=q.dst, dst=q.src, seq=q.seq, tok_start=q.tok_start,
                      tok_end=q.tok_end, head_start=q.head_start, head_end=q.head_end, nbytes=q.nbytes)
    return TransferTable.concat([q, kv_fetch_rows(sequences, tiles, shape, index), o])
