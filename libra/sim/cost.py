"""Cost model: price one Plan per worker (compute, bytes and time per link class, exposed comm).

Convention: every time is one layer's core attention, **forward plus backward**, in ms, per
global worker id (arrays of length ``DP * CP``; workers outside the plan's pools are zero).
Terms are named and summed (vidur style):

* ``compute_ms = compute_fwd_ms + compute_bwd_ms``. Forward is the sum over the worker's kernel
  segments (:meth:`PoolPlan.kernel_segments`: adjacent pieces merged as the runtime runs them) of
  :meth:`KernelModel.chunked_forward_ms` (each segment a piece of its sample, priced by the
  profile's ``piece_pricing``) with the calls of the pool's :class:`~libra.tap.pipeline.ChunkSchedule` (M calls of hq/(H*M) heads, Libra sec.
  4.4), plus ``M`` kernel launches; backward is ``backward_time_ratio`` x forward, or the kernel
  model's own backward length curve where the profile has one. A per-worker
  ``speed`` multiplier divides both (device variability, Libra sec. 3.2).
* Communication has four phases (Libra sec. 4.3.3): forward dispatch (Q + KV, src -> dst), forward
  return (O), backward dispatch (dO along the Q path), backward return (dQ along the O path plus
  dK/dV along the reversed KV paths). A phase's time on worker w is, per port, the sum over the
  port's link classes of ``max(bytes sent, bytes received) / bandwidth + latency`` (latency only
  where the class carries traffic), and the max over ports (NVLink and the NIC run concurrently;
  RoCE and inter-supernode traffic share the NIC). Each worker's own link time stands in for its
  transfers; coupling with the peer's link is not modelled.
* ``exposed_comm_serial_ms``: all four phases exposed (no overlap) = ``comm_ms``.
* ``exposed_comm_ms``: the Pipeliner's M-chunk overlap, per pass, by :func:`pipelined_exposed`,
  which walks :attr:`ChunkSchedule.events` -- the list the runtime executes -- with each chunk's
  own dispatch and return bytes (:meth:`ChunkSchedule.phase_routes`: Q by query-head chunk, KV with
  the first chunk that reads each KV head, dK/dV after the last). Each chunk pays its phase
  latency where it carries traffic. Compute runs on one stream, transfers on one FIFO comm stream.
  Chunk ``m``'s return and chunk ``m + 2``'s dispatch form one exchange (``ISSUE_EXCHANGE``: one
  group whose transfers progress together), priced by the phase formula over the two's summed bytes
  per port and class. When compute covers transfers only chunk 0's dispatch and chunk M-1's return
  are exposed; with ``M = 1`` it equals the serial figure.
* KV hops (the Plan contract's ``TransferTable.hop``; no paper planner makes them): a KV row with ``hop = h > 0``
  forwards KV its ``src`` received in an earlier hop. The runtime sends the hops as sequential
  rounds inside chunk 0's forward dispatch (hop 0, 1, ..., H) and chunk ``M - 1``'s backward return
  (H, ..., 0: a relay adds its children's dK/dV before forwarding them; dQ goes with hop 0), so those
  two columns are priced round by round: each round's port time per worker is the phase formula
  above over that round's bytes, and a worker starts a round when it and the senders of its rows in
  that round have finished the previous ones (``start[w] = max(t[w], t[s] for rows s -> w)``;
  ``t[w] = start[w] + port[w]`` where ``w`` moves bytes in the round). The serial phase time is the
  same dataflow over each row's total bytes; bytes and per-class link times stay the byte sums (a
  relay row's ``src`` is the forwarding worker). A pool with relays must pass its schedule's
  ``check_hops`` (:meth:`libra.tap.pipeline.ChunkSchedule.check_hops`: relayed KV heads travel in
  chunk 0 and return in chunk ``M - 1``). Plans without relays take none of this path.
* ``total_ms = compute_ms + exposed_comm_ms``; the straggler is the worker with the largest total.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from libra import jit as jit_modules
from libra.arrays import sorted_unique
from libra.plan import HEADS, Plan
from libra.sim.profiles import LINK_CLASSES, HardwareProfile
from libra.sim.structure import PoolStructures
from libra.sim.topology import Topology
from libra.sim.variability import check_speeds
from libra.tap.pipeline import (
    BWD_DISPATCH,
    BWD_RETURN,
    COMPUTE,
    FWD_DISPATCH,
    FWD_RETURN,
    ISSUE_DISPATCH,
    ISSUE_EXCHANGE,
    ISSUE_RETURN,
    PHASES,
    WAIT_DISPATCH,
    WAIT_RETURN,
    ChunkSchedule,
    Routes,
    check_chunks,
    pipeline_events,
    schedule_for_pool,
)
from libra.workload import attention_flops


@dataclass(frozen=True, eq=False)
class PlanCost:
    """Per-worker price of one Plan (arrays are ``(N,)`` indexed by global worker id, N = DP*CP).

    Attributes:
        method, ga_index: copied from the Plan.
        pipeline_chunks: M used for the overlap term.
        pool: pool index of each worker in the plan (-1 if the worker is in no pool).
        flops_fwd: forward attention FLOPs computed by each worker.
        compute_fwd_ms, compute_bwd_ms, compute_ms: kernel time (compute = fwd + bwd).
        bytes_sent, bytes_recv: ``{link class: (N,)}`` bytes over forward + backward.
        link_ms: ``{link class: (N,)}`` time that class's traffic alone takes (fwd + bwd).
        comm_ms: the four communication phases' time, unchunked (fwd + bwd).
        exposed_comm_serial_ms: exposed communication without overlap (= ``comm_ms``).
        exposed_comm_ms: exposed communication with the Pipeliner's M-chunk overlap.
        total_ms: ``compute_ms + exposed_comm_ms``.
        balance_bound_ms: the plan's total fwd+bwd attention compute spread evenly over its
            workers at the kernel's best rate (Libra's perfect-balance limit for this step).
        speed: the ``(N,)`` per-worker speed multipliers compute was divided by (None: all 1).
    """

    @property
    def balanced_compute_ms(self) -> float:
        """The plan's own kernel time spread evenly over its workers (mean worker compute).

        Unlike :attr:`balance_bound_ms` this keeps each segment's real kernel efficiency (short
        segments run below the best rate), so ``straggler / balanced_compute`` isolates what
        placement and communication cost from what the data's short samples cost any method.
        """
        active = self.pool >= 0
        return float(self.compute_ms[active].mean()) if active.any() else 0.0

    method: str
    ga_index: int
    pipeline_chunks: int
    pool: np.ndarray
    flops_fwd: np.ndarray
    compute_fwd_ms: np.ndarray
    compute_bwd_ms: np.ndarray
    compute_ms: np.ndarray
    bytes_sent: dict
    bytes_recv: dict
    link_ms: dict
    comm_ms: np.ndarray
    exposed_comm_serial_ms: np.ndarray
    exposed_comm_ms: np.ndarray
    total_ms: np.ndarray
    balance_bound_ms: float
    speed: np.ndarray | None = None

    @property
    def straggler_worker(self) -> int:
        """Global id of the slowest worker (lowest id on ties)."""
        return int(np.argmax(self.total_ms))

    @property
    def straggler_ms(self) -> float:
        """Slowest worker's complete core-attention time (compute + exposed communication)."""
        return float(self.total_ms[self.straggler_worker])

    def total_bytes(self) -> dict[str, int]:
        """Bytes moved per link class over the whole plan (fwd + bwd; each byte counted once)."""
        return {c: int(v.sum()) for c, v in self.bytes_sent.items()}

    def loss_factors(self) -> dict[str, float]:
        """Split ``straggler / balance_bound`` into four factors whose product is exactly that ratio.

        With ``w`` the straggler worker, ``pool_mean`` the mean compute over the workers of ``w``'s
        pool and ``step_mean`` the mean compute over every worker of the plan's pools (the
        :attr:`balanced_compute_ms`, the same workers :attr:`balance_bound_ms` divides by):

        * ``comm``: ``straggler / compute[w]`` -- exposed communication (Libra sec. 4.3.3, 4.4);
        * ``placement``: ``compute[w] / pool_mean`` -- imbalance TAP leaves inside the pool
          (sec. 4.3; includes tiles heavier than a worker's share and device jitter, sec. 3.2);
        * ``pooling``: ``pool_mean / step_mean`` -- imbalance between the step's pools, which
          grouping (VRSP, sec. 4.2) and the pool size ``P`` bound;
        * ``kernel``: ``step_mean / balance_bound`` -- the step's kernel time over its FLOPs at the
          kernel's best rate (short segments below the best rate, launches, the mean jitter).

        The product telescopes to ``straggler / balance_bound``. A zero denominator (no compute,
        an empty plan) gives NaN for the factors it enters.
        """
        w = self.straggler_worker
        comp = float(self.compute_ms[w])
        pool_mean = self._straggler_pool_mean(self.compute_ms)
        step_mean = self.balanced_compute_ms

        def ratio(a: float, b: float) -> float:
            return a / b if b > 0 else float("nan")

        return {"comm": ratio(self.straggler_ms, comp), "placement": ratio(comp, pool_mean),
                "pooling": ratio(pool_mean, step_mean), "kernel": ratio(step_mean, self.balance_bound_ms)}

    def placement_split(self) -> dict[str, float]:
        """Split the ``placement`` factor of :meth:`loss_factors` into what the plan and what the
        devices' speeds contribute, exactly (their product is ``placement``):

        * ``plan``: the straggler worker's compute at speed 1 over its pool's mean compute at speed
          1 -- the imbalance the plan itself leaves (tiles, Alg. 2's slack);
        * ``device``: ``placement / plan`` -- how much the step's speed draw (Libra sec. 3.2) moves
          it; 1 without jitter, above 1 when the straggler is a slower than average GPU.
        """
        placement = self.loss_factors()["placement"]
        base = self.compute_ms if self.speed is None else self.compute_ms * self.speed
        pool_mean = self._straggler_pool_mean(base)
        plan = float(base[self.straggler_worker]) / pool_mean if pool_mean > 0 else float("nan")
        return {"plan": plan, "device": placement / plan if plan > 0 else float("nan")}

    def _straggler_pool_mean(self, values: np.ndarray) -> float:
        """Mean of ``values`` over the straggler worker's pool (0 when it is in no pool)."""
        w = self.straggler_worker
        return float(values[self.pool == self.pool[w]].mean()) if self.pool[w] >= 0 else 0.0


