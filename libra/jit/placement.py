"""Compiled TAP placement (Libra sec. 4.3.2, Algorithm 2) with numba: the kernels behind
:func:`libra.tap.placement.place_tiles` when numba is installed (``pip install -e '.[fast]'``).

Each kernel makes exactly the choices of its Python counterpart in :mod:`libra.tap.placement`
(which stays the oracle and the fallback; the tests compare destinations and fallback counts):

* :func:`place_grouped` (SH-tiles, the normal case) mirrors ``_place_grouped``: per tile the
  token-axis fields of ``_grouped_columns`` (:func:`_grouped_rows`, with galloping searches), KV
  groups (sample x KV atom) as small linked lists of members (worker, prefix end fetched, block
  body fetched) rather than a (groups x workers) map, whose fresh pages would cost more than the
  placement at 1M; the same ``special`` workers are scored (the Q-home, holders of the first
  prefix, the groups' members), and every other worker costs the generic amount, so the
  least-loaded worker (a tournament tree) stands for them. The Q-home shortcut (it holds the
  whole KV interval and has room) records nothing, as in Python.
* :func:`place_dense` (any tiles, and link-priced placement) runs ``_place_dense`` on prefix sums
  of the same missing-bytes map (per sequence and worker, shared by the KV atoms until a worker
  fetches one): a tile scores a worker in O(1) per atom, and placing it rewrites only the
  destination's rows, so a 1M pool of 4096 tiles on 128 workers places in a few ms.
* :func:`place_flops_only` is the least-loaded placement (``comm_aware=False``).
* :func:`repair_overload` is :mod:`libra.extensions.adaptive.repair`'s loop (``libra-adaptive``'s overload repair).

Hot loops are written out in few functions (helpers that take arrays are inlined at numba's IR
level, ``_inline``); every function stays within the project's 80-line limit.

Costs are int64 bytes (Python's are ints, or integer-valued float64 sums in the dense path, both
exact), loads are float64 summed in the same order, and ties break on (cost, load, lowest worker)
exactly as in Python. Kernels compile lazily on first call and numba caches the machine code on
disk (``cache=True``: beside this module, or in numba's user-wide cache folder where that is
read-only), so each training rank pays the ~20-40 s compilation once per machine and code version,
not once per process; :func:`warmup` compiles (or loads) them on tiny inputs and returns the
seconds it took. Nothing is memoised
across calls: every call allocates its state afresh.
"""

from __future__ import annotations

import time

import numba
import numpy as np

from libra.jit.search import right as _right

_njit = numba.njit(cache=True, nogil=True)
_inline = numba.njit(cache=True, nogil=True, inline="always")

# columns of the grouped kernel's per-tile int64 table (module constants: compile-time in numba)
HOME, FREE, KF, KL, BODY, A0, A1, QO, SF, NF, SL, E, J0, J1 = range(14)
N_COLS = 14


def _i64(x) -> np.ndarray:
    """A fresh, writable, contiguous int64 copy (one numba signature whatever the caller's arrays)."""
    return np.array(x, dtype=np.int64)


def _f64(x) -> np.ndarray:
    return np.array(x, dtype=np.float64)


# ----------------------------------------------------------------------------- shared choice


@_inline
def _least_loaded(loads):
    """Index of the least-loaded worker, lowest id on ties."""
    w, best = 0, loads[0]
    for i in range(1, loads.shape[0]):
        v = loads[i]
        if v < best:  # the running minimum stays in a register (no reload of loads[w])
            w, best = i, v
    return w


@_inline
def _pick(a, b, loads):
    """The less loaded of workers ``a < b`` (``a`` on ties: the lower id; -1 = padding)."""
    if a < 0:
        return b
    if b < 0:
        return a
    return b if loads[b] < loads[a] else a


