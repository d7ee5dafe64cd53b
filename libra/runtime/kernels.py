"""Causal varlen core-attention kernels with explicit forward/backward and log-sum-exp.

One interface, several backends. A *batch of segments* is packed along the token axis:
segment ``i`` owns query rows ``[cu_q[i], cu_q[i+1])`` and key/value rows ``[cu_k[i], cu_k[i+1])``
and its query rows are aligned to the END of its keys (bottom-right causal, FlashAttention's
convention for ``Lq != Lk``): query row ``j`` of a segment with ``Lq`` queries and ``Lk`` keys sees
keys ``[0, Lk - Lq + j]``. That is exactly an SH-Tile piece attending to its sample's KV prefix
(Libra sec. 4.3.1), so every tile's output is final where it is computed.

Shapes (all backends):
    q: ``(Tq, hq, d)``; k, v: ``(Tk, hkv, d)`` with ``hkv | hq`` (query head ``h`` reads KV head
    ``h // (hq / hkv)``, contiguous GQA groups); out: ``(Tq, hq, d)`` in q's dtype;
    lse: ``(hq, Tq)`` float32 (float64 for float64 inputs); dq/dk/dv: shapes of q/k/v.

Backends (choose explicitly with :func:`get_backend`; ``"auto"`` resolves deterministically from the
device and what is importable, and the resolved ``name`` is what experiments record):

* ``cpu-flash``: ATen's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``) per
  segment. Its ``is_causal`` is top-left aligned, so a segment with ``Lq < Lk`` is split into the
  full off-diagonal block and the square causal diagonal block, merged by lse (DESIGN.md sec. 7).
* ``math``: plain PyTorch (matmul, mask, softmax) per segment on any device; also the "plain
  PyTorch at the same precision" implementation of FlashAttention's tolerance rule.
* ``flash-attn``: ``flash_attn_varlen_func`` (CUDA, when the package imports).
* ``aten-flash``: the FlashAttention-2 kernels built into PyTorch's CUDA build, called through
  their ATen operators (``_flash_attention_forward`` / ``_flash_attention_backward``), the pair that
  ``torch.nn.attention.varlen`` wraps (pytorch/pytorch, ``torch/nn/attention/varlen.py`` at
  000459dc). The backward is the kernel's own, from the saved output and log-sum-exp.
* ``torch-varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, when present).

``flash-attn`` and ``torch-varlen`` compute the backward by re-running their forward under
autograd (one extra forward; their public backward entry points differ between versions), so
``auto`` prefers ``aten-flash`` on CUDA when flash-attn is missing.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Segments", "AttentionBackend", "get_backend", "BACKENDS"]


@dataclass(frozen=True, eq=False)
class Segments:
    """Packed varlen batch geometry.

    Attributes:
        q_lens, kv_lens: int64 ``(n,)``; ``1 <= q_len <= kv_len`` (bottom-right causal).
        cu_q, cu_k: int64 ``(n + 1,)`` cumulative offsets.

    Raises:
        ValueError: a non-positive length or ``q_len > kv_len`` (names the segment).
    """

    q_lens: np.ndarray
    kv_lens: np.ndarray

    def __post_init__(self) -> None:
        ql = np.ascontiguousarray(np.asarray(self.q_lens, dtype=np.int64).reshape(-1))
        kl = np.ascontiguousarray(np.asarray(self.kv_lens, dtype=np.int64).reshape(-1))
        if ql.shape != kl.shape:
            raise ValueError(f"q_lens has {len(ql)} segments but kv_lens has {len(kl)}")
        bad = np.nonzero((ql < 1) | (kl < ql))[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"segment {i}: need 1 <= q_len <= kv_len, got q_len={ql[i]}, kv_len={kl[i]}")
        object.__setattr__(self, "q_lens", ql)
        object.__setattr__(self, "kv_lens", kl)
        object.__setattr__(self, "cu_q", np.concatenate(([0], np.cumsum(ql))).astype(np.int64))
        object.__setattr__(self, "cu_k", np.concatenate(([0], np.cumsum(kl))).astype(np.int64))

    def __len__(self) -> int:
        return len(self.q_lens)

    @property
    def total_q(self) -> int:
        return int(self.cu_q[-1])

    @property
    def total_k(self) -> int:
        return int(self.cu_k[-1])

    @property
    def max_q(self) -> int:
        return int(self.q_lens.max()) if len(self) else 0

    @property
    def max_k(self) -> int:
        return int(self.kv_lens.max()) if len(self) else 0

    def runs(self) -> list[tuple[int, int, int, int]]:
        """Maximal runs of consecutive segments with the same ``(q_len, kv_len)``: ``(first segment,
        count, q_len, kv_len)`` each. A backend can run each as one batched call (a packed sequence
        of equal-length samples is one run); built once and cached."""
        got = self.__dict__.get("_runs")
        if got is None:
            n = len(self)
            change = np.ones(n, dtype=bool)
            change[1:] = (self.q_lens[1:] != self.q_lens[:-1]) | (self.kv_lens[1:] != self.kv_lens[:-1])
            first = np.nonzero(change)[0]
            count = np.diff(np.append(first, n))
            got = [(int(f), int(c), int(self.q_lens[f]), int(self.kv_lens[f])) for f, c in zip(first, count)]
            self.__dict__["_runs"] = got
        return got

    def cu_tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 cumulative offsets on ``device`` (what flash-attn style kernels take); built once
        per device, so a prepared runner moves them at its first call and never again."""
        cache = self.__dict__.setdefault("_cu_cache", {})
        key = str(device)
        if key not in cache:
            cache[key] = (torch.as_tensor(self.cu_q, dtype=torch.int32, device=device),
                          torch.as_tensor(self.cu_k, dtype=torch.int32, device=device))
        return cache[key]


