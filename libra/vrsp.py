"""Variance-Reduced Sequence Placement, VRSP (Libra sec. 4.2, Algorithm 1).

Given the ``D = GBS`` packed sequences of one optimizer window with workloads ``F_i`` (the proxy
``sum l^2`` from :mod:`libra.workload`) and a pool size ``P``, VRSP forms ``K = D / P`` pools of
exactly ``P`` sequences each whose aggregate workloads are as equal as it can make them:

1. sort the sequences by decreasing ``F_i``; equal workloads keep their original index order;
2. keep a min-heap of the pools that still have room, keyed by ``(load, pool index)``;
3. give each sequence in that order to the heap's top pool (least loaded, lowest index on ties);
   a pool that reaches ``P`` sequences leaves the heap.

That is longest-processing-time-first (Graham, 1969) with an exact-cardinality constraint. It takes
O(D log D) time and O(K) pool state and is fully deterministic. It never changes which sequences
form the window (the step's sample multiset is preserved), only how they are grouped into pools.

Implementation note (speed, measured in ``benchmarks/test_bench_vrsp.py``): numpy sorts, then a
tight loop over Python lists drives ``heapq``; a pop+push pair is fused into one ``heapreplace``
whenever the pool still has room. For positive integer workloads (``sum l^2`` always is) the heap
holds single ints ``load * K + pool`` instead of ``(load, pool)`` tuples, which orders identically
and compares faster; other workloads take the tuple loop. Both give the same pools.
"""

from __future__ import annotations

import heapq

import numpy as np


