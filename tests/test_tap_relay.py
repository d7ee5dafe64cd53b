"""KV relays (libra.tap.relay): the doubling tree, the Plan checks of relay rows, the chunking rule."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from dist_utils import long_tail_lengths

from libra.plan import KV, TILES, PlanValidationError, Q, TransferTable
from libra.runtime.program import compile_worker
from libra.tap.relay import relay_transfers


def _table(rows):
    cols = ("kind", "src", "dst", "seq", "tok_start", "tok_end", "head_start", "head_end", "nbytes")
    return TransferTable(**{c: np.array([r[i] for r in rows]) for i, c in enumerate(cols)})


def test_relay_tree_on_nested_prefixes():
    """Holder 0 fans one payload out to 4 destinations needing nested prefixes: it sends once, to the
    widest need, and every member that has the payload forwards it, doubling the set each hop."""
    x = _table([(KV, 0, 1, 0, 0, 4, 0, 1, 16), (KV, 0, 2, 0, 0, 8, 0, 1, 32), (Q, 0, 3, 0, 0, 4, 0, 1, 8),
                (KV, 0, 3, 0, 0, 12, 0, 1, 48), (KV, 0, 4, 0, 0, 16, 0, 1, 64)])
    r = relay_transfers(x, np.array([True]))
    # members by decreasing need: dst 4 (hop 0 from the holder), dst 3 (hop 1 from 4), then hop 2:
    # dst 2 from 4 and dst 1 from 3
    assert r.src.tolist() == [3, 4, 0, 4, 0]
    assert r.hop.tolist() == [2, 2, 0, 1, 0]
    assert r.dst.tolist() == x.dst.tolist() and r.nbytes.tolist() == x.nbytes.tolist()
    nine = _table([(KV, 0, d, 0, 0, 4, 0, 1, 16) for d in range(1, 10)])
    r = relay_transfers(nine, np.array([True]))
    assert (r.src == 0).sum() == 1 and r.hop.max() == 4  # 1 + ceil(log2 9) hops, the holder sends once
    assert r.hop.tolist() == [0, 1, 2, 2, 3, 3, 3, 3, 4]


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
    assert r.to_dict()["hop"] == [0, 1] and TransferTable.from_dict(r.to_dict()).hop.tolist() == [0, 1]


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
                          candidates=("fine-retain-link-relay",))
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
