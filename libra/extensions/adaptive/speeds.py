"""Measure each GPU's attention speed, for a planner that balances on known-unequal devices.

Libra sec. 3.2 (Fig. 3) measures a per-step spread of 7% across the GPUs of a pool: part of it
persists (silicon and thermal lottery, a throttled card), part is each step's own. TAP balances
FLOPs, so the pool waits for its slowest GPU. :func:`measure_device_speeds` times the same causal
attention forward + backward on every rank and agrees on one speed per rank, which a speed-aware
planner takes (``libra-adaptive``'s ``device_speeds``; :func:`libra.extensions.adaptive.retention.speed_reserve`).
Run it once at start-up, or between steps to follow a GPU that slows down; the planner's plans stay
pure functions of (metadata, speeds), identical on every rank, since every rank gets the same tuple.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from libra.runtime.kernels import Segments, get_backend
from libra.workload import AttentionShape

SPEED_PROBE_TOKENS = 4096
"""Tokens of the probe: one causal sample, long enough that the kernel runs near its best rate."""


def _probe_ms(shape: AttentionShape, tokens: int, repeats: int, backend, device, dtype) -> float:
    """Median ms of ``repeats`` forward + backward calls of one causal ``tokens``-token sample."""
    g = torch.Generator().manual_seed(0)  # the same work on every rank
    q, do = (torch.randn(tokens, shape.num_q_heads, shape.head_dim, generator=g, dtype=dtype).to(device)
             for _ in range(2))
    k, v = (torch.randn(tokens, shape.num_kv_heads, shape.head_dim, generator=g, dtype=dtype).to(device)
            for _ in range(2))
    seg = Segments(q_lens=np.array([tokens], dtype=np.int64), kv_lens=np.array([tokens], dtype=np.int64))
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = []
    for i in range(repeats + 1):  # the first call warms up (allocations, kernel selection)
        sync()
        t0 = time.perf_counter()
        out, lse = backend.forward(q, k, v, seg)
        backend.backward(do, q, k, v, out, lse, seg)
        sync()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_device_speeds(shape: AttentionShape, group=None, device="cpu", backend: str = "auto",
                          dtype=torch.float32, tokens: int = SPEED_PROBE_TOKENS,
                          repeats: int = 5) -> tuple[float, ...]:
    """Every rank's attention speed multiplier, the same tuple on every rank of ``group``.

    Each rank times the median of ``repeats`` forward + backward calls of one causal
    ``tokens``-token sample of ``shape`` (same backend, dtype and data everywhere, after a barrier),
    then the times are all-gathered; rank ``r``'s speed is the median time over its own
    (``> 1``: faster than the group's typical GPU). Collective: every rank of ``group`` calls it.

    Args:
        shape: the attention heads the model runs (the probe's shape).
        group: the process group (default: the world); the result is in its rank order, which is
            ``libra-adaptive``'s worker id order when the group is the DP x CP grid.
        device, backend, dtype: where and how the probe runs (:func:`libra.runtime.kernels.get_backend`).
        tokens, repeats: the probe's length and timed calls (>= 1 each).

    Returns:
        One float > 0 per rank of ``group``: pass it as ``device_speeds``.

    Raises:
        ValueError: ``tokens`` or ``repeats`` below 1, or no initialised process group.
    """
    if tokens < 1 or repeats < 1:
        raise ValueError(f"tokens and repeats must be >= 1, got {tokens} and {repeats}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("measure_device_speeds needs an initialised torch.distributed process group")
    kernel = get_backend(backend, device)
    dist.barrier(group=group)  # every rank probes at the same time, as they run a step
    ms = _probe_ms(shape, int(tokens), int(repeats), kernel, device, dtype)
    mine = torch.tensor([ms], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    times = [float(t.item()) for t in every]
    typical = statistics.median(times)
    return tuple(typical / t for t in times)
