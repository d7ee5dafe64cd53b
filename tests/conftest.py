"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

WORKLOADS_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "workloads"


def pytest_configure(config):
    """One intra-op torch thread: the tests' tensors are tiny, and two threads that synchronise on
    every small op spin against each other on a 2-core machine (the suite ran 2-3x slower). Spawned
    ranks and measuring commands set their own thread count."""
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """A ``gpu`` test on a machine without CUDA is skipped with that reason (listed by ``-ra``),
    never deselected silently."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture
def workloads_dir() -> Path:
    """The public length files in ``../shared/workloads`` next to the checkout (skips when absent)."""
    if not WORKLOADS_DIR.is_dir():
        pytest.skip(f"public length files not found at {WORKLOADS_DIR} (they live next to the checkout)")
    return WORKLOADS_DIR


@pytest.fixture
def planner_calls(monkeypatch) -> list:
    """Every ``baselines.registry.get_planner(name, tap=None, **options)`` call of the test, as ``(name,
    options)`` in the flat form a run records (:func:`baselines.registry.option_record` when a TapConfig is given)."""
    import baselines.registry as registry  # noqa: PLC0415

    seen, real = [], registry.get_planner

    def spy(name, tap=None, **options):
        seen.append((name, options if tap is None else registry.option_record(name, tap, **options)))
        return real(name, tap, **options)

    monkeypatch.setattr(registry, "get_planner", spy)
    return seen
