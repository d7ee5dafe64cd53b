"""Libra as a Hugging Face ``transformers`` attention implementation (Libra sec. 1, 5: a drop-in
core-attention operator).

Registered through transformers' public ``AttentionInterface`` / ``AttentionMaskInterface`` (no
patching of private model code, which broke other CP libraries when transformers changed)::

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=register())
    shard = shard_packed_batch(batch, cp_rank, cp_size)        # this rank's S/CP tokens
    runner = prepare(program, groups.pool)                     # Libra; or UlyssesAttention(...)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                   cp_runner=runner, use_cache=False).logits

Every decoder layer calls :func:`attention_forward` with its ``(1, heads, S/CP, d)`` query, key
and value; the runner passed as the ``cp_runner`` keyword of ``model(...)`` (transformers forwards
unknown keywords to the attention function, also when gradient checkpointing recomputes a layer)
runs in the ``(S/CP, heads, d)`` pre-attention layout and its output goes back in the
``(1, S/CP, heads, d)`` layout transformers reshapes. The runner carries the document structure
(its Plan, or Ulysses' sample lengths), so the mask function registered beside it builds no dense
mask: a ``(S, S)`` mask is what a 1M-token sequence cannot afford.

What the runners cannot compute is refused at the first layer's call with a message naming it:
dropout, sliding windows, logit soft-capping, attention sinks, a scaling other than the runner's,
padding or custom masks, a KV cache, bidirectional attention, batches of more than one packed
sequence -- and a missing runner when the tokens are a CP slice. Without a runner (CP = 1, e.g.
DP-only training) the layer runs document-causal attention over its own tokens
(:class:`LocalAttention`), documents from ``cu_seq_lens_q`` or the ``position_ids`` restarts. A
missing runner is recognised from those documents: ``cu_seq_lens_q`` covering more tokens than
the layer holds, or ``position_ids`` that start inside a document. A CP slice that happens to
begin at a document boundary, with no ``cu_seq_lens_q``, looks like a whole sequence; its CP peers
then fail at the same layer (at least one of them starts inside a document unless every slice
edge is a document boundary), so the run stops there rather than training on a wrong mask.

The registry is transformers' own (class-level, as its API defines); this module keeps no state.

``transformers`` is imported only inside :func:`register`; importing this module does not need it.
"""

from __future__ import annotations

import math

import torch

from libra.data.collate import IGNORE_INDEX, PieceFeatures, collate_packed, shard_packed_batch
from libra.runtime.attention import RunnerFunction
from libra.runtime.kernels import AttentionBackend, Segments, get_backend

__all__ = ["IGNORE_INDEX", "RUNNER_KWARG", "LocalAttention", "PieceFeatures", "attention_forward", "collate_packed",
           "no_dense_mask", "register", "shard_packed_batch"]

RUNNER_KWARG = "cp_runner"
"""Keyword of ``model(...)`` that carries the prepared runner to every attention layer."""

_BUILTIN = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")


def register(name: str = "libra") -> str:
    """Register :func:`attention_forward` and :func:`no_dense_mask` under ``name``; returns ``name``
    for ``attn_implementation=``. Idempotent.

    Raises:
        ValueError: an empty name, or the name of one of transformers' own implementations.
        ImportError: transformers is not installed (``pip install 'libra-bench[hf]'``).
    """
    if not isinstance(name, str) or not name or name in _BUILTIN or name.startswith("paged|"):
        raise ValueError(f"register needs a new attention name (not one of transformers' {_BUILTIN}), got {name!r}")
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as exc:  # the optional [hf] extra
        raise ImportError("libra.integrations.transformers needs transformers: pip install 'libra-bench[hf]'") from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, no_dense_mask)
    return name


def no_dense_mask(batch_size: int = 1, q_length: int = 0, kv_length: int = 0, attention_mask=None, **kwargs):
    """Mask function for ``AttentionMaskInterface``: documents and causality live in the runner, so
    no ``(S, S)`` mask is built (returns None). A 2-D padding mask with a masked token is refused:
    packed batches carry no padding.

    Raises:
        ValueError: ``attention_mask`` masks a token.
    """
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
        raise ValueError("Libra attention takes packed batches without padding: pass attention_mask=None (the "
                         "documents come from the runner or from cu_seq_lens_q / position_ids)")
    return None


