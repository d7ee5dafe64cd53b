"""libra.arrays' idioms against the numpy calls they stand for (property tests)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from libra.arrays import row_ids, sorted_unique
from libra.tap.pipeline import _distinct_ranges


@settings(max_examples=200, deadline=None)
@given(arrays(np.int64, st.integers(0, 60), elements=st.integers(-2**40, 2**40)))
def test_sorted_unique_is_np_unique(x):
    got = sorted_unique(x)
    assert got.dtype == x.dtype and np.array_equal(got, np.unique(x))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), max_size=60))
def test_distinct_ranges_is_row_ids(pairs):
    hs = np.array([a for a, _ in pairs], dtype=np.int64)
    he = hs + np.array([w for _, w in pairs], dtype=np.int64)
    first, _ = row_ids([hs, he])
    want = np.stack([hs[first], he[first]], axis=1) if len(pairs) else np.zeros((0, 2), np.int64)
    got = _distinct_ranges(hs, he)
    assert got.shape == want.shape and np.array_equal(got, want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 6), st.integers(0, 2**40), st.integers(0, 2)), max_size=80),
       st.booleans())
def test_row_ids_is_np_unique_of_the_rows(rows, wide):
    """Ids are the rows' lexicographic ranks and ``first`` each distinct row's first occurrence, as
    ``np.unique(..., axis=0, return_index=True, return_inverse=True)`` gives them -- packed into one
    key or (``wide``: ranges past 2**62) sorted row by row."""
    cols = [np.array([r[i] for r in rows], dtype=np.int64) for i in range(3)]
    if wide:
        cols[0] = cols[0] * 2**30  # spans multiply past 2**62: the unpacked path
    first, ids = row_ids(cols)
    stacked = np.stack(cols, axis=1) if rows else np.zeros((0, 3), np.int64)
    _, want_first, want_ids = np.unique(stacked, axis=0, return_index=True, return_inverse=True)
    assert ids.dtype == np.int64 and first.dtype == np.int64
    assert np.array_equal(first, want_first) and np.array_equal(ids, want_ids.reshape(-1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(-7, 7), st.booleans()), max_size=90), st.booleans())
def test_lexsort_and_stable_sort_are_numpys(rows, wide):
    """``lexsort`` is ``np.lexsort`` (last key primary, ties by index) on int and bool keys, packed
    or (``wide``) not; ``stable_sort`` is a stable argsort, with or without room for the index."""
    from libra.arrays import lexsort, stable_sort

    keys = [np.array([r[i] for r in rows], dtype=np.int64 if i < 2 else bool) for i in range(3)]
    assert np.array_equal(lexsort(keys[:2] + [keys[1] * 0.5]), np.lexsort(keys[:2] + [keys[1] * 0.5]))  # floats
    if wide:
        keys[0] = keys[0] * 2**61  # ranges multiply past 2**62: np.lexsort itself
    got = lexsort(keys)
    assert got.dtype == np.int64 and np.array_equal(got, np.lexsort(keys))
    key = keys[1] + 7
    for bound in (None, 2.0**62):  # 2**62: no room for the index bits, a stable argsort
        order, s = stable_sort(key, bound)
        assert np.array_equal(order, np.argsort(key, kind="stable")) and np.array_equal(s, key[order])


@pytest.mark.parametrize("n", [0, 1, 511, 512, 3000])
def test_packed_sorts_match_numpy_on_both_sides_of_the_threshold(n):
    """Around :data:`PACKED_SORT_MIN` (numpy's own sorts below it, a packed key from it on) the
    results are numpy's: ``lexsort`` on int and bool keys with ties, ``row_ids`` as ``np.unique``."""
    from libra.arrays import PACKED_SORT_MIN, lexsort

    assert PACKED_SORT_MIN == 512
    rng = np.random.default_rng(n)
    keys = [rng.integers(-3, 40, n), rng.integers(0, 2, n).astype(bool), rng.integers(0, 5, n)]
    assert np.array_equal(lexsort(keys), np.lexsort(keys))
    cols = [keys[0], keys[2]]
    first, ids = row_ids(cols)
    stacked = np.stack(cols, axis=1)
    _, want_first, want_ids = np.unique(stacked, axis=0, return_index=True, return_inverse=True)
    assert np.array_equal(first, want_first) and np.array_equal(ids, want_ids.reshape(-1))
