"""Kernel-time load estimates for TAP placement (an extension beyond Libra sec. 4.3.2).

Algorithm 2 balances tile FLOPs. A FlashAttention varlen call runs short segments below its best
rate (Libra sec. 3.3, Figure 5; :class:`libra.sim.kernel.KernelModel`), so a tile made of many
short sample pieces costs more time per FLOP than one inside a long sample, and a FLOPs-balanced
pool is not time-balanced. :func:`kernel_time_weights` prices each tile as the cost model
(:mod:`libra.sim.cost`) prices its compute: the tile is split into the kernel segments of
:func:`libra.plan.segments` (per sample: query rows, key prefix; priced by the profile's
``piece_pricing``) and each segment costs
``KernelModel.chunked_forward_ms`` with the calls of the Pipeliner's
:class:`~libra.tap.pipeline.ChunkSchedule` (``M`` calls of ``heads / M`` heads, Libra sec. 4.4). Per-call launch cost is left out: it is paid once per
worker per call, not per tile, so it does not move the balance. Without a backward curve, backward
time is ``backward_time_ratio`` x forward for every segment, so forward time alone orders and
balances the tiles the same way and is what the weights hold; with one (a calibrated profile:
:meth:`KernelModel.segment_backward_ms`), backward grows differently with length than forward, and
the weights are forward + backward time, the work the step actually waits for. Under the
occupancy kernel model (:mod:`libra.sim.occupancy`) a tile weighs its blocks' forward + backward
work over the SMs; the longest-block floor is paid once per call, like the launch, and left out.

numpy only (no torch): data-loader workers can plan with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from libra.plan import PoolIndex, SequenceLayout, TileTable, segments
from libra.sim.kernel import KernelModel
from libra.tap.pipeline import ChunkSchedule, check_chunks
from libra.workload import AttentionShape


def kernel_time_weights(tiles: TileTable, sequences: Sequence[SequenceLayout], shape: AttentionShape,
                        kernel: KernelModel, pipeline_chunks: int = 1, index: PoolIndex | None = None) -> np.ndarray:
    """Estimated kernel time of every tile (ms, launch excluded): forward, or forward + backward when
    ``kernel`` has its own backward curve (module docstring).

    Args:
        tiles: ``(T,)`` tiles (``dest`` ignored), e.g. from :func:`libra.tap.tiles.make_tiles`.
        sequences: the pool's sequences; ``tiles.seq`` indexes them.
        shape: head geometry (``head_dim`` sets the FLOPs per causal pair).
        kernel: the kernel timing model the cost model will price the plan with (the profile's
            ``kernel``; ideally a measured one from ``libra-bench calibrate``).
        pipeline_chunks: Pipeliner chunks ``M``; each tile runs as ``M`` calls of ``heads / M``
            heads, as :meth:`libra.sim.cost.CostModel.price` prices it.
        index: the pool's :class:`~libra.plan.PoolIndex` when the caller already built it.

    Returns:
        ``(T,)`` float64 milliseconds; a worker's estimated compute is the sum over its tiles plus
        ``M`` launches.

    Raises:
        ValueError: ``kernel`` not a KernelModel, ``M`` not a positive integer or not dividing a
            tile's head width, a tile whose sequence index is out of range or whose token range
            lies outside its sequence.
    """
    if not isinstance(kernel, KernelModel):
        raise ValueError(f"kernel must be a libra.sim.kernel.KernelModel, got {type(kernel).__name__}")
    check_chunks(pipeline_chunks)
    if not isinstance(tiles, TileTable):
        raise ValueError(f"tiles must be a TileTable, got {type(tiles).__name__}")
    sequences = tuple(sequences)
    n = len(tiles)
    if n == 0:
        return np.zeros(0)
    if not 0 <= int(tiles.seq.min()) <= int(tiles.seq.max()) < len(sequences):
        raise ValueError(f"tile sequence index out of range for {len(sequences)} sequences")
    lengths = np.array([s.num_tokens for s in sequences], dtype=np.int64)[tiles.seq]
    bad = np.nonzero((tiles.q_start < 0) | (tiles.q_end <= tiles.q_start) | (tiles.q_end > lengths))[0]
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"tile {i} has token range [{tiles.q_start[i]}, {tiles.q_end[i]}) outside its "
                         f"sequence of {lengths[i]} tokens")
    # the Pipeliner's calls and the piece split are the ones the cost model and the runtime use
    sched = ChunkSchedule(shape, tiles.head_start, tiles.head_end, pipeline_chunks)  # checks M | widths
    seg = segments(sequences, tiles, index)
    heads = sched.heads_per_call(seg["heads"])
    if kernel.occupancy is not None:  # the calls' summed block work, forward + backward
        geometry = kernel.occupancy.block_tiles(seg["q_len"], seg["kv_len"])  # both passes' blocks
        t = sum(kernel.occupancy_terms(seg, heads, sched.chunks, shape.head_dim, backward, geometry)[0]
                for backward in (False, True))
        return np.bincount(seg["tile"].astype(np.int64), weights=t, minlength=n)
    t = kernel.chunked_forward_ms(seg["area"], heads, shape.head_dim, sched.chunks, seg["kv_len"])
    if kernel.has_backward_curve:
        t = t + kernel.chunked_backward_ms(seg["area"], heads, shape.head_dim, sched.chunks, seg["kv_len"])
    return np.bincount(seg["tile"].astype(np.int64), weights=t, minlength=n)
