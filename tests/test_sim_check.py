"""`libra-bench sim-check` on CPU (tiny sizes): kernel batches from the plan, predictions equal the
cost model's, summary arithmetic, bad input; the GPU run is marked."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.measured.gpu_common import worker_pieces
from experiments.measured.sim_check import SimCheckConfig, sim_check, summarize, worker_calls
from libra.config import TapConfig
from libra.data.windows import gbs_windows
from libra.sim.cost import CostModel
from libra.sim.profiles import DEFAULT_PROFILE, load_profile
from libra.sim.topology import Topology
from libra.tap.pipeline import ChunkSchedule, schedule_for_pool

TINY = ["--device", "cpu", "--seq-len", "1024", "--pool-size", "2", "--cp", "2", "--block-size", "128",
        "--head-split", "2", "--chunks", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16",
        "--windows", "1", "--warmup", "0", "--repeats", "2", "--rotate", "1", "--no-progress"]
TAP = TapConfig(pool_size=2, block_size=128, head_split=2, pipeline_chunks=2)
CFG = SimCheckConfig(seq_len=1024, cp=2, tap=TAP, q_heads=4, kv_heads=2, head_dim=16, windows=1)


@pytest.fixture(scope="module")
def plan():
    window = gbs_windows(CFG.workload, CFG.seq_len, CFG.par().gbs, 1, seed=0)[0]
    (p,) = CFG.planner().plan_window(window, CFG.par(), CFG.shape())
    return p


def test_worker_pieces_cover_every_query_token_and_head_once(plan):
    shape = plan.shape
    (pool,) = plan.pools
    T = int(pool.index().base[-1])
    cover = np.zeros((T, shape.num_q_heads), dtype=np.int64)
    for w in pool.workers:
        p = worker_pieces(pool, shape, w, schedule_for_pool(pool, shape, plan.pipeline_chunks))
        for qt, ql, h0, h1, kt, kl in zip(p["q_tok"], p["q_len"], p["head_start"], p["head_end"], p["kv_tok"],
                                          p["kv_len"]):
            cover[qt:qt + ql, h0:h1] += 1
            # a piece's keys are its sample's prefix, ending at its last query row
            assert kt + kl == qt + ql and kt >= 0
    assert np.all(cover == 1)


def test_worker_calls_match_the_cost_model_geometry(plan):
    (pool,) = plan.pools
    p = worker_pieces(pool, plan.shape, pool.workers[0], ChunkSchedule.for_pool(pool, plan.shape, plan.pipeline_chunks))
    calls = worker_calls(p, plan.shape, ChunkSchedule.for_pool(pool, plan.shape, plan.pipeline_chunks))
    assert len(calls) == plan.pipeline_chunks == 2
    seg, qh, kvh = calls[0]
    assert qh == 1 and kvh == 1  # tile width hq/H = 2 heads, M = 2 -> 1 query head (and 1 KV head) per call
    assert seg.total_q == int(p["q_len"].sum()) and seg.total_k == int(p["kv_len"].sum())


def test_cli_rows_predictions_equal_cost_model(tmp_path, plan):
    res = CliRunner().invoke(sim_check, [*TINY, "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for name in ("sim_check.csv", "sim_check.png", "run.json"):
        assert (tmp_path / name).stat().st_size > 0
    df = pd.read_csv(tmp_path / "sim_check.csv")
    assert sorted(df.worker) == list(range(4))
    prof = load_profile(DEFAULT_PROFILE)
    cost = CostModel(prof, Topology(prof, CFG.par())).price(plan)
    for r in df.itertuples():
        assert r.pred_fwd_ms == pytest.approx(cost.compute_fwd_ms[r.worker])
        assert r.pred_bwd_ms == pytest.approx(cost.compute_bwd_ms[r.worker])
        assert r.meas_fwd_ms > 0 and r.meas_bwd_ms > 0
        assert r.rel_err == pytest.approx(r.pred_ms / r.meas_ms - 1)
    assert df.flops_fwd.sum() == pytest.approx(cost.flops_fwd.sum())
    # every worker priced under the other piece-pricing rule too
    other = dataclasses.replace(prof, kernel=dataclasses.replace(prof.kernel, piece_pricing="prefix-difference"))
    alt = CostModel(other, Topology(other, CFG.par())).price(plan)
    for r in df.itertuples():
        assert r.pred_ms_other_rule == pytest.approx(alt.compute_ms[r.worker])
        assert r.rel_err_other_rule == pytest.approx(r.pred_ms_other_rule / r.meas_ms - 1)
    run = json.loads((tmp_path / "run.json").read_text())
    s = run["summary"]
    assert s["median_abs_err_total"] == pytest.approx(df.rel_err.abs().median())
    assert s["worst_abs_err_total"] == pytest.approx(df.rel_err.abs().max())
    assert "median |err|" in res.output and "prefix-difference would give" in res.output
    assert s["other_rule"] == "prefix-difference"
    assert s["median_abs_err_other_rule"] == pytest.approx(df.rel_err_other_rule.abs().median())


def test_summarize_hand_computed():
    df = pd.DataFrame({"window": [0, 0, 1, 1], "worker": [0, 1, 0, 1], "pred_ms": [1.0, 2.0, 3.0, 1.0],
                       "meas_ms": [1.0, 2.5, 2.0, 1.0]})
    df["rel_err"] = df.pred_ms / df.meas_ms - 1
    df["rel_err_fwd"] = df["rel_err_bwd"] = df["rel_err"]
    s = summarize(df)
    assert s["median_abs_err_total"] == pytest.approx(np.median([0, 0.2, 0.5, 0]))
    assert s["worst_abs_err_total"] == pytest.approx(0.5)
    assert s["straggler_worker_agrees"] == "2/2 windows"
    assert s["median_within_target"] is True


@pytest.mark.parametrize("kwargs, match", [
    ({"method": "nope"}, "unknown method 'nope'"),
    ({"tap": dataclasses.replace(TAP, block_size=100)}, "block size B=100"),
    ({"tap": dataclasses.replace(TAP, pipeline_chunks=3)}, "M=3"),
    ({"tap": {"pool_size": 2}}, "tap must be a TapConfig"),
    ({"kv_heads": 3}, "num_kv_heads=3 must divide"),
    ({"seq_len": 0}, "seq_len must be a positive integer"),
])
def test_config_rejects_bad_values(kwargs, match):
    base = dict(seq_len=1024, cp=2, tap=TAP, q_heads=4, kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=match):
        SimCheckConfig(**{**base, **kwargs})


def test_tap_options_come_from_tapconfig_with_this_commands_defaults():
    res = CliRunner().invoke(sim_check, ["--help"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for flag in ("--pool-size", "--block-size", "--head-split", "--tau", "--pipeline-chunks"):
        assert flag in text
    assert "soft load-target slack" in text and "[default: 0.03; x>=0.0]" in text
    assert "must divide DP [default: 2; x>=1]" in text  # sim-check's P, not TapConfig's 8


def test_tau_reaches_the_planner_and_the_run_record(tmp_path, planner_calls):
    seen = planner_calls
    res = CliRunner().invoke(sim_check, [*TINY, "--tau", "0.25", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert seen == [("libra", {"pool_size": 2, "block_size": 128, "head_split": 2, "tau": 0.25,
                               "pipeline_chunks": 2, "comm_aware": True})]
    tap = json.loads((tmp_path / "run.json").read_text())["config"]["tap"]
    assert tap["tau"] == 0.25 and tap["block_size"] == 128 and tap["pipeline_chunks"] == 2
    # TapConfig's default when --tau is not given; the TAP-only variants run M = 1
    assert SimCheckConfig().tap.tau == TapConfig.tau
    assert SimCheckConfig(method="libra-tap", seq_len=1024, cp=2, tap=TAP, q_heads=4, kv_heads=2,
                          head_dim=16).planner().tap == dataclasses.replace(TAP, pipeline_chunks=1)


def test_chunks_is_an_alias_of_pipeline_chunks():
    # TINY passes --chunks 2 (the default M is 4): the test above saw M = 2 reach the planner; the two
    # spellings are one option (experiments.common.options.tap_options)
    res = CliRunner().invoke(sim_check, ["--help"])
    assert res.exit_code == 0 and "--chunks, --pipeline-chunks" in res.output


@pytest.mark.parametrize("args, match", [
    (["--backend", "nope"], "unknown attention backend 'nope'"),
    (["--block-size", "100"], "block size B=100"),
])
def test_cli_bad_input(args, match, tmp_path):
    res = CliRunner().invoke(sim_check, [*TINY, *args, "--out", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert match in res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is absent")
def test_cuda_without_cuda(tmp_path):
    res = CliRunner().invoke(sim_check, [*TINY, "--device", "cuda", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "CUDA is not available" in res.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sim_check_on_cuda(tmp_path):
    args = ["--device", "cuda", "--seq-len", "16384", "--pool-size", "2", "--cp", "2", "--block-size", "2048",
            "--windows", "1", "--repeats", "3", "--no-progress", "--out", str(tmp_path)]
    res = CliRunner().invoke(sim_check, args)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "sim_check.csv")
    assert len(df) > 0 and np.all(df.meas_ms > 0)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), block=st.sampled_from([32, 64, 128, 256]), method=st.sampled_from(
    ["libra", "libra-tap", "ulysses"]), cp=st.sampled_from([1, 2, 4]))
def test_property_pieces_partition_the_pool(seed, block, method, cp):
    """Any plan: each worker's pieces, over all workers, cover every (query token, head) exactly once,
    and each piece reads exactly its sample's prefix up to its last query row."""
    cfg = SimCheckConfig(method=method, seq_len=1024, cp=cp, tap=dataclasses.replace(TAP, block_size=block), q_heads=4,
                         kv_heads=2, head_dim=16, windows=1, seed=seed)
    window = gbs_windows(cfg.workload, cfg.seq_len, cfg.par().gbs, 1, seed=seed)[0]
    for plan in cfg.planner().plan_window(window, cfg.par(), cfg.shape()):
        for pool in plan.pools:
            T = int(pool.index().base[-1])
            cover = np.zeros((T, 4), dtype=np.int64)
            starts = set(np.concatenate([pool.index().base[i] + s.sample_offsets[:-1]
                                         for i, s in enumerate(pool.sequences)]).tolist())
            for w in pool.workers:
                p = worker_pieces(pool, plan.shape, w, schedule_for_pool(pool, plan.shape, plan.pipeline_chunks))
                for qt, ql, h0, h1, kt, kl in zip(p["q_tok"], p["q_len"], p["head_start"], p["head_end"],
                                                  p["kv_tok"], p["kv_len"]):
                    cover[qt:qt + ql, h0:h1] += 1
                    assert kt + kl == qt + ql and int(kt) in starts
            assert np.all(cover == 1)


