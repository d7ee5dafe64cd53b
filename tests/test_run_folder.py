"""A run folder is written as one unit by one run at a time (experiments/common/run_folder.py, used by
experiments/common/runner.py): a killed run leaves the previous complete folder or the new one, never a
mix or a temporary file in it, and a second run into a folder being written is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.common import run_folder
from experiments.common.runner import ExperimentRun, RunFolderConflict

ROOT = Path(__file__).resolve().parent.parent

# one run of experiment "demo" whose value is argv[2]; argv[3] names where it is killed: "plot" (after
# its CSV is written), "discard" (after the exchange, before the old folder is removed), "replace"
# (the file-by-file fallback, between the record's removal and its new copy) or "none"
CHILD = textwrap.dedent("""
    import os, signal, sys
    import pandas as pd
    from experiments.common import run_folder
    from experiments.common.runner import ExperimentRun

    out, value, kill = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)

    def plot(df, path):
        path.write_bytes(b"png %d" % value)
        if kill == "plot":
            die()

    run = ExperimentRun("demo", {"v": value}, out_dir=out, quiet=True, overwrite=True)
    run.map([0], lambda k: [{"x": value}])
    if kill == "discard":
        run_folder.discard = die
    if kill == "replace":
        run_folder._swap = lambda a, b: False
        moves = []
        real_replace = os.replace
        def replace(src, dst):
            moves.append(dst)
            if len(moves) == 2:
                die()
            real_replace(src, dst)
        os.replace = replace
    run.finish(pd.DataFrame({"x": [value]}), plot=plot, files={"demo_summary.csv": f"s\\n{value}\\n"})
""")


def _run(out: Path, value: int, kill: str = "none") -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", CHILD, str(out), str(value), kill], env=env, cwd=ROOT).returncode


def _snapshot(folder: Path) -> dict:
    """Every file under ``folder`` (the point cache included) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _record(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text())


@pytest.mark.slow
def test_a_kill_while_the_run_writes_leaves_the_previous_folder(tmp_path):
    out = tmp_path / "o"
    assert _run(out, 1) == 0
    before = _snapshot(out)
    assert _run(out, 2, kill="plot") == -signal.SIGKILL  # the new CSV and summary exist, the PNG is half made
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if not k.startswith(".points")} == \
        {k: v for k, v in before.items() if not k.startswith(".points")}  # no new CSV beside the old record
    assert not [p for p in out.iterdir() if p.name not in ("demo.csv", "demo_summary.csv", "demo.png", "run.json",
                                                           ".points")]  # no temporary file in the folder
    assert [p.name for p in tmp_path.iterdir() if p.name != "o"]  # the stage the kill left, beside it
    assert _run(out, 3) == 0  # the next run of the folder removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    assert _record(out)["config"] == {"v": 3} and pd.read_csv(out / "demo.csv")["x"].tolist() == [3]


@pytest.mark.slow
def test_a_kill_after_the_exchange_leaves_the_new_folder_and_its_point_cache(tmp_path):
    out = tmp_path / "o"
    assert _run(out, 1) == 0
    assert _run(out, 2, kill="discard") == -signal.SIGKILL
    assert _record(out)["config"] == {"v": 2} and (out / "demo.png").read_bytes() == b"png 2"
    assert (out / "demo_summary.csv").read_text() == "s\n2\n"
    assert len(list(out.glob(".points/*/*.json"))) == 2  # both runs' cached points moved with the folder
    assert _run(out, 2) == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["o"]


