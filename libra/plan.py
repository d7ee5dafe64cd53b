"""The Plan contract: who computes which attention work, and which transfers that implies.

Every method (Libra and each baseline) is a planner that turns one microbatch group into a
:class:`Plan` (DESIGN.md sec. 2). The simulator prices Plans, the runtime executes them and the
tests check their invariants, so this module is deliberately small, numpy-only and explicit.

Structure
---------
``Plan`` (one microbatch group = one GA index)
  ``pools``: one :class:`PoolPlan` per pool of ``P`` DP replicas (Ulysses and WLB-LLM: P = 1).
``PoolPlan``
  ``workers``: global worker ids ``dp_rank * CP + cp_rank`` in pool-rank order.
  ``sequences``: the pool's packed sequences with their pre-attention token layout
  (:class:`SequenceLayout`: which worker holds which token range, all heads).
  ``tiles``: a :class:`TileTable` (struct of arrays): each row is one unit of placed attention
  work -- a token range of one sequence x a query-head range, with its Q-home and destination.
  ``transfers``: a :class:`TransferTable`: forward Q dispatch, KV fetch (per sample and KV-head
  range, per fragment holder, de-duplicated per destination) and output return.

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

from libra.workload import AttentionShape, attention_flops, range_areas

Q, KV, O = 0, 1, 2  # noqa: E741  (the paper's names for the three transfer kinds)
KIND_NAMES = {Q: "q", KV: "kv", O: "o"}


class PlanMismatchError(RuntimeError):
    """Ranks of one pool hold plans with different hashes (raised before a plan's first use)."""


class PlanValidationError(ValueError):
    """A Plan violates one of its invariants; the message names the invariant and the offender."""


def _arr(values, dtype) -> np.ndarray:
    out = np.ascontiguousarray(np.asarray(values, dtype=dtype))
    out.setflags(write=False)
    return out


# --------------------------------------------------------------------------------------------
# sequences and their pre-attention layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SequenceLayout:
    """One packed sequence of a pool and where its tokens live before attention.

    Attributes:
        seq_id: index of the packed sequence in its GBS window (stable across plans).
        dp_rank: DP replica whose CP group holds it.
        sample_lengths: int64 ``(n_samples,)`` sample lengths in packing order.
        holder_start, holder_end, holder_worker: ``(n_ranges,)`` token ranges ``[start, end)``
            and the global worker holding Q, K and V of those tokens (all heads). The ranges
            partition ``[0, num_tokens)``. Standard layout: CP contiguous equal ranges.

    Raises:
        ValueError: arrays that are not 1-D, negative sample lengths, holder columns of unequal
            length, or holder ranges that do not partition ``[0, num_tokens)`` (names the ranges).
    """

    seq_id: int
    dp_rank: int
    sample_lengths: np.ndarray
    holder_start: np.ndarray
    holder_end: np.ndarray
    holder_worker: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "sample_lengths", _arr(self.sample_lengths, np.int64))
        for name in ("holder_start", "holder_end"):
            object.__setattr__(self, name, _arr(getattr(self, name), np.int64))
        object.__setattr__(self, "holder_worker", _arr(self.holder_worker, np.int32))
        lengths, hs, he = self.sample_lengths, self.holder_start, self.holder_end
        if lengths.ndim != 1 or np.any(lengths < 0):
            raise ValueError(f"sequence {self.seq_id}: sample_lengths must be 1-D and >= 0")
        if not (hs.ndim == he.ndim == self.holder_worker.ndim == 1 and len(hs) == len(he) == len(self.holder_worker)):
            raise ValueError(f"sequence {self.seq_id}: holder_start/end/worker must be 1-D of equal length")
        # cached derived arrays (the layout is immutable): planning reads them per tile batch
        offsets = _arr(np.concatenate(([0], np.cumsum(lengths))), np.int64)
        order = _arr(np.argsort(hs, kind="stable"), np.int64)
        a, b, total = hs[order], he[order], int(offsets[-1])
        if len(a) == 0 or a[0] != 0 or b[-1] != total or np.any(b <= a) or np.any(a[1:] != b[:-1]):
            raise ValueError(f"sequence {self.seq_id}: holder ranges {list(zip(a.tolist(), b.tolist()))} do not "
                             f"partition its {total} tokens")
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_holder_order", order)

    @classmethod
    def contiguous(cls, seq_id: int, dp_rank: int, sample_lengths, cp: int) -> SequenceLayout:
        """The standard pre-attention layout: CP equal contiguous ranges, rank r -> worker dp*CP+r.

        Raises:
            ValueError: CP does not divide the sequence's token count.
        """
        lengths = np.asarray(sample_lengths, dtype=np.int64)
        total = int(lengths.sum())
        if total % cp:
            raise ValueError(f"CP={cp} must divide the packed sequence length {total}")
        per = total // cp
        starts = np.arange(cp, dtype=np.int64) * per
        return cls(seq_id, dp_rank, lengths, starts, starts + per,
                   dp_rank * cp + np.arange(cp, dtype=np.int32))

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    @property
    def sample_offsets(self) -> np.ndarray:
        """``[0, l_0, l_0 + l_1, ..., num_tokens]`` (read-only, cached)."""
        return self._offsets

    @property
    def holder_order(self) -> np.ndarray:
        """Indices that sort the holder ranges by start (read-only, cached)."""
        return self._holder_order

    def holder_of(self, tokens) -> np.ndarray:
        """Index into the holder ranges of each token position."""
        order = self._holder_order
        pos = np.searchsorted(self.holder_start[order], np.asarray(tokens), side="right") - 1
        return order[pos]

    def to_dict(self) -> dict:
        return {"seq_id": int(self.seq_id), "dp_rank": int(self.dp_rank),
                "sample_lengths": self.sample_lengths.tolist(),
                "holder_start": self.holder_start.tolist(), "holder_end": self.holder_end.tolist(),
                "holder_worker": self.holder_worker.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> SequenceLayout:
        return cls(**d)


# --------------------------------------------------------------------------------------------
# struct-of-arrays tables
# --------------------------------------------------------------------------------------------

_TILE_FIELDS = {"seq": np.int32, "q_start": np.int64, "q_end": np.int64, "head_start": np.int32,
                "head_end": np.int32, "q_home": np.int32, "dest": np.int32, "flops": np.float64}
_TRANSFER_FIELDS = {"kind": np.int8, "src": np.int32, "dst": np.int32, "seq": np.int32,
                    "tok_start": np.int64, "tok_end": np.int64, "head_start": np.int32,
                    "head_end": np.int32, "nbytes": np.int64}


class _Table:
    """Immutable struct of equal-length numpy columns, JSON-serialisable and hashable."""

    FIELDS: dict = {}

    def __init__(self, **columns):
        missing = set(self.FIELDS) - set(columns)
        if missing:
            raise TypeError(f"{type(self).__name__} missing columns {sorted(missing)}")
        n = None
        for name, dtype in self.FIELDS.items():
            col = _arr(columns[name], dtype).reshape(-1)
            if n is None:
                n = len(col)
            elif len(col) != n:
                raise ValueError(f"{type(self).__name__}.{name} has {len(col)} rows, expected {n}")
            object.__setattr__(self, name, col)
        object.__setattr__(self, "_n", n or 0)

    def __setattr__(self, key, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __len__(self) -> int:
        return self._n

    @classmethod
    def empty(cls):
        return cls(**{k: np.zeros(0, dtype=v) for k, v in cls.FIELDS.items()})

    @classmethod
    def concat(cls, tables):
        tables = list(tables)
        if not tables:
            return cls.empty()
        return cls(**{k: np.concatenate([getattr(t, k) for t in tables]) for k in cls.FIELDS})

    def select(self, mask_or_index):
        return type(self)(**{k: getattr(self, k)[mask_or_index] for k in self.FIELDS})

    def to_dict(self) -> dict:
        return {k: getattr(self, k).tolist() for k in self.FIELDS}

    @classmethod
    def from_dict(cls, d: dict):
        return cls(**d)

    def digest_into(self, h) -> None:
        for k in self.FIELDS:
            h.update(k.encode())
            h.update(getattr(self, k).tobytes())


class TileTable(_Table):
    """Placed attention work, one row per tile (or per tile piece for non-TAP methods).

    Columns (all ``(T,)``): ``seq`` index into the pool's sequences; ``q_start, q_end`` token
    range inside that packed sequence (within one holder range); ``head_start, head_end`` query
    heads; ``q_home`` global worker holding the range's Q and receiving its output; ``dest``
    global worker computing it; ``flops`` forward FLOPs (causal, block-diagonal).
    """

    FIELDS = _TILE_FIELDS


class TransferTable(_Table):
    """Forward tensor transfers, one row per (kind, src, dst, piece).

    Columns (all ``(X,)``): ``kind`` (``Q``, ``KV`` or ``O``); ``src, dst`` global workers
    (never equal); ``seq`` pool sequence index; ``tok_start, tok_end`` token range; ``head_start,
    head_end`` query heads for Q/O, KV heads for KV; ``nbytes`` bytes moved (K and V together).
    """

    FIELDS = _TRANSFER_FIELDS

    def backward(self) -> TransferTable:
        """Backward transfers (Libra sec. 4.3.3): dO along Q, dQ along O, dK/dV reversed KV.

        The ``kind`` column keeps the forward kind whose path the gradient follows.
        """
        is_kv = self.kind == KV
        return TransferTable(kind=self.kind, src=np.where(is_kv, self.dst, self.src),
                             dst=np.where(is_kv, self.src, self.dst), seq=self.seq,
                             tok_start=self.tok_start, tok_end=self.tok_end,
                             head_start=self.head_start, head_end=self.head_end, nbytes=self.nbytes)

    def bytes_by_kind(self) -> dict[str, int]:
        return {name: int(self.nbytes[self.kind == k].sum()) for k, name in KIND_NAMES.items()}


# --------------------------------------------------------------------------------------------
# pool and plan
# --------------------------------------------------------------------------------------------


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
    """

    pool_index: int
    workers: tuple[int, ...]
    sequences: tuple[SequenceLayout, ...]
    tiles: TileTable
    transfers: TransferTable
    fallback_tiles: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(int(w) for w in self.workers))
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

    def segments(self, shape: AttentionShape) -> dict[str, np.ndarray]:
        """Kernel segments per worker: each tile split at sample boundaries.

        Returns a dict of ``(G,)`` arrays: ``tile`` (row in ``tiles``), ``dest``, ``sample_len``,
        ``q_len`` (query rows in this piece), ``kv_len`` (prefix keys it reads = offset of its last
        row + 1), ``heads`` and ``area`` (causal pairs per head). This is what a varlen kernel call
        sees, so the cost model and the runtime both derive their work lists from it.
        """
        out = {k: [] for k in ("tile", "dest", "sample_len", "q_len", "kv_len", "heads", "area")}
        t = self.tiles
        for s_idx, seq in enumerate(self.sequences):
            rows = np.nonzero(t.seq == s_idx)[0]
            if not len(rows):
                continue
            offs = seq.sample_offsets
            a, b = t.q_start[rows], t.q_end[rows]
            first = np.searchsorted(offs, a, side="right") - 1
            last = np.searchsorted(offs, b, side="left")
            counts = last - first
            rep = np.repeat(np.arange(len(rows)), counts)
            sample = np.repeat(first, counts) + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
            s0 = offs[sample]
            lo = np.maximum(a[rep], s0) - s0
            hi = np.minimum(b[rep], offs[sample + 1]) - s0
            keep = hi > lo
            rep, sample, lo, hi = rep[keep], sample[keep], lo[keep], hi[keep]
            out["tile"].append(rows[rep])
            out["dest"].append(t.dest[rows][rep])
            out["sample_len"].append(seq.sample_lengths[sample])
            out["q_len"].append(hi - lo)
            out["kv_len"].append(hi)
            out["heads"].append((t.head_end - t.head_start)[rows][rep])
            out["area"].append((hi * (hi + 1) - lo * (lo + 1)) // 2)
        return {k: (np.concatenate(v) if v else np.zeros(0, dtype=np.int64)) for k, v in out.items()}

    def to_dict(self) -> dict:
        return {"pool_index": self.pool_index, "workers": list(self.workers),
                "sequences": [s.to_dict() for s in self.sequences], "tiles": self.tiles.to_dict(),
                "transfers": self.transfers.to_dict(), "fallback_tiles": int(self.fallback_tiles)}

    @classmethod
    def from_dict(cls, d: dict) -> PoolPlan:
        return cls(pool_index=d["pool_index"], workers=tuple(d["workers"]),
                   sequences=tuple(SequenceLayout.from_dict(s) for s in d["sequences"]),
                   tiles=TileTable.from_dict(d["tiles"]), transfers=TransferTable.from_dict(d["transfers"]),
                   fallback_tiles=d.get("fallback_tiles", 0))

    def digest(self) -> str:
        """sha256 of the pool plan's content; all ranks of the pool must agree on it."""
        h = hashlib.sha256()
        h.update(json.dumps({"pool_index": self.pool_index, "workers": list(self.workers),
                             "fallback_tiles": int(self.fallback_tiles)}).encode())
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
        from libra.plan_checks import check_pool  # noqa: PLC0415  (keeps this module small)

        seen: dict[int, int] = {}
        for pool in self.pools:
            for w in pool.workers:
                if w in seen:
                    raise PlanValidationError(f"worker {w} is in pool {seen[w]} and pool {pool.pool_index}")
                seen[w] = pool.pool_index
            check_pool(pool, self.shape)
        return self


def tile_flops(seq: SequenceLayout, q_start, q_end, heads, head_dim: int) -> np.ndarray:
    """Forward FLOPs of query ranges ``[q_start, q_end)`` of ``seq`` over ``heads`` heads each."""
    return attention_flops(range_areas(seq.sample_offsets, q_start, q_end), 1, head_dim) * np.asarray(heads)
