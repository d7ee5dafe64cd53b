"""The Pipeliner chunkings a pool plan may name, and where each one's schedule lives.

A :class:`~libra.plan.PoolPlan` says how the Pipeliner cuts its work into chunks (its
``chunking``). The paper's chunking is :data:`HEADS`: every tile's query heads cut into ``M``
slices (Libra sec. 4.4, :class:`libra.tap.pipeline.ChunkSchedule`). Other chunkings come from
extensions, which register their schedule class under the setuptools entry-point group
:data:`ENTRY_POINT_GROUP` (``name = "module:Class"``); the runtime and the simulator look a pool's
schedule up here by name (:func:`schedule_class`), so neither imports the extension that planned
the pool, and a plan read back from JSON in another process finds its schedule too.

Every schedule class has ``for_pool(pool, shape, chunks)`` and the interface of
:class:`~libra.tap.pipeline.ChunkSchedule` (``chunks``, ``events``, ``segment_calls``,
``transfer_pieces``, ``phase_routes``, ``check_hops``).
"""

from __future__ import annotations

import importlib
from functools import cache
from importlib.metadata import entry_points

HEADS = "heads"
"""The paper's chunking (Libra sec. 4.4)."""

ENTRY_POINT_GROUP = "libra.chunkings"
"""The entry-point group an extension registers its chunkings under."""

CORE = {HEADS: "libra.tap.pipeline:ChunkSchedule"}


@cache
def chunkings() -> dict[str, str]:
    """``{chunking name: "module:Class"}``: the paper's, then the installed extensions' in name
    order (read once per process: installed packages do not change while it runs)."""
    found = {ep.name: ep.value for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)}
    return {**CORE, **{k: v for k, v in found.items() if k not in CORE}}


def check_chunking(name: str, where: str = "") -> str:
    """``name`` when it is a registered chunking, else ValueError listing the registered ones."""
    known = chunkings()
    if name not in known:
        raise ValueError(f"{where}unknown Pipeliner chunking {name!r} (expected one of {', '.join(known)})")
    return name


@cache
def schedule_class(name: str) -> type:
    """The schedule class registered as chunking ``name`` (its module imported on first use).

    Raises:
        ValueError: an unknown chunking.
    """
    module, attr = chunkings()[check_chunking(name)].split(":")
    return getattr(importlib.import_module(module), attr)
