"""``libra-adaptive``'s guard against a wrong profile (an extension beyond the Libra paper).

``libra-adaptive`` prices its candidates with the profile it plans with, and that profile scores
them too, so its lead over the paper's plan holds under the model by construction. Where the model
is wrong its choices can lose: a candidate that runs fewer query heads per kernel call gains under
a profile without a heads-per-call penalty and loses 2x under a strong one. The guard keeps a
candidate only if, under every member of a profile ensemble
(:mod:`libra.sim.profiles.ensemble`: the planning profile with its unmeasured numbers moved --
heads-per-call penalty, link bandwidth and latency, kernel length curve), the pool prices at most
``1 + margin`` times the paper's plan of the same pool at the layout's Pipeliner depth (what
``libra`` runs) under that member. The paper's plan passes by definition, so the guard can only
give back gain, never lose to ``libra`` under a member by more than the margin (each pool priced
alone, no device jitter: a pool's straggler is the window's on its workers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from libra.config import ParallelConfig, TapConfig
from libra.plan import Plan, PoolPlan
from libra.sim.cost import CostModel
from libra.sim.profiles import HardwareProfile
from libra.sim.profiles.ensemble import load_ensemble
from libra.sim.structure import PoolStructures
from libra.sim.topology import Topology
from libra.workload import AttentionShape

ROBUST_MARGIN = 0.01
"""How much slower than the paper's plan a guarded candidate may price under any ensemble member:
1%, half the 2% a window may lose to ``libra`` under a member, the other half left for the device
jitter the pool prices do not see."""


def check_margin(value, what: str = "libra-adaptive robust_margin") -> float:
    """``value`` as a float in [0, 1).

    Raises:
        ValueError: not a finite number in [0, 1).
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not 0.0 <= value < 1.0:
        raise ValueError(f"{what} must be a number in [0, 1), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PoolPricing:
    """What pricing one pool alone needs besides the cost model: the layout, the attention shape and
    the known device speeds (None: every GPU at the profile's speed)."""

    par: ParallelConfig
    shape: AttentionShape
    speeds: np.ndarray | None = None

    def worker_ms(self, cost: CostModel, pool: PoolPlan, tap: TapConfig, cutoff: float = float("inf")):
        """``pool`` run alone (as a one-pool Plan at ``tap``'s Pipeliner chunks): every pool worker's
        priced ``(compute, exposed)`` (:meth:`libra.sim.cost.CostModel.worker_ms`; ``exposed`` None
        once compute exceeds ``cutoff``)."""
        plan = Plan(method="libra-adaptive", ga_index=0, shape=self.shape, cp=self.par.cp,
                    pipeline_chunks=tap.pipeline_chunks, pools=(pool,), meta={})
        compute, exposed = cost.worker_ms(plan, cutoff=cutoff, speed=self.speeds)
        ws = list(pool.workers)
        return compute[ws], (None if exposed is None else exposed[ws])

    def straggler_ms(self, cost: CostModel, pool: PoolPlan, tap: TapConfig, cutoff: float = float("inf")) -> float:
        """``pool``'s priced straggler alone (``inf`` once its compute alone exceeds ``cutoff``)."""
        compute, exposed = self.worker_ms(cost, pool, tap, cutoff)
        return float("inf") if exposed is None else float((compute + exposed).max())


class EnsembleGuard:
    """The ensemble check of one window layout's candidates (module doc).

    ``members`` are the ensemble's members the planning profile can take
    (:meth:`libra.sim.profiles.ensemble.Ensemble.applicable_profiles`; ``skipped`` names the rest),
    each with its cost model built once. :meth:`reference` prices the paper's plan of a pool under
    every member; :meth:`admits` checks a candidate against those prices, trying first the member
    that rejected the last candidate (most rejections come from one member, so most checks stop
    after one pricing)."""

    def __init__(self, profile: HardwareProfile, ensemble: str, margin: float, pricing: PoolPricing):
        members, self.skipped = load_ensemble(ensemble).applicable_profiles(profile)
        self.names = tuple(members)
        structures = PoolStructures()  # one candidate's structure, built once for every member
        self.costs = tuple(CostModel(p, Topology(p, pricing.par), structures=structures) for p in members.values())
        self.margin, self.pricing = margin, pricing
        self._order = list(range(len(self.costs)))

    def reference(self, paper: PoolPlan, layout: TapConfig) -> np.ndarray:
        """The paper's plan ``paper`` priced alone under every member at the layout's Pipeliner."""
        return np.array([self.pricing.straggler_ms(c, paper, layout) for c in self.costs])

    def admits(self, pool: PoolPlan, tap: TapConfig, reference: np.ndarray) -> bool:
        """Whether ``pool`` at ``tap``'s Pipeliner prices at most ``1 + margin`` times ``reference``
        under every member (each priced with that bound as its cutoff)."""
        for pos, i in enumerate(self._order):
            limit = reference[i] * (1.0 + self.margin)
            if self.pricing.straggler_ms(self.costs[i], pool, tap, cutoff=limit) > limit:
                self._order.insert(0, self._order.pop(pos))
                return False
        return True
