"""Megatron Core's dynamic context-parallel scheduler: CP group sizes and balanced microbatches.

Re-implemented from ``NVIDIA/Megatron-LM`` at commit ``00c51e1``:
``megatron/core/datasets/data_schedule.py`` (``DefaultDynamicCPScheduler.get_groups_and_subsamples``,
called ``DefaultHybridCPscheduler`` / ``BalancedCPScheduler`` in earlier versions) and the helpers
of ``megatron/core/datasets/data_schedule_utils.py`` (``dcp_gpus_needed``,
``dcp_get_total_workload``, ``dcp_make_buckets_equal``, ``next_hdp_group``). The algorithm and its
constants are Megatron's; the code and words are ours.

* **CP size of a sample** (:func:`gpus_needed`): the smallest power of two of ranks that holds it at
  ``per_rank`` tokens each (``max_seqlen_per_dp_cp_rank``), at least ``min_cp``.
* **Workload estimate** (:func:`workload`): ``L^2 / cp``, the per-rank share of the quadratic term.
  Megatron balances a rank's whole step with it (linear layers, loss, everything the sample costs),
  not only its attention; it is a ranking proxy, not a FLOP count.
* **Microbatches** (:func:`schedule`): samples sorted longest first are cut into as many buckets of
  about equal total workload as there are distinct CP sizes (:func:`equal_work_buckets`); one
  microbatch is then filled sample by sample (:func:`next_microbatch`): the first bucket whose head
  sample can be placed gives the next sample; it opens a new CP group on the lowest free ranks when
  enough are free, else joins the least-loaded group of its CP size whose packed tokens per rank
  stay within ``per_rank``. Once a sample of a smaller CP size than the microbatch's first has been
  placed, the microbatch closes as soon as every rank's load is within ``delta`` of the largest.
  Ranks still idle are then filled by doubling the CP size of the first smallest group
  (:func:`fill_idle_ranks`, moving later groups up). Unplaced samples start the next microbatch, so
  the number of microbatches follows the data, not GBS / DP.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

DEFAULT_DELTA = 0.05
"""Megatron's balance slack of one microbatch (``next_hdp_group``'s ``delta``)."""
BUCKET_SLACK = 1.1
"""A bucket closes when the next sample would take it past 1.1 x its work target (Megatron's)."""


def gpus_needed(length: int, per_rank: int, min_cp: int = 1) -> int:
    """CP size of a sample: ``max(min_cp, 1, 2 ** ceil(log2(length / per_rank)))``."""
    return max(min_cp, 1, 2 ** math.ceil(math.log2(length / per_rank)))


def workload(length: int, per_rank: int, min_cp: int = 1) -> float:
    """Megatron's workload estimate of a sample on each rank of its CP group: ``L^2 / cp``."""
    return (length * length) / gpus_needed(length, per_rank, min_cp)


@dataclass(frozen=True)
class CPGroup:
    """One CP group of one microbatch: ranks ``[start, start + size)`` computing ``samples`` (sample
    ids in packing order) together."""

    start: int
    size: int
    samples: tuple[int, ...]


def equal_work_buckets(samples: list[tuple[int, int]], per_rank: int, min_cp: int) -> list[deque]:
    """Cut ``(id, length)`` samples, in order, into one bucket per distinct CP size of about equal work.

    A bucket closes before a sample when it already holds one and that sample would take it past
    :data:`BUCKET_SLACK` x the target (total work / buckets), or when the samples left are needed to
    open the remaining buckets (Megatron's count test, kept as written).
    """
    k = len({gpus_needed(n, per_rank, min_cp) for _, n in samples})
    target = sum(workload(n, per_rank, min_cp) for _, n in samples) / k
    buckets, cur, cur_work, remaining = [], [], 0.0, k
    for i, (sid, n) in enumerate(samples):
        w = workload(n, per_rank, min_cp)
        if cur and (cur_work + w > target * BUCKET_SLACK or len(samples) - i <= remaining - len(buckets)):
            buckets.append(deque(cur))
            cur, cur_work, remaining = [], 0.0, remaining - 1
        cur.append((sid, n))
        cur_work += w
    if cur:
        buckets.append(deque(cur))
    return buckets


class _Microbatch:
    """The state of one microbatch being filled: per-rank loads, groups and their packed tokens."""

    def __init__(self, ranks: int, per_rank: int, min_cp: int):
        self.per_rank, self.min_cp = per_rank, min_cp
        self.load = np.zeros(ranks)
        self.next_free = 0                        # groups take the lowest free ranks: free = a suffix
        self.start: list[int] = []
        self.size: list[int] = []
        self.tokens: list[float] = []             # packed tokens per rank of each group
        self.samples: list[list[int]] = []

    def placeable(self, length: int) -> bool:
        need = gpus_needed(length, self.per_rank, self.min_cp)
        return need in self.size or len(self.load) - self.next_free >= need

    def place(self, sid: int, length: int) -> bool:
        """Put a sample in a new group or the least-loaded fitting one; False when neither exists."""
        need = gpus_needed(length, self.per_rank, self.min_cp)
        if len(self.load) - self.next_free >= need:
            g = len(self.start)
            self.start.append(self.next_free)
            self.size.append(need)
            self.tokens.append(0.0)
            self.samples.append([])
            self.next_free += need
        else:
            fits = [g for g, s in enumerate(self.size)
                    if s == need and self.tokens[g] + length / need <= self.per_rank]
            if not fits:
                return False
            g = min(fits, key=lambda j: self.load[self.start[j]])   # first of the least loaded
        self.tokens[g] += length / need
        self.load[self.start[g]:self.start[g] + need] += workload(length, self.per_rank, self.min_cp)
        self.samples[g].append(sid)
        return True

    def balanced(self, delta: float) -> bool:
        top = float(self.load.max())
        return top - float(self.load.min()) <= delta * top


def next_microbatch(samples: list[tuple[int, int]], ranks: int, per_rank: int, min_cp: int = 1,
                    delta: float = DEFAULT_DELTA) -> tuple[list[CPGroup], list[tuple[int, int]]]:
    """Fill one microbatch from ``(id, length)`` samples sorted longest first (``next_hdp_group``).

    Returns:
        The microbatch's CP groups (covering every rank) and the samples left for the next ones
        (still longest first).

    Raises:
        ValueError: the idle ranks cannot be filled by doubling CP groups (DP x CP not a power of two).
    """
    buckets = equal_work_buckets(samples, per_rank, min_cp)
    mb = _Microbatch(ranks, per_rank, min_cp)
    first_need, check = None, False
    while buckets:
        idx = next((i for i, b in enumerate(buckets) if b and mb.placeable(b[0][1])), None)
        if idx is None:
            break
        sid, length = buckets[idx][0]
        need = gpus_needed(length, per_rank, min_cp)
        first_need = need if first_need is None else first_need
        if not mb.place(sid, length):
            break
        buckets[idx].popleft()
        while buckets and not buckets[0]:
            buckets.pop(0)
        check = check or need < first_need
        if check and buckets and mb.balanced(delta):
            break
    groups = fill_idle_ranks(mb.start, mb.size, mb.samples, ranks)
    return groups, [s for b in buckets for s in b]


def fill_idle_ranks(start: list[int], size: list[int], samples: list[list[int]], ranks: int) -> list[CPGroup]:
    """Give idle ranks work: double the first smallest group (capped at ``ranks``), moving the groups
    after it up, until no rank is idle (Megatron's ``fill_empty_gpus``).

    Raises:
        ValueError: no group at all, or too few idle ranks to double the smallest group.
    """
    start, size = list(start), list(size)
    if not size:
        raise ValueError("dynamic-cp: a microbatch placed no sample (a sample longer than all ranks hold?)")
    while start[-1] + size[-1] < ranks:
        small = min(size)
        g = size.index(small)
        grow = min(2 * small, ranks) - small
        if start[-1] + size[-1] + grow > ranks:
            raise ValueError(f"dynamic-cp: {ranks - start[-1] - size[-1]} idle ranks cannot double a CP group of "
                             f"{small}; DP x CP = {ranks} must be a power of two")
        size[g] += grow
        for j in range(g + 1, len(start)):
            start[j] += grow
    return [CPGroup(s, n, tuple(ids)) for s, n, ids in zip(start, size, samples)]


def schedule(samples: list[tuple[int, int]], ranks: int, per_rank: int, min_cp: int = 1,
             delta: float = DEFAULT_DELTA) -> list[list[CPGroup]]:
    """Every microbatch of one global batch (``get_groups_and_subsamples``).

    Args:
        samples: ``(id, length)`` of every sample of the global batch, in Megatron's gather order
            (DP rank by DP rank); sorted longest first here (stable).
        ranks: DP x CP ranks.
        per_rank: tokens one rank holds (``max_seqlen_per_dp_cp_rank``).
        min_cp, delta: see :func:`gpus_needed` and :func:`next_microbatch`.

    Raises:
        ValueError: a sample needs more ranks than there are, or :func:`next_microbatch`'s errors.
    """
    too_long = [n for _, n in samples if gpus_needed(n, per_rank, min_cp) > ranks]
    if too_long:
        raise ValueError(f"dynamic-cp: a sample of {too_long[0]} tokens needs more than {ranks} ranks of "
                         f"{per_rank} tokens")
    left = sorted(samples, key=lambda s: s[1], reverse=True)
    out = []
    while left:
        groups, left = next_microbatch(left, ranks, per_rank, min_cp, delta)
        out.append(groups)
    return out
