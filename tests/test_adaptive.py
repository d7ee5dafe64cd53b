"""``libra-adaptive`` (beyond the paper): the finer head split, Q-home retention order, per-pool choice.

Properties on random windows and pools: the retention order is a permutation that keeps each home within ``C``
(the compiled and Python placers agree in that order: ``tests/compiled_identity/``); and the planner's plans validate, are
deterministic and -- since each pool takes the fastest candidate, the paper's plan among them --
are never priced slower than ``libra``'s, step by step, without device jitter.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_baselines_planners import make_window

from baselines.libra_planners import LibraAdaptiveConfig
from baselines.registry import get_planner
from libra.config import ParallelConfig, TapConfig
from libra.extensions.adaptive.candidates import (
    CANDIDATES,
    CandidateSpace,
    candidate,
    candidate_pools,
    fine_head_split,
)
from libra.extensions.adaptive.rebalance import (
    REBALANCE_MIN_EXCESS,
    exposure_excess,
    rebalance_exposed,
)
from libra.extensions.adaptive.retention import _retained, retention_order
from libra.plan import Plan, PoolPlan, SequenceLayout
from libra.sim.cost import CostModel
from libra.sim.profiles import load_profile
from libra.sim.topology import Topology
from libra.tap.exchange import build_transfers
from libra.tap.placement import PlacementPolicy, place_tiles
from libra.tap.tiles import make_tiles
from libra.workload import AttentionShape

SHAPE = AttentionShape(8, 2, 8)
OPTS = {"block_size": 32, "head_split": 1, "pipeline_chunks": 2, "pool_size": 2}


def _pool(seed: int, p: int = 2, cp: int = 2, per_rank: int = 128):
    rng = np.random.default_rng(seed)
    seqs = []
    for j in range(p):
        n = per_rank * cp
        cuts = np.sort(rng.choice(np.arange(1, n), size=int(rng.integers(0, 6)), replace=False))
        lengths = np.diff(np.r_[0, cuts, n])
        seqs.append(SequenceLayout.contiguous(j, j, lengths, cp))
    return seqs, list(range(p * cp))


@pytest.mark.parametrize("hq, hkv, h, m, want", [(32, 4, 2, 4, 4), (32, 4, 2, 1, 4), (8, 2, 1, 2, 2),
                                                 (8, 2, 4, 2, 4), (12, 3, 1, 8, 1), (4, 4, 1, 2, 2)])
def test_fine_head_split_is_one_kv_head_per_shard_where_possible(hq, hkv, h, m, want):
    tap = TapConfig(head_split=h, pipeline_chunks=m)
    assert fine_head_split(tap, AttentionShape(hq, hkv, 8)) == want


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), tau=st.sampled_from([0.0, 0.03, 0.2]))
def test_retention_order_keeps_homes_within_the_target(seed, tau):
    seqs, workers = _pool(seed, p=2, cp=4, per_rank=64)
    tiles = make_tiles(seqs, 32, 2, SHAPE)
    order = retention_order(tiles, SHAPE, tiles.flops, len(workers), tau)
    assert sorted(order.tolist()) == list(range(len(tiles)))
    placed, fallbacks = place_tiles(tiles, seqs, workers, SHAPE, tau=tau, policy=PlacementPolicy(order=order))
    cap = (1 + tau) * tiles.flops.sum() / len(workers)
    loads = np.bincount(placed.dest, weights=placed.flops, minlength=len(workers))
    assert fallbacks > 0 or loads.max() <= cap * (1 + 1e-9)
    # the retained set: per home, a prefix of its tiles by increasing load per byte, within C
    move_cost = np.random.default_rng(seed).uniform(1, 10, len(tiles))
    keep = _retained(tiles.q_home, tiles.flops, move_cost, cap)
    density = tiles.flops / move_cost
    for w in workers:
        mine = tiles.q_home == w
        assert tiles.flops[keep & mine].sum() <= cap * (1 + 1e-9)
        if (keep & mine).any() and (~keep & mine).any():
            assert density[keep & mine].max() <= density[~keep & mine].min()


def test_order_must_be_a_permutation():
    seqs, workers = _pool(1)
    tiles = make_tiles(seqs, 32, 1, SHAPE)
    with pytest.raises(ValueError, match="permutation"):
        place_tiles(tiles, seqs, workers, SHAPE, policy=PlacementPolicy(order=np.zeros(len(tiles), dtype=np.int64)))


def _price_steps(plans, profile, par):
    cost = CostModel(profile, Topology(profile, par))
    return np.array([cost.price(p).straggler_ms for p in plans])


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), dp=st.sampled_from([2, 4]), cp=st.sampled_from([1, 2]))
def test_adaptive_never_priced_slower_than_libra(seed, dp, cp):
    par = ParallelConfig(dp=dp, cp=cp, gbs=2 * dp, seq_len=512)
    window = make_window(par.gbs, 512, seed)
    profile = load_profile("h100-roce-v1")
    libra = get_planner("libra", **OPTS).plan_window(window, par, SHAPE)
    planner = get_planner("libra-adaptive", **OPTS, profile=profile)
    adaptive = planner.plan_window(window, par, SHAPE)
    for plan in adaptive:
        plan.validate()
        assert len(plan.meta["adaptive_choice"]) == len(plan.pools)
        for choice, pool in zip(plan.meta["adaptive_choice"], plan.pools):
            name, *how = choice.split("+")
            assert candidate(name).name in CANDIDATES and set(how) <= {"rebalanced", "tiles"}
            assert ("tiles" if "tiles" in how else "heads") == pool.chunking
    assert (_price_steps(adaptive, profile, par) <= _price_steps(libra, profile, par) * (1 + 1e-12)).all()
    again = get_planner("libra-adaptive", **OPTS, profile=profile).plan_window(window, par, SHAPE)
    assert [p.digest() for p in adaptive] == [p.digest() for p in again]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), cp=st.sampled_from([1, 2]), chunkings=st.sampled_from([None, ("heads", "tiles")]))
def test_branch_and_bound_choice_is_the_priced_minimum(seed, cp, chunkings):
    """``choose`` drops candidates by their compute bound, in ``price_order``; it must keep exactly
    the option that pricing every one picks (the fastest, ties: the earlier)."""
    from libra.extensions.adaptive.planner import price_order

    price_first = sorted((c.name for c in CANDIDATES.values() if c.price_rank is not None),
                         key=lambda n: CANDIDATES[n].price_rank)

    par = ParallelConfig(dp=2, cp=cp, gbs=2, seq_len=128 * cp)
    seqs, workers = _pool(seed, cp=cp)
    profile = load_profile("h100-roce-v1")
    planner = get_planner("libra-adaptive", **OPTS, profile=profile, candidates=CANDIDATES, chunkings=chunkings,
                          heavy_tile_limits=(1.0, 0.5, 0.25))
    pools = planner.pool_planner(par, SHAPE)[0]
    options = pools.options(0, seqs, workers)
    priced = [pools.pricing.straggler_ms(pools.cost, p, pools.tap) for _, p in options]
    want = min(range(len(options)), key=lambda i: priced[i])
    name, pool = pools.choose(options)
    assert (name, pool.chunking) == (options[want][0], options[want][1].chunking)
    assert pool is options[want][1]
    order = price_order([n for n, _ in options])
    assert sorted(order) == list(range(len(options)))
    firsts = [options[i][0] for i in order if options[i][0] in price_first]
    assert firsts == sorted(firsts, key=price_first.index)  # price_first in its order, before the rest
    assert all(options[i][0] in price_first for i in order[:len(firsts)])


def test_pinned_candidate_is_used_with_one_kv_head_per_tile():
    par = ParallelConfig(dp=2, cp=2, gbs=2, seq_len=512)
    window = make_window(2, 512, 3)
    plans = get_planner("libra-adaptive", **OPTS, candidates=("fine-retain",),
                        chunkings=("heads",)).plan_window(window, par, SHAPE)
    assert [c.split("+")[0] for c in plans[0].meta["adaptive_choice"]] == ["fine-retain"]
    assert [p.chunking for p in plans[0].pools] == ["heads"]
    widths = {int(w) for pool in plans[0].pools for w in pool.tiles.head_end - pool.tiles.head_start}
    assert widths == {4}  # H=1 (8 heads) cut to one KV head's 4 query heads


def test_chunking_choice_is_priced_and_can_be_pinned():
    """By default each candidate runs with its own chunking (``Candidate.chunking``); given ``chunkings``,
    each pool runs its candidate with the faster of them as priced; one chunking pins it."""
    par = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=512)
    window = make_window(8, 512, 5)
    profile = load_profile("h100-roce-v1")
    cost = CostModel(profile, Topology(profile, par))
    default = get_planner("libra-adaptive", **OPTS, profile=profile).plan_window(window, par, SHAPE)
    for plan in default:
        for choice, pool in zip(plan.meta["adaptive_choice"], plan.pools):
            assert pool.chunking == candidate(choice.partition("+")[0]).chunking
    both = get_planner("libra-adaptive", **OPTS, profile=profile, chunkings=("heads", "tiles"),
                       rebalance_passes=0).plan_window(window, par, SHAPE)  # the choice itself, not re-placed
    for plan in both:
        for pool in plan.pools:
            runs = ("heads",) if pool.transfers.hop.any() else ("heads", "tiles")  # relays: head chunks only
            priced = {c: cost.price(replace(plan, pools=(replace(pool, chunking=c),))).straggler_ms for c in runs}
            assert priced[pool.chunking] == min(priced.values())
    tiles = get_planner("libra-adaptive", **OPTS, profile=profile, chunkings="tiles").plan_window(window, par, SHAPE)
    assert {p.chunking for plan in tiles for p in plan.pools} == {"tiles"}
    with pytest.raises(ValueError, match="relay KV, which runs under head chunks only"):
        get_planner("libra-adaptive", **OPTS, profile=profile, candidates=("fine-retain-link-relay",), chunkings="tiles")


@pytest.mark.parametrize("bad, match", [({"candidates": ("nope",)}, "candidates"),
                                        ({"candidates": ()}, "candidates"),
                                        ({"chunkings": ("rows",)}, "chunkings"),
                                        ({"rebalance_passes": -1}, "rebalance_passes"),
                                        ({"rebalance_passes": 1.5}, "rebalance_passes"),
                                        ({"rebalance_passes": True}, "rebalance_passes")])
def test_config_rejects_bad_options(bad, match):
    with pytest.raises(ValueError, match=match):
        LibraAdaptiveConfig(**bad)


def test_link_priced_candidate_needs_link_costs_and_equals_retention_on_one_link_class():
    """``fine-retain-link`` is the retention order placed with each byte priced by its link: with
    one cost on every link it is ``fine-retain``; without ``link_cost`` it is refused."""
    seqs, workers = _pool(4, p=2, cp=4, per_rank=64)
    tap = TapConfig(block_size=32, head_split=1, pipeline_chunks=2)
    kernel = load_profile("h100-roce-v1").kernel
    with pytest.raises(ValueError, match="link_cost"):
        candidate_pools(0, seqs, workers, CandidateSpace(tap, SHAPE, kernel, ("fine-retain-link",)))
    flat = candidate_pools(0, seqs, workers, CandidateSpace(tap, SHAPE, kernel, ("fine-retain", "fine-retain-link"), link_cost=lambda a, b: np.ones(np.broadcast(a, b).shape, dtype=np.int64)))
    assert flat["fine-retain"].tiles.dest.tolist() == flat["fine-retain-link"].tiles.dest.tolist()


def test_link_priced_placement_prefers_the_fast_link():
    """Two 4-GPU 'nodes', P = 4 x CP = 2: one long sample on workers 0-1 must spread. By bytes every
    non-holder costs the same and the less-loaded far node takes worker 0's tiles; priced by link
    (:meth:`Topology.byte_cost`: NVLink 1000, RoCE 9000 per byte) workers 2-3 on its node take what
    fits, and the plan's bytes weighted by their links cost less. Both plans validate."""
    profile = replace(load_profile("h100-roce-v1"), gpus_per_node=4)
    par = ParallelConfig(dp=4, cp=2, gbs=4, seq_len=256)
    topo = Topology(profile, par)
    assert topo.byte_cost(0, 3) == 1000 and topo.byte_cost(0, 4) == 9000 and topo.byte_cost(5, 5) == 0
    seqs = [SequenceLayout.contiguous(0, 0, [256], 2), SequenceLayout.contiguous(1, 1, [64] * 4, 2),
            SequenceLayout.contiguous(2, 2, [16] * 16, 2), SequenceLayout.contiguous(3, 3, [16] * 16, 2)]
    tiles = make_tiles(seqs, 16, 2, SHAPE)
    dest, weighted = [], []
    for link_cost in (None, topo.byte_cost):
        placed, _ = place_tiles(tiles, seqs, list(range(8)), SHAPE, tau=0.03, policy=PlacementPolicy(link_cost=link_cost))
        tr = build_transfers(seqs, placed, SHAPE)
        pool = PoolPlan(pool_index=0, workers=tuple(range(8)), sequences=tuple(seqs), tiles=placed, transfers=tr)
        Plan(method="x", ga_index=0, shape=SHAPE, cp=2, pipeline_chunks=2, pools=(pool,), meta={}).validate()
        dest.append(placed.dest[placed.q_home == 0].tolist())
        weighted.append(int((tr.nbytes.astype(np.int64) * topo.byte_cost(tr.src, tr.dst)).sum()))
    assert set(dest[0]) - {0} <= {4, 5, 6, 7} and {2, 3} <= set(dest[1]), dest
    assert weighted[1] < weighted[0], weighted


