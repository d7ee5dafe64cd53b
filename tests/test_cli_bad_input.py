"""Bad input to the commands: one ``Error:`` line naming the file or option, before any work, with
nothing written -- lengths out of range, unreadable length files, a profile name that is a path, an
output folder that cannot be written, layout errors, TOML arrays and paths -- and the line that says
how to resume when a ``--jobs`` worker dies."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from experiments.cli import main


def _one_error(res, *needles, code=2):
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output and "Aborted!" not in res.output, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, res.output
    for needle in needles:
        assert needle in errors[0], res.output
    return errors[0]


@pytest.mark.parametrize("command", [
    ["straggler", "--quick", "--settings", "256k"],
    ["microbench", "--nproc", "2", "--dp", "2", "--cp", "1", "--pool-size", "2", "--quick"],
    ["train", "--nproc", "2", "--cp", "2", "--steps", "1"],
])
@pytest.mark.parametrize("content", ["[1e19, 5, 6]", "[" + ", ".join(["1000000000000000000"] * 10) + "]"],
                         ids=["one-length-1e19", "ten-lengths-of-1e18"])
def test_lengths_that_would_wrap_int64_are_one_error_before_any_work(tmp_path, command, content):
    path = tmp_path / "lengths.json"
    path.write_text(content)
    t0 = time.monotonic()
    res = CliRunner().invoke(main, [*command, "--workload", str(path), "--out", str(tmp_path / "o")])
    _one_error(res, str(path), "length 1", "out of range [1, 2^40]")
    assert time.monotonic() - t0 < 30 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("name, data, needle", [
    ("cut.txt.gz", gzip.compress(b"1024\n" * 4000)[:60], "truncated compressed file"),
    ("plain.txt.gz", b"1024\n2048\n", "not a gzip file"),
    ("bin.txt", b"\x89PNG\r\n\x1a\n\x00\x00", "not UTF-8 text"),
    ("huge.txt", b"100\n99999999999999999999999\n", "length 99999999999999999999999 at line 2 out of range"),
])
def test_unreadable_length_files_are_one_error_naming_the_file(tmp_path, name, data, needle):
    (tmp_path / name).write_bytes(data)
    res = CliRunner().invoke(main, ["lln", "--quick", "--workload", str(tmp_path / name), "--out", str(tmp_path / "o")])
    _one_error(res, f"{tmp_path / name}: ", needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["x/../../../escaped", "..", ".hidden", "a\\b", ""])
def test_fit_links_refuses_a_name_that_is_a_path(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["fit-links", "--quick", "--name", name])
    _one_error(res, "--name", "not a plain name")
    assert list(tmp_path.iterdir()) == []


def _read_only_folder(tmp_path) -> Path:
    """An existing folder this process cannot create files in (root ignores permission bits)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").touch()
    except OSError:
        return folder
    (folder / "probe").unlink()
    for candidate in (Path("/sys/kernel"), Path("/proc/self")):
        try:
            (candidate / "libra-probe").touch()
        except OSError:
            return candidate
    pytest.skip("no folder this process cannot write to")


@pytest.mark.parametrize("command", [["lln", "--quick"], ["straggler", "--quick", "--settings", "256k"]])
def test_an_existing_read_only_out_folder_is_one_error_before_any_work(tmp_path, command):
    folder = _read_only_folder(tmp_path)
    t0 = time.monotonic()
    res = CliRunner().invoke(main, [*command, "--no-progress", "--out", str(folder)])
    _one_error(res, f"cannot write to output folder {folder}", code=1)
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("command, needle", [
    (["straggler", "--settings", "256k", "--pool-size", "3"], "setting 256k: pool size P=3 must divide DP=32"),
    (["straggler", "--settings", "1m", "--head-split", "3"], "head split H=3 must divide"),
    (["pool-sweep", "--settings", "256k", "--block-size", "3000"], "block size B=3000 must divide S/CP=32768"),
    (["tile-overhead", "--setting", "256k", "--pool-size", "3"], "pool size P=3 must divide DP"),
])
def test_layout_errors_come_before_the_output_folder_is_claimed(tmp_path, command, needle):
    res = CliRunner().invoke(main, [*command, "--quick", "--out", str(tmp_path / "o")])
    _one_error(res, needle)
    assert not (tmp_path / "o").exists()


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


@pytest.mark.parametrize("config", ['"abc"', "[1, 2]", "7"])
def test_a_run_json_whose_config_is_not_an_object_is_named_as_such(tmp_path, config):
    out = tmp_path / "o"
    out.mkdir()
    (out / "run.json").write_text(f'{{"experiment": "lln", "config": {config}}}')
    res = CliRunner().invoke(main, ["lln", "--quick", "--out", str(out)])
    _one_error(res, "holds a run.json that is not a run record (no config object)", code=1)


def test_a_toml_array_for_a_one_value_option_is_refused(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("dp = 8\ncp = [4]\nseq-len = \"128K\"\ngbs = 32\n")
    res = CliRunner().invoke(main, ["straggler", "--config", str(cfg), "--out", str(tmp_path / "o")])
    _one_error(res, "cp = [4]", "takes one value, not a list")
    assert not (tmp_path / "o").exists()


def test_relative_paths_in_a_toml_resolve_from_its_folder(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "lengths.txt").write_text("3000\n500\n12000\n800\n" * 40)
    (project / "c.toml").write_text('workload = "lengths.txt"\nout = "my-run"\nprofile = "h100-roce-v1"\n'
                                    "dp = 4\ncp = 2\nseq-len = \"8K\"\ngbs = 8\npool-size = 2\nblock-size = 1024\n"
                                    'methods = ["ulysses", "libra"]\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    res = CliRunner().invoke(main, ["straggler", "--config", str(project / "c.toml"), "--windows", "1",
                                    "--no-progress"])
    assert res.exit_code == 0, res.output
    record = json.loads((project / "my-run" / "run.json").read_text())
    assert record["inputs"]["workload"]["path"] == str(project / "lengths.txt")
    assert record["config"]["profile"]["name"] == "h100-roce-v1"  # a built-in name stays a name
    assert list(elsewhere.iterdir()) == []
