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

Three implementations return identical tables (same rows, same order; the tests compare them):
the compiled kernel :mod:`libra.jit.exchange` (used when numba imports), a packed-key numpy
one (the fallback), and :func:`transfers_reference`, the plain interval-merging formulation they
are checked against, which also serves tables whose keys would overflow an int64.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from libra import jit as jit_modules
from libra.arrays import expand_counts, pack_keys, stable_sort
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
from libra.tap.tiles import kv_atoms, make_tiles
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
    group = pack_keys(ks)
    key = None if group is None else pack_keys([group, start])
    if key is not None:
        # one int64 sort key: (keys..., start) packed mixed-radix (much cheaper than a lexsort)
        order = np.argsort(key, kind="stable")
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


def _kv_fetch_reference(tiles: TileTable, shape: AttentionShape, idx: PoolIndex) -> TransferTable:
    """KV-fetch rows by generic interval merging (the reference :func:`kv_fetch_rows` must match)."""
    bounds, a0, a1 = kv_atoms(shape, tiles.head_start, tiles.head_end)
    rep, atom = expand_counts(a1 - a0)
    atom += a0[rep]
    shift = idx.base[tiles.seq]
    lo_need = kv_need_start((), tiles, idx) + shift
    # per (destination, KV atom): union of the needed intervals on the pool's global token axis
    (dst, atom), lo, hi = merge_intervals([tiles.dest[rep], atom], lo_need[rep], (tiles.q_end + shift)[rep])
    # cut at holder boundaries; pieces the destination holds itself need no transfer
    first = np.searchsorted(idx.h_start, lo, side="right") - 1
    r, j = expand_counts(np.searchsorted(idx.h_start, hi - 1, side="right") - first)
    j += first[r]
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


def transfers_reference(sequences: Sequence[SequenceLayout], tiles: TileTable, shape: AttentionShape,
                        index: PoolIndex | None = None) -> TransferTable:
    """:func:`build_transfers` by generic interval merging (:func:`merge_intervals`), no checks.

    The straightforward formulation, kept as the oracle of the packed-key implementation (the tests
    compare them) and as its fallback for tables whose keys do not pack into one int64.
    """
    if len(tiles) == 0:
        return TransferTable.empty()
    idx = index if index is not None else pool_index(sequences)
    q = _q_like(Q, tiles.q_home, tiles.dest, tiles, np.nonzero(tiles.dest != tiles.q_home)[0], shape)
    o = TransferTable(kind=np.full(len(q), O), src=q.dst, dst=q.src, seq=q.seq, tok_start=q.tok_start,
                      tok_end=q.tok_end, head_start=q.head_start, head_end=q.head_end, nbytes=q.nbytes)
    return TransferTable.concat([q, _kv_fetch_reference(tiles, shape, idx), o])


# ----------------------------------------------------------------------------------------------
# packed-key numpy implementation: every merge is one sort of an int64 key (mixed radix, the row
# index in the low bits), and the interval union a running maximum of ``key - start + end`` (which
# never crosses a group, since a group's keys exceed every previous group's key + end); no lexsort
# ----------------------------------------------------------------------------------------------

_KEY_LIMIT = 2.0**62


class _Radix(NamedTuple):
    """Bounds of the values a packed key holds: workers < ``w``, heads < ``h``, tokens < ``t``."""

    w: int
    h: int
    t: int


def _radix(tiles: TileTable, idx: PoolIndex, n_seq: int) -> _Radix | None:
    """The radices of ``tiles``' keys; None when a value is negative, a tile is empty or the widest
    key (``W^2 * n_seq * H^2 * T``) would not fit an int64 with room for ``end - start``."""
    home, dest = tiles.q_home, tiles.dest
    heads = tiles.head_start | tiles.head_end  # >= both and >= 0 iff both are: one min/max each
    toks = tiles.q_start | tiles.q_end
    w = max(int(home.max()), int(dest.max()), int(idx.h_worker.max()) if len(idx.h_worker) else 0) + 1
    if min(int(home.min()), int(heads.min()), int(toks.min()), int(idx.h_worker.min(initial=0))) < 0:
        return None
    if int((tiles.q_end - tiles.q_start).min()) <= 0:
        return None
    r = _Radix(w, int(heads.max()) + 1, int(toks.max()) + 1)
    if float(r.w) ** 2 * n_seq * float(r.h) ** 2 * r.t * 2 >= _KEY_LIMIT:
        return None
    return r