class LocalAttention:
    """Document-causal attention of a whole packed sequence on one process (CP = 1).

    Args:
        sample_lengths: the documents' token lengths (sum = tokens of q).
        backend: a :mod:`libra.runtime.kernels` backend name or instance.
        scale: softmax scale (None: ``1/sqrt(d)``).

    Same call and autograd bridge as the CP runners: ``runner(q (T, hq, d), k, v) -> (T, hq, d)``.
    """

    def __init__(self, sample_lengths, backend: str | AttentionBackend = "auto", scale: float | None = None,
                 device="cpu"):
        self.seg = Segments(sample_lengths, sample_lengths)
        self.backend = backend if isinstance(backend, AttentionBackend) else get_backend(backend, device)
        self.scale = scale

    def forward(self, q, k, v):
        out, lse = self.backend.forward(q, k, v, self.seg, self.scale)
        return out, [out, lse], {}

    def backward(self, dout, q, k, v, tensors, meta):
        out, lse = tensors
        tensors.clear()
        return self.backend.backward(dout, q, k, v, out.contiguous(), lse.contiguous(), self.seg, self.scale)

    def __call__(self, q, k, v):
        if q.shape[0] != self.seg.total_q:
            raise ValueError(f"LocalAttention covers {self.seg.total_q} tokens, got q of shape {tuple(q.shape)}")
        return RunnerFunction.apply(q, k, v, self)


def _refuse_options(module, query, key, attention_mask, dropout, kwargs) -> None:
    """Raise ValueError, naming the option, for what a Libra/Ulysses runner cannot compute."""
    name = type(module).__name__
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"{name}: Libra attention takes one packed sequence per call (batch 1, see "
                         f"shard_packed_batch), got query of shape {tuple(query.shape)}")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"{name}: {key.shape[2]} keys for {query.shape[2]} queries: a KV cache is not supported "
                         "(pass use_cache=False; Libra attention is for training)")
    if dropout:
        raise ValueError(f"{name}: attention dropout {dropout} is not supported (set config.attention_dropout=0)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{name}: sliding-window attention (window {kwargs['sliding_window']}) is not supported; "
                         "Libra computes full document-causal attention")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{name}: attention logit soft-capping (softcap={kwargs['softcap']}) is not supported")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError(f"{name}: attention sinks are not supported")
    if attention_mask is not None:
        raise ValueError(f"{name}: a dense or custom attention mask is not supported: documents come from the "
                         "runner (or cu_seq_lens_q / position_ids without one)")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise ValueError(f"{name}: bidirectional attention is not supported (Libra attention is causal)")


def _local_runner(query, scaling, kwargs) -> LocalAttention:
    """The CP = 1 runner for this layer's tokens; refuses tokens that are visibly a CP slice (see
    the module docstring for the one case that cannot be told apart)."""
    t = query.shape[2]
    cu, pos = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")
    if cu is not None:
        bounds = torch.as_tensor(cu).reshape(-1).tolist()
    elif pos is not None:
        pos = torch.as_tensor(pos).reshape(-1)
        if int(pos[0]) != 0:
            raise ValueError(f"no {RUNNER_KWARG}= was passed, but these tokens start inside a document "
                             f"(position_ids[0] = {int(pos[0])}): under context parallelism (CP > 1) pass the "
                             f"prepared runner as model(..., {RUNNER_KWARG}=runner)")
        bounds = [*torch.nonzero(pos == 0).reshape(-1).tolist(), t]
    else:
        bounds = [0, t]
    if bounds[0] != 0 or bounds[-1] != t:
        raise ValueError(f"no {RUNNER_KWARG}= was passed, but the documents (cu_seq_lens_q) cover {bounds[-1]} "
                         f"tokens and this rank holds {t}: under context parallelism (CP > 1) pass the prepared "
                         f"runner as model(..., {RUNNER_KWARG}=runner)")
    return LocalAttention([b - a for a, b in zip(bounds, bounds[1:])], scale=scaling, device=query.device)


def _check_scale(runner, scaling, head_dim: int) -> None:
    mine = getattr(runner, "scale", None)
    mine = head_dim ** -0.5 if mine is None else mine
    wanted = head_dim ** -0.5 if scaling is None else scaling
    if not math.isclose(mine, wanted, rel_tol=1e-12):
        raise ValueError(f"the model scales attention scores by {wanted!r} but the runner by {mine!r}: "
                         f"prepare the runner with scale={wanted!r}")


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """``AttentionInterface`` function: ``(1, hq, T, d)``, ``(1, hkv, T, d)`` x2 ->
    ``((1, T, hq, d), None)`` through the ``cp_runner`` keyword's runner (see the module docstring).

    Raises:
        ValueError: an unsupported option (named), or no runner for a CP slice.
    """
    _refuse_options(module, query, key, attention_mask, dropout, kwargs)
    runner = kwargs.get(RUNNER_KWARG)
    if runner is None:
        runner = _local_runner(query, scaling, kwargs)
    _check_scale(runner, scaling, query.shape[-1])
    # (1, heads, T, d) -> (T, heads, d): a transposed view of the projections' (T, heads, d) rows
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    return runner(q, k, v).unsqueeze(0), None
