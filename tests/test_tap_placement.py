"""Algorithm 2 (Libra sec. 4.3.2): hand-computed cases, the oracle, C and the fallback, bad input,
placement by caller weights (``place_tiles(weights=...)``, which ``libra-kt`` uses) and from
reserved per-worker loads (the compiled placer against the Python one: ``tests/compiled_identity/``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tap_strategies import gqa_pools, oracle_place, placed_with, pools, scattered_pools

from libra.plan import SequenceLayout, TileTable, pool_index
from libra.tap import build_transfers, make_tiles, place_tiles
from libra.tap.placement import (
    PlacementArrays,
    PlacementPolicy,
    _place_dense,
    _place_grouped,
    available_placers,
    is_block_partition,
)
from libra.workload import AttentionShape

UNIT = AttentionShape(num_q_heads=1, num_kv_heads=1, head_dim=1, dtype_bytes=2)  # FLOPs = 4 * area


def _seq(seq_id, lengths, holders, per_rank):
    starts = np.arange(len(holders)) * per_rank
    return SequenceLayout(seq_id, seq_id, lengths, starts, starts + per_rank, holders)


def _loads(placed, workers):
    return {w: float(placed.flops[placed.dest == w].sum()) for w in workers}


def _arrays(sequences, wsorted, order, load, cap) -> PlacementArrays:
    """The bundle ``place_tiles`` builds, with nothing reserved and every moved byte costing 1."""
    return PlacementArrays(wsorted, order, load, cap, np.zeros(len(wsorted)), pool_index(sequences))


def test_home_first_and_least_communication():
    """Two workers, one 8-token sequence per worker; everything fits at home: nothing moves."""
    seqs = [_seq(0, [4, 4], [0], 8), _seq(1, [4, 4], [1], 8)]
    tiles = make_tiles(seqs, 4, 1, UNIT)
    placed, fb = place_tiles(tiles, seqs, [0, 1], UNIT, tau=0.0)
    assert placed.dest.tolist() == [0, 0, 1, 1] and fb == 0
    assert len(build_transfers(seqs, placed, UNIT)) == 0


def test_greedy_is_not_optimal_in_communication():
    """Algorithm 2 is a greedy heuristic, and here provably not communication-optimal.

    Worker 0 holds tiles A (area 10: one 4-token sample), B and C (area 5 each: samples 2,1,1);
    worker 1 holds tile D (area 4: samples 1,1,1,1). Total area 24, so with tau = 0 the cap is
    C = 12 (x4 FLOPs). Every 2-way split has max area >= 14 (A plus anything is >= 14; without A the
    rest sums to 14), so 14 is the optimal makespan and moving only A achieves it with one tile of
    traffic. Greedy (heaviest first): A stays home (10 <= 12); B cannot stay (15 > 12) and moves to
    worker 1; C moves too (worker 1: 10 <= 12); D fits nowhere (14 > 12 on both) and the fallback
    sends it to the least-loaded worker with the lowest id, worker 0. Result: makespan 14 as well,
    but three tiles moved instead of one (96 bytes of Q+KV+O instead of 32).
    """
    seqs = [_seq(0, [4, 2, 1, 1, 2, 1, 1], [0], 12), _seq(1, [1, 1, 1, 1], [1], 4)]
    tiles = make_tiles(seqs, 4, 1, UNIT)
    assert (tiles.flops / 4).tolist() == [10, 5, 5, 4]
    placed, fb = place_tiles(tiles, seqs, [0, 1], UNIT, tau=0.0)
    assert placed.dest.tolist() == [0, 1, 1, 0]
    assert fb == 1
    greedy = build_transfers(seqs, placed, UNIT)
    better = build_transfers(seqs, placed_with(tiles, [1, 0, 0, 1]), UNIT)
    assert max(_loads(placed, [0, 1]).values()) == max(_loads(placed_with(tiles, [1, 0, 0, 1]), [0, 1]).values())
    assert int(greedy.nbytes.sum()) == 96 and int(better.nbytes.sum()) == 32


def test_flops_only_is_lpt_and_not_optimal_in_balance():
    """comm_aware=False is capacity-bounded LPT; jobs 6,6,4,4,4 on two workers (the classic LPT
    counterexample): LPT reaches 14 + fallback while {6,6} / {4,4,4} balances exactly at 12.

    Areas: blocks [2,2] have area 6, blocks [1,1,1,1] area 4.
    """
    seqs = [_seq(0, [2, 2, 2, 2, 1, 1, 1, 1], [0], 12), _seq(1, [1] * 8, [1], 8)]
    tiles = make_tiles(seqs, 4, 1, UNIT)
    assert (tiles.flops / 4).tolist() == [6, 6, 4, 4, 4]
    placed, fb = place_tiles(tiles, seqs, [0, 1], UNIT, tau=0.0, policy=PlacementPolicy(comm_aware=False))
    assert placed.dest.tolist() == [0, 1, 0, 1, 0] and fb == 1
    assert sorted(_loads(placed, [0, 1]).values()) == [4 * 10, 4 * 14]
    # the communication-aware placer keeps the two heavy tiles home and moves the third block
    placed_c, fb_c = place_tiles(tiles, seqs, [0, 1], UNIT, tau=0.0)
    assert placed_c.dest.tolist() == [0, 0, 1, 1, 1] and fb_c == 0


def test_long_sample_across_holders_matches_oracle():
    """One 8-token sample spans the ranges of workers 0 and 1 (KV fetched across holders, partial
    prefixes re-used); the heaviest tile (area 15) exceeds C = 40/3 alone, so the fallback fires."""
    shape = UNIT
    # sequence 0: one 8-token sample held by workers 0 ([0,4)) and 1 ([4,8)); worker 2 holds seq 1
    seqs = [_seq(0, [8], [0, 1], 4), _seq(1, [1] * 4, [2], 4)]
    tiles = make_tiles(seqs, 2, 1, shape)
    dest, fb = oracle_place(tiles, seqs, [0, 1, 2], shape, tau=0.0)
    placed, fb2 = place_tiles(tiles, seqs, [0, 1, 2], shape, tau=0.0)
    assert placed.dest.tolist() == dest and fb == fb2 and fb >= 1


def test_block_partition_detection():
    seqs = [_seq(0, [8], [0], 8)]
    tiles = make_tiles(seqs, 4, 1, UNIT)
    assert is_block_partition(tiles)
    cols = {k: getattr(tiles, k) for k in tiles.FIELDS}
    cols["q_start"] = np.array([0, 2])
    from libra.plan import TileTable

    assert not is_block_partition(TileTable(**cols))


@pytest.mark.parametrize("tau", [-0.01, float("nan"), "0.1", True])
def test_bad_tau(tau):
    seqs = [_seq(0, [8], [0], 8)]
    tiles = make_tiles(seqs, 4, 1, UNIT)
    with pytest.raises(ValueError, match="tau"):
        place_tiles(tiles, seqs, [0], UNIT, tau=tau)


def test_bad_workers():
    seqs = [_seq(0, [8], [3], 8)]
    tiles = make_tiles(seqs, 4, 1, UNIT)
    with pytest.raises(ValueError, match="worker 3 holds sequence tokens but is not a pool worker"):
        place_tiles(tiles, seqs, [0, 1], UNIT)  # make_tiles' tiles: their Q-home is a holder
    with pytest.raises(ValueError, match="Q-home worker 3"):
        place_tiles(TileTable(**{k: getattr(tiles, k) for k in TileTable.FIELDS}), seqs, [0, 1], UNIT)
    with pytest.raises(ValueError, match="distinct"):
        place_tiles(tiles, seqs, [3, 3], UNIT)
    with pytest.raises(ValueError, match="at least one worker"):
        place_tiles(tiles, seqs, [], UNIT)


@settings(max_examples=100, deadline=None)
@given(pools(), st.sampled_from([0.0, 0.03, 0.3]), st.booleans())
def test_matches_oracle_and_respects_cap(pool, tau, comm_aware):
    """The optimised placer equals the plain oracle; loads stay <= C unless a fallback fired."""
    sequences, workers, block, head_split, shape = pool
    tiles = make_tiles(sequences, block, head_split, shape)
    placed, fb = place_tiles(tiles, sequences, workers, shape, tau=tau, policy=PlacementPolicy(comm_aware=comm_aware))
    dest, fb_o = oracle_place(tiles, sequences, workers, shape, tau, comm_aware)
    assert placed.dest.tolist() == dest
    assert fb == fb_o
    cap = (1 + tau) * tiles.flops.sum() / len(workers)
    loads = np.array(list(_loads(placed, workers).values()))
    if fb == 0:
        assert loads.max() <= cap * (1 + 1e-12)
    assert np.array_equal(placed.flops, tiles.flops) and np.array_equal(placed.q_home, tiles.q_home)


@settings(max_examples=25, deadline=None)
@given(pools(max_cp=4, max_p=3))
def test_grouped_equals_dense(pool):
    """The grouped (fast) and dense (bitmap) implementations choose identically."""
    sequences, workers, block, head_split, shape = pool
    tiles = make_tiles(sequences, block, head_split, shape)
    w = np.array(sorted(workers))
    cap = 1.03 * tiles.flops.sum() / len(w)
    order = np.argsort(-tiles.flops, kind="stable")
    arrays = _arrays(sequences, w, order, tiles.flops, cap)
    d1, f1 = _place_grouped(tiles, shape, arrays)
    d2, f2 = _place_dense(tiles, sequences, shape, arrays)
    assert np.array_equal(d1, d2) and f1 == f2


def test_deterministic_and_order_of_workers_irrelevant():
    rng = np.random.default_rng(0)
    lengths = [list(rng.integers(1, 300, 40)) for _ in range(4)]
    seqs = []
    for j, ls in enumerate(lengths):
        ls = np.array(ls)
        total = 64 * 8
        ls = np.concatenate((ls[np.cumsum(ls) < total], [0]))
        ls[-1] = total - ls[:-1].sum()
        ls = ls[ls > 0]
        seqs.append(SequenceLayout.contiguous(j, j, ls, 4))
    shape = AttentionShape(8, 2, 4, 2)
    tiles = make_tiles(seqs, 32, 2, shape)
    a, fa = place_tiles(tiles, seqs, list(range(16)), shape)
    b, fb = place_tiles(tiles, seqs, list(reversed(range(16))), shape)
    assert np.array_equal(a.dest, b.dest) and fa == fb


def test_tile_outside_its_holder_range_rejected():
    seqs = [_seq(0, [8], [0, 1], 4)]
    tiles = make_tiles(seqs, 4, 1, UNIT)
    cols = {k: getattr(tiles, k) for k in tiles.FIELDS}
    cols["q_home"] = np.array([1, 1])
    from libra.plan import TileTable

    with pytest.raises(ValueError, match=r"tile 0 .* must lie in one holder range held by its q_home 1"):
        place_tiles(TileTable(**cols), seqs, [0, 1], UNIT)


@settings(max_examples=80, deadline=None)
@given(scattered_pools(), st.sampled_from([0.0, 0.03]))
def test_scattered_layouts_match_oracle(pool, tau):
    """Holder partitions with several ranges per worker: placement still equals the oracle."""
    sequences, workers, tiles, shape = pool
    placed, fb = place_tiles(tiles, sequences, workers, shape, tau=tau)
    dest, fb_o = oracle_place(tiles, sequences, workers, shape, tau)
    assert placed.dest.tolist() == dest and fb == fb_o


def _links(a, b):
    """An arbitrary non-negative integer byte cost (asymmetric, pairs of workers share a 'node')."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    return np.where(a == b, 0, 1 + 4 * (a // 2 != b // 2) + (a + 2 * b) % 3)


