"""Progress records in logs (no TTY), and Ctrl-C during a sweep says how many
points are cached, that a rerun resumes, and exits 130."""

from __future__ import annotations

import io
import json

from click.testing import CliRunner

import experiments.common.progress as progress_mod
from experiments.cli import main
from experiments.common.progress import progress

LLN = ["lln", "--seq-len", "8192", "--gbs", "8", "--quick", "--pool-sizes", "1,2"]


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_log_records_every_few_seconds_without_a_tty():
    clock, buf = _Clock(), io.StringIO()
    with progress(total=10, desc="grid-search", every_s=5.0, stream=buf, clock=clock) as bar:
        for _ in range(10):
            clock.t += 2.0
            bar.advance()
    lines = buf.getvalue().splitlines()
    assert lines == ["grid-search: 3/10 points (30%), 6 s elapsed, ~14 s left",
                     "grid-search: 6/10 points (60%), 12 s elapsed, ~8 s left",
                     "grid-search: 9/10 points (90%), 18 s elapsed, ~2 s left",
                     "grid-search: done, 10/10 points in 20 s"]


def test_short_or_disabled_runs_print_nothing():
    clock, buf = _Clock(), io.StringIO()
    with progress(total=3, desc="x", every_s=5.0, stream=buf, clock=clock) as bar:
        for _ in range(3):
            clock.t += 1.0
            bar.advance()
    with progress(total=3, desc="x", disable=True, every_s=0.0, stream=buf, clock=clock) as bar:
        bar.advance()
    assert buf.getvalue() == ""


def test_a_command_logs_progress_to_stderr(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_mod, "LOG_EVERY_S", 0.0)  # a record at every point
    res = CliRunner().invoke(main, [*LLN, "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    records = [ln for ln in res.stderr.splitlines() if ln.startswith("lln S=8192 GBS=8:")]
    assert records[0].startswith("lln S=8192 GBS=8: 1/4 points (25%)") and records[-1].startswith(
        "lln S=8192 GBS=8: done, 4/4 points"), res.stderr
    assert "points" not in res.stdout  # tables stay clean on stdout


def test_ctrl_c_says_what_is_cached_and_exits_130(tmp_path, monkeypatch):
    import experiments.figures.vrsp_sweep as sweep

    real, calls = sweep.window_rows, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "window_rows", interrupted)
    res = CliRunner().invoke(main, [*LLN, "--out", str(tmp_path)])
    assert res.exit_code == 130, res.output
    assert "Aborted" not in res.output
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("interrupted:")]
    assert "2 of 4 points of lln are cached" in line and "rerun the same command to resume" in line
    assert not (tmp_path / "run.json").exists()

    monkeypatch.setattr(sweep, "window_rows", real)
    again = CliRunner().invoke(main, [*LLN, "--out", str(tmp_path)])
    assert again.exit_code == 0, again.output
    record = json.loads((tmp_path / "run.json").read_text())
    assert (record["points_reused"], record["points_computed"]) == (2, 2)


def test_no_rich_bar_without_a_tty():
    class Stream(io.StringIO):
        def isatty(self):
            return False

    buf = Stream()
    with progress(total=2, desc="x", every_s=60.0, stream=buf) as bar:
        bar.advance()
        bar.advance()
    assert buf.getvalue() == ""  # no bar redraws, no escape codes in a log


def test_no_progress_silences_commands_that_take_it_through_the_context(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_mod, "LOG_EVERY_S", 0.0)
    res = CliRunner().invoke(main, [*LLN, "--no-progress", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "points" not in res.stderr