@_njit
def _tree_new(loads):
    """A tournament tree over the workers' ``loads``: ``tree[1]`` is the least-loaded worker
    (lowest id on ties); leaves at ``size + w``."""
    n_workers = loads.shape[0]
    size = 1
    while size < n_workers:
        size *= 2
    tree = np.full(2 * size, -1, dtype=np.int64)
    for w in range(n_workers):
        tree[size + w] = w
    for node in range(size - 1, 0, -1):
        tree[node] = _pick(tree[2 * node], tree[2 * node + 1], loads)
    return tree


@_inline
def _tree_update(tree, loads, w):
    """Re-run the matches above leaf ``w`` after its load changed (O(log W))."""
    node = ((tree.shape[0] >> 1) + w) >> 1
    while node >= 1:
        tree[node] = _pick(tree[2 * node], tree[2 * node + 1], loads)
        node >>= 1


@_inline
def _choose(cost, loads, f, cap):
    """``(worker, fallback)``: the least (cost, load, id) among workers with ``load + f <= cap``;
    none: the least-loaded worker and ``fallback = 1``."""
    best = -1
    for w in range(loads.shape[0]):
        lw = loads[w]
        if lw + f > cap:
            continue
        if best < 0 or cost[w] < cost[best] or (cost[w] == cost[best] and lw < loads[best]):
            best = w
    if best >= 0:
        return best, 0
    return _least_loaded(loads), 1


# ----------------------------------------------------------------------------- grouped (SH-tiles)


@_njit
def _tile_positions(tcols, pool, h_widx, rows):
    """Per tile the token-axis fields into ``rows`` (``_grouped_columns``' formulas): first /
    last sample (global indices, compacted later), first prefix ``[sf, nf)``, last start ``sl``,
    end ``e``, body, ``free`` and the holder ranges ``[j0, j1)`` overlapping ``[sf, nf)`` (none
    when ``free``: Python's ``_EMPTY``); also copies ``home``, ``a0``, ``a1``, ``qo``. Searches
    start from the previous tile's answers (tiles come in token order)."""
    seq, q_start, q_end, home, a0, a1, qo = tcols
    base, offs, h_start, h_end = pool
    p_first = p_last = p_pos = p_j0 = 0
    for t in range(seq.shape[0]):
        shift = base[seq[t]]
        qs, qe = q_start[t] + shift, q_end[t] + shift
        first = _right(offs, qs, p_first) - 1
        last = _right(offs, qe - 1, p_last) - 1
        pos = _right(h_start, qs, p_pos) - 1
        sf, nf, sl = offs[first], min(qe, offs[first + 1]), offs[last]
        j0 = _right(h_start, sf, p_j0) - 1
        p_first, p_last, p_pos, p_j0 = first + 1, last + 1, pos + 1, j0 + 1
        free = h_start[pos] <= sf and qe <= h_end[pos] and h_widx[pos] == home[t]
        rows[t, HOME] = home[t]
        rows[t, FREE] = 1 if free else 0
        rows[t, KF] = first
        rows[t, KL] = last if last > first else -1
        rows[t, BODY] = sl - offs[first + 1] if last > first + 1 else 0
        rows[t, A0] = a0[t]
        rows[t, A1] = a1[t]
        rows[t, QO] = qo[t]
        rows[t, SF] = sf
        rows[t, NF] = nf
        rows[t, SL] = sl
        rows[t, E] = qe
        rows[t, J0] = j0
        rows[t, J1] = j0 if free else _right(h_start, nf - 1, pos + 1)


@_njit
def _grouped_rows(tcols, pool, h_widx):
    """``(rows, n_keys)``: the per-tile int64 table (columns :data:`HOME` ... :data:`J1`) with
    KV-group keys compacted to the samples that are some tile's first or last sample."""
    n_tiles = tcols[0].shape[0]
    rows = np.empty((n_tiles, N_COLS), dtype=np.int64)
    _tile_positions(tcols, pool, h_widx, rows)
    key = np.zeros(pool[1].shape[0], dtype=np.int64)
    for t in range(n_tiles):
        key[rows[t, KF]] = 1
        if rows[t, KL] >= 0:
            key[rows[t, KL]] = 1
    n_keys = 0
    for i in range(key.shape[0]):  # key[i] = compact index of sample i
        n_keys += key[i]
        key[i] = n_keys - 1
    for t in range(n_tiles):
        rows[t, KF] = key[rows[t, KF]]
        if rows[t, KL] >= 0:
            rows[t, KL] = key[rows[t, KL]]
    return rows, n_keys


