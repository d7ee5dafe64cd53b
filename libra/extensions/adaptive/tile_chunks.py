"""Tile-grouped Pipeliner chunks: spread a worker's KV over the chunks (an extension of Libra
sec. 4.4 for fine SH-tiles, ``libra-adaptive``).

The paper's Pipeliner (:class:`libra.tap.pipeline.ChunkSchedule`, ``chunking="heads"``) cuts every
tile's query heads into ``M`` slices. A tile that reads one KV head (``libra-adaptive``'s fine
tiles) then needs its whole KV in chunk 0 and returns its whole dK/dV after chunk ``M - 1``: on real
corpora those two transfers were 77-87% of the straggler's exposed communication. With
``chunking="tiles"`` each tile runs whole (all its heads, one kernel call) in one chunk instead:

* **Which chunk** (:func:`assign_tile_chunks`): per destination worker, tiles are ordered and cut
  into ``M`` runs of equal forward FLOPs. *Local* tiles -- computed at their Q-home with every KV
  token they read held there too -- need no transfer in either direction, so half of them (by
  FLOPs) open the order (chunk 0's dispatch, which nothing hides) and half close it (chunk
  ``M - 1``'s return). The remote tiles sit between, by KV head, then sequence and position, so
  successive chunks read different KV heads and each sample's causal prefix grows chunk by chunk.
* **What travels when**: Q and dO go with their tile's chunk, O and dQ come back after it. A KV
  token goes with the *first* chunk that reads it at that destination and its dK/dV returns after
  the *last* one -- per token, so one de-duplicated KV row may travel in several pieces
  (:meth:`TileChunkSchedule.transfer_pieces`).

The assignment is a pure function of the pool plan (identical on every rank), and the object has
the interface of :class:`~libra.tap.pipeline.ChunkSchedule`, so the runtime executes and the cost
model prices the same pieces.
"""

from __future__ import annotations

import numpy as np

from libra.arrays import expand_counts, lexsort, row_ids, sorted_unique
from libra.plan import KV, PlanValidationError, Q, TransferTable, kv_need_start
from libra.tap.pipeline import (
    Routes,
    check_chunks,
    phase_routes,
    pipeline_events,
)
from libra.workload import AttentionShape

TILES = "tiles"
"""The chunking this module registers (``pyproject.toml``'s ``libra.chunkings`` entry points)."""


def _kv_local(pool) -> np.ndarray:
    """bool ``(T,)``: the tile's Q-home computes it and holds every KV token it reads."""
    tiles = pool.tiles
    out = tiles.dest == tiles.q_home
    start = np.zeros(len(tiles), dtype=np.int64)  # first token of the holder range of q_start
    for s, seq in enumerate(pool.sequences):
        sel = np.nonzero(tiles.seq == s)[0]
        if len(sel):
            order = np.argsort(seq.holder_start, kind="stable")
            pos = np.searchsorted(seq.holder_start[order], tiles.q_start[sel], side="right") - 1
            start[sel] = seq.holder_start[order][np.maximum(pos, 0)]
    return out & (kv_need_start(pool.sequences, tiles, pool.index()) >= start)


def assign_tile_chunks(pool, shape: AttentionShape, chunks: int) -> np.ndarray:
    """The chunk of every tile of ``pool`` (int64 ``(T,)``; module docstring for the rule).

    Per destination, the tiles are ordered (local first half, remote, local second half; remote by
    KV head, sequence, position, query heads) and chunk ``m`` takes the tiles whose FLOPs midpoint
    lies in the ``m``-th ``1/M`` of the destination's FLOPs.
    """
    M, tiles = check_chunks(chunks), pool.tiles
    n = len(tiles)
    if n == 0 or M == 1:
        return np.zeros(n, dtype=np.int64)
    flops = np.maximum(tiles.flops.astype(np.float64), 1.0)  # an empty tile still gets a chunk
    dest, local = tiles.dest.astype(np.int64), _kv_local(pool)
    k0, _ = shape.kv_head_range(tiles.head_start, tiles.head_end)
    # local tiles: first half (by FLOPs, in position order) -> front, the rest -> back
    lorder = lexsort((tiles.head_start, tiles.q_start, tiles.seq, ~local, dest))
    lf = np.where(local[lorder], flops[lorder], 0.0)
    before, total = _position_in_run(dest[lorder], lf)
    front = np.zeros(n, dtype=bool)
    front[lorder] = (before + lf / 2) <= total / 2
    part = np.where(local, np.where(front, 0, 2), 1)
    order = lexsort((tiles.head_start, tiles.q_start, tiles.seq, np.where(part == 1, k0, 0), part, dest))
    f = flops[order]
    before, total = _position_in_run(dest[order], f)
    out = np.empty(n, dtype=np.int64)
    out[order] = np.minimum((M * (before + f / 2) / total).astype(np.int64), M - 1)
    return out


