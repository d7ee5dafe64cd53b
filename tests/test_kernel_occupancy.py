"""The occupancy kernel model (libra.sim.occupancy): block counts, the per-call formula, its
monotonicity, the profile that selects it, and the cost model and TAP weights pricing with it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.config import ParallelConfig
from libra.plan import Plan, PoolPlan, SequenceLayout
from libra.sim.cost import CostModel
from libra.sim.kernel import KernelModel
from libra.sim.occupancy import OccupancyModel, PassCost, fit_pass_cost
from libra.sim.profiles import load_profile, profile_from_dict
from libra.sim.topology import Topology
from libra.tap import build_transfers, kernel_time_weights, make_tiles, place_tiles
from libra.tap.pipeline import schedule_for_pool
from libra.workload import AttentionShape

FWD = PassCost(launch_ms=0.03, block_ms=0.005, tile_ms=0.002)
BWD = PassCost(launch_ms=0.04, block_ms=0.02, tile_ms=0.004)
OCC = OccupancyModel(multiprocessors=4, block_q=128, block_k=64, reference_head_dim=128, forward=FWD, backward=BWD)
PROFILE = load_profile("h200-occupancy-v1")
SHAPE = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=128, dtype_bytes=2)


def test_block_count_and_tiles_by_hand():
    """A 512-token document: 4 blocks ending at keys 128..512, each minus half a block of
    diagonal (64 keys): 64 + 192 + 320 + 448 = 1024 keys = 16 tiles, the last 448 / 64 = 7.
    Rows [768, 1024) of a 1024-token sample: 2 blocks, (832 + 960) / 64 = 28 tiles, last 15.
    A 100-token document: one block of 100 rows, (100 - 50) / 64 tiles."""
    blocks, tiles, longest = OCC.block_tiles([512, 256, 100], [512, 1024, 100])
    assert blocks.tolist() == [4, 2, 1]
    assert np.allclose(tiles, [16, 28, 50 / 64]) and np.allclose(longest, [7, 15, 50 / 64])


def test_call_time_is_launch_plus_the_larger_of_sm_work_and_longest_block():
    # one 512-token document, 1 head: 4 blocks on 4 SMs; the longest block (7 tiles) sets the call
    few = OCC.call_ms([512], [512], 1, 128)
    assert few == pytest.approx(0.03 + 0.005 + 0.002 * 7)
    # 8 heads: 32 blocks of 16 tiles each head over 4 SMs: (8 * (4 * 0.005 + 16 * 0.002)) / 4
    many = OCC.call_ms([512], [512], 8, 128)
    assert many == pytest.approx(0.03 + 8 * (4 * 0.005 + 16 * 0.002) / 4)
    # backward uses its own constants; head_dim scales the tile cost
    assert OCC.call_ms([512], [512], 8, 128, backward=True) == pytest.approx(0.04 + 8 * (4 * 0.02 + 16 * 0.004) / 4)
    assert OCC.call_ms([512], [512], 8, 64) == pytest.approx(0.03 + 8 * (4 * 0.005 + 16 * 0.001) / 4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9000), min_size=1, max_size=6), st.sampled_from([1, 2, 4, 8]))
def test_more_heads_per_call_is_never_slower_per_flop(lengths, heads):
    """The same FLOPs in one call of 2n heads never cost more than two calls of n heads."""
    for backward in (False, True):
        one = OCC.call_ms(lengths, lengths, 2 * heads, 128, backward)
        two = 2 * OCC.call_ms(lengths, lengths, heads, 128, backward)
        assert one <= two + 1e-12


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4096), st.integers(0, 8192), st.integers(1, 4096))
def test_monotone_in_kv(q, start, extra):
    kv = q + start
    for backward in (False, True):
        a = OCC.call_ms([q], [kv], 2, 128, backward)
        b = OCC.call_ms([q], [kv + extra], 2, 128, backward)
        assert b >= a
        assert OCC.work_ms([q], [kv + extra], 2, 128, backward)[0] > OCC.work_ms([q], [kv], 2, 128, backward)[0]


def test_profile_round_trip_and_validation():
    data = PROFILE.to_dict()
    assert data["kernel"]["model"] == "occupancy" and data["kernel"]["occupancy"]["multiprocessors"] == 132
    again = profile_from_dict(json.loads(json.dumps(data)))
    assert again.to_dict() == data and again.kernel.occupancy == PROFILE.kernel.occupancy
    bad = json.loads(json.dumps(data))
    del bad["kernel"]["occupancy"]
    with pytest.raises(ValueError, match="occupancy"):
        profile_from_dict(bad)
    bad = json.loads(json.dumps(data))
    bad["kernel"]["occupancy"]["block_q"] = 0
    with pytest.raises(ValueError, match="block_q"):
        profile_from_dict(bad)
    with pytest.raises(ValueError, match="kernel.model"):
        replace(PROFILE.kernel, model="waves")


def test_default_profile_is_unchanged():
    """The default profile records exactly what it did before the occupancy model existed."""
    data = load_profile("h100-roce-v1").to_dict()
    assert "model" not in data["kernel"] and "occupancy" not in data["kernel"]
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    assert digest == "3f6f2ccffe4ab4dca1bb6ab12c34d44952f78b67437065f4467a390e7712baf1"
    assert isinstance(load_profile("h100-roce-v1").kernel, KernelModel)


def _one_tile_per_worker(m: int):
    """Four tiles of 8 heads placed one per worker by hand; the plan and the tiles' weights."""
    par = ParallelConfig(dp=2, cp=2, gbs=2, seq_len=2048)
    seqs = [SequenceLayout.contiguous(0, 0, [600, 1000, 448], 2),
            SequenceLayout.contiguous(1, 1, [100, 300, 1500, 148], 2)]
    tiles = make_tiles(seqs, 1024, 1, SHAPE)
    weights = kernel_time_weights(tiles, seqs, SHAPE, PROFILE.kernel, pipeline_chunks=m)
    placed, _ = place_tiles(tiles, seqs, [0, 1, 2, 3], SHAPE, tau=0.0, weights=weights)
    placed = type(placed)(**{**{k: getattr(placed, k) for k in placed.FIELDS}, "dest": [3, 2, 1, 0]})
    pool = PoolPlan(0, (0, 1, 2, 3), tuple(seqs), placed, build_transfers(seqs, placed, SHAPE))
    return Plan("hand", 0, SHAPE, 2, m, (pool,)).validate(), par, placed, weights


