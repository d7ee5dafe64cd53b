"""`libra-bench microbench`: a tiny spawned CPU run writes the measured CSV, resumes, and rejects bad input."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main

TINY = ["microbench", "--nproc", "2", "--dp", "2", "--cp", "1", "--pool-size", "2", "--seq-len", "256", "--gbs", "2",
        "--block-size", "32", "--head-split", "2", "--chunks", "2", "--q-heads", "4", "--kv-heads", "2",
        "--head-dim", "8", "--repeats", "1", "--warmup", "0", "--methods", "ulysses,libra", "--no-progress",
        "--timeout", "60"]


@pytest.mark.slow
@pytest.mark.distributed
def test_tiny_spawned_run_and_resume(tmp_path):
    out = tmp_path / "mb"
    res = CliRunner().invoke(main, TINY + ["--tau", "0.2", "--out", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    df = pd.read_csv(out / "microbench.csv")
    from experiments.measured.microbench import STRAGGLER_COLUMNS

    assert list(df.columns[:len(STRAGGLER_COLUMNS)]) == STRAGGLER_COLUMNS  # the straggler schema first
    assert set(df["method"]) == {"ulysses", "libra"}
    assert len(df) == 2 and df["measured"].all()
    for col in ("straggler_ms", "compute_ms", "comm_exposed_ms", "mean_worker_ms", "pipeline_chunks",
                "peak_transient_bytes", "backend", "device"):
        assert col in df.columns
    assert (df["straggler_ms"] > 0).all() and (df["straggler_ms"] >= df["mean_worker_ms"] - 1e-9).all()
    assert df.set_index("method").loc["libra", "pipeline_chunks"] == 2
    run = json.loads((out / "run.json").read_text())
    assert run["measured"] and run["kernel_backend"] == "cpu-flash" and run["device"] == "cpu"
    assert run["config"]["tap"]["tau"] == 0.2 and run["config"]["tap"]["pipeline_chunks"] == 2
    assert (out / "microbench.png").exists() and (out / "microbench_summary.csv").exists()
    # a rerun of the same config reuses the finished points (no processes spawned)
    again = CliRunner().invoke(main, TINY + ["--tau", "0.2", "--out", str(out)])
    assert again.exit_code == 0, again.output
    assert json.loads((out / "run.json").read_text())["points_reused"] == 2


@pytest.mark.parametrize("args,message", [
    (["--nproc", "3"], "must equal DP*CP=2"),
    (["--methods", "ulysses,ring"], "unknown method 'ring'"),
    (["--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["--comm", "nccl"], "unknown comm mode 'nccl'"),
    (["--repeats", "0"], "0 is not in the range x>=1"),
    (["--device", "cuda"], "torchrun"),
])
def test_bad_input_is_rejected_before_spawning(tmp_path, args, message):
    res = CliRunner().invoke(main, TINY + args + ["--out", str(tmp_path / "x")])
    assert res.exit_code == 2, res.output
    assert message in res.output


def test_tap_options_come_from_tapconfig_with_this_commands_defaults():
    res = CliRunner().invoke(main, ["microbench", "--help"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for flag in ("--pool-size", "--block-size", "--head-split", "--tau", "--pipeline-chunks"):
        assert flag in text
    assert "soft load-target slack" in text and "[default: 0.03; x>=0.0]" in text
    assert "(accepts 4K) [default: 256]" in text  # microbench's CPU-sized B, not TapConfig's 4096


def test_tau_reaches_every_tap_planner():
    from dataclasses import replace

    from experiments.measured.microbench import DEFAULT_TAP, make_config, make_planner

    cfg = make_config(dp=2, cp=2, seq_len=2048, gbs=4, tap=replace(DEFAULT_TAP, tau=0.2), q_heads=8, kv_heads=2,
                      head_dim=32, dtype="fp32", device="cpu", backend="auto", comm="p2p",
                      methods="ulysses,wlb-llm,distca-paper,libra-tap,libra-tap-vrsp,libra", windows=1,
                      workload="libra-prod", seed=0, repeats=1, warmup=0, backward=True, timeout=60.0)
    assert cfg["tap"]["tau"] == 0.2 and cfg["tap"]["block_size"] == 256  # what run.json records
    for method in ("distca-paper", "libra-tap", "libra-tap-vrsp", "libra"):
        planner = make_planner(method, cfg)
        assert planner.tap.tau == 0.2 and planner.tap.block_size == 256, method
    assert make_planner("libra", cfg).tap.pipeline_chunks == 2


def test_chunks_is_an_alias_of_pipeline_chunks():
    # one option with two spellings (experiments.common.options.tap_options), not two options that may disagree
    res = CliRunner().invoke(main, ["microbench", "--help"])
    assert res.exit_code == 0 and "--chunks, --pipeline-chunks" in res.output
