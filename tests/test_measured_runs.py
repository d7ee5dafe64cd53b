"""Measured runs (``train``, ``microbench``, ``e2e --measure``) in logs and under signals: a progress
line at least every 10 s, every finished step or point kept on Ctrl-C with the line that says how to
resume (and a rerun that resumes: ``train`` from its checkpoint, with the losses of an uninterrupted
run), and a rank killed before or during the rendezvous ending the run within 30 s naming it."""

from __future__ import annotations

import glob
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

import experiments.common.progress as progress_mod
from experiments.cli import main

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--nproc", "2", "--cp", "2", "--quick"]
MICROBENCH = ["microbench", "--nproc", "2", "--dp", "2", "--cp", "1", "--pool-size", "2", "--quick", "--windows", "6",
              "--methods", "ulysses,libra", "--workload", "workloads/skewed-2k.txt", "--seq-len", "2048"]


@pytest.fixture
def cli():
    """Start ``libra-bench`` in its own process group; whatever is still running at the end of the
    test (a run that hung, its ranks) is killed."""
    started = []

    def start(args) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _ctrl_c(proc: subprocess.Popen) -> tuple[str, int]:
    """Ctrl-C as a terminal sends it: SIGINT to the whole process group (the ranks too)."""
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=90)[0]
    return out, proc.returncode


@pytest.mark.slow  # waits for the heartbeat thread's one-second ticks
def test_a_log_gets_a_heartbeat_while_nothing_finishes(monkeypatch):
    monkeypatch.setattr(progress_mod, "HEARTBEAT_S", 1.0)
    buf = io.StringIO()
    with progress_mod.progress(total=3, desc="train", unit="steps", stream=buf) as bar:
        time.sleep(2.6)  # one long step
        bar.advance()
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("train: 0/3 steps, ") and lines[0].endswith("elapsed (the first is running)"), lines
    assert lines[-1].startswith("train: done, 1/3 steps in ")
    assert progress_mod.HEARTBEAT_S < 10 and progress_mod.LOG_EVERY_S < 10


@pytest.mark.slow
def test_train_ctrl_c_keeps_the_finished_steps_and_a_rerun_resumes_them(tmp_path, cli):
    # 40 steps of ~70 ms: the interrupt lands well before the end even when the relayed step
    # lines reach this process late on a loaded host
    args = [*TRAIN, "--steps", "40", "--out", str(tmp_path / "t")]
    proc = cli(args)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step 2:"):
            break
    out, code = _ctrl_c(proc)
    assert code == 130, "".join(seen) + out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("interrupted:")]
    assert "of 40 steps of train are kept in" in line and "rerun the same command to resume from step" in line
    assert not (tmp_path / "t" / "run.json").exists() and "Traceback" not in out
    kept = int(line.split("interrupted: ")[1].split(" of")[0])
    assert kept >= 3

    resumed = subprocess.run([sys.executable, "-m", "experiments.cli", *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming after step {kept - 1}: {kept} of 40 steps kept" in resumed.stdout
    whole = subprocess.run([sys.executable, "-m", "experiments.cli", *TRAIN, "--steps", "40", "--no-progress",
                            "--out", str(tmp_path / "w")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    a, b = (pd.read_csv(tmp_path / d / "train.csv") for d in ("t", "w"))
    assert a["loss"].tolist() == b["loss"].tolist()  # bit for bit: the same state, data and plans
    assert not list((tmp_path / "t").glob(".points/*/train-checkpoint.pt"))  # finished: a rerun trains again


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return out


def _rank_pids(pid: int, world: int) -> list[int]:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        ranks = []
        for child in _children(pid):
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                ranks.append(child)
        if len(ranks) == world:
            return ranks
        time.sleep(0.02)
    raise AssertionError("the ranks did not start")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the rank processes in /proc")
def test_a_rank_killed_before_the_rendezvous_ends_train_within_30_s_naming_it(tmp_path, cli):
    proc = cli([*TRAIN, "--steps", "3", "--out", str(tmp_path / "t")])
    victim = _rank_pids(proc.pid, 2)[-1]
    os.kill(victim, signal.SIGKILL)  # the rank is still importing torch: before the rendezvous
    t0 = time.monotonic()
    out = proc.communicate(timeout=90)[0]
    assert time.monotonic() - t0 < 30, out
    assert proc.returncode == 1 and "Traceback" not in out, out
    errors = [ln for ln in out.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "training ranks: rank " in errors[0] and "exited (code -9)" in errors[0], out
    assert "no step finished; rerun the same command to start again" in errors[0]


@pytest.mark.slow
def test_microbench_ctrl_c_keeps_each_finished_point_and_a_rerun_resumes(tmp_path, cli):
    out_dir = tmp_path / "m"
    proc = cli([*MICROBENCH, "--out", str(out_dir)])
    end = time.monotonic() + 120
    while proc.poll() is None and not glob.glob(f"{out_dir}/.points/*/*.json") and time.monotonic() < end:
        time.sleep(0.05)
    out, code = _ctrl_c(proc)
    assert code == 130, out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("interrupted:")]
    assert "of 12 points of microbench are cached in" in line and "rerun the same command to resume" in line
    cached = int(line.split("interrupted: ")[1].split(" of")[0])
    assert cached >= 1 and "Traceback" not in out
    res = CliRunner().invoke(main, [*MICROBENCH, "--out", str(out_dir)])
    assert res.exit_code == 0, res.output
    assert len(pd.read_csv(out_dir / "microbench.csv")) == 24  # 2 methods x 6 windows x 2 steps


def test_e2e_measure_caches_each_method_as_it_finishes(tmp_path, monkeypatch):
    import experiments.measured.train as train_mod  # noqa: PLC0415

    asked = []

    def fake_training(cfgs, on_message=None, **_):
        asked.append([c.attention for c in cfgs])
        for i in range(len(cfgs)):
            steps = [{"step": s, "loss": 5.0 - s, "step_ms": 10.0, "tokens_per_gpu_s": 100.0 + s} for s in range(3)]
            for r in steps:
                on_message({"config": i, "step": r})
            on_message({"config": i, "done": {"steps": steps}})
            if len(asked) == 1:
                raise KeyboardInterrupt  # Ctrl-C while the second method trains

    monkeypatch.setattr(train_mod, "run_training", fake_training)
    args = ["e2e", "--measure", "--nproc", "4", "--steps", "3", "--out", str(tmp_path)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 130, res.output
    assert "interrupted: 1 of 2 methods of e2e --measure are cached in" in res.stderr
    assert "(ulysses); rerun the same command to resume" in res.stderr
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert asked == [["ulysses", "libra"], ["libra"]]  # the rerun trains only what was not kept
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["experiment"] == "e2e-measured"
