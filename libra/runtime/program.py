"""Compile one worker's share of a PoolPlan into index arrays (numpy only, no communication).

A :class:`WorkerProgram` says, for the calling worker and each Pipeliner chunk, which rows to pack
into each outgoing message, how to read each incoming message, and how to pack the varlen kernel
inputs (Libra sec. 4.3.3, 4.4). Every tensor is handled as *rows* of width ``d``: an element
``(sequence, token, head)`` of Q/K/V/O is one row. Row keys are ``(seq * BIG + token) * heads +
head``; the sender and the receiver derive the same keys in the same order from the same
TransferTable, which is why the pool's ranks must agree on the plan digest first.

The TransferTable is executed literally. The Pipeliner (:class:`~libra.tap.pipeline.ChunkSchedule`,
the same object the cost model prices) splits each transfer by heads: chunk ``m`` holds the
``m``-th head piece of every tile, a KV head travels (forward) with the first chunk whose query
heads read it and its gradient (backward) with the last, so KV is fetched once per destination
however ``M`` cuts a GQA group.

Compilation checks the plan against the data flow it implies and raises
:class:`~libra.plan.PlanValidationError` when a tile's Q or KV is not delivered, an output row is
returned twice or never (dropped or duplicated tiles), or a transfer's source does not hold its
rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from libra.plan import KV, O, PlanValidationError, PoolPlan, Q
from libra.tap.pipeline import BWD_DISPATCH, BWD_RETURN, FWD_DISPATCH, FWD_RETURN, PHASES, ChunkSchedule
from libra.workload import AttentionShape, causal_area


class KeyIndex:
    """Sorted lookup from int64 row keys to row positions."""

    def __init__(self, keys: np.ndarray, rows: np.ndarray | None = None):
        keys = np.asarray(keys, dtype=np.int64)
        rows = np.arange(len(keys), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
        order = np.argsort(keys, kind="stable")
        self.keys, self.rows = keys[order], rows[order]

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``query`` keys and a found mask (first match when a key repeats)."""
        query = np.asarray(query, dtype=np.int64)
        if not len(self.keys):
            return np.zeros(len(query), dtype=np.int64), np.zeros(len(query), dtype=bool)
        pos = np.clip(np.searchsorted(self.keys, query, side="left"), 0, len(self.keys) - 1)
        found = self.keys[pos] == query
        return np.where(found, self.rows[pos], 0), found

    def duplicates(self) -> int:
        return int(np.sum(self.keys[1:] == self.keys[:-1])) if len(self.keys) > 1 else 0


Gather = list  # list[(store, src_idx, dst_pos)]: dst[dst_pos] = stores[store][src_idx]


def _gather(n_rows: int, parts: list[tuple[str, np.ndarray, np.ndarray]]) -> tuple[int, Gather]:
    return n_rows, [(s, np.asarray(i, np.int64), np.asarray(p, np.int64)) for s, i, p in parts if len(p)]


@dataclass
class Message:
    """One phase x chunk at this worker: what to send to / expect from every pool rank.

    ``send_rows[r]``/``recv_rows[r]``: rows exchanged with pool rank ``r`` (0 for self and
    non-peers); the flat send/recv buffers hold peers in pool-rank order. ``pack`` fills the send
    buffer; the unpack fields are phase specific (see :class:`WorkerProgram`).
    """

    send_rows: np.ndarray
    recv_rows: np.ndarray
    pack: Gather = field(default_factory=list)

    @property
    def n_send(self) -> int:
        return int(self.send_rows.sum())

    @property
    def n_recv(self) -> int:
        return int(self.recv_rows.sum())


