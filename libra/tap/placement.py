"""Communication-aware SH-tile placement (Libra sec. 4.3.2, Algorithm 2).

Tiles are taken heaviest first (ties: lower tile index first). Each goes to a *candidate* worker,
one whose load stays within the soft target ``C = (1 + tau) * mean`` (``mean`` = total tile FLOPs /
W), choosing the least incremental communication, then the least load, then the lowest worker id.
The load of a tile is its FLOPs (the paper) or, optionally, a caller's per-tile estimate such as
its kernel time (``weights=``, :mod:`libra.tap.weights`; an extension, not in the paper).
If no worker is a candidate, the least-loaded worker (ties: lowest id) takes the tile and the
fallback is counted. ``comm_aware=False`` drops the communication term (FLOPs-only placement, used
to emulate DistCA).

Incremental communication of tile ``t`` on worker ``w``:

* Q bytes + O bytes of the tile when ``w`` is not its Q-home;
* the KV bytes of ``[kv_start_t, q_end_t)`` (per KV atom of its heads) that ``w`` neither holds in
  the pre-attention layout nor already fetches for tiles placed on it earlier. Per sample this is
  exactly "pay only the rows beyond the prefix already fetched", since a tile's KV interval is the
  union of the prefixes of the samples it touches.

Implementations (identical choices; the tests check both against a plain oracle):

* :func:`_place_grouped` (used for SH-tiles, i.e. whenever tiles of one sequence have identical or
  disjoint token ranges): per-KV-group state, so a tile only scores the few workers that hold or
  already fetched part of its KV groups, plus the least-loaded worker of all others (who all cost
  the same). The Q-home wins without scoring when it has room and holds the whole KV interval.
  :func:`_grouped_tiles` prepares the per-tile inputs with numpy; :class:`_KVGroupState` holds the
  loads and KV groups, makes each choice (:meth:`~_KVGroupState.place`) and is the one place a
  worker's cost is computed (:meth:`~_KVGroupState.best_scored`).
* :func:`_place_dense` (any tiles): per sequence and KV atom a ``missing[w, seg]`` byte map over
  elementary token segments (:func:`_missing_bytes`); every worker is scored for every tile with
  numpy.

Link-priced placement (``link_cost=``, an extension used by ``libra-adaptive``): each byte moved is
weighted by the link it crosses -- Q and O between the Q-home and the worker, KV from each token's
holder -- as an integer relative time per byte (:meth:`libra.sim.topology.Topology.byte_cost`), so
a move over NVLink is cheaper than one over the NIC. Only the dense placers take it (the grouped
one relies on every non-holder costing the same); with a cost of 1 on every link they make
Algorithm 2's choices.

Cost: O(T log W) plus the scored workers; a 256K pool (1024 tiles, 64 workers) takes a few ms in
CPython (``benchmarks/test_bench_tap.py``). The loops are scalar Python over lists, so hot paths
avoid per-worker function calls.

Compiled placer: with numba installed (``pip install -e '.[fast]'``), :func:`place_tiles` runs the
kernels of :mod:`libra.jit.placement` instead (``placer="auto"``, the default; force either
with ``placer="numba"`` / ``"python"``). They make the same choices as the loops above (which stay
the oracle and the fallback), from the same inputs: one :class:`PlacementArrays` per pool, built
once by :func:`place_tiles`, and :func:`_grouped_base` / :func:`_dense_inputs` derived from it.
:func:`default_placer` names the placer ``auto`` runs (record it with timings); :func:`warmup`
compiles the kernels (once per process).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from libra import jit as jit_modules
from libra.arrays import lexsort, sorted_unique
from libra.config import TapConfig, check_tau
from libra.plan import PoolIndex, SequenceLayout, TileTable, kv_need_start, pool_index
from libra.tap.tiles import PoolTiles, kv_atoms
from libra.workload import AttentionShape, kv_bytes, o_bytes, q_bytes


def _check_inputs(tiles: TileTable, sequences, workers, tau):
    """Validate ``place_tiles``' inputs; return the sorted workers and the pool index (the tiles',
    or built here when there are tiles; None when there are none). Tiles of
    :func:`libra.tap.tiles.make_tiles` made for these ``sequences`` (:class:`PoolTiles`) already lie
    inside one holder range of their Q-home, so only the scalar arguments, the workers and the
    holders are checked for them (the per-tile checks were about a fifth of ``libra``'s whole TAP
    time)."""
    check_tau(tau)
    w = np.asarray(list(workers), dtype=np.int64)
    if w.ndim != 1 or len(w) == 0:
        raise ValueError("placement needs at least one worker")
    if len(np.unique(w)) != len(w):
        raise ValueError(f"pool workers must be distinct, got {w.tolist()}")
    w = np.sort(w)
    made = isinstance(tiles, PoolTiles) and tiles.made_for(sequences)
    idx = tiles.index if made else None
    if len(tiles) and not made:
        if not 0 <= int(tiles.seq.min()) <= int(tiles.seq.max()) < len(sequences):
            raise ValueError(f"tile sequence index out of range for {len(sequences)} sequences")
        home = sorted_unique(tiles.q_home)
        missing = home[w[np.minimum(np.searchsorted(w, home), len(w) - 1)] != home]
        if len(missing):
            raise ValueError(f"Q-home worker {int(missing[0])} is not a pool worker {w.tolist()}")
        if not (np.isfinite(tiles.flops).all() and tiles.flops.min() >= 0):
            raise ValueError("tile FLOPs must be finite and >= 0")
        idx = pool_index(sequences)
        lengths = np.diff(idx.base)[tiles.seq]
        bad = np.nonzero((tiles.q_start < 0) | (tiles.q_end <= tiles.q_start) | (tiles.q_end > lengths))[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"tile {i} has token range [{tiles.q_start[i]}, {tiles.q_end[i]}) outside its "
                             f"sequence of {lengths[i]} tokens")
        shift = idx.base[tiles.seq]
        pos = np.searchsorted(idx.h_start, tiles.q_start + shift, side="right") - 1
        bad = np.nonzero((idx.h_worker[pos] != tiles.q_home) | (tiles.q_end + shift > idx.h_end[pos]))[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"tile {i} (tokens [{tiles.q_start[i]}, {tiles.q_end[i]}) of sequence {tiles.seq[i]}) "
                             f"must lie in one holder range held by its q_home {tiles.q_home[i]}")
    holders = sorted_unique(np.concatenate([seq.holder_worker for seq in sequences])) if sequences else w[:0]
    extra = holders[w[np.minimum(np.searchsorted(w, holders), len(w) - 1)] != holders]
    if len(extra):
        raise ValueError(f"worker {int(extra[0])} holds sequence tokens but is not a pool worker {w.tolist()}")
    return w, idx


def _place_flops_only(flops, order, reserved, cap):
    """Least-loaded placement with a (load, worker) heap from the ``(W,)`` starting loads
    ``reserved``; returns pool-index dests and fallbacks."""
    heap = [(float(r), i) for i, r in enumerate(reserved)]
    heapq.heapify(heap)
    dest = np.empty(len(flops), dtype=np.int64)
    fallback = 0
    for t in order.tolist():
        load, i = heap[0]
        f = flops[t]
        if load + f > cap:  # the least-loaded worker cannot take it, so nobody can
            fallback += 1
        dest[t] = i
        heapq.heapreplace(heap, (load + f, i))
    return dest, fallback


@dataclass(frozen=True, eq=False)
class PlacementPolicy:
    """How Algorithm 2 orders tiles and prices a move, beside its slack ``tau`` and load estimate:
    the one seam through which an extension changes placement (:func:`place_tiles`).

    Attributes:
        comm_aware: score by incremental communication first (the paper); False: FLOPs only
            (least-loaded placement, DistCA's emulation).
        order: the order tiles are placed in, a permutation of ``range(T)`` (None: Alg. 2's,
            heaviest first, ties by tile index).
        link_cost: optional ``link_cost(src, dst)``, vectorised over broadcastable arrays of global
            worker ids, giving the non-negative integer cost of one byte from ``src`` to ``dst``
            (e.g. :meth:`libra.sim.topology.Topology.byte_cost`: relative time per byte of the link
            class between them). Incremental communication is then priced in link time, each byte
            weighted by the link it crosses (Q and O: Q-home <-> destination; KV: the token's
            holder -> destination), and the dense placer runs (the grouped one relies on every
            non-holder costing the same). None: every byte that moves costs 1, as in the paper.
        reserved: optional ``(W,)`` load each worker (in ``workers`` order) carries before any
            tile, in the units of the tile loads (e.g. its predicted exposed communication).
            Placement starts from these loads and ``C = (1 + tau) * (sum(loads) + sum(reserved)) / W``.
            None: all 0, as in the paper.
    """

    comm_aware: bool = TapConfig.comm_aware
    order: np.ndarray | None = None
    link_cost: object = None
    reserved: np.ndarray | None = None


PAPER_POLICY = PlacementPolicy()
"""Algorithm 2 as in the paper: heaviest first, every moved byte costs 1, nothing reserved."""


class PlacementArrays(NamedTuple):
    """One pool's Algorithm 2 inputs beside its tiles (Libra sec. 4.3.2): what :func:`place_tiles`
    resolves once from ``weights``, ``tau`` and a :class:`PlacementPolicy`, handed whole to every
    placer (grouped, dense, and the compiled kernels, which :func:`_place_compiled` gives them
    one by one), so that all of them place from the very same arrays. No placer writes to them.

    Attributes:
        wsorted: int64 ``(W,)`` the pool's global worker ids, ascending; a placer's worker index is
            a position here, so "lowest index" on ties is the lowest id.
        order: int64 ``(T,)`` the order tiles are placed in (a permutation of the tiles).
        load: float64 ``(T,)`` each tile's load: its FLOPs or the caller's ``weights``.
        cap: the soft target ``C`` (:func:`soft_target`).
        base: float64 ``(W,)`` each worker's load before any tile, in ``wsorted`` order
            (:func:`reserved_loads`; zeros in the paper).
        index: the pool's :class:`~libra.plan.PoolIndex` (its global token axis).
        lw: int64 ``(W, W)`` cost of a byte between workers (:func:`link_matrix`), or None: every
            moved byte costs 1, as in the paper (the only case the grouped placers take).
    """

    wsorted: np.ndarray
    order: np.ndarray
    load: np.ndarray
    cap: float
    base: np.ndarray
    index: PoolIndex
    lw: np.ndarray | None = None


def place_tiles(tiles: TileTable, sequences: Sequence[SequenceLayout], workers: Sequence[int],
                shape: AttentionShape, tau: float = TapConfig.tau, weights=None,
                policy: PlacementPolicy = PAPER_POLICY, placer: str = "auto") -> tuple[TileTable, int]:
    """Algorithm 2: assign every tile a destination worker.

    Args:
        tiles: ``(T,)`` tiles (``dest`` ignored), e.g. from :func:`libra.tap.tiles.make_tiles`.
        sequences: the pool's sequences; ``tiles.seq`` indexes them; holders must be pool workers.
        workers: the pool's global worker ids (any order; ties break on the lowest id).
        shape: head geometry; bytes come from :mod:`libra.workload`.
        tau: soft-target slack, ``C = (1 + tau) * mean``.
        weights: optional ``(T,)`` float per-tile load estimates used instead of ``tiles.flops``
            for the heaviest-first order, the worker loads and ``C = (1 + tau) * sum(weights) / W``
            (e.g. :func:`libra.tap.weights.kernel_time_weights`: estimated kernel ms, an
            extension beyond the paper). ``None`` (default) balances FLOPs as Algorithm 2 does.
        placer: ``"auto"`` (default: the compiled kernels when numba imports, else Python; see
            :func:`default_placer`), ``"numba"`` or ``"python"``. All make identical choices.
        policy: the order, byte cost and reserved load to place with (:class:`PlacementPolicy`;
            default :data:`PAPER_POLICY`, Algorithm 2 as in the paper).

        The tiles of :func:`libra.tap.tiles.make_tiles` (a :class:`~libra.tap.tiles.PoolTiles` made
        for these very ``sequences``) lie inside one holder range of their Q-home by construction
        and carry the pool's index, so only the scalar arguments, the workers and the holders are
        checked for them; any other tiles are checked one by one against the sequences.

    Returns:
        ``(placed, fallback_count)``: the tiles with ``dest`` set (same row order) and the number of
        tiles that went to the least-loaded worker because no worker stayed within ``C``.

    Raises:
        ValueError: ``tau < 0`` (or not a number), no/duplicate workers, a Q-home or holder outside
            the pool, a sequence index out of range, negative or non-finite FLOPs, a tile whose
            token range is not inside one holder range of its Q-home, ``weights`` that are not
            ``(T,)`` finite numbers >= 0, an unknown placer, or a policy's ``order`` that is not a permutation of the tiles, a ``link_cost`` that does not
            give a non-negative integer per worker pair, or ``reserved`` that is not ``(W,)``
            finite numbers >= 0.
        ImportError: ``placer="numba"`` without numba (``pip install -e '.[fast]'``).
    """
    jit = placer_module(placer)
    if not isinstance(policy, PlacementPolicy):
        raise ValueError(f"policy must be a PlacementPolicy, got {type(policy).__name__}")
    wsorted, idx = _check_inputs(tiles, sequences, workers, tau)
    load = tiles.flops if weights is None else _check_weights(weights, len(tiles))
    n_tiles = len(tiles)
    base = reserved_loads(policy.reserved, workers, wsorted)
    if n_tiles == 0:
        return tiles, 0
    cap = soft_target(load, base, tau)
    order = (np.argsort(-load, kind="stable") if policy.order is None  # heaviest first
             else _check_order(policy.order, n_tiles))
    lw = None if policy.link_cost is None else link_matrix(policy.link_cost, wsorted)
    arrays = PlacementArrays(wsorted, order, load, cap, base, idx, lw)
    if jit is not None:
        dest_idx, fallback = _place_compiled(jit, tiles, sequences, shape, arrays, policy.comm_aware)
    elif policy.comm_aware:
        dense = lw is not None or not is_block_partition(tiles)
        dest_idx, fallback = (_place_dense(tiles, sequences, shape, arrays) if dense
                              else _place_grouped(tiles, shape, arrays))
    else:
        dest_idx, fallback = _place_flops_only(load.tolist(), order, base, cap)
    cols = {k: getattr(tiles, k) for k in TileTable.FIELDS}
    cols["dest"] = wsorted[dest_idx]
    return TileTable(**cols), fallback


PLACERS = ("auto", "numba", "python")
"""Values of ``place_tiles(placer=...)``: ``"auto"`` picks :func:`default_placer`."""


def available_placers() -> tuple[str, ...]:
    """The concrete placers this process can run: ``("numba", "python")`` or ``("python",)``."""
    return ("numba", "python") if jit_modules.impl_name("placement", "python") == "numba" else ("python",)


def default_placer() -> str:
    """The placer ``place_tiles(placer="auto")`` runs here: ``"numba"`` when numba imports (the
    compiled kernels of :mod:`libra.jit.placement`), else ``"python"``. Record it with timings."""
    return available_placers()[0]


def warmup(placer: str = "auto") -> float:
    """Compile the placement kernels now (once per process; numba only) so that timed calls
    exclude compilation; returns the seconds spent (0.0 for the Python placer)."""
    jit = placer_module(placer)
    return 0.0 if jit is None else float(jit.warmup())


def placer_module(placer: str):
    """The compiled-kernel module for ``placer``, or None for the Python loops."""
    if placer not in PLACERS:
        raise ValueError(f"placer must be one of {PLACERS}, got {placer!r}")
    return jit_modules.select("placement", placer, "placer")


def _place_compiled(jit, tiles, sequences, shape, arrays: PlacementArrays, comm_aware: bool):
    """``(dest pool indices, fallbacks)`` from the compiled kernels (same choices as the Python
    placers: grouped for SH-tiles, dense for other tiles or link-priced placement, least-loaded
    when not comm-aware). The kernels take their arrays one by one, so the bundle is unpacked
    here, the one place that knows both signatures."""
    a = arrays
    if not comm_aware:
        return jit.place_flops_only(a.order, a.load, a.cap, a.base)
    if a.lw is None and is_block_partition(tiles):
        return jit.place_grouped(_grouped_base(tiles, a.index, a.wsorted, shape), a.order, a.load, a.cap, a.base)
    return jit.place_dense(_dense_inputs(tiles, sequences, a.wsorted, shape, a.index, a.lw), tiles.seq, a.order,
                           a.load, a.cap, a.base)


def reserved_loads(reserved, workers, wsorted: np.ndarray) -> np.ndarray:
    """float64 ``(W,)`` starting loads in ``wsorted`` order from ``reserved`` in ``workers`` order
    (zeros for None; ValueError unless ``(W,)`` finite numbers >= 0)."""
    if reserved is None:
        return np.zeros(len(wsorted))
    try:
        r = np.asarray(reserved, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"reserved loads must be numbers, got {reserved!r:.80}") from exc
    if r.shape != (len(wsorted),) or not np.all(np.isfinite(r)) or np.any(r < 0):
        raise ValueError(f"reserved loads must be {len(wsorted)} finite numbers >= 0 (one per worker), "
                         f"got shape {r.shape}")
    return r[np.argsort(np.asarray(list(workers)), kind="stable")]


def soft_target(load: np.ndarray, base: np.ndarray, tau: float) -> float:
    """Algorithm 2's soft target ``C = (1 + tau) * (sum(loads) + sum(base)) / W``: the tile loads
    ``load`` and the ``(W,)`` starting loads ``base`` (:func:`reserved_loads`) spread evenly, plus
    the slack (what :func:`place_tiles` places within, and a repair after it restores)."""
    return (1.0 + float(tau)) * (float(load.sum() + base.sum()) / len(base))


def link_matrix(link_cost, wsorted: np.ndarray) -> np.ndarray:
    """int64 ``(W, W)``: ``link_cost`` between the pool's sorted workers, the diagonal 0 (a worker
    reading its own bytes moves nothing); ``None``: 1 per byte between any two workers (plain
    bytes, Alg. 2). ValueError when it is not a non-negative integer per pair."""
    if link_cost is None:
        n = len(wsorted)
        return np.ones((n, n), dtype=np.int64) - np.eye(n, dtype=np.int64)
    try:
        raw = np.asarray(link_cost(wsorted[:, None], wsorted[None, :]))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"link_cost failed on the pool's workers: {exc}") from exc
    n = len(wsorted)
    if raw.shape != (n, n) or raw.dtype.kind not in "iu" or (raw < 0).any():
        raise ValueError(f"link_cost must give a non-negative integer per worker pair, shape ({n}, {n}); "
                         f"got dtype {raw.dtype}, shape {raw.shape}")
    lw = raw.astype(np.int64)
    np.fill_diagonal(lw, 0)
    return lw


def _check_weights(weights, n_tiles: int) -> np.ndarray:
    """``weights`` as a float64 ``(T,)`` array of finite values >= 0 (ValueError otherwise)."""
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"tile weights must be numbers, got {weights!r:.80}") from exc
    if w.shape != (n_tiles,):
        raise ValueError(f"tile weights must have shape ({n_tiles},) (one per tile), got {w.shape}")
    bad = np.nonzero(~np.isfinite(w) | (w < 0))[0]
    if len(bad):
        raise ValueError(f"tile weights must be finite and >= 0; tile {int(bad[0])} has {float(w[bad[0]])!r}")
    return w


def _check_order(order, n_tiles: int) -> np.ndarray:
    """``order`` as an int64 permutation of ``range(n_tiles)`` (ValueError otherwise)."""
    o = np.asarray(order)
    if o.shape != (n_tiles,) or o.dtype.kind not in "iu" or not np.array_equal(np.sort(o), np.arange(n_tiles)):
        raise ValueError(f"order must be a permutation of the {n_tiles} tiles")
    return o.astype(np.int64)


def _qo_bytes(tiles: TileTable, shape: AttentionShape) -> np.ndarray:
    """int64 ``(T,)`` Q + O bytes each tile moves when it leaves its Q-home."""
    tokens = tiles.q_end - tiles.q_start
    return (q_bytes(tokens, 1, shape.head_dim, shape.dtype_bytes)
            + o_bytes(tokens, 1, shape.head_dim, shape.dtype_bytes)) \
        * (tiles.head_end - tiles.head_start).astype(np.int64)


def _segment_costs(tiles, sequences, wsorted, shape, kv_lo, lw):
    """Per sequence the int64 ``(W, segments)`` cost of one KV head's rows of each elementary token
    segment (cut by holder ranges and tile KV intervals) on each worker: its bytes times
    ``lw[holder, w]`` (0 on its holder, whose diagonal is 0); and per tile its segment span
    ``[seg0, seg1)`` (its KV interval ``[kv_lo, q_end)``)."""
    per_token = kv_bytes(1, 1, shape.head_dim, shape.dtype_bytes)
    seg0 = np.zeros(len(tiles), dtype=np.int64)
    seg1 = np.zeros(len(tiles), dtype=np.int64)
    costs = []
    for s_idx, seq in enumerate(sequences):
        rows = np.nonzero(tiles.seq == s_idx)[0]
        cuts = sorted_unique(np.concatenate(([0, seq.num_tokens], seq.holder_start, seq.holder_end,
                                         kv_lo[rows], tiles.q_end[rows])))
        seg0[rows] = np.searchsorted(cuts, kv_lo[rows])
        seg1[rows] = np.searchsorted(cuts, tiles.q_end[rows])
        holder = np.empty(len(cuts) - 1, dtype=np.int64)  # pool index of each segment's holder
        h_idx = np.searchsorted(wsorted, seq.holder_worker)
        for w, c0, c1 in zip(h_idx.tolist(), np.searchsorted(cuts, seq.holder_start).tolist(),
                             np.searchsorted(cuts, seq.holder_end).tolist()):
            holder[c0:c1] = w
        costs.append(lw[holder].T * (np.diff(cuts) * per_token)[None, :])
    return costs, seg0, seg1


def _missing_bytes(d: dict) -> list[np.ndarray]:
    """Per sequence the float64 ``(atoms, W, segments)`` map of what each worker lacks before any
    placement (:func:`_dense_inputs`' segment costs times each KV atom's heads): bytes, or bytes
    priced by link. Integer-valued, so the dense placer's sums stay exact."""
    return [d["atom_heads"][:, None, None].astype(np.float64) * c[None, :, :] for c in d["seg_costs"]]


