"""GBS windows of packed sequences from a named workload (libra/data/windows.py)."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest

from libra.data.windows import gbs_windows, window_workloads


def test_gbs_windows_shape_determinism_and_prefix():
    a = gbs_windows("libra-prod", 4096, 8, 3, seed=5)
    b = gbs_windows("libra-prod", 4096, 8, 3, seed=5)
    c = gbs_windows("libra-prod", 4096, 8, 1, seed=5)
    d = gbs_windows("libra-prod", 4096, 8, 3, seed=6)
    assert len(a) == 3 and all(len(w) == 8 for w in a)
    assert all(s.num_tokens == 4096 for w in a for s in w)
    assert [s.seq_id for s in a[1]] == list(range(8))
    for wa, wb in zip(a, b):
        assert np.array_equal(window_workloads(wa), window_workloads(wb))
    assert np.array_equal(window_workloads(a[0]), window_workloads(c[0]))
    assert not np.array_equal(window_workloads(a[0]), window_workloads(d[0]))
    # consecutive windows continue one stream (strictly ordered under 'split')
    s = gbs_windows("libra-prod", 4096, 8, 2, seed=5, policy="split")
    assert s[1][0].sample_ids[0] >= s[0][-1].sample_ids[-1]


@pytest.mark.parametrize("args, match", [((0, 8, 1), "sequence length"), ((64, 0, 1), "GBS must be"),
                                         ((64, 8, 0), "number of windows")])
def test_gbs_windows_bad_args(args, match):
    with pytest.raises(ValueError, match=match):
        gbs_windows("libra-prod", *args)


def test_gbs_windows_truncate_still_fills():
    windows = gbs_windows("libra-prod-heavy", 1024, 4, 2, seed=0, policy="truncate")
    assert [len(w) for w in windows] == [4, 4]


@pytest.mark.parametrize("lookahead", [0, -1, 10**9, 2.5, True])
def test_gbs_windows_bad_lookahead(lookahead):
    with pytest.raises(ValueError, match="lookahead must be an integer in"):
        gbs_windows("libra-prod", 64, 2, 1, lookahead=lookahead)


def test_gbs_windows_unknown_policy():
    with pytest.raises(ValueError, match="unknown packing policy 'pad'"):
        gbs_windows("libra-prod", 64, 2, 1, policy="pad")


def test_window_workloads_are_sums_of_squared_pieces():
    window = gbs_windows("libra-prod", 4096, 4, 1, seed=0)[0]
    got = window_workloads(window)
    assert got.dtype == np.float64 and got.shape == (4,)
    assert got.tolist() == [float((s.sample_lengths.astype(np.float64) ** 2).sum()) for s in window]


def test_a_sample_longer_than_s_is_cut_with_one_warning_saying_into_how_many_pieces(tmp_path, caplog):
    (tmp_path / "giant.txt").write_text("1000\n" * 8 + "1000000\n" + "1000\n" * 8)
    with caplog.at_level("WARNING", logger="libra.data.windows"):
        windows = gbs_windows(str(tmp_path / "giant.txt"), 4096, 8, 31, policy="split")  # not cycled
    cut = [r.getMessage() for r in caplog.records if "longer than S" in r.getMessage()]
    assert len(cut) == 1, caplog.text
    pieces = sum(int((s.sample_ids == 8).sum()) for w in windows for s in w)  # the 10^6-token sample's id
    assert pieces == 246  # 1000000 tokens from offset 8000 (3904 into a sequence): 192 + 244 x 4096 + 384
    assert cut[0] == (f"warning: 1 sample(s) longer than S=4096 cut into {pieces} pieces in all (the longest, "
                      f"1000000 tokens of it packed, into {pieces})")
    caplog.clear()
    with caplog.at_level("WARNING", logger="libra.data.windows"):
        gbs_windows(str(tmp_path / "giant.txt"), 2**20, 1, 1)
    assert "longer than S" not in caplog.text


def test_stream_requests_past_2_62_tokens_are_an_error_not_a_loop():
    from libra.data.packing import PackedSequence  # noqa: PLC0415
    from libra.data.source import LengthSource  # noqa: PLC0415

    class Stingy(LengthSource):  # never gives 'defer' a full lookahead buffer past the windows
        name = "stingy"
        calls = 0

        def take(self, n_tokens, seed=0):
            Stingy.calls += 1
            return np.array([n_tokens], dtype=np.int64)

    with pytest.raises(ValueError, match="stingy: 2 packed sequences of S=64 tokens need more than 2\\^62"):
        gbs_windows(Stingy(), 64, 2, 1)
    assert Stingy.calls < 64  # the request doubles each round
    assert PackedSequence  # imported for the type of what gbs_windows returns


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


@pytest.mark.slow
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
