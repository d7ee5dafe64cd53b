"""Compiled exchange planning (Libra sec. 4.3.3) with numba: the kernel behind
:func:`libra.tap.exchange.build_transfers` when numba is installed (``pip install -e '.[fast]'``).

:func:`transfer_rows` computes the same rows, in the same order, as the numpy implementation in
:mod:`libra.tap.exchange` (which stays the fallback; the tests compare the two and the reference
interval-merging formulation): Q pieces merged per (src, dst, sequence, heads), KV intervals
unioned per (destination, KV atom), cut at holder boundaries, and adjacent KV atoms of one piece
merged. Each merge orders its rows with two stable counting sorts on the leading keys (workers,
atoms) and an insertion sort of each short run on the remaining key packed into one int64 (a
stable merge sort for long runs), then makes one pass; :func:`_radix` checks that the keys fit.

Kernels compile lazily on first call and are cached on disk (see :mod:`libra.jit.placement`);
:func:`libra.tap.exchange.warmup` compiles them on a tiny pool. Nothing is memoised across calls.
"""

from __future__ import annotations

import numba
import numpy as np

from libra.jit.search import right

_njit = numba.njit(cache=True, nogil=True)

_SMALL_BUCKET = 32
"""Buckets up to this many rows are insertion-sorted; larger ones use a stable merge sort."""
_KEY_LIMIT = 2.0**62
"""Packed keys (and a key plus an interval length) stay below this (as in :mod:`libra.tap.exchange`)."""
_MAX_ID = 1 << 16
"""Worker ids and head indices above this take the numpy path (counting sorts allocate per id)."""


@_njit
def _merge_sort(order, lo, hi, sec):
    """Sort ``order[lo:hi]`` by ``sec[order]``, stably (bottom-up merge sort)."""
    n = hi - lo
    a = order[lo:hi].copy()
    b = np.empty(n, dtype=np.int64)
    width, flip = 1, False
    while width < n:
        x = b if flip else a
        y = a if flip else b
        start = 0
        while start < n:
            mid, end = min(start + width, n), min(start + 2 * width, n)
            i, j, k = start, mid, start
            while k < end:
                if i < mid and (j >= end or sec[x[i]] <= sec[x[j]]):
                    y[k] = x[i]
                    i += 1
                else:
                    y[k] = x[j]
                    j += 1
                k += 1
            start = end
        flip = not flip
        width *= 2
    res = b if flip else a
    for k in range(n):
        order[lo + k] = res[k]


@_njit
def _counting_sort(key, n_keys, order):
    """``order`` re-sorted stably by ``key[order]`` (``0 <= key < n_keys``)."""
    start = np.zeros(n_keys + 1, dtype=np.int64)
    for i in order:
        start[key[i] + 1] += 1
    for k in range(n_keys):
        start[k + 1] += start[k]
    out = np.empty_like(order)
    for i in order:
        out[start[key[i]]] = i
        start[key[i]] += 1
    return out


@_njit
def _order(major, n_major, minor, n_minor, sec):
    """Row order sorting by ``(major, minor, sec)``, ties by row index: two stable counting sorts,
    then each run of equal ``(major, minor)`` sorted by ``sec`` (insertion sort; merge sort when
    long). Runs are short and often already in order, so this is about linear."""
    order = _counting_sort(major, n_major, _counting_sort(minor, n_minor, np.arange(major.shape[0])))
    n, lo = order.shape[0], 0
    while lo < n:
        hi = lo + 1
        while hi < n and major[order[hi]] == major[order[lo]] and minor[order[hi]] == minor[order[lo]]:
            hi += 1
        if hi - lo > _SMALL_BUCKET:
            _merge_sort(order, lo, hi, sec)
        else:
            for i in range(lo + 1, hi):
                x = order[i]
                k = sec[x]
                j = i - 1
                while j >= lo and sec[order[j]] > k:
                    order[j + 1] = order[j]
                    j -= 1
                order[j + 1] = x
        lo = hi
    return order