def pipelined_exposed(events, compute, dispatch, ret, exchange=None, jit=None) -> np.ndarray:
    """Exposed communication of one pass under the Pipeliner, per worker (Libra sec. 4.4).

    Walks the schedule's events with a host clock: an issue is non-blocking and queues the transfer
    on the worker's FIFO comm stream (a return also waits for its chunk's compute); a wait blocks
    the host until the transfer arrived; a compute starts when the host reaches it and the compute
    stream is free.

    Args:
        events: :attr:`libra.tap.pipeline.ChunkSchedule.events`.
        compute: ``(N,)`` compute time of every chunk, or ``(N, M)`` each chunk's own.
        dispatch, ret: ``(N, M)`` time of each chunk's dispatch and return transfers.
        exchange: ``(N, M)``: column ``m`` the time of chunk ``m``'s return and chunk ``m + 2``'s
            dispatch issued as one group (``ISSUE_EXCHANGE``); default the two back to back.
        jit: :mod:`libra.jit.cost` to walk the events compiled (the same numbers), or None.

    Returns:
        ``(N,)`` end of the pass minus its compute.
    """
    compute = np.asarray(compute, dtype=np.float64)
    chunks = dispatch.shape[1]
    per = compute if compute.ndim == 2 else np.broadcast_to(compute[:, None], (len(compute), chunks))
    busy = compute.sum(axis=1) if compute.ndim == 2 else chunks * compute
    if jit is not None:
        codes, ms = jit.event_codes(events)
        end = jit.pipelined_end(codes, ms, np.ascontiguousarray(per), dispatch, ret,
                                dispatch if exchange is None else exchange, exchange is not None)
        return end - busy
    host, comm_free, compute_free = (np.zeros(len(compute)) for _ in range(3))
    arrived, returned = {}, {}
    for ev, m in events:
        if ev == ISSUE_DISPATCH:
            comm_free = np.maximum(comm_free, host) + dispatch[:, m]
            arrived[m] = comm_free
        elif ev == WAIT_DISPATCH:
            host = np.maximum(host, arrived[m])
        elif ev == COMPUTE:
            compute_free = host = np.maximum(host, compute_free) + per[:, m]
        elif ev == ISSUE_RETURN:
            comm_free = np.maximum(comm_free, compute_free) + ret[:, m]
            returned[m] = comm_free
        elif ev == ISSUE_EXCHANGE:
            t = ret[:, m] + dispatch[:, m + 2] if exchange is None else exchange[:, m]
            comm_free = np.maximum(comm_free, compute_free) + t
            returned[m] = arrived[m + 2] = comm_free
        elif ev == WAIT_RETURN:
            host = np.maximum(host, returned[m])
    return np.maximum.reduce([host, comm_free, compute_free]) - busy


