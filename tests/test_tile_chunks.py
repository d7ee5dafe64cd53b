"""Tile-grouped Pipeliner chunks (libra.extensions.adaptive.tile_chunks): the assignment rule, the per-token KV
split against a brute-force reference, the bytes the cost model prices, the runtime's data flow
(compile_worker validates every delivery) and the Plan contract field."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tap_strategies import pools

from libra.config import ParallelConfig, TapConfig
from libra.extensions.adaptive.tile_chunks import TILES, TileChunkSchedule, assign_tile_chunks
from libra.plan import HEADS, KV, O, Plan, PoolPlan, Q, SequenceLayout, kv_need_start
from libra.runtime.program import compile_worker
from libra.sim.cost import CostModel
from libra.sim.profiles import load_profile
from libra.sim.topology import Topology
from libra.tap import plan_pool
from libra.tap.pipeline import BWD_RETURN, FWD_DISPATCH, PHASES, ChunkSchedule, schedule_for_pool
from libra.workload import AttentionShape


def _seq(seq_id: int, lengths, holders, dp: int) -> SequenceLayout:
    """A packed sequence split into equal contiguous ranges, one per holder (the standard layout)."""
    n, cp = int(np.sum(lengths)), len(holders)
    starts = np.arange(cp) * (n // cp)
    return SequenceLayout(seq_id, dp, np.asarray(lengths), starts, starts + n // cp, np.asarray(holders))


def _pool(pool, chunks: int) -> PoolPlan:
    sequences, workers, block, head_split, shape = pool
    tap = TapConfig(pool_size=len(sequences), block_size=block, head_split=head_split, pipeline_chunks=1)
    return replace(plan_pool(0, sequences, workers, tap, shape), chunking=TILES)


def _first_last_reference(pp: PoolPlan, shape, chunk: np.ndarray, row: int):
    """Per (KV head, token) of KV row ``row``: min and max chunk of the destination's tiles reading it."""
    tr, t = pp.transfers, pp.tiles
    ks = kv_need_start(pp.sequences, t, pp.index())
    k0, k1 = shape.kv_head_range(t.head_start, t.head_end)
    out = {}
    for k in range(int(tr.head_start[row]), int(tr.head_end[row])):
        for tok in range(int(tr.tok_start[row]), int(tr.tok_end[row])):
            read = ((t.dest == tr.dst[row]) & (t.seq == tr.seq[row]) & (k0 <= k) & (k < k1)
                    & (ks <= tok) & (tok < t.q_end))
            out[(k, tok)] = (int(chunk[read].min()), int(chunk[read].max()))
    return out


@settings(max_examples=40, deadline=None)
@given(pools(), st.sampled_from([2, 3, 4]))
def test_pieces_partition_rows_and_follow_first_and_last_reader(pool, chunks):
    pp = _pool(pool, chunks)
    shape = pool[4]
    sched = schedule_for_pool(pp, shape, chunks)
    assert isinstance(sched, TileChunkSchedule) and sched.chunking == TILES
    chunk = sched.tile_chunk
    assert chunk.shape == (len(pp.tiles),) and np.all((chunk >= 0) & (chunk < chunks))
    tr = pp.transfers
    for kind in (Q, KV, O):
        rows = np.nonzero(tr.kind == kind)[0]
        for backward in (False, True):
            covered = np.zeros(len(rows))
            seen = {}
            for m in range(chunks):
                i, h0, h1, t0, t1 = sched.transfer_pieces(kind, tr, rows, m, backward)
                assert np.all((t1 > t0) & (h1 > h0))
                assert np.all(t0 >= tr.tok_start[rows][i]) and np.all(t1 <= tr.tok_end[rows][i])
                np.add.at(covered, i, (t1 - t0) * (h1 - h0))
                for a, b, c, d, e in zip(i, h0, h1, t0, t1):
                    for k in range(b, c):
                        for tok in range(d, e):
                            assert (rows[a], k, tok) not in seen, "a token travels twice"
                            seen[(rows[a], k, tok)] = m
            area = (tr.tok_end[rows] - tr.tok_start[rows]) * (tr.head_end[rows] - tr.head_start[rows])
            assert np.array_equal(covered, area), "pieces must partition every row"
            if kind == KV and len(rows):
                r = int(rows[0])
                ref = _first_last_reference(pp, shape, chunk, r)
                for (k, tok), (first, last) in ref.items():
                    assert seen[(r, k, tok)] == (last if backward else first)


@settings(max_examples=25, deadline=None)
@given(pools(), st.sampled_from([1, 2, 4]))
def test_every_worker_program_compiles_and_routes_price_the_table(pool, chunks):
    """compile_worker checks that each chunk's kernel finds its Q and KV delivered by chunks <= it,
    exactly once, and every output row comes back once; the routes carry each row's bytes."""
    pp = _pool(pool, chunks)
    shape = pool[4]
    for w in pp.workers:
        prog = compile_worker(pp, shape, w, chunks)
        assert prog.schedule.chunking == TILES
    routes = schedule_for_pool(pp, shape, chunks).phase_routes(pp.transfers)
    for phase in PHASES:
        r = routes[phase]
        assert np.allclose(r.nbytes.sum(axis=1), pp.transfers.nbytes[r.row])


