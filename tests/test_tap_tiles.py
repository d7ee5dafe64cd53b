"""SH-tiles (Libra sec. 4.3.1): decomposition, Q-homes, FLOPs, KV intervals, GQA atoms, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from test_tap_strategies import pools

from libra.plan import SequenceLayout
from libra.tap import kv_atoms, kv_need_start, make_tiles
from libra.tap.tiles import pool_index
from libra.workload import AttentionShape, packed_flops


def test_hand_computed_tiles():
    """S = 8, CP = 2 (worker 4 holds [0,4), worker 5 holds [4,8)), samples [3, 5], B = 2, H = 2."""
    shape = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=1, dtype_bytes=2)
    seq = SequenceLayout.contiguous(7, 2, [3, 5], cp=2)
    tiles = make_tiles([seq], 2, 2, shape)
    assert len(tiles) == 8
    assert tiles.q_start.tolist() == [0, 0, 2, 2, 4, 4, 6, 6]
    assert tiles.head_start.tolist() == [0, 2] * 4 and tiles.head_end.tolist() == [2, 4] * 4
    assert tiles.q_home.tolist() == [4, 4, 4, 4, 5, 5, 5, 5]
    assert np.all(tiles.dest == -1)
    # areas per block: rows 0,1 of sample 0 -> 1+2; row 2 of sample 0 + row 0 of sample 1 -> 3+1;
    # rows 1,2 of sample 1 -> 2+3; rows 3,4 -> 4+5. FLOPs = 4 * area * 2 heads * head_dim 1
    assert (tiles.flops / 8).tolist() == [3, 3, 4, 4, 5, 5, 9, 9]
    assert kv_need_start([seq], tiles).tolist() == [0, 0, 0, 0, 3, 3, 3, 3]


def test_partial_last_block_with_cp1():
    seq = SequenceLayout.contiguous(0, 0, [5], cp=1)
    tiles = make_tiles([seq], 2, 1, AttentionShape(1, 1, 1, 2))
    assert tiles.q_start.tolist() == [0, 2, 4] and tiles.q_end.tolist() == [2, 4, 5]


def test_block_not_dividing_rank_range():
    seq = SequenceLayout.contiguous(0, 0, [12], cp=2)
    with pytest.raises(ValueError, match=r"block 1 \[4, 8\) of sequence 0 .* B=4 must divide"):
        make_tiles([seq], 4, 1, AttentionShape(1, 1, 1, 2))


def test_bad_head_split_and_sizes():
    seq = SequenceLayout.contiguous(0, 0, [8], cp=1)
    shape = AttentionShape(6, 2, 1, 2)
    with pytest.raises(ValueError, match="H=4 must divide num_q_heads=6"):
        make_tiles([seq], 4, 4, shape)
    with pytest.raises(ValueError, match="block size B must be a positive integer, got 0"):
        make_tiles([seq], 0, 1, shape)
    with pytest.raises(ValueError, match="head split H must be a positive integer"):
        make_tiles([seq], 4, -1, shape)


def test_holders_must_partition():
    with pytest.raises(ValueError, match=r"sequence 0: holder ranges \[\(0, 4\), \(5, 8\)\] do not partition"):
        SequenceLayout(0, 0, [8], [0, 5], [4, 8], [0, 1])
    with pytest.raises(ValueError, match="do not partition its 8 tokens"):
        SequenceLayout(0, 0, [8], [0], [4], [0])
    with pytest.raises(ValueError, match="equal length"):
        SequenceLayout(0, 0, [8], [0, 4], [4, 8], [0])
    idx = pool_index([SequenceLayout(0, 0, [3, 5], [4, 0], [8, 4], [1, 0]), SequenceLayout.contiguous(1, 1, [4], 2)])
    assert idx.base.tolist() == [0, 8, 12] and idx.offs.tolist() == [0, 3, 8, 12]
    assert idx.h_start.tolist() == [0, 4, 8, 10] and idx.h_worker.tolist() == [0, 1, 2, 3]


def test_gqa_atoms_replicated_and_split():
    shape = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=1, dtype_bytes=2)  # group 4
    # H = 8 > hkv: shards of one query head; four shards share each KV head
    bounds, a0, a1 = kv_atoms(shape, np.arange(8), np.arange(1, 9))
    assert bounds.tolist() == [0, 1, 2] and a0.tolist() == [0] * 4 + [1] * 4 and (a1 - a0).tolist() == [1] * 8
    # partial overlap: q heads [0,6) -> kv [0,2), [6,8) -> kv [1,2): atoms [0,1), [1,2)
    bounds, a0, a1 = kv_atoms(shape, [0, 6], [6, 8])
    assert bounds.tolist() == [0, 1, 2] and a0.tolist() == [0, 1] and a1.tolist() == [2, 2]


@settings(max_examples=30, deadline=None)
@given(pools())
def test_tiles_cover_sequence_and_sum_flops(pool):
    sequences, workers, block, head_split, shape = pool
    tiles = make_tiles(sequences, block, head_split, shape)
    width = shape.num_q_heads // head_split
    assert np.all(tiles.head_end - tiles.head_start == width)
    for s_idx, seq in enumerate(sequences):
        rows = tiles.seq == s_idx
        assert np.isclose(tiles.flops[rows].sum(), packed_flops(seq.sample_lengths, shape), rtol=1e-12)
        # Q-home is the holder of every token of the tile
        for qs, qe, home in zip(tiles.q_start[rows], tiles.q_end[rows], tiles.q_home[rows]):
            held = [(a, b) for a, b, w in zip(seq.holder_start, seq.holder_end, seq.holder_worker) if w == home]
            assert any(a <= qs and qe <= b for a, b in held)
    kv0 = kv_need_start(sequences, tiles)
    assert np.all(kv0 <= tiles.q_start)


def test_pool_index_matches_per_sequence_construction():
    """The one-sort PoolIndex equals the per-sequence definition (permuted holders, empty samples)."""
    seqs = [SequenceLayout(0, 0, [3, 0, 5], [4, 0], [8, 4], [1, 0]),
            SequenceLayout(1, 1, [2, 2, 0], [2, 0, 3], [3, 2, 4], [5, 6, 7]), SequenceLayout.contiguous(2, 2, [6], 3)]
    idx = pool_index(seqs)
    base = np.concatenate(([0], np.cumsum([s.num_tokens for s in seqs])))
    assert idx.base.tolist() == base.tolist()
    assert idx.offs.tolist() == [int(o) + int(b) for s, b in zip(seqs, base) for o in s.sample_offsets[:-1]] + [18]
    rows = sorted((int(a) + int(b), int(e) + int(b), int(w), i) for i, (s, b) in enumerate(zip(seqs, base))
                  for a, e, w in zip(s.holder_start, s.holder_end, s.holder_worker))
    assert [idx.h_start.tolist(), idx.h_end.tolist(), idx.h_worker.tolist(), idx.h_seq.tolist()] == \
        [list(c) for c in zip(*rows)]
    assert [a.dtype for a in idx] == [np.int64, np.int64, np.int64, np.int64, np.int32, np.int64]
