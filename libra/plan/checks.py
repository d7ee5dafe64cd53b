"""Invariant checks of a :class:`~libra.plan.PoolPlan` (DESIGN.md sec. 2; Libra sec. 4.3.3).

:func:`check_pool` is what :meth:`libra.plan.Plan.validate` runs for every pool. It is exact, not
sampled: token x head sets are compared on the elementary grid spanned by every boundary involved
(a 2-D difference array), so "exactly once", "no less, no more" and "never twice" are all checked
cell by cell. Every failure raises :class:`~libra.plan.PlanValidationError` naming the pool and the
offending tile, transfer, worker or cell.

Invariants:

1. tiles name valid sequences, token ranges and query heads; ``dest`` and ``q_home`` are pool
   workers; every transfer's ``src`` and ``dst`` are pool workers and differ;
2. every (query token, query head) of every sequence is computed by exactly one tile;
3. tile FLOPs equal :func:`libra.plan.layout.tile_flops` (the formulas of :mod:`libra.workload`);
4. ``q_home`` is the holder of the tile's whole token range;
5. Q rows ``src -> dst`` cover exactly the tiles with Q-home ``src`` computed on ``dst != src``
   (each cell once), and O rows cover the same cells in the reverse direction;
6. per destination and sequence, KV rows cover exactly the union of the KV prefixes its tiles need
   (``[sample start, last row]`` per sample, over the tile's GQA KV heads) minus the tokens the
   destination holds, each cell once; each row comes from the holder of its tokens or, with
   hop ``h > 0`` (a KV relay), from a worker that receives a KV row of a
   smaller hop covering its tokens and KV heads; Q and O rows have hop 0;
7. ``nbytes`` of every row matches :func:`libra.workload.q_bytes` / :func:`~libra.workload.kv_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from libra.arrays import expand_counts, sorted_unique
from libra.plan.layout import PoolIndex, SequenceLayout, kv_need_start, tile_flops
from libra.plan.tables import KV, O, PlanMismatchError, PlanValidationError, Q, TileTable, TransferTable
from libra.workload import AttentionShape, kv_bytes, q_bytes


class PoolFields(Protocol):
    """What the checks read of a pool plan (:class:`libra.plan.PoolPlan` has it; the contract
    imports these checks, so they name its fields, never the class)."""

    pool_index: int
    workers: tuple[int, ...]
    sequences: tuple[SequenceLayout, ...]
    tiles: TileTable
    transfers: TransferTable

    def index(self) -> PoolIndex: ...


def _grid(rects, tb: np.ndarray, hb: np.ndarray) -> np.ndarray:
    """Cover counts of ``rects = (t0, t1, h0, h1)`` on the cells ``[tb[i], tb[i+1]) x [hb[j], hb[j+1])``."""
    t0, t1, h0, h1 = (np.asarray(r, dtype=np.int64) for r in rects)
    i0, i1 = np.searchsorted(tb, t0), np.searchsorted(tb, t1)
    j0, j1 = np.searchsorted(hb, h0), np.searchsorted(hb, h1)
    d = np.zeros((len(tb), len(hb)), dtype=np.int64)
    np.add.at(d, (i0, j0), 1)
    np.add.at(d, (i1, j0), -1)
    np.add.at(d, (i0, j1), -1)
    np.add.at(d, (i1, j1), 1)
    return d.cumsum(0).cumsum(1)[:-1, :-1]


def _bounds(*rect_sets) -> tuple[np.ndarray, np.ndarray]:
    tb = sorted_unique(np.concatenate([np.concatenate((r[0], r[1])) for r in rect_sets] + [np.zeros(1, np.int64)]))
    hb = sorted_unique(np.concatenate([np.concatenate((r[2], r[3])) for r in rect_sets] + [np.zeros(1, np.int64)]))
    return tb, hb


def _groups(*keys: np.ndarray) -> dict[tuple, np.ndarray]:
    """Row indices grouped by the tuple of key columns."""
    if len(keys[0]) == 0:
        return {}
    stacked = np.stack([np.asarray(k, dtype=np.int64) for k in keys], axis=1)
    uniq, inverse = np.unique(stacked, axis=0, return_inverse=True)
    order = np.argsort(inverse.reshape(-1), kind="stable")
    splits = np.split(order, np.cumsum(np.bincount(inverse.reshape(-1), minlength=len(uniq)))[:-1])
    return {tuple(int(v) for v in u): rows for u, rows in zip(uniq, splits)}


def _fail(pool: PoolFields, msg: str) -> None:
    raise PlanValidationError(f"pool {pool.pool_index}: {msg}")


def _cell(tb, hb, i, j, what="heads") -> str:
    return f"tokens [{tb[i]}, {tb[i + 1]}) x {what} [{hb[j]}, {hb[j + 1]})"


def _check_basic(pool: PoolFields, shape: AttentionShape) -> None:
    t, x = pool.tiles, pool.transfers
    workers = np.asarray(pool.workers, dtype=np.int64)
    if len(np.unique(workers)) != len(workers):
        _fail(pool, f"duplicate workers {list(pool.workers)}")
    n_seq = len(pool.sequences)
    for name, col in (("tile", t.seq), ("transfer", x.seq)):
        bad = np.nonzero((col < 0) | (col >= n_seq))[0]
        if len(bad):
            _fail(pool, f"{name} {int(bad[0])} names sequence {int(col[bad[0]])} of {n_seq}")
    lengths = np.array([s.num_tokens for s in pool.sequences], dtype=np.int64)
    bad = np.nonzero((t.q_start < 0) | (t.q_end <= t.q_start) | (t.q_end > lengths[t.seq])
                     | (t.head_start < 0) | (t.head_end <= t.head_start) | (t.head_end > shape.num_q_heads))[0]
    if len(bad):
        i = int(bad[0])
        _fail(pool, f"tile {i} has an invalid range: tokens [{t.q_start[i]}, {t.q_end[i]}) heads "
                    f"[{t.head_start[i]}, {t.head_end[i]}) (sequence of {lengths[t.seq[i]]} tokens, "
                    f"{shape.num_q_heads} query heads)")
    for name, col in (("dest", t.dest), ("q_home", t.q_home)):
        bad = np.nonzero(~np.isin(col, workers))[0]
        if len(bad):
            _fail(pool, f"tile {int(bad[0])} has {name} {int(col[bad[0]])} outside the pool workers")
    for name, col in (("src", x.src), ("dst", x.dst)):
        bad = np.nonzero(~np.isin(col, workers))[0]
        if len(bad):
            _fail(pool, f"transfer {int(bad[0])} has {name} {int(col[bad[0]])} outside the pool workers")
    bad = np.nonzero(x.src == x.dst)[0]
    if len(bad):
        _fail(pool, f"transfer {int(bad[0])} is a self-transfer on worker {int(x.src[bad[0]])}")
    bad = np.nonzero(~np.isin(x.kind, (Q, KV, O)))[0]
    if len(bad):
        _fail(pool, f"transfer {int(bad[0])} has unknown kind {int(x.kind[bad[0]])}")
    bad = np.nonzero((x.hop < 0) | ((x.kind != KV) & (x.hop != 0)))[0]
    if len(bad):
        _fail(pool, f"transfer {int(bad[0])} has hop {int(x.hop[bad[0]])} (only KV rows relay, with hop >= 1)")
    head_lim = np.where(x.kind == KV, shape.num_kv_heads, shape.num_q_heads)
    bad = np.nonzero((x.tok_start < 0) | (x.tok_end <= x.tok_start) | (x.tok_end > lengths[x.seq])
                     | (x.head_start < 0) | (x.head_end <= x.head_start) | (x.head_end > head_lim))[0]
    if len(bad):
        i = int(bad[0])
        _fail(pool, f"transfer {i} has an invalid range: tokens [{x.tok_start[i]}, {x.tok_end[i]}) "
                    f"heads [{x.head_start[i]}, {x.head_end[i]})")
    tok = (x.tok_end - x.tok_start)
    heads = (x.head_end - x.head_start).astype(np.int64)
    expect = np.where(x.kind == KV, kv_bytes(tok, 1, shape.head_dim, shape.dtype_bytes) * heads,
                      q_bytes(tok, 1, shape.head_dim, shape.dtype_bytes) * heads)
    bad = np.nonzero(x.nbytes != expect)[0]
    if len(bad):
        i = int(bad[0])
        _fail(pool, f"transfer {i} carries nbytes={int(x.nbytes[i])}, the formula gives {int(expect[i])}")


def _check_tiles(pool: PoolFields, shape: AttentionShape) -> None:
    t = pool.tiles
    for s_idx, seq in enumerate(pool.sequences):
        rows = np.nonzero(t.seq == s_idx)[0]
        rects = (t.q_start[rows], t.q_end[rows], t.head_start[rows], t.head_end[rows])
        tb = sorted_unique(np.concatenate(([0, seq.num_tokens], rects[0], rects[1])))
        hb = sorted_unique(np.concatenate(([0, shape.num_q_heads], rects[2], rects[3])))
        g = _grid(rects, tb, hb)
        bad = np.argwhere(g != 1)
        if len(bad):
            i, j = bad[0]
            _fail(pool, f"sequence {s_idx}: {_cell(tb, hb, i, j)} is computed {int(g[i, j])} times "
                        f"(must be exactly once)")
        if not len(rows):
            continue
        flops = tile_flops(seq, t.q_start[rows], t.q_end[rows], t.head_end[rows] - t.head_start[rows],
                           shape.head_dim)
        bad = np.nonzero(~np.isclose(t.flops[rows], flops, rtol=1e-9, atol=0.0))[0]
        if len(bad):
            i = int(rows[bad[0]])
            _fail(pool, f"tile {i} records {t.flops[i]:.6g} FLOPs, the formula gives {flops[bad[0]]:.6g}")
        hold = seq.holder_of(t.q_start[rows])
        ok = (seq.holder_worker[hold] == t.q_home[rows]) & (t.q_end[rows] <= seq.holder_end[hold])
        bad = np.nonzero(~ok)[0]
        if len(bad):
            i = int(rows[bad[0]])
            _fail(pool, f"tile {i} (tokens [{t.q_start[i]}, {t.q_end[i]}) of sequence {s_idx}) has q_home "
                        f"{int(t.q_home[i])} but its tokens are held by worker "
                        f"{int(seq.holder_worker[hold[bad[0]]])} (range [{seq.holder_start[hold[bad[0]]]}, "
                        f"{seq.holder_end[hold[bad[0]]]}))")


def _check_q_like(pool: PoolFields, kind: int) -> None:
    t, x = pool.tiles, pool.transfers
    name = "Q dispatch" if kind == Q else "O return"
    away = np.nonzero(t.dest != t.q_home)[0]
    src, dst = (t.q_home, t.dest) if kind == Q else (t.dest, t.q_home)
    tile_groups = _groups(src[away], dst[away], t.seq[away])
    rows_k = np.nonzero(x.kind == kind)[0]
    x_groups = _groups(x.src[rows_k], x.dst[rows_k], x.seq[rows_k])
    for key in sorted(set(tile_groups) | set(x_groups)):
        tr = away[tile_groups.get(key, np.zeros(0, np.int64))]
        xr = rows_k[x_groups.get(key, np.zeros(0, np.int64))]
        a = (t.q_start[tr], t.q_end[tr], t.head_start[tr], t.head_end[tr])
        b = (x.tok_start[xr], x.tok_end[xr], x.head_start[xr], x.head_end[xr])
        tb, hb = _bounds(a, b)
        ga, gb = _grid(a, tb, hb), _grid(b, tb, hb)
        bad = np.argwhere(ga != gb)
        if len(bad):
            i, j = bad[0]
            cell = _cell(tb, hb, i, j)
            if gb[i, j] > ga[i, j]:
                hit = xr[(x.tok_start[xr] <= tb[i]) & (x.tok_end[xr] > tb[i])
                         & (x.head_start[xr] <= hb[j]) & (x.head_end[xr] > hb[j])]
                _fail(pool, f"{name} transfer {int(hit[0])} ({key[0]} -> {key[1]}, sequence {key[2]}) "
                            f"moves {cell} {int(gb[i, j])} times, tiles need it {int(ga[i, j])} times")
            hit = tr[(t.q_start[tr] <= tb[i]) & (t.q_end[tr] > tb[i])
                     & (t.head_start[tr] <= hb[j]) & (t.head_end[tr] > hb[j])]
            _fail(pool, f"tile {int(hit[0])} (q_home {int(t.q_home[hit[0]])}, dest {int(t.dest[hit[0]])}) "
                        f"lacks its {name} of {cell} on sequence {key[2]}")


def _check_kv(pool: PoolFields, shape: AttentionShape) -> None:
    t, x = pool.tiles, pool.transfers
    kv_lo = kv_need_start(pool.sequences, t, pool.index())
    k0, k1 = shape.kv_head_range(t.head_start, t.head_end)
    tile_groups = _groups(t.dest, t.seq)
    rows_k = np.nonzero(x.kind == KV)[0]
    x_groups = _groups(x.dst[rows_k], x.seq[rows_k])
    relayed = []
    for s_idx, seq in enumerate(pool.sequences):  # every KV row comes from the holder of its tokens
        xr = rows_k[x.seq[rows_k] == s_idx]
        hold = seq.holder_of(x.tok_start[xr])
        bad = np.nonzero((seq.holder_worker[hold] != x.src[xr]) | (x.tok_end[xr] > seq.holder_end[hold]))[0]
        relayed.append(xr[bad[x.hop[xr[bad]] > 0]])  # ... or relays it (checked below)
        bad = bad[x.hop[xr[bad]] == 0]
        if len(bad):
            i = int(xr[bad[0]])
            _fail(pool, f"KV transfer {i} sends tokens [{x.tok_start[i]}, {x.tok_end[i]}) of sequence {s_idx} "
                        f"from worker {int(x.src[i])}, which does not hold them all")
    _check_relays(pool, rows_k, np.concatenate(relayed) if relayed else np.zeros(0, np.int64))
    for key in sorted(set(tile_groups) | set(x_groups)):
        dst, s_idx = key
        seq = pool.sequences[s_idx]
        tr = tile_groups.get(key, np.zeros(0, np.int64))
        xr = rows_k[x_groups.get(key, np.zeros(0, np.int64))]
        need = (kv_lo[tr], t.q_end[tr], k0[tr], k1[tr])
        got = (x.tok_start[xr], x.tok_end[xr], x.head_start[xr], x.head_end[xr])
        mine = seq.holder_worker == dst
        held = (seq.holder_start[mine], seq.holder_end[mine], np.zeros(int(mine.sum()), np.int64),
                np.full(int(mine.sum()), shape.num_kv_heads, np.int64))
        tb, hb = _bounds(need, got, held)
        g_need, g_got, g_held = _grid(need, tb, hb) > 0, _grid(got, tb, hb), _grid(held, tb, hb) > 0
        expect = (g_need & ~g_held).astype(np.int64)
        bad = np.argwhere(g_got != expect)
        if not len(bad):
            continue
        i, j = bad[0]
        cell = _cell(tb, hb, i, j, "KV heads")
        if g_got[i, j] < expect[i, j]:
            _fail(pool, f"worker {dst} needs KV {cell} of sequence {s_idx} but no transfer brings it")
        hit = xr[(x.tok_start[xr] <= tb[i]) & (x.tok_end[xr] > tb[i])
                 & (x.head_start[xr] <= hb[j]) & (x.head_end[xr] > hb[j])]
        if g_held[i, j]:
            why = "which it already holds"
        elif g_got[i, j] > 1:
            why = f"{int(g_got[i, j])} times (KV must be de-duplicated per destination)"
        else:
            why = "which none of its tiles needs"
        _fail(pool, f"KV transfer {int(hit[0])} sends {cell} of sequence {s_idx} to worker {dst}, {why}")


def _check_relays(pool: PoolFields, rows_k: np.ndarray, relays: np.ndarray) -> None:
    """Every KV relay row (hop ``h > 0``, ``src`` not the holder) forwards KV its ``src`` receives in
    one row of a smaller hop. Vectorised over (relay, row its ``src`` receives in that sequence)
    pairs: a broadcast relays thousands of rows."""
    if not len(relays):
        return
    x = pool.transfers
    got = rows_k[np.lexsort((x.seq[rows_k], x.dst[rows_k]))]  # received KV rows by (worker, sequence)
    key_got = x.dst[got].astype(np.int64) * (int(x.seq.max()) + 1) + x.seq[got]
    key_rel = x.src[relays].astype(np.int64) * (int(x.seq.max()) + 1) + x.seq[relays]
    lo, hi = np.searchsorted(key_got, key_rel, side="left"), np.searchsorted(key_got, key_rel, side="right")
    pair, k = expand_counts(hi - lo)
    i, c = relays[pair], got[lo[pair] + k]
    cover = ((x.hop[c] < x.hop[i]) & (x.tok_start[c] <= x.tok_start[i]) & (x.tok_end[c] >= x.tok_end[i])
             & (x.head_start[c] <= x.head_start[i]) & (x.head_end[c] >= x.head_end[i]))
    fed = np.zeros(len(relays), dtype=bool)
    fed[pair[cover]] = True
    if not fed.all():
        i = int(relays[np.argmin(fed)])
        _fail(pool, f"KV relay transfer {i} (hop {int(x.hop[i])}) forwards tokens [{x.tok_start[i]}, "
                    f"{x.tok_end[i]}) x KV heads [{x.head_start[i]}, {x.head_end[i]}) of sequence "
                    f"{int(x.seq[i])} from worker {int(x.src[i])}, which neither holds them nor receives "
                    f"them in an earlier hop")


def check_pool(pool: PoolFields, shape: AttentionShape) -> None:
    """Check every invariant of one pool plan (module docstring lists them).

    Raises:
        PlanValidationError: naming the pool and the violated invariant (tile, transfer or cell).
    """
    _check_basic(pool, shape)
    _check_tiles(pool, shape)
    _check_q_like(pool, Q)
    _check_q_like(pool, O)
    _check_kv(pool, shape)


def check_plan_agreement(local_digest: str, gathered_digests: Sequence[str]) -> None:
    """Check that every rank of a pool planned the same thing (run after an all_gather of digests).

    Args:
        local_digest: this rank's :meth:`Plan.digest`.
        gathered_digests: every rank's digest in rank order (including this rank's).

    Raises:
        PlanMismatchError: some rank's digest differs; names the ranks and both digests.
        ValueError: an empty gather.
    """
    digests = list(gathered_digests)
    if not digests:
        raise ValueError("check_plan_agreement needs the gathered digests of at least one rank")
    bad = [r for r, d in enumerate(digests) if d != local_digest]
    if bad:
        others = sorted({digests[r] for r in bad})
        raise PlanMismatchError(
            f"plan digest mismatch: this rank has {local_digest[:16]}..., ranks {bad} have "
            f"{', '.join(d[:16] + '...' for d in others)}; all ranks of a pool must build identical plans "
            f"(same inputs, same planner version) before executing one")