def _check_inputs(q, k, v, seg: Segments) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be (tokens, heads, dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k ({k.shape[2]}) differ")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"kv heads {k.shape[1]} must divide query heads {q.shape[1]}")
    if q.shape[0] != seg.total_q or k.shape[0] != seg.total_k:
        raise ValueError(f"segments cover {seg.total_q} query / {seg.total_k} key rows, tensors have "
                         f"{q.shape[0]} / {k.shape[0]}")


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class AttentionBackend:
    """Interface: ``forward(q, k, v, seg, scale) -> (out, lse)``,
    ``backward(dout, q, k, v, out, lse, seg, scale) -> (dq, dk, dv)``. ``scale`` None = 1/sqrt(d)."""

    name = "abstract"
    views = False
    """Whether the runtime should hand this backend strided views of the buffers a run of segments
    reads instead of one packed varlen batch per chunk (:mod:`libra.runtime.calls`): True for
    the CPU backends, which run segment by segment anyway, False for one-launch GPU varlen kernels."""

    def forward(self, q, k, v, seg: Segments, scale: float | None = None):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, seg: Segments, scale: float | None = None):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# --------------------------------------------------------------------------------------------
# CPU flash (ATen) with the bottom-right split
# --------------------------------------------------------------------------------------------


def _batched(x: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """Rows of ``b`` consecutive segments of ``length`` tokens as a ``(b, length, H, D)`` view."""
    return x.view(b, length, *x.shape[1:])


class CpuFlashBackend(AttentionBackend):
    """ATen's CPU flash attention (float64, float32, bfloat16), one call per run of consecutive
    equal-geometry segments (:meth:`Segments.runs`: e.g. a packed sequence of equal-length samples
    is one batched call, ``(B, L, H, D)`` views of the packed rows, no copies in or out).

    A run whose queries do not see all their keys causally (``Lq < Lk``: a tile piece attending to
    its sample's prefix) is two calls on views of its keys -- the full off-diagonal block and the
    square causal diagonal block -- merged by lse (DESIGN.md sec. 7)."""

    name = "cpu-flash"
    views = True

    @staticmethod
    def _fwd(q, k, v, causal, scale):
        """``(B, L, H, D)`` views in; out ``(B, L, H, D)`` (ATen's layout) and lse ``(B, H, L)``."""
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=None, scale=scale)
        return out.transpose(1, 2), lse

    def forward(self, q, k, v, seg, scale=None):
        _check_inputs(q, k, v, seg)
        runs = seg.runs()
        if len(runs) == 1 and runs[0][2] == runs[0][3]:  # whole samples of one length: the kernel's output as is
            _, b, lq, _ = runs[0]
            o, lse = self._fwd(*(_batched(x, b, lq) for x in (q, k, v)), True, scale)
            return o.reshape(q.shape), lse.transpose(0, 1).reshape(q.shape[1], -1).to(_lse_dtype(q.dtype))
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=_lse_dtype(q.dtype), device=q.device)
        for i, b, lq, lk in runs:
            q0, q1, k0, k1 = int(seg.cu_q[i]), int(seg.cu_q[i + b]), int(seg.cu_k[i]), int(seg.cu_k[i + b])
            qs, ks, vs = _batched(q[q0:q1], b, lq), _batched(k[k0:k1], b, lk), _batched(v[k0:k1], b, lk)
            off = lk - lq  # keys every query row sees in full (the off-diagonal block)
            o_d, l_d = self._fwd(qs, ks[:, off:], vs[:, off:], True, scale)
            o_run, l_run = out[q0:q1].view(b, lq, *q.shape[1:]), lse[:, q0:q1].view(-1, b, lq).transpose(0, 1)
            if off == 0:
                o_run.copy_(o_d)
                l_run.copy_(l_d)
                continue
            o_f, l_f = self._fwd(qs, ks[:, :off], vs[:, :off], False, scale)
            # Both blocks give every row >= 1 visible key, so no lse = 0 "empty row" trap here.
            lse_m = torch.logaddexp(l_f.to(lse.dtype), l_d.to(lse.dtype))
            w_f = torch.exp(l_f - lse_m).transpose(1, 2).unsqueeze(-1)
            w_d = torch.exp(l_d - lse_m).transpose(1, 2).unsqueeze(-1)
            o_run.copy_(o_f.to(w_f.dtype) * w_f + o_d.to(w_d.dtype) * w_d)
            l_run.copy_(lse_m)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, seg, scale=None):
        _check_inputs(q, k, v, seg)
        if q.dtype in (torch.bfloat16, torch.float16):
            # FlashAttention accumulates dQ/dK/dV in float32; ATen's CPU kernel accumulates in the
            # input dtype across query blocks, which loses ~3x accuracy on long samples. Upcast.
            grads = self.backward(*(x.float() for x in (dout, q, k, v, out)), lse.float(), seg, scale)
            return tuple(g.to(q.dtype) for g in grads)
        runs = seg.runs()
        whole = len(runs) == 1 and runs[0][2] == runs[0][3]
        # every row of dq/dk/dv is written by exactly one block below (dq of a split run: the
        # diagonal block's copy, then the off-diagonal block's add), so nothing is zero-filled
        dq, dk, dv = (None, None, None) if whole else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        for i, b, lq, lk in runs:
            q0, q1, k0, k1 = int(seg.cu_q[i]), int(seg.cu_q[i + b]), int(seg.cu_k[i]), int(seg.cu_k[i + b])
            qs, ks, vs = _batched(q[q0:q1], b, lq), _batched(k[k0:k1], b, lk), _batched(v[k0:k1], b, lk)
            do_, o_ = _batched(dout[q0:q1], b, lq), _batched(out[q0:q1], b, lq)
            l_ = lse[:, q0:q1].reshape(-1, b, lq).transpose(0, 1)
            off = lk - lq
            # With the merged out and lse, each block's backward gives exactly its share of the
            # gradient (the softmax normaliser is the global one), as in ring attention.
            gq, gk, gv = self._bwd(do_, qs, ks[:, off:], vs[:, off:], o_, l_, True, scale)
            if whole:
                return gq.reshape(q.shape), gk.reshape(k.shape), gv.reshape(v.shape)
            dq[q0:q1].view(gq.shape).copy_(gq)
            dk[k0:k1].view(b, lk, *k.shape[1:])[:, off:].copy_(gk)
            dv[k0:k1].view(b, lk, *v.shape[1:])[:, off:].copy_(gv)
            if off:
                gq, gk, gv = self._bwd(do_, qs, ks[:, :off], vs[:, :off], o_, l_, False, scale)
                dq[q0:q1].view(gq.shape).add_(gq)
                dk[k0:k1].view(b, lk, *k.shape[1:])[:, :off].copy_(gk)
                dv[k0:k1].view(b, lk, *v.shape[1:])[:, :off].copy_(gv)
        return dq, dk, dv

    @staticmethod
    def _bwd(do_, q, k, v, o_, l_, causal, scale):
        """Gradients of one block as ``(B, L, H, D)`` views (ATen's layout)."""
        t = (x.transpose(1, 2) for x in (do_, q, k, v, o_))
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *t, l_, 0.0, causal, attn_mask=None, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)


