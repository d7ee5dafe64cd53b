"""Kernel calls of a compiled chunk: its kernel work run on views of the buffers it reads.

A :class:`~libra.runtime.program.ChunkKernel` describes one packed varlen batch per Pipeliner chunk
(Libra sec. 4.4): its query, key and value inputs are gathered into packed buffers and its outputs
land in one packed buffer (``kout``) that the O / dQ returns read. On a GPU one varlen launch over
the packed batch is what is wanted. On a CPU every segment is its own kernel call anyway, so the
gather only copies rows; when a run of consecutive segments reads each of its inputs from one
rectangle of one buffer (its own tokens of a chunk's heads, a prefix of a sample, a received piece)
the kernel can read that rectangle in place.

:func:`split_calls` cuts a chunk's segments into :class:`KernelCall` s: maximal runs of such
"view" segments, and runs of the others (packed as before, call by call). Each call's output is
its own buffer (:func:`call_key`); :func:`rekey_messages` points the return messages' blocks that
read ``kout`` at the calls' outputs instead, so no output is copied into a packed ``kout`` first.
With ``views=False`` (GPU varlen backends) a chunk is one call, i.e. the packed execution.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from libra.runtime.blocks import (
    DO,
    DST_OFF,
    KEY,
    N_HEADS,
    N_TOK,
    SRC_H0,
    SRC_OFF,
    SRC_STRIDE,
    Blocks,
    BufKey,
    K,
    Q,
    V,
    covers_once,
    kout_key,
    merge_rows,
)
from libra.runtime.executor import MemoryMeter, copy_blocks, gather
from libra.runtime.kernels import Segments


def call_key(chunk: int, call: int) -> BufKey:
    """Output buffer of call ``call`` of chunk ``chunk`` (forward O; in backward, its dQ)."""
    return BufKey(f"kout.{call}", chunk)


@dataclass
class KernelCall:
    """One backend call: its segments and where each input comes from.

    ``q``/``k``/``v``/``do``: blocks filling the call's packed inputs (offsets relative to the call;
    one rectangle of one buffer for a view call, so :func:`~libra.runtime.executor.gather` returns
    a view); ``out_local``: its output rows that are this worker's own (copied into out / dq).
    ``q_row0``: the call's first row in the chunk's packed ``kout`` layout.
    """

    seg: Segments
    qh: int
    kvh: int
    q: Blocks
    k: Blocks
    v: Blocks
    do: Blocks
    out_local: Blocks
    q_row0: int
    key: BufKey

    @property
    def total_q(self) -> int:
        return self.seg.total_q

    @property
    def total_k(self) -> int:
        return self.seg.total_k


def _segment_of(blocks: Blocks, starts: np.ndarray) -> np.ndarray:
    """Segment of every block, from its target offset (``starts``: first row of each segment)."""
    return np.searchsorted(starts, blocks.table[:, DST_OFF], side="right") - 1


def _single_rects(blocks: Blocks, starts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per segment: whether its blocks merge into one rectangle, and that rectangle (a table row)."""
    t = blocks.table
    seg = _segment_of(blocks, starts)
    # merge within a segment only: a sentinel key column keeps segments apart
    tagged = t.copy()
    tagged[:, KEY] = t[:, KEY] + seg * (len(blocks.keys) + 1)
    merged = merge_rows(tagged)
    mseg = merged[:, KEY] // (len(blocks.keys) + 1)
    count = np.bincount(mseg, minlength=n)
    rows = np.zeros((n, t.shape[1]), dtype=np.int64)
    one = count[mseg] == 1
    rows[mseg[one]] = merged[one]
    rows[:, KEY] %= len(blocks.keys) + 1
    return count == 1, rows


