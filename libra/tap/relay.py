"""KV relays: a sample's KV fan-out sent along doubling trees (an extension beyond Libra sec. 4.3.3;
issue 11).

Under the Plan contract a tile reads its whole causal KV prefix where it runs. When a long sample's
work is spread over many workers, every destination fetches its own copy of the prefix from the
sample's holders, so a holder's port carries one copy per destination: on Wikipedia at 1M the
holders of the long sample send gigabytes in the first Pipeliner chunk while the receivers are
nearly idle on the wire. A *relay* row (``TransferTable.hop = h > 0``) lets a destination forward
KV it received in hop ``h - 1`` to another destination; dK/dV flow back along the same tree and each
relay adds its children's gradients to its own before it forwards them (the runtime's
``unpack_add`` into the fetched-KV gradient). A holder then sends each payload once, and the
receivers' idle ports carry the rest.

Tree (:func:`relay_transfers`): KV rows with the same sequence, holder, KV heads and first token
form a payload group. Its destinations, by decreasing last token (ties: worker id), are members
``0..n-1``. The holder sends once, to member 0 (hop 0); then every member that has the payload
forwards it, doubling the set each hop: member ``j >= 1`` receives in hop ``1 + floor(log2 j)``
from member ``j - 2**floor(log2 j)``. A member's parent needs the same first token and a later or
equal last one, so it forwards a sub-range of what it received. Sending once, not in every hop as a
plain doubling tree from the holder does, costs one hop of depth and frees the holder's port, which
is also the Q-home of the moved tiles: measured with ``straggler``'s pricing (2 windows, jitter on),
Wikipedia 4.75x -> 4.85x over Ulysses at 256K and 2.78x -> 2.86x at 1M, ProLong 5.55x -> 5.78x and
2.60x -> 2.76x, libra-prod unchanged.

Where (:func:`relay_heads`): only KV heads that travel with chunk 0 and return after chunk
``M - 1`` of the paper's head-sliced Pipeliner -- the two transfers it never hides -- so the hops
run inside them in order (hop 0, 1, ... forward; deepest first backward) without delaying a chunk
that would otherwise overlap compute. Tile-grouped chunks (:mod:`libra.tap.tile_chunks`) spread
each destination's KV over its chunks and take no relays.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from libra.arrays import expand_counts
from libra.plan import HEADS, KV, PlanValidationError, PoolPlan, TransferTable
from libra.tap.pipeline import ChunkSchedule


def relay_heads(sched: ChunkSchedule) -> np.ndarray:
    """bool ``(hkv,)``: the KV heads whose fetch may be relayed under ``sched`` (first read in
    chunk 0 and last read in chunk ``M - 1``)."""
    return (sched.kv_first == 0) & (sched.kv_last == sched.chunks - 1)


def _within(eligible: np.ndarray, head_start: np.ndarray, head_end: np.ndarray) -> np.ndarray:
    """bool: whether every KV head of each range ``[head_start, head_end)`` is ``eligible``."""
    outside = np.concatenate(([0], np.cumsum(~np.asarray(eligible, dtype=bool))))
    return outside[head_end] == outside[head_start]


def check_relays(pool: PoolPlan, sched) -> None:
    """The runtime's and the cost model's rule for relay rows: a pool with any row of hop > 0 runs
    under head chunks, and every relay row's KV heads are :func:`relay_heads`.

    Raises:
        PlanValidationError: naming the pool and the first offending row.
    """
    x = pool.transfers
    relays = np.nonzero(x.hop > 0)[0]
    if not len(relays):
        return
    if pool.chunking != HEADS or not isinstance(sched, ChunkSchedule) or sched.chunking != HEADS:
        raise PlanValidationError(f"pool {pool.pool_index}: KV relay rows need the Pipeliner's head chunks, "
                                  f"the pool runs {pool.chunking!r}")
    bad = relays[~_within(relay_heads(sched), x.head_start[relays], x.head_end[relays])]
    if len(bad):
        i = int(bad[0])
        raise PlanValidationError(
            f"pool {pool.pool_index}: KV relay transfer {i} carries KV heads [{x.head_start[i]}, {x.head_end[i]}) "
            f"with M={sched.chunks}, but only heads read from chunk 0 through chunk {sched.chunks - 1} may relay")


def relay_transfers(transfers: TransferTable, eligible: np.ndarray) -> TransferTable:
    """``transfers`` with the KV rows of ``eligible`` KV heads sent along relay trees (module doc).

    Args:
        transfers: a pool's direct transfers (every hop 0).
        eligible: bool ``(hkv,)`` (:func:`relay_heads`).

    Returns:
        The same rows (same order, destinations, bytes) with ``src`` and ``hop`` rewritten.
    """
    x = transfers
    rows = np.nonzero(x.kind == KV)[0]
    rows = rows[_within(eligible, x.head_start[rows], x.head_end[rows])]
    src, hop = x.src.copy(), x.hop.copy()
    if len(rows):
        keys = [x.seq[rows], x.src[rows], x.head_start[rows], x.head_end[rows], x.tok_start[rows]]
        order = rows[np.lexsort([x.dst[rows], -x.tok_end[rows]] + keys[::-1])]
        k = np.stack([c[order] for c in (x.seq, x.src, x.head_start, x.head_end, x.tok_start)], axis=1)
        first = np.nonzero(np.r_[True, np.any(k[1:] != k[:-1], axis=1)])[0]
        group, d = expand_counts(np.diff(np.r_[first, len(order)]))  # d: 0-based member of its group
        top = np.floor(np.log2(np.maximum(d, 1))).astype(np.int64)
        h = np.where(d == 0, 0, 1 + top)
        parent = np.where(d == 0, 0, d - (1 << top))
        src[order] = np.where(d == 0, x.src[order], x.dst[order[first[group] + parent]])
        hop[order] = h
    cols = {name: getattr(x, name) for name in TransferTable.FIELDS}
    return TransferTable(**{**cols, "src": src.astype(np.int32), "hop": hop.astype(np.int8)})


def relay_pool(pool: PoolPlan, sched: ChunkSchedule) -> PoolPlan:
    """``pool`` (head-chunked, direct transfers) with its eligible KV fan-out relayed."""
    if pool.chunking != HEADS:
        raise ValueError(f"pool {pool.pool_index}: KV relays need head chunks, got {pool.chunking!r}")
    return replace(pool, transfers=relay_transfers(pool.transfers, relay_heads(sched)))
