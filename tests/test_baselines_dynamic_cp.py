"""Megatron's dynamic context parallelism (``dynamic-cp``): CP group sizes, balanced microbatches over
all DP x CP ranks, and the Plans (every token once, chunks computed at home, deterministic)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_baselines_planners import deterministic_plans, make_window

from baselines.dynamic_cp_schedule import equal_work_buckets, fill_idle_ranks, gpus_needed, schedule, workload
from baselines.registry import get_planner
from libra.config import ParallelConfig
from libra.workload import AttentionShape, packed_flops

SHAPE = AttentionShape(8, 2, 8)


def test_cp_size_is_the_smallest_power_of_two_that_holds_the_sample():
    assert [gpus_needed(n, 100) for n in (1, 100, 101, 200, 201, 399, 400, 401)] == [1, 1, 2, 2, 4, 4, 4, 8]
    assert gpus_needed(50, 100, min_cp=2) == 2 and gpus_needed(300, 100, min_cp=2) == 4
    assert workload(300, 100) == 300 * 300 / 4


def test_one_bucket_per_cp_size_of_about_equal_work():
    samples = [(i, n) for i, n in enumerate([400, 390, 150, 120, 110, 60, 50, 40, 30, 20])]
    buckets = equal_work_buckets(samples, 100, 1)
    assert len(buckets) == 3                                     # CP sizes 4, 2 and 1
    assert [s for b in buckets for s in b] == samples            # order kept, nothing lost


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), ranks=st.sampled_from([4, 8, 16]), per_rank=st.sampled_from([64, 128]))
def test_every_sample_is_placed_once_on_power_of_two_groups_covering_all_ranks(seed, ranks, per_rank):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(3.5, 1.3, 60).astype(int) + 1, ranks * per_rank)
    samples = list(enumerate(lengths.tolist()))
    out = schedule(samples, ranks, per_rank)
    placed = [sid for groups in out for g in groups for sid in g.samples]
    assert sorted(placed) == list(range(len(samples)))
    for groups in out:
        covered = np.zeros(ranks, dtype=int)
        for g in groups:
            covered[g.start:g.start + g.size] += 1
            assert g.size & (g.size - 1) == 0                    # a power of two
            need = max(gpus_needed(lengths[s], per_rank) for s in g.samples)
            assert g.size >= need                                # grown only by filling idle ranks
            assert sum(lengths[s] for s in g.samples) / g.size <= per_rank + 1e-9
        assert np.all(covered == 1)
    assert schedule(samples, ranks, per_rank) == out             # deterministic


def test_idle_ranks_double_the_first_smallest_group():
    groups = fill_idle_ranks([0, 2, 3], [2, 1, 1], [[0], [1], [2]], 8)
    assert [(g.start, g.size, g.samples) for g in groups] == [(0, 4, (0,)), (4, 2, (1,)), (6, 2, (2,))]
    with pytest.raises(ValueError, match="must be a power of two"):
        fill_idle_ranks([0, 4], [4, 2], [[0], [1]], 7)   # 1 idle rank cannot double a group of 2


def test_a_sample_longer_than_all_ranks_is_refused():
    with pytest.raises(ValueError, match="a sample of 900 tokens needs more than 8 ranks of 100"):
        schedule([(0, 900)], 8, 100)


PAR = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=512)


def test_plans_compute_every_token_once_at_home():
    window = make_window(8, 512, 3)
    plans = deterministic_plans("dynamic-cp", window, PAR)
    assert [p.ga_index for p in plans] == list(range(len(plans)))
    total = 0.0
    for plan in plans:
        plan.validate()
        (pool,) = plan.pools
        assert pool.workers == tuple(range(8))
        assert np.array_equal(pool.tiles.dest, pool.tiles.q_home)          # no query leaves its rank
        assert set(pool.transfers.kind.tolist()) <= {1}                   # only KV moves
        held = np.zeros(8)
        for s in pool.sequences:                                          # each group holds <= S/CP per rank
            np.add.at(held, s.holder_worker, s.holder_end - s.holder_start)
        assert np.all(held <= 256)
        assert sum(plan.meta["cp_groups"].values()) == len(pool.sequences)
        total += pool.tiles.flops.sum()
    assert total == pytest.approx(sum(packed_flops(s.sample_lengths, SHAPE) for s in window))


def test_a_long_sample_gets_a_larger_group_with_balanced_chunks():
    from libra.data.packing import PackedSequence

    window = [PackedSequence(0, [512], [0])] + [PackedSequence(i, [8] * 64, np.arange(64)) for i in range(1, 8)]
    plans = get_planner("dynamic-cp").plan_window(window, PAR, SHAPE)
    first = plans[0].pools[0].sequences[0]
    assert first.sample_lengths.tolist() == [512] and sorted(set(first.holder_worker.tolist())) == [0, 1]
    tokens = np.bincount(first.holder_worker, weights=first.holder_end - first.holder_start)
    assert tokens.tolist() == [256, 256]                                  # chunks r and 2 x size - 1 - r
    flops = plans[0].pools[0].worker_flops()
    assert flops[0] == pytest.approx(flops[1])                            # the zig-zag balances the triangle