def test_split_heavy_tiles_cuts_equal_work_and_keeps_coverage():
    """A tile heavier than the limit becomes ceil(load / limit) token ranges of equal causal area:
    same heads and Q-home, the same rows covered once, the same FLOPs in total."""
    from libra.extensions.adaptive.candidates import split_heavy_tiles  # noqa: PLC0415

    seqs = [SequenceLayout(0, 0, [4096, 512, 512], [0, 2560], [2560, 5120], [0, 1]),
            SequenceLayout(1, 1, [1024] * 5, [0, 2560], [2560, 5120], [2, 3])]
    tiles = make_tiles(seqs, 512, 2, SHAPE)
    limit = 0.3 * float(tiles.flops.max())
    out = split_heavy_tiles(tiles, seqs, SHAPE, tiles.flops, limit)
    assert np.isclose(out.flops.sum(), tiles.flops.sum())
    assert out.flops.max() <= 1.01 * limit
    heavy = tiles.flops > limit
    assert len(out) == len(tiles) - heavy.sum() + np.ceil(tiles.flops[heavy] / limit).sum()
    for t in range(len(tiles)):  # every tile's rows are covered exactly once by its pieces
        own = ((out.seq == tiles.seq[t]) & (out.head_start == tiles.head_start[t]) & (out.q_start >= tiles.q_start[t])
               & (out.q_end <= tiles.q_end[t]))
        assert (out.q_end[own] - out.q_start[own]).sum() == tiles.q_end[t] - tiles.q_start[t]
        assert set(out.q_home[own].tolist()) == {tiles.q_home[t]}
    assert split_heavy_tiles(tiles, seqs, SHAPE, tiles.flops, float(tiles.flops.max())) is tiles