@pytest.mark.slow
def test_where_folders_cannot_be_exchanged_a_killed_write_leaves_no_record(tmp_path):
    out = tmp_path / "o"
    assert _run(out, 1) == 0
    assert _run(out, 2, kill="replace") == -signal.SIGKILL  # one file moved in, the record removed first
    assert not (out / "run.json").exists()  # an unfinished folder, never one whose record lies
    assert (out / "demo.csv").read_text() == "x\n2\n"
    assert _run(out, 3) == 0 and _record(out)["config"] == {"v": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_a_stage_left_mid_commit_gives_back_what_it_carried(tmp_path):
    out = tmp_path / "o"
    ExperimentRun("demo", {"v": 1}, out_dir=out, quiet=True).finish(pd.DataFrame({"x": [1]}))
    stage = tmp_path / ".o.unit-1-dead"
    (stage / ".points" / "k").mkdir(parents=True)  # a kill between moving the cache and the exchange
    (stage / "demo.csv").write_text("x\n2\n")
    ExperimentRun("demo", {"v": 1}, out_dir=out, quiet=True).claim_folder()
    assert (out / ".points" / "k").is_dir() and not stage.exists()
    assert (out / "demo.csv").read_text() == "x\n1\n"


def test_overwriting_with_another_experiment_removes_the_old_outputs_only(tmp_path):
    out = tmp_path / "o"
    ExperimentRun("demo", {"v": 1}, out_dir=out, quiet=True).finish(
        pd.DataFrame({"x": [1]}), plot=lambda d, p: p.write_bytes(b"png"), files={"demo_summary.csv": "s\n"})
    (out / "nested").mkdir()
    (out / "nested" / "run.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    ExperimentRun("other", {"w": 1}, out_dir=out, quiet=True, overwrite=True).finish(pd.DataFrame({"y": [1]}))
    assert sorted(p.name for p in out.iterdir() if p.name != ".points") == ["nested", "notes.txt", "other.csv",
                                                                            "run.json"]
    assert _record(out)["outputs"] == ["other.csv"]


def test_the_current_folder_is_written_file_by_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inode = tmp_path.stat().st_ino
    ExperimentRun("demo", {"v": 1}, out_dir=Path("."), quiet=True).finish(pd.DataFrame({"x": [1]}))
    ExperimentRun("demo", {"v": 2}, out_dir=Path("."), quiet=True, overwrite=True).finish(pd.DataFrame({"x": [2]}))
    assert Path.cwd().stat().st_ino == inode == tmp_path.stat().st_ino  # the shell's folder is not replaced
    assert _record(tmp_path)["config"] == {"v": 2} and not [p for p in tmp_path.iterdir() if ".unit-" in p.name]


def test_a_second_run_into_a_folder_being_written_is_refused(tmp_path):
    first = ExperimentRun("demo", {"a": 1}, out_dir=tmp_path, quiet=True)
    first.claim_folder()  # running: run.json comes at its end
    for name, config in (("demo", {"a": 2}), ("demo", {"a": 1}), ("other", {"a": 1})):
        with pytest.raises(run_folder.FolderBusy, match="being written by another run"):
            ExperimentRun(name, config, out_dir=tmp_path, quiet=True, overwrite=True).claim_folder()
    first.finish(pd.DataFrame({"x": [1]}))
    with pytest.raises(RunFolderConflict, match=r"\(a differ\)"):  # ended: the folder's record decides
        ExperimentRun("demo", {"a": 2}, out_dir=tmp_path, quiet=True).claim_folder()
    ExperimentRun("demo", {"a": 1}, out_dir=tmp_path, quiet=True).claim_folder()


HOLDER = textwrap.dedent("""
    import sys
    from experiments.common.runner import ExperimentRun
    run = ExperimentRun("straggler", {"a": 1}, out_dir=sys.argv[1], quiet=True)
    run.claim_folder()
    print("claimed", flush=True)
    sys.stdin.readline()
""")


@pytest.mark.slow
def test_concurrent_commands_into_one_out_one_is_refused(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], env=env, cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        res = CliRunner().invoke(main, ["lln", "--seq-len", "8192", "--gbs", "8", "--quick", "--pool-sizes", "1,2",
                                        "--out", str(tmp_path), "--no-progress"])
        errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
        assert res.exit_code == 1 and len(errors) == 1 and "being written by another run" in errors[0], res.output
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing of lln's written
    finally:
        holder.communicate("\n", timeout=30)
    assert CliRunner().invoke(main, ["lln", "--seq-len", "8192", "--gbs", "8", "--quick", "--pool-sizes", "1,2",
                                     "--out", str(tmp_path), "--no-progress"]).exit_code == 0
