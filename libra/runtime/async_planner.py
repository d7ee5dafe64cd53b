"""Asynchronous CPU planning: plans for upcoming steps are built while the current step runs.

Libra sec. 5: planning (VRSP, TAP) runs on CPU from sequence-length metadata only, hidden behind
multi-second GPU steps. :class:`AsyncPlanner` runs a pure ``plan_fn(metadata) -> plans`` in a
background worker (a thread by default, or a process for GIL-heavy planners); the training loop
calls :meth:`AsyncPlanner.get` when it needs step ``s``'s plans and waits only if they are late
(the wait is recorded). :meth:`AsyncPlanner.get_verified` additionally checks, before the first use,
that every pool rank built the same plan (all_gather of the digest, PlanMismatchError naming ranks).

Ahead-of-time compilation: with ``compile_for=worker`` (this rank's global worker id, or a tuple of
ids) the background job also runs :func:`libra.runtime.program.compile_worker` for that worker's
pool of every Plan ``plan_fn`` returned, and :meth:`AsyncPlanner.get` returns a
:class:`CompiledStep` (``plans`` plus ``programs``, one :class:`~libra.runtime.program.WorkerProgram`
per Plan). On the step's path :func:`libra.runtime.attention.prepare` then receives the program and
only checks the digest agreement and builds the runner; no index construction is left there::

    planner = AsyncPlanner(plan_step, compile_for=groups.pool.worker)
    planner.submit(step, metadata)
    ready = planner.get(step)                      # CompiledStep
    attn = prepare(ready.programs[ga_index], groups.pool)

The planner owns its executor (no module globals); close it, or use it as a context manager.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from libra.plan import Plan
from libra.runtime.agreement import check_plan_agreement
from libra.runtime.groups import PoolGroup
from libra.runtime.program import WorkerProgram, compile_worker
from libra.tap.pipeline import check_chunks


@dataclass
class StepRecord:
    """Timing of one step's plans: seconds spent planning (in the background) and waiting for it."""

    step: int
    plan_s: float = float("nan")
    wait_s: float = 0.0
    verified: bool = False
    compile_s: float = 0.0


@dataclass(frozen=True, eq=False)
class CompiledStep:
    """One step's plans with this rank's compiled programs (what a compiling planner returns).

    Attributes:
        plans: what ``plan_fn`` returned (a Plan or a sequence of Plans, one per GA index); None
            when the planner was built with ``keep_plans=False``.
        programs: mirrors ``plans``: for each Plan the :class:`WorkerProgram` of the ``compile_for``
            worker (a tuple, one per worker in ``compile_for`` order, when several were asked for);
            a single Plan gives a single entry, a sequence of Plans a list.
        workers: the worker ids the programs were compiled for.
    """

    plans: object
    programs: object
    workers: tuple[int, ...]


def _is_worker_id(w) -> bool:
    return isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= 0


def _worker_ids(workers) -> tuple[int, ...]:
    """``compile_for`` as a tuple of worker ids (ValueError unless non-negative integers)."""
    ids = (workers,) if _is_worker_id(workers) else workers
    if not isinstance(ids, Sequence) or isinstance(ids, str) or not ids or not all(map(_is_worker_id, ids)):
        raise ValueError(f"compile_for must be a worker id or a non-empty sequence of worker ids, got {workers!r}")
    return tuple(int(w) for w in ids)


def compile_plans(plans, workers, chunks: int | None = None):
    """Compile ``workers``' programs of ``plans`` (a Plan or a sequence of Plans) on this process.

    Each worker gets the program of its pool, digest-stamped with the Plan's digest (what
    :func:`~libra.runtime.attention.prepare` compiles from a Plan), with ``chunks`` Pipeliner
    chunks (default: each Plan's ``pipeline_chunks``). Used by :class:`AsyncPlanner` in its
    background worker; pure (no communication), so it may run in another process.

    Returns:
        ``plans``' shape mirrored: per Plan a WorkerProgram (``workers`` an int) or a tuple of them.

    Raises:
        ValueError: ``plans`` holds something other than Plans, or a worker is in no pool of a plan;
        the errors of :func:`~libra.runtime.program.compile_worker` (PlanValidationError, ...).
    """
    ids = _worker_ids(workers)
    single = _is_worker_id(workers)

    def one(plan):
        if not isinstance(plan, Plan):
            raise ValueError(f"compile_for needs plan_fn to return a Plan or a sequence of Plans, got "
                             f"{type(plan).__name__}")
        digest = plan.digest()
        m = plan.pipeline_chunks if chunks is None else chunks
        progs = []
        for w in ids:
            try:
                pool = plan.pool_of_worker(w)
            except KeyError as exc:
                raise ValueError(f"worker {w} is in no pool of the plan of GA index {plan.ga_index}") from exc
            progs.append(compile_worker(pool, plan.shape, w, m, digest=digest))
        return progs[0] if single else tuple(progs)

    if isinstance(plans, Plan):
        return one(plans)
    if isinstance(plans, (str, bytes)) or not isinstance(plans, Sequence):
        raise ValueError(f"compile_for needs plan_fn to return a Plan or a sequence of Plans, got "
                         f"{type(plans).__name__}")
    return [one(p) for p in plans]


