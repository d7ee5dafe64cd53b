"""The CPU flash backend batches runs of equal segments into one call (views of
the packed rows, no zero-filled gradients) and stays exact against the plain-PyTorch backend."""

from __future__ import annotations

import pytest
import torch

from libra.runtime.kernels import CpuFlashBackend, MathBackend, Segments

CASES = {
    "whole-run": ([16] * 3, [16] * 3),
    "mixed-runs": ([4, 4, 4, 2, 2, 3, 5, 5], [4, 4, 4, 6, 6, 3, 9, 9]),
    "single-split": ([7], [20]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (6, 2)])
def test_batched_runs_match_math_float64(case, hq, hkv):
    ql, kl = CASES[case]
    seg = Segments(ql, kl)
    g = torch.Generator().manual_seed(len(ql) * 100 + hq + hkv)
    q = torch.randn(seg.total_q, hq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(seg.total_k, hkv, 8, generator=g, dtype=torch.float64)
    v = torch.randn(seg.total_k, hkv, 8, generator=g, dtype=torch.float64)
    do = torch.randn_like(q)
    fast, ref = CpuFlashBackend(), MathBackend()
    out, lse = fast.forward(q, k, v, seg)
    out_r, lse_r = ref.forward(q, k, v, seg)
    assert out.shape == q.shape and lse.shape == (hq, seg.total_q)
    torch.testing.assert_close(out, out_r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_r, rtol=1e-10, atol=1e-10)
    grads = fast.backward(do, q, k, v, out, lse, seg)
    grads_r = ref.backward(do, q, k, v, out_r, lse_r, seg)
    for a, b in zip(grads, grads_r):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_runs_are_maximal_and_cached():
    seg = Segments([4, 4, 2, 2, 4], [4, 4, 6, 6, 4])
    assert seg.runs() == [(0, 2, 4, 4), (2, 2, 2, 6), (4, 1, 4, 4)]
    assert seg.runs() is seg.runs()
