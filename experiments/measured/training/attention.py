"""Core-attention backends for the training model, each bound to one microbatch.

* :func:`reference_attention` (re-exported): one process, the whole packed sequence.
* :func:`ulysses_core_attention`: :class:`baselines.ulysses_runtime.UlyssesAttention` (the deployed
  DeepSpeed-Ulysses runtime) over the CP group, prepared once per packed sequence.
* :func:`libra_core_attention`: :func:`libra.runtime.attention.prepare` compiling this GA index's
  Plan in the pool's process group (Libra sec. 5: the drop-in CP attention operator).

Every backend maps ``q (T_local, hq, d), k, v (T_local, hkv, d) -> o (T_local, hq, d)`` in the
pre-attention layout.
"""

from __future__ import annotations

from baselines.ulysses_runtime import UlyssesAttention
from experiments.measured.training.model import CoreAttention, reference_attention
from libra.runtime.attention import prepare

__all__ = ["reference_attention", "ulysses_core_attention", "libra_core_attention"]


def ulysses_core_attention(sample_lengths, group, num_q_heads: int, num_kv_heads: int,
                           device="cpu") -> CoreAttention:
    """Bind :class:`~baselines.ulysses_runtime.UlyssesAttention` to one packed sequence and the CP
    :class:`~libra.runtime.groups.PoolGroup`; every layer reuses it (``device`` picks the kernel)."""
    return UlyssesAttention(sample_lengths, group, num_q_heads, num_kv_heads, device=device)


def libra_core_attention(plan, group, **options) -> CoreAttention:
    """Bind Libra attention to one GA index's Plan and the pool's PoolGroup.

    The plan is compiled (and, with ``verify_plan``, its digest checked across the pool) once here
    with :func:`libra.runtime.attention.prepare`; every layer then reuses the prepared operator.
    """
    return prepare(plan, group, **options)
