"""Ulysses core attention over a CP group, as deployed (DeepSpeed-Ulysses style; Libra sec. 2.1).

Forward: one ``all_to_all_single`` turns the sequence-sharded layout (each CP rank: its ``S/CP``
tokens, all heads) into a head-sharded one (each rank: all ``S`` tokens, ``hq/CP`` query heads
and the KV heads they read), varlen causal attention over the packed sequence's samples, and a
second all-to-all back to the sequence layout. Backward (its own autograd.Function): dO takes the
forward's first all-to-all, the kernel backward runs on the saved head-sharded tensors, and dQ,
dK, dV take the way back; KV heads replicated to several ranks (``hkv < CP``, or a GQA group cut
by a head-shard boundary) have their gradients summed at the holder.

GQA: rank ``j`` receives exactly the KV heads its query heads read
(:meth:`libra.workload.AttentionShape.kv_head_range`). When its local query-head -> KV-head map is
the kernels' standard contiguous grouping (the common case: CP | hkv, or the shard inside one
group) the kernel runs on the received KV as is; otherwise (the shard starts or ends inside a GQA
group, e.g. hq=12, hkv=3, CP=2: rank 0's heads 0-5 read KV heads 0,0,0,0,1,1) the KV is expanded to
one head per query head for the kernel and dK/dV are summed back before they travel home.

A CP group of one rank (CP = 1, e.g. the 2-rank DP CPU microbench) already holds the whole
sequence and every head: it runs the kernel on its inputs with no all-to-all and no packing
copies, as a deployment would, so the baseline carries no runtime overhead that Libra is then
compared against.

Shapes: ``q (S/CP, hq, d)``, ``k, v (S/CP, hkv, d)`` in, ``out (S/CP, hq, d)``.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from baselines.ulysses import check_ulysses_heads
from libra.runtime.attention import RunnerFunction
from libra.runtime.executor import MemoryMeter
from libra.runtime.groups import CollectiveTimeoutError, PoolGroup, wait_all
from libra.runtime.kernels import AttentionBackend, Segments, get_backend
from libra.workload import AttentionShape


def local_kv_map(shape: AttentionShape, q_head_start: int, q_head_end: int):
    """KV heads read by query heads ``[q_head_start, q_head_end)`` and the local map between them.

    Returns:
        ``(kv_start, kv_end, index)``: the KV head range (:meth:`AttentionShape.kv_head_range`) and
        ``None`` when local query head ``i`` reads local KV head ``i // (qh / kvh)`` (the kernels'
        contiguous grouping), else the int64 array of local KV heads, one per local query head.
    """
    a, b = shape.kv_head_range(q_head_start, q_head_end)
    qh, kvh = q_head_end - q_head_start, b - a
    index = np.arange(q_head_start, q_head_end, dtype=np.int64) // shape.group_size - a
    if qh % kvh == 0 and np.array_equal(index, np.arange(qh) // (qh // kvh)):
        return a, b, None
    return a, b, index


class UlyssesAttention:
    """Prepared Ulysses attention of one CP group and one packed sequence.

    Args:
        sample_lengths: the packed sequence's sample lengths (sum = ``S``, ``CP | S``).
        group: the CP group (group rank ``r`` holds tokens ``[r S/CP, (r+1) S/CP)``).
        num_q_heads, num_kv_heads: head geometry; ``CP | hq`` (the planner's condition,
            :func:`baselines.ulysses.check_ulysses_heads`) and ``hkv | hq``; a head shard may cut
            a GQA group.
        backend: kernel backend name or instance.

    Raises:
        ValueError: ``CP`` not dividing ``hq`` or ``S``, ``hkv`` not dividing ``hq``, bad lengths.
    """

    def __init__(self, sample_lengths, group: PoolGroup, num_q_heads: int, num_kv_heads: int,
                 backend: str | AttentionBackend = "auto", scale: float | None = None, device="cpu"):
        lengths = np.asarray(sample_lengths, dtype=np.int64).reshape(-1)
        if not len(lengths) or lengths.min() < 1:
            raise ValueError(f"sample lengths must be positive, got {lengths.tolist()[:8]}")
        C, S = group.size, int(lengths.sum())
        # refuse exactly what the planner refuses, in its order: the shape (hkv | hq), CP | hq, CP | S
        shape = AttentionShape(num_q_heads=int(num_q_heads), num_kv_heads=int(num_kv_heads), head_dim=1)
        check_ulysses_heads(shape.num_q_heads, C)
        if S % C:
            raise ValueError(f"CP={C} must divide the packed sequence length {S}")
        self.group, self.C, self.S, self.n = group, C, S, S // C
        self.hq, self.hkv, self.qh = num_q_heads, num_kv_heads, num_q_heads // C
        # KV heads each rank's query heads read, [kv_lo[j], kv_hi[j]), and this rank's local
        # query-head -> KV-head index when it is not the kernels' contiguous grouping (else None)
        maps = [local_kv_map(shape, j * self.qh, (j + 1) * self.qh) for j in range(C)]
        self.kv_lo = [m[0] for m in maps]
        self.kv_hi = [m[1] for m in maps]
        index = maps[group.rank][2]
        self.kv_index = None if index is None else torch.as_tensor(index, device=device)
        self.seg = Segments(lengths, lengths)
        self.backend = backend if isinstance(backend, AttentionBackend) else get_backend(backend, device)
        self.scale = scale
        self.stats = {"forward_s": 0.0, "backward_s": 0.0, "compute_s": 0.0, "comm_wait_s": 0.0,
                      "peak_transient_bytes": 0, "sent_bytes": 0, "calls": 0}

    def _a2a(self, send: torch.Tensor, send_rows, recv_rows, what: str) -> torch.Tensor:
        recv = send.new_empty(int(sum(recv_rows)), send.shape[-1])
        me = self.group.rank  # bytes leaving this rank (its own split stays local)
        self.stats["sent_bytes"] += (int(sum(send_rows)) - int(send_rows[me])) * send.shape[-1] * send.element_size()
        try:
            work = dist.all_to_all_single(recv, send, output_split_sizes=list(recv_rows),
                                          input_split_sizes=list(send_rows), group=self.group.group, async_op=True)
        except RuntimeError as exc:
            raise CollectiveTimeoutError(f"worker {self.group.worker}: Ulysses {what} failed: {exc}") from exc
        t0 = time.perf_counter()
        wait_all([work], self.group, f"Ulysses {what}")
        self.stats["comm_wait_s"] += time.perf_counter() - t0
        return recv

    def _expand(self, kf, vf, meter):
        """K, V as the kernel reads them: as received, or one KV head per local query head."""
        if self.kv_index is None:
            return kf, vf
        idx = self.kv_index.to(kf.device)
        kx, vx = kf.index_select(1, idx), vf.index_select(1, idx)
        meter.alloc(kx, vx)
        return kx, vx

    def _reduce(self, gx, like):
        """Sum the per-query-head gradient ``gx (T, qh, d)`` onto ``like``'s KV heads (``T, kvh, d``)."""
        acc = torch.float32 if gx.dtype in (torch.float16, torch.bfloat16) else gx.dtype
        out = torch.zeros(like.shape, dtype=acc, device=gx.device)
        out.index_add_(1, self.kv_index.to(gx.device), gx.to(acc))
        return out.to(like.dtype)

    def _to_heads(self, q, k, v, meter):
        """Sequence-sharded q, k, v -> this rank's head shard of the whole sequence (first all-to-all)."""
        C, n, qh, d, me = self.C, self.n, self.qh, q.shape[-1], self.group.rank
        if C == 1:  # a CP group of one holds the whole sequence and every head: no all-to-all, no copy
            return q, k, v
        parts, rows = [], []
        for j in range(C):  # one packed buffer per destination rank: its Q heads, then its K and V heads
            a, b = self.kv_lo[j], self.kv_hi[j]
            parts += [q[:, j * qh:(j + 1) * qh].reshape(-1, d), k[:, a:b].reshape(-1, d), v[:, a:b].reshape(-1, d)]
            rows.append(n * (qh + 2 * (b - a)))
        send = torch.cat(parts)
        kvh = self.kv_hi[me] - self.kv_lo[me]
        recv = self._a2a(send, rows, [n * (qh + 2 * kvh)] * C, "sequence-to-head all-to-all")
        meter.alloc(send, recv)
        meter.free(send)
        del send
        blocks = recv.view(C, -1, d)
        qf = blocks[:, :n * qh].reshape(C * n, qh, d).contiguous()
        kf = blocks[:, n * qh:n * (qh + kvh)].reshape(C * n, kvh, d).contiguous()
        vf = blocks[:, n * (qh + kvh):].reshape(C * n, kvh, d).contiguous()
        meter.alloc(qf, kf, vf)
        meter.free(recv)
        return qf, kf, vf

    def forward(self, q, k, v):
        t0 = time.perf_counter()
        C, n, qh, d = self.C, self.n, self.qh, q.shape[-1]
        meter = MemoryMeter()
        qf, kf, vf = self._to_heads(q, k, v, meter)
        tc = time.perf_counter()
        kx, vx = self._expand(kf, vf, meter)
        out_full, lse = self.backend.forward(qf, kx, vx, self.seg, self.scale)
        self.stats["compute_s"] += time.perf_counter() - tc
        if kx is not kf:
            meter.free(kx, vx)
        del kx, vx
        meter.alloc(out_full, lse)
        if C == 1:
            out = out_full
        else:
            send = out_full.reshape(-1, d)  # token-major: rank i's tokens are rows [i n qh, (i+1) n qh)
            recv = self._a2a(send, [n * qh] * C, [n * qh] * C, "head-to-sequence all-to-all")
            meter.alloc(recv)
            out = recv.view(C, n, qh, d).permute(1, 0, 2, 3).reshape(n, self.hq, d)
            meter.free(recv)
        self.stats["forward_s"] += time.perf_counter() - t0
        self.stats["calls"] += 1
        # head-sharded q, k, v, out and lse are saved for backward (RunnerFunction: save_for_backward)
        return out, [qf, kf, vf, out_full, lse], {"meter": meter}

    def backward(self, dout, q, k, v, tensors, meta):
        """``(dq, dk, dv)`` from :meth:`forward`'s ``tensors`` (possibly copies; consumed) and ``meta``."""
        t0 = time.perf_counter()
        C, n, qh, d = self.C, self.n, self.qh, dout.shape[-1]
        meter = meta["meter"]
        qf, kf, vf, out_full, lse = tensors
        tensors.clear()
        if C == 1:
            do_full = dout
        else:
            send = torch.cat([dout[:, j * qh:(j + 1) * qh].reshape(-1, d) for j in range(C)])
            recv = self._a2a(send, [n * qh] * C, [n * qh] * C, "dO all-to-all")
            meter.alloc(send, recv)
            meter.free(send)
            do_full = recv.view(C, n, qh, d).reshape(C * n, qh, d)
        tc = time.perf_counter()
        kx, vx = self._expand(kf, vf, meter)
        gq, gk, gv = self.backend.backward(do_full, qf, kx, vx, out_full, lse, self.seg, self.scale)
        meter.alloc(gq, gk, gv)
        if kx is not kf:  # one KV head per query head: sum dK/dV back onto the received KV heads
            meter.free(kx, vx, gk, gv)
            gk, gv = self._reduce(gk, kf), self._reduce(gv, vf)
            meter.alloc(gk, gv)
        self.stats["compute_s"] += time.perf_counter() - tc
        meter.free(*([] if C == 1 else [do_full]), qf, kf, vf, out_full, lse)
        del qf, kf, vf, kx, vx, out_full, lse
        dq, dk, dv = (gq, gk, gv) if C == 1 else self._to_sequence_grads(gq, gk, gv, dout, k, v, meter)
        meta.clear()
        self.stats["backward_s"] += time.perf_counter() - t0
        self.stats["peak_transient_bytes"] = max(self.stats["peak_transient_bytes"], meter.peak)
        return dq, dk, dv

    def _to_sequence_grads(self, gq, gk, gv, dout, k, v, meter):
        """This rank's head-shard gradients -> dq, dk, dv of its own tokens (gradient all-to-all;
        KV heads replicated to several ranks have their gradients summed here)."""
        C, n, qh, d = self.C, self.n, self.qh, dout.shape[-1]
        kvh = gk.shape[1]
        parts, rows = [], []
        for i in range(C):  # to rank i: dQ, dK, dV of its tokens for this rank's heads
            sl = slice(i * n, (i + 1) * n)
            parts += [gq[sl].reshape(-1, d), gk[sl].reshape(-1, d), gv[sl].reshape(-1, d)]
            rows.append(n * (qh + 2 * kvh))
        send = torch.cat(parts)
        recv_rows = [n * (qh + 2 * (self.kv_hi[j] - self.kv_lo[j])) for j in range(C)]
        recv = self._a2a(send, rows, recv_rows, "gradient all-to-all")
        meter.alloc(send, recv)
        dq, dk, dv = torch.empty_like(dout), torch.zeros_like(k), torch.zeros_like(v)
        off = 0
        for j in range(C):
            a, b = self.kv_lo[j], self.kv_hi[j]
            blk = recv[off:off + recv_rows[j]]
            dq[:, j * qh:(j + 1) * qh] = blk[:n * qh].view(n, qh, d)
            dk[:, a:b] += blk[n * qh:n * (qh + b - a)].view(n, b - a, d)   # replicated KV heads sum here
            dv[:, a:b] += blk[n * (qh + b - a):].view(n, b - a, d)
            off += recv_rows[j]
        meter.free(send, recv, gq, gk, gv)
        return dq, dk, dv

    def __call__(self, q, k, v):
        if q.shape[0] != self.n or k.shape[0] != self.n:
            raise ValueError(f"each CP rank holds S/CP={self.n} tokens, got q {tuple(q.shape)}, k {tuple(k.shape)}")
        if q.shape[1] != self.hq or k.shape[1] != self.hkv or k.shape != v.shape:
            raise ValueError(f"expected q (n, {self.hq}, d), k/v (n, {self.hkv}, d); got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        return RunnerFunction.apply(q, k, v, self)


def ulysses_attention(q, k, v, sample_lengths, group: PoolGroup, **kwargs) -> torch.Tensor:
    """One-shot Ulysses core attention (see :class:`UlyssesAttention`)."""
    return UlyssesAttention(sample_lengths, group, q.shape[1], k.shape[1], **kwargs)(q, k, v)
