"""The TAP Pipeliner (Libra sec. 3.3, 4.4): one object that the runtime executes and the simulator prices.

A :class:`ChunkSchedule` cuts every SH-tile's query heads into ``M`` equal contiguous chunks;
chunk ``m`` holds the ``m``-th head piece of every tile on a worker, so all chunks carry the same
FLOPs and kernel structure. It owns, for one pool plan:

* the query-head -> chunk map of each tile head range (tiles of different widths are fine: a
  range ``[a, b)`` of width ``w`` puts head ``h`` in chunk ``(h - a) // (w / M)``);
* the first and last chunk that reads each KV head: a KV head is *sent* (forward) with the first
  chunk whose query heads read it, and its gradient is *returned* (backward) after the last, so KV
  moves once per destination however ``M`` cuts a GQA group;
* the per-chunk bytes of every transfer in each of the four phases (:data:`PHASES`), as the
  runtime sends them (:meth:`ChunkSchedule.phase_routes`);
* the ordered events (:attr:`ChunkSchedule.events`) that the runtime's loop and the cost model's
  recurrence (:func:`libra.sim.cost.pipelined_end`) both iterate.

Event order. The runtime issues chunk ``m + 1``'s dispatch *before* it waits for chunk ``m``'s
(an earlier prefetch than the paper's listing, which issues it after the wait). On one FIFO comm
stream both orders put the same transfers in the same sequence, so the cost model prices them
alike; measured on 2 gloo CPU ranks (8 q / 2 kv heads, d = 64, M = 4, one 8K-token sample against
32 x 256, one process per core), forward + backward took 4.49 s with this order and 4.55 s with
the paper's (medians of 5).

Chunk ``m``'s return and chunk ``m + 2``'s dispatch are issued back to back (right after chunk
``m``'s compute), so they are one *exchange*: one ``batch_isend_irecv`` group, whose sends and
receives NCCL progresses concurrently (NCCL user guide, point-to-point: "calls within a group can be
seen as progressing independently"). They mostly run in opposite directions -- a Q-home sends the
next Q and receives outputs, a destination receives the next Q and sends outputs -- so the exchange
takes each port's summed bytes, not the return's time plus the dispatch's (an extension of Libra
sec. 4.4; the cost model prices the exchange from its bytes). The list is::

    issue_dispatch 0, issue_dispatch 1 (M > 1)
    for m in 0..M-1: wait_dispatch m, compute m,
                     issue_exchange m (return m + dispatch m+2) if m + 2 < M else issue_return m
    wait_return 0..M-1

``M = 1`` degenerates to dispatch, compute, return with nothing overlapped; ``M = 2`` has no
exchange.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from libra.arrays import pack_keys, row_ids, sorted_unique
from libra.plan import HEADS, KV, O, PlanValidationError, Q, TransferTable, schedule_class
from libra.workload import AttentionShape

FWD_DISPATCH, FWD_RETURN, BWD_DISPATCH, BWD_RETURN = "fwd_dispatch", "fwd_return", "bwd_dispatch", "bwd_return"
PHASES = (FWD_DISPATCH, FWD_RETURN, BWD_DISPATCH, BWD_RETURN)
"""The four communication phases of one layer's core attention (Libra sec. 4.3.3)."""

ISSUE_DISPATCH, WAIT_DISPATCH, COMPUTE, ISSUE_RETURN, ISSUE_EXCHANGE, WAIT_RETURN = (
    "issue_dispatch", "wait_dispatch", "compute", "issue_return", "issue_exchange", "wait_return")
EVENTS = (ISSUE_DISPATCH, WAIT_DISPATCH, COMPUTE, ISSUE_RETURN, ISSUE_EXCHANGE, WAIT_RETURN)
"""``(ISSUE_EXCHANGE, m)`` issues chunk ``m``'s return and chunk ``m + 2``'s dispatch as one group."""

# the transfer kinds of each phase; backward phases read TransferTable.backward() (dO along Q, dQ
# along O, dK/dV along the reversed KV fetches)
PHASE_KINDS = {FWD_DISPATCH: (Q, KV), FWD_RETURN: (O,), BWD_DISPATCH: (Q,), BWD_RETURN: (O, KV)}


