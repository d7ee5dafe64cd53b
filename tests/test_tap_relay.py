"""KV relays (libra.extensions.adaptive.relay): the scatter + all-gather, the Plan checks of relay rows, the chunking rule."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from dist_utils import long_tail_lengths
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.extensions.adaptive.relay import relay_transfers
from libra.extensions.adaptive.tile_chunks import TILES
from libra.plan import KV, PlanValidationError, Q, TransferTable
from libra.runtime.program import compile_worker


def _table(rows):
    cols = ("kind", "src", "dst", "seq", "tok_start", "tok_end", "head_start", "head_end", "nbytes")
    return TransferTable(**{c: np.array([r[i] for r in rows]) for i, c in enumerate(cols)})


def test_broadcast_on_nested_prefixes():
    """Holder 0 fans one payload out to 4 destinations needing nested prefixes [0, 4), [0, 8),
    [0, 12), [0, 16): it scatters pieces of 4 tokens (hop 0), and each member sends its piece to the
    members that need it (hop 1)."""
    x = _table([(KV, 0, 1, 0, 0, 4, 0, 1, 16), (KV, 0, 2, 0, 0, 8, 0, 1, 32), (Q, 0, 3, 0, 0, 4, 0, 1, 8),
                (KV, 0, 3, 0, 0, 12, 0, 1, 48), (KV, 0, 4, 0, 0, 16, 0, 1, 64)])
    r = relay_transfers(x, np.array([True]))
    rows = list(zip(r.kind.tolist(), r.src.tolist(), r.dst.tolist(), r.tok_start.tolist(), r.tok_end.tolist(),
                    r.nbytes.tolist(), r.hop.tolist()))
    assert rows == [(Q, 0, 3, 0, 4, 8, 0),  # the direct row stays first
                    (KV, 0, 1, 0, 4, 16, 0), (KV, 0, 2, 4, 8, 16, 0), (KV, 0, 3, 8, 12, 16, 0),
                    (KV, 0, 4, 12, 16, 16, 0),
                    (KV, 1, 2, 0, 4, 16, 1), (KV, 1, 3, 0, 4, 16, 1), (KV, 1, 4, 0, 4, 16, 1),
                    (KV, 2, 3, 4, 8, 16, 1), (KV, 2, 4, 4, 8, 16, 1), (KV, 3, 4, 8, 12, 16, 1)]
    nine = _table([(KV, 0, d, 0, 0, 9, 0, 1, 36) for d in range(1, 10)])
    r = relay_transfers(nine, np.array([True]))
    assert (r.src == 0).sum() == 9 and r.nbytes[r.src == 0].sum() == 36  # the payload once, in 9 pieces
    assert r.hop.max() == 1 and (r.hop == 1).sum() == 72
    assert np.bincount(r.src[r.hop == 1], weights=r.nbytes[r.hop == 1]).tolist()[1:] == [32.0] * 9


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(1, 40)), min_size=1, max_size=14))
def test_broadcast_delivers_each_need_exactly(rows):
    """Random payload groups (holder h holds tokens from 50 h; one KV head): every destination
    receives exactly the tokens it needs, once; every relay forwards tokens its sender received in
    hop 0; each holder sends its payload's widest need once."""
    seen, table = set(), []
    for holder, dst, length in rows:
        if dst != holder and (holder, dst) not in seen:
            seen.add((holder, dst))
            table.append((KV, holder, dst, 0, 50 * holder, 50 * holder + length, 0, 1, 4 * length))
    if not table:
        return
    r = relay_transfers(_table(table), np.array([True]))
    assert set(r.hop.tolist()) <= {0, 1} and np.all(r.src != r.dst)
    assert np.array_equal(r.nbytes, 4 * (r.tok_end - r.tok_start))
    for dst in {t[2] for t in table}:
        got = np.zeros(300, np.int64)
        for i in np.nonzero(r.dst == dst)[0]:
            got[r.tok_start[i]:r.tok_end[i]] += 1
        want = np.zeros(300, np.int64)
        for t in table:
            if t[2] == dst:
                want[t[4]:t[5]] = 1
        assert np.array_equal(got, want)
    for i in np.nonzero(r.hop == 1)[0]:  # the forwarder got those tokens in hop 0
        fed = (r.hop == 0) & (r.dst == r.src[i]) & (r.tok_start <= r.tok_start[i]) & (r.tok_end >= r.tok_end[i])
        assert fed.any()
    for holder in {t[1] for t in table}:
        mine = (r.src == holder) & (r.hop == 0) & (r.tok_start >= 50 * holder) & (r.tok_end <= 50 * holder + 50)
        assert (r.tok_end - r.tok_start)[mine].sum() == max(t[5] - t[4] for t in table if t[1] == holder)


def test_ineligible_heads_and_other_payloads_stay_direct():
    x = _table([(KV, 0, 1, 0, 0, 4, 0, 1, 16), (KV, 0, 2, 0, 0, 8, 0, 1, 32),  # KV head 0: not eligible
                (KV, 0, 1, 0, 0, 4, 1, 2, 16), (KV, 5, 2, 0, 4, 8, 1, 2, 16)])  # head 1: two payloads of one row
    r = relay_transfers(x, np.array([False, True]))
    assert r.src.tolist() == x.src.tolist() and not r.hop.any()