@_njit
def _radix(home, dest, q_start, q_end, head_start, head_end, base, h_start, h_end, h_worker, group, n_seq):
    """The key bounds ``(ok, w, hr, t, t1, span)`` (as :func:`libra.tap.exchange._radix`): workers
    < ``w``, head indices < ``hr``, token positions < ``t`` (global ones < ``t1``), holder lengths <
    ``span``; ``ok`` False when a value is negative, a tile empty, a packed key would overflow or a
    worker id or head index exceeds :data:`_MAX_ID` (the counting sorts and tables are that long)."""
    w, hr, t, low = 0, 0, 0, 0
    for i in range(dest.shape[0]):
        w = max(w, home[i], dest[i])
        hr = max(hr, head_start[i], head_end[i])
        t = max(t, q_start[i], q_end[i])
        low = min(low, home[i], head_start[i], head_end[i], q_start[i], q_end[i] - q_start[i] - 1)
    span = 0
    for j in range(h_start.shape[0]):
        w = max(w, h_worker[j])
        low = min(low, h_worker[j])
        span = max(span, h_end[j] - h_start[j])
    w, hr, t, span = w + 1, hr + 1, t + 1, span + 1
    t1 = base[base.shape[0] - 1] + t
    atoms = (hr - 1 + group - 1) // group + 1  # > the number of KV atoms
    ok = low >= 0 and w <= _MAX_ID and hr <= _MAX_ID and float(w) * w * n_seq * hr * hr * t * 2 < _KEY_LIMIT and \
        float(w) * t1 * span * (atoms + 1) < _KEY_LIMIT
    return ok, w, hr, t, t1, span


