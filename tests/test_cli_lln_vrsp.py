"""`libra-bench lln` and `libra-bench vrsp` through click's CliRunner."""

from __future__ import annotations

import json

import pandas as pd
from click.testing import CliRunner

from experiments.cli import main

COLUMNS = ["workload", "seq_len", "gbs", "strategy", "pool_size", "window", "r_minus_1", "r_minus_1_lower_bound"]
SMALL = ["--seq-len", "16K", "--gbs", "16", "--windows", "3"]


def invoke(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_vrsp_small_run_outputs_and_resume(tmp_path):
    out = tmp_path / "v"
    res = invoke("vrsp", *SMALL, "--out", str(out))
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "vrsp.csv")
    assert list(df.columns) == COLUMNS
    assert set(df["strategy"]) == {"production", "random", "zigzag", "zigzag-swap", "vrsp"}
    assert sorted(df["pool_size"].unique()) == [1, 2, 4, 8]  # P = GBS (one pool) left out by default
    assert len(df) == 3 * 5 * 4 and df["seq_len"].eq(16384).all()
    assert (df["r_minus_1"] >= df["r_minus_1_lower_bound"] - 1e-9).all()
    assert (out / "vrsp.png").read_bytes()[:4] == b"\x89PNG"
    record = json.loads((out / "run.json").read_text())
    assert record["config"]["gbs"] == 16 and record["points_computed"] == 3
    assert "mean R - 1 over 3 windows" in res.output and "vrsp" in res.output

    points = {p: p.stat().st_mtime_ns for p in out.glob(".points/*/*.json")}
    again = invoke("vrsp", *SMALL, "--out", str(out))
    assert len(points) == 3 and {p: p.stat().st_mtime_ns for p in points} == points  # every point reused
    assert pd.read_csv(out / "vrsp.csv").equals(df), again.output  # deterministic
    assert json.loads((out / "run.json").read_text()) == record and "run.json kept" in again.output
    invoke("vrsp", *SMALL, "--out", str(out), "--force")
    assert all(p.stat().st_mtime_ns != t for p, t in points.items())  # recomputed


def test_lln_production_only_and_quick(tmp_path):
    res = invoke("lln", "--seq-len", "8192", "--gbs", "8", "--quick", "--pool-sizes", "1,2,8", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "lln.csv")
    assert set(df["strategy"]) == {"production"} and sorted(df["pool_size"].unique()) == [1, 2, 8]
    assert df["window"].nunique() == 4  # --quick caps the windows
    assert (df.loc[df.pool_size == 8, "r_minus_1"] == 0).all()  # one pool: no imbalance


def test_file_workloads(tmp_path, workloads_dir):
    for name in ("flexsp_wikipedia.txt.gz", "distca_dist_prolong.json"):
        out = tmp_path / name
        res = invoke("vrsp", "--workload", str(workloads_dir / name), *SMALL, "--out", str(out))
        assert res.exit_code == 0, res.output
        assert pd.read_csv(out / "vrsp.csv")["workload"].eq(name).all()
