"""Benchmark session setup: JIT compilation (e.g. the numba TAP placer) runs once, before any
benchmark, so that no round includes it; the placer and the warmup cost are printed at the end of
the session, as ``libra-bench plan-cost`` reports them."""

from __future__ import annotations

import pytest

_WARMUP: dict = {}


@pytest.fixture(scope="session", autouse=True)
def jit_warmup():
    from experiments.figures.plan_cost import jit_warmup as run_warmups
    from experiments.figures.plan_cost import placer_name

    _WARMUP.update(placer=placer_name(), ms=run_warmups())
    return _WARMUP


def pytest_terminal_summary(terminalreporter):
    if _WARMUP:
        spent = ", ".join(f"{m} {ms:.0f} ms" for m, ms in _WARMUP["ms"].items()) or "none"
        terminalreporter.write_line(f"placer: {_WARMUP['placer']}; JIT warmup (once, excluded from every "
                                    f"benchmark): {spent}")