@settings(max_examples=60, deadline=None)
@given(pools(), st.sampled_from([0.0, 0.03, 0.3]))
def test_link_priced_placement_matches_oracle(pool, tau):
    """``link_cost``: every byte weighted by the link it crosses (Q/O: Q-home <-> worker; KV: the
    token's holder -> worker), exactly as the plain oracle prices it."""
    sequences, workers, block, head_split, shape = pool
    tiles = make_tiles(sequences, block, head_split, shape)
    placed, fb = place_tiles(tiles, sequences, workers, shape, tau=tau, placer="python", policy=PlacementPolicy(link_cost=_links))
    assert (placed.dest.tolist(), fb) == oracle_place(tiles, sequences, workers, shape, tau, link_cost=_links)


@settings(max_examples=30, deadline=None)
@given(pools(max_cp=4, max_p=3))
def test_unit_link_cost_is_algorithm_2(pool):
    """A byte costing 1 on every link is the paper's Algorithm 2 (the dense placer then runs)."""
    sequences, workers, block, head_split, shape = pool
    tiles = make_tiles(sequences, block, head_split, shape)
    ref = place_tiles(tiles, sequences, workers, shape, placer="python")
    got = place_tiles(tiles, sequences, workers, shape, placer="python", policy=PlacementPolicy(link_cost=lambda a, b: np.ones(np.broadcast(a, b).shape, dtype=np.int64)))
    assert got[0].dest.tolist() == ref[0].dest.tolist() and got[1] == ref[1]


