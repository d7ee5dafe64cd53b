"""Cost model on hand-built Plans with hand-computed compute, bytes per link class and overlap."""

import numpy as np
import pytest

from libra.config import ParallelConfig
from libra.plan import KV, O, Plan, PoolPlan, Q, SequenceLayout, TileTable, TransferTable
from libra.sim.cost import CostModel, pipelined_exposed
from libra.sim.profiles import load_profile, profile_from_dict
from libra.sim.topology import Topology
from libra.tap.pipeline import pipeline_events
from libra.workload import AttentionShape, kv_bytes, q_bytes

SHAPE = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=8, dtype_bytes=2)
PAR = ParallelConfig(dp=4, cp=2, gbs=4, seq_len=16)


def toy_profile():
    """2 GPUs per node, 2 nodes per supernode; 1e3 FLOP/ms at any length; 100/50/25 bytes per ms."""
    d = load_profile("h100-roce-v1").to_dict()
    d.update(name="toy", gpus_per_node=2, nodes_per_supernode=2, peak_tflops=1.0)
    d["kernel"] = {"rate_inf_tflops": 1e-6, "half_length": 1e-9, "exponent": 1.0, "launch_ms": 0.0,
                   "reference_heads": 4, "heads_half": 0.0, "backward_time_ratio": 2.0}
    d["links"] = {"nvlink": {"bandwidth_gbps": 1e-4, "latency_ms": 0.0, "port": "nvlink"},
                  "roce": {"bandwidth_gbps": 5e-5, "latency_ms": 0.0, "port": "nic"},
                  "inter_supernode": {"bandwidth_gbps": 2.5e-5, "latency_ms": 0.0, "port": "nic"}}
    return profile_from_dict(d)


def toy_plan(chunks=1):
    """One 16-token sample on workers 0 (tokens 0-8) and 1 (8-16).

    Tile A: rows 0-8, heads 0-4, computed at home (worker 0). Tile B: rows 8-16, heads 0-2 -> worker
    2 (other node, same supernode: RoCE). Tile C: rows 8-16, heads 2-4 -> worker 4 (other supernode).
    """
    seq = SequenceLayout.contiguous(0, 0, [16], cp=2)
    area_a, area_bc = 8 * 9 // 2, (16 * 17 - 8 * 9) // 2  # 36 and 100 pairs per head
    tiles = TileTable(seq=[0, 0, 0], q_start=[0, 8, 8], q_end=[8, 16, 16], head_start=[0, 0, 2],
                      head_end=[4, 2, 4], q_home=[0, 1, 1], dest=[0, 2, 4],
                      flops=[4 * area_a * 4 * 8, 4 * area_bc * 2 * 8, 4 * area_bc * 2 * 8])
    qb = q_bytes(8, 2, 8)          # 256 bytes: 8 tokens x 2 heads x 8 x bf16
    kvb = kv_bytes(8, 1, 8)        # 256 bytes: 8 tokens x 1 KV head x 8 x bf16 x (K, V)
    rows = [  # kind, src, dst, tok_start, tok_end, head_start, head_end, nbytes
        (Q, 1, 2, 8, 16, 0, 2, qb), (KV, 0, 2, 0, 8, 0, 1, kvb), (KV, 1, 2, 8, 16, 0, 1, kvb), (O, 2, 1, 8, 16, 0, 2, qb),
        (Q, 1, 4, 8, 16, 2, 4, qb), (KV, 0, 4, 0, 8, 1, 2, kvb), (KV, 1, 4, 8, 16, 1, 2, kvb), (O, 4, 1, 8, 16, 2, 4, qb),
    ]
    cols = list(zip(*rows))
    transfers = TransferTable(kind=cols[0], src=cols[1], dst=cols[2], seq=[0] * len(rows), tok_start=cols[3],
                              tok_end=cols[4], head_start=cols[5], head_end=cols[6], nbytes=cols[7])
    pool = PoolPlan(0, tuple(range(8)), (seq,), tiles, transfers)
    return Plan("hand", 0, SHAPE, cp=2, pipeline_chunks=chunks, pools=(pool,))


@pytest.fixture(scope="module")
def model():
    prof = toy_profile()
    return CostModel(prof, Topology(prof, PAR))


