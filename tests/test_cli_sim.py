"""CLI tests of the simulated experiments: straggler, pool-sweep, variability (--quick, small)."""

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main

STRAGGLER = ["straggler", "--quick", "--settings", "256k", "--methods", "ulysses,libra", "--no-progress"]


def invoke(args):
    result = CliRunner().invoke(main, args)
    return result


def test_straggler_quick_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ra = invoke(STRAGGLER + ["--out", str(a)])
    assert ra.exit_code == 0, ra.output
    rb = invoke(STRAGGLER + ["--out", str(b)])
    assert rb.exit_code == 0, rb.output
    assert (a / "straggler.csv").read_bytes() == (b / "straggler.csv").read_bytes()
    df = pd.read_csv(a / "straggler.csv")
    for col in ("workload", "setting", "method", "step", "straggler_ms", "compute_ms", "comm_exposed_ms"):
        assert col in df.columns
    assert set(df["method"]) == {"ulysses", "libra"} and set(df["setting"]) == {"256k"}
    assert len(df) == 2 * 4  # two methods x GA = 128 / 32 steps
    summary = pd.read_csv(a / "straggler_summary.csv").set_index("method")
    assert summary.loc["ulysses", "mean_norm"] == pytest.approx(1.0)
    assert summary.loc["libra", "mean_speedup"] > 1.0  # pooling beats Ulysses on the default workload
    run = json.loads((a / "run.json").read_text())
    assert run["profile"]["name"] == "h100-roce-v2"
    assert (a / "straggler.png").stat().st_size > 0
    assert "libra" in ra.output and "paper_mean_speedup" in ra.output
    # a second run into the same folder reuses every point
    points = {p: p.stat().st_mtime_ns for p in a.glob(".points/*/*.json")}
    rc = invoke(STRAGGLER + ["--out", str(a)])
    assert rc.exit_code == 0 and len(points) == 2 and {p: p.stat().st_mtime_ns for p in points} == points
    assert json.loads((a / "run.json").read_text()) == run  # same numbers: the record of the run that made them


