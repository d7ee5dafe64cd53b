"""Cost model: price one Plan per worker (compute, bytes and time per link class, exposed comm).

Convention: every time is one layer's core attention, **forward plus backward**, in ms, per
global worker id (arrays of length ``DP * CP``; workers outside the plan's pools are zero).
Terms are named and summed (vidur style):

* ``compute_ms = compute_fwd_ms + compute_bwd_ms``. Forward is the sum over the worker's kernel
  segments (:meth:`libra.plan.PoolPlan.segments`) of :meth:`KernelModel.segment_forward_ms` with
  ``heads per call = tile head width / M`` (the Pipeliner runs M calls of hq/(H*M) heads, Libra
  sec. 4.4), plus ``M`` kernel launches; backward is ``backward_time_ratio`` x forward. A per-worker
  ``speed`` multiplier divides both (device variability, Libra sec. 3.2).
* Communication has four phases (Libra sec. 4.3.3): forward dispatch (Q + KV, src -> dst), forward
  return (O), backward dispatch (dO along the Q path), backward return (dQ along the O path plus
  dK/dV along the reversed KV paths). A phase's time on worker w is, per port, the sum over the
  port's link classes of ``max(bytes sent, bytes received) / bandwidth + latency`` (latency only
  where the class carries traffic), and the max over ports (NVLink and the NIC run concurrently;
  RoCE and inter-supernode traffic share the NIC). Each worker's own link time stands in for its
  transfers; coupling with the peer's link is not modelled.
* ``exposed_comm_serial_ms``: all four phases exposed (no overlap) = ``comm_ms``.
* ``exposed_comm_ms``: the Pipeliner's M-chunk overlap, per pass, by the event recurrence of
  :func:`pipelined_exposed_ms`: chunk 0's dispatch is exposed, chunk i+1's dispatch and chunk
  i-1's return run on the comm stream while chunk i computes, chunk M-1's return is exposed. When
  compute covers transfers this is ``(D + R) / M``; where transfers outlast compute the excess is
  exposed too. With ``M = 1`` it equals the serial figure.
* ``total_ms = compute_ms + exposed_comm_ms``; the straggler is the worker with the largest total.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra.plan import KV, O, Plan, Q
from libra.sim.profiles import LINK_CLASSES, HardwareProfile
from libra.sim.topology import Topology
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


def pipelined_exposed_ms(compute_ms, dispatch_ms, return_ms, chunks: int, latency_ms=0.0) -> np.ndarray:
    """Exposed communication of one pass under the Pipeliner (Libra sec. 4.4), per worker.

    Chunk m has ``compute / M`` compute, ``dispatch / M + latency`` dispatch and ``return / M +
    latency`` return. Compute runs on one stream, transfers serialise on one comm stream. Chunk i
    starts once its dispatch arrived; when it starts, chunk i+1's dispatch and chunk i-1's return
    are issued; chunk M-1's return is issued after its compute.

    Args:
        compute_ms, dispatch_ms, return_ms: ``(N,)`` unchunked times of the pass.
        chunks: M >= 1.
        latency_ms: ``(N,)`` or scalar per-chunk latency of each transfer (0 where none).

    Returns:
        ``(N,)`` time the pass takes beyond its compute.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise ValueError(f"pipeline chunks M must be a positive integer, got {chunks!r}")
    c = np.asarray(compute_ms, dtype=np.float64) / chunks
    dispatch_ms = np.asarray(dispatch_ms, dtype=np.float64)
    return_ms = np.asarray(return_ms, dtype=np.float64)
    d = np.where(dispatch_ms > 0, dispatch_ms / chunks + latency_ms, 0.0)
    r = np.where(return_ms > 0, return_ms / chunks + latency_ms, 0.0)
    return _recurrence(c, np.broadcast_to(d, c.shape).copy(), np.broadcast_to(r, c.shape).copy(), chunks)


