"""The kernel model's optional backward length curve: one definition that the cost
model prices backward with and that libra-kt's tile weights add, absent = the old ratio model."""

from __future__ import annotations

import numpy as np
import pytest

from libra.sim.kernel import KernelModel
from libra.workload import sample_area

RATIO = KernelModel(rate_inf_tflops=0.1, half_length=400.0, exponent=0.8, launch_ms=0.1, reference_heads=8,
                    heads_half=0.1, backward_time_ratio=2.0)
CURVE = KernelModel(**{**RATIO.to_dict(), "backward_rate_inf_tflops": 0.04, "backward_half_length": 150.0,
                       "backward_exponent": 1.1})


def test_without_a_curve_backward_is_the_ratio_and_the_profile_json_is_unchanged():
    area = sample_area(np.array([128, 1024, 8192]))
    np.testing.assert_allclose(RATIO.segment_backward_ms(area, 8, 64), 2.0 * RATIO.segment_forward_ms(area, 8, 64))
    assert not RATIO.has_backward_curve and RATIO.best_backward_ratio() == 2.0
    assert not any(k.startswith("backward_") and k != "backward_time_ratio" for k in RATIO.to_dict())


def test_the_curve_makes_backward_grow_differently_with_length():
    area = sample_area(np.array([128, 8192]))
    ratio = CURVE.segment_backward_ms(area, 8, 64) / CURVE.segment_forward_ms(area, 8, 64)
    assert ratio[0] < ratio[1]  # short segments: backward relatively cheaper (smaller half_length), as on CPU
    assert CURVE.best_backward_ratio() == pytest.approx(0.1 / 0.04)
    assert CURVE.chunked_backward_ms(area, 4, 64, 2) == pytest.approx(2 * CURVE.segment_backward_ms(area, 4, 64))


@pytest.mark.parametrize("fields", [{"backward_rate_inf_tflops": 0.04},
                                    {"backward_rate_inf_tflops": 0.04, "backward_half_length": 9.0,
                                     "backward_exponent": -1.0}])
def test_a_partial_or_bad_curve_is_rejected(fields):
    with pytest.raises(ValueError, match="backward"):
        KernelModel(**{**RATIO.to_dict(), **fields})


def _one_pool_plan():
    from baselines.registry import get_planner  # noqa: PLC0415
    from libra.config import ParallelConfig  # noqa: PLC0415
    from libra.data.windows import gbs_windows  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    par = ParallelConfig(dp=2, cp=1, gbs=2, seq_len=2048)
    shape = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=64, dtype_bytes=4)
    window = gbs_windows("libra-prod", 2048, 2, 1, seed=0)[0]
    planner = get_planner("libra", pool_size=2, block_size=256, head_split=2, pipeline_chunks=2)
    return planner.plan_window(window, par, shape)[0], par, shape


def test_cost_model_prices_backward_with_the_curve():
    from libra.sim.cost import CostModel  # noqa: PLC0415
    from libra.sim.profiles import load_profile  # noqa: PLC0415
    from libra.sim.topology import Topology  # noqa: PLC0415

    plan, par, shape = _one_pool_plan()
    base = load_profile("h100-roce-v1")
    from dataclasses import replace  # noqa: PLC0415

    def price(kernel):
        prof = replace(base, kernel=kernel)
        return CostModel(prof, Topology(prof, par)).price(plan)

    ratio_cost, curve_cost = price(RATIO), price(CURVE)
    np.testing.assert_allclose(ratio_cost.compute_bwd_ms, 2.0 * ratio_cost.compute_fwd_ms)
    np.testing.assert_allclose(curve_cost.compute_fwd_ms, ratio_cost.compute_fwd_ms)  # forward untouched
    pool = plan.pools[0]
    from libra.plan import merge_pieces  # noqa: PLC0415
    from libra.tap.pipeline import ChunkSchedule  # noqa: PLC0415

    sched = ChunkSchedule.for_pool(pool, shape, plan.pipeline_chunks)
    seg = pool.segments()  # priced as the runtime runs them: adjacent pieces on one worker merged
    seg, _ = merge_pieces(seg, sched.segment_calls(seg)[0], pool.tiles.head_start[seg["tile"]],
                          pool.tiles.head_end[seg["tile"]])
    t = CURVE.chunked_backward_ms(seg["area"], sched.heads_per_call(seg["heads"]), 64, sched.chunks)
    want = np.bincount(seg["dest"], weights=t, minlength=2) + sched.chunks * CURVE.launch_ms * 2.0
    np.testing.assert_allclose(curve_cost.compute_bwd_ms, want)


def test_kernel_time_weights_add_backward_only_with_a_curve():
    from libra.tap.tiles import make_tiles  # noqa: PLC0415
    from libra.tap.weights import kernel_time_weights  # noqa: PLC0415

    plan, _, shape = _one_pool_plan()
    seqs = plan.pools[0].sequences
    tiles = make_tiles(seqs, 256, 2, shape)
    fwd = kernel_time_weights(tiles, seqs, shape, RATIO, 2)
    both = kernel_time_weights(tiles, seqs, shape, CURVE, 2)
    from libra.plan import segments  # noqa: PLC0415
    from libra.tap.pipeline import ChunkSchedule  # noqa: PLC0415

    seg = segments(seqs, tiles)
    sched = ChunkSchedule(shape, tiles.head_start, tiles.head_end, 2)
    bwd = np.bincount(seg["tile"].astype(np.int64),
                      weights=CURVE.chunked_backward_ms(seg["area"], sched.heads_per_call(seg["heads"]), 64, 2),
                      minlength=len(tiles))
    np.testing.assert_allclose(both, fwd + bwd)
