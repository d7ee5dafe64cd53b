"""The optional compiled kernels (numba, the ``[fast]`` extra), found in one place.

Placement, tiles and exchange each have a numba module (``libra.tap.placement_jit``, ``tiles_jit``,
``exchange_jit``), the plan's kernel segments one (``libra.plan.layout_jit``) and the cost model's
communication terms one (``libra.sim.cost_jit``), next to
the Python/numpy implementation that stays the oracle and the fallback. :func:`compiled` imports
one of them once per process, or returns None where numba is missing; :func:`select` is the one
rule by which an ``impl`` (``placer``) choice picks it, and :func:`impl_name` what ``"auto"`` runs.
"""

from __future__ import annotations

import functools
import importlib
import time

JIT_MODULES = {"placement_jit": "libra.tap.placement_jit", "tiles_jit": "libra.tap.tiles_jit",
               "exchange_jit": "libra.tap.exchange_jit", "cost_jit": "libra.sim.cost_jit",
               "layout_jit": "libra.plan.layout_jit"}


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
