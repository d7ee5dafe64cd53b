"""The TAP Pipeliner (Libra sec. 4.4): one ChunkSchedule that the runtime executes and the cost model prices."""

from __future__ import annotations

import numpy as np
import pytest
from dist_utils import long_tail_lengths

from baselines.registry import PLANNERS, get_planner
from libra.config import ParallelConfig
from libra.data.packing import PackedSequence
from libra.plan import KV, Q, TransferTable
from libra.runtime.program import compile_worker
from libra.sim.cost import CostModel
from libra.sim.profiles import load_profile
from libra.sim.topology import Topology
from libra.tap.pipeline import BWD_RETURN, FWD_DISPATCH, PHASES, ChunkSchedule, pipeline_events
from libra.workload import AttentionShape


def test_head_chunks_and_events():
    sched = ChunkSchedule(AttentionShape(32, 4, 128), [0, 16], [16, 32], 4)
    assert sched.head_chunks(16, 32) == [(16, 20), (20, 24), (24, 28), (28, 32)]
    assert sched.heads_per_call([16, 16]).tolist() == [4, 4]
    assert pipeline_events(1) == (("issue_dispatch", 0), ("wait_dispatch", 0), ("compute", 0),
                                  ("issue_return", 0), ("wait_return", 0))
    # the runtime's order: chunk m+1's dispatch is issued before chunk m's wait; chunk m's return
    # goes with chunk m+2's dispatch (one exchange) while there is one
    assert sched.events[:5] == (("issue_dispatch", 0), ("issue_dispatch", 1), ("wait_dispatch", 0),
                                ("compute", 0), ("issue_exchange", 0))
    assert [e for e in sched.events if e[0].startswith("issue")] == [
        ("issue_dispatch", 0), ("issue_dispatch", 1), ("issue_exchange", 0), ("issue_exchange", 1),
        ("issue_return", 2), ("issue_return", 3)]
    assert [e[0] for e in pipeline_events(2) if e[0].startswith("issue")] == [
        "issue_dispatch", "issue_dispatch", "issue_return", "issue_return"]
    assert [e for e in sched.events if e[0] == "compute"] == [("compute", m) for m in range(4)]
    assert sched.events[-4:] == tuple(("wait_return", m) for m in range(4))


@pytest.mark.parametrize("chunks, msg", [(0, "positive integer"), (True, "positive integer"),
                                         (3, "M=3 must divide every tile's head width")])
def test_bad_chunks(chunks, msg):
    with pytest.raises(ValueError, match=msg):
        ChunkSchedule(AttentionShape(32, 4, 128), [0, 16], [16, 32], chunks)


def test_gqa_kv_first_and_last_chunk():
    # 32 q / 4 kv heads, H = 2, M = 4: chunk m of shard [0, 16) reads KV head m // 2, so half the KV
    # heads go with chunk 0 and half with chunk 2; dK/dV return after chunks 1 and 3
    sched = ChunkSchedule(AttentionShape(32, 4, 128), [0, 16], [16, 32], 4)
    assert sched.kv_first.tolist() == [0, 2, 0, 2]
    assert sched.kv_last.tolist() == [1, 3, 1, 3]
    tr = TransferTable(kind=[KV], src=[0], dst=[1], seq=[0], tok_start=[0], tok_end=[8], head_start=[0],
                       head_end=[2], nbytes=[800])
    fwd = sched.phase_routes(tr)["fwd_dispatch"]
    assert fwd.nbytes.tolist() == [[400.0, 0.0, 400.0, 0.0]]
    back = sched.phase_routes(tr)["bwd_return"]
    assert (back.src.tolist(), back.dst.tolist()) == ([1], [0])  # dK/dV retrace the fetch
    assert back.nbytes.tolist() == [[0.0, 400.0, 0.0, 400.0]]
    assert sched.row_heads(KV, 0, 2, 2).tolist() == [1] and sched.row_heads(KV, 0, 2, 1, backward=True).tolist() == [0]


def test_one_chunk_moves_every_row_whole():
    """At M = 1 every phase's route carries its row's whole bytes (the shortcut past the KV-head
    shares gives what the shares give: exactly 1 per row)."""
    sched = ChunkSchedule(AttentionShape(32, 4, 128), [0, 16], [16, 32], 1)
    tr = TransferTable(kind=[KV, KV, Q], src=[0, 1, 0], dst=[1, 0, 1], seq=[0, 0, 0], tok_start=[0, 8, 0],
                       tok_end=[8, 16, 4], head_start=[0, 1, 0], head_end=[2, 4, 16], nbytes=[800, 1201, 333])
    routes = sched.phase_routes(tr)
    assert routes["fwd_dispatch"].nbytes.tolist() == [[333.0], [800.0], [1201.0]]  # Q rows first, then KV
    assert routes["bwd_return"].nbytes.tolist() == [[800.0], [1201.0]]
    shares = sched._kv_cum[False][[2, 4]] - sched._kv_cum[False][[0, 1]]
    assert (shares / np.array([[2], [3]]) == 1.0).all()  # what the shares would have given


