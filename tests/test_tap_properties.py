"""Property tests of TAP plans (plan_pool) over random long-tailed pools, plus layout errors."""

from __future__ import annotations

import gzip
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tap_strategies import pools

from libra.config import ParallelConfig, TapConfig, check_layout
from libra.plan import KV, O, Plan, PoolPlan, Q, SequenceLayout, TileTable, pool_index
from libra.tap import plan_pool
from libra.tap.placement import PlacementPolicy, place_tiles
from libra.tap.tiles import PoolTiles, make_tiles
from libra.workload import AttentionShape, packed_flops


def _plan(pool_plan: PoolPlan, shape, cp) -> Plan:
    return Plan(method="libra-tap", ga_index=0, shape=shape, cp=cp, pipeline_chunks=1, pools=(pool_plan,),
                meta={"test": True})


@settings(max_examples=80, deadline=None)
@given(pools(), st.sampled_from([0.0, 0.03, 0.5]), st.booleans())
def test_plan_pool_invariants(pool, tau, comm_aware):
    sequences, workers, block, head_split, shape = pool
    tap = TapConfig(pool_size=len(sequences), block_size=block, head_split=head_split, tau=tau,
                    pipeline_chunks=1, comm_aware=comm_aware)
    pp = plan_pool(3, sequences, workers, tap, shape)
    plan = _plan(pp, shape, len(sequences[0].holder_start)).validate()  # every invariant of libra.plan.checks
    # tile FLOPs sum to the packed sequences' FLOPs
    total = sum(packed_flops(s.sample_lengths, shape) for s in sequences)
    assert np.isclose(pp.tiles.flops.sum(), total, rtol=1e-12)
    # backward moves exactly the forward volume, each KV path reversed
    fwd, bwd = pp.transfers, pp.transfers.backward()
    assert bwd.bytes_by_kind() == fwd.bytes_by_kind()
    kv = fwd.kind == KV
    assert np.array_equal(bwd.src[kv], fwd.dst[kv]) and np.array_equal(bwd.dst[kv], fwd.src[kv])
    by = fwd.bytes_by_kind()
    assert by["q"] == by["o"]
    assert np.all(fwd.src != fwd.dst)
    # loads stay within C unless the fallback fired
    cap = (1 + tau) * total / len(workers)
    if pp.fallback_tiles == 0:
        assert pp.worker_flops().max() <= cap * (1 + 1e-12)
    # every tile computed away from home has its Q and its O on the wire
    away = pp.tiles.dest != pp.tiles.q_home
    assert (by["q"] > 0) == bool(away.any())
    # same input, same plan; JSON round trip keeps the digest
    again = _plan(plan_pool(3, sequences, workers, tap, shape), shape, len(sequences[0].holder_start))
    assert again.digest() == plan.digest()
    back = Plan.from_json(plan.to_json())
    assert back.digest() == plan.digest()
    back.validate()


def _realistic_pool(workloads_dir, seq_len, cp, p, seed):
    lengths = np.loadtxt(gzip.open(workloads_dir / "flexsp_wikipedia.txt.gz"), dtype=np.int64, max_rows=200_000)
    rng = np.random.default_rng(seed)
    stream = rng.permutation(lengths)
    seqs, cur, fill = [], [], 0
    for n in stream.tolist():  # fixed-token packing, a sample crossing a boundary is cut
        while n and len(seqs) < p:
            take = min(n, seq_len - fill)
            cur.append(take)
            fill += take
            n -= take
            if fill == seq_len:
                seqs.append(SequenceLayout.contiguous(len(seqs), len(seqs), cur, cp))
                cur, fill = [], 0
        if len(seqs) == p:
            break
    return seqs


