"""Tiled Attention Pooling (Libra sec. 4.3, 4.4): SH-tiles, Algorithm 2, exchange plan, Pipeliner."""

from libra.tap.exchange import build_transfers
from libra.tap.pipeline import ChunkSchedule
from libra.tap.placement import place_tiles
from libra.tap.planner import plan_pool
from libra.tap.tiles import kv_atoms, kv_need_start, make_tiles
from libra.tap.weights import kernel_time_weights

__all__ = ["ChunkSchedule", "build_transfers", "kernel_time_weights", "kv_atoms", "kv_need_start", "make_tiles",
           "place_tiles", "plan_pool"]