@_inline
def _special(rows, t, groups, h_widx, n_atoms, stamp, mark, special):
    """Into ``special`` (length returned, each worker once: ``mark[w] == stamp``): the workers
    that may cost less than the generic amount (``place``'s ``special``): the Q-home, holders of
    the first prefix and the members of the tile's KV groups (a block body's fetchers are members
    of its first sample's group). Written out without helper calls: this is the hot loop."""
    head, e_w, e_next = groups[0], groups[1], groups[3]
    h = rows[t, HOME]
    mark[h] = stamp
    special[0] = h
    n = 1
    for j in range(rows[t, J0], rows[t, J1]):
        v = h_widx[j]
        if mark[v] != stamp:
            mark[v] = stamp
            special[n] = v
            n += 1
    for b in range(rows[t, A0], rows[t, A1]):
        for key in (rows[t, KF] * n_atoms + b, rows[t, KL] * n_atoms + b if rows[t, KL] >= 0 else -1):
            j = head[key] if key >= 0 else -1
            while j >= 0:
                v = e_w[j]
                if mark[v] != stamp:
                    mark[v] = stamp
                    special[n] = v
                    n += 1
                j = e_next[j]
    return n


@_inline
def _fetched_into(groups, key, stamp, seen, end, body):
    """Scatter KV group ``key``'s members into per-worker scratch: ``end[w]`` prefix end fetched,
    ``body[w]`` block body fetched, valid where ``seen[w] == stamp``."""
    head, e_w, e_end, e_next, e_body = groups
    j = head[key] if key >= 0 else -1
    while j >= 0:
        w = e_w[j]
        seen[w], end[w], body[w] = stamp, e_end[j], e_body[j]
        j = e_next[j]


@_inline
def _special_costs(rows, t, special, n, groups, holders, atom_bytes, scratch, stamp, cost):
    """``cost[i]``: incremental bytes of tile ``t`` on worker ``special[i]`` (``best_scored``'s
    rule): Q + O unless it is the Q-home; per KV atom the rows of the first prefix ``[sf, nf)``
    beyond what it fetched and does not hold, and unless it is the Q-home the block body if it did
    not fetch it and the rows of the last sample's prefix ``[sl, e)`` beyond what it fetched.
    ``scratch``: six ``(W,)`` int64 arrays; ``stamp``: a fresh stamp per tile (2 per atom used)."""
    h_start, h_end, h_widx = holders
    seen_f, end_f, body_f, seen_l, end_l, body_l = scratch
    n_atoms = atom_bytes.shape[0]
    h, sf, nf, sl, e, body = rows[t, HOME], rows[t, SF], rows[t, NF], rows[t, SL], rows[t, E], rows[t, BODY]
    for i in range(n):
        cost[i] = 0 if special[i] == h else rows[t, QO]
    for b in range(rows[t, A0], rows[t, A1]):
        st = stamp + 2 * (b - rows[t, A0])
        _fetched_into(groups, rows[t, KF] * n_atoms + b, st, seen_f, end_f, body_f)
        _fetched_into(groups, rows[t, KL] * n_atoms + b if rows[t, KL] >= 0 else -1, st + 1, seen_l, end_l,
                      body_l)
        for i in range(n):
            w = special[i]
            x = max(end_f[w], sf) if seen_f[w] == st else sf  # recorded ends lie past sf
            kv = nf - x if x < nf else 0
            if kv > 0:
                for j in range(rows[t, J0], rows[t, J1]):
                    if h_widx[j] == w:
                        ov = min(h_end[j], nf) - max(h_start[j], x)
                        if ov > 0:
                            kv -= ov
            if w != h:
                if body > 0 and not (seen_f[w] == st and body_f[w]):
                    kv += body
                y = max(end_l[w], sl) if seen_l[w] == st + 1 else sl
                if rows[t, KL] >= 0 and y < e:
                    kv += e - y
            cost[i] += kv * atom_bytes[b]