def test_link_priced_placement_keeps_bytes_on_the_fast_link():
    """Worker 0 must shed one of its two tiles (loads 3 + 3 > C = 1.7 * 9 / 3). By bytes, workers 1
    (load 2) and 2 (load 1) cost the same and the less-loaded worker 2 takes it; priced by link,
    worker 1 -- on worker 0's 'node' -- is cheaper (``_links``: 3 vs 6 per byte)."""
    seqs = [_seq(0, [2, 2], [0], 4), _seq(1, [2], [1], 2), _seq(2, [2], [2], 2)]
    tiles = make_tiles(seqs, 2, 1, UNIT)
    kwargs = {"tau": 0.7, "weights": [3.0, 3.0, 2.0, 1.0]}
    order = [2, 3, 0, 1]
    assert int(_links(0, 1)) == 3 and int(_links(0, 2)) == 6
    for placer in ("python", "numba") if "numba" in available_placers() else ("python",):
        by_bytes = place_tiles(tiles, seqs, [0, 1, 2], UNIT, placer=placer, **kwargs,
                               policy=PlacementPolicy(order=order))
        by_link = place_tiles(tiles, seqs, [0, 1, 2], UNIT, placer=placer, **kwargs,
                              policy=PlacementPolicy(order=order, link_cost=_links))
        assert by_bytes[0].dest.tolist() == [0, 2, 1, 2] and by_link[0].dest.tolist() == [0, 1, 1, 2]