class CostModel:
    """Prices Plans on a cluster described by a profile and a rank topology.

    Args:
        profile: hardware profile (kernel model, link classes).
        topology: placement of the workers (must come from the same profile).
    """

    def __init__(self, profile: HardwareProfile, topology: Topology):
        if topology.profile is not profile and topology.profile.to_dict() != profile.to_dict():
            raise ValueError(f"topology was built for profile {topology.profile.name!r}, "
                             f"cost model got {profile.name!r}")
        self.profile = profile
        self.topology = topology
        self.kernel = profile.kernel
        links = [profile.links[c] for c in LINK_CLASSES]
        self._bw = np.array([lk.bandwidth_gbps for lk in links]) * 1e6  # bytes per ms
        self._lat = np.array([lk.latency_ms for lk in links])
        ports = sorted({lk.port for lk in links})
        self._port_of = np.array([ports.index(lk.port) for lk in links])
        self._nports = len(ports)

    # -- compute ---------------------------------------------------------------------------
    def _compute(self, plan: Plan, chunks: int):
        n = self.topology.num_workers
        fwd = np.zeros(n)
        flops = np.zeros(n)
        calls = np.zeros(n)
        d = plan.shape.head_dim
        for pool in plan.pools:
            seg = pool.segments(plan.shape)
            if not len(seg["dest"]):
                continue
            dest = self.topology.check_ids(seg["dest"])
            heads = seg["heads"].astype(np.int64)
            try:
                t = self.kernel.chunked_forward_ms(seg["area"], heads, d, chunks)
            except ValueError as exc:
                raise ValueError(f"plan {plan.method!r}: {exc}") from None
            fwd += np.bincount(dest, weights=t, minlength=n)
            flops += np.bincount(dest, weights=attention_flops(seg["area"], 1, d) * heads, minlength=n)
            calls[np.unique(dest)] = chunks
        fwd += calls * self.kernel.launch_ms
        return flops, fwd

    # -- communication ---------------------------------------------------------------------
    def _phase_bytes(self, src, dst, nbytes):
        """``(C, N)`` bytes sent and received per link class for one phase's transfers."""
        n, k = self.topology.num_workers, len(LINK_CLASSES)
        sent = np.zeros((k, n))
        recv = np.zeros((k, n))
        if len(src):
            code = self.topology.link_code(src, dst)
            keep = code >= 0  # self-transfers cost nothing
            for ci in range(k):
                m = keep & (code == ci)
                if m.any():
                    sent[ci] = np.bincount(src[m], weights=nbytes[m], minlength=n)
                    recv[ci] = np.bincount(dst[m], weights=nbytes[m], minlength=n)
        return sent, recv

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
        np.add.at(port_bw, self._port_of, per_class)
        np.add.at(port_lat, self._port_of, lat_class)
        # the slowest port sets the phase; its latency is paid once per chunk
        slow = np.argmax(port_bw + port_lat, axis=0)
        cols = np.arange(busy.shape[1])
        return port_bw[slow, cols], port_lat[slow, cols], per_class + lat_class

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
        chunks = plan.pipeline_chunks if pipeline_chunks is None else pipeline_chunks
        if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
            raise ValueError(f"pipeline_chunks must be a positive integer, got {chunks!r}")
        n = self.topology.num_workers
        flops, fwd = self._compute(plan, int(chunks))
        if speed is not None:
            speed = np.asarray(speed, dtype=np.float64)
            if speed.shape != (n,) or not np.all(np.isfinite(speed)) or np.any(speed <= 0):
                raise ValueError(f"speed must be {n} finite multipliers > 0, got shape {speed.shape}")
            fwd = fwd / speed
        bwd = fwd * self.kernel.backward_time_ratio

        pool_of = np.full(n, -1, dtype=np.int64)
        src_l, dst_l, nb_l, kind_l = [], [], [], []
        for pi, pool in enumerate(plan.pools):
            pool_of[self.topology.check_ids(list(pool.workers))] = pi
            tr = pool.transfers
            src_l.append(tr.src.astype(np.int64))
            dst_l.append(tr.dst.astype(np.int64))
            nb_l.append(tr.nbytes.astype(np.float64))
            kind_l.append(tr.kind)
        src = np.concatenate(src_l) if src_l else np.zeros(0, np.int64)
        dst = np.concatenate(dst_l) if dst_l else np.zeros(0, np.int64)
        nb = np.concatenate(nb_l) if nb_l else np.zeros(0)
        kind = np.concatenate(kind_l) if kind_l else np.zeros(0, np.int8)
        is_q, is_kv, is_o = kind == Q, kind == KV, kind == O
        # (src, dst) of each phase; backward KV gradients retrace the KV path in reverse
        phases = {
            "fwd_dispatch": (src[is_q | is_kv], dst[is_q | is_kv], nb[is_q | is_kv]),
            "fwd_return": (src[is_o], dst[is_o], nb[is_o]),
            "bwd_dispatch": (src[is_q], dst[is_q], nb[is_q]),
            "bwd_return": (np.concatenate([src[is_o], dst[is_kv]]), np.concatenate([dst[is_o], src[is_kv]]),
                           np.concatenate([nb[is_o], nb[is_kv]])),
        }
        k = len(LINK_CLASSES)
        sent_tot, recv_tot, link_tot = np.zeros((k, n)), np.zeros((k, n)), np.zeros((k, n))
        phase_bw, phase_lat = {}, {}
        for name, (s, t, b) in phases.items():
            sent, recv = self._phase_bytes(s, t, b)
            bw_ms, lat_ms, per_class = self._phase_ms(sent, recv)
            phase_bw[name], phase_lat[name] = bw_ms, lat_ms
            sent_tot += sent
            recv_tot += recv
            link_tot += per_class
        comm = sum(phase_bw[p] + phase_lat[p] for p in phases)
        exposed = np.zeros(n)
        for pass_name, comp in (("fwd", fwd), ("bwd", bwd)):
            disp, ret = f"{pass_name}_dispatch", f"{pass_name}_return"
            exposed += self._pass_exposed(comp, phase_bw[disp], phase_lat[disp],
                                          phase_bw[ret], phase_lat[ret], int(chunks))
        total_flops = float(flops.sum())
        workers = max(int((pool_of >= 0).sum()), 1)
        best = self.kernel.best_rate_tflops() * 1e9  # FLOPs per ms
        bound = total_flops / workers / best * (1.0 + self.kernel.backward_time_ratio)
        compute = fwd + bwd
        return PlanCost(
            method=plan.method, ga_index=int(plan.ga_index), pipeline_chunks=int(chunks), pool=pool_of,
            flops_fwd=flops, compute_fwd_ms=fwd, compute_bwd_ms=bwd, compute_ms=compute,
            bytes_sent={c: sent_tot[i] for i, c in enumerate(LINK_CLASSES)},
            bytes_recv={c: recv_tot[i] for i, c in enumerate(LINK_CLASSES)},
            link_ms={c: link_tot[i] for i, c in enumerate(LINK_CLASSES)},
            comm_ms=comm, exposed_comm_serial_ms=comm, exposed_comm_ms=exposed,
            total_ms=compute + exposed, balance_bound_ms=bound)

    @staticmethod
    def _pass_exposed(compute, d_bw, d_lat, r_bw, r_lat, chunks: int) -> np.ndarray:
        """Exposed comm of one pass; each chunk pays its own phase latency."""
        c = np.asarray(compute, dtype=np.float64) / chunks
        d = np.where(d_bw + d_lat > 0, d_bw / chunks + d_lat, 0.0)
        r = np.where(r_bw + r_lat > 0, r_bw / chunks + r_lat, 0.0)
        return _recurrence(c, d, r, chunks)


def _recurrence(c, d, r, chunks: int) -> np.ndarray:
    """Event recurrence of the Pipeliner for per-chunk compute ``c``, dispatch ``d``, return ``r``.

    Returns the pass's end time minus its total compute, i.e. the exposed communication.
    """
    comm_free = d.copy()  # chunk 0's dispatch is exposed
    arrived = d.copy()
    compute_free = np.zeros_like(c)
    for i in range(chunks):
        start = np.maximum(compute_free, arrived)
        if i + 1 < chunks:  # chunk i+1's dispatch is issued as chunk i starts
            comm_free = np.maximum(comm_free, start) + d
            arrived = comm_free.copy()
        if i >= 1:  # chunk i-1's return, ready since chunk i-1's compute ended (<= start)
            comm_free = np.maximum(comm_free, start) + r
        compute_free = start + c
    comm_free = np.maximum(comm_free, compute_free) + r  # chunk M-1's return, exposed
    return np.maximum(comm_free, compute_free) - chunks * c
