"""Your layout on the simulated end-to-end commands: `dp-scaling`,
`pp-balance` and `e2e` take --dp --cp --seq-len --gbs (+ TAP and head options), `--dps` sweeps DP,
paper numbers only on the paper's presets, `--config` files, and e2e's printed statistic is the
plotted one."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import seaborn as sns
from click.testing import CliRunner

from experiments.cli import main

LAYOUT = ["--dp", "4", "--cp", "2", "--seq-len", "32K", "--gbs", "8"]
QUIET = ["--windows", "1", "--no-progress"]
EXTRA = {"dp-scaling": [], "pp-balance": [], "e2e": ["--models", "qwen3-8b", "--pp", "2"]}
TAG = "libra-prod-dp4-cp2-s32k-gbs8-p4-b4k-h2-m4"
PP_TAG = {"dp-scaling": "", "pp-balance": "-pp2", "e2e": "-pp2"}  # PP is part of the layout where it is set


def _invoke(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _paper_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if c.startswith("paper")]


def _quotes_paper(output: str) -> bool:
    """Whether a command's output compares with the paper ("...; paper 4.42x", "(paper 1.58x-...")."""
    return "; paper" in output or "(paper" in output


@pytest.mark.parametrize("name", ["dp-scaling", "pp-balance", "e2e"])
def test_a_users_layout_runs_records_and_stays_out_of_results(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = _invoke([name, *LAYOUT, *QUIET, *EXTRA[name]])
    assert r.exit_code == 0, r.output
    out = tmp_path / "runs" / name / (TAG + PP_TAG[name] + "-h100-roce-v2")
    df = pd.read_csv(out / f"{name}.csv")
    assert set(df["setting"]) == {"dp4-cp2-s32k-gbs8"}
    assert not _paper_columns(df) and not _quotes_paper(r.output)
    rec = json.loads((out / "run.json").read_text())["config"]["settings"]
    assert [(s["dp"], s["cp"], s["seq_len"], s["gbs"], s["tap"]["pool_size"]) for s in rec] == [(4, 2, 32768, 8, 4)]
    assert not (tmp_path / "results").exists()
    if name == "pp-balance":
        assert not _paper_columns(pd.read_csv(out / "pp-balance_summary.csv"))
        assert len(df[df.method == "libra"]) == 4 * 2  # DP 4 x GA 2 microbatches on stage 0


def test_dps_sweeps_dp_with_cp_s_and_gbs_fixed(tmp_path):
    r = _invoke(["dp-scaling", *LAYOUT, "--pool-size", "2", "--dps", "1,2,4,8", *QUIET, "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "dp-scaling.csv")
    assert sorted(set(df["dp"])) == [1, 2, 4, 8]
    assert set(df["cp"]) == {2} and set(df["gbs"]) == {8} and df["tokens"].nunique() == 1  # GBS fixed
    assert (df["gpus"] == df["dp"] * 2).all()
    pools = df[df.method == "libra"].set_index("dp")["pool_size"].to_dict()
    assert pools == {1: 1, 2: 2, 4: 2, 8: 2}  # the largest divisor of DP up to --pool-size
    assert (df[df.dp == 1]["scaling"] == 1.0).all()
    assert json.loads((tmp_path / "run.json").read_text())["config"]["dps"] == {"dp4-cp2-s32k-gbs8": [1, 2, 4, 8]}
    default = _invoke(["dp-scaling", *LAYOUT, *QUIET, "--out", str(tmp_path / "default")])
    assert default.exit_code == 0, default.output
    assert sorted(set(pd.read_csv(tmp_path / "default" / "dp-scaling.csv")["dp"])) == [1, 2, 4]


def test_e2e_dps_and_pp_on_a_users_layout(tmp_path):
    r = _invoke(["e2e", *LAYOUT, "--dps", "2,4", *QUIET, "--models", "qwen3-8b", "--pp", "2",
                 "--q-heads", "16", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "e2e.csv")
    assert sorted(set(df["dp"])) == [2, 4] and set(df["pp"]) == {2} and sorted(set(df["gpus"])) == [8, 16]
    config = json.loads((tmp_path / "run.json").read_text())["config"]
    assert config["heads"] == {"q_heads": 16} and config["pp"] == {"dp4-cp2-s32k-gbs8": 2}


@pytest.mark.slow  # five runs at the paper's 1M layout
def test_paper_columns_only_on_the_papers_layout_and_corpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paper = _invoke(["dp-scaling", "--settings", "1m", "--dps", "1,16", *QUIET, "--out", str(tmp_path / "p")])
    assert paper.exit_code == 0, paper.output
    df = pd.read_csv(tmp_path / "p" / "dp-scaling.csv").set_index(["method", "dp"])
    assert df.loc[("ulysses", 16), "paper_scaling"] == pytest.approx(4.42) and "paper 4.42x" in paper.output
    other = _invoke(["dp-scaling", "--settings", "1m", "--dps", "1,16", *QUIET, "--workload", "libra-prod-light",
                     "--out", str(tmp_path / "o")])
    assert other.exit_code == 0, other.output
    assert not _paper_columns(pd.read_csv(tmp_path / "o" / "dp-scaling.csv")) and not _quotes_paper(other.output)
    pp = _invoke(["pp-balance", "--settings", "1m", *QUIET, "--out", str(tmp_path / "pp")])
    assert pp.exit_code == 0 and "; paper 23.1 -> 1.57" in pp.output
    summary = pd.read_csv(tmp_path / "pp" / "pp-balance_summary.csv").set_index("method")
    assert summary.loc["ulysses", "paper_max"] == pytest.approx(23.1)
    heads = _invoke(["pp-balance", "--settings", "1m", *QUIET, "--q-heads", "16"])  # not the paper's shape
    assert heads.exit_code == 0, heads.output
    (folder,) = (tmp_path / "runs" / "pp-balance").iterdir()
    assert not _paper_columns(pd.read_csv(folder / "pp-balance_summary.csv")) and not _quotes_paper(heads.output)
    assert not (tmp_path / "results").exists()
    e2e = _invoke(["e2e", "--settings", "1m", "--models", "qwen3-8b", *QUIET, "--out", str(tmp_path / "e")])
    assert e2e.exit_code == 0 and "(paper 1.58x-3.24x)" in e2e.output  # the paper's grid: DP 2, 4, 8


CONFIG = """dp = 4
cp = 2
seq-len = "32K"
gbs = 8
windows = 1
[dp-scaling]
dps = [1, 2]
[e2e]
dps = [2, 4]
models = "qwen3-8b"
pp = 2
[pp-balance]
pp = 1
"""


@pytest.mark.parametrize("name, key, value", [("dp-scaling", "dps", {"dp4-cp2-s32k-gbs8": [1, 2]}),
                                              ("e2e", "dps", {"dp4-cp2-s32k-gbs8": [2, 4]}),
                                              ("pp-balance", "pp", 1)])
def test_config_file_sets_layout_and_sweep(name, key, value, tmp_path):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG)
    r = _invoke([name, "--config", str(cfg), "--no-progress", "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "out" / "run.json").read_text())["config"]
    (setting,) = config["settings"]
    assert (setting["dp"], setting["cp"], setting["seq_len"], setting["gbs"]) == (4, 2, 32768, 8)
    assert config[key] == value and config["windows"] == 1


# --------------------------------------------------------------------------------------------
# e2e: the printed table shows the statistic the PNG draws, labelled
# --------------------------------------------------------------------------------------------


@pytest.fixture
def drawn(monkeypatch):
    """The frames seaborn's catplot is asked to draw, and the y labels it ends up with."""
    seen = {"data": [], "ylabel": []}
    real = sns.catplot

    def spy(*args, **kwargs):
        seen["data"].append(kwargs["data"].copy())
        grid = real(*args, **kwargs)
        original = grid.set_axis_labels

        def labels(x, y, **kw):
            seen["ylabel"].append(y)
            return original(x, y, **kw)

        grid.set_axis_labels = labels
        return grid

    monkeypatch.setattr(sns, "catplot", spy)
    return seen


def _fake_training(monkeypatch):
    """`run_training` returning three steps per method, the first a slow warm-up (mean != median)."""
    import experiments.measured.train

    per_method = {"ulysses": [10.0, 100.0, 110.0], "libra": [20.0, 200.0, 230.0]}

    def fake(cfgs, on_message=None):
        results = []
        for index, c in enumerate(cfgs):
            steps = [{"step": i, "tokens_per_gpu_s": v, "loss": 1.0, "step_ms": 5.0}
                     for i, v in enumerate(per_method[c.attention])]
            for record in steps:
                on_message({"config": index, "step": record})
            on_message({"config": index, "done": {"steps": steps}})
            results.append({"steps": steps})
        return results

    monkeypatch.setattr(experiments.measured.train, "run_training", fake)


def test_e2e_measure_prints_and_plots_the_same_labelled_median(tmp_path, monkeypatch, drawn):
    _fake_training(monkeypatch)
    r = _invoke(["e2e", "--measure", "--steps", "3", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "median tokens/GPU/s over 2 step(s) after the first" in r.output  # step 0: the warm-up
    (frame,) = drawn["data"]
    plotted = frame.set_index("method")["tokens_per_gpu_s"].to_dict()
    assert plotted == {"ulysses": 105.0, "libra": 215.0}  # medians of steps 1-2, not means with the warm-up
    assert drawn["ylabel"] == ["median tokens/GPU/s"]
    for value in ("105.0", "215.0", "2.048"):  # the two medians and libra/ulysses
        assert value in r.output
    assert (tmp_path / "e2e-measured.png").stat().st_size > 0
    assert len(pd.read_csv(tmp_path / "e2e-measured.csv")) == 6  # the CSV keeps every step


def test_throughput_table_is_the_plotted_frame():
    from experiments.figures.e2e import throughput_frame, throughput_table

    df = pd.DataFrame({"setting": "s", "model": "m", "gpus": 8, "method": ["ulysses"] * 3 + ["libra"] * 3,
                       "tokens_per_gpu_s": [1.0, 10.0, 13.0, 2.0, 20.0, 50.0]})
    for stat in ("mean", "median"):
        frame = throughput_frame(df, stat)
        table = throughput_table(frame, stat)
        assert table.columns.name == f"{stat} tokens/GPU/s"
        for method, value in frame.set_index("method")["tokens_per_gpu_s"].items():
            assert table.loc[("s", "m", 8), method] == value == df[df.method == method].tokens_per_gpu_s.agg(stat)
