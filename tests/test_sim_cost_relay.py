"""Cost model on KV relays (:mod:`libra.extensions.adaptive.relay`): hop rounds priced as per-worker dataflow
in chunk 0's forward dispatch and chunk M-1's backward return, on a hand-built fan-out and a real plan."""

from dataclasses import replace

import numpy as np
import pytest

from experiments.common.sim_common import SETTINGS, build_cost_model, load_windows, make_planner, make_shape
from libra.config import ParallelConfig
from libra.extensions.adaptive.relay import relay_pool, relay_transfers
from libra.plan import KV, O, Plan, PlanValidationError, PoolPlan, Q, SequenceLayout, TileTable, TransferTable
from libra.plan.layout import tile_flops
from libra.sim.cost import CostModel
from libra.sim.profiles import load_profile, profile_from_dict
from libra.sim.topology import Topology
from libra.tap.pipeline import BWD_RETURN, FWD_DISPATCH, ChunkSchedule
from libra.workload import AttentionShape, kv_bytes, q_bytes

SHAPE = AttentionShape(num_q_heads=8, num_kv_heads=1, head_dim=8, dtype_bytes=2)
PAR = ParallelConfig(dp=1, cp=4, gbs=1, seq_len=8)
BW, LAT = 100.0, 0.5  # NVLink bytes per ms and latency of the toy profile
QB, KVB = q_bytes(8, 2, 8), kv_bytes(8, 1, 8)  # a tile's Q (2 query heads) and its KV payload
B = KVB // 8  # K + V bytes of one token of the payload


def toy_profile():
    """4 GPUs on one node (every transfer on NVLink, 100 bytes/ms, 0.5 ms latency); 1e3 FLOP/ms."""
    d = load_profile("h100-roce-v1").to_dict()
    d.update(name="toy-relay", gpus_per_node=4, nodes_per_supernode=1, peak_tflops=1.0)
    d["kernel"] = {"rate_inf_tflops": 1e-6, "half_length": 1e-9, "exponent": 1.0, "launch_ms": 0.0,
                   "reference_heads": 4, "heads_half": 0.0, "backward_time_ratio": 2.0}
    d["links"] = {"nvlink": {"bandwidth_gbps": BW * 1e-6, "latency_ms": LAT, "port": "nvlink"},
                  "roce": {"bandwidth_gbps": 5e-5, "latency_ms": 0.0, "port": "nic"},
                  "inter_supernode": {"bandwidth_gbps": 2.5e-5, "latency_ms": 0.0, "port": "nic"}}
    return profile_from_dict(d)


def fan_out_plan(chunks: int, relayed: bool, chunking: str = "heads") -> Plan:
    """One 8-token sample held by worker 0; tile i (rows 0-8, query heads [2i, 2i+2)) runs on worker i,
    so the holder sends Q and the one KV head (a KV payload) to each of workers 1, 2, 3. Relayed
    (:func:`relay_transfers`): hop 0 scatters tokens [0, 2), [2, 5), [5, 8) to workers 1, 2, 3; in hop
    1 each sends its piece to the other two."""
    seq = SequenceLayout(0, 0, [8], [0], [8], [0])
    dest = np.arange(4)
    tiles = TileTable(seq=[0] * 4, q_start=[0] * 4, q_end=[8] * 4, head_start=2 * dest, head_end=2 * dest + 2,
                      q_home=[0] * 4, dest=dest, flops=tile_flops(seq, [0] * 4, [8] * 4, [2] * 4, 8))
    rows = [(kind, src, dst, 2 * d if kind != KV else 0, 2 * d + 2 if kind != KV else 1, QB if kind != KV else KVB)
            for d in (1, 2, 3) for kind, src, dst in ((Q, 0, d), (KV, 0, d), (O, d, 0))]
    cols = list(zip(*rows))
    transfers = TransferTable(kind=cols[0], src=cols[1], dst=cols[2], seq=[0] * 9, tok_start=[0] * 9,
                              tok_end=[8] * 9, head_start=cols[3], head_end=cols[4], nbytes=cols[5])
    if relayed:
        transfers = relay_transfers(transfers, np.ones(SHAPE.num_kv_heads, dtype=bool))
    pool = PoolPlan(0, (0, 1, 2, 3), (seq,), tiles, transfers, chunking=chunking)
    return Plan("hand", 0, SHAPE, cp=4, pipeline_chunks=chunks, pools=(pool,)).validate()