def test_adaptive_plans_with_split_tiles_validate():
    """The default candidates cut a long sample's heaviest tiles; every candidate still validates."""
    from libra.extensions.adaptive.candidates import DEFAULT_CANDIDATES, candidate_pools, fine_head_split  # noqa: PLC0415

    par = ParallelConfig(dp=4, cp=2, gbs=4, seq_len=4096)
    seqs = [SequenceLayout.contiguous(i, i, n, 2) for i, n in enumerate([[4096], [64] * 64, [512] * 8, [128] * 32])]
    profile = load_profile("h100-roce-v1")
    tap = TapConfig(pool_size=4, block_size=2048, head_split=1, pipeline_chunks=2)
    found = candidate_pools(0, seqs, list(range(8)), CandidateSpace(tap, SHAPE, profile.kernel, DEFAULT_CANDIDATES, link_cost=Topology(profile, par).byte_cost))
    fine = found["fine-retain-link"]
    plain = make_tiles(seqs, tap.block_size, fine_head_split(tap, SHAPE), SHAPE)
    assert len(fine.tiles) > len(plain)  # some tile was cut
    assert np.any((fine.tiles.q_end - fine.tiles.q_start) % tap.block_size != 0)
    for pool in found.values():
        Plan("libra-adaptive", 0, SHAPE, cp=2, pipeline_chunks=tap.pipeline_chunks, pools=(pool,)).validate()


