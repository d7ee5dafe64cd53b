"""The compiled TAP placer (:mod:`libra.jit.placement`) and overload repair against the Python ones.

``place_tiles(placer="numba")`` must make exactly the choices of ``placer="python"`` (the oracle):
same destination for every tile and the same fallback count, on random pools (GQA shapes, skewed
samples, permuted and scattered holder layouts, overlapping tiles, tau = 0, caller weights with
ties and zeros, comm-aware on and off, link costs, reserved loads, the retention order) and inside
every registry planner that places tiles; ``repair_overload`` makes the same moves on arbitrary
placements. The golden fixture runs through every available placer in
``tests/test_tap_placement_golden.py``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tap_repair import placements
from test_tap_strategies import gqa_pools, scattered_pools

import libra.tap.planner as tap_planner
from libra.config import TapConfig
from libra.extensions.adaptive.repair import repair_overload
from libra.extensions.adaptive.retention import retention_order
from libra.plan import SequenceLayout
from libra.tap.placement import PlacementPolicy, place_tiles
from libra.tap.tiles import make_tiles
from libra.workload import AttentionShape

pytestmark = pytest.mark.numba


def _both(tiles, sequences, workers, shape, tau=TapConfig.tau, weights=None, **policy):
    """``(python, numba)`` results of ``place_tiles`` as ``(dest list, fallbacks)`` (``policy``: the
    :class:`PlacementPolicy` fields)."""
    out = []
    for placer in ("python", "numba"):
        placed, fallback = place_tiles(tiles, sequences, workers, shape, tau, weights, PlacementPolicy(**policy), placer)
        out.append((placed.dest.tolist(), fallback))
    return out


@st.composite
def weights_for(draw, n_tiles: int):
    """None (FLOPs) or per-tile loads with many ties and zeros."""
    kind = draw(st.sampled_from(["none", "ties", "zeros"]))
    if kind == "none" or n_tiles == 0:
        return None
    w = np.array(draw(st.lists(st.integers(0 if kind == "zeros" else 1, 5), min_size=n_tiles,
                               max_size=n_tiles)), dtype=np.float64)
    return w * 0.1  # inexact binary fractions: loads sum with rounding, as real estimates do


def _links(a, b):
    """Arbitrary non-negative integer byte costs (asymmetric; workers in 'nodes' of two)."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    return np.where(a == b, 0, 1 + 7 * (a // 2 != b // 2) + (3 * a + b) % 4)


COSTS = {"bytes": {}, "flops-only": {"comm_aware": False}, "links": {"link_cost": _links}}
"""Alg. 2's comm-aware cost by bytes, the FLOPs-only heap, and link-priced bytes (the dense kernels)."""


@settings(max_examples=100, deadline=None)
@given(pool=gqa_pools(), tau=st.sampled_from([0.0, 0.03, 0.2, 0.5, 1.0]), cost=st.sampled_from(sorted(COSTS)),
       data=st.data())
def test_agree_on_sh_tiles(pool, tau, cost, data):
    sequences, workers, tiles, shape = pool
    weights = data.draw(weights_for(len(tiles)))
    ref, got = _both(tiles, sequences, workers, shape, tau=tau, weights=weights, **COSTS[cost])
    assert got == ref


@settings(max_examples=40, deadline=None)
@given(pool=scattered_pools(), tau=st.sampled_from([0.0, 0.03, 0.5]), comm_aware=st.booleans(),
       overlap=st.booleans(), data=st.data())
def test_agree_on_scattered_and_overlapping_tiles(pool, tau, comm_aware, overlap, data):
    """Arbitrary holder partitions (the grouped kernel) and, with ``overlap``, an extra tile over a
    whole holder range on top of its pieces (not a block partition: the dense kernel)."""
    sequences, workers, tiles, shape = pool
    if overlap:
        tiles = type(tiles).concat([tiles, tiles.select(np.arange(len(tiles)) == 0)])
        cols = {k: getattr(tiles, k).copy() for k in tiles.FIELDS}
        s = int(cols["seq"][-1])
        k = int(np.searchsorted(sequences[s].holder_start, cols["q_start"][-1], side="right") - 1)
        cols["q_start"][-1] = sequences[s].holder_start[k]
        cols["q_end"][-1] = sequences[s].holder_end[k]
        tiles = type(tiles)(**cols)
    weights = data.draw(weights_for(len(tiles)))
    ref, got = _both(tiles, sequences, workers, shape, tau=tau, comm_aware=comm_aware, weights=weights)
    assert got == ref


@settings(max_examples=40, deadline=None)
@given(pool=gqa_pools(), tau=st.sampled_from([0.0, 0.03, 0.5]), comm_aware=st.booleans(),
       link=st.booleans(), data=st.data())