@_inline
def _choose_special(rows, t, special, n, cost, loads, ll, f, cap, atom_bytes, stamp, mark):
    """``(worker, fallback)``: the least (cost, load, id) over the ``special`` workers within ``C``
    and the least-loaded worker (at the generic cost when it is not special); none within ``C``:
    the least-loaded worker ``ll``, a fallback."""
    best, bc, bl = -1, 0, 0.0
    for i in range(n):
        w, c, lw = special[i], cost[i], loads[special[i]]
        if lw + f > cap:
            continue
        if best < 0 or c < bc or (c == bc and (lw < bl or (lw == bl and w < best))):
            best, bc, bl = w, c, lw
    lw = loads[ll]
    if lw + f <= cap and mark[ll] != stamp:  # every non-special worker costs the generic amount
        c = rows[t, QO]
        for b in range(rows[t, A0], rows[t, A1]):
            c += (rows[t, E] - rows[t, SF]) * atom_bytes[b]
        if best < 0 or c < bc or (c == bc and (lw < bl or (lw == bl and ll < best))):
            best = ll
    if best < 0:
        return ll, 1
    return best, 0


@_inline
def _record_one(groups, key, w, end, body, n_entries):
    """``w`` fetched KV group ``key`` up to ``end`` (and the block body when ``body``); a first
    fetch adds ``w`` as a member (a new entry at ``n_entries``). Returns the new entry count."""
    head, e_w, e_end, e_next, e_body = groups
    j = head[key]
    while j >= 0 and e_w[j] != w:
        j = e_next[j]
    if j < 0:
        j = n_entries
        e_w[j], e_end[j], e_body[j], e_next[j] = w, 0, 0, head[key]
        head[key] = j
        n_entries += 1
    e_end[j] = max(e_end[j], end)
    if body:
        e_body[j] = 1
    return n_entries


@_njit
def _grouped_kernel(order, load, cap, rows, atom_bytes, holders, n_keys, loads):
    """Algorithm 2 over block-partitioned tiles; ``(dest pool indices, fallbacks)``.

    KV groups (key = compact sample x KV atom) as linked lists of member entries (``groups``:
    ``head[key]`` first entry or -1; per entry worker, prefix end fetched, next entry, body
    fetched): small, so no per-call page faults on a (groups x workers) map; a member is a worker
    that fetched part of the group.
    """
    n_atoms, n_workers = atom_bytes.shape[0], loads.shape[0]
    n_slots = 2 * int(np.sum(rows[:, A1] - rows[:, A0])) + 1  # at most 2 groups per tile and atom
    groups = (np.full(n_keys * n_atoms, -1, dtype=np.int64), np.empty(n_slots, dtype=np.int64),
              np.empty(n_slots, dtype=np.int64), np.empty(n_slots, dtype=np.int64),
              np.empty(n_slots, dtype=np.int64))
    scratch = (np.zeros(n_workers, dtype=np.int64), np.empty(n_workers, dtype=np.int64),
               np.empty(n_workers, dtype=np.int64), np.zeros(n_workers, dtype=np.int64),
               np.empty(n_workers, dtype=np.int64), np.empty(n_workers, dtype=np.int64))
    dest = np.zeros(rows.shape[0], dtype=np.int64)
    mark = np.zeros(n_workers, dtype=np.int64)
    special = np.empty(n_workers, dtype=np.int64)
    cost = np.empty(n_workers, dtype=np.int64)
    tree = _tree_new(loads)
    fallback, n_entries, stamp = 0, 0, 1
    for i in range(order.shape[0]):
        t = order[i]
        f = load[t]
        h = rows[t, HOME]
        if rows[t, FREE] and loads[h] + f <= cap:
            w = h  # the Q-home holds all it needs: cost 0, and nothing new to record
        else:
            n = _special(rows, t, groups, holders[2], n_atoms, i + 1, mark, special)
            _special_costs(rows, t, special, n, groups, holders, atom_bytes, scratch, stamp, cost)
            stamp += 2 * (rows[t, A1] - rows[t, A0])
            w, fb = _choose_special(rows, t, special, n, cost, loads, tree[1], f, cap, atom_bytes, i + 1,
                                    mark)
            fallback += fb
            for b in range(rows[t, A0], rows[t, A1]):  # what w fetched now (or holds: harmless)
                n_entries = _record_one(groups, rows[t, KF] * n_atoms + b, w, rows[t, NF], rows[t, BODY] > 0,
                                        n_entries)
                if rows[t, KL] >= 0:
                    n_entries = _record_one(groups, rows[t, KL] * n_atoms + b, w, rows[t, E], False,
                                            n_entries)
        dest[t] = w
        loads[w] += f
        _tree_update(tree, loads, w)
    return dest, fallback