def test_straggler_with_file_workload_and_user_profile(tmp_path):
    from libra.sim.profiles import load_profile

    prof = load_profile("h100-roce-v1").to_dict()
    prof["name"] = "mine"
    prof["links"]["roce"]["bandwidth_gbps"] = 25.0
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(prof))
    lengths = tmp_path / "lens.txt"
    lengths.write_text("\n".join(str(x) for x in [3000, 500, 120000, 800, 40000, 7000] * 400) + "\n")
    r = invoke(STRAGGLER + ["--profile", str(path), "--workload", str(lengths), "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "o" / "straggler.csv")
    assert df["workload"].iloc[0] == "lens.txt"
    assert json.loads((tmp_path / "o" / "run.json").read_text())["profile"]["name"] == "mine"


def test_straggler_prices_windows_for_a_planner_with_its_own_microbatch_count(tmp_path):
    """dynamic-cp forms its own number of microbatches: every method gets the window total (its step
    stragglers summed), and dynamic-cp's steps carry no GA-paired FLOPs-only references."""
    r = invoke(["straggler", "--quick", "--settings", "256k", "--methods", "ulysses,dynamic-cp,distca",
                "--no-progress", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "straggler.csv")
    summary = pd.read_csv(tmp_path / "straggler_summary.csv").set_index("method")
    for method, steps in df.groupby("method"):
        assert summary.loc[method, "window_ms"] == pytest.approx(steps["straggler_ms"].sum())
        assert summary.loc[method, "window_speedup"] == pytest.approx(
            summary.loc["ulysses", "window_ms"] / summary.loc[method, "window_ms"])
    dcp = df[df["method"] == "dynamic-cp"]
    assert len(dcp) != 4  # this window's samples make Megatron's scheduler form another count than GA = 4
    assert dcp["flops_ulysses_ms"].isna().all()
    assert len(df[df["method"] == "distca"]) == 4 and "window_ms" in r.output


@pytest.mark.parametrize("args, match", [
    (["--methods", "ulysses,foo"], "unknown method 'foo'"),
])
def test_straggler_bad_input(tmp_path, args, match):
    r = invoke(["straggler", "--quick", "--no-progress", "--out", str(tmp_path)] + args)
    assert r.exit_code != 0
    assert match in r.output


def test_pool_sweep_quick(tmp_path):
    r = invoke(["pool-sweep", "--quick", "--settings", "256k", "--pool-sizes", "2,8,3", "--methods",
                "libra-tap-vrsp,libra", "--no-progress", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    s = pd.read_csv(tmp_path / "pool_sweep_summary.csv")
    assert sorted(set(s["pool_size"])) == [2, 8]  # 3 does not divide DP = 32
    assert set(s["method"]) == {"libra-tap-vrsp", "libra"}
    for _, row in s.iterrows():
        assert row["straggler_norm"] == pytest.approx(row["compute_norm"] + row["comm_norm"])
    # the Pipeliner hides communication: full Libra exposes no more than the split variant sends
    full = s[s["method"] == "libra"].set_index("pool_size")
    split = s[s["method"] == "libra-tap-vrsp"].set_index("pool_size")
    assert (full["comm_norm"] <= split["comm_serial_norm"] + 1e-9).all()
    assert (tmp_path / "pool_sweep.png").exists()
    bad = invoke(["pool-sweep", "--quick", "--pool-sizes", "x", "--out", str(tmp_path)])
    assert bad.exit_code != 0 and "'x' in 'x' is not an integer" in bad.output
    bad = invoke(["pool-sweep", "--quick", "--pool-sizes", "64", "--out", str(tmp_path)])
    assert bad.exit_code != 0 and "no pool size in [64] divides DP=32" in bad.output


def test_variability_quick(tmp_path):
    r = invoke(["variability", "--quick", "--pool-sizes", "1,8", "--no-progress", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "variability.csv")
    assert set(df["pool_size"]) == {1, 8}
    assert df["spread"].mean() > 0  # speed-aware placement beats FLOPs-only placement on average
    s = pd.read_csv(tmp_path / "variability_summary.csv").set_index("pool_size")
    assert s.loc[8, "mean_spread"] > s.loc[1, "mean_spread"]  # larger pool, more device-runtime exposure
    assert "paper: 7.01%" in r.output
    bad = invoke(["variability", "--quick", "--pool-sizes", "3", "--out", str(tmp_path / "bad")])
    assert bad.exit_code != 0 and "no pool size in [3] divides DP=32" in bad.output


def test_wlb_llm_computes_the_same_attention_work_as_ulysses(tmp_path):
    """Default rejoin='none': per window, the perfect-balance bounds (total FLOPs) agree."""
    r = invoke(["straggler", "--quick", "--settings", "256k", "--methods", "ulysses,wlb-llm", "--no-progress",
                "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "straggler.csv")
    total = df.groupby("method")["balance_bound_ms"].sum()
    assert total["wlb-llm"] == pytest.approx(total["ulysses"], rel=1e-9)
    assert json.loads((tmp_path / "run.json").read_text())["config"]["wlb_rejoin"] == "none"


# --------------------------------------------------------------------------------------------
# TAP options: one decorator generated from TapConfig's fields
# --------------------------------------------------------------------------------------------

TAP_COMMANDS = ("straggler", "pool-sweep", "grid-search", "tune", "plan-cost", "e2e", "dp-scaling", "pp-balance")


def test_tap_options_are_generated_from_tapconfig():
    from dataclasses import fields

    import click

    from experiments.common.options import TAP_OPTION_HELP, tap_options
    from libra.config import TapConfig

    names = [f.name for f in fields(TapConfig)]
    assert list(TAP_OPTION_HELP) == names  # a new TapConfig field needs its flag and help here

    @click.command()
    @tap_options()
    def show(**kw):
        click.echo(json.dumps(kw, sort_keys=True))

    @click.command()
    @tap_options("block_size", "tau", per_setting=True)
    def overrides(**kw):
        click.echo(json.dumps(kw, sort_keys=True))

    runner = CliRunner()
    assert json.loads(runner.invoke(show, []).output) == {f.name: f.default for f in fields(TapConfig)}
    given = runner.invoke(show, ["--tau", "0.1", "--block-size", "8K", "--flops-only"])
    assert json.loads(given.output) == {f.name: f.default for f in fields(TapConfig)} | {
        "tau": 0.1, "block_size": 8192, "comm_aware": False}
    assert json.loads(runner.invoke(overrides, []).output) == {"block_size": None, "tau": None}
    bad = runner.invoke(show, ["--tau", "-1"])
    assert bad.exit_code != 0 and "--tau" in bad.output
    helptext = runner.invoke(show, ["--help"]).output
    for flag, _help in TAP_OPTION_HELP.values():
        for f in (flag,) if isinstance(flag, str) else flag:
            assert f.split("/")[0] in helptext
    assert json.loads(runner.invoke(show, ["--chunks", "2"]).output)["pipeline_chunks"] == 2  # the alias
    with pytest.raises(ValueError, match="not TapConfig fields"):
        tap_options("tau", "bogus")


@pytest.mark.parametrize("name", TAP_COMMANDS)
def test_tau_exists_wherever_the_tap_layout_is_used(name):
    r = invoke([name, "--help"])
    assert r.exit_code == 0, r.output
    assert "--tau" in r.output


def test_straggler_tap_options_reach_the_planners_and_the_record(tmp_path):
    r = invoke(STRAGGLER + ["--tau", "0.25", "--block-size", "8K", "--pipeline-chunks", "2", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "run.json").read_text())["config"]
    tap = config["settings"][0]["tap"]
    assert (tap["tau"], tap["block_size"], tap["pipeline_chunks"], tap["pool_size"]) == (0.25, 8192, 2, 8)
    libra = config["planner_options"]["256k"]["libra"]
    assert (libra["tau"], libra["block_size"], libra["pipeline_chunks"]) == (0.25, 8192, 2)
    assert set(pd.read_csv(tmp_path / "straggler.csv").query("method == 'libra'")["pipeline_chunks"]) == {2}
    bad = invoke(STRAGGLER + ["--pipeline-chunks", "3", "--out", str(tmp_path / "bad")])
    assert bad.exit_code != 0 and "Pipeliner chunks M=3 must divide hq/H=16" in bad.output
