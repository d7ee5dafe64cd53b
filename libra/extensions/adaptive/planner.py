"""``libra-adaptive``'s planner config and its per-pool chooser (an extension beyond the Libra paper).

:class:`AdaptiveOptions` declares and validates the options ``libra-adaptive`` adds to ``libra-kt``'s;
:class:`AdaptivePools` plans one pool of a window: every candidate of
:func:`~libra.extensions.adaptive.candidates.candidate_pools`, priced alone on the profile's cost
model, the fastest kept, re-placed for its exposed communication
(:mod:`~libra.extensions.adaptive.rebalance`); :func:`deepened_tap` is the deeper Pipeliner it runs.
The registry's planner (``baselines.libra_planners.LibraAdaptivePlanner``) groups the window into
pools and calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from libra.config import CheckedLayout, ParallelConfig, TapConfig, check_layout, check_tau
from libra.extensions.adaptive.candidates import (
    CANDIDATES,
    DEFAULT_CANDIDATES,
    FINE_TAU,
    HEAVY_TILE_LIMITS,
    CandidateSpace,
    candidate,
    candidate_pools,
)
from libra.extensions.adaptive.rebalance import (
    REBALANCE_MIN_EXCESS,
    REBALANCE_PASSES,
    exposure_excess,
    rebalance_exposed,
)
from libra.extensions.adaptive.robust import ROBUST_MARGIN, EnsembleGuard, PoolPricing, check_margin
from libra.plan import HEADS, Plan, PoolPlan, chunkings
from libra.sim.cost import CostModel
from libra.sim.profiles import HardwareProfile
from libra.sim.profiles.ensemble import DEFAULT_ENSEMBLE, load_ensemble
from libra.sim.topology import Topology
from libra.sim.variability import check_speeds
from libra.tap.planner import plan_pool
from libra.tap.weights import kernel_time_weights
from libra.workload import AttentionShape


@dataclass(frozen=True)
class AdaptiveOptions:
    """The options of ``libra-adaptive`` beyond ``libra-kt``'s (a TapConfig and the profile it plans
    for; ``baselines.libra_planners.LibraAdaptiveConfig`` joins the two):

    Attributes:
        candidates: the per-pool plans to choose from, any of :data:`libra.extensions.adaptive.candidates.CANDIDATES`
            (default :data:`libra.extensions.adaptive.candidates.DEFAULT_CANDIDATES`; one name pins that plan, e.g.
            for an ablation).
        chunkings: the Pipeliner chunkings (:func:`libra.plan.chunkings`) every candidate is priced
            with, the fastest pair kept (one name pins it); default None: each candidate with its own
            (:attr:`~libra.extensions.adaptive.candidates.Candidate.chunking`).
        heavy_tile_limits: the fine candidates' heavy-tile cuts, each as a fraction of a worker's
            mean load (:data:`libra.extensions.adaptive.candidates.HEAVY_TILE_LIMITS`; one value pins it).
        rebalance_passes: how many times the chosen plan may be placed again with each worker's
            exposed communication reserved (:func:`libra.extensions.adaptive.rebalance.rebalance_exposed`), each
            pass kept only while it prices faster (default
            :data:`libra.extensions.adaptive.rebalance.REBALANCE_PASSES`; 0: never).
        fine_tau: the soft-target slack of the fine candidates' placement and re-placement
            (default :data:`libra.extensions.adaptive.candidates.FINE_TAU`; None: the layout's ``tau``, which the
            paper's plan keeps either way).
        deepen_pipeline: run :data:`DEEPER_CHUNKS` times the layout's Pipeliner chunks ``M``
            where the tiles allow it (:meth:`LibraAdaptivePlanner.window_tap`; default True);
            False: the layout's ``M``.
        device_speeds: known speed multipliers of the cluster's GPUs, one per global worker id
            (``DP * CP`` of them; e.g. :func:`libra.extensions.adaptive.speeds.measure_device_speeds`), which
            the candidates' placement (:func:`libra.extensions.adaptive.retention.speed_reserve`) and their pricing
            take into account; default None: every GPU at the profile's speed.
        ensemble: the profile ensemble (:func:`libra.sim.profiles.ensemble.load_ensemble`: a built-in
            name or a path) whose members, applied to the planning profile, guard every choice
            (:class:`libra.extensions.adaptive.robust.EnsembleGuard`: a candidate is kept only if it
            prices within ``robust_margin`` of the paper's plan under every member); default
            :data:`~libra.sim.profiles.ensemble.DEFAULT_ENSEMBLE`; None: the fastest under the
            planning profile alone, trusting it.
        robust_margin: how much slower than the paper's plan a candidate may price under a member
            (default :data:`~libra.extensions.adaptive.robust.ROBUST_MARGIN`).

    Raises:
        ValueError: an empty or unknown candidate or chunking list, a negative or non-integer
            ``rebalance_passes``, a negative or non-finite ``fine_tau``, a non-bool ``deepen_pipeline``,
            a speed that is not finite and > 0, an ensemble that does not load, a margin outside [0, 1).
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    chunkings: tuple[str, ...] | None = None
    heavy_tile_limits: tuple[float, ...] = HEAVY_TILE_LIMITS
    rebalance_passes: int = REBALANCE_PASSES
    fine_tau: float | None = FINE_TAU
    deepen_pipeline: bool = True
    device_speeds: tuple[float, ...] | None = None
    ensemble: str | None = DEFAULT_ENSEMBLE
    robust_margin: float = ROBUST_MARGIN

    def __post_init__(self) -> None:
        if self.ensemble is not None:
            object.__setattr__(self, "ensemble", str(self.ensemble))
            load_ensemble(self.ensemble)  # fails here, at the config boundary, not mid-plan
        object.__setattr__(self, "robust_margin", check_margin(self.robust_margin))
        if self.device_speeds is not None:
            speeds = check_speeds(self.device_speeds, what="libra-adaptive device_speeds")
            object.__setattr__(self, "device_speeds", tuple(speeds.tolist()))
        for field_name, allowed in (("candidates", tuple(CANDIDATES)), ("chunkings", tuple(chunkings()))):
            value = getattr(self, field_name)
            if value is None and field_name == "chunkings":
                continue
            names = (value,) if isinstance(value, str) else tuple(value)
            unknown = [c for c in names if c not in allowed]
            if not names or unknown:
                raise ValueError(f"libra-adaptive {field_name} must be a non-empty subset of {allowed}, got {names!r}")
            object.__setattr__(self, field_name, names)  # frozen: normalise a str or list once
        limits = self.heavy_tile_limits
        limits = (limits,) if isinstance(limits, (int, float)) else tuple(limits)
        if not limits or not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in limits):
            raise ValueError(f"libra-adaptive heavy_tile_limits must be positive finite fractions, got {limits!r}")
        object.__setattr__(self, "heavy_tile_limits", tuple(float(x) for x in limits))
        passes = self.rebalance_passes
        if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 0:
            raise ValueError(f"libra-adaptive rebalance_passes must be an integer >= 0, got {passes!r}")
        object.__setattr__(self, "rebalance_passes", int(passes))
        if self.fine_tau is not None:
            object.__setattr__(self, "fine_tau", check_tau(self.fine_tau, "libra-adaptive fine_tau"))
        if not isinstance(self.deepen_pipeline, (bool, np.bool_)):
            raise ValueError(f"libra-adaptive deepen_pipeline must be True or False, got {self.deepen_pipeline!r}")
        object.__setattr__(self, "deepen_pipeline", bool(self.deepen_pipeline))
        if self.chunkings and HEADS not in self.chunkings and all(candidate(n).relay for n in self.candidates):
            raise ValueError(f"libra-adaptive candidates {list(self.candidates)} relay KV, which runs under head "
                             f"chunks only; chunkings {list(self.chunkings)} leave no candidate to run")




class AdaptivePools:
    """``libra-adaptive``'s per-pool planner for one window layout: every candidate of
    :func:`libra.extensions.adaptive.candidates.candidate_pools` under its chunking (or each configured one), priced
    alone on the profile's cost model (built once here), the fastest kept (ties: the earlier
    candidate, the paper's plan first, then the paper's head chunks) among those the ensemble guard
    admits (:class:`~libra.extensions.adaptive.robust.EnsembleGuard`; every candidate without one).
    ``choices`` maps the window index of a pool's first sequence to the candidate it took."""

    def __init__(self, profile: HardwareProfile, checked: CheckedLayout, config: AdaptiveOptions,
                 layout: TapConfig | None = None):
        par, tap, shape = checked
        self.profile, self.checked, self.config = profile, checked, config
        self.par, self.tap, self.shape = par, tap, shape
        self.cost = CostModel(profile, Topology(profile, par))
        # the fine candidates' layout: their soft-target slack (AdaptiveOptions.fine_tau)
        self.fine_tap = tap if config.fine_tau is None else replace(tap, tau=config.fine_tau)
        self.speeds = None if config.device_speeds is None else np.asarray(config.device_speeds, dtype=np.float64)
        self.pricing = PoolPricing(par, shape, self.speeds)
        self.space = CandidateSpace(tap, shape, profile.kernel, config.candidates, self.cost.topology.byte_cost,
                                    config.heavy_tile_limits, config.fine_tau, checked)
        self.choices: dict[int, str] = {}
        # a deepened Pipeliner (LibraAdaptivePlanner.window_tap) keeps the layout's planner to fall
        # back on, and per pool the price of its plan and of the paper's plan at the layout's M
        self.layout = (None if layout is None or layout == tap
                       else AdaptivePools(profile, check_layout(par, layout, shape), config))
        self.prices: dict[int, list] = {}  # [its price, the paper plan's price or bound, that plan or None]
        self.guard = (None if config.ensemble is None else
                      EnsembleGuard(profile, config.ensemble, config.robust_margin, self.pricing))
        self.unguarded: set[int] = set()  # pools no candidate at this depth passed the guard for

    def __call__(self, k: int, sequences, workers):
        loads = {}
        options = self.options(k, sequences, workers, loads)
        reference = self.reference(k, sequences, workers, options)
        name, pool, times = self._choose(options, reference)
        key = int(sequences[0].seq_id)
        if times is False:  # nothing passed the guard: the paper's plan, or its layout's depth
            name, pool, times = self._unguarded(key, k, sequences, workers, options)
        name, pool, price = self._rebalance(name, pool, times, loads.get(name), reference)
        self.choices[key] = name if pool.chunking == HEADS else f"{name}+{pool.chunking}"
        if self.layout is not None:
            price = self._price(pool) if price is None else price
            paper = self._paper_plan(k, sequences, workers, options)
            compute, exposed = self._worker_ms(paper, price, self.layout.tap)
            # above its price the paper plan's compute alone settles it (a lower bound: branch and
            # bound, as choose); kept to price exactly only if keep_depth needs it
            self.prices[key] = ([price, float((compute + exposed).max()), None] if exposed is not None
                                else [price, float(compute.max()), paper])
        return pool

    def reference(self, k: int, sequences, workers, options) -> np.ndarray | None:
        """The paper's plan of the pool priced under every guard member at the layout's ``M`` (what
        ``libra`` runs); None without a guard."""
        if self.guard is None:
            return None
        layout = self.tap if self.layout is None else self.layout.tap
        return self.guard.reference(self._paper_plan(k, sequences, workers, options), layout)

    def _unguarded(self, key: int, k: int, sequences, workers, options):
        """The choice when no candidate passes the guard: at a deepened Pipeliner the fastest (the
        Plan is planned again at the layout's ``M`` by :meth:`keep_depth`), else the paper's plan,
        which passes by definition -- unless the configured candidates leave it out (a pin, e.g.
        for an ablation, is kept: the fastest of them)."""
        if self.layout is not None or "alg2-flops" not in self.config.candidates:
            self.unguarded.add(key)
            return self._choose(options, None)
        return "alg2-flops", replace(self._paper_plan(k, sequences, workers, options), chunking=HEADS), None

    def _price(self, pool: PoolPlan, tap: TapConfig | None = None) -> float:
        """``pool``'s priced straggler alone, at ``tap``'s Pipeliner chunks (default this planner's)."""
        compute, exposed = self._worker_ms(pool, tap=tap)
        return float((compute + exposed).max())

    def _paper_plan(self, k: int, sequences, workers, options) -> PoolPlan:
        """The paper's Alg. 2 plan of the pool (``libra``'s; its placement does not depend on
        ``M``): the ``alg2-flops`` candidate when priced among ``options``, else planned here."""
        for name, pool in options:
            if name == "alg2-flops" and pool.chunking == HEADS:
                return pool
        return plan_pool(k, sequences, workers, replace(self.tap, load_estimate="flops"), self.shape,
                         checked=self.checked)

    def keep_depth(self, plan: Plan) -> tuple[Plan, AdaptivePools]:
        """``(plan, the planner of its pools)``: ``plan`` when it runs the layout's ``M`` or, with every
        pool's choice guarded, its slowest pool prices no slower than the paper's plan of the
        slowest pool at the layout's ``M``; else its pools planned again at the layout's ``M`` (so
        ``libra-adaptive`` is never priced slower than ``libra``, Libra sec. 4.4's ``M``)."""
        if self.layout is None or not plan.pools:
            return plan, self
        keys = [int(pool.sequences[0].seq_id) for pool in plan.pools]
        if not self.unguarded.intersection(keys):
            slowest = max(self.prices[k][0] for k in keys)
            if slowest <= max(self.prices[k][1] for k in keys):
                return plan, self  # some paper pool's bound already reaches the slowest
            for k in keys:  # every paper price below it is exact already; price the bounded ones
                entry = self.prices[k]
                if entry[2] is not None:
                    entry[1], entry[2] = self._price(entry[2], self.layout.tap), None
            if slowest <= max(self.prices[k][1] for k in keys):
                return plan, self
        pools = tuple(self.layout(pool.pool_index, pool.sequences, pool.workers) for pool in plan.pools)
        M = self.layout.tap.pipeline_chunks
        return replace(plan, pools=pools, pipeline_chunks=M, meta={**plan.meta, "pipeline_chunks": M}), self.layout

    def options(self, k: int, sequences, workers, loads: dict | None = None) -> list[tuple[str, PoolPlan]]:
        """Every ``(candidate name, pool plan)`` to price: :func:`~libra.extensions.adaptive.candidates.candidate_pools`
        each under its chunking (or every configured one); ``loads`` (optional) receives the fine
        candidates' tile loads (``candidate_pools(loads=...)``) for :meth:`rebalance`.

        Raises:
            ValueError: no candidate runs under the configured chunkings.
        """
        found = candidate_pools(k, sequences, workers, self.space, loads=loads, speeds=self._speeds_of(workers))
        # each candidate under its own chunking (or every configured one): pricing only the winner
        # of one chunking under the others was measured to lose 0.1-4.0% (ProLong 256K: 4.0%)
        # (KV relays run under head chunks only: ChunkSchedule.check_hops)
        options = [(n, replace(p, chunking=c)) for n, p in found.items()
                   for c in (self.config.chunkings or (candidate(n).chunking,))
                   if c == HEADS or not p.transfers.hop.any()]
        if not options:
            raise ValueError(f"libra-adaptive: no candidate of {list(found)} runs under chunkings "
                             f"{list(self.config.chunkings)} (KV relays need head chunks)")
        return options

    def choose(self, options: list[tuple[str, PoolPlan]], reference: np.ndarray | None = None) -> tuple[str, PoolPlan]:
        """The fastest of ``options`` as the cost model prices each pool alone (ties: the earlier),
        among those the guard admits against ``reference`` (:meth:`reference`; None: every option).

        Branch and bound, same choice as pricing every option: the options are priced in
        :func:`price_order` and an option whose compute alone exceeds the best priced straggler
        so far (:meth:`libra.sim.cost.CostModel.straggler_ms` with ``cutoff``) is dropped unpriced
        -- it cannot win, since exposed communication only adds to compute. The margin keeps
        rounding (an exposed term of -1 ulp) from dropping an exact tie. Only an option that would
        become the best is checked against the ensemble. Without an admitted option: ``(None, None)``."""
        name, pool, _ = self._choose(options, reference)
        return (name, pool) if name is not None else (None, None)

    def _choose(self, options: list[tuple[str, PoolPlan]], reference: np.ndarray | None = None):
        """:meth:`choose` and the winner's priced ``(compute, exposed)`` per pool worker (None for a
        lone option that :meth:`rebalance` would not re-place: nothing needs its price); ``(None,
        None, False)`` when the guard admits no option."""
        if len(options) == 1 and not self._rebalances(options[0][0]) and reference is None:
            return (*options[0], None)
        best, pick, times = float("inf"), None, None
        for i in (price_order([n for n, _ in options]) if len(options) > 1 else [0]):
            compute, exposed = self._worker_ms(options[i][1], cutoff=best * (1 + 1e-9))
            t = float((compute if exposed is None else compute + exposed).max())
            better = t < best or (t == best and pick is not None and i < pick)
            if better and (reference is None or self.guard.admits(options[i][1], self.tap, reference)):
                best, pick, times = t, i, (compute, exposed)
        return (None, None, False) if pick is None else (*options[pick], times)

    def rebalance(self, name: str, pool: PoolPlan, times, load: np.ndarray | None = None,
                  reference: np.ndarray | None = None) -> tuple[str, PoolPlan]:
        """:meth:`_rebalance` without the price."""
        return self._rebalance(name, pool, times, load, reference)[:2]

    def _rebalance(self, name: str, pool: PoolPlan, times, load: np.ndarray | None = None,
                   reference: np.ndarray | None = None):
        """The chosen ``pool`` after up to ``rebalance_passes`` passes of
        :func:`libra.extensions.adaptive.rebalance.rebalance_exposed`, the fastest priced plan that
        the guard admits against ``reference`` kept (its name gains ``+rebalanced``). The first pass
        reserves the chosen plan's exposure; each later one the mean
        of the last reservation and the last plan's exposure (:data:`~libra.extensions.adaptive.rebalance.REBALANCE_PASSES`:
        reserving only the last plan's exposure swings work back and forth between passes). Passes
        stop once the last plan's :func:`~libra.extensions.adaptive.rebalance.exposure_excess` is at most
        :data:`~libra.extensions.adaptive.rebalance.REBALANCE_MIN_EXCESS`. Candidates outside
        that do not retain (:attr:`~libra.extensions.adaptive.candidates.Candidate.retain`) stay. ``load``: the plan's tile loads as placed, when
        the caller has them (:meth:`options`' ``loads``); estimated here otherwise. Returns
        ``(name, pool, price)``, the price its straggler as priced (None when nothing priced it)."""
        if times is None or times[1] is None:
            return name, pool, None
        if not self._rebalances(name):
            return name, pool, float((times[0] + times[1]).max())
        passes = self.config.rebalance_passes
        if load is None:
            load = kernel_time_weights(pool.tiles, pool.sequences, self.shape, self.profile.kernel,
                                       self.tap.pipeline_chunks, index=pool.index())
        best, kept, current = float((times[0] + times[1]).max()), (name, pool), pool
        reserved = times[1]
        for i in range(passes):
            if exposure_excess(*times) <= REBALANCE_MIN_EXCESS:
                break  # too little exposure above the pool's mean to win back (REBALANCE_MIN_EXCESS)
            current = rebalance_exposed(name, current, self.shape, self.fine_tap, load, (times[0], reserved),
                                        link_cost=self.cost.topology.byte_cost, speeds=self._speeds_of(pool.workers))
            times = self._worker_ms(current, cutoff=best if i == passes - 1 else float("inf"))
            if times[1] is None:
                break  # the last pass, its compute alone above the best
            t = float((times[0] + times[1]).max())
            if t < best and (reference is None or self.guard.admits(current, self.tap, reference)):
                best, kept = t, (f"{name}+rebalanced", current)
            reserved = (reserved + times[1]) / 2
        return (*kept, best)

    def _rebalances(self, name: str) -> bool:
        """Whether :meth:`rebalance` may re-place candidate ``name`` (passes configured, a
        retention placement, :attr:`~libra.extensions.adaptive.candidates.Candidate.retain`)."""
        return bool(self.config.rebalance_passes) and candidate(name).retain

    def _worker_ms(self, pool: PoolPlan, cutoff: float = float("inf"), tap: TapConfig | None = None):
        """``pool``'s priced ``(compute, exposed)`` per pool worker (``exposed`` None above ``cutoff``),
        at ``tap``'s Pipeliner chunks (default this planner's)."""
        return self.pricing.worker_ms(self.cost, pool, tap or self.tap, cutoff)

    def _speeds_of(self, workers) -> np.ndarray | None:
        """The known speeds of ``workers`` (global ids, in their order); None when none are known."""
        return None if self.speeds is None else self.speeds[list(workers)]

    def stages(self, k: int, sequences, workers) -> dict:
        """The parts of one call that ``libra-bench plan-cost`` times apart, as zero-argument calls:
        ``candidates`` (:meth:`options`), ``reference`` (the paper's plan priced under the guard's
        members, with a guard), ``pricing`` (:meth:`choose` on them, built once here, the guard's
        checks included), ``rebalance`` (:meth:`rebalance` of the chosen plan) and, with a deepened
        Pipeliner, ``depth`` (pricing the paper's plan at the layout's ``M`` for :meth:`keep_depth`,
        its compute alone where that already exceeds the chosen plan's price)."""
        loads = {}
        options = self.options(k, sequences, workers, loads)
        reference = self.reference(k, sequences, workers, options)
        chosen = self._choose(options, reference)
        if chosen[2] is False:
            chosen = self._unguarded(-1, k, sequences, workers, options)
        price = self._rebalance(*chosen, loads.get(chosen[0]), reference)[2]
        parts = {"candidates": partial(self.options, k, sequences, workers),
                 "pricing": partial(self.choose, options, reference),
                 "rebalance": partial(self.rebalance, *chosen, loads.get(chosen[0]), reference)}
        if self.guard is not None:
            parts["reference"] = partial(self.reference, k, sequences, workers, options)
        if self.layout is not None:  # the deeper Pipeliner's guard: the paper's plan at the layout's M
            parts["depth"] = partial(self._worker_ms, self._paper_plan(k, sequences, workers, options),
                                     float("inf") if price is None else price, self.layout.tap)
        return parts


DEEPER_CHUNKS = 2
"""How many times the layout's Pipeliner chunks ``M`` ``libra-adaptive`` runs (``deepen_pipeline``).
Only chunk 0's dispatch and chunk ``M - 1``'s return are never hidden (Libra sec. 4.4), each about
``1/M`` of a worker's traffic, and on real corpora those two transfers are most of the straggler's
exposed communication; a deeper Pipeliner shortens them for a few more chunk latencies and kernel
calls. Measured with ``straggler``'s pricing (4 windows, jitter on; every Plan at one depth),
``libra-adaptive``'s mean speedup over Ulysses at M = 4 / 8: Wikipedia 4.744 / 4.766 (256K) and
2.929 / 2.985 (1M), ProLong 7.183 / 7.178 and 3.812 / 3.899, libra-prod 2.341 / 2.369 and
2.502 / 2.519, the WLB-LLM synthetic corpus 3.167 / 3.215 and 2.063 / 2.110. M = 16 cuts
the paper shape's one-KV-head tiles (8 query heads) to two KV heads, which head chunks of one query
head per chunk need (:func:`libra.extensions.adaptive.candidates.fine_head_split`), and lost up to 45%. Choosing per
Plan between M = 4 and 8 by pricing the plan built for M = 4 at both gained less than planning at
8 (Wikipedia 1M 2.953, ProLong 1M 3.866, libra-prod 256K 2.345): the tile loads, chunkings and
re-placement are priced at the depth that runs."""


def price_order(names) -> list[int]:
    """Indices of candidate ``names`` in pricing order: the candidates with a ``price_rank``
    (:attr:`~libra.extensions.adaptive.candidates.Candidate.price_rank`) in its order, then the rest
    (finer heavy-tile cuts ``name@limit`` included) as given."""
    last = len(CANDIDATES)

    def rank(label: str) -> int:
        c = CANDIDATES.get(label)
        return last if c is None or c.price_rank is None else c.price_rank

    return sorted(range(len(names)), key=lambda i: rank(names[i]))


def deepened_tap(tap: TapConfig, par: ParallelConfig, shape: AttentionShape) -> TapConfig:
    """``tap`` with the Pipeliner deepened: ``M`` times :data:`DEEPER_CHUNKS` where the one-KV-head
    tiles (``hq / hkv`` query heads) and the paper's tiles (``hq / H``) still split into that many
    head chunks and the layout allows it (:func:`libra.config.check_layout`); ``tap`` otherwise."""
    deeper = replace(tap, pipeline_chunks=DEEPER_CHUNKS * tap.pipeline_chunks)
    if (shape.num_q_heads // shape.num_kv_heads) % deeper.pipeline_chunks:
        return tap  # head chunks would cut the one-KV-head tiles wider (fine_head_split)
    try:
        check_layout(par, deeper, shape)
    except ValueError:
        return tap
    return deeper
