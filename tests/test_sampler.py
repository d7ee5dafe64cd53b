"""LibraSampler: packing, VRSP pools, GA x DP mapping, multiset preservation, resume, errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.sampler import LibraSampler, SamplePiece, pack_stream
from libra.vrsp import microbatch_groups
from libra.vrsp import vrsp as vrsp_pools
from libra.workload import packed_workload


def _lengths(n=400, seed=0, hi=3000):
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(5.5, 1.3, size=n).astype(np.int64) + 1, hi)


def _token_multiset(pieces):
    """(sample, token) pairs as a Counter: what a step trains on."""
    c = Counter()
    for p in pieces:
        for t in range(p.start, p.stop):
            c[(p.index, t)] += 1
    return c


@pytest.mark.parametrize("policy", ["defer", "split"])
def test_every_step_preserves_its_sample_multiset_and_each_ga_index_holds_vrsp_pools(policy):
    s = LibraSampler(_lengths(), seq_len=512, gbs=16, dp=8, pool_size=4, seed=3, policy=policy)
    assert s.steps_per_epoch > 2
    for k in range(s.steps_per_epoch):
        a = s.step(k)
        stream = s.step_pieces(k)
        assert all(sum(p.length for p in seq) == 512 for seq in a.sequences)
        packed = [p for seq in a.sequences for p in seq]
        assert _token_multiset(packed) == _token_multiset(stream)
        # what the DP ranks receive over the GA window is exactly the step's sequences
        got = sorted(int(x) for x in a.groups.ravel())
        assert got == list(range(16))
        # each GA index consists of whole VRSP pools: ranks [j*P, (j+1)*P) form pool rows
        pools = {tuple(sorted(r)) for r in a.pools.tolist()}
        for g in range(a.groups.shape[0]):
            for j in range(8 // 4):
                assert tuple(sorted(a.groups[g, j * 4:(j + 1) * 4].tolist())) in pools


def test_iteration_yields_each_ranks_sequences_in_ga_order_and_union_is_the_epoch():
    lengths = _lengths(300, seed=1)
    samplers = [LibraSampler(lengths, 256, gbs=8, dp=4, pool_size=2, dp_rank=r, seed=7) for r in range(4)]
    per_rank = [list(s) for s in samplers]
    steps = samplers[0].steps_per_epoch
    assert all(len(b) == steps * 2 for b in per_rank)
    for k in range(steps):
        a = samplers[0].step(k, epoch=0)
        for r in range(4):
            for g in range(2):
                assert tuple(per_rank[r][k * 2 + g]) == a.sequences[int(a.groups[g, r])]
    # the epoch covers the token stream prefix of steps * GBS * S tokens, no token twice
    all_tokens = _token_multiset([p for b in per_rank for seq in b for p in seq])
    assert sum(all_tokens.values()) == steps * 8 * 256
    assert max(all_tokens.values()) == 1
    # epoch advanced; a new epoch is a different permutation, same seed+epoch is identical
    assert samplers[0].epoch == 1
    again = LibraSampler(lengths, 256, gbs=8, dp=4, pool_size=2, dp_rank=0, seed=7)
    assert [tuple(b) for b in again] == [tuple(b) for b in per_rank[0]]
    nxt = [tuple(b) for b in samplers[0]]
    assert nxt != [tuple(b) for b in per_rank[0]]


def test_vrsp_balances_better_than_arrival_order():
    lengths = _lengths(3000, seed=2, hi=20000)
    on = LibraSampler(lengths, 4096, gbs=32, dp=8, pool_size=4, seed=0)
    off = LibraSampler(lengths, 4096, gbs=32, dp=8, pool_size=4, seed=0, use_vrsp=False)

    def imbalance(a):
        w = np.array([packed_workload([p.length for p in s]) for s in a.sequences])
        loads = w[a.pools].sum(axis=1)
        return loads.max() / loads.mean() - 1

    r_on = [imbalance(on.step(k)) for k in range(on.steps_per_epoch)]
    r_off = [imbalance(off.step(k)) for k in range(off.steps_per_epoch)]
    assert np.mean(r_on) < 0.5 * np.mean(r_off)
    # same sequences either way: VRSP only regroups
    assert on.step(0).sequences == off.step(0).sequences


def test_resume_from_state_dict_mid_step_and_mid_epoch():
    lengths = _lengths(500, seed=4)
    full = [tuple(b) for b in LibraSampler(lengths, 256, gbs=8, dp=2, pool_size=2, dp_rank=1, seed=5)]
    s = LibraSampler(lengths, 256, gbs=8, dp=2, pool_size=2, dp_rank=1, seed=5)
    it = iter(s)
    head = [tuple(next(it)) for _ in range(7)]  # GA = 4: stops in the middle of step 1
    state = s.state_dict()
    t = LibraSampler(lengths, 256, gbs=8, dp=2, pool_size=2, dp_rank=1, seed=5)
    t.load_state_dict(state)
    assert head + [tuple(b) for b in t] == full
    with pytest.raises(ValueError, match="seed"):
        LibraSampler(lengths, 256, gbs=8, dp=2, pool_size=2, dp_rank=1, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="next_micro"):
        t.load_state_dict({**state, "next_micro": 10**6})


def test_metadata_for_the_planner_matches_what_ranks_receive():
    s = LibraSampler(_lengths(), 512, gbs=8, dp=4, pool_size=4, seed=0)
    a = s.step(1)
    for g in range(2):
        lens = a.group_lengths(g)
        assert len(lens) == 4
        for r in range(4):
            assert lens[r].tolist() == [p.length for p in a.rank_sequences(r)[g]]
            assert lens[r].sum() == 512


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=40), st.integers(1, 8))
def test_vrsp_pools_exact_cardinality_and_lpt_bound(ws, p):
    d = len(ws) - len(ws) % p
    if d == 0:
        return
    w = np.array(ws[:d])
    pools = vrsp_pools(w, p)
    assert pools.shape == (d // p, p)
    assert sorted(pools.ravel().tolist()) == list(range(d))
    loads = w[pools].sum(axis=1)
    # greedy LPT with cardinality: max load <= mean + heaviest item
    assert loads.max() <= loads.mean() + w.max() + 1e-6
    assert np.array_equal(pools, vrsp_pools(w, p))  # deterministic


def test_microbatch_groups_layout():
    pools = np.arange(16).reshape(4, 4)
    g = microbatch_groups(pools, dp=8)
    assert g.shape == (2, 8)
    assert g[0].tolist() == list(range(8)) and g[1].tolist() == list(range(8, 16))
    with pytest.raises(ValueError, match="P=4 must divide DP=6"):
        microbatch_groups(pools, dp=6)


def test_pack_stream_splits_and_rejects_ragged_total():
    out = pack_stream([SamplePiece(0, 0, 5), SamplePiece(1, 0, 7)], 4)
    assert [[tuple(p) for p in s] for s in out] == [[(0, 0, 4)], [(0, 4, 5), (1, 0, 3)], [(1, 3, 7)]]
    # first-fit: the 3-token sample waits while the 1-token one fills the room
    out = pack_stream([SamplePiece(0, 0, 3), SamplePiece(1, 0, 3), SamplePiece(2, 0, 1), SamplePiece(3, 0, 1)], 4,
                      policy="defer")
    assert [[tuple(p) for p in s] for s in out] == [[(0, 0, 3), (2, 0, 1)], [(1, 0, 3), (3, 0, 1)]]
    with pytest.raises(ValueError, match="must be 'split' or 'defer'"):
        pack_stream([SamplePiece(0, 0, 4)], 4, policy="truncate")
    with pytest.raises(ValueError, match="not a multiple of S=4"):
        pack_stream([SamplePiece(0, 0, 5)], 4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gbs=10, dp=4), "DP=4 must divide GBS=10"),
    (dict(gbs=8, dp=4, pool_size=3), "P=3 must divide DP=4"),
    (dict(dp_rank=4, dp=4), "dp_rank=4"),
    (dict(seq_len=0), "seq_len must be a positive integer, got 0"),
    (dict(seq_len=10**9), "fewer than one step"),
])
def test_bad_configuration_raises_clear_errors(kwargs, match):
    base = dict(seq_len=256, gbs=8, dp=4, pool_size=1, dp_rank=0)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        LibraSampler(_lengths(), **base)


@pytest.mark.parametrize("lengths, match", [
    ([], "non-empty"), ([5, 0, 3], "sample 1 has length 0"), ([5, 2.5], "must be integers, got 2.5"),
])
def test_bad_lengths_raise(lengths, match):
    with pytest.raises(ValueError, match=match):
        LibraSampler(np.array(lengths), seq_len=2, gbs=1, dp=1)


def test_step_and_epoch_out_of_range():
    s = LibraSampler(_lengths(), 512, gbs=8, dp=4)
    with pytest.raises(ValueError, match="step=999"):
        s.step(999)
    with pytest.raises(ValueError, match="epoch must be a non-negative integer, got -1"):
        s.set_epoch(-1)


def test_long_sample_policies():
    lengths = np.array([10, 3, 2, 9, 4, 4])
    split = LibraSampler(lengths, 4, gbs=2, dp=1, shuffle=False, policy="split")
    assert [tuple(p) for p in split.step(0).sequences[0]] == [(0, 0, 4)]
    assert split.steps_per_epoch == 4  # 32 tokens / 8 per step
    trunc = LibraSampler(lengths, 4, gbs=2, dp=1, shuffle=False, policy="truncate")
    a = trunc.step(0)
    assert [tuple(p) for s in a.sequences for p in s] == [(0, 0, 4), (1, 0, 3), (2, 0, 1)]
    assert all(p.stop <= 4 for k in range(trunc.steps_per_epoch) for s in trunc.step(k).sequences for p in s)
    with pytest.raises(ValueError, match="sample 0 has 10 tokens, longer than S=4"):
        LibraSampler(lengths, 4, gbs=2, dp=1, policy="error")
    with pytest.raises(ValueError, match="unknown packing policy 'drop'"):
        LibraSampler(lengths, 4, gbs=2, dp=1, policy="drop")


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=5, max_size=80), st.sampled_from([16, 32, 64]),
       st.sampled_from([(2, 1, 1), (4, 2, 2), (4, 4, 2), (8, 4, 4)]), st.sampled_from(["defer", "split"]),
       st.integers(0, 3))
def test_property_steps_keep_their_tokens_and_fill_every_sequence(lengths, seq_len, layout, policy, seed):
    gbs, dp, p = layout
    lengths = np.array(lengths)
    if lengths.sum() < gbs * seq_len:
        return
    s = LibraSampler(lengths, seq_len, gbs, dp, pool_size=p, seed=seed, policy=policy)
    for k in range(s.steps_per_epoch):
        a = s.step(k)
        assert len(a.sequences) == gbs and all(sum(x.length for x in q) == seq_len for q in a.sequences)
        assert _token_multiset([x for q in a.sequences for x in q]) == _token_multiset(s.step_pieces(k))
        assert sorted(a.groups.ravel().tolist()) == list(range(gbs))


def test_works_as_a_torch_dataloader_batch_sampler():
    torch = pytest.importorskip("torch")

    class Tokens:
        def __getitem__(self, piece):
            return torch.full((piece.length,), piece.index)

    lengths = _lengths(200, seed=9)
    s = LibraSampler(lengths, 256, gbs=4, dp=2, pool_size=2, dp_rank=1, seed=1)
    loader = torch.utils.data.DataLoader(Tokens(), batch_sampler=s, collate_fn=torch.cat)
    got = [b for b in loader]
    assert len(got) == len(s) and all(b.shape == (256,) for b in got)
    first = s.step(0, epoch=0).rank_sequences(1)[0]
    assert got[0].tolist() == [p.index for p in first for _ in range(p.length)]