def _check_workloads(workloads) -> np.ndarray:
    w = np.asarray(workloads, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError(f"workloads must be a non-empty 1-D array, got shape {w.shape}")
    if not (w.min() >= 0 and w.sum() < np.inf):  # cheap check first (NaN fails >=); name culprit below
        mask = ~np.isfinite(w) | (w < 0)
        if not mask.any():
            raise ValueError(f"workloads sum to {w.sum()!r}: too large to compare pools")
        bad = int(np.argmax(mask))
        raise ValueError(f"workload {bad} must be finite and >= 0, got {float(w[bad])!r}")
    return w


def check_pool_size(n_sequences: int, pool_size) -> int:
    """Return ``K = n_sequences / P`` or raise when ``P`` is not a positive divisor of ``GBS``.

    Raises:
        ValueError: ``pool_size`` not an integer >= 1, or ``GBS`` not a multiple of it.
    """
    if isinstance(pool_size, bool) or not isinstance(pool_size, (int, np.integer)) or pool_size < 1:
        raise ValueError(f"pool size P must be an integer >= 1, got {pool_size!r}")
    if n_sequences % pool_size:
        raise ValueError(
            f"pool size P={pool_size} must divide GBS={n_sequences} "
            f"(GBS must be a multiple of the pool size)"
        )
    return n_sequences // int(pool_size)


def vrsp(workloads, pool_size: int) -> np.ndarray:
    """Algorithm 1: exact-cardinality greedy LPT grouping of one window into pools.

    Args:
        workloads: float ``(D,)`` workload of each packed sequence (``D = GBS``), each >= 0.
        pool_size: ``P`` sequences per pool; must divide ``D``.

    Returns:
        int64 ``(K, P)`` sequence indices, ``K = D / P``; row ``k`` is pool ``k``, its columns in
        the order the sequences were assigned (heaviest first).

    Raises:
        ValueError: empty / non-1-D / negative / non-finite workloads, or ``P`` not dividing ``D``.
    """
    w = _check_workloads(workloads)
    d = w.size
    k = check_pool_size(d, pool_size)
    p = int(pool_size)
    # stable sort of -w: decreasing workload, ties by original index (deterministic)
    order_arr = np.argsort(-w, kind="stable")
    if p == 1:
        return order_arr.reshape(k, 1).astype(np.int64)
    ws = w[order_arr]
    if ws[-1] > 0 and ws[0] * d * k < 2.0**62 and ((wi := ws.astype(np.int64)) == ws).all():
        flat = _greedy_int(order_arr.tolist(), (wi * k).tolist(), k, p)
    else:
        flat = _greedy_tuple(order_arr.tolist(), ws.tolist(), k, p)
    return np.array(flat, dtype=np.int64).reshape(k, p)


def _greedy_tuple(order: list[int], ws: list[float], k: int, p: int) -> list[int]:
    """Reference loop: heap of ``(load, pool)`` tuples. Returns the flat (K*P,) assignment."""
    counts = [0] * k
    flat = [0] * (k * p)
    heap = [(0.0, j) for j in range(k)]  # a valid heap: equal loads, increasing pool index
    replace, pop = heapq.heapreplace, heapq.heappop
    for i, x in zip(order, ws):
        load, j = heap[0]
        c = counts[j]
        flat[j * p + c] = i
        c += 1
        counts[j] = c
        if c < p:
            replace(heap, (load + x, j))  # pop + push fused
        else:
            pop(heap)  # a full pool leaves the candidate heap
    return flat


def _greedy_int(order: list[int], ws_k: list[int], k: int, p: int) -> list[int]:
    """Same greedy as :func:`_greedy_tuple` for positive integer workloads (e.g. ``sum l^2``).

    The heap holds plain ints ``load * K + pool``: since loads are integers, ordering these keys
    is exactly ordering ``(load, pool)``, but int comparisons are much cheaper than tuple ones.
    ``ws_k`` holds the sorted workloads times ``K``. With every workload > 0 the first ``K``
    sequences go to pools ``0..K-1`` in turn (each pool still at load 0 has the lowest index), so
    that round is done without heap operations.
    """
    counts = [1] * k
    flat = [0] * (k * p)
    for j in range(k):
        flat[j * p] = order[j]
    heap = [ws_k[j] + j for j in range(k)]
    heapq.heapify(heap)
    replace, pop = heapq.heapreplace, heapq.heappop
    for i, x in zip(order[k:], ws_k[k:]):
        key = heap[0]
        j = key % k
        c = counts[j]
        flat[j * p + c] = i
        c += 1
        counts[j] = c
        if c < p:
            replace(heap, key + x)
        else:
            pop(heap)
    return flat


def pool_loads(workloads, pools) -> np.ndarray:
    """float64 ``(K,)`` aggregate workload of each pool (row of ``pools``)."""
    w = _check_workloads(workloads)
    idx = _check_pools(pools, w.size)
    return w[idx].sum(axis=1)


def _check_pools(pools, d: int) -> np.ndarray:
    idx = np.asarray(pools)
    if idx.ndim != 2 or idx.size == 0 or idx.dtype.kind not in "iu":
        raise ValueError(f"pools must be a non-empty 2-D integer array (K, P), got shape {idx.shape}")
    if idx.min() < 0 or idx.max() >= d:
        raise ValueError(f"pool entries must index the {d} workloads, got values in [{idx.min()}, {idx.max()}]")
    return idx


def pool_imbalance(workloads, pools) -> float:
    """Pool imbalance ``R - 1 = max_k W_k / mean_k W_k - 1`` (Libra sec. 3.2).

    Args:
        workloads: float ``(D,)`` sequence workloads.
        pools: int ``(K, P)`` sequence indices per pool.

    Returns:
        ``R - 1 >= 0``; 0.0 when every workload is 0.

    Raises:
        ValueError: malformed workloads or pools.
    """
    loads = pool_loads(workloads, pools)
    mean = loads.mean()
    return 0.0 if mean == 0 else float(loads.max() / mean - 1.0)


def microbatch_groups(pools, dp: int) -> np.ndarray:
    """Map pools onto (GA index, DP rank): pool ``k`` runs at GA index ``k // (DP/P)`` on DP ranks
    ``(k % (DP/P)) * P + j``, ``j`` its column.

    Args:
        pools: int ``(K, P)`` sequence indices (e.g. from :func:`vrsp`).
        dp: data-parallel degree; ``P`` must divide it and ``DP`` must divide ``K * P``.

    Returns:
        int64 ``(GA, DP)``: entry ``[g, r]`` is the sequence DP rank ``r`` processes at GA index ``g``.

    Raises:
        ValueError: ``dp`` not a positive integer, ``P`` not dividing ``dp``, or ``dp`` not dividing
            ``GBS = K * P``.
    """
    idx = np.asarray(pools)
    if idx.ndim != 2 or idx.size == 0:
        raise ValueError(f"pools must be a non-empty 2-D array (K, P), got shape {idx.shape}")
    k, p = idx.shape
    if isinstance(dp, bool) or not isinstance(dp, (int, np.integer)) or dp < 1:
        raise ValueError(f"DP must be an integer >= 1, got {dp!r}")
    if dp % p:
        raise ValueError(f"pool size P={p} must divide DP={dp}")
    if (k * p) % dp:
        raise ValueError(f"DP={dp} must divide GBS={k * p} (mbs = 1)")
    # pools k..k+DP/P-1 share one GA index and tile the DP ranks in order: a plain reshape
    return idx.reshape(k * p // dp, dp).astype(np.int64)


def vrsp_schedule(workloads, pool_size: int, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """One optimizer window's schedule: VRSP pools mapped onto (GA index, DP rank) slots.

    The one implementation every consumer schedules a window with: Libra's planners
    (``pool_size = P``), the ``ulysses-sorted`` baseline and the data sampler for any CP method
    (``pool_size = 1``: Alg. 1 degenerates to sorting the window's sequences by decreasing
    ``sum l^2``, so GA index ``g`` trains the ``g``-th heaviest ``DP`` of them -- the cross-step
    balance without pooling). The step multiset of the window is unchanged; only which GA index
    trains which sequence moves. Pure function of the workloads: identical on every rank.

    Args:
        workloads: float ``(GBS,)`` workload of each packed sequence (``sum l^2``).
        pool_size: ``P``; must divide ``DP``.
        dp: data-parallel degree; must divide ``GBS``.

    Returns:
        ``(pools, groups)``: int64 ``(K, P)`` VRSP pools and int64 ``(GA, DP)`` window indices
        (``groups[g, r]`` is the sequence DP rank ``r`` trains at GA index ``g``).

    Raises:
        ValueError: the errors of :func:`vrsp` and :func:`microbatch_groups`.
    """
    pools = vrsp(workloads, pool_size)
    return pools, microbatch_groups(pools, dp)

