"""Compile one worker's share of a PoolPlan into block copies (numpy only, no communication).

A :class:`WorkerProgram` says, for the calling worker and each Pipeliner chunk, which rectangles
(:mod:`libra.runtime.blocks`) to copy into each outgoing message, where each incoming piece lands,
and how to assemble the varlen kernel inputs (Libra sec. 4.3.3, 4.4). The sender and the receiver
lay a message out the same way from the same TransferTable (peers in pool-rank order, then the
phase's transfer kinds, then table order), which is why the pool's ranks agree on the plan digest
first. The TransferTable is executed literally; the pool's :class:`~libra.tap.pipeline.ChunkSchedule`
(the object the cost model prices) says which heads of each transfer travel with which chunk.

Compilation checks the plan against the data flow it implies and raises
:class:`~libra.plan.PlanValidationError` when a tile's Q or KV is not delivered (or delivered
twice), an output row is returned twice or never (dropped or duplicated tiles), or a transfer's
source does not hold its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from libra.plan import KV, O, PlanValidationError, PoolPlan, Q
from libra.runtime.blocks import (
    DK,
    DO,
    DQ,
    DV,
    N_HEADS,
    N_TOK,
    OUT,
    Blocks,
    BufKey,
    Rects,
    covers_once,
    do_recv_key,
    first_missing,
    grad_recv_key,
    kout_key,
    layout,
    recv_key,
    relay_grad_key,
    relay_key,
    resolve,
)
from libra.runtime.blocks import K as LK
from libra.runtime.blocks import Q as LQ
from libra.runtime.blocks import V as LV
from libra.tap.pipeline import (
    BWD_DISPATCH,
    BWD_RETURN,
    FWD_DISPATCH,
    FWD_RETURN,
    PHASES,
    ChunkSchedule,
    schedule_for_pool,
)
from libra.workload import AttentionShape, causal_area


@dataclass
class Message:
    """One phase x chunk at this worker: what to send to / expect from every pool rank.

    ``send_rows[r]``/``recv_rows[r]``: rows exchanged with pool rank ``r`` (0 for self and
    non-peers); the flat send/recv buffers hold peers in pool-rank order. ``pack`` fills the send
    buffer from this worker's buffers; ``unpack`` (returns only) copies the receive buffer into
    local tensors and ``unpack_add`` adds into them (dK/dV), each block read in reverse (target
    rectangle -> source buffer).
    """

    send_rows: np.ndarray
    recv_rows: np.ndarray
    pack: Blocks = field(default_factory=Blocks.empty)
    unpack: Blocks = field(default_factory=Blocks.empty)
    unpack_add: Blocks = field(default_factory=Blocks.empty)

    @property
    def n_send(self) -> int:
        return int(self.send_rows.sum())

    @property
    def n_recv(self) -> int:
        return int(self.recv_rows.sum())


@dataclass
class ChunkKernel:
    """Kernel work of one Pipeliner chunk at this worker (tile pieces; adjacent blocks merged).

    ``q_pack``/``k_pack``/``v_pack``/``do_pack`` fill the packed kernel inputs ``(total_q, qh, d)``
    / ``(total_k, kvh, d)``; ``out_local`` are the ``q_pack`` blocks read from this worker's own Q:
    their outputs (and dQ) go straight to the local tensors.
    """

    q_lens: np.ndarray
    kv_lens: np.ndarray
    qh: int
    kvh: int
    q_pack: Blocks
    k_pack: Blocks
    v_pack: Blocks
    do_pack: Blocks
    out_local: Blocks
    flops: float = 0.0

    @property
    def total_q(self) -> int:
        return int(self.q_lens.sum())

    @property
    def total_k(self) -> int:
        return int(self.kv_lens.sum())


@dataclass
class WorkerProgram:
    """Everything one worker executes for one PoolPlan (compiled by :func:`compile_worker`).

    Attributes:
        worker, pool_rank: the worker and its rank in ``workers``.
        workers: pool workers in pool-rank order.
        shape: head geometry; ``num_local``: tokens this worker holds (rows of its q/k/v).
        chunks: Pipeliner chunks ``M``; ``schedule``: the pool's :class:`ChunkSchedule`.
        kernels: ``M`` :class:`ChunkKernel`.
        messages: ``{phase: [Message] * M}``.
        relays: KV hop rounds (rows of ``TransferTable.hop > 0``): ``{FWD_DISPATCH: [hop 1, ..., H]}``, run
            in order right after chunk 0's dispatch, and ``{BWD_RETURN: [hop H, ..., 1]}``, run
            before chunk ``M - 1``'s return; empty lists when the pool relays nothing.
        digest: the plan digest the program was compiled from.
        local_ranges: ``(sequence index, start, end)`` token ranges this worker holds, in the order
            its q/k/v rows concatenate them.
    """

    worker: int
    pool_rank: int
    workers: tuple[int, ...]
    shape: AttentionShape
    num_local: int
    chunks: int
    kernels: list[ChunkKernel]
    messages: dict[str, list[Message]]
    digest: str
    schedule: ChunkSchedule
    local_ranges: list[tuple[int, int, int]] = field(default_factory=list)
    relays: dict[str, list[Message]] = field(default_factory=lambda: {FWD_DISPATCH: [], BWD_RETURN: []})

    @property
    def hops(self) -> int:
        """Relay rounds after hop 0 (``H``; 0 without relays)."""
        return len(self.relays[FWD_DISPATCH])

    def phase_messages(self, phase: str) -> list[Message]:
        """Every exchange of ``phase`` at this worker: its ``M`` chunks' and its relay rounds'."""
        return self.messages[phase] + self.relays.get(phase, [])

    def all_messages(self) -> list[Message]:
        """Every exchange of every phase (what closed-call and dK/dV-copy decisions must see)."""
        return [msg for p in PHASES for msg in self.phase_messages(p)]

    def comm_rows(self) -> dict[str, int]:
        """Rows sent by this worker per phase (bytes = rows * d * element size), relays included."""
        return {p: sum(m.n_send for m in self.phase_messages(p)) for p in PHASES}


# --------------------------------------------------------------------------------------------
# compilation context: the worker's holdings and transfer pieces
# --------------------------------------------------------------------------------------------


class _Context:
    """What every compilation step reads: the pool, this worker's holdings, the schedule."""

    def __init__(self, pool: PoolPlan, shape: AttentionShape, worker: int, chunks: int):
        if worker not in pool.workers:
            raise ValueError(f"worker {worker} is not in pool {pool.pool_index} (workers {list(pool.workers)})")
        self.sched = schedule_for_pool(pool, shape, chunks)
        self.pool, self.shape, self.me, self.M = pool, shape, int(worker), self.sched.chunks
        self.rank_of = {w: i for i, w in enumerate(pool.workers)}
        t = pool.tiles
        bad = np.nonzero((t.head_end > shape.num_q_heads) | (t.head_start < 0) | (t.head_end <= t.head_start))[0]
        if len(bad):
            raise self.fail(f"tile {int(bad[0])} has head range outside [0, {shape.num_q_heads})")
        ranges = sorted((s, int(a), int(b)) for s, seq in enumerate(pool.sequences)
                        for a, b, w in zip(seq.holder_start, seq.holder_end, seq.holder_worker)
                        if int(w) == self.me and b > a)
        self.ranges = ranges
        lens = np.array([b - a for _, a, b in ranges], dtype=np.int64)
        self.local_off = np.cumsum(lens) - lens
        self.num_local = int(lens.sum())
        self._local: dict = {}
        self.H = int(pool.transfers.hop.max()) if len(pool.transfers) else 0
        if self.H:
            self.sched.check_hops(pool)
        self.keys = _keys(self.M, self.H)
        self.index = {k: i for i, k in enumerate(self.keys)}

    def fail(self, what: str) -> PlanValidationError:
        return PlanValidationError(f"pool {self.pool.pool_index}, worker {self.me}: {what}")

    def local(self, heads: int, key: int) -> Rects:
        """This worker's holdings as sources in a local tensor of ``heads`` heads per token."""
        got = self._local.get((heads, key))
        if got is None:
            r = self.ranges
            got = Rects.make(np.array([s for s, _, _ in r], np.int64), np.array([a for _, a, _ in r], np.int64),
                             np.array([b for _, _, b in r], np.int64), 0, heads,
                             (key, self.local_off * heads, heads, 0))
            self._local[(heads, key)] = got
        return got

    def pieces(self, kind: int, chunk: int, incoming: bool, backward: bool = False, hop: int = 0) -> dict:
        """Transfer pieces of ``kind`` and relay ``hop`` to (``incoming=False``) or from this worker
        in ``chunk``."""
        tr = self.pool.transfers
        rows = np.nonzero((tr.kind == kind) & ((tr.dst if incoming else tr.src) == self.me) & (tr.hop == hop))[0]
        i, h0, h1, t0, t1 = self.sched.transfer_pieces(kind, tr, rows, chunk, backward)
        rows = rows[i]
        other = (tr.src if incoming else tr.dst)[rows]
        peer = np.array([self.rank_of[int(w)] for w in other], dtype=np.int64)
        return {"row": rows.astype(np.int64), "peer": peer, "seq": tr.seq[rows].astype(np.int64),
                "t0": t0, "t1": t1, "h0": h0, "h1": h1, "rows": (t1 - t0) * (h1 - h0) * (2 if kind == KV else 1)}


