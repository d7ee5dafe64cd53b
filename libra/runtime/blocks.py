"""Block copies: the unit a compiled worker program is made of (numpy only).

Every runtime buffer is a 2-D tensor of rows of width ``d`` (one row = one token of one head). A
*rectangle* of a buffer is ``n`` tokens x ``nh`` heads of a region whose rows are token-major with
``stride`` heads per token: rows ``[off, off + n * stride)`` viewed as ``(n, stride, d)``, heads
``[h0, h0 + nh)``. A local q of ``T`` tokens is one region (``off = t * hq``, ``stride = hq``); a
received piece of ``n`` tokens x ``nh`` heads is one region of its own (``stride = nh``). A
:class:`Blocks` table lists rectangle copies from named source buffers into one target, so the
runtime moves a whole tile piece with one strided copy and builds no index arrays.

:func:`resolve` is how a program is compiled: each *request* (a token x head rectangle of one
sequence that some target needs) is cut against the *sources* that hold parts of it (local
holdings, received pieces, kernel outputs), giving the blocks and, per request, how much was found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from libra.arrays import lexsort


class BufKey(NamedTuple):
    """A runtime buffer: a local tensor (``chunk = -1``) or one Pipeliner chunk's buffer."""

    kind: str
    chunk: int = -1


# local tensors of the worker (pre-attention layout)
Q, K, V, DO = BufKey("q"), BufKey("k"), BufKey("v"), BufKey("do")
OUT, DQ, DK, DV = BufKey("out"), BufKey("dq"), BufKey("dk"), BufKey("dv")


def recv_key(chunk: int) -> BufKey:
    """The chunk's forward-dispatch receive buffer (Q and KV pieces; kept for backward)."""
    return BufKey("recv", chunk)


def grad_recv_key(chunk: int) -> BufKey:
    """Gradient accumulator of :func:`recv_key` (dK/dV of fetched KV, sent home in backward)."""
    return BufKey("grad_recv", chunk)


def relay_key(hop: int) -> BufKey:
    """Receive buffer of KV relay round ``hop >= 1`` (chunk 0's dispatch; KV rows of that hop)."""
    return BufKey("relay", hop)


def relay_grad_key(hop: int) -> BufKey:
    """Gradient accumulator of :func:`relay_key` (its children's dK/dV are added here too)."""
    return BufKey("grad_relay", hop)


def do_recv_key(chunk: int) -> BufKey:
    """The chunk's backward-dispatch receive buffer (dO pieces)."""
    return BufKey("do_recv", chunk)


def kout_key(chunk: int) -> BufKey:
    """The chunk's kernel output ``(total_q * qh, d)``; in backward, its kernel dQ."""
    return BufKey("kout", chunk)


# columns of a block table
KEY, SRC_OFF, SRC_STRIDE, SRC_H0, DST_OFF, DST_STRIDE, DST_H0, N_TOK, N_HEADS = range(9)


@dataclass
class Blocks:
    """Rectangle copies into one target: row ``i`` copies ``table[i, N_TOK] x table[i, N_HEADS]``
    from buffer ``keys[table[i, KEY]]`` (``SRC_*``) to the target (``DST_*``)."""

    keys: tuple[BufKey, ...]
    table: np.ndarray

    @classmethod
    def empty(cls) -> Blocks:
        return cls((), np.zeros((0, 9), dtype=np.int64))

    def __len__(self) -> int:
        return len(self.table)

    def rows(self) -> list[list[int]]:
        """The table as Python ints, consecutive blocks that continue one another in both source
        and target merged (:func:`merge_rows`): what the runtime loops over; built once, cached."""
        got = self.__dict__.get("_rows")
        if got is None:
            got = merge_rows(self.table).tolist()
            self.__dict__["_rows"] = got
        return got

    def as_view(self) -> list[int] | None:
        """The one block (a row of :meth:`rows`) when the whole table is a single rectangle copied
        to the start of a packed target (``dst`` offset 0, head 0, stride = its heads): the target
        is then just a strided view of the source and need not be built (a kernel input read from one
        local tensor is not gathered). None otherwise."""
        rows = self.rows()
        if len(rows) != 1:
            return None
        r = rows[0]
        return r if r[DST_OFF] == 0 and r[DST_H0] == 0 and r[DST_STRIDE] == r[N_HEADS] else None

    def select(self, mask) -> Blocks:
        return Blocks(self.keys, self.table[mask])

    def rekey(self, mapping: dict) -> Blocks:
        """The same copies with source buffers renamed (``mapping``: old key -> new key)."""
        return Blocks(tuple(mapping.get(k, k) for k in self.keys), self.table)

    def sources(self) -> list[BufKey]:
        """The key of every block (row order)."""
        return [self.keys[i] for i in self.table[:, KEY].tolist()]

    @staticmethod
    def concat(parts: list[Blocks]) -> Blocks:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Blocks.empty()
        keys = tuple(dict.fromkeys(k for p in parts for k in p.keys))
        tables = []
        for p in parts:
            t = p.table.copy()
            t[:, KEY] = np.array([keys.index(k) for k in p.keys], dtype=np.int64)[p.table[:, KEY]]
            tables.append(t)
        return Blocks(keys, np.concatenate(tables))


