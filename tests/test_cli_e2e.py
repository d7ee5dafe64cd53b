"""CLI tests of the simulated end-to-end experiments (dp-scaling, pp-balance, e2e): outputs and errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main


def _run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_dp_scaling_writes_normalized_scaling(tmp_path):
    res = _run(["dp-scaling", "--settings", "1m", "--dps", "1,4", "--windows", "1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "dp-scaling.csv")
    assert set(df.method) == {"ulysses", "libra"} and set(df.dp) == {1, 4}
    assert (df[df.dp == 1].scaling == 1.0).all()
    assert ((df.scaling > 0) & (df.scaling <= 4.0 + 1e-9)).all()
    assert (tmp_path / "dp-scaling.png").stat().st_size > 0
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["config"]["dps"] == {"1m": [1, 4]} and record["profile"] == "h100-roce-v2"
    # a rerun reuses the finished points
    points = {p: p.stat().st_mtime_ns for p in tmp_path.glob(".points/*/*.json")}
    again = _run(["dp-scaling", "--settings", "1m", "--dps", "1,4", "--windows", "1", "--out", str(tmp_path)])
    assert again.exit_code == 0 and len(points) == 4
    assert {p: p.stat().st_mtime_ns for p in points} == points  # none recomputed
    assert json.loads((tmp_path / "run.json").read_text()) == record  # same numbers: the record is kept


def test_pp_balance_normalizes_to_libra_mean(tmp_path):
    res = _run(["pp-balance", "--settings", "1m", "--windows", "1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "pp-balance.csv")
    lib = df[df.method == "libra"]
    assert lib.normalized_fwd.mean() == pytest.approx(1.0)
    assert len(lib) == 4 * 8  # DP 4 x GA 8 microbatches on stage 0
    assert "worst microbatch" in res.output


def test_e2e_simulated_subset(tmp_path):
    res = _run(["e2e", "--models", "qwen3-8b", "--settings", "1m", "--dps", "2", "--windows", "1",
                "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "e2e.csv")
    assert set(df.method) == {"ulysses", "wlb-llm", "libra"} and set(df.gpus) == {64}
    assert (df.tokens_per_gpu_s > 0).all() and (df.source == "simulated").all()
    assert "mean tokens/GPU/s over 1 window(s)" in res.output


@pytest.mark.parametrize("args, match", [
    (["dp-scaling", "--dps", "2,4"], "must include 1"),
    (["dp-scaling", "--dps", "1,3"], "GBS=128 must be a multiple of DP=3"),
    (["e2e", "--models", "gpt5"], "unknown model 'gpt5'"),
])
def test_bad_options_fail_with_clear_messages(args, match, tmp_path):
    res = CliRunner().invoke(main, args + ["--out", str(tmp_path)])
    assert res.exit_code != 0
    assert match in res.output


def test_e2e_tap_options_are_for_the_simulated_settings(tmp_path):
    res = _run(["e2e", "--measure", "--tau", "0.1", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "--tau set the simulated settings' layout" in res.output
    bad = _run(["dp-scaling", "--settings", "1m", "--dps", "1", "--windows", "1", "--block-size", "3000",
                "--out", str(tmp_path)])
    assert bad.exit_code != 0 and "block size B=3000 must divide S/CP=65536" in bad.output

