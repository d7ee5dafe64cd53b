"""Occupancy kernel model: a varlen attention call priced from the thread blocks it launches.

An opt-in alternative to the length-curve model of :mod:`libra.sim.kernel` (a profile selects it
with ``kernel.model = "occupancy"``; see ``docs/profile.md``). FlashAttention's forward kernel
splits every (segment, query head) into blocks of ``block_q`` query rows; a block loops over the
``block_k``-key tiles its rows attend to, so its cost grows with the keys it reads. The SMs run the
blocks concurrently. For one kernel call with segments ``s`` (``q_len``, ``kv_len``) and ``n_s``
query heads each:

    blocks(s)      = ceil(q_len / block_q)                         (per head)
    tiles(block)   = (keys its last row reads - rows / 2) / block_k (the causal diagonal counts half)
    cost(block)    = block_ms + tile_ms * tiles(block)
    t(call)        = launch_ms + max(sum_s n_s * sum_blocks cost / multiprocessors, max_block cost)

The ``max`` is the list-scheduling lower bound: enough blocks keep every SM busy (the sum over
SMs), a call with few blocks waits for its longest block. It is additive per segment in its first
term, which is what TAP's per-tile weights need; the second term is paid once per call, like the
launch. Explicit wave quantization (``ceil(blocks / SMs)`` waves of the longest block) overprices
calls whose blocks differ in length (a causal sample's early blocks are short), so it is not used;
a greedy schedule in grid order fits the forward sweep better still (3.9% against 7.2% median
error on the H200 sweep) but needs a walk over every block of every call.

Modelling choices the GPU measures: FlashAttention-2's varlen grid is ``ceil(max q_len /
block_q) x segments x heads``, sized by the call's longest segment, and blocks past a short
segment's end exit at once; the sum over segments counts only blocks that do work. The backward
pass (parallel over key blocks in FlashAttention-2) is priced with the same decomposition and its
own fitted constants. The tile cost scales with ``head_dim / reference_head_dim``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

OCCUPANCY = "occupancy"
KERNEL_MODELS = ("length-curve", OCCUPANCY)
"""``kernel.model`` values: the length-curve model (the default) and this module's."""


def _positive(name: str, value, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if not isinstance(value, kind) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"kernel.occupancy.{name} must be a{'n integer' if integer else ' number'} > 0, "
                         f"got {value!r}")


