"""Bad input to the commands: one ``Error:`` line naming the file or option, before any work, with
nothing written.

Each shared option's bad values are tested once, at the option, on one command that takes it (the
length files of ``--workload``, the layout options and ``--settings``, sizes, counts and integer
lists, ``--profile``, ``--dtype``, the output folder); then every command gets one smoke that its
bad input is refused the same way. Errors that belong to one command stay in that command's tests."""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from experiments.cli import COMMANDS, main


def _one_error(res, *needles, code=2):
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output and "Aborted!" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, res.output
    for needle in needles:
        assert needle in errors[0], res.output
    return errors[0]


# --------------------------------------------------------------------------------------------
# --workload: a length file that cannot be read, or a preset that does not exist
# --------------------------------------------------------------------------------------------

WRAPS_INT64 = "[" + ", ".join(["1000000000000000000"] * 10) + "]"  # ten lengths of 1e18: their sum wraps


@pytest.mark.parametrize("name, data, needles", [
    ("bad.txt", b"100\nabc\n300\n", ["line 2", "positive integer"]),
    ("one.json", b"[1e19, 5, 6]", ["length 1", "out of range [1, 2^40]"]),
    ("ten.json", WRAPS_INT64.encode(), ["length 1", "out of range [1, 2^40]"]),
    ("cut.txt.gz", gzip.compress(b"1024\n" * 4000)[:60], ["truncated compressed file"]),
    ("plain.txt.gz", b"1024\n2048\n", ["not a gzip file"]),
    ("bin.txt", b"\x89PNG\r\n\x1a\n\x00\x00", ["not UTF-8 text"]),
    ("huge.txt", b"100\n99999999999999999999999\n", ["length 99999999999999999999999 at line 2 out of range"]),
    ("lengths.xlsx", b"1", ["unknown type"]),
])
def test_a_length_file_that_cannot_be_read_is_one_error_naming_the_file(tmp_path, name, data, needles):
    (tmp_path / name).write_bytes(data)
    res = CliRunner().invoke(main, ["lln", "--quick", "--workload", str(tmp_path / name), "--out", str(tmp_path / "o")])
    _one_error(res, str(tmp_path / name), *needles)
    assert not (tmp_path / "o").exists()


def test_an_unknown_workload_preset_is_one_error(tmp_path):
    res = CliRunner().invoke(main, ["lln", "--quick", "--workload", "no-such-preset", "--out", str(tmp_path / "o")])
    _one_error(res, "unknown workload 'no-such-preset'")
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------
# the layout: --dp --cp --seq-len --gbs, --settings, the TAP layout and the head shape
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--dp", "4", "--cp", "2"], "missing --seq-len, --gbs"),
    (["--dp", "3", "--cp", "2", "--seq-len", "16K", "--gbs", "8"], "GBS=8 must be a multiple of DP=3"),
    (["--dp", "4", "--cp", "3", "--seq-len", "16K", "--gbs", "8"], "CP=3 must divide the sequence length S=16384"),
    (["--settings", "2m"], "unknown setting '2m'"),
    (["--settings", "256k", "--pool-size", "3"], "setting 256k: pool size P=3 must divide DP=32"),
    (["--settings", "1m", "--head-split", "3"], "head split H=3 must divide"),
    (["--settings", "256k", "--block-size", "3000"], "block size B=3000 must divide S/CP=32768"),
    (["--settings", "256k", "--kv-heads", "5"], "must divide num_q_heads"),
])
def test_a_bad_layout_is_one_error_before_the_output_folder_is_claimed(tmp_path, args, needle):
    res = CliRunner().invoke(main, ["straggler", "--quick", "--no-progress", *args, "--out", str(tmp_path / "o")])
    _one_error(res, needle)
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------
# sizes (--seq-len 16K), counts (--windows) and integer lists (--pool-sizes 1,2,4)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--gbs", "0"], "must be >= 1, got '0'"),
    (["--seq-len", "0"], "must be >= 1"),
    (["--seq-len", "12x"], "not an integer size: '12x'"),
    (["--windows", "0"], "0 is not in the range x>=1"),
    (["--pool-sizes", "2,a"], "'a' in '2,a' is not an integer"),
    (["--pool-sizes", "2,0"], "'0' in '2,0' must be >= 1"),
    (["--pool-sizes", "3"], "pool size(s) [3] must divide GBS=16"),
])
def test_a_bad_size_count_or_list_is_one_error(tmp_path, args, needle):
    res = CliRunner().invoke(main, ["vrsp", "--gbs", "16", *args, "--out", str(tmp_path / "o")])
    _one_error(res, needle)
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------
# --profile and --dtype
# --------------------------------------------------------------------------------------------

