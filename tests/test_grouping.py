"""Pool-grouping baselines and the lower bound (baselines/grouping.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.grouping import (
    GROUPINGS,
    lower_bound_r_minus_1,
    max_pool_lower_bound,
    zigzag_grouping,
    zigzag_swap_grouping,
)
from libra.vrsp import pool_imbalance, pool_loads

cases = st.integers(1, 5).flatmap(lambda k: st.integers(1, 5).flatmap(
    lambda p: st.lists(st.floats(0, 1e4, allow_nan=False), min_size=k * p, max_size=k * p).map(lambda w: (w, p))))


@settings(max_examples=80, deadline=None)
@given(case=cases, seed=st.integers(0, 10))
def test_every_strategy_partitions_and_respects_bound(case, seed):
    w, p = case
    bound = lower_bound_r_minus_1(w, p)
    for name, fn in GROUPINGS.items():
        pools = fn(w, p, seed=seed)
        assert pools.shape == (len(w) // p, p), name
        assert sorted(pools.ravel().tolist()) == list(range(len(w))), name
        assert pool_imbalance(w, pools) >= bound - 1e-9, name


@settings(max_examples=60, deadline=None)
@given(case=cases)
def test_zigzag_swap_never_worse_than_zigzag(case):
    w, p = case
    assert pool_loads(w, zigzag_swap_grouping(w, p)).max() <= pool_loads(w, zigzag_grouping(w, p)).max() + 1e-9


def test_production_and_random():
    w = np.arange(8.0)
    assert GROUPINGS["production"](w, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    a, b = GROUPINGS["random"](w, 2, seed=3), GROUPINGS["random"](w, 2, seed=3)
    assert np.array_equal(a, b)
    assert not all(np.array_equal(a, GROUPINGS["random"](w, 2, seed=s)) for s in range(4, 10))


def test_zigzag_snake_order():
    w = np.array([9.0, 8, 7, 6, 5, 4])  # already sorted; K = 3 pools of 2
    assert zigzag_grouping(w, 2).tolist() == [[0, 5], [1, 4], [2, 3]]
    w = np.array([1.0, 9, 5, 7])  # sorted order 1, 3, 2, 0
    assert zigzag_grouping(w, 2).tolist() == [[1, 0], [3, 2]]


def test_zigzag_swap_by_hand():
    w = [14, 15, 22, 28, 2, 5, 24, 28]
    # snake over 28(3) 28(7) 24(6) 22(2) 15(1) 14(0) 5(5) 2(4): loads 67 and 71
    assert zigzag_grouping(w, 4).tolist() == [[3, 2, 1, 4], [7, 6, 0, 5]]
    # the best swap moves 24 <-> 22: both pools at 69 (optimal: total 138)
    assert zigzag_swap_grouping(w, 4).tolist() == [[3, 6, 1, 4], [7, 2, 0, 5]]
    best = min(max(sum(w[i] for i in c), sum(w) - sum(w[i] for i in c)) for c in itertools.combinations(range(8), 4))
    assert best == 69


def test_lower_bound_values():
    w = [10.0, 1, 1, 1, 1, 1, 1, 1]  # mean pool (P=4) = 8.5; outlier pool >= 10 + 3 = 13
    assert max_pool_lower_bound(w, 4) == 13.0
    assert lower_bound_r_minus_1(w, 4) == pytest.approx(13 / 8.5 - 1)
    assert lower_bound_r_minus_1([1.0, 1, 1, 1], 2) == 0.0
    assert lower_bound_r_minus_1([0.0, 0.0], 1) == 0.0


def test_bad_input():
    with pytest.raises(ValueError, match="pool size P=3 must divide GBS=4"):
        GROUPINGS["zigzag"]([1, 2, 3, 4], 3)
    with pytest.raises(ValueError, match="pool size P=5 must divide GBS=4"):
        lower_bound_r_minus_1([1, 2, 3, 4], 5)
