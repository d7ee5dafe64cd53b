"""Every compiled kernel of ``libra/jit/`` gives exactly what its Python/numpy oracle gives.

One parametrized sweep over the five kernels (tiles, placement under every policy,
exchange, kernel segments, the cost model's communication terms) and ``libra-adaptive``'s
overload repair, on pools of mixed sample lengths: the compiled code is a second implementation
for speed only, so any difference is a bug in it.
"""

from __future__ import annotations

import numpy as np
import pytest

from libra.config import ParallelConfig, TapConfig
from libra.extensions.adaptive.repair import repair_overload
from libra.jit import compiled
from libra.plan import Plan, SequenceLayout
from libra.plan.layout import _segments_compiled, _segments_numpy, pool_index
from libra.sim.cost import CostModel
from libra.sim.profiles import load_profile
from libra.sim.topology import Topology
from libra.tap.exchange import build_transfers
from libra.tap.placement import PlacementPolicy, link_matrix, place_tiles
from libra.tap.planner import plan_pool
from libra.tap.tiles import make_tiles
from libra.workload import AttentionShape

pytestmark = pytest.mark.numba

SHAPE = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=16)
KERNELS = ("tiles", "placement", "exchange", "layout", "cost", "repair")


def _pool(seed: int, p: int = 4, cp: int = 2, per_rank: int = 256):
    """``(sequences, workers)``: P packed sequences of ``cp * per_rank`` tokens with a long tail."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(p):
        total, lengths = cp * per_rank, []
        while total:
            n = int(min(total, rng.choice([8, 24, 64, 200, 700])))
            lengths.append(n)
            total -= n
        seqs.append(SequenceLayout.contiguous(i, i, np.array(lengths), cp))
    return tuple(seqs), tuple(range(p * cp))


def _links(a, b):
    return 1 + 3 * (np.asarray(a) // 4 != np.asarray(b) // 4)


def _policies(workers, n_tiles, seed):
    rng = np.random.default_rng(seed)
    return [PlacementPolicy(), PlacementPolicy(comm_aware=False), PlacementPolicy(link_cost=_links),
            PlacementPolicy(reserved=rng.uniform(0, 1e6, len(workers))),
            PlacementPolicy(order=rng.permutation(n_tiles), link_cost=_links)]


def _pairs(kernel: str, seed: int):
    """``[(compiled result, oracle result), ...]`` of ``kernel`` on one pool."""
    seqs, workers = _pool(seed)
    tap = TapConfig(pool_size=4, block_size=64, head_split=2, pipeline_chunks=2)
    tiles = make_tiles(seqs, tap.block_size, tap.head_split, SHAPE)
    if kernel == "tiles":
        return [(make_tiles(seqs, 64, h, SHAPE, impl="numba"), make_tiles(seqs, 64, h, SHAPE, impl="numpy"))
                for h in (1, 2, 4)]
    if kernel == "placement":
        out = []
        for policy in _policies(workers, len(tiles), seed):
            got = place_tiles(tiles, seqs, workers, SHAPE, 0.03, policy=policy, placer="numba")
            want = place_tiles(tiles, seqs, workers, SHAPE, 0.03, policy=policy, placer="python")
            out += [(got[0], want[0]), (got[1], want[1])]
        return out
    placed = plan_pool(0, seqs, workers, tap, SHAPE).tiles
    if kernel == "exchange":
        return [(build_transfers(seqs, placed, SHAPE, impl="numba"), build_transfers(seqs, placed, SHAPE, impl="numpy"))]
    if kernel == "layout":
        idx = pool_index(seqs)
        return [(_segments_compiled(compiled("layout"), placed, idx), _segments_numpy(placed, idx))]
    if kernel == "cost":
        profile = load_profile("h100-roce-v1")
        par = ParallelConfig(dp=4, cp=2, gbs=4, seq_len=512)
        pool = plan_pool(0, seqs, workers, tap, SHAPE)
        plan = Plan("libra", 0, SHAPE, cp=2, pipeline_chunks=2, pools=(pool,))
        got, want = (CostModel(profile, Topology(profile, par), impl=i).price(plan) for i in ("numba", "numpy"))
        return [(got.compute_ms, want.compute_ms), (got.exposed_comm_ms, want.exposed_comm_ms),
                (got.exposed_comm_serial_ms, want.exposed_comm_serial_ms)]
    # repair: every tile left at its Q-home (causal work piles up on the late ranks), moved by link cost
    load = tiles.flops.astype(np.float64)
    wsorted = np.asarray(workers, dtype=np.int64)
    home = np.searchsorted(wsorted, tiles.q_home)
    dest = home.copy()
    base = np.zeros(len(workers))
    cap = 1.05 * float(load.sum()) / len(workers)
    prio = load / np.maximum(np.arange(1, len(load) + 1), 1)
    lw = link_matrix(_links, wsorted)
    got = repair_overload(dest.copy(), load, base, cap, prio, home, lw, placer="numba")
    want = repair_overload(dest.copy(), load, base, cap, prio, home, lw, placer="python")
    assert not np.array_equal(want[0], dest)  # something was repaired
    return [(got[0], want[0]), (got[1], want[1])]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kernel", KERNELS)
def test_compiled_kernel_equals_its_oracle(kernel, seed, assert_same):
    pairs = _pairs(kernel, seed)
    assert pairs
    for got, want in pairs:
        assert_same(got, want, f"{kernel}: the compiled result differs from the oracle's")
