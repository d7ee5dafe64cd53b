"""KV relays: a sample's KV fan-out sent as a scatter and an all-gather (an extension beyond Libra
sec. 4.3.3, ``libra-adaptive``).

Under the Plan contract a tile reads its whole causal KV prefix where it runs. When a long sample's
work is spread over many workers, every destination fetches its own copy of the prefix from the
sample's holders, so a holder's port carries one copy per destination: on Wikipedia at 1M the
holders of the long sample send gigabytes in the first Pipeliner chunk while the receivers are
nearly idle on the wire. A *relay* row (``TransferTable.hop = h > 0``) lets a destination forward
KV it received in hop ``h - 1`` to another destination; dK/dV flow back along the same rows and each
relay adds the gradients that come back to its own before it forwards them (the runtime's
``unpack_add`` into the fetched-KV gradient). A holder then sends each payload once, and the
receivers' idle ports carry the rest.

Broadcast (:func:`relay_transfers`): KV rows with the same sequence, holder, KV heads and first token
``t0`` form a payload group. Its ``n >= 2`` destinations, by increasing last token ``d_1 <= ... <=
d_n`` (ties: worker id), split ``[t0, d_n)`` into ``n`` consecutive pieces of about equal tokens,
piece ``k`` ending no later than ``d_k`` (so member ``k`` needs all of it). Hop 0: the holder sends
piece ``k`` to member ``k`` (the payload once in all). Hop 1: every member sends its piece to every
other member that needs part of it, clipped to that member's need. This is the bandwidth-optimal
broadcast of collective libraries (scatter, then all-gather: van de Geijn): every port carries about
one copy of the payload in two rounds, where a doubling tree takes ``1 + log2 n`` rounds and its
first member forwards ``log2 n`` copies. Each destination receives exactly its need ``[t0, d_j)``,
in pieces from several workers. Measured with ``straggler``'s pricing (2 windows, jitter on, the
default candidates) against the holder-once doubling tree it replaces: Wikipedia 4.85x -> 5.08x
over Ulysses at 256K and 2.98x -> 3.20x at 1M, ProLong 5.78x -> 5.95x and 2.78x -> 2.93x, libra-prod
2.24x -> 2.24x and 2.75x -> 2.79x; keeping groups of 2-4 members direct instead lost up to 4.6%
(ProLong 1M). The price is rows: a group of ``n`` gives up to ``n**2`` (Wikipedia pools grew from
~850 to ~4,900 transfer rows).

Where (:meth:`libra.tap.pipeline.ChunkSchedule.hop_heads`): only KV heads that travel with chunk 0 and return after chunk
``M - 1`` of the paper's head-sliced Pipeliner -- the two transfers it never hides -- so the hops
run inside them in order (hop 0, 1 forward; 1, 0 backward) without delaying a chunk that would
otherwise overlap compute. Tile-grouped chunks (:mod:`libra.extensions.adaptive.tile_chunks`) spread each
destination's KV over its chunks and take no relays.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from libra.arrays import expand_counts, lexsort, row_ids
from libra.plan import HEADS, KV, PoolPlan, TransferTable
from libra.tap.pipeline import ChunkSchedule


def _within(eligible: np.ndarray, head_start: np.ndarray, head_end: np.ndarray) -> np.ndarray:
    """bool: whether every KV head of each range ``[head_start, head_end)`` is ``eligible``."""
    outside = np.concatenate(([0], np.cumsum(~np.asarray(eligible, dtype=bool))))
    return outside[head_end] == outside[head_start]


def relay_transfers(transfers: TransferTable, eligible: np.ndarray) -> TransferTable:
    """``transfers`` with the KV rows of ``eligible`` KV heads sent as a scatter and an all-gather
    per payload group of two or more destinations (module doc).

    Args:
        transfers: a pool's direct transfers (every hop 0).
        eligible: bool ``(hkv,)`` (:meth:`ChunkSchedule.hop_heads`).

    Returns:
        The rows that stay direct (same order), then per group (in order of its first row) its hop-0
        pieces and hop-1 forwards; every destination still receives exactly the tokens it did.
    """
    x = transfers
    rows = np.nonzero(x.kind == KV)[0]
    rows = rows[_within(eligible, x.head_start[rows], x.head_end[rows])]
    if not len(rows):
        return x
    keys = [x.seq[rows], x.src[rows], x.head_start[rows], x.head_end[rows], x.tok_start[rows]]
    first_row, gid = row_ids(keys)
    size = np.bincount(gid)
    rows, gid = rows[size[gid] >= 2], gid[size[gid] >= 2]  # a lone destination keeps its direct row
    if not len(rows):
        return x
    # members: by group (in order of the group's first row), then last token, then worker id
    order = lexsort((x.dst[rows], x.tok_end[rows], first_row[gid]))
    members, gid = rows[order], gid[order]
    first = np.nonzero(np.r_[True, gid[1:] != gid[:-1]])[0]
    group, k = expand_counts(np.diff(np.r_[first, len(members)]))  # k: 0-based member of its group
    n, t0 = np.diff(np.r_[first, len(members)])[group], x.tok_start[members].astype(np.int64)
    need = x.tok_end[members].astype(np.int64)
    top = need[first[group] + n - 1]
    # piece k ends at min(d_k, t0 + (k + 1) (d_n - t0) / n) (d_n for the last)
    # (both bounds grow with k, so the pieces are consecutive; d_k > t0, so none starts before t0)
    end = np.where(k == n - 1, top, np.minimum(need, t0 + (k + 1) * (top - t0) // n))
    start = np.where(k == 0, t0, np.r_[0, end[:-1]])
    return _broadcast_rows(x, members, group, first, start, end, need)


def _broadcast_rows(x: TransferTable, members, group, first, start, end, need) -> TransferTable:
    """The direct rows of ``x`` that are not ``members``, then per group its hop-0 pieces (holder ->
    member ``k``: ``[start_k, end_k)``) and hop-1 forwards (member ``k`` -> member ``j``: the piece
    clipped to ``need_j``), all other columns from the receiving member's row."""
    size = np.diff(np.r_[first, len(members)])
    pk, off = expand_counts(size[group])  # every (member k, member j) pair of a group
    pj = first[group[pk]] + off
    fwd = (pk != pj) & (need[pj] > start[pk]) & (end[pk] > start[pk])
    pk, pj = pk[fwd], pj[fwd]
    own = end > start
    recv = np.concatenate([members[own], members[pj]])  # the row whose columns each new row copies
    src = np.concatenate([x.src[members[own]], x.dst[members[pk]]])
    t0 = np.concatenate([start[own], start[pk]])
    t1 = np.concatenate([end[own], np.minimum(end[pk], need[pj])])
    hop = np.concatenate([np.zeros(int(own.sum()), np.int64), np.ones(len(pk), np.int64)])
    sender = np.concatenate([np.nonzero(own)[0], pk])
    order = lexsort((np.concatenate([np.zeros(int(own.sum()), np.int64), pj]), sender, hop, group[sender]))
    recv, src, t0, t1, hop = recv[order], src[order], t0[order], t1[order], hop[order]
    per_token = x.nbytes[recv] // (x.tok_end[recv] - x.tok_start[recv])  # K + V bytes of one token, its heads
    direct = np.ones(len(x), dtype=bool)
    direct[members] = False
    new = {name: getattr(x, name)[recv] for name in TransferTable.FIELDS}
    new.update(src=src, tok_start=t0, tok_end=t1, nbytes=per_token * (t1 - t0), hop=hop)
    return TransferTable(**{name: np.concatenate([getattr(x, name)[direct], new[name]]).astype(dtype)
                            for name, dtype in TransferTable.FIELDS.items()})


def relay_pool(pool: PoolPlan, sched: ChunkSchedule) -> PoolPlan:
    """``pool`` (head-chunked, direct transfers) with its eligible KV fan-out relayed."""
    if pool.chunking != HEADS:
        raise ValueError(f"pool {pool.pool_index}: KV relays need head chunks, got {pool.chunking!r}")
    return replace(pool, transfers=relay_transfers(pool.transfers, sched.hop_heads()))
