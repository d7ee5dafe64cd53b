"""The shared experiment runner (experiments/runner.py)."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from experiments.runner import ExperimentRun, atomic_write_text, stable_hash


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "a.txt"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert os.listdir(path.parent) == ["a.txt"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600


def test_atomic_write_failure_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    atomic_write_text(path, "old")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.txt"]


def test_points_resume_and_force(tmp_path):
    calls = []

    def fn(key):
        calls.append(key)
        return [{"key": key, "value": key * 10}]

    run = ExperimentRun("demo", {"a": 1}, out_dir=tmp_path, quiet=True)
    rows = run.map(range(3), fn)
    assert [r["value"] for r in rows] == [0, 10, 20] and calls == [0, 1, 2]

    # an interrupted sweep: rerun with more keys reuses the finished ones
    run2 = ExperimentRun("demo", {"a": 1}, out_dir=tmp_path, quiet=True)
    rows = run2.map(range(4), fn)
    assert calls == [0, 1, 2, 3] and run2.reused == 3 and run2.computed == 1
    assert [r["value"] for r in rows] == [0, 10, 20, 30]

    # a different config never sees these points
    run3 = ExperimentRun("demo", {"a": 2}, out_dir=tmp_path, quiet=True)
    run3.map(range(1), fn)
    assert calls[-1] == 0 and run3.computed == 1

    # --force recomputes
    run4 = ExperimentRun("demo", {"a": 1}, out_dir=tmp_path, force=True, quiet=True)
    run4.map(range(2), fn)
    assert run4.computed == 2 and run4.reused == 0


def test_finish_writes_csv_png_and_run_record(tmp_path):
    run = ExperimentRun("demo", {"seed": 3}, out_dir=tmp_path, quiet=True)
    df = pd.DataFrame({"x": [1, 2], "y": [3.0, 4.0]})

    def plot(frame, path):
        path.write_bytes(b"\x89PNG fake")

    paths = run.finish(df, plot=plot, extra={"note": "hi"})
    assert pd.read_csv(paths["csv"]).equals(df)
    assert paths["png"].read_bytes().startswith(b"\x89PNG")
    record = json.loads(paths["run"].read_text())
    assert record["config"] == {"seed": 3} and record["note"] == "hi" and record["rows"] == 2
    assert record["config_hash"] == stable_hash({"seed": 3})
    assert "packages" in record["environment"] and "git_sha" in record["environment"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "demo.csv", "demo.png", "run.json"]


def test_a_quick_run_never_writes_into_results(tmp_path, monkeypatch):
    # `lln --quick` (one window of the paper preset) wrote results/lln/, and the next `report` quoted
    # it as the newest Fig. 4 run instead of `make fig4`'s results/lln/256k
    from click.testing import CliRunner

    from experiments.cli import main

    monkeypatch.chdir(tmp_path)
    for args in (["lln", "--quick"], ["pool-sweep", "--quick", "--settings", "256k"],
                 ["calibrate", "--device", "cpu", "--quick"]):
        res = CliRunner().invoke(main, [*args, "--no-progress"])
        assert res.exit_code == 0, (args, res.output)
    assert not (tmp_path / "results").exists()
    assert (tmp_path / "runs/lln/libra-prod-s256k-gbs128/lln.csv").is_file()
    assert (tmp_path / "runs/pool-sweep").is_dir() and (tmp_path / "runs/gpu").is_dir()
    # not --quick, a paper preset: make fig4's own folder, where a differing config is refused
    res = CliRunner().invoke(main, ["lln", "--no-progress", "--windows", "1"])
    assert res.exit_code == 0 and (tmp_path / "results/lln/256k/run.json").is_file(), res.output
    res = CliRunner().invoke(main, ["lln", "--no-progress", "--windows", "2"])
    assert res.exit_code == 1 and "results/lln/256k holds a different run (windows differ)" in res.output
