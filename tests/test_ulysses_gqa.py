"""Ulysses runtime with head shards that cut GQA groups, single process.

The gloo parity of these shapes is in tests/test_runtime_parity.py; here, without spawning: the
local query-head -> KV-head map, each rank's kernel step (expand, kernel, reduce) against the
float64 reference, and the runtime refusing exactly what the planner refuses, with its message.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_utils import full_tensors, max_err, reference_grads

from baselines.registry import get_planner
from baselines.ulysses_runtime import UlyssesAttention, local_kv_map
from libra.config import ParallelConfig
from libra.data.packing import PackedSequence
from libra.runtime.executor import MemoryMeter
from libra.runtime.groups import PoolGroup
from libra.workload import AttentionShape

CUT = [(12, 3, 2), (24, 6, 4), (6, 3, 2), (6, 2, 3), (24, 3, 8), (16, 4, 8), (8, 2, 4), (8, 2, 2), (4, 4, 2), (4, 1, 4)]


def _group(cp: int, rank: int) -> PoolGroup:
    """A CP group description for construction only (no process group: nothing is communicated)."""
    return PoolGroup(group=None, workers=tuple(range(cp)), ranks=tuple(range(cp)), worker=rank, timeout_s=1.0)


def test_local_map_of_the_issue_shapes():
    s = AttentionShape(12, 3, 8)
    a, b, idx = local_kv_map(s, 0, 6)
    assert (a, b) == (0, 2) and idx.tolist() == [0, 0, 0, 0, 1, 1]
    a, b, idx = local_kv_map(s, 6, 12)
    assert (a, b) == (1, 3) and idx.tolist() == [0, 0, 1, 1, 1, 1]
    a, b, idx = local_kv_map(AttentionShape(6, 3, 8), 0, 3)
    assert (a, b) == (0, 2) and idx.tolist() == [0, 0, 1]
    # the aligned cases keep the fast path (no expansion)
    assert local_kv_map(AttentionShape(8, 2, 8), 4, 8) == (1, 2, None)
    assert local_kv_map(AttentionShape(12, 4, 8), 6, 12) == (2, 4, None)
    assert local_kv_map(AttentionShape(8, 2, 8), 2, 4) == (0, 1, None)


@pytest.mark.parametrize("hq", [1, 2, 3, 4, 6, 8, 12, 16, 24])
def test_local_map_is_the_gqa_map(hq):
    for hkv in [h for h in range(1, hq + 1) if hq % h == 0]:
        shape = AttentionShape(hq, hkv, 8)
        for cp in [c for c in range(1, hq + 1) if hq % c == 0]:
            qh = hq // cp
            for j in range(cp):
                a, b, idx = local_kv_map(shape, j * qh, (j + 1) * qh)
                assert (a, b) == shape.kv_head_range(j * qh, (j + 1) * qh)
                want = np.arange(j * qh, (j + 1) * qh) // shape.group_size - a
                kvh = b - a
                contiguous = qh % kvh == 0 and np.array_equal(want, np.arange(qh) // (qh // kvh))
                if idx is None:
                    assert contiguous
                else:
                    assert not contiguous and idx.tolist() == want.tolist()
                    assert set(idx.tolist()) == set(range(kvh)), "a received KV head is never read"


@pytest.mark.parametrize("backend", ["cpu-flash", "math"])
@pytest.mark.parametrize("hq,hkv,cp", CUT)
def test_each_ranks_kernel_step_matches_the_reference(hq, hkv, cp, backend):
    """Every rank's head-sharded step (expand, kernel fwd/bwd, reduce), assembled over the CP group."""
    shape = AttentionShape(hq, hkv, 8)
    lengths = np.array([5, 17, 1, 9, 16], dtype=np.int64)   # S = 48: every CP here divides it
    q, k, v, do = full_tensors([lengths], shape, seed=hq * 31 + hkv * 7 + cp)[0]
    ref = reference_grads(q, k, v, do, lengths)
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    qh = hq // cp
    for j in range(cp):
        attn = UlyssesAttention(lengths, _group(cp, j), hq, hkv, backend=backend)
        a, b = attn.kv_lo[j], attn.kv_hi[j]
        heads = slice(j * qh, (j + 1) * qh)
        qf, kf, vf = q[:, heads].contiguous(), k[:, a:b].contiguous(), v[:, a:b].contiguous()
        meter = MemoryMeter()
        kx, vx = attn._expand(kf, vf, meter)
        o, lse = attn.backend.forward(qf, kx, vx, attn.seg)
        gq, gk, gv = attn.backend.backward(do[:, heads].contiguous(), qf, kx, vx, o, lse, attn.seg)
        if kx is not kf:
            gk, gv = attn._reduce(gk, kf), attn._reduce(gv, vf)
        assert gk.shape == kf.shape and gv.shape == vf.shape
        out[:, heads], dq[:, heads] = o, gq
        dk[:, a:b] += gk
        dv[:, a:b] += gv
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        assert max_err(got, want) < 1e-10, f"{name}"


def _planner_error(hq, hkv, cp):
    try:
        shape = AttentionShape(hq, hkv, 8)
        par = ParallelConfig(dp=1, cp=cp, gbs=1, seq_len=8 * cp)
        window = [PackedSequence(0, np.array([8 * cp]), np.arange(1))]
        get_planner("ulysses").plan_window(window, par, shape)[0].validate()
    except ValueError as exc:
        return str(exc)
    return None


def _runtime_error(hq, hkv, cp):
    try:
        UlyssesAttention([8 * cp], _group(cp, 0), hq, hkv, backend="math")
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("hq,hkv,cp", [*CUT, (6, 2, 4), (12, 3, 8), (6, 4, 2), (3, 2, 3), (5, 1, 2)])
def test_runtime_refuses_exactly_what_the_planner_refuses(hq, hkv, cp):
    planner, runtime = _planner_error(hq, hkv, cp), _runtime_error(hq, hkv, cp)
    assert planner == runtime
    if (hq, hkv, cp) in CUT:
        assert runtime is None
