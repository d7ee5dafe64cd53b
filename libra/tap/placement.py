"""Communication-aware SH-tile placement (Libra sec. 4.3.2, Algorithm 2).

Tiles are taken heaviest first (ties: lower tile index first). Each goes to a *candidate* worker,
one whose load stays within the soft target ``C = (1 + tau) * mean`` (``mean`` = total tile FLOPs /
W), choosing the least incremental communication, then the least load, then the lowest worker id.
The load of a tile is its FLOPs (the paper) or, optionally, a caller's per-tile estimate such as
its kernel time (``weights=``, :mod:`libra.tap.weights`; an extension, not in the paper).
If no worker is a candidate, the least-loaded worker (ties: lowest id) takes the tile and the
fallback is counted. ``comm_aware=False`` drops the communication term (FLOPs-only placement, used
to emulate DistCA).

Incremental communication of tile ``t`` on worker ``w``:

* Q bytes + O bytes of the tile when ``w`` is not its Q-home;
* the KV bytes of ``[kv_start_t, q_end_t)`` (per KV atom of its heads) that ``w`` neither holds in
  the pre-attention layout nor already fetches for tiles placed on it earlier. Per sample this is
  exactly "pay only the rows beyond the prefix already fetched", since a tile's KV interval is the
  union of the prefixes of the samples it touches.

Implementations (identical choices; the tests check both against a plain oracle):

* :func:`_place_grouped` (used for SH-tiles, i.e. whenever tiles of one sequence have identical or
  disjoint token ranges): per-KV-group state, so a tile only scores the few workers that hold or
  already fetched part of its KV groups, plus the least-loaded worker of all others (who all cost
  the same). The Q-home wins without scoring when it has room and holds the whole KV interval.
* :func:`_place_dense` (any tiles): per sequence and KV atom a ``missing[w, seg]`` byte map over
  elementary token segments; every worker is scored for every tile with numpy.

Cost: O(T log W) plus the scored workers; a 256K pool (1024 tiles, 64 workers) takes a few ms in
CPython (``benchmarks/test_bench_tap.py``).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

import numpy as np

from libra.plan import SequenceLayout, TileTable
from libra.tap.tiles import kv_atoms, kv_need_start, pool_index
from libra.workload import AttentionShape, kv_bytes, o_bytes, q_bytes


def _check_inputs(tiles: TileTable, sequences, workers, tau) -> np.ndarray:
    if isinstance(tau, bool) or not isinstance(tau, (int, float, np.integer, np.floating)) or not tau >= 0:
        raise ValueError(f"tau must be a number >= 0, got {tau!r}")
    w = np.asarray(list(workers), dtype=np.int64)
    if w.ndim != 1 or len(w) == 0:
        raise ValueError("placement needs at least one worker")
    if len(np.unique(w)) != len(w):
        raise ValueError(f"pool workers must be distinct, got {w.tolist()}")
    w = np.sort(w)
    if len(tiles):
        if not 0 <= int(tiles.seq.min()) <= int(tiles.seq.max()) < len(sequences):
            raise ValueError(f"tile sequence index out of range for {len(sequences)} sequences")
        home = np.unique(tiles.q_home)
        missing = home[w[np.minimum(np.searchsorted(w, home), len(w) - 1)] != home]
        if len(missing):
            raise ValueError(f"Q-home worker {int(missing[0])} is not a pool worker {w.tolist()}")
        if not (np.isfinite(tiles.flops).all() and tiles.flops.min() >= 0):
            raise ValueError("tile FLOPs must be finite and >= 0")
        idx = pool_index(sequences)
        lengths = np.diff(idx.base)[tiles.seq]
        bad = np.nonzero((tiles.q_start < 0) | (tiles.q_end <= tiles.q_start) | (tiles.q_end > lengths))[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"tile {i} has token range [{tiles.q_start[i]}, {tiles.q_end[i]}) outside its "
                             f"sequence of {lengths[i]} tokens")
        shift = idx.base[tiles.seq]
        pos = np.searchsorted(idx.h_start, tiles.q_start + shift, side="right") - 1
        bad = np.nonzero((idx.h_worker[pos] != tiles.q_home) | (tiles.q_end + shift > idx.h_end[pos]))[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"tile {i} (tokens [{tiles.q_start[i]}, {tiles.q_end[i]}) of sequence {tiles.seq[i]}) "
                             f"must lie in one holder range held by its q_home {tiles.q_home[i]}")
    holders = np.unique(np.concatenate([seq.holder_worker for seq in sequences])) if sequences else w[:0]
    extra = holders[w[np.minimum(np.searchsorted(w, holders), len(w) - 1)] != holders]
    if len(extra):
        raise ValueError(f"worker {int(extra[0])} holds sequence tokens but is not a pool worker {w.tolist()}")
    return w


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
                shape: AttentionShape, tau: float = 0.03, comm_aware: bool = True,
                weights=None) -> tuple[TileTable, int]:
    """Algorithm 2: assign every tile a destination worker.

    Args:
        tiles: ``(T,)`` tiles (``dest`` ignored), e.g. from :func:`libra.tap.tiles.make_tiles`.
        sequences: the pool's sequences; ``tiles.seq`` indexes them; holders must be pool workers.
        workers: the pool's global worker ids (any order; ties break on the lowest id).
        shape: head geometry; bytes come from :mod:`libra.workload`.
        tau: soft-target slack, ``C = (1 + tau) * mean``.
        comm_aware: score by incremental communication first (False: FLOPs only).
        weights: optional ``(T,)`` float per-tile load estimates used instead of ``tiles.flops``
            for the heaviest-first order, the worker loads and ``C = (1 + tau) * sum(weights) / W``
            (e.g. :func:`libra.tap.weights.kernel_time_weights`: estimated kernel ms, an
            extension beyond the paper). ``None`` (default) balances FLOPs as Algorithm 2 does.

    Returns:
        ``(placed, fallback_count)``: the tiles with ``dest`` set (same row order) and the number of
        tiles that went to the least-loaded worker because no worker stayed within ``C``.

    Raises:
        ValueError: ``tau < 0`` (or not a number), no/duplicate workers, a Q-home or holder outside
            the pool, a sequence index out of range, negative or non-finite FLOPs, a tile whose
            token range is not inside one holder range of its Q-home, or ``weights`` that are not
            ``(T,)`` finite numbers >= 0.
    """
    wsorted = _check_inputs(tiles, sequences, workers, tau)
    load = tiles.flops if weights is None else _check_weights(weights, len(tiles))
    n_tiles, n_workers = len(tiles), len(wsorted)
    if n_tiles == 0:
        return tiles, 0
    cap = (1.0 + float(tau)) * (float(load.sum()) / n_workers)
    order = np.argsort(-load, kind="stable")  # heaviest first, ties by tile index
    if comm_aware:
        impl = _place_grouped if is_block_partition(tiles) else _place_dense
        dest_idx, fallback = impl(tiles, sequences, wsorted, shape, order, cap, load)
    else:
        dest_idx, fallback = _place_flops_only(load.tolist(), order, n_workers, cap)
    cols = {k: getattr(tiles, k) for k in TileTable.FIELDS}
    cols["dest"] = wsorted[dest_idx]
    return TileTable(**cols), fallback


def _check_weights(weights, n_tiles: int) -> np.ndarray:
    """``weights`` as a float64 ``(T,)`` array of finite values >= 0 (ValueError otherwise)."""
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"tile weights must be numbers, got {weights!r:.80}") from exc
    if w.shape != (n_tiles,):
        raise ValueError(f"tile weights must have shape ({n_tiles},) (one per tile), got {w.shape}")
    bad = np.nonzero(~np.isfinite(w) | (w < 0))[0]
    if len(bad):
        raise ValueError(f"tile weights must be finite and >= 0; tile {int(bad[0])} has {float(w[bad[0]])!r}")
    return w


def _place_dense(tiles, sequences, wsorted, shape, order, cap, tile_load=None):
    """Reference Algorithm 2 on token-segment bitmaps: scores every worker for every tile.

    Exact for any tiles (used when tiles of one sequence are not a block partition, and by the
    tests as the oracle for :func:`_place_grouped`). ``missing[s][b, w, k]`` = KV bytes of atom
    ``b`` that worker ``w`` lacks in token segment ``k`` of sequence ``s``. ``tile_load``:
    ``(T,)`` per-tile load (default ``tiles.flops``).
    """
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

    loads = np.zeros(n_workers)
    dest = np.empty(len(tiles), dtype=np.int64)
    fallback = 0
    flops = tiles.flops if tile_load is None else tile_load
    seq_l, widx_l, qo_l = tiles.seq.tolist(), widx.tolist(), qo.astype(np.float64).tolist()
    s0_l, s1_l, a0_l, a1_l = seg0.tolist(), seg1.tolist(), a0.tolist(), a1.tolist()
    flops_l = flops.tolist()
    inf = np.inf
    for t in order.tolist():
        f, h = flops_l[t], widx_l[t]
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


def is_block_partition(tiles: TileTable) -> bool:
    """True when, per sequence, any two tiles' token ranges are identical or disjoint (SH-tiles)."""
    if len(tiles) < 2:
        return True
    o = np.lexsort((tiles.q_end, tiles.q_start, tiles.seq))
    seq, qs, qe = tiles.seq[o], tiles.q_start[o], tiles.q_end[o]
    same = (qs[1:] == qs[:-1]) & (qe[1:] == qe[:-1])
    return bool(np.all((seq[1:] != seq[:-1]) | same | (qe[:-1] <= qs[1:])))


