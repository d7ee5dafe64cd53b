"""paper-inferred-v1 profile and experiments.common.link_fit (bandwidth fit by bisection, re-pricing)."""

import math

import numpy as np
import pytest

from baselines.registry import get_planner
from experiments.common.link_fit import (
    bisect_bandwidth,
    comm_share,
    crossing_traffic,
    price_windows,
    with_link_bandwidth,
)
from libra.config import ParallelConfig
from libra.data.packing import PackedSequence
from libra.sim.cost import CostModel
from libra.sim.profiles import available_profiles, load_profile, profile_from_dict
from libra.sim.simulator import simulate_window
from libra.sim.topology import Topology
from libra.workload import AttentionShape

# 4 DP x 2 CP on 2-GPU nodes, 1 node per supernode: a P = 4 pool spans 4 supernodes
PAR = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=16384)
SHAPE = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=64)


def small_profile(bw: float = 25.0):
    d = load_profile("h100-roce-v1").to_dict()
    d.update(name="small", gpus_per_node=2, nodes_per_supernode=1)
    d["links"]["inter_supernode"]["bandwidth_gbps"] = bw
    return profile_from_dict(d)


def window():
    """8 sequences of 16K tokens, skewed so the pool moves tiles between supernodes."""
    rows = [[16384], [12288, 4096], [2048] * 8, [1024] * 16, [4096] * 4, [512] * 32, [8192, 8192], [2048] * 8]
    out, n = [], 0
    for i, r in enumerate(rows):
        out.append(PackedSequence(i, np.array(r), np.arange(n, n + len(r))))
        n += len(r)
    return out


@pytest.fixture(scope="module")
def planned():
    tap = get_planner("libra-tap-vrsp", pool_size=4, block_size=2048, head_split=2)
    uly = get_planner("ulysses")
    return [tap.plan_window(window(), PAR, SHAPE)], [uly.plan_window(window(), PAR, SHAPE)], [11]


def test_paper_profile_loads_and_differs_only_in_the_fitted_bandwidth():
    assert "paper-inferred-v1" in available_profiles()
    paper, base = load_profile("paper-inferred-v1"), load_profile("h100-roce-v1")
    assert paper.name == "paper-inferred-v1" and "INFERRED, not public facts" in paper.description
    fitted = paper.links["inter_supernode"].bandwidth_gbps
    assert 0.5 < fitted < base.links["inter_supernode"].bandwidth_gbps
    assert "0.77" in paper.source["inter_supernode_fit"]
    assert paper.source["derived_from"] == "h100-roce-v1"
    a, b = paper.to_dict(), base.to_dict()
    for d in (a, b):
        for key in ("name", "description", "source"):
            d.pop(key)
    assert a["links"]["inter_supernode"].pop("bandwidth_gbps") == fitted
    b["links"]["inter_supernode"].pop("bandwidth_gbps")
    assert a == b  # same kernel fit, NVLink, RoCE, latencies, cluster shape, variability


def test_paper_profile_prices_crossing_bytes_at_the_fitted_bandwidth():
    # hand-computed: one worker sends 1 GB across supernodes in one phase; time = bytes / bandwidth
    # (+ the class latency) and nothing else on its NIC
    paper = load_profile("paper-inferred-v1")
    cm = CostModel(paper, Topology(paper, ParallelConfig(dp=16, cp=8, gbs=16, seq_len=8192)))
    sent = np.zeros((3, 128))
    sent[2, 0] = 1e9
    bw_ms, lat_ms, per_class = cm._phase_ms(sent, np.zeros_like(sent))
    expect = 1e9 / (paper.links["inter_supernode"].bandwidth_gbps * 1e6)
    assert bw_ms[0] == pytest.approx(expect, rel=1e-12)
    assert lat_ms[0] == paper.links["inter_supernode"].latency_ms
    assert bw_ms[1:].max() == 0


def test_with_link_bandwidth_replaces_one_field_and_validates():
    base = small_profile()
    new = with_link_bandwidth(base, "roce", 12.5, name="x")
    assert new.name == "x" and new.links["roce"].bandwidth_gbps == 12.5
    assert new.links["nvlink"] == base.links["nvlink"] and new.kernel == base.kernel
    with pytest.raises(ValueError, match="unknown link class 'pcie'"):
        with_link_bandwidth(base, "pcie", 1.0)
    for bad in (0.0, -3.0, math.nan, math.inf, True, "5"):
        with pytest.raises(ValueError, match="bandwidth_gbps must be a finite number > 0"):
            with_link_bandwidth(base, "roce", bad)


