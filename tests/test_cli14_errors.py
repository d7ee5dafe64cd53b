"""Issue 14 item 6: clean errors before any process starts, grid-search without a valid cell,
and a warning when a length file is repeated to fill the windows."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from click.testing import CliRunner

from experiments.cli import main
from libra.data.windows import gbs_windows


@pytest.fixture
def bad_lengths(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("100\nabc\n300\n")
    return path


def _single_error(res, *needles):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, res.output
    for needle in needles:
        assert needle in errors[0], res.output


@pytest.mark.parametrize("command", [
    ["lln"], ["vrsp"],
    # nproc 2: an unchecked file would only fail inside the spawned ranks
    ["train", "--nproc", "2", "--cp", "2", "--steps", "1"],
])
def test_bad_length_file_is_one_error_line(command, bad_lengths, tmp_path):
    res = CliRunner().invoke(main, [*command, "--workload", str(bad_lengths), "--out", str(tmp_path / "o")])
    _single_error(res, "line 2", "positive integer")
    assert not (tmp_path / "o").exists()


def test_train_under_torchrun_takes_world_size_and_rejects_a_differing_nproc(tmp_path):
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    res = CliRunner().invoke(main, ["train", "--nproc", "4", "--cp", "2", "--out", str(tmp_path)], env=env)
    _single_error(res, "--nproc 4", "world size 2")
    # the world size is WORLD_SIZE: CP=3 must divide it (the error names nproc=2, not the default 4)
    res = CliRunner().invoke(main, ["train", "--cp", "3", "--out", str(tmp_path)], env=env)
    _single_error(res, "nproc=2")
    from experiments.measured.train import train  # noqa: PLC0415  (imported by the invocations above)

    assert "--overwrite" in [o for p in train.params for o in p.opts]


def test_grid_search_without_a_valid_cell_exits_2_naming_why(tmp_path):
    res = CliRunner().invoke(main, ["grid-search", "--quick", "--setting", "256k", "--block-sizes", "3000",
                                    "--out", str(tmp_path / "g")])
    _single_error(res, "no valid (B, H) cell", "256k", "B=3000 must divide S/CP")
    assert not (tmp_path / "g").exists()


def test_repeated_length_file_warns_how_many_times(tmp_path, caplog):
    tiny = tmp_path / "three.txt"
    tiny.write_text("100\n200\n300\n")
    with caplog.at_level(logging.WARNING, logger="libra.data.windows"):
        gbs_windows(str(tiny), 1024, 2, 3, seed=0)  # 6144 tokens from a 600-token file
    assert [r.getMessage() for r in caplog.records] == [
        "warning: length file three.txt (3 samples, 600 tokens) is repeated 10.2 times to fill "
        "3 window(s) of GBS 2 x S 1024 tokens"]
    caplog.clear()
    long = tmp_path / "long.txt"
    long.write_text("1000\n" * 10)
    with caplog.at_level(logging.WARNING, logger="libra.data.windows"):
        gbs_windows(str(long), 1024, 2, 3, seed=0)  # 6144 of 10000 tokens: no repetition
    assert not caplog.records


def test_repeated_length_file_warning_is_one_stderr_line(tmp_path):
    tiny = tmp_path / "three.txt"
    tiny.write_text("100\n200\n300\n")
    proc = subprocess.run([sys.executable, "-m", "experiments.cli", "lln", "--workload", str(tiny), "--seq-len", "8192",
                           "--gbs", "8", "--quick", "--pool-sizes", "1,2", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "repeated" in ln]
    assert lines == ["warning: length file three.txt (3 samples, 600 tokens) is repeated 436.9 times to fill "
                     "4 window(s) of GBS 8 x S 8192 tokens"], proc.stderr


def test_dtype_accepts_both_spellings():
    import click  # noqa: PLC0415

    from experiments.common.options import DtypeType  # noqa: PLC0415

    short, long = DtypeType(("fp32", "bf16", "fp64")), DtypeType(("float32", "bfloat16"))
    assert short.convert("bfloat16", None, None) == "bf16" and short.convert("FP32", None, None) == "fp32"
    assert long.convert("bf16", None, None) == "bfloat16" and long.convert("float32", None, None) == "float32"
    try:
        long.convert("fp8", None, None)
    except click.BadParameter as exc:
        assert "accepted: bf16, bfloat16, float32, fp32" in str(exc)
    else:
        raise AssertionError("fp8 accepted")


@pytest.mark.parametrize("args, match", [
    (["plan-cost", "--quick", "--methods", "nope"], "unknown planner 'nope'"),
    (["plan-cost", "--quick", "--methods", "libra,ulysses"], "'ulysses' does not plan pools with TAP"),
    (["tune", "--quick", "--dp", "4", "--cp", "2", "--seq-len", "16K", "--gbs", "8", "--methods", "libra,nope"],
     "unknown method 'nope'; choose from libra-tap, libra-tap-vrsp, libra, libra-kt, libra-adaptive"),
    (["straggler", "--quick", "--dp", "3", "--cp", "2", "--seq-len", "16K", "--gbs", "8"],
     "GBS=8 must be a multiple of DP=3"),
    (["straggler", "--quick", "--dp", "4", "--cp", "3", "--seq-len", "16K", "--gbs", "8"],
     "CP=3 must divide the sequence length S=16384"),
])
def test_bad_methods_and_layouts_are_one_line_errors(tmp_path, args, match):
    res = CliRunner().invoke(main, args + ["--out", str(tmp_path)])
    assert res.exit_code == 2 and match in res.output and "Traceback" not in res.output, res.output