def _timed(plan_fn, metadata, workers=None, chunks=None, keep_plans=True):
    """The background job: ``plan_fn(metadata)`` and, with ``workers``, its compilation.

    Returns ``(plans or CompiledStep, plan seconds, compile seconds)``; module level so that a
    spawned process can run it.
    """
    t0 = time.perf_counter()
    out = plan_fn(metadata)
    t1 = time.perf_counter()
    if workers is None:
        return out, t1 - t0, 0.0
    programs = compile_plans(out, workers, chunks)
    step = CompiledStep(out if keep_plans else None, programs, _worker_ids(workers))
    return step, t1 - t0, time.perf_counter() - t1


class AsyncPlanner:
    """Background planner for upcoming steps.

    Args:
        plan_fn: pure function ``metadata -> plans`` (e.g. ``lambda w: planner.plan_window(w, par,
            shape)``); must be picklable for ``mode="process"``.
        mode: ``"thread"`` or ``"process"`` (spawned; planning then never contends for this
            process's GIL).
        max_pending: bound on submitted, not yet consumed steps (memory guard).
        compile_for: this rank's worker id (or a sequence of ids): the background job then also
            compiles that worker's program of every Plan and :meth:`get` returns a
            :class:`CompiledStep` (see :func:`compile_plans`). None: plans only.
        chunks: Pipeliner chunks to compile with (default: each Plan's ``pipeline_chunks``).
        keep_plans: with ``compile_for``, also hand back the Plans (``CompiledStep.plans``); False
            returns programs only (in process mode: less to pickle and unpickle in :meth:`get`).

    Raises:
        ValueError: bad ``mode`` / ``max_pending`` / ``compile_for`` / ``chunks`` or a non-callable
            ``plan_fn``.
    """

    def __init__(self, plan_fn: Callable, mode: str = "thread", max_pending: int = 4, *,
                 compile_for: int | Sequence[int] | None = None, chunks: int | None = None,
                 keep_plans: bool = True):
        if not callable(plan_fn):
            raise ValueError(f"plan_fn must be callable, got {type(plan_fn).__name__}")
        if mode not in ("thread", "process"):
            raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive integer, got {max_pending!r}")
        if chunks is not None:
            check_chunks(chunks)
        if compile_for is None and (chunks is not None or not keep_plans):
            raise ValueError("chunks and keep_plans are only used with compile_for")
        if compile_for is not None:  # validated now; kept as given (an id, or a tuple of ids)
            ids = _worker_ids(compile_for)
            compile_for = int(compile_for) if _is_worker_id(compile_for) else ids
        self.compile_for, self.chunks, self.keep_plans = compile_for, chunks, bool(keep_plans)
        self.plan_fn, self.mode, self.max_pending = plan_fn, mode, max_pending
        if mode == "thread":
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="libra-planner")
        else:
            self._pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
        self._futures: dict[int, cf.Future] = {}
        self.records: dict[int, StepRecord] = {}

    def submit(self, step: int, metadata) -> None:
        """Start planning ``step`` from ``metadata`` (sequence lengths / a GBS window).

        Raises:
            ValueError: step already submitted, negative, or too many pending steps.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if step in self._futures or step in self.records and self.records[step].verified:
            raise ValueError(f"step {step} was already submitted")
        if len(self._futures) >= self.max_pending:
            raise ValueError(f"{len(self._futures)} steps pending (max_pending={self.max_pending}); consume "
                             f"plans with get() before submitting step {step}")
        self._futures[step] = self._pool.submit(_timed, self.plan_fn, metadata, self.compile_for, self.chunks,
                                                self.keep_plans)
        self.records[step] = StepRecord(step)

    def ready(self, step: int) -> bool:
        fut = self._futures.get(step)
        return fut is not None and fut.done()

    def get(self, step: int, timeout: float | None = None):
        """Plans of ``step`` (a :class:`CompiledStep` with ``compile_for``); blocks only while they
        are still being built (wait recorded; in process mode the result is unpickled here).

        Raises:
            KeyError: ``step`` was never submitted (or already consumed).
            TimeoutError: not ready within ``timeout`` seconds.
            RuntimeError: planning failed (chained to the planner's exception).
        """
        fut = self._futures.get(step)
        if fut is None:
            raise KeyError(f"step {step} was not submitted (or its plans were already taken)")
        t0 = time.perf_counter()
        try:
            plans, plan_s, compile_s = fut.result(timeout=timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"plans of step {step} not ready after {timeout}s") from None
        except Exception as exc:
            del self._futures[step]
            raise RuntimeError(f"planning step {step} failed: {exc}") from exc
        rec = self.records[step]
        rec.wait_s, rec.plan_s, rec.compile_s = time.perf_counter() - t0, plan_s, compile_s
        del self._futures[step]
        return plans

    def get_verified(self, step: int, group: PoolGroup, select=None, timeout: float | None = None):
        """:meth:`get` plus the pool's digest agreement check before the first use.

        Args:
            select: ``plans -> plan`` picking what this pool executes (default: the plans
                themselves, which must then have ``digest()``); it may pick a WorkerProgram of a
                :class:`CompiledStep` (its ``digest`` is the Plan's).

        Raises:
            PlanMismatchError: pool ranks built different plans (names the ranks).
        """
        plans = self.get(step, timeout)
        plan = select(plans) if select is not None else plans
        check_plan_agreement(plan.digest if isinstance(plan, WorkerProgram) else plan.digest(), group)
        self.records[step].verified = True
        return plans

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> AsyncPlanner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
