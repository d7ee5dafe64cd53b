"""A layout everywhere: `variability` and `grid-search` on the paper's settings or
your own layout (--dp --cp --seq-len --gbs), with the paper's numbers only on a paper run."""

from __future__ import annotations

import json
from dataclasses import replace

import matplotlib.figure
import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main

LAYOUT = ["--dp", "8", "--cp", "2", "--seq-len", "64K", "--gbs", "16"]


def invoke(args):
    return CliRunner().invoke(main, args)


@pytest.fixture
def plotted(monkeypatch):
    """Labels of the lines and the count of unfilled rectangles (grid outlines) of every saved figure."""
    seen: list[dict] = []
    save = matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        seen.append({"lines": [ln.get_label() for ax in fig.axes for ln in ax.lines],
                     "outlines": sum(1 for ax in fig.axes for p in ax.patches if not p.get_fill())})
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return seen


def test_variability_on_a_users_layout_goes_to_runs_without_paper_numbers(tmp_path, monkeypatch, plotted):
    monkeypatch.chdir(tmp_path)
    r = invoke(["variability", *LAYOUT, "--block-size", "8K", "--windows", "1", "--no-progress"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "runs" / "variability" / "libra-prod-dp8-cp2-s64k-gbs16-b8k-h2-h100-roce-v2"
    rec = json.loads((out / "run.json").read_text())["config"]["setting"]
    assert (rec["dp"], rec["cp"], rec["seq_len"], rec["gbs"], rec["tap"]["block_size"]) == (8, 2, 65536, 16, 8192)
    df = pd.read_csv(out / "variability.csv")
    assert set(df["setting"]) == {"dp8-cp2-s64k-gbs16"} and set(df["pool_size"]) == {1, 2, 4, 8}  # P | DP
    assert set(df["workers"]) == {2, 4, 8, 16}  # W = P x CP
    summary = pd.read_csv(out / "variability_summary.csv")
    assert not [c for c in summary if c.startswith("paper")] and "setting" not in summary
    assert "(paper:" not in r.output
    assert not any(label.startswith("paper") for fig in plotted for label in fig["lines"])
    assert not (tmp_path / "results").exists()


@pytest.mark.slow  # four runs at the paper's layouts
def test_variability_paper_numbers_only_on_a_paper_run(tmp_path, plotted):
    paper = invoke(["variability", "--quick", "--settings", "256K,1m", "--pool-sizes", "1,8", "--no-progress",
                    "--out", str(tmp_path / "paper")])
    assert paper.exit_code == 0, paper.output
    s = pd.read_csv(tmp_path / "paper" / "variability_summary.csv")
    assert list(s["setting"]) == ["256k", "256k", "1m", "1m"]  # several settings: a setting column
    assert (s["paper_mean_spread"] == 0.0701).all() and (s["paper_max_spread"] == 0.1507).all()
    assert paper.output.count("(paper: 7.01%, 15.07%)") == 2
    assert sum(label.startswith("paper") for label in plotted[-1]["lines"]) == 4  # mean + max per panel
    config = json.loads((tmp_path / "paper" / "run.json").read_text())["config"]
    assert [x["name"] for x in config["settings"]] == ["256k", "1m"]
    for extra in (["--workload", "libra-prod-light"], ["--head-split", "4"], ["--kv-heads", "8"]):
        other = invoke(["variability", "--quick", "--setting", "256k", "--pool-sizes", "8", "--no-progress",
                        *extra, "--out", str(tmp_path / extra[0])])
        assert other.exit_code == 0, other.output
        assert "(paper:" not in other.output, extra
        assert not [c for c in pd.read_csv(tmp_path / extra[0] / "variability_summary.csv") if "paper" in c]
        assert not any(label.startswith("paper") for label in plotted[-1]["lines"])


def test_grid_search_on_a_users_layout_goes_to_runs_without_paper_numbers(tmp_path, monkeypatch, plotted):
    monkeypatch.chdir(tmp_path)
    r = invoke(["grid-search", "--quick", "--no-progress", "--dp", "4", "--cp", "2", "--seq-len", "32K",
                "--gbs", "8", "--head-splits", "1,2", "--pool-size", "2"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "runs" / "grid-search" / "libra-prod-dp4-cp2-s32k-gbs8-p2-h100-roce-v2"
    s = pd.read_csv(out / "grid-search_summary.csv")
    assert set(s["setting"]) == {"dp4-cp2-s32k-gbs8"}
    assert sorted(set(s["block_size"])) == [1024, 2048, 4096, 8192]  # S/CP = 16K halved 1-4 times
    assert set(s["pool_size"]) == {2} and set(s["kv_heads"]) == {4} and (s["status"] == "ok").all()
    assert not [c for c in s if c.startswith("paper")] and "paper_speedup" not in r.output
    assert plotted[-1]["outlines"] == 0
    rec = json.loads((out / "run.json").read_text())["config"]["settings"][0]
    assert (rec["dp"], rec["cp"], rec["seq_len"], rec["gbs"], rec["tap"]["pool_size"]) == (4, 2, 32768, 8, 2)
    assert not (tmp_path / "results").exists()


@pytest.mark.slow  # four runs at the paper's layouts
def test_grid_search_paper_columns_and_outlines_only_on_a_paper_run(tmp_path, plotted):
    base = ["grid-search", "--quick", "--no-progress", "--setting", "256K", "--head-splits", "1,4",
            "--block-sizes", "8K"]
    paper = invoke(base + ["--out", str(tmp_path / "paper")])
    assert paper.exit_code == 0, paper.output
    s = pd.read_csv(tmp_path / "paper" / "grid-search_summary.csv").set_index("head_split")
    assert s.loc[4, "paper_speedup_low"] == pytest.approx(1.89) and pd.isna(s.loc[1, "paper_speedup_low"])
    assert plotted[-1]["outlines"] == 1 and "paper_speedup_low" in paper.output
    for extra in (["--workload", "libra-prod-light"], ["--pool-size", "4"], ["--kv-heads", "4"]):
        other = invoke(base + extra + ["--out", str(tmp_path / extra[0])])
        assert other.exit_code == 0, other.output
        summary = pd.read_csv(tmp_path / extra[0] / "grid-search_summary.csv")
        assert not [c for c in summary if c.startswith("paper")], extra
        assert plotted[-1]["outlines"] == 0 and "paper_speedup" not in other.output


def test_grid_default_block_axis_follows_the_presets_rule():
    from experiments.figures.grid_search import GRID_BLOCK_SIZES, GRID_SETTINGS, default_block_sizes

    for name, setting in GRID_SETTINGS.items():
        assert default_block_sizes(replace(setting, name="mine")) == GRID_BLOCK_SIZES[name]


def test_config_file_sets_the_layout_of_both_commands(tmp_path):
    cfg = tmp_path / "layout.toml"
    cfg.write_text('dp = 8\ncp = 2\nseq-len = "64K"\ngbs = 16\nquick = true\nno-progress = true\n'
                   '[variability]\npool-sizes = [2, 4]\nblock-size = "8K"\n'
                   '[grid-search]\nhead-splits = [2]\nblock-sizes = ["4K", "8K"]\npool-size = 4\n')
    v = invoke(["variability", "--config", str(cfg), "--out", str(tmp_path / "v")])
    assert v.exit_code == 0, v.output
    rec = json.loads((tmp_path / "v" / "run.json").read_text())["config"]
    assert (rec["setting"]["dp"], rec["setting"]["cp"], rec["setting"]["seq_len"], rec["setting"]["gbs"],
            rec["setting"]["tap"]["block_size"], rec["pool_sizes"]) == (8, 2, 65536, 16, 8192, [2, 4])
    g = invoke(["grid-search", "--config", str(cfg), "--out", str(tmp_path / "g")])
    assert g.exit_code == 0, g.output
    rec = json.loads((tmp_path / "g" / "run.json").read_text())["config"]
    st = rec["settings"][0]
    assert (st["dp"], st["cp"], st["seq_len"], st["gbs"], st["tap"]["pool_size"]) == (8, 2, 65536, 16, 4)
    assert rec["head_splits"] == [2] and rec["block_sizes"] == {st["name"]: [4096, 8192]}
