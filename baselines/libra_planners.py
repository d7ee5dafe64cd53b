"""Libra and its ablation variants as planners (Libra sec. 4, 6.1 "Comparison methods").

* ``libra-tap``: Tiled Attention Pooling only. Pools are formed in production order (``P``
  consecutive DP ranks at each GA index) and TAP places SH-Tiles inside each pool (sec. 4.3).
* ``libra-tap-vrsp``: adds Variance-Reduced Sequence Placement (sec. 4.2): VRSP groups the whole
  window's packed sequences into ``K = GBS/P`` pools by their workload ``w(S) = sum l^2``, and
  :func:`libra.vrsp.microbatch_groups` maps pool ``k`` to GA index ``k // (DP/P)``.
* ``libra``: adds the TAP Pipeliner (sec. 4.4, default ``M = 4``). The Pipeliner changes how a
  Plan is executed (``Plan.pipeline_chunks``), never the placement, so ``libra`` and
  ``libra-tap-vrsp`` produce the same tiles and transfers for the same options.
* ``libra-kt``: ``libra`` with kernel-time-aware TAP placement (an extension, not in the paper):
  Algorithm 2 balances each tile's estimated kernel time under the ``profile``'s kernel model
  (:func:`libra.tap.weights.kernel_time_weights`) instead of its FLOPs, so pools of short
  samples, which the kernel runs below its best rate, are balanced in time. Same VRSP pools and
  Pipeliner as ``libra``. It needs the profile the cluster will run with -- ideally a measured
  one from ``libra-bench calibrate`` -- since a wrong kernel curve mis-weights short segments.

Every planner here (and ``distca``) is a :class:`TapPlanner`: its config *is* a
:class:`libra.config.TapConfig` (``libra-kt``: a TapConfig plus the profile), the one declaration
of the TAP layout and its defaults. A variant pins the TapConfig fields it fixes
(:attr:`TapPlanner.pinned`, applied with :func:`dataclasses.replace`): ``libra-tap`` and
``libra-tap-vrsp`` ``M = 1``, ``libra-kt`` ``load_estimate="kernel-time"``, ``distca``
``comm_aware=False``; the other fields are its :func:`baselines.registry.get_planner` options.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from baselines.registry import Planner, pool_workers, production_groups, window_lengths
from libra.config import CheckedLayout, ParallelConfig, TapConfig, check_layout
from libra.extensions.adaptive.planner import AdaptiveOptions, AdaptivePools, deepened_tap
from libra.plan import Plan, SequenceLayout
from libra.sim.profiles import DEFAULT_PROFILE, HardwareProfile, load_profile
from libra.tap.planner import plan_pool
from libra.vrsp import pool_imbalance, vrsp_schedule
from libra.workload import AttentionShape, packed_workloads


def plan_grouped_window(method: str, lengths: list[np.ndarray], groups: np.ndarray, par: ParallelConfig,
                        tap: TapConfig, shape: AttentionShape, meta: dict, plan_one=None) -> list[Plan]:
    """Run TAP on every pool of every GA index.

    Args:
        method: registry name recorded in the Plans.
        lengths: sample lengths of every window sequence (``gbs`` arrays).
        groups: ``(GA, DP)`` window indices: ``groups[g, d]`` runs at GA ``g`` on DP rank ``d``.
        par, tap, shape: a layout that passed :func:`libra.config.check_layout` (the caller's one
            check per window, as :meth:`TapPlanner.plan_window` does; not repeated here or per pool).
        meta: method parameters copied into every Plan.
        plan_one: ``(k, sequences, workers) -> PoolPlan`` planning one pool (default:
            :func:`libra.tap.planner.plan_pool` with ``tap`` and ``shape``, FLOPs-balanced).

    Returns:
        ``par.ga`` Plans with ``DP / P`` pools each; pool ``k`` spans DP ranks ``[k*P, (k+1)*P)``.

    Raises:
        ValueError: ``groups`` not a ``(GA, DP)`` permutation of the window, and the errors of
            :func:`libra.tap.planner.plan_pool`.
    """
    groups = np.asarray(groups)
    if groups.shape != (par.ga, par.dp) or sorted(groups.ravel().tolist()) != list(range(par.gbs)):
        raise ValueError(f"groups must be a ({par.ga}, {par.dp}) permutation of the window, got shape {groups.shape}")
    P = tap.pool_size
    plans = []
    for g in range(par.ga):
        pools = []
        for k in range(par.dp // P):
            p0 = k * P
            seqs = [SequenceLayout.contiguous(int(groups[g, p0 + j]), p0 + j, lengths[int(groups[g, p0 + j])], par.cp)
                    for j in range(P)]
            workers = pool_workers(p0, P, par.cp)
            pools.append(plan_pool(k, seqs, workers, tap, shape) if plan_one is None else plan_one(k, seqs, workers))
        plans.append(Plan(method=method, ga_index=g, shape=shape, cp=par.cp, pipeline_chunks=tap.pipeline_chunks,
                          pools=tuple(pools), meta=dict(meta)))
    return plans


def vrsp_groups(lengths: list[np.ndarray], par: ParallelConfig, pool_size: int) -> tuple[np.ndarray, float]:
    """VRSP over the window's packed workloads, mapped to ``(GA, DP)`` slots; also returns R - 1."""
    workloads = packed_workloads(lengths)
    pools, groups = vrsp_schedule(workloads, pool_size, par.dp)
    return groups, float(pool_imbalance(workloads, pools))


