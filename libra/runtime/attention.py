"""``libra_attention``: drop-in core attention of a CP group that executes a Libra Plan.

Takes this worker's ``q (tokens, hq, d)``, ``k, v (tokens, hkv, d)`` in the pre-attention layout
(its token range of its packed sequence, all heads) and returns ``out (tokens, hq, d)`` in the same
layout. Forward: dispatch Q and KV, compute the SH-Tiles placed here, return outputs to their
Q-homes. Backward (Libra sec. 4.3.3): dO follows the Q path, dQ the output path, dK/dV retrace the
KV fetches and are summed at their holders.

TAP Pipeliner (Libra sec. 4.4): each pass executes the events of the pool's
:class:`~libra.tap.pipeline.ChunkSchedule` in order -- the list the cost model prices. With ``M``
head chunks, chunk ``i + 1``'s dispatch is in flight while chunk ``i`` computes, and chunk ``i``'s
return is issued right after it, together with chunk ``i + 2``'s dispatch as one group (an
exchange), so both overlap chunk ``i + 1``'s compute; only chunk 0's dispatch and chunk ``M - 1``'s
return are exposed. ``M = 1`` is the non-overlapped execution. A plan with KV
relays (KV rows of ``TransferTable.hop > 0``) runs its hop rounds inside exactly those two exposed transfers: hops
``1..H`` right after chunk 0's dispatch (each forwards what earlier rounds delivered) and hops
``H..1`` of dK/dV right before chunk ``M - 1``'s return (each relay sums its children's in first),
as the cost model prices them. All transient
buffers (packed sends, receives, kernel inputs) are released by the end of backward;
:class:`RuntimeStats` records their peak.

Usage::

    attn = prepare(plan, groups.pool)          # digest agreement check + compile, once per plan
    out = attn(q, k, v)                        # autograd-aware; or libra_attention(q, k, v, plan, group)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from libra.plan import Plan, PoolPlan
from libra.runtime.agreement import check_finite_inputs, check_plan_agreement
from libra.runtime.blocks import (
    DK,
    DO,
    DQ,
    DV,
    OUT,
    K,
    Q,
    V,
    do_recv_key,
    grad_recv_key,
    recv_key,
    relay_grad_key,
    relay_key,
)
from libra.runtime.calls import (
    call_backward,
    call_forward,
    closed_call,
    kv_grad_blocks,
    rekey_messages,
    split_calls,
)
from libra.runtime.executor import COMM_MODES, Exchanger, MemoryMeter, copy_blocks
from libra.runtime.groups import PoolGroup
from libra.runtime.kernels import AttentionBackend, get_backend
from libra.runtime.program import WorkerProgram, compile_worker
from libra.tap.pipeline import (
    BWD_DISPATCH,
    BWD_RETURN,
    COMPUTE,
    FWD_DISPATCH,
    FWD_RETURN,
    ISSUE_DISPATCH,
    ISSUE_EXCHANGE,
    ISSUE_RETURN,
    WAIT_DISPATCH,
    WAIT_RETURN,
)
from libra.workload import AttentionShape

RELAY_TAG = 50_000
"""Tag offset of KV relay round ``h`` (``RELAY_TAG + h`` in place of a chunk index; chunks stay below)."""


@dataclass
class RuntimeStats:
    """Measurements of the last calls (seconds, bytes); reset with :meth:`reset`."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    compute_s: float = 0.0
    comm_wait_s: float = 0.0
    issue_s: float = 0.0  # host time issuing messages: packing send buffers, posting sends and receives
    unpack_s: float = 0.0  # host time copying (or adding) received returns into outputs and gradients
    peak_transient_bytes: int = 0
    held_for_backward_bytes: int = 0
    unreleased_bytes: int = 0
    sent_bytes: dict = field(default_factory=dict)
    calls: int = 0

    def reset(self) -> None:
        self.__init__()


def as_pool_group(group, workers: tuple[int, ...], timeout_s: float = 60.0) -> PoolGroup:
    """Wrap a raw ProcessGroup whose rank ``i`` is worker ``workers[i]`` (a PoolGroup passes through).

    Raises:
        ValueError: the group's size differs from ``len(workers)``.
    """
    if isinstance(group, PoolGroup):
        if tuple(group.workers) != tuple(workers):
            raise ValueError(f"group workers {list(group.workers)} differ from the pool's {list(workers)}")
        return group
    size = dist.get_world_size(group)
    if size != len(workers):
        raise ValueError(f"process group has {size} ranks but the pool has {len(workers)} workers")
    ranks = tuple(dist.get_global_rank(group, i) for i in range(size)) if group is not None else tuple(range(size))
    return PoolGroup(group, tuple(workers), ranks, workers[dist.get_rank(group)], timeout_s)