def place_grouped(g: dict, order, load, cap: float, reserved) -> tuple[np.ndarray, int]:
    """Compiled ``_place_grouped``. ``g``: ``libra.tap.placement._grouped_base`` of the tiles;
    ``order``: the placement order; ``load``: per-tile loads; ``cap``: ``C``; ``reserved``: ``(W,)``
    starting loads. Returns the pool indices of the destinations and the fallback count."""
    tcols = tuple(_i64(g[k]) for k in ("seq", "q_start", "q_end", "home", "a0", "a1", "qo"))
    pool = tuple(_i64(g[k]) for k in ("base", "offs", "h_start", "h_end"))
    h_widx = _i64(g["h_widx"])
    rows, n_keys = _grouped_rows(tcols, pool, h_widx)
    dest, fallback = _grouped_kernel(_i64(order), _f64(load), float(cap), rows, _i64(g["atom_bytes"]),
                                     (pool[2], pool[3], h_widx), n_keys, _f64(reserved).copy())
    return dest, int(fallback)


# ----------------------------------------------------------------------------- dense (any tiles)


@_njit
def _dense_state(costs, c_off, m_nseg, n_atoms, n_workers):
    """The dense kernel's state. ``base``: per sequence the prefix sums of every worker's segment
    costs (one KV head; ``costs`` flattened segment-major at ``c_off``), at ``b_off[s] + k * W + w``:
    worker-minor, so scoring a tile on every worker reads two contiguous runs of ``W`` (worker-major
    rows made that loop stride through memory: 6.6 -> 5.4 ms per call on a 1M pool of 4096 tiles
    and 128 workers). ``rows``: per (sequence, atom, worker) its own prefix row once that worker
    fetched some of it (``own``; allocated but untouched until then, so a pool pays only for the
    rows it uses), at ``r_off[s] + (b * W + w) * (n + 1)``."""
    n_seq = m_nseg.shape[0]
    b_off, r_off = np.zeros(n_seq, dtype=np.int64), np.zeros(n_seq, dtype=np.int64)
    nb = nr = 0
    for s in range(n_seq):
        b_off[s], r_off[s] = nb, nr
        nb += n_workers * (m_nseg[s] + 1)
        nr += n_atoms * n_workers * (m_nseg[s] + 1)
    base = np.empty(nb, dtype=np.int64)
    for s in range(n_seq):
        o, src = b_off[s], c_off[s]
        for w in range(n_workers):
            base[o + w] = 0
        for k in range(m_nseg[s]):
            row, nxt = o + k * n_workers, o + (k + 1) * n_workers
            for w in range(n_workers):
                base[nxt + w] = base[row + w] + costs[src + k * n_workers + w]
    own = np.zeros(n_seq * n_atoms * n_workers, dtype=np.bool_)
    return base, b_off, np.empty(nr, dtype=np.int64), r_off, own


