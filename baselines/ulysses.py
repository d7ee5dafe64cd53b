"""DeepSpeed-Ulysses as a planner: every CP group computes its own packed sequence, head-sharded.

Ulysses (Jacobs et al., 2023; Libra sec. 6.1) turns the pre-attention layout (CP contiguous equal
token ranges, all heads) into a head-sharded layout with one all-to-all: CP rank ``r`` computes
query heads ``[r*hq/CP, (r+1)*hq/CP)`` of the whole packed sequence. No work leaves the CP group,
so each DP replica is its own pool (``P = 1``) and cross-group skew is left as it is -- the
baseline every Libra figure is normalised to.

Expressed as a Plan: one tile per (holder range of ``S/CP`` tokens) x (CP rank's head shard), with
``q_home`` = the holder and ``dest`` = the rank owning the head shard. The exchange planner
(:func:`libra.tap.exchange.build_transfers`) then yields exactly the all-to-all volume: Q and O
move ``(CP-1)/CP`` of the sequence for each head shard, and every rank fetches the K/V of the
tokens it does not hold for the KV heads its shard reads (replicated when ``hkv < CP``).

``ulysses-sorted`` (not in the paper) is the same Ulysses execution with one change: which GA
index trains which packed sequence. The window is scheduled by VRSP with ``P = 1``
(:func:`libra.vrsp.vrsp_schedule`: Alg. 1 degenerates to sorting the window by ``sum l^2``), so GA
index ``g`` trains the ``g``-th heaviest ``DP`` sequences. Each step keeps the window's multiset
(Libra sec. 2.3), every sequence is computed exactly as by ``ulysses``, and the gain over
``ulysses`` is the cross-step sorting alone -- separated from the gain of pooling, which needs
Libra's TAP (sec. 4.3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baselines.registry import Planner, pool_workers, production_groups, window_lengths
from libra.config import ParallelConfig
from libra.plan import Plan, PoolPlan, SequenceLayout, TileTable, tile_flops
from libra.tap.exchange import build_transfers
from libra.vrsp import vrsp_schedule
from libra.workload import AttentionShape, packed_workloads


@dataclass(frozen=True)
class UlyssesConfig:
    """Ulysses has no tunable knobs; the head split is fixed to CP."""


def check_ulysses_heads(num_q_heads: int, cp: int) -> None:
    """The one head-geometry condition of Ulysses: CP divides the query heads.

    Shared by this planner and the deployed runtime (:class:`baselines.ulysses_runtime.UlyssesAttention`)
    so both refuse exactly the same shapes with the same message. Any ``hkv | hq`` is fine: a head
    shard that cuts a GQA group reads the KV heads :meth:`AttentionShape.kv_head_range` gives.

    Raises:
        ValueError: ``CP`` does not divide ``num_q_heads``.
    """
    if num_q_heads % cp:
        raise ValueError(f"Ulysses needs CP={cp} to divide num_q_heads={num_q_heads}")


def ulysses_tiles(seq: SequenceLayout, cp: int, shape: AttentionShape) -> TileTable:
    """Head-sharded work of one packed sequence in its CP group.

    Args:
        seq: the sequence in the standard contiguous layout (``cp`` holder ranges).
        cp: context-parallel degree; must divide ``shape.num_q_heads``.
        shape: head geometry.

    Returns:
        ``CP * CP`` tiles: row ``h * CP + r`` covers holder range ``h`` (``S/CP`` tokens) and
        rank ``r``'s ``hq/CP`` query heads, ``q_home`` = holder ``h``, ``dest`` = worker of rank ``r``.

    Raises:
        ValueError: CP does not divide the query heads, or the layout is not ``cp`` ranges.
    """
    check_ulysses_heads(shape.num_q_heads, cp)
    if len(seq.holder_start) != cp:
        raise ValueError(f"Ulysses expects {cp} holder ranges, sequence {seq.seq_id} has {len(seq.holder_start)}")
    width = shape.num_q_heads // cp
    h = np.repeat(np.arange(cp), cp)          # holder range of each tile
    r = np.tile(np.arange(cp), cp)            # head shard (= CP rank computing it)
    q_start, q_end = seq.holder_start[h], seq.holder_end[h]
    base = int(seq.holder_worker.min())
    if not np.array_equal(seq.holder_worker, base + np.arange(cp)):
        raise ValueError(f"Ulysses expects holder h on worker {base}+h, got {seq.holder_worker.tolist()}")
    return TileTable(seq=np.zeros(cp * cp), q_start=q_start, q_end=q_end, head_start=r * width,
                     head_end=(r + 1) * width, q_home=seq.holder_worker[h], dest=base + r,
                     flops=tile_flops(seq, q_start, q_end, width, shape.head_dim))


class UlyssesPlanner(Planner):
    """Ulysses: per-replica pools (``P = 1``), all-to-all head sharding, no overlap (``M = 1``)."""

    name = "ulysses"
    Config = UlyssesConfig
    grouping = "production"

    def groups(self, lengths, par: ParallelConfig) -> np.ndarray:
        """``(GA, DP)`` window indices per slot: production order (``window[i]`` at GA ``i // DP``)."""
        return production_groups(par)

    def plan_window(self, window, par: ParallelConfig, shape: AttentionShape) -> list[Plan]:
        """One Plan per GA index with one PoolPlan per DP replica (see :class:`Planner`).

        Raises:
            ValueError: window/layout mismatch, CP not dividing ``hq`` or ``S``.
        """
        check_ulysses_heads(shape.num_q_heads, par.cp)
        lengths = window_lengths(window, par)
        groups = self.groups(lengths, par)
        plans = []
        for g in range(par.ga):
            pools = []
            for d in range(par.dp):
                i = int(groups[g, d])
                seq = SequenceLayout.contiguous(i, d, lengths[i], par.cp)
                tiles = ulysses_tiles(seq, par.cp, shape)
                pools.append(PoolPlan(pool_index=d, workers=pool_workers(d, 1, par.cp), sequences=(seq,),
                                      tiles=tiles, transfers=build_transfers((seq,), tiles, shape)))
            plans.append(Plan(method=self.name, ga_index=g, shape=shape, cp=par.cp, pipeline_chunks=1,
                              pools=tuple(pools),
                              meta={"pool_size": 1, "head_split": par.cp, "grouping": self.grouping}))
        return plans


class UlyssesSortedPlanner(UlyssesPlanner):
    """``ulysses-sorted``: Ulysses with the window sorted across GA steps by VRSP at ``P = 1``.

    Not in the paper: it isolates what cross-step sorting alone buys (a step of only heavy
    sequences and a step of only light ones instead of mixed steps), so a Figure 12 row can
    separate that from what Libra's pooling adds.
    """

    name = "ulysses-sorted"
    grouping = "vrsp-p1"

    def groups(self, lengths, par: ParallelConfig) -> np.ndarray:
        """The one VRSP implementation with ``P = 1`` (a stable sort by decreasing ``sum l^2``)."""
        _pools, groups = vrsp_schedule(packed_workloads(lengths), 1, par.dp)
        return groups
