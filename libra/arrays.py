"""Numpy idioms the plan contract, TAP and the runtime share (one home each, numpy only).

* :func:`expand_counts`: row ``i`` repeated ``counts[i]`` times, with each copy's position -- the
  ragged ``arange`` behind every "one row per (tile, sample)", "(tile, KV head)" or "(interval,
  holder)" expansion.
* :func:`pack_keys`: several integer key columns as one int64 whose order is the rows'
  lexicographic order (mixed radix), so one 1-D sort replaces a ``lexsort`` or a row-wise ``unique``.
* :func:`row_ids`: dense ids of equal key rows, by :func:`pack_keys` where the keys fit in an int64.
* :func:`sorted_unique`: ``np.unique(x)`` of a 1-D array by one sort (numpy >= 2.3's hashed
  ``unique`` is an order of magnitude slower on thousands of distinct integers).
* :func:`stable_sort`: ``argsort(kind="stable")`` of non-negative int64 keys, and the sorted keys,
  by one ``np.sort`` of the keys with the row index in their low bits (on thousands of keys ~10x
  faster than a stable argsort, which numpy runs as a timsort).
* :func:`lexsort`: ``np.lexsort(keys)`` of integer keys, by :func:`pack_keys` and :func:`stable_sort`.
"""

from __future__ import annotations

import math
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
    if math.prod(float(x) for x in spans) >= 2.0**62:
        return None
    key = np.zeros(len(cols[0]), dtype=np.int64)
    for c, lo, span in zip(cols, lows, spans):
        key = key * span + (c - lo)
    return key


PACKED_SORT_MIN = 512
"""Rows from which :func:`lexsort` and :func:`row_ids` sort one packed key with :func:`stable_sort`:
packing costs ~50 us whatever the size, and below ~500 rows ``np.lexsort`` and ``np.unique`` are
faster (measured on 5 int64 keys: 8 us vs 60 us at 100 rows, 197 us vs 65 us at 1000)."""


def stable_sort(key: np.ndarray, bound: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(order, key[order])``: ``order = np.argsort(key, kind="stable")`` of the non-negative int64
    ``key`` (every value below ``bound``; default ``key.max() + 1``).

    The row index rides in the key's low bits, so one SIMD ``np.sort`` of int64 does the work; a
    stable argsort runs only when ``bound`` leaves no room for the index."""
    key = np.asarray(key, dtype=np.int64)
    if not len(key):
        return np.zeros(0, dtype=np.int64), key
    bound = float(int(key.max()) + 1) if bound is None else float(bound)
    bits = max(int(len(key) - 1).bit_length(), 1)
    if bound * 2.0**bits >= 2.0**63:
        order = np.argsort(key, kind="stable")
        return order, key[order]
    packed = key << bits
    packed |= np.arange(len(key), dtype=np.int64)
    packed.sort()
    return packed & ((1 << bits) - 1), packed >> bits


def lexsort(keys: Sequence[np.ndarray]) -> np.ndarray:
    """``np.lexsort(keys)`` (the *last* key primary, ties in index order): for integer and boolean
    keys one packed key (:func:`pack_keys`) sorted by :func:`stable_sort`; ``np.lexsort`` itself
    for other dtypes or keys whose ranges multiply past what one int64 holds."""
    keys = [np.asarray(k) for k in keys]
    if not keys or len(keys[0]) < PACKED_SORT_MIN or any(k.dtype.kind not in "biu" for k in keys):
        return np.lexsort(keys)  # few rows, floats (or other): numpy's own
    packed = pack_keys(list(reversed(keys)))
    if packed is None:
        return np.lexsort(keys)
    return stable_sort(packed)[0]


def row_ids(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids of the distinct rows of ``columns``, numbered in lexicographic order.

    Returns ``(first, ids)``: the index of each distinct row's first occurrence, and each row's id.
    """
    key = pack_keys(columns)
    if key is None:  # too wide to pack: sort the rows themselves
        _, first, ids = np.unique(np.stack([np.asarray(c, np.int64) for c in columns], axis=1), axis=0,
                                  return_index=True, return_inverse=True)
        return first, ids.reshape(-1).astype(np.int64)
    if len(key) < PACKED_SORT_MIN:
        _, first, ids = np.unique(key, return_index=True, return_inverse=True)
        return first.astype(np.int64), ids.reshape(-1).astype(np.int64)
    order, s = stable_sort(key)  # what np.unique(key, return_index=True) sorts by, faster
    new = np.empty(len(key), dtype=bool)
    new[0] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    ids = np.empty(len(key), dtype=np.int64)
    ids[order] = np.cumsum(new) - 1
    return order[new], ids


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