@dataclass
class ChunkKernel:
    """Kernel work of one Pipeliner chunk at this worker (tile pieces; adjacent blocks merged).

    ``q_pack``/``k_pack``/``v_pack``/``do_pack`` build the packed kernel inputs
    ``(total_q * qh, d)`` / ``(total_k * kvh, d)`` rows from the stores; ``out_local`` copies kernel
    output rows of tiles whose Q-home is this worker into the local output.
    """

    q_lens: np.ndarray
    kv_lens: np.ndarray
    qh: int
    kvh: int
    q_pack: Gather
    k_pack: Gather
    v_pack: Gather
    do_pack: Gather
    out_local: tuple[np.ndarray, np.ndarray]  # (kernel out rows, local output rows)
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
        fr_unpack[m]: (recv rows, local output rows) for returned outputs.
        br_dq[m]: (recv rows, local dq rows); br_dk[m]/br_dv[m]: (recv rows, local kv rows) to add.
        digest: the plan digest the program was compiled from.
    """

    worker: int
    pool_rank: int
    workers: tuple[int, ...]
    shape: AttentionShape
    num_local: int
    chunks: int
    kernels: list[ChunkKernel]
    messages: dict[str, list[Message]]
    fr_unpack: list[tuple[np.ndarray, np.ndarray]]
    br_dq: list[tuple[np.ndarray, np.ndarray]]
    br_dk: list[tuple[np.ndarray, np.ndarray]]
    br_dv: list[tuple[np.ndarray, np.ndarray]]
    digest: str
    schedule: ChunkSchedule
    local_ranges: list[tuple[int, int, int]] = field(default_factory=list)

    def comm_rows(self) -> dict[str, int]:
        """Rows sent by this worker per phase (bytes = rows * d * element size)."""
        return {p: sum(m.n_send for m in self.messages[p]) for p in PHASES}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _keys(seq, tok_start, tok_end, heads, n_heads, big) -> np.ndarray:
    """Row keys of tokens ``[tok_start, tok_end)`` x ``heads`` (token-major)."""
    toks = np.arange(tok_start, tok_end, dtype=np.int64)
    return np.add.outer((seq * big + toks) * n_heads, np.asarray(heads, dtype=np.int64)).ravel()


class _Local:
    """This worker's pre-attention holdings: (seq, start, end) ranges, concatenated in that order."""

    def __init__(self, pool: PoolPlan, me: int, big: int):
        ranges = []
        for s, seq in enumerate(pool.sequences):
            for a, b, w in zip(seq.holder_start, seq.holder_end, seq.holder_worker):
                if int(w) == me and b > a:
                    ranges.append((s, int(a), int(b)))
        ranges.sort()
        self.ranges = ranges
        self.big = big
        offs = np.cumsum([0] + [b - a for _, a, b in ranges])
        self.num = int(offs[-1])
        self._start = np.array([s * big + a for s, a, _ in ranges], dtype=np.int64)
        self._end = np.array([s * big + b for s, _, b in ranges], dtype=np.int64)
        self._off = offs[:-1].astype(np.int64)

    def rows(self, keys: np.ndarray, n_heads: int) -> tuple[np.ndarray, np.ndarray]:
        """Local row (token * n_heads + head) of each key, and whether it is held here."""
        keys = np.asarray(keys, dtype=np.int64)
        tok, head = np.divmod(keys, n_heads)
        if not len(self._start):
            return np.zeros(len(keys), np.int64), np.zeros(len(keys), bool)
        i = np.clip(np.searchsorted(self._start, tok, side="right") - 1, 0, len(self._start) - 1)
        held = (tok >= self._start[i]) & (tok < self._end[i])
        local_tok = self._off[i] + tok - self._start[i]
        return np.where(held, local_tok * n_heads + head, 0), held


def _fail(pool: PoolPlan, me: int, what: str) -> PlanValidationError:
    return PlanValidationError(f"pool {pool.pool_index}, worker {me}: {what}")


# --------------------------------------------------------------------------------------------
# compilation
# --------------------------------------------------------------------------------------------


