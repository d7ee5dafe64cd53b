"""The Plan contract (DESIGN.md sec. 2): one package, four modules with one job each.

* :mod:`libra.plan.tables`: the struct-of-arrays TileTable / TransferTable, transfer kinds, errors;
* :mod:`libra.plan.layout`: SequenceLayout, PoolIndex, KV intervals, kernel segments;
* :mod:`libra.plan.contract`: PoolPlan and Plan (data, JSON, digests);
* :mod:`libra.plan.checks`: every invariant, checked exactly (``Plan.validate``);
* :mod:`libra.plan.chunkings`: the registry of Pipeliner chunkings (the paper's and extensions').

Dependencies run ``tables <- layout <- checks <- contract``; this ``__init__`` re-exports the
public names so ``from libra.plan import Plan`` keeps working.
"""

from libra.plan.checks import check_plan_agreement, check_pool
from libra.plan.chunkings import HEADS, chunkings, schedule_class
from libra.plan.contract import Plan, PoolPlan
from libra.plan.layout import (
    SEGMENT_FIELDS,
    PoolIndex,
    SequenceLayout,
    kv_need_start,
    merge_pieces,
    pool_index,
    segments,
    tile_flops,
)
from libra.plan.tables import (
    KIND_NAMES,
    KV,
    O,
    PlanMismatchError,
    PlanValidationError,
    Q,
    TileTable,
    TransferTable,
)

__all__ = ["HEADS", "KIND_NAMES", "KV", "O", "Q", "SEGMENT_FIELDS", "Plan", "PlanMismatchError", "PlanValidationError",
           "PoolIndex", "PoolPlan", "SequenceLayout", "TileTable", "TransferTable", "check_plan_agreement",
           "check_pool", "chunkings", "kv_need_start", "merge_pieces", "pool_index", "schedule_class", "segments", "tile_flops"]