def test_agree_with_reserved_loads(pool, tau, comm_aware, link, data):
    """Both placers (grouped, dense, FLOPs-only) start from the same reserved per-worker loads."""
    sequences, workers, tiles, shape = pool
    cost = (lambda a, b: 1 + (np.asarray(a) // 2 != np.asarray(b) // 2)) if link else None
    reserved = np.array(data.draw(st.lists(st.integers(0, 8), min_size=len(workers), max_size=len(workers)))) \
        * float(tiles.flops.mean() if len(tiles) else 1.0) * 0.25
    py, nb = _both(tiles, sequences, workers, shape, tau, comm_aware=comm_aware,
                   link_cost=cost if comm_aware else None, reserved=reserved)
    assert py == nb


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), tau=st.sampled_from([0.0, 0.03, 0.2]))
def test_agree_in_the_retention_order(seed, tau):
    """``libra-adaptive``'s Q-home retention order (a caller's order, not Alg. 2's)."""
    shape = AttentionShape(8, 2, 8)
    rng = np.random.default_rng(seed)
    seqs = []
    for j in range(2):
        n = 64 * 4
        cuts = np.sort(rng.choice(np.arange(1, n), size=int(rng.integers(0, 6)), replace=False))
        seqs.append(SequenceLayout.contiguous(j, j, np.diff(np.r_[0, cuts, n]), 4))
    workers = list(range(8))
    tiles = make_tiles(seqs, 32, 2, shape)
    order = retention_order(tiles, shape, tiles.flops, len(workers), tau)
    ref, got = _both(tiles, seqs, workers, shape, tau=tau, order=order)
    assert got == ref


@settings(max_examples=150, deadline=None)
@given(case=placements())
def test_repair_makes_the_same_moves(case):
    dest, load, base, cap, priority, home, lw = case
    (py, n_py), (nb, n_nb) = (repair_overload(dest, load, base, cap, priority, home, lw, placer=p)
                              for p in ("python", "numba"))
    assert nb.tolist() == py.tolist() and n_nb == n_py


@pytest.mark.parametrize("tau", [0.0, 0.03])
def test_block_body_is_paid_once_per_worker(tau):
    """Shards over two KV atoms (hq=12, hkv=3, H=2) share atom 1, so a worker that fetched a block's
    body for one shard must not pay it again for the other; only then does the Q-home, whose
    missing prefix lies between the two costs, lose (found by random search against a kernel that
    ignored the record)."""
    shape = AttentionShape(12, 3, 1)
    seqs = [SequenceLayout.contiguous(0, 0, [2, 3, 35, 1, 1, 3, 3, 2, 3, 11], 4)]
    tiles = make_tiles(seqs, 8, 2, shape)
    ref, got = _both(tiles, seqs, range(4), shape, tau=tau)
    assert got == ref


def _window(gbs: int, seq_len: int, seed: int):
    """A long-tailed fixed-token window (outliers longer than S get split)."""
    from libra.data.packing import PackedSequence, pack_fixed_tokens

    rng = np.random.default_rng(seed)
    lens = np.maximum(1, rng.lognormal(np.log(seq_len / 16), 1.4, 40 * gbs)).astype(np.int64)
    lens[rng.random(len(lens)) < 0.03] = int(1.5 * seq_len)
    packed = pack_fixed_tokens(lens, seq_len)[:gbs]
    return [PackedSequence(j, s.sample_lengths, s.sample_ids) for j, s in enumerate(packed)]


@pytest.mark.parametrize("name", ["libra-tap", "libra-tap-vrsp", "libra", "libra-kt", "distca-paper"])
def test_planners_make_identical_plans_with_either_placer(name, monkeypatch):
    from baselines.registry import get_planner
    from libra.config import ParallelConfig

    shape = AttentionShape(32, 4, 8)
    opts = {"block_size": 32, "head_split": 4, "tau": 0.0}
    if name != "distca-paper":
        opts["pool_size"] = 4
    calls = []

    def forced(placer, *args, **kwargs):
        calls.append(placer)
        return place_tiles(*args, placer=placer, **kwargs)

    digests = {}
    for seed in (3, 4):
        for cp in (2, 4):
            par = ParallelConfig(dp=8, cp=cp, gbs=16, seq_len=1024)
            window = _window(par.gbs, par.seq_len, seed)
            for placer in ("python", "numba"):
                monkeypatch.setattr(tap_planner, "place_tiles", functools.partial(forced, placer))
                plans = get_planner(name, **opts).plan_window(window, par, shape)
                digests.setdefault((seed, cp), {})[placer] = [p.digest() for p in plans]
    assert {"python", "numba"} == set(calls)
    for key, by_placer in digests.items():
        assert by_placer["numba"] == by_placer["python"], key