def _position_in_run(key: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``weight`` in runs of equal (sorted) ``key``: the weight before each element in its run,
    and its run's total."""
    starts = np.nonzero(np.r_[True, key[1:] != key[:-1]])[0]
    runs = np.diff(np.r_[starts, len(key)])
    csum = np.cumsum(weight)
    before = csum - weight - np.repeat(csum[starts] - weight[starts], runs)
    return before, np.repeat(np.add.reduceat(weight, starts), runs)


# --------------------------------------------------------------------------------------------
# interval algebra on one token axis per group (packed int64 keys: group * span + token)
# --------------------------------------------------------------------------------------------


def _step_function(gid, start, end, value, M: int, last: bool):
    """Per group, the union of ``[start, end)`` cut where the min (``last``: max) ``value`` of the
    intervals covering a token changes. Returns ``(gid, start, end, value)`` sorted by group, start."""
    span = int(end.max()) + 1
    pts = sorted_unique(np.concatenate([gid * span + start, gid * span + end]))
    lo, hi = np.searchsorted(pts, gid * span + start), np.searchsorted(pts, gid * span + end)
    # (M, points) how many intervals of each value cover each elementary segment: one bincount
    # each way over (value, point) bins, one cumsum along the points
    n = len(pts) + 1
    count = np.bincount(value * n + lo, minlength=M * n) - np.bincount(value * n + hi, minlength=M * n)
    covered = np.cumsum(count.reshape(M, n), axis=1)[:, :-1] > 0
    pick = covered[::-1].argmax(axis=0) if last else covered.argmax(axis=0)  # first True: max / min value
    best = np.where(covered.any(axis=0), (M - 1 - pick) if last else pick, -1)
    seg = np.nonzero(best[:-1] >= 0)[0]  # elementary segment i = [pts[i], pts[i+1])
    seg = seg[pts[seg] // span == pts[seg + 1] // span]
    g, s, e, v = pts[seg] // span, pts[seg] % span, pts[seg + 1] - (pts[seg] // span) * span, best[seg]
    # merge touching segments of one group with one value
    new = np.r_[True, (g[1:] != g[:-1]) | (v[1:] != v[:-1]) | (s[1:] != e[:-1])]
    first = np.nonzero(new)[0]
    last_i = np.r_[first[1:], len(g)] - 1
    return g[first], s[first], e[last_i], v[first]


def _split_rows(row_gid, row_start, row_end, gid, start, end, value):
    """Cut every row ``[row_start, row_end)`` of group ``row_gid`` by disjoint pieces ``(gid, start,
    end, value)`` sorted by group and start. Returns ``(row, start, end, value)`` of the overlaps."""
    if not len(row_gid) or not len(gid):
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    span = int(max(end.max(), row_end.max())) + 1
    ps, pe = gid * span + start, gid * span + end
    lo = np.searchsorted(pe, row_gid * span + row_start, side="right")
    hi = np.searchsorted(ps, row_gid * span + row_end, side="left")
    row, k = expand_counts(np.maximum(hi - lo, 0))
    j = lo[row] + k
    s, e = np.maximum(row_start[row], start[j]), np.minimum(row_end[row], end[j])
    keep = e > s
    return row[keep], s[keep], e[keep], value[j][keep]


def _group_ids(*keys) -> tuple[np.ndarray, ...]:
    """Dense ids of equal key tuples across several ``(n_i, k)`` int key arrays (same id = same key)."""
    allk = np.concatenate(keys, axis=0)
    _, ids = row_ids(list(allk.T))
    return tuple(np.split(ids, np.cumsum([len(k) for k in keys])[:-1]))


class TileChunkSchedule:
    """The Pipeliner of one pool plan with ``chunking="tiles"`` (module docstring).

    Same interface as :class:`~libra.tap.pipeline.ChunkSchedule`: ``chunks``, ``events``,
    :meth:`segment_calls`, :meth:`transfer_pieces` and :meth:`phase_routes`.
    """

    chunking = TILES

    def __init__(self, pool, shape: AttentionShape, chunks: int):
        self.shape, self.chunks = shape, check_chunks(chunks)
        self.events = pipeline_events(self.chunks)
        self.tile_chunk = assign_tile_chunks(pool, shape, self.chunks)
        self._pool, self._cache = pool, {}

    @classmethod
    def for_pool(cls, pool, shape: AttentionShape, chunks: int) -> TileChunkSchedule:
        """The schedule of a pool plan (the registry's constructor, :mod:`libra.plan.chunkings`)."""
        return cls(pool, shape, chunks)

    def check_hops(self, pool) -> None:
        """Tile-grouped chunks spread each destination's KV over its chunks, so no KV row may take
        more than one hop (:meth:`libra.tap.pipeline.ChunkSchedule.check_hops`).

        Raises:
            PlanValidationError: a row of hop > 0.
        """
        if len(pool.transfers) and pool.transfers.hop.any():
            raise PlanValidationError(f"pool {pool.pool_index}: KV relay rows need the Pipeliner's head chunks, "
                                      f"the pool runs {self.chunking!r}")

    def segment_calls(self, seg: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per kernel segment: its chunk, query heads per call and calls -- one whole-width call
        in its tile's chunk."""
        return self.tile_chunk[seg["tile"]], np.asarray(seg["heads"], np.int64), np.ones(len(seg["tile"]), np.int64)

    def _pieces_all(self, kind: int, backward: bool):
        """Every row of the pool's forward transfer table cut into ``(row, h0, h1, t0, t1, chunk)``."""
        key = (kind, bool(backward) and kind == KV)
        got = self._cache.get(key)
        if got is not None:
            return got
        tr, tiles = self._pool.transfers, self._pool.tiles
        rows = np.nonzero(tr.kind == kind)[0]
        if kind == KV:
            got = self._kv_pieces(tr, rows, backward)
        else:
            # Q: q_home -> dest; O: dest -> q_home; a row is a union of whole tiles with its heads
            src, dst = (tiles.q_home, tiles.dest) if kind == Q else (tiles.dest, tiles.q_home)
            cols = (tiles.seq, tiles.head_start, tiles.head_end)
            rk = np.stack([tr.src[rows], tr.dst[rows], tr.seq[rows], tr.head_start[rows], tr.head_end[rows]], 1)
            tk = np.stack([src, dst, *cols], 1)
            rg, tg = _group_ids(rk.astype(np.int64), tk.astype(np.int64))
            order = lexsort((tiles.q_start, tg))
            r, s, e, v = _split_rows(rg, tr.tok_start[rows].astype(np.int64), tr.tok_end[rows].astype(np.int64),
                                     tg[order], tiles.q_start[order].astype(np.int64),
                                     tiles.q_end[order].astype(np.int64), self.tile_chunk[order])
            got = (rows[r], tr.head_start[rows][r].astype(np.int64), tr.head_end[rows][r].astype(np.int64), s, e, v)
        self._cache[key] = got
        return got

    def _kv_pieces(self, tr: TransferTable, rows: np.ndarray, backward: bool):
        """KV rows cut per KV head and token: with the first chunk that reads the token at the row's
        destination (``backward``: the last one, for dK/dV)."""
        groups = self._cache.get("kv-groups")
        if groups is None:  # what both directions share: one row per (tile, KV head) and (row, KV head)
            groups = self._cache["kv-groups"] = self._kv_groups(tr, rows)
        rix, rhead, rg, tg, tix, need_start = groups
        if not len(tix):
            z = np.zeros(0, dtype=np.int64)
            return z, z, z, z, z, z
        g, s, e, v = _step_function(tg, need_start, self._pool.tiles.q_end[tix].astype(np.int64),
                                    self.tile_chunk[tix], self.chunks, last=backward)
        r, ts, te, c = _split_rows(rg, tr.tok_start[rows][rix].astype(np.int64),
                                   tr.tok_end[rows][rix].astype(np.int64), g, s, e, v)
        return rows[rix][r], rhead[r], rhead[r] + 1, ts, te, c

    def _kv_groups(self, tr: TransferTable, rows: np.ndarray):
        """``(rix, rhead, rg, tg, tix, need_start)``: KV rows ``rows`` expanded per KV head (``rix``
        indexes ``rows``) and the tiles per KV head (``tix``, with the first KV token each reads),
        with dense ids of their (destination, sequence, KV head) groups (``rg``, ``tg``)."""
        pool, tiles = self._pool, self._pool.tiles
        k0, k1 = self.shape.kv_head_range(tiles.head_start, tiles.head_end)
        tix, head = expand_counts(k1 - k0)  # one row per (tile, KV head) and (transfer row, KV head)
        head += k0[tix]
        need_start = kv_need_start(pool.sequences, tiles, pool.index())
        rix, rhead = expand_counts(tr.head_end[rows] - tr.head_start[rows])
        rhead += tr.head_start[rows][rix]
        rg, tg = _group_ids(np.stack([tr.dst[rows][rix], tr.seq[rows][rix], rhead], 1).astype(np.int64),
                            np.stack([tiles.dest[tix], tiles.seq[tix], head], 1).astype(np.int64))
        return rix, rhead, rg, tg, tix, need_start[tix]

    def transfer_pieces(self, kind: int, table: TransferTable, rows: np.ndarray, chunk: int,
                        backward: bool = False):
        """The pieces of forward-table rows ``rows`` (sorted) of ``kind`` that travel with ``chunk``:
        ``(i, h0, h1, t0, t1)`` int64 arrays, ``i`` indexing ``rows``; ordered by row, head, token."""
        if table is not self._pool.transfers:
            raise ValueError("a tile-chunked schedule cuts only its own pool's transfer table")
        row, h0, h1, t0, t1, c = self._pieces_all(kind, backward)
        rows = np.asarray(rows, dtype=np.int64)
        pos = np.searchsorted(rows, row)
        hit = (c == chunk) & (pos < len(rows))
        hit[hit] = rows[pos[hit]] == row[hit]
        i, h0, h1, t0, t1 = pos[hit], h0[hit], h1[hit], t0[hit], t1[hit]
        order = lexsort((t0, h0, i))
        return i[order], h0[order], h1[order], t0[order], t1[order]

    def phase_routes(self, transfers: TransferTable) -> dict[str, Routes]:
        """Every phase's transfers with their per-chunk bytes (a row's bytes split by the share of
        its token x head area that travels in each chunk)."""
        return phase_routes(transfers, self.chunks, self._chunk_bytes)

    def _chunk_bytes(self, table: TransferTable, rows: np.ndarray, kind: int, backward: bool) -> np.ndarray:
        """``(len(rows), M)`` bytes of rows ``rows`` (all of ``kind``) per chunk."""
        row, h0, h1, t0, t1, c = self._pieces_all(kind, backward)
        area = (table.tok_end[row] - table.tok_start[row]).astype(np.float64) * (table.head_end[row] - table.head_start[row])
        # one bincount over (row, chunk) bins: each bin sums its pieces in order, as np.add.at would
        share = np.bincount(row * self.chunks + c, weights=(t1 - t0) * (h1 - h0) / np.maximum(area, 1.0),
                            minlength=len(table) * self.chunks).reshape(len(table), self.chunks)
        return table.nbytes[rows].astype(np.float64)[:, None] * share[rows]