EXCHANGES = {FWD_RETURN: FWD_DISPATCH, BWD_RETURN: BWD_DISPATCH}
"""Each pass's return phase and the dispatch phase its exchanges carry (``ISSUE_EXCHANGE``)."""


RELAY_PHASES = (FWD_DISPATCH, BWD_RETURN)
"""The phases whose KV rows may relay (``TransferTable.hop > 0``): the forward KV fetch and the
backward dK/dV return along the reversed relay rows."""


PAIR_ROUTES_MIN_ROWS = 65536
"""Rows from which :func:`_pair_routes` sums a phase's routes per worker pair (a per-document CP
plan at 1M has millions of KV rows; a TAP pool a few thousand, where summing would not pay)."""


def _pair_routes(r: Routes, n: int) -> Routes:
    """``r`` with one route per (src, dst) pair carrying its rows' summed bytes, when that changes
    no price: one chunk and integer byte counts whose total stays below 2**52, so every partial sum
    is exact in any order, as the per-row sums of :meth:`CostModel._phase_bytes` are. Otherwise,
    or below :data:`PAIR_ROUTES_MIN_ROWS` rows, ``r`` itself. The pair routes keep no row or kind
    (``-1``): only the phase sums read them."""
    if not len(r.src) or len(r.src) < PAIR_ROUTES_MIN_ROWS or r.nbytes.shape[1] != 1:
        return r
    b = r.nbytes[:, 0]
    if not (np.array_equal(np.floor(b), b) and float(b.sum()) < 2.0**52 and float(b.min()) >= 0):
        return r
    total = np.bincount(r.src * n + r.dst, weights=b, minlength=n * n)
    pairs = np.flatnonzero(total)
    none = np.full(len(pairs), -1, dtype=np.int64)
    return Routes(none, none.astype(np.int8), pairs // n, pairs % n, total[pairs][:, None])


COST_IMPLS = ("auto", "numba", "numpy")
"""``CostModel(impl=...)``: the compiled communication kernels when numba imports, or either one."""


def _cost_kernels(impl: str):
    """:mod:`libra.jit.cost` for ``impl`` (None: the numpy code; :func:`libra.jit.select`)."""
    if impl not in COST_IMPLS:
        raise ValueError(f"cost model impl must be one of {', '.join(COST_IMPLS)}, got {impl!r}")
    return jit_modules.select("cost", impl, "cost model impl")


def cost_impl() -> str:
    """The implementation ``CostModel(impl="auto")`` runs here: ``"numba"`` or ``"numpy"``."""
    return jit_modules.impl_name("cost")


def _ids(a: np.ndarray) -> np.ndarray:
    """int64 ``a`` (the compiled kernels take one integer type: no recompilation per dtype)."""
    return np.asarray(a, dtype=np.int64)


def _per_worker(t: np.ndarray) -> np.ndarray:
    """``(N,)`` compute per worker from ``(N,)`` or per-chunk ``(N, M)`` times."""
    return t if t.ndim == 1 else t.sum(axis=1)


class _ChunkBins:
    """Where one pool's kernel segments land: worker ``dest`` and Pipeliner chunk ``chunk`` (-1: a
    slice of the segment in every chunk) of ``n`` workers and ``M`` chunks. Depends on the plan
    alone, so it is built once per pool and shared by every profile that prices it."""

    def __init__(self, dest: np.ndarray, chunk: np.ndarray, n: int, M: int):
        self.dest, self.n, self.M = dest, n, M
        self.every = chunk < 0
        self.one = ~self.every
        self.dest_every = dest[self.every]
        self.keys_one = dest[self.one] * M + chunk[self.one]

    def sums(self, t: np.ndarray) -> np.ndarray:
        """``(n, M)`` sums of segment times ``t`` per worker and chunk; chunk -1 spreads over all M."""
        n, M = self.n, self.M
        out = np.zeros((n, M))
        out += np.bincount(self.dest_every, weights=t[self.every], minlength=n)[:, None] / M
        out += np.bincount(self.keys_one, weights=t[self.one], minlength=n * M).reshape(n, M)
        return out

    @cached_property
    def _max_one(self) -> tuple:
        return _bin_groups(self.keys_one)

    @cached_property
    def _max_every(self) -> tuple:
        return _bin_groups(self.dest_every)

    def max_into(self, out: np.ndarray, values: np.ndarray) -> None:
        """``out[w, c] = max(out[w, c], values of the segments on worker w in chunk c)`` (``(n, M)``;
        a segment in every chunk counts in each). One sort per pool instead of ``np.maximum.at``'s
        per-element loop; a max rounds nothing, so the result is exactly ``np.maximum.at``'s."""
        _max_by(out.reshape(-1), self._max_one, values[self.one])
        top = np.zeros(self.n)
        _max_by(top, self._max_every, values[self.every])
        np.maximum(out, top[:, None], out=out)


def _bin_groups(keys: np.ndarray) -> tuple:
    """``(order, starts, unique keys)``: ``keys`` sorted (stable) and where each key's run starts."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if len(k) else np.zeros(0, dtype=np.int64)
    return order, starts, k[starts]


def _max_by(out: np.ndarray, groups: tuple, values: np.ndarray) -> None:
    order, starts, keys = groups
    if len(keys):
        out[keys] = np.maximum(out[keys], np.maximum.reduceat(values[order], starts))


def plan_chunks(plan: Plan, pipeline_chunks: int | None = None) -> int:
    """The Pipeliner ``M`` a plan is priced at: ``pipeline_chunks``, or the plan's own when None --
    the cost model's one check of M (:func:`libra.tap.pipeline.check_chunks`), since a plan may come
    from a file rather than a validated :class:`libra.config.TapConfig`."""
    return check_chunks(plan.pipeline_chunks if pipeline_chunks is None else pipeline_chunks)

class CostModel:
    """Prices Plans on a cluster described by a profile and a rank topology.

    Args:
        profile: hardware profile (kernel model, link classes).
        topology: placement of the workers (must come from the same profile).
        impl: ``"auto"`` (default: the compiled communication kernels of :mod:`libra.jit.cost`
            when numba imports, else numpy), ``"numba"`` or ``"numpy"``; all price identically,
            bit for bit (:func:`cost_impl`).

    Raises:
        ValueError: a topology of another profile, or an unknown ``impl``.
        ImportError: ``impl="numba"`` without numba.
    """

    def __init__(self, profile: HardwareProfile, topology: Topology, impl: str = "auto",
                 structures: PoolStructures | None = None):
        if topology.profile is not profile and topology.profile.to_dict() != profile.to_dict():
            raise ValueError(f"topology was built for profile {topology.profile.name!r}, "
                             f"cost model got {profile.name!r}")
        self._jit = _cost_kernels(impl)
        # per-pool structure no profile changes: shared by the cost models that price one plan
        self.structures = PoolStructures(size=0) if structures is None else structures
        self.profile = profile
        self.topology = topology
        self.kernel = profile.kernel
        links = [profile.links[c] for c in LINK_CLASSES]
        self._bw = np.array([lk.bandwidth_gbps for lk in links]) * 1e6  # bytes per ms
        self._lat = np.array([lk.latency_ms for lk in links])
        ports = sorted({lk.port for lk in links})
        self._port_of = np.array([ports.index(lk.port) for lk in links])
        self._nports = len(ports)

    def flops_ms(self, flops_fwd):
        """Forward + backward time of ``flops_fwd`` forward attention FLOPs at the kernel's best
        rate (the unit of :attr:`PlanCost.balance_bound_ms` and of FLOPs-only stragglers)."""
        best = self.kernel.best_rate_tflops() * 1e9  # FLOPs per ms
        return flops_fwd / best * (1.0 + self.kernel.best_backward_ratio())

    # -- compute ---------------------------------------------------------------------------
    def _schedules(self, plan: Plan, chunks: int) -> list[ChunkSchedule]:
        try:
            return [self.structures.get(pool, ("schedule", plan.shape, chunks),
                                        lambda pool=pool: schedule_for_pool(pool, plan.shape, chunks))
                    for pool in plan.pools]
        except ValueError as exc:
            raise ValueError(f"plan {plan.method!r}: {exc}") from None

    def _compute(self, plan: Plan, schedules: list[ChunkSchedule]):
        """Forward FLOPs, forward kernel time and -- when the kernel model has its own backward curve
        (:meth:`KernelModel.segment_backward_ms`) -- backward kernel time per worker (the schedule's
        calls per segment); None instead of backward time when it is ``backward_time_ratio`` x forward.

        Times are ``(N,)`` when every pool cuts by heads (each chunk a ``1/M`` slice of every
        segment), else ``(N, M)`` per chunk (:meth:`ChunkSchedule.segment_calls`)."""
        if self.kernel.occupancy is not None:
            return self._occupancy_compute(plan, schedules)
        n, M = self.topology.num_workers, schedules[0].chunks if schedules else 1
        per_chunk = any(s.chunking != HEADS for s in schedules)
        fwd, bwd = np.zeros((n, M) if per_chunk else n), np.zeros((n, M) if per_chunk else n)
        flops, calls = np.zeros(n), np.zeros(n)
        d, k = plan.shape.head_dim, self.kernel
        for seg, bins, heads, ncalls in self._worker_segments(plan, schedules, flops, calls):
            times = [k.chunked_forward_ms(seg["area"], heads, d, ncalls, seg["kv_len"])]
            if k.has_backward_curve:
                times.append(k.chunked_backward_ms(seg["area"], heads, d, ncalls, seg["kv_len"]))
            for acc, t in zip((fwd, bwd), times):
                acc += bins.sums(t) if per_chunk else np.bincount(bins.dest, weights=t, minlength=n)
        launch = calls * k.launch_ms
        if per_chunk:
            launch = launch[:, None] / M  # one launch per chunk
        fwd += launch
        # without a curve backward is the ratio x forward, applied in price() after the speed division
        return flops, fwd, (bwd + launch * k.backward_time_ratio if k.has_backward_curve else None)

    def _worker_segments(self, plan: Plan, schedules: list[ChunkSchedule], flops, calls):
        """``(segments, _ChunkBins, heads per call, calls)`` of each pool's kernel segments as the
        runtime runs them (merged; :meth:`ChunkSchedule.segment_calls`); adds each pool's FLOPs into
        ``flops`` and its kernel calls into ``calls`` (per worker) on the way."""
        d, n = plan.shape.head_dim, len(flops)
        for pool, sched in zip(plan.pools, schedules):
            seg, _ = self.structures.get(pool, ("segments", plan.shape, sched.chunks),
                                         lambda pool=pool, sched=sched: pool.kernel_segments(sched, ordered=False))
            if not len(seg["dest"]):
                continue
            # what follows depends on the segments and the worker count alone: built once per pool
            bins, heads, ncalls, pool_flops, workers = self.structures.get(
                seg, ("calls", n), lambda seg=seg, sched=sched: self._segment_calls(seg, sched, d, n))
            yield seg, bins, heads, ncalls
            flops += pool_flops
            calls[workers] = sched.chunks

    def _segment_calls(self, seg: dict, sched: ChunkSchedule, head_dim: int, n: int):
        """``(_ChunkBins, heads per call, calls, (n,) FLOPs per worker, workers)`` of one pool's
        kernel segments (:meth:`ChunkSchedule.segment_calls`)."""
        dest = self.topology.check_ids(seg["dest"])
        flops = np.bincount(dest, weights=attention_flops(seg["area"], 1, head_dim) * seg["heads"], minlength=n)
        chunk, heads, ncalls = sched.segment_calls(seg)
        return _ChunkBins(dest, chunk, n, sched.chunks), heads, ncalls, flops, sorted_unique(dest)

    def _occupancy_compute(self, plan: Plan, schedules: list[ChunkSchedule]):
        """:meth:`_compute` under the occupancy kernel model (:mod:`libra.sim.occupancy`): each
        worker's call costs its pass's launch plus the larger of its segments' summed block work
        over the SMs and its longest block; the same shapes as :meth:`_compute`, backward always
        priced (the model has its own backward constants)."""
        n, M = self.topology.num_workers, schedules[0].chunks if schedules else 1
        occ, d = self.kernel.occupancy, plan.shape.head_dim
        work, floor = np.zeros((2, n, M)), np.zeros((2, n, M))
        flops, calls = np.zeros(n), np.zeros(n)
        for seg, bins, heads, ncalls in self._worker_segments(plan, schedules, flops, calls):
            # the blocks depend on the (cached, shared) segments alone: keyed by that object, built once
            geometry = self.structures.get(seg, ("blocks", occ.block_q, occ.block_k),
                                           lambda seg=seg: occ.block_tiles(seg["q_len"], seg["kv_len"]))
            for p in range(2):
                w, f = self.kernel.occupancy_terms(seg, heads, ncalls, d, p == 1, geometry)
                work[p] += bins.sums(w)
                bins.max_into(floor[p], f)
        launch = np.array([occ.forward.launch_ms, occ.backward.launch_ms])[:, None, None] * (calls > 0)[None, :, None]
        fwd, bwd = np.maximum(work, floor) + launch
        if not any(s.chunking != HEADS for s in schedules):
            fwd, bwd = fwd.sum(axis=1), bwd.sum(axis=1)
        return flops, fwd, bwd

    # -- communication ---------------------------------------------------------------------
    def _link_codes(self, src, dst) -> np.ndarray:
        """The link class index of each of a phase's transfers (-1: a self-transfer, which uses none)."""
        return self.topology.link_code(src, dst) if len(src) else np.zeros(0, dtype=np.int64)

    def _phase_bytes(self, src, dst, code, nbytes):
        """``(C, N)`` bytes sent and received per link class for one phase's transfers (``code``:
        :meth:`_link_codes`); ``(C, N, M)`` when ``nbytes`` is ``(X, M)`` per chunk. One bincount over
        (class, worker, column) bins each way: every bin sums its rows in row order, exactly as a
        bincount per class and chunk would."""
        n, k = self.topology.num_workers, len(LINK_CLASSES)
        per = nbytes.shape[1:]
        cols = int(np.prod(per, dtype=np.int64))
        use = np.flatnonzero(code >= 0)  # one index array for the four gathers below
        w = nbytes[use].reshape(-1)
        c = code[use] * n  # int64 already (_link_codes)
        size = k * n * cols
        sent, recv = c + src[use], c + dst[use]  # (class, worker) bins
        if cols > 1:  # (class, worker, column) bins
            step = np.arange(cols)
            sent, recv = (sent[:, None] * cols + step).reshape(-1), (recv[:, None] * cols + step).reshape(-1)
        sent = np.bincount(sent, weights=w, minlength=size)
        recv = np.bincount(recv, weights=w, minlength=size)
        return sent.reshape(k, n, *per), recv.reshape(k, n, *per)

    def _phase_ms(self, sent, recv, chunks: int = 1):
        """Time of a phase whose bytes are ``(sent, recv)`` split in ``chunks`` sequential pieces.

        Returns ``(bandwidth_ms, latency_ms, per_class_ms)``: the max over ports of the summed class
        times without latency, that phase's per-chunk latency, and ``(C, N)`` per-class times.
        """
        busy = np.maximum(sent, recv)
        per_class = busy / self._bw[:, None]
        lat_class = np.where(busy > 0, self._lat[:, None], 0.0)
        port_bw = np.zeros((self._nports, busy.shape[1]))
        port_lat = np.zeros_like(port_bw)
        for ci, port in enumerate(self._port_of):  # class order, as np.add.at would add them
            port_bw[port] += per_class[ci]
            port_lat[port] += lat_class[ci]
        # the slowest port sets the phase; its latency is paid once per chunk
        slow = np.argmax(port_bw + port_lat, axis=0)
        cols = np.arange(busy.shape[1])
        return port_bw[slow, cols], port_lat[slow, cols], per_class + lat_class

    def _pool_routes(self, pool, sched: ChunkSchedule, shape):
        """``pool``'s :meth:`ChunkSchedule.phase_routes` under ``sched`` (its schedule for ``shape``;
        built once per pool)."""
        return self.structures.get(pool, ("routes", shape, sched.chunks), lambda: sched.phase_routes(pool.transfers))

    @staticmethod
    def _routes(plan: Plan, schedules: list[ChunkSchedule], per_pool: list | None = None) -> dict[str, Routes]:
        """Every pool's :meth:`ChunkSchedule.phase_routes` (``per_pool`` when already built),
        concatenated per phase in pool order."""
        M = schedules[0].chunks if schedules else 1
        if per_pool is None:
            per_pool = [sched.phase_routes(pool.transfers) for pool, sched in zip(plan.pools, schedules)]
        out = {}
        for phase in PHASES:
            parts = [r[phase] for r in per_pool]
            out[phase] = Routes(*(np.concatenate([r[i] for r in parts]) if parts else np.zeros(0, np.int64)
                                  for i in range(4)),
                                np.concatenate([r.nbytes for r in parts]) if parts else np.zeros((0, M)))
        return out

    @staticmethod
    def _relay_hops(plan: Plan, schedules: list[ChunkSchedule], per_pool: list) -> dict[str, np.ndarray]:
        """``{phase: hop of every route row}`` for :data:`RELAY_PHASES`, aligned with :meth:`_routes`;
        ``{}`` when no pool has a relay row (the common case costs one ``any`` per pool).

        Raises:
            PlanValidationError: a pool with relays its schedule's ``check_hops`` rejects.
        """
        relaying = [bool(pool.transfers.hop.any()) for pool in plan.pools]
        if not any(relaying):
            return {}
        for pool, sched, relays in zip(plan.pools, schedules, relaying):
            if relays:
                sched.check_hops(pool)
        # backward routes index TransferTable.backward(), whose rows keep the forward index and hop
        return {phase: np.concatenate([pool.transfers.hop[r[phase].row] for pool, r in zip(plan.pools, per_pool)])
                for phase in RELAY_PHASES}

    def chunk_traffic(self, plan: Plan, pipeline_chunks: int | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Bytes each worker sends and receives in each Pipeliner chunk of each phase, as priced.

        Returns ``{phase: (sent, recv)}`` with ``(N, M)`` arrays (self-transfers excluded).
        """
        chunks = plan_chunks(plan, pipeline_chunks)
        n = self.topology.num_workers
        out = {}
        for phase, r in self._routes(plan, self._schedules(plan, chunks)).items():
            keep = r.src != r.dst
            sent = np.stack([np.bincount(r.src[keep], r.nbytes[keep, m], n) for m in range(chunks)], axis=1)
            recv = np.stack([np.bincount(r.dst[keep], r.nbytes[keep, m], n) for m in range(chunks)], axis=1)
            out[phase] = (sent.reshape(n, chunks), recv.reshape(n, chunks))
        return out

    def _relay_rounds(self, r: Routes, code, hop: np.ndarray, nbytes: np.ndarray, backward: bool) -> np.ndarray:
        """``(N, J)`` end times of ``J`` relay phase columns moving ``nbytes[i, j]`` on route row ``i``,
        sent in hop rounds (forward 0..H, backward H..0; module docstring): each round's port time is
        the phase formula over its bytes, started when the worker and its round's senders are done.
        The columns share one pass over the rounds (a chunk's column and the whole phase)."""
        n, k, J = self.topology.num_workers, len(LINK_CLASSES), nbytes.shape[1]
        if self._jit is not None:
            return self._jit.relay_rounds(_ids(r.src), _ids(r.dst), code, _ids(hop), np.asarray(nbytes, np.float64),
                                          backward, k, n, self._bw, self._lat, self._port_of, self._nports)
        t = np.zeros((n, J))
        top = int(hop.max()) if len(hop) else 0
        for h in (range(top, -1, -1) if backward else range(top + 1)):
            sel = hop == h
            src, dst = r.src[sel], r.dst[sel]
            sent, recv = self._phase_bytes(src, dst, code[sel], nbytes[sel])
            bw_ms, lat_ms, _ = self._phase_ms(sent.reshape(k, n * J), recv.reshape(k, n * J))
            port = (bw_ms + lat_ms).reshape(n, J)
            start = t.copy()
            np.maximum.at(start, dst, t[src])  # a receiver waits for its sender's earlier rounds
            t = np.where(port > 0, start + port, t)
        return t

    def _phases(self, plan: Plan, schedules: list[ChunkSchedule], chunked_only: bool = False):
        """Price the four phases: unchunked totals and ``(N, M)`` per-chunk times.

        Returns ``(sent, recv, link, serial, per_chunk)``: ``(C, N)`` bytes sent / received and
        per-class time summed over phases, ``(N,)`` serial comm time, and ``{phase: (N, M)}`` plus
        the exchanges' times (:meth:`_exchanges`); with ``chunked_only`` only ``per_chunk`` is
        priced (the rest ``None``): what the overlap term and so :meth:`total_ms` need.
        """
        n, k, M = self.topology.num_workers, len(LINK_CLASSES), schedules[0].chunks if schedules else 1
        sent_tot, recv_tot, link_tot = np.zeros((k, n)), np.zeros((k, n)), np.zeros((k, n))
        serial, per_chunk, chunk_bytes = np.zeros(n), {}, {}
        per_pool = [self._pool_routes(pool, sched, plan.shape) for pool, sched in zip(plan.pools, schedules)]
        hops = self._relay_hops(plan, schedules, per_pool)
        for phase, r in self._routes(plan, schedules, per_pool).items():
            if phase not in hops:  # relay rounds need the rows themselves
                r = _pair_routes(r, n)
            code = self._link_codes(r.src, r.dst)  # once per phase, shared by its chunks
            # each chunk moves its own bytes and pays its own latency: (worker, chunk) as columns
            if self._jit is not None and (chunked_only or M > 1):  # per-class times unused: compiled
                sent_m, recv_m, per_chunk[phase] = self._jit.chunk_times(
                    _ids(r.src), _ids(r.dst), code, np.asarray(r.nbytes, np.float64), k, n, self._bw, self._lat,
                    self._port_of, self._nports)
                chunk_bytes[phase] = (sent_m, recv_m)
            else:
                sent_m, recv_m = chunk_bytes[phase] = self._phase_bytes(r.src, r.dst, code, r.nbytes)
                bw_m, lat_m, class_m = self._phase_ms(sent_m.reshape(k, n * M), recv_m.reshape(k, n * M))
                per_chunk[phase] = (bw_m + lat_m).reshape(n, M)
            rounds = None
            if phase in hops:  # relay rounds replace the byte sum of the chunk they run in (and the phase's)
                col = M - 1 if phase == BWD_RETURN else 0
                cols = [r.nbytes[:, col]] + ([] if chunked_only else [r.nbytes.sum(axis=1)])
                rounds = self._relay_rounds(r, code, hops[phase], np.stack(cols, axis=1), phase == BWD_RETURN)
                per_chunk[phase][:, col] = rounds[:, 0]
            if chunked_only:
                continue
            if M == 1:  # one chunk: the phase's totals are that chunk's, the same sums bit for bit
                sent, recv, bw_ms, lat_ms, per_class = sent_m.reshape(k, n), recv_m.reshape(k, n), bw_m, lat_m, class_m
            else:
                sent, recv = self._phase_bytes(r.src, r.dst, code, r.nbytes.sum(axis=1))
                bw_ms, lat_ms, per_class = self._phase_ms(sent, recv)
            sent_tot += sent
            recv_tot += recv
            link_tot += per_class
            serial += bw_ms + lat_ms if rounds is None else rounds[:, 1]
        per_chunk.update(self._exchanges(chunk_bytes, M))
        if chunked_only:
            return None, None, None, None, per_chunk
        return sent_tot, recv_tot, link_tot, serial, per_chunk

    def _exchanges(self, chunk_bytes: dict, M: int) -> dict:
        """``{(return phase, "exchange"): (N, M)}``: column ``m < M - 2`` the time of chunk ``m``'s
        return and chunk ``m + 2``'s dispatch as one group (:data:`EXCHANGES`): the phase formula
        over their summed bytes per port and class; empty for ``M <= 2`` (no exchange)."""
        if M <= 2:
            return {}
        n, k, out = self.topology.num_workers, len(LINK_CLASSES), {}
        for ret, disp in EXCHANGES.items():
            (sr, rr), (sd, rd) = chunk_bytes[ret], chunk_bytes[disp]
            sent, recv = sr[:, :, :M - 2] + sd[:, :, 2:], rr[:, :, :M - 2] + rd[:, :, 2:]
            sent, recv = sent.reshape(k, n * (M - 2)), recv.reshape(k, n * (M - 2))
            if self._jit is not None:
                both = self._jit.phase_times(sent, recv, self._bw, self._lat, self._port_of, self._nports)
            else:
                bw, lat, _ = self._phase_ms(sent, recv)
                both = bw + lat
            t = np.zeros((n, M))
            t[:, :M - 2] = both.reshape(n, M - 2)
            out[(ret, "exchange")] = t
        return out

    def _apply_speed(self, fwd, bwd, speed, n: int):
        """Compute times divided by the per-worker ``speed`` multipliers; backward filled in as
        ``backward_time_ratio`` x forward where the kernel model has no backward curve."""
        if speed is not None:
            speed = check_speeds(speed, n, "speed")
            div = speed if fwd.ndim == 1 else speed[:, None]
            fwd = fwd / div
            bwd = None if bwd is None else bwd / div
        return fwd, (fwd * self.kernel.backward_time_ratio if bwd is None else bwd)

    def price(self, plan: Plan, pipeline_chunks: int | None = None, speed=None) -> PlanCost:
        """Price ``plan`` per worker (see the module docstring for every term).

        Args:
            plan: a Plan whose worker ids fit this topology.
            pipeline_chunks: M for the overlap and heads-per-call terms; default ``plan.pipeline_chunks``.
            speed: optional ``(N,)`` per-worker speed multipliers (> 0) dividing compute time.

        Returns:
            A :class:`PlanCost`.

        Raises:
            ValueError: bad M, bad speed array, a worker id outside the topology, or M not
                dividing a tile's head width.
        """
        chunks = plan_chunks(plan, pipeline_chunks)
        n = self.topology.num_workers
        flops, fwd, bwd, exposed, (sent, recv, link, comm, _) = self._terms(plan, chunks, speed, chunked_only=False)
        pool_of = np.full(n, -1, dtype=np.int64)
        for pi, pool in enumerate(plan.pools):
            pool_of[self.topology.check_ids(list(pool.workers))] = pi
        workers = max(int((pool_of >= 0).sum()), 1)
        bound = self.flops_ms(float(flops.sum()) / workers)
        compute = fwd + bwd
        return PlanCost(
            method=plan.method, ga_index=int(plan.ga_index), pipeline_chunks=chunks, pool=pool_of,
            flops_fwd=flops, compute_fwd_ms=fwd, compute_bwd_ms=bwd, compute_ms=compute,
            bytes_sent={c: sent[i] for i, c in enumerate(LINK_CLASSES)},
            bytes_recv={c: recv[i] for i, c in enumerate(LINK_CLASSES)},
            link_ms={c: link[i] for i, c in enumerate(LINK_CLASSES)},
            comm_ms=comm, exposed_comm_serial_ms=comm, exposed_comm_ms=exposed,
            total_ms=compute + exposed, balance_bound_ms=bound,
            speed=None if speed is None else np.asarray(speed, dtype=np.float64))

    def total_ms(self, plan: Plan, pipeline_chunks: int | None = None, speed=None) -> np.ndarray:
        """``(N,)`` :attr:`PlanCost.total_ms` of ``plan``, equal to ``price(plan, ...).total_ms``, pricing
        only what it needs (compute and the per-chunk phases; no per-class or serial totals): what
        a planner comparing candidate plans calls. Arguments and errors as :meth:`price`."""
        chunks = plan_chunks(plan, pipeline_chunks)
        _, fwd, bwd, exposed, _ = self._terms(plan, chunks, speed, chunked_only=True)
        return fwd + bwd + exposed

    def straggler_ms(self, plan: Plan, pipeline_chunks: int | None = None, speed=None,
                     cutoff: float = float("inf")) -> float:
        """``max(total_ms(plan, ...))``, the priced straggler -- or, as soon as some worker's compute
        alone exceeds ``cutoff``, that compute (a lower bound of the straggler, itself above
        ``cutoff``), without pricing any communication: what a planner comparing candidate plans
        against the best so far needs (branch and bound: a plan whose bound exceeds the best
        cannot win). Arguments and errors as :meth:`price`."""
        compute, exposed = self.worker_ms(plan, pipeline_chunks, speed, cutoff)
        if not len(compute):
            return 0.0
        return float(compute.max()) if exposed is None else float((compute + exposed).max())

    def worker_ms(self, plan: Plan, pipeline_chunks: int | None = None, speed=None,
                  cutoff: float = float("inf")) -> tuple[np.ndarray, np.ndarray | None]:
        """``(compute_ms, exposed_comm_ms)`` per worker, as :meth:`price` gives them, pricing only
        what they need -- or ``(compute_ms, None)`` as soon as some worker's compute alone exceeds
        ``cutoff`` (:meth:`straggler_ms`). What a planner that balances compute plus exposed
        communication reads. Arguments and errors as :meth:`price`."""
        chunks = plan_chunks(plan, pipeline_chunks)
        schedules, _, fwd_c, bwd_c = self._compute_terms(plan, chunks, speed)
        compute = _per_worker(fwd_c) + _per_worker(bwd_c)  # total_ms adds exposed comm >= 0 to this
        if len(compute) and float(compute.max()) > cutoff:
            return compute, None
        _, _, exposed, _ = self._exposed_terms(plan, schedules, chunks, fwd_c, bwd_c, chunked_only=True)
        return compute, exposed

    def _compute_terms(self, plan: Plan, chunks: int, speed):
        """``(schedules, flops, fwd, bwd)``: the pools' Pipeliners and :meth:`_compute`'s terms at
        ``speed`` (``(N,)`` or per chunk ``(N, M)``; backward filled in)."""
        schedules = self._schedules(plan, chunks)
        flops, fwd_c, bwd_c = self._compute(plan, schedules)
        fwd_c, bwd_c = self._apply_speed(fwd_c, bwd_c, speed, self.topology.num_workers)
        return schedules, flops, fwd_c, bwd_c

    def _terms(self, plan: Plan, chunks: int, speed, chunked_only: bool):
        """``(flops, fwd, bwd, exposed, phases)``: forward FLOPs, forward and backward compute and
        exposed communication per worker (``(N,)`` each) and :meth:`_phases`' result."""
        schedules, flops, fwd_c, bwd_c = self._compute_terms(plan, chunks, speed)
        fwd, bwd, exposed, phases = self._exposed_terms(plan, schedules, chunks, fwd_c, bwd_c, chunked_only)
        return flops, fwd, bwd, exposed, phases

    def _exposed_terms(self, plan: Plan, schedules, chunks: int, fwd_c, bwd_c, chunked_only: bool):
        """``(fwd, bwd, exposed, phases)``: compute per worker and the exposed communication of the
        Pipeliner's events over :meth:`_phases`' per-chunk times."""
        phases = self._phases(plan, schedules, chunked_only)
        per_chunk = phases[-1]
        events = pipeline_events(chunks)  # the runtime's loop, priced event by event
        # (N,) times: every chunk is 1/M of the worker's compute; (N, M): each chunk its own
        chunk_f, chunk_b = (fwd_c / chunks, bwd_c / chunks) if fwd_c.ndim == 1 else (fwd_c, bwd_c)
        exposed = (pipelined_exposed(events, chunk_f, per_chunk[FWD_DISPATCH], per_chunk[FWD_RETURN],
                                     per_chunk.get((FWD_RETURN, "exchange")), self._jit)
                   + pipelined_exposed(events, chunk_b, per_chunk[BWD_DISPATCH], per_chunk[BWD_RETURN],
                                       per_chunk.get((BWD_RETURN, "exchange")), self._jit))
        return _per_worker(fwd_c), _per_worker(bwd_c), exposed, phases
