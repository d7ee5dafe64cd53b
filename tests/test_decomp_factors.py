"""The per-step loss decomposition and the FLOPs-only stragglers.

``comm x placement x pooling x kernel`` must equal ``straggler / balance_bound`` exactly on every
step of every method (with and without device jitter), each factor must be the ratio its name
says, and the FLOPs-only stragglers must be Ulysses' heaviest sequence / CP and Libra's heaviest
VRSP pool / (P * CP) in the bound's unit. The summary keeps the product exact with geometric means.
"""

import numpy as np
import pandas as pd
import pytest
from test_sim_simulator import PAR, window  # the same 8-sequence window

from baselines.registry import get_planner
from experiments.figures.straggler import FACTORS, gmean, summarize
from libra.sim.cost import CostModel
from libra.sim.profiles import load_profile
from libra.sim.simulator import flops_stragglers, simulate_window
from libra.sim.topology import Topology
from libra.vrsp import vrsp
from libra.workload import AttentionShape, packed_flops, packed_workloads

SHAPE = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=64)
TAP = {"block_size": 2048, "head_split": 2}
PLANNERS = {"ulysses": {}, "ulysses-sorted": {}, "wlb-llm": {"rejoin": "none"}, "distca-paper": TAP, "distca": {},
            "dynamic-cp": {},
            "libra-tap": {**TAP, "pool_size": 2}, "libra": {**TAP, "pool_size": 2}}


@pytest.fixture(scope="module")
def model():
    prof = load_profile("h100-roce-v1")
    return CostModel(prof, Topology(prof, PAR))


@pytest.mark.parametrize("jitter", [True, False])
@pytest.mark.parametrize("name", list(PLANNERS))
def test_factors_multiply_to_the_bound_ratio_on_every_step(model, name, jitter):
    planner = get_planner(name, **PLANNERS[name])
    plans = planner.plan_window(window(), PAR, SHAPE)
    steps = simulate_window(planner, window(), PAR, SHAPE, model, seed=5, jitter=jitter)
    for plan, r in zip(plans, steps):
        product = r.comm_factor * r.placement_factor * r.pooling_factor * r.kernel_factor
        assert product == pytest.approx(r.straggler_ms / r.balance_bound_ms, rel=1e-12)
        assert r.comm_factor >= 1.0 - 1e-12          # exposed communication only adds
        # placement = the plan's own imbalance x the device speed draw's share (1 without jitter)
        assert r.placement_plan_factor * r.placement_device_factor == pytest.approx(r.placement_factor, rel=1e-12)
        if not jitter:
            assert r.placement_device_factor == 1.0
        # each factor is the ratio its name says, recomputed here from the priced plan
        cost = model.price(plan, speed=None) if not jitter else None
        if cost is not None:
            w = cost.straggler_worker
            pool = cost.pool == cost.pool[w]
            assert r.comm_factor == pytest.approx(cost.straggler_ms / cost.compute_ms[w], rel=1e-12)
            assert r.placement_factor == pytest.approx(cost.compute_ms[w] / cost.compute_ms[pool].mean(), rel=1e-12)
            step_mean = cost.compute_ms[cost.pool >= 0].mean()
            assert r.pooling_factor == pytest.approx(cost.compute_ms[pool].mean() / step_mean, rel=1e-12)
            assert r.kernel_factor == pytest.approx(step_mean / cost.balance_bound_ms, rel=1e-12)
            assert r.kernel_factor >= 1.0 - 1e-12    # no segment beats the kernel's best rate


def test_ulysses_pooling_factor_is_the_cross_group_skew(model):
    """Ulysses' pools are its CP groups: each computes one sequence, so without jitter its
    placement factor is 1 and its pooling factor is the heaviest group over the mean group."""
    steps = simulate_window(get_planner("ulysses"), window(), PAR, SHAPE, model, seed=0, jitter=False)
    for r in steps:
        assert r.placement_factor == pytest.approx(1.0, abs=1e-9)
        assert r.pooling_factor > 1.0