def check_chunks(chunks) -> int:
    """``chunks`` as an int, or ValueError when it is not a positive integer."""
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise ValueError(f"Pipeliner chunks M must be a positive integer, got {chunks!r}")
    return int(chunks)


def pipeline_events(chunks: int) -> tuple[tuple[str, int], ...]:
    """The ordered Pipeliner events for ``chunks`` chunks (module docstring)."""
    M = check_chunks(chunks)
    events = [(ISSUE_DISPATCH, m) for m in range(min(M, 2))]
    for m in range(M):
        events += [(WAIT_DISPATCH, m), (COMPUTE, m), (ISSUE_EXCHANGE if m + 2 < M else ISSUE_RETURN, m)]
    return tuple(events + [(WAIT_RETURN, m) for m in range(M)])


class Routes(NamedTuple):
    """One phase's transfers: row ``i`` moves ``nbytes[i, m]`` from ``src[i]`` to ``dst[i]`` in chunk ``m``.

    ``row`` is the forward TransferTable row it comes from and ``kind`` that row's kind (``KV``
    rows of :data:`BWD_RETURN` carry dK/dV in the reverse direction).
    """

    row: np.ndarray
    kind: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray  # (X, M)


class ChunkSchedule:
    """The Pipeliner of one pool plan: built from the shape, the tiles' head ranges and ``M``.

    Args:
        shape: attention head geometry (GQA map).
        head_start, head_end: ``(T,)`` query-head range of every tile of the pool.
        chunks: ``M``; must divide every tile's head width.

    Raises:
        ValueError: ``M`` not a positive integer, or not dividing a tile's head width.
    """

    chunking = HEADS

    def __init__(self, shape: AttentionShape, head_start, head_end, chunks: int):
        self.shape, self.chunks = shape, check_chunks(chunks)
        self.events = pipeline_events(self.chunks)
        hs, he = np.asarray(head_start, np.int64).reshape(-1), np.asarray(head_end, np.int64).reshape(-1)
        ranges = _distinct_ranges(hs, he)
        self._check_widths(ranges[:, 1] - ranges[:, 0])
        self.kv_first, self.kv_last = self._kv_chunks(ranges)
        # per chunk, how many of the first k KV heads travel with it (forward) / return after it
        self._kv_cum = {backward: self._cumulative(owner) for backward, owner in
                        ((False, self.kv_first), (True, self.kv_last))}

    def _cumulative(self, owner: np.ndarray) -> np.ndarray:
        """``(hkv + 1, M)`` cumulative one-hot counts of the KV heads' chunks ``owner``."""
        cum = np.zeros((len(owner) + 1, self.chunks))
        cum[1:] = np.cumsum(np.eye(self.chunks)[owner], axis=0)
        return cum

    @classmethod
    def for_pool(cls, pool, shape: AttentionShape, chunks: int) -> ChunkSchedule:
        """The schedule of a :class:`~libra.plan.PoolPlan`'s tiles."""
        return cls(shape, pool.tiles.head_start, pool.tiles.head_end, chunks)

    def hop_heads(self) -> np.ndarray:
        """bool ``(hkv,)``: the KV heads whose fetch may take more than one hop under this schedule
        -- first read in chunk 0 and last read in chunk ``M - 1``, the two transfers the Pipeliner
        never hides, inside which the hop rounds run in order."""
        return (self.kv_first == 0) & (self.kv_last == self.chunks - 1)

    def check_hops(self, pool) -> None:
        """The runtime's and the cost model's rule for KV rows of hop > 0 (forwarded by a worker
        that received them in an earlier hop, :data:`libra.plan.TransferTable` ``hop``): every such
        row's KV heads are :meth:`hop_heads`.

        Raises:
            PlanValidationError: naming the pool and the first offending row.
        """
        x = pool.transfers
        rows = np.nonzero(x.hop > 0)[0]
        if not len(rows):
            return
        outside = np.concatenate(([0], np.cumsum(~self.hop_heads())))
        bad = rows[outside[x.head_end[rows]] != outside[x.head_start[rows]]]
        if len(bad):
            i = int(bad[0])
            raise PlanValidationError(
                f"pool {pool.pool_index}: KV relay transfer {i} (hop {int(x.hop[i])}) carries KV heads "
                f"[{x.head_start[i]}, {x.head_end[i]}) with M={self.chunks}, but only heads read from chunk 0 "
                f"through chunk {self.chunks - 1} may take more than one hop")

    def _check_widths(self, widths: np.ndarray) -> None:
        bad = widths[(widths < 1) | (widths % self.chunks != 0)]
        if len(bad):
            raise ValueError(f"Pipeliner chunks M={self.chunks} must divide every tile's head width "
                             f"(hq/H); a tile has {int(bad[0])} heads")

    def _kv_chunks(self, ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """First and last chunk whose query heads read each KV head (0 / M-1 where none does)."""
        hkv, M = self.shape.num_kv_heads, self.chunks
        first, last = np.full(hkv, M, np.int64), np.full(hkv, -1, np.int64)
        for a, b in ranges:
            for m, (c0, c1) in enumerate(self.head_chunks(a, b)):
                k0, k1 = self.shape.kv_head_range(c0, c1)
                first[k0:k1] = np.minimum(first[k0:k1], m)
                last[k0:k1] = np.maximum(last[k0:k1], m)
        return np.where(first == M, 0, first), np.where(last < 0, M - 1, last)

    # -- query heads ----------------------------------------------------------------------------
    def head_chunks(self, head_start: int, head_end: int) -> list[tuple[int, int]]:
        """The ``M`` contiguous query-head pieces ``[(a, b), ...]`` of one tile head range."""
        step = (int(head_end) - int(head_start)) // self.chunks
        return [(int(head_start) + m * step, int(head_start) + (m + 1) * step) for m in range(self.chunks)]

    def heads_per_call(self, widths) -> np.ndarray:
        """Query heads of each of a tile's ``M`` kernel calls (``width / M``); the kernel-time model
        prices a segment as ``M`` calls of this many heads."""
        widths = np.asarray(widths, dtype=np.int64)
        self._check_widths(widths.reshape(-1))
        return widths // self.chunks

    def segment_calls(self, seg: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per kernel segment (:func:`libra.plan.segments`): its chunk (-1: a slice in every chunk),
        query heads per kernel call and number of calls -- ``M`` calls of ``width / M`` heads."""
        n = len(seg["heads"])
        return (np.full(n, -1, np.int64), self.heads_per_call(seg["heads"]),
                np.full(n, self.chunks, np.int64))

    # -- transfers ------------------------------------------------------------------------------
    def transfer_pieces(self, kind: int, table: TransferTable, rows: np.ndarray, chunk: int,
                        backward: bool = False):
        """The pieces of ``table`` rows ``rows`` of ``kind`` that travel with ``chunk``: ``(i, h0,
        h1, t0, t1)`` int64 arrays, ``i`` indexing ``rows`` (:meth:`row_pieces`; whole token ranges)."""
        rows = np.asarray(rows, dtype=np.int64)
        i, h0, h1 = self.row_pieces(kind, table.head_start[rows], table.head_end[rows], chunk, backward)
        return i, h0, h1, table.tok_start[rows][i].astype(np.int64), table.tok_end[rows][i].astype(np.int64)

    def row_heads(self, kind: int, head_start: int, head_end: int, chunk: int, backward: bool = False) -> np.ndarray:
        """Heads of one transfer row that travel with ``chunk`` (query heads for Q/O, KV heads for KV).

        KV heads go forward with their first reading chunk and come back (dK/dV) with their last.
        """
        if kind == KV:
            heads = np.arange(head_start, head_end)
            owner = (self.kv_last if backward else self.kv_first)[heads]
            return heads[owner == chunk]
        a, b = self.head_chunks(head_start, head_end)[chunk]
        return np.arange(a, b)

    def row_pieces(self, kind: int, head_start, head_end, chunk: int, backward: bool = False):
        """Vectorised :meth:`row_heads`: the contiguous head pieces of many rows that travel with
        ``chunk``. Returns ``(row, h0, h1)`` int64 arrays (a row may give 0, 1 or several pieces),
        ordered by row, then head."""
        hs, he = np.asarray(head_start, np.int64), np.asarray(head_end, np.int64)
        if kind != KV:
            step = (he - hs) // self.chunks
            a = hs + chunk * step
            return np.arange(len(hs), dtype=np.int64), a, a + step
        width = he - hs
        row = np.repeat(np.arange(len(hs), dtype=np.int64), width)
        head = np.arange(int(width.sum()), dtype=np.int64) - np.repeat(np.cumsum(width) - width, width) + hs[row]
        owner = (self.kv_last if backward else self.kv_first)[head] if len(head) else head
        keep = owner == chunk
        row, head = row[keep], head[keep]
        if not len(row):
            return row, head, head.copy()
        start = np.ones(len(row), dtype=bool)
        start[1:] = (row[1:] != row[:-1]) | (head[1:] != head[:-1] + 1)
        first = np.nonzero(start)[0]
        last = np.append(first[1:], len(row)) - 1
        return row[first], head[first], head[last] + 1

    def _chunk_bytes(self, tr: TransferTable, rows: np.ndarray, backward: bool) -> np.ndarray:
        """``(len(rows), M)`` bytes of each row per chunk (:meth:`row_heads`' split, vectorised)."""
        M = self.chunks
        hs, he = tr.head_start[rows].astype(np.int64), tr.head_end[rows].astype(np.int64)
        nb = tr.nbytes[rows].astype(np.float64)[:, None]
        is_kv = tr.kind[rows] == KV
        if not is_kv.all():
            self._check_widths((he - hs)[~is_kv])
            if not is_kv.any():  # Q / O rows (phase_routes asks one kind at a time): 1/M per chunk
                return nb * np.full((1, M), 1.0 / M)
        if M == 1 and bool(np.all(he > hs)):  # one chunk carries every head: a share of exactly 1
            return nb
        # KV: heads per chunk from a cumulative one-hot count over the KV heads
        cum = self._kv_cum[bool(backward)]
        hkv = len(cum) - 1
        share = (cum[np.minimum(he, hkv)] - cum[np.minimum(hs, hkv)]) / np.maximum(he - hs, 1)[:, None]
        return nb * (share if is_kv.all() else np.where(is_kv[:, None], share, 1.0 / M))

    def phase_routes(self, transfers: TransferTable) -> dict[str, Routes]:
        """Every phase's transfers with their per-chunk bytes, as the runtime sends them."""
        return phase_routes(transfers, self.chunks, lambda table, rows, kind, backward:
                            self._chunk_bytes(table, rows, backward))


def schedule_for_pool(pool, shape: AttentionShape, chunks: int):
    """The Pipeliner of ``pool``: the schedule class registered for its ``chunking``
    (:func:`libra.plan.schedule_class`; the paper's :class:`ChunkSchedule` for ``"heads"``)."""
    return schedule_class(pool.chunking).for_pool(pool, shape, chunks)


def _distinct_ranges(head_start: np.ndarray, head_end: np.ndarray) -> np.ndarray:
    """``(R, 2)`` the distinct ``[head_start, head_end)`` pairs in lexicographic order (one sort of
    packed keys: a pool has thousands of tiles and a handful of head ranges)."""
    key = pack_keys([head_start, head_end])
    if key is None or not len(key):
        first, _ = row_ids([head_start, head_end])
        return np.stack([head_start[first], head_end[first]], axis=1)
    lo, span = int(head_end.min()), int(head_end.max()) - int(head_end.min()) + 1
    u = sorted_unique(key)
    return np.stack([u // span + int(head_start.min()), u % span + lo], axis=1)


def phase_routes(transfers: TransferTable, chunks: int, chunk_bytes) -> dict[str, Routes]:
    """Every phase's :class:`Routes` (:data:`PHASE_KINDS`; backward phases read
    :meth:`TransferTable.backward`), with ``chunk_bytes(table, rows, kind, backward)`` giving the
    ``(len(rows), chunks)`` bytes of a schedule's rows per chunk."""
    out, reverse = {}, transfers.backward()
    for phase, kinds in PHASE_KINDS.items():
        backward = phase in (BWD_DISPATCH, BWD_RETURN)
        table = reverse if backward else transfers
        pieces = []
        for kind in kinds:
            rows = np.nonzero(table.kind == kind)[0]
            pieces.append((rows, np.full(len(rows), kind, np.int8), table.src[rows].astype(np.int64),
                           table.dst[rows].astype(np.int64), chunk_bytes(table, rows, kind, backward)))
        out[phase] = Routes(*(np.concatenate([p[i] for p in pieces]) for i in range(4)),
                            np.concatenate([p[4] for p in pieces]).reshape(-1, chunks))
    return out