@pytest.mark.parametrize("bad, match", [
    (lambda a, b: np.zeros(np.broadcast(a, b).shape), "non-negative integer"),
    (lambda a, b: -np.ones(np.broadcast(a, b).shape, dtype=np.int64), "non-negative integer"),
    (lambda a, b: np.zeros(3, dtype=np.int64), "shape"),
    (lambda a: a, "link_cost failed"),  # not a function of (src, dst)
])
def test_bad_link_cost(bad, match):
    seqs = [_seq(0, [4, 4], [0], 8), _seq(1, [4, 4], [1], 8)]
    tiles = make_tiles(seqs, 4, 1, UNIT)
    with pytest.raises(ValueError, match=match):
        place_tiles(tiles, seqs, [0, 1], UNIT, policy=PlacementPolicy(link_cost=bad))


# --------------------------------------------------------------------------------------------
# place_tiles(weights=...)
# --------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(pool=pools(), tau=st.sampled_from([0.0, 0.03, 0.2]), comm_aware=st.booleans())
def test_weights_equal_to_flops_place_identically(pool, tau, comm_aware):
    sequences, workers, block, head_split, shape = pool
    tiles = make_tiles(sequences, block, head_split, shape)
    ref, fb_ref = place_tiles(tiles, sequences, workers, shape, tau=tau, policy=PlacementPolicy(comm_aware=comm_aware))
    got, fb = place_tiles(tiles, sequences, workers, shape, tau=tau, weights=tiles.flops.copy(), policy=PlacementPolicy(comm_aware=comm_aware))
    assert got.dest.tolist() == ref.dest.tolist() and fb == fb_ref


@settings(max_examples=25, deadline=None)
@given(pool=pools(), tau=st.sampled_from([0.0, 0.03, 0.2]), seed=st.integers(0, 1000))
def test_grouped_and_dense_agree_under_weights(pool, tau, seed):
    """The two implementations make the same choices for arbitrary weights, not only FLOPs."""
    sequences, workers, block, head_split, shape = pool
    tiles = make_tiles(sequences, block, head_split, shape)
    w = np.random.default_rng(seed).uniform(0.1, 5.0, len(tiles))
    wsorted = np.sort(np.asarray(workers))
    order = np.argsort(-w, kind="stable")
    cap = (1.0 + tau) * w.sum() / len(wsorted)
    arrays = _arrays(sequences, wsorted, order, w, cap)
    d1, f1 = _place_grouped(tiles, shape, arrays)
    d2, f2 = _place_dense(tiles, sequences, shape, arrays)
    assert d1.tolist() == d2.tolist() and f1 == f2


@pytest.mark.parametrize("comm_aware", [True, False])
def test_unequal_weights_place_by_weight(comm_aware):
    """16 one-token samples, blocks of 4: four tiles of equal FLOPs (area 4), tiles 0-1 held by
    worker 0, tiles 2-3 by worker 1. By FLOPs (tau 0, C = 2 tiles) each worker keeps its own two.
    With weights (3, 1, 1, 1), C = 3: tile 0 fills worker 0, so tile 1 must go to worker 1
    (1 + 1 + 1 = 3 <= C there) and worker 1 ends with three tiles."""
    seqs = [_seq(0, [1] * 16, [0, 1], 8)]
    tiles = make_tiles(seqs, 4, 1, UNIT)
    assert tiles.flops.tolist() == [16.0] * 4
    by_flops, fb0 = place_tiles(tiles, seqs, [0, 1], UNIT, tau=0.0, policy=PlacementPolicy(comm_aware=comm_aware))
    by_weight, fb1 = place_tiles(tiles, seqs, [0, 1], UNIT, tau=0.0, weights=[3.0, 1.0, 1.0, 1.0], policy=PlacementPolicy(comm_aware=comm_aware))
    assert fb0 == 0 and fb1 == 0
    assert sorted(np.bincount(by_flops.dest, minlength=2).tolist()) == [2, 2]
    assert by_weight.dest.tolist()[0] == 0 and np.bincount(by_weight.dest, minlength=2).tolist() == [1, 3]
    assert by_weight.flops.tolist() == tiles.flops.tolist()  # FLOPs stay FLOPs; only the load differs