def _dense_inputs(tiles, sequences, wsorted, shape, index=None, lw=None) -> dict:
    """Per-tile inputs of the dense placers (:func:`_place_dense` and the compiled kernel):
    ``seg_costs`` (:func:`_segment_costs`, per sequence), ``atom_heads`` the KV heads of each atom,
    ``seg0``/``seg1`` each tile's segment span, ``a0``/``a1`` its KV-atom span, ``qo`` its Q + O
    bytes, ``home`` the pool index of its Q-home, and ``lw`` the ``(W, W)`` cost of a byte between
    workers (default 1, 0 on the diagonal: bytes)."""
    lw = link_matrix(None, wsorted) if lw is None else lw
    kv_lo = kv_need_start(sequences, tiles, index)
    bounds, a0, a1 = kv_atoms(shape, tiles.head_start, tiles.head_end)
    costs, seg0, seg1 = _segment_costs(tiles, sequences, wsorted, shape, kv_lo, lw)
    return {"seg_costs": costs, "atom_heads": np.diff(bounds).astype(np.int64), "seg0": seg0, "seg1": seg1,
            "a0": a0, "a1": a1, "qo": _qo_bytes(tiles, shape), "home": np.searchsorted(wsorted, tiles.q_home),
            "lw": lw}


def _place_dense(tiles, sequences, shape, arrays: PlacementArrays):
    """Reference Algorithm 2 on token-segment bitmaps: scores every worker for every tile.

    Exact for any tiles (used when tiles of one sequence are not a block partition, and by the
    tests as the oracle for :func:`_place_grouped`). ``missing[s][b, w, k]`` = KV bytes (priced
    by link with ``arrays.lw``; None: bytes) of atom ``b`` that worker ``w`` lacks in token
    segment ``k`` of sequence ``s`` (:func:`_missing_bytes`). Tiles go in ``arrays.order`` with
    loads ``arrays.load`` onto workers starting at ``arrays.base`` (:class:`PlacementArrays`).
    """
    cap = arrays.cap
    d = _dense_inputs(tiles, sequences, arrays.wsorted, shape, arrays.index, arrays.lw)
    missing = _missing_bytes(d)
    qo_cost = d["lw"].astype(np.float64)  # row h: the cost of one Q/O byte between Q-home h and each worker
    loads = np.array(arrays.base, dtype=np.float64)  # a copy: the bundle is never written
    dest = np.empty(len(tiles), dtype=np.int64)
    fallback = 0
    seq_l, widx_l = tiles.seq.tolist(), d["home"].tolist()
    qo_l = d["qo"].astype(np.float64).tolist()
    s0_l, s1_l, a0_l, a1_l = d["seg0"].tolist(), d["seg1"].tolist(), d["a0"].tolist(), d["a1"].tolist()
    flops_l = arrays.load.tolist()
    inf = np.inf
    for t in arrays.order.tolist():
        f, h = flops_l[t], widx_l[t]
        miss = missing[seq_l[t]]
        i0, i1, b0, b1 = s0_l[t], s1_l[t], a0_l[t], a1_l[t]
        if b1 - b0 == 1:
            cost = miss[b0, :, i0:i1].sum(axis=1)
        else:
            cost = miss[b0:b1, :, i0:i1].sum(axis=(0, 2))
        cost += qo_l[t] * qo_cost[h]
        ok = loads + f <= cap
        if ok.any():  # least communication, then least load, then lowest id (argmin: first)
            c = np.where(ok, cost, inf)
            w = int(np.where(c == c.min(), loads, inf).argmin())
        else:
            w = int(loads.argmin())
            fallback += 1
        miss[b0:b1, w, i0:i1] = 0.0
        dest[t] = w
        loads[w] += f
    return dest, fallback


