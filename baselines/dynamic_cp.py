"""Megatron Core's dynamic context parallelism as a planner (``dynamic-cp``).

Megatron Core's dynamic CP gives each sample the smallest power-of-two CP group that holds it at a
fixed token budget per rank and balances the resulting groups over the whole DP x CP domain
(:mod:`baselines.dynamic_cp_schedule`, from ``NVIDIA/Megatron-LM``). Per GBS window:

1. the window's samples, as packed (the causal segments every other method computes), are gathered
   in Megatron's order (DP rank by DP rank: DP rank ``d`` holds ``window[g * DP + d]`` for every GA
   index ``g``) and scheduled into microbatches of CP groups with ``per_rank = S / CP`` tokens per
   rank (``max_seqlen_per_dp_cp_rank``);
2. inside each group Megatron runs its CP attention on the group's packed samples (Transformer
   Engine's THD layout): each sample is cut into ``2 x size`` chunks and group rank ``r`` holds
   chunks ``r`` and ``2 x size - 1 - r`` (:func:`baselines.wlbllm.per_document_shards`, the same
   load-balanced cut WLB-LLM's CP uses).

Plan mapping: one Plan per *microbatch* (``ga_index`` = microbatch index), one pool of all
workers, one packed sequence per CP group (its holder ranges the chunks on the group's ranks), one
all-heads tile per chunk computed where it lives, and the KV each chunk reads from the group's other
ranks as transfers (:func:`libra.tap.exchange.build_transfers`: each rank fetches the causal prefix
its chunks need, de-duplicated). Megatron's ring passes K/V around the group in ``size - 1``
point-to-point steps overlapped with compute; here those bytes are priced as direct fetches, and
the overlap as Libra's Pipeliner at ``pipeline_chunks`` head chunks (default TapConfig's M, the
credit ``libra``, ``distca`` and ``distca-paper`` get).

The number of microbatches follows the data, not GBS / DP, so a step is not comparable one to one;
compare windows (the sum of a window's step stragglers, ``libra-bench straggler``'s ``window_ms``).

Approximations: Megatron pads each sample to a multiple of ``2 x size`` tokens (Transformer
Engine's THD requirement); here the unpadded sample is cut and its remainder tokens spread one per
chunk, so no padding is computed or moved. Fixed-token windows only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from baselines.dynamic_cp_schedule import DEFAULT_DELTA, CPGroup, schedule
from baselines.registry import Planner, pool_workers, window_lengths
from baselines.wlbllm import per_document_shards, wlb_tiles
from libra.config import ParallelConfig, TapConfig
from libra.plan import Plan, PoolPlan, SequenceLayout, TileTable
from libra.tap.exchange import build_transfers
from libra.workload import AttentionShape


@dataclass(frozen=True)
class DynamicCPConfig:
    """Options of the ``dynamic-cp`` planner.

    Attributes:
        max_seqlen_per_rank: tokens one rank holds (Megatron's ``max_seqlen_per_dp_cp_rank``); None:
            ``S / CP``, the static layout's share.
        min_cp_size: the smallest CP group (Megatron's ``min_dynamic_context_parallel_size``, 1).
        delta: a microbatch's balance slack (Megatron's 0.05).
        pipeline_chunks: Pipeliner head chunks ``M`` the Plans are priced and run with.

    Raises:
        ValueError: a non-positive size or count, or ``delta`` outside ``[0, 1)``.
    """

    max_seqlen_per_rank: int | None = None
    min_cp_size: int = 1
    delta: float = DEFAULT_DELTA
    pipeline_chunks: int = TapConfig.pipeline_chunks

    def __post_init__(self) -> None:
        for name in ("max_seqlen_per_rank", "min_cp_size", "pipeline_chunks"):
            v = getattr(self, name)
            if v is None and name == "max_seqlen_per_rank":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"DynamicCPConfig.{name} must be a positive integer, got {v!r}")
        d = self.delta
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or not 0 <= d < 1:
            raise ValueError(f"DynamicCPConfig.delta must be a number in [0, 1), got {d!r}")


def window_samples(lengths: list[np.ndarray], par: ParallelConfig) -> tuple[list[tuple[int, int]], np.ndarray]:
    """``(id, length)`` of every sample of the window in Megatron's gather order, and the lengths by id."""
    order = [g * par.dp + d for d in range(par.dp) for g in range(par.ga)]
    flat = np.concatenate([lengths[i] for i in order])
    return list(enumerate(flat.tolist())), flat


def group_sequence(seq_id: int, group: CPGroup, sample_lengths: np.ndarray, cp: int) -> SequenceLayout:
    """A CP group's packed samples with each rank's two load-balanced chunks per sample."""
    docs = sample_lengths[list(group.samples)]
    start, end, rank = per_document_shards(docs, group.size)
    return SequenceLayout(seq_id, group.start // cp, docs, start, end, group.start + rank)


def cp_group_counts(groups: list[CPGroup]) -> dict[str, int]:
    """``{CP size: groups of that size}`` of one microbatch, largest first (Plan meta)."""
    sizes = sorted((g.size for g in groups), reverse=True)
    return {str(n): sizes.count(n) for n in dict.fromkeys(sizes)}


class DynamicCPPlanner(Planner):
    """Megatron's dynamic CP: power-of-two CP groups per sample, balanced over DP x CP ranks."""

    name = "dynamic-cp"
    Config = DynamicCPConfig

    @property
    def pipeline_chunks(self) -> int:
        return self.config.pipeline_chunks

    def plan_window(self, window, par: ParallelConfig, shape: AttentionShape) -> list[Plan]:
        """One Plan per microbatch Megatron's scheduler forms (their count need not be GA).

        Raises:
            ValueError: a window that does not match ``par``, M not dividing the query heads, and
                the errors of :func:`baselines.dynamic_cp_schedule.schedule`.
        """
        cfg = self.config
        if shape.num_q_heads % cfg.pipeline_chunks:
            raise ValueError(f"dynamic-cp: pipeline_chunks={cfg.pipeline_chunks} must divide "
                             f"num_q_heads={shape.num_q_heads}")
        per_rank = cfg.max_seqlen_per_rank or par.seq_len // par.cp
        samples, by_id = window_samples(window_lengths(window, par), par)
        microbatches = schedule(samples, par.workers, per_rank, cfg.min_cp_size, cfg.delta)
        meta = {"pool_size": par.dp, "grouping": "dynamic-cp", "max_seqlen_per_rank": per_rank,
                "min_cp_size": cfg.min_cp_size, "delta": cfg.delta, "microbatches": len(microbatches)}
        plans, seq_id = [], 0
        for i, groups in enumerate(microbatches):
            seqs = [group_sequence(seq_id + k, grp, by_id, par.cp) for k, grp in enumerate(groups)]
            seq_id += len(groups)
            tiles = TileTable.concat(wlb_tiles(s, shape, k) for k, s in enumerate(seqs))
            pool = PoolPlan(0, pool_workers(0, par.dp, par.cp), tuple(seqs), tiles, build_transfers(seqs, tiles, shape))
            plans.append(Plan(method=self.name, ga_index=i, shape=shape, cp=par.cp,
                              pipeline_chunks=cfg.pipeline_chunks, pools=(pool,),
                              meta={**meta, "cp_groups": cp_group_counts(groups)}))
        return plans
