"""CLI tests of `libra-bench grid-search` (Figure 16) and `libra-bench tune` (tiny sizes, seconds)."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.figures.tune import (
    candidate_grid,
    default_block_sizes,
    default_head_splits,
    default_pool_sizes,
    recommend,
)
from libra.config import TapConfig

GRID = ["grid-search", "--quick", "--no-progress", "--setting", "256k", "--head-splits", "1,4",
        "--block-sizes", "8192,3000"]
TUNE = ["tune", "--quick", "--no-progress", "--dp", "4", "--cp", "2", "--seq-len", "16384", "--gbs", "8",
        "--pool-sizes", "2,4", "--head-splits", "1,2", "--block-sizes", "4096,8192"]


def invoke(args):
    return CliRunner().invoke(main, args)


def test_grid_search_quick_cells_skips_and_determinism(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ra = invoke(GRID + ["--out", str(a)])
    assert ra.exit_code == 0, ra.output
    assert invoke(GRID + ["--out", str(b)]).exit_code == 0
    assert (a / "grid-search.csv").read_bytes() == (b / "grid-search.csv").read_bytes()
    steps = pd.read_csv(a / "grid-search.csv")
    for col in ("setting", "method", "block_size", "head_split", "window", "step", "straggler_ms"):
        assert col in steps.columns
    assert set(steps["method"]) == {"ulysses", "libra-tap-vrsp"}
    assert set(steps["pipeline_chunks"]) == {1}  # sec. 6.6: Pipeliner off
    assert len(steps) == 3 * 16  # Ulysses + two valid cells, GA = 128 / 8 steps each
    s = pd.read_csv(a / "grid-search_summary.csv")
    assert len(s) == 4  # 2 H x 2 B, the invalid B kept as skipped rows
    skipped = s[s["status"] == "skipped"]
    assert set(skipped["block_size"]) == {3000}
    assert skipped["reason"].str.contains("must divide S/CP=32768").all()
    assert skipped["speedup"].isna().all()
    cell = s[(s["head_split"] == 4) & (s["block_size"] == 8192)].iloc[0]
    assert cell["tiles_per_sequence"] == 128 and cell["kv_heads"] == 16 and cell["q_heads"] == 32
    assert cell["paper_speedup_low"] == pytest.approx(1.89)
    u = steps[steps["method"] == "ulysses"]["straggler_ms"].mean()
    c = steps[(steps["method"] != "ulysses") & (steps["head_split"] == 4) & (steps["block_size"] == 8192)]
    assert cell["speedup"] == pytest.approx(u / c["straggler_ms"].mean())
    assert s[(s["head_split"] == 1) & (s["block_size"] == 8192)]["tiles_per_sequence"].iloc[0] == 32
    run = json.loads((a / "run.json").read_text())
    assert run["experiment"] == "grid-search" and run["profile"]["name"] == "h100-roce-v2"
    assert (a / "grid-search.png").stat().st_size > 0
    assert "skipped 256k H=1 B=3000" in ra.output
    points = {p: p.stat().st_mtime_ns for p in a.glob(".points/*/*.json")}
    rc = invoke(GRID + ["--out", str(a)])  # resumable: every point reused
    assert rc.exit_code == 0 and len(points) == 3 and {p: p.stat().st_mtime_ns for p in points} == points
    assert json.loads((a / "run.json").read_text()) == run  # same numbers: the record is kept


def test_grid_search_1m_kv_override_marks_replicated_kv(tmp_path):
    r = invoke(["grid-search", "--quick", "--no-progress", "--setting", "1m", "--head-splits", "8",
                "--block-sizes", "32768", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    s = pd.read_csv(tmp_path / "grid-search_summary.csv").iloc[0]
    assert s["kv_heads"] == 4 and bool(s["kv_replicated"])  # H = 8 > h_kv = 4
    assert s["tiles_per_sequence"] == 256 and s["paper_speedup_low"] == pytest.approx(1.58)
    assert np.isfinite(s["speedup"]) and s["speedup"] > 0


@pytest.mark.parametrize("args, match", [
    (["--q-heads", "24"], "h_kv=16"),
    (["--head-splits", "0"], "'0' in '0' must be >= 1"),
])
def test_grid_search_bad_input(tmp_path, args, match):
    r = invoke(["grid-search", "--quick", "--no-progress", "--setting", "256k", "--out", str(tmp_path)] + args)
    assert r.exit_code != 0
    assert match in r.output


def test_tune_quick_ranks_and_recommends(tmp_path):
    r = invoke(TUNE + ["--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    t = pd.read_csv(tmp_path / "tune.csv")
    # 8 (P, H, B) x {libra, libra-adaptive}, less the candidates planned bit-identically at a smaller H
    twins = sum(len(g["head_splits"]) - 1 for g in json.loads((tmp_path / "run.json").read_text())["same_plan_head_splits"])
    assert len(t) == 16 - twins and list(t["rank"]) == list(range(1, 17 - twins))
    assert set(t["method"]) == {"libra", "libra-adaptive"}
    assert t["mean_ms"].is_monotonic_increasing
    assert t["recommended"].sum() == 1
    assert set(t["pool_size"]) == {2, 4} and set(t["pipeline_chunks"]) == {4}
    assert set(t["tau"]) == {TapConfig().tau}  # TapConfig's defaults unless --tau / --pipeline-chunks
    assert np.allclose(t["speedup"], t["ulysses_mean_ms"] / t["mean_ms"])
    assert (t["tiles_per_sequence"] == 16384 // t["block_size"] * t["head_split"]).all()
    # straggler's loss decomposition per candidate: the factors' product is exactly the bound ratio
    factors = t["comm_factor"] * t["placement_factor"] * t["pooling_factor"] * t["kernel_factor"]
    assert np.allclose(factors, t["bound_ratio_gmean"], rtol=1e-12) and (t["bound_ratio_gmean"] > 1).all()
    assert np.allclose(t["pool_balanced_ratio"], t["comm_factor"] * t["placement_factor"])
    assert (t["flops_limit_speedup"] > 0).all()  # each candidate's own P in the FLOPs-only limit
    assert t.groupby("pool_size")["flops_libra_ms"].nunique().eq(1).all()  # the same per P, any method
    rec = t[t["recommended"]].iloc[0]
    assert rec.name == recommend(t.drop(columns=["recommended"]), 0.01)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["recommendation"]["pool_size"] == rec["pool_size"]
    assert (run["config"]["tau"], run["config"]["pipeline_chunks"]) == (TapConfig().tau, TapConfig().pipeline_chunks)
    assert run["recommendation"]["block_size"] == rec["block_size"]
    steps = pd.read_csv(tmp_path / "tune_steps.csv")
    assert set(steps["method"]) == {"ulysses", "libra", "libra-adaptive"} and len(steps) == 17 * 2  # GA = 8 / 4
    assert (tmp_path / "tune.png").stat().st_size > 0
    assert (f"Recommended: {rec['method']} with P={rec['pool_size']}, H={rec['head_split']}, "
            f"B={rec['block_size']}") in r.output
    only = invoke(TUNE + ["--methods", "libra", "--out", str(tmp_path / "libra")])
    assert only.exit_code == 0, only.output
    assert set(pd.read_csv(tmp_path / "libra" / "tune.csv")["method"]) == {"libra"}
    assert "Rule: lowest mean straggler" in r.output and "<- recommended" in r.output


@pytest.mark.parametrize("args, match", [
    (["--pool-sizes", "3"], "pool size P=3 must divide DP=4"),
    (["--block-sizes", "3000"], "block size B=3000 must divide S/CP=8192"),
    (["--head-splits", "3"], "head split H=3 must divide --q-heads=32"),
    (["--head-splits", "4", "--pipeline-chunks", "16"], "M=16 must divide hq/H=8"),
    (["--head-splits", "4", "--chunk-counts", "16,32"], "M=any of 16,32 must divide hq/H=8"),
    (["--head-splits", "1,8", "--chunk-counts", "4,64"], "M=64 divides hq/H for no head split H of [1, 8]"),
    (["--tie-tolerance", "-0.1"], "must be >= 0"),
    (["--methods", "libra,nope"],
     "unknown method 'nope'; choose from libra-tap, libra-tap-vrsp, libra, libra-kt, libra-adaptive"),
])
def test_tune_bad_input(tmp_path, args, match):
    base = list(TUNE)
    for flag in args[::2]:  # replace a flag already in TUNE
        if flag in base:
            i = base.index(flag)
            del base[i:i + 2]
    r = invoke(base + args + ["--out", str(tmp_path)])
    assert r.exit_code != 0
    assert match in r.output


def _table(rows):
    cols = ["pool_size", "head_split", "block_size", "tiles_per_sequence", "mean_ms", "max_ms"]
    return pd.DataFrame(rows, columns=cols)


def test_recommend_rule_on_constructed_case():
    t = _table([
        (8, 2, 4096, 128, 100.0, 120.0),  # best mean
        (2, 4, 8192, 128, 100.5, 150.0),  # within 1%, smaller P -> wins the tie
        (2, 2, 8192, 64, 100.9, 160.0),   # within 1%, same P, fewer tiles -> wins over the one above
        (1, 1, 4096, 64, 102.0, 101.0),   # outside 1%: not a tie even though P is smallest
    ])
    assert recommend(t, 0.01) == 2
    assert recommend(t, 0.0) == 0  # no tolerance: the strict best
    assert recommend(t, 0.05) == 3  # wide tolerance: P = 1 joins the tie
    assert recommend(t, 0.0, objective="max") == 3  # ranking by worst step
    tie = _table([(4, 2, 4096, 64, 50.0, 70.0), (4, 1, 8192, 64, 50.0, 60.0)])
    assert recommend(tie, 0.01) == 1  # same P and tiles: lower worst step
    with pytest.raises(ValueError, match="no candidate"):
        recommend(t.iloc[:0])
    with pytest.raises(ValueError, match="tie tolerance must be >= 0"):
        recommend(t, -1.0)
    with pytest.raises(ValueError, match="unknown objective 'p99'"):
        recommend(t, 0.01, objective="p99")


def test_default_candidate_axes():
    assert default_pool_sizes(12) == (1, 2, 3, 4, 6, 12)
    assert default_head_splits(32, 4) == (1, 2, 4, 8)
    assert default_head_splits(32, 16) == (1, 2)  # M must divide hq / H
    assert default_block_sizes(32768) == (32768, 16384, 8192, 4096, 2048)
    assert default_block_sizes(3000) == (3000, 1500)  # integral halvings >= 1024 only
    assert default_block_sizes(512) == (512,)


def test_candidate_grid_with_chunk_counts():
    """--chunk-counts: every (H, M) with M | hq/H, M innermost; a single M is the old (P, H, B) grid."""
    from libra.config import ParallelConfig  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    par, shape = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=16384), AttentionShape(32, 4, 128)
    grid = candidate_grid(par, shape, TapConfig(), (2,), (2, 8), (8192,), (4, 8))
    assert grid == [(2, 2, 8192, 4), (2, 2, 8192, 8), (2, 8, 8192, 4)]  # hq/H = 4 at H = 8: no M = 8
    assert candidate_grid(par, shape, TapConfig(), (2,), (2,), (8192,)) == [(2, 2, 8192, 4)]
    default_h = {h for _, h, _, m in candidate_grid(par, shape, TapConfig(), (2,), None, (8192,), (8, 16))}
    assert default_h == {1, 2, 4}  # H = 8 leaves hq/H = 4, which neither M divides


def test_tune_searches_chunk_counts(tmp_path):
    r = invoke(TUNE + ["--head-splits", "2", "--block-sizes", "8192", "--chunk-counts", "2,4", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    t = pd.read_csv(tmp_path / "tune.csv")
    assert len(t) == 8 and set(t["pipeline_chunks"]) == {2, 4}  # 2 P x 2 M x 2 planners
    steps = pd.read_csv(tmp_path / "tune_steps.csv")
    for (p, m), g in steps[steps["method"] == "libra"].groupby(["pool_size", "pipeline_chunks"]):
        row = t[(t["method"] == "libra") & (t["pool_size"] == p) & (t["pipeline_chunks"] == m)].iloc[0]
        assert row["mean_ms"] == pytest.approx(g["straggler_ms"].mean())
    assert json.loads((tmp_path / "run.json").read_text())["config"]["chunk_counts"] == [2, 4]
    rec = t[t["recommended"]].iloc[0]
    assert f"B={rec['block_size']}, M={rec['pipeline_chunks']}" in r.output and "(P, H, B, M) candidates" in r.output


def test_grid_search_without_a_valid_cell_exits_2_naming_why(tmp_path):
    res = invoke(["grid-search", "--quick", "--setting", "256k", "--block-sizes", "3000", "--out", str(tmp_path / "g")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    (error,) = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert "no valid (B, H) cell" in error and "256k" in error and "B=3000 must divide S/CP" in error
    assert not (tmp_path / "g").exists()