def test_realistic_256k_pool_balances_and_beats_flops_only(workloads_dir):
    """Paper setting 6.3 at 256K (CP 8, P 8, B 4096, H 2; 32 q / 4 kv heads): public Wikipedia
    lengths (the closest public stand-in for the paper's corpus)."""
    shape = AttentionShape(32, 4, 128, 2)
    seqs = _realistic_pool(workloads_dir, 262144, 8, 8, seed=0)
    tap = TapConfig(pool_size=8, block_size=4096, head_split=2, tau=0.03, pipeline_chunks=4)
    pp = plan_pool(0, seqs, range(64), tap, shape)
    _plan(pp, shape, 8).validate()
    loads = pp.worker_flops()
    assert pp.fallback_tiles > 0 or loads.max() / loads.mean() <= 1.03 + 1e-12
    distca_like = plan_pool(0, seqs, range(64), TapConfig(pool_size=8, block_size=4096, head_split=2,
                                                          comm_aware=False), shape)
    assert pp.transfers.nbytes.sum() < distca_like.transfers.nbytes.sum()


# --------------------------------------------------------------------------------------------
# bad input: each a clear ValueError naming the value
# --------------------------------------------------------------------------------------------


def _seqs(cp=2, total=16):
    return [SequenceLayout.contiguous(0, 0, [total], cp)]


def test_block_not_dividing_tokens_per_rank():
    shape = AttentionShape(4, 2, 8, 2)
    with pytest.raises(ValueError, match=r"block size B=3 must divide S/CP=8"):
        plan_pool(0, _seqs(), [0, 1], TapConfig(pool_size=1, block_size=3, head_split=1, pipeline_chunks=1), shape)


def test_head_split_not_dividing_heads():
    shape = AttentionShape(6, 2, 8, 2)
    with pytest.raises(ValueError, match=r"head split H=4 must divide num_q_heads=6"):
        plan_pool(0, _seqs(), [0, 1], TapConfig(pool_size=1, block_size=4, head_split=4, pipeline_chunks=1), shape)


def test_chunks_not_dividing_shard_width():
    shape = AttentionShape(32, 4, 8, 2)
    with pytest.raises(ValueError, match=r"Pipeliner chunks M=3 must divide hq/H=16"):
        plan_pool(0, _seqs(), [0, 1], TapConfig(pool_size=1, block_size=4, head_split=2, pipeline_chunks=3), shape)


@pytest.mark.parametrize("tau, why", [(float("inf"), "got inf; it must be finite"), (True, "got True"),
                                      (float("nan"), "got nan"), ("0.1", "got '0.1'")])
def test_tau_is_one_rule_for_the_layout_and_the_placer(tau, why):
    """TapConfig and place_tiles share libra.config.check_tau: a finite number >= 0, not a bool."""
    with pytest.raises(ValueError, match=f"TapConfig.tau must be a number >= 0, {re.escape(why)}"):
        TapConfig(tau=tau)
    seqs, shape = _seqs(), AttentionShape(4, 2, 8, 2)
    tiles = make_tiles(seqs, 4, 1, shape)
    with pytest.raises(ValueError, match=f"^tau must be a number >= 0, {re.escape(why)}"):
        place_tiles(tiles, seqs, [0, 1], shape, tau=tau)


@settings(max_examples=40, deadline=None)
@given(pools(), st.sampled_from([0.0, 0.03]), st.booleans())
def test_pool_tiles_place_as_unchecked_ones(pool, tau, comm_aware):
    """make_tiles' PoolTiles carry their sequences and index, so place_tiles skips their per-tile
    checks; nothing else changes (the same tiles as a plain TileTable, checked one by one, place
    alike), and a Q-home outside the pool is still refused."""
    sequences, workers, block, head_split, shape = pool
    tiles = make_tiles(sequences, block, head_split, shape, index=pool_index(sequences))
    assert isinstance(tiles, PoolTiles) and tiles.made_for(sequences)
    plain_tiles = TileTable(**{k: getattr(tiles, k) for k in TileTable.FIELDS})
    policy = PlacementPolicy(comm_aware=comm_aware)
    made, fb_made = place_tiles(tiles, sequences, workers, shape, tau, policy=policy)
    plain, fb_plain = place_tiles(plain_tiles, sequences, workers, shape, tau, policy=policy)
    assert fb_made == fb_plain and np.array_equal(made.dest, plain.dest)
    assert not tiles.made_for([replace(s) for s in sequences])  # other layout objects: checked again
    with pytest.raises(ValueError, match="is not a pool worker"):
        place_tiles(tiles, sequences, workers[:-1] or [max(workers) + 1], shape, tau=tau)


