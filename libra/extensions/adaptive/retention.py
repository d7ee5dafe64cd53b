"""Q-home retention placement: keep the tiles least worth moving home, then Alg. 2 places the
rest (an extension beyond Libra sec. 4.3, ``libra-adaptive``'s ``fine-retain*`` candidates; the
reason is :mod:`libra.extensions.adaptive.candidates`' "Moving the wrong tiles").

Also the load a worker reserves for being slower than its pool's fastest (:func:`speed_reserve`).
All are pure functions of the pool's metadata.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from libra.extensions.adaptive.repair import repair_overload
from libra.plan import SequenceLayout, TileTable
from libra.sim.variability import check_speeds
from libra.tap.placement import (
    PAPER_POLICY,
    PlacementPolicy,
    link_matrix,
    place_tiles,
    reserved_loads,
    soft_target,
)
from libra.workload import AttentionShape


def speed_reserve(total_load: float, speeds) -> np.ndarray:
    """float64 ``(W,)``: the load each worker reserves before placement (``PlacementPolicy.reserved``)
    for being slower than the pool's fastest: ``(s_max - s_w) * L / sum(s)`` for ``total_load`` ``L``
    and speed multipliers ``speeds`` (> 0; all 0 for equal speeds). A placement that fills every
    worker to one total then gives worker ``w`` about ``s_w * L / sum(s)`` -- its share at its
    speed, so the pool's workers finish together on known-unequal devices (Libra sec. 3.2 measures
    the per-GPU spread; an extension beyond the paper's TAP, which balances FLOPs only).

    Raises:
        ValueError: speeds that :func:`libra.sim.variability.check_speeds` rejects.
    """
    s = check_speeds(speeds)
    return (s.max() - s) * float(total_load) / float(s.sum())


def retention_order(tiles: TileTable, shape: AttentionShape, load: np.ndarray, n_workers: int,
                    tau: float, reserved: Mapping[int, float] | None = None) -> np.ndarray:
    """Alg. 2's placement order with Q-home retention: the tiles each Q-home keeps first, then the
    others heaviest first (ties: tile index in both parts).

    A tile's *move cost* is what it costs on a worker that holds none of it: its Q + O bytes plus
    all the KV bytes of its KV interval (Alg. 2's ``generic`` cost); its *density* is load / move
    cost. Per Q-home, tiles in order of increasing density are kept while the home's load stays
    within ``C = (1 + tau) * mean``: the work least worth moving stays where its Q, O and (for the
    usual tile) KV already are. Placed first, those tiles take their Q-home under Alg. 2's own rule
    (the Q-home has room and costs nothing), and the movers -- the tiles that carry the most work
    per byte -- are then scored as Alg. 2 scores any tile (:func:`libra.tap.placement.place_tiles`
    with this ``order``).

    Args:
        tiles: the pool's tiles; ``load``: ``(T,)`` their loads; ``n_workers``: W; ``tau``: the slack.
        reserved: optional ``{global worker id: load}`` each worker carries before any tile
            (``PlacementPolicy.reserved``): ``C`` grows by their sum over ``n_workers`` and a
            Q-home keeps up to ``C`` minus its own.

    Returns:
        int64 ``(T,)`` permutation of the tiles.
    """
    reserved = dict(reserved or {})
    cap = (1.0 + float(tau)) * (float(load.sum()) + float(sum(reserved.values()))) / n_workers
    if reserved:  # per tile: C less its Q-home's reserved load
        homes, inverse = np.unique(tiles.q_home, return_inverse=True)
        cap = cap - np.array([float(reserved.get(int(h), 0.0)) for h in homes])[inverse]
    keep = _retained(tiles.q_home, load, move_bytes(tiles, shape), cap)
    heavy = np.argsort(-load, kind="stable")
    return np.concatenate((heavy[keep[heavy]], heavy[~keep[heavy]]))


def move_bytes(tiles: TileTable, shape: AttentionShape) -> np.ndarray:
    """float64 ``(T,)``: what each tile costs on a worker that holds none of it -- its Q + O bytes
    plus all the KV bytes of its causal prefix (an upper bound of its KV interval's)."""
    qo = (tiles.q_end - tiles.q_start).astype(np.float64) * (tiles.head_end - tiles.head_start) * 2 \
        * shape.head_dim * shape.dtype_bytes
    k0, k1 = shape.kv_head_range(tiles.head_start, tiles.head_end)
    return qo + tiles.q_end.astype(np.float64) * (k1 - k0) * 2 * shape.head_dim * shape.dtype_bytes


def place_retaining(tiles: TileTable, sequences: Sequence[SequenceLayout], workers: Sequence[int],
                    shape: AttentionShape, tau: float, load: np.ndarray | None = None,
                    policy: PlacementPolicy = PAPER_POLICY, placer: str = "auto") -> tuple[TileTable, int]:
    """Alg. 2 (:func:`libra.tap.placement.place_tiles`, compiled when numba imports) in
    :func:`retention_order`, then :func:`libra.extensions.adaptive.repair.repair_overload` of the
    workers it left above ``C``, the most work per byte moved leaving first; arguments and result as
    ``place_tiles`` (``load``: its ``weights``; ``policy``: its byte cost and reserved load, the
    order being retention's; the fallback count is Alg. 2's, before the repair).

    Raises:
        ValueError: a ``policy`` with its own order, and ``place_tiles``' errors.
    """
    if policy.order is not None:
        raise ValueError("place_retaining places in retention order; give a policy without an order")
    workers = tuple(workers)
    load = tiles.flops if load is None else np.asarray(load, dtype=np.float64)
    reserved = policy.reserved
    by_worker = None if reserved is None else dict(zip(workers, np.asarray(reserved, dtype=np.float64).tolist()))
    order = retention_order(tiles, shape, load, len(workers), tau, by_worker)
    placed, fallback = place_tiles(tiles, sequences, workers, shape, tau=tau, weights=load,
                                   policy=replace(policy, order=order), placer=placer)
    if not len(tiles):
        return placed, fallback
    wsorted = np.sort(np.asarray(workers, dtype=np.int64))
    base = reserved_loads(reserved, workers, wsorted)
    dest, _ = repair_overload(np.searchsorted(wsorted, placed.dest), load, base, soft_target(load, base, tau),
                              load / np.maximum(move_bytes(tiles, shape), 1.0), np.searchsorted(wsorted, tiles.q_home),
                              link_matrix(policy.link_cost, wsorted), placer)
    return TileTable(**{**{k: getattr(placed, k) for k in TileTable.FIELDS}, "dest": wsorted[dest]}), fallback


def _retained(home: np.ndarray, load: np.ndarray, move_cost: np.ndarray, cap) -> np.ndarray:
    """bool ``(T,)``: the tiles each Q-home keeps -- in order of increasing load per byte moved,
    the longest prefix of that order whose load stays within ``cap`` (a number, or per tile its
    home's)."""
    density = load / np.maximum(move_cost, 1.0)
    order = np.lexsort((np.arange(len(load)), density, home))  # by home, then density, then index
    h, lo = home[order], load[order]
    starts = np.flatnonzero(np.r_[True, h[1:] != h[:-1]])
    csum = np.cumsum(lo)
    before = np.repeat(csum[starts] - lo[starts], np.diff(np.r_[starts, len(h)]))
    keep = np.zeros(len(load), dtype=bool)
    keep[order] = (csum - before) <= (cap[order] if np.ndim(cap) else cap)
    return keep