def _concat_pieces(parts: list[dict]) -> dict:
    keys = ("row", "peer", "seq", "t0", "t1", "h0", "h1", "rows", "group")
    return {k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0, np.int64) for k in keys}


def _with_layout(parts: list[dict], W: int) -> tuple[dict, np.ndarray]:
    """Pieces of one message (groups in ``parts`` order) with their buffer offsets; rows per peer."""
    allp = _concat_pieces([{**p, "group": np.full(len(p["row"]), g, dtype=np.int64)} for g, p in enumerate(parts)])
    off, per_peer = layout(allp["peer"], allp["group"], allp["row"], allp["rows"], W)
    allp["off"] = off
    return allp, per_peer


def _rects(p: dict, sel, key: int, off=None, kv_half: int = 0) -> Rects:
    """Pieces ``sel`` as rectangles placed at their buffer offsets (``kv_half`` 1: the V block)."""
    n, nh = p["t1"][sel] - p["t0"][sel], p["h1"][sel] - p["h0"][sel]
    base = p["off"][sel] if off is None else off
    return Rects.make(p["seq"][sel], p["t0"][sel], p["t1"][sel], p["h0"][sel], p["h1"][sel],
                      (key, base + kv_half * n * nh, nh))


def _found_all(ctx: _Context, req: Rects, src: Rects, found: np.ndarray, missing, twice) -> None:
    """Raise when a request is not covered exactly once (``missing``/``twice`` build the message)."""
    area = req.area()
    short = np.nonzero(found < area)[0]
    if len(short):
        tok, head = first_missing(req, int(short[0]), src)
        raise ctx.fail(missing(int(short[0]), int(req.seq[short[0]]), tok, head))
    over = np.nonzero(found > area)[0]
    if len(over):
        raise ctx.fail(twice(int(over[0])))


