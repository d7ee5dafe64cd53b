"""Core-attention backends for the training model, each bound to one microbatch.

* :func:`reference_attention` (re-exported): one process, the whole packed sequence.
* :func:`ulysses_attention`: DeepSpeed-Ulysses over the CP group -- sequence-to-head all-to-all,
  varlen causal attention over the full packed sequence on ``hq / CP`` heads, head-to-sequence
  all-to-all. Differentiable through ``torch.distributed.nn.functional.all_to_all_single`` (its
  backward is the reverse all-to-all). Used when ``baselines/ulysses_runtime.py`` is absent.
* :func:`libra_core_attention`: ``libra.runtime.libra_attention`` executing this GA index's Plan in
  the pool's process group (Libra sec. 5: the drop-in CP attention operator).

Every backend maps ``q (T_local, hq, d), k, v (T_local, hkv, d) -> o (T_local, hq, d)`` in the
pre-attention layout.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from experiments.training.model import CoreAttention, reference_attention

__all__ = ["reference_attention", "ulysses_attention", "libra_core_attention", "resolve_ulysses", "project_ulysses"]


def _seq_to_head(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """``(T/CP, h, d)`` local tokens, all heads -> ``(T, h/CP, d)`` all tokens, this rank's heads."""
    t, h, d = x.shape
    send = x.reshape(t, cp, h // cp, d).transpose(0, 1).contiguous()  # [dest rank] = its head chunk
    recv = all_to_all_single(torch.empty_like(send), send, group=group)
    return recv.reshape(cp * t, h // cp, d)  # [source rank] = its token chunk, in token order


def _head_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """Inverse of :func:`_seq_to_head`: ``(T, h/CP, d)`` -> ``(T/CP, h, d)``."""
    t_all, hc, d = x.shape
    send = x.reshape(cp, t_all // cp, hc, d).contiguous()  # [dest rank] = its token chunk
    recv = all_to_all_single(torch.empty_like(send), send, group=group)
    return recv.transpose(0, 1).reshape(t_all // cp, cp * hc, d)


def ulysses_attention(sample_lengths, cp: int, group) -> CoreAttention:
    """Ulysses core attention for one packed sequence over a CP group of ``cp`` ranks.

    KV heads: with ``hkv >= CP`` each rank takes ``hkv / CP`` of them; with ``hkv < CP`` they are
    replicated ``CP / hkv`` times first so each rank gets the one its query heads read (GQA).

    Raises:
        ValueError: ``CP`` not dividing ``hq``, or ``hkv`` and ``CP`` not dividing one another.
    """
    attn_full = reference_attention(sample_lengths)

    def attn(q, k, v):
        hq, hkv = q.shape[1], k.shape[1]
        if hq % cp:
            raise ValueError(f"Ulysses needs CP={cp} to divide the query heads hq={hq}")
        if hkv % cp and cp % hkv:
            raise ValueError(f"Ulysses needs CP={cp} and hkv={hkv} to divide one another")
        if hkv < cp:
            k, v = k.repeat_interleave(cp // hkv, dim=1), v.repeat_interleave(cp // hkv, dim=1)
        qh, kh, vh = (_seq_to_head(x, cp, group) for x in (q, k, v))
        return _head_to_seq(attn_full(qh, kh, vh), cp, group)

    return attn


def resolve_ulysses():
    """``baselines.ulysses_runtime.ulysses_attention(q, k, v, sample_lengths, group)`` if present."""
    try:
        return importlib.import_module("baselines.ulysses_runtime").ulysses_attention
    except (ImportError, AttributeError):
        return None


def project_ulysses(sample_lengths, group, op) -> CoreAttention:
    """Bind the project's Ulysses runtime (``op``) to one packed sequence and the CP PoolGroup."""

    def attn(q, k, v):
        return op(q, k, v, sample_lengths, group)

    return attn


def libra_core_attention(plan, group, **options) -> CoreAttention:
    """Bind ``libra_attention`` to one GA index's Plan and the pool's PoolGroup.

    The plan is compiled (and its digest checked across the pool) once here with
    ``libra.runtime.attention.prepare``; every layer then reuses the prepared operator.

    Raises:
        RuntimeError: the runtime does not provide ``prepare`` (names the missing module).
    """
    try:
        prepare = importlib.import_module("libra.runtime.attention").prepare
    except (ImportError, AttributeError) as exc:
        raise RuntimeError("libra.runtime.attention.prepare is not available in this checkout") from exc
    runner = prepare(plan, group, **options)

    def attn(q, k, v):
        return runner(q, k, v)

    return attn


def world_is_initialised() -> bool:
    return dist.is_available() and dist.is_initialized()
