"""Every planner on random long-tailed windows: valid Plans, pool membership, determinism.

Small shapes (S = 512, B = 32, 8 query heads) keep each example to milliseconds.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.registry import PLANNERS, get_planner
from libra.config import ParallelConfig
from libra.data.packing import PackedSequence, pack_fixed_tokens
from libra.vrsp import microbatch_groups, vrsp
from libra.workload import AttentionShape, packed_flops, packed_workloads

SHAPE = AttentionShape(8, 2, 8)
TAP_OPTS = {"block_size": 32, "head_split": 2}


def make_window(gbs: int, seq_len: int, seed: int) -> list[PackedSequence]:
    """Long-tailed lengths (lognormal body + samples longer than S that get split), fixed-token packed."""
    rng = np.random.default_rng(seed)
    n = 40 * gbs
    lens = np.maximum(1, rng.lognormal(np.log(seq_len / 16), 1.4, n)).astype(np.int64)
    lens[rng.random(n) < 0.02] = int(1.5 * seq_len)
    seqs = pack_fixed_tokens(lens, seq_len)[:gbs]
    return [PackedSequence(j, s.sample_lengths, s.sample_ids) for j, s in enumerate(seqs)]


def deterministic_plans(name: str, window, par: ParallelConfig, shape: AttentionShape = SHAPE, **opts) -> list:
    """``name``'s Plans of ``window``, after checking a second planner instance plans them identically."""
    plans = get_planner(name, **opts).plan_window(window, par, shape)
    assert [p.digest() for p in plans] == [p.digest() for p in get_planner(name, **opts).plan_window(window, par, shape)]
    return plans


def options(name: str, pool_size: int) -> dict:
    if name in ("ulysses", "ulysses-sorted", "wlb-llm", "distca", "dynamic-cp"):
        return {}
    if name == "distca-paper":
        return dict(TAP_OPTS)
    return dict(TAP_OPTS, pool_size=pool_size)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), dp=st.sampled_from([2, 4]), cp=st.sampled_from([1, 2, 4]),
       ga=st.integers(1, 2), name=st.sampled_from(list(PLANNERS)))
def test_every_planner_gives_valid_plans(seed, dp, cp, ga, name):
    par = ParallelConfig(dp=dp, cp=cp, gbs=dp * ga, seq_len=512)
    window = make_window(par.gbs, 512, seed)
    planner = get_planner(name, **options(name, 2))
    plans = planner.plan_window(window, par, SHAPE)
    assert [p.ga_index for p in plans] == list(range(len(plans)))
    assert len(plans) == ga or name == "dynamic-cp"                 # dynamic CP forms its own microbatches
    workers = set()
    for plan in plans:
        plan.validate()
        assert plan.method == name and plan.cp == cp and plan.pipeline_chunks == planner.pipeline_chunks
        assert plan.meta                                            # method parameters recorded
        pool_workers = [w for pool in plan.pools for w in pool.workers]
        assert sorted(pool_workers) == list(range(dp * cp))         # pools tile the PP stage
        workers |= set(pool_workers)
    if name != "wlb-llm":                                           # fixed-token methods keep FLOPs
        total = sum(pool.tiles.flops.sum() for plan in plans for pool in plan.pools)
        assert total == pytest.approx(sum(packed_flops(s.sample_lengths, SHAPE) for s in window))
    again = get_planner(name, **options(name, 2)).plan_window(window, par, SHAPE)
    assert [p.digest() for p in plans] == [p.digest() for p in again]


def test_distca_paper_pool_spans_all_workers_flops_only():
    par = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=512)
    plans = get_planner("distca-paper", **TAP_OPTS).plan_window(make_window(8, 512, 1), par, SHAPE)
    for plan in plans:
        (pool,) = plan.pools
        assert pool.workers == tuple(range(8))
        assert plan.meta["pool_size"] == 4 and plan.meta["comm_aware"] is False
        assert plan.pipeline_chunks == 4
        assert sorted(s.dp_rank for s in pool.sequences) == [0, 1, 2, 3]


def pool_members(plan) -> list[set[int]]:
    return [{s.seq_id for s in pool.sequences} for pool in plan.pools]


def test_libra_pools_are_vrsp_pools():
    par = ParallelConfig(dp=4, cp=2, gbs=16, seq_len=512)
    window = make_window(16, 512, 7)
    pools = vrsp(packed_workloads([s.sample_lengths for s in window]), 2)
    groups = microbatch_groups(pools, par.dp)
    for name in ("libra-tap-vrsp", "libra"):
        plans = get_planner(name, pool_size=2, **TAP_OPTS).plan_window(window, par, SHAPE)
        got = [m for plan in plans for m in pool_members(plan)]
        assert sorted(map(sorted, got)) == sorted(sorted(p) for p in pools.tolist())
        for g, plan in enumerate(plans):
            for pool in plan.pools:
                for s in pool.sequences:
                    assert groups[g, s.dp_rank] == s.seq_id                 # microbatch_groups mapping
                    assert set(pool.workers) >= set(range(s.dp_rank * 2, s.dp_rank * 2 + 2))


def test_libra_tap_uses_production_order():
    par = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=512)
    plans = get_planner("libra-tap", pool_size=2, **TAP_OPTS).plan_window(make_window(8, 512, 3), par, SHAPE)
    assert [pool_members(p) for p in plans] == [[{0, 1}, {2, 3}], [{4, 5}, {6, 7}]]
    assert plans[1].pools[1].workers == tuple(range(4, 8))


def test_pipeliner_changes_execution_not_placement():
    par = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=512)
    window = make_window(8, 512, 11)
    base = get_planner("libra-tap-vrsp", pool_size=2, **TAP_OPTS).plan_window(window, par, SHAPE)
    full = get_planner("libra", pool_size=2, **TAP_OPTS).plan_window(window, par, SHAPE)
    for a, b in zip(base, full):
        assert (a.pipeline_chunks, b.pipeline_chunks) == (1, 4)
        assert [p.digest() for p in a.pools] == [p.digest() for p in b.pools]


def test_tap_pools_balance_better_than_ulysses():
    # one heavy sequence next to light ones: TAP spreads it over the pool, Ulysses cannot
    par = ParallelConfig(dp=4, cp=2, gbs=4, seq_len=512)
    window = [PackedSequence(0, [512], [0])] + [PackedSequence(i, [16] * 32, range(32 * i, 32 * i + 32))
                                                for i in range(1, 4)]
    uly = get_planner("ulysses").plan_window(window, par, SHAPE)[0]
    lib = get_planner("libra-tap", pool_size=4, **TAP_OPTS).plan_window(window, par, SHAPE)[0]
    uly_max = max(p.worker_flops().max() for p in uly.pools)
    lib_flops = lib.pools[0].worker_flops()
    assert lib_flops.max() < 0.5 * uly_max
    assert lib_flops.max() <= (1 + 0.03) * lib_flops.mean() or lib.pools[0].fallback_tiles > 0
