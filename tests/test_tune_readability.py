"""Choosing a configuration: tune lists candidates with bit-identical plans once, draws its methods
apart with the gaps that decide the ranking visible, says what straggler will predict for its
recommendation (and why it differs); compare of tune runs compares the recommended configurations
and shows P, H, B, M as values, not ratios."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main

LAYOUT = ["--dp", "8", "--cp", "4", "--seq-len", "64K", "--gbs", "32", "--windows", "1", "--no-progress"]


@pytest.fixture(scope="module")
def lengths(tmp_path_factory):
    path = tmp_path_factory.mktemp("tune") / "mine.txt"
    rng = np.random.default_rng(0)
    path.write_text("\n".join(map(str, np.clip(rng.lognormal(7, 1.5, 20000), 1, 200000).astype(int))))
    return path


@pytest.fixture(scope="module")
def tuned(lengths, tmp_path_factory):
    out = tmp_path_factory.mktemp("tuned") / "t"
    res = CliRunner().invoke(main, ["tune", "--workload", str(lengths), *LAYOUT, "--pool-sizes", "2,4",
                                    "--head-splits", "1,2,4", "--block-sizes", "4K", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out, res.output


def test_candidates_with_bit_identical_plans_are_listed_once(tuned):
    out, text = tuned
    table = pd.read_csv(out / "tune.csv")
    steps = pd.read_csv(out / "tune_steps.csv")
    merged = json.loads((out / "run.json").read_text())["same_plan_head_splits"]
    assert merged, "this workload has libra-adaptive pools planned alike at every H"
    for g in merged:
        rows = table[(table["method"] == g["method"]) & (table["pool_size"] == g["pool_size"])
                     & (table["block_size"] == g["block_size"]) & (table["pipeline_chunks"] == g["pipeline_chunks"])]
        assert set(rows["head_split"]) & set(g["head_splits"]) == {g["head_splits"][0]}
        assert (f"Same plans: {g['method']} at P={g['pool_size']}, B={g['block_size']}, M={g['pipeline_chunks']} "
                f"plans bit-identically for H={','.join(map(str, g['head_splits']))}; listed once") in text
        # what was simulated stays in the steps, without the digest that found the twins
        assert set(steps.loc[(steps["method"] == g["method"]) & (steps["pool_size"] == g["pool_size"]),
                             "head_split"]) >= set(g["head_splits"])
    assert "plan_digest" not in steps.columns and "plan_digest" not in table.columns


def test_the_recommendation_rerun_in_straggler_gives_the_number_tune_prints(tuned, tmp_path):
    out, text = tuned
    record = json.loads((out / "run.json").read_text())
    rec = record["recommendation"]
    command = record["recommendation_in_straggler"]
    assert f"Rerun it: {command}" in text
    args = command.split()[1:] + ["--no-progress", "--out", str(tmp_path / "s")]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    got = pd.read_csv(tmp_path / "s" / "straggler_summary.csv").set_index("method").loc[rec["method"], "mean_ms"]
    if rec["method"] == "libra-adaptive":  # straggler deepens its Pipeliner; tune says so and by how much
        assert got == pytest.approx(rec["as_straggler_ms"], rel=1e-12)
        m = re.search(r"straggler predicts (\S+) ms for libra-adaptive there, not (\S+) ms: it runs libra-adaptive "
                      r"with deepen_pipeline", text)
        assert m and float(m.group(1)) == pytest.approx(got, abs=0.05)
    else:
        assert got == pytest.approx(rec["mean_ms"], rel=1e-12)


def test_tune_png_tells_methods_apart_and_shows_the_gaps(tuned, monkeypatch):
    import matplotlib.figure  # noqa: PLC0415

    from experiments.figures.tune import plot_tune  # noqa: PLC0415

    out, _ = tuned
    seen, real = [], matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        seen.append(fig)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    table = pd.read_csv(out / "tune.csv")
    plot_tune(table, out / "again.png")
    left = seen[0].axes[0]
    legend = {t.get_text() for t in left.get_legend().get_texts()}
    assert {"libra", "libra-adaptive", "recommended"} <= legend
    assert "above rank 1 (%)" in left.get_xlabel()
    gaps = (table["mean_ms"].head(15) / table["mean_ms"].min() - 1) * 100
    lo, hi = left.get_xlim()
    assert lo <= 0 and hi < 1.3 * max(gaps.max(), 0.5)  # the axis spans the gaps, not 0..speedup


def _tune_folder(root, name, rows, recommended: int):
    folder = root / name
    folder.mkdir()
    table = pd.DataFrame(rows)
    table.insert(0, "rank", range(1, len(table) + 1))
    table["recommended"] = [i == recommended for i in range(len(table))]
    table.to_csv(folder / "tune.csv", index=False)
    (folder / "run.json").write_text(json.dumps({"experiment": "tune", "config": {"workload": name, "windows": 1}}))
    return folder


def test_compare_of_tune_runs_compares_the_recommended_config_with_p_h_b_m_as_values(tmp_path, monkeypatch):
    import matplotlib.figure  # noqa: PLC0415

    seen, real = [], matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        seen.append(fig)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    row = {"method": "libra", "head_split": 2, "pipeline_chunks": 4}
    a = _tune_folder(tmp_path, "a", [{**row, "pool_size": 8, "block_size": 8192, "mean_ms": 100.0, "speedup": 2.0},
                                     {**row, "pool_size": 4, "block_size": 4096, "mean_ms": 100.5, "speedup": 1.99}], 1)
    b = _tune_folder(tmp_path, "b", [{**row, "pool_size": 2, "block_size": 512, "mean_ms": 80.0, "speedup": 2.5}], 0)
    res = CliRunner().invoke(main, ["compare", str(a), str(b), "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert "compared rows are the recommended configuration" in res.output
    table = pd.read_csv(tmp_path / "c" / "compare.csv").set_index("metric")
    assert table.loc["mean_ms", "a"] == 100.5 and table.loc["pool_size", "a"] == 4  # not rank 1's 8
    assert table.loc["mean_ms", "ratio:b"] == pytest.approx(80.0 / 100.5)
    assert table.loc[["pool_size", "head_split", "block_size", "pipeline_chunks"], "ratio:b"].isna().all()
    (fig,) = seen
    titles = [ax.get_title() for ax in fig.axes]
    assert not any(t.startswith(("pool_size", "block_size", "head_split", "pipeline_chunks")) for t in titles)
    (values,) = [ax for ax in fig.axes if ax.tables]
    cells = {c.get_text().get_text() for c in values.tables[0].get_celld().values()}
    assert {"4096", "512"} <= cells and {"P (pool_size)", "B (block_size)"} <= {c.split(" libra")[0] for c in cells}