@pytest.mark.parametrize("weights,match", [
    ([1.0, 1.0, 1.0], r"shape \(4,\)"),
    ([1.0, float("nan"), 1.0, 1.0], "tile 1 has nan"),
    ([1.0, 1.0, -2.0, 1.0], "tile 2 has -2.0"),
    (["a", "b", "c", "d"], "must be numbers"),
])
def test_bad_weights_are_value_errors(weights, match):
    seqs = [_seq(0, [1] * 16, [0, 1], 8)]
    tiles = make_tiles(seqs, 4, 1, UNIT)
    with pytest.raises(ValueError, match=match):
        place_tiles(tiles, seqs, [0, 1], UNIT, weights=weights)


@settings(max_examples=40, deadline=None)
@given(pool=gqa_pools(), tau=st.sampled_from([0.0, 0.03, 0.5]), comm_aware=st.booleans(),
       link=st.booleans(), data=st.data())
def test_reserved_loads_count_in_the_cap(pool, tau, comm_aware, link, data):
    """``reserved``: zeros are the paper's placement exactly, in every placer (grouped, dense,
    FLOPs-only); reserved loads count in ``C``."""
    sequences, workers, tiles, shape = pool
    cost = (lambda a, b: 1 + (np.asarray(a) // 2 != np.asarray(b) // 2)) if link else None
    reserved = np.array(data.draw(st.lists(st.integers(0, 8), min_size=len(workers), max_size=len(workers)))) \
        * float(tiles.flops.mean() if len(tiles) else 1.0) * 0.25
    kw = {"comm_aware": comm_aware, "link_cost": cost if comm_aware else None}
    for placer in available_placers():
        plain = place_tiles(tiles, sequences, workers, shape, tau, policy=PlacementPolicy(**kw), placer=placer)
        zero = place_tiles(tiles, sequences, workers, shape, tau, placer=placer,
                           policy=PlacementPolicy(**kw, reserved=np.zeros(len(workers))))
        assert plain[0].dest.tolist() == zero[0].dest.tolist() and plain[1] == zero[1]
    # the reserved loads count in C: the total load per worker never exceeds C except by fallbacks
    placed, fallback = place_tiles(tiles, sequences, workers, shape, tau, policy=PlacementPolicy(**kw, reserved=reserved))
    loads = reserved + np.bincount(np.searchsorted(workers, placed.dest), weights=placed.flops, minlength=len(workers))
    cap = (1 + tau) * (tiles.flops.sum() + reserved.sum()) / len(workers)
    assert fallback > 0 or (loads <= cap * (1 + 1e-9)).all()


def test_a_worker_with_reserved_load_gets_less_work():
    """A worker reserved above ``C`` takes no tile while another has room (in any placer)."""
    shape = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=8, dtype_bytes=2)
    seqs = [SequenceLayout.contiguous(j, j, np.array([64] * 4), 2) for j in range(2)]
    workers = [0, 1, 2, 3]
    tiles = make_tiles(seqs, 16, 2, shape)
    busy = np.array([0.0, 0.0, 10.0 * tiles.flops.sum(), 0.0])
    for placer in available_placers():
        for comm_aware in (True, False):
            placed, fallback = place_tiles(tiles, seqs, workers, shape, placer=placer,
                                           policy=PlacementPolicy(comm_aware=comm_aware, reserved=busy))
            assert 2 not in set(placed.dest.tolist()) and fallback == 0
    with pytest.raises(ValueError, match="reserved loads"):
        place_tiles(tiles, seqs, workers, shape, policy=PlacementPolicy(reserved=[1.0, 2.0]))
    with pytest.raises(ValueError, match="reserved loads"):
        place_tiles(tiles, seqs, workers, shape, policy=PlacementPolicy(reserved=[0.0, -1.0, 0.0, 0.0]))
