"""`--config FILE.toml` on every command: keys are the long options, flags override the file, an
unknown key is a one-line error naming it."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from experiments.cli import COMMANDS, main


def _write(tmp_path, text: str):
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def test_every_command_takes_config():
    runner = CliRunner()
    for name in COMMANDS:
        out = runner.invoke(main, [name, "--help"])
        assert out.exit_code == 0, (name, out.output)
        assert "--config" in out.output, name


def test_config_sets_the_layout_and_flags_override(tmp_path):
    cfg = _write(tmp_path, 'dp = 8\ncp = 4\nseq-len = "128K"\ngbs = 32\npool-size = 4\nblock_size = "4K"\n'
                           'methods = ["ulysses", "libra"]\nwindows = 3\n[straggler]\nchunks = 2\n'
                           '[tune]\nbogus-only-for-tune = 1\n')
    out_dir = tmp_path / "run"
    res = CliRunner().invoke(main, ["straggler", "--config", str(cfg), "--windows", "1", "--no-progress",
                                    "--out", str(out_dir)])
    assert res.exit_code == 0, res.output
    run = json.loads((out_dir / "run.json").read_text())
    setting = run["config"]["settings"][0]
    assert (setting["dp"], setting["cp"], setting["seq_len"], setting["gbs"]) == (8, 4, 131072, 32)
    assert setting["tap"]["pool_size"] == 4 and setting["tap"]["block_size"] == 4096
    assert setting["tap"]["pipeline_chunks"] == 2  # from the [straggler] table, via the --chunks alias
    assert run["config"]["windows"] == 1  # the command line beats the file's 3
    assert run["config_file"]["values"]["windows"] == 3
    assert set(run["config"]["methods"]) == {"ulysses", "libra"}


@pytest.mark.parametrize("text, needle", [
    ("dpp = 3\n", "unknown key 'dpp'"),
    ("dp = [\n", "not valid TOML"),
    ("[straggler]\nnot-an-option = 1\n", "unknown key 'not-an-option'"),
    ("[strangler]\ndp = 1\n", "unknown key 'strangler'"),
])
def test_bad_config_is_one_line_error(tmp_path, text, needle):
    res = CliRunner().invoke(main, ["straggler", "--config", str(_write(tmp_path, text))])
    assert res.exit_code == 2
    assert needle in res.output and "Traceback" not in res.output


def test_missing_config_file(tmp_path):
    res = CliRunner().invoke(main, ["pool-sweep", "--config", str(tmp_path / "none.toml")])
    assert res.exit_code == 2 and "cannot read" in res.output


def test_settings_option_is_a_repeatable_comma_list(tmp_path):
    import click

    from experiments.common.options import settings_option, with_config_option

    @click.command("show")
    @settings_option()
    def show(settings_):
        click.echo(settings_)

    with_config_option(show)
    runner = CliRunner()
    assert runner.invoke(show, []).output.strip() == "256k,1m"
    assert runner.invoke(show, ["--setting", "1M", "--setting", "256k"]).output.strip() == "1M,256k"
    assert runner.invoke(show, ["--settings", "1m"]).output.strip() == "1m"
    cfg = _write(tmp_path, 'setting = ["1m", "256k"]\n')
    assert runner.invoke(show, ["--config", str(cfg)]).output.strip() == "1m,256k"


def test_a_toml_array_for_a_one_value_option_is_refused(tmp_path):
    cfg = _write(tmp_path, "dp = 8\ncp = [4]\nseq-len = \"128K\"\ngbs = 32\n")
    res = CliRunner().invoke(main, ["straggler", "--config", str(cfg), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "cp = [4]" in res.output and "takes one value, not a list" in res.output
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