def test_an_unknown_hardware_profile_is_one_error(tmp_path):
    res = CliRunner().invoke(main, ["straggler", "--quick", "--profile", "no-such-profile", "--out", str(tmp_path / "o")])
    _one_error(res, "unknown hardware profile 'no-such-profile'")
    assert not (tmp_path / "o").exists()


def test_dtype_accepts_both_spellings():
    from experiments.common.options import DtypeType  # noqa: PLC0415

    short, long = DtypeType(("fp32", "bf16", "fp64")), DtypeType(("float32", "bfloat16"))
    assert short.convert("bfloat16", None, None) == "bf16" and short.convert("FP32", None, None) == "fp32"
    assert long.convert("bf16", None, None) == "bfloat16" and long.convert("float32", None, None) == "float32"
    with pytest.raises(click.BadParameter, match="accepted: bf16, bfloat16, float32, fp32"):
        long.convert("fp8", None, None)


# --------------------------------------------------------------------------------------------
# --out: a folder this process cannot write
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# one smoke per command: its bad input is one error line before any work (for train and
# microbench: before any process is spawned, where an unchecked file would only fail in the ranks)
# --------------------------------------------------------------------------------------------

PARTIAL = ["--dp", "4", "--cp", "2"]
SMOKES = {
    "lln": ([], "bad.txt", ["line 2", "positive integer"]),
    "vrsp": ([], "bad.txt", ["line 2", "positive integer"]),
    "train": (["--nproc", "2", "--cp", "2", "--steps", "1"], "bad.txt", ["line 2", "positive integer"]),
    "microbench": (["--nproc", "2", "--dp", "2", "--cp", "1", "--pool-size", "2", "--quick"], "ten.json",
                   ["length 1", "out of range [1, 2^40]"]),
    "straggler": (["--quick", "--settings", "256k"], "ten.json", ["length 1", "out of range [1, 2^40]"]),
    "pool-sweep": (["--quick", "--settings", "256k", "--block-size", "3000"], None,
                   ["block size B=3000 must divide S/CP=32768"]),
    "tile-overhead": (["--quick", "--setting", "256k", "--pool-size", "3"], None, ["pool size P=3 must divide DP"]),
    **{name: (["--quick", *PARTIAL], None, ["missing --seq-len, --gbs"])
       for name in ("plan-cost", "grid-search", "variability", "tune", "dp-scaling", "pp-balance", "e2e")},
    "fit-links": (["--quick", "--name", "x/../escaped"], None, ["--name", "not a plain name"]),
    "robustness": (["--quick", "--settings", "256k"], "ten.json", ["length 1", "out of range [1, 2^40]"]),
}
ELSEWHERE = {"report", "compare", "gpu-summary", "calibrate", "sim-check", "fidelity", "kernel-sweep"}
"""Commands with no shared layout or length-file option: their bad input is tested with the command."""


def test_every_command_has_a_bad_input_smoke():
    assert set(SMOKES) | ELSEWHERE == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(SMOKES))
def test_bad_input_smoke(tmp_path, monkeypatch, command):
    args, lengths, needles = SMOKES[command]
    files = {"bad.txt": "100\nabc\n300\n", "ten.json": WRAPS_INT64}
    if lengths:
        (tmp_path / lengths).write_text(files[lengths])
        args = [*args, "--workload", str(tmp_path / lengths)]
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    res = CliRunner().invoke(main, [command, *args, "--out", str(tmp_path / "o")])
    _one_error(res, *needles)
    assert time.monotonic() - t0 < 30 and not (tmp_path / "o").exists()