def test_bisect_recovers_an_analytic_bandwidth():
    # metric = a + b / bw (a phase priced bytes / bandwidth): target at bw = 7.3 exactly
    def metric(bw):
        return 0.1 + 4.2 / bw

    fit = bisect_bandwidth(metric, metric(7.3), 0.5, 50.0, rel_tol=1e-6)
    assert fit.bandwidth_gbps == pytest.approx(7.3, rel=1e-5)
    assert fit.probes[:2] == [(0.5, metric(0.5)), (50.0, metric(50.0))]
    assert bisect_bandwidth(metric, metric(7.3), 0.5, 50.0, rel_tol=1e-6) == fit  # deterministic


def test_bisect_rejects_bad_input():
    def metric(bw):
        return 1.0 / bw

    with pytest.raises(ValueError, match="outside the bracket"):
        bisect_bandwidth(metric, 5.0, 1.0, 10.0)
    with pytest.raises(ValueError, match="0 < lo < hi"):
        bisect_bandwidth(metric, 0.5, 10.0, 1.0)
    with pytest.raises(ValueError, match="0 < lo < hi"):
        bisect_bandwidth(metric, 0.5, 0.0, 1.0)
    with pytest.raises(ValueError, match="rel_tol must be > 0"):
        bisect_bandwidth(metric, 0.5, 1.0, 10.0, rel_tol=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        bisect_bandwidth(metric, 0.5, 1.0, 10.0, max_iter=0)
    with pytest.raises(ValueError, match="target must be a finite number"):
        bisect_bandwidth(metric, math.nan, 1.0, 10.0)
    with pytest.raises(ValueError, match="metric returned nan"):
        bisect_bandwidth(lambda bw: math.nan, 0.5, 1.0, 10.0)


def test_price_windows_matches_simulate_window(planned):
    method_plans, _, seeds = planned
    prof = small_profile()
    planner = get_planner("libra-tap-vrsp", pool_size=4, block_size=2048, head_split=2)
    direct = simulate_window(planner, window(), PAR, SHAPE, CostModel(prof, Topology(prof, PAR)), seed=seeds[0])
    assert price_windows(prof, PAR, method_plans, seeds) == direct
    with pytest.raises(ValueError, match="1 planned windows but 2 jitter seeds"):
        price_windows(prof, PAR, method_plans, [1, 2])


def test_fit_recovers_a_known_bandwidth_on_a_small_pool(planned):
    method_plans, base_plans, seeds = planned
    base = small_profile()
    # the pool crosses supernodes, so the comm share falls as the inter-supernode bandwidth grows
    shares = [comm_share(with_link_bandwidth(base, "inter_supernode", bw), PAR, method_plans, base_plans, seeds)
              for bw in (1.0, 3.7, 25.0)]
    assert shares[0] > shares[1] > shares[2] > 0
    topo = Topology(base, PAR)
    rows = crossing_traffic(CostModel(base, topo).price(method_plans[0][0]), topo)
    assert sum(r["bytes_sent"] for r in rows) > 0 and all(r["workers"] == 2 for r in rows)

    def metric(bw):
        return comm_share(with_link_bandwidth(base, "inter_supernode", bw), PAR, method_plans, base_plans, seeds)

    fit = bisect_bandwidth(metric, shares[1], 0.5, 50.0, rel_tol=1e-4)
    assert fit.bandwidth_gbps == pytest.approx(3.7, rel=2e-3)
    assert fit.value == pytest.approx(shares[1], rel=1e-3)


def test_crossing_traffic_hand_counted():
    # DistCA-like P = DP pool on the small cluster: every supernode's bytes add up to the plan's total
    prof = small_profile()
    topo = Topology(prof, PAR)
    plans = get_planner("distca-paper", block_size=2048, head_split=2).plan_window(window(), PAR, SHAPE)
    cost = CostModel(prof, topo).price(plans[0])
    rows = crossing_traffic(cost, topo)
    sent = cost.bytes_sent["inter_supernode"]
    assert sum(r["bytes_sent"] for r in rows) == pytest.approx(cost.total_bytes()["inter_supernode"])
    for r in rows:
        ids = np.arange(2 * r["supernode"], 2 * r["supernode"] + 2)  # 2 GPUs per supernode here
        assert r["senders"] == int((sent[ids] > 0).sum())
        assert r["max_worker_bytes"] == sent[ids].max()
        assert r["mean_worker_bytes"] == pytest.approx(sent[ids].mean())
