"""GBS windows of packed sequences from a named workload (libra/data/windows.py)."""

from __future__ import annotations

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
