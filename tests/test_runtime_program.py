"""Single-process tests of plan compilation (WorkerProgram), the rank grid and the async planner."""

from __future__ import annotations

import time

import numpy as np
import pytest
from dist_utils import long_tail_lengths

from libra.plan import KV, O, PlanValidationError, PoolPlan, Q
from libra.runtime.async_planner import AsyncPlanner
from libra.runtime.groups import RankGrid
from libra.runtime.program import compile_worker
from libra.tap.pipeline import BWD_DISPATCH as BD
from libra.tap.pipeline import BWD_RETURN as BR
from libra.tap.pipeline import FWD_DISPATCH as FD
from libra.tap.pipeline import FWD_RETURN as FR
from libra.workload import AttentionShape


def _plan(hq=8, hkv=2, B=32, H=2, M=2, dp=2, cp=2, S=256, seed=3):
    from baselines.registry import get_planner
    from libra.config import ParallelConfig
    from libra.data.packing import PackedSequence

    rng = np.random.default_rng(seed)
    window = []
    for i in range(dp):
        lengths = long_tail_lengths(rng, S, scale=120.0 if i % 2 == 0 else 6.0)
        window.append(PackedSequence(i, lengths, np.arange(len(lengths))))
    shape = AttentionShape(hq, hkv, 16, 8)
    par = ParallelConfig(dp=dp, cp=cp, gbs=dp, seq_len=S)
    plan = get_planner("libra", pool_size=dp, block_size=B, head_split=H, pipeline_chunks=M).plan_window(
        window, par, shape)[0]
    return plan, shape


def _with(pool: PoolPlan, tiles=None, transfers=None) -> PoolPlan:
    return PoolPlan(pool.pool_index, pool.workers, pool.sequences, tiles if tiles is not None else pool.tiles,
                    transfers if transfers is not None else pool.transfers, pool.fallback_tiles)


@pytest.mark.parametrize("M", [1, 2, 4])
def test_programs_conserve_work_and_volume(M):
    plan, shape = _plan(M=M)
    pool = plan.pools[0]
    progs = [compile_worker(pool, shape, w, M) for w in pool.workers]
    segs = pool.segments()
    for p in progs:
        # the kernels see exactly this worker's PoolPlan.segments (all chunks together)
        mine = segs["dest"] == p.worker
        assert sum(k.total_q * k.qh for k in p.kernels) == int(np.sum(segs["q_len"][mine] * segs["heads"][mine]))
        area = int(np.sum(segs["area"][mine] * segs["heads"][mine]))
        assert sum(k.flops for k in p.kernels) == pytest.approx(area)
    rows = {ph: sum(p.comm_rows()[ph] for p in progs) for ph in (FD, FR, BD, BR)}
    # backward moves exactly the forward volume (Libra sec. 4.3.3), and it matches the plan's bytes
    assert rows[FD] + rows[FR] == rows[BD] + rows[BR]
    el = shape.head_dim * shape.dtype_bytes
    assert rows[FD] * el == sum(pool.transfers.bytes_by_kind()[k] for k in ("q", "kv"))
    assert rows[FR] * el == pool.transfers.bytes_by_kind()["o"]
    for ph in (FD, FR, BD, BR):  # what one worker sends, its peer expects
        for m in range(M):
            send = np.array([p.messages[ph][m].send_rows for p in progs])
            recv = np.array([p.messages[ph][m].recv_rows for p in progs])
            assert np.array_equal(send, recv.T)


def test_mutated_plans_are_rejected():
    plan, shape = _plan()
    pool = plan.pools[0]
    n = len(pool.tiles)
    compile_all = (lambda p: [compile_worker(p, shape, w, 2) for w in p.workers])  # noqa: E731
    # dropped tile (computed away from home: its destination has an O row for rows it no longer computes)
    with pytest.raises(PlanValidationError, match="written 0 times|returns rows no tile computes here"):
        compile_all(_with(pool, tiles=pool.tiles.select(np.arange(1, n))))
    home = np.nonzero(pool.tiles.dest == pool.tiles.q_home)[0]
    assert len(home), "the plan must compute some tile at home for this test"
    with pytest.raises(PlanValidationError, match="written 0 times"):  # a dropped tile computed at home
        compile_all(_with(pool, tiles=pool.tiles.select(np.arange(n) != home[0])))
    # duplicated tile (computed twice, returned twice)
    dup = np.concatenate([np.arange(n), [0]])
    with pytest.raises(PlanValidationError):
        compile_all(_with(pool, tiles=pool.tiles.select(dup)))
    tr = pool.transfers
    # an output returned to the wrong Q-home
    o_rows = np.nonzero(tr.kind == O)[0]
    assert len(o_rows), "the plan must move tiles for this test"
    r = int(o_rows[0])
    wrong = [w for w in pool.workers if w not in (tr.src[r], tr.dst[r])][0]
    dst = tr.dst.copy()
    dst[r] = wrong
    bad = type(tr)(**{**{f: getattr(tr, f) for f in tr.FIELDS}, "dst": dst})
    with pytest.raises(PlanValidationError):
        compile_all(_with(pool, transfers=bad))
    # a missing KV fetch and a missing Q dispatch
    for kind, what in ((KV, "KV of token"), (Q, "Q of token")):
        rows = np.nonzero(tr.kind == kind)[0]
        keep = np.ones(len(tr), bool)
        keep[rows[0]] = False
        with pytest.raises(PlanValidationError, match=what):
            compile_all(_with(pool, transfers=tr.select(keep)))
    # a duplicated KV fetch
    kv0 = int(np.nonzero(tr.kind == KV)[0][0])
    with pytest.raises(PlanValidationError, match="more than once"):
        compile_all(_with(pool, transfers=tr.select(np.concatenate([np.arange(len(tr)), [kv0]]))))


