"""WLB-LLM as the Libra authors ran it: variable-length repacking plus per-document CP sharding.

WLB-LLM (Wang et al., OSDI'25) has no official release; Libra sec. 6.1 used the open-source
implementation inside the DistCA repository (``hao-ai-lab/distca``, ``d2/planner/wlb_planner.py``
for the packing and ``baseline/wlbllm_original/wlbllm/utils.py`` for the sharding). This module
re-implements the behaviour described there (no code copied):

1. **Repacking (per GBS window).** Split pieces of one sample (fixed-token packing cuts samples at
   sequence boundaries) are rejoined via ``sample_ids`` into documents of at most ``S`` tokens
   (option ``rejoin``, below). Documents go longest first into one of
   ``GBS`` buckets: the bucket with the least workload ``sum((l/Bp)^2 + l/Bp)`` if its token count
   stays within ``Lmax = alpha * (window tokens / GBS)``; otherwise the bucket with the fewest
   tokens if the sample fits there; otherwise the sample is set aside and, after all others are
   placed, goes to the least-workload bucket regardless of ``Lmax``. Ties go to the lowest bucket
   index. Bucket ``b`` runs at GA index ``b // DP`` on DP rank ``b % DP``.
2. **Per-document CP sharding.** Each document of a bucket is cut into ``2*CP`` chunks and CP rank
   ``r`` keeps chunks ``r`` and ``2*CP-1-r`` (the zig-zag that balances the causal triangle inside
   every document). Remainders: a document of ``l`` tokens gives every chunk ``l // (2CP)``
   tokens, and its ``l % (2CP)`` extra tokens go one each to consecutive chunk indices starting at
   a round-robin pointer that carries over from one document to the next (as the public code does),
   so per-chunk-index totals of a bucket differ by at most one token and a bucket's token count
   need not be divisible by ``CP`` or ``2*CP``. Each chunk is computed where it lives, with all
   heads; K/V of the earlier chunks of the same document come from the ranks holding them.

Rejoining (option ``rejoin``). The public code repacks the documents exactly as its fixed-length
batches hold them (``rejoin="none"``). Fixed-token packing, however, cuts samples at arbitrary
sequence boundaries that variable-length packing does not need, so by default (``"context"``) the
pieces of a sample are rejoined -- but never into a document longer than the training context
``S``: a sample of ``L > S`` tokens becomes ``L // S`` documents of ``S`` tokens plus one of
``L % S``, the longest a document can be in an ``S``-token training job, which is also how
Ulysses and Libra see it (at most ``S`` tokens per causal segment). ``"full"`` rejoins whole samples
however long (a 1M-token sample becomes one 1M-token document even at ``S = 256K``: more attention
FLOPs than any other method computes for the same data).

Plan mapping: a :class:`~libra.plan.SequenceLayout` whose holder ranges are the chunks, one tile
per chunk (``dest == q_home``), transfers from :func:`libra.tap.exchange.build_transfers` -- KV
fetches only. The public code all-gathers the whole bucket's K/V inside the CP group; the Plan
fetches per document only the causal prefix each rank's chunks read (the per-document all-gather
that is actually consumed), so its byte count is a lower bound on the original's.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from baselines.registry import Planner, pool_workers, window_lengths
from libra.config import ParallelConfig
from libra.plan import Plan, PoolPlan, SequenceLayout, TileTable, TransferTable, tile_flops
from libra.tap.exchange import build_transfers
from libra.workload import AttentionShape

DEFAULT_BP = 128 * 1024
"""``Bp``: the public code's ``attn_linear_breakpoint`` default (``128 * K`` tokens) in
``d2/planner/wlb_planner.py`` of hao-ai-lab/distca (an earlier revision used ``64 * K``; its run
scripts override it per model): the length where attention's quadratic term catches up with the
linear layers' cost."""

REJOIN_MODES = ("context", "full", "none")

DEFAULT_ALPHA = 1.0
"""``alpha``: the bucket cap is ``alpha`` times the average tokens per bucket. The public code caps
a bucket at ``Lmax = total_seq_len * 2 * batch_size // dp_size * alpha_factor`` tokens
(``d2/planner/wlb_planner.py``; its run scripts' ``--alpha-factor`` defaults to 1.0), and it
applies that cap to the ``2 * batch_size`` sequences of ``total_seq_len`` tokens it draws per step
and spreads over ``dp_size`` buckets. ``2 * S * batch / DP`` is therefore exactly the average tokens
per bucket -- the factor 2 counts the two sequences drawn per batch slot, not headroom -- so the
public default is ``alpha = 1`` (1x the average), not 2x."""