@_inline
def _dense_cost(t, tcols, state, m_nseg, heads, cost, loads, f, cap):
    """``cost[w]`` += KV cost tile ``t`` lacks on worker ``w`` (prefix-sum differences over its
    segments, per atom), for the workers with room: the others cannot take it (``_choose``)."""
    seq, seg0, seg1, a0, a1 = tcols[0], tcols[1], tcols[2], tcols[3], tcols[4]
    base, b_off, rows, r_off, own = state
    n_workers, n_atoms = cost.shape[0], heads.shape[0]
    s = seq[t]
    n1 = m_nseg[s] + 1
    lo, hi = b_off[s] + seg0[t] * n_workers, b_off[s] + seg1[t] * n_workers
    for b in range(a0[t], a1[t]):
        mine = (s * n_atoms + b) * n_workers
        for w in range(n_workers):
            if loads[w] + f > cap:
                continue
            if own[mine + w]:
                o = r_off[s] + (b * n_workers + w) * n1
                cost[w] += rows[o + seg1[t]] - rows[o + seg0[t]]
            else:
                cost[w] += heads[b] * (base[hi + w] - base[lo + w])


@_inline
def _dense_fetch(t, w, tcols, state, m_nseg, heads, n_workers):
    """Worker ``w`` now holds tile ``t``'s KV segments: zero them in its own prefix rows."""
    seq, seg0, seg1, a0, a1 = tcols[0], tcols[1], tcols[2], tcols[3], tcols[4]
    base, b_off, rows, r_off, own = state
    n_atoms = heads.shape[0]
    s = seq[t]
    n1 = m_nseg[s] + 1
    for b in range(a0[t], a1[t]):
        o = r_off[s] + (b * n_workers + w) * n1
        key = (s * n_atoms + b) * n_workers + w
        if not own[key]:  # first fetch of this (sequence, atom) by w: its row from the shared sums
            own[key] = True
            ob = b_off[s] + w
            for k in range(n1):
                rows[o + k] = heads[b] * base[ob + k * n_workers]
        p0 = rows[o + seg0[t]]
        drop = rows[o + seg1[t]] - p0
        for k in range(seg0[t] + 1, seg1[t] + 1):
            rows[o + k] = p0
        if drop:
            for k in range(seg1[t] + 1, n1):
                rows[o + k] -= drop


@_njit
def _dense_kernel(order, load, cap, tcols, costs, c_off, m_nseg, heads, lw, loads):
    """``_place_dense`` on prefix sums of the missing-cost map (a tile scores each worker in O(1)
    per atom; placing it updates that worker's rows); ``loads``: the workers' starting loads,
    updated in place. Returns ``(dest pool indices, fallbacks)``."""
    qo, home = tcols[5], tcols[6]
    n_workers = loads.shape[0]
    state = _dense_state(costs, c_off, m_nseg, heads.shape[0], n_workers)
    dest = np.zeros(qo.shape[0], dtype=np.int64)
    cost = np.empty(n_workers, dtype=np.int64)
    fallback = 0
    for t in order:
        f = load[t]
        for w in range(n_workers):  # Q + O bytes priced on the Q-home's link to w (0 at the Q-home)
            cost[w] = qo[t] * lw[home[t], w]
        _dense_cost(t, tcols, state, m_nseg, heads, cost, loads, f, cap)
        w, fb = _choose(cost, loads, f, cap)
        fallback += fb
        _dense_fetch(t, w, tcols, state, m_nseg, heads, n_workers)
        dest[t] = w
        loads[w] += f
    return dest, fallback


def place_dense(d: dict, seq, order, load, cap: float, reserved) -> tuple[np.ndarray, int]:
    """Compiled ``_place_dense``. ``d``: ``libra.tap.placement._dense_inputs``; ``seq``: each
    tile's sequence index; ``reserved``: ``(W,)`` starting loads. Returns the pool indices of the
    destinations and the fallback count."""
    costs = d["seg_costs"]  # per sequence (W, segments) int64
    m_nseg = _i64([c.shape[1] for c in costs])
    c_off = _i64(np.concatenate(([0], np.cumsum([c.size for c in costs])[:-1])))
    tcols = tuple(_i64(c) for c in (seq, d["seg0"], d["seg1"], d["a0"], d["a1"], d["qo"], d["home"]))
    flat = _i64(np.concatenate([c.T.ravel() for c in costs]))  # segment-major (_dense_state)
    dest, fallback = _dense_kernel(_i64(order), _f64(load), float(cap), tcols, flat, c_off, m_nseg,
                                   _i64(d["atom_heads"]), _i64(d["lw"]), _f64(reserved).copy())
    return dest, int(fallback)