@pytest.mark.parametrize("m", [1, 2])
def test_cost_model_prices_each_call_with_the_occupancy_model(m):
    plan, par, placed, weights = _one_tile_per_worker(m)
    cost = CostModel(PROFILE, Topology(PROFILE, par), impl="numpy").price(plan)
    occ = PROFILE.kernel.occupancy
    seg, _ = plan.pools[0].kernel_segments(schedule_for_pool(plan.pools[0], SHAPE, m), ordered=False)
    for w in range(4):
        mine = seg["dest"] == w
        q, kv = seg["q_len"][mine], seg["kv_len"][mine]
        heads = 8 // m
        assert cost.compute_fwd_ms[w] == pytest.approx(m * occ.call_ms(q, kv, heads, 128))
        assert cost.compute_bwd_ms[w] == pytest.approx(m * occ.call_ms(q, kv, heads, 128, backward=True))
        # the weight is the additive block work of both passes (no launch, no longest-block floor)
        tile = int(np.flatnonzero(placed.dest == w)[0])
        work = sum(m * float(np.sum(occ.work_ms(q, kv, heads, 128, b))) for b in (False, True))
        assert weights[tile] == pytest.approx(work)
    assert cost.compute_ms.sum() > 0 and np.all(cost.total_ms >= cost.compute_ms)


def test_fit_recovers_the_constants():
    rng = np.random.default_rng(0)
    calls = []
    for _ in range(40):
        lengths = rng.integers(128, 20000, size=int(rng.integers(1, 5)))
        calls.append((lengths, lengths, int(rng.choice([1, 2, 4, 8, 32])), 128))
    for backward in (False, True):
        times = [OCC.call_ms(q, kv, h, d, backward) for q, kv, h, d in calls]
        fitted, err = fit_pass_cost(replace(OCC, forward=PassCost(0.01, 0.001, 0.001)), calls, times, backward)
        assert np.max(np.abs(err)) < 1e-9
        assert fitted.tile_ms == pytest.approx(OCC.pass_cost(backward).tile_ms, rel=1e-6)
