"""Compiled communication pricing with numba: the kernels behind :class:`libra.sim.cost.CostModel`'s
per-chunk phase times, KV relay rounds and Pipeliner overlap when numba is installed
(``pip install -e '.[fast]'``).

A planner that chooses by price (``libra-adaptive``) prices several candidate plans per pool, and
the numpy formulation of these terms is some hundred small array operations per pricing (a
bincount per phase, a port loop per phase and column, a vector step per Pipeliner event), which
cost more than the arithmetic. Each kernel here computes the same numbers **bit for bit**: every
sum adds the same terms in the same order as the numpy code (a weighted ``np.bincount`` adds its
rows in row order; the port sums go in link-class order from 0), every max and division is the
same IEEE operation, and ties pick the first index as ``np.argmax`` does. The numpy code in
:mod:`libra.sim.cost` stays the oracle and the fallback; the tests compare the two exactly.

Kernels compile lazily on first call and are cached on disk (as :mod:`libra.jit.placement`);
:func:`libra.sim.cost.warmup` compiles them on a tiny plan.
"""

from __future__ import annotations

import numba
import numpy as np

from libra.tap.pipeline import (
    COMPUTE,
    EVENTS,
    ISSUE_DISPATCH,
    ISSUE_EXCHANGE,
    ISSUE_RETURN,
    WAIT_DISPATCH,
    WAIT_RETURN,
)

_njit = numba.njit(cache=True, nogil=True)

# event codes of libra.tap.pipeline.EVENTS (compile-time constants in the kernels)
_ISSUE_DISPATCH = EVENTS.index(ISSUE_DISPATCH)
_WAIT_DISPATCH = EVENTS.index(WAIT_DISPATCH)
_COMPUTE = EVENTS.index(COMPUTE)
_ISSUE_RETURN = EVENTS.index(ISSUE_RETURN)
_ISSUE_EXCHANGE = EVENTS.index(ISSUE_EXCHANGE)
_WAIT_RETURN = EVENTS.index(WAIT_RETURN)


def event_codes(events) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, chunks)`` int64 arrays of :func:`libra.tap.pipeline.pipeline_events`' list (codes:
    indices into :data:`libra.tap.pipeline.EVENTS`), what :func:`pipelined_end` walks."""
    return (np.array([EVENTS.index(ev) for ev, _ in events], dtype=np.int64),
            np.array([m for _, m in events], dtype=np.int64))


@_njit
def phase_bytes(src, dst, code, nbytes, k, n):
    """``(k, n, J)`` bytes sent and received per (link class, worker, column) of route rows moving
    ``nbytes[i, j]`` from ``src[i]`` to ``dst[i]`` over class ``code[i]`` (rows with ``code < 0``,
    self-transfers, skipped): ``CostModel._phase_bytes``' bincounts, rows added in row order."""
    J = nbytes.shape[1]
    sent = np.zeros((k, n, J))
    recv = np.zeros((k, n, J))
    for i in range(src.shape[0]):
        c = code[i]
        if c < 0:
            continue
        s, d = src[i], dst[i]
        for j in range(J):
            w = np.float64(nbytes[i, j])
            sent[c, s, j] += w
            recv[c, d, j] += w
    return sent, recv


@_njit
def phase_times(sent, recv, bw, lat, port_of, nports):
    """``(cols,)`` time of a phase per column of ``(k, cols)`` bytes: per port the sum over its
    classes (in class order) of ``max(sent, recv) / bandwidth`` plus each busy class's latency, and
    the slowest port's sum (first on ties): ``CostModel._phase_ms``' ``bandwidth + latency``."""
    k, cols = sent.shape
    out = np.empty(cols)
    port_bw = np.empty(nports)
    port_lat = np.empty(nports)
    for j in range(cols):
        port_bw[:] = 0.0
        port_lat[:] = 0.0
        for c in range(k):
            busy = max(sent[c, j], recv[c, j])
            port_bw[port_of[c]] += busy / bw[c]
            port_lat[port_of[c]] += lat[c] if busy > 0 else 0.0
        slow = 0
        for p in range(1, nports):
            if port_bw[p] + port_lat[p] > port_bw[slow] + port_lat[slow]:
                slow = p
        out[j] = port_bw[slow] + port_lat[slow]
    return out


