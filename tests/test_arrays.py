"""libra.arrays' idioms against the numpy calls they stand for (property tests)."""

import numpy as np
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