def test_heavy_tile_limits_add_finer_cuts_only_where_they_cut():
    """Each later heavy-tile limit that cuts some tile adds the relayed candidate (else every fine
    one) as ``name@limit``, cut finer; a limit that cuts nothing adds nothing; every candidate validates; the planner's
    ``heavy_tile_limits`` pins one and is checked."""
    from libra.extensions.adaptive.candidates import DEFAULT_CANDIDATES  # noqa: PLC0415

    par = ParallelConfig(dp=4, cp=2, gbs=4, seq_len=4096)
    seqs = [SequenceLayout.contiguous(i, i, n, 2) for i, n in enumerate([[4096], [64] * 64, [512] * 8, [128] * 32])]
    profile = load_profile("h100-roce-v1")
    tap = TapConfig(pool_size=4, block_size=2048, head_split=1, pipeline_chunks=2)
    link = Topology(profile, par).byte_cost
    found = candidate_pools(0, seqs, list(range(8)), CandidateSpace(tap, SHAPE, profile.kernel, DEFAULT_CANDIDATES, link_cost=link, limits=(1.0, 0.5, 1e6)))
    assert list(found) == ["alg2-flops", "fine-retain-link", "fine-retain-link-relay",
                           "fine-retain-link-relay@0.5"]  # finer cuts: the relayed plan; 1e6 cuts nothing
    assert len(found["fine-retain-link-relay@0.5"].tiles) > len(found["fine-retain-link-relay"].tiles)
    plain = candidate_pools(0, seqs, list(range(8)), CandidateSpace(tap, SHAPE, profile.kernel, ("fine-retain-link",), link_cost=link, limits=(1.0, 0.5)))
    assert list(plain) == ["fine-retain-link", "fine-retain-link@0.5"]  # no relayed plan asked: every fine one
    assert candidate("fine-retain-link-relay@0.5") is CANDIDATES["fine-retain-link-relay"]
    for pool in found.values():
        Plan("libra-adaptive", 0, SHAPE, cp=2, pipeline_chunks=tap.pipeline_chunks, pools=(pool,)).validate()
    one = candidate_pools(0, seqs, list(range(8)), CandidateSpace(tap, SHAPE, profile.kernel, DEFAULT_CANDIDATES, link_cost=link, limits=(1.0,)))
    assert list(one) == list(found)[:3] and all(one[n].digest() == found[n].digest() for n in one)
    assert get_planner("libra-adaptive", heavy_tile_limits=0.75).config.heavy_tile_limits == (0.75,)
    for bad in ((), (0.0,), (float("nan"),), ("x",)):
        with pytest.raises(ValueError, match="heavy_tile_limits"):
            get_planner("libra-adaptive", heavy_tile_limits=bad)


