"""Exchange planning (Libra sec. 4.3.3): hand-computed transfers, KV de-duplication, generic layouts
(the fast implementations against the reference: ``tests/compiled_identity/``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tap_strategies import placed_with, pools, scattered_pools

from libra.plan import KV, O, PoolPlan, Q, SequenceLayout, TileTable, check_pool, tile_flops
from libra.tap import build_transfers, make_tiles
from libra.tap.exchange import merge_intervals
from libra.workload import AttentionShape

UNIT = AttentionShape(num_q_heads=1, num_kv_heads=1, head_dim=1, dtype_bytes=2)


def _rows(tr, kind):
    m = tr.kind == kind
    return sorted(zip(tr.src[m].tolist(), tr.dst[m].tolist(), tr.tok_start[m].tolist(), tr.tok_end[m].tolist(),
                      tr.nbytes[m].tolist()))


@pytest.fixture
def two_holders():
    """S = 8, worker 0 holds [0,4), worker 1 holds [4,8); samples [6, 2]; B = 2, one head."""
    seq = SequenceLayout.contiguous(0, 0, [6, 2], cp=2)
    return [seq], make_tiles([seq], 2, 1, UNIT)


def test_hand_computed_transfers(two_holders):
    seqs, tiles = two_holders
    # tile 0 [0,2) leaves worker 0; tile 2 [4,6) leaves worker 1 and needs sample 0's prefix [0,6)
    tr = build_transfers(seqs, placed_with(tiles, [1, 0, 0, 1]), UNIT)
    assert _rows(tr, Q) == [(0, 1, 0, 2, 4), (1, 0, 4, 6, 4)]
    assert _rows(tr, O) == [(0, 1, 4, 6, 4), (1, 0, 0, 2, 4)]
    # worker 1 fetches [0,2) from worker 0; worker 0 holds [0,4) and fetches only [4,6) from worker 1
    assert _rows(tr, KV) == [(0, 1, 0, 2, 8), (1, 0, 4, 6, 8)]
    assert tr.bytes_by_kind() == {"q": 8, "kv": 16, "o": 8}
    check_pool(PoolPlan(0, (0, 1), tuple(seqs), placed_with(tiles, [1, 0, 0, 1]), tr), UNIT)


def test_kv_deduplicated_per_destination(two_holders):
    seqs, tiles = two_holders
    # worker 1 computes tiles 0 and 1: prefixes [0,2) and [0,4) of sample 0 -> one fetch of [0,4)
    tr = build_transfers(seqs, placed_with(tiles, [1, 1, 1, 1]), UNIT)
    assert _rows(tr, KV) == [(0, 1, 0, 4, 16)]
    assert _rows(tr, Q) == [(0, 1, 0, 4, 8)]  # contiguous Q pieces merged
    # two destinations fetch separate copies
    tr = build_transfers(seqs, placed_with(tiles, [1, 0, 0, 0]), UNIT)
    assert _rows(tr, KV) == [(0, 1, 0, 2, 8), (1, 0, 4, 8, 16)]


def test_all_home_still_fetches_foreign_prefix(two_holders):
    """Nothing moves, yet worker 1's tile [4,6) reads sample 0's prefix [0,4) held by worker 0
    (the Q-home need not hold the tile's complete K/V, Libra sec. 4.3.2)."""
    seqs, tiles = two_holders
    tr = build_transfers(seqs, placed_with(tiles, tiles.q_home), UNIT)
    assert _rows(tr, KV) == [(0, 1, 0, 4, 16)] and _rows(tr, Q) == [] and _rows(tr, O) == []


def test_unplaced_tiles_rejected(two_holders):
    seqs, tiles = two_holders
    with pytest.raises(ValueError, match="unplaced"):
        build_transfers(seqs, tiles, UNIT)


def test_gqa_replicated_kv_fetched_once():
    """H = 4 > hkv = 2: shards 0 and 1 share KV head 0; on one destination it is fetched once."""
    shape = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=1, dtype_bytes=2)
    seq = SequenceLayout.contiguous(0, 0, [4], cp=1)
    seqs = [seq]
    tiles = make_tiles(seqs, 4, 4, shape)
    tr = build_transfers(seqs, placed_with(tiles, [1, 1, 2, 1]), shape)
    kv = tr.select(tr.kind == KV)
    got = sorted(zip(kv.dst.tolist(), kv.head_start.tolist(), kv.head_end.tolist()))
    # worker 1 needs KV heads 0 (shards 0, 1) and 1 (shard 3): adjacent atoms with equal ranges merge
    assert got == [(1, 0, 2), (2, 1, 2)]
    check_pool(PoolPlan(0, (0, 1, 2), tuple(seqs), placed_with(tiles, [1, 1, 2, 1]), tr), shape)


