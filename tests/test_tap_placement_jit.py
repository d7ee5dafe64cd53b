"""The compiled TAP placer (:mod:`libra.jit.placement`, numba) against the Python one.

``place_tiles(placer="numba")`` must make exactly the choices of ``placer="python"`` (the oracle):
same destination for every tile and the same fallback count, on random pools (GQA shapes, skewed
samples, permuted and scattered holder layouts, tau = 0, caller weights with ties and zeros,
comm-aware on and off) and inside every registry planner that places tiles; the golden fixture
runs through every available placer in ``test_tap_placement_golden.py``. Without numba the
compiled tests skip; the dispatch tests still run.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tap_strategies import long_tail_lengths, scattered_pools

import libra.tap.planner as tap_planner
from libra import jit as kernels
from libra.config import TapConfig
from libra.plan import SequenceLayout
from libra.tap.placement import PlacementPolicy, available_placers, default_placer, place_tiles, warmup
from libra.tap.tiles import make_tiles
from libra.workload import AttentionShape

HAVE_NUMBA = "numba" in available_placers()
needs_numba = pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed (pip install -e '.[fast]')")

# (hq, hkv): GQA groups of 4, 8, 4, 1 and 2 (6/3 with H=2 and 12/3 with H=4: shards over 2 KV atoms)
GQA = [(8, 2), (32, 4), (12, 3), (4, 4), (6, 3)]


def _both(tiles, sequences, workers, shape, tau=TapConfig.tau, weights=None, **policy):
    """``(python, numba)`` results of ``place_tiles`` as ``(dest list, fallbacks)`` (``policy``: the
    :class:`PlacementPolicy` fields)."""
    out = []
    for placer in ("python", "numba"):
        placed, fallback = place_tiles(tiles, sequences, workers, shape, tau, weights, PlacementPolicy(**policy), placer)
        out.append((placed.dest.tolist(), fallback))
    return out


@st.composite
def gqa_pools(draw):
    """``(sequences, workers, tiles, shape)``: a standard-layout pool of P DP ranks x CP with SH-tiles."""
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


@st.composite
def weights_for(draw, n_tiles: int):
    """None (FLOPs) or per-tile loads with many ties and zeros."""
    kind = draw(st.sampled_from(["none", "ties", "zeros"]))
    if kind == "none" or n_tiles == 0:
        return None
    w = np.array(draw(st.lists(st.integers(0 if kind == "zeros" else 1, 5), min_size=n_tiles,
                               max_size=n_tiles)), dtype=np.float64)
    return w * 0.1  # inexact binary fractions: loads sum with rounding, as real estimates do


@needs_numba
@settings(max_examples=60, deadline=None)
@given(pool=gqa_pools(), tau=st.sampled_from([0.0, 0.03, 0.2, 1.0]), comm_aware=st.booleans(),
       data=st.data())
def test_numba_matches_python_on_sh_tiles(pool, tau, comm_aware, data):
    sequences, workers, tiles, shape = pool
    weights = data.draw(weights_for(len(tiles)))
    ref, got = _both(tiles, sequences, workers, shape, tau=tau, comm_aware=comm_aware, weights=weights)
    assert got == ref


@needs_numba
@settings(max_examples=40, deadline=None)
@given(pool=scattered_pools(), tau=st.sampled_from([0.0, 0.03, 0.5]), comm_aware=st.booleans(),
       overlap=st.booleans(), data=st.data())
def test_numba_matches_python_on_scattered_and_overlapping_tiles(pool, tau, comm_aware, overlap, data):
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


@needs_numba
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


@needs_numba
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


@needs_numba
def test_warmup_compiles_once_and_auto_uses_numba():
    assert default_placer() == "numba" and available_placers() == ("numba", "python")
    assert warmup() >= 0.0
    assert warmup() < 1.0  # already compiled in this process
    assert warmup("python") == 0.0


def test_unknown_placer_is_a_value_error():
    seqs = [SequenceLayout.contiguous(0, 0, [4, 4], 2)]
    shape = AttentionShape(2, 1, 4)
    tiles = make_tiles(seqs, 2, 1, shape)
    with pytest.raises(ValueError, match="placer must be one of"):
        place_tiles(tiles, seqs, [0, 1], shape, placer="jit")
    with pytest.raises(ValueError, match="placer must be one of"):
        warmup("fast")


def test_without_numba_auto_falls_back_to_python(monkeypatch):
    """No numba: ``auto`` runs the Python loops, ``numba`` is an ImportError naming the extra, and
    importing the kernel module fails cleanly (so :func:`libra.jit.compiled` reports None)."""
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` now raises ImportError
    monkeypatch.delitem(sys.modules, "libra.jit.placement", raising=False)
    assert kernels.compiled.__wrapped__("placement") is None
    monkeypatch.setattr(kernels, "compiled", lambda name: None)  # every compiled module, as without numba
    assert default_placer() == "python" and available_placers() == ("python",)
    assert warmup() == 0.0
    seqs = [SequenceLayout.contiguous(0, 0, [1, 7], 2), SequenceLayout.contiguous(1, 1, [8], 2)]
    shape = AttentionShape(4, 2, 4)
    tiles = make_tiles(seqs, 2, 2, shape)
    placed, fallback = place_tiles(tiles, seqs, range(4), shape, tau=0.0)
    ref, fb_ref = place_tiles(tiles, seqs, range(4), shape, tau=0.0, placer="python")
    assert placed.dest.tolist() == ref.dest.tolist() and fallback == fb_ref
    with pytest.raises(ImportError, match=r"\.\[fast\]"):
        place_tiles(tiles, seqs, range(4), shape, placer="numba")


def test_compiled_names_only_the_kernel_modules():
    with pytest.raises(ValueError, match="unknown compiled module 'placer_jit'"):
        kernels.compiled("placer_jit")  # a typo must not read as "numba missing"


def _links(a, b):
    """Arbitrary non-negative integer byte costs (asymmetric; workers in 'nodes' of two)."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    return np.where(a == b, 0, 1 + 7 * (a // 2 != b // 2) + (3 * a + b) % 4)