def is_block_partition(tiles: TileTable) -> bool:
    """True when, per sequence, any two tiles' token ranges are identical or disjoint (SH-tiles)."""
    if len(tiles) < 2:
        return True
    o = lexsort((tiles.q_end, tiles.q_start, tiles.seq))
    seq, qs, qe = tiles.seq[o], tiles.q_start[o], tiles.q_end[o]
    same = (qs[1:] == qs[:-1]) & (qe[1:] == qe[:-1])
    return bool(np.all((seq[1:] != seq[:-1]) | same | (qe[:-1] <= qs[1:])))


def _place_grouped(tiles, shape, arrays: PlacementArrays):
    """Algorithm 2 on per-KV-group state (exact for block-partitioned tiles, the SH-tile case).

    A tile's KV need splits into its *first* sample's prefix ``[s_f, n_f)`` (which may reach back
    before the block), the *body* of samples that lie wholly inside the block, and the *last*
    sample's prefix ``[s_l, q_end)``. Per (sample, KV atom) we keep ``{worker: prefix end
    fetched}`` (the paper's KV groups: "a destination that fetched a shorter prefix pays only the
    extra rows"), and per (block, atom) the set of workers that fetched its body (only tiles of the
    same block read it). Only workers named there, holders of the first sample's prefix and the
    Q-home can cost less than ``Q + O + all KV bytes``; every other worker costs exactly that, so
    among them only the least-loaded one (a lazy heap) can win. The Q-home wins outright when it
    has room and holds the tile's whole KV interval (cost 0; everyone else pays at least Q + O).
    All positions are on the pool's global token axis (``arrays.index``). Tiles go in
    ``arrays.order`` with loads ``arrays.load`` onto workers starting at ``arrays.base``
    (:class:`PlacementArrays`; ``arrays.lw`` must be None: every moved byte costs 1).

    Per-tile inputs come from :func:`_grouped_tiles`; the running state, the choice and the one
    scoring rule live in :class:`_KVGroupState`.
    """
    cap = arrays.cap
    rows, home, free, atom_bytes = _grouped_tiles(tiles, arrays.index, arrays.wsorted, shape)
    state = _KVGroupState(arrays.base, cap, atom_bytes)
    loads, heap, push = state.loads, state.heap, heapq.heappush
    load_l = arrays.load.tolist()
    dest = [0] * len(tiles)
    for t in arrays.order.tolist():
        f, h = load_l[t], home[t]
        if free[t] and loads[h] + f <= cap:
            w = h  # the Q-home holds all it needs: cost 0, and nothing new to record
        else:
            w = state.place(rows[t], h, f, free[t])
        dest[t] = w
        loads[w] += f
        push(heap, (loads[w], w))
    return np.asarray(dest, dtype=np.int64), state.fallbacks


