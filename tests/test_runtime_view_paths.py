"""The lower-overhead Libra runtime stays exact (gloo, float64 vs reference).

The paths it added, each checked against a single-process float64 reference over the full packed
sequences, forward and q/k/v gradients:

* *view calls* (``libra.runtime.calls``): a CPU backend reads each run of segments in place;
* a *closed* worker (exchanges nothing: identical work on every rank) runs one call over all heads
  whose outputs are out / dq / dk / dv themselves;
* a backend that wants one packed varlen batch per chunk (``views = False``, as the GPU ones) keeps
  the packed execution; on a closed worker its dK/dV land without a zero-fill
  (``kv_grad_blocks``);
* skewed windows (tiles moved, KV fetched) on both.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_utils import full_tensors, max_err, reference_grads, run_ranks

from libra.runtime.blocks import Blocks, merge_rows
from libra.runtime.kernels import MathBackend

F64_TOL = 1e-10


class PackedMath(MathBackend):
    """The math backend asking for the packed execution (as the GPU varlen backends do)."""

    views = False


def _window(kind: str, seq_len: int):
    from libra.data.packing import PackedSequence  # noqa: PLC0415

    if kind == "uniform":  # identical work on both ranks: TAP moves nothing
        lens = [np.full(seq_len // 64, 64), np.full(seq_len // 64, 64)]
    else:  # one long sample vs many short ones: TAP moves tiles, KV is fetched
        lens = [np.array([seq_len]), np.full(seq_len // 32, 32)]
    return [PackedSequence(i, x, np.arange(len(x))) for i, x in enumerate(lens)]


def _case(rank, groups, kind, backend, comm, seq_len=256):
    from baselines.registry import get_planner  # noqa: PLC0415
    from libra.config import ParallelConfig  # noqa: PLC0415
    from libra.runtime.attention import prepare  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    shape = AttentionShape(8, 2, 8, 8)
    window = _window(kind, seq_len)
    plan = get_planner("libra", pool_size=2, block_size=32, head_split=2, pipeline_chunks=2).plan_window(
        window, ParallelConfig(dp=2, cp=1, gbs=2, seq_len=seq_len), shape)[0]
    attn = prepare(plan, groups.pool, backend=backend, comm=comm)
    pool = plan.pool_of_worker(groups.pool.worker)
    ranges = [(pool.sequences[s].seq_id, a, b) for s, a, b in attn.program.local_ranges]
    full = {w.seq_id: t for w, t in zip(window, full_tensors([w.sample_lengths for w in window], shape, 5))}
    lengths = {w.seq_id: w.sample_lengths for w in window}
    refs = {s: reference_grads(*full[s], lengths[s]) for s, _, _ in ranges}
    ref = [torch.cat([refs[s][i][a:b] for s, a, b in ranges]) for i in range(4)]
    q, k, v, do = (torch.cat([full[s][i][a:b] for s, a, b in ranges]).requires_grad_(i < 3) for i in range(4))
    out = attn(q, k, v)
    out.backward(do)
    errs = {n: max_err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref)}
    return {"errs": errs, "closed": attn._closed is not None, "kv_blocks": attn._kv_blocks is not None,
            "calls": [len(c) for c in attn._calls], "sent": sum(attn.program.comm_rows().values()),
            "unreleased": attn.stats.unreleased_bytes}


CASES = [("uniform", "cpu-flash", "p2p"), ("uniform", "cpu-flash", "a2a"), ("uniform", "packed", "a2a"), ("skewed", "cpu-flash", "p2p"),
         ("skewed", "cpu-flash", "a2a"), ("skewed", "packed", "p2p")]


def _rank(rank, world):
    from libra.runtime.groups import RankGrid, build_groups  # noqa: PLC0415

    groups = build_groups(RankGrid(dp=2, cp=1, pool_size=2), timeout_s=60)
    out = {}
    for kind, backend, comm in CASES:
        be = PackedMath() if backend == "packed" else backend
        out[(kind, backend, comm)] = _case(rank, groups, kind, be, comm)
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_view_closed_and_packed_paths_match_reference(tmp_path):
    results = run_ranks(_rank, 2, tmp_path, deadline_s=180)
    for rank, res in enumerate(results):
        for case, got in res.items():
            for name, err in got["errs"].items():
                assert err < F64_TOL, f"rank {rank} {case}: {name} error {err:.3g}"
            assert got["unreleased"] == 0, (rank, case)
        uni = res[("uniform", "cpu-flash", "p2p")]
        assert uni["closed"] and uni["sent"] == 0 and sum(uni["calls"]) == 1  # one call over all heads
        packed = res[("uniform", "packed", "a2a")]
        assert not packed["closed"] and packed["kv_blocks"] and packed["calls"] == [1, 1]
        skew = res[("skewed", "cpu-flash", "p2p")]
        assert not skew["closed"] and skew["sent"] > 0
        assert res[("skewed", "packed", "p2p")]["calls"] == [1, 1]  # one packed batch per chunk


def test_merge_rows_and_views():
    # three blocks of one source, the second continuing the first; the third jumps
    t = np.array([[0, 0, 8, 2, 0, 2, 0, 4, 2],
                  [0, 32, 8, 2, 8, 2, 0, 4, 2],
                  [0, 100, 8, 2, 16, 2, 0, 4, 2]], dtype=np.int64)
    merged = merge_rows(t)
    assert merged.tolist() == [[0, 0, 8, 2, 0, 2, 0, 8, 2], [0, 100, 8, 2, 16, 2, 0, 4, 2]]
    assert Blocks(("q",), t[:2]).as_view() == [0, 0, 8, 2, 0, 2, 0, 8, 2]
    assert Blocks(("q",), t).as_view() is None
    assert Blocks(("q",), t[1:2]).as_view() is None  # not at the start of the target