@pytest.fixture(scope="module")
def model():
    prof = toy_profile()
    return CostModel(prof, Topology(prof, PAR))


def _per_chunk(model, plan):
    """``{phase: (N, M)}`` chunk times and the ``(N,)`` serial comm time, as price() uses them."""
    *_, serial, per_chunk = model._phases(plan, model._schedules(plan, plan.pipeline_chunks))
    return serial, per_chunk


def test_relay_broadcast_is_the_documented_one():
    x = fan_out_plan(1, relayed=True).pools[0].transfers
    kv = x.kind == KV
    got = list(zip(x.src[kv].tolist(), x.dst[kv].tolist(), x.tok_start[kv].tolist(), x.tok_end[kv].tolist(),
                   x.hop[kv].tolist()))
    assert got == [(0, 1, 0, 2, 0), (0, 2, 2, 5, 0), (0, 3, 5, 8, 0),
                   (1, 2, 0, 2, 1), (1, 3, 0, 2, 1), (2, 1, 2, 5, 1), (2, 3, 2, 5, 1), (3, 1, 5, 8, 1), (3, 2, 5, 8, 1)]
    assert (x.hop[~kv] == 0).all() and x.nbytes[kv].tolist() == [B * n for n in (2, 3, 3, 2, 2, 3, 3, 3, 3)]


@pytest.mark.parametrize("chunks", [1, 2])
def test_fan_out_hand_computed(model, chunks):
    q = QB / chunks  # each chunk carries 1/M of every Q (and dQ) row; the KV heads travel whole
    _, direct = _per_chunk(model, fan_out_plan(chunks, relayed=False))
    serial, relay = _per_chunk(model, fan_out_plan(chunks, relayed=True))
    # direct: the holder's port moves 3 Q pieces and 3 KV payloads, one latency
    assert direct[FWD_DISPATCH][0, 0] == pytest.approx((3 * q + 3 * KVB) / BW + LAT)
    assert direct[BWD_RETURN][0, -1] == pytest.approx((3 * q + 3 * KVB) / BW + LAT)
    # relayed, forward chunk 0: hop 0 the holder sends the Q pieces and the payload once (2 + 3 + 3
    # tokens); hop 1 every member sends 2 copies of its piece and receives the other two pieces
    # (port: 6 tokens on workers 1-3), starting when its senders finished hop 0 (worker 1 waits for 2, 3)
    fwd = [(3 * q + 8 * B) / BW + LAT] + [(q + 9 * B) / BW + 2 * LAT] * 3
    assert relay[FWD_DISPATCH][:, 0] == pytest.approx(fwd)
    # backward chunk M-1: hop 1's dK/dV go back first (6 tokens on each member's port), then hop 0 to
    # the holder with the dQ, which the holder waits for
    bwd = [(3 * q + 14 * B) / BW + 2 * LAT, (q + 8 * B) / BW + 2 * LAT,
           (q + 9 * B) / BW + 2 * LAT, (q + 9 * B) / BW + 2 * LAT]
    assert relay[BWD_RETURN][:, -1] == pytest.approx(bwd)
    assert max(fwd) < direct[FWD_DISPATCH][0, 0]
    # the chunks without KV are priced as before
    for phase in direct:
        cols = [m for m in range(chunks) if (phase, m) not in ((FWD_DISPATCH, 0), (BWD_RETURN, chunks - 1))]
        np.testing.assert_array_equal(relay[phase][:, cols], direct[phase][:, cols])
    # the serial figure runs the same rounds over whole rows: 2 relayed phases + 2 direct phases
    relayed = [(3 * QB + KVB) / BW + LAT, (3 * QB + KVB + 6 * B) / BW + 2 * LAT]  # forward, backward
    assert serial[0] == pytest.approx(sum(relayed) + 2 * (3 * QB / BW + LAT))