def _grouped_base(tiles, idx, wsorted, shape) -> dict[str, np.ndarray]:
    """The grouped placers' inputs other than token positions (shared by :func:`_grouped_columns`
    and the compiled kernel of :mod:`libra.jit.placement`, which derives the positions itself
    from ``seq``, ``q_start``, ``q_end`` and the pool index ``base``, ``offs``).

    Keys: per tile ``a0``, ``a1`` its KV-atom span, ``qo`` its Q + O bytes, ``home`` the pool
    index of its Q-home; per pool ``bounds`` the KV-atom boundaries, ``atom_bytes`` KV bytes per
    token of each atom, the holder ranges ``h_start``, ``h_end`` of ``idx`` and ``h_widx`` the
    pool index of each one's worker; and the inputs named above.
    """
    bounds, a0, a1 = kv_atoms(shape, tiles.head_start, tiles.head_end)
    per_token = int(kv_bytes(1, 1, shape.head_dim, shape.dtype_bytes))
    return {"a0": a0, "a1": a1, "qo": _qo_bytes(tiles, shape), "home": np.searchsorted(wsorted, tiles.q_home),
            "bounds": bounds, "atom_bytes": np.diff(bounds) * per_token, "h_start": idx.h_start,
            "h_end": idx.h_end, "h_widx": np.searchsorted(wsorted, idx.h_worker), "seq": tiles.seq,
            "q_start": tiles.q_start, "q_end": tiles.q_end, "base": idx.base, "offs": idx.offs}