def _chosen(seed: int, cp: int = 2, **options):
    """``(pools, name, pool, times)``: ``libra-adaptive``'s per-pool planner on a random pool and its
    chosen candidate with the priced ``(compute, exposed)`` per pool worker."""
    par = ParallelConfig(dp=2, cp=cp, gbs=2, seq_len=128 * cp)
    pools = get_planner("libra-adaptive", **OPTS, profile=load_profile("h100-roce-v1"), **options).pool_planner(
        par, SHAPE)[0]
    seqs, workers = _pool(seed, cp=cp)
    return (pools, *pools._choose(pools.options(0, seqs, workers)))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), passes=st.sampled_from([0, 1, 3]))
def test_rebalance_keeps_a_pass_only_when_it_prices_faster(seed, passes):
    """``rebalance`` returns the chosen plan or a re-placed one priced strictly faster (named
    ``+rebalanced``), never re-places below the excess gate, and with 0 passes never at all."""
    pools, name, pool, times = _chosen(seed, rebalance_passes=passes)
    new_name, new = pools.rebalance(name, pool, times)
    before = float((times[0] + times[1]).max())
    if new is pool:
        assert new_name == name
        if passes and exposure_excess(*times) > REBALANCE_MIN_EXCESS and candidate(name).retain:
            first = rebalance_exposed(name, pool, SHAPE, pools.fine_tap, _load(pools, pool), times,
                                      link_cost=pools.cost.topology.byte_cost)
            assert float(sum(pools._worker_ms(first)).max()) >= before  # the first pass was not faster
    else:
        assert passes > 0 and new_name == f"{name}+rebalanced"
        assert float(sum(pools._worker_ms(new)).max()) < before
        assert sorted(new.tiles.flops.tolist()) == sorted(pool.tiles.flops.tolist()) and new.chunking == pool.chunking
        Plan(method="x", ga_index=0, shape=SHAPE, cp=2, pipeline_chunks=OPTS["pipeline_chunks"], pools=(new,),
             meta={}).validate()


