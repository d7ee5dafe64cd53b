"""Plan compilation and the step's path, at the paper's two settings (issue 12 targets on a 2-core
machine: ``compile`` <= 50 ms per worker, ``prepare`` <= 5 ms).

* ``compile``: :func:`libra.runtime.program.compile_worker` for one worker of a TAP-planned VRSP
  pool of the first ``libra-prod`` window (the planner-side call ``AsyncPlanner(compile_for=...)``
  runs in the background), for a worker at the pool's first, middle and last rank;
* ``prepare``: what remains on the step's path once ``AsyncPlanner.get()`` returned -- unpickling
  the program (process mode), :func:`libra.runtime.attention.prepare` on it and the digest
  agreement -- on a 1-process gloo group, CPU device (``experiments.figures.plan_cost.step_path_fns``, the
  same calls ``libra-bench plan-cost`` times).

Run with ``make bench`` (or ``pytest benchmarks --benchmark-only``).
"""

from __future__ import annotations

import functools

import pytest
from test_bench_tap import SETTINGS, SHAPE, realistic_pool

from experiments.figures.plan_cost import one_process_group, step_path_fns
from libra.config import TapConfig
from libra.runtime.program import compile_worker
from libra.tap.planner import plan_pool

M = 4  # Pipeliner chunks of the paper settings (TapConfig's default)


@functools.cache
def planned_pool(name: str):
    seqs, workers = realistic_pool(name)
    tap = TapConfig(pool_size=8, block_size=SETTINGS[name]["block"], head_split=2, tau=0.03, pipeline_chunks=M)
    pool = plan_pool(0, seqs, workers, tap, SHAPE)
    return pool, pool.digest()


@pytest.fixture(scope="module")
def world():
    with one_process_group() as group:
        yield group


@pytest.mark.parametrize("rank", ["first", "middle", "last"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_bench_compile_worker(benchmark, name, rank):
    pool, digest = planned_pool(name)
    w = pool.workers[{"first": 0, "middle": len(pool.workers) // 2, "last": -1}[rank]]
    prog = benchmark(compile_worker, pool, SHAPE, w, M, digest=digest)
    benchmark.extra_info.update(worker=w, workers=len(pool.workers), target_ms=50.0)
    assert prog.worker == w and prog.chunks == M and prog.digest == digest


@pytest.mark.parametrize("name", list(SETTINGS))
def test_bench_prepare(benchmark, name, world):
    pool, digest = planned_pool(name)
    w = pool.workers[len(pool.workers) // 2]
    step_path = step_path_fns(compile_worker(pool, SHAPE, w, M, digest=digest), world)["prepare"]
    attn = benchmark(step_path)
    benchmark.extra_info.update(worker=w, target_ms=5.0)
    assert attn.program.worker == w