def _runs(key_sorted: np.ndarray, end_key_sorted: np.ndarray) -> np.ndarray:
    """Start positions of the merged runs: ``key[i]`` above the running max of earlier end keys."""
    run_end = np.maximum.accumulate(end_key_sorted)
    new = np.empty(len(key_sorted), dtype=bool)
    new[0] = True
    np.greater(key_sorted[1:], run_end[:-1], out=new[1:])
    return np.flatnonzero(new)


def _q_rows(tiles: TileTable, shape: AttentionShape, r: _Radix, n_seq: int) -> tuple:
    """Merged Q-dispatch pieces ``(src, dst, seq, lo, hi, hs, he, nbytes)``, sorted like the
    reference: by (src, dst, sequence, heads, start)."""
    home, dest = tiles.q_home, tiles.dest
    away = np.flatnonzero(home != dest)
    if not len(away):
        return (np.zeros(0, dtype=np.int64),) * 8
    key = home.astype(np.int64) * r.w
    key += dest
    key *= n_seq
    key += tiles.seq
    key *= r.h
    key += tiles.head_start
    key *= r.h
    key += tiles.head_end
    key *= r.t
    key += tiles.q_start
    order, key = stable_sort(key[away], float(r.w) ** 2 * n_seq * float(r.h) ** 2 * r.t)
    t = away[order]
    end = tiles.q_end[t]
    first = _runs(key, key + (end - tiles.q_start[t]))
    tf = t[first]
    lo, hi = tiles.q_start[tf], np.maximum.reduceat(end, first)
    hs, he = tiles.head_start[tf], tiles.head_end[tf]
    return (home[tf], dest[tf], tiles.seq[tf], lo, hi, hs, he,
            q_bytes(hi - lo, he - hs, shape.head_dim, shape.dtype_bytes))


def _kv_needs(tiles: TileTable, shape: AttentionShape, idx: PoolIndex):
    """Per (tile, KV atom): destination, atom, needed interval ``[lo, hi)`` on the global axis."""
    bounds, a0, a1 = kv_atoms(shape, tiles.head_start, tiles.head_end)
    shift = idx.base[tiles.seq]
    lo = idx.offs[np.searchsorted(idx.offs, tiles.q_start + shift, side="right") - 1]
    hi = tiles.q_end + shift
    cnt = a1 - a0
    if int(cnt.min()) == int(cnt.max()) == 1:  # one atom per tile (every usual GQA layout)
        return bounds, tiles.dest, a0, lo, hi
    rep, atom = expand_counts(cnt)
    atom += a0[rep]
    return bounds, tiles.dest[rep], atom, lo[rep], hi[rep]


def _kv_union(dst, atom, lo, hi, n_atoms: int, t1: int, w: int):
    """Per (destination, atom): the union of the needed intervals, sorted by (dst, atom, lo)."""
    key = dst.astype(np.int64) * n_atoms
    key += atom
    key *= t1
    key += lo
    order, key = stable_sort(key, float(t1) * n_atoms * w)
    hi_s = hi[order]
    first = _runs(key, key + (hi_s - lo[order]))
    pick = order[first]
    return dst[pick], atom[pick], lo[pick], np.maximum.reduceat(hi_s, first)


def _kv_pieces(dst, atom, lo, hi, idx: PoolIndex):
    """Cut the intervals at holder boundaries; drop the pieces the destination holds itself."""
    j0 = np.searchsorted(idx.h_start, lo, side="right") - 1
    r, j = expand_counts(np.searchsorted(idx.h_start, hi - 1, side="right") - j0)
    j += j0[r]
    src = idx.h_worker[j]
    keep = np.flatnonzero(src != dst[r])
    r, j = r[keep], j[keep]
    plo = np.maximum(lo[r], idx.h_start[j])
    return src[keep], dst[r], atom[r], j, plo, np.minimum(hi[r], idx.h_end[j]) - plo


