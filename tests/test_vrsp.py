"""VRSP, Algorithm 1 (libra/vrsp.py)."""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.vrsp import microbatch_groups, pool_imbalance, pool_loads, vrsp


def reference_vrsp(w, p):
    """Algorithm 1 written as literally as possible (sorted(), tuples, heappop/heappush)."""
    k = len(w) // p
    order = sorted(range(len(w)), key=lambda i: (-w[i], i))
    heap = [(0.0, j) for j in range(k)]
    pools = [[] for _ in range(k)]
    for i in order:
        load, j = heapq.heappop(heap)
        pools[j].append(i)
        if len(pools[j]) < p:
            heapq.heappush(heap, (load + w[i], j))
    return np.array(pools)


workloads_st = st.integers(min_value=1, max_value=6).flatmap(
    lambda k: st.integers(min_value=1, max_value=6).flatmap(
        lambda p: st.lists(st.one_of(st.integers(0, 50).map(float), st.floats(0, 1e6, allow_nan=False)),
                           min_size=k * p, max_size=k * p).map(lambda w: (w, p))))


@settings(max_examples=150, deadline=None)
@given(case=workloads_st)
def test_matches_literal_algorithm_and_is_a_partition(case):
    w, p = case
    pools = vrsp(w, p)
    assert pools.shape == (len(w) // p, p)
    assert sorted(pools.ravel().tolist()) == list(range(len(w)))
    assert np.array_equal(pools, reference_vrsp(w, p))


@settings(max_examples=60, deadline=None)
@given(case=workloads_st)
def test_integer_fast_path_equals_tuple_path(case):
    w, p = case
    wi = np.floor(np.asarray(w)) + 1.0  # positive integers: the int-key path
    assert np.array_equal(vrsp(wi, p), reference_vrsp(wi.tolist(), p))
    assert np.array_equal(vrsp(wi + 0.5, p), reference_vrsp((wi + 0.5).tolist(), p))


def test_ties_by_index_and_pool_index():
    assert vrsp([1.0] * 4, 2).tolist() == [[0, 2], [1, 3]]
    assert vrsp([0.0] * 4, 2).tolist() == [[0, 1], [2, 3]]  # pool 0 stays least loaded until full
    assert vrsp([5, 5, 1, 1], 2).tolist() == [[0, 2], [1, 3]]


def test_small_case_optimal():
    w = [8, 7, 6, 5, 4, 3, 2, 1]
    pools = vrsp(w, 4)
    best = min(max(sum(w[i] for i in c), sum(w) - sum(w[i] for i in c))
               for c in itertools.combinations(range(8), 4))
    assert pool_loads(w, pools).max() == best == 18


def test_beats_production_on_skewed_window():
    rng = np.random.default_rng(0)
    w = rng.pareto(1.2, 128) + 1
    prod = np.arange(128).reshape(16, 8)
    assert pool_imbalance(w, vrsp(w, 8)) < pool_imbalance(w, prod)


@pytest.mark.parametrize("w, p, match", [
    ([1, 2, 3], 2, r"pool size P=2 must divide GBS=3"),
    ([1, 2], 0, r"pool size P must be an integer >= 1, got 0"),
    ([1, 2], 1.5, r"got 1.5"),
    ([], 1, r"non-empty 1-D"),
    ([1, -2], 1, r"workload 1 must be finite and >= 0, got -2.0"),
    ([1, float("nan")], 1, r"workload 1 must be finite"),
    ([1, float("inf")], 2, r"workload 1 must be finite"),
])
def test_bad_input(w, p, match):
    with pytest.raises(ValueError, match=match):
        vrsp(w, p)


def test_pool_imbalance_values_and_errors():
    assert pool_imbalance([1, 1, 1, 3], [[0, 1], [2, 3]]) == pytest.approx(4 / 3 - 1)
    assert pool_imbalance([0, 0], [[0], [1]]) == 0.0
    with pytest.raises(ValueError, match="2-D"):
        pool_imbalance([1, 2], [0, 1])
    with pytest.raises(ValueError, match="index the 2 workloads"):
        pool_imbalance([1, 2], [[0, 2]])


def test_microbatch_groups_mapping():
    pools = np.arange(16).reshape(4, 4)  # K=4 pools of P=4
    groups = microbatch_groups(pools, dp=8)  # DP/P = 2 pools per GA index, GA = 2
    assert groups.shape == (2, 8)
    for k in range(4):
        for j in range(4):
            assert groups[k // 2, (k % 2) * 4 + j] == pools[k, j]
    with pytest.raises(ValueError, match="pool size P=4 must divide DP=6"):
        microbatch_groups(pools, dp=6)
    with pytest.raises(ValueError, match="DP=32 must divide GBS=16"):
        microbatch_groups(pools, dp=32)
    with pytest.raises(ValueError, match="DP must be an integer >= 1"):
        microbatch_groups(pools, dp=0)