@dataclass(frozen=True)
class PassCost:
    """One pass's constants: ``launch_ms`` per call, ``block_ms`` per block, ``tile_ms`` per
    ``block_q x block_k`` tile of keys a block reads (ms)."""

    launch_ms: float
    block_ms: float
    tile_ms: float

    def __post_init__(self) -> None:
        for name in ("launch_ms", "block_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"kernel.occupancy.{name} must be a number >= 0, got {value!r}")
        _positive("tile_ms", self.tile_ms)


@dataclass(frozen=True)
class OccupancyModel:
    """Thread-block model of one varlen attention kernel (module docstring).

    Attributes:
        multiprocessors: SMs that run blocks concurrently (one block per SM).
        block_q, block_k: query rows per block and keys per tile of the kernel.
        reference_head_dim: head width the constants were fitted at.
        forward, backward: each pass's :class:`PassCost` (dicts are accepted).

    Raises:
        ValueError: a non-positive size or a bad pass cost.
    """

    multiprocessors: int
    block_q: int
    block_k: int
    reference_head_dim: int
    forward: PassCost
    backward: PassCost

    def __post_init__(self) -> None:
        for name in ("multiprocessors", "block_q", "block_k", "reference_head_dim"):
            _positive(name, getattr(self, name), integer=True)
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if isinstance(value, dict):
                try:
                    object.__setattr__(self, name, PassCost(**value))
                except TypeError as exc:
                    raise ValueError(f"kernel.occupancy.{name}: {exc}") from None
            elif not isinstance(value, PassCost):
                raise ValueError(f"kernel.occupancy.{name} must be an object, got {value!r}")

    def pass_cost(self, backward: bool) -> PassCost:
        return self.backward if backward else self.forward

    def block_tiles(self, q_len, kv_len) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(blocks, tiles, longest)`` per segment (one head): its block count, the key tiles its
        blocks read in all and those of its longest (last) block.

        A segment is query rows ``[kv_len - q_len, kv_len)`` of a sample reading keys up to each
        row. Block ``i`` holds rows ``[i * block_q, min((i + 1) * block_q, q_len))`` of the segment;
        its last row reads ``start + end`` keys and its ``rows / 2`` diagonal keys count half.
        """
        q = np.asarray(q_len, dtype=np.int64)
        kv = np.asarray(kv_len, dtype=np.int64)
        if np.any(q < 0) or np.any(q > kv):
            raise ValueError("a segment needs 0 <= q_len <= kv_len")
        bq, start = self.block_q, (kv - q).astype(np.float64)
        blocks = -(-q // bq)
        full = np.maximum(blocks - 1, 0).astype(np.float64)  # blocks of block_q rows before the last
        last_rows = (q - full * bq).astype(np.float64)
        # full blocks: keys at their end are start + (i + 1) * bq, i < full; minus half a block of diagonal
        keys = full * start + bq * full * (full + 1) / 2 - full * bq / 2
        keys = keys + np.where(blocks > 0, kv - last_rows / 2, 0.0)
        longest = np.where(blocks > 0, (kv - last_rows / 2) / self.block_k, 0.0)
        return blocks.astype(np.float64), keys / self.block_k, longest

    def tile_ms(self, backward: bool, head_dim: int) -> float:
        """One pass's cost of a ``block_q x block_k`` tile at width ``head_dim``."""
        return self.pass_cost(backward).tile_ms * head_dim / self.reference_head_dim

    def work_ms(self, q_len, kv_len, heads, head_dim: int, backward: bool = False) -> np.ndarray:
        """``(G,)`` each segment's share of a call's time when the SMs are full (launch and the
        longest-block floor excluded): ``heads * sum of its blocks' cost / multiprocessors``."""
        return occupancy_terms(self, {"q_len": q_len, "kv_len": kv_len}, heads, 1, head_dim, backward)[0]

    def longest_block_ms(self, q_len, kv_len, head_dim: int, backward: bool = False) -> np.ndarray:
        """``(G,)`` cost of each segment's longest block (0 for an empty segment)."""
        return occupancy_terms(self, {"q_len": q_len, "kv_len": kv_len}, 1, 1, head_dim, backward)[1]

    def call_ms(self, q_len, kv_len, heads, head_dim: int, backward: bool = False) -> float:
        """Time of one kernel call running segments ``q_len, kv_len`` with ``heads`` query heads each."""
        work, floor = occupancy_terms(self, {"q_len": q_len, "kv_len": kv_len}, heads, 1, head_dim, backward)
        return self.pass_cost(backward).launch_ms + max(float(np.sum(work)), float(np.max(floor, initial=0.0)))

    def best_backward_ratio(self, head_dim: int) -> float:
        """Backward / forward time of long calls (their tile costs)."""
        return self.tile_ms(True, head_dim) / self.tile_ms(False, head_dim)

    def to_dict(self) -> dict:
        return asdict(self)


def occupancy_terms(model: OccupancyModel, seg: dict, heads, calls, head_dim: int, backward: bool,
                    geometry: tuple | None = None):
    """``(work, floor)`` of kernel segments run as ``calls`` calls of ``heads`` heads each: the
    additive time over all their calls and the longest block each call of theirs waits for.

    ``geometry``: the segments' :meth:`OccupancyModel.block_tiles`, where the caller has them
    (they depend on the segments and block sizes only, so both passes and every profile with the
    same blocks share them); None computes them."""
    blocks, tiles, longest = model.block_tiles(seg["q_len"], seg["kv_len"]) if geometry is None else geometry
    c, tile_ms = model.pass_cost(backward), model.tile_ms(backward, head_dim)
    work = np.asarray(heads, dtype=np.float64) * (c.block_ms * blocks + tile_ms * tiles) / model.multiprocessors
    floor = np.where(blocks > 0, c.block_ms + tile_ms * longest, 0.0)
    return np.asarray(calls, dtype=np.float64) * work, floor


def fit_pass_cost(model: OccupancyModel, calls: list[tuple], times_ms, backward: bool = False,
                  rounds: int = 50) -> tuple[PassCost, np.ndarray]:
    """Fit one pass's ``launch_ms, block_ms, tile_ms`` to measured kernel calls.

    Relative least squares (every call weighs the same whatever its length): with each call's
    active term of the ``max`` fixed, the model is linear in the three constants; alternate
    solving and re-choosing the active term until it stops changing.

    Args:
        model: supplies ``multiprocessors, block_q, block_k``; its constants are the start.
        calls: one ``(q_lens, kv_lens, heads, head_dim)`` per measured call.
        times_ms: ``(n,)`` measured call times.

    Returns:
        ``(PassCost, relative errors)``.

    Raises:
        ValueError: fewer than 3 calls or mismatched sizes.
    """
    t = np.asarray(times_ms, dtype=np.float64)
    if len(calls) != len(t) or len(t) < 3 or not np.all(t > 0):
        raise ValueError(f"need >= 3 calls with positive times, got {len(calls)} calls and {len(t)} times")
    unit = PassCost(0.0, 1.0, 1.0)
    probe = OccupancyModel(model.multiprocessors, model.block_q, model.block_k, model.reference_head_dim, unit, unit)
    feats = []
    for q, kv, heads, d in calls:
        blocks, tiles, longest = probe.block_tiles(q, kv)
        scale = d / model.reference_head_dim
        feats.append((float(np.sum(heads * blocks)) / model.multiprocessors,
                      float(np.sum(heads * tiles)) * scale / model.multiprocessors,
                      float(np.max(longest, initial=0.0)) * scale))
    sum_b, sum_t, top = (np.array(f) for f in zip(*feats))
    c = model.pass_cost(backward)
    par, active = np.array([c.launch_ms, c.block_ms, c.tile_ms]), None
    for _ in range(rounds):
        wave = par[1] * sum_b + par[2] * sum_t >= par[1] + par[2] * top
        if active is not None and np.array_equal(wave, active):
            break
        active = wave
        x = np.stack([np.ones_like(t), np.where(wave, sum_b, 1.0), np.where(wave, sum_t, top)], axis=1)
        par = np.linalg.lstsq(x / t[:, None], np.ones_like(t), rcond=None)[0]
    par = np.maximum(par, [0.0, 0.0, 1e-12])  # constants are costs: never negative
    pred = par[0] + np.maximum(par[1] * sum_b + par[2] * sum_t, par[1] + par[2] * top)
    return PassCost(*(float(v) for v in par)), pred / t - 1.0
