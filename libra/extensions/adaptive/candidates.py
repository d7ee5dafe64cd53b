"""Adaptive TAP for real corpora: finer tiles, keep cheap-to-move work home (an extension
beyond Libra sec. 4.3; the planner ``libra-adaptive``).

An audit of the paper-faithful TAP on real length data found two losses that Alg. 2's
tile set and order cause, not the data:

* **Heavy tiles.** An equal-token SH-tile at the end of a long causal sample carries work that
  grows linearly with its position; at 1M (B = 8192, H = 2) the heaviest is 1.5-2.3x a worker's
  share, so no placement balances the pool. :func:`fine_head_split` cuts every block into head
  shards of one KV head's query heads (finer shards would fetch that KV head twice), which
  quarters the heaviest tile at the paper's shape. Cutting only the heavy tiles was measured too
  (same per-tile FLOPs limit as a fraction of a worker's mean): it was never better than cutting
  all of them, and it gives a worker tiles of mixed head widths, which the runtime's one kernel
  call per Pipeliner chunk does not take. A one-KV-head tile can still outweigh a worker's mean
  load at the end of a long sample: :func:`split_heavy_tiles` cuts those by tokens instead
  (:data:`HEAVY_TILE_LIMITS`), which keeps every tile's head width.
* **Moving the wrong tiles.** Alg. 2 takes tiles heaviest first, so a Q-home fills with its heavy
  tiles and its light ones -- short-sample tiles whose Q and O cost as many bytes as a heavy
  tile's but carry a hundredth of the work -- are displaced last, to whichever worker has room.
  The receiving workers then spend more time on the wire than computing. :func:`place_retaining`
  first lets every Q-home *retain* its tiles in order of increasing work per byte moved (the
  least worth moving stay), up to the soft target, and only then places the rest -- the tiles
  that carry the most work per byte -- with Alg. 2's own scoring (least incremental
  communication, then least load; :class:`libra.tap.placement._KVGroupState`), heaviest first.
  Where that leaves no room for a long sample's late tiles, Alg. 2 falls back to the least-loaded
  worker, which ends above the soft target; :func:`libra.extensions.adaptive.repair.repair_overload` then moves the
  most work per byte off such workers to the cheapest worker with room.

* **Bytes on slow links.** Alg. 2 prices a move in bytes, so a byte to a worker on the same node
  (NVLink) costs as much as one across the supernode spine (a ninth to an eighteenth of the
  bandwidth in the default profile), and on real corpora a Q-home's displaced tiles travel to
  whichever worker has room, often the far side of the cluster. ``fine-retain-link`` places
  the retention order pricing each byte by the link it crosses
  (``PlacementPolicy.link_cost``, :meth:`libra.sim.topology.Topology.byte_cost`), which keeps
  moved work near its data where room allows.

* **Waiting on the wire.** Even then a few workers -- those receiving or relaying a long sample's
  KV -- wait on chunk 0's dispatch and chunk ``M - 1``'s return, which the Pipeliner never hides,
  while the pool's mean exposed time is small: placement balanced their compute, not their
  compute plus exposed communication. :func:`rebalance_exposed` places the chosen plan again with
  each worker's priced exposure reserved as load (``libra-adaptive``'s ``rebalance_passes``).

None helps every pool: on a pool of short samples the paper's Alg. 2 is already good and a
retained tile set can cost more communication. :func:`candidate_pools` therefore returns the
paper's plan beside the adaptive ones (:data:`DEFAULT_CANDIDATES`; the kernel-time plan and
byte-priced retention stay available for ablations), and the planner keeps, per pool, the one its
cost model prices fastest (``baselines.libra_planners.LibraAdaptivePlanner``).

All are pure functions of the pool's metadata (deterministic, identical on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from libra.arrays import expand_counts, sorted_unique
from libra.config import CheckedLayout, TapConfig
from libra.extensions.adaptive.relay import relay_pool
from libra.extensions.adaptive.retention import place_retaining, speed_reserve
from libra.extensions.adaptive.tile_chunks import TILES
from libra.plan import HEADS, PoolPlan, SequenceLayout, TileTable, pool_index
from libra.plan.layout import tile_flops
from libra.tap.exchange import build_transfers
from libra.tap.pipeline import ChunkSchedule
from libra.tap.placement import PlacementPolicy, place_tiles
from libra.tap.planner import plan_pool
from libra.tap.tiles import PoolTiles, make_tiles
from libra.tap.weights import kernel_time_weights
from libra.workload import AttentionShape, range_areas


@dataclass(frozen=True)
class Candidate:
    """One plan :func:`candidate_pools` can offer per pool; its features are its fields.

    Attributes:
        name: its option name (``libra-adaptive``'s ``candidates``).
        load: what Alg. 2 balances: ``"flops"`` (the paper) or ``"kernel-time"``
            (:func:`~libra.tap.weights.kernel_time_weights`).
        fine: one-KV-head tiles (:func:`fine_head_split`) placed to :data:`FINE_TAU` and cut at each
            heavy-tile limit (:data:`HEAVY_TILE_LIMITS`); False: the paper's SH-tiles through
            :func:`~libra.tap.planner.plan_pool`.
        retain: placed in Q-home retention order (:func:`~libra.extensions.adaptive.retention.place_retaining`),
            which :func:`~libra.extensions.adaptive.rebalance.rebalance_exposed` can place again.
        link_priced: each byte priced by the link it crosses (``PlacementPolicy.link_cost``).
        relay: the placement with its KV fan-out relayed (:mod:`~libra.extensions.adaptive.relay`;
            head chunks only).
        chunking: the Pipeliner chunking (a registered one, :func:`libra.plan.chunkings`) it is
            priced and run with unless the planner is told to price others (``libra-adaptive``'s
            ``chunkings``). Pricing every default candidate under both chunkings (4 windows of each
            public corpus and libra-prod, both settings, 240 pools) never picked the paper's plan
            tile-chunked or ``fine-retain-link`` head-chunked, and picked ``fine`` tile-chunked in 2
            pools: one chunking each gives the same steps within 0.01% for half the pricings.
            Retention keeps a worker's own tiles, so its tile-grouped chunks start and end with
            local work; Alg. 2's plans spread each KV head over many workers, whose head-sliced
            chunks overlap best. Relays run only under head chunks
            (:meth:`libra.tap.pipeline.ChunkSchedule.check_hops`).
        price_rank: its place among the candidates ``libra-adaptive`` prices first, most often
            fastest first (None: after those, as given): of 640 pools (8 windows of libra-prod,
            Wikipedia, ProLong and the WLB-LLM synthetic corpus, 256K and 1M, each priced
            alone without jitter), the relayed plan won 410 (11 of them cut at the finer heavy-tile
            limit), the plain link-priced one 229 and the paper's plan 1. Pricing the likely winner
            first lets the bound drop the others
            (:meth:`libra.extensions.adaptive.planner.AdaptivePools.choose`).
    """

    name: str
    load: str = "kernel-time"
    fine: bool = True
    retain: bool = False
    link_priced: bool = False
    relay: bool = False
    chunking: str = HEADS
    price_rank: int | None = None


CANDIDATES: dict[str, Candidate] = {c.name: c for c in (
    Candidate("alg2-flops", load="flops", fine=False),
    Candidate("alg2-kernel-time", fine=False),
    Candidate("fine"),
    Candidate("fine-retain", retain=True, chunking=TILES),
    Candidate("fine-retain-link", retain=True, link_priced=True, chunking=TILES, price_rank=1),
    Candidate("fine-retain-link-relay", retain=True, link_priced=True, relay=True, price_rank=0),
)}
"""The plans :func:`candidate_pools` offers per pool, by name: the paper's Alg. 2 on FLOPs
(``libra``'s plan), Alg. 2 on estimated kernel time (``libra-kt``'s), and on kernel-time weights with
the finer head split of :func:`fine_head_split`, placed by Alg. 2 (``fine``), by retention
(``fine-retain``), or by retention pricing each byte by the link it crosses (``fine-retain-link``;
needs the cluster's ``link_cost``); the last placement with its KV fan-out relayed (a scatter and an
all-gather) under the paper's head chunks (``fine-retain-link-relay``)."""


def candidate(label: str) -> Candidate:
    """The :class:`Candidate` of a :func:`candidate_pools` key (``name`` or ``name@limit``).

    Raises:
        ValueError: an unknown name.
    """
    name = label.partition("@")[0]
    if name not in CANDIDATES:
        raise ValueError(f"unknown libra-adaptive candidate {name!r}; choose from {', '.join(CANDIDATES)}")
    return CANDIDATES[name]


DEFAULT_CANDIDATES = ("alg2-flops", "fine-retain-link", "fine-retain-link-relay")
"""The candidates ``libra-adaptive`` chooses from unless told otherwise: the paper's plan, the
link-priced retention plan (tile-grouped chunks) and the same placement with its KV fan-out
relayed (head chunks). Measured with ``straggler``'s pricing (jitter on, the default profile):

* before relays, ``alg2-flops, fine, fine-retain-link`` was as fast or faster than all four
  byte-priced candidates on every workload and setting (4 windows; Wikipedia 1M 2.09x over Ulysses
  instead of 2.00x, ProLong 1M 2.50x instead of 2.42x, within 1% elsewhere);
* adding the relayed plan (2 windows) took Wikipedia from 2.43x to 2.86x over Ulysses at 1M and
  4.53x to 4.85x at 256K, ProLong from 2.23x to 2.76x and 5.34x to 5.78x, libra-prod unchanged;
* with it, ``fine`` (one-KV-head tiles placed by Alg. 2) won no pool of 4 windows of the three
  workloads at either setting, and dropping it left every mean straggler identical: one placement
  and one pricing fewer per pool. The paper's plan still wins pools of libra-prod at 1M."""

def fine_head_split(tap: TapConfig, shape: AttentionShape) -> int:
    """The head split ``H'`` whose shards hold one KV head's query heads (``hq / hkv`` of them),
    widened to a multiple of the Pipeliner's ``M`` -- or ``tap.head_split`` when that is already as
    fine, or no such width divides ``hq``."""
    width = math.lcm(max(shape.num_q_heads // shape.num_kv_heads, 1), tap.pipeline_chunks)
    fine = shape.num_q_heads // width if shape.num_q_heads % width == 0 else tap.head_split
    return max(fine, tap.head_split)


HEAVY_TILE_LIMITS = (1.0, 0.75)
"""Fractions of a worker's mean load above which a fine tile is cut into token ranges of equal
causal work (:func:`split_heavy_tiles`): such a tile fills a worker alone and, at the end of a long
sample, overfills it (Alg. 2's fallback). Every piece fetches the sample's KV prefix again, so a
finer cut trades placement balance for bytes, and which wins depends on the pool:
:func:`candidate_pools` builds the fine candidates with the first limit and, for each later one that
cuts some tile, the relayed candidate cut that finer (more pieces of one prefix means more
destinations, which the relay's scatter + all-gather serves), and the planner prices them all.
Measured with ``straggler``'s pricing (jitter on, the default candidates):

* one limit, 4 windows: 1.0 took Wikipedia 1M from 2.56x to 2.64x over Ulysses and ProLong 1M from
  3.25x to 3.29x (256K and libra-prod unchanged: no tile that heavy); 0.8 gave 2.62x / 3.27x and
  0.5 2.49x / 3.10x;
* with the scatter + all-gather relays, 2 windows: 0.75 alone took ProLong 1M from 2.93x to 3.03x but
  Wikipedia 1M from 3.20x to 3.05x; choosing per pool between 1.0 and 0.75 gave ProLong 1M 3.03x,
  and among 1.0, 0.75 and 0.5 3.08x (every pool that took a finer cut took it relayed; building only
  the relayed plan at the finer cuts gave the same 3.08x); Wikipedia 1M, both corpora at 256K and
  libra-prod kept their 1.0 figures either way.
* the price is planning time where a tile is heavy (libra-prod has none that heavy), median per
  pool at 1M: ProLong 29 ms with 1.0 alone, 43 ms with (1.0, 0.75), 52 ms with (1.0, 0.75, 0.5);
  Wikipedia 40, 53 and 112 ms (its giant sample's finer pieces make large relay groups). The
  default stops at 0.75; ``heavy_tile_limits`` adds 0.5."""

FINE_TAU = 0.01
"""The soft-target slack ``tau`` (Alg. 2's ``C = (1 + tau) * mean``) ``libra-adaptive`` places its
fine candidates (:attr:`Candidate.fine`) to, and re-places them with (:func:`rebalance_exposed`); the paper's plan
keeps the layout's (``TapConfig.tau``, 0.03). The paper's slack keeps a tile home while its worker
stays within 3% of the mean, which saves transfers; on one-KV-head tiles priced with their links,
which already weigh what a move costs, it left the straggler worker's planned compute 2.4-4.7%
above its pool's mean. Measured with ``straggler``'s pricing (4 windows, jitter on, default
profile), ``libra-adaptive``'s mean straggler (ms) and ``pool_balanced_ratio`` with every
candidate at tau = 0.03 / 0.02 / 0.01 / 0.005 -- 256K: libra-prod 350.15 / 348.20 / 346.55 /
347.07 (1.108 / 1.101 / 1.093 / 1.091), Wikipedia 55.00 / 54.50 / 54.51 / 54.51, ProLong 54.87 /
55.18 / 54.72 / 55.01, the WLB-LLM synthetic corpus 76.92 / 76.27 / 76.07 / 76.27; 1M:
libra-prod 1184.8 / 1174.4 / 1164.6 / 1164.4 (1.117 / 1.104 / 1.098 / 1.097), Wikipedia 94.55 /
93.77 / 94.09 / 95.73, ProLong 104.69 / 103.05 / 103.88 / 103.64, synthetic 150.23 / 148.30 /
148.17 / 148.14. 0.01 is faster than 0.03 on all eight; 0.005 and 0.02 each lose somewhere."""


@dataclass(frozen=True, eq=False)
class CandidateSpace:
    """What every pool of one window builds its candidates with (:func:`candidate_pools`).

    Attributes:
        tap, shape: as :func:`libra.tap.planner.plan_pool` (a layout already checked).
        kernel: the :class:`libra.sim.kernel.KernelModel` that prices tiles by kernel time.
        names: the candidates to build (keys of :data:`CANDIDATES`).
        link_cost: the byte cost between workers of the link-priced candidates
            (``PlacementPolicy.link_cost``, e.g. :meth:`libra.sim.topology.Topology.byte_cost`).
        limits: the heavy-tile limits (:data:`HEAVY_TILE_LIMITS`): the fine candidates are built
            with the first; each later limit that cuts some tile adds the relayed one (or, without
            it among ``names``, every fine one) cut that finer, named ``name@limit``
            (:func:`candidate` reads the name back).
        fine_tau: the soft-target slack ``tau`` the fine candidates are placed to (:data:`FINE_TAU`
            is ``libra-adaptive``'s); None: ``tap.tau``, the paper's plans' slack.
        checked: the window's :func:`libra.config.check_layout` result, which the paper's plans'
            :func:`~libra.tap.planner.plan_pool` reuses (None: each checks its pool).

    Raises:
        ValueError: an unknown candidate name, or a link-priced one without ``link_cost``.
    """

    tap: TapConfig
    shape: AttentionShape
    kernel: object
    names: tuple[str, ...] = tuple(CANDIDATES)
    link_cost: object = None
    limits: tuple[float, ...] = HEAVY_TILE_LIMITS
    fine_tau: float | None = None
    checked: CheckedLayout | None = None

    def __post_init__(self) -> None:
        linked = sorted(n for n in self.names if candidate(n).link_priced)
        if self.link_cost is None and linked:
            raise ValueError(f"candidates {linked} price bytes by link: pass link_cost")


def candidate_pools(index_in_group: int, sequences: Sequence[SequenceLayout], workers: Sequence[int],
                    space: CandidateSpace, loads: dict | None = None, speeds=None) -> dict[str, PoolPlan]:
    """Every candidate plan of ``space`` for one pool.

    Args:
        index_in_group: the pool's index in its microbatch group (``PoolPlan.pool_index``).
        sequences, workers: as :func:`libra.tap.planner.plan_pool`.
        space: the window's :class:`CandidateSpace`.
        loads: optional dict that receives each fine candidate's tile loads as placed
            (``{name: (T,) array}``, :func:`~libra.tap.weights.kernel_time_weights`): what
            :func:`~libra.extensions.adaptive.rebalance.rebalance_exposed` places with, so the
            planner need not estimate them again.
        speeds: optional ``(W,)`` known speed multipliers of ``workers`` (in their order): the fine
            candidates' placers reserve :func:`~libra.extensions.adaptive.retention.speed_reserve`
            of each, so a slower worker gets less work. None (default): equal speeds. The paper's
            plans (``alg2-*``) ignore them.

    Returns:
        ``{candidate name: PoolPlan}`` for ``space.names``, in :data:`CANDIDATES` order, then the
        later limits' fine candidates.
    """
    sequences, tap, shape = tuple(sequences), space.tap, space.shape
    chosen = [c for c in CANDIDATES.values() if c.name in space.names]
    out = {c.name: plan_pool(index_in_group, sequences, workers, replace(tap, load_estimate=c.load), shape,
                             kernel=space.kernel if c.load == "kernel-time" else None, checked=space.checked)
           for c in chosen if not c.fine}
    fine = [c for c in chosen if c.fine]
    if not fine:
        return out
    tap = tap if space.fine_tau is None else replace(tap, tau=space.fine_tau)
    index = pool_index(sequences)
    tiles = make_tiles(sequences, tap.block_size, fine_head_split(tap, shape), shape, index=index)
    load = kernel_time_weights(tiles, sequences, shape, space.kernel, tap.pipeline_chunks, index=index)
    mean = float(load.sum()) / len(workers)
    for i, limit in enumerate(space.limits):
        heavy = np.any(load > limit * mean)  # tiles that would fill (or overfill) a worker alone
        if i and not heavy:
            continue  # no tile to cut: the first limit's plans again
        cut, cut_load = tiles, load
        if heavy:
            cut = split_heavy_tiles(tiles, sequences, shape, load, limit * mean)
            cut_load = kernel_time_weights(cut, sequences, shape, space.kernel, tap.pipeline_chunks, index=index)
        suffix = f"@{limit:g}" if i else ""
        finer = [c for c in fine if c.relay] or fine  # finer cuts: the relayed plan (HEAVY_TILE_LIMITS)
        reserved = None if speeds is None else speed_reserve(float(cut_load.sum()), speeds)
        placed = _FinePool(index_in_group, sequences, workers, cut, cut_load, reserved)
        for c in (finer if i else fine):
            out[c.name + suffix] = placed.plan(c, tap, shape, space.link_cost)
            if loads is not None:
                loads[c.name + suffix] = cut_load
    return out


class _FinePool:
    """The fine candidates of one pool on one tile set (make_tiles' PoolTiles of its sequences, or
    token pieces of them: :func:`split_heavy_tiles`) with its ``load`` and ``reserved`` load per
    worker: each placement built once, shared by the candidates that differ only in relaying."""

    def __init__(self, index_in_group, sequences, workers, tiles, load, reserved):
        self.index_in_group, self.sequences, self.workers = index_in_group, sequences, tuple(workers)
        self.tiles, self.load, self.reserved = tiles, load, reserved
        self._placed: dict = {}

    def plan(self, c: Candidate, tap: TapConfig, shape: AttentionShape, link_cost) -> PoolPlan:
        key = (c.retain, c.link_priced)
        plain = self._placed.get(key)
        if plain is None:
            policy = PlacementPolicy(link_cost=link_cost if c.link_priced else None, reserved=self.reserved)
            place = place_retaining if c.retain else place_tiles
            tiles, fallback = place(self.tiles, self.sequences, self.workers, shape, tap.tau, self.load, policy)
            plain = self._placed[key] = PoolPlan(
                pool_index=self.index_in_group, workers=self.workers, sequences=self.sequences, tiles=tiles,
                transfers=build_transfers(self.sequences, tiles, shape, index=self.tiles.index),
                fallback_tiles=fallback)
        if not c.relay:
            return plain
        # the same placement, its KV fan-out relayed (head chunks: the rule of relay's check_hops)
        return relay_pool(plain, ChunkSchedule.for_pool(plain, shape, tap.pipeline_chunks))


def split_heavy_tiles(tiles: TileTable, sequences: Sequence[SequenceLayout], shape: AttentionShape,
                      load: np.ndarray, limit: float) -> TileTable:
    """``tiles`` with every tile whose ``load`` exceeds ``limit`` replaced, in place, by
    ``ceil(load / limit)`` token ranges of equal causal area (same query heads and Q-home; fewer
    when the tile has fewer tokens). Any token range inside one Q-home is a tile to the Plan checks
    and the runtime; pieces of :class:`~libra.tap.tiles.PoolTiles` stay PoolTiles of the same pool."""
    heavy = np.nonzero(np.asarray(load) > limit)[0]
    if not len(heavy):
        return tiles
    cuts = {t: _equal_area_bounds(sequences[int(tiles.seq[t])], int(tiles.q_start[t]), int(tiles.q_end[t]),
                                  int(np.ceil(load[t] / limit))) for t in heavy.tolist()}
    counts = np.ones(len(tiles), dtype=np.int64)
    counts[heavy] = [len(cuts[t]) - 1 for t in heavy.tolist()]
    rows, _ = expand_counts(counts)
    q0, q1 = tiles.q_start[rows].copy(), tiles.q_end[rows].copy()
    first = np.cumsum(counts) - counts
    for t, bounds in cuts.items():
        f = first[t]
        q0[f:f + len(bounds) - 1], q1[f:f + len(bounds) - 1] = bounds[:-1], bounds[1:]
    seq, heads = tiles.seq[rows], (tiles.head_end - tiles.head_start)[rows]
    flops = np.zeros(len(rows))
    for s_idx, layout in enumerate(sequences):
        sel = np.nonzero(seq == s_idx)[0]
        flops[sel] = tile_flops(layout, q0[sel], q1[sel], heads[sel], shape.head_dim)
    cols = {"seq": seq, "q_start": q0, "q_end": q1, "head_start": tiles.head_start[rows],
            "head_end": tiles.head_end[rows], "q_home": tiles.q_home[rows], "dest": tiles.dest[rows], "flops": flops}
    return tiles.pieces(**cols) if isinstance(tiles, PoolTiles) else TileTable(**cols)


def _equal_area_bounds(seq: SequenceLayout, a: int, b: int, n: int) -> np.ndarray:
    """Boundaries ``a < c_1 < ... < b`` cutting ``[a, b)`` of ``seq`` into at most ``n`` ranges of
    (nearly) equal causal area."""
    ends = np.arange(a + 1, b + 1)
    area = range_areas(seq.sample_offsets, np.full(len(ends), a), ends).astype(np.float64)
    cuts = ends[np.minimum(np.searchsorted(area, area[-1] * np.arange(1, n) / n), len(ends) - 1)]
    return sorted_unique(np.concatenate(([a], np.clip(cuts, a + 1, b), [b])))