def _continues(prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """Whether each next single rectangle continues the previous one in its source buffer."""
    same = np.all(nxt[:, [KEY, SRC_STRIDE, SRC_H0, N_HEADS]] == prev[:, [KEY, SRC_STRIDE, SRC_H0, N_HEADS]], axis=1)
    return same & (nxt[:, SRC_OFF] == prev[:, SRC_OFF] + prev[:, N_TOK] * prev[:, SRC_STRIDE])


def _select(blocks: Blocks, seg: np.ndarray, s0: int, s1: int, base: int) -> Blocks:
    """The blocks of segments ``[s0, s1)`` with target offsets rebased to ``base``."""
    t = blocks.table[(seg >= s0) & (seg < s1)].copy()
    t[:, DST_OFF] -= base
    return Blocks(blocks.keys, t)


def _bounds(kern, views: bool, cu_q: np.ndarray, cu_k: np.ndarray) -> np.ndarray:
    """Segment indices where a new call starts (first 0, last ``n``)."""
    n = len(kern.q_lens)
    if not views or n < 2:
        return np.array([0, n])
    ok = np.ones(n, dtype=bool)
    cont = np.ones(n - 1, dtype=bool)
    for blocks, starts in ((kern.q_pack, cu_q * kern.qh), (kern.k_pack, cu_k * kern.kvh),
                           (kern.v_pack, cu_k * kern.kvh), (kern.do_pack, cu_q * kern.qh)):
        single, rows = _single_rects(blocks, starts[:-1], n)
        ok &= single
        cont &= _continues(rows[:-1], rows[1:])
    # view segments that continue one another share a call; packed segments are batched together
    joined = np.where(ok[1:] & ok[:-1], cont, ~ok[1:] & ~ok[:-1])
    return np.concatenate(([0], np.nonzero(~joined)[0] + 1, [n]))


def split_calls(kern, chunk: int, views: bool) -> list[KernelCall]:
    """The kernel calls of one chunk (module docstring); none for a chunk with no kernel work."""
    n = len(kern.q_lens)
    if not n:
        return []
    cu_q = np.concatenate(([0], np.cumsum(kern.q_lens))).astype(np.int64)
    cu_k = np.concatenate(([0], np.cumsum(kern.kv_lens))).astype(np.int64)
    qs, ks = cu_q[:-1] * kern.qh, cu_k[:-1] * kern.kvh
    seg_of = {"q": _segment_of(kern.q_pack, qs), "k": _segment_of(kern.k_pack, ks),
              "v": _segment_of(kern.v_pack, ks), "do": _segment_of(kern.do_pack, qs),
              "out": _segment_of(kern.out_local, qs)}
    bounds = _bounds(kern, views, cu_q, cu_k)
    calls = []
    for c, (s0, s1) in enumerate(zip(bounds[:-1], bounds[1:])):
        qb, kb = int(cu_q[s0] * kern.qh), int(cu_k[s0] * kern.kvh)
        calls.append(KernelCall(
            Segments(kern.q_lens[s0:s1], kern.kv_lens[s0:s1]), kern.qh, kern.kvh,
            _select(kern.q_pack, seg_of["q"], s0, s1, qb), _select(kern.k_pack, seg_of["k"], s0, s1, kb),
            _select(kern.v_pack, seg_of["v"], s0, s1, kb), _select(kern.do_pack, seg_of["do"], s0, s1, qb),
            _select(kern.out_local, seg_of["out"], s0, s1, qb), qb, call_key(chunk, c)))
    return calls


def _rekey(blocks: Blocks, outputs: dict) -> Blocks:
    """``blocks`` with every block reading a chunk's ``kout`` pointed at the call that computed it."""
    if not len(blocks):
        return blocks
    col = blocks.table[:, KEY]
    read = [i for i, key in enumerate(blocks.keys) if key in outputs]
    read = [i for i in read if np.any(col == i)]
    if not read:
        return blocks
    keys = list(blocks.keys)
    t = blocks.table.copy()
    for i in read:
        calls = outputs[blocks.keys[i]]
        rows = np.nonzero(t[:, KEY] == i)[0]
        starts = np.array([c.q_row0 for c in calls], dtype=np.int64)
        which = np.searchsorted(starts, t[rows, SRC_OFF], side="right") - 1
        for c in np.unique(which):
            sel = rows[which == c]
            t[sel, SRC_OFF] -= starts[c]
            t[sel, KEY] = len(keys)
            keys.append(calls[c].key)
    return Blocks(tuple(keys), t)


def rekey_messages(messages: dict, calls: list[list[KernelCall]]) -> dict:
    """The program's messages with ``kout`` reads pointed at the calls' outputs (module docstring)."""
    outputs = {kout_key(m): cs for m, cs in enumerate(calls) if cs}
    return {phase: [replace(msg, pack=_rekey(msg.pack, outputs)) for msg in msgs]
            for phase, msgs in messages.items()}


def closed_call(program, calls: list[list[KernelCall]], chunk: int) -> KernelCall | None:
    """All of a worker's kernel work as one call on its whole q, k, v, when it exchanges nothing.

    A worker that sends and receives nothing computes exactly its own samples, every head (TAP
    moved none of its tiles, or only tiles it computes itself): the Pipeliner has no transfer to
    overlap, so splitting its heads into chunks and its tiles into head ranges only adds copies
    (each call's output into ``out``, its dQ into ``dq``). When every call covers all local tokens
    with the same segments and their head ranges tile ``[0, hq)``, one call over all heads reads
    q, k, v in place and its outputs *are* out, dq, dk, dv (as a CP = 1 Ulysses rank's are).

    Returns the call (computed at chunk ``chunk``'s compute event), or None.
    """
    if any(msg.n_send or msg.n_recv for msg in program.all_messages()):
        return None
    flat = [c for cs in calls for c in cs]
    n, hq, hkv = program.num_local, program.shape.num_q_heads, program.shape.num_kv_heads
    if not flat or not n:
        return None
    seg = flat[0].seg
    heads = []
    for c in flat:
        r, rk = c.q.as_view(), c.k.as_view()
        if r is None or rk is None or r[SRC_OFF] != 0 or r[N_TOK] != n or rk[SRC_OFF] != 0 or rk[N_TOK] != n \
                or not (np.array_equal(c.seg.q_lens, seg.q_lens) and np.array_equal(c.seg.kv_lens, seg.kv_lens)):
            return None
        heads.append((r[SRC_H0], r[SRC_H0] + r[N_HEADS]))
    heads.sort()
    if heads[0][0] != 0 or heads[-1][1] != hq or any(a[1] != b[0] for a, b in zip(heads[:-1], heads[1:])):
        return None
    keys = flat[0].q.keys
    whole = {}
    for key, h in ((Q, hq), (K, hkv), (V, hkv), (DO, hq)):
        whole[key] = Blocks(keys, np.array([[keys.index(key), 0, h, 0, 0, h, 0, n, h]], dtype=np.int64))
    return KernelCall(seg, hq, hkv, whole[Q], whole[K], whole[V], whole[DO], Blocks.empty(), 0, call_key(chunk, 0))


def kv_grad_blocks(calls: list[list[KernelCall]], messages: list, order: list[int], num_local: int,
                   kv_heads: int) -> dict | None:
    """How each call's dK/dV land in dk / dv without zero-filling them, or None (zero-fill and add).

    Applies when every K and V row's gradient comes only from call blocks reading this worker's own
    k / v (no fetched KV here, no dK/dV returned here) and those blocks' rectangles are pairwise
    equal or disjoint and cover k exactly once (e.g. a pool whose ranks keep their own work: each
    KV head of each local sample read by one call per Pipeliner chunk). Then the first block (in the
    chunks' compute ``order``) of each rectangle copies its gradient and the others add theirs.
    ``messages``: every exchange of the worker (:meth:`WorkerProgram.all_messages`, relay rounds
    included): any that adds a received dK/dV here rules the copies out.

    Returns:
        ``{(chunk, call): {"k": (copy, add), "v": (copy, add)}}`` (Blocks each), or None.
    """
    if any(len(msg.unpack_add) for msg in messages):
        return None
    out: dict = {(m, c): {} for m in order for c in range(len(calls[m]))}
    for name, local in (("k", K), ("v", V)):
        seen: set = set()
        for m in order:
            for c, call in enumerate(calls[m]):
                blocks = getattr(call, name)
                rows = np.array(blocks.rows(), dtype=np.int64).reshape(-1, 9)
                if any(blocks.keys[i] != local for i in np.unique(rows[:, KEY])):
                    return None  # reads fetched KV: its gradient accumulates in grad_recv
                first = np.zeros(len(rows), dtype=bool)
                for i, r in enumerate(rows[:, [SRC_OFF, SRC_STRIDE, SRC_H0, N_TOK, N_HEADS]].tolist()):
                    first[i] = tuple(r) not in seen
                    seen.add(tuple(r))
                out[(m, c)][name] = (Blocks(blocks.keys, rows[first]), Blocks(blocks.keys, rows[~first]))
        rect = np.array(sorted(seen), dtype=np.int64).reshape(-1, 5)
        t0 = rect[:, 0] // np.maximum(rect[:, 1], 1)
        if not covers_once(t0, t0 + rect[:, 3], rect[:, 2], rect[:, 2] + rect[:, 4], num_local, kv_heads):
            return None
    return out


# --------------------------------------------------------------------------------------------
# running a call
# --------------------------------------------------------------------------------------------


def call_forward(call: KernelCall, backend, stores: dict, meter: MemoryMeter, scale, out_rows: torch.Tensor):
    """Run one call forward: inputs gathered (views where they can be), output stored under
    ``call.key`` for the O return and copied into this worker's own ``out`` rows. Returns (o, lse)."""
    like = stores[Q]
    kq, nq = gather(call.q, stores, call.total_q, call.qh, like, meter)
    kk, nk = gather(call.k, stores, call.total_k, call.kvh, like, meter)
    kv, nv = gather(call.v, stores, call.total_k, call.kvh, like, meter)
    o, lse = backend.forward(kq, kk, kv, call.seg, scale)
    meter.alloc(o, lse)
    meter.free(*(x for x, new in ((kq, nq), (kk, nk), (kv, nv)) if new))
    stores[call.key] = o_rows = o.reshape(-1, like.shape[-1])
    copy_blocks(o_rows, call.out_local, {Q: out_rows}, reverse=True)
    return o, lse


def call_backward(call: KernelCall, backend, stores: dict, meter: MemoryMeter, scale, saved: tuple,
                  grads: dict | None, kv_blocks: dict | None = None):
    """Run one call backward from its forward's ``saved = (o, lse)`` (:func:`call_forward`): dQ
    stored under ``call.key`` for the dQ return and copied into this worker's own dq rows
    (``grads["q"][Q]``); dK/dV added onto the rows the inputs were read from (local or fetched:
    ``grads["k"]``/``grads["v"]`` map each source buffer to its gradient buffer), or, with
    ``kv_blocks`` (this call's entry of :func:`kv_grad_blocks`), copied where first written.
    ``grads`` None (:func:`closed_call`): nothing is scattered. Returns ``(dq, dk, dv)`` of the call."""
    o, lse = saved
    like = stores[Q]
    d = like.shape[-1]
    kq, nq = gather(call.q, stores, call.total_q, call.qh, like, meter)
    kk, nk = gather(call.k, stores, call.total_k, call.kvh, like, meter)
    kv, nv = gather(call.v, stores, call.total_k, call.kvh, like, meter)
    kdo, ndo = gather(call.do, stores, call.total_q, call.qh, like, meter)
    gq, gk, gv = backend.backward(kdo, kq, kk, kv, o, lse, call.seg, scale)
    meter.alloc(gq, gk, gv)
    meter.free(*(x for x, new in ((kq, nq), (kk, nk), (kv, nv), (kdo, ndo)) if new), o, lse)
    stores[call.key] = gq_rows = gq.reshape(-1, d)  # the dQ return reads it
    if grads is None:
        meter.free(gk, gv)  # the caller's dk, dv: results, not transients
        return gq, gk, gv
    copy_blocks(gq_rows, call.out_local, grads["q"], reverse=True)
    for name, g in (("k", gk), ("v", gv)):
        rows = g.reshape(-1, d)
        if kv_blocks is None:
            copy_blocks(rows, getattr(call, name), grads[name], reverse=True, add=True)
        else:
            first, again = kv_blocks[name]
            copy_blocks(rows, first, grads[name], reverse=True)
            copy_blocks(rows, again, grads[name], reverse=True, add=True)
    meter.free(gk, gv)
    return gq, gk, gv
