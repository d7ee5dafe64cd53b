"""Re-place a chosen plan with each worker's exposed communication reserved as load (an extension
beyond Libra sec. 4.3, ``libra-adaptive``'s ``rebalance_passes``; the reason is
:mod:`libra.extensions.adaptive.candidates`' "Waiting on the wire")."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from libra.config import TapConfig
from libra.extensions.adaptive.candidates import CANDIDATES, candidate
from libra.extensions.adaptive.relay import relay_pool
from libra.extensions.adaptive.retention import place_retaining, speed_reserve
from libra.plan import PoolPlan
from libra.tap.exchange import build_transfers
from libra.tap.pipeline import ChunkSchedule
from libra.tap.placement import PlacementPolicy
from libra.workload import AttentionShape

REBALANCE_PASSES = 1
"""``libra-adaptive``'s default ``rebalance_passes`` (:func:`rebalance_exposed`). Measured with
``straggler``'s pricing (2 windows, jitter on; mean straggler ms for 0 / 1 / 2 / 3 passes that each
reserved only the last plan's exposure and stopped at the first that priced no faster): ProLong 1M
110.9 / 103.5 / 104.9 / 102.4 (without jitter 109.7 / 103.9 / 103.1 / 101.7), ProLong 256K 59.5 /
56.3 / 56.1 / 56.1, Wikipedia 256K 64.7 / 63.4 / 63.4 / 63.2, Wikipedia 1M 114.6 / 111.4 / 111.4 /
111.2. Later passes that reserve the mean of the last reservation and the last exposure, and go on
past a pass that priced no faster (the rule ``libra-adaptive`` runs), gain more: on the re-placed
pools priced alone (geometric mean of straggler before / after, 2 windows), 1 / 2 / 3 / 5 passes
give ProLong 1M 1.061 / 1.085 / 1.086 / 1.092, Wikipedia 1M 1.066 / - / 1.087 / 1.092, ProLong 256K
1.054 / - / 1.066 / 1.069, Wikipedia 256K 1.058 / 1.068 / 1.075 / 1.078 (the last-exposure rule with 3
passes: 1.075, 1.085, 1.063, 1.068). Each pass costs another placement, relay and pricing per pool,
about as much as the first (``plan-cost``'s ``rebalance`` part), so the default stays at one."""


REBALANCE_MIN_EXCESS = 0.01
"""The :func:`exposure_excess` at or below which ``libra-adaptive`` does not re-place a pool. Measured
on the chosen plans priced alone (gain = straggler before / after one pass, every pool re-placed):
libra-prod's 256K pools sit at 0.003-0.012 and gain 0.28% on average (the 7 of 32 above 0.01 keep
0.18 points of it; 2 windows), its 1M pools at 0.018-0.036 and gain 0.9% (4 windows), Wikipedia's
at 0.043 and up (256K) and 0.037-0.20 (1M), gaining 5.8% and 6.6% (up to 15%; 2 windows). Below
it a pass costs a placement, a relay and a pricing for next to nothing."""


def exposure_excess(compute: np.ndarray, exposed: np.ndarray) -> float:
    """How much of the straggler's time is exposed communication above the pool's mean exposure:
    ``(exposed[s] - mean(exposed)) / (compute[s] + exposed[s])`` with ``s`` the slowest worker --
    about what :func:`rebalance_exposed` can win (0 for an empty pool)."""
    total = compute + exposed
    if not len(total) or total.max() <= 0:
        return 0.0
    s = int(np.argmax(total))
    return float((exposed[s] - exposed.mean()) / total[s])


def rebalance_exposed(name: str, pool: PoolPlan, shape: AttentionShape, tap: TapConfig, load: np.ndarray,
                      priced: tuple[np.ndarray, np.ndarray], link_cost=None, speeds=None) -> PoolPlan:
    """``pool`` (a retention candidate ``name``, :attr:`Candidate.retain`, any heavy-tile cut) placed again by its
    own placer with each worker's exposed communication reserved as load, so that compute *plus*
    exposed communication is what the placement balances (an extension beyond Libra sec. 4.3).

    The priced plans of real corpora leave most of their straggler's loss on a few workers: those
    that receive a long sample's Q and KV or relay it wait for chunk 0's dispatch and chunk
    ``M - 1``'s return (the two transfers the Pipeliner never hides), while the pool's mean exposed
    time is small. Placement balances compute within ``C`` and so hands those workers a full share
    of it. Here each worker starts with its exposed time of ``pool`` as load
    (``PlacementPolicy.reserved``, converted to tile-load units by the pool's load per ms of
    compute), so the placer gives it less compute and the others more. Fewer tiles then move to
    it, which changes its exposure in turn: the caller prices the result and iterates or keeps the
    faster plan (``libra-adaptive``'s ``rebalance_passes``).

    Args:
        name: the candidate that built ``pool`` (:func:`candidate_pools` key).
        pool: its plan (tiles, transfers; relayed when ``name`` relays).
        shape, tap: as :func:`candidate_pools`.
        load: ``(T,)`` the tiles' loads as placed (:func:`~libra.tap.weights.kernel_time_weights`).
        priced: ``(compute, exposed)``, ``(W,)`` each: every worker's priced compute and exposed
            communication (ms) in ``pool.workers`` order (:meth:`libra.sim.cost.CostModel.worker_ms`)
            -- the exposure to reserve.
        link_cost: the byte cost of the link-priced candidates (:attr:`Candidate.link_priced`).
        speeds: optional ``(W,)`` known speed multipliers (as :func:`candidate_pools`): their
            :func:`speed_reserve` is reserved on top of the exposure.

    Returns:
        The new PoolPlan (same tiles and chunking; destinations, transfers and relays rebuilt).

    Raises:
        ValueError: a candidate that does not retain, or arrays of the wrong length.
    """
    c = candidate(name)
    if not c.retain:
        retaining = sorted(n for n, x in CANDIDATES.items() if x.retain)
        raise ValueError(f"rebalance_exposed re-places {retaining}, got {name!r}")
    compute, exposed = (np.asarray(a, dtype=np.float64) for a in priced)
    if compute.shape != (len(pool.workers),) or exposed.shape != compute.shape:
        raise ValueError(f"compute and exposed must have one entry per pool worker ({len(pool.workers)})")
    per_ms = float(load.sum()) / float(compute.sum()) if compute.sum() > 0 else 0.0
    reserved = np.maximum(exposed, 0.0) * per_ms
    if speeds is not None:
        reserved = reserved + speed_reserve(float(load.sum()), speeds)
    index = pool.index()
    policy = PlacementPolicy(link_cost=link_cost if c.link_priced else None, reserved=reserved)
    placed, fallback = place_retaining(pool.tiles, pool.sequences, pool.workers, shape, tap.tau, load, policy)
    out = replace(pool, tiles=placed, transfers=build_transfers(pool.sequences, placed, shape, index=index),
                  fallback_tiles=fallback)
    if c.relay:
        out = relay_pool(out, ChunkSchedule.for_pool(out, shape, tap.pipeline_chunks))
    return out
