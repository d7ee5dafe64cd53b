"""Fixed-token packing of sample lengths (libra/data/packing.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.data.packing import PackedSequence, pack_fixed_tokens


def rejoined_before(seqs, upto, sample_id) -> int:
    """Tokens of ``sample_id`` in the sequences up to and including ``upto``."""
    total = 0
    for s in seqs:
        total += int(s.sample_lengths[s.sample_ids == sample_id].sum())
        if s is upto:
            return total
    return total


lengths_st = st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=60)


def test_split_example_by_hand():
    seqs = pack_fixed_tokens([5, 3, 10, 2, 7], 4, policy="split")
    assert [s.sample_lengths.tolist() for s in seqs] == [[4], [1, 3], [4], [4], [2, 2], [4]]
    assert [s.sample_ids.tolist() for s in seqs] == [[0], [0, 1], [2], [2], [2, 3], [4]]
    assert [s.seq_id for s in seqs] == list(range(6))


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(min_value=1, max_value=40))
def test_split_preserves_tokens_and_sample_multiset(lengths, seq_len):
    seqs = pack_fixed_tokens(lengths, seq_len, policy="split")
    total = sum(lengths)
    assert len(seqs) == total // seq_len
    assert all(s.num_tokens == seq_len for s in seqs)
    if not seqs:
        return
    ids = np.concatenate([s.sample_ids for s in seqs])
    pieces = np.concatenate([s.sample_lengths for s in seqs])
    # arrival order: ids never decrease along the stream
    assert np.all(np.diff(ids) >= 0)
    # per sample, the pieces add up to the sample (all but the sample cut by the dropped tail)
    rejoined = np.bincount(ids, weights=pieces, minlength=len(lengths)).astype(int)
    last = int(ids[-1])
    assert rejoined[:last].tolist() == list(lengths[:last])
    assert rejoined[last] <= lengths[last]
    # a sample is cut only at sequence boundaries: at most one piece per sequence, and a sample
    # continuing into the next sequence fills the end of this one and starts the next one
    for a, b in zip(seqs, seqs[1:]):
        assert np.all(np.diff(a.sample_ids) > 0)
        if a.sample_ids[-1] == b.sample_ids[0] and b.sample_ids.size > 1:
            assert b.sample_lengths[0] == lengths[b.sample_ids[0]] - rejoined_before(seqs, a, b.sample_ids[0])


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(min_value=1, max_value=40))
def test_full_stream_when_total_divisible(lengths, seq_len):
    lengths = list(lengths) + [seq_len - sum(lengths) % seq_len] if sum(lengths) % seq_len else list(lengths)
    for policy in ("split", "defer"):
        seqs = pack_fixed_tokens(lengths, seq_len, policy=policy)
        ids = np.concatenate([s.sample_ids for s in seqs])
        pieces = np.concatenate([s.sample_lengths for s in seqs])
        assert np.bincount(ids, weights=pieces).astype(int).tolist() == lengths
    seqs = pack_fixed_tokens(lengths, seq_len, policy="split")
    ids = np.concatenate([s.sample_ids for s in seqs])
    pieces = np.concatenate([s.sample_lengths for s in seqs])
    assert np.bincount(ids, weights=pieces).astype(int).tolist() == lengths
    assert sorted(set(ids.tolist())) == list(range(len(lengths)))


def test_long_sample_split_into_full_sequences():
    seqs = pack_fixed_tokens([10, 2, 3, 1], 4, policy="split")
    assert [s.sample_lengths.tolist() for s in seqs] == [[4], [4], [2, 2], [3, 1]]
    assert seqs[0].workload == 16.0 and seqs[2].workload == 8.0


def test_truncate_policy_keeps_first_s_tokens():
    seqs = pack_fixed_tokens([10, 2, 2], 4, policy="truncate")
    assert [s.sample_lengths.tolist() for s in seqs] == [[4], [2, 2]]
    assert [s.sample_ids.tolist() for s in seqs] == [[0], [1, 2]]


def test_error_policy_names_sample():
    with pytest.raises(ValueError, match="sample 1 has 9 tokens, longer than S=4"):
        pack_fixed_tokens([3, 9], 4, policy="error")
    # boundary-crossing samples are still split under 'error'
    assert [s.sample_lengths.tolist() for s in pack_fixed_tokens([3, 3, 2], 4, policy="error")] == [[3, 1], [2, 2]]


@pytest.mark.parametrize("seq_len", [0, -5, 2.5, "8", True])
def test_bad_seq_len(seq_len):
    with pytest.raises(ValueError, match="sequence length S must be an integer >= 1"):
        pack_fixed_tokens([1, 2], seq_len)


@pytest.mark.parametrize("lengths, match", [([3, 0, 2], "sample 1: length must be a positive integer, got 0"),
                                            ([3, -4], "sample 1"), ([1.5, 2], "sample 0"),
                                            ([[1, 2]], "1-D")])
def test_bad_lengths(lengths, match):
    with pytest.raises(ValueError, match=match):
        pack_fixed_tokens(lengths, 4)


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown packing policy 'pad'"):
        pack_fixed_tokens([1], 4, policy="pad")


def test_packed_sequence_validation():
    with pytest.raises(ValueError, match="equal length"):
        PackedSequence(0, np.array([1, 2]), np.array([0]))
    with pytest.raises(ValueError, match="length >= 1"):
        PackedSequence(0, np.array([0]), np.array([0]))


def test_defer_by_hand():
    # S=10: 4 fits, 8 does not fit the 6 left -> deferred; 3 and 3 fill the room; 8 starts seq 2
    seqs = pack_fixed_tokens([4, 8, 3, 3, 2], 10, policy="defer")
    assert [s.sample_lengths.tolist() for s in seqs] == [[4, 3, 3], [8, 2]]
    assert [s.sample_ids.tolist() for s in seqs] == [[0, 2, 3], [1, 4]]
    # nothing fits the room: the shortest buffered sample is cut; long samples start at a boundary
    seqs = pack_fixed_tokens([7, 25, 6, 9], 10, policy="defer")
    assert [s.sample_lengths.tolist() for s in seqs] == [[7, 3], [10], [10], [5, 3, 2], [4]][:4]
    assert [s.sample_ids.tolist() for s in seqs] == [[0, 2], [1], [1], [1, 2, 3]]
    # lookahead 1 is exactly 'split'
    lengths = [5, 3, 10, 2, 7]
    one = pack_fixed_tokens(lengths, 4, policy="defer", lookahead=1)
    split = pack_fixed_tokens(lengths, 4, policy="split")
    assert [s.sample_lengths.tolist() for s in one] == [s.sample_lengths.tolist() for s in split]


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(min_value=1, max_value=40), lookahead=st.integers(1, 8))
def test_defer_preserves_tokens_and_bounds_reordering(lengths, seq_len, lookahead):
    seqs = pack_fixed_tokens(lengths, seq_len, policy="defer", lookahead=lookahead)
    assert len(seqs) == sum(lengths) // seq_len
    assert all(s.num_tokens == seq_len for s in seqs)
    if not seqs:
        return
    ids = np.concatenate([s.sample_ids for s in seqs])
    pieces = np.concatenate([s.sample_lengths for s in seqs])
    rejoined = np.bincount(ids, weights=pieces, minlength=len(lengths)).astype(int)
    assert np.all(rejoined <= np.asarray(lengths))
    assert sum(lengths) - rejoined.sum() < seq_len  # only the partial tail is missing
    # placement is bounded: a sample is never placed after one `lookahead` positions newer started
    first_seen = {}
    for pos, i in enumerate(ids.tolist()):
        first_seen.setdefault(i, pos)
    order = sorted(first_seen, key=first_seen.get)
    for rank, i in enumerate(order):
        assert i - rank <= lookahead  # a sample starts at most `lookahead` places early


def test_defer_keeps_long_samples_whole_at_boundaries():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, 400).tolist()
    lengths[50] = 900  # shorter than S: never cut under 'defer'
    seqs = pack_fixed_tokens(lengths, 1000, policy="defer")
    holders = [s for s in seqs if 50 in s.sample_ids.tolist()]
    assert len(holders) == 1 and holders[0].sample_ids[0] == 50
    assert holders[0].sample_lengths[0] == 900
    # under 'split' the same sample is usually cut in two
    split = [s for s in pack_fixed_tokens(lengths, 1000, policy="split") if 50 in s.sample_ids.tolist()]
    assert sum(int(s.sample_lengths[s.sample_ids == 50].sum()) for s in split) == 900


@pytest.mark.parametrize("lookahead", [0, -1, 10**9, 2.5, True])
def test_bad_lookahead(lookahead):
    with pytest.raises(ValueError, match="lookahead must be an integer in"):
        pack_fixed_tokens([1, 2], 4, lookahead=lookahead)


@pytest.mark.parametrize("lengths, shown", [([1e19, 3], "length 1e+19 at sample 0"),
                                           (np.array([5, 2**63 + 5], dtype=np.uint64), "at sample 1"),
                                           ([2**40 + 1] * 3, f"length {2**40 + 1} at sample 0")])
def test_lengths_out_of_range_are_refused_before_any_sum(lengths, shown):
    with pytest.raises(ValueError, match="out of range") as info:
        pack_fixed_tokens(lengths, 4)
    assert shown in str(info.value)