def test_flops_stragglers_are_the_heaviest_sequence_and_pool(model):
    win = window()
    flops = np.array([packed_flops(s.sample_lengths, SHAPE) for s in win])
    uly, lib = flops_stragglers(win, PAR, SHAPE, 2, model)
    to_ms = model.flops_ms
    for g in range(PAR.ga):
        assert uly[g] == pytest.approx(to_ms(flops[g * PAR.dp:(g + 1) * PAR.dp].max() / PAR.cp), rel=1e-12)
    pools = vrsp(packed_workloads([s.sample_lengths for s in win]), 2)   # (K, P); pool k at GA k // (DP/P)
    loads = flops[pools].sum(axis=1).reshape(PAR.ga, PAR.dp // 2)
    assert lib == pytest.approx([to_ms(x) for x in loads.max(axis=1) / (2 * PAR.cp)], rel=1e-12)
    # both are at least the perfect-balance bound of their step (same unit), and pooling can only help
    bounds = [r.balance_bound_ms for r in simulate_window(get_planner("ulysses"), win, PAR, SHAPE, model, 0, False)]
    assert np.all(uly >= np.array(bounds) * (1 - 1e-12))
    assert lib.mean() <= uly.mean()
    # P = 1 (no pooling) leaves Libra's limit at sorted Ulysses' heaviest sequence / CP
    _, lib1 = flops_stragglers(win, PAR, SHAPE, 1, model)
    assert lib1 == pytest.approx(np.sort(flops)[::-1].reshape(PAR.ga, PAR.dp).max(axis=1) / PAR.cp * to_ms(1.0))


def test_flops_stragglers_ride_on_every_step_only_when_asked(model):
    planner = get_planner("libra", **PLANNERS["libra"])
    plain = simulate_window(planner, window(), PAR, SHAPE, model, seed=1)
    assert all(np.isnan(r.flops_ulysses_ms) and np.isnan(r.flops_libra_ms) for r in plain)
    steps = simulate_window(planner, window(), PAR, SHAPE, model, seed=1, flops_pool_size=2)
    uly, lib = flops_stragglers(window(), PAR, SHAPE, 2, model)
    assert [r.flops_ulysses_ms for r in steps] == pytest.approx(uly)
    assert [r.flops_libra_ms for r in steps] == pytest.approx(lib)
    assert [r.straggler_ms for r in steps] == [r.straggler_ms for r in plain]
    with pytest.raises(ValueError, match="GBS is 8"):
        flops_stragglers(window()[:4], PAR, SHAPE, 2, model)


def _steps_frame(model) -> pd.DataFrame:
    rows = []
    for name in ("ulysses", "ulysses-sorted", "libra"):
        for w in range(2):
            for r in simulate_window(get_planner(name, **PLANNERS[name]), window(), PAR, SHAPE, model, seed=w,
                                     flops_pool_size=2):
                rows.append({"workload": "t", "setting": "256k", "window": w, **r.to_row(),
                             "bound_ratio": r.straggler_ms / r.balance_bound_ms})
    return pd.DataFrame(rows)


def test_summary_geometric_means_keep_the_product_exact(model):
    df = _steps_frame(model)
    s = summarize(df).set_index("method")
    for m, g in df.groupby("method"):
        prod = np.prod([s.loc[m, f] for f in FACTORS])
        assert prod == pytest.approx(s.loc[m, "bound_ratio_gmean"], rel=1e-12)
        assert s.loc[m, "bound_ratio_gmean"] == pytest.approx(gmean(g["bound_ratio"]), rel=1e-12)
        assert s.loc[m, "pool_balanced_ratio"] == pytest.approx(s.loc[m, "comm_factor"] * s.loc[m, "placement_factor"])
        assert s.loc[m, "flops_limit_speedup"] == pytest.approx(g["flops_ulysses_ms"].mean() / g["flops_libra_ms"].mean())
        lo, hi = s.loc[m, "window_speedup_min"], s.loc[m, "window_speedup_max"]
        assert lo <= s.loc[m, "mean_speedup"] * (1 + 1e-12) and s.loc[m, "mean_speedup"] <= hi * (1 + 1e-12)
    assert s.loc["ulysses", "window_speedup_min"] == s.loc["ulysses", "window_speedup_max"] == 1.0
    # the limit depends on the window only: every method of the setting reports the same one
    assert s["flops_limit_speedup"].nunique() == 1


def test_summary_of_a_csv_written_before_the_decomposition(model):
    """The report summarises committed CSVs of older runs: the new columns come out NaN, no error."""
    old = _steps_frame(model).drop(columns=[*FACTORS, "flops_ulysses_ms", "flops_libra_ms", "balanced_compute_ms"])
    s = summarize(old)
    assert s[[*FACTORS, "pool_balanced_ratio", "flops_limit_speedup", "balanced_ratio"]].isna().all().all()
    assert np.isfinite(s["mean_speedup"]).all()


def test_gmean_refuses_to_hide_bad_values():
    assert gmean([1.0, 4.0]) == pytest.approx(2.0)
    assert np.isnan(gmean([1.0, np.nan])) and np.isnan(gmean([1.0, 0.0])) and np.isnan(gmean([]))
