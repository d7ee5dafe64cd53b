"""`libra-bench plan-cost --quick`: outputs, printed figures, resumable points, bad input."""

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main


@pytest.mark.slow
def test_plan_cost_quick_writes_and_prints(tmp_path):
    out = tmp_path / "pc"
    runner = CliRunner()
    result = runner.invoke(main, ["plan-cost", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out / "plan-cost.csv")
    assert list(df.columns) == ["setting", "stage", "median_ms", "iqr_ms", "repeats", "paper_ms"]
    stages = {"vrsp", "tap", "tap.tiles", "tap.placement", "tap.exchange", "compile", "prepare",
              "prepare.unpickle", "prepare.runner", "prepare.digest"}
    for setting in ("256k", "1m"):  # every stage at both paper settings, nothing else (no JIT warmup row)
        assert set(df[df["setting"] == setting]["stage"]) == stages
    assert set(df["setting"]) == {"256k", "1m"}
    main_rows = df[df["stage"].isin(["vrsp", "tap", "compile", "prepare"])].set_index(["setting", "stage"])
    assert main_rows.loc[("256k", "vrsp"), "paper_ms"] == 2.2
    assert main_rows.loc[("1m", "tap"), "paper_ms"] == 10.7
    assert pd.isna(main_rows.loc[("1m", "compile"), "paper_ms"])      # the paper gives no figure
    assert (main_rows["median_ms"] > 0).all()
    assert main_rows.loc[("256k", "tap"), "repeats"] == 2 * 16      # 2 repeats x 16 pools (4 GA x 4 pools)
    for stage in ("compile", "prepare"):                            # 2 repeats x 2 sampled workers
        assert main_rows.loc[("1m", stage), "repeats"] == 2 * 2
    assert (out / "plan-cost.png").stat().st_size > 0
    record = json.loads((out / "run.json").read_text())
    assert record["config"]["repeats"] == 2 and record["points_computed"] > 0
    assert record["placer"] == record["config"]["placer"] and record["placer"] in ("numba", "python")
    assert isinstance(record["jit_warmup_ms"], dict)
    assert record["targets_ms"]["256k"] == {"vrsp": 2.2, "tap": 1.2, "compile": 50.0, "prepare": 5.0}
    assert f"placer: {record['placer']}" in result.output
    assert "compile per worker" in result.output and "target <= 50 ms" in result.output
    assert "target <= 1.2 ms" in result.output and "target <= 5.4 ms" in result.output
    quality = pd.read_csv(out / "plan-cost-quality.csv").set_index(["setting", "method"])
    for setting in ("256k", "1m"):
        # Libra moves fewer bytes than the cluster-wide DistCA pool and balances far better than Ulysses
        assert quality.loc[(setting, "libra"), "bytes_total"] < quality.loc[(setting, "distca-paper"), "bytes_total"]
        assert quality.loc[(setting, "libra"), "stage_max_over_mean"] < quality.loc[(setting, "ulysses"), "stage_max_over_mean"]
        # every pool Libra leaves above 1 + tau holds a tile heavier than the target (indivisible)
        row = quality.loc[(setting, "libra")]
        assert row["pools_over_1_plus_tau"] == row["pools_over_with_tile_above_target"]
    assert "VRSP + workload estimation per step" in result.output and "paper 2.2 ms" in result.output
    assert "ulysses" in result.output and "distca" in result.output
    points = {p: p.stat().st_mtime_ns for p in out.glob(".points/*/*.json")}
    again = runner.invoke(main, ["plan-cost", "--quick", "--out", str(out)])
    assert again.exit_code == 0, again.output
    assert points and {p: p.stat().st_mtime_ns for p in points} == points  # resumed from points
    assert json.loads((out / "run.json").read_text()) == record and "run.json kept" in again.output


def test_plan_cost_bad_input(tmp_path):
    runner = CliRunner()
    zero = runner.invoke(main, ["plan-cost", "--repeats", "0", "--out", str(tmp_path)])
    assert zero.exit_code != 0 and "repeats" in zero.output
    none = runner.invoke(main, ["plan-cost", "--compile-workers", "0", "--out", str(tmp_path)])
    assert none.exit_code != 0 and "compile-workers" in none.output


def test_compile_sample_spreads_over_the_pool():
    from experiments.figures.plan_cost import sample_ranks

    assert sample_ranks(64, 1) == [32]
    assert sample_ranks(64, 4) == [13, 25, 38, 50]
    assert sample_ranks(3, 5) == [0, 1, 2]


@pytest.mark.parametrize("methods, match", [("nope", "unknown planner 'nope'"),
                                            ("libra,ulysses", "'ulysses' does not plan pools with TAP")])
def test_plan_cost_times_tap_planners_only(tmp_path, methods, match):
    res = CliRunner().invoke(main, ["plan-cost", "--quick", "--methods", methods, "--out", str(tmp_path)])
    assert res.exit_code == 2 and match in res.output and "Traceback" not in res.output, res.output
