"""The ``ulysses-sorted`` baseline is a Ulysses plan with VRSP's P = 1 schedule.

Same tiles and transfers as ``ulysses`` for every sequence; only which GA index trains which
sequence differs, and that grouping is :func:`libra.vrsp.vrsp_schedule` at ``P = 1``. Its plans pass
the Plan checks and run through ``libra_attention`` on gloo ranks with float64 parity.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_utils import full_tensors, long_tail_lengths, max_err, reference_grads, run_ranks

from baselines.registry import get_planner
from experiments.common.sim_common import LABELS, METHODS
from libra.config import ParallelConfig
from libra.data.packing import PackedSequence
from libra.vrsp import vrsp_schedule
from libra.workload import AttentionShape, packed_flops, packed_workloads

SHAPE = AttentionShape(8, 2, 16)


def _window(n: int, seq_len: int, seed: int):
    """Alternating heavy (long samples) and light (short samples) sequences: production order mixes
    them in every step, sorting separates them."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lengths = long_tail_lengths(rng, seq_len, scale=120.0 if i % 2 == 0 else 6.0)
        out.append(PackedSequence(i, lengths, np.arange(len(lengths))))
    return out


def _relative_pool(pool):
    """A pool's tiles and transfers with worker ids relative to its first worker."""
    base = pool.workers[0]
    t, x = pool.tiles, pool.transfers
    return (t.q_start.tolist(), t.q_end.tolist(), t.head_start.tolist(), t.head_end.tolist(),
            (t.q_home - base).tolist(), (t.dest - base).tolist(), t.flops.tolist(),
            (x.src - base).tolist(), (x.dst - base).tolist(), x.nbytes.tolist())


@pytest.mark.parametrize("dp,cp,ga", [(2, 2, 2), (4, 2, 3), (2, 4, 2)])
def test_a_ulysses_plan_with_the_p1_vrsp_schedule(dp, cp, ga):
    par = ParallelConfig(dp=dp, cp=cp, gbs=dp * ga, seq_len=512)
    window = _window(par.gbs, 512, seed=dp + ga)
    plain = get_planner("ulysses").plan_window(window, par, SHAPE)
    ranked = get_planner("ulysses-sorted").plan_window(window, par, SHAPE)
    _, groups = vrsp_schedule(packed_workloads([s.sample_lengths for s in window]), 1, dp)
    by_seq = {pool.sequences[0].seq_id: _relative_pool(pool) for plan in plain for pool in plan.pools}
    for g, plan in enumerate(ranked):
        plan.validate()                                             # the Plan checks
        assert plan.method == "ulysses-sorted" and plan.ga_index == g and plan.pipeline_chunks == 1
        assert plan.meta == {"pool_size": 1, "head_split": cp, "grouping": "vrsp-p1"}
        assert [pool.sequences[0].seq_id for pool in plan.pools] == groups[g].tolist()
        for d, pool in enumerate(plan.pools):
            assert pool.workers == tuple(range(d * cp, (d + 1) * cp))
            assert _relative_pool(pool) == by_seq[pool.sequences[0].seq_id]  # executed exactly as Ulysses
    # GA index g trains the g-th heaviest DP sequences, so the sum of step maxima can only drop
    flops = np.array([packed_flops(s.sample_lengths, SHAPE) for s in window])
    step_flops = [flops[[p.sequences[0].seq_id for p in plan.pools]] for plan in ranked]
    assert all(a.min() >= b.max() for a, b in zip(step_flops, step_flops[1:]))
    assert sum(f.max() for f in step_flops) <= sum(flops.reshape(ga, dp).max(axis=1))


def test_it_is_a_default_method_with_a_label():
    assert METHODS[:2] == ("ulysses", "ulysses-sorted") and LABELS["ulysses-sorted"] == "Ulysses (sorted)"
    with pytest.raises(ValueError, match="takes no option"):
        get_planner("ulysses-sorted", pool_size=2)


# ------------------------------------------------------------------------------ gloo parity

DP, CP, S, SEED = 2, 2, 256, 23


def _sorted_rank(rank, world):
    from libra.runtime.attention import prepare
    from libra.runtime.groups import RankGrid, build_groups

    groups = build_groups(RankGrid(dp=DP, cp=CP, pool_size=1), timeout_s=60)
    shape = AttentionShape(8, 2, 16, 8)
    par = ParallelConfig(dp=DP, cp=CP, gbs=2 * DP, seq_len=S)
    window = _window(par.gbs, S, SEED)
    full = {w.seq_id: t for w, t in zip(window, full_tensors([w.sample_lengths for w in window], shape, SEED))}
    out = []
    for plan in get_planner("ulysses-sorted").plan_window(window, par, shape):
        plan.validate()
        pool = plan.pool_of_worker(groups.pool.worker)
        attn = prepare(plan, groups.pool)
        ranges = [(pool.sequences[s].seq_id, a, b) for s, a, b in attn.program.local_ranges]
        lengths = {s.seq_id: s.sample_lengths for s in pool.sequences}
        refs = {s: reference_grads(*full[s], lengths[s]) for s, _, _ in ranges}
        ref = [torch.cat([refs[s][i][a:b] for s, a, b in ranges]) for i in range(4)]
        local = [torch.cat([full[s][i][a:b] for s, a, b in ranges]) for i in range(4)]
        q, k, v, do = (x.clone().requires_grad_(i < 3) for i, x in enumerate(local))
        o = attn(q, k, v)
        o.backward(do)
        errs = {n: max_err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), (o, q.grad, k.grad, v.grad), ref)}
        out.append({"step": plan.ga_index, "seqs": [p.sequences[0].seq_id for p in plan.pools], **errs})
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_libra_attention_runs_ulysses_sorted_plans_on_gloo(tmp_path):
    """4 gloo ranks (DP 2, CP 2, P 1), both GA steps: float64 forward and q/k/v gradients match."""
    window = _window(2 * DP, S, SEED)
    _, groups = vrsp_schedule(packed_workloads([s.sample_lengths for s in window]), 1, DP)
    assert sorted(groups[0]) != [0, 1]                              # the sort moved sequences across steps
    results = run_ranks(_sorted_rank, DP * CP, tmp_path, deadline_s=150)
    for rank_res in results:
        assert [r["seqs"] for r in rank_res] == groups.tolist()
        for r in rank_res:
            for name in ("out", "dq", "dk", "dv"):
                assert r[name] < 1e-10, f"step {r['step']}: float64 {name} error {r[name]:.3g}"
