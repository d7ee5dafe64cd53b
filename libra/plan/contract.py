"""The Plan contract: who computes which attention work, and which transfers that implies.

Every method (Libra and each baseline) is a planner that turns one microbatch group into a
:class:`Plan` (DESIGN.md sec. 2). The simulator prices Plans, the runtime executes them and the
tests check their invariants, so these classes are data: numpy-only, explicit, immutable.

Structure
---------
``Plan`` (one microbatch group = one GA index)
  ``pools``: one :class:`PoolPlan` per pool of ``P`` DP replicas (Ulysses and WLB-LLM: P = 1).
``PoolPlan``
  ``workers``: global worker ids ``dp_rank * CP + cp_rank`` in pool-rank order.
  ``sequences``: the pool's packed sequences with their pre-attention token layout
  (:class:`~libra.plan.layout.SequenceLayout`: which worker holds which token range, all heads).
  ``tiles``: a :class:`~libra.plan.tables.TileTable` (struct of arrays): each row is one unit of
  placed attention work -- a token range of one sequence x a query-head range, with its Q-home
  and destination.
  ``transfers``: a :class:`~libra.plan.tables.TransferTable`: forward Q dispatch, KV fetch (per
  sample and KV-head range, per fragment holder, de-duplicated per destination) and output return.

Backward (Libra sec. 4.3.3) is derived, never planned separately: dO follows the Q path, dQ the
output path, dK/dV retrace the KV paths in reverse (:meth:`TransferTable.backward`).

A tile's KV group is the whole causal prefix of each sample it touches, so its output is final on
its destination: no cross-worker softmax merge exists in any Plan.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from libra.plan.checks import check_pool
from libra.plan.chunkings import HEADS, check_chunking
from libra.plan.layout import SEGMENT_FIELDS, PoolIndex, SequenceLayout, merge_pieces, pool_index, segments
from libra.plan.tables import PlanValidationError, TileTable, TransferTable
from libra.workload import AttentionShape


@dataclass(frozen=True, eq=False)
class PoolPlan:
    """Placement and transfers of one pool at one GA index.

    Attributes:
        pool_index: index of the pool within its microbatch group.
        workers: global worker ids in pool-rank order (``W = P * CP`` of them).
        sequences: the pool's packed sequences (``P`` for fixed-token methods).
        tiles: placed work.
        transfers: forward transfers implied by the placement.
        fallback_tiles: tiles Algorithm 2 placed by its least-loaded fallback (no worker below C).
        chunking: how the Pipeliner cuts the pool's work into chunks (a registered chunking,
            :mod:`libra.plan.chunkings`; the paper's is ``heads``); part of
            the digest only when not the paper's ``heads``, so paper plans hash as before.
    """

    pool_index: int
    workers: tuple[int, ...]
    sequences: tuple[SequenceLayout, ...]
    tiles: TileTable
    transfers: TransferTable
    fallback_tiles: int = 0
    chunking: str = HEADS

    def __post_init__(self) -> None:
        if self.chunking != HEADS:
            check_chunking(self.chunking, f"pool {self.pool_index}: ")
        object.__setattr__(self, "workers", tuple(map(int, self.workers)))
        object.__setattr__(self, "sequences", tuple(self.sequences))

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def worker_index(self) -> dict[int, int]:
        """Global worker id -> rank inside the pool."""
        return {w: i for i, w in enumerate(self.workers)}

    def worker_flops(self) -> np.ndarray:
        """Forward FLOPs per pool worker, ``(W,)`` in pool-rank order (workers need not be sorted).

        Raises:
            ValueError: a tile whose ``dest`` is not a pool worker.
        """
        w = np.asarray(self.workers, dtype=np.int64)
        order = np.argsort(w, kind="stable")
        pos = np.minimum(np.searchsorted(w[order], self.tiles.dest), max(len(w) - 1, 0))
        if len(self.tiles) and (not len(w) or np.any(w[order][pos] != self.tiles.dest)):
            raise ValueError(f"pool {self.pool_index}: a tile's dest is not one of the pool workers {list(self.workers)}")
        return np.bincount(order[pos], weights=self.tiles.flops, minlength=self.num_workers)

    def index(self) -> PoolIndex:
        """The pool's :class:`~libra.plan.layout.PoolIndex` (built once, cached: the plan is immutable)."""
        idx = self.__dict__.get("_index")
        if idx is None:
            idx = pool_index(self.sequences)
            object.__setattr__(self, "_index", idx)
        return idx

    def segments(self) -> dict[str, np.ndarray]:
        """The pool's kernel segments (:func:`libra.plan.layout.segments` of its tiles)."""
        return segments(self.sequences, self.tiles, self.index())

    def kernel_segments(self, sched, worker: int | None = None, ordered: bool = True) -> tuple[dict, np.ndarray]:
        """The segments the runtime runs and the cost model prices under Pipeliner schedule
        ``sched`` -- :meth:`segments` with adjacent pieces merged (:func:`libra.plan.layout.merge_pieces`)
        -- of the whole pool or of one ``worker``, and the chunk of each (``ordered``: as there)."""
        seg = self.segments()
        if worker is not None:
            mine = np.flatnonzero(seg["dest"] == worker)
            seg = {k: v[mine] for k, v in seg.items()}
        if not len(seg["tile"]):
            return {k: np.zeros(0, np.int64) for k in SEGMENT_FIELDS}, np.zeros(0, np.int64)
        tile = seg["tile"]
        return merge_pieces(seg, sched.segment_calls(seg)[0], self.tiles.head_start[tile], self.tiles.head_end[tile],
                            ordered)

    def to_dict(self) -> dict:
        out = {"pool_index": self.pool_index, "workers": list(self.workers),
               "sequences": [s.to_dict() for s in self.sequences], "tiles": self.tiles.to_dict(),
               "transfers": self.transfers.to_dict(), "fallback_tiles": int(self.fallback_tiles)}
        if self.chunking != HEADS:
            out["chunking"] = self.chunking
        return out

    @classmethod
    def from_dict(cls, d: dict) -> PoolPlan:
        return cls(pool_index=d["pool_index"], workers=tuple(d["workers"]),
                   sequences=tuple(SequenceLayout.from_dict(s) for s in d["sequences"]),
                   tiles=TileTable.from_dict(d["tiles"]), transfers=TransferTable.from_dict(d["transfers"]),
                   fallback_tiles=d.get("fallback_tiles", 0), chunking=d.get("chunking", HEADS))

    def digest(self) -> str:
        """sha256 of the pool plan's content; all ranks of the pool must agree on it."""
        h = hashlib.sha256()
        head = {"pool_index": self.pool_index, "workers": list(self.workers),
                "fallback_tiles": int(self.fallback_tiles)}
        if self.chunking != HEADS:
            head["chunking"] = self.chunking
        h.update(json.dumps(head).encode())
        for s in self.sequences:
            h.update(json.dumps(s.to_dict(), sort_keys=True).encode())
        self.tiles.digest_into(h)
        self.transfers.digest_into(h)
        return h.hexdigest()


