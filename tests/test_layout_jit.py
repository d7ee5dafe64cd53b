"""The compiled kernel segments (:mod:`libra.jit.layout`) are the numpy ones, row for row:
random pools of many short samples and samples cut by tiles, holder boundaries and CP ranks, tiles
of every head split, and the empty table."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.jit import compiled
from libra.plan import SequenceLayout, TileTable
from libra.plan.layout import _segments_compiled, _segments_numpy, pool_index, segments
from libra.tap.tiles import make_tiles
from libra.workload import AttentionShape

pytest.importorskip("numba")

SHAPE = AttentionShape(8, 2, 8)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 100_000), p=st.integers(1, 3), cp=st.sampled_from([1, 2, 4]),
       block=st.sampled_from([8, 16, 32]), split=st.sampled_from([1, 2, 4]), long_tail=st.booleans())
def test_compiled_segments_equal_numpy(seed, p, cp, block, split, long_tail):
    rng = np.random.default_rng(seed)
    seqs = []
    for j in range(p):
        n = 64 * cp
        k = int(rng.integers(0, 40 if long_tail else 6))  # many short samples, or a few long ones
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(k, n - 1), replace=False))
        seqs.append(SequenceLayout.contiguous(j, j, np.diff(np.r_[0, cuts, n]), cp))
    tiles = make_tiles(seqs, block, split, SHAPE)
    workers = np.arange(p * cp)
    tiles = TileTable(**{**{f: getattr(tiles, f) for f in TileTable.FIELDS},
                         "dest": rng.choice(workers, size=len(tiles)).astype(np.int32)})
    idx = pool_index(seqs)
    got, want = _segments_compiled(compiled("layout"), tiles, idx), _segments_numpy(tiles, idx)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key
    assert all(np.array_equal(segments(seqs, tiles)[k], want[k]) for k in want)  # the default path


def test_no_tiles_no_segments():
    out = segments([SequenceLayout.contiguous(0, 0, [8], 1)], TileTable.empty())
    assert set(out) and all(len(v) == 0 for v in out.values())
