"""DistCA as its own planner plans (``distca``): head/tail-pair layout and deficit filling.

DistCA (Zhuang et al., 2026) disaggregates core attention onto attention servers spanning the
cluster. This planner runs the DistCA authors' planning algorithm (:mod:`baselines.distca_items`,
from ``hao-ai-lab/DistCA``) on each microbatch group, one project worker per attention server; the
Libra paper's emulation of DistCA is ``distca-paper`` (:mod:`baselines.distca_paper`).

Per GA index (production order: ``window[g * DP + d]`` at GA ``g``, DP rank ``d``):

1. the group's ``DP`` packed sequences form ``nano_batches`` nano-batches of consecutive sequences
   (DistCA's ping/pong: the first half, then the second), each laid over all ``W = DP * CP`` workers
   at ``S / (nano_batches * CP)`` tokens per worker by :func:`~baselines.distca_items.layout_items`
   (one nano-batch: sequence ``d`` on its own CP group, documents that cross a worker boundary held
   as head/tail pairs);
2. each nano-batch is planned on its own by :func:`~baselines.distca_items.fill_deficits`;
3. with ``buffer_retry``, DistCA's end-to-end driver (``tests/test_e2e_combined.py``) is followed:
   the tolerance steps up through :data:`TOLERANCE_STEPS` until every worker's all-to-all fits
   ``buffer_gib`` (:func:`buffer_need`); if none fits, the last step's plan is kept (DistCA then
   grows its buffer).

Plan mapping: one pool of all workers. Every planned item piece is one tile of all query heads with
``q_home`` = the worker holding it before attention and ``dest`` = its attention worker; the
transfers come from :func:`libra.tap.exchange.build_transfers`, whose KV rows are de-duplicated
per (document, destination) -- DistCA's own priority counts a document's KV once per move. The
Plan is priced with Libra's Pipeliner at ``pipeline_chunks`` head chunks (default TapConfig's M),
the overlap credit ``distca-paper`` gets: DistCA's own ping/pong hides its all-to-all behind the
other nano-batch's linear layers, which an attention-only benchmark cannot see.

Defaults: one nano-batch, tolerance 0.05 (the floor DistCA's end-to-end driver starts from),
buffer retry off. DistCA sizes its 2 GiB buffer for TP 8 (each rank moves 1/8 of the hidden size);
at TP 1 the same data needs 8x the bytes, and the retry would push the tolerance toward 1 and
balancing toward none, which says nothing about DistCA's algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from baselines.distca_items import Items, fill_deficits, item_pieces, layout_items
from baselines.registry import Planner, pool_workers, window_lengths
from libra.config import ParallelConfig, TapConfig
from libra.plan import KV, Plan, PoolPlan, Q, SequenceLayout, TileTable, TransferTable
from libra.tap.exchange import build_transfers
from libra.workload import AttentionShape, attention_flops, causal_area

DEFAULT_TOLERANCE = 0.05
"""DistCA's ``MIN_TOLERANCE_FACTOR`` default in its end-to-end driver: the smallest tolerance it
plans with (its ``Planner`` class defaults to 0.1, which the driver overrides)."""

TOLERANCE_STEPS = (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09,
                   0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
"""The tolerances DistCA's driver tries in turn until the all-to-all fits its buffer."""

DEFAULT_BUFFER_GIB = 2.0
"""DistCA's all-to-all buffer in its run scripts (``EXPERIMENT_NVSHMEM_BUFFER_SIZE_GB=2``, TP 8)."""

GIB = 1024 ** 3


