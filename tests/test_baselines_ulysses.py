"""Ulysses planner: head-sharded tiles, all-to-all volume equal to the closed form, no cross-group work."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.registry import get_planner
from baselines.ulysses import ulysses_tiles
from libra.config import ParallelConfig
from libra.data.packing import PackedSequence, pack_fixed_tokens
from libra.plan import KV, O, Q, SequenceLayout
from libra.workload import AttentionShape, packed_flops


def make_window(gbs: int, seq_len: int, seed: int) -> list[PackedSequence]:
    """Long-tailed lengths (lognormal body + a few samples longer than S), fixed-token packed."""
    rng = np.random.default_rng(seed)
    n = 40 * gbs
    lens = np.maximum(1, rng.lognormal(np.log(seq_len / 16), 1.3, n)).astype(np.int64)
    lens[rng.random(n) < 0.01] = int(1.7 * seq_len)
    seqs = pack_fixed_tokens(lens, seq_len)[:gbs]
    assert len(seqs) == gbs
    return [PackedSequence(j, s.sample_lengths, s.sample_ids) for j, s in enumerate(seqs)]


def closed_form_bytes(seq_len: int, cp: int, shape: AttentionShape) -> dict[str, int]:
    """Ulysses all-to-all volume of one CP group (forward).

    Q (and O): every rank keeps 1/CP of its tokens for its own head shard and sends the rest,
    ``S (CP-1)/CP * hq * d * bytes``. K/V: every rank receives the other ranks' ``S (CP-1)/CP``
    tokens for the KV heads its ``hq/CP`` query heads read: ``hkv/CP`` heads when CP divides hkv,
    one (replicated) head when hkv < CP.
    """
    d, b = shape.head_dim, shape.dtype_bytes
    moved = seq_len * (cp - 1) // cp
    kv_heads = shape.num_kv_heads // cp if shape.num_kv_heads >= cp else 1
    return {"q": moved * shape.num_q_heads * d * b, "o": moved * shape.num_q_heads * d * b,
            "kv": cp * moved * kv_heads * d * b * 2}


@pytest.mark.parametrize("cp,hq,hkv", [(4, 8, 8), (4, 8, 4), (4, 8, 2), (8, 32, 4), (2, 4, 1), (8, 16, 16)])
def test_bytes_match_closed_form_all_to_all(cp, hq, hkv):
    shape = AttentionShape(hq, hkv, 16)
    par = ParallelConfig(dp=2, cp=cp, gbs=2, seq_len=512)
    plans = get_planner("ulysses").plan_window(make_window(2, 512, seed=cp + hkv), par, shape)
    want = closed_form_bytes(512, cp, shape)
    for plan in plans:
        plan.validate()
        for pool in plan.pools:
            assert pool.transfers.bytes_by_kind() == want
            # backward volume equals forward volume (derived, never planned)
            assert pool.transfers.backward().nbytes.sum() == pool.transfers.nbytes.sum()


def test_tiles_shard_heads_over_the_cp_group():
    shape = AttentionShape(8, 2, 16)
    seq = SequenceLayout.contiguous(0, 1, [100, 300, 112], 4)      # 512 tokens on workers 4..7
    tiles = ulysses_tiles(seq, 4, shape)
    assert len(tiles) == 16
    # every worker computes exactly hq/CP heads of every token
    for r in range(4):
        mine = tiles.dest == 4 + r
        assert set(tiles.head_start[mine]) == {2 * r} and set(tiles.head_end[mine]) == {2 * r + 2}
        assert tiles.q_end[mine].sum() - tiles.q_start[mine].sum() == 512
    assert tiles.flops.sum() == pytest.approx(packed_flops([100, 300, 112], shape))
    # every Q-home keeps its own shard: a quarter of the tiles is local
    assert int((tiles.dest == tiles.q_home).sum()) == 4


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), dp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2, 4]),
       ga=st.integers(1, 2))
def test_plans_validate_and_stay_inside_cp_groups(seed, dp, cp, ga):
    shape = AttentionShape(8, 2, 8)
    par = ParallelConfig(dp=dp, cp=cp, gbs=dp * ga, seq_len=256)
    window = make_window(par.gbs, 256, seed)
    plans = get_planner("ulysses").plan_window(window, par, shape)
    assert [p.ga_index for p in plans] == list(range(ga))
    total = 0.0
    for plan in plans:
        plan.validate()
        assert plan.pipeline_chunks == 1 and len(plan.pools) == dp
        for d, pool in enumerate(plan.pools):
            group = set(range(d * cp, (d + 1) * cp))
            assert set(pool.workers) == group
            assert set(pool.tiles.dest) <= group and set(pool.tiles.q_home) <= group
            t = pool.transfers
            assert set(t.src) <= group and set(t.dst) <= group, "no transfer leaves the CP group"
            assert np.all(t.src != t.dst)
            assert pool.sequences[0].seq_id == plan.ga_index * dp + d   # production order
            total += pool.tiles.flops.sum()
    assert total == pytest.approx(sum(packed_flops(s.sample_lengths, shape) for s in window))
    again = get_planner("ulysses").plan_window(window, par, shape)
    assert [p.digest() for p in plans] == [p.digest() for p in again]


def test_kinds_have_expected_directions():
    shape = AttentionShape(4, 4, 8)
    par = ParallelConfig(dp=1, cp=2, gbs=1, seq_len=64)
    (plan,) = get_planner("ulysses").plan_window(make_window(1, 64, 3), par, shape)
    t = plan.pools[0].transfers
    # worker 0 holds tokens [0, 32) and computes heads [0, 2): it sends heads [2, 4) of its tokens
    q01 = (t.kind == Q) & (t.src == 0)
    assert t.head_start[q01].tolist() == [2] and t.tok_end[q01].tolist() == [32]
    assert int((t.kind == O).sum()) == int((t.kind == Q).sum())
    assert int((t.kind == KV).sum()) >= 2


def test_cp_not_dividing_query_heads_is_an_error():
    par = ParallelConfig(dp=1, cp=4, gbs=1, seq_len=64)
    with pytest.raises(ValueError, match="CP=4 to divide num_q_heads=6"):
        get_planner("ulysses").plan_window(make_window(1, 64, 0), par, AttentionShape(6, 2, 8))


def test_window_mismatch_is_an_error():
    par = ParallelConfig(dp=2, cp=2, gbs=4, seq_len=64)
    shape = AttentionShape(4, 2, 8)
    with pytest.raises(ValueError, match="expected GBS=4"):
        get_planner("ulysses").plan_window(make_window(2, 64, 0), par, shape)
    with pytest.raises(ValueError, match="expected S=128"):
        get_planner("ulysses").plan_window(make_window(4, 64, 0), ParallelConfig(2, 2, 4, 128), shape)


@pytest.mark.parametrize("hq,hkv,cp", [(12, 3, 2), (24, 6, 4), (6, 3, 2), (6, 2, 3)])
def test_head_shards_cutting_gqa_groups_fetch_exactly_the_kv_heads_they_read(hq, hkv, cp):
    """A shard that starts or ends inside a GQA group is planned; it fetches kv_head_range's heads."""
    shape = AttentionShape(hq, hkv, 8)
    par = ParallelConfig(dp=1, cp=cp, gbs=1, seq_len=24 * cp)
    (plan,) = get_planner("ulysses").plan_window(make_window(1, 24 * cp, 5), par, shape)
    plan.validate()
    t, qh = plan.pools[0].transfers, hq // cp
    for r in range(cp):
        kv = (t.kind == KV) & (t.dst == r)
        assert int(kv.sum()) == cp - 1
        want = shape.kv_head_range(r * qh, (r + 1) * qh)
        assert set(zip(t.head_start[kv].tolist(), t.head_end[kv].tolist())) == {want}
