"""Compiled-vs-oracle identity: every compiled kernel of ``libra/jit/`` gives exactly what its
Python/numpy implementation gives, and the one switch that picks between them.

The compiled code is a second implementation for speed only, so any difference is a bug in it.
Modules: ``test_identity_kernels`` (one parametrized sweep of every kernel on mixed pools),
``test_identity_tiles_layout``, ``test_identity_placement``, ``test_identity_exchange`` and
``test_identity_cost`` (property tests over wider inputs), ``test_compiled_switch`` (the
``impl``/``placer`` choice, the fallback without numba, warmup). A test marked ``numba`` is skipped
with that reason where numba is not installed; the rest still compare the numpy paths or check
the fallback.
"""

from __future__ import annotations

import numpy as np
import pytest

from libra.tap.placement import available_placers

HAVE_NUMBA = "numba" in available_placers()


def pytest_configure(config):
    config.addinivalue_line("markers", "numba: compares a compiled kernel; skipped without numba")


def pytest_collection_modifyitems(config, items):
    """A ``numba`` test without numba is skipped with the extra to install (listed by ``-ra``)."""
    if HAVE_NUMBA:
        return
    skip = pytest.mark.skip(reason="numba not installed (pip install -e '.[fast]')")
    for item in items:
        if item.get_closest_marker("numba"):
            item.add_marker(skip)


def _assert_same(a, b, what: str = "") -> None:
    """``a`` (compiled) is ``b`` (oracle): column tables (``TileTable``, ``TransferTable``) column
    for column with their declared dtypes, dicts of arrays (kernel segments) key for key with equal
    dtypes, anything else value for value."""
    fields = getattr(type(a), "FIELDS", None)
    if isinstance(fields, dict):
        assert len(a) == len(b), what
        for name, dtype in fields.items():
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype == dtype and np.array_equal(x, y), f"{what} {name}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for key in a:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), f"{what} {key}"
    else:
        assert np.array_equal(np.asarray(a), np.asarray(b)), what


@pytest.fixture(scope="session")
def assert_same():
    """:func:`_assert_same` (session-scoped, so hypothesis tests may take it)."""
    return _assert_same