def _place_grouped(tiles, sequences, wsorted, shape, order, cap, tile_load=None):
    """Algorithm 2 on per-KV-group state (exact for block-partitioned tiles, the SH-tile case).

    A tile's KV need splits into its *first* sample's prefix ``[s_f, n_f)`` (which may reach back
    before the block), the *body* of samples that lie wholly inside the block, and the *last*
    sample's prefix ``[s_l, q_end)``. Per (sample, KV atom) we keep ``{worker: prefix end
    fetched}`` (the paper's KV groups: "a destination that fetched a shorter prefix pays only the
    extra rows"), and per (block, atom) the set of workers that fetched its body (only tiles of the
    same block read it). Only workers named there, holders of the first sample's prefix and the
    Q-home can cost less than ``Q + O + all KV bytes``; every other worker costs exactly that, so
    among them only the least-loaded one (a lazy heap) can win. The Q-home wins outright when it
    has room and lacks fewer KV bytes than the tile's Q + O bytes (everyone else pays at least
    Q + O). All positions are on the pool's global token axis (:func:`pool_index`). ``tile_load``:
    ``(T,)`` per-tile load (default ``tiles.flops``).
    """
    n_workers, n_tiles = len(wsorted), len(tiles)
    idx = pool_index(sequences)
    bounds, a0, a1 = kv_atoms(shape, tiles.head_start, tiles.head_end)
    n_atoms = len(bounds) - 1
    per_token = int(kv_bytes(1, 1, shape.head_dim, shape.dtype_bytes))
    atom_bytes = (np.diff(bounds) * per_token).tolist()  # KV bytes per token of each atom
    tokens = tiles.q_end - tiles.q_start
    qo = (q_bytes(tokens, 1, shape.head_dim, shape.dtype_bytes)
          + o_bytes(tokens, 1, shape.head_dim, shape.dtype_bytes)) * (tiles.head_end - tiles.head_start)
    shift = idx.base[tiles.seq]
    qs, qe = tiles.q_start + shift, tiles.q_end + shift
    offs = idx.offs
    first = np.searchsorted(offs, qs, side="right") - 1
    last = np.searchsorted(offs, qe - 1, side="right") - 1
    s_f, n_f, s_l = offs[first], np.minimum(qe, offs[first + 1]), offs[last]
    body = np.where(last > first + 1, s_l - offs[first + 1], 0)
    g_l = np.where(last > first, last, -1)
    pos = np.searchsorted(idx.h_start, qs, side="right") - 1
    home_free = (idx.h_start[pos] <= s_f) & (qe <= idx.h_end[pos]) & (idx.h_worker[pos] == tiles.q_home)
    full_kv = (qe - s_f) * per_token * (bounds[a1] - bounds[a0])
    h_start, h_end = idx.h_start.tolist(), idx.h_end.tolist()
    h_w = np.searchsorted(wsorted, idx.h_worker).tolist()

    state: dict[int, dict] = {}  # sample*A+atom -> {worker: prefix end}; -(...)-1: block-body set
    loads = [0.0] * n_workers
    heap = [(0.0, i) for i in range(n_workers)]
    dest = [0] * n_tiles
    fallback = 0
    (flops_l, widx_l, qo_l, a0_l, a1_l, sf_l, nf_l, sl_l, e_l, body_l, gf_l, gl_l, free_l, gen_l) = (
        (tiles.flops if tile_load is None else tile_load).tolist(), np.searchsorted(wsorted, tiles.q_home).tolist(), qo.tolist(), a0.tolist(),
        a1.tolist(), s_f.tolist(), n_f.tolist(), s_l.tolist(), qe.tolist(), body.tolist(),
        (first * n_atoms).tolist(), np.where(g_l >= 0, g_l * n_atoms, -1).tolist(), home_free.tolist(),
        (qo + full_kv).tolist())
    empty: dict = {}
    get = state.get
    rest = list(zip(gf_l, gl_l, body_l, a0_l, a1_l, qo_l, sf_l, nf_l, sl_l, e_l, gen_l))

    def least_loaded():
        while True:
            load, i = heap[0]
            if load == loads[i]:
                return load, i
            heapq.heappop(heap)  # stale entry: that worker's load has grown since

    for t in order.tolist():
        f, h = flops_l[t], widx_l[t]
        free = free_l[t]
        if free and loads[h] + f <= cap:
            w = h  # the Q-home holds all it needs: cost 0, every other worker pays Q + O
            loads[w] += f
            heapq.heappush(heap, (loads[w], w))
            dest[t] = w
            continue
        gf, gl, bd, b0, b1, qo_t, sf, nf, sl, e, gen = rest[t]
        if b1 - b0 == 1:  # the usual case: one KV atom per tile
            gfd = get(gf + b0, empty)
            gbd = get(-gf - b0 - 1, empty) if bd else empty
            gld = get(gl + b0, empty) if gl >= 0 else empty
            fetched = bool(gfd or gbd or gld)
        else:
            groups = [(atom_bytes[b], get(gf + b, empty), get(-gf - b - 1, empty) if bd else empty,
                       get(gl + b, empty) if gl >= 0 else empty) for b in range(b0, b1)]
            fetched = any(g[1] or g[2] or g[3] for g in groups)
        if free and not fetched:
            # Q-home full; nobody else holds or fetched any of it: all others cost the same
            load, w = least_loaded()
            if load + f > cap:
                fallback += 1
        else:
            if free:  # only the (full) Q-home holds any of it: no holder pieces to score
                pieces = ()
            else:
                j0 = bisect.bisect_right(h_start, sf) - 1
                pieces = [(h_w[j], h_start[j], h_end[j]) for j in range(j0, bisect.bisect_right(h_start, nf - 1))]
            best = None
            if b1 - b0 == 1:  # inlined scoring
                ab = atom_bytes[b0]
                special = gfd.keys() | gbd.keys() | gld.keys()
                if pieces:
                    special.update(p[0] for p in pieces)
                    special.add(h)
                for w in special:
                    lw = loads[w]
                    if lw + f > cap:
                        continue
                    x = gfd.get(w, sf)
                    kv = nf - x if x < nf else 0
                    if kv:
                        for hw, lo, hi in pieces:
                            if hw == w:
                                ov = (hi if hi < nf else nf) - (lo if lo > x else x)
                                if ov > 0:
                                    kv -= ov
                    if w != h:
                        if bd and w not in gbd:
                            kv += bd
                        if gl >= 0:
                            y = gld.get(w, sl)
                            if y < e:
                                kv += e - y
                        c = qo_t + kv * ab
                    else:
                        c = kv * ab
                    if best is None or c < best[0] or (c == best[0] and (lw < best[1] or (lw == best[1] and w < best[2]))):
                        best = (c, lw, w)
            else:
                def cost_of(w, h=h, qo_t=qo_t, sf=sf, nf=nf, sl=sl, e=e, bd=bd, gl=gl, groups=groups, pieces=pieces):
                    c = 0 if w == h else qo_t
                    for ab, gfd, gbd, gld in groups:
                        x = gfd.get(w, sf)
                        kv = nf - x if x < nf else 0
                        if kv:
                            for hw, lo, hi in pieces:
                                if hw == w:
                                    ov = min(hi, nf) - max(lo, x)
                                    if ov > 0:
                                        kv -= ov
                        if w != h:
                            if bd and w not in gbd:
                                kv += bd
                            if gl >= 0:
                                y = gld.get(w, sl)
                                if y < e:
                                    kv += e - y
                        c += kv * ab
                    return c

                special = {h}
                special.update(p[0] for p in pieces)
                for _, gfd_b, gbd_b, gld_b in groups:
                    special.update(gfd_b)
                    special.update(gbd_b)
                    special.update(gld_b)
                for w in special:
                    if loads[w] + f <= cap:
                        key = (cost_of(w), loads[w], w)
                        if best is None or key < best:
                            best = key
            load, wm = least_loaded()
            if load + f <= cap and (best is None or wm not in special):
                key = (gen, load, wm)  # every worker outside `special` costs the generic amount
                if best is None or key < best:
                    best = key
            if best is None:
                w = wm
                fallback += 1
            else:
                w = best[2]
        # record what w now has: the first sample's prefix, the block body, the last sample's prefix
        if b1 - b0 == 1:
            if gfd is empty:
                gfd = state[gf + b0] = {}
            if gfd.get(w, sf) < nf:
                gfd[w] = nf
            if bd:
                if gbd is empty:
                    gbd = state[-gf - b0 - 1] = {}
                gbd[w] = True
            if gl >= 0:
                if gld is empty:
                    gld = state[gl + b0] = {}
                if gld.get(w, -1) < e:
                    gld[w] = e
        else:
            for b in range(b0, b1):
                d = get(gf + b)
                if d is None:
                    d = state[gf + b] = {}
                if d.get(w, sf) < nf:
                    d[w] = nf
                if bd:
                    d = get(-gf - b - 1)
                    if d is None:
                        d = state[-gf - b - 1] = {}
                    d[w] = True
                if gl >= 0:
                    d = get(gl + b)
                    if d is None:
                        d = state[gl + b] = {}
                    if d.get(w, -1) < e:
                        d[w] = e
        dest[t] = w
        loads[w] += f
        heapq.heappush(heap, (loads[w], w))
    return np.asarray(dest, dtype=np.int64), fallback
