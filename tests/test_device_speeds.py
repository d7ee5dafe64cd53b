"""Speed-aware planning: ``speed_reserve``, ``libra-adaptive``'s ``device_speeds``, the runtime's
``measure_device_speeds`` (gloo) and ``straggler --known-speeds``."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from dist_utils import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.registry import get_planner
from experiments.cli import main as cli
from libra.config import ParallelConfig
from libra.data.windows import gbs_windows
from libra.extensions.adaptive.retention import speed_reserve
from libra.plan.checks import check_pool
from libra.sim.cost import CostModel
from libra.sim.profiles import load_profile
from libra.sim.topology import Topology
from libra.workload import AttentionShape

SHAPE = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=64, dtype_bytes=2)
PAR = ParallelConfig(dp=4, cp=2, seq_len=16384, gbs=8)
TAP = {"pool_size": 4, "block_size": 1024, "head_split": 2, "tau": 0.03, "pipeline_chunks": 2}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.5, 2.0), min_size=1, max_size=16), st.floats(1.0, 1e6))
def test_speed_reserve_gives_each_worker_its_share(speeds, total):
    """Filling every worker to one total after the reserve leaves worker w s_w / sum(s) of the load."""
    r = speed_reserve(total, speeds)
    s = np.asarray(speeds)
    assert np.all(r >= 0) and r[int(np.argmax(s))] == 0
    level = (total + r.sum()) / len(s)
    np.testing.assert_allclose(level - r, s / s.sum() * total, rtol=1e-9, atol=1e-9 * total)


def test_speed_reserve_equal_speeds_and_errors():
    assert np.all(speed_reserve(10.0, [1.3, 1.3, 1.3]) == 0)
    for bad in ([], [1.0, 0.0], [1.0, float("nan")], [[1.0]], [True, True], ["1.0"]):
        with pytest.raises(ValueError, match="speeds must be"):
            speed_reserve(1.0, bad)


# The speed reserve moves work (libra.extensions.adaptive.retention): priced with the length curve,
# where a worker's time is its work. Under the occupancy model at this small size a worker's time is
# the longest block of a call (the tail of a 16K sample), which no work reserve moves.
PROFILE = "h100-roce-v1"


def _plans(**options):
    window = gbs_windows("libra-prod", PAR.seq_len, PAR.gbs, 1, 3)[0]
    planner = get_planner("libra-adaptive", profile=PROFILE, **TAP, **options)
    return planner.plan_window(window, PAR, SHAPE)


def test_equal_speeds_plan_as_unknown_speeds():
    """Known equal speeds change nothing: same pools, tiles and transfers as no speeds."""
    a, b = _plans(), _plans(device_speeds=(1.0,) * PAR.workers)
    for pa, pb in zip(a, b):
        for qa, qb in zip(pa.pools, pb.pools):
            assert np.array_equal(qa.tiles.dest, qb.tiles.dest) and qa.digest() == qb.digest()


def test_a_slow_gpu_gets_less_work_and_the_step_runs_faster():
    """One GPU at half speed: the speed-aware plan gives it less compute and prices faster at
    those speeds than the plan that does not know (both valid Plans)."""
    speeds = np.ones(PAR.workers)
    speeds[1] = 0.5
    blind, aware = _plans(), _plans(device_speeds=tuple(speeds))
    profile = load_profile(PROFILE)
    cost = CostModel(profile, Topology(profile, PAR))
    for pb, pa in zip(blind, aware):
        for pool in pa.pools:
            check_pool(pool, SHAPE)
        cb, ca = cost.price(pb, speed=speeds), cost.price(pa, speed=speeds)
        assert ca.compute_fwd_ms[1] < cb.compute_fwd_ms[1]
        assert ca.total_ms.max() < cb.total_ms.max()
        assert pa.meta["device_speeds"] is True and pb.meta["device_speeds"] is False


def test_device_speeds_errors():
    with pytest.raises(ValueError, match="device_speeds must be one finite multiplier > 0"):
        get_planner("libra-adaptive", device_speeds=(1.0, -1.0))
    with pytest.raises(ValueError, match="device_speeds has 3 entries; the layout has 8 GPUs"):
        _plans(device_speeds=(1.0, 1.0, 1.0))


def _measure(rank, world):
    import torch.distributed as dist  # noqa: PLC0415

    from libra.extensions.adaptive.speeds import measure_device_speeds  # noqa: PLC0415

    return measure_device_speeds(SHAPE, tokens=256, repeats=2), dist.get_world_size()


@pytest.mark.slow
def test_measure_device_speeds_agrees_on_every_rank(tmp_path):
    out = run_ranks(_measure, 2, tmp_path)
    (s0, w0), (s1, _) = out
    assert w0 == 2 and s0 == s1 and len(s0) == 2
    assert all(0 < s < 10 for s in s0) and np.isclose(np.median(1 / np.asarray(s0)), 1.0)  # time / the median time


def test_measure_device_speeds_needs_a_group():
    from libra.extensions.adaptive.speeds import measure_device_speeds  # noqa: PLC0415

    with pytest.raises(ValueError, match="initialised torch.distributed"):
        measure_device_speeds(SHAPE)


def test_straggler_known_speeds_cli(tmp_path):
    """--known-speeds lowers libra-adaptive's device share of the placement factor; it needs jitter."""
    args = ["straggler", "--quick", "--settings", "256k", "--methods", "ulysses,libra-adaptive", "--no-progress"]
    runner = CliRunner()
    bad = runner.invoke(cli, [*args, "--no-jitter", "--known-speeds", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "drop --no-jitter" in bad.output
    blind = runner.invoke(cli, [*args[:5], "ulysses,libra", "--no-progress", "--known-speeds", "--out", str(tmp_path / "y")])
    assert blind.exit_code == 2 and "none of ulysses, libra does: add libra-adaptive" in blind.output, blind.output
    assert not (tmp_path / "y").exists()  # refused before any point
    import pandas as pd  # noqa: PLC0415

    dev = {}
    for flag in ("", "--known-speeds"):
        out = tmp_path / (flag or "blind")
        res = runner.invoke(cli, [*args, *([flag] if flag else []), "--out", str(out)])
        assert res.exit_code == 0, res.output
        s = pd.read_csv(out / "straggler_summary.csv").set_index("method")
        dev[flag] = s.loc["libra-adaptive", "placement_device_factor"]
        assert s.loc["ulysses", "mean_ms"] > 0
    assert dev["--known-speeds"] < dev[""]


def test_a_known_speeds_run_is_never_the_figure_12_source(tmp_path):
    from experiments.common.report import PAPER_FIG12_METHODS, Source, straggler_source  # noqa: PLC0415

    def source(label, finished, **extra):
        config = {"workload": "libra-prod", "settings": [{"name": "256k"}], "methods": list(PAPER_FIG12_METHODS),
                  **extra}
        return Source("straggler", tmp_path, {"config": config, "finished_utc": finished}, label)

    plain, known = source("fig12", "2026-01-01"), source("known", "2026-02-01", known_speeds=True)
    assert straggler_source([plain, known], "256K") is plain
    assert straggler_source([known], "256K") is None