def test_compile_argument_errors():
    plan, shape = _plan(M=2)
    pool = plan.pools[0]
    with pytest.raises(ValueError, match="not in pool"):
        compile_worker(pool, shape, 99, 2)
    with pytest.raises(ValueError, match="M=3 must divide every tile's head width .* has 4 heads"):
        compile_worker(pool, shape, pool.workers[0], 3)
    with pytest.raises(ValueError, match="positive integer"):
        compile_worker(pool, shape, pool.workers[0], 0)


def test_rank_grid_numbering():
    g = RankGrid(dp=4, cp=2, pool_size=2, pp=2)
    assert g.world_size == 16 and g.num_pools == 2
    assert g.coords(11) == (1, 1, 1)
    assert g.worker_of(11) == 3 and g.rank_of(3, stage=1) == 11
    assert g.pool_workers(1) == (4, 5, 6, 7)
    assert g.pool_of_worker(5) == 1
    assert g.cp_workers(2) == (4, 5)
    with pytest.raises(ValueError, match="pool size P=3 must divide DP=4"):
        RankGrid(dp=4, cp=2, pool_size=3)
    with pytest.raises(ValueError, match="RankGrid.cp"):
        RankGrid(dp=4, cp=0)
    with pytest.raises(ValueError, match="rank 16 outside"):
        g.coords(16)


def _slow_plan(x):
    time.sleep(0.3)
    return x * 2


def _failing_plan(x):
    raise ValueError(f"bad metadata {x}")


def test_async_planner_waits_only_when_late():
    with AsyncPlanner(_slow_plan) as ap:
        ap.submit(0, 1)
        assert ap.get(0) == 2
        late = ap.records[0].wait_s
        ap.submit(1, 2)
        time.sleep(0.6)  # the "current step" runs longer than planning
        assert ap.ready(1)
        assert ap.get(1) == 4
        assert late > 0.15 and ap.records[1].wait_s < 0.05
        assert ap.records[1].plan_s >= 0.25
        with pytest.raises(KeyError, match="step 1 was not submitted"):
            ap.get(1)
        ap.submit(2, 3)
        with pytest.raises(TimeoutError, match="step 2"):
            ap.get(2, timeout=0.01)


def test_async_planner_errors():
    with pytest.raises(ValueError, match="mode"):
        AsyncPlanner(_slow_plan, mode="fork")
    with pytest.raises(ValueError, match="callable"):
        AsyncPlanner(3)
    with AsyncPlanner(_failing_plan, max_pending=1) as ap:
        ap.submit(0, 5)
        with pytest.raises(ValueError, match="max_pending=1"):
            ap.submit(1, 5)
        with pytest.raises(RuntimeError, match="planning step 0 failed: bad metadata 5"):
            ap.get(0)
        with pytest.raises(ValueError, match="non-negative"):
            ap.submit(-1, 0)


@pytest.mark.slow
def test_async_planner_process_mode_is_deterministic():
    with AsyncPlanner(_slow_plan, mode="process") as ap:
        ap.submit(0, 21)
        assert ap.get(0) == 42


def test_pipeliner_issues_next_dispatch_before_computing(monkeypatch):
    """One libra_attention call executes the program's ChunkSchedule.events in order (Libra sec. 4.4),
    chunk m's return and chunk m + 2's dispatch started as one group."""
    import torch

    from libra.runtime.attention import LibraAttention
    from libra.runtime.executor import Exchanger
    from libra.runtime.groups import PoolGroup
    from libra.runtime.kernels import get_backend

    plan, shape = _plan(M=4, dp=1, cp=1, S=128, B=32, H=2)
    pool = plan.pools[0]
    prog = compile_worker(pool, shape, pool.workers[0], 4)
    events = []
    monkeypatch.setattr(Exchanger, "start_group", lambda self, exchanges:
                        events.append(("issue", tuple((phase, chunk) for *_, phase, chunk in exchanges))) or [])
    backend = get_backend("cpu-flash")
    # the packed execution (as on a GPU): one backend call per chunk, so each call marks a compute
    # event (with views a one-worker pool is closed: one call over all heads, libra.runtime.calls)
    backend.views = False
    real_forward = backend.forward

    def forward(*args, **kwargs):
        events.append(("compute", len([e for e in events if e[0] == "compute"])))
        return real_forward(*args, **kwargs)

    backend.forward = forward
    group = PoolGroup(None, tuple(pool.workers), tuple(pool.workers), pool.workers[0], 5.0)
    attn = LibraAttention(prog, group, backend, check_finite=False)
    n = prog.num_local
    q = torch.randn(n, shape.num_q_heads, shape.head_dim, dtype=torch.float64)
    k = torch.randn(n, shape.num_kv_heads, shape.head_dim, dtype=torch.float64)
    attn(q, k, torch.randn_like(k))
    groups = {"issue_dispatch": lambda i: (("fwd_dispatch", i),), "issue_return": lambda i: (("fwd_return", i),),
              "issue_exchange": lambda i: (("fwd_return", i), ("fwd_dispatch", i + 2))}
    expected = [("issue", groups[e](i)) if e in groups else (e, i)
                for e, i in prog.schedule.events if e in (*groups, "compute")]
    assert expected[:3] == [("issue", (("fwd_dispatch", 0),)), ("issue", (("fwd_dispatch", 1),)), ("compute", 0)]
    assert ("issue", (("fwd_return", 1), ("fwd_dispatch", 3))) in expected
    assert events == expected
