"""Your layout: `straggler` on --dp --cp --seq-len --gbs instead of the paper's settings."""

import json

import pandas as pd
from click.testing import CliRunner

from experiments.cli import main


def test_straggler_on_a_users_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lengths = tmp_path / "my_lengths.txt"
    lengths.write_text("\n".join(["8192"] + ["1024"] * 8 + ["30000", "512"]) + "\n")
    args = ["straggler", "--quick", "--no-progress", "--workload", str(lengths), "--dp", "4", "--cp", "2",
            "--seq-len", "32K", "--gbs", "8", "--pool-size", "2", "--block-size", "4096",
            "--methods", "ulysses,libra"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    out = tmp_path / "runs" / "straggler" / "my_lengths-dp4-cp2-s32k-gbs8-p2-b4k-h2-m4-h100-roce-v2"
    df = pd.read_csv(out / "straggler.csv")
    assert set(df["setting"]) == {"dp4-cp2-s32k-gbs8"} and set(df["method"]) == {"ulysses", "libra"}
    summary = pd.read_csv(out / "straggler_summary.csv")
    assert "paper_mean_speedup" not in summary  # not the paper's data or layout: no paper numbers
    rec = json.loads((out / "run.json").read_text())["config"]["settings"][0]
    assert (rec["dp"], rec["cp"], rec["seq_len"], rec["gbs"], rec["tap"]["pool_size"]) == (4, 2, 32768, 8, 2)
    assert not (tmp_path / "results").exists()


def test_settings_are_case_insensitive_and_setting_is_an_alias(tmp_path):
    r = CliRunner().invoke(main, ["straggler", "--quick", "--no-progress", "--setting", "256K", "--windows", "1",
                                  "--methods", "ulysses", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert set(pd.read_csv(tmp_path / "straggler.csv")["setting"]) == {"256k"}


def test_pool_sweep_on_a_users_layout(tmp_path):
    r = CliRunner().invoke(main, ["pool-sweep", "--quick", "--no-progress", "--dp", "4", "--cp", "2", "--seq-len",
                                  "32K", "--gbs", "8", "--pool-sizes", "1,2,4", "--methods", "libra",
                                  "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "pool_sweep.csv")
    assert set(df["setting"]) == {"dp4-cp2-s32k-gbs8"} and set(df["pool_size"]) == {0, 1, 2, 4}
