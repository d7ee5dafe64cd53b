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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from baselines.registry import Planner, pool_workers, production_groups, window_lengths
from libra.config import ParallelConfig, TapConfig, check_layout
from libra.plan import Plan, SequenceLayout
from libra.sim.profiles import DEFAULT_PROFILE, HardwareProfile, load_profile
from libra.tap.planner import plan_pool
from libra.vrsp import microbatch_groups, pool_imbalance, vrsp
from libra.workload import AttentionShape, packed_workloads


@dataclass(frozen=True)
class LibraTapOptions:
    """Options of ``libra-tap`` and ``libra-tap-vrsp`` (no Pipeliner: ``M = 1``).

    Attributes mirror :class:`libra.config.TapConfig` (paper defaults ``P = 8, B = 4096, H = 2,
    tau = 0.03``, communication-aware placement).

    Raises:
        ValueError: any value :class:`TapConfig` rejects.
    """

    pool_size: int = 8
    block_size: int = 4096
    head_split: int = 2
    tau: float = 0.03
    comm_aware: bool = True

    def __post_init__(self) -> None:
        self.tap()

    def tap(self) -> TapConfig:
        return TapConfig(pool_size=self.pool_size, block_size=self.block_size, head_split=self.head_split,
                         tau=self.tau, pipeline_chunks=1, comm_aware=self.comm_aware)


@dataclass(frozen=True)
class LibraOptions(LibraTapOptions):
    """Options of full ``libra``: the TAP options plus the Pipeliner's ``M`` (default 4).

    Raises:
        ValueError: any value :class:`TapConfig` rejects.
    """

    pipeline_chunks: int = 4

    def tap(self) -> TapConfig:
        return TapConfig(pool_size=self.pool_size, block_size=self.block_size, head_split=self.head_split,
                         tau=self.tau, pipeline_chunks=self.pipeline_chunks, comm_aware=self.comm_aware)


@dataclass(frozen=True)
class LibraKtOptions(LibraOptions):
    """Options of ``libra-kt``: full ``libra``'s options plus the hardware profile whose kernel
    model prices the tiles (kernel-time-aware placement).

    Attributes:
        profile: a built-in profile name, a profile ``.json`` path (e.g. written by ``libra-bench
            calibrate``) or a loaded :class:`libra.sim.profiles.HardwareProfile`. Use the profile
            the cluster runs with; the estimate is only as good as its kernel curve.

    Raises:
        ValueError: any value :class:`TapConfig` rejects, or a profile that cannot be loaded.
    """

    profile: str | HardwareProfile = DEFAULT_PROFILE

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.profile, (str, HardwareProfile)) or isinstance(self.profile, bool):
            raise ValueError(f"libra-kt profile must be a profile name, a .json path or a HardwareProfile, "
                             f"got {self.profile!r}")
        load_profile(self.profile)  # fail here, at construction, on an unknown name or a bad file

    def tap(self) -> TapConfig:
        return TapConfig(pool_size=self.pool_size, block_size=self.block_size, head_split=self.head_split,
                         tau=self.tau, pipeline_chunks=self.pipeline_chunks, comm_aware=self.comm_aware,
                         load_estimate="kernel-time")


def plan_grouped_window(method: str, lengths: list[np.ndarray], groups: np.ndarray, par: ParallelConfig,
                        tap: TapConfig, shape: AttentionShape, meta: dict, kernel=None) -> list[Plan]:
    """Run TAP on every pool of every GA index.

    Args:
        method: registry name recorded in the Plans.
        lengths: sample lengths of every window sequence (``gbs`` arrays).
        groups: ``(GA, DP)`` window indices: ``groups[g, d]`` runs at GA ``g`` on DP rank ``d``.
        par, tap, shape: layout; ``tap.pool_size`` must divide DP.
        meta: method parameters copied into every Plan.
        kernel: the KernelModel for ``tap.load_estimate == "kernel-time"`` (None for FLOPs).

    Returns:
        ``par.ga`` Plans with ``DP / P`` pools each; pool ``k`` spans DP ranks ``[k*P, (k+1)*P)``.

    Raises:
        ValueError: from :func:`libra.config.check_layout` or the window checks.
    """
    check_layout(par, tap, shape)
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
            pools.append(plan_pool(k, seqs, pool_workers(p0, P, par.cp), tap, shape, kernel=kernel))
        plans.append(Plan(method=method, ga_index=g, shape=shape, cp=par.cp, pipeline_chunks=tap.pipeline_chunks,
                          pools=tuple(pools), meta=dict(meta)))
    return plans


