"""`libra-bench compare`: two or more result folders of one experiment side by side."""

import json

import pandas as pd
from click.testing import CliRunner

from experiments.cli import main


def _run(folder, experiment, config, rows, summary=True):
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"experiment": experiment, "config": config}))
    name = f"{experiment}_summary.csv" if summary else f"{experiment}.csv"
    pd.DataFrame(rows).to_csv(folder / name, index=False)
    return str(folder)


def _straggler(folder, workload, scale):
    rows = [{"workload": workload, "setting": s, "method": m, "mean_ms": base * scale, "mean_speedup": 100 / base,
             "pool_balanced_ratio": 1.0 + base / 1000} for s in ("256k", "1m") for m, base in
            (("ulysses", 100.0), ("libra", 40.0))]
    return _run(folder, "straggler", {"workload": workload, "windows": 4, "profile": {"name": "a"}}, rows)


def test_compare_lists_config_differences_and_ratios(tmp_path):
    a = _straggler(tmp_path / "a", "wiki.txt", 1.0)
    b = _straggler(tmp_path / "b", "prolong.json", 2.0)
    out = tmp_path / "cmp"
    r = CliRunner().invoke(main, ["compare", a, b, "--labels", "wiki,prolong", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "prolong vs wiki: config differs in workload" in r.output
    t = pd.read_csv(out / "compare.csv")
    assert list(t.columns[:3]) == ["setting", "method", "metric"]
    assert set(t["metric"]) == {"mean_ms", "mean_speedup", "pool_balanced_ratio"}
    ms = t[t["metric"] == "mean_ms"]
    assert (ms["ratio:prolong"] == 2.0).all() and (ms["wiki"] == [100.0, 40.0, 100.0, 40.0]).all()
    assert (out / "compare.png").stat().st_size > 0
    assert json.loads((out / "run.json").read_text())["config_differences"]["prolong"] == ["workload"]


def test_compare_metrics_option_and_per_step_tables(tmp_path):
    rows = [{"setting": "256k", "method": "libra", "step": i, "straggler_ms": 10.0 + i} for i in range(4)]
    a = _run(tmp_path / "a", "microbench", {"x": 1}, rows, summary=False)
    b = _run(tmp_path / "b", "microbench", {"x": 2}, [dict(r, straggler_ms=2 * r["straggler_ms"]) for r in rows],
             summary=False)
    r = CliRunner().invoke(main, ["compare", a, b, "--metrics", "straggler_ms", "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    t = pd.read_csv(tmp_path / "c" / "compare.csv")
    assert len(t) == 1 and t["a"].iloc[0] == 11.5 and t["ratio:b"].iloc[0] == 2.0  # mean over steps


def test_compare_bad_input_is_one_line(tmp_path):
    a = _straggler(tmp_path / "a", "w", 1.0)
    b = _straggler(tmp_path / "b", "w", 1.0)
    other = _run(tmp_path / "o", "tune", {}, [{"method": "libra", "mean_ms": 1.0}])
    empty = tmp_path / "empty"
    empty.mkdir()
    for args, match in ((["compare", a], "at least two"), (["compare", a, other], "different experiments"),
                        (["compare", a, str(empty)], "no run.json"),
                        (["compare", a, b, "--metrics", "nope"], "not numeric columns"),
                        (["compare", a, a], "distinct names")):
        r = CliRunner().invoke(main, args + ["--out", str(tmp_path / "x")])
        assert r.exit_code == 2 and match in r.output and "Traceback" not in r.output, (args, r.output)


def _one_setting(folder, setting, methods, scale=1.0):
    rows = [{"workload": "mine.txt", "setting": setting, "method": m, "mean_ms": 10.0 * (i + 1) * scale,
             "mean_speedup": 1.0 + i, "pool_balanced_ratio": 1.1} for i, m in enumerate(methods)]
    return _run(folder, "straggler", {"dp": 8, "setting": setting}, rows)


def test_compare_runs_of_two_layouts_matches_rows_on_method(tmp_path):
    # README's "bring your own data and cluster": two runs on two layouts name their one setting
    # after the layout, so rows pair on the method (not all NaN as when matched on the setting too)
    a = _one_setting(tmp_path / "a", "dp8-cp4-s128k-gbs32", ("ulysses", "libra"))
    b = _one_setting(tmp_path / "b", "dp16-cp2-s128k-gbs32", ("ulysses", "libra", "libra-adaptive"), scale=2.0)
    out = tmp_path / "cmp"
    r = CliRunner().invoke(main, ["compare", a, b, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "setting differs per run (a: dp8-cp4-s128k-gbs32, b: dp16-cp2-s128k-gbs32): rows matched on method" \
        in r.output
    assert "1 (method) row(s) are missing from some run: NaN there" in r.output
    t = pd.read_csv(out / "compare.csv")
    assert "setting" not in t.columns
    ms = t[t["metric"] == "mean_ms"].set_index("method")
    assert ms.loc["libra", "ratio:b"] == 2.0 and ms.loc["ulysses", "b"] == 20.0
    assert pd.isna(ms.loc["libra-adaptive", "a"])
    record = json.loads((out / "run.json").read_text())
    assert record["config"]["run_naming_keys"] == {"setting": ["dp8-cp4-s128k-gbs32", "dp16-cp2-s128k-gbs32"]}


def test_compare_runs_that_share_no_row_is_one_error(tmp_path):
    a = _straggler(tmp_path / "a", "w", 1.0)  # settings 256k and 1m
    b = _one_setting(tmp_path / "b", "dp8-cp4-s128k-gbs32", ("ulysses", "libra"))
    r = CliRunner().invoke(main, ["compare", a, b, "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "the runs share no (setting, method) row to compare" in r.output
    assert "b: setting {dp8-cp4-s128k-gbs32}" in r.output and not (tmp_path / "x").exists()


def test_compare_tune_runs_takes_the_recommended_candidate(tmp_path):
    # a tune table ranks every (P, H, B, M) candidate: its mean over candidates means nothing, and
    # what tune says to run is its recommendation (ties go to the smaller P), not always rank 1
    def tune(folder, scale):
        rows = [{"rank": r, "method": m, "pool_size": p, "head_split": 2, "block_size": 16384, "pipeline_chunks": 4,
                 "mean_ms": ms * scale, "speedup": 100 / (ms * scale), "recommended": r == 2}
                for r, (m, p, ms) in enumerate((("libra-adaptive", 8, 50.0), ("libra", 4, 60.0),
                                                ("libra-adaptive", 4, 70.0), ("libra", 8, 90.0)), start=1)]
        return _run(folder, "tune", {"cp": scale}, rows, summary=False)

    a, b = tune(tmp_path / "a", 1), tune(tmp_path / "b", 2)
    out = tmp_path / "cmp"
    r = CliRunner().invoke(main, ["compare", a, b, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "tune: compared rows are the recommended configuration" in r.output
    t = pd.read_csv(out / "compare.csv").set_index(["method", "metric"])
    assert t.loc[("libra", "mean_ms"), "a"] == 60.0 and t.loc[("libra", "mean_ms"), "b"] == 120.0
    assert ("libra-adaptive", "mean_ms") not in t.index  # rank 1, but not recommended
    assert t.loc[("libra", "pool_size"), "a"] == 4 and pd.isna(t.loc[("libra", "pool_size"), "ratio:b"])
    assert "16384" in r.output and "e+04" not in r.output
