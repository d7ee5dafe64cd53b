"""DistCA as the Libra paper ran it (``distca-paper``): a cluster-wide TAP pool, FLOPs-only placement.

DistCA (Zhuang et al., 2026) disaggregates core attention onto an attention-server pool spanning
the cluster. Its cross-layer ping-pong overlap cannot be exercised by isolated single-layer runs,
so the Libra authors emulate it at SH-Tile granularity (Libra sec. 6.1): TAP tiles, one pool
spanning every DP replica of the PP stage (``P = DP``), FLOPs-balanced placement without the
communication term (``comm_aware=False``), and Libra's own Pipeliner overlap (``M`` chunks,
TapConfig's default 4). Production order is kept (a single pool per GA index makes grouping
irrelevant). This is what the paper's DistCA numbers describe; DistCA's own planning algorithm is
``distca`` (:mod:`baselines.distca`).
"""

from __future__ import annotations

from dataclasses import replace

from baselines.libra_planners import TapPlanner
from libra.config import ParallelConfig, TapConfig


class DistCAPaperPlanner(TapPlanner):
    """The paper's DistCA emulation: ``P = DP``, FLOPs-only TAP placement, Pipeliner overlap.

    Its config is a :class:`TapConfig` with ``comm_aware=False`` pinned; its ``pool_size`` is set to
    each window's DP (:meth:`window_tap`), so the options are ``block_size``, ``head_split``,
    ``tau`` and ``pipeline_chunks`` (TapConfig's defaults, as the paper gives DistCA Libra's tiling
    and overlap).
    """

    name = "distca-paper"
    pinned = {"load_estimate": "flops", "comm_aware": False}
    per_window = ("pool_size",)

    def window_tap(self, par: ParallelConfig, shape=None) -> TapConfig:
        """One pool of all ``DP * CP`` workers per GA index: ``P = DP``."""
        return replace(self.tap, pool_size=par.dp)
