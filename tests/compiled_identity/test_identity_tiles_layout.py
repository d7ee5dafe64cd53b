"""SH-tiles (:mod:`libra.jit.tiles`) and kernel segments (:mod:`libra.jit.layout`): the compiled
kernels equal the numpy implementations on random pools -- zero-length samples and a partial last
block, many short samples cut by tiles, holder boundaries and CP ranks, every head split, tiles
on arbitrary workers, the empty table -- and name a bad block the same way."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tap_strategies import pools

from libra.jit import compiled
from libra.plan import SequenceLayout, TileTable
from libra.plan.layout import _segments_compiled, _segments_numpy, pool_index, segments
from libra.tap.tiles import make_tiles, tiles_impl
from libra.workload import AttentionShape

SHAPE = AttentionShape(8, 2, 8)
TILE_IMPLS = ["numpy"] + (["numba"] if tiles_impl() == "numba" else [])
"""Where numba is missing only numpy runs (against itself: the test still checks the inputs are valid)."""


@settings(max_examples=40, deadline=None)
@given(pools(), st.integers(0, 3))
def test_tiles_agree(assert_same, pool, zeros):
    """Same tiles from every implementation, with zero-length samples and a partial last block."""
    sequences, _workers, block, head_split, shape = pool
    lengths = list(sequences[0].sample_lengths) + [0] * zeros  # zero-length samples at the end
    seqs = [SequenceLayout.contiguous(0, 0, lengths + [block // 2 or 1], cp=1)] + list(sequences)
    ref = make_tiles(seqs, block, head_split, shape, impl="numpy")
    for impl in TILE_IMPLS:
        assert_same(make_tiles(seqs, block, head_split, shape, impl=impl), ref, impl)


@pytest.mark.parametrize("impl", TILE_IMPLS)
def test_crossing_block_named_by_every_implementation(impl):
    seqs = [SequenceLayout.contiguous(0, 0, [8], cp=2), SequenceLayout.contiguous(1, 1, [12], cp=2)]
    with pytest.raises(ValueError, match=r"block 1 \[4, 8\) of sequence 1 \(seq_id 1\) crosses"):
        make_tiles(seqs, 4, 1, AttentionShape(1, 1, 1, 2), impl=impl)


@pytest.mark.numba
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 100_000), p=st.integers(1, 3), cp=st.sampled_from([1, 2, 4]),
       block=st.sampled_from([8, 16, 32]), split=st.sampled_from([1, 2, 4]), long_tail=st.booleans())
def test_segments_agree(assert_same, seed, p, cp, block, split, long_tail):
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
    want = _segments_numpy(tiles, idx)
    assert_same(_segments_compiled(compiled("layout"), tiles, idx), want)
    assert_same(segments(seqs, tiles), want)  # the default path


def test_empty_table_gives_empty_segments_either_way(assert_same):
    seqs = [SequenceLayout.contiguous(0, 0, [8, 24], 2)]
    out = segments(seqs, TileTable.empty())
    assert set(out) and all(len(v) == 0 for v in out.values())
    if compiled("layout") is not None:
        empty = make_tiles(seqs, 8, 2, SHAPE).select(np.zeros(0, dtype=np.int64))
        idx = pool_index(seqs)
        assert_same(_segments_compiled(compiled("layout"), empty, idx), _segments_numpy(empty, idx))