@dataclass(frozen=True, eq=False)
class Plan:
    """Everything one method decided for one microbatch group (one GA index).

    Attributes:
        method: planner registry name (``ulysses``, ``libra``, ...).
        ga_index: gradient-accumulation index within the optimizer step.
        shape: attention head geometry the FLOPs and bytes were computed for.
        cp: context-parallel degree.
        pipeline_chunks: Pipeliner chunks ``M`` the runtime/simulator should use (1 = no overlap).
        pools: one plan per pool.
        meta: method parameters (block size, head split, tau, ...) for records; hashed too.
    """

    method: str
    ga_index: int
    shape: AttentionShape
    cp: int
    pipeline_chunks: int
    pools: tuple[PoolPlan, ...]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(self.pools))

    def pool_of_worker(self, worker: int) -> PoolPlan:
        for pool in self.pools:
            if worker in pool.workers:
                return pool
        raise KeyError(f"worker {worker} is in no pool of this plan")

    def to_dict(self) -> dict:
        s = self.shape
        return {"method": self.method, "ga_index": self.ga_index,
                "shape": {"num_q_heads": s.num_q_heads, "num_kv_heads": s.num_kv_heads,
                          "head_dim": s.head_dim, "dtype_bytes": s.dtype_bytes},
                "cp": self.cp, "pipeline_chunks": self.pipeline_chunks, "meta": self.meta,
                "pools": [p.to_dict() for p in self.pools]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(method=d["method"], ga_index=d["ga_index"], shape=AttentionShape(**d["shape"]),
                   cp=d["cp"], pipeline_chunks=d["pipeline_chunks"],
                   pools=tuple(PoolPlan.from_dict(p) for p in d["pools"]), meta=d.get("meta", {}))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def digest(self) -> str:
        """sha256 over the header and every pool's digest."""
        h = hashlib.sha256()
        header = self.to_dict()
        header.pop("pools")
        h.update(json.dumps(header, sort_keys=True).encode())
        for p in self.pools:
            h.update(p.digest().encode())
        return h.hexdigest()

    def validate(self) -> Plan:
        """Check every invariant of DESIGN.md sec. 2; returns ``self`` so calls can chain.

        Raises:
            PlanValidationError: naming the pool and the violated invariant.
        """
        seen: dict[int, int] = {}
        for pool in self.pools:
            for w in pool.workers:
                if w in seen:
                    raise PlanValidationError(f"worker {w} is in pool {seen[w]} and pool {pool.pool_index}")
                seen[w] = pool.pool_index
            check_pool(pool, self.shape)
        return self