def _keys(M: int, H: int = 0) -> tuple[BufKey, ...]:
    """Every buffer a program names, in a fixed order (block tables index into it)."""
    per_chunk = [f(m) for m in range(M) for f in (recv_key, grad_recv_key, do_recv_key, kout_key)]
    per_hop = [f(h) for h in range(1, H + 1) for f in (relay_key, relay_grad_key)]
    return (LQ, LK, LV, DO, OUT, DQ, DK, DV, *per_chunk, *per_hop)


# --------------------------------------------------------------------------------------------
# dispatch messages (forward Q + KV, backward dO)
# --------------------------------------------------------------------------------------------


def _from_local(ctx: _Context, p: dict, sel, heads: int, key: BufKey, kv_half: int, name: str) -> Blocks:
    """Send-buffer blocks of pieces ``sel`` read from a local tensor; every row must be held here."""
    req = _rects(p, sel, -1, kv_half=kv_half)
    src = ctx.local(heads, ctx.index[key])
    blocks, found = resolve(req, src, ctx.keys)
    bad = np.nonzero(found != req.area())[0]
    if len(bad):
        row = int(p["row"][sel][bad[0]])
        raise ctx.fail(f"{name} transfer row {row} sends tokens this worker does not hold")
    return blocks


def _dispatch(ctx: _Context, m: int) -> tuple[Message, Message, dict]:
    """Chunk ``m``'s forward dispatch (Q, then KV per peer) and backward dispatch (dO) messages,
    and the sources they deliver here: ``{"q": Rects, "k": Rects, "v": Rects, "do": Rects}``."""
    W, hq, hkv = len(ctx.pool.workers), ctx.shape.num_q_heads, ctx.shape.num_kv_heads
    q_out, q_in = ctx.pieces(Q, m, False), ctx.pieces(Q, m, True)  # dO below retraces them
    out, send = _with_layout([q_out, ctx.pieces(KV, m, False)], W)
    inn, recv = _with_layout([q_in, ctx.pieces(KV, m, True)], W)
    oq, okv, iq, ikv = out["group"] == 0, out["group"] == 1, inn["group"] == 0, inn["group"] == 1
    pack = Blocks.concat([_from_local(ctx, out, oq, hq, LQ, 0, "Q"), _from_local(ctx, out, okv, hkv, LK, 0, "KV"),
                          _from_local(ctx, out, okv, hkv, LV, 1, "KV")])
    fd = Message(send, recv, pack)
    # dO retraces Q: the same pieces, laid out on their own
    dq_out, bsend = _with_layout([q_out], W)
    dq_in, brecv = _with_layout([q_in], W)
    bd = Message(bsend, brecv, _from_local(ctx, dq_out, slice(None), hq, DO, 0, "Q"))
    rk, dk = ctx.index[recv_key(m)], ctx.index[do_recv_key(m)]
    got = {"q": _rects(inn, iq, rk), "k": _rects(inn, ikv, rk), "v": _rects(inn, ikv, rk, kv_half=1),
           "do": _rects(dq_in, slice(None), dk)}
    return fd, bd, got


