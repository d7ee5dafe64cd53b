"""Compiled kernel segments with numba: the loop behind :func:`libra.plan.layout.segments` when
numba is installed (``pip install -e '.[fast]'``).

Every pricing of a pool plan (the cost model, ``libra-adaptive``'s candidates) cuts its tiles at
sample boundaries; on a real-corpus pool that is tens of thousands of pieces, and the numpy
formulation spends most of its time building and filtering index arrays. The kernel makes the same
rows in the same order (by tile, then sample) with integer arithmetic only, so its output is
identical; the numpy code stays the oracle and the fallback, and the tests compare the two.
"""

from __future__ import annotations

import numba
import numpy as np

_njit = numba.njit(cache=True, nogil=True)


@_njit
def _bisect(a, x, right):
    """``np.searchsorted(a, x, side="right" if right else "left")`` for sorted ``a``."""
    lo, hi = 0, a.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < x or (right and a[mid] == x):
            lo = mid + 1
        else:
            hi = mid
    return lo


@_njit
def segment_rows(tseq, q_start, q_end, base, offs):
    """Pieces of every tile ``[q_start, q_end)`` of sequence ``tseq`` cut at the global sample
    offsets ``offs`` (``base``: each sequence's global offset): ``(tile, sample_start, sample_len,
    q_start, q_len, kv_len, area)`` int64 arrays, by tile then position, empty pieces dropped."""
    T = tseq.shape[0]
    first = np.empty(T, np.int64)
    stop = np.empty(T, np.int64)
    n = 0
    for t in range(T):
        a, b = q_start[t] + base[tseq[t]], q_end[t] + base[tseq[t]]
        first[t], stop[t] = _bisect(offs, a, True) - 1, _bisect(offs, b, False)
        for s in range(first[t], stop[t]):
            if min(b, offs[s + 1]) > max(a, offs[s]):
                n += 1
    tile, s_start, s_len = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    qs, ql, kv, area = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    i = 0
    for t in range(T):
        shift = base[tseq[t]]
        a, b = q_start[t] + shift, q_end[t] + shift
        for s in range(first[t], stop[t]):
            s0 = offs[s]
            lo, hi = max(a, s0) - s0, min(b, offs[s + 1]) - s0
            if hi <= lo:
                continue
            tile[i], s_start[i], s_len[i] = t, s0 - shift, offs[s + 1] - s0
            qs[i], ql[i], kv[i] = s0 - shift + lo, hi - lo, hi
            area[i] = (hi * (hi + 1) - lo * (lo + 1)) // 2
            i += 1
    return tile, s_start, s_len, qs, ql, kv, area


def warmup() -> None:
    """Compile :func:`segment_rows` for the argument types :func:`libra.plan.layout.segments` passes."""
    one = np.zeros(1, np.int64)
    segment_rows(one, one, one + 2, np.array([0, 2], np.int64), np.array([0, 1, 2], np.int64))
