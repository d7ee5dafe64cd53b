"""The optional compiled TAP kernels (numba, the ``[fast]`` extra), found in one place.

Placement, tiles and exchange each have a numba module (``placement_jit``, ``tiles_jit``,
``exchange_jit``) next to the Python/numpy implementation that stays the oracle and the fallback.
:func:`compiled` imports one of them once per process, or returns None where numba is missing.
"""

from __future__ import annotations

import functools
import importlib

JIT_MODULES = ("placement_jit", "tiles_jit", "exchange_jit")


@functools.cache
def compiled(name: str):
    """``libra.tap.<name>`` when numba imports, else None (checked once per process)."""
    if name not in JIT_MODULES:
        raise ValueError(f"unknown compiled TAP module {name!r}; one of {JIT_MODULES}")
    try:
        return importlib.import_module(f"libra.tap.{name}")
    except ImportError:
        return None