def test_local_tiles_open_and_close_the_order():
    """A worker whose tiles are all local splits them between the first and the last chunk; tiles
    that need transfers fill the chunks between, by KV head."""
    shape = AttentionShape(8, 2, 16)
    seqs = (_seq(0, [256], [0, 1], 0), _seq(1, [16] * 16, [2, 3], 1))
    tap = TapConfig(pool_size=2, block_size=32, head_split=2, pipeline_chunks=1)
    pp = replace(plan_pool(0, seqs, (0, 1, 2, 3), tap, shape), chunking=TILES)
    chunk = assign_tile_chunks(pp, shape, 4)
    t = pp.tiles
    local = (t.dest == t.q_home)
    for w in range(4):
        mine = t.dest == w
        if np.all(local[mine]) and mine.sum() > 1:
            assert {0, 3} <= set(chunk[mine].tolist())
        remote = mine & ~local
        if remote.sum() > 1:  # remote tiles are ordered by KV head: chunks never decrease with it
            k0 = t.head_start[remote] // shape.group_size
            order = np.lexsort((t.q_start[remote], t.seq[remote], k0))
            assert np.all(np.diff(chunk[remote][order]) >= 0)


def test_cost_model_prices_each_tile_chunk_its_own_compute():
    shape = AttentionShape(8, 2, 16)
    seqs = (_seq(0, [512], [0, 1], 0), _seq(1, [32] * 16, [2, 3], 1))
    tap = TapConfig(pool_size=2, block_size=64, head_split=2, pipeline_chunks=2)
    pp = plan_pool(0, seqs, (0, 1, 2, 3), tap, shape)
    # prefix-difference prices merged and unmerged pieces alike, so only the calls' heads differ here
    # (head chunks merge a worker's adjacent blocks into one segment; tile chunks cannot across chunks)
    base = load_profile("h100-roce-v1")
    profile = replace(base, kernel=replace(base.kernel, piece_pricing="prefix-difference"))
    cost = CostModel(profile, Topology(profile, ParallelConfig(dp=2, cp=2, gbs=2, seq_len=512)))
    heads = Plan("x", 0, shape, 2, 2, (pp,))
    tiles = replace(heads, pools=(replace(pp, chunking=TILES),))
    a, b = cost.price(heads), cost.price(tiles)
    assert np.allclose(a.flops_fwd, b.flops_fwd)
    # whole-width calls run at the rate of more heads per call: never slower than M slices
    assert np.all(b.compute_fwd_ms <= a.compute_fwd_ms + 1e-12)
    flops, fwd, bwd = cost._compute(tiles, cost._schedules(tiles, 2))
    assert fwd.shape == (4, 2) and np.allclose(fwd.sum(axis=1), b.compute_fwd_ms)
    traffic = cost.chunk_traffic(tiles)
    assert np.isclose(sum(t[0].sum() for t in traffic.values()), sum(t[0].sum() for t in cost.chunk_traffic(heads).values()))
    assert set(traffic) == set(PHASES) and traffic[FWD_DISPATCH][0].shape == (4, 2) and BWD_RETURN in traffic


def test_chunking_is_part_of_the_contract():
    shape = AttentionShape(8, 2, 16)
    seqs = (_seq(0, [128], [0, 1], 0), _seq(1, [16] * 8, [2, 3], 1))
    pp = plan_pool(0, seqs, (0, 1, 2, 3), TapConfig(pool_size=2, block_size=32, head_split=2), shape)
    assert pp.chunking == HEADS and "chunking" not in pp.to_dict()  # paper plans hash and serialise as before
    tiled = replace(pp, chunking=TILES)
    assert tiled.digest() != pp.digest()
    assert PoolPlan.from_dict(tiled.to_dict()).digest() == tiled.digest()
    assert isinstance(schedule_for_pool(pp, shape, 2), ChunkSchedule)
    with pytest.raises(ValueError, match="unknown Pipeliner chunking 'rows'"):
        replace(pp, chunking="rows")


def test_a_tile_schedule_refuses_another_pools_transfer_table():
    """Its pieces are cut from its own pool's table; rows of another table would be cut wrongly."""
    shape = AttentionShape(8, 2, 16)
    seqs = (_seq(0, [128], [0, 1], 0), _seq(1, [16] * 8, [2, 3], 1))
    pp = replace(plan_pool(0, seqs, (0, 1, 2, 3), TapConfig(pool_size=2, block_size=32, head_split=2), shape),
                 chunking=TILES)
    sched = schedule_for_pool(pp, shape, 2)
    other = pp.transfers.select(np.arange(len(pp.transfers)))  # equal content, another object
    with pytest.raises(ValueError, match="cuts only its own pool's transfer table"):
        sched.transfer_pieces(KV, other, np.nonzero(other.kind == KV)[0], 0)
