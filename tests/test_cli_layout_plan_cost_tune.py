"""Your layout on `plan-cost` and `tune`, and tune's spread over windows."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main

TUNE_SMALL = ["tune", "--no-progress", "--pool-sizes", "2", "--head-splits", "2", "--block-sizes", "8192",
              "--methods", "libra"]


def invoke(args):
    return CliRunner().invoke(main, args)


def test_plan_cost_on_a_users_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke(["plan-cost", "--quick", "--no-progress", "--dp", "4", "--cp", "2", "--seq-len", "32K", "--gbs", "8",
                "--pool-size", "2", "--block-size", "4K", "--q-heads", "16", "--head-dim", "64"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "runs" / "plan-cost" / "libra-prod-dp4-cp2-s32k-gbs8-p2-b4k-h2-m4"
    df = pd.read_csv(out / "plan-cost.csv")
    assert list(df.columns) == ["setting", "stage", "median_ms", "iqr_ms", "repeats", "paper_ms"]
    assert set(df["setting"]) == {"dp4-cp2-s32k-gbs8"}
    assert {"vrsp", "tap", "compile", "prepare"} <= set(df["stage"]) and (df["median_ms"] > 0).all()
    assert df["paper_ms"].isna().all()  # not the paper's run: no paper numbers
    record = json.loads((out / "run.json").read_text())
    st = record["config"]["settings"][0]
    assert (st["dp"], st["cp"], st["seq_len"], st["gbs"], st["tap"]["pool_size"]) == (4, 2, 32768, 8, 2)
    assert record["config"]["shape"]["num_q_heads"] == 16 and record["config"]["shape"]["head_dim"] == 64
    assert record["targets_ms"] == {} and record["paper_settings"] == []
    stage_lines = [line for line in r.output.splitlines() if " median " in line]
    assert len(stage_lines) == 4  # vrsp, tap, compile, prepare: medians only, no target or paper column
    assert not any("target" in line or "paper" in line for line in stage_lines)
    assert "targets: goals" not in r.output
    assert "no targets or paper numbers for dp4-cp2-s32k-gbs8" in r.output
    assert "16q/4kv heads d=64" in r.output
    assert not (tmp_path / "results").exists()
    quality = pd.read_csv(out / "plan-cost-quality.csv")
    assert set(quality["method"]) == {"ulysses", "wlb-llm", "libra", "distca-paper", "distca"}


def test_plan_cost_settings_are_a_comma_list_and_repeatable():
    cmd = main.get_command(None, "plan-cost")

    def parsed(args):
        return cmd.make_context("plan-cost", list(args)).params["settings_"]

    assert parsed([]) == "256k,1m"
    assert parsed(["--setting", "1M", "--setting", "256k"]) == "1M,256k"
    assert parsed(["--settings", "1m,256K"]) == "1m,256K"


def test_plan_cost_config_file(tmp_path):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text('quick = true\n[plan-cost]\ndp = 2\ncp = 2\nseq-len = "16K"\ngbs = 4\nchunks = 2\n')
    r = invoke(["plan-cost", "--config", str(cfg), "--no-progress", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    record = json.loads((tmp_path / "o" / "run.json").read_text())
    st = record["config"]["settings"][0]
    assert (st["name"], st["tap"]["pipeline_chunks"]) == ("dp2-cp2-s16k-gbs4", 2)
    assert record["config_file"]["values"]["seq_len"] == "16K"


def test_tune_setting_preset_fills_the_layout_and_flags_override(tmp_path):
    r = invoke(TUNE_SMALL + ["--quick", "--setting", "256K", "--dp", "4", "--cp", "2", "--seq-len", "16K",
                             "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    par = json.loads((tmp_path / "run.json").read_text())["config"]["par"]
    assert par == {"dp": 4, "cp": 2, "seq_len": 16384, "gbs": 128}  # GBS from the 256k preset
    assert "DP 4, CP 2, S 16384, GBS 128" in r.output


@pytest.mark.parametrize("args, needle", [
    ([], "tune needs a layout"),
    (["--settings", "256k,1m"], "tune tunes one layout"),
])
def test_tune_layout_errors(tmp_path, args, needle):
    r = invoke(TUNE_SMALL + ["--quick"] + args + ["--out", str(tmp_path)])
    assert r.exit_code == 2 and needle in r.output


def test_tune_config_file_with_a_preset(tmp_path):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text('[tune]\nsetting = "1m"\ndp = 4\ncp = 2\nseq-len = "16K"\ngbs = 8\nquick = true\n'
                   'pool-sizes = [2]\nhead-splits = [2]\nblock-sizes = [8192]\nmethods = "libra"\n')
    r = invoke(["tune", "--config", str(cfg), "--no-progress", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "o" / "run.json").read_text())["config"]["par"] == {
        "dp": 4, "cp": 2, "seq_len": 16384, "gbs": 8}


def test_tune_reports_the_spread_over_windows_and_says_when_it_is_noise(tmp_path):
    # libra at M = 1 plans exactly as libra-tap-vrsp (no Pipeliner overlap): equal per-window speedups,
    # so the two must be reported within the spread of each other
    r = invoke(["tune", "--no-progress", "--windows", "2", "--dp", "4", "--cp", "2", "--seq-len", "16K", "--gbs",
                "8", "--pool-sizes", "2", "--head-splits", "2", "--block-sizes", "4096", "--chunks", "1",
                "--methods", "libra,libra-tap-vrsp", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    t = pd.read_csv(tmp_path / "tune.csv")
    steps = pd.read_csv(tmp_path / "tune_steps.csv")
    u = steps[steps["method"] == "ulysses"].groupby("window")["straggler_ms"].mean()
    for _, row in t.iterrows():  # the columns are what they say: Ulysses / candidate on each window
        c = steps[steps["method"] == row["method"]].groupby("window")["straggler_ms"].mean()
        ratio = u / c
        assert row["speedup_window_mean"] == pytest.approx(ratio.mean())
        assert row["speedup_window_min"] == pytest.approx(ratio.min())
        assert row["speedup_window_max"] == pytest.approx(ratio.max())
        assert row["windows"] == 2 and row["speedup_window_min"] < row["speedup_window_max"]
    assert t["within_noise"].all() and (t["windows_behind_rank1"] == 0).all()
    assert "speedup per window" in r.output and "mean [min, max]" in r.output
    first = t.iloc[0]
    assert (f"{first['speedup_window_mean']:.2f} [{first['speedup_window_min']:.2f}, "
            f"{first['speedup_window_max']:.2f}]") in r.output
    assert "Noise: the top 2 candidates are within the window-to-window spread (noise): ranks 1, 2" in r.output
    assert json.loads((tmp_path / "run.json").read_text())["within_noise_ranks"] == [1, 2]


def _ranked(ranges, windows=3):
    rows = [{"rank": i + 1, "windows": windows, "speedup_window_min": lo, "speedup_window_max": hi,
             "speedup_window_mean": (lo + hi) / 2, "max_speedup_window_min": lo, "max_speedup_window_max": hi}
            for i, (lo, hi) in enumerate(ranges)]
    return pd.DataFrame(rows)


def test_within_noise_is_range_overlap_with_the_top_candidate():
    from experiments.figures.tune import noise_line, within_noise

    assert within_noise(_ranked([(1.5, 1.7), (1.4, 1.55), (1.2, 1.45), (1.0, 1.6)])) == [1, 2, 4]
    assert within_noise(_ranked([(1.5, 1.7), (1.2, 1.45)])) == []          # separated: no noise line
    assert within_noise(_ranked([(1.5, 1.7), (1.6, 1.65)])) == [1, 2]      # inside the best's range
    assert within_noise(_ranked([(1.5, 1.7), (1.5, 1.7)], windows=1)) == []  # one window: no spread
    assert within_noise(_ranked([(1.5, 1.7)])) == []
    table = _ranked([(1.5, 1.7), (1.4, 1.55), (1.2, 1.45)])
    assert within_noise(table, "max") == [1, 2]
    assert noise_line(table).startswith("Noise: the top 2 candidates are within the window-to-window spread")
    assert "rank 1's [1.50, 1.70] over 3 windows" in noise_line(table)
    assert noise_line(_ranked([(1.5, 1.7), (1.2, 1.45)])).startswith("Spread: rank 1's per-window speedup range")
    assert "no window-to-window spread" in noise_line(_ranked([(1.5, 1.5), (1.5, 1.5)], windows=1))


def test_windows_behind_best_is_a_paired_count():
    from experiments.figures.tune import noise_line, windows_behind_best

    idx = pd.Index([0, 1, 2], name="window")
    best = pd.DataFrame({"speedup": [1.2, 1.6, 1.4]}, index=idx)
    always_behind = pd.DataFrame({"speedup": [1.1, 1.5, 1.3]}, index=idx)  # overlapping range, behind everywhere
    mixed = pd.DataFrame({"speedup": [1.3, 1.5, 1.4]}, index=idx)
    assert windows_behind_best([best, always_behind, mixed], "speedup") == [0, 3, 1]
    table = _ranked([(1.2, 1.6), (1.1, 1.5), (1.3, 1.5)]).assign(windows_behind_rank1=[0, 3, 1])
    assert "rank 1 is ahead of rank 2 on every one of the 3 windows" in noise_line(table)
    assert np.isfinite(table["speedup_window_mean"]).all()


def test_plan_cost_times_another_planner_and_its_parts(tmp_path):
    """``--methods libra,libra-adaptive``: its per-pool call as ``tap@libra-adaptive`` and the parts
    it names (candidates, pricing) as rows of their own, printed against libra's TAP."""
    out = tmp_path / "pc"
    r = invoke(["plan-cost", "--quick", "--no-progress", "--dp", "4", "--cp", "2", "--seq-len", "32K", "--gbs", "8",
                "--pool-size", "2", "--block-size", "4K", "--methods", "libra,libra-adaptive", "--out", str(out)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "plan-cost.csv").set_index("stage")
    parts = ["tap@libra-adaptive", "tap@libra-adaptive.candidates", "tap@libra-adaptive.pricing",
             "tap@libra-adaptive.rebalance", "tap@libra-adaptive.depth"]
    assert set(parts) <= set(df.index) and (df.loc[parts, "median_ms"] > 0).all()
    assert (df.loc[parts, "repeats"] == df.loc["tap", "repeats"]).all()  # every pool, every repeat
    assert "TAP per pool, libra-adaptive" in r.output and "x libra's" in r.output
    ratio = df.loc["tap@libra-adaptive", "median_ms"] / df.loc["tap", "median_ms"]  # the extension's planning-time target, printed
    assert f"x libra's  target <= 2x ({'met' if ratio <= 2 else 'NOT met'})" in r.output
    assert "parts (median ms, x libra's TAP): candidates" in r.output and "pricing" in r.output
    assert "rebalance" in r.output