def _grouped_columns(tiles, idx, wsorted, shape) -> dict[str, np.ndarray]:
    """Per-tile inputs of :func:`_place_grouped` as numpy arrays on the global token axis:
    :func:`_grouped_base` plus

    ``first``, ``last`` global sample index of the tile's first / last sample; ``body`` tokens of
    the samples wholly inside the block; ``sf``, ``nf`` the first sample's prefix ``[sf, nf)`` it
    needs; ``sl`` the last sample's start; ``e`` the tile's end; ``generic`` Q + O + all its KV
    bytes; ``free`` whether the Q-home holds the whole KV interval; ``j0``, ``j1`` the holder
    ranges (rows of ``idx``) overlapping ``[sf, nf)``.
    """
    g = _grouped_base(tiles, idx, wsorted, shape)
    per_token, bounds = int(kv_bytes(1, 1, shape.head_dim, shape.dtype_bytes)), g["bounds"]
    shift = idx.base[tiles.seq]
    qs, qe = tiles.q_start + shift, tiles.q_end + shift
    offs = idx.offs
    first = np.searchsorted(offs, qs, side="right") - 1
    last = np.searchsorted(offs, qe - 1, side="right") - 1
    s_f, n_f, s_l = offs[first], np.minimum(qe, offs[first + 1]), offs[last]
    pos = np.searchsorted(idx.h_start, qs, side="right") - 1
    free = (idx.h_start[pos] <= s_f) & (qe <= idx.h_end[pos]) & (idx.h_worker[pos] == tiles.q_home)
    kv_heads = bounds[g["a1"]] - bounds[g["a0"]]
    g.update(first=first, last=last, body=np.where(last > first + 1, s_l - offs[first + 1], 0),
             sf=s_f, nf=n_f, sl=s_l, e=qe, generic=g["qo"] + (qe - s_f) * per_token * kv_heads, free=free,
             j0=np.searchsorted(idx.h_start, s_f, side="right") - 1,
             j1=np.searchsorted(idx.h_start, n_f - 1, side="right"))
    return g