def vrsp_groups(lengths: list[np.ndarray], par: ParallelConfig, pool_size: int) -> tuple[np.ndarray, float]:
    """VRSP over the window's packed workloads, mapped to ``(GA, DP)`` slots; also returns R - 1."""
    workloads = packed_workloads(lengths)
    pools = vrsp(workloads, pool_size)
    return np.asarray(microbatch_groups(pools, par.dp)), float(pool_imbalance(workloads, pools))


class LibraTapPlanner(Planner):
    """``libra-tap``: production-order pools of ``P`` replicas, TAP placement, no Pipeliner."""

    name = "libra-tap"
    Config = LibraTapOptions
    grouping = "production"

    def groups(self, lengths, par: ParallelConfig) -> tuple[np.ndarray, dict]:
        return production_groups(par), {}

    def plan_window(self, window, par: ParallelConfig, shape: AttentionShape) -> list[Plan]:
        """See :class:`Planner`. Raises ValueError for P not dividing DP, B not dividing S/CP, ..."""
        tap = self.config.tap()
        check_layout(par, tap, shape)
        lengths = window_lengths(window, par)
        groups, extra = self.groups(lengths, par)
        meta = {"grouping": self.grouping, **asdict(tap), **extra}
        return plan_grouped_window(self.name, lengths, groups, par, tap, shape, meta)


class LibraTapVrspPlanner(LibraTapPlanner):
    """``libra-tap-vrsp``: VRSP pools over the window, TAP placement, no Pipeliner."""

    name = "libra-tap-vrsp"
    grouping = "vrsp"

    def groups(self, lengths, par: ParallelConfig) -> tuple[np.ndarray, dict]:
        groups, imbalance = vrsp_groups(lengths, par, self.config.pool_size)
        return groups, {"pool_imbalance": imbalance}


class LibraPlanner(LibraTapVrspPlanner):
    """``libra``: VRSP + TAP + Pipeliner (``M`` chunks along the head axis, default 4)."""

    name = "libra"
    Config = LibraOptions

    @property
    def pipeline_chunks(self) -> int:
        return self.config.pipeline_chunks


class LibraKtPlanner(LibraTapVrspPlanner):
    """``libra-kt``: ``libra`` (VRSP + TAP + Pipeliner) with tiles balanced by estimated kernel time
    under ``profile``'s kernel model instead of FLOPs. An extension, not in the paper."""

    name = "libra-kt"
    Config = LibraKtOptions

    @property
    def pipeline_chunks(self) -> int:
        return self.config.pipeline_chunks

    def plan_window(self, window, par: ParallelConfig, shape: AttentionShape) -> list[Plan]:
        """See :class:`Planner`. Raises ValueError for P not dividing DP, B not dividing S/CP, ..."""
        tap = self.config.tap()
        check_layout(par, tap, shape)
        profile = load_profile(self.config.profile)
        lengths = window_lengths(window, par)
        groups, extra = self.groups(lengths, par)
        # the estimate's profile goes into the plan (and its hash): a plan made for another
        # cluster's kernel curve is a different plan
        meta = {"grouping": self.grouping, **asdict(tap), **extra, "kernel_profile": profile.name,
                "kernel": profile.kernel.to_dict()}
        return plan_grouped_window(self.name, lengths, groups, par, tap, shape, meta, kernel=profile.kernel)
