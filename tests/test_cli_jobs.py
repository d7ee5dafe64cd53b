"""`--jobs N`: a sweep's points computed in N processes give identical results."""

import json
import os

import click
import pytest
from click.testing import CliRunner

from experiments.cli import main

RUNS = {
    "straggler": ["straggler", "--quick", "--settings", "256k", "--methods", "ulysses,libra,libra-adaptive"],
    "tune": ["tune", "--quick", "--dp", "4", "--cp", "2", "--seq-len", "16384", "--gbs", "8", "--pool-sizes", "2,4",
             "--head-splits", "2", "--block-sizes", "4096"],
}


@pytest.mark.parametrize("name", [pytest.param("straggler", marks=pytest.mark.slow), "tune"])
def test_jobs_give_identical_results(tmp_path, name):
    outs = []
    for jobs in (1, 2):
        out = tmp_path / f"j{jobs}"
        r = CliRunner().invoke(main, RUNS[name] + ["--no-progress", "--jobs", str(jobs), "--out", str(out)])
        assert r.exit_code == 0, r.output
        record = json.loads((out / "run.json").read_text())
        assert record["points_computed"] > 1
        if name == "straggler":  # each point's compute time comes back from the worker that ran it
            assert record["simulate_seconds_per_setting"]["256k"] > 0
        outs.append((out / f"{name}.csv").read_bytes())
    assert outs[0] == outs[1]


def _dies_on_key_2(key):
    if key == 2:
        os._exit(9)  # a --jobs worker killed mid-sweep
    return [{"key": key}]


def test_a_killed_jobs_worker_says_how_many_points_are_cached_and_to_rerun(tmp_path, capsys):
    from experiments.common.runner import ExperimentRun  # noqa: PLC0415

    run = ExperimentRun("sweep", {"k": 1}, out_dir=tmp_path / "o", quiet=True, jobs=2)
    with pytest.raises(click.exceptions.Exit) as info:
        run.map(range(6), _dies_on_key_2)
    assert info.value.exit_code == 1
    err = capsys.readouterr().err
    assert "a --jobs worker process died:" in err and "points of sweep are cached" in err
    assert "rerun the same command to resume" in err and "Traceback" not in err