def test_no_hop_column_keeps_digests_and_json():
    """Plans without relays serialise and hash as before the column existed."""
    x = _table([(KV, 0, 1, 0, 0, 4, 0, 1, 16)])
    assert "hop" not in x.to_dict()
    assert TransferTable.from_dict(x.to_dict()).hop.tolist() == [0]
    r = relay_transfers(_table([(KV, 0, 1, 0, 0, 4, 0, 1, 16), (KV, 0, 2, 0, 0, 4, 0, 1, 16)]), np.array([True]))
    assert r.to_dict()["hop"] == [0, 0, 1, 1] and TransferTable.from_dict(r.to_dict()).hop.tolist() == [0, 0, 1, 1]


def _relayed_plan():
    from baselines.registry import get_planner  # noqa: PLC0415
    from libra.config import ParallelConfig  # noqa: PLC0415
    from libra.data.packing import PackedSequence  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    rng = np.random.default_rng(3)
    lengths = [long_tail_lengths(rng, 256, scale=120.0 if i % 2 == 0 else 6.0) for i in range(4)]
    window = [PackedSequence(i, n, np.arange(len(n))) for i, n in enumerate(lengths)]
    shape = AttentionShape(8, 2, 16, 8)
    planner = get_planner("libra-adaptive", pool_size=4, block_size=16, head_split=1, pipeline_chunks=2,
                          candidates=("fine-retain-link-relay",),
                          profile="h100-roce-v1")  # the length-curve profile's placement fans KV out here
    plan = planner.plan_window(window, ParallelConfig(dp=4, cp=2, gbs=4, seq_len=256), shape)[0]
    return plan.validate(), shape


def test_relayed_plan_validates_and_a_bad_relay_is_named():
    plan, shape = _relayed_plan()
    pool = plan.pools[0]
    x = pool.transfers
    relays = np.nonzero(x.hop > 0)[0]
    assert len(relays), "the small plan must relay something, or this test exercises nothing"
    cols = {c: getattr(x, c).copy() for c in TransferTable.FIELDS}
    i = int(relays[0])
    # a worker that neither holds those tokens nor receives them earlier
    receivers = set(x.dst[(x.kind == KV) & (x.seq == x.seq[i]) & (x.hop < x.hop[i])].tolist())
    holders = set(pool.sequences[int(x.seq[i])].holder_worker.tolist())
    other = next(w for w in pool.workers if w not in receivers | holders | {int(x.dst[i])})
    cols["src"][i] = other
    bad = replace(pool, transfers=TransferTable(**cols))
    with pytest.raises(PlanValidationError, match=f"KV relay transfer {i} .* neither holds them nor receives"):
        replace(plan, pools=(bad,)).validate()
    cols = {c: getattr(x, c).copy() for c in TransferTable.FIELDS}
    q = int(np.nonzero(x.kind == Q)[0][0])
    cols["hop"][q] = 1
    with pytest.raises(PlanValidationError, match=f"transfer {q} has hop 1"):
        replace(plan, pools=(replace(pool, transfers=TransferTable(**cols)),)).validate()


def test_relays_need_head_chunks_at_compile():
    plan, shape = _relayed_plan()
    pool = replace(plan.pools[0], chunking=TILES)
    with pytest.raises(PlanValidationError, match="need the Pipeliner's head chunks"):
        compile_worker(pool, shape, pool.workers[0], 2)


def test_relay_rounds_compile_and_pickle():
    """Every worker of a relayed pool compiles the pool's H relay rounds (empty where it neither
    forwards nor receives); the rounds survive pickling (AsyncPlanner's process mode ships them)."""
    import pickle  # noqa: PLC0415

    from libra.tap.pipeline import BWD_RETURN, FWD_DISPATCH  # noqa: PLC0415

    plan, shape = _relayed_plan()
    pool = plan.pools[0]
    H = int(pool.transfers.hop.max())
    progs = [compile_worker(pool, shape, w, 2) for w in pool.workers]
    assert all(p.hops == H and len(p.relays[BWD_RETURN]) == H for p in progs)
    assert sum(m.n_send for p in progs for m in p.relays[FWD_DISPATCH]) == \
        sum(m.n_recv for p in progs for m in p.relays[FWD_DISPATCH]) > 0
    back = pickle.loads(pickle.dumps(progs[0]))
    assert back.hops == H and back.comm_rows() == progs[0].comm_rows()


def test_compile_rejects_a_relay_whose_source_lacks_the_tokens():
    """compile_worker checks the data flow of unvalidated plans too: a relay row whose source neither
    holds nor earlier received its tokens is named before anything runs."""
    plan, shape = _relayed_plan()
    pool = plan.pools[0]
    x = pool.transfers
    i = int(np.nonzero(x.hop > 0)[0][0])
    receivers = set(x.dst[(x.kind == KV) & (x.seq == x.seq[i]) & (x.hop < x.hop[i])].tolist())
    holders = set(pool.sequences[int(x.seq[i])].holder_worker.tolist())
    other = next(w for w in pool.workers if w not in receivers | holders | {int(x.dst[i])})
    cols = {c: getattr(x, c).copy() for c in TransferTable.FIELDS}
    cols["src"][i] = other
    bad = replace(pool, transfers=TransferTable(**cols))
    with pytest.raises(PlanValidationError, match=f"worker {other}: KV relay round {int(x.hop[i])} forwards tokens"):
        compile_worker(bad, shape, other, 2)