@_njit
def chunk_times(src, dst, code, nbytes, k, n, bw, lat, port_of, nports):
    """``(sent, recv, times)``: :func:`phase_bytes` and the ``(n, J)`` :func:`phase_times` of every
    (worker, column)."""
    sent, recv = phase_bytes(src, dst, code, nbytes, k, n)
    J = nbytes.shape[1]
    t = phase_times(sent.reshape(k, n * J), recv.reshape(k, n * J), bw, lat, port_of, nports)
    return sent, recv, t.reshape(n, J)


@_njit
def relay_rounds(src, dst, code, hop, nbytes, backward, k, n, bw, lat, port_of, nports):
    """``CostModel._relay_rounds``: ``(n, J)`` end times of relay phase columns sent in hop rounds
    (forward 0..H, backward H..0); a worker starts a round when it and the senders of its rows in
    that round have finished the previous ones."""
    J = nbytes.shape[1]
    t = np.zeros((n, J))
    top = 0
    for i in range(hop.shape[0]):
        top = max(top, hop[i])
    for step in range(top + 1):
        h = top - step if backward else step
        sel = np.flatnonzero(hop == h)
        _, _, port = chunk_times(src[sel], dst[sel], code[sel], nbytes[sel], k, n, bw, lat, port_of, nports)
        start = t.copy()
        for i in sel:  # a receiver waits for its sender's earlier rounds
            for j in range(J):
                start[dst[i], j] = max(start[dst[i], j], t[src[i], j])
        for w in range(n):
            for j in range(J):
                if port[w, j] > 0:
                    t[w, j] = start[w, j] + port[w, j]
    return t


@_njit
def pipelined_end(codes, chunks, per, dispatch, ret, exchange, has_exchange):
    """``(n,)`` end of one pass under the Pipeliner per worker (the host clock, comm stream and
    compute stream of :func:`libra.sim.cost.pipelined_exposed`, walked over the encoded events
    :func:`event_codes`); the caller subtracts the compute."""
    n, M = per.shape
    out = np.empty(n)
    arrived = np.zeros(M)
    returned = np.zeros(M)
    for w in range(n):
        host, comm, comp = 0.0, 0.0, 0.0
        for e in range(codes.shape[0]):
            ev, m = codes[e], chunks[e]
            if ev == _ISSUE_DISPATCH:
                comm = max(comm, host) + dispatch[w, m]
                arrived[m] = comm
            elif ev == _WAIT_DISPATCH:
                host = max(host, arrived[m])
            elif ev == _COMPUTE:
                comp = max(host, comp) + per[w, m]
                host = comp
            elif ev == _ISSUE_RETURN:
                comm = max(comm, comp) + ret[w, m]
                returned[m] = comm
            elif ev == _ISSUE_EXCHANGE:
                x = exchange[w, m] if has_exchange else ret[w, m] + dispatch[w, m + 2]
                comm = max(comm, comp) + x
                returned[m] = comm
                arrived[m + 2] = comm
            elif ev == _WAIT_RETURN:
                host = max(host, returned[m])
        out[w] = max(max(host, comm), comp)
    return out


def warmup() -> None:
    """Compile every kernel for the argument types :class:`libra.sim.cost.CostModel` passes."""
    ids = np.array([0, 1], dtype=np.int64)
    code, hop = np.array([0, -1], dtype=np.int64), np.array([0, 1], dtype=np.int64)
    nbytes = np.ones((2, 2))
    bw, lat, port_of = np.ones(1), np.zeros(1), np.zeros(1, dtype=np.int64)
    sent, recv, t = chunk_times(ids, ids, code, nbytes, 1, 2, bw, lat, port_of, 1)
    phase_times(sent.reshape(1, 4), recv.reshape(1, 4), bw, lat, port_of, 1)
    relay_rounds(ids, ids, code, hop, nbytes, True, 1, 2, bw, lat, port_of, 1)
    codes, chunks = event_codes([(ISSUE_DISPATCH, 0), (WAIT_DISPATCH, 0), (COMPUTE, 0), (ISSUE_RETURN, 0),
                                 (WAIT_RETURN, 0)])
    pipelined_end(codes, chunks, t, t, t, t, False)