def test_compute_per_worker(model):
    c = model.price(toy_plan())
    # forward FLOPs / 1e3 FLOP per ms; backward = 2x forward
    assert c.flops_fwd[[0, 2, 4]] == pytest.approx([4608, 6400, 6400])
    assert c.compute_fwd_ms[[0, 2, 4]] == pytest.approx([4.608, 6.4, 6.4], rel=1e-6)
    assert c.compute_ms[[0, 2, 4]] == pytest.approx([13.824, 19.2, 19.2], rel=1e-6)
    assert c.compute_ms[[1, 3, 5, 6, 7]].tolist() == [0] * 5


def test_bytes_per_link_class(model):
    c = model.price(toy_plan())
    # forward: dispatch 3 x 256 to each of w2 (RoCE) and w4 (inter), return 256 each; backward the same
    assert c.total_bytes() == {"nvlink": 0, "roce": 2048, "inter_supernode": 2048}
    assert c.bytes_sent["roce"][[0, 1, 2]].tolist() == [256, 768, 1024]
    assert c.bytes_recv["inter_supernode"][[0, 1, 4]].tolist() == [256, 768, 1024]  # w4: Q, 2 KV, dO


def test_serial_communication_hand_computed(model):
    c = model.price(toy_plan())
    # w1 NIC, per phase: fwd dispatch 512/50 + 512/25 = 30.72; fwd return 256/50 + 256/25 = 15.36;
    # bwd dispatch (dO) 15.36; bwd return (dQ + dK/dV) 512/50 + 512/25 = 30.72
    assert c.comm_ms[[0, 1, 2, 4]] == pytest.approx([30.72, 92.16, 40.96, 81.92], rel=1e-9)
    assert c.exposed_comm_ms == pytest.approx(c.comm_ms)  # M = 1: nothing overlaps
    assert c.total_ms[4] == pytest.approx(19.2 + 81.92, rel=1e-6)
    assert c.straggler_worker == 4 and c.straggler_ms == pytest.approx(101.12, rel=1e-6)
    # perfect balance: 17408 forward FLOPs over 8 workers at the best rate, fwd + bwd
    assert c.balance_bound_ms == pytest.approx(17408 / 8 / 1e3 * 3)
    # the plan's own kernel time spread evenly: (13.824 + 19.2 + 19.2) ms over the 8 pool workers
    assert c.balanced_compute_ms == pytest.approx((13.824 + 19.2 + 19.2) / 8, rel=1e-6)


def test_pipeliner_overlap_hand_computed(model):
    c = model.price(toy_plan(chunks=2))
    # w4 (inter-supernode, 25 B/ms). Both KV heads are first read by chunk 0 and last by chunk 1, so
    # all KV bytes go with chunk 0 and all dK/dV bytes with chunk 1 (the runtime's split).
    # forward: c = 3.2/chunk; dispatch (128 Q + 512 KV)/25 = 25.6 then 128/25 = 5.12; return 5.12 each
    #   D0 [0, 25.6], D1 [25.6, 30.72], C0 [25.6, 28.8], R0 -> 35.84, C1 [30.72, 33.92], R1 -> 40.96
    #   exposed 40.96 - 6.4 = 34.56
    # backward: c = 6.4; dispatch (dO) 5.12 each; return dQ 5.12, then dQ + dK/dV 5.12 + 20.48 = 25.6
    #   D0 [0, 5.12], D1 [5.12, 10.24], C0 [5.12, 11.52], R0 -> 16.64, C1 [11.52, 17.92], R1 -> 43.52
    #   exposed 43.52 - 12.8 = 30.72
    assert c.exposed_comm_ms[4] == pytest.approx(34.56 + 30.72, rel=1e-6)
    assert c.total_ms[4] == pytest.approx(19.2 + 65.28, rel=1e-6)
    assert np.all(c.exposed_comm_ms <= c.exposed_comm_serial_ms + 1e-9)
    assert c.pipeline_chunks == 2
    # an explicit override wins over the plan's M
    assert model.price(toy_plan(chunks=2), pipeline_chunks=1).exposed_comm_ms[4] == pytest.approx(81.92)


