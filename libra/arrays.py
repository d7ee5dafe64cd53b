"""Numpy idioms the plan contract, TAP and the runtime share (one home each, numpy only).

* :func:`expand_counts`: row ``i`` repeated ``counts[i]`` times, with each copy's position -- the
  ragged ``arange`` behind every "one row per (tile, sample)", "(tile, KV head)" or "(interval,
  holder)" expansion.
* :func:`pack_keys`: several integer key columns as one int64 whose order is the rows'
  lexicographic order (mixed radix), so one 1-D sort replaces a ``lexsort`` or a row-wise ``unique``.
* :func:`row_ids`: dense ids of equal key rows, by :func:`pack_keys` where the keys fit in an int64.
* :func:`sorted_unique`: ``np.unique(x)`` of a 1-D array by one sort (numpy >= 2.3's hashed
  ``unique`` is an order of magnitude slower on thousands of distinct integers).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def expand_counts(counts) -> tuple[np.ndarray, np.ndarray]:
    """``(owner, offset)``, both int64 of length ``counts.sum()``: element ``j`` is copy number
    ``offset[j]`` (0-based) of row ``owner[j]``; rows appear in order, ``counts[i]`` copies each."""
    counts = np.asarray(counts, dtype=np.int64)
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    offset = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, offset


def pack_keys(columns: Sequence[np.ndarray]) -> np.ndarray | None:
    """One int64 per row of the equal-length integer ``columns`` (first column most significant),
    ordered as the rows are lexicographically; None when the columns' ranges multiply past 2**62."""
    cols = [np.asarray(c, dtype=np.int64) for c in columns]
    if not len(cols[0]):
        return np.zeros(0, dtype=np.int64)
    lows = [int(c.min()) for c in cols]
    spans = [int(c.max()) - lo + 1 for c, lo in zip(cols, lows)]
    if float(np.prod([float(x) for x in spans])) >= 2.0**62:
        return None
    key = np.zeros(len(cols[0]), dtype=np.int64)
    for c, lo, span in zip(cols, lows, spans):
        key = key * span + (c - lo)
    return key


def row_ids(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids of the distinct rows of ``columns``, numbered in lexicographic order.

    Returns ``(first, ids)``: the index of each distinct row's first occurrence, and each row's id.
    """
    key = pack_keys(columns)
    if key is None:  # too wide to pack: sort the rows themselves
        _, first, ids = np.unique(np.stack([np.asarray(c, np.int64) for c in columns], axis=1), axis=0,
                                  return_index=True, return_inverse=True)
    else:
        _, first, ids = np.unique(key, return_index=True, return_inverse=True)
    return first, ids.reshape(-1).astype(np.int64)


def sorted_unique(values) -> np.ndarray:
    """The distinct elements of the 1-D ``values``, ascending: ``np.unique(values)`` for integer and
    other NaN-free arrays, by one sort (numpy >= 2.3 hashes plain ``unique``, which on a few
    thousand distinct int64 measured ~15x slower than sorting)."""
    s = np.sort(np.asarray(values).reshape(-1))
    if len(s) < 2:
        return s
    keep = np.empty(len(s), dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]
