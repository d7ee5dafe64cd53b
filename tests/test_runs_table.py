"""Your runs side by side (experiments.common.runs_table, `libra-bench report` over a user's folders): one row
per method with workload, layout, profile, straggler, speedup and bound; a Markdown table and a
self-contained HTML page with the figures; the Python API reads only."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.common.runs_table import load_runs

LAYOUT = ["--dp", "4", "--cp", "2", "--seq-len", "16K", "--gbs", "8", "--windows", "2", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("user") / "runs"
    lengths = root.parent / "mine.txt"
    lengths.write_text("".join(f"{n}\n" for n in [300, 9000, 120, 2200, 40, 700, 15000, 90] * 30))
    cli = CliRunner()
    for args in (["straggler", "--workload", str(lengths), *LAYOUT, "--methods", "ulysses,libra",
                  "--block-size", "2048", "--out", str(root / "a")],
                 ["straggler", "--workload", str(lengths), *LAYOUT, "--methods", "ulysses,libra",
                  "--block-size", "2048", "--profile", "paper-inferred-v1", "--out", str(root / "b")],
                 ["tune", "--workload", str(lengths), *LAYOUT, "--pool-sizes", "2,4", "--head-splits", "2",
                  "--methods", "libra", "--out", str(root / "t")],
                 ["lln", "--workload", str(lengths), "--seq-len", "16K", "--gbs", "8", "--windows", "2",
                  "--out", str(root / "g")]):
        res = cli.invoke(main, args)
        assert res.exit_code == 0, res.output
    # a measured run's folder as microbench writes it (its ranks are tested elsewhere)
    mb = root / "m"
    mb.mkdir()
    (mb / "run.json").write_text(json.dumps({"experiment": "microbench", "finished_utc": "2026-01-01T00:00:00",
                                             "config": {"dp": 2, "cp": 1, "seq_len": 2048, "gbs": 2,
                                                        "tap": {"pool_size": 2, "block_size": 256},
                                                        "workload": "workloads/skewed-2k.txt", "windows": 1}}))
    pd.DataFrame({"method": ["ulysses", "libra"], "mean_ms": [10.0, 8.0], "ideal_ms": [6.0, 6.0],
                  "ideal_ratio": [10 / 6, 8 / 6], "mean_speedup": [1.0, 1.25]}).to_csv(mb / "microbench_summary.csv",
                                                                                       index=False)
    (root / "broken").mkdir()
    (root / "broken" / "run.json").write_text('{"experiment": "straggler", "config": "abc"}')
    return root


def test_every_method_of_every_run_side_by_side(runs):
    tables = load_runs(runs)
    m = tables.methods.set_index(["folder", "method"])
    for run, profile in (("a", "h100-roce-v2"), ("b", "paper-inferred-v1")):
        summary = pd.read_csv(runs / run / "straggler_summary.csv").set_index("method")
        row = m.loc[(f"runs/{run}", "libra")]
        assert (row["workload"], row["profile"]) == ("mine.txt", profile)
        assert row["layout"].startswith("dp4-cp2-s16k-gbs8-") and "-b2k-" in row["layout"]
        assert row["straggler_ms"] == summary.loc["libra", "mean_ms"]
        assert row["speedup"] == summary.loc["libra", "mean_speedup"]
        assert row["bound_ms"] == summary.loc["libra", "bound_ms"] and row["bound"] == "perfect balance"
    tune = pd.read_csv(runs / "t" / "tune.csv")
    rec = tune[tune["recommended"]].iloc[0]
    row = tables.methods[(tables.methods["folder"] == "runs/t") & tables.methods["recommended"]].iloc[0]
    assert row["straggler_ms"] == rec["mean_ms"] and f"-p{rec['pool_size']}-" in row["layout"]
    mb = m.loc[("runs/m", "libra")]
    assert (mb["speedup"], mb["bound_ms"], mb["bound"]) == (1.25, 6.0, "measured reference")
    assert set(tables.runs["experiment"]) == {"straggler", "tune", "lln", "microbench"}
    assert tables.runs.set_index("folder").loc["runs/g", "figures"] == "lln.png"
    assert len(tables.problems) == 1 and "runs/broken" in tables.problems[0] and "config object" in tables.problems[0]


def test_the_api_writes_nothing_into_the_current_folder(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = sorted(p for p in runs.rglob("*"))
    load_runs(runs)
    assert list(tmp_path.iterdir()) == []
    assert sorted(p for p in runs.rglob("*")) == before


def test_report_over_your_runs_writes_markdown_and_a_self_contained_html_page(runs, tmp_path):
    res = CliRunner().invoke(main, ["report", "--results", str(runs), "--out", str(tmp_path / "REPRODUCTION.md")])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "runs.md").read_text()
    assert "| run | workload | layout | profile | method | straggler ms |" in md
    assert md.count("| runs/a | mine.txt |") == 2 and "paper-inferred-v1" in md and "libra *" in md
    page = (tmp_path / "runs.html").read_text()
    pngs = sorted(runs.rglob("*.png"))
    assert len(pngs) == 4 and page.count('src="data:image/png;base64,') == len(pngs)
    assert "src=\"http" not in page and "<link" not in page and "<script" not in page
    assert "| runs/b | mine.txt |" in res.output  # the table is printed too


def test_the_paper_results_report_writes_no_runs_page(tmp_path, monkeypatch):
    (tmp_path / "results").mkdir()
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["report", "--results", "results", "--out", "results/REPRODUCTION.md"])
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(tmp_path / "results")) == ["REPRODUCTION.md"]
