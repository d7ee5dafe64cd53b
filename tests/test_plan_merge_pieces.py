"""``libra.plan.merge_pieces``: the kernel segments a worker runs (adjacent pieces of one sample,
head range and chunk merged), one rule for the runtime's work list and the cost model's pricing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.registry import get_planner
from libra.config import ParallelConfig
from libra.data.windows import gbs_windows
from libra.plan import SEGMENT_FIELDS, merge_pieces
from libra.sim.cost import CostModel
from libra.sim.profiles import load_profile
from libra.sim.topology import Topology
from libra.tap.pipeline import ChunkSchedule
from libra.workload import AttentionShape, sample_area


def _pieces(rows: list[tuple]) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """Segments from ``(dest, chunk, head_start, seq, sample_start, q_start, q_len, kv_len)`` rows."""
    a = np.array(rows, dtype=np.int64).reshape(-1, 8)
    q0, ql, kv = a[:, 5], a[:, 6], a[:, 7]
    lo = kv - ql  # rows inside the sample
    seg = {"tile": np.arange(len(a)), "seq": a[:, 3], "dest": a[:, 0], "sample_start": a[:, 4],
           "sample_len": kv + 100, "q_start": q0, "q_len": ql, "kv_len": kv, "heads": np.full(len(a), 4),
           "area": (kv * (kv + 1) - lo * (lo + 1)) // 2}
    return seg, a[:, 1], a[:, 2], a[:, 2] + 4


def test_adjacent_blocks_merge_and_others_stay_apart():
    rows = [  # dest, chunk, head_start, seq, sample_start, q_start, q_len, kv_len
        (0, -1, 0, 0, 0, 0, 256, 256), (0, -1, 0, 0, 0, 256, 256, 512),  # adjacent: one segment
        (0, -1, 0, 0, 0, 768, 256, 1024),  # a gap before it: its own
        (1, -1, 0, 0, 0, 512, 256, 768),  # another worker
        (0, -1, 4, 0, 0, 512, 256, 768),  # other heads
        (0, 1, 0, 0, 0, 1024, 256, 1280),  # another chunk
    ]
    seg, chunk, hs, he = _pieces(rows)
    out, ch = merge_pieces(seg, chunk, hs, he)
    assert set(out) == set(SEGMENT_FIELDS) and len(out["q_len"]) == 5
    first = np.nonzero((out["dest"] == 0) & (out["q_start"] == 0))[0][0]
    assert (out["q_len"][first], out["kv_len"][first], out["area"][first]) == (512, 512, sample_area(512))
    assert sorted(zip(out["dest"].tolist(), ch.tolist())) == [(0, -1), (0, -1), (0, -1), (0, 1), (1, -1)]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(-1, 1), st.sampled_from([0, 4]), st.integers(0, 1),
                          st.integers(1, 6)), min_size=1, max_size=25))
def test_merging_keeps_every_row_and_the_work(spec):
    # blocks of 64 rows of one 512-token sample per sequence, placed anywhere
    rows = {(d, c, h, s, b) for d, c, h, s, b in spec}
    seg, chunk, hs, he = _pieces([(d, c, h, s, 0, 64 * b, 64, 64 * (b + 1)) for d, c, h, s, b in sorted(rows)])
    out, ch = merge_pieces(seg, chunk, hs, he)
    assert out["q_len"].sum() == seg["q_len"].sum() and out["area"].sum() == seg["area"].sum()
    # a merged segment is the last rows of its key prefix, so its area is the prefix's minus the rows before
    lo = out["kv_len"] - out["q_len"]
    assert np.all(out["area"] == (out["kv_len"] * (out["kv_len"] + 1) - lo * (lo + 1)) // 2)
    # nothing left to merge: applying the rule again changes nothing
    again, _ = merge_pieces(out, ch, hs[out["tile"]], he[out["tile"]])
    assert len(again["q_len"]) == len(out["q_len"])


def test_the_cost_model_prices_a_ulysses_sample_cut_by_the_cp_shards_as_one_call():
    # Ulysses' plan cuts a packed sequence into S / CP token shards; the runtime runs each head group's
    # samples whole, so a sample crossing a shard boundary must cost what the whole sample costs
    par = ParallelConfig(dp=2, cp=2, gbs=2, seq_len=4096)
    shape = AttentionShape(8, 2, 64, 2)
    window = gbs_windows("libra-prod", 4096, 2, 1, seed=3)[0]
    plan = get_planner("ulysses").plan_window(window, par, shape)[0]
    prof = load_profile("h100-roce-v1")
    cost = CostModel(prof, Topology(prof, par)).price(plan)
    k = prof.kernel
    for pool in plan.pools:
        seg = pool.segments()
        crossing = np.sum(seg["q_len"] != seg["kv_len"])
        lengths = np.concatenate([s.sample_lengths for s in pool.sequences])
        for w in pool.workers:
            heads = int(seg["heads"][seg["dest"] == w][0])
            whole = k.segment_forward_ms(sample_area(lengths).astype(np.float64), heads, 64).sum()
            assert cost.compute_fwd_ms[w] == pytest.approx(whole + k.launch_ms * plan.pipeline_chunks, rel=1e-9)
        assert crossing  # the window has samples the shards cut (else this test checks nothing)


def test_the_runtime_runs_the_segments_the_cost_model_prices():
    from libra.runtime.program import _work_list  # noqa: PLC0415

    par = ParallelConfig(dp=2, cp=1, gbs=2, seq_len=2048)
    shape = AttentionShape(8, 2, 64, 4)
    window = gbs_windows("libra-prod", 2048, 2, 1, seed=0)[0]
    plan = get_planner("libra", pool_size=2, block_size=256, head_split=2, pipeline_chunks=2).plan_window(
        window, par, shape)[0]
    pool = plan.pools[0]
    sched = ChunkSchedule.for_pool(pool, shape, plan.pipeline_chunks)
    seg = pool.segments()
    merged, _ = merge_pieces(seg, sched.segment_calls(seg)[0], pool.tiles.head_start[seg["tile"]],
                             pool.tiles.head_end[seg["tile"]])
    assert len(merged["q_len"]) < len(seg["q_len"])  # the plan puts adjacent blocks together somewhere
    for w in pool.workers:
        got = _work_list(pool, w, sched)
        mine = merged["dest"] == w
        assert sorted(zip(got["qtok"].tolist(), got["q"].tolist(), got["kv"].tolist())) == sorted(
            zip(merged["q_start"][mine].tolist(), merged["q_len"][mine].tolist(), merged["kv_len"][mine].tolist()))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(-1, 1), st.sampled_from([0, 4]), st.integers(0, 3),
                          st.integers(0, 6)), min_size=1, max_size=30))
def test_unordered_merging_gives_the_same_segments(spec):
    # sequences 0-1: blocks of 64 rows of one 512-token sample; 2-3: a whole 64-token sample per block
    rows, lens = [], []
    for d, c, h, s, b in sorted(set(spec)):
        whole = s >= 2
        rows.append((d, c, h, s, 64 * b if whole else 0, 64 * b, 64, 64 if whole else 64 * (b + 1)))
        lens.append(64 if whole else 512)
    seg, chunk, hs, he = _pieces(rows)
    seg["sample_len"] = np.array(lens)
    a, ca = merge_pieces(seg, chunk, hs, he)
    b, cb = merge_pieces(seg, chunk, hs, he, ordered=False)
    key = ("dest", "seq", "sample_start", "q_start", "q_len", "kv_len", "area", "heads", "tile")
    assert sorted(zip(ca.tolist(), *(a[k].tolist() for k in key))) == sorted(zip(cb.tolist(), *(b[k].tolist() for k in key)))