@needs_numba
@settings(max_examples=40, deadline=None)
@given(pool=gqa_pools(), tau=st.sampled_from([0.0, 0.03, 0.5]), data=st.data())
def test_numba_matches_python_with_link_costs(pool, tau, data):
    """Link-priced placement (the dense kernels, integer-weighted bytes) chooses identically."""
    sequences, workers, tiles, shape = pool
    weights = data.draw(weights_for(len(tiles)))
    ref, got = _both(tiles, sequences, workers, shape, tau=tau, weights=weights, link_cost=_links)
    assert got == ref


@settings(max_examples=40, deadline=None)
@given(pool=gqa_pools(), tau=st.sampled_from([0.0, 0.03, 0.5]), comm_aware=st.booleans(),
       link=st.booleans(), data=st.data())
def test_reserved_loads_start_every_placer_from_the_same_loads(pool, tau, comm_aware, link, data):
    """``reserved``: all placers (grouped, dense, FLOPs-only; Python and compiled) start from the same
    per-worker loads and agree; zeros are the paper's placement exactly; ``C`` counts them."""
    sequences, workers, tiles, shape = pool
    cost = (lambda a, b: 1 + (np.asarray(a) // 2 != np.asarray(b) // 2)) if link else None
    reserved = np.array(data.draw(st.lists(st.integers(0, 8), min_size=len(workers), max_size=len(workers)))) \
        * float(tiles.flops.mean() if len(tiles) else 1.0) * 0.25
    kw = {"comm_aware": comm_aware, "link_cost": cost if comm_aware else None}
    for placer in available_placers():
        plain = place_tiles(tiles, sequences, workers, shape, tau, policy=PlacementPolicy(**kw), placer=placer)
        zero = place_tiles(tiles, sequences, workers, shape, tau, placer=placer,
                           policy=PlacementPolicy(**kw, reserved=np.zeros(len(workers))))
        assert plain[0].dest.tolist() == zero[0].dest.tolist() and plain[1] == zero[1]
    if HAVE_NUMBA:
        py, nb = _both(tiles, sequences, workers, shape, tau, reserved=reserved, **kw)
        assert py == nb
    # the reserved loads count in C: the total load per worker never exceeds C except by fallbacks
    placed, fallback = place_tiles(tiles, sequences, workers, shape, tau, policy=PlacementPolicy(**kw, reserved=reserved))
    loads = reserved + np.bincount(np.searchsorted(workers, placed.dest), weights=placed.flops, minlength=len(workers))
    cap = (1 + tau) * (tiles.flops.sum() + reserved.sum()) / len(workers)
    assert fallback > 0 or (loads <= cap * (1 + 1e-9)).all()


def test_a_worker_with_reserved_load_gets_less_work():
    """A worker reserved above ``C`` takes no tile while another has room (in any placer)."""
    shape = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=8, dtype_bytes=2)
    seqs = [SequenceLayout.contiguous(j, j, np.array([64] * 4), 2) for j in range(2)]
    workers = [0, 1, 2, 3]
    tiles = make_tiles(seqs, 16, 2, shape)
    busy = np.array([0.0, 0.0, 10.0 * tiles.flops.sum(), 0.0])
    for placer in available_placers():
        for comm_aware in (True, False):
            placed, fallback = place_tiles(tiles, seqs, workers, shape, placer=placer,
                                           policy=PlacementPolicy(comm_aware=comm_aware, reserved=busy))
            assert 2 not in set(placed.dest.tolist()) and fallback == 0
    with pytest.raises(ValueError, match="reserved loads"):
        place_tiles(tiles, seqs, workers, shape, policy=PlacementPolicy(reserved=[1.0, 2.0]))
    with pytest.raises(ValueError, match="reserved loads"):
        place_tiles(tiles, seqs, workers, shape, policy=PlacementPolicy(reserved=[0.0, -1.0, 0.0, 0.0]))