def test_merge_intervals():
    (k,), lo, hi = merge_intervals([np.array([1, 1, 1, 2])], np.array([5, 0, 2, 0]), np.array([7, 2, 4, 1]))
    assert k.tolist() == [1, 1, 2] and lo.tolist() == [0, 5, 0] and hi.tolist() == [4, 7, 1]


def _ulysses_like(seq: SequenceLayout, s_idx: int, shape: AttentionShape, cp_workers):
    """Head-sharded tiles as Ulysses computes them: worker r of the CP group computes every token
    of the sequence for query heads [r*hq/CP, (r+1)*hq/CP), one tile per holder range."""
    rows = []
    width = shape.num_q_heads // len(cp_workers)
    for r, w in enumerate(cp_workers):
        for a, b, home in zip(seq.holder_start, seq.holder_end, seq.holder_worker):
            rows.append((s_idx, a, b, r * width, (r + 1) * width, home, w))
    cols = list(zip(*rows))
    t = dict(seq=cols[0], q_start=cols[1], q_end=cols[2], head_start=cols[3], head_end=cols[4],
             q_home=cols[5], dest=cols[6], flops=np.zeros(len(rows)))
    t["flops"] = tile_flops(seq, np.array(cols[1]), np.array(cols[2]), width, shape.head_dim)
    return TileTable(**t)


@settings(max_examples=30, deadline=None)
@given(pools(max_cp=4), st.randoms(use_true_random=False))
def test_random_placements_validate(pool, rnd):
    """build_transfers is generic: any placement of the tiles yields a valid plan."""
    sequences, workers, block, head_split, shape = pool
    tiles = make_tiles(sequences, block, head_split, shape)
    placed = placed_with(tiles, [rnd.choice(workers) for _ in range(len(tiles))])
    tr = build_transfers(sequences, placed, shape)
    check_pool(PoolPlan(0, tuple(workers), tuple(sequences), placed, tr), shape)
    assert np.all(tr.src != tr.dst)
    assert tr.backward().bytes_by_kind() == tr.bytes_by_kind()


@settings(max_examples=20, deadline=None)
@given(pools(max_cp=4, max_p=2))
def test_head_sharded_layout_validates(pool):
    """The Ulysses layout (tiles spanning whole holder ranges, head-sharded) through the same code."""
    sequences, workers, _block, _h, shape = pool
    cp = len(sequences[0].holder_start)
    if shape.num_q_heads % cp:
        return
    parts = [_ulysses_like(seq, i, shape, sorted(seq.holder_worker.tolist())) for i, seq in enumerate(sequences)]
    tiles = TileTable.concat(parts)
    tr = build_transfers(sequences, tiles, shape)
    check_pool(PoolPlan(0, tuple(workers), tuple(sequences), tiles, tr), shape)
    # nothing crosses CP groups
    for k in (Q, KV, O):
        m = tr.kind == k
        assert np.all(tr.src[m] // cp == tr.dst[m] // cp)


@settings(max_examples=40, deadline=None)
@given(scattered_pools(), st.randoms(use_true_random=False))
def test_scattered_layouts_validate(pool, rnd):
    """Arbitrary holder partitions (several ranges per worker): any placement gives a valid plan."""
    sequences, workers, tiles, shape = pool
    placed = placed_with(tiles, [rnd.choice(workers) for _ in range(len(tiles))])
    tr = build_transfers(sequences, placed, shape)
    check_pool(PoolPlan(0, tuple(workers), tuple(sequences), placed, tr), shape)