def merge_rows(table: np.ndarray) -> np.ndarray:
    """Merge each block into its predecessor when it continues it: same source buffer, strides,
    heads and head offsets, and its first token follows the predecessor's last one in both the
    source and the target (e.g. a kernel input's per-sample blocks read from one local tensor).
    The copies are the same; there are fewer of them."""
    if len(table) < 2:
        return table
    t = table
    same = np.all(t[1:][:, [KEY, SRC_STRIDE, SRC_H0, DST_STRIDE, DST_H0, N_HEADS]]
                  == t[:-1][:, [KEY, SRC_STRIDE, SRC_H0, DST_STRIDE, DST_H0, N_HEADS]], axis=1)
    follows = ((t[1:, SRC_OFF] == t[:-1, SRC_OFF] + t[:-1, N_TOK] * t[:-1, SRC_STRIDE])
               & (t[1:, DST_OFF] == t[:-1, DST_OFF] + t[:-1, N_TOK] * t[:-1, DST_STRIDE]))
    start = np.ones(len(t), dtype=bool)
    start[1:] = ~(same & follows)
    first = np.nonzero(start)[0]
    out = t[first].copy()
    out[:, N_TOK] = np.add.reduceat(t[:, N_TOK], first)
    return out


def covers_once(t0: np.ndarray, t1: np.ndarray, h0: np.ndarray, h1: np.ndarray, n_tok: int, heads: int) -> bool:
    """Whether token x head rectangles ``[t0, t1) x [h0, h1)`` cover an ``n_tok`` x ``heads`` grid
    exactly once: their areas add up to it and no two overlap (sorted by first token, a rectangle
    can only overlap those starting before it ends)."""
    if int(np.sum((t1 - t0) * (h1 - h0))) != n_tok * heads:
        return False
    order = np.argsort(t0, kind="stable")
    t0, t1, h0, h1 = t0[order], t1[order], h0[order], h1[order]
    reach = np.searchsorted(t0, t1, side="left")
    return not any(np.any((h0[i + 1:reach[i]] < h1[i]) & (h1[i + 1:reach[i]] > h0[i]))
                   for i in range(len(t0)) if reach[i] > i + 1)


