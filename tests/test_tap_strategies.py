"""Shared hypothesis strategies and an independent Algorithm 2 oracle for the TAP tests.

The oracle restates Algorithm 2 (Libra sec. 4.3.2) as plainly as possible -- per worker, per sample,
per KV head, one Python dict of fetched prefix ends -- so the optimised placer in
``libra.tap.placement`` is checked against a second, independent reading of the paper's text.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.plan import SequenceLayout, TileTable
from libra.workload import AttentionShape, kv_bytes, q_bytes

# --------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------


@st.composite
def shapes(draw) -> AttentionShape:
    """GQA shapes with 1-8 KV heads and group sizes 1-4 (hq up to 32)."""
    hkv = draw(st.sampled_from([1, 2, 4, 8]))
    group = draw(st.sampled_from([1, 2, 4]))
    return AttentionShape(num_q_heads=hkv * group, num_kv_heads=hkv, head_dim=draw(st.sampled_from([4, 8])),
                          dtype_bytes=2)


@st.composite
def long_tail_lengths(draw, total: int) -> list[int]:
    """Sample lengths summing to ``total``: mostly short, sometimes one huge (long-tailed)."""
    out, left = [], total
    while left:
        kind = draw(st.integers(0, 9))
        if kind == 0:
            n = draw(st.integers(1, total))  # an outlier spanning blocks and holders
        elif kind <= 2:
            n = draw(st.integers(1, max(1, total // 4)))
        else:
            n = draw(st.integers(1, max(1, total // 16)))
        n = min(n, left)
        out.append(n)
        left -= n
    return out


@st.composite
def pools(draw, max_cp: int = 4, max_p: int = 3, permute_holders: bool = True):
    """A pool: ``(sequences, workers, block_size, head_split, shape)`` with the standard layout.

    CP ranks may hold their ranges in permuted order (a valid non-standard layout), and the pool's
    first DP rank may be nonzero (global worker ids then do not start at 0).
    """
    shape = draw(shapes())
    cp = draw(st.sampled_from([c for c in (1, 2, 4) if c <= max_cp]))
    p = draw(st.integers(1, max_p))
    block = draw(st.sampled_from([2, 4, 8]))
    per_rank = block * draw(st.integers(1, 3))
    seq_len = per_rank * cp
    divisors = [h for h in range(1, shape.num_q_heads + 1) if shape.num_q_heads % h == 0]
    head_split = draw(st.sampled_from(divisors))
    p0 = draw(st.integers(0, 2))
    sequences = []
    for j in range(p):
        lengths = draw(long_tail_lengths(seq_len))
        dp = p0 + j
        ranks = np.arange(cp)
        if permute_holders and cp > 1:
            ranks = np.array(draw(st.permutations(list(range(cp)))))
        starts = np.arange(cp) * per_rank
        sequences.append(SequenceLayout(seq_id=10 + j, dp_rank=dp, sample_lengths=lengths,
                                        holder_start=starts, holder_end=starts + per_rank,
                                        holder_worker=dp * cp + ranks))
    workers = list(range(p0 * cp, (p0 + p) * cp))
    return sequences, workers, block, head_split, shape


# --------------------------------------------------------------------------------------------
# independent oracle of Algorithm 2
# --------------------------------------------------------------------------------------------


def oracle_place(tiles: TileTable, sequences, workers, shape: AttentionShape, tau: float,
                 comm_aware: bool = True, link_cost=None) -> tuple[list[int], int]:
    """Plain restatement of Algorithm 2; returns (dest per tile, fallback count). ``link_cost(src,
    dst)``: each byte moved weighted by the link it crosses (``place_tiles(link_cost=...)``)."""
    def lc(a, b):
        return 0 if a == b else (1 if link_cost is None else int(link_cost(np.int64(a), np.int64(b))))

    workers = sorted(int(w) for w in workers)
    loads = {w: 0.0 for w in workers}
    cap = (1 + tau) * (float(np.sum(tiles.flops)) / len(workers))
    fetched: dict[tuple, int] = {}  # (worker, seq, sample, kv head) -> prefix end (absolute token)
    dest = [-1] * len(tiles)
    fallback = 0
    order = sorted(range(len(tiles)), key=lambda t: (-tiles.flops[t], t))
    for t in order:
        s = int(tiles.seq[t])
        seq = sequences[s]
        offs = seq.sample_offsets.tolist()
        qs, qe = int(tiles.q_start[t]), int(tiles.q_end[t])
        kv0, kv1 = shape.kv_head_range(int(tiles.head_start[t]), int(tiles.head_end[t]))
        heads = int(tiles.head_end[t] - tiles.head_start[t])
        needs = []  # (sample, start, prefix end)
        for i in range(len(offs) - 1):
            if offs[i] < qe and offs[i + 1] > qs:
                needs.append((i, offs[i], min(qe, offs[i + 1])))

        def fetch(w, lo, hi, seq=seq):
            """Cost of KV rows [lo, hi) (one head) on w: each holder's rows over its link to w."""
            n = 0
            for a, b, hw in zip(seq.holder_start.tolist(), seq.holder_end.tolist(), seq.holder_worker.tolist()):
                n += max(0, min(hi, b) - max(lo, a)) * lc(hw, w)
            return n

        def cost(w, t=t, s=s, needs=needs, kv0=kv0, kv1=kv1, heads=heads, qs=qs, qe=qe, fetch=fetch):
            c = 2 * q_bytes(qe - qs, heads, shape.head_dim, shape.dtype_bytes) * lc(int(tiles.q_home[t]), w)
            for i, a, e in needs:
                for k in range(kv0, kv1):
                    x = max(a, fetched.get((w, s, i, k), a))
                    if x < e:
                        c += kv_bytes(1, 1, shape.head_dim, shape.dtype_bytes) * fetch(w, x, e)
            return c

        f = float(tiles.flops[t])
        cands = [w for w in workers if loads[w] + f <= cap]
        if cands:
            if comm_aware:
                w = min(cands, key=lambda w: (cost(w), loads[w], w))
            else:
                w = min(cands, key=lambda w: (loads[w], w))
        else:
            w = min(workers, key=lambda w: (loads[w], w))
            fallback += 1
        for i, _a, e in needs:
            for k in range(kv0, kv1):
                key = (w, s, i, k)
                fetched[key] = max(fetched.get(key, 0), e)
        loads[w] += f
        dest[t] = w
    return dest, fallback


