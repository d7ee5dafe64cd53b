"""Results are never stale (input contents key the points) and never clobbered
(ad-hoc runs default to runs/, a folder holding a different run is refused unless --overwrite)."""

from __future__ import annotations

import json
from dataclasses import asdict

import click
import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.common.runner import ExperimentRun, RunFolderConflict, default_out_dir, layout_tag
from experiments.common.sim_common import SETTINGS, setting_record
from libra.config import TapConfig

SMALL = ("--seq-len", "8192", "--gbs", "8", "--quick", "--pool-sizes", "1,2")


def _lengths(path, seed=0, n=400):
    rng = np.random.default_rng(seed)
    path.write_text("\n".join(str(int(x)) for x in rng.integers(1, 3000, size=n)) + "\n")
    return path


def _lln(*args):
    return CliRunner().invoke(main, ["lln", *SMALL, *args])


def _record(folder):
    return json.loads((folder / "run.json").read_text())


def test_shuffled_length_file_is_recomputed_not_reused(tmp_path):
    data = _lengths(tmp_path / "my_lengths.txt")
    out = tmp_path / "o"
    first = _lln("--workload", str(data), "--out", str(out))
    assert first.exit_code == 0, first.output
    rec = _record(out)
    assert rec["points_computed"] == 4 and rec["inputs"]["workload"]["lengths_sha256"]
    points = {p: p.stat().st_mtime_ns for p in out.glob(".points/*/*.json")}
    again = _lln("--workload", str(data), "--out", str(out))
    assert again.exit_code == 0 and _record(out) == rec  # same numbers: the record of the run that made them
    assert {p: p.stat().st_mtime_ns for p in out.glob(".points/*/*.json")} == points  # same data: reused

    lines = data.read_text().split()
    np.random.default_rng(1).shuffle(lines)
    data.write_text("\n".join(lines) + "\n")  # same file, same size, same multiset: only the order
    shuffled = _lln("--workload", str(data), "--out", str(out))
    assert shuffled.exit_code == 0, shuffled.output
    new = _record(out)
    assert new["points_computed"] == 4 and new["points_reused"] == 0
    assert new["inputs"]["workload"]["lengths_sha256"] != rec["inputs"]["workload"]["lengths_sha256"]


def test_ad_hoc_run_goes_to_runs_not_results(tmp_path, monkeypatch):
    data = _lengths(tmp_path / "my_lengths.txt")
    monkeypatch.chdir(tmp_path)
    res = _lln("--workload", str(data))
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "results").exists()
    folder = tmp_path / "runs" / "lln" / "my_lengths-s8k-gbs8"
    assert (folder / "lln.csv").is_file() and (folder / "run.json").is_file()


def test_default_folders_and_layout_tag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paper = setting_record(SETTINGS["256k"])
    # the paper's preset too: results/ is written only by the make targets' --out
    assert default_out_dir("straggler", "libra-prod", [paper]).as_posix() == \
        "runs/straggler/libra-prod-dp32-cp8-s256k-gbs128-p8-b4k-h2-m4"
    assert default_out_dir("straggler", str(tmp_path / "w.txt.gz"), [paper]).as_posix() == \
        "runs/straggler/w-dp32-cp8-s256k-gbs128-p8-b4k-h2-m4"
    both = [paper, setting_record(SETTINGS["1m"])]
    assert default_out_dir("straggler", "data/w.npy", both).as_posix() == "runs/straggler/w-256k+1m"
    # the experiment pool_sweep (its CSV's name) writes where `make fig15` does: the command's name
    assert default_out_dir("pool_sweep", "libra-prod", [paper]).parts[:2] == ("runs", "pool-sweep")
    custom = {"dp": 8, "cp": 4, "seq_len": 128 * 1024, "gbs": 32,
              "tap": asdict(TapConfig(pool_size=4, block_size=4096, head_split=2))}
    assert layout_tag(custom) == "dp8-cp4-s128k-gbs32-p4-b4k-h2-m4"
    # the runner reads workload and layouts from a config when the command does not pass them
    run = ExperimentRun("demo", {"workload": "libra-prod", "par": {"dp": 8, "cp": 4, "gbs": 32, "seq_len": 131072}},
                        quiet=True)
    assert run.out_dir.as_posix() == "runs/demo/libra-prod-dp8-cp4-s128k-gbs32"