class Rects(NamedTuple):
    """Token x head rectangles of pool sequences, with where each lives (struct of arrays).

    For a *source*: ``key`` indexes ``keys`` and ``(off, stride, h_base)`` place token ``t0`` /
    head ``h0`` of the rectangle in that buffer (head ``h`` sits at column ``h - h_base``).
    For a *request*: ``(off, stride, h_base)`` place it in the target the same way.
    """

    seq: np.ndarray
    t0: np.ndarray
    t1: np.ndarray
    h0: np.ndarray
    h1: np.ndarray
    key: np.ndarray
    off: np.ndarray
    stride: np.ndarray
    h_base: np.ndarray

    @staticmethod
    def make(seq, t0, t1, h0, h1, at: tuple) -> Rects:
        """Rectangles ``[t0, t1) x [h0, h1)`` of sequences ``seq``, living ``at`` ``(key, off, stride)``
        or ``(key, off, stride, h_base)`` (``h_base`` defaults to ``h0``); a scalar column is
        broadcast to every rectangle."""
        key, off, stride, h_base = (*at, h0) if len(at) == 3 else at
        n = len(seq)
        return Rects(*(np.asarray(c, dtype=np.int64) if np.ndim(c) else np.full(n, c, dtype=np.int64)
                       for c in (seq, t0, t1, h0, h1, key, off, stride, h_base)))

    @staticmethod
    def concat(parts: list[Rects]) -> Rects:
        return Rects(*(np.concatenate([p[i] for p in parts]) if parts else np.zeros(0, np.int64)
                       for i in range(9)))

    @property
    def size(self) -> int:
        """Number of rectangles (``len()`` of a NamedTuple is its field count)."""
        return len(self.seq)

    def area(self) -> np.ndarray:
        return (self.t1 - self.t0) * (self.h1 - self.h0)


def resolve(req: Rects, src: Rects, keys: tuple[BufKey, ...]) -> tuple[Blocks, np.ndarray]:
    """Cut every request against the sources that overlap it.

    Returns the blocks (source rectangle -> request's place in the target, in request order, then
    source order) and, per request, the area found (``== req.area()`` when exactly covered; less
    where something is missing, more where sources overlap).
    """
    if not req.size or not src.size:
        return Blocks(keys, np.zeros((0, 9), dtype=np.int64)), np.zeros(req.size, dtype=np.int64)
    hit = ((req.seq[:, None] == src.seq[None, :]) & (req.t0[:, None] < src.t1[None, :])
           & (req.t1[:, None] > src.t0[None, :]) & (req.h0[:, None] < src.h1[None, :])
           & (req.h1[:, None] > src.h0[None, :]))
    r, s = np.nonzero(hit)
    t0 = np.maximum(req.t0[r], src.t0[s])
    t1 = np.minimum(req.t1[r], src.t1[s])
    h0 = np.maximum(req.h0[r], src.h0[s])
    h1 = np.minimum(req.h1[r], src.h1[s])
    table = np.stack([src.key[s],
                      src.off[s] + (t0 - src.t0[s]) * src.stride[s], src.stride[s], h0 - src.h_base[s],
                      req.off[r] + (t0 - req.t0[r]) * req.stride[r], req.stride[r], h0 - req.h_base[r],
                      t1 - t0, h1 - h0], axis=1).astype(np.int64)
    found = np.bincount(r, weights=(t1 - t0) * (h1 - h0), minlength=req.size).astype(np.int64)
    return Blocks(keys, table), found


def first_missing(req: Rects, i: int, src: Rects) -> tuple[int, int]:
    """A (token, head) of request ``i`` that no source holds (for error messages only)."""
    mine = (src.seq == req.seq[i]) & (src.t0 < req.t1[i]) & (src.t1 > req.t0[i]) \
        & (src.h0 < req.h1[i]) & (src.h1 > req.h0[i])
    for h in range(int(req.h0[i]), int(req.h1[i])):
        cols = mine & (src.h0 <= h) & (src.h1 > h)
        covered = np.zeros(int(req.t1[i] - req.t0[i]), dtype=np.int64)
        for a, b in zip(np.maximum(src.t0[cols], req.t0[i]), np.minimum(src.t1[cols], req.t1[i])):
            covered[a - req.t0[i]:b - req.t0[i]] += 1
        gap = np.nonzero(covered == 0)[0]
        if len(gap):
            return int(req.t0[i] + gap[0]), h
    return int(req.t0[i]), int(req.h0[i])


def layout(peer: np.ndarray, group: np.ndarray, rows: np.ndarray, size: np.ndarray, n_peers: int):
    """Offsets of pieces in one flat buffer ordered by peer, then group, then input order.

    Returns ``(offset per piece, rows per peer)``.
    """
    order = lexsort((np.arange(len(peer)), rows, group, peer))
    off = np.zeros(len(peer), dtype=np.int64)
    off[order] = np.cumsum(size[order]) - size[order]
    return off, np.bincount(peer, weights=size, minlength=n_peers).astype(np.int64)