def placed_with(tiles: TileTable, dest) -> TileTable:
    """``tiles`` with the given destinations."""
    cols = {k: getattr(tiles, k) for k in TileTable.FIELDS}
    cols["dest"] = np.asarray(dest)
    return TileTable(**cols)


# --------------------------------------------------------------------------------------------
# sanity of the strategies themselves
# --------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(pools())
def test_pool_strategy_gives_valid_layouts(pool):
    sequences, workers, block, head_split, shape = pool
    for seq in sequences:
        assert seq.num_tokens % (block * len(seq.holder_start)) == 0
        assert set(seq.holder_worker.tolist()) <= set(workers)
        assert np.all(seq.sample_lengths > 0)
    assert shape.num_q_heads % head_split == 0


@st.composite
def scattered_pools(draw):
    """Pools with arbitrary holder partitions (unequal ranges, one worker holding several
    non-adjacent ranges, as WLB-LLM's per-document CP sharding does) and tiles = holder ranges
    (or pieces of them) x head shards. Returns ``(sequences, workers, tiles, shape)``, tiles unplaced."""
    from libra.plan import tile_flops

    shape = draw(shapes())
    n_workers = draw(st.integers(1, 5))
    workers = list(range(3, 3 + n_workers))
    sequences, rows = [], []
    for s_idx in range(draw(st.integers(1, 3))):
        total = draw(st.integers(1, 40))
        lengths = draw(long_tail_lengths(total))
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, total - 1)), max_size=6))) - {total})
        starts = [0] + cuts
        ends = cuts + [total]
        holders = [draw(st.sampled_from(workers)) for _ in starts]
        seq = SequenceLayout(s_idx, s_idx, lengths, starts, ends, holders)
        sequences.append(seq)
        divisors = [h for h in range(1, shape.num_q_heads + 1) if shape.num_q_heads % h == 0]
        split = draw(st.sampled_from(divisors))
        width = shape.num_q_heads // split
        for a, b, w in zip(starts, ends, holders):
            mid = draw(st.integers(a, b))  # optionally cut a holder range into two tiles
            for lo, hi in ((a, mid), (mid, b)) if a < mid < b else ((a, b),):
                for k in range(split):
                    rows.append((s_idx, lo, hi, k * width, (k + 1) * width, w))
    cols = list(zip(*rows))
    flops = np.concatenate([tile_flops(sequences[s], np.array([lo]), np.array([hi]), he - hs, shape.head_dim)
                            for s, lo, hi, hs, he, _ in rows])
    tiles = TileTable(seq=cols[0], q_start=cols[1], q_end=cols[2], head_start=cols[3], head_end=cols[4],
                      q_home=cols[5], dest=np.full(len(rows), -1), flops=flops)
    return sequences, workers, tiles, shape


GQA = [(8, 2), (32, 4), (12, 3), (4, 4), (6, 3)]
"""(hq, hkv): GQA groups of 4, 8, 4, 1 and 2 (6/3 with H=2 and 12/3 with H=4: shards over 2 KV atoms)."""


@st.composite
def gqa_pools(draw):
    """``(sequences, workers, tiles, shape)``: a standard-layout pool of P DP ranks x CP with SH-tiles
    (:data:`GQA` shapes, head_dim 4 or 128, CP ranks permuted or not, long-tailed samples)."""
    from libra.tap.tiles import make_tiles

    hq, hkv = draw(st.sampled_from(GQA))
    shape = AttentionShape(num_q_heads=hq, num_kv_heads=hkv, head_dim=draw(st.sampled_from([4, 128])),
                           dtype_bytes=2)
    cp, p, p0 = draw(st.sampled_from([1, 2, 4, 8])), draw(st.integers(1, 4)), draw(st.integers(0, 2))
    block = draw(st.sampled_from([2, 4, 16]))
    per_rank = block * draw(st.integers(1, 3))
    sequences = []
    for j in range(p):
        ranks = np.array(draw(st.permutations(list(range(cp))))) if draw(st.booleans()) else np.arange(cp)
        starts = np.arange(cp) * per_rank
        sequences.append(SequenceLayout(j, p0 + j, draw(long_tail_lengths(per_rank * cp)), starts,
                                        starts + per_rank, (p0 + j) * cp + ranks))
    head_split = draw(st.sampled_from([h for h in (1, 2, 3, 4, 8) if hq % h == 0]))
    tiles = make_tiles(sequences, block, head_split, shape)
    return sequences, list(range(p0 * cp, (p0 + p) * cp)), tiles, shape
