"""`make check-results` (experiments/common/check_results.py): a recomputed slice of the committed
simulated results must match them exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.common.check_results import check_results, compare_rows, config_differences

ROOT = Path(__file__).resolve().parent.parent


def _frame(**cols):
    base = {"setting": ["256k", "256k"], "method": ["libra", "libra"], "window": ["0", "0"], "step": ["0", "1"]}
    return pd.DataFrame({**base, **cols}, dtype=str)


def test_identical_rows_have_no_difference_and_listed_timing_columns_are_ignored():
    a = _frame(straggler_ms=["1.5", "2.25"], plan_ms=["3", "4"])
    b = _frame(straggler_ms=["1.5", "2.25"], plan_ms=["5", "6"])
    assert compare_rows(a, b, ignore=("plan_ms",)) == []
    assert compare_rows(a, b) == ["{'setting': '256k', 'method': 'libra', 'window': '0', 'step': '0'} plan_ms: "
                                  "committed 3, recomputed 5",
                                  "{'setting': '256k', 'method': 'libra', 'window': '0', 'step': '1'} plan_ms: "
                                  "committed 4, recomputed 6"]


def test_a_last_digit_a_row_or_a_column_is_a_difference():
    a = _frame(straggler_ms=["1.5", "2.25"])
    assert compare_rows(a, _frame(straggler_ms=["1.5", "2.2500000000000004"])) == [
        "{'setting': '256k', 'method': 'libra', 'window': '0', 'step': '1'} straggler_ms: committed 2.25, "
        "recomputed 2.2500000000000004"]
    assert compare_rows(a, a.iloc[:1]) == ["row {'setting': '256k', 'method': 'libra', 'window': '0', 'step': '1'} "
                                           "is only committed"]
    assert compare_rows(a, _frame(straggler_ms=["1.5", "2.25"], new=["1", "2"])) == ["column new is only recomputed"]


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
    cells[5] = cells[5] + "1"  # straggler_ms of a first-window row, one more digit
    lines[1] = ",".join(cells)
    csv.write_text("".join(lines))
    res = CliRunner().invoke(check_results, ["--results", str(tmp_path), "--workloads", str(tmp_path / "none")])
    assert res.exit_code == 1, res.output
    assert "FAILED" in res.output and f"straggler_ms: committed {cells[5]}" in res.output
    assert "Wikipedia" in res.output and "skipped" in res.output and "flexsp_wikipedia.txt.gz not found" in res.output
