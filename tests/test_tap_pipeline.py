"""TAP Pipeliner (Libra sec. 4.4): equal-head chunks, the overlap schedule, GQA KV pieces."""

from __future__ import annotations

import pytest

from libra.tap import chunk_heads, chunk_kv_heads, chunk_kv_sends, schedule
from libra.workload import AttentionShape


def test_chunk_heads():
    assert chunk_heads(16, 32, 4) == [(16, 20), (20, 24), (24, 28), (28, 32)]
    assert chunk_heads(0, 16, 1) == [(0, 16)]


@pytest.mark.parametrize("args, msg", [((0, 16, 3), "M=3 must divide the head-shard width 16"),
                                       ((0, 16, 0), "positive integer, got 0"),
                                       ((4, 4, 1), "empty head range"),
                                       ((0, 16, 2.0), "positive integer")])
def test_chunk_heads_bad(args, msg):
    with pytest.raises(ValueError, match=msg):
        chunk_heads(*args)


def test_schedule_order():
    assert schedule(1) == [("issue_dispatch", 0), ("wait_dispatch", 0), ("compute", 0), ("issue_return", 0),
                           ("wait_return", 0)]
    ev = schedule(3)
    assert ev == [("issue_dispatch", 0),
                  ("wait_dispatch", 0), ("issue_dispatch", 1), ("compute", 0), ("issue_return", 0),
                  ("wait_dispatch", 1), ("issue_dispatch", 2), ("compute", 1), ("issue_return", 1),
                  ("wait_dispatch", 2), ("compute", 2), ("issue_return", 2),
                  ("wait_return", 0), ("wait_return", 1), ("wait_return", 2)]


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_schedule_invariants(m):
    ev = schedule(m)
    pos = {e: i for i, e in enumerate(ev)}
    assert len(pos) == len(ev) == 5 * m
    for i in range(m):
        assert pos[("issue_dispatch", i)] < pos[("wait_dispatch", i)] < pos[("compute", i)] \
            < pos[("issue_return", i)] < pos[("wait_return", i)]
        if i + 1 < m:  # chunk i+1's transfer is in flight while chunk i computes
            assert pos[("issue_dispatch", i + 1)] < pos[("compute", i)]
    with pytest.raises(ValueError):
        schedule(0)


def test_gqa_chunk_kv():
    shape = AttentionShape(num_q_heads=32, num_kv_heads=4, head_dim=128)  # group 8
    # shard [16, 32) with M = 4: chunks of 4 q heads; KV heads 2, 2, 3, 3
    assert chunk_kv_heads(shape, 16, 32, 4) == [(2, 3), (2, 3), (3, 4), (3, 4)]
    # each KV head is sent once, with the first chunk that reads it
    assert chunk_kv_sends(shape, 16, 32, 4) == [(2, 3), (3, 3), (3, 4), (4, 4)]
    # wide shards split KV evenly: 32 q / 16 kv heads, shard of 16 q heads, M = 4 -> 2 KV heads each
    shape16 = AttentionShape(num_q_heads=32, num_kv_heads=16, head_dim=128)
    assert chunk_kv_sends(shape16, 0, 16, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