def _kv_rows(tiles: TileTable, shape: AttentionShape, idx: PoolIndex, r: _Radix) -> tuple | None:
    """Merged KV-fetch rows ``(src, dst, seq, lo, hi, k0, k1, nbytes)`` sorted like the reference
    (src, dst, sequence, start, end, heads); None when the keys do not fit an int64."""
    bounds, dst, atom, lo, hi = _kv_needs(tiles, shape, idx)
    n_atoms, t1 = len(bounds) - 1, int(idx.base[-1]) + r.t  # every lo, hi < t1
    if float(r.w) * n_atoms * t1 * 2 >= _KEY_LIMIT:
        return None
    src, dst, atom, j, glo, length = _kv_pieces(*_kv_union(dst, atom, lo, hi, n_atoms, t1, r.w), idx)
    span = int((idx.h_end - idx.h_start).max()) + 1  # a piece lies in one holder range
    if float(r.w) ** 2 * t1 * span * (n_atoms + 1) >= _KEY_LIMIT:
        return None
    # (src, dst, sequence, start, end) sorts as (src, dst, global start, length); atoms radix A + 1,
    # so a step of exactly 1 between sorted keys is the next atom of the same piece: merge those
    key = src.astype(np.int64) * r.w
    key += dst
    key *= t1
    key += glo
    key *= span
    key += length
    key *= n_atoms + 1
    key += atom
    order, key = stable_sort(key, float(r.w) ** 2 * t1 * span * (n_atoms + 1))
    new = np.empty(len(order), dtype=bool)
    new[:1] = True
    np.not_equal(key[1:] - key[:-1], 1, out=new[1:])
    first = np.flatnonzero(new)
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1:] = len(order) - 1
    p = order[first]
    seq = idx.h_seq[j[p]]
    start = glo[p] - idx.base[seq]
    k0, k1 = bounds[atom[p]], bounds[atom[order[last]] + 1]
    return (src[p], dst[p], seq, start, start + length[p], k0, k1,
            kv_bytes(length[p], k1 - k0, shape.head_dim, shape.dtype_bytes))


def _table(kinds, parts) -> TransferTable:
    """One TransferTable of row blocks ``parts`` (each ``(src, dst, seq, lo, hi, hs, he, nbytes)``)."""
    cols = list(zip(*parts))
    return TransferTable(
        kind=np.repeat(np.array(kinds, dtype=np.int8), [len(p[0]) for p in parts]),
        **{name: np.concatenate(cols[i], dtype=TransferTable.FIELDS[name])
           for i, name in enumerate(("src", "dst", "seq", "tok_start", "tok_end", "head_start", "head_end",
                                     "nbytes"))})


def kv_fetch_rows(sequences: Sequence[SequenceLayout], tiles: TileTable, shape: AttentionShape,
                  index: PoolIndex | None = None) -> TransferTable:
    """The de-duplicated KV-fetch rows of placed ``tiles`` (see module docstring)."""
    if len(tiles) == 0:
        return TransferTable.empty()
    idx = index if index is not None else pool_index(sequences)
    r = _radix(tiles, idx, len(sequences))
    kv = _kv_rows(tiles, shape, idx, r) if r is not None else None
    return _kv_fetch_reference(tiles, shape, idx) if kv is None else _table([KV], [kv])


IMPLS = ("numba", "numpy", "reference")
"""Exchange implementations: the compiled kernel (:mod:`libra.jit.exchange`), the packed-key
numpy one and the reference interval merging; all return identical tables."""


def exchange_impl() -> str:
    """The implementation ``build_transfers(impl="auto")`` runs here: ``"numba"`` when numba
    imports, else ``"numpy"`` (the reference only serves tables whose keys overflow an int64)."""
    return jit_modules.impl_name("exchange")