def test_tiles_of_different_head_widths():
    # a wide tile [0, 8) and narrow tiles [0, 4), [4, 8) in one pool: each range has its own map
    sched = ChunkSchedule(AttentionShape(8, 2, 16), [0, 0, 4], [8, 4, 8], 2)
    assert sched.head_chunks(0, 8) == [(0, 4), (4, 8)]
    assert sched.head_chunks(0, 4) == [(0, 2), (2, 4)]
    assert sched.row_heads(Q, 0, 4, 1).tolist() == [2, 3]
    # KV head 0 (q heads 0-3) is read by chunk 0 of [0, 8) and chunk 1 of [0, 4)
    assert sched.kv_first.tolist() == [0, 0] and sched.kv_last.tolist() == [1, 1]
    assert sched.heads_per_call([8, 4, 4]).tolist() == [4, 2, 2]


# --------------------------------------------------------------------------------------------
# runtime == cost model: every planner, several M and GQA shapes
# --------------------------------------------------------------------------------------------


def _window(rng, dp: int, S: int):
    window = []
    for i in range(dp):
        lengths = long_tail_lengths(rng, S, scale=float(rng.choice([4.0, 40.0, 200.0])))
        window.append(PackedSequence(i, lengths, np.arange(len(lengths))))
    return window


def _options(name: str, M: int, H: int, B: int, dp: int) -> dict:
    if name in ("ulysses", "ulysses-sorted", "wlb-llm"):
        return {}
    if name in ("distca", "dynamic-cp"):
        return {"pipeline_chunks": M}
    opts = {"block_size": B, "head_split": H}
    if name != "distca-paper":
        opts["pool_size"] = dp
    if name in ("libra", "libra-kt", "libra-adaptive", "distca-paper"):
        opts["pipeline_chunks"] = M
    return opts


TILED = "libra-adaptive+tiles"  # libra-adaptive pinned to tile-grouped chunks (libra.extensions.adaptive.tile_chunks)
RELAY = "libra-adaptive+relay"  # libra-adaptive pinned to relayed KV fan-out (libra.extensions.adaptive.relay)
CASES = [(name, hq, hkv, H, M, seed) for name in (*PLANNERS, TILED, RELAY)
         for (hq, hkv, H, M, seed) in [(8, 2, 2, 2, 0), (8, 2, 1, 4, 1), (12, 3, 2, 3, 2), (4, 4, 2, 2, 3)]]


@pytest.mark.parametrize("name, hq, hkv, H, M, seed", CASES)
def test_runtime_sends_what_the_cost_model_prices(name, hq, hkv, H, M, seed):
    """Per worker, phase and chunk: the compiled programs' send/receive bytes equal the cost model's,
    and the runtime's event list is the one the cost model walks."""
    dp, cp, S, B = 2, 2, 128, 16
    shape = AttentionShape(hq, hkv, 8, 2)
    par = ParallelConfig(dp=dp, cp=cp, gbs=dp, seq_len=S)
    window = _window(np.random.default_rng(seed), dp, S)
    if name == TILED:
        planner = get_planner("libra-adaptive", **_options("libra-adaptive", M, H, B, dp), chunkings=("tiles",))
    elif name == RELAY:
        planner = get_planner("libra-adaptive", **_options("libra-adaptive", M, H, B, dp),
                              candidates=("fine-retain-link-relay",), rebalance_passes=0,  # keep its relays
                              profile="h100-roce-v1")  # whose placement of these tiny pools fans KV out
    else:
        planner = get_planner(name, **_options(name, M, H, B, dp))
    plan = planner.plan_window(window, par, shape)[0]
    assert name != TILED or {p.chunking for p in plan.pools} == {"tiles"}
    # planners without an M option are priced (and run) with M wherever their tiles' widths allow it
    widths = np.concatenate([p.tiles.head_end - p.tiles.head_start for p in plan.pools])
    chunks = M if np.all(widths % M == 0) else plan.pipeline_chunks
    prof = load_profile("h100-roce-v1")
    priced = CostModel(prof, Topology(prof, par)).chunk_traffic(plan, chunks)
    el = shape.head_dim * shape.dtype_bytes
    seen = 0
    for pool in plan.pools:
        for w in pool.workers:
            prog = compile_worker(pool, shape, w, chunks)
            assert prog.schedule.events == pipeline_events(chunks)
            # relay rounds travel with chunk 0's dispatch and chunk M-1's return
            relay_chunk = {FWD_DISPATCH: 0, BWD_RETURN: chunks - 1}
            for phase in PHASES:
                extra = [sum(r.n_send for r in prog.relays.get(phase, [])), sum(r.n_recv for r in prog.relays.get(phase, []))]
                sent = [(prog.messages[phase][m].n_send + (extra[0] if relay_chunk.get(phase) == m else 0)) * el
                        for m in range(chunks)]
                recv = [(prog.messages[phase][m].n_recv + (extra[1] if relay_chunk.get(phase) == m else 0)) * el
                        for m in range(chunks)]
                assert sent == pytest.approx(priced[phase][0][w].tolist(), abs=1e-6), (phase, w)
                assert recv == pytest.approx(priced[phase][1][w].tolist(), abs=1e-6), (phase, w)
                seen += sum(sent)
    assert (seen > 0) == any(len(p.transfers) > 0 for p in plan.pools)
    relayed = sum(int((p.transfers.hop > 0).sum()) for p in plan.pools)
    # GQA at M = 2: both chunks read each tile's one KV head, so its fan-out may relay (MHA at M = 2
    # reads a different KV head per chunk, M = 3, 4 tiles likewise: nothing may relay there)
    assert not (name == RELAY and (hq, hkv, M) == (8, 2, 2)) or relayed, "the relayed case relays nothing"