def _grouped_tiles(tiles, idx, wsorted, shape):
    """Per-tile inputs of :func:`_place_grouped` (from :func:`_grouped_columns`).

    Returns ``(rows, home, free, atom_bytes)`` as Python lists (the placement loop is scalar):
    ``rows[t]`` the tuple of :data:`_ROW`, ``home[t]`` the pool index of the Q-home, ``free[t]``
    whether the Q-home holds the tile's whole KV interval, ``atom_bytes[b]`` KV bytes per token of
    KV atom ``b``.
    """
    g = _grouped_columns(tiles, idx, wsorted, shape)
    n_atoms = len(g["atom_bytes"])
    first, last = g["first"], g["last"]
    cols = (first * n_atoms, np.where(last > first, last * n_atoms, -1), g["body"], g["a0"], g["a1"], g["qo"],
            g["sf"], g["nf"], g["sl"], g["e"], g["generic"])
    rows = list(zip(*(c.tolist() for c in cols), _held_ranges(idx, g)))
    return rows, g["home"].tolist(), g["free"].tolist(), g["atom_bytes"].tolist()


def _held_ranges(idx, g) -> list:
    """Per tile ``{pool worker: [(start, end), ...]}``: the holder ranges overlapping its first
    sample's prefix ``[sf, nf)`` (rows ``[j0, j1)`` of ``idx``; one shared dict per distinct set of
    ranges). Empty when the Q-home holds the whole KV interval (``free``): the Q-home is then the
    only holder. ``g``: :func:`_grouped_columns`."""
    j0, j1, free = g["j0"], g["j1"], g["free"]
    _, pick, inverse = np.unique(j0 * (len(idx.h_start) + 1) + j1, return_index=True, return_inverse=True)
    h_w = g["h_widx"].tolist()
    h_start, h_end = idx.h_start.tolist(), idx.h_end.tolist()
    maps = []
    for lo, hi in zip(j0[pick].tolist(), j1[pick].tolist()):
        held: dict[int, list] = {}
        for j in range(lo, hi):
            held.setdefault(h_w[j], []).append((h_start[j], h_end[j]))
        maps.append(held)
    return [_EMPTY if fr else maps[i] for fr, i in zip(free.tolist(), inverse.tolist())]