@dataclass(frozen=True)
class WlbLlmConfig:
    """Options of the WLB-LLM planner.

    Attributes:
        bp: ``Bp`` tokens in the bucket workload ``sum((l/Bp)^2 + l/Bp)`` (default 128K, see
            :data:`DEFAULT_BP`).
        alpha: token cap factor, ``Lmax = alpha * average tokens per bucket`` (default 1, the
            public code's ``--alpha-factor`` default, see :data:`DEFAULT_ALPHA`); must be >= 1 so
            the cap can hold the window.
        rejoin: which documents are repacked: ``"context"`` (default; split pieces rejoined, no
            document longer than ``S``), ``"full"`` (whole samples) or ``"none"`` (pieces as packed,
            as the public code does); see the module docstring.
        outlier_threshold: ``None`` (default) disables the outlier-delay queue. When set, documents
            longer than this many tokens are held back in a FIFO queue owned by the planner
            instance and released, ``GBS`` at a time (oldest first, one per bucket on average),
            once the queue holds at least ``GBS`` of them -- WLB-LLM's original rule. **This
            changes the step's sample multiset** (a delayed sample trains in a later optimizer
            step), which Libra's step-equivalence requirement forbids (Libra sec. 2.3, 3.2); it
            exists to reproduce the original paper, never as a default. Planning then depends on
            the order of ``plan_window`` calls; :meth:`WlbLlmPlanner.reset` empties the queue.

    Raises:
        ValueError: non-positive ``bp``, ``alpha < 1``, an unknown ``rejoin`` or a non-positive
            threshold.
    """

    bp: int = DEFAULT_BP
    alpha: float = DEFAULT_ALPHA
    rejoin: str = "context"
    outlier_threshold: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.bp, bool) or not isinstance(self.bp, (int, np.integer)) or self.bp < 1:
            raise ValueError(f"WlbLlmConfig.bp must be a positive integer, got {self.bp!r}")
        if not isinstance(self.alpha, (int, float)) or self.alpha != self.alpha or self.alpha < 1:
            raise ValueError(f"WlbLlmConfig.alpha must be a number >= 1, got {self.alpha!r}")
        if self.rejoin not in REJOIN_MODES:
            raise ValueError(f"WlbLlmConfig.rejoin must be one of {REJOIN_MODES}, got {self.rejoin!r}")
        t = self.outlier_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 1):
            raise ValueError(f"WlbLlmConfig.outlier_threshold must be None or a positive integer, got {t!r}")


# --------------------------------------------------------------------------------------------
# step 1: repacking
# --------------------------------------------------------------------------------------------


def rejoin_samples(window) -> np.ndarray:
    """Whole-sample lengths of a window: pieces sharing a sample id are summed.

    Args:
        window: packed sequences with ``sample_lengths`` and ``sample_ids`` (``None`` ids: every
            piece is its own sample).

    Returns:
        int64 ``(n_samples,)`` in order of each sample's first appearance.

    Raises:
        ValueError: a sequence whose ids and lengths differ in count.
    """
    lengths, ids = [], []
    for seq in window:
        lens = np.asarray(seq.sample_lengths, dtype=np.int64).reshape(-1)
        sid = getattr(seq, "sample_ids", None)
        if sid is None:
            sid = np.full(len(lens), -1, dtype=np.int64)
        sid = np.asarray(sid, dtype=np.int64).reshape(-1)
        if len(sid) != len(lens):
            raise ValueError(f"sequence {getattr(seq, 'seq_id', '?')}: {len(sid)} sample ids for {len(lens)} samples")
        lengths.append(lens)
        ids.append(sid)
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    anonymous = ids < 0
    # anonymous pieces get unique negative keys so they are never merged
    keys = np.where(anonymous, -1 - np.arange(len(ids)), ids)
    uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    sums = np.bincount(inverse, weights=lengths, minlength=len(uniq)).astype(np.int64)
    return sums[np.argsort(first, kind="stable")]


def cut_documents(lengths, max_len: int) -> np.ndarray:
    """Cut every length ``L > max_len`` into ``L // max_len`` documents of ``max_len`` plus the rest.

    Returns:
        int64 document lengths, each sample's documents in place of it (order kept).

    Raises:
        ValueError: ``max_len < 1``.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    full, rest = np.divmod(lengths, max_len)
    count = full + (rest > 0)
    out = np.full(int(count.sum()), max_len, dtype=np.int64)
    last = np.cumsum(count) - 1                              # each sample's last document
    out[last[rest > 0]] = rest[rest > 0]
    return out


def window_documents(window, rejoin: str, seq_len: int) -> np.ndarray:
    """The documents WLB-LLM repacks: the window's pieces as packed (``"none"``), rejoined whole
    samples (``"full"``) or rejoined samples cut to at most ``seq_len`` tokens (``"context"``)."""
    if rejoin == "none":
        return np.concatenate([np.asarray(s.sample_lengths, dtype=np.int64).reshape(-1) for s in window])
    samples = rejoin_samples(window)
    return samples if rejoin == "full" else cut_documents(samples, seq_len)


def bucket_workload(lengths, bp: int) -> float:
    """WLB-LLM's bucket workload ``sum((l/Bp)^2 + l/Bp)``."""
    a = np.asarray(lengths, dtype=np.float64) / bp
    return float(np.sum(a * a + a))


