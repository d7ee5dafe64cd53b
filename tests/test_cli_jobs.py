"""`--jobs N`: a sweep's points computed in N processes give identical results."""

import json

import pytest
from click.testing import CliRunner

from experiments.cli import main

RUNS = {
    "straggler": ["straggler", "--quick", "--settings", "256k", "--methods", "ulysses,libra,libra-adaptive"],
    "tune": ["tune", "--quick", "--dp", "4", "--cp", "2", "--seq-len", "16384", "--gbs", "8", "--pool-sizes", "2,4",
             "--head-splits", "2", "--block-sizes", "4096"],
}


@pytest.mark.parametrize("name", list(RUNS))
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
