"""Kernel-time-aware TAP (an extension beyond Libra sec. 4.3.2): the per-tile kernel-time estimate,
the ``libra-kt`` planner and its errors."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from baselines.registry import get_planner
from libra.config import ParallelConfig, TapConfig
from libra.data.packing import PackedSequence
from libra.plan import Plan, PoolPlan, SequenceLayout, TileTable
from libra.sim.cost import CostModel
from libra.sim.profiles import DEFAULT_PROFILE, load_profile
from libra.sim.topology import Topology
from libra.tap import build_transfers, kernel_time_weights, make_tiles, place_tiles, plan_pool
from libra.workload import AttentionShape

UNIT = AttentionShape(num_q_heads=1, num_kv_heads=1, head_dim=1, dtype_bytes=2)
PROFILE = load_profile("h100-roce-v1")
KERNEL = PROFILE.kernel


def _seq(seq_id, lengths, holders, per_rank):
    starts = np.arange(len(holders)) * per_rank
    return SequenceLayout(seq_id, seq_id, lengths, starts, starts + per_rank, holders)


# --------------------------------------------------------------------------------------------
# kernel_time_weights
# --------------------------------------------------------------------------------------------

SHAPE = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=128, dtype_bytes=2)


def test_weights_are_the_hand_computed_kernel_pieces():
    """Samples (600, 1000, 448) in one 2048-token sequence, B = 1024, H = 2 (4 heads), M = 2.

    Tile [0, 1024) holds sample 0 whole (area 600*601/2) and rows 0..423 of sample 1
    (area 424*425/2); tile [1024, 2048) holds rows 424..999 of sample 1 (area (1000*1001 -
    424*425)/2) and sample 2 whole (448*449/2). Each piece costs 2 calls of 2 heads."""
    seq = SequenceLayout.contiguous(0, 0, [600, 1000, 448], 2)
    tiles = make_tiles([seq], 1024, 2, SHAPE)
    w = kernel_time_weights(tiles, [seq], SHAPE, KERNEL, pipeline_chunks=2)

    def t(areas):
        return float(np.sum(2 * KERNEL.segment_forward_ms(np.asarray(areas, dtype=np.float64), 2, 128)))

    first = t([600 * 601 // 2, 424 * 425 // 2])
    second = t([(1000 * 1001 - 424 * 425) // 2, 448 * 449 // 2])
    assert np.allclose(w, [first, first, second, second], rtol=1e-12)
    # same FLOPs-per-ms ordering as the kernel curve says: the long late piece runs faster per FLOP
    assert w[2] / tiles.flops[2] < w[0] / tiles.flops[0]


def test_weight_equals_cost_model_compute_of_a_single_tile_worker():
    """Place one tile per worker by hand, price the plan: each worker's forward compute minus its
    M launches is exactly that tile's weight (one formula, one place)."""
    par = ParallelConfig(dp=2, cp=2, gbs=2, seq_len=2048)
    seqs = [SequenceLayout.contiguous(0, 0, [600, 1000, 448], 2),
            SequenceLayout.contiguous(1, 1, [100, 300, 1500, 148], 2)]
    tiles = make_tiles(seqs, 1024, 1, SHAPE)  # 4 tiles of 8 heads, one per worker
    assert len(tiles) == 4
    m = 4
    w = kernel_time_weights(tiles, seqs, SHAPE, KERNEL, pipeline_chunks=m)
    placed, _ = place_tiles(tiles, seqs, [0, 1, 2, 3], SHAPE, tau=0.0, weights=w)
    placed = type(placed)(**{**{k: getattr(placed, k) for k in placed.FIELDS}, "dest": [3, 2, 1, 0]})
    pool = PoolPlan(0, (0, 1, 2, 3), tuple(seqs), placed, build_transfers(seqs, placed, SHAPE))
    plan = Plan("hand", 0, SHAPE, 2, m, (pool,)).validate()
    cost = CostModel(PROFILE, Topology(PROFILE, par)).price(plan)
    compute = cost.compute_fwd_ms[placed.dest] - m * KERNEL.launch_ms
    assert np.allclose(compute, w, rtol=1e-12)


def test_kernel_time_weights_bad_input():
    seq = SequenceLayout.contiguous(0, 0, [600, 1000, 448], 2)
    tiles = make_tiles([seq], 1024, 2, SHAPE)  # 4 heads per tile
    with pytest.raises(ValueError, match="KernelModel"):
        kernel_time_weights(tiles, [seq], SHAPE, PROFILE)
    with pytest.raises(ValueError, match="M=3 must divide"):
        kernel_time_weights(tiles, [seq], SHAPE, KERNEL, pipeline_chunks=3)
    with pytest.raises(ValueError, match="positive integer, got 0"):
        kernel_time_weights(tiles, [seq], SHAPE, KERNEL, pipeline_chunks=0)
    with pytest.raises(ValueError, match="sequence index out of range"):
        kernel_time_weights(tiles, [], SHAPE, KERNEL)
    assert kernel_time_weights(TileTable.empty(), [seq], SHAPE, KERNEL).shape == (0,)


