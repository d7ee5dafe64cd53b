"""`train` under torchrun takes the world size from the environment, so the
README's line runs as written (no `--nproc`, which torchrun's own parser would take as a prefix
of its `--nproc-per-node`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main


@pytest.mark.slow
@pytest.mark.distributed  # ~9 s on an idle 2-core machine (torchrun + two ranks importing torch)
def test_train_runs_under_torchrun_with_two_gloo_processes(tmp_path):
    out = tmp_path / "train"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even on a GPU machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "experiments.cli", "train", "--cp", "2", "--attention", "ulysses", "--steps", "1",
           "--seq-len", "256", "--gbs", "2", "--layers", "1", "--hidden", "32", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    df = pd.read_csv(out / "train.csv")
    assert df["nproc"].eq(2).all() and df["launch"].eq("torchrun").all() and df["cp"].eq(2).all()
    assert "median tokens/GPU/s" in proc.stdout and "2 rank(s) on 1 node(s)" in proc.stdout
    ranks = json.loads((out / "run.json").read_text())["ranks"]  # one node: local rank = rank
    assert [(r["rank"], r["local_rank"], r["node"], r["cp_group"]) for r in ranks] == [(0, 0, 0, [0, 1]),
                                                                                     (1, 1, 0, [0, 1])]


def test_train_under_torchrun_takes_world_size_and_rejects_a_differing_nproc(tmp_path):
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    res = CliRunner().invoke(main, ["train", "--nproc", "4", "--cp", "2", "--out", str(tmp_path)], env=env)
    assert res.exit_code == 2 and "--nproc 4" in res.output and "world size 2" in res.output, res.output
    # the world size is WORLD_SIZE: CP=3 must divide it (the error names nproc=2, not the default 4)
    res = CliRunner().invoke(main, ["train", "--cp", "3", "--out", str(tmp_path)], env=env)
    assert res.exit_code == 2 and "nproc=2" in res.output and "Traceback" not in res.output, res.output
    from experiments.measured.train import train  # noqa: PLC0415  (imported by the invocations above)

    assert "--overwrite" in [o for p in train.params for o in p.opts]
