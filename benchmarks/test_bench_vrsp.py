"""VRSP speed (Libra sec. 4.2: 48 us at D = 128 and 106 us at D = 256, P = 8, one CPU core).

Run with ``make bench`` or
``pytest benchmarks/test_bench_vrsp.py --benchmark-only --benchmark-columns=median,iqr,rounds``.
The inputs are real window workloads (``sum l^2`` of libra-prod packed sequences), the case VRSP
runs on in training; a float-workload case exercises the tuple-heap fallback.
"""

from __future__ import annotations

import numpy as np
import pytest

from libra.data.windows import gbs_windows, window_workloads
from libra.vrsp import vrsp

PAPER_US = {128: 48.0, 256: 106.0}


def _window(d: int) -> np.ndarray:
    return window_workloads(gbs_windows("libra-prod", 262144, d, 1, seed=0)[0])


@pytest.mark.parametrize("d", [128, 256])
def test_vrsp_p8(benchmark, d):
    w = _window(d)
    pools = benchmark(vrsp, w, 8)
    assert pools.shape == (d // 8, 8)
    benchmark.extra_info["paper_us"] = PAPER_US[d]


@pytest.mark.parametrize("d", [128, 256])
def test_vrsp_p8_float_workloads(benchmark, d):
    w = _window(d) * 1.000001 + 0.5  # non-integer: the (load, pool) tuple heap
    pools = benchmark(vrsp, w, 8)
    assert pools.shape == (d // 8, 8)