def test_one_chunk_exposed_equals_serial(model):
    c = model.price(fan_out_plan(1, relayed=True))
    np.testing.assert_allclose(c.exposed_comm_ms, c.exposed_comm_serial_ms, rtol=1e-12)
    assert c.exposed_comm_ms[0] < model.price(fan_out_plan(1, relayed=False)).exposed_comm_ms[0]


def _sent_recv(cost):
    return (sum(cost.bytes_sent[c] for c in cost.bytes_sent), sum(cost.bytes_recv[c] for c in cost.bytes_recv))


def _src_shift(direct: Plan, relayed: Plan, n: int) -> np.ndarray:
    """Per worker, bytes of the KV rows it sends after relaying minus before: each row's src sends
    it forward and receives its dK/dV backward, so sent and received both move by this (every
    destination receives the same KV bytes either way)."""
    out = np.zeros(n)
    for a, b in zip(direct.pools, relayed.pools):
        for sign, x in ((-1.0, a.transfers), (1.0, b.transfers)):
            kv = x.kind == KV
            out += sign * np.bincount(x.src[kv], x.nbytes[kv].astype(np.float64), n)
    return out


def _check_bytes_moved(model, direct: Plan, relayed: Plan, chunks=None):
    a, b = model.price(direct, chunks), model.price(relayed, chunks)
    assert sum(b.total_bytes().values()) == sum(a.total_bytes().values())
    shift = _src_shift(direct, relayed, model.topology.num_workers)
    for before, after in zip(_sent_recv(a), _sent_recv(b)):
        np.testing.assert_array_equal(after - before, shift)
    return b


def test_relays_only_move_sends_from_holders(model):
    direct, relayed = fan_out_plan(2, relayed=False), fan_out_plan(2, relayed=True)
    _check_bytes_moved(model, direct, relayed)
    assert _src_shift(direct, relayed, 4).tolist() == [-2 * KVB, 4 * B, 6 * B, 6 * B]  # each member: 2 copies of its piece


def test_relay_in_tile_chunked_pool_is_rejected(model):
    with pytest.raises(PlanValidationError, match="head chunks"):
        model.price(fan_out_plan(2, relayed=True, chunking="tiles"))
    model.price(fan_out_plan(2, relayed=False, chunking="tiles"))  # no relay row: priced as before


# -- a real plan: Libra (full) on a libra-prod window at 256K ---------------------------------------
@pytest.fixture(scope="module")
def real():
    setting = SETTINGS["256k"]
    window = load_windows("libra-prod", setting, 1, 0)[0]
    model = build_cost_model(load_profile("h100-roce-v1"), setting.par())
    return setting, window, model


def _relayed(plan: Plan, chunks: int) -> Plan:
    pools = tuple(relay_pool(p, ChunkSchedule.for_pool(p, plan.shape, chunks)) for p in plan.pools)
    return replace(plan, pipeline_chunks=chunks, pools=pools)


@pytest.mark.parametrize("kv_heads,chunks", [(4, 1), (2, 4)])
def test_real_plan_relayed(real, kv_heads, chunks):
    """8 query heads per KV head: only M = 1 relays (a KV head is read by chunks 0-1 of 4); 16: any M."""
    setting, window, model = real
    shape = make_shape(32, kv_heads, 128)
    plan = replace(make_planner("libra", setting).plan_window(window, setting.par(), shape)[0], pipeline_chunks=chunks)
    relayed = _relayed(plan, chunks).validate()
    assert max(int(p.transfers.hop.max()) for p in relayed.pools) == 1
    cost = _check_bytes_moved(model, plan, relayed)
    assert np.all(np.isfinite(cost.exposed_comm_ms)) and np.all(cost.exposed_comm_ms >= 0)
    if chunks == 1:
        np.testing.assert_allclose(cost.exposed_comm_ms, cost.exposed_comm_serial_ms, rtol=1e-12)
        with pytest.raises(PlanValidationError, match="relay transfer"):
            model.price(relayed, 4)  # relayed KV heads that chunk 0 does not read in full


