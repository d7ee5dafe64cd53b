"""`libra-bench microbench`: a tiny spawned CPU run writes the measured CSV, resumes, and rejects bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.measured import microbench as mb

ROOT = Path(__file__).resolve().parents[1]

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

    from experiments.measured.microbench import DEFAULT_TAP, MicrobenchConfig, make_planner

    cfg = MicrobenchConfig(dp=2, cp=2, seq_len=2048, gbs=4, tap=replace(DEFAULT_TAP, tau=0.2), q_heads=8, kv_heads=2,
                           head_dim=32, dtype="fp32", device="cpu", backend="auto", comm="p2p",
                           methods="ulysses,wlb-llm,distca-paper,libra-tap,libra-tap-vrsp,libra", windows=1,
                           workload="libra-prod", seed=0, repeats=1, warmup=0, backward=True, timeout=60.0)
    record = cfg.to_record()
    assert record["tap"]["tau"] == 0.2 and record["tap"]["block_size"] == 256  # what run.json records
    for method in ("distca-paper", "libra-tap", "libra-tap-vrsp", "libra"):
        planner = make_planner(method, cfg)
        assert planner.tap.tau == 0.2 and planner.tap.block_size == 256, method
    assert make_planner("libra", cfg).tap.pipeline_chunks == 2


def test_chunks_is_an_alias_of_pipeline_chunks():
    # one option with two spellings (experiments.common.options.tap_options), not two options that may disagree
    res = CliRunner().invoke(main, ["microbench", "--help"])
    assert res.exit_code == 0 and "--chunks, --pipeline-chunks" in res.output


# the Makefile's `microbench` target, which wrote the committed results/microbench-cpu
MAKE_MICROBENCH = ["microbench", "--nproc", "2", "--dp", "2", "--cp", "1", "--pool-size", "2", "--seq-len", "8192",
                   "--gbs", "2", "--block-size", "1024", "--head-split", "2", "--q-heads", "8", "--kv-heads", "2",
                   "--head-dim", "64", "--methods", "ulysses,libra,libra-kt,libra-adaptive", "--profile",
                   "results/microbench-cpu/calibrate-cpu/profile.json", "--workload", "workloads/skewed-8k.txt",
                   "--repeats", "3"]


def _committed_config() -> dict:
    return json.loads((ROOT / "results" / "microbench-cpu" / "run.json").read_text())["config"]


def test_the_config_record_round_trips_the_committed_run(monkeypatch):
    # run.json keeps the record, not the object: every committed field must come back from the typed config
    from libra.config import TapConfig

    monkeypatch.chdir(ROOT)  # the record names its profile relative to the repository
    record = _committed_config()
    fields = {k: v for k, v in record.items() if k != "threads"}  # threads is recorded, not chosen
    cfg = mb.MicrobenchConfig(**{**fields, "tap": TapConfig(**record["tap"])})
    assert cfg.to_record() == record
    assert cfg.methods == ("ulysses", "libra", "libra-kt", "libra-adaptive") and cfg.threads == mb.RANK_THREADS
    assert mb.MicrobenchConfig(**{**fields, "tap": cfg.tap, "methods": "ulysses, libra,libra-kt,libra-adaptive"}) == cfg


def test_the_makefile_command_records_the_committed_config(tmp_path, monkeypatch):
    # the same config record means the same config hash: a rerun reuses the committed run's points
    seen = {}

    def no_ranks(run, cfg, world, under_torchrun):
        seen.update(config=run.config, cfg=cfg)
        return None  # as a non-zero torchrun rank: nothing measured, nothing written

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(mb, "usable_cores", lambda: 2)
    monkeypatch.setattr(mb, "_measure", no_ranks)
    res = CliRunner().invoke(main, MAKE_MICROBENCH + ["--out", str(tmp_path / "mb")])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert seen["config"] == _committed_config()
    assert isinstance(seen["cfg"], mb.MicrobenchConfig) and seen["cfg"].par.seq_len == 8192


def test_config_errors_name_the_bad_value():
    from libra.config import TapConfig

    base = {k: v for k, v in _committed_config().items() if k not in ("threads", "profile")}
    base["tap"] = TapConfig(**base["tap"])
    for over, message in (({"methods": "ulysses,ring"}, "unknown method 'ring'"), ({"methods": ""}, "empty --methods"),
                          ({"dtype": "fp8"}, "unknown dtype 'fp8'"), ({"comm": "nccl"}, "unknown comm mode 'nccl'"),
                          ({"warmup": -1}, "--warmup must be >= 0"), ({"timeout": 0.0}, "--timeout must be > 0"),
                          ({"cp": 4, "dp": 1, "gbs": 1, "q_heads": 6,
                            "tap": TapConfig(pool_size=1, block_size=1024, pipeline_chunks=1)},
                           "ulysses needs CP=4 to divide q_heads=6"),
                          ({"methods": "ulysses,libra", "profile": "h100-roce-v1"}, "add one to --methods")):
        with pytest.raises(ValueError, match=re.escape(message)):
            mb.MicrobenchConfig(**{**base, **over})