# --------------------------------------------------------------------------------------------
# plain PyTorch
# --------------------------------------------------------------------------------------------


class MathBackend(AttentionBackend):
    """Plain PyTorch per segment: scores and products in the input dtype, softmax in float32
    (float64 for float64), like FlashAttention's ``attention_ref(upcast=False)``. Any device."""

    name = "math"
    views = True

    @staticmethod
    def _expand(x, group):
        return x if group == 1 else x.repeat_interleave(group, dim=1)

    @staticmethod
    def _mask(lq, lk, device):
        rows = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)
        return torch.arange(lk, device=device).unsqueeze(0) <= rows  # (lq, lk) True = visible

    def _probs(self, qs, ks, scale):
        acc = _lse_dtype(qs.dtype)
        scores = torch.einsum("qhd,khd->hqk", qs, ks).to(acc) * scale
        scores = scores.masked_fill(~self._mask(qs.shape[0], ks.shape[0], qs.device), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse

    def forward(self, q, k, v, seg, scale=None):
        _check_inputs(q, k, v, seg)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=_lse_dtype(q.dtype), device=q.device)
        for i in range(len(seg)):
            q0, q1, k0, k1 = (int(x) for x in (seg.cu_q[i], seg.cu_q[i + 1], seg.cu_k[i], seg.cu_k[i + 1]))
            p, lse_s = self._probs(q[q0:q1], self._expand(k[k0:k1], group), scale)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", p.to(q.dtype), self._expand(v[k0:k1], group))
            lse[:, q0:q1] = lse_s
        return out, lse

    def backward(self, dout, q, k, v, out, lse, seg, scale=None):
        _check_inputs(q, k, v, seg)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        group = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        acc = _lse_dtype(q.dtype)
        for i in range(len(seg)):
            q0, q1, k0, k1 = (int(x) for x in (seg.cu_q[i], seg.cu_q[i + 1], seg.cu_k[i], seg.cu_k[i + 1]))
            qs, do_ = q[q0:q1], dout[q0:q1]
            ks, vs = self._expand(k[k0:k1], group), self._expand(v[k0:k1], group)
            scores = torch.einsum("qhd,khd->hqk", qs, ks).to(acc) * scale
            scores = scores.masked_fill(~self._mask(q1 - q0, k1 - k0, q.device), float("-inf"))
            p = torch.exp(scores - lse[:, q0:q1].to(acc).unsqueeze(-1))
            dvs = torch.einsum("hqk,qhd->khd", p.to(q.dtype), do_)
            dp = torch.einsum("qhd,khd->hqk", do_, vs).to(acc)
            delta = (do_.to(acc) * out[q0:q1].to(acc)).sum(-1).transpose(0, 1).unsqueeze(-1)
            ds = (p * (dp - delta) * scale).to(q.dtype)
            dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, ks)
            dks = torch.einsum("hqk,qhd->khd", ds, qs)
            if group > 1:  # sum the gradients of a GQA group's query heads onto their KV head
                dks = dks.unflatten(1, (-1, group)).sum(2)
                dvs = dvs.unflatten(1, (-1, group)).sum(2)
            dk[k0:k1] += dks
            dv[k0:k1] += dvs
        return dq, dk, dv


