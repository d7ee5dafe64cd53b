"""`make check-results` (experiments/common/check_results.py): a recomputed slice of the committed
simulated results must match them exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.common.check_results import RowComparison, check_results, compare_rows, config_differences

ROOT = Path(__file__).resolve().parent.parent


def _frame(**cols):
    base = {"setting": ["256k", "256k"], "method": ["libra", "libra"], "window": ["0", "0"], "step": ["0", "1"]}
    return pd.DataFrame({**base, **cols}, dtype=str)


def test_identical_rows_have_no_difference_and_listed_timing_columns_are_ignored():
    a = _frame(straggler_ms=["1.5", "2.25"], plan_ms=["3", "4"])
    b = _frame(straggler_ms=["1.5", "2.25"], plan_ms=["5", "6"])
    assert compare_rows(a, b, ignore=("plan_ms",)) == RowComparison([])
    assert compare_rows(a, b).problems == [
        "{'setting': '256k', 'method': 'libra', 'window': '0', 'step': '0'} plan_ms: committed 3, recomputed 5",
        "{'setting': '256k', 'method': 'libra', 'window': '0', 'step': '1'} plan_ms: committed 4, recomputed 6"]


def test_a_changed_digit_a_row_or_a_column_is_a_difference():
    a = _frame(straggler_ms=["1.5", "2.25"])
    assert compare_rows(a, _frame(straggler_ms=["1.5", "2.2500000001"])).problems == [
        "{'setting': '256k', 'method': 'libra', 'window': '0', 'step': '1'} straggler_ms: committed 2.25, "
        "recomputed 2.2500000001"]
    assert compare_rows(a, a.iloc[:1]).problems == [
        "row {'setting': '256k', 'method': 'libra', 'window': '0', 'step': '1'} is only committed"]
    assert compare_rows(a, _frame(straggler_ms=["1.5", "2.25"], new=["1", "2"])).problems == [
        "column new is only recomputed"]
    assert compare_rows(_frame(planner=["a", "b"]), _frame(planner=["a", "c"])).problems == [
        "{'setting': '256k', 'method': 'libra', 'window': '0', 'step': '1'} planner: committed b, recomputed c"]


def test_last_bit_rounding_is_counted_not_failed():
    # numpy's AVX-512 math rounds the last bit differently from its AVX2 math: 2.25 vs one ulp above
    a = _frame(straggler_ms=["1.5", "2.25"], exposed_ms=["1000.0", "0.0"])
    b = _frame(straggler_ms=["1.5", "2.2500000000000004"], exposed_ms=["1000.0", "1e-13"])
    found = compare_rows(a, b)
    assert found.problems == [] and found.rounded == 2
    assert found.worst_rounding == 1.0  # 0 against 1e-13: all of its value, yet small against its column's 1000
    one_ulp = compare_rows(a, _frame(straggler_ms=["1.5", "2.2500000000000004"], exposed_ms=["1000.0", "0.0"]))
    assert one_ulp.rounded == 1 and one_ulp.worst_rounding == 2.0 ** -51 / 2.2500000000000004
    assert compare_rows(a, _frame(straggler_ms=["1.5", "2.25"], exposed_ms=["1000.0", "1e-8"])).problems


def test_a_recomputed_run_must_be_a_slice_of_the_committed_one():
    st = [{"name": "256k", "dp": 32}, {"name": "1m", "dp": 16}]
    committed = {"config": {"seed": 0, "windows": 8, "settings": st, "methods": ["ulysses", "libra"],
                            "planner_options": {"1m": {"libra": {"tau": 0.03}}}, "workload": "libra-prod"},
                 "inputs": {}}
    part = {"config": {"seed": 0, "windows": 1, "settings": st[1:], "methods": ["libra"],
                       "planner_options": {"1m": {"libra": {"tau": 0.03}}}, "workload": "libra-prod"}, "inputs": {}}
    assert config_differences(committed, part) == []
    moved = {"config": {**part["config"], "seed": 1, "methods": ["wlb-llm"],
                        "planner_options": {"1m": {"libra": {"tau": 0.05}}}}, "inputs": {}}
    assert config_differences(committed, moved) == ["config seed differs", "method wlb-llm is not in the committed run",
                                                    "planner options of 1m/libra differ"]
    other = {"config": {**part["config"], "workload": "x.txt"}, "inputs": {"workload": {"lengths_sha256": "ab"}}}
    assert config_differences(committed, other) == ["the workload's lengths differ"]


@pytest.mark.slow
def test_check_results_fails_on_an_edited_committed_number(tmp_path):
    shutil.copytree(ROOT / "results" / "straggler", tmp_path / "straggler")
    csv = tmp_path / "straggler" / "straggler.csv"
    lines = csv.read_text().splitlines(keepends=True)
    cells = lines[1].split(",")
    cells[5] = repr(float(cells[5]) * (1 + 1e-9))  # straggler_ms of a first-window row, past float rounding
    lines[1] = ",".join(cells)
    csv.write_text("".join(lines))
    res = CliRunner().invoke(check_results, ["--results", str(tmp_path), "--workloads", str(tmp_path / "none")])
    assert res.exit_code == 1, res.output
    assert "FAILED" in res.output and f"straggler_ms: committed {cells[5]}" in res.output
    assert "Wikipedia" in res.output and "skipped" in res.output and "flexsp_wikipedia.txt.gz not found" in res.output
