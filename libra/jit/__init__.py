"""The compiled kernels (numba, the ``[fast]`` extra): one room, one switch.

Each hot algorithm has one Python/numpy implementation next to its concept (the oracle and the
fallback: :mod:`libra.tap.tiles`, :mod:`libra.tap.placement`, :mod:`libra.tap.exchange`,
:mod:`libra.plan.layout`, :mod:`libra.sim.cost`) and, here, its compiled twin:
:mod:`~libra.jit.tiles`, :mod:`~libra.jit.placement`, :mod:`~libra.jit.exchange`,
:mod:`~libra.jit.layout` and :mod:`~libra.jit.cost`. The twins are numba-only code: run without
numba (``NUMBA_DISABLE_JIT=1``) they were 12x (tiles), 10x (placement) and 44x (exchange) slower
than the numpy/Python implementations on a 256K libra-prod pool, so the numpy code cannot be
replaced by them. ``tests/compiled_identity/`` checks every twin against its oracle.

:func:`compiled` imports one of them once per process, or returns None where numba is missing;
:func:`select` is the one switch by which an ``impl`` (``placer``) choice picks it, and
:func:`impl_name` what ``"auto"`` runs.
"""

from __future__ import annotations

import functools
import importlib
import time

JIT_MODULES = {name: f"libra.jit.{name}" for name in ("placement", "tiles", "exchange", "cost", "layout")}


@functools.cache
def compiled(name: str):
    """The compiled module ``name`` (:data:`JIT_MODULES`) when numba imports, else None (checked
    once per process)."""
    if name not in JIT_MODULES:
        raise ValueError(f"unknown compiled module {name!r}; one of {tuple(JIT_MODULES)}")
    try:
        return importlib.import_module(JIT_MODULES[name])
    except ImportError:
        return None


COMPILED_IMPLS = ("auto", "numba")
"""The ``impl`` choices that run a compiled module (``"auto"`` only where numba imports)."""


def select(name: str, impl: str, option: str = "impl"):
    """The compiled module ``name`` that an ``option`` value ``impl`` runs: it for ``"auto"`` (None
    where numba is missing) and ``"numba"``; None for any other value (the caller's numpy/Python
    implementations, whose names the caller checks).

    Raises:
        ImportError: ``impl="numba"`` without numba, naming the extra to install.
    """
    if impl not in COMPILED_IMPLS:
        return None
    jit = compiled(name)
    if jit is None and impl == "numba":
        raise ImportError(f"{option}='numba' needs numba: pip install -e '.[fast]'")
    return jit


def impl_name(name: str, fallback: str = "numpy") -> str:
    """What ``impl="auto"`` runs for compiled module ``name`` in this process: ``"numba"`` or
    ``fallback``. Record it with timings."""
    return "numba" if compiled(name) is not None else fallback


def warmup(name: str) -> float:
    """Compile the kernels of compiled module ``name`` now (its ``warmup()``; once per process, then
    numba's disk cache) so that timed calls exclude compilation; the seconds spent (0.0 without numba)."""
    jit = compiled(name)
    if jit is None:
        return 0.0
    t0 = time.perf_counter()
    jit.warmup()
    return time.perf_counter() - t0
