"""WLB-LLM planner: repacking rules, per-document CP sharding, sample multiset, outlier queue."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.registry import get_planner
from baselines.wlbllm import (
    WlbLlmConfig,
    bucket_workload,
    cut_documents,
    per_document_shards,
    rejoin_samples,
    window_documents,
    wlb_pack,
)
from libra.config import ParallelConfig
from libra.data.packing import PackedSequence, pack_fixed_tokens
from libra.plan import KV
from libra.workload import AttentionShape, packed_flops


def make_window(gbs: int, seq_len: int, seed: int, long_frac: float = 0.01) -> list[PackedSequence]:
    """Long-tailed lengths (lognormal body + samples longer than S that get split), fixed-token packed."""
    rng = np.random.default_rng(seed)
    n = 40 * gbs
    lens = np.maximum(1, rng.lognormal(np.log(seq_len / 16), 1.3, n)).astype(np.int64)
    lens[rng.random(n) < long_frac] = int(1.7 * seq_len)
    seqs = pack_fixed_tokens(lens, seq_len, policy="split")[:gbs]   # split pieces to rejoin
    return [PackedSequence(j, s.sample_lengths, s.sample_ids) for j, s in enumerate(seqs)]


# ---------------------------------------------------------------------------------------------
# pure functions
# ---------------------------------------------------------------------------------------------


def test_rejoin_merges_pieces_of_split_samples():
    window = [PackedSequence(0, [5, 3], [0, 1]), PackedSequence(1, [8], [1]), PackedSequence(2, [2, 6], [1, 2])]
    assert rejoin_samples(window).tolist() == [5, 13, 6]


def test_documents_per_rejoin_mode():
    # sample 1 (3 + 8 + 2 = 13 tokens) spans three sequences of S = 8
    window = [PackedSequence(0, [5, 3], [0, 1]), PackedSequence(1, [8], [1]), PackedSequence(2, [2, 6], [1, 2])]
    assert window_documents(window, "none", 8).tolist() == [5, 3, 8, 2, 6]
    assert window_documents(window, "full", 8).tolist() == [5, 13, 6]
    assert window_documents(window, "context", 8).tolist() == [5, 8, 5, 6]     # 13 -> 8 + 5: never above S
    assert cut_documents([16, 17, 3], 8).tolist() == [8, 8, 8, 8, 1, 3]
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        cut_documents([3], 0)


def test_pack_hand_computed_case():
    # lengths 10, 6, 5, 4, 3 into 2 buckets, bp=100 (integer workload l^2 + 100 l), Lmax = 1.5 * 14 = 21:
    # 10 -> b0 (tie: lowest index), 6 -> b1, 5 -> b1 (636 < 1100), 4 -> b0 (1100 < 1161), 3 -> b1.
    buckets = wlb_pack([10, 6, 5, 4, 3], 2, bp=100, alpha=1.5)
    assert [b.tolist() for b in buckets] == [[0, 3], [1, 2, 4]]


def test_pack_sets_aside_samples_that_fit_nowhere():
    # Lmax = 1.0 * 20 / 2 = 10: 9 -> b0, 9 -> b1; 2 overflows both -> set aside, then goes to the
    # least-workload bucket regardless (tie -> b0).
    buckets = wlb_pack([9, 9, 2], 2, bp=1, alpha=1.0)
    assert [b.tolist() for b in buckets] == [[0, 2], [1]]
    # a sample longer than Lmax = 9.5 is placed last: 3 -> b0, 3 -> b1, 1 -> b0, then 12 -> b1
    # (least workload 12 < 14)
    b = wlb_pack([12, 3, 3, 1], 2, bp=1, alpha=1.0)
    assert [x.tolist() for x in b] == [[1, 3], [2, 0]]


def test_pack_second_choice_is_least_tokens_bucket():
    # bp huge -> workload ~ linear in tokens; craft one where least-workload != least-tokens:
    # with bp=1 workload ~ l^2: b0 = [6] (w 42, 6 tok), b1 = [4, 4] (w 40, 8 tok)
    # next sample 3: least workload is b1 (8+3=11 > Lmax=10.5 at alpha 1.0? total 17 / 2 = 8.5)
    buckets = wlb_pack([6, 4, 4, 3], 2, bp=1, alpha=1.25)      # Lmax = 1.25 * 17 / 2 = 10.625
    # 6 -> b0; 4 -> b1; 4 -> b1 (w 20 < 42, 8 <= 10.6); 3 -> least workload b1 (w 40 < 42) but 11 > 10.6,
    # so least tokens b0 (6 + 3 = 9 fits)
    assert [x.tolist() for x in buckets] == [[0, 3], [1, 2]]


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=60), n=st.integers(1, 9),
       alpha=st.floats(1.0, 3.0))
def test_pack_is_a_partition(lengths, n, alpha):
    buckets = wlb_pack(lengths, n, bp=1024, alpha=alpha)
    assert len(buckets) == n
    assert sorted(np.concatenate(buckets).tolist()) == list(range(len(lengths)))


def test_bucket_workload_formula():
    assert bucket_workload([2, 4], 2) == pytest.approx((1 + 1) + (4 + 2))


@pytest.mark.parametrize("lengths,cp", [([16], 2), ([17, 5, 1, 40], 2), ([3, 3, 3], 4), ([1000, 7, 129], 8)])
def test_shards_partition_documents_in_zigzag(lengths, cp):
    start, end, rank = per_document_shards(lengths, cp)
    total = sum(lengths)
    assert start[0] == 0 and end[-1] == total and np.all(start[1:] == end[:-1]) and np.all(end > start)
    # per rank token counts within 2 tokens (each rank owns two chunk indices, each within 1 token)
    per_rank = np.bincount(rank, weights=end - start, minlength=cp)
    assert per_rank.max() - per_rank.min() <= 2
    # chunk c of a document goes to rank c (c < CP) or 2CP-1-c
    offs = np.concatenate(([0], np.cumsum(lengths)))
    for j, length in enumerate(lengths):
        inside = (start >= offs[j]) & (end <= offs[j + 1])
        ranks = rank[inside]
        if length >= 2 * cp:
            assert ranks.tolist() == list(range(cp)) + list(range(cp - 1, -1, -1))


def test_shards_hand_computed_remainders():
    # CP=2 -> 4 chunks. doc 6: base 1, rem 2 -> chunks 0,1 get +1 -> [2,2,1,1]; pointer -> 2.
    # doc 3: base 0, rem 3 -> chunks 2,3,0 get +1 -> [1,0,1,1] (empty chunk 1 dropped).
    start, end, rank = per_document_shards([6, 3], 2)
    assert (end - start).tolist() == [2, 2, 1, 1, 1, 1, 1]
    assert rank.tolist() == [0, 1, 1, 0, 0, 1, 0]


def test_shard_errors():
    with pytest.raises(ValueError, match="CP must be >= 1"):
        per_document_shards([4], 0)
    with pytest.raises(ValueError, match="positive"):
        per_document_shards([4, 0], 2)


# ---------------------------------------------------------------------------------------------
# planner
# ---------------------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), dp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2, 4]),
       ga=st.integers(1, 3))
def test_plans_validate_and_keep_the_sample_multiset(seed, dp, cp, ga):
    shape = AttentionShape(8, 2, 8)
    par = ParallelConfig(dp=dp, cp=cp, gbs=dp * ga, seq_len=512)
    window = make_window(par.gbs, 512, seed)
    planner = get_planner("wlb-llm")
    plans = planner.plan_window(window, par, shape)
    assert len(plans) == ga
    samples = window_documents(window, "context", par.seq_len)
    assert samples.sum() == par.gbs * par.seq_len and samples.max() <= par.seq_len
    ids = {int(i) for s in window for i in s.sample_ids}
    assert len(samples) >= len(ids)                                   # every sample kept (maybe cut)
    got, flops = [], 0.0
    for plan in plans:
        plan.validate()
        assert plan.pipeline_chunks == 1 and plan.meta["bp"] == 128 * 1024
        for d, pool in enumerate(plan.pools):
            group = set(range(d * cp, (d + 1) * cp))
            assert set(pool.workers) == group
            assert np.all(pool.tiles.dest == pool.tiles.q_home)          # computed where it lives
            assert set(pool.transfers.kind) <= {KV}                       # KV only: no Q/O moves
            assert set(pool.transfers.src) | set(pool.transfers.dst) <= group
            for seq in pool.sequences:
                got.extend(seq.sample_lengths.tolist())
                flops += packed_flops(seq.sample_lengths, shape)
            assert pool.tiles.flops.sum() == pytest.approx(sum(packed_flops(s.sample_lengths, shape)
                                                               for s in pool.sequences))
    assert sorted(got) == sorted(samples.tolist())
    assert flops == pytest.approx(packed_flops(samples, shape))
    assert [p.digest() for p in plans] == [p.digest() for p in get_planner("wlb-llm").plan_window(window, par, shape)]


def test_bucket_token_counts_need_not_divide_cp():
    shape = AttentionShape(4, 2, 8)
    window = [PackedSequence(0, [37, 12], [0, 1]), PackedSequence(1, [49], [2])]
    par = ParallelConfig(dp=2, cp=4, gbs=2, seq_len=49)
    plans = get_planner("wlb-llm", alpha=1.0).plan_window(window, par, shape)
    tokens = [seq.num_tokens for pool in plans[0].pools for seq in pool.sequences]
    assert sorted(tokens) == [49, 49] and all(t % 4 for t in tokens)
    plans[0].validate()


def test_fewer_samples_than_buckets_leaves_idle_pools():
    shape = AttentionShape(4, 2, 8)
    window = [PackedSequence(0, [64], [0]), PackedSequence(1, [64], [0])]   # one sample split in two
    par = ParallelConfig(dp=2, cp=2, gbs=2, seq_len=64)
    (plan,) = get_planner("wlb-llm", rejoin="full").plan_window(window, par, shape)
    sizes = [len(pool.sequences) for pool in plan.pools]
    assert sizes == [1, 0]
    assert plan.pools[0].sequences[0].sample_lengths.tolist() == [128]
    plan.validate()
    # default: the rejoined 128-token sample is longer than S = 64, so it trains as two S-token documents
    (ctx,) = get_planner("wlb-llm").plan_window(window, par, shape)
    assert [s.sample_lengths.tolist() for p in ctx.pools for s in p.sequences] == [[64], [64]]
    ctx.validate()


def test_outlier_queue_changes_the_multiset_and_is_off_by_default():
    shape = AttentionShape(4, 2, 8)
    par = ParallelConfig(dp=2, cp=2, gbs=4, seq_len=256)
    window = [PackedSequence(0, [200, 56], [0, 1]), PackedSequence(1, [100, 156], [2, 3]),
              PackedSequence(2, [50, 206], [4, 5]), PackedSequence(3, [120, 136], [6, 7])]
    everything = [50, 56, 100, 120, 136, 156, 200, 206]
    default = get_planner("wlb-llm")
    assert sorted(np.concatenate(default.buckets(window, par)).tolist()) == everything
    assert sorted(np.concatenate(default.buckets(window, par)).tolist()) == everything   # stateless
    delayed = get_planner("wlb-llm", outlier_threshold=150)
    first = np.concatenate(delayed.buckets(window, par)).tolist()
    assert sorted(first) == [50, 56, 100, 120, 136]          # 200, 156, 206 held back (3 < GBS)
    second = np.concatenate(delayed.buckets(window, par)).tolist()
    # queue 6 >= GBS=4: the 4 oldest (200, 156, 206, 200) are released into this step
    assert sorted(second) == sorted([50, 56, 100, 120, 136, 200, 156, 206, 200])
    delayed.reset()
    plans = delayed.plan_window(window, par, shape)
    assert sum(s.num_tokens for p in plans for pool in [p] for q in pool.pools for s in q.sequences) == 462
    for plan in plans:
        plan.validate()


@pytest.mark.parametrize("opts,match", [({"bp": 0}, "bp must be a positive integer"),
                                        ({"alpha": 0.5}, "alpha must be a number >= 1"),
                                        ({"outlier_threshold": 0}, "outlier_threshold"),
                                        ({"rejoin": "some"}, "rejoin must be one of")])
def test_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        WlbLlmConfig(**opts)
    with pytest.raises(ValueError, match=match):
        get_planner("wlb-llm", **opts)


def test_window_size_mismatch():
    par = ParallelConfig(dp=2, cp=2, gbs=4, seq_len=64)
    with pytest.raises(ValueError, match="expected GBS=4"):
        get_planner("wlb-llm").plan_window(make_window(2, 64, 0), par, AttentionShape(4, 2, 8))
