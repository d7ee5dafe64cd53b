"""The compiled cost model (:mod:`libra.jit.cost`) prices every Plan exactly as the numpy one:
every registry planner's plans (Ulysses' per-document CP, WLB-LLM, DistCA, TAP under head and tile
chunks, KV relays), at several Pipeliner depths and device speeds, on a cluster with NVLink, RoCE
and the inter-supernode spine -- bit for bit, not within a tolerance, so a planner choosing by
price makes the same choice either way."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_baselines_planners import make_window

from baselines.registry import get_planner
from libra.config import ParallelConfig, TapConfig
from libra.extensions.adaptive.candidates import CANDIDATES, CandidateSpace, candidate_pools
from libra.extensions.adaptive.tile_chunks import TILES
from libra.plan import HEADS, Plan
from libra.sim.cost import CostModel
from libra.sim.profiles import load_profile
from libra.sim.topology import Topology
from libra.workload import AttentionShape

pytestmark = pytest.mark.numba

SHAPE = AttentionShape(8, 2, 8)
TAP = {"block_size": 32, "head_split": 1, "pipeline_chunks": 2, "pool_size": 2}
METHODS = {"ulysses": {}, "wlb-llm": {}, "distca-paper": {k: v for k, v in TAP.items() if k != "pool_size"},
           "distca": {"pipeline_chunks": 2}, "dynamic-cp": {"pipeline_chunks": 2},
           "libra": TAP, "libra-kt": TAP, "libra-adaptive": TAP}
PROFILE = load_profile("h100-roce-v1")


def _models(par: ParallelConfig) -> tuple[CostModel, CostModel]:
    topo = Topology(PROFILE, par)
    return CostModel(PROFILE, topo, impl="numba"), CostModel(PROFILE, topo, impl="numpy")


def _same_price(jit: CostModel, ref: CostModel, plan: Plan, chunks: int, speed) -> None:
    a, b = jit.price(plan, chunks, speed=speed), ref.price(plan, chunks, speed=speed)
    for field in ("compute_ms", "comm_ms", "exposed_comm_ms", "total_ms"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    for c in a.link_ms:
        assert np.array_equal(a.link_ms[c], b.link_ms[c]) and np.array_equal(a.bytes_sent[c], b.bytes_sent[c])
    assert np.array_equal(jit.total_ms(plan, chunks, speed=speed), ref.total_ms(plan, chunks, speed=speed))
    (ca, ea), (cb, eb) = jit.worker_ms(plan, chunks, speed=speed), ref.worker_ms(plan, chunks, speed=speed)
    assert np.array_equal(ca, cb) and np.array_equal(ea, eb)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), dp=st.sampled_from([8, 16]), cp=st.sampled_from([1, 2, 4]),
       method=st.sampled_from(sorted(METHODS)), jitter=st.booleans())
def test_compiled_prices_every_plan_bit_for_bit(seed, dp, cp, method, jitter):
    par = ParallelConfig(dp=dp, cp=cp, gbs=dp, seq_len=512)
    jit, ref = _models(par)
    options = dict(METHODS[method], profile=PROFILE) if method.startswith("libra-") else METHODS[method]
    plans = get_planner(method, **options).plan_window(make_window(par.gbs, 512, seed), par, SHAPE)
    speed = np.random.default_rng(seed).uniform(0.8, 1.2, par.workers) if jitter else None
    for plan in plans:
        for chunks in sorted({plan.pipeline_chunks, 1, 2, 4}):
            try:
                ref.total_ms(plan, chunks)
            except ValueError:
                continue  # M not dividing a tile's heads: not a plan either prices
            _same_price(jit, ref, plan, chunks, speed)


def test_every_candidate_with_relays_and_tile_chunks():
    """Every :data:`~libra.extensions.adaptive.candidates.CANDIDATES` plan of real pools (KV relays and tile chunks
    among them: the compiled relay rounds and tile-chunked routes are reached), each priced alone."""
    par = ParallelConfig(dp=8, cp=4, gbs=8, seq_len=2048)
    jit, ref = _models(par)
    tap = TapConfig(pool_size=2, block_size=128, head_split=1, pipeline_chunks=2)
    kinds = set()
    for seed in range(3):
        for plan in get_planner("libra", **TAP | {"block_size": 128}).plan_window(
                make_window(par.gbs, 2048, seed), par, SHAPE):
            for pool in plan.pools:
                found = candidate_pools(pool.pool_index, pool.sequences, pool.workers, CandidateSpace(tap, SHAPE, PROFILE.kernel, tuple(CANDIDATES), link_cost=jit.topology.byte_cost))
                for cand in found.values():
                    for chunking in ((HEADS,) if cand.transfers.hop.any() else (HEADS, TILES)):
                        one = Plan("x", 0, SHAPE, cp=par.cp, pipeline_chunks=2, pools=(replace(cand, chunking=chunking),))
                        kinds.add("relay" if cand.transfers.hop.any() else chunking)
                        _same_price(jit, ref, one, 2, None)
    assert {"relay", TILES, HEADS} <= kinds