def test_negative_tau_and_pool_not_dividing_dp():
    with pytest.raises(ValueError, match=r"tau must be a number >= 0, got -0.1"):
        TapConfig(tau=-0.1)
    with pytest.raises(ValueError, match=r"pool size P=4 must divide DP=6"):
        check_layout(ParallelConfig(dp=6, cp=2, gbs=12, seq_len=16), TapConfig(pool_size=4, block_size=4),
                     AttentionShape(32, 4, 8, 2))


def test_bad_tap_argument_and_empty_pool():
    shape = AttentionShape(4, 2, 8, 2)
    with pytest.raises(ValueError, match="TapConfig"):
        plan_pool(0, _seqs(), [0, 1], {"block_size": 4}, shape)
    with pytest.raises(ValueError, match="no sequences"):
        plan_pool(0, [], [0, 1], TapConfig(pool_size=1, block_size=4, head_split=1, pipeline_chunks=1), shape)


def test_kinds_cover_q_and_o_symmetrically():
    shape = AttentionShape(4, 2, 8, 2)
    seqs = [SequenceLayout.contiguous(0, 0, [2, 30], 2), SequenceLayout.contiguous(1, 1, [1] * 32, 2)]
    pp = plan_pool(0, seqs, range(4), TapConfig(pool_size=2, block_size=4, head_split=2, pipeline_chunks=1,
                                                 tau=0.0), shape)
    q, o = pp.transfers.select(pp.transfers.kind == Q), pp.transfers.select(pp.transfers.kind == O)
    assert sorted(zip(q.src, q.dst, q.tok_start)) == sorted(zip(o.dst, o.src, o.tok_start))
    assert len(q) > 0


@pytest.mark.parametrize("seq_len, cp, gbs, block", [(262144, 8, 128, 4096), (1048576, 16, 32, 8192)])
def test_libra_prod_vrsp_pools_meet_target(seq_len, cp, gbs, block):
    """The balance check on every VRSP pool of one ``libra-prod`` window (Libra sec. 6.3 layouts):
    max/mean worker FLOPs <= 1 + tau unless a fallback fired, plans validate, and TAP moves fewer
    bytes than FLOPs-only placement (the DistCA emulation)."""
    from libra.data.windows import gbs_windows, window_workloads
    from libra.vrsp import vrsp

    shape = AttentionShape(32, 4, 128, 2)
    window = gbs_windows("libra-prod", seq_len, gbs, 1, seed=0)[0]
    tap = TapConfig(pool_size=8, block_size=block, head_split=2, tau=0.03, pipeline_chunks=4)
    flops_only = TapConfig(pool_size=8, block_size=block, head_split=2, tau=0.03, pipeline_chunks=4,
                           comm_aware=False)
    for k, members in enumerate(vrsp(window_workloads(window), 8)):
        seqs = [SequenceLayout.contiguous(int(i), j, window[int(i)].sample_lengths, cp)
                for j, i in enumerate(members)]
        pp = plan_pool(k, seqs, range(8 * cp), tap, shape)
        _plan(pp, shape, cp).validate()
        loads = pp.worker_flops()
        assert pp.fallback_tiles > 0 or loads.max() / loads.mean() <= 1.03 + 1e-12
        other = plan_pool(k, seqs, range(8 * cp), flops_only, shape)
        assert pp.transfers.nbytes.sum() < other.transfers.nbytes.sum()