@dataclass(frozen=True)
class DistCAConfig:
    """Options of the ``distca`` planner.

    Attributes:
        tolerance: a recipient stops pulling work once its deficit is at most ``tolerance`` x the
            mean worker load (with ``buffer_retry``: the first tolerance tried).
        nano_batches: nano-batches planned separately per GA index (2 = DistCA's ping/pong); must
            divide DP.
        buffer_retry: step the tolerance up until every worker's all-to-all fits ``buffer_gib``.
        buffer_gib: the all-to-all buffer per worker, GiB.
        pipeline_chunks: Pipeliner head chunks ``M`` the Plan is priced and run with.

    Raises:
        ValueError: a negative or non-finite tolerance, a non-positive count or buffer.
    """

    tolerance: float = DEFAULT_TOLERANCE
    nano_batches: int = 1
    buffer_retry: bool = False
    buffer_gib: float = DEFAULT_BUFFER_GIB
    pipeline_chunks: int = TapConfig.pipeline_chunks

    def __post_init__(self) -> None:
        for name in ("tolerance", "buffer_gib"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                    or (name == "buffer_gib" and v == 0):
                raise ValueError(f"DistCAConfig.{name} must be a finite number {'>' if name == 'buffer_gib' else '>='}"
                                 f" 0, got {v!r}")
        for name in ("nano_batches", "pipeline_chunks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"DistCAConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.buffer_retry, bool):
            raise ValueError(f"DistCAConfig.buffer_retry must be True or False, got {self.buffer_retry!r}")

    def tolerances(self) -> tuple[float, ...]:
        """The tolerances planned in turn: ``tolerance``, then (with retry) the larger steps."""
        steps = (t for t in TOLERANCE_STEPS if t > self.tolerance) if self.buffer_retry else ()
        return (float(self.tolerance), *steps)


@dataclass(frozen=True)
class NanoBatch:
    """One nano-batch's layout before attention.

    Attributes:
        items: the layout's items (:func:`~baselines.distca_items.layout_items`).
        sequences: the nano-batch's packed sequences with their holder ranges.
        first: pool index of ``sequences[0]`` (the pool lists every nano-batch's sequences in turn).
        doc_seq, doc_offset: per document, its sequence's pool index and its first token there.
    """

    items: Items
    sequences: tuple[SequenceLayout, ...]
    first: int
    doc_seq: np.ndarray
    doc_offset: np.ndarray


def nano_batch(lengths: list[np.ndarray], seq_ids, dp_ranks, first: int, tokens_per_worker: int,
               n_workers: int) -> NanoBatch:
    """Lay one nano-batch's packed sequences over the workers (DistCA's layout before attention)."""
    docs = np.concatenate(lengths)
    counts = np.array([len(x) for x in lengths])
    doc_seq = first + np.repeat(np.arange(len(lengths)), counts)
    starts = np.concatenate([np.concatenate(([0], np.cumsum(x)[:-1])) for x in lengths])
    items = layout_items(docs, tokens_per_worker, n_workers)
    row, a, b = item_pieces(items)
    doc = items.doc[row]
    seq, start, end, worker = doc_seq[doc], starts[doc] + a, starts[doc] + b, items.worker[row]
    sequences = []
    for k, (sid, dp, x) in enumerate(zip(seq_ids, dp_ranks, lengths)):
        mine = np.flatnonzero(seq == first + k)
        o = mine[np.argsort(start[mine], kind="stable")]
        keep = np.concatenate(([True], worker[o][1:] != worker[o][:-1]))   # merge touching ranges of one worker
        last = np.concatenate((np.flatnonzero(keep)[1:] - 1, [len(o) - 1]))
        sequences.append(SequenceLayout(int(sid), int(dp), x, start[o][keep], end[o][last], worker[o][keep]))
    return NanoBatch(items, tuple(sequences), first, doc_seq, starts)


def nano_tiles(nb: NanoBatch, planned: Items, shape: AttentionShape) -> TileTable:
    """One all-heads tile per planned item piece: ``q_home`` its holder, ``dest`` its attention worker."""
    row, a, b = item_pieces(planned)
    doc = planned.doc[row]
    heads = shape.num_q_heads
    n = len(row)
    return TileTable(seq=nb.doc_seq[doc], q_start=nb.doc_offset[doc] + a, q_end=nb.doc_offset[doc] + b,
                     head_start=np.zeros(n), head_end=np.full(n, heads), q_home=planned.home[row],
                     dest=planned.worker[row], flops=attention_flops(causal_area(a, b), heads, shape.head_dim))


def buffer_need(transfers: TransferTable, nano_of_seq: np.ndarray, n_workers: int) -> np.ndarray:
    """Bytes each worker's all-to-all buffer must hold, per nano-batch: ``(nano-batches, W)``.

    DistCA's overflow check takes, per attention server, the larger of the bytes it sends and
    receives in each all-to-all (Q/K/V dispatch, output return; the backward ones mirror them). The
    cross-worker rows of the Plan stand in for those all-to-alls; DistCA's buffer also stages a
    worker's own shards, which this count leaves out.
    """
    out = np.zeros((int(nano_of_seq.max()) + 1, n_workers))
    nano = nano_of_seq[transfers.seq]
    dispatch = (transfers.kind == Q) | (transfers.kind == KV)
    for k in range(len(out)):
        for rows in (dispatch & (nano == k), ~dispatch & (nano == k)):
            nb = transfers.nbytes[rows]
            sent = np.bincount(transfers.src[rows], weights=nb, minlength=n_workers)
            recv = np.bincount(transfers.dst[rows], weights=nb, minlength=n_workers)
            out[k] = np.maximum(out[k], np.maximum(sent, recv))
    return out


class DistCAPlanner(Planner):
    """DistCA's own planner: one pool of all workers per GA index, deficit filling over causal cells."""

    name = "distca"
    Config = DistCAConfig

    @property
    def pipeline_chunks(self) -> int:
        return self.config.pipeline_chunks

    def check(self, par: ParallelConfig, shape: AttentionShape) -> int:
        """The tokens per worker of a nano-batch in layout ``par``.

        Raises:
            ValueError: nano-batches not dividing DP or ``S * DP / nano-batches`` not a multiple of
                the workers, or M not dividing the query heads.
        """
        n = self.config.nano_batches
        if par.dp % n:
            raise ValueError(f"distca: nano_batches={n} must divide DP={par.dp}")
        if (par.seq_len * (par.dp // n)) % par.workers:
            raise ValueError(f"distca: {par.dp // n} sequences of S={par.seq_len} tokens do not split evenly over "
                             f"{par.workers} workers")
        if shape.num_q_heads % self.config.pipeline_chunks:
            raise ValueError(f"distca: pipeline_chunks={self.config.pipeline_chunks} must divide "
                             f"num_q_heads={shape.num_q_heads}")
        return par.seq_len * (par.dp // n) // par.workers

    def plan_window(self, window, par: ParallelConfig, shape: AttentionShape) -> list[Plan]:
        """One Plan per GA index, one pool of all ``DP * CP`` workers (see :class:`Planner`).

        Raises:
            ValueError: the window does not match ``par``, or :meth:`check` fails.
        """
        per_worker = self.check(par, shape)
        lengths = window_lengths(window, par)
        n, per = self.config.nano_batches, par.dp // self.config.nano_batches
        plans = []
        for g in range(par.ga):
            nanos = []
            for k in range(n):
                dp_ranks = range(k * per, (k + 1) * per)
                seq_ids = [g * par.dp + d for d in dp_ranks]
                nanos.append(nano_batch([lengths[i] for i in seq_ids], seq_ids, dp_ranks, k * per, per_worker,
                                        par.workers))
            pool, meta = self.plan_group(nanos, par, shape)
            plans.append(Plan(method=self.name, ga_index=g, shape=shape, cp=par.cp,
                              pipeline_chunks=self.config.pipeline_chunks, pools=(pool,), meta=meta))
        return plans

    def plan_group(self, nanos: list[NanoBatch], par: ParallelConfig, shape: AttentionShape) -> tuple[PoolPlan, dict]:
        """The pool of one GA index and its meta: every nano-batch planned at the first tolerance
        whose all-to-all fits the buffer (without retry: the configured tolerance)."""
        cfg = self.config
        sequences = tuple(s for nb in nanos for s in nb.sequences)
        nano_of_seq = np.repeat(np.arange(len(nanos)), [len(nb.sequences) for nb in nanos])
        for tolerance in cfg.tolerances():
            tiles = TileTable.concat(nano_tiles(nb, fill_deficits(nb.items, par.workers, tolerance, shape), shape)
                                     for nb in nanos)
            transfers = build_transfers(sequences, tiles, shape)
            need = buffer_need(transfers, nano_of_seq, par.workers) if len(transfers) else np.zeros(1)
            if not cfg.buffer_retry or need.max() <= cfg.buffer_gib * GIB:
                break
        meta = {"pool_size": par.dp, "grouping": "production", "tolerance": tolerance,
                "nano_batches": cfg.nano_batches, "buffer_retry": cfg.buffer_retry, "buffer_gib": cfg.buffer_gib,
                "buffer_need_gib": float(need.max()) / GIB}
        return PoolPlan(0, pool_workers(0, par.dp, par.cp), sequences, tiles, transfers), meta
