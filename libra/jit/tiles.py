"""Compiled SH-tile decomposition (Libra sec. 4.3.1) with numba: the kernel behind
:func:`libra.tap.tiles.make_tiles` when numba is installed (``pip install -e '.[fast]'``).

:func:`tile_rows` walks the blocks of the pool's global token axis once, with one pointer into the
holder ranges and one into the samples, and fills the TileTable columns in tile order; it returns
each tile's causal area, which :func:`libra.workload.attention_flops` turns into FLOPs (one
formula, one place). Same rows as the numpy implementation in :mod:`libra.tap.tiles`, which stays
the fallback (the tests compare them). Compiles lazily on first call and is cached on
disk (see :mod:`libra.jit.placement`); :func:`libra.tap.tiles.warmup` compiles it on a tiny pool.
"""

from __future__ import annotations

import numba
import numpy as np

_njit = numba.njit(cache=True, nogil=True)


@_njit
def tile_rows(base, offs, h_start, h_end, h_worker, block, head_split, width):
    """``(bad, seq, q_start, q_end, head_start, head_end, q_home, dest, area)`` of every tile.

    ``bad``: -1, or the index of the first block (in pool order) that crosses a holder range (the
    columns are then incomplete). ``area``: causal (query, key) pairs per head of the tile's block.
    """
    n_seq, n_holders, n_offs = base.shape[0] - 1, h_start.shape[0], offs.shape[0]
    n_blocks = 0
    for s in range(n_seq):
        n_blocks += (base[s + 1] - base[s] + block - 1) // block
    n = n_blocks * head_split
    seq, q_home = np.empty(n, dtype=np.int32), np.empty(n, dtype=np.int32)
    q_start, q_end = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    head_start, head_end = np.empty(n, dtype=np.int32), np.empty(n, dtype=np.int32)
    dest, area = np.full(n, -1, dtype=np.int32), np.empty(n, dtype=np.int64)
    j, smp, cum, prev, r, b = 0, 0, np.int64(0), np.int64(0), 0, 0
    for s in range(n_seq):
        for start in range(0, base[s + 1] - base[s], block):
            g0 = base[s] + start
            g1 = min(g0 + block, base[s + 1])
            while j + 1 < n_holders and h_start[j + 1] <= g0:  # the holder range containing g0
                j += 1
            if g1 > h_end[j]:
                return b, seq, q_start, q_end, head_start, head_end, q_home, dest, area
            # cumulative area up to g1: whole samples before it, then k (k + 1) / 2 of its sample
            while smp + 1 < n_offs and offs[smp + 1] <= g1:
                length = offs[smp + 1] - offs[smp]
                cum += (length * (length + 1)) >> 1
                smp += 1
            k = g1 - offs[smp]
            at = cum + ((k * (k + 1)) >> 1)
            for h in range(head_split):
                seq[r], q_start[r], q_end[r], q_home[r] = s, start, g1 - base[s], h_worker[j]
                head_start[r], head_end[r], area[r] = h * width, (h + 1) * width, at - prev
                r += 1
            prev = at
            b += 1
    return -1, seq, q_start, q_end, head_start, head_end, q_home, dest, area