@_njit
def _kv_atoms(head_start, head_end, group, hr):
    """``kv_atoms`` as lookup tables: the sorted KV-head bounds and, per query-head value ``h <
    hr``, the atom a range starting at ``h`` starts at and the atom one ending at ``h`` ends before
    (one division per head value, none per tile)."""
    seen_start, seen_end = np.zeros(hr, dtype=np.bool_), np.zeros(hr, dtype=np.bool_)
    for i in range(head_start.shape[0]):
        seen_start[head_start[i]] = True
        seen_end[head_end[i]] = True
    top = (hr - 1 + group - 1) // group
    mark = np.zeros(top + 1, dtype=np.bool_)
    for h in range(hr):
        mark[h // group] |= seen_start[h]
        mark[(h + group - 1) // group] |= seen_end[h]
    rank = np.empty(top + 1, dtype=np.int64)
    bounds = np.empty(top + 1, dtype=np.int64)
    c = 0
    for v in range(top + 1):
        rank[v] = c
        if mark[v]:
            bounds[c] = v
            c += 1
    at_start, at_end = np.empty(hr, dtype=np.int64), np.empty(hr, dtype=np.int64)
    for h in range(hr):
        at_start[h] = rank[h // group]
        at_end[h] = rank[(h + group - 1) // group]
    return bounds[:c], at_start, at_end


@_njit
def _q_pieces(home, dest, seq, q_start, q_end, head_start, head_end, n_seq, w, hr, t):
    """Q pieces merged per (src, dst, sequence, heads) in that order: tile of each row and its end."""
    n = dest.shape[0]
    away = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        if dest[i] != home[i]:
            away[m] = i
            m += 1
    src, dst, sec = np.empty(m, dtype=np.int64), np.empty(m, dtype=np.int64), np.empty(m, dtype=np.int64)
    for k in range(m):
        i = away[k]
        src[k], dst[k] = home[i], dest[i]
        sec[k] = ((np.int64(seq[i]) * hr + head_start[i]) * hr + head_end[i]) * t + q_start[i]
    order = _order(src, w, dst, w, sec)
    tile = np.empty(m, dtype=np.int64)
    end = np.empty(m, dtype=np.int64)
    nq, group = 0, np.int64(-1)
    for k in range(m):
        x = order[k]
        i = away[x]
        g = sec[x] - q_start[i]  # the key without the start: equal within one (seq, heads)
        if nq > 0 and home[i] == home[tile[nq - 1]] and dest[i] == dest[tile[nq - 1]] and \
                g == group and q_start[i] <= end[nq - 1]:
            end[nq - 1] = max(end[nq - 1], q_end[i])
        else:
            tile[nq], end[nq], group = i, q_end[i], g
            nq += 1
    return tile[:nq], end[:nq]


@_njit
def _kv_union(dest, seq, q_start, q_end, head_start, head_end, at_start, at_end, base, offs, w, n_atoms):
    """Per (destination, KV atom), sorted so: the union of the tiles' needed global intervals."""
    n = dest.shape[0]
    m = 0
    for i in range(n):
        m += at_end[head_end[i]] - at_start[head_start[i]]
    bucket = np.empty(m, dtype=np.int64)
    atom = np.empty(m, dtype=np.int64)
    lo = np.empty(m, dtype=np.int64)
    hi = np.empty(m, dtype=np.int64)
    k, s = 0, 0  # s: sample containing the previous tile's start (tiles usually come in order)
    for i in range(n):
        shift = base[seq[i]]
        x = q_start[i] + shift
        if offs[s] <= x:
            while s + 1 < offs.shape[0] and offs[s + 1] <= x:
                s += 1
        else:
            s = right(offs, x, 0) - 1
        for a in range(at_start[head_start[i]], at_end[head_end[i]]):
            bucket[k], atom[k], lo[k], hi[k] = dest[i], a, offs[s], q_end[i] + shift
            k += 1
    order = _order(bucket, w, atom, n_atoms, lo)
    u_dst = np.empty(m, dtype=np.int64)
    u_atom = np.empty(m, dtype=np.int64)
    u_lo = np.empty(m, dtype=np.int64)
    u_hi = np.empty(m, dtype=np.int64)
    nu = 0
    for k in range(m):
        x = order[k]
        if nu > 0 and bucket[x] == u_dst[nu - 1] and atom[x] == u_atom[nu - 1] and lo[x] <= u_hi[nu - 1]:
            u_hi[nu - 1] = max(u_hi[nu - 1], hi[x])
        else:
            u_dst[nu], u_atom[nu], u_lo[nu], u_hi[nu] = bucket[x], atom[x], lo[x], hi[x]
            nu += 1
    return u_dst[:nu], u_atom[:nu], u_lo[:nu], u_hi[:nu]


@_njit
def _kv_rows(u_dst, u_atom, u_lo, u_hi, h_start, h_end, h_worker, w, span, n_atoms):
    """Cut the unions at holder boundaries, dropping what the destination holds, then sort the
    pieces by (src, dst, global start, length, atom) and merge adjacent atoms of one piece. Per
    row: holder, source, destination, global start, length, first and last atom."""
    nu, nh = u_dst.shape[0], h_start.shape[0]
    first = np.empty(nu, dtype=np.int64)
    m = 0
    for u in range(nu):
        first[u] = right(h_start, u_lo[u], 0) - 1
        j = first[u]
        while j < nh and h_start[j] < u_hi[u]:
            m += 1
            j += 1
    hold, src, dst, glo = np.empty(m, np.int64), np.empty(m, np.int64), np.empty(m, np.int64), np.empty(m, np.int64)
    length, atom, sec = np.empty(m, np.int64), np.empty(m, np.int64), np.empty(m, np.int64)
    k = 0
    for u in range(nu):
        j = first[u]
        while j < nh and h_start[j] < u_hi[u]:
            if h_worker[j] != u_dst[u]:
                lo = max(u_lo[u], h_start[j])
                hold[k], src[k], dst[k], glo[k], atom[k] = j, h_worker[j], u_dst[u], lo, u_atom[u]
                length[k] = min(u_hi[u], h_end[j]) - lo
                sec[k] = (lo * span + length[k]) * (n_atoms + 1) + u_atom[u]
                k += 1
            j += 1
    order = _order(src[:k], w, dst[:k], w, sec[:k])
    rows = np.empty((7, k), dtype=np.int64)
    nk = 0
    for i in range(k):
        x = order[i]
        y = order[i - 1]
        if nk > 0 and src[x] == src[y] and dst[x] == dst[y] and sec[x] == sec[y] + 1:
            rows[6, nk - 1] = atom[x]
        else:
            rows[0, nk], rows[1, nk], rows[2, nk], rows[3, nk] = hold[x], src[x], dst[x], glo[x]
            rows[4, nk], rows[5, nk], rows[6, nk] = length[x], atom[x], atom[x]
            nk += 1
    return rows, nk


@_njit
def transfer_rows(home, dest, seq, q_start, q_end, head_start, head_end, index, group, n_seq, q_unit, kv_unit):
    """``(ok, columns)``: the TransferTable columns ``(kind, src, dst, seq, tok_start, tok_end,
    head_start, head_end, nbytes)``, Q rows, KV rows, then O rows (Q reversed); ``ok`` False (and
    empty columns) when a value is negative, a tile is empty, a packed key would overflow or an id
    is too large (the caller then takes the numpy path). ``index``: the pool's
    :class:`~libra.plan.layout.PoolIndex` (or a plain tuple of its six arrays in its field order),
    passed whole because its arrays always travel together; ``group``: query heads per KV head;
    ``q_unit``, ``kv_unit``: bytes of one token of one head of Q and of K+V."""
    base, offs, h_start, h_end, h_worker, h_seq = index
    ok, w, hr, t, t1, span = _radix(home, dest, q_start, q_end, head_start, head_end, base, h_start, h_end,
                                    h_worker, group, n_seq)
    nq, nk = 0, 0
    if ok:
        q_tile, q_end_m = _q_pieces(home, dest, seq, q_start, q_end, head_start, head_end, n_seq, w, hr, t)
        bounds, at_start, at_end = _kv_atoms(head_start, head_end, group, hr)
        u_dst, u_atom, u_lo, u_hi = _kv_union(dest, seq, q_start, q_end, head_start, head_end, at_start, at_end,
                                              base, offs, w, bounds.shape[0] - 1)
        kv, nk = _kv_rows(u_dst, u_atom, u_lo, u_hi, h_start, h_end, h_worker, w, span, bounds.shape[0] - 1)
        nq = q_tile.shape[0]
    n = 2 * nq + nk
    kind = np.empty(n, dtype=np.int8)
    src, dst, sq = np.empty(n, dtype=np.int32), np.empty(n, dtype=np.int32), np.empty(n, dtype=np.int32)
    lo, hi = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    hs, he = np.empty(n, dtype=np.int32), np.empty(n, dtype=np.int32)
    nbytes = np.empty(n, dtype=np.int64)
    for r in range(nq):
        i, o = q_tile[r], nq + nk + r  # the Q row and its O row
        kind[r], src[r], dst[r], kind[o], src[o], dst[o] = 0, home[i], dest[i], 2, dest[i], home[i]
        sq[r] = sq[o] = seq[i]
        lo[r] = lo[o] = q_start[i]
        hi[r] = hi[o] = q_end_m[r]
        hs[r] = hs[o] = head_start[i]
        he[r] = he[o] = head_end[i]
        nbytes[r] = nbytes[o] = (q_end_m[r] - q_start[i]) * (head_end[i] - head_start[i]) * q_unit
    for r in range(nk):
        row, s = nq + r, h_seq[kv[0, r]]
        k0, k1 = bounds[kv[5, r]], bounds[kv[6, r] + 1]
        kind[row], src[row], dst[row], sq[row] = 1, kv[1, r], kv[2, r], s
        lo[row], hi[row] = kv[3, r] - base[s], kv[3, r] - base[s] + kv[4, r]
        hs[row], he[row], nbytes[row] = k0, k1, kv[4, r] * (k1 - k0) * kv_unit
    return ok, (kind, src, dst, sq, lo, hi, hs, he, nbytes)