# --------------------------------------------------------------------------------------------
# CUDA backends (unverified without a GPU)
# --------------------------------------------------------------------------------------------


class _RecomputeBackend(AttentionBackend):
    """Backward by re-running the autograd-enabled forward (portable across library versions)."""

    def _call(self, q, k, v, seg, scale, want_lse):
        raise NotImplementedError

    def forward(self, q, k, v, seg, scale=None):
        _check_inputs(q, k, v, seg)
        with torch.no_grad():
            out, lse = self._call(q, k, v, seg, scale, True)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, seg, scale=None):
        _check_inputs(q, k, v, seg)
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
            o = self._call(*leaves, seg, scale, False)
            return torch.autograd.grad(o, leaves, dout)


class FlashAttnBackend(_RecomputeBackend):
    """flash-attn 2.x ``flash_attn_varlen_func`` (causal is bottom-right per segment; native GQA)."""

    name = "flash-attn"

    def __init__(self):
        self._fn = importlib.import_module("flash_attn").flash_attn_varlen_func

    def _call(self, q, k, v, seg, scale, want_lse):
        cu_q, cu_k = seg.cu_tensors(q.device)
        res = self._fn(q, k, v, cu_q, cu_k, seg.max_q, seg.max_k, dropout_p=0.0, softmax_scale=scale,
                       causal=True, return_attn_probs=want_lse)
        return (res[0], res[1]) if want_lse else res


