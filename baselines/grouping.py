"""Pool-grouping strategies VRSP is compared against (Libra sec. 3.2, 4.2, Figures 4 and 8).

Every strategy maps one GBS window's ``D`` packed-sequence workloads ``w`` (float ``(D,)``) and a
pool size ``P`` (dividing ``D``) to an int64 ``(K, P)`` array of sequence indices, ``K = D / P``
pools of exactly ``P`` sequences. None changes the window's contents, only the grouping.

* ``production``: arrival order; pool ``k`` = sequences ``[k*P, (k+1)*P)``. This is what a
  trainer does without a placement step (Figure 4's "production-order grouping").
* ``random``: a uniformly random permutation (``numpy.random.default_rng(seed)``), then consecutive
  chunks of ``P`` -- the pool LLN analysis of sec. 3.2 is about.
* ``zigzag``: sort by decreasing workload (ties by index) and deal in snake order: sorted item
  ``r`` goes to pool ``r mod K`` in even rounds ``r // K`` and to pool ``K - 1 - (r mod K)`` in odd
  rounds (0, 1, ..., K-1, K-1, ..., 1, 0, 0, 1, ...).
* ``zigzag-swap``: start from ``zigzag``, then repeat: let ``m`` be the most loaded pool (lowest
  index on ties); among all pairs (``i`` in ``m``, ``j`` in another pool ``q``) with
  ``w_i > w_j``, take the swap minimising ``max(W_m - d, W_q + d)`` (``d = w_i - w_j``; ties:
  smallest ``(q, position of i, position of j)``); apply it if that value is strictly below
  ``W_m``, else stop. Each accepted swap strictly reduces ``sum_k W_k^2``, so it terminates;
  ``max_swaps`` bounds it anyway.
* ``vrsp``: Libra's Algorithm 1 (:func:`libra.vrsp.vrsp`).

Lower bound: no grouping can make the heaviest pool lighter than
``max(mean pool, w_max + sum of the P - 1 lightest other sequences)`` -- the pool holding the
heaviest packed sequence (an indivisible outlier, sec. 2.3) has ``P - 1`` companions at least as
heavy as the lightest ones. :func:`lower_bound_r_minus_1` turns it into a bound on ``R - 1``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from libra.vrsp import _check_workloads, check_pool_size, vrsp

Grouping = Callable[..., np.ndarray]


def production_grouping(workloads, pool_size: int, seed: int = 0) -> np.ndarray:
    """Arrival-order pools: ``(K, P)`` with row ``k`` = ``[k*P, ..., (k+1)*P - 1]``."""
    w = _check_workloads(workloads)
    k = check_pool_size(w.size, pool_size)
    return np.arange(w.size, dtype=np.int64).reshape(k, pool_size)


def random_grouping(workloads, pool_size: int, seed: int = 0) -> np.ndarray:
    """Random pools: a seeded permutation cut into ``K`` chunks of ``P``."""
    w = _check_workloads(workloads)
    k = check_pool_size(w.size, pool_size)
    perm = np.random.default_rng(seed).permutation(w.size)
    return perm.astype(np.int64).reshape(k, pool_size)


def zigzag_grouping(workloads, pool_size: int, seed: int = 0) -> np.ndarray:
    """Snake deal over the decreasing-workload order (see module docstring)."""
    w = _check_workloads(workloads)
    k = check_pool_size(w.size, pool_size)
    order = np.argsort(-w, kind="stable")
    # round r fills column r of every pool; odd rounds run over the pools backwards
    grid = order.reshape(pool_size, k).copy()
    grid[1::2] = grid[1::2, ::-1]
    return grid.T.astype(np.int64)


def zigzag_swap_grouping(workloads, pool_size: int, seed: int = 0, max_swaps: int = 10_000) -> np.ndarray:
    """``zigzag`` then best improving pairwise swaps between the max pool and the others."""
    w = _check_workloads(workloads)
    pools = zigzag_grouping(w, pool_size)
    k = pools.shape[0]
    if k == 1:
        return pools
    loads = w[pools].sum(axis=1)
    for _ in range(max_swaps):
        m = int(np.argmax(loads))
        wm = w[pools[m]]  # (P,)
        others = np.delete(np.arange(k), m)
        wo = w[pools[others]]  # (K-1, P)
        d = wm[None, :, None] - wo[:, None, :]  # (K-1, P_i, P_j): load moved from m to q
        new_max = np.maximum(loads[m] - d, loads[others][:, None, None] + d)
        new_max = np.where(d > 0, new_max, np.inf)
        flat = int(np.argmin(new_max))  # first minimum = smallest (q, i, j) on ties
        if not new_max.flat[flat] < loads[m]:
            break
        qi, i, j = np.unravel_index(flat, new_max.shape)
        q = int(others[qi])
        pools[m, i], pools[q, j] = pools[q, j], pools[m, i]
        delta = float(d[qi, i, j])
        loads[m] -= delta
        loads[q] += delta
    return pools


def vrsp_grouping(workloads, pool_size: int, seed: int = 0) -> np.ndarray:
    """Libra's VRSP (Algorithm 1); ``seed`` is unused (deterministic)."""
    return vrsp(workloads, pool_size)


GROUPINGS: dict[str, Grouping] = {
    "production": production_grouping,
    "random": random_grouping,
    "zigzag": zigzag_grouping,
    "zigzag-swap": zigzag_swap_grouping,
    "vrsp": vrsp_grouping,
}
"""Strategy name (as in CSVs and plots) -> ``fn(workloads, pool_size, seed=0) -> (K, P)``."""


def max_pool_lower_bound(workloads, pool_size: int) -> float:
    """Lower bound on the heaviest pool's workload over all groupings into pools of ``P``.

    ``max(sum(w) / K, w_max + sum of the P - 1 smallest remaining workloads)``.

    Raises:
        ValueError: malformed workloads or ``P`` not dividing ``D``.
    """
    w = _check_workloads(workloads)
    k = check_pool_size(w.size, pool_size)
    s = np.sort(w)
    outlier_pool = s[-1] + s[: pool_size - 1].sum()  # the P-1 lightest never include the max itself
    return float(max(s.sum() / k, outlier_pool))


def lower_bound_r_minus_1(workloads, pool_size: int) -> float:
    """Lower bound on ``R - 1`` any grouping can reach: ``max_pool_lower_bound / mean pool - 1``."""
    w = _check_workloads(workloads)
    k = check_pool_size(w.size, pool_size)
    mean = w.sum() / k
    return 0.0 if mean == 0 else max(0.0, max_pool_lower_bound(w, pool_size) / mean - 1.0)
