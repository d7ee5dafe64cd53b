"""Asynchronous CPU planning: plans for upcoming steps are built while the current step runs.

Libra sec. 5: planning (VRSP, TAP) runs on CPU from sequence-length metadata only, hidden behind
multi-second GPU steps. :class:`AsyncPlanner` runs a pure ``plan_fn(metadata) -> plans`` in a
background worker (a thread by default, or a process for GIL-heavy planners); the training loop
calls :meth:`AsyncPlanner.get` when it needs step ``s``'s plans and waits only if they are late
(the wait is recorded). :meth:`AsyncPlanner.get_verified` additionally checks, before the first use,
that every pool rank built the same plan (all_gather of the digest, PlanMismatchError naming ranks).

The planner owns its executor (no module globals); close it, or use it as a context manager.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass

from libra.runtime.agreement import check_plan_agreement
from libra.runtime.groups import PoolGroup


@dataclass
class StepRecord:
    """Timing of one step's plans: seconds spent planning (in the background) and waiting for it."""

    step: int
    plan_s: float = float("nan")
    wait_s: float = 0.0
    verified: bool = False


def _timed(plan_fn, metadata):
    t0 = time.perf_counter()
    out = plan_fn(metadata)
    return out, time.perf_counter() - t0


class AsyncPlanner:
    """Background planner for upcoming steps.

    Args:
        plan_fn: pure function ``metadata -> plans`` (e.g. ``lambda w: planner.plan_window(w, par,
            shape)``); must be picklable for ``mode="process"``.
        mode: ``"thread"`` or ``"process"`` (spawned; planning then never contends for this
            process's GIL).
        max_pending: bound on submitted, not yet consumed steps (memory guard).

    Raises:
        ValueError: bad ``mode`` / ``max_pending`` or a non-callable ``plan_fn``.
    """

    def __init__(self, plan_fn: Callable, mode: str = "thread", max_pending: int = 4):
        if not callable(plan_fn):
            raise ValueError(f"plan_fn must be callable, got {type(plan_fn).__name__}")
        if mode not in ("thread", "process"):
            raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive integer, got {max_pending!r}")
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
        self._futures[step] = self._pool.submit(_timed, self.plan_fn, metadata)
        self.records[step] = StepRecord(step)

    def ready(self, step: int) -> bool:
        fut = self._futures.get(step)
        return fut is not None and fut.done()

    def get(self, step: int, timeout: float | None = None):
        """Plans of ``step``; blocks only while they are still being built (wait recorded).

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
            plans, plan_s = fut.result(timeout=timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"plans of step {step} not ready after {timeout}s") from None
        except Exception as exc:
            del self._futures[step]
            raise RuntimeError(f"planning step {step} failed: {exc}") from exc
        rec = self.records[step]
        rec.wait_s, rec.plan_s = time.perf_counter() - t0, plan_s
        del self._futures[step]
        return plans

    def get_verified(self, step: int, group: PoolGroup, select=None, timeout: float | None = None):
        """:meth:`get` plus the pool's digest agreement check before the first use.

        Args:
            select: ``plans -> plan`` picking what this pool executes (default: the plans
                themselves, which must then have ``digest()``).

        Raises:
            PlanMismatchError: pool ranks built different plans (names the ranks).
        """
        plans = self.get(step, timeout)
        plan = select(plans) if select is not None else plans
        check_plan_agreement(plan.digest(), group)
        self.records[step].verified = True
        return plans

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> AsyncPlanner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