class TorchVarlenBackend(_RecomputeBackend):
    """``torch.nn.attention.varlen.varlen_attn`` on CUDA, causal via ``window_size=(-1, 0)``."""

    name = "torch-varlen"

    def __init__(self):
        mod = importlib.import_module("torch.nn.attention.varlen")
        self._fn = mod.varlen_attn
        self._aux = getattr(mod, "AuxRequest", None)
        params = inspect.signature(self._fn).parameters
        self._gqa = "enable_gqa" in params
        self._window = "window_size" in params
        if not self._window and "is_causal" not in params:
            raise ImportError("varlen_attn has neither window_size nor is_causal: cannot ask for causal")

    def _call(self, q, k, v, seg, scale, want_lse):
        cu_q, cu_k = seg.cu_tensors(q.device)
        kw = {"scale": scale}
        kw.update({"window_size": (-1, 0)} if self._window else {"is_causal": True})
        if q.shape[1] != k.shape[1]:
            if self._gqa:
                kw["enable_gqa"] = True
            else:
                g = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        if want_lse:
            if self._aux is None:
                raise RuntimeError("this torch's varlen_attn cannot return the log-sum-exp")
            out, aux = self._fn(q, k, v, cu_q, cu_k, seg.max_q, seg.max_k, return_aux=self._aux(lse=True), **kw)
            lse = aux.lse if hasattr(aux, "lse") else aux
            return out, lse
        return self._fn(q, k, v, cu_q, cu_k, seg.max_q, seg.max_k, **kw)


class AtenFlashBackend(AttentionBackend):
    """PyTorch's built-in FlashAttention-2 varlen kernels through their ATen operators.

    ``is_causal`` of FlashAttention's varlen kernels aligns each segment's queries to the end of its
    keys (bottom-right), the convention of :class:`Segments`; GQA is native (KV heads are read, and
    their gradients summed, by the kernel). The log-sum-exp is ``(hq, Tq)`` float32, as here. The
    operators are attributes so a test can stand in for them on CPU (their schemas are registered in
    every build, their kernels only in CUDA builds)."""

    name = "aten-flash"

    def __init__(self):
        ops = torch.ops.aten
        if not hasattr(ops, "_flash_attention_forward") or not hasattr(ops, "_flash_attention_backward"):
            raise ImportError("this torch has no aten::_flash_attention_forward/_backward operators")
        self.forward_op = ops._flash_attention_forward
        self.backward_op = ops._flash_attention_backward

    def forward(self, q, k, v, seg, scale=None):
        _check_inputs(q, k, v, seg)
        cu_q, cu_k = seg.cu_tensors(q.device)
        # positional: cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask
        res = self.forward_op(q, k, v, cu_q, cu_k, seg.max_q, seg.max_k, 0.0, True, False, scale=scale)
        return res[0], res[1]

    def backward(self, dout, q, k, v, out, lse, seg, scale=None):
        _check_inputs(q, k, v, seg)
        cu_q, cu_k = seg.cu_tensors(q.device)
        # rng_state and the unused philox offset only matter with dropout, which is always 0 here
        rng, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
        dq, dk, dv = self.backward_op(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, seg.max_q, seg.max_k,
                                      0.0, True, rng, unused, scale=scale)
        return dq, dk, dv


BACKENDS = {"cpu-flash": CpuFlashBackend, "math": MathBackend, "flash-attn": FlashAttnBackend,
            "aten-flash": AtenFlashBackend, "torch-varlen": TorchVarlenBackend}
CUDA_BACKENDS = ("flash-attn", "aten-flash", "torch-varlen")
"""The CUDA-only backends, in the order ``auto`` tries them."""


def _has_cpu_flash() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def resolve_backend_name(name: str, device) -> str:
    """Deterministic resolution of ``"auto"``: CUDA -> flash-attn, aten-flash, torch-varlen, math
    (first that is present); CPU -> cpu-flash, math.

    Raises:
        ValueError: unknown name, or a CUDA-only backend requested for a non-CUDA device.
    """
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            if importlib.util.find_spec("flash_attn") is not None:
                return "flash-attn"
            if hasattr(torch.ops.aten, "_flash_attention_backward") and torch.backends.cuda.is_flash_attention_available():
                return "aten-flash"
            if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
                return "torch-varlen"
            return "math"
        return "cpu-flash" if device.type == "cpu" and _has_cpu_flash() else "math"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {['auto', *BACKENDS]}")
    if name in CUDA_BACKENDS and device.type != "cuda":
        raise ValueError(f"backend {name!r} needs a CUDA device, got {device}")
    if name == "cpu-flash" and device.type != "cpu":
        raise ValueError(f"backend 'cpu-flash' runs on CPU only, got {device}")
    return name


def get_backend(name: str = "auto", device="cpu") -> AttentionBackend:
    """Instantiate a backend; ``.name`` is the resolved name to record.

    Raises:
        ValueError: see :func:`resolve_backend_name`; ImportError if the library is missing.
    """
    return BACKENDS[resolve_backend_name(name, device)]()