_ROW = ("gf", "gl", "body", "b0", "b1", "qo", "sf", "nf", "sl", "e", "generic", "held")
"""Fields of a tile's row in :func:`_grouped_tiles` (ints are global token positions or bytes):
``gf``, ``gl`` first / last sample times the number of KV atoms (KV-group keys; ``gl = -1`` when
the tile lies in one sample); ``body`` tokens of the samples wholly inside the block; ``[b0, b1)``
its KV atoms; ``qo`` its Q + O bytes; ``[sf, nf)`` the first sample's prefix it needs; ``sl`` the
last sample's start; ``e`` the tile's end; ``generic`` Q + O + all its KV bytes (the cost on a
worker that holds and fetched none of it); ``held`` :func:`_held_ranges`."""

# empty and read-only: stands in for a KV group a tile does not have (no body, no last sample) and
# for the holder map of a tile whose Q-home holds all its KV, so shared uses can never be written
_EMPTY = MappingProxyType({})


class _KVGroupState:
    """Running state of :func:`_place_grouped` for one pool (Libra sec. 4.3.2, Alg. 2).

    Attributes:
        cap: the soft target ``C``.
        loads: per pool worker, the load placed so far.
        heap: ``(load, worker)`` entries; stale ones (load grown since) are skipped lazily.
        fetched: the KV groups: per (sample, atom) key ``sample * A + atom`` ``{worker: prefix end
            fetched}``; per (block, atom) key ``-(first sample * A + atom) - 1`` the workers that
            fetched the block body (``{worker: True}``).
        atom_bytes: KV bytes per token of each KV atom.
        fallbacks: tiles placed so far by the least-loaded fallback.
    """

    __slots__ = ("cap", "loads", "heap", "fetched", "atom_bytes", "fallbacks")

    def __init__(self, loads, cap: float, atom_bytes: list):
        self.cap = cap
        self.loads = [float(x) for x in loads]
        self.heap = [(x, i) for i, x in enumerate(self.loads)]
        heapq.heapify(self.heap)
        self.fetched: dict[int, dict] = {}
        self.atom_bytes = atom_bytes
        self.fallbacks = 0

    def least_loaded(self) -> tuple[float, int]:
        """``(load, worker)`` of the least-loaded worker, lowest id on ties."""
        heap, loads = self.heap, self.loads
        while True:
            load, i = heap[0]
            if load == loads[i]:
                return load, i
            heapq.heappop(heap)  # stale entry: that worker's load has grown since

    def place(self, row, h: int, f: float, free: bool) -> int:
        """Destination of a tile its Q-home does not take outright; records what it fetches.

        Only the Q-home, holders of the first sample's prefix and workers that fetched part of the
        tile's KV groups (``special``) are scored; every other worker costs ``generic``, so of
        them only the least-loaded one competes. No candidate within ``C``: the least-loaded
        worker takes it (a fallback, counted).
        """
        gf, gl, body, b0, b1, _, sf, nf, _, e, generic, held = row
        # per KV atom: (KV bytes per token, first sample's group, block-body set, last sample's
        # group), created on first use; _EMPTY for a body or last sample the tile lacks
        new, ab = self.fetched.setdefault, self.atom_bytes
        if b1 - b0 == 1:  # the usual case, built without a comprehension (hot loop)
            groups = [(ab[b0], new(gf + b0, {}), new(-gf - b0 - 1, {}) if body else _EMPTY,
                       new(gl + b0, {}) if gl >= 0 else _EMPTY)]
        else:
            groups = [(ab[b], new(gf + b, {}), new(-gf - b - 1, {}) if body else _EMPTY,
                       new(gl + b, {}) if gl >= 0 else _EMPTY) for b in range(b0, b1)]
        special = set()
        for _, first, body_d, last in groups:
            special.update(first)
            special.update(body_d)
            special.update(last)
        if free and not special:
            # the Q-home is full and nobody else holds or fetched any of it: all others cost the same
            load, w = self.least_loaded()
            self.fallbacks += load + f > self.cap
        else:
            special.add(h)
            special.update(held)
            best = self.best_scored(special, groups, held, row, h, f)
            load, w = self.least_loaded()
            if load + f <= self.cap and (best is None or w not in special):
                key = (generic, load, w)  # every worker outside `special` costs the generic amount
                if best is None or key < best:
                    best = key
            if best is None:
                self.fallbacks += 1
            else:
                w = best[2]
        for _, first, body_d, last in groups:  # what w fetched now (or holds: harmless)
            if first.get(w, sf) < nf:
                first[w] = nf
            if body_d is not _EMPTY:
                body_d[w] = True
            if last is not _EMPTY and last.get(w, -1) < e:
                last[w] = e
        return w

    def best_scored(self, special, groups, held, row, h: int, f: float):
        """The least ``(cost, load, worker)`` over ``special`` workers that stay within ``C``
        (None if none does): the one place a worker's incremental communication is computed.

        Cost on ``w``: Q + O bytes unless ``w`` is the Q-home, plus per KV atom the KV bytes it
        lacks: the rows of the first sample's prefix ``[sf, nf)`` beyond what it fetched and does
        not hold (``held``), and, unless ``w`` is the Q-home (which holds the whole block), the
        block body if not fetched and the rows of the last sample's prefix ``[sl, e)`` beyond what
        it fetched.
        """
        _, gl, body, _, _, qo, sf, nf, sl, e, _, _ = row
        loads, cap = self.loads, self.cap
        best = None
        for w in special:
            lw = loads[w]
            if lw + f > cap:
                continue
            ranges = held.get(w, ())
            c = 0 if w == h else qo
            for ab, first_d, body_d, last_d in groups:
                x = first_d.get(w, sf)
                kv = nf - x if x < nf else 0
                if kv:
                    for lo, hi in ranges:
                        ov = (hi if hi < nf else nf) - (lo if lo > x else x)
                        if ov > 0:
                            kv -= ov
                if w != h:
                    if body and w not in body_d:
                        kv += body
                    if gl >= 0:
                        y = last_d.get(w, sl)
                        if y < e:
                            kv += e - y
                c += kv * ab
            # (c, lw, w) < best, spelled out so that no tuple is built per scored worker
            if best is None or c < best[0] or (
                    c == best[0] and (lw < best[1] or (lw == best[1] and w < best[2]))):
                best = (c, lw, w)
        return best
