"""TAP planning of one pool: tiles, Algorithm 2 placement and the exchange plan (Libra sec. 4.3)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from libra.config import CheckedLayout, TapConfig, check_block, check_heads
from libra.plan import PoolPlan, SequenceLayout
from libra.plan import pool_index as make_pool_index
from libra.tap.exchange import build_transfers
from libra.tap.placement import PAPER_POLICY, PlacementPolicy, place_tiles
from libra.tap.tiles import make_tiles
from libra.tap.weights import kernel_time_weights
from libra.workload import AttentionShape


def _is_standard(seq: SequenceLayout) -> bool:
    n = len(seq.holder_start)
    per = seq.num_tokens // n if n else 0
    return (n > 0 and per * n == seq.num_tokens
            and np.array_equal(np.sort(seq.holder_start), np.arange(n) * per)
            and np.array_equal(np.sort(seq.holder_end), np.arange(1, n + 1) * per))


def _checked_fields(tap: TapConfig) -> tuple[int, int, int]:
    """The TapConfig fields the layout checks read: ``B``, ``H`` and ``M``."""
    return tap.block_size, tap.head_split, tap.pipeline_chunks


def _check_pool_layout(sequences, tap: TapConfig, shape: AttentionShape, checked: CheckedLayout | None) -> None:
    """``B | S/CP`` for every standard-layout sequence length and ``H | hq``, ``M | hq/H``, except
    what ``checked`` already covers (the same ``B``, ``H``, ``M`` and ``shape``; sequences of its ``S``
    and ``CP``)."""
    covered = (checked is not None and checked.shape == shape
               and _checked_fields(checked.tap) == _checked_fields(tap))
    seen = set()
    for seq in sequences:  # non-standard layouts: make_tiles checks blocks against holder ranges
        key = (len(seq.holder_start), seq.num_tokens)
        if covered and key == (checked.par.cp, checked.par.seq_len):
            continue
        if key not in seen and _is_standard(seq):
            seen.add(key)
            check_block(tap.block_size, seq.num_tokens, key[0])
    if not covered:
        check_heads(tap, shape)


def plan_pool(pool_index: int, sequences: Sequence[SequenceLayout], workers: Sequence[int],
              tap: TapConfig, shape: AttentionShape, kernel=None, *, checked: CheckedLayout | None = None) -> PoolPlan:
    """Plan one pool with TAP: make SH-tiles, place them (Alg. 2), derive the transfers.

    Args:
        pool_index: index of the pool within its microbatch group.
        sequences: the pool's ``P`` packed sequences with their pre-attention layout.
        workers: the pool's ``W = P * CP`` global worker ids in pool-rank order.
        tap: block size, head split, tau, Pipeliner chunks and the comm-aware switch.
        shape: attention head geometry.
        kernel: a :class:`libra.sim.kernel.KernelModel`, required when ``tap.load_estimate ==
            "kernel-time"`` (tiles are then balanced by :func:`kernel_time_weights` under it, with
            the plan's ``M``); must be None for ``"flops"``.
        checked: what :func:`libra.config.check_layout` returned for this ``tap`` and ``shape``
            (the planners check once per GBS window): the per-pool layout checks are then skipped
            for sequences of its parallel layout (``S`` tokens over ``CP`` holders). None (a direct
            call) checks ``B | S/CP`` for every standard-layout sequence length and ``H | hq``,
            ``M | hq/H``, with the same messages.

    Raises:
        ValueError: the layout errors of :func:`libra.config.check_layout` (``B`` not dividing
            ``S/CP``, ``H`` not dividing ``hq``, ``M`` not dividing ``hq/H``; unless
            ``checked``), a missing kernel for ``"kernel-time"`` or one given for
            ``"flops"``, and those of :func:`make_tiles` (which also checks that blocks stay within
            the holder ranges of non-standard layouts) / :func:`place_tiles` /
            :func:`kernel_time_weights`.
    """
    if not isinstance(tap, TapConfig):
        raise ValueError(f"tap must be a TapConfig, got {type(tap).__name__}")
    if tap.load_estimate == "kernel-time" and kernel is None:
        raise ValueError("tap.load_estimate='kernel-time' needs a kernel (a libra.sim.kernel.KernelModel, "
                         "e.g. load_profile(name).kernel)")
    if tap.load_estimate == "flops" and kernel is not None:
        raise ValueError("a kernel was given but tap.load_estimate='flops' would ignore it; "
                         "set load_estimate='kernel-time' or pass kernel=None")
    sequences = tuple(sequences)
    if not sequences:
        raise ValueError(f"pool {pool_index} has no sequences")
    _check_pool_layout(sequences, tap, shape, checked)
    index = make_pool_index(sequences)  # built once per pool, passed to every step below
    tiles = make_tiles(sequences, tap.block_size, tap.head_split, shape, index=index)
    weights = (kernel_time_weights(tiles, sequences, shape, kernel, tap.pipeline_chunks, index=index)
               if tap.load_estimate == "kernel-time" else None)
    placed, fallback = place_tiles(tiles, sequences, workers, shape, tau=tap.tau, weights=weights,
                                   policy=PAPER_POLICY if tap.comm_aware else PlacementPolicy(comm_aware=False))
    return PoolPlan(pool_index=pool_index, workers=tuple(workers), sequences=sequences, tiles=placed,
                    transfers=build_transfers(sequences, placed, shape, index=index), fallback_tiles=fallback)
