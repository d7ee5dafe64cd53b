"""Ahead-of-time compilation: AsyncPlanner(compile_for=...) returns this rank's WorkerPrograms, and
``prepare`` accepts one (no compilation on the step's path), still compiling a Plan on demand."""

from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest
import torch
from dist_utils import long_tail_lengths

from libra.plan import Plan
from libra.runtime import attention as attention_mod
from libra.runtime.async_planner import AsyncPlanner, CompiledStep, compile_plans
from libra.runtime.attention import LibraAttention, libra_attention, prepare
from libra.runtime.groups import PoolGroup
from libra.runtime.program import WorkerProgram, compile_worker
from libra.workload import AttentionShape

SHAPE = AttentionShape(8, 2, 16, 8)


def plan_window(meta: dict, M: int = 2, B: int = 32, H: int = 2) -> list[Plan]:
    """Module level (picklable for mode="process"): one Plan per GA index of a small window."""
    from baselines.registry import get_planner
    from libra.config import ParallelConfig
    from libra.data.packing import PackedSequence

    dp, cp, S, seed = meta["dp"], meta["cp"], meta["S"], meta["seed"]
    rng = np.random.default_rng(seed)
    window = []
    for i in range(2 * dp):
        lengths = long_tail_lengths(rng, S, scale=120.0 if i % 2 == 0 else 6.0)
        window.append(PackedSequence(i, lengths, np.arange(len(lengths))))
    par = ParallelConfig(dp=dp, cp=cp, gbs=2 * dp, seq_len=S)
    return get_planner("libra", pool_size=dp, block_size=B, head_split=H, pipeline_chunks=M).plan_window(
        window, par, SHAPE)


def _not_a_plan(meta):
    return {"plans": meta}


META = {"dp": 2, "cp": 2, "S": 256, "seed": 3}


def _same_program(got: WorkerProgram, want: WorkerProgram) -> None:
    for attr in ("worker", "pool_rank", "workers", "shape", "chunks", "digest"):
        assert getattr(got, attr) == getattr(want, attr), attr


@pytest.mark.parametrize("mode", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_planner_returns_this_ranks_compiled_programs(mode):
    plans = plan_window(META)
    with AsyncPlanner(plan_window, mode=mode, compile_for=3) as ap:
        ap.submit(0, META)
        got = ap.get(0)
        assert isinstance(got, CompiledStep) and got.workers == (3,)
        assert [p.digest() for p in got.plans] == [p.digest() for p in plans]   # deterministic planning
        assert len(got.programs) == len(plans)
        for plan, prog in zip(plans, got.programs):
            assert isinstance(prog, WorkerProgram)
            # the program prepare(plan, group) would compile: same pool, chunks and (Plan) digest
            _same_program(prog, compile_worker(plan.pool_of_worker(3), plan.shape, 3, plan.pipeline_chunks,
                                               digest=plan.digest()))
        rec = ap.records[0]
        assert rec.plan_s > 0 and rec.compile_s > 0


def test_planner_compiles_several_workers_with_given_chunks():
    plans = plan_window(META)
    with AsyncPlanner(functools.partial(plan_window, M=2), compile_for=[2, 0], chunks=1, keep_plans=False) as ap:
        ap.submit(0, META)
        got = ap.get(0)
        assert got.workers == (2, 0) and got.plans is None
        # a tuple per plan in compile_for order; chunks overrides the plans' M
        assert [tuple(p.worker for p in progs) for progs in got.programs] == [(2, 0)] * len(plans)
        assert {p.chunks for progs in got.programs for p in progs} == {1}


def test_compile_plans_mirrors_its_input_and_names_bad_input():
    plans = plan_window(META)
    assert isinstance(compile_plans(plans[0], 1), WorkerProgram)
    assert compile_plans(plans[0], np.int64(1)).worker == 1
    assert [p.worker for p in compile_plans(plans[0], (1,))] == [1]
    assert [p.worker for p in compile_plans(tuple(plans), 1)] == [1] * len(plans)
    with pytest.raises(ValueError, match="worker 9 is in no pool"):
        compile_plans(plans, 9)
    with pytest.raises(ValueError, match="Plan or a sequence of Plans"):
        compile_plans({"a": 1}, 0)
    with pytest.raises(ValueError, match="compile_for must be"):
        compile_plans(plans, [])


def test_compiling_planner_errors():
    with pytest.raises(ValueError, match="compile_for must be"):
        AsyncPlanner(plan_window, compile_for=-1)
    with pytest.raises(ValueError, match="compile_for must be"):
        AsyncPlanner(plan_window, compile_for="0")
    with pytest.raises(ValueError, match="Pipeliner chunks M must be a positive integer"):
        AsyncPlanner(plan_window, compile_for=0, chunks=0)
    with pytest.raises(ValueError, match="only used with compile_for"):
        AsyncPlanner(plan_window, chunks=2)
    with pytest.raises(ValueError, match="only used with compile_for"):
        AsyncPlanner(plan_window, keep_plans=False)
    with AsyncPlanner(_not_a_plan, compile_for=0) as ap:
        ap.submit(0, META)
        with pytest.raises(RuntimeError, match="planning step 0 failed: .*Plan or a sequence of Plans"):
            ap.get(0)
    with AsyncPlanner(plan_window, compile_for=7) as ap:  # a 4-worker plan has no worker 7
        ap.submit(0, META)
        with pytest.raises(RuntimeError, match="worker 7 is in no pool"):
            ap.get(0)


# --------------------------------------------------------------------------------------------
# prepare(WorkerProgram)
# --------------------------------------------------------------------------------------------


def _solo(pool_workers, worker) -> PoolGroup:
    """A PoolGroup without a process group (verify_plan=False, check_finite=False: no collectives)."""
    return PoolGroup(None, tuple(pool_workers), tuple(pool_workers), worker, 5.0)


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, SHAPE.num_q_heads, SHAPE.head_dim, dtype=torch.float64, generator=g)
    k = torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, dtype=torch.float64, generator=g)
    return q, k, torch.randn(k.shape, dtype=torch.float64, generator=g)


