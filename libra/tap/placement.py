"""Communication-aware SH-tile placement (Libra sec. 4.3.2, Algorithm 2).

Tiles are taken heaviest first (ties: lower tile index first). Each goes to a *candidate* worker,
one whose load stays within the soft target ``C = (1 + tau) * mean`` (``mean`` = total tile FLOPs /
W), choosing the least incremental communication, then the least load, then the lowest worker id.
If no worker is a candidate, the least-loaded worker (ties: lowest id) takes the tile and the
fallback is counted. ``comm_aware=False`` drops the communication term (FLOPs-only placement, used
to emulate DistCA).

Incremental communication of tile ``t`` on worker ``w``:

* Q bytes + O bytes of the tile when ``w`` is not its Q-home;
* the KV bytes of ``[kv_start_t, q_end_t)`` (per KV atom of its heads) that ``w`` neither holds in
  the pre-attention layout nor already fetches for tiles placed on it earlier. Per sample this is
  exactly "pay only the rows beyond the prefix already fetched", since a tile's KV interval is the
  union of the prefixes of the samples it touches.

Implementation. Per sequence and KV atom we keep ``missing[w, seg]``: the KV bytes worker ``w``
still lacks in each elementary token segment (segments cut at every tile's KV-interval ends and the
holder boundaries). A tile's KV cost on every worker is one row-sum over its segments; placing it
zeroes those segments on the destination. Fast path: when the Q-home holds the tile's whole KV
interval and has room, its cost is 0 while every other worker pays Q + O bytes, so Algorithm 2
picks the Q-home; the vectorised scoring is skipped (same result, exactly).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from libra.plan import SequenceLayout, TileTable
from libra.tap.tiles import kv_atoms, kv_need_start
from libra.workload import AttentionShape, kv_bytes, o_bytes, q_bytes


def _check_inputs(tiles: TileTable, sequences, workers, tau) -> np.ndarray:
    if isinstance(tau, bool) or not isinstance(tau, (int, float, np.floating)) or not tau >= 0:
        raise ValueError(f"tau must be a number >= 0, got {tau!r}")
    w = np.asarray(list(workers), dtype=np.int64)
    if w.ndim != 1 or len(w) == 0:
        raise ValueError("placement needs at least one worker")
    if len(np.unique(w)) != len(w):
        raise ValueError(f"pool workers must be distinct, got {w.tolist()}")
    if len(tiles):
        if not 0 <= int(tiles.seq.min()) <= int(tiles.seq.max()) < len(sequences):
            raise ValueError(f"tile sequence index out of range for {len(sequences)} sequences")
        missing = np.setdiff1d(tiles.q_home, w)
        if len(missing):
            raise ValueError(f"Q-home worker {int(missing[0])} is not a pool worker {w.tolist()}")
        if np.any(tiles.flops < 0) or not np.all(np.isfinite(tiles.flops)):
            raise ValueError("tile FLOPs must be finite and >= 0")
    for s_idx, seq in enumerate(sequences):
        extra = np.setdiff1d(seq.holder_worker, w)
        if len(extra):
            raise ValueError(f"sequence {s_idx} is held by worker {int(extra[0])}, not a pool worker")
    return np.sort(w)


def _place_flops_only(flops, order, n_workers, cap):
    """Least-loaded placement with a (load, worker) heap; returns pool-index dests and fallbacks."""
    heap = [(0.0, i) for i in range(n_workers)]
    dest = np.empty(len(flops), dtype=np.int64)
    fallback = 0
    for t in order.tolist():
        load, i = heap[0]
        f = flops[t]
        if load + f > cap:  # the least-loaded worker cannot take it, so nobody can
            fallback += 1
        dest[t] = i
        heapq.heapreplace(heap, (load + f, i))
    return dest, fallback


def place_tiles(tiles: TileTable, sequences: Sequence[SequenceLayout], workers: Sequence[int],
                shape: AttentionShape, tau: float = 0.03, comm_aware: bool = True) -> tuple[TileTable, int]:
    """Algorithm 2: assign every tile a destination worker.

    Args:
        tiles: ``(T,)`` tiles (``dest`` ignored), e.g. from :func:`libra.tap.tiles.make_tiles`.
        sequences: the pool's sequences; ``tiles.seq`` indexes them; holders must be pool workers.
        workers: the pool's global worker ids (any order; ties break on the lowest id).
        shape: head geometry; bytes come from :mod:`libra.workload`.
        tau: soft-target slack, ``C = (1 + tau) * mean``.
        comm_aware: score by incremental communication first (False: FLOPs only).

    Returns:
        ``(placed, fallback_count)``: the tiles with ``dest`` set (same row order) and the number of
        tiles that went to the least-loaded worker because no worker stayed within ``C``.

    Raises:
        ValueError: ``tau < 0`` (or not a number), no/duplicate workers, a Q-home or holder outside
            the pool, a sequence index out of range, negative or non-finite FLOPs.
    """
    wsorted = _check_inputs(tiles, sequences, workers, tau)
    n_tiles, n_workers = len(tiles), len(wsorted)
    if n_tiles == 0:
        return tiles, 0
    flops = tiles.flops
    cap = (1.0 + float(tau)) * (float(flops.sum()) / n_workers)
    order = np.argsort(-flops, kind="stable")  # heaviest first, ties by tile index
    if comm_aware:
        dest_idx, fallback = _place_comm_aware(tiles, sequences, wsorted, shape, order, cap)
    else:
        dest_idx, fallback = _place_flops_only(flops.tolist(), order, n_workers, cap)
    cols = {k: getattr(tiles, k) for k in TileTable.FIELDS}
    cols["dest"] = wsorted[dest_idx]
    return TileTable(**cols), fallback


def _place_comm_aware(tiles, sequences, wsorted, shape, order, cap):
    n_workers = len(wsorted)
    widx = np.searchsorted(wsorted, tiles.q_home)
    kv_lo = kv_need_start(sequences, tiles)
    bounds, a0, a1 = kv_atoms(shape, tiles.head_start, tiles.head_end)
    atom_heads = np.diff(bounds)
    # Q + O bytes paid when a tile leaves its Q-home
    qo = (q_bytes(tiles.q_end - tiles.q_start, 1, shape.head_dim, shape.dtype_bytes)
          + o_bytes(tiles.q_end - tiles.q_start, 1, shape.head_dim, shape.dtype_bytes)) \
        * (tiles.head_end - tiles.head_start).astype(np.int64)
    seg0 = np.zeros(len(tiles), dtype=np.int64)
    seg1 = np.zeros(len(tiles), dtype=np.int64)
    home_free = np.zeros(len(tiles), dtype=bool)
    missing = []  # per sequence: float64 (atoms, W, segments) bytes each worker still lacks
    for s_idx, seq in enumerate(sequences):
        rows = np.nonzero(tiles.seq == s_idx)[0]
        cuts = np.unique(np.concatenate(([0, seq.num_tokens], seq.holder_start, seq.holder_end,
                                         kv_lo[rows], tiles.q_end[rows])))
        seg0[rows] = np.searchsorted(cuts, kv_lo[rows])
        seg1[rows] = np.searchsorted(cuts, tiles.q_end[rows])
        per_token = kv_bytes(1, 1, shape.head_dim, shape.dtype_bytes)
        seg_bytes = np.diff(cuts).astype(np.float64) * per_token
        miss = np.broadcast_to(atom_heads[:, None, None] * seg_bytes[None, None, :],
                               (len(atom_heads), n_workers, len(seg_bytes))).copy()
        h_idx = np.searchsorted(wsorted, seq.holder_worker)
        hs0, hs1 = np.searchsorted(cuts, seq.holder_start), np.searchsorted(cuts, seq.holder_end)
        for w, c0, c1 in zip(h_idx.tolist(), hs0.tolist(), hs1.tolist()):
            miss[:, w, c0:c1] = 0.0  # held tokens (all heads) cost nothing
        missing.append(miss)
        # static fast-path flag: the Q-home's own holder range covers the tile's KV interval
        hold = seq.holder_of(tiles.q_start[rows])
        home_free[rows] = ((seq.holder_start[hold] <= kv_lo[rows]) & (tiles.q_end[rows] <= seq.holder_end[hold])
                           & (seq.holder_worker[hold] == tiles.q_home[rows]))

    loads = np.zeros(n_workers)
    dest = np.empty(len(tiles), dtype=np.int64)
    fallback = 0
    flops = tiles.flops
    seq_l, widx_l, qo_l = tiles.seq.tolist(), widx.tolist(), qo.astype(np.float64).tolist()
    s0_l, s1_l, a0_l, a1_l = seg0.tolist(), seg1.tolist(), a0.tolist(), a1.tolist()
    free_l, flops_l = home_free.tolist(), flops.tolist()
    inf = np.inf
    for t in order.tolist():
        f, h = flops_l[t], widx_l[t]
        if free_l[t] and loads[h] + f <= cap:
            dest[t] = h
            loads[h] += f
            continue
        miss = missing[seq_l[t]]
        i0, i1, b0, b1 = s0_l[t], s1_l[t], a0_l[t], a1_l[t]
        if b1 - b0 == 1:
            cost = miss[b0, :, i0:i1].sum(axis=1)
        else:
            cost = miss[b0:b1, :, i0:i1].sum(axis=(0, 2))
        cost += qo_l[t]
        cost[h] -= qo_l[t]
        ok = loads + f <= cap
        if ok.any():
            c = np.where(ok, cost, inf)
            w = int(np.where(c == c.min(), loads, inf).argmin())
        else:
            w = int(loads.argmin())
            fallback += 1
        miss[b0:b1, w, i0:i1] = 0.0
        dest[t] = w
        loads[w] += f
    return dest, fallback