def test_exchange_groups_a_return_with_the_dispatch_two_chunks_on(model):
    """Chunk m's return and chunk m + 2's dispatch are one exchange, priced on their summed bytes."""
    seq = SequenceLayout.contiguous(0, 0, [16], cp=2)
    # tile A: rows 0-8 at home (worker 0); tile B: rows 8-16, all 4 heads, worker 1 -> worker 2 (RoCE)
    tiles = TileTable(seq=[0, 0], q_start=[0, 8], q_end=[8, 16], head_start=[0, 0], head_end=[4, 4],
                      q_home=[0, 1], dest=[0, 2], flops=[4 * 36 * 4 * 8, 4 * 100 * 4 * 8])
    qb, kvb = q_bytes(8, 4, 8), kv_bytes(8, 2, 8)  # 512 bytes each
    rows = [(Q, 1, 2, 8, 16, 0, 4, qb), (KV, 0, 2, 0, 8, 0, 2, kvb), (KV, 1, 2, 8, 16, 0, 2, kvb),
            (O, 2, 1, 8, 16, 0, 4, qb)]
    cols = list(zip(*rows))
    transfers = TransferTable(kind=cols[0], src=cols[1], dst=cols[2], seq=[0] * 4, tok_start=cols[3],
                              tok_end=cols[4], head_start=cols[5], head_end=cols[6], nbytes=cols[7])
    plan = Plan("hand", 0, SHAPE, cp=2, pipeline_chunks=4,
                pools=(PoolPlan(0, tuple(range(8)), (seq,), tiles, transfers),))
    c = model.price(plan)
    # worker 1 (Q-home of tile B, computes nothing; RoCE 50 B/ms). M = 4: one query head per chunk;
    # KV head 0 goes with chunk 0 (its dK/dV back after chunk 1), KV head 1 with chunk 2 (after 3).
    # forward: D0 = (128 Q + 256 KV) / 50 = 7.68, D1 = 2.56; return 128 O each: 2.56
    #   exchange 0 = R0 + D2: sends 384, receives 128 -> 7.68 (back to back: 10.24)
    #   exchange 1 = R1 + D3: 128 each way -> 2.56
    #   D0 -> 7.68, D1 -> 10.24, X0 -> 17.92, X1 -> 20.48, R2 -> 23.04, R3 -> 25.6
    # backward: dO 128 per chunk: 2.56; R0 = 2.56 (dQ), R1 = (128 dQ + 256 dK/dV) / 50 = 7.68, R2, R3 alike
    #   X0 = R0 + D2: 128 each way -> 2.56; X1 = R1 + D3: receives 384, sends 128 -> 7.68
    #   D0 -> 2.56, D1 -> 5.12, X0 -> 7.68, X1 -> 15.36, R2 -> 17.92, R3 -> 25.6
    assert c.exposed_comm_ms[1] == pytest.approx(25.6 + 25.6, rel=1e-9)
    # with no overlap at all the four phases take (1024 + 512 + 512 + 1024) / 50
    assert c.comm_ms[1] == pytest.approx(61.44, rel=1e-9)


def _exposed(compute, dispatch, ret, chunks):
    """Whole-pass times split evenly over ``chunks`` and walked through the Pipeliner's events."""
    d = np.full((1, chunks), dispatch / chunks)
    r = np.full((1, chunks), ret / chunks)
    return pipelined_exposed(pipeline_events(chunks), np.array([compute / chunks]), d, r)


def test_overlap_formula_when_compute_covers_transfers():
    # only chunk 0's dispatch and chunk M-1's return are exposed: (D + R) / M
    assert _exposed(100.0, 8.0, 4.0, 4) == pytest.approx([3.0])
    assert _exposed(100.0, 8.0, 4.0, 1) == pytest.approx([12.0])
    # transfer-bound: everything but the overlapped compute is exposed (one FIFO comm stream)
    assert _exposed(1.0, 8.0, 4.0, 4) == pytest.approx([11.0])
    assert _exposed(0.0, 8.0, 4.0, 4) == pytest.approx([12.0])
    with pytest.raises(ValueError, match="positive integer"):
        pipeline_events(0)