def test_prepare_runs_a_compiled_program_without_compiling(monkeypatch):
    meta = {"dp": 1, "cp": 1, "S": 128, "seed": 5}        # one worker: runs in this process
    plan = plan_window(meta, M=2)[0]
    (w,) = plan.pools[0].workers
    group = _solo(plan.pools[0].workers, w)
    opts = {"verify_plan": False, "check_finite": False, "backend": "cpu-flash"}
    q, k, v = _inputs(plan.pools[0].sequences[0].num_tokens)
    ref = prepare(plan, group, **opts)(q, k, v)            # compiled on demand
    prog = pickle.loads(pickle.dumps(compile_plans(plan, w)))  # as a process-mode planner hands it over

    def no_compile(*args, **kwargs):
        raise AssertionError("prepare compiled a WorkerProgram again")

    monkeypatch.setattr(attention_mod, "compile_worker", no_compile)
    attn = prepare(prog, group, **opts)
    assert isinstance(attn, LibraAttention) and attn.program is prog
    torch.testing.assert_close(attn(q, k, v), ref, rtol=0, atol=0)
    torch.testing.assert_close(libra_attention(q, k, v, prog, group, **opts), ref, rtol=0, atol=0)
    assert prepare(prog, group, chunks=prog.chunks, shape=SHAPE, **opts).program is prog  # agreeing values pass
    # the one-shot form with a Plan still compiles (here: must call compile_worker)
    with pytest.raises(AssertionError, match="compiled a WorkerProgram again"):
        libra_attention(q, k, v, plan, group, **opts)


def test_prepare_rejects_a_program_of_another_worker_pool_or_chunking():
    plan = plan_window(META)[0]
    pool = plan.pool_of_worker(1)
    prog = compile_plans(plan, 1)
    opts = {"verify_plan": False, "check_finite": False}
    with pytest.raises(ValueError, match="compiled for worker 1, but this rank is worker 0"):
        prepare(prog, _solo(pool.workers, 0), **opts)
    with pytest.raises(ValueError, match="differ from the pool's"):
        prepare(prog, _solo((0, 1, 2, 3, 4), 1), **opts)
    with pytest.raises(ValueError, match=f"chunks=1 contradicts the WorkerProgram, compiled with {prog.chunks}"):
        prepare(prog, _solo(pool.workers, 1), chunks=1, **opts)
    with pytest.raises(ValueError, match="shape .* differs from the WorkerProgram"):
        prepare(prog, _solo(pool.workers, 1), shape=AttentionShape(8, 8, 16, 8), **opts)
    with pytest.raises(ValueError, match="WorkerProgram, Plan or PoolPlan"):
        prepare("plan", _solo(pool.workers, 1), **opts)


GLOO_META = {"dp": 1, "cp": 2, "S": 128, "seed": 5}


def _gloo_rank(rank, world):
    """One of 2 gloo ranks (one pool of 2 workers): prepare(program) with the digest agreement,
    then with rank 1's program tampered."""
    from libra.plan import PlanMismatchError
    from libra.runtime.groups import RankGrid, build_groups

    groups = build_groups(RankGrid(dp=1, cp=2, pool_size=1), rank=rank, timeout_s=30.0)
    with AsyncPlanner(plan_window, compile_for=groups.pool.worker) as ap:
        ap.submit(0, GLOO_META)
        step = ap.get_verified(0, groups.pool, select=lambda s: s.programs[0])
    prog = step.programs[0]
    attn = prepare(prog, groups.pool)
    plan = step.plans[0]
    n = prog.num_local
    q, k, v = _inputs(n, seed=rank)
    for x in (q, k, v):
        x.requires_grad_(True)
    out = attn(q, k, v)
    out.backward(torch.ones_like(out))
    q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref = prepare(plan, groups.pool)(q2, k2, v2)     # the Plan, compiled on demand
    ref.backward(torch.ones_like(ref))
    diff = max(float((a - b).abs().max()) for a, b in ((out, ref), (q.grad, q2.grad), (k.grad, k2.grad),
                                                       (v.grad, v2.grad)))
    bad = pickle.loads(pickle.dumps(prog))
    if rank == 1:
        bad.digest = "0" * 64
    try:
        prepare(bad, groups.pool)
        mismatch = None
    except PlanMismatchError as exc:
        mismatch = str(exc)
    return diff, mismatch


@pytest.mark.slow
@pytest.mark.distributed
def test_prepare_program_checks_the_digest_on_a_gloo_group():
    from libra.runtime.launch import run_local_ranks

    recs = run_local_ranks(_gloo_rank, 2, deadline_s=180)
    for rec in recs:
        assert "ok" in rec, rec.get("traceback")
    assert [r["ok"][0] for r in recs] == [0.0, 0.0]       # program path == Plan path, forward and backward
    for r in recs:  # a tampered program: every rank raises, naming the rank that differs
        assert r["ok"][1] is not None and "1" in r["ok"][1]