def _load(pools, pool):
    from libra.tap.weights import kernel_time_weights
    return kernel_time_weights(pool.tiles, pool.sequences, SHAPE, pools.profile.kernel, pools.tap.pipeline_chunks)


def test_rebalance_exposed_moves_compute_off_the_exposed_worker():
    """A worker whose exposed time is reserved gets less compute; relayed plans stay relayed; a
    candidate that is not a retention placement, or arrays of the wrong length, are refused."""
    seed = next(s for s in range(100) if _chosen(s)[1].startswith("fine-retain-link"))
    pools, name, pool, (compute, exposed) = _chosen(seed)
    load = _load(pools, pool)
    heavy = int(np.argmax(compute))
    fake = np.zeros_like(exposed)
    fake[heavy] = compute.mean()  # as if that worker waited a whole mean share on the wire
    new = rebalance_exposed(name, pool, SHAPE, pools.tap, load, (compute, fake), link_cost=pools.cost.topology.byte_cost)
    after, _ = pools._worker_ms(new)
    assert after[heavy] < compute[heavy]
    Plan(method="x", ga_index=0, shape=SHAPE, cp=2, pipeline_chunks=OPTS["pipeline_chunks"], pools=(new,),
         meta={}).validate()
    with pytest.raises(ValueError, match="re-places"):
        rebalance_exposed("alg2-flops", pool, SHAPE, pools.tap, load, (compute, exposed))
    with pytest.raises(ValueError, match="one entry per pool worker"):
        rebalance_exposed(name, pool, SHAPE, pools.tap, load, (compute[:-1], exposed[:-1]))


def test_exposure_excess():
    assert exposure_excess(np.array([10.0, 10.0]), np.array([0.0, 0.0])) == 0.0
    assert exposure_excess(np.array([10.0, 8.0]), np.array([0.0, 4.0])) == pytest.approx((4 - 2) / 12)
    assert exposure_excess(np.zeros(0), np.zeros(0)) == 0.0


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_more_rebalance_passes_never_price_slower(seed):
    """Pass 1 is the same whatever the count, and the fastest pass is kept: three passes price at
    most what one does."""
    one, name, pool, times = _chosen(seed, rebalance_passes=1)
    three = _chosen(seed, rebalance_passes=3)[0]
    t1 = float(sum(one._worker_ms(one.rebalance(name, pool, times)[1])).max())
    t3 = float(sum(three._worker_ms(three.rebalance(name, pool, times)[1])).max())
    assert t3 <= t1


@pytest.mark.parametrize("hq, hkv, m, deepen, want", [(32, 4, 4, True, 8), (32, 4, 4, False, 4), (32, 4, 8, True, 8),
                                                       (8, 2, 2, True, 4), (8, 8, 2, True, 2), (12, 3, 4, True, 4)])
def test_adaptive_deepens_the_pipeliner_only_where_the_tiles_split(hq, hkv, m, deepen, want):
    """Twice the layout's M where the one-KV-head tiles (hq / hkv heads) and the paper's tiles
    (hq / H) still split into that many head chunks; the layout's M otherwise or when told not to."""
    par = ParallelConfig(dp=2, cp=1, gbs=4, seq_len=512)
    planner = get_planner("libra-adaptive", block_size=32, head_split=1, pipeline_chunks=m, pool_size=2,
                          deepen_pipeline=deepen)
    assert planner.window_tap(par, AttentionShape(hq, hkv, 8)).pipeline_chunks == want
    assert planner.window_tap(par).pipeline_chunks == m  # no shape: the layout's