@pytest.mark.parametrize("variant,kv_heads,chunks", [("heads", 4, 1), ("heads", 4, 2), ("relayed", 4, 1),
                                                     ("relayed", 2, 4), ("tiles", 4, 2)])
def test_total_ms_is_price_total(real, variant, kv_heads, chunks):
    """CostModel.total_ms (what libra-adaptive compares) equals price().total_ms bit for bit, for
    head-chunked, relayed (forward and backward relay columns at M = 4) and tile-chunked pools,
    with per-worker speeds."""
    setting, window, model = real
    shape = make_shape(32, kv_heads, 128)
    plan = replace(make_planner("libra", setting).plan_window(window, setting.par(), shape)[0], pipeline_chunks=chunks)
    if variant == "relayed":
        plan = _relayed(plan, chunks)
    elif variant == "tiles":
        plan = replace(plan, pools=tuple(replace(p, chunking="tiles") for p in plan.pools))
    speed = np.random.default_rng(3).uniform(0.8, 1.2, model.topology.num_workers)
    priced = model.price(plan, speed=speed)
    want = priced.total_ms
    assert np.array_equal(model.total_ms(plan, speed=speed), want)
    # straggler_ms: the same straggler, or with a cutoff below the compute bound that bound (> cutoff,
    # <= the straggler) and no communication priced
    assert model.straggler_ms(plan, speed=speed) == want.max()
    bound = priced.compute_ms.max()
    assert bound < want.max()
    assert model.straggler_ms(plan, speed=speed, cutoff=bound * 0.999) == bound
    assert model.straggler_ms(plan, speed=speed, cutoff=bound) == want.max()  # not above: priced in full
    # worker_ms: price()'s compute and exposed communication per worker, or no exposure above the cutoff
    compute, exposed = model.worker_ms(plan, speed=speed)
    assert np.array_equal(compute, priced.compute_ms) and np.array_equal(exposed, priced.exposed_comm_ms)
    compute, exposed = model.worker_ms(plan, speed=speed, cutoff=bound * 0.999)
    assert np.array_equal(compute, priced.compute_ms) and exposed is None


@pytest.mark.parametrize("method", ["wlb-llm", "ulysses", "libra"])
def test_pair_routes_price_bit_for_bit_as_rows(real, method, monkeypatch):
    """Summing a phase's routes per worker pair (one chunk, integer bytes) changes no PlanCost field:
    forced on every phase (threshold 0) against never (threshold above any phase)."""
    import libra.sim.cost as cost_module

    setting, window, model = real
    shape = make_shape(32, 4, 128)
    plans = make_planner(method, setting).plan_window(window, setting.par(), shape)[:2]
    speed = np.random.default_rng(5).uniform(0.8, 1.2, model.topology.num_workers)

    def priced(threshold):
        monkeypatch.setattr(cost_module, "PAIR_ROUTES_MIN_ROWS", threshold)
        return [model.price(p, speed=speed) for p in plans]

    rows, pairs = priced(10**12), priced(0)
    for a, b in zip(rows, pairs):
        for f in a.__dataclass_fields__:
            x, y = getattr(a, f), getattr(b, f)
            same = all(np.array_equal(x[c], y[c]) for c in x) if isinstance(x, dict) else np.array_equal(x, y)
            assert same, f
    r = cost_module.Routes(np.arange(3), np.zeros(3, np.int8), np.array([0, 0, 1]), np.array([1, 1, 0]),
                           np.array([[1.0], [2.0], [4.0]]))
    monkeypatch.setattr(cost_module, "PAIR_ROUTES_MIN_ROWS", 0)
    got = cost_module._pair_routes(r, 2)
    assert got.src.tolist() == [0, 1] and got.dst.tolist() == [1, 0] and got.nbytes[:, 0].tolist() == [3.0, 4.0]
    for kept in (r._replace(nbytes=np.array([[1.5], [2.0], [4.0]])),   # fractional bytes: row order matters
                 r._replace(nbytes=np.ones((3, 2)))):                   # M = 2: per-chunk columns
        assert cost_module._pair_routes(kept, 2) is kept