def wlb_pack(lengths, n_buckets: int, bp: int = DEFAULT_BP, alpha: float = DEFAULT_ALPHA) -> list[np.ndarray]:
    """WLB-LLM's variable-length packing of one window's samples into ``n_buckets`` buckets.

    Args:
        lengths: int ``(n,)`` whole-sample lengths.
        n_buckets: number of buckets (``GBS``).
        bp, alpha: see :class:`WlbLlmConfig`.

    Returns:
        ``n_buckets`` int64 arrays of indices into ``lengths`` (insertion order, longest first);
        together they hold every index exactly once. A bucket may be empty when the window has
        fewer samples than buckets.

    Raises:
        ValueError: ``n_buckets < 1`` or a non-positive length.
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if n_buckets < 1:
        raise ValueError(f"n_buckets must be >= 1, got {n_buckets}")
    if np.any(lengths < 1):
        raise ValueError(f"sample lengths must be positive, got {lengths[lengths < 1][:4].tolist()}")
    lmax = alpha * float(lengths.sum()) / n_buckets
    order = np.argsort(-lengths, kind="stable")          # longest first, ties by arrival
    # exact integer workload Bp^2 * sum((l/Bp)^2 + l/Bp) = sum(l^2 + l*Bp): same order, no rounding
    work = [0] * n_buckets
    toks = [0] * n_buckets
    by_work = [(0, b) for b in range(n_buckets)]
    by_toks = [(0, b) for b in range(n_buckets)]
    members: list[list[int]] = [[] for _ in range(n_buckets)]

    def least(heap, current):
        while heap[0][0] != current[heap[0][1]]:          # drop stale entries (lazy deletion)
            heapq.heappop(heap)
        return heap[0][1]

    def put(b: int, i: int) -> None:
        length = int(lengths[i])
        members[b].append(int(i))
        work[b] += length * length + length * bp
        toks[b] += length
        heapq.heappush(by_work, (work[b], b))
        heapq.heappush(by_toks, (toks[b], b))

    deferred = []
    for i in order:
        length = int(lengths[i])
        b = least(by_work, work)
        if toks[b] + length <= lmax:
            put(b, i)
            continue
        b = least(by_toks, toks)
        if toks[b] + length <= lmax:
            put(b, i)
        else:
            deferred.append(i)
    for i in deferred:                                     # fits nowhere: least workload regardless
        put(least(by_work, work), i)
    return [np.asarray(m, dtype=np.int64) for m in members]


# --------------------------------------------------------------------------------------------
# step 2: per-document CP sharding
# --------------------------------------------------------------------------------------------


def per_document_shards(doc_lengths, cp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every document into ``2*CP`` chunks; rank ``r`` keeps chunks ``r`` and ``2CP-1-r``.

    Args:
        doc_lengths: int ``(n_docs,)`` lengths of the documents of one bucket, in packing order.
        cp: context-parallel degree.

    Returns:
        ``(start, end, rank)``: int64 arrays ``(n_chunks,)`` of the non-empty chunks' token ranges
        inside the bucket (sorted, partitioning ``[0, sum(doc_lengths))``) and their CP rank.
        Remainders follow the carried round-robin rule of the module docstring.

    Raises:
        ValueError: ``cp < 1`` or a non-positive document length.
    """
    lens = np.asarray(doc_lengths, dtype=np.int64).reshape(-1)
    if cp < 1:
        raise ValueError(f"CP must be >= 1, got {cp}")
    if np.any(lens < 1):
        raise ValueError(f"document lengths must be positive, got {lens[lens < 1][:4].tolist()}")
    n_chunks = 2 * cp
    base, rem = np.divmod(lens, n_chunks)
    pointer = np.concatenate(([0], np.cumsum(rem)[:-1])) % n_chunks     # carried round-robin start
    c = np.arange(n_chunks)
    extra = ((c[None, :] - pointer[:, None]) % n_chunks) < rem[:, None]
    sizes = base[:, None] + extra                                        # (n_docs, 2CP)
    doc_start = np.concatenate(([0], np.cumsum(lens)[:-1]))
    ends = doc_start[:, None] + np.cumsum(sizes, axis=1)
    starts = ends - sizes
    rank = np.where(c < cp, c, n_chunks - 1 - c)
    keep = sizes > 0
    return starts[keep], ends[keep], np.broadcast_to(rank, sizes.shape)[keep].astype(np.int64)