# --------------------------------------------------------------------------------------------
# TapConfig / plan_pool / libra-kt
# --------------------------------------------------------------------------------------------


def test_tap_config_load_estimate_is_validated():
    assert TapConfig().load_estimate == "flops"
    assert TapConfig(load_estimate="kernel-time").load_estimate == "kernel-time"
    with pytest.raises(ValueError, match="load_estimate must be one of.*'time'"):
        TapConfig(load_estimate="time")


def test_plan_pool_kernel_argument_errors():
    seqs = [SequenceLayout.contiguous(0, 0, [600, 1000, 448], 2)]
    kt = TapConfig(pool_size=1, block_size=1024, head_split=2, pipeline_chunks=2, load_estimate="kernel-time")
    with pytest.raises(ValueError, match="needs a kernel"):
        plan_pool(0, seqs, [0, 1], kt, SHAPE)
    with pytest.raises(ValueError, match="load_estimate='flops' would ignore it"):
        plan_pool(0, seqs, [0, 1], TapConfig(pool_size=1, block_size=1024, head_split=2, pipeline_chunks=2),
                  SHAPE, kernel=KERNEL)
    with pytest.raises(ValueError, match="KernelModel"):
        plan_pool(0, seqs, [0, 1], kt, SHAPE, kernel="h100-roce-v1")
    pool = plan_pool(0, seqs, [0, 1], kt, SHAPE, kernel=KERNEL)
    assert len(pool.tiles) == 4


def _window(gbs, seq_len, seed):
    rng = np.random.default_rng(seed)
    out = []
    for j in range(gbs):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), size=int(rng.integers(1, 12)), replace=False))
        lens = np.diff(np.concatenate(([0], cuts, [seq_len])))
        out.append(PackedSequence(j, lens.tolist(), list(range(100 * j, 100 * j + len(lens)))))
    return out


def test_libra_kt_plans_validate_and_record_the_estimate():
    par = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=2048)
    opts = {"block_size": 256, "head_split": 2, "pool_size": 2}
    window = _window(par.gbs, par.seq_len, 3)
    kt = get_planner("libra-kt", **opts)
    base = get_planner("libra", **opts)
    assert kt.pipeline_chunks == base.pipeline_chunks == 4
    plans, ref = kt.plan_window(window, par, SHAPE), base.plan_window(window, par, SHAPE)
    assert len(plans) == par.ga
    for p, r in zip(plans, ref):
        p.validate()
        assert p.method == "libra-kt" and p.meta["load_estimate"] == "kernel-time"
        assert p.meta["kernel_profile"] == DEFAULT_PROFILE
        assert p.meta["kernel"] == load_profile(DEFAULT_PROFILE).kernel.to_dict()
        assert r.meta["load_estimate"] == "flops"
        # same VRSP pools as libra: only the placement inside a pool may differ
        assert [[s.seq_id for s in pool.sequences] for pool in p.pools] == \
               [[s.seq_id for s in pool.sequences] for pool in r.pools]
    again = kt.plan_window(window, par, SHAPE)
    assert [p.digest() for p in again] == [p.digest() for p in plans]  # deterministic


def test_libra_kt_bad_profile_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware profile 'no-such'"):
        get_planner("libra-kt", profile="no-such")
    bad = tmp_path / "p.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        get_planner("libra-kt", profile=str(bad))
    with pytest.raises(ValueError, match="libra-kt profile must be"):
        get_planner("libra-kt", profile=3)
    assert get_planner("libra-kt", profile=PROFILE).config.profile is PROFILE


def test_straggler_cli_accepts_libra_kt_and_stays_the_straggler_experiment(tmp_path):
    from experiments.cli import main

    out = tmp_path / "s"
    res = CliRunner().invoke(main, ["straggler", "--workload", "libra-prod", "--settings", "256k", "--quick",
                                    "--methods", "libra,libra-kt", "--no-progress", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "libra-kt" in res.output and (out / "straggler.csv").exists()  # an extension keeps the experiment's name
    assert not (out / "straggler-extension.csv").exists()
    res = CliRunner().invoke(main, ["straggler", "--quick", "--methods", "libra-kt2", "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "unknown method 'libra-kt2'" in res.output
