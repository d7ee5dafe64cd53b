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
from libra.config import ParallelConfig, TapConfig, check_layout
from libra.plan import Plan, SequenceLayout
from libra.sim.profiles import DEFAULT_PROFILE, HardwareProfile, load_profile
from libra.tap.planner import plan_pool
from libra.vrsp import pool_imbalance, vrsp_schedule
from libra.workload import AttentionShape, packed_workloads


def plan_grouped_window(method: str, lengths: list[np.ndarray], groups: np.ndarray, par: ParallelConfig,
                        tap: TapConfig, shape: AttentionShape, meta: dict, kernel=None) -> list[Plan]:
    """Run TAP on every pool of every GA index.

    Args:
        method: registry name recorded in the Plans.
        lengths: sample lengths of every window sequence (``gbs`` arrays).
        groups: ``(GA, DP)`` window indices: ``groups[g, d]`` runs at GA ``g`` on DP rank ``d``.
        par, tap, shape: a layout that passed :func:`libra.config.check_layout` (the caller's one
            check per window, as :meth:`TapPlanner.plan_window` does; not repeated here or per pool).
        meta: method parameters copied into every Plan.
        kernel: the KernelModel for ``tap.load_estimate == "kernel-time"`` (None for FLOPs).

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
            pools.append(plan_pool(k, seqs, pool_workers(p0, P, par.cp), tap, shape, kernel=kernel,
                                   layout_checked=True))
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
        return cls(TapConfig(**options))

    def window_tap(self, par: ParallelConfig) -> TapConfig:
        """The TapConfig of one window in layout ``par`` (:attr:`per_window` fields set)."""
        return self.tap

    def groups(self, lengths, par: ParallelConfig, tap: TapConfig) -> tuple[np.ndarray, dict]:
        """``(GA, DP)`` window indices per slot and extra Plan meta (production order here)."""
        return production_groups(par), {}

    def load_model(self) -> tuple[object, dict]:
        """The KernelModel Alg. 2 balances under (None: FLOPs) and the meta recording it."""
        return None, {}

    def plan_window(self, window, par: ParallelConfig, shape: AttentionShape) -> list[Plan]:
        """See :class:`Planner`. Checks the layout once (:func:`libra.config.check_layout`), then
        plans every pool of every GA index.

        Raises:
            ValueError: P not dividing DP, B not dividing S/CP, H not dividing hq, M not dividing
                hq/H, or a window that does not match ``par``.
        """
        tap = self.window_tap(par)
        check_layout(par, tap, shape)
        lengths = window_lengths(window, par)
        groups, extra = self.groups(lengths, par, tap)
        kernel, kernel_meta = self.load_model()
        meta = {"grouping": self.grouping, **asdict(tap), **extra, **kernel_meta}
        return plan_grouped_window(self.name, lengths, groups, par, tap, shape, meta, kernel=kernel)


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
        config = LibraKtConfig() if config is None else config
        if not isinstance(config, LibraKtConfig):
            raise ValueError(f"LibraKtPlanner takes a LibraKtConfig, got {type(config).__name__}")
        self.config = replace(config, tap=replace(config.tap, **self.pinned))

    @property
    def tap(self) -> TapConfig:
        return self.config.tap

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return super().option_names() + tuple(f.name for f in fields(LibraKtConfig) if f.name != "tap")

    @classmethod
    def from_options(cls, **options) -> LibraKtPlanner:
        own = {f.name for f in fields(LibraKtConfig)} - {"tap"}
        tap = TapConfig(**{k: v for k, v in options.items() if k not in own})
        return cls(LibraKtConfig(tap=tap, **{k: v for k, v in options.items() if k in own}))

    def load_model(self) -> tuple[object, dict]:
        # the estimate's profile goes into the plan (and its hash): a plan made for another
        # cluster's kernel curve is a different plan
        profile = load_profile(self.config.profile)
        return profile.kernel, {"kernel_profile": profile.name, "kernel": profile.kernel.to_dict()}
