"""Failure behaviour of the runtime over gloo: plan mismatch, non-finite inputs, hung and dead
ranks (bounded-time timeout errors instead of hangs), and the async planner's digest check."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from dist_utils import long_tail_lengths, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_S = 3.0


def _plan(seed: int):
    from baselines.registry import get_planner  # noqa: PLC0415
    from libra.config import ParallelConfig  # noqa: PLC0415
    from libra.data.packing import PackedSequence  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    shape = AttentionShape(4, 2, 8, 8)
    par = ParallelConfig(dp=2, cp=1, gbs=2, seq_len=128)
    rng = np.random.default_rng(seed)
    window = []
    for i, scale in enumerate((100.0, 4.0)):
        lengths = long_tail_lengths(rng, 128, scale=scale)
        window.append(PackedSequence(i, lengths, np.arange(len(lengths))))
    planner = get_planner("libra", pool_size=2, block_size=16, head_split=2, pipeline_chunks=2)
    return shape, planner.plan_window(window, par, shape)[0], (window, par, planner)


def _groups(timeout_s: float):
    from libra.runtime.groups import RankGrid, build_groups  # noqa: PLC0415

    return build_groups(RankGrid(dp=2, cp=1, pool_size=2), timeout_s=timeout_s)


def _inputs(shape, n, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, shape.num_q_heads, shape.head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=g, dtype=torch.float64)
    return q, k, torch.randn_like(k)


def _catch(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001  (the parent checks type and message)
        return {"type": type(exc).__name__, "msg": str(exc), "s": time.monotonic() - t0}
    return {"type": None, "msg": "", "s": time.monotonic() - t0}


def _failures_rank(rank, world):
    from libra.runtime.async_planner import AsyncPlanner  # noqa: PLC0415
    from libra.runtime.attention import prepare  # noqa: PLC0415

    out = {}
    groups = _groups(60.0)
    short = _groups(TIMEOUT_S)
    shape, plan, (window, par, planner) = _plan(seed=0)
    # 1. different plans on the pool's ranks -> PlanMismatchError before first use, on every rank
    other = _plan(seed=1)[1] if rank == 1 else plan
    out["mismatch"] = _catch(lambda: prepare(other, groups.pool))
    # 2. NaN in one rank's k -> ValueError on every rank, naming the rank and tensor
    attn = prepare(plan, groups.pool)
    q, k, v = _inputs(shape, attn.program.num_local, rank)
    # (first: same plan + same inputs => bitwise-identical outputs and gradients)
    runs = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        o = attn(*leaves)
        o.backward(torch.ones_like(o))
        runs.append([o.detach()] + [x.grad for x in leaves])
    out["deterministic"] = all(torch.equal(a, b) for a, b in zip(*runs))
    # the one-shot form on a PoolPlan and a raw ProcessGroup (rank i = pool worker i) agrees
    from libra.runtime.attention import libra_attention  # noqa: PLC0415

    pool = plan.pool_of_worker(groups.pool.worker)
    raw = libra_attention(q, k, v, pool, groups.pool.group, shape=shape, chunks=2, comm="a2a")
    out["raw_group_equal"] = torch.equal(raw, runs[0][0])
    if rank == 1:
        k[3, 0, 0] = float("nan")
    out["nan"] = _catch(lambda: attn(q, k, v))
    # 3. the async planner: plans built in the background, digest agreed before first use
    with AsyncPlanner(lambda w: planner.plan_window(w, par, shape)) as ap:
        ap.submit(0, window)
        plans = ap.get_verified(0, groups.pool, select=lambda ps: ps[0])
        out["async_same_digest"] = plans[0].digest() == plan.digest()
        out["async_wait_s"] = ap.records[0].wait_s
    # 4. a hung rank: rank 1 never joins the exchange; rank 0 must fail within the timeout
    q, k, v = _inputs(shape, attn.program.num_local, rank)
    if rank == 1:
        time.sleep(TIMEOUT_S * 2.5)
        out["hung"] = {"type": "sleeping", "msg": "", "s": 0.0}
    else:  # no finite-check collective: the first thing to block is the p2p dispatch itself
        from libra.runtime.attention import LibraAttention  # noqa: PLC0415

        p2p = LibraAttention(attn.program, short.pool, attn.backend, check_finite=False)
        out["hung"] = _catch(lambda: p2p(q, k, v).sum().backward())
    return out


def test_mismatch_nan_async_and_hung_rank(tmp_path):
    res = run_ranks(_failures_rank, 2, tmp_path, deadline_s=90, pg_timeout_s=TIMEOUT_S)
    for r in res:
        assert r["mismatch"]["type"] == "PlanMismatchError", r["mismatch"]
        assert "ranks [" in r["mismatch"]["msg"]
        assert r["nan"]["type"] == "ValueError", r["nan"]
        assert "k on pool rank 1" in r["nan"]["msg"], r["nan"]["msg"]
        assert r["async_same_digest"]
        assert r["deterministic"]
        assert r["raw_group_equal"]
    hung = res[0]["hung"]
    assert hung["type"] == "CollectiveTimeoutError", hung
    assert "timed out" in hung["msg"] or "failed" in hung["msg"]
    assert hung["s"] < TIMEOUT_S * 2.5, f"timeout took {hung['s']:.1f}s"


def _dead_rank(rank, world):
    from libra.runtime.attention import prepare  # noqa: PLC0415

    groups = _groups(TIMEOUT_S)
    shape, plan, _ = _plan(seed=0)
    attn = prepare(plan, groups.pool)
    if rank == 1:
        os._exit(3)  # dies without a word
    q, k, v = _inputs(shape, attn.program.num_local, rank)
    return _catch(lambda: attn(q, k, v))


def test_dead_rank_fails_fast(tmp_path):
    res = run_ranks(_dead_rank, 2, tmp_path, deadline_s=60, pg_timeout_s=TIMEOUT_S, allow_errors=True)
    r = res[0]
    assert r["type"] == "CollectiveTimeoutError", r
    assert r["s"] < TIMEOUT_S * 2.5, f"took {r['s']:.1f}s"
