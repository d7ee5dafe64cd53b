"""Sorted-array search shared by the compiled kernels (:mod:`libra.jit.placement`,
:mod:`libra.jit.exchange`)."""

from __future__ import annotations

import numba

_njit = numba.njit(cache=True, nogil=True)


@_njit
def right(a, x, hint):
    """``np.searchsorted(a, x, side="right")``, galloping from ``hint`` (any hint gives the right
    answer; tiles come in token order, so the previous tile's answer makes it O(1))."""
    n = a.shape[0]
    h = min(max(hint, 0), n)
    step = 1
    if h < n and a[h] <= x:  # the answer lies above h
        lo, hi = h + 1, n
        while lo + step - 1 < n:
            p = lo + step - 1
            if a[p] > x:
                hi = p
                break
            lo = p + 1
            step *= 2
    else:  # the answer is at most h
        lo, hi = 0, h
        while hi - step >= 0:
            p = hi - step
            if a[p] <= x:
                lo = p + 1
                break
            hi = p
            step *= 2
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo
