"""The exchange's fast implementations -- compiled (:mod:`libra.jit.exchange`) and packed-key
numpy -- build exactly the transfers of the reference interval merging (Libra sec. 4.3.3): on any
placed table (tiles crossing holders and samples, duplicated or overlapping, any heads, scattered
holders, zero-length samples), on TAP placements, on scattered layouts, on a large pool, and on
the edge tables that take the reference path. Without numba the numpy path is still checked."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tap_strategies import long_tail_lengths, placed_with, pools, scattered_pools, shapes

from libra.plan import KV, O, Q, SequenceLayout, TileTable
from libra.tap import build_transfers, make_tiles
from libra.tap.exchange import exchange_impl
from libra.workload import AttentionShape

UNIT = AttentionShape(num_q_heads=1, num_kv_heads=1, head_dim=1, dtype_bytes=2)
FAST = [i for i in ("numba", "numpy") if i != "numba" or exchange_impl() == "numba"]


def _all_agree(same, sequences, tiles, shape):
    ref = build_transfers(sequences, tiles, shape, impl="reference")
    for impl in FAST:
        same(build_transfers(sequences, tiles, shape, impl=impl), ref, impl)
    return ref


@st.composite
def generic_tables(draw):
    """Any placed table: tiles crossing holders and samples, duplicated or overlapping, any heads
    (several KV atoms), any homes and destinations; holder ranges scattered; zero-length samples."""
    shape = draw(shapes())
    n_workers = draw(st.integers(1, 6))
    sequences = []
    for s_idx in range(draw(st.integers(1, 3))):
        total = draw(st.integers(1, 40))
        lengths = draw(long_tail_lengths(total))
        if draw(st.booleans()):
            lengths.insert(draw(st.integers(0, len(lengths))), 0)
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, total - 1)), max_size=5))) - {total})
        holders = [draw(st.integers(0, n_workers - 1)) for _ in range(len(cuts) + 1)]
        sequences.append(SequenceLayout(s_idx, s_idx, lengths, [0] + cuts, cuts + [total], holders))
    rows = []
    for _ in range(draw(st.integers(1, 25))):
        s = draw(st.integers(0, len(sequences) - 1))
        n = sequences[s].num_tokens
        a = draw(st.integers(0, n - 1))
        hs = draw(st.integers(0, shape.num_q_heads - 1))
        rows.append((s, a, draw(st.integers(a + 1, n)), hs, draw(st.integers(hs + 1, shape.num_q_heads)),
                     draw(st.integers(0, n_workers - 1)), draw(st.integers(0, n_workers))))
    rows += draw(st.lists(st.sampled_from(rows), max_size=3))  # exact duplicates
    c = [np.array(x) for x in zip(*rows)]
    tiles = TileTable(seq=c[0], q_start=c[1], q_end=c[2], head_start=c[3], head_end=c[4], q_home=c[5],
                      dest=c[6], flops=np.zeros(len(rows)))
    return sequences, tiles, shape


@settings(max_examples=150, deadline=None)
@given(generic_tables())
def test_agree_on_generic_tables(assert_same, case):
    _all_agree(assert_same, *case)


@settings(max_examples=40, deadline=None)
@given(pools(max_cp=4), st.randoms(use_true_random=False))
def test_agree_on_tap_placements(assert_same, pool, rnd):
    sequences, workers, block, head_split, shape = pool
    tiles = make_tiles(sequences, block, head_split, shape)
    for dest in (tiles.q_home, [rnd.choice(workers) for _ in range(len(tiles))], [workers[0]] * len(tiles)):
        _all_agree(assert_same, sequences, placed_with(tiles, dest), shape)


@settings(max_examples=30, deadline=None)
@given(scattered_pools(), st.randoms(use_true_random=False))
def test_agree_on_scattered_layouts(assert_same, pool, rnd):
    sequences, workers, tiles, shape = pool
    _all_agree(assert_same, sequences, placed_with(tiles, [rnd.choice(workers) for _ in range(len(tiles))]), shape)


def test_agree_on_a_large_pool(assert_same):
    """Long runs per (worker, worker) and (worker, atom) (the kernel's merge sort), many samples."""
    rng = np.random.default_rng(5)
    shape = AttentionShape(8, 4, 2, 2)
    seqs = [SequenceLayout.contiguous(s, s, np.diff(np.sort(np.r_[0, rng.choice(np.arange(1, 512), 40, replace=False),
                                                               512])), 4) for s in range(4)]
    tiles = make_tiles(seqs, 8, 4, shape)
    workers = np.arange(16)
    for dest in (np.zeros(len(tiles), dtype=int), rng.choice(workers[:3], len(tiles)), rng.choice(workers, len(tiles)),
                 np.where(tiles.seq % 2 == 0, tiles.q_home, 15 - tiles.q_home)):
        _all_agree(assert_same, seqs, placed_with(tiles, dest), shape)


def test_edge_tables_take_the_reference_path(assert_same):
    """Empty tiles, empty tables and keys too wide for one int64 give the reference result."""
    seqs = [SequenceLayout.contiguous(0, 0, [6, 2], cp=2)]
    tiles = make_tiles(seqs, 2, 1, UNIT)
    cols = {k: getattr(tiles, k) for k in TileTable.FIELDS}
    empty_tile = TileTable(**{**cols, "q_end": np.where(np.arange(len(tiles)) == 1, 2, tiles.q_end),
                              "dest": np.array([1, 1, 0, 0], dtype=np.int32)})
    assert len(_all_agree(assert_same, seqs, empty_tile, UNIT))
    for huge in (70_000, 2**30):  # worker ids past the kernel's tables; W^2 alone past 2^60
        far = [SequenceLayout(0, 0, [6, 2], [0, 4], [4, 8], [huge, huge + 1])]
        t = make_tiles(far, 2, 1, UNIT)
        tr = _all_agree(assert_same, far, placed_with(t, [huge + 1, huge, huge, huge + 1]), UNIT)
        assert set(tr.kind.tolist()) == {Q, KV, O}
    for impl in (*FAST, "reference"):
        assert len(build_transfers(seqs, TileTable.empty(), UNIT, impl=impl)) == 0


def test_no_transfers_when_one_worker_holds_everything(assert_same):
    seqs = [SequenceLayout.contiguous(0, 0, [3, 5], cp=1)]
    shape = AttentionShape(4, 2, 1, 2)
    tiles = make_tiles(seqs, 2, 2, shape)
    assert len(_all_agree(assert_same, seqs, placed_with(tiles, tiles.q_home), shape)) == 0


@pytest.mark.numba
def test_kernel_order_is_a_stable_lexicographic_sort():
    from libra.jit.exchange import _order

    rng = np.random.default_rng(0)
    for n, n_major, n_minor in ((0, 1, 1), (1, 1, 1), (50, 3, 2), (400, 2, 2), (300, 40, 5)):
        major, minor = rng.integers(0, n_major, n), rng.integers(0, n_minor, n)
        sec = rng.integers(0, 6, n)  # many ties
        assert np.array_equal(_order(major, n_major, minor, n_minor, sec), np.lexsort((sec, minor, major)))