def test_different_config_refused_with_named_keys_unless_overwrite(tmp_path):
    out = tmp_path / "o"
    assert _lln("--out", str(out)).exit_code == 0
    before = (out / "lln.csv").read_bytes()
    refused = CliRunner().invoke(main, ["lln", "--seq-len", "8192", "--gbs", "16", "--quick", "--pool-sizes", "1,2",
                                        "--out", str(out)])
    assert refused.exit_code == 1
    errors = [ln for ln in refused.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "gbs" in errors[0] and "--overwrite" in errors[0], refused.output
    assert "seq_len" not in errors[0]  # only the keys that differ
    assert (out / "lln.csv").read_bytes() == before and _record(out)["config"]["gbs"] == 8

    forced = CliRunner().invoke(main, ["lln", "--seq-len", "8192", "--gbs", "16", "--quick", "--pool-sizes", "1,2",
                                       "--out", str(out), "--overwrite"])
    assert forced.exit_code == 0, forced.output
    assert _record(out)["config"]["gbs"] == 16 and pd.read_csv(out / "lln.csv")["gbs"].eq(16).all()


def test_runner_conflict_api(tmp_path):
    ExperimentRun("demo", {"a": 1}, out_dir=tmp_path, quiet=True).finish(pd.DataFrame({"x": [1]}))
    ExperimentRun("demo", {"a": 1}, out_dir=tmp_path, quiet=True).claim_folder()  # the same run: fine
    other = ExperimentRun("demo", {"a": 2}, out_dir=tmp_path, quiet=True)  # checked before writing, not here
    with pytest.raises(RunFolderConflict, match=r"\(a differ\)"):
        other.map([1], lambda k: [{"k": k}])
    assert not other.points_dir.exists()
    with pytest.raises(RunFolderConflict, match="experiment"):
        ExperimentRun("other", {"a": 1}, out_dir=tmp_path, quiet=True).finish(pd.DataFrame({"x": [2]}))
    assert pd.read_csv(tmp_path / "demo.csv")["x"].tolist() == [1]
    ExperimentRun("demo", {"a": 2}, out_dir=tmp_path, quiet=True, overwrite=True).claim_folder()
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(RunFolderConflict, match="not a run record"):
        ExperimentRun("demo", {"a": 1}, out_dir=tmp_path, quiet=True).claim_folder()


def test_output_folder_that_cannot_be_made_is_one_error_before_any_point(tmp_path):
    (tmp_path / "afile").write_text("")
    run = ExperimentRun("demo", {"a": 1}, out_dir=tmp_path / "afile" / "sub", quiet=True)
    computed = []
    with pytest.raises(click.ClickException, match="cannot create output folder .*afile/sub: Not a directory"):
        run.map([1], computed.append)
    assert computed == []  # refused before the first point, not at its first write
    res = _lln("--out", str(tmp_path / "afile" / "sub"))
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert res.exit_code == 1 and len(errors) == 1 and "Traceback" not in res.output, res.output
    assert errors[0] == f"Error: cannot create output folder {tmp_path / 'afile' / 'sub'}: Not a directory"


def test_microbench_checks_its_folder_before_it_spawns_ranks(tmp_path, monkeypatch):
    from experiments.measured import microbench  # noqa: PLC0415

    def spawned(*args, **kwargs):
        raise AssertionError("ranks were spawned before the output folder was checked")

    monkeypatch.setattr(microbench, "run_spawned", spawned)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "o"
    assert _lln("--out", str(out)).exit_code == 0  # the folder now holds another experiment's run
    (tmp_path / "afile").write_text("")
    for folder, expected in ((out, "holds a different run"), (tmp_path / "afile" / "sub", "cannot create output folder")):
        res = CliRunner().invoke(main, ["microbench", "--quick", "--nproc", "2", "--dp", "2", "--cp", "1",
                                        "--methods", "ulysses", "--oversubscribe", "--out", str(folder)])
        assert res.exit_code == 1 and expected in res.output and "AssertionError" not in repr(res.exception), res.output


@pytest.mark.parametrize("command", ["lln", "vrsp", "straggler", "pool-sweep", "grid-search", "tune",
                                     "variability"])
def test_overwrite_offered_wherever_force_is(command):
    res = CliRunner().invoke(main, [command, "--help"])
    assert res.exit_code == 0 and "--force" in res.output and "--overwrite" in res.output


def test_profile_file_contents_key_the_points(tmp_path):
    profile = tmp_path / "my-cluster.json"
    profile.write_text('{"name": "a"}')
    first = ExperimentRun("demo", {"profile": str(profile)}, out_dir=tmp_path / "o", quiet=True)
    assert first.inputs["profile"]["sha256"]
    profile.write_text('{"name": "b"}')  # edited in place: same path, new contents
    second = ExperimentRun("demo", {"profile": str(profile)}, out_dir=tmp_path / "o", quiet=True)
    assert second.points_dir != first.points_dir
    named = ExperimentRun("demo", {"profile": "h100-roce-v1"}, out_dir=tmp_path / "p", quiet=True)
    assert named.inputs == {}  # a built-in profile name is no file


@pytest.mark.parametrize("config", ['"abc"', "[1, 2]", "7"])
def test_a_run_json_whose_config_is_not_an_object_is_named_as_such(tmp_path, config):
    out = tmp_path / "o"
    out.mkdir()
    (out / "run.json").write_text(f'{{"experiment": "lln", "config": {config}}}')
    res = CliRunner().invoke(main, ["lln", "--quick", "--out", str(out)])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "holds a run.json that is not a run record (no config object)" in res.output