class LibraAttention:
    """A prepared ``libra_attention`` for one plan on one worker (see :func:`prepare`)."""

    def __init__(self, program: WorkerProgram, group: PoolGroup, backend: AttentionBackend,
                 comm: str = "p2p", scale: float | None = None, check_finite: bool = True):
        self.program, self.group, self.backend = program, group, backend
        self.exchanger = Exchanger(group, comm)
        self.scale, self.check_finite = scale, check_finite
        self.stats = RuntimeStats()
        # each chunk's kernel calls (on views of the buffers they read where the backend runs
        # segment by segment anyway) and the messages reading their outputs; built once, so no
        # index construction is on the step's path
        self._calls = [split_calls(kern, m, getattr(backend, "views", False)) for m, kern in enumerate(program.kernels)]
        order = [m for ev, m in program.schedule.events if ev == COMPUTE]
        closed = closed_call(program, self._calls, order[0]) if order else None
        if closed is not None:  # exchanges nothing: one call at the first compute event, no copies
            self._calls = [[closed] if m == order[0] else [] for m in range(program.chunks)]
        self._closed = closed
        self._messages = rekey_messages(program.messages, self._calls)
        self._kv_blocks = None if closed else kv_grad_blocks(self._calls, program.all_messages(), order,
                                                             program.num_local, program.shape.num_kv_heads)

    # -- checks -------------------------------------------------------------------------------
    def _check(self, q, k, v) -> None:
        s, n = self.program.shape, self.program.num_local
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError(f"q, k, v must be (tokens, heads, dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        if tuple(q.shape[:2]) != (n, s.num_q_heads) or tuple(k.shape[:2]) != (n, s.num_kv_heads) \
                or k.shape != v.shape or q.shape[2] != k.shape[2]:
            raise ValueError(f"worker {self.program.worker} holds {n} tokens: expected q ({n}, {s.num_q_heads}, d) "
                             f"and k, v ({n}, {s.num_kv_heads}, d); got {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        if q.shape[2] != s.head_dim:
            raise ValueError(f"head_dim {q.shape[2]} differs from the plan's {s.head_dim}")
        if self.check_finite:
            check_finite_inputs({"q": q, "k": k, "v": v}, self.group)

    # -- forward ------------------------------------------------------------------------------
    def _run_pass(self, phases: tuple[str, str], recv_of, stores: dict, meter: MemoryMeter,
                  compute, unpack, after_return=None) -> None:
        """Execute one pass as the pool's :class:`~libra.tap.pipeline.ChunkSchedule` lists it
        (Libra sec. 4.4): the same events the cost model prices, in the same order.

        ``phases``: (dispatch, return) phase names; chunk ``m``'s received dispatch is stored under
        ``recv_of(m)``. ``compute(m)`` runs chunk ``m``'s kernels, ``unpack(m, recv)`` consumes its
        returned rows, ``after_return(m)`` (optional) runs once its return is issued. Host seconds
        waiting, computing, issuing and unpacking are added to :attr:`stats`.
        """
        prog, ex, messages = self.program, self.exchanger, self._messages
        disp, ret = phases
        pending, returns, wait_s, compute_s, issue_s, unpack_s = {}, {}, 0.0, 0.0, 0.0, 0.0
        for ev, m in prog.schedule.events:
            t0 = time.perf_counter()
            if ev == ISSUE_DISPATCH:
                pending[m] = ex.issue(messages[disp][m], stores, stores[Q], disp, m, meter)
                issue_s += time.perf_counter() - t0
                if m == 0 and prog.relays.get(disp):  # relay rounds forward what chunk 0 delivered
                    tw = time.perf_counter()
                    stores[recv_of(0)] = ex.finish(pending.pop(0), meter)
                    self._relay_dispatch(stores, meter)
                    wait_s += time.perf_counter() - tw
            elif ev == WAIT_DISPATCH:
                if m in pending:
                    stores[recv_of(m)] = ex.finish(pending.pop(m), meter)
                wait_s += time.perf_counter() - t0
            elif ev == COMPUTE:
                compute(m)
                compute_s += time.perf_counter() - t0
            elif ev == ISSUE_RETURN:
                if m == prog.chunks - 1 and prog.relays.get(ret):  # children's dK/dV reach relays first
                    self._relay_returns(stores, meter)
                    wait_s += time.perf_counter() - t0
                    t0 = time.perf_counter()
                returns[m] = ex.issue(messages[ret][m], stores, stores[Q], ret, m, meter)
                issue_s += time.perf_counter() - t0
                if after_return is not None:
                    after_return(m)
            elif ev == ISSUE_EXCHANGE:  # chunk m's return and chunk m + 2's dispatch, one group
                returns[m], pending[m + 2] = ex.issue_group(
                    [(messages[ret][m], ret, m), (messages[disp][m + 2], disp, m + 2)], stores, stores[Q], meter)
                issue_s += time.perf_counter() - t0
                if after_return is not None:
                    after_return(m)
            elif ev == WAIT_RETURN:
                recv = ex.finish(returns.pop(m), meter)
                t1 = time.perf_counter()
                wait_s += t1 - t0
                unpack(m, recv)
                meter.free(recv)
                unpack_s += time.perf_counter() - t1
        st = self.stats
        st.comm_wait_s, st.compute_s = st.comm_wait_s + wait_s, st.compute_s + compute_s
        st.issue_s, st.unpack_s = st.issue_s + issue_s, st.unpack_s + unpack_s

    def _relay_dispatch(self, stores: dict, meter: MemoryMeter) -> None:
        """KV relay rounds ``1..H`` (the plan's KV rows of hop ``1..H``), in order: each packs from buffers the
        earlier rounds filled, so each is finished before the next starts."""
        for h, msg in enumerate(self.program.relays[FWD_DISPATCH], start=1):
            handle = self.exchanger.issue(msg, stores, stores[Q], FWD_DISPATCH, RELAY_TAG + h, meter)
            stores[relay_key(h)] = self.exchanger.finish(handle, meter)

    def _relay_returns(self, stores: dict, meter: MemoryMeter) -> None:
        """dK/dV relay rounds ``H..1``: each adds what comes back into this worker's dK/dV or into
        the gradient of the KV it received (forwarded on by a later round or chunk ``M - 1``'s return)."""
        H = self.program.hops
        for i, msg in enumerate(self.program.relays[BWD_RETURN]):
            handle = self.exchanger.issue(msg, stores, stores[Q], BWD_RETURN, RELAY_TAG + H - i, meter)
            recv = self.exchanger.finish(handle, meter)
            copy_blocks(recv, msg.unpack_add, stores, reverse=True, add=True)
            meter.free(recv)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Non-autograd forward. Returns ``(out, tensors, meta)`` for :meth:`backward`.

        ``tensors``: every tensor backward needs besides q, k, v (chunk ``m``'s received dispatch
        buffer and, where it computes, its kernel output and lse), in the order of
        ``meta["names"]``; :class:`RunnerFunction` saves them with ``save_for_backward``.
        ``meta``: non-tensor state (names, per-chunk Segments, the memory meter).
        """
        t0 = time.perf_counter()
        prog, meter = self.program, MemoryMeter()
        d, M = q.shape[-1], prog.chunks
        stores = {Q: q.reshape(-1, d), K: k.reshape(-1, d), V: v.reshape(-1, d)}
        out = None if self._closed else torch.empty_like(q)  # closed: the kernel's output is out
        out_rows = None if out is None else out.view(-1, d)
        saved = {}

        def compute(m):
            for c, call in enumerate(self._calls[m]):
                saved[("o", m, c)], saved[("lse", m, c)] = call_forward(call, self.backend, stores, meter, self.scale,
                                                                      out_rows)

        def unpack(m, recv):
            copy_blocks(recv, self._messages[FWD_RETURN][m].unpack, {OUT: out_rows}, reverse=True)

        self._run_pass((FWD_DISPATCH, FWD_RETURN), recv_key, stores, meter, compute, unpack)
        if out is None:
            out = saved[("o", self._closed.key.chunk, 0)].view_as(q)
        held = {**{("recv", m): stores[recv_key(m)] for m in range(M)},
                **{("relay", h): stores[relay_key(h)] for h in range(1, prog.hops + 1)}, **saved}
        st = self.stats
        st.held_for_backward_bytes = meter.current
        st.forward_s += time.perf_counter() - t0
        st.calls += 1
        return out, list(held.values()), {"names": list(held), "meter": meter}

    # -- backward -----------------------------------------------------------------------------
    def backward(self, dout: torch.Tensor, q, k, v, tensors: list, meta: dict) -> tuple[torch.Tensor, ...]:
        """Gradients ``(dq, dk, dv)`` in the pre-attention layout from :meth:`forward`'s ``tensors``
        and ``meta`` (consumed: both are emptied). The tensors may be copies of the forward's (e.g.
        unpacked by ``saved_tensors_hooks``); only their values and shapes are used."""
        t0 = time.perf_counter()
        prog, meter = self.program, meta["meter"]
        d, M = q.shape[-1], prog.chunks
        if len(tensors) != len(meta["names"]):
            raise RuntimeError(f"backward got {len(tensors)} saved tensors, forward saved {len(meta['names'])}")
        saved = {name: t.contiguous() for name, t in zip(meta["names"], tensors)}
        tensors.clear()
        stores = {Q: q.reshape(-1, d), K: k.reshape(-1, d), V: v.reshape(-1, d), DO: dout.reshape(-1, d),
                  **{recv_key(m): saved.pop(("recv", m)) for m in range(M)},
                  **{relay_key(h): saved.pop(("relay", h)) for h in range(1, prog.hops + 1)}}
        dq, dk, dv, grads = self._grad_buffers(q, k, v, stores, meter)
        if grads is not None:  # relay rounds add into dk / dv and the fetched-KV gradients by key
            stores.update({DK: dk.view(-1, d), DV: dv.view(-1, d)})
        dq_rows = None if dq is None else dq.view(-1, d)
        closed_grads = []

        def compute(m):
            for c, call in enumerate(self._calls[m]):
                got = call_backward(call, self.backend, stores, meter, self.scale,
                                    (saved.pop(("o", m, c)), saved.pop(("lse", m, c))), grads,
                                    self._kv_blocks and self._kv_blocks[(m, c)])
                closed_grads.extend(got if grads is None else ())

        def after_return(m):
            for call in self._calls[m]:
                meter.free(stores.pop(call.key))
            meter.free(stores.pop(do_recv_key(m)))

        def unpack(m, recv):
            if grads is None:  # closed: nothing comes back
                return
            msg = self._messages[BWD_RETURN][m]
            copy_blocks(recv, msg.unpack, {DQ: dq_rows}, reverse=True)
            copy_blocks(recv, msg.unpack_add, {DK: grads["k"][K], DV: grads["v"][V]}, reverse=True, add=True)

        self._run_pass((BWD_DISPATCH, BWD_RETURN), do_recv_key, stores, meter, compute, unpack, after_return)
        if grads is None:  # closed: the one call's gradients are dq, dk, dv
            dq, dk, dv = (g.view_as(x) for g, x in zip(closed_grads, (q, k, v)))
        for m in range(M):
            meter.free(stores.pop(recv_key(m)), stores.pop(grad_recv_key(m)))
        for h in range(1, prog.hops + 1):
            meter.free(stores.pop(relay_key(h)), stores.pop(relay_grad_key(h)))
        meta.clear()
        st = self.stats
        st.backward_s += time.perf_counter() - t0
        st.peak_transient_bytes = max(st.peak_transient_bytes, meter.peak)
        st.unreleased_bytes = meter.current  # 0 unless a transient buffer outlived the call
        el = q.element_size() * d
        st.sent_bytes = {p: rows * el for p, rows in prog.comm_rows().items()}
        return dq, dk, dv

    def _grad_buffers(self, q, k, v, stores: dict, meter: MemoryMeter):
        """``(dq, dk, dv, grads)``: the gradient tensors and, for the calls' scatter, every source
        buffer's gradient buffer (``grads["q"]``: local q; ``grads["k"]``, ``grads["v"]``: local k/v
        and fetched KV); all
        None for a closed worker (:func:`~libra.runtime.calls.closed_call`), whose one call's
        gradients are dq, dk, dv themselves."""
        M, H = self.program.chunks, self.program.hops
        for m in range(M):
            stores[grad_recv_key(m)] = torch.zeros_like(stores[recv_key(m)])
            meter.alloc(stores[grad_recv_key(m)])
        for h in range(1, H + 1):
            stores[relay_grad_key(h)] = torch.zeros_like(stores[relay_key(h)])
            meter.alloc(stores[relay_grad_key(h)])
        if self._closed is not None:
            return None, None, None, None
        # every dq row is written exactly once (a local kernel's dQ or a returned one: compile_worker
        # checked each output row is returned once), so it is not zero-filled; dK/dV rows sum the
        # gradients of every tile that read them (not zero-filled either where calls.kv_grad_blocks
        # finds each written first by a copy)
        dq = torch.empty_like(q)
        dk, dv = ((torch.empty_like(k), torch.empty_like(v)) if self._kv_blocks is not None
                  else (torch.zeros_like(k), torch.zeros_like(v)))
        d = q.shape[-1]
        fetched = {**{recv_key(m): stores[grad_recv_key(m)] for m in range(M)},
                   **{relay_key(h): stores[relay_grad_key(h)] for h in range(1, H + 1)}}
        return dq, dk, dv, {"q": {Q: dq.view(-1, d)}, "k": {K: dk.view(-1, d), **fetched},
                            "v": {V: dv.view(-1, d), **fetched}}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._check(q, k, v)
        return RunnerFunction.apply(q, k, v, self)


class RunnerFunction(torch.autograd.Function):
    """Autograd bridge for a core-attention runner with an explicit backward.

    The runner has ``forward(q, k, v) -> (out, tensors, meta)`` and ``backward(dout, q, k, v,
    tensors, meta) -> (dq, dk, dv)``. Every tensor backward needs (q, k, v and the runner's
    ``tensors``: fetched buffers, kernel outputs, lse) goes through ``ctx.save_for_backward``, so
    ``torch.autograd.graph.saved_tensors_hooks`` (CPU offload) and non-reentrant activation
    checkpointing see them; only non-tensor ``meta`` (segment descriptors, names, the memory
    meter) stays on ctx. Used by :class:`LibraAttention` and by the Ulysses runtime in ``baselines/``.
    """

    @staticmethod
    def forward(ctx, q, k, v, runner: LibraAttention):
        q, k, v = (x.contiguous() for x in (q, k, v))
        out, tensors, meta = runner.forward(q.detach(), k.detach(), v.detach())
        ctx.runner, ctx.meta = runner, meta
        ctx.save_for_backward(q, k, v, *tensors)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, *tensors = ctx.saved_tensors  # possibly copies (saved_tensors_hooks unpack)
        grads = ctx.runner.backward(dout.contiguous(), q, k, v, tensors, ctx.meta)
        ctx.meta = None
        return (*grads, None)


@dataclass(frozen=True)
class RunnerConfig:
    """How one worker executes a plan (:func:`prepare`'s options besides the plan's own ``shape``
    and ``chunks``); checked once, here, before any work.

    Attributes:
        backend: kernel backend name (``"auto"`` resolves per device) or instance.
        comm: ``"p2p"`` (batch_isend_irecv) or ``"a2a"`` (all_to_all_single).
        scale: softmax scale (``None``: ``1 / sqrt(head_dim)``); a positive finite number.
        check_finite: all-reduce a non-finite flag of q, k, v before each forward.
        verify_plan: all_gather the plan digest and the execution options first
            (:func:`execution_options`).
        device: where ``"auto"`` resolves the backend (``None``: ``"cuda"`` on an NCCL group, else
            ``"cpu"``).

    Raises:
        ValueError: ``scale`` not a positive finite number, or an unknown ``comm`` mode.
    """

    backend: str | AttentionBackend = "auto"
    comm: str = "p2p"
    scale: float | None = None
    check_finite: bool = True
    verify_plan: bool = True
    device: str | torch.device | None = None

    def __post_init__(self):
        s = self.scale
        if s is not None and not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
            raise ValueError(f"scale must be a positive finite number, got {s!r}")
        if self.comm not in COMM_MODES:
            raise ValueError(f"comm mode must be one of {COMM_MODES}, got {self.comm!r}")


def prepare(plan, group, *, shape: AttentionShape | None = None, chunks: int | None = None,
            config: RunnerConfig | None = None, **options) -> LibraAttention:
    """Build this worker's runner for ``plan`` and check that the pool agrees on it.

    The step's path passes a :class:`~libra.runtime.program.WorkerProgram` compiled ahead of time
    (``AsyncPlanner(..., compile_for=worker)`` or :func:`libra.runtime.async_planner.compile_plans`):
    then nothing is compiled here, only the digest agreement is checked and the runner built. A
    Plan or PoolPlan is compiled on demand (:func:`~libra.runtime.program.compile_worker`).

    Args:
        plan: a WorkerProgram (its ``worker`` must be the group's worker; its ``chunks`` and
            ``shape`` are used), a :class:`~libra.plan.Plan` (this worker's pool is selected) or a
            PoolPlan (then ``shape`` is required).
        group: the pool's :class:`~libra.runtime.groups.PoolGroup` (or a raw ProcessGroup whose
            rank ``i`` is ``pool.workers[i]``).
        chunks: Pipeliner chunks ``M`` (default: the plan's ``pipeline_chunks``; 1 for a PoolPlan;
            a WorkerProgram's own, which a different value contradicts).
        config: the execution options as one :class:`RunnerConfig`; or pass its fields as keywords
            (``backend=``, ``comm=``, ``scale=``, ``check_finite=``, ``verify_plan=``, ``device=``),
            not both. With ``verify_plan``, the plan digest and the execution options (``chunks``,
            ``comm``, the resolved backend name, ``scale``, ``check_finite``) are all_gathered
            first; a difference raises PlanMismatchError naming the option (or plan) and the ranks,
            on every rank.

    Raises:
        ValueError: bad arguments, including a WorkerProgram compiled for another worker, pool,
            ``chunks`` or ``shape``; PlanValidationError: plan inconsistent for this worker;
        PlanMismatchError: pool ranks hold different plans or prepare them with different options.
        TypeError: ``config`` together with option keywords, or an unknown keyword.
    """
    if config is not None and options:
        raise TypeError(f"prepare() takes config= or option keywords, not both (got {sorted(options)})")
    cfg = RunnerConfig(**options) if config is None else config
    program = None
    if isinstance(plan, WorkerProgram):
        program = plan
        if chunks is not None and chunks != program.chunks:
            raise ValueError(f"chunks={chunks!r} contradicts the WorkerProgram, compiled with {program.chunks} "
                             f"Pipeliner chunks (omit chunks=, or compile with the chunks you want)")
        if shape is not None and shape != program.shape:
            raise ValueError(f"shape {shape} differs from the WorkerProgram's {program.shape}")
        workers = program.workers
    elif isinstance(plan, Plan):
        shape = plan.shape
        chunks = plan.pipeline_chunks if chunks is None else chunks
        worker = group.worker if isinstance(group, PoolGroup) else None
        if worker is None:
            raise ValueError("pass a PoolGroup with a Plan (the worker id selects the pool)")
        pool = plan.pool_of_worker(worker)
        digest = plan.digest()
        workers = pool.workers
    elif isinstance(plan, PoolPlan):
        if shape is None:
            raise ValueError("shape is required when a PoolPlan is passed")
        pool, chunks, digest = plan, (1 if chunks is None else chunks), None
        workers = pool.workers
    else:
        raise ValueError(f"plan must be a WorkerProgram, Plan or PoolPlan, got {type(plan).__name__}")
    group = as_pool_group(group, workers)
    if program is not None and group.worker != program.worker:
        raise ValueError(f"the WorkerProgram was compiled for worker {program.worker}, but this rank is worker "
                         f"{group.worker} of pool workers {list(group.workers)}: pass this rank's program "
                         f"(AsyncPlanner(compile_for=group.worker))")
    device = cfg.device
    if device is None:
        device = "cuda" if dist.is_initialized() and dist.get_backend(group.group) == "nccl" else "cpu"
    be = cfg.backend if isinstance(cfg.backend, AttentionBackend) else get_backend(cfg.backend, device)
    if program is None:
        program = compile_worker(pool, shape, group.worker, chunks, digest=digest or pool.digest())
    if cfg.verify_plan:
        check_plan_agreement(program.digest, group, options=execution_options(program, be, cfg))
    return LibraAttention(program, group, be, comm=cfg.comm, scale=cfg.scale, check_finite=cfg.check_finite)


def execution_options(program: WorkerProgram, backend: AttentionBackend, config: RunnerConfig) -> dict:
    """What every pool rank must execute a plan with besides the plan itself: ranks that differ in
    any of these would pair different exchanges (chunks ``M`` sets the message tags and sizes,
    ``comm`` p2p vs all-to-all, ``check_finite`` an extra collective) or compute differently
    (``backend``, resolved; ``scale``)."""
    scale = config.scale
    return {"chunks": int(program.chunks), "comm": config.comm, "backend": backend.name,
            "scale": None if scale is None else float(scale), "check_finite": bool(config.check_finite)}


def libra_attention(q, k, v, plan, group, **kwargs) -> torch.Tensor:
    """One-shot form: ``prepare(plan, group, **kwargs)(q, k, v)``; ``plan`` is a Plan, PoolPlan or
    WorkerProgram (see :func:`prepare`), or a prepared :class:`LibraAttention`, which skips
    compilation and the digest check."""
    runner = plan if isinstance(plan, LibraAttention) else prepare(plan, group, **kwargs)
    return runner(q, k, v)