def test_exchange_time_replaces_the_back_to_back_pair():
    d, r = np.full((1, 4), 2.0), np.full((1, 4), 1.0)
    # transfer-bound (no compute): back to back every byte is exposed; an exchange of 2 instead of 3
    assert pipelined_exposed(pipeline_events(4), np.array([0.0]), d, r) == pytest.approx([12.0])
    assert pipelined_exposed(pipeline_events(4), np.array([0.0]), d, r, np.full((1, 4), 2.0)) == pytest.approx([10.0])


def test_uneven_chunks_price_each_chunk_own_bytes():
    # all dispatch bytes in chunk 0 (e.g. every KV head first read by chunk 0): nothing to overlap it with
    d = np.array([[8.0, 0.0, 0.0, 0.0]])
    r = np.zeros((1, 4))
    assert pipelined_exposed(pipeline_events(4), np.array([25.0]), d, r) == pytest.approx([8.0])
    # the same bytes spread evenly: only chunk 0's quarter is exposed
    assert pipelined_exposed(pipeline_events(4), np.array([25.0]), np.full((1, 4), 2.0), r) == pytest.approx([2.0])


def test_placement_split_into_plan_and_device_speed(model):
    plain = model.price(toy_plan()).placement_split()
    assert plain["device"] == 1.0
    # straggler w4 computes 19.2 ms of its pool's 52.224 over 8 workers at speed 1
    assert plain["plan"] == pytest.approx(19.2 / (52.224 / 8), rel=1e-9)
    speed = np.ones(8)
    speed[4] = 0.8  # the straggler runs slower: its compute 24 ms, the pool mean (52.224 + 4.8) / 8
    c = model.price(toy_plan(), speed=speed)
    split = c.placement_split()
    assert split["plan"] == pytest.approx(plain["plan"], rel=1e-12)
    assert split["device"] == pytest.approx((24.0 / ((52.224 + 4.8) / 8)) / plain["plan"], rel=1e-9)
    assert split["plan"] * split["device"] == pytest.approx(c.loss_factors()["placement"], rel=1e-12)


def test_speed_divides_compute(model):
    speed = np.ones(8)
    speed[2] = 0.5
    c = model.price(toy_plan(), speed=speed)
    assert c.compute_ms[2] == pytest.approx(38.4, rel=1e-6)
    with pytest.raises(ValueError, match="speed must be 8 finite multipliers"):
        model.price(toy_plan(), speed=np.ones(3))
    with pytest.raises(ValueError, match="speed must be"):
        model.price(toy_plan(), speed=-np.ones(8))


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="Pipeliner chunks M must be a positive integer"):
        model.price(toy_plan(), pipeline_chunks=0)
    with pytest.raises(ValueError, match="M=3 must divide every tile's head width"):
        model.price(toy_plan(), pipeline_chunks=3)
    small = Topology(toy_profile(), ParallelConfig(dp=2, cp=2, gbs=2, seq_len=16))
    with pytest.raises(ValueError, match="worker id 4 outside"):
        CostModel(small.profile, small).price(toy_plan())
    with pytest.raises(ValueError, match="topology was built for profile"):
        CostModel(load_profile("h100-roce-v1"), small)


def test_default_profile_short_segments_cost_more_per_flop():
    """Same FLOPs, one long sample vs many 1K samples: the long one prices faster (Fig. 5 / DESIGN 5)."""
    prof = load_profile("h100-roce-v1")
    model = CostModel(prof, Topology(prof, ParallelConfig(dp=1, cp=1, gbs=1, seq_len=32768)))
    shape = AttentionShape(32, 4, 128, 2)

    def one_worker_plan(lengths):
        seq = SequenceLayout.contiguous(0, 0, lengths, cp=1)
        tiles = TileTable(seq=[0], q_start=[0], q_end=[seq.num_tokens], head_start=[0], head_end=[32],
                          q_home=[0], dest=[0], flops=[0.0])
        pool = PoolPlan(0, (0,), (seq,), tiles, TransferTable.empty())
        return Plan("one", 0, shape, cp=1, pipeline_chunks=1, pools=(pool,))

    long_ = model.price(one_worker_plan([32768]))
    short = model.price(one_worker_plan([1024] * 32))
    rate_long = long_.flops_fwd[0] / long_.compute_fwd_ms[0]
    rate_short = short.flops_fwd[0] / short.compute_fwd_ms[0]
    assert rate_long > 2 * rate_short
    assert long_.exposed_comm_ms[0] == 0.0
