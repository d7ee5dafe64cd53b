"""Scoring plans with a profile other than the one they were planned with: ``--score-profile`` on
``straggler`` (and its byte-identity when it names the planning profile), the profile ensemble
ensembles (``default-v2`` for the occupancy default, ``default-v1`` for the length-curve profile) and
the `libra-bench robustness` run on a tiny layout."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from baselines.registry import get_planner
from experiments.cli import main
from experiments.common.runs_table import run_caption
from experiments.common.sim_common import (
    custom_setting,
    jitter_seed,
    load_windows,
    make_shape,
    planner_options,
)
from experiments.figures.straggler import StragglerConfig, run_straggler
from libra.sim.cost import CostModel
from libra.sim.profiles import DEFAULT_PROFILE, load_profile
from libra.sim.profiles.ensemble import load_ensemble, member_profile
from libra.sim.topology import Topology
from libra.sim.variability import DeviceJitter

TINY = ["--dp", "2", "--cp", "2", "--seq-len", "16K", "--gbs", "4", "--windows", "1", "--no-progress"]
BASE = load_profile(DEFAULT_PROFILE)
V1 = load_profile("h100-roce-v1")


def _member(name: str):
    return load_ensemble().profiles(BASE)[name]


def test_the_length_curve_ensemble_has_twelve_named_transformations_of_its_profile():
    ens = load_ensemble("default-v1")
    assert ens.base == "h100-roce-v1"
    BASE = V1  # noqa: N806 -- the profile this ensemble transforms
    profiles = ens.profiles(BASE)
    assert list(profiles) == ["default", "heads-c0.25", "heads-c1", "heads-c4", "links-bw-x0.25", "links-bw-x0.5",
                              "links-bw-x2", "links-bw-x4", "latency-x4", "latency-x30", "kernel-half-length-x4",
                              "kernel-rate-div2"]
    assert profiles["default"] is BASE
    k = BASE.kernel
    for c in (0.25, 1.0, 4.0):
        p = profiles[f"heads-c{c:g}"]
        assert p.kernel.heads_half == c and p.links == BASE.links
        assert p.kernel.heads_efficiency(1) == pytest.approx((1 / (1 + c)) / (64 / (64 + c)))
    for s in (0.25, 0.5, 2, 4):
        p = profiles[f"links-bw-x{s:g}"]
        assert p.links["roce"].bandwidth_gbps == pytest.approx(50.0 * s)
        assert p.links["nvlink"].latency_ms == BASE.links["nvlink"].latency_ms and p.kernel == k
    assert profiles["latency-x30"].links["inter_supernode"].latency_ms == pytest.approx(0.025 * 30)
    assert profiles["latency-x4"].links["roce"].bandwidth_gbps == 50.0
    assert profiles["kernel-half-length-x4"].kernel.half_length == pytest.approx(4 * k.half_length)
    assert profiles["kernel-rate-div2"].kernel.rate_inf_tflops == pytest.approx(k.rate_inf_tflops / 2)
    assert profiles["kernel-rate-div2"].kernel.half_length == k.half_length


def test_the_default_ensemble_transforms_the_occupancy_default():
    ens = load_ensemble()
    assert ens.name == "default-v2" and ens.base == BASE.name == DEFAULT_PROFILE
    profiles = ens.profiles(BASE)
    assert len(profiles) == 12 and profiles["default"] is BASE
    occ = BASE.kernel.occupancy
    block = profiles["kernel-block-cost-x4"].kernel.occupancy
    slow = profiles["kernel-rate-div2"].kernel.occupancy
    for p in ("forward", "backward"):
        assert getattr(block, p).block_ms == pytest.approx(4 * getattr(occ, p).block_ms)
        assert getattr(block, p).tile_ms == getattr(occ, p).tile_ms
        assert getattr(slow, p).block_ms == pytest.approx(2 * getattr(occ, p).block_ms)
        assert getattr(slow, p).tile_ms == pytest.approx(2 * getattr(occ, p).tile_ms)
        assert getattr(slow, p).launch_ms == getattr(occ, p).launch_ms
    # the heads factor prices on top of the occupancy model: every block 1 / h(n) slower
    seg = {"q_len": np.array([4096, 512]), "kv_len": np.array([4096, 8192])}
    heads4 = profiles["heads-c4"].kernel
    for heads in (1, 8):
        plain = BASE.kernel.occupancy_terms(seg, heads, 2, 128, backward=False)
        penalised = heads4.occupancy_terms(seg, heads, 2, 128, backward=False)
        for a, b in zip(plain, penalised):
            np.testing.assert_allclose(b, a / heads4.heads_efficiency(heads))
    assert heads4.heads_efficiency(1) < heads4.heads_efficiency(8) < 1


def test_an_ensemble_member_that_cannot_apply_is_one_clear_error():
    with pytest.raises(ValueError, match="already has one"):
        load_ensemble().profiles(member_profile(BASE, {"name": "c1", "heads_half": 1.0}))
    with pytest.raises(ValueError, match="unknown profile ensemble"):
        load_ensemble("nope")


@pytest.mark.parametrize("data, match", [
    ({"members": []}, "non-empty 'members' list"),
    ({"members": [{"bandwidth_scale": 2}]}, "needs a non-empty name"),
    ({"members": [{"name": "a"}, {"name": "a"}]}, "must be unique"),
    ({"members": [{"name": "a", "jitter_scale": 2}]}, "unknown transformation"),
    ({"members": [{"name": "a", "rate_scale": 0}]}, "rate_scale must be a number > 0"),
    ({"members": [{"name": "a", "latency_scale": True}]}, "latency_scale must be a number > 0"),
])
def test_a_malformed_ensemble_file_is_one_clear_error(tmp_path, data, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        load_ensemble(path)


def test_a_member_of_the_other_kernel_model_is_one_clear_error():
    with pytest.raises(ValueError, match="does not price with"):
        member_profile(load_profile("h200-occupancy-v1"), {"name": "long", "half_length_scale": 4.0})
    with pytest.raises(ValueError, match="prices with the length curve"):
        member_profile(V1, {"name": "blocks", "block_cost_scale": 4.0})


def _straggler(tmp_path, name, score_profile):
    setting = custom_setting(dp=2, cp=2, seq_len=16384, gbs=4)
    cfg = StragglerConfig(workload="libra-prod", profile=BASE, settings=[setting], windows=1, seed=0,
                          methods=("ulysses", "libra-adaptive"), shape=make_shape(32, 4, 128),
                          out=str(tmp_path / name), quiet=True, score_profile=score_profile)
    return run_straggler(cfg)[0], setting


def test_a_plan_scored_with_another_profile_is_priced_by_that_profile(tmp_path):
    truth = _member("heads-c4")
    same, setting = _straggler(tmp_path, "same", None)
    other, _ = _straggler(tmp_path, "other", truth)
    adaptive = other["method"] == "libra-adaptive"
    assert not np.allclose(other.loc[adaptive, "straggler_ms"], same.loc[adaptive, "straggler_ms"])
    # by hand: plan with the default profile through the registry, price with CostModel(truth)
    par, shape = setting.par(), make_shape(32, 4, 128)
    planner = get_planner("libra-adaptive", **planner_options("libra-adaptive", setting, profile=BASE))
    plans = planner.plan_window(load_windows("libra-prod", setting, 1, 0)[0], par, shape)
    model = CostModel(truth, Topology(truth, par))
    jitter = DeviceJitter(truth.variability, par.workers, jitter_seed(0, 0))
    manual = [model.price(p, speed=jitter.speeds(int(p.ga_index))).straggler_ms for p in plans]
    assert other.loc[adaptive, "straggler_ms"].tolist() == pytest.approx(manual, rel=1e-12)


def test_score_profile_equal_to_profile_is_the_run_without_it(tmp_path):
    outs = {}
    for name, extra in (("plain", []), ("same", ["--score-profile", DEFAULT_PROFILE]),
                        ("other", ["--score-profile", "h200-occupancy-v1"])):
        out = tmp_path / name
        res = CliRunner().invoke(main, ["straggler", *TINY, "--methods", "ulysses,libra", "--out", str(out), *extra])
        assert res.exit_code == 0, res.output
        outs[name] = (out, res.output)
    plain, same, other = (outs[k][0] for k in ("plain", "same", "other"))
    for f in ("straggler.csv", "straggler_summary.csv"):
        assert (plain / f).read_bytes() == (same / f).read_bytes()
    assert [p.name.split("-")[0] for p in (plain / ".points").iterdir()] == \
           [p.name.split("-")[0] for p in (same / ".points").iterdir()]
    configs = [json.loads((d / "run.json").read_text())["config"] for d in (plain, same, other)]
    assert configs[0] == configs[1] and "score_profile" not in configs[0]
    assert configs[2]["score_profile"]["name"] == "h200-occupancy-v1"
    assert "(scored with h200-occupancy-v1)" in run_caption(configs[2])
    assert "scored with profile h200-occupancy-v1" in outs["other"][1]
    assert (plain / "straggler.csv").read_bytes() != (other / "straggler.csv").read_bytes()


def test_a_bad_score_profile_is_one_error_line(tmp_path):
    res = CliRunner().invoke(main, ["tune", *TINY, "--score-profile", "nope", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--score-profile" in res.output and "unknown hardware profile" in res.output


def test_robustness_on_a_tiny_layout(tmp_path):
    out = tmp_path / "r"
    res = CliRunner().invoke(main, ["robustness", *TINY, "--methods", "ulysses,libra,libra-adaptive", "--out", str(out)])
    assert res.exit_code == 0, res.output
    summary = pd.read_csv(out / "robustness_summary.csv")
    assert {"speedup", "speedup_min", "speedup_max", "truth_speedup_min", "truth_speedup_max", "vs_libra_min",
            "vs_libra_window_min", "plans_with_profile"} <= set(summary.columns)
    row = summary.set_index("method").loc["libra-adaptive"]
    assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"] and np.isfinite(row["truth_speedup_min"])
    assert "libra-adaptive's worst ratio to libra over the ensemble" in res.output
    steps = pd.read_csv(out / "robustness.csv")
    # only the planner that plans with the profile is planned again per member (11 members are not the profile)
    truth = steps[steps["variant"] == "truth"]
    assert set(truth["method"]) == {"libra-adaptive"} and truth["member"].nunique() == 11
    assert steps[steps["variant"] == "default-planned"].groupby("method")["member"].nunique().eq(12).all()
    assert json.loads((out / "run.json").read_text())["config"]["ensemble"]["name"] == "default-v2"
    assert (out / "robustness.png").exists()


def test_robustness_bad_ensemble_is_one_error_line(tmp_path):
    res = CliRunner().invoke(main, ["robustness", *TINY, "--ensemble", "nope", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "unknown profile ensemble" in res.output
    assert not (tmp_path / "x").exists()
