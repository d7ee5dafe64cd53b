"""Spawn helper for multi-process gloo tests (DESIGN.md sec. 7).

``run_ranks(fn, world, tmp_path, *args)`` runs ``fn(rank, world, *args)`` on ``world`` spawned gloo
ranks through :func:`libra.runtime.launch.run_local_ranks` and returns every rank's return value.
A deadline kills all ranks so a hang fails the test instead of blocking the suite; an exception in a
rank is re-raised in the parent with the rank's traceback.

Also: data and reference helpers shared by the runtime tests (float64 references over full packed
sequences, independent of libra's kernels: plain autograd over per-sample causal attention).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def run_ranks(fn, world: int, tmp_path, *args, deadline_s: float = 120.0, pg_timeout_s: float = 60.0,
              allow_errors: bool = False):
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; return per-rank results.

    A thin test wrapper of :func:`libra.runtime.launch.run_local_ranks` (``tmp_path`` is kept for
    the callers' signature; the launcher uses its own private folder). With ``allow_errors`` the
    result of a failed rank is ``{"error": msg, "traceback": tb}``; otherwise the first error is
    raised as AssertionError, and a hang past ``deadline_s`` fails the test.
    """
    from libra.runtime.launch import RankDeadlineError, run_local_ranks  # noqa: PLC0415

    try:
        records = run_local_ranks(fn, world, *args, deadline_s=deadline_s, pg_timeout_s=pg_timeout_s)
    except RankDeadlineError as exc:
        raise AssertionError(str(exc)) from exc
    results = []
    for r, res in enumerate(records):
        if "error" in res and not allow_errors:
            raise AssertionError(f"rank {r} failed: {res['error']}\n{res['traceback']}")
        results.append(res["ok"] if "error" not in res else res)
    return results


# --------------------------------------------------------------------------------------------
# data and references
# --------------------------------------------------------------------------------------------


def long_tail_lengths(rng: np.random.Generator, total: int, scale: float = 24.0, alpha: float = 0.9) -> np.ndarray:
    """Random long-tailed sample lengths (Pareto) summing to exactly ``total``."""
    out, left = [], total
    while left > 0:
        length = int(min(left, max(1, round(rng.pareto(alpha) * scale + 1))))
        out.append(length)
        left -= length
    return np.asarray(rng.permutation(out), dtype=np.int64)


def full_tensors(lengths_per_seq, shape, seed: int, dtype=torch.float64):
    """Deterministic full q, k, v, dout per packed sequence (identical on every rank)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for lengths in lengths_per_seq:
        n = int(np.sum(lengths))
        q = torch.randn(n, shape.num_q_heads, shape.head_dim, generator=g, dtype=torch.float64)
        k = torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=g, dtype=torch.float64)
        v = torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=g, dtype=torch.float64)
        do = torch.randn(n, shape.num_q_heads, shape.head_dim, generator=g, dtype=torch.float64)
        out.append(tuple(x.to(dtype) for x in (q, k, v, do)))
    return out


def reference_attention(q, k, v, lengths, upcast_softmax=True):
    """Plain PyTorch block-diagonal causal attention over one packed sequence (autograd-able).

    q ``(S, hq, d)``, k/v ``(S, hkv, d)``; computed in the input dtype with softmax in float32 (or
    float64), i.e. FlashAttention's ``attention_ref(upcast=False)``.
    """
    g = q.shape[1] // k.shape[1]
    outs, start = [], 0
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    for n in np.asarray(lengths).tolist():
        qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
        ks, vs = ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks).to(acc) / math.sqrt(q.shape[-1])
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        p = s.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
        start += n
    return torch.cat(outs)


def reference_grads(q, k, v, do, lengths):
    """``(out, dq, dk, dv)`` of :func:`reference_attention` in the inputs' dtype."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = reference_attention(*leaves, lengths)
    grads = torch.autograd.grad(out, leaves, do)
    return (out.detach(), *grads)


def max_err(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0
