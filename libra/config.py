"""Validated configuration dataclasses shared by planners, the simulator and the runtime.

Configs have no side effects; ``__post_init__`` checks every value and raises ``ValueError`` naming
the bad value. Cross-field checks that involve the attention shape live in :func:`check_layout`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from libra.workload import AttentionShape


def _positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


def check_tau(value, what: str = "tau") -> float:
    """Alg. 2's soft-target slack ``tau`` (``C = (1 + tau) * mean``) as a float: the one rule of
    :class:`TapConfig`, :func:`libra.tap.placement.place_tiles` and ``libra-adaptive``'s ``fine_tau``.

    Raises:
        ValueError: not a finite number >= 0 (bools are not numbers here); the message names ``what``.
    """
    number = not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
    if not number or not value >= 0 or not math.isfinite(value):
        why = "; it must be finite" if number and value >= 0 else ""
        raise ValueError(f"{what} must be a number >= 0, got {value!r}{why}")
    return float(value)


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout of one PP stage (Libra sec. 2.1 notation; mbs = 1).

    Attributes:
        dp: data-parallel replicas (one CP group each).
        cp: context-parallel degree (workers per CP group).
        gbs: global batch in packed sequences; ``GA = gbs / dp``.
        seq_len: tokens per packed sequence ``S``.
        pp: pipeline stages (pools never span stages).

    Raises:
        ValueError: non-positive values, or ``dp`` not dividing ``gbs``.
    """

    dp: int
    cp: int
    gbs: int
    seq_len: int
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "gbs", "seq_len", "pp"):
            _positive_int("ParallelConfig", name, getattr(self, name))
        if self.gbs % self.dp:
            raise ValueError(f"GBS={self.gbs} must be a multiple of DP={self.dp} (mbs = 1)")

    @property
    def ga(self) -> int:
        """Gradient-accumulation steps per optimizer step: ``GBS / DP``."""
        return self.gbs // self.dp

    @property
    def workers(self) -> int:
        """Workers of one PP stage: ``DP * CP``."""
        return self.dp * self.cp

    @property
    def tokens_per_rank(self) -> int:
        """Tokens each CP rank holds in the pre-attention layout: ``S / CP``."""
        if self.seq_len % self.cp:
            raise ValueError(f"CP={self.cp} must divide the sequence length S={self.seq_len}")
        return self.seq_len // self.cp


LOAD_ESTIMATES = ("flops", "kernel-time")
"""Per-tile loads TAP placement can balance (:attr:`TapConfig.load_estimate`)."""


@dataclass(frozen=True)
class TapConfig:
    """Libra's pool and tiling knobs (Libra sec. 4.1, 4.3, 4.4).

    The one declaration of the TAP layout and its defaults: the TAP planners (``libra-tap``,
    ``libra-tap-vrsp``, ``libra``, ``libra-kt``, ``distca``) hold one as their config, the
    experiments' settings hold one, and the ``libra-bench`` TAP options
    (:func:`experiments.common.options.tap_options`) are generated from its fields.

    Attributes:
        pool_size: ``P`` DP replicas per pool; must divide DP.
        block_size: ``B`` tokens per SH-Tile; must divide ``S / CP``.
        head_split: ``H`` head shards per block; must divide the query heads.
        tau: soft load-target slack, ``C = (1 + tau) * mean`` (paper: 0.03).
        pipeline_chunks: Pipeliner chunks ``M`` along the head axis; 1 disables overlap.
        comm_aware: score destinations by incremental communication (Alg. 2); False gives the
            FLOPs-only placement used to emulate DistCA.
        load_estimate: what Alg. 2 balances: ``"flops"`` (the paper) or ``"kernel-time"`` (each
            tile's estimated kernel time under a :class:`libra.sim.kernel.KernelModel`, so short
            segments' lower kernel rate counts; an extension, not in the paper; see
            :mod:`libra.tap.weights`).
    """

    pool_size: int = 8
    block_size: int = 4096
    head_split: int = 2
    tau: float = 0.03
    pipeline_chunks: int = 4
    comm_aware: bool = True
    load_estimate: str = "flops"

    def __post_init__(self) -> None:
        for name in ("pool_size", "block_size", "head_split", "pipeline_chunks"):
            _positive_int("TapConfig", name, getattr(self, name))
        check_tau(self.tau, "TapConfig.tau")
        if self.load_estimate not in LOAD_ESTIMATES:
            raise ValueError(f"TapConfig.load_estimate must be one of {LOAD_ESTIMATES}, got {self.load_estimate!r}")


def check_block(block_size: int, seq_len: int, cp: int) -> None:
    """Check that TAP's block size ``B`` divides the tokens per CP rank ``S / CP``.

    Raises:
        ValueError: ``CP`` not dividing ``S``, or ``B`` not dividing ``S/CP``; the message names them.
    """
    if seq_len % cp:
        raise ValueError(f"CP={cp} must divide the sequence length S={seq_len}")
    per_rank = seq_len // cp
    if per_rank % block_size:
        raise ValueError(f"block size B={block_size} must divide S/CP={per_rank} (S={seq_len}, CP={cp})")


def check_heads(tap: TapConfig, shape: AttentionShape) -> None:
    """Check the head-axis rules of a TAP layout: ``H`` divides ``hq`` and ``M`` divides ``hq / H``.

    Raises:
        ValueError: the message names the offending values.
    """
    if shape.num_q_heads % tap.head_split:
        raise ValueError(f"head split H={tap.head_split} must divide num_q_heads={shape.num_q_heads}")
    width = shape.num_q_heads // tap.head_split
    if width % tap.pipeline_chunks:
        raise ValueError(
            f"Pipeliner chunks M={tap.pipeline_chunks} must divide hq/H={width} "
            f"(hq={shape.num_q_heads}, H={tap.head_split})"
        )


class CheckedLayout(NamedTuple):
    """A TAP layout that :func:`check_layout` accepted for a parallel layout and head shape: the
    value :func:`libra.tap.planner.plan_pool` takes (``checked=``) to skip its own per-pool layout
    checks for pools of exactly this ``tap``, ``shape`` and ``par``'s sequence length and CP."""

    par: ParallelConfig
    tap: TapConfig
    shape: AttentionShape


def check_layout(par: ParallelConfig, tap: TapConfig, shape: AttentionShape) -> CheckedLayout:
    """Check the divisibility rules that tie a TAP layout to the parallel layout and head shape.

    The one layout check of a planning call: planners run it once per GBS window (``plan_window``)
    and hand its result to :func:`libra.tap.planner.plan_pool` (``checked=``).

    Raises:
        ValueError: ``P`` not dividing DP, ``B`` not dividing ``S/CP``, ``H`` not dividing ``hq``,
            or ``M`` not dividing ``hq / H``; the message names the offending values.
    """
    if par.dp % tap.pool_size:
        raise ValueError(f"pool size P={tap.pool_size} must divide DP={par.dp}")
    check_block(tap.block_size, par.seq_len, par.cp)
    check_heads(tap, shape)
    return CheckedLayout(par, tap, shape)