class TapPlanner(Planner):
    """A planner whose config is a :class:`TapConfig`: TAP placement inside pools of ``P`` replicas.

    Attributes:
        config: the TapConfig, with :attr:`pinned` applied.
        pinned: TapConfig fields the method fixes; they are not options, and a config given to the
            constructor has them replaced (:func:`dataclasses.replace`).
        per_window: TapConfig fields set from each window's layout (:meth:`window_tap`); not options.
        grouping: how the window's sequences are grouped into pools (recorded in ``Plan.meta``).

    Raises:
        ValueError: a config that is not a TapConfig.
    """

    Config = TapConfig
    pinned: dict = {"load_estimate": "flops"}
    per_window: tuple[str, ...] = ()
    grouping = "production"

    def __init__(self, config: TapConfig | None = None):
        config = TapConfig() if config is None else config
        if not isinstance(config, TapConfig):
            raise ValueError(f"{type(self).__name__} takes a TapConfig, got {type(config).__name__}")
        self.config = replace(config, **self.pinned)

    @property
    def tap(self) -> TapConfig:
        """The TAP layout this planner plans with (``pool_size`` of :attr:`per_window` not yet set)."""
        return self.config

    @property
    def pipeline_chunks(self) -> int:
        return self.tap.pipeline_chunks

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The TapConfig fields that are neither pinned nor set per window."""
        return tuple(f.name for f in fields(TapConfig) if f.name not in cls.pinned and f.name not in cls.per_window)

    @classmethod
    def from_options(cls, **options) -> TapPlanner:
        return cls.from_tap(TapConfig(**options))

    @classmethod
    def from_tap(cls, tap: TapConfig, profile=None, **options) -> TapPlanner:
        """The planner holding ``tap`` whole as its config, its :attr:`pinned` fields applied; a
        TAP-only planner plans without a profile, so ``profile`` is ignored.

        Raises:
            ValueError: any other option (a TapPlanner's options are its TapConfig's fields).
        """
        if options:
            raise ValueError(f"planner {cls.name!r} takes no option(s) {sorted(options)} besides its TapConfig")
        return cls(tap)

    def window_tap(self, par: ParallelConfig, shape: AttentionShape | None = None) -> TapConfig:
        """The TapConfig of one window in layout ``par`` (:attr:`per_window` fields set) for heads
        ``shape`` (None: not known yet; only ``libra-adaptive``'s Pipeliner depth reads it)."""
        return self.tap

    def groups(self, lengths, par: ParallelConfig, tap: TapConfig) -> tuple[np.ndarray, dict]:
        """``(GA, DP)`` window indices per slot and extra Plan meta (production order here)."""
        return production_groups(par), {}

    def load_model(self) -> tuple[object, dict]:
        """The KernelModel Alg. 2 balances under (None: FLOPs) and the meta recording it."""
        return None, {}

    def pool_planner(self, par: ParallelConfig, shape: AttentionShape, checked: CheckedLayout | None = None):
        """``(plan_one, meta)``: the call that plans one pool of a window in layout ``par`` --
        ``plan_one(k, sequences, workers) -> PoolPlan`` -- and the method's meta for its Plans. The
        one per-pool entry point: :meth:`plan_window` plans every pool with it, ``libra-bench
        plan-cost`` times it. ``checked``: the window's :func:`libra.config.check_layout` result
        (None: checked here), which every pool's plan_pool reuses."""
        tap = self.window_tap(par, shape)
        checked = check_layout(par, tap, shape) if checked is None else checked
        kernel, kernel_meta = self.load_model()

        def plan_one(k, sequences, workers):
            return plan_pool(k, sequences, workers, tap, shape, kernel=kernel, checked=checked)

        return plan_one, kernel_meta

    def plan_window(self, window, par: ParallelConfig, shape: AttentionShape) -> list[Plan]:
        """See :class:`Planner`. Checks the layout once (:func:`libra.config.check_layout`), then
        plans every pool of every GA index with :meth:`pool_planner`.

        Raises:
            ValueError: P not dividing DP, B not dividing S/CP, H not dividing hq, M not dividing
                hq/H, or a window that does not match ``par``.
        """
        tap = self.window_tap(par, shape)
        checked = check_layout(par, tap, shape)
        lengths = window_lengths(window, par)
        groups, extra = self.groups(lengths, par, tap)
        return self.plan_groups(lengths, groups, par, shape, extra, checked)

    def plan_groups(self, lengths: list[np.ndarray], groups: np.ndarray, par: ParallelConfig, shape: AttentionShape,
                    meta: dict | None = None, checked: CheckedLayout | None = None) -> list[Plan]:
        """This method's Plans of a window whose pools are already grouped -- ``groups[g, d]`` the
        window index at GA ``g`` on DP rank ``d``, e.g. a :class:`libra.sampler.LibraSampler` step's
        VRSP groups -- with every pool planned by :meth:`pool_planner` and :meth:`finish` applied:
        how a training loop plans the steps its sampler hands it (``meta`` joins each Plan's).

        Raises:
            ValueError: a layout :func:`libra.config.check_layout` rejects (``checked``: its result,
                when the caller checked already),
                ``groups`` not a ``(GA, DP)`` permutation of the window.
        """
        tap = self.window_tap(par, shape)
        checked = check_layout(par, tap, shape) if checked is None else checked
        plan_one, method_meta = self.pool_planner(par, shape, checked)
        meta = {"grouping": self.grouping, **asdict(tap), **(meta or {}), **method_meta}
        plans = plan_grouped_window(self.name, lengths, groups, par, tap, shape, meta, plan_one=plan_one)
        return self.finish(plans, plan_one)

    def finish(self, plans: list[Plan], plan_one) -> list[Plan]:
        """Hook applied to a window's Plans (planned by ``plan_one``) before they are returned."""
        return plans


class LibraTapPlanner(TapPlanner):
    """``libra-tap``: production-order pools of ``P`` replicas, TAP placement, no Pipeliner (``M = 1``)."""

    name = "libra-tap"
    pinned = {"load_estimate": "flops", "pipeline_chunks": 1}


class LibraTapVrspPlanner(LibraTapPlanner):
    """``libra-tap-vrsp``: VRSP pools over the window, TAP placement, no Pipeliner."""

    name = "libra-tap-vrsp"
    grouping = "vrsp"

    def groups(self, lengths, par: ParallelConfig, tap: TapConfig) -> tuple[np.ndarray, dict]:
        groups, imbalance = vrsp_groups(lengths, par, tap.pool_size)
        return groups, {"pool_imbalance": imbalance}


class LibraPlanner(LibraTapVrspPlanner):
    """``libra``: VRSP + TAP + Pipeliner (``M`` chunks along the head axis, TapConfig's default)."""

    name = "libra"
    pinned = {"load_estimate": "flops"}


@dataclass(frozen=True)
class LibraKtConfig:
    """Config of ``libra-kt``: full ``libra``'s TapConfig plus the hardware profile whose kernel
    model prices the tiles (kernel-time-aware placement).

    Attributes:
        tap: the TAP layout (the planner pins ``load_estimate="kernel-time"``).
        profile: a built-in profile name, a profile ``.json`` path (e.g. written by ``libra-bench
            calibrate``) or a loaded :class:`libra.sim.profiles.HardwareProfile`. Use the profile
            the cluster runs with; the estimate is only as good as its kernel curve.

    Raises:
        ValueError: a tap that is not a TapConfig, or a profile that cannot be loaded.
    """

    tap: TapConfig = field(default_factory=TapConfig)
    profile: str | HardwareProfile = DEFAULT_PROFILE

    def __post_init__(self) -> None:
        if not isinstance(self.tap, TapConfig):
            raise ValueError(f"LibraKtConfig.tap must be a TapConfig, got {type(self.tap).__name__}")
        if not isinstance(self.profile, (str, HardwareProfile)) or isinstance(self.profile, bool):
            raise ValueError(f"libra-kt profile must be a profile name, a .json path or a HardwareProfile, "
                             f"got {self.profile!r}")
        load_profile(self.profile)  # fail here, at construction, on an unknown name or a bad file


class LibraKtPlanner(LibraPlanner):
    """``libra-kt``: ``libra`` (VRSP + TAP + Pipeliner) with tiles balanced by estimated kernel time
    under ``profile``'s kernel model instead of FLOPs. An extension, not in the paper.

    Its options are ``libra``'s plus ``profile``; ``config`` is a :class:`LibraKtConfig`.
    """

    name = "libra-kt"
    Config = LibraKtConfig
    pinned = {"load_estimate": "kernel-time"}

    def __init__(self, config: LibraKtConfig | None = None):
        config = self.Config() if config is None else config
        if not isinstance(config, self.Config):
            raise ValueError(f"{type(self).__name__} takes a {self.Config.__name__}, got {type(config).__name__}")
        self.config = replace(config, tap=replace(config.tap, **self.pinned))

    @property
    def tap(self) -> TapConfig:
        return self.config.tap

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return super().option_names() + tuple(f.name for f in fields(cls.Config) if f.name != "tap")

    @classmethod
    def from_options(cls, **options) -> LibraKtPlanner:
        own = {f.name for f in fields(cls.Config)} - {"tap"}
        tap = TapConfig(**{k: v for k, v in options.items() if k not in own})
        return cls.from_tap(tap, **{k: v for k, v in options.items() if k in own})

    @classmethod
    def from_tap(cls, tap: TapConfig, profile=None, **options) -> LibraKtPlanner:
        """The planner whose config holds ``tap`` whole (``load_estimate`` pinned), ``profile``
        (None: the config's default) and its own ``options``."""
        given = {} if profile is None else {"profile": profile}
        return cls(cls.Config(tap=tap, **given, **options))

    def load_model(self) -> tuple[object, dict]:
        # the estimate's profile goes into the plan (and its hash): a plan made for another
        # cluster's kernel curve is a different plan
        profile = load_profile(self.config.profile)
        return profile.kernel, {"kernel_profile": profile.name, "kernel": profile.kernel.to_dict()}


@dataclass(frozen=True)
class LibraAdaptiveConfig(AdaptiveOptions, LibraKtConfig):
    """Config of ``libra-adaptive``: ``libra-kt``'s (TapConfig + the profile it plans for) plus the
    extension's :class:`~libra.extensions.adaptive.planner.AdaptiveOptions`.

    Raises:
        ValueError: the errors of both.
    """

    def __post_init__(self) -> None:
        LibraKtConfig.__post_init__(self)
        AdaptiveOptions.__post_init__(self)


class LibraAdaptivePlanner(LibraKtPlanner):
    """``libra-adaptive``: VRSP pools, then per pool the fastest of its candidates
    (:data:`libra.extensions.adaptive.candidates.DEFAULT_CANDIDATES`: the paper's Alg. 2 plan and a plan with one KV
    head per tile placed in Q-home retention order with each byte priced by the link it crosses,
    with its KV fan-out sent directly or relayed) as the profile's cost model prices that pool
    alone (no device jitter;
    :class:`libra.sim.cost.CostModel`; the links from its :class:`~libra.sim.topology.Topology`).
    An extension for real corpora, not in the paper.

    Planning with the cost model means its choice is as good as the profile: with a profile that
    mis-prices this cluster (uncalibrated links or kernel curve) it can pick a worse candidate than
    ``libra`` would have planned; simulated comparisons priced with the same profile show its best
    case. Each candidate is priced under its Pipeliner chunking
    (:attr:`libra.extensions.adaptive.candidates.Candidate.chunking`; ``tiles``: :mod:`libra.extensions.adaptive.tile_chunks`), or under each
    of ``chunkings`` when given, and the fastest runs. Each Plan's ``meta["adaptive_choice"]`` names
    the candidate each pool took (``name+tiles`` when it runs tile-chunked).
    """

    name = "libra-adaptive"
    Config = LibraAdaptiveConfig
    grouping = "vrsp"

    def pool_planner(self, par: ParallelConfig, shape: AttentionShape, checked: CheckedLayout | None = None):
        """See :meth:`TapPlanner.pool_planner`: an :class:`AdaptivePools` on the profile's cost model."""
        profile = load_profile(self.config.profile)
        speeds = self.config.device_speeds
        if speeds is not None and len(speeds) != par.workers:
            raise ValueError(f"libra-adaptive device_speeds has {len(speeds)} entries; the layout has "
                             f"{par.workers} GPUs (DP * CP)")
        checked = check_layout(par, self.window_tap(par, shape), shape) if checked is None else checked
        plan_one = AdaptivePools(profile, checked, self.config, layout=super().window_tap(par, shape))
        return plan_one, {"kernel_profile": profile.name, "candidates": list(self.config.candidates),
                          "heavy_tile_limits": list(self.config.heavy_tile_limits),
                          "rebalance_passes": self.config.rebalance_passes,
                          "fine_tau": self.config.fine_tau,
                          "deepen_pipeline": self.config.deepen_pipeline,
                          "device_speeds": self.config.device_speeds is not None,
                          "layout_pipeline_chunks": self.tap.pipeline_chunks,
                          "ensemble": self.config.ensemble, "robust_margin": self.config.robust_margin,
                          "ensemble_skipped": list(plan_one.guard.skipped) if plan_one.guard else []}

    def window_tap(self, par: ParallelConfig, shape: AttentionShape | None = None) -> TapConfig:
        """The layout's TapConfig with the Pipeliner deepened (``deepen_pipeline``): ``M`` times
        :data:`~libra.extensions.adaptive.planner.DEEPER_CHUNKS` where the one-KV-head tiles (``hq / hkv`` query heads) and the paper's
        tiles (``hq / H``) still split into that many head chunks and the layout allows it
        (:func:`libra.config.check_layout`); the layout's ``M`` otherwise. The Plans carry it
        (``pipeline_chunks``, which the runtime and the simulator run)."""
        tap = super().window_tap(par, shape)
        if not self.config.deepen_pipeline or shape is None:
            return tap
        return deepened_tap(tap, par, shape)

    def finish(self, plans: list[Plan], plan_one) -> list[Plan]:
        """Each Plan's ``meta["adaptive_choice"]`` (the candidate each of its pools took), after
        :meth:`AdaptivePools.keep_depth`: a deepened Plan whose slowest pool prices slower than the
        paper's plan of its slowest pool at the layout's ``M`` is planned again at that ``M``."""
        out = []
        for p in plans:
            p, planner = plan_one.keep_depth(p)
            out.append(replace(p, meta={**p.meta, "adaptive_choice": [planner.choices[int(pool.sequences[0].seq_id)]
                                                                       for pool in p.pools]}))
        return out