def warmup() -> float:
    """Compile the exchange kernel now (numba only; once per process) on a two-worker pool so that
    timed calls exclude compilation; returns the seconds spent (0.0 without numba)."""
    if jit_modules.compiled("exchange") is None:
        return 0.0
    t0 = time.perf_counter()
    seqs = [SequenceLayout.contiguous(0, 0, [3, 1], 2)]
    shape = AttentionShape(2, 1, 1, 2)
    tiles = make_tiles(seqs, 2, 2, shape, impl="numpy")
    cols = {k: getattr(tiles, k) for k in TileTable.FIELDS}
    placed = TileTable(**{**cols, "dest": np.array([1, 0, 0, 0], dtype=np.int32)})
    build_transfers(seqs, placed, shape, impl="numba")
    return time.perf_counter() - t0


def _compiled(jit, tiles: TileTable, shape: AttentionShape, idx: PoolIndex, n_seq: int) -> TransferTable | None:
    """The kernel's table; None when the kernel declines (see :func:`_radix`)."""
    ok, cols = jit.transfer_rows(tiles.q_home, tiles.dest, tiles.seq, tiles.q_start, tiles.q_end, tiles.head_start,
                                 tiles.head_end, idx, shape.group_size, n_seq,
                                 q_bytes(1, 1, shape.head_dim, shape.dtype_bytes),
                                 kv_bytes(1, 1, shape.head_dim, shape.dtype_bytes))
    return TransferTable(**dict(zip(TransferTable.FIELDS, cols))) if ok else None


def _numpy(tiles: TileTable, shape: AttentionShape, idx: PoolIndex, r: _Radix, n_seq: int) -> TransferTable | None:
    """The packed-key numpy table; None when a key overflows an int64."""
    kv = _kv_rows(tiles, shape, idx, r)
    if kv is None:
        return None
    q = _q_rows(tiles, shape, r, n_seq)
    # O return retraces every Q dispatch in reverse (same pieces, same bytes)
    return _table([Q, KV, O], [q, kv, (q[1], q[0]) + q[2:]])


def build_transfers(sequences: Sequence[SequenceLayout], tiles: TileTable,
                    shape: AttentionShape, index: PoolIndex | None = None, *, impl: str = "auto") -> TransferTable:
    """Forward transfers of a placement: Q dispatch, de-duplicated KV fetch, O return.

    Args:
        sequences: the pool's packed sequences (``tiles.seq`` indexes them) with their holders.
        tiles: placed tiles (every ``dest >= 0``).
        shape: head geometry; bytes via :func:`libra.workload.q_bytes` / ``kv_bytes``.
        index: the pool's :class:`~libra.plan.PoolIndex` when the caller already built it.
        impl: ``"auto"`` (:func:`exchange_impl`) or one of :data:`IMPLS`; all give the same table
            (tables whose keys would overflow an int64 always take the reference path).

    Returns:
        A :class:`TransferTable` ordered Q rows, KV rows, O rows (each sorted by src, dst, ...).

    Raises:
        ValueError: an unplaced tile (``dest < 0``), a tile whose sequence index is out of range, or
            an unknown ``impl``.
        ImportError: ``impl="numba"`` without numba (``pip install -e '.[fast]'``).
    """
    if impl not in IMPLS and impl != "auto":
        raise ValueError(f"impl must be 'auto' or one of {IMPLS}, got {impl!r}")
    jit = jit_modules.select("exchange", impl)
    if len(tiles) == 0:
        return TransferTable.empty()
    if int(tiles.dest.min()) < 0:
        raise ValueError(f"tile {int(np.argmin(tiles.dest))} is unplaced (dest = -1); place tiles first")
    if not 0 <= int(tiles.seq.min()) <= int(tiles.seq.max()) < len(sequences):
        raise ValueError(f"tile sequence index out of range for {len(sequences)} sequences")
    idx = index if index is not None else pool_index(sequences)
    out = _compiled(jit, tiles, shape, idx, len(sequences)) if jit is not None else None
    if out is None and impl != "reference":
        r = _radix(tiles, idx, len(sequences))
        out = _numpy(tiles, shape, idx, r, len(sequences)) if r is not None else None
    return transfers_reference(sequences, tiles, shape, idx) if out is None else out
