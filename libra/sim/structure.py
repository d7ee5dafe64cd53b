"""What pricing a pool needs that no hardware profile changes, built once per pool.

A pool's Pipeliner schedule (:func:`libra.tap.pipeline.schedule_for_pool`), its merged kernel
segments (:meth:`libra.plan.PoolPlan.kernel_segments`) and its per-phase transfer routes
(:meth:`libra.tap.pipeline.ChunkSchedule.phase_routes`) depend on the plan alone: the profile only
prices them. A planner that prices one candidate under several profiles (``libra-adaptive``'s
ensemble guard) or one plan twice shares a :class:`PoolStructures` between its cost models, so
each pool's structure is built once. Values are read, never modified, by the cost model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

STRUCTURE_POOLS = 16
"""How many pools' structures a shared :class:`PoolStructures` keeps (least recently used dropped):
the candidates of one pool. A pool's structure at 256K is megabytes, so a cost model keeps none of
its own (``size = 0``) unless given a shared one."""


class PoolStructures:
    """A bounded cache of per-pool structure, keyed by the pool object (identity: a PoolPlan is
    frozen), what was built and its arguments. The pool is held with its entry, so its id cannot be
    reused while the entry lives."""

    def __init__(self, size: int = STRUCTURE_POOLS):
        self._entries: OrderedDict = OrderedDict()
        self._size = size

    def get(self, pool, what: tuple, build: Callable[[], object]):
        """The structure ``what`` (a hashable tag with its arguments) of ``pool``: built by ``build``
        on the first request, the same object after."""
        if not self._size:
            return build()
        key = (id(pool), what)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is pool:
            self._entries.move_to_end(key)
            return hit[1]
        value = build()
        self._entries[key] = (pool, value)
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return value