# --------------------------------------------------------------------------------------------
# kernel work list and inputs
# --------------------------------------------------------------------------------------------


def _work_list(pool: PoolPlan, me: int, sched) -> dict:
    """This worker's kernel segments (:meth:`PoolPlan.kernel_segments`: adjacent pieces merged, the
    segments the cost model prices), with the chunk each runs in (-1: a head slice in every chunk;
    :meth:`ChunkSchedule.segment_calls`).

    Ordered by chunk, head range, then sample: a chunk's segments of one head range over consecutive
    local samples read consecutive rows of the local q/k/v, so a CPU backend runs them as one call on
    views (libra.runtime.calls) instead of one call per sample.
    """
    merged, chunk = pool.kernel_segments(sched, me)
    t = merged["tile"]
    return {"chunk": chunk, "seq": merged["seq"], "s0": merged["sample_start"],
            "hs": pool.tiles.head_start[t].astype(np.int64), "he": pool.tiles.head_end[t].astype(np.int64),
            "qtok": merged["q_start"], "q": merged["q_len"], "kv": merged["kv_len"]}


def _kv_requests(ctx: _Context, w: dict, c0: np.ndarray, qh: int, ck: np.ndarray):
    """KV rectangles each segment's kernel call reads, placed in the packed KV input; and ``kvh``.

    Query heads ``[c0, c0 + qh)`` read whole GQA groups (``kvh = qh / g``), lie inside one group
    (``kvh = 1``), or straddle groups unevenly: then each query head gets its own KV head.
    """
    g = ctx.shape.group_size
    if qh % g == 0 and np.all(c0 % g == 0):
        kvh, width, rep = qh // g, qh // g, np.arange(len(c0))
        col, k0 = np.zeros(len(c0), np.int64), c0 // g
    elif np.all(c0 // g == (c0 + qh - 1) // g):
        kvh, width, rep = 1, 1, np.arange(len(c0))
        col, k0 = np.zeros(len(c0), np.int64), c0 // g
    else:
        kvh, width, rep = qh, 1, np.repeat(np.arange(len(c0)), qh)
        col = np.tile(np.arange(qh), len(c0))
        k0 = (c0[rep] + col) // g
    req = Rects.make(w["seq"][rep], w["s0"][rep], w["s0"][rep] + w["kv"][rep], k0, k0 + width,
                     (-1, ck[rep] * kvh, kvh, k0 - col))
    return req, kvh


def _kernel(ctx: _Context, w: dict, m: int, got: list[dict]) -> tuple[ChunkKernel, Rects]:
    """Chunk ``m``'s kernel inputs, resolved against local holdings and what chunks ``<= m`` delivered.

    Returns the kernel and its outputs as sources (for the O / dQ returns).
    """
    hq, hkv, M = ctx.shape.num_q_heads, ctx.shape.num_kv_heads, ctx.M
    w = {k: v[(w["chunk"] < 0) | (w["chunk"] == m)] for k, v in w.items()}  # this chunk's segments
    sliced = w["chunk"] < 0  # a head slice of the segment in every chunk; else whole in its chunk
    step = np.where(sliced, (w["he"] - w["hs"]) // M, w["he"] - w["hs"])
    if len(step) and np.any(step != step[0]):
        raise ValueError("all tiles computed on one worker must have the same head width per chunk")
    qh = int(step[0]) if len(step) else 0
    c0 = w["hs"] + np.where(sliced, m * step, 0)
    cq, ck = np.cumsum(w["q"]) - w["q"], np.cumsum(w["kv"]) - w["kv"]
    kout = ctx.index[kout_key(m)]
    q_req = Rects.make(w["seq"], w["qtok"], w["qtok"] + w["q"], c0, c0 + qh, (kout, cq * qh, qh, c0))
    kv_req, kvh = _kv_requests(ctx, w, c0, qh, ck) if len(c0) else (q_req, 0)

    def pack(req, local_key, heads, sources, missing, twice):
        src = Rects.concat([ctx.local(heads, ctx.index[local_key]), *sources])
        blocks, found = resolve(req, src, ctx.keys)
        _found_all(ctx, req, src, found, missing, twice)
        return blocks

    q_miss = (lambda i, s, t, h: f"chunk {m}: Q of token {t} (head {h}) needed by a tile here is neither held "  # noqa: E731
                                 f"nor dispatched to this worker")
    q_twice = (lambda i: f"chunk {m}: Q rows of a tile here are delivered more than once")  # noqa: E731
    kv_miss = (lambda i, s, t, h: f"chunk {m}: KV of token {t} (sequence {s}, KV head {h}) needed by a tile "  # noqa: E731
                                  f"here is neither held nor fetched")
    kv_twice = (lambda i: f"chunk {m}: KV rows are fetched more than once (KV must be de-duplicated per "  # noqa: E731
                          f"destination)")
    q_pack = pack(q_req, LQ, hq, [got[m]["q"]], q_miss, q_twice)
    do_pack = pack(q_req, DO, hq, [got[m]["do"]], q_miss, q_twice)
    k_pack = pack(kv_req, LK, hkv, [got[c]["k"] for c in range(m + 1)], kv_miss, kv_twice)
    v_pack = pack(kv_req, LV, hkv, [got[c]["v"] for c in range(m + 1)], kv_miss, kv_twice)
    out_local = q_pack.select(q_pack.table[:, 0] == ctx.index[LQ])
    flops = float(np.sum(causal_area(w["kv"] - w["q"], w["kv"]))) * qh
    kern = ChunkKernel(w["q"].copy(), w["kv"].copy(), qh, int(kvh), q_pack, k_pack, v_pack, do_pack, out_local, flops)
    return kern, q_req


# --------------------------------------------------------------------------------------------
# return messages (forward O, backward dQ + dK/dV)
# --------------------------------------------------------------------------------------------


def _returns(ctx: _Context, m: int, outputs: Rects, fetched: dict) -> tuple[Message, Message]:
    """Chunk ``m``'s forward return (O) and backward return (dQ, then dK/dV per peer) messages."""
    W, hq, hkv = len(ctx.pool.workers), ctx.shape.num_q_heads, ctx.shape.num_kv_heads
    o_pieces_out, o_pieces_in = ctx.pieces(O, m, False), ctx.pieces(O, m, True)  # dQ below retraces them
    o_out, send = _with_layout([o_pieces_out], W)
    o_in, recv = _with_layout([o_pieces_in], W)
    req = _rects(o_out, slice(None), -1)
    o_pack, found = resolve(req, outputs, ctx.keys)
    bad = np.nonzero(found != req.area())[0]
    if len(bad):
        raise ctx.fail(f"O transfer row {int(o_out['row'][bad[0]])} returns rows no tile computes here")
    fr = Message(send, recv, o_pack, _unpack(ctx, o_in, slice(None), hq, OUT, 0, "O"))
    # backward: dQ along the O path, dK/dV of fetched KV back to its holder after its last chunk
    b_out, bsend = _with_layout([o_pieces_out, ctx.pieces(KV, m, True, backward=True)], W)
    b_in, brecv = _with_layout([o_pieces_in, ctx.pieces(KV, m, False, backward=True)], W)
    okv, ikv = b_out["group"] == 1, b_in["group"] == 1
    dq_pack, _ = resolve(_rects(b_out, ~okv, -1), outputs, ctx.keys)
    parts = [dq_pack] + [_resolved(ctx, _rects(b_out, okv, -1, kv_half=half), fetched[name],
                                   f"chunk {m}: a KV gradient is due for rows never fetched")
                         for half, name in ((0, "k"), (1, "v"))]
    add = Blocks.concat([_unpack(ctx, b_in, ikv, hkv, DK, 0, "KV"), _unpack(ctx, b_in, ikv, hkv, DV, 1, "KV")])
    return fr, Message(bsend, brecv, Blocks.concat(parts), _unpack(ctx, b_in, ~ikv, hq, DQ, 0, "O"), add)


def _fetched_grads(ctx: _Context, got: list[dict]) -> dict:
    """``{"k": Rects, "v": Rects}``: every fetched KV rectangle (all chunks and relay rounds)
    pointed at its gradient buffer (same offsets): where dK/dV of fetched rows accumulate."""
    lut = np.arange(len(ctx.keys))
    for c in range(ctx.M):
        lut[ctx.index[recv_key(c)]] = ctx.index[grad_recv_key(c)]
    for h in range(1, ctx.H + 1):
        lut[ctx.index[relay_key(h)]] = ctx.index[relay_grad_key(h)]
    out = {}
    for name in ("k", "v"):
        r = Rects.concat([got[c][name] for c in range(ctx.M)])
        out[name] = r._replace(key=lut[r.key])
    return out


# --------------------------------------------------------------------------------------------
# KV relay rounds (KV rows of hop > 0): after chunk 0's dispatch, before chunk M-1's return
# --------------------------------------------------------------------------------------------


def _resolved(ctx: _Context, req: Rects, src: Rects, what: str) -> Blocks:
    blocks, found = resolve(req, src, ctx.keys)
    if np.any(found != req.area()):
        raise ctx.fail(what)
    return blocks


def _relay_dispatch(ctx: _Context, got0: dict) -> list[Message]:
    """Relay rounds ``1..H`` of chunk 0's forward dispatch: each forwards KV held here or received
    in an earlier round; ``got0``'s k / v sources grow by what each round delivers here."""
    W, hkv = len(ctx.pool.workers), ctx.shape.num_kv_heads
    msgs = []
    for h in range(1, ctx.H + 1):
        out, send = _with_layout([ctx.pieces(KV, 0, False, hop=h)], W)
        inn, recv = _with_layout([ctx.pieces(KV, 0, True, hop=h)], W)
        pack = [_resolved(ctx, _rects(out, slice(None), -1, kv_half=half),
                          Rects.concat([ctx.local(hkv, ctx.index[local]), got0[name]]),
                          f"KV relay round {h} forwards tokens this worker neither holds nor received earlier")
                for half, local, name in ((0, LK, "k"), (1, LV, "v"))]
        msgs.append(Message(send, recv, Blocks.concat(pack)))
        rk = ctx.index[relay_key(h)]
        got0["k"] = Rects.concat([got0["k"], _rects(inn, slice(None), rk)])
        got0["v"] = Rects.concat([got0["v"], _rects(inn, slice(None), rk, kv_half=1)])
    return msgs


def _relay_returns(ctx: _Context, fetched: dict) -> list[Message]:
    """Relay rounds ``H..1`` of chunk ``M - 1``'s backward return: the dK/dV of rows received in
    hop ``h`` go back to their sender, which adds them to its own gradient of those rows (its dK/dV
    when it holds them, else the gradient of the KV it received) before its own round sends them on."""
    W, hkv, last = len(ctx.pool.workers), ctx.shape.num_kv_heads, ctx.M - 1
    msgs = []
    for h in range(ctx.H, 0, -1):
        b_out, send = _with_layout([ctx.pieces(KV, last, True, backward=True, hop=h)], W)
        b_in, recv = _with_layout([ctx.pieces(KV, last, False, backward=True, hop=h)], W)
        pack, add = [], []
        for half, local, name in ((0, DK, "k"), (1, DV, "v")):
            pack.append(_resolved(ctx, _rects(b_out, slice(None), -1, kv_half=half), fetched[name],
                                  f"relay round {h}: a KV gradient is due for rows never fetched"))
            add.append(_resolved(ctx, _rects(b_in, slice(None), -1, kv_half=half),
                                 Rects.concat([ctx.local(hkv, ctx.index[local]), fetched[name]]),
                                 f"relay round {h}: a KV gradient comes back for rows this worker neither "
                                 f"holds nor received"))
        msgs.append(Message(send, recv, Blocks.concat(pack), Blocks.empty(), Blocks.concat(add)))
    return msgs


def _unpack(ctx: _Context, p: dict, sel, heads: int, key: BufKey, kv_half: int, name: str) -> Blocks:
    """Blocks placing received pieces ``sel`` into a local tensor (read in reverse at run time)."""
    req = _rects(p, sel, -1, kv_half=kv_half)
    blocks, found = resolve(req, ctx.local(heads, ctx.index[key]), ctx.keys)
    bad = np.nonzero(found != req.area())[0]
    if len(bad):
        row = int(p["row"][sel][bad[0]])
        what = "tokens whose Q-home is not this worker" if name == "O" else "a gradient for tokens this worker does not hold"
        raise ctx.fail(f"{name} transfer row {row} returns {what}")
    return blocks


def _check_outputs(ctx: _Context, kernels: list[ChunkKernel], messages: dict) -> None:
    """Every local output row is written exactly once (no dropped, duplicated or misrouted tile).

    The written rectangles cover the local (token, head) grid exactly once iff their areas add up to
    it and no two overlap; only on failure is the grid built, to name a bad row.
    """
    hq = ctx.shape.num_q_heads
    t = np.concatenate([x.table for m in range(ctx.M) for x in (kernels[m].out_local, messages[FWD_RETURN][m].unpack)])
    t0 = t[:, 1] // t[:, 2]  # SRC_OFF // SRC_STRIDE: the local token of the rectangle
    h0 = t[:, 3]
    t1, h1 = t0 + t[:, N_TOK], h0 + t[:, N_HEADS]
    if covers_once(t0, t1, h0, h1, ctx.num_local, hq):
        return
    corners = np.concatenate([t0 * (hq + 1) + h0, t1 * (hq + 1) + h0, t0 * (hq + 1) + h1, t1 * (hq + 1) + h1])
    signs = np.repeat(np.array([1, -1, -1, 1]), len(t0))
    grid = np.bincount(corners, weights=signs, minlength=(ctx.num_local + 1) * (hq + 1)).astype(np.int64)
    count = grid.reshape(ctx.num_local + 1, hq + 1).cumsum(0).cumsum(1)[:-1, :-1]
    tok, head = (int(x) for x in np.argwhere(count != 1)[0])
    raise ctx.fail(f"local output row (local token {tok}, head {head}) is written {int(count[tok, head])} "
                   f"times (expected exactly once): a tile is missing, duplicated or returned to the wrong "
                   f"Q-home")


def compile_worker(pool: PoolPlan, shape: AttentionShape, worker: int, chunks: int = 1,
                   digest: str | None = None) -> WorkerProgram:
    """Compile ``worker``'s program for ``pool`` with ``chunks`` Pipeliner chunks.

    Raises:
        ValueError: worker not in the pool; ``chunks`` incompatible with the tile head widths.
        PlanValidationError: the plan's transfers do not deliver what its tiles need (module doc).
    """
    ctx = _Context(pool, shape, worker, chunks)
    work = _work_list(pool, ctx.me, ctx.sched)
    messages: dict[str, list[Message]] = {p: [] for p in PHASES}
    kernels, got = [], []
    for m in range(ctx.M):  # dispatches first: a chunk's kernel reads KV fetched by earlier chunks
        fd, bd, delivered = _dispatch(ctx, m)
        messages[FWD_DISPATCH].append(fd)
        messages[BWD_DISPATCH].append(bd)
        got.append(delivered)
    relays = {FWD_DISPATCH: _relay_dispatch(ctx, got[0]) if ctx.H else []}
    fetched = _fetched_grads(ctx, got)  # after the relay rounds: they deliver fetched KV too
    for m in range(ctx.M):
        kern, outputs = _kernel(ctx, work, m, got)
        fr, br = _returns(ctx, m, outputs, fetched)
        kernels.append(kern)
        messages[FWD_RETURN].append(fr)
        messages[BWD_RETURN].append(br)
    relays[BWD_RETURN] = _relay_returns(ctx, fetched) if ctx.H else []
    _check_outputs(ctx, kernels, messages)
    return WorkerProgram(ctx.me, ctx.rank_of[ctx.me], tuple(pool.workers), shape, ctx.num_local, ctx.M, kernels,
                         messages, digest or pool.digest(), ctx.sched, list(ctx.ranges), relays)