def test_a_profile_of_another_device_type_gets_no_verdict(tmp_path):
    # the built-in profiles model H100 kernels: timed against CPU kernels, a 99% error says how far
    # the two devices are apart, not how good the model is -- no met / NOT met verdict, and a note
    from experiments.measured.gpu_common import sim_check_verdict

    assert load_profile("h100-roce-v2").kernel_device_type == "cuda"
    cpu = dataclasses.replace(load_profile("h100-roce-v2"), source={"environment": {"device": "cpu"}})
    assert cpu.kernel_device_type == "cpu"
    assert dataclasses.replace(cpu, source={"environment": {"device": "cuda:1"}}).kernel_device_type == "cuda"
    res = CliRunner().invoke(sim_check, [*TINY, "--out", str(tmp_path / "gpu-profile")])
    assert res.exit_code == 0, res.output
    assert "target median <= 10%: no verdict (another device's profile)" in res.output
    assert "profile h100-roce-v2 models a cuda kernel and this run measured on cpu" in res.output
    summary = json.loads((tmp_path / "gpu-profile" / "run.json").read_text())["summary"]
    assert (summary["device_type"], summary["profile_device_type"]) == ("cpu", "cuda")
    base = {"median_within_target": False, "device_type": "cpu"}
    assert sim_check_verdict({**base, "profile_device_type": "cpu"}) == "NOT met"
    assert sim_check_verdict({**base, "profile_device_type": "cuda"}).startswith("no verdict")
    assert sim_check_verdict({"median_within_target": True}) == "met"  # a summary from before the record
