"""Step simulator: replay one GBS window for one method and report per-step stragglers.

A *step* is one GA index (microbatch group) of the window: the planner turns the window into one
Plan per GA index (every pool of that index inside it), the cost model prices each Plan per worker
under that step's device speeds, and the step's straggler is the slowest worker (Libra sec. 6.1
"Metrics": bulk-synchronous execution, so the slowest worker sets the step time).

Each step also carries its loss decomposition (:meth:`libra.sim.cost.PlanCost.loss_factors`:
``straggler / balance_bound = comm x placement x pooling x kernel``) and, when the caller names a
pool size, two FLOPs-only stragglers of the window (:func:`flops_stragglers`) -- what Ulysses and
Libra would reach if time were FLOPs at the kernel's best rate and communication were free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from libra.config import ParallelConfig
from libra.sim.cost import CostModel, PlanCost
from libra.sim.variability import DeviceJitter
from libra.vrsp import vrsp_schedule
from libra.workload import AttentionShape, packed_flops, packed_workloads


@dataclass(frozen=True)
class StepResult:
    """One step (GA index) of one method.

    Attributes:
        method: planner name.
        step: GA index.
        straggler_ms: slowest worker's compute + exposed communication (fwd + bwd, one layer).
        straggler_worker: its global id; ``straggler_pool`` its pool index in the plan.
        compute_ms, comm_exposed_ms, comm_serial_ms: the straggler's compute, exposed
            communication (with the plan's overlap) and unoverlapped communication time.
        mean_worker_ms: mean total over the plan's workers.
        balance_bound_ms: perfect-balance limit of the step at the kernel's best rate (see
            :class:`PlanCost`); ``balanced_compute_ms``: the step's own kernel time spread evenly.
        bytes_<class>: bytes moved over that link class in the whole step (fwd + bwd).
        pipeline_chunks: M the step was priced with.
        comm_factor, placement_factor, pooling_factor, kernel_factor: the step's
            :meth:`PlanCost.loss_factors`; their product is ``straggler_ms / balance_bound_ms``.
        placement_plan_factor, placement_device_factor: :meth:`PlanCost.placement_split` (their
            product is ``placement_factor``): the plan's own imbalance and the speed draw's share.
        flops_ulysses_ms, flops_libra_ms: the window's FLOPs-only stragglers at this GA index
            (:func:`flops_stragglers`, same unit as ``balance_bound_ms``); NaN unless the caller
            gave :func:`simulate_window` a ``flops_pool_size``. They depend on the window, not
            on the method.
    """

    method: str
    step: int
    straggler_ms: float
    straggler_worker: int
    straggler_pool: int
    compute_ms: float
    comm_exposed_ms: float
    comm_serial_ms: float
    mean_worker_ms: float
    balance_bound_ms: float
    balanced_compute_ms: float
    bytes_nvlink: int
    bytes_roce: int
    bytes_inter_supernode: int
    pipeline_chunks: int
    comm_factor: float
    placement_factor: float
    pooling_factor: float
    kernel_factor: float
    placement_plan_factor: float = float("nan")
    placement_device_factor: float = float("nan")
    flops_ulysses_ms: float = float("nan")
    flops_libra_ms: float = float("nan")

    def to_row(self) -> dict:
        return asdict(self)


def step_result(cost: PlanCost) -> StepResult:
    """Summarise a priced plan into its :class:`StepResult`."""
    w = cost.straggler_worker
    active = cost.pool >= 0
    totals = cost.total_bytes()
    f, split = cost.loss_factors(), cost.placement_split()
    return StepResult(
        method=cost.method, step=cost.ga_index, straggler_ms=cost.straggler_ms, straggler_worker=w,
        straggler_pool=int(cost.pool[w]), compute_ms=float(cost.compute_ms[w]),
        comm_exposed_ms=float(cost.exposed_comm_ms[w]), comm_serial_ms=float(cost.comm_ms[w]),
        mean_worker_ms=float(cost.total_ms[active].mean()) if active.any() else 0.0,
        balance_bound_ms=cost.balance_bound_ms, balanced_compute_ms=cost.balanced_compute_ms,
        bytes_nvlink=totals["nvlink"], bytes_roce=totals["roce"],
        bytes_inter_supernode=totals["inter_supernode"], pipeline_chunks=cost.pipeline_chunks,
        comm_factor=f["comm"], placement_factor=f["placement"], pooling_factor=f["pooling"],
        kernel_factor=f["kernel"], placement_plan_factor=split["plan"], placement_device_factor=split["device"])


def flops_stragglers(window, par: ParallelConfig, shape: AttentionShape, pool_size: int,
                     cost_model: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """FLOPs-only stragglers of every GA index of one window (Ulysses' and Libra's limits).

    * Ulysses: production order (``window[i]`` at GA ``i // DP``), each CP group computes its own
      packed sequence, so the step waits for its heaviest sequence's attention FLOPs / CP.
    * Libra: VRSP pools of ``pool_size`` (Alg. 1, :func:`libra.vrsp.vrsp_schedule`, pool ``k`` at
      GA ``k // (DP/P)``) with perfect placement inside each pool: the step waits for its
      heaviest pool's FLOPs / (P * CP).

    Both are priced by :meth:`CostModel.flops_ms` (forward + backward at the kernel's best rate,
    the unit of ``balance_bound_ms``), so they compare directly with the simulated stragglers; the
    ratio of their means is the speedup Libra could reach if time were FLOPs and communication
    were free. Fixed-token windows only: every sequence's samples as packed.

    Returns:
        ``(ulysses_ms, libra_ms)``, float64 ``(GA,)`` each.

    Raises:
        ValueError: a window that is not ``par.gbs`` sequences, or the errors of
            :func:`libra.vrsp.vrsp_schedule` (``P`` not dividing ``DP``).
    """
    if len(window) != par.gbs:
        raise ValueError(f"window holds {len(window)} packed sequences, GBS is {par.gbs}")
    lengths = [np.asarray(seq.sample_lengths, dtype=np.int64) for seq in window]
    flops = np.array([packed_flops(x, shape) for x in lengths])
    ulysses = flops.reshape(par.ga, par.dp).max(axis=1) / par.cp
    pools, _groups = vrsp_schedule(packed_workloads(lengths), pool_size, par.dp)
    per_pool = flops[pools].sum(axis=1).reshape(par.ga, par.dp // pool_size)
    libra = per_pool.max(axis=1) / (pool_size * par.cp)
    return cost_model.flops_ms(ulysses), cost_model.flops_ms(libra)


def simulate_window(planner, window, par: ParallelConfig, shape: AttentionShape, cost_model: CostModel,
                    seed: int, jitter: bool = True, flops_pool_size: int | None = None) -> list[StepResult]:
    """Replay one GBS window (every GA index, every pool) for one method: plan it with ``planner``
    (an object with ``plan_window(window, par, shape) -> list[Plan]``, the baselines registry's
    Planner) and price the plans (:func:`price_window`, which documents the other arguments).

    Raises:
        ValueError: ``par`` differs from the cost model's topology, or the window size is not GBS.
    """
    _check_window(window, par, cost_model)
    return price_window(planner.plan_window(window, par, shape), window, par, shape, cost_model, seed, jitter,
                        flops_pool_size)


def price_window(plans, window, par: ParallelConfig, shape: AttentionShape, cost_model: CostModel,
                 seed: int, jitter: bool = True, flops_pool_size: int | None = None) -> list[StepResult]:
    """Price one GBS window's plans (made once, possibly priced under several cost models).

    Args:
        plans: the window's Plans (one per GA index; a planner may form another number of microbatches).
        window: the window's ``GBS`` packed sequences (``list[PackedSequence]``).
        par: parallel layout; must match the cost model's topology.
        shape: attention head geometry.
        cost_model: prices each Plan.
        seed: device-jitter seed; use the same seed for every method of a comparison.
        jitter: apply the profile's device variability (False: every GPU at speed 1).
        flops_pool_size: ``P`` of Libra's FLOPs-only straggler; when given, every step carries
            both :func:`flops_stragglers` (None, or plans that form another number of steps
            than GA: they stay NaN).

    Returns:
        One :class:`StepResult` per Plan, in order.

    Raises:
        ValueError: ``par`` differs from the cost model's topology, or the window size is not GBS.
    """
    _check_window(window, par, cost_model)
    dev = DeviceJitter(cost_model.profile.variability, par.workers, seed) if jitter else None
    out = []
    for plan in plans:
        speed = dev.speeds(int(plan.ga_index)) if dev is not None else None
        out.append(step_result(cost_model.price(plan, speed=speed)))
    if flops_pool_size is not None and len(out) == par.ga:  # a planner with its own step count: no GA pairing
        uly, lib = flops_stragglers(window, par, shape, flops_pool_size, cost_model)
        out = [replace(r, flops_ulysses_ms=float(uly[r.step]), flops_libra_ms=float(lib[r.step])) for r in out]
    return out


def _check_window(window, par: ParallelConfig, cost_model: CostModel) -> None:
    if par != cost_model.topology.par:
        raise ValueError(f"parallel layout {par} differs from the cost model's topology {cost_model.topology.par}")
    if len(window) != par.gbs:
        raise ValueError(f"window holds {len(window)} packed sequences, GBS is {par.gbs}")


def summarize(results: list[StepResult]) -> dict:
    """Mean and max straggler over a list of steps (the Figure 12 statistics)."""
    s = np.array([r.straggler_ms for r in results], dtype=np.float64)
    return {"mean_ms": float(s.mean()), "max_ms": float(s.max()), "steps": len(s)}
