"""Step simulator and device jitter on small layouts with the real planners."""

import numpy as np
import pytest

from baselines.registry import get_planner
from experiments.figures.variability import greedy_assign
from libra.config import ParallelConfig
from libra.data.packing import PackedSequence
from libra.sim.cost import CostModel
from libra.sim.profiles import Variability, load_profile
from libra.sim.simulator import simulate_window, summarize
from libra.sim.topology import Topology
from libra.sim.variability import DeviceJitter
from libra.workload import AttentionShape, packed_flops

PAR = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=16384)
SHAPE = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=64)


def window():
    """8 sequences of 16K tokens: two heavy (one 16K or 12K sample), the rest short samples."""
    rows = [[16384], [12288, 4096], [2048] * 8, [1024] * 16, [4096] * 4, [512] * 32, [8192, 8192], [2048] * 8]
    out, n = [], 0
    for i, r in enumerate(rows):
        out.append(PackedSequence(i, np.array(r), np.arange(n, n + len(r))))
        n += len(r)
    return out


@pytest.fixture(scope="module")
def model():
    prof = load_profile("h100-roce-v1")
    return CostModel(prof, Topology(prof, PAR))


def test_one_result_per_ga_index_and_consistent_fields(model):
    planner = get_planner("libra", pool_size=2, block_size=2048, head_split=2)
    res = simulate_window(planner, window(), PAR, SHAPE, model, seed=3)
    assert [r.step for r in res] == [0, 1]
    for r in res:
        assert r.straggler_ms == pytest.approx(r.compute_ms + r.comm_exposed_ms)
        assert r.comm_exposed_ms <= r.comm_serial_ms + 1e-9
        assert r.straggler_ms >= r.mean_worker_ms > 0
        assert r.pipeline_chunks == 4
    # step 0 holds sequences 0-3 under production order; its bound covers exactly their FLOPs
    flops = sum(packed_flops(s.sample_lengths, SHAPE) for s in window()[:4])
    prof = model.profile
    bound = flops / PAR.workers / (prof.kernel.rate_inf_tflops * 1e9) * (1 + prof.kernel.backward_time_ratio)
    ulysses = simulate_window(get_planner("ulysses"), window(), PAR, SHAPE, model, seed=3)
    assert ulysses[0].balance_bound_ms == pytest.approx(bound)
    s = summarize(res)
    assert s["max_ms"] == max(r.straggler_ms for r in res) and s["steps"] == 2


def test_deterministic_and_jitter_shared_across_methods(model):
    planner = get_planner("libra-tap", pool_size=4, block_size=2048, head_split=2)
    a = simulate_window(planner, window(), PAR, SHAPE, model, seed=7)
    b = simulate_window(planner, window(), PAR, SHAPE, model, seed=7)
    assert a == b
    c = simulate_window(planner, window(), PAR, SHAPE, model, seed=8)
    assert [r.straggler_ms for r in a] != [r.straggler_ms for r in c]
    flat = simulate_window(planner, window(), PAR, SHAPE, model, seed=7, jitter=False)
    assert [r.straggler_ms for r in flat] != [r.straggler_ms for r in a]


def test_pooling_beats_ulysses_on_skewed_window(model):
    u = summarize(simulate_window(get_planner("ulysses"), window(), PAR, SHAPE, model, seed=0, jitter=False))
    lib = summarize(simulate_window(get_planner("libra", pool_size=4, block_size=2048, head_split=2), window(),
                                    PAR, SHAPE, model, seed=0, jitter=False))
    assert lib["max_ms"] < u["max_ms"]


def test_simulator_rejects_mismatches(model):
    planner = get_planner("ulysses")
    with pytest.raises(ValueError, match="GBS is 8"):
        simulate_window(planner, window()[:4], PAR, SHAPE, model, seed=0)
    other = ParallelConfig(dp=2, cp=2, gbs=8, seq_len=16384)
    with pytest.raises(ValueError, match="differs from the cost model's topology"):
        simulate_window(planner, window(), other, SHAPE, model, seed=0)


def test_device_jitter():
    v = Variability(sigma_gpu=0.02, sigma_step=0.01)
    j = DeviceJitter(v, 16, seed=5)
    s0, s1 = j.speeds(0), j.speeds(1)
    assert s0.shape == (16,) and np.all(s0 > 0)
    assert np.array_equal(s0, DeviceJitter(v, 16, seed=5).speeds(0))
    assert not np.array_equal(s0, s1)
    # persistent per-GPU factor (var 0.02^2) vs per-step factor (0.01^2): steps correlate ~0.8
    big = DeviceJitter(v, 2000, seed=5)
    assert 0.7 < np.corrcoef(np.log(big.speeds(0)), np.log(big.speeds(1)))[0, 1] < 0.9
    assert np.std(np.log(big.speeds(0))) == pytest.approx(np.hypot(0.02, 0.01), rel=0.1)
    assert np.all(DeviceJitter(Variability(), 4, seed=0).speeds(3) == 1.0)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        DeviceJitter(v, 4, seed=-1)
    with pytest.raises(ValueError, match="num_workers"):
        DeviceJitter(v, 0, seed=0)
    with pytest.raises(ValueError, match="step must be"):
        j.speeds(-2)


def test_greedy_assign_time_vs_flops_balance():
    flops = np.full(8, 10.0)
    speed = np.array([1.0, 0.5])
    f = greedy_assign(flops, speed, use_speed=False)
    t = greedy_assign(flops, speed, use_speed=True)
    assert f.tolist() == [40.0, 40.0]            # equal FLOPs, the slow GPU takes 80
    assert np.max(t / speed) < np.max(f / speed)  # speed-aware: 50/30 -> 60 at most
    assert t.sum() == 80.0