# ----------------------------------------------------------------------------- FLOPs only


@_njit
def _flops_only_kernel(order, load, cap, loads):
    """``_place_flops_only``'s least-loaded heap as a tournament tree (``loads``: starting loads,
    updated in place)."""
    dest = np.zeros(load.shape[0], dtype=np.int64)
    tree = _tree_new(loads)
    fallback = 0
    for t in order:
        w = tree[1]
        if loads[w] + load[t] > cap:  # the least-loaded worker cannot take it, so nobody can
            fallback += 1
        dest[t] = w
        loads[w] += load[t]
        _tree_update(tree, loads, w)
    return dest, fallback


def place_flops_only(order, load, cap: float, reserved) -> tuple[np.ndarray, int]:
    """Compiled ``_place_flops_only``: least-loaded placement (lowest id on ties) from the
    ``(W,)`` starting loads ``reserved``."""
    dest, fallback = _flops_only_kernel(_i64(order), _f64(load), float(cap), _f64(reserved).copy())
    return dest, int(fallback)


# ----------------------------------------------------------------------------- overload repair


@_njit
def _repair_kernel(dest, load, loads, cap, over, by_worker, starts, home, lw):
    """``libra.extensions.adaptive.repair._repair_python``'s loop: the same moves, ties on (cost, load, lowest id)."""
    moved = 0
    for w in over:
        for i in range(starts[w], starts[w + 1]):
            if loads[w] <= cap:
                break
            t = by_worker[i]
            f = load[t]
            h = home[t]
            best = -1
            for v in range(loads.shape[0]):
                if v == w or loads[v] + f > cap:
                    continue
                if best < 0 or lw[h, v] < lw[h, best] or (lw[h, v] == lw[h, best] and loads[v] < loads[best]):
                    best = v
            if best < 0:
                continue
            dest[t] = best
            loads[w] -= f
            loads[best] += f
            moved += 1
    return moved


def repair_overload(dest, load, loads, cap: float, over, by_worker, starts, home, lw) -> int:
    """Compiled :func:`libra.extensions.adaptive.repair._repair_python` (``dest`` and ``loads`` updated in place,
    both as the caller's arrays: int64 and float64); returns the tiles moved."""
    return int(_repair_kernel(dest, _f64(load), loads, float(cap), _i64(over), _i64(by_worker), _i64(starts),
                              _i64(home), _i64(lw)))


def warmup() -> float:
    """Compile every kernel now (on tiny inputs) and return the seconds it took; later calls in
    this process reuse the compiled code (calling it again is cheap and returns ~0)."""
    t0 = time.perf_counter()
    one = np.zeros(1, dtype=np.int64)
    g = {"seq": one, "q_start": one, "q_end": one + 1, "home": one, "a0": one, "a1": one + 1, "qo": one + 1,
         "base": _i64([0, 1]), "offs": _i64([0, 1]), "h_start": one, "h_end": one + 1, "h_widx": one,
         "atom_bytes": one + 1}
    place_grouped(g, one, one, 1.0, np.zeros(1))
    d = {"seg_costs": [np.ones((1, 1), dtype=np.int64)], "atom_heads": one + 1, "seg0": one, "seg1": one + 1,
         "a0": one, "a1": one + 1, "qo": one + 1, "home": one, "lw": np.zeros((1, 1), dtype=np.int64)}
    place_dense(d, one, one, one, 1.0, np.zeros(1))
    place_flops_only(one, one, 1.0, np.zeros(1))
    repair_overload(one.copy(), np.ones(1), np.ones(1), 0.5, one, one, _i64([0, 1]), one, _i64([[0]]))
    return time.perf_counter() - t0