def compile_worker(pool: PoolPlan, shape: AttentionShape, worker: int, chunks: int = 1,
                   digest: str | None = None) -> WorkerProgram:
    """Compile ``worker``'s program for ``pool`` with ``chunks`` Pipeliner chunks.

    Raises:
        ValueError: worker not in the pool; ``chunks`` incompatible with the tile head widths.
        PlanValidationError: the plan's transfers do not deliver what its tiles need (see module doc).
    """
    if worker not in pool.workers:
        raise ValueError(f"worker {worker} is not in pool {pool.pool_index} (workers {list(pool.workers)})")
    sched = ChunkSchedule.for_pool(pool, shape, chunks)
    hq, hkv, g = shape.num_q_heads, shape.num_kv_heads, shape.group_size
    W = len(pool.workers)
    rank_of = {w: i for i, w in enumerate(pool.workers)}
    me, M = int(worker), int(chunks)
    big = max([s.num_tokens for s in pool.sequences] + [1]) + 1
    local = _Local(pool, me, big)
    tr, tiles = pool.transfers, pool.tiles
    bad = np.nonzero((tiles.head_end > hq) | (tiles.head_start < 0) | (tiles.head_end <= tiles.head_start))[0]
    if len(bad):
        raise _fail(pool, me, f"tile {int(bad[0])} has head range outside [0, {hq})")

    def pieces(kind, m, sel, backward=False):
        """(row index, keys) of transfer rows ``sel`` restricted to the heads chunk ``m`` moves."""
        out = []
        n_heads = hkv if kind == KV else hq
        for r in sel:
            heads = sched.row_heads(kind, int(tr.head_start[r]), int(tr.head_end[r]), m, backward)
            if len(heads):
                out.append((r, _keys(int(tr.seq[r]), int(tr.tok_start[r]), int(tr.tok_end[r]), heads,
                                     n_heads, big)))
        return out

    rows_of_kind = {k: np.nonzero(tr.kind == k)[0] for k in (Q, KV, O)}

    def rows_between(kind, src, dst):
        r = rows_of_kind[kind]
        return r[(tr.src[r] == src) & (tr.dst[r] == dst)]

    # ---- kernel work list: PoolPlan.segments filtered to this worker, in tile order ----------
    segs = pool.segments()  # ordered by tile, then position
    mine = np.nonzero(segs["dest"] == me)[0]
    seg_tile, seg_q, seg_kv = segs["tile"][mine], segs["q_len"][mine], segs["kv_len"][mine]
    seg_qtok, seg_s0, seg_seq = segs["q_start"][mine], segs["sample_start"][mine], segs["seq"][mine]
    seg_hs = tiles.head_start[seg_tile].astype(np.int64)
    seg_he = tiles.head_end[seg_tile].astype(np.int64)
    # Merge pieces of one sample and head range whose query rows are contiguous here (adjacent
    # blocks placed on the same worker): one kernel segment reads the KV prefix once instead of
    # once per block, which cuts both kernel launches and the packed-KV copy.
    if len(seg_tile):
        order = np.lexsort((seg_qtok, seg_he, seg_hs, seg_s0, seg_seq))
        seg_seq, seg_s0, seg_hs, seg_he, seg_qtok, seg_q, seg_kv = (
            x[order] for x in (seg_seq, seg_s0, seg_hs, seg_he, seg_qtok, seg_q, seg_kv))
        cont = np.zeros(len(order), dtype=bool)
        cont[1:] = ((seg_seq[1:] == seg_seq[:-1]) & (seg_s0[1:] == seg_s0[:-1]) & (seg_hs[1:] == seg_hs[:-1])
                    & (seg_he[1:] == seg_he[:-1]) & (seg_qtok[1:] == seg_qtok[:-1] + seg_q[:-1]))
        first = np.nonzero(~cont)[0]
        last = np.concatenate((first[1:], [len(order)])) - 1
        seg_q = np.add.reduceat(seg_q, first)
        seg_kv = seg_kv[last]
        seg_seq, seg_s0, seg_hs, seg_he, seg_qtok = (x[first] for x in (seg_seq, seg_s0, seg_hs, seg_he, seg_qtok))

    messages: dict[str, list[Message]] = {p: [] for p in PHASES}
    kernels, fr_unpack, br_dq, br_dk, br_dv = [], [], [], [], []
    fd_kv_index: list[tuple[KeyIndex, np.ndarray]] = []  # per chunk: KV keys -> (K row), V row

    for m in range(M):
        # ---------------- forward dispatch: Q then KV per peer, peers in pool-rank order ------
        send_rows, recv_rows = np.zeros(W, np.int64), np.zeros(W, np.int64)
        pack, q_recv_keys, q_recv_rows, kv_keys, k_rows, v_rows = [], [], [], [], [], []
        bd_pack, bd_send, bd_recv, bd_keys, bd_rows = [], np.zeros(W, np.int64), np.zeros(W, np.int64), [], []
        s_off = r_off = bd_s_off = bd_r_off = 0
        for p, peer in enumerate(pool.workers):
            if peer == me:
                continue
            # outgoing
            for r, keys in pieces(Q, m, rows_between(Q, me, peer)):
                src, held = local.rows(keys, hq)
                if not held.all():
                    raise _fail(pool, me, f"Q transfer row {r} sends tokens this worker does not hold")
                pos = np.arange(len(keys))
                pack.append(("q", src, s_off + pos))
                bd_pack.append(("do", src, bd_s_off + pos))
                s_off += len(keys)
                bd_s_off += len(keys)
            for r, keys in pieces(KV, m, rows_between(KV, me, peer)):
                src, held = local.rows(keys, hkv)
                if not held.all():
                    raise _fail(pool, me, f"KV transfer row {r} sends tokens this worker does not hold")
                n = len(keys)
                pack.append(("k", src, s_off + np.arange(n)))
                pack.append(("v", src, s_off + n + np.arange(n)))
                s_off += 2 * n
            send_rows[p] = s_off - send_rows.sum()
            bd_send[p] = bd_s_off - bd_send.sum()
            # incoming
            start = r_off
            for _, keys in pieces(Q, m, rows_between(Q, peer, me)):
                q_recv_keys.append(keys)
                q_recv_rows.append(r_off + np.arange(len(keys)))
                bd_keys.append(keys)
                bd_rows.append(bd_r_off + np.arange(len(keys)))
                r_off += len(keys)
                bd_r_off += len(keys)
            for _, keys in pieces(KV, m, rows_between(KV, peer, me)):
                n = len(keys)
                kv_keys.append(keys)
                k_rows.append(r_off + np.arange(n))
                v_rows.append(r_off + n + np.arange(n))
                r_off += 2 * n
            recv_rows[p] = r_off - start
            bd_recv[p] = bd_r_off - bd_recv.sum()
        messages[FWD_DISPATCH].append(Message(send_rows, recv_rows, _gather(0, pack)[1]))
        messages[BWD_DISPATCH].append(Message(bd_send, bd_recv, _gather(0, bd_pack)[1]))
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))  # noqa: E731
        q_index = KeyIndex(cat(q_recv_keys), cat(q_recv_rows))
        bd_index = KeyIndex(cat(bd_keys), cat(bd_rows))
        kv_index = KeyIndex(cat(kv_keys), cat(k_rows))
        if kv_index.duplicates():
            # a second copy would split the KV gradient between two receive rows
            raise _fail(pool, me, f"chunk {m}: {kv_index.duplicates()} KV rows are fetched more than once "
                                  f"(KV must be de-duplicated per destination)")
        v_of_k = np.full(r_off, -1, np.int64)
        if kv_keys:
            v_of_k[cat(k_rows)] = cat(v_rows)
        fd_kv_index.append((kv_index, v_of_k))

        # ---------------- kernel pack for chunk m -----------------------------------------
        q_keys, k_keys, kv_heads_all, c0s = [], [], [], []
        tile_chunks = [sched.head_chunks(a, b)[m] for a, b in zip(seg_hs, seg_he)]
        qh = tile_chunks[0][1] - tile_chunks[0][0] if len(seg_seq) else 0
        c0 = np.array([c[0] for c in tile_chunks], dtype=np.int64)
        if len(seg_seq):
            if np.any(np.array([c[1] - c[0] for c in tile_chunks]) != qh):
                raise ValueError("all tiles computed on one worker must have the same head width per chunk")
            if qh % g == 0 and np.all(c0 % g == 0):
                kvh = qh // g
                kv_heads = (c0 // g)[:, None] + np.arange(kvh)[None, :]
            elif np.all(c0 // g == (c0 + qh - 1) // g):
                kvh = 1
                kv_heads = (c0 // g)[:, None]
            else:  # GQA groups straddle chunk boundaries unevenly: give each query head its KV head
                kvh = qh
                kv_heads = (c0[:, None] + np.arange(qh)[None, :]) // g
        else:
            kvh, kv_heads = 0, np.zeros((0, 0), np.int64)
        for i in range(len(seg_seq)):
            q_keys.append(_keys(seg_seq[i], seg_qtok[i], seg_qtok[i] + seg_q[i], np.arange(c0[i], c0[i] + qh),
                                hq, big))
            k_keys.append(_keys(seg_seq[i], seg_s0[i], seg_s0[i] + seg_kv[i], kv_heads[i], hkv, big))
            kv_heads_all.append(kv_heads[i])
            c0s.append(c0[i])
        qk = cat(q_keys)
        kk = cat(k_keys)
        # Q: local or this chunk's dispatch
        lrow, held = local.rows(qk, hq)
        rrow, found = q_index.find(qk)
        missing = ~(held | found)
        if missing.any():
            tok = (qk[missing][0] // hq) % big
            raise _fail(pool, me, f"chunk {m}: Q of token {tok} (head {qk[missing][0] % hq}) needed by a tile "
                                  f"here is neither held nor dispatched to this worker")
        pos = np.arange(len(qk))
        q_pack = _gather(len(qk), [("q", lrow[held], pos[held]), (f"fd{m}", rrow[~held], pos[~held])])[1]
        brow, bfound = bd_index.find(qk)
        do_pack = _gather(len(qk), [("do", lrow[held], pos[held]), (f"bd{m}", brow[~held], pos[~held])])[1]
        assert bfound[~held].all()
        # KV: local or any chunk <= m's dispatch
        klrow, kheld = local.rows(kk, hkv)
        kpos = np.arange(len(kk))
        k_parts = [("k", klrow[kheld], kpos[kheld])]
        v_parts = [("v", klrow[kheld], kpos[kheld])]
        todo = ~kheld
        for c in range(m + 1):
            idx, v_of = fd_kv_index[c]
            rows, f = idx.find(kk)
            f &= todo
            k_parts.append((f"fd{c}", rows[f], kpos[f]))
            v_parts.append((f"fd{c}", v_of[rows[f]], kpos[f]))
            todo &= ~f
        if todo.any():
            key = kk[todo][0]
            raise _fail(pool, me, f"chunk {m}: KV of token {(key // hkv) % big} (sequence {key // hkv // big}, "
                                  f"KV head {key % hkv}) needed by a tile here is neither held nor fetched")
        # outputs of tiles whose Q-home is here
        out_local = (pos[held], lrow[held])
        flops = float(np.sum(causal_area(seg_kv - seg_q, seg_kv))) * qh
        kernels.append(ChunkKernel(seg_q.copy(), seg_kv.copy(), int(qh), int(kvh), q_pack,
                                   _gather(0, k_parts)[1], _gather(0, v_parts)[1], do_pack, out_local, flops))
        out_index = KeyIndex(qk)

        # ---------------- forward return (O) and backward return (dQ + dKV) -----------------
        send_rows, recv_rows = np.zeros(W, np.int64), np.zeros(W, np.int64)
        br_send, br_recv = np.zeros(W, np.int64), np.zeros(W, np.int64)
        pack, br_pack, unpack_r, unpack_l = [], [], [], []
        dq_r, dq_l, dk_r, dk_l, dv_r, dv_l = [], [], [], [], [], []
        s_off = r_off = b_s_off = b_r_off = 0
        for p, peer in enumerate(pool.workers):
            if peer == me:
                continue
            for r, keys in pieces(O, m, rows_between(O, me, peer)):
                rows, f = out_index.find(keys)
                if not f.all():
                    raise _fail(pool, me, f"O transfer row {r} returns rows no tile computes here")
                pack.append((f"out{m}", rows, s_off + np.arange(len(keys))))
                br_pack.append((f"dq{m}", rows, b_s_off + np.arange(len(keys))))
                s_off += len(keys)
                b_s_off += len(keys)
            # dK/dV retrace KV fetches: this worker received KV from `peer`, sends its gradient back
            for _r, keys in pieces(KV, m, rows_between(KV, peer, me), backward=True):
                n = len(keys)
                # the KV head of each key first arrived with chunk kv_first[head]
                heads = keys % hkv
                for c in np.unique(sched.kv_first[heads]):
                    sel = sched.kv_first[heads] == c
                    if c > m:
                        raise _fail(pool, me, "internal: KV gradient due before its fetch")
                    br_pack.append((f"gfd{c}k", np.asarray(keys[sel]), b_s_off + np.nonzero(sel)[0]))
                    br_pack.append((f"gfd{c}v", np.asarray(keys[sel]), b_s_off + n + np.nonzero(sel)[0]))
                b_s_off += 2 * n
            send_rows[p] = s_off - send_rows.sum()
            br_send[p] = b_s_off - br_send.sum()
            start, b_start = r_off, b_r_off
            for r, keys in pieces(O, m, rows_between(O, peer, me)):
                lrow, held = local.rows(keys, hq)
                if not held.all():
                    raise _fail(pool, me, f"O transfer row {r} returns tokens whose Q-home is not this worker")
                unpack_r.append(r_off + np.arange(len(keys)))
                unpack_l.append(lrow)
                dq_r.append(b_r_off + np.arange(len(keys)))
                dq_l.append(lrow)
                r_off += len(keys)
                b_r_off += len(keys)
            for r, keys in pieces(KV, m, rows_between(KV, me, peer), backward=True):
                lrow, held = local.rows(keys, hkv)
                if not held.all():
                    raise _fail(pool, me, f"KV transfer row {r}: gradient for tokens this worker does not hold")
                n = len(keys)
                dk_r.append(b_r_off + np.arange(n))
                dk_l.append(lrow)
                dv_r.append(b_r_off + n + np.arange(n))
                dv_l.append(lrow)
                b_r_off += 2 * n
            recv_rows[p] = r_off - start
            br_recv[p] = b_r_off - b_start
        messages[FWD_RETURN].append(Message(send_rows, recv_rows, _gather(0, pack)[1]))
        messages[BWD_RETURN].append(Message(br_send, br_recv, br_pack))
        fr_unpack.append((cat(unpack_r), cat(unpack_l)))
        br_dq.append((cat(dq_r), cat(dq_l)))
        br_dk.append((cat(dk_r), cat(dk_l)))
        br_dv.append((cat(dv_r), cat(dv_l)))

    # resolve backward dKV pack keys (gfd{c}k/v placeholders) into rows of the fd{c} buffers
    for m in range(M):
        resolved = []
        for store, src, dst in messages[BWD_RETURN][m].pack:
            if store.startswith("gfd"):
                c, which = int(store[3:-1]), store[-1]
                idx, v_of = fd_kv_index[c]
                rows, f = idx.find(src)
                if not f.all():
                    raise _fail(pool, me, f"chunk {m}: KV gradient for rows never fetched in chunk {c}")
                resolved.append((f"gfd{c}", rows if which == "k" else v_of[rows], dst))
            else:
                resolved.append((store, src, dst))
        messages[BWD_RETURN][m].pack = _gather(0, resolved)[1]

    # every local output row written exactly once (no dropped, duplicated or misrouted tile)
    count = np.zeros(local.num * hq, dtype=np.int64)
    for m in range(M):
        np.add.at(count, kernels[m].out_local[1], 1)
        np.add.at(count, fr_unpack[m][1], 1)
    if local.num and not (count == 1).all():
        bad_row = int(np.nonzero(count != 1)[0][0])
        tok, head = divmod(bad_row, hq)
        raise _fail(pool, me, f"local output row (local token {tok}, head {head}) is written "
                              f"{int(count[bad_row])} times (expected exactly once): a tile is missing, "
                              f"duplicated or returned to the wrong Q-home")
    return WorkerProgram(me, rank_of[me], tuple(pool.workers), shape, local.num, M, kernels, messages,
                         fr_unpack, br_dq, br_dk, br_dv, digest or pool.digest(), sched,
                         list(local.ranges))
