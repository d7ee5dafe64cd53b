"""DistCA emulated as in Libra sec. 6.1: a cluster-wide pool with FLOPs-only placement.

DistCA (Zhuang et al., 2026) disaggregates core attention onto an attention-server pool spanning
the cluster. Its cross-layer ping-pong overlap cannot be exercised by isolated single-layer runs,
so the Libra authors emulate it at SH-Tile granularity: TAP tiles, one pool spanning every DP
replica of the PP stage (``P = DP``), FLOPs-balanced placement without the communication term
(``comm_aware=False``), and Libra's own Pipeliner overlap (``M`` chunks, default 4). Production
order is kept (a single pool per GA index makes grouping irrelevant).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from baselines.libra_planners import plan_grouped_window
from baselines.registry import Planner, production_groups, window_lengths
from libra.config import ParallelConfig, TapConfig, check_layout
from libra.plan import Plan
from libra.workload import AttentionShape


@dataclass(frozen=True)
class DistCAConfig:
    """Options of the DistCA emulation (the pool size is always DP).

    Attributes:
        block_size, head_split, tau: TAP tiling and soft target (same defaults as Libra).
        pipeline_chunks: Pipeliner chunks ``M`` (default 4, as the paper gives DistCA our overlap).

    Raises:
        ValueError: any value :class:`TapConfig` rejects.
    """

    block_size: int = 4096
    head_split: int = 2
    tau: float = 0.03
    pipeline_chunks: int = 4

    def __post_init__(self) -> None:
        self.tap(1)

    def tap(self, dp: int) -> TapConfig:
        return TapConfig(pool_size=dp, block_size=self.block_size, head_split=self.head_split, tau=self.tau,
                         pipeline_chunks=self.pipeline_chunks, comm_aware=False)


class DistCAPlanner(Planner):
    """DistCA emulation: ``P = DP``, FLOPs-only TAP placement, Pipeliner overlap."""

    name = "distca"
    Config = DistCAConfig

    @property
    def pipeline_chunks(self) -> int:
        return self.config.pipeline_chunks

    def plan_window(self, window, par: ParallelConfig, shape: AttentionShape) -> list[Plan]:
        """See :class:`Planner`; one pool of all ``DP * CP`` workers per GA index.

        Raises:
            ValueError: B not dividing S/CP, H not dividing hq, M not dividing hq/H, window mismatch.
        """
        tap = self.config.tap(par.dp)
        check_layout(par, tap, shape)
        lengths = window_lengths(window, par)
        meta = {"grouping": "production", **asdict(tap)}
        return plan_grouped_window(self.name, lengths, production_groups(par), par, tap, shape, meta)
