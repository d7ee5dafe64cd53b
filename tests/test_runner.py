"""The shared experiment runner (experiments/common/runner.py)."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from experiments.common.runner import ExperimentRun, atomic_write_text, stable_hash
from experiments.common.same_numbers import same_csv_numbers


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
    run.release()  # the interrupted process ends: its lock goes with it

    # an interrupted sweep: rerun with more keys reuses the finished ones
    run2 = ExperimentRun("demo", {"a": 1}, out_dir=tmp_path, quiet=True)
    rows = run2.map(range(4), fn)
    assert calls == [0, 1, 2, 3] and run2.reused == 3 and run2.computed == 1
    assert [r["value"] for r in rows] == [0, 10, 20, 30]
    run2.release()

    # a different config never sees these points
    run3 = ExperimentRun("demo", {"a": 2}, out_dir=tmp_path, quiet=True)
    run3.map(range(1), fn)
    assert calls[-1] == 0 and run3.computed == 1
    run3.release()

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


def test_no_command_writes_into_results_by_default(tmp_path, monkeypatch):
    # results/ holds what the make targets write with --out; a run without --out -- the paper's
    # preset or a --quick smoke -- goes under runs/, so it can never replace a committed result
    from click.testing import CliRunner

    from experiments.cli import main

    monkeypatch.chdir(tmp_path)
    for args in (["lln", "--quick"], ["vrsp", "--windows", "1"],
                 ["pool-sweep", "--quick", "--dp", "4", "--cp", "2", "--seq-len", "32K", "--gbs", "8", "--pool-sizes", "1,2"]):
        res = CliRunner().invoke(main, [*args, "--no-progress"])
        assert res.exit_code == 0, (args, res.output)
    assert not (tmp_path / "results").exists()
    assert (tmp_path / "runs/lln/libra-prod-s256k-gbs128/lln.csv").is_file()
    assert (tmp_path / "runs/vrsp/libra-prod-s256k-gbs128/vrsp.csv").is_file()
    assert (tmp_path / "runs/pool-sweep").is_dir()
    res = CliRunner().invoke(main, ["lln", "--no-progress", "--windows", "2"])
    assert res.exit_code == 1 and "runs/lln/libra-prod-s256k-gbs128 holds a different run (quick, windows differ)" in res.output


@pytest.mark.slow
def test_a_measured_calibration_writes_under_runs_by_default(tmp_path, monkeypatch):
    from click.testing import CliRunner  # noqa: PLC0415

    from experiments.cli import main  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["calibrate", "--device", "cpu", "--quick", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "runs/gpu").is_dir() and not (tmp_path / "results").exists()


def _finish(folder, value, png=b"png", config=None):
    run = ExperimentRun("demo", config or {"a": 1}, out_dir=folder, quiet=True)
    return run.finish(pd.DataFrame({"x": [value]}), plot=lambda d, p: p.write_bytes(png),
                      files={"demo_summary.csv": f"s\n{value}\n"})


def _stats(folder):
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()}


def test_a_rerun_with_the_same_numbers_changes_no_file(tmp_path):
    _finish(tmp_path, 1)
    record, files = (tmp_path / "run.json").read_bytes(), _stats(tmp_path)
    _finish(tmp_path, 1)  # another time, wall time and (on another commit) git SHA: same numbers
    assert (tmp_path / "run.json").read_bytes() == record and _stats(tmp_path) == files


def test_a_missing_data_file_or_a_new_png_is_written_beside_the_kept_record(tmp_path):
    # a fresh clone holds the committed summary, PNG and run.json, not the git-ignored per-step CSV
    _finish(tmp_path, 1)
    record = (tmp_path / "run.json").read_bytes()
    (tmp_path / "demo.csv").unlink()
    summary = _stats(tmp_path)["demo_summary.csv"]
    _finish(tmp_path, 1, png=b"png re-rendered")
    assert (tmp_path / "run.json").read_bytes() == record and _stats(tmp_path)["demo_summary.csv"] == summary
    assert (tmp_path / "demo.csv").read_text() == "x\n1\n" and (tmp_path / "demo.png").read_bytes() == b"png re-rendered"


def test_a_rerun_on_a_cpu_that_rounds_the_last_bit_differently_changes_no_file(tmp_path):
    # numpy's AVX-512 and AVX2 math can round the last bit apart: the same run on another host
    _finish(tmp_path, 2.25)
    record, files = (tmp_path / "run.json").read_bytes(), _stats(tmp_path)
    _finish(tmp_path, 2.2500000000000004)
    assert (tmp_path / "run.json").read_bytes() == record and _stats(tmp_path) == files
    assert (tmp_path / "demo.csv").read_text() == "x\n2.25\n"
    _finish(tmp_path, 2.2500001)  # past rounding: a changed number
    assert json.loads((tmp_path / "run.json").read_bytes()) != json.loads(record)
    assert (tmp_path / "demo.csv").read_text() == "x\n2.2500001\n"


def test_same_csv_numbers_tolerates_only_float_rounding():
    assert same_csv_numbers(b"a,b\nx,1.0\n", b"a,b\nx,1.0000000000000002\n")
    assert not same_csv_numbers(b"a,b\nx,1.0\n", b"a,b\ny,1.0\n")  # text is exact
    assert not same_csv_numbers(b"a,b\nx,1.0\n", b"a,c\nx,1.0\n")
    assert not same_csv_numbers(b"a,b\nx,1.0\n", b"a,b\nx,1.0\nx,1.0\n")
    assert not same_csv_numbers(b"a,b\nx,1.0\n", b"a,b\nx,1.000001\n")
    assert not same_csv_numbers(b"a\n1\n", b"")


def test_a_changed_number_rewrites_the_record(tmp_path):
    _finish(tmp_path, 1)
    old = json.loads((tmp_path / "run.json").read_text())
    _finish(tmp_path, 2)
    new = json.loads((tmp_path / "run.json").read_text())
    assert new["finished_utc"] != old["finished_utc"] and new["outputs"] == ["demo.csv", "demo.png", "demo_summary.csv"]
    assert (tmp_path / "demo_summary.csv").read_text() == "s\n2\n"


BAD_POINTS = {
    "rows emptied": lambda p: {**p, "rows": []},
    "value edited": lambda p: {**p, "rows": [{"k": 0, "v": 999}]},
    "hash missing": lambda p: {k: v for k, v in p.items() if k != "sha256"},
    "rows not records": lambda p: {**p, "rows": [1, 2]},
    "not an object": lambda p: [p],
    "another key": lambda p: {**p, "key": 7},
}


@pytest.mark.parametrize("damage", [*BAD_POINTS, "malformed"])
def test_a_point_file_that_fails_its_check_is_recomputed_with_one_warning(tmp_path, capsys, damage):
    def fn(key):
        return [{"k": key, "v": key * 10}]

    run = ExperimentRun("demo", {"a": 1}, out_dir=tmp_path, quiet=True)
    run.map([0, 1], fn)
    run.release()
    path = run._point_path(0)
    if damage == "malformed":
        path.write_text('{"key": 0, "rows": [')
    else:
        path.write_text(json.dumps(BAD_POINTS[damage](json.loads(path.read_text()))))
    capsys.readouterr()
    again = ExperimentRun("demo", {"a": 1}, out_dir=tmp_path, quiet=True)
    assert again.map([0, 1], fn) == [{"k": 0, "v": 0}, {"k": 1, "v": 10}]
    assert again.computed == 1 and again.reused == 1
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and str(path) in warnings[0] and "recomputing" in warnings[0]
    assert again.cached(0) == [{"k": 0, "v": 0}]  # the recomputed point replaced the bad file


def test_the_default_folder_names_the_profile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = {"workload": "libra-prod", "par": {"dp": 8, "cp": 4, "gbs": 32, "seq_len": 131072}}
    folders = {ExperimentRun("straggler", {**base, "profile": prof}, quiet=True).out_dir.as_posix()
               for prof in ({"name": "h100-roce-v1"}, "paper-inferred-v1", "cluster/my-cluster.json")}
    assert folders == {f"runs/straggler/libra-prod-dp8-cp4-s128k-gbs32-{p}"
                       for p in ("h100-roce-v1", "paper-inferred-v1", "my-cluster")}


def test_two_straggler_runs_differing_only_in_profile_get_two_folders(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from experiments.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["straggler", "--quick", "--no-progress", "--dp", "4", "--cp", "2", "--seq-len", "32768", "--gbs", "8",
            "--methods", "libra"]
    for prof in ("h100-roce-v1", "paper-inferred-v1"):
        res = CliRunner().invoke(main, [*args, "--profile", prof])
        assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "runs/straggler").iterdir()) == [
        "libra-prod-dp4-cp2-s32k-gbs8-p4-b4k-h2-m4-h100-roce-v1",
        "libra-prod-dp4-cp2-s32k-gbs8-p4-b4k-h2-m4-paper-inferred-v1"]