def wlb_sequence(bucket: int, dp_rank: int, doc_lengths, cp: int) -> SequenceLayout:
    """The bucket's :class:`SequenceLayout`: holder ranges are the per-document chunks."""
    start, end, rank = per_document_shards(doc_lengths, cp)
    return SequenceLayout(bucket, dp_rank, np.asarray(doc_lengths, dtype=np.int64), start, end,
                          dp_rank * cp + rank)


def wlb_tiles(seq: SequenceLayout, shape: AttentionShape, seq_index: int = 0) -> TileTable:
    """One tile per chunk, all query heads, computed where it lives (``dest == q_home``); ``seq_index``
    is the sequence's index in its pool."""
    n = len(seq.holder_start)
    heads = shape.num_q_heads
    return TileTable(seq=np.full(n, seq_index), q_start=seq.holder_start, q_end=seq.holder_end,
                     head_start=np.zeros(n), head_end=np.full(n, heads), q_home=seq.holder_worker,
                     dest=seq.holder_worker,
                     flops=tile_flops(seq, seq.holder_start, seq.holder_end, heads, shape.head_dim))


# --------------------------------------------------------------------------------------------
# planner
# --------------------------------------------------------------------------------------------


class WlbLlmPlanner(Planner):
    """WLB-LLM: repack the window into GBS variable-length buckets, shard each per document.

    Pools are single CP groups (``P = 1``); no overlap (``M = 1``). With the outlier queue enabled
    the instance carries state between windows (see :class:`WlbLlmConfig`).
    """

    name = "wlb-llm"
    Config = WlbLlmConfig

    def __init__(self, config=None):
        super().__init__(config)
        self._queue: deque[int] = deque()

    def reset(self) -> None:
        """Empty the outlier-delay queue (only used with ``outlier_threshold``)."""
        self._queue.clear()

    def window_samples(self, window, n_buckets: int, seq_len: int) -> np.ndarray:
        """The documents this window trains on (see ``rejoin``), then (optionally) outlier-delayed."""
        samples = window_documents(window, self.config.rejoin, seq_len)
        t = self.config.outlier_threshold
        if t is None:
            return samples
        outlier = samples > t
        self._queue.extend(int(x) for x in samples[outlier])
        samples = samples[~outlier]
        if len(self._queue) >= n_buckets:
            released = [self._queue.popleft() for _ in range(n_buckets)]
            samples = np.concatenate([samples, np.asarray(released, dtype=np.int64)])
        return samples

    def buckets(self, window, par: ParallelConfig) -> list[np.ndarray]:
        """Sample lengths of each of the ``GBS`` buckets (bucket ``b`` -> GA ``b // DP``, DP ``b % DP``)."""
        window_lengths(window, par, fixed_tokens=False)
        samples = self.window_samples(window, par.gbs, par.seq_len)
        if samples.size == 0:
            return [np.zeros(0, dtype=np.int64) for _ in range(par.gbs)]
        cfg = self.config
        return [samples[idx] for idx in wlb_pack(samples, par.gbs, cfg.bp, cfg.alpha)]

    def plan_window(self, window, par: ParallelConfig, shape: AttentionShape) -> list[Plan]:
        """One Plan per GA index, one single-CP-group pool per DP rank (see :class:`Planner`).

        An empty bucket (fewer samples than GBS) becomes a pool with no sequences: its workers idle.

        Raises:
            ValueError: the window does not hold ``par.gbs`` sequences of positive sample lengths.
        """
        buckets = self.buckets(window, par)
        meta = {"pool_size": 1, "bp": self.config.bp, "alpha": self.config.alpha, "rejoin": self.config.rejoin,
                "outlier_threshold": self.config.outlier_threshold,
                "lmax_tokens": self.config.alpha * float(sum(int(b.sum()) for b in buckets)) / par.gbs}
        plans = []
        for g in range(par.ga):
            pools = []
            for d in range(par.dp):
                b = g * par.dp + d
                workers = pool_workers(d, 1, par.cp)
                if buckets[b].size == 0:
                    pools.append(PoolPlan(d, workers, (), TileTable.empty(), TransferTable.empty()))
                    continue
                seq = wlb_sequence(b, d, buckets[b], par.cp)
                tiles = wlb_tiles(seq, shape)
                pools.append(PoolPlan(d, workers, (seq,), tiles, build_transfers((seq,), tiles, shape)))
            plans.append(Plan(method=self.name, ga_index=g, shape=shape, cp=par.cp, pipeline_chunks=1,
                              pools=tuple(pools), meta=dict(meta)))
        return plans
