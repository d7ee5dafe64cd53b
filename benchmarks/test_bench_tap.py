"""TAP planning time per microbatch per pool (Libra sec. 5: 2.4 ms at 256K, 10.7 ms at 1M).

Settings of Libra sec. 6.3 with the ``libra-prod`` preset: 256K (CP 8, P 8, B 4096, H 2 -> 1024
tiles on 64 workers) and 1M (CP 16, P 8, B 8192, H 2 -> 2048 tiles on 128 workers), 32 query
heads, 4 KV heads, head_dim 128. The pool is a VRSP pool of the first GBS window (what Libra plans
in production). Run with ``make bench`` (or ``pytest benchmarks --benchmark-only``).
"""

from __future__ import annotations

import numpy as np
import pytest

from libra.data.windows import gbs_windows, window_workloads
from libra.plan import SequenceLayout
from libra.tap import build_transfers, make_tiles, place_tiles
from libra.vrsp import vrsp
from libra.workload import AttentionShape

SHAPE = AttentionShape(num_q_heads=32, num_kv_heads=4, head_dim=128, dtype_bytes=2)
SETTINGS = {"256K": dict(seq_len=262144, cp=8, gbs=128, block=4096),
            "1M": dict(seq_len=1048576, cp=16, gbs=32, block=8192)}
P, H = 8, 2


def realistic_pool(name: str, pool: int = 0, seed: int = 0):
    """``(sequences, workers)`` of VRSP pool ``pool`` of the first ``libra-prod`` GBS window."""
    s = SETTINGS[name]
    window = gbs_windows("libra-prod", s["seq_len"], s["gbs"], 1, seed=seed)[0]
    members = vrsp(window_workloads(window), P)[pool]
    seqs = [SequenceLayout.contiguous(int(i), j, window[int(i)].sample_lengths, s["cp"])
            for j, i in enumerate(members)]
    return seqs, list(range(P * s["cp"]))


def tap_plan(seqs, workers, block):
    tiles = make_tiles(seqs, block, H, SHAPE)
    placed, fallback = place_tiles(tiles, seqs, workers, SHAPE, tau=0.03)
    return placed, build_transfers(seqs, placed, SHAPE), fallback


@pytest.mark.parametrize("name", list(SETTINGS))
def test_bench_tap_plan(benchmark, name):
    """Tiles + Algorithm 2 + exchange for one pool (the paper's 'TAP placement' figure)."""
    seqs, workers = realistic_pool(name)
    placed, transfers, _ = benchmark(tap_plan, seqs, workers, SETTINGS[name]["block"])
    loads = np.bincount(placed.dest, weights=placed.flops, minlength=len(workers))
    benchmark.extra_info.update(tiles=len(placed), workers=len(workers),
                                max_over_mean=float(loads.max() / loads.mean()),
                                bytes=int(transfers.nbytes.sum()))
    assert len(placed) == len(seqs) * SETTINGS[name]["seq_len"] // SETTINGS[name]["block"] * H


@pytest.mark.parametrize("name", list(SETTINGS))
def test_bench_tap_place_only(benchmark, name):
    seqs, workers = realistic_pool(name)
    tiles = make_tiles(seqs, SETTINGS[name]["block"], H, SHAPE)
    benchmark(place_tiles, tiles, seqs, workers, SHAPE, 0.03)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_bench_tap_exchange_only(benchmark, name):
    seqs, workers = realistic_pool(name)
    placed, _ = place_tiles(make_tiles(seqs, SETTINGS[name]["block"], H, SHAPE), seqs, workers, SHAPE)
    benchmark(build_transfers, seqs, placed, SHAPE)