def test_deepened_plans_run_deeper_and_fall_back_where_priced_slower():
    """On 128K sequences of the paper's head shape the deeper Pipeliner prices faster and the Plans
    run it; on 512-token sequences its chunk latencies outweigh what it hides, and every Plan is
    planned again at the layout's M (then it is the layout's plan). Each Plan's meta records the M
    it runs."""
    profile = load_profile("h100-roce-v1")
    for S, cp, shape, opts, runs in ((131072, 8, AttentionShape(32, 4, 128),
                                      {"block_size": 4096, "head_split": 2, "pipeline_chunks": 4, "pool_size": 2}, 8),
                                     (512, 1, SHAPE, OPTS, 2)):
        par = ParallelConfig(dp=2, cp=cp, gbs=4, seq_len=S)
        window = make_window(par.gbs, S, 0)
        # the deepening as the planning profile prices it (the ensemble guard is tests/test_adaptive_robust.py's)
        deep = get_planner("libra-adaptive", **opts, profile=profile, ensemble=None).plan_window(window, par, shape)
        flat = get_planner("libra-adaptive", **opts, profile=profile, ensemble=None,
                           deepen_pipeline=False).plan_window(window, par, shape)
        assert [p.pipeline_chunks for p in deep] == [runs] * len(deep)
        assert all(p.meta["pipeline_chunks"] == runs and p.meta["layout_pipeline_chunks"] == opts["pipeline_chunks"]
                   for p in deep)
        if runs == opts["pipeline_chunks"]:
            assert [p.digest() for p in deep] == [replace(f, meta=d.meta).digest() for d, f in zip(deep, flat)]
        else:
            # faster over the window; per step the guard only promises no slower than the paper's plan
            # at the layout's M (one step here prices 0.14% slower than the flat adaptive plan)
            assert _price_steps(deep, profile, par).sum() < _price_steps(flat, profile, par).sum()


def test_deepen_pipeline_must_be_a_bool():
    with pytest.raises(ValueError, match="deepen_pipeline"):
        LibraAdaptiveConfig(deepen_pipeline="yes")


def test_fine_tau_places_only_the_fine_candidates_to_its_slack():
    """``fine_tau`` is the slack of the fine candidates alone: they are the plans of a layout with that
    ``tau``, the paper's plan keeps the layout's; the planner passes its ``fine_tau`` on, records it,
    and checks it."""
    from libra.extensions.adaptive.candidates import DEFAULT_CANDIDATES  # noqa: PLC0415

    par = ParallelConfig(dp=4, cp=2, gbs=4, seq_len=4096)
    seqs = [SequenceLayout.contiguous(i, i, n, 2) for i, n in enumerate([[4096], [64] * 64, [512] * 8, [128] * 32])]
    profile = load_profile("h100-roce-v1")
    tap = TapConfig(pool_size=4, block_size=2048, head_split=1, pipeline_chunks=2, tau=0.3)
    link = Topology(profile, par).byte_cost

    def build(t, **kw):
        return candidate_pools(0, seqs, list(range(8)), CandidateSpace(t, SHAPE, profile.kernel, DEFAULT_CANDIDATES, link_cost=link, **kw))

    layout, tight, loose = build(tap), build(tap, fine_tau=0.0), build(replace(tap, tau=0.0))
    assert tight["alg2-flops"].digest() == layout["alg2-flops"].digest()
    assert all(tight[n].digest() == loose[n].digest() for n in tight if candidate(n).fine)
    assert any(tight[n].digest() != layout[n].digest() for n in tight if candidate(n).fine)  # the slack mattered here
    assert LibraAdaptiveConfig().fine_tau == 0.01 and LibraAdaptiveConfig(fine_tau=None).fine_tau is None
    window = make_window(4, 512, 3)
    plans = get_planner("libra-adaptive", **OPTS, fine_tau=0.0).plan_window(window, ParallelConfig(dp=2, cp=1, gbs=4,
                                                                                                   seq_len=512), SHAPE)
    assert all(p.meta["fine_tau"] == 0.0 for p in plans)
    for bad in (-0.01, float("nan"), float("inf"), True, "0.01"):
        with pytest.raises(ValueError, match="fine_tau"):
            LibraAdaptiveConfig(fine_tau=bad)
