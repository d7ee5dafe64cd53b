"""Multi-process (gloo) parity of libra_attention and the Ulysses runtime against a float64
single-process reference over the full packed sequences, forward and q/k/v gradients.

Each spawn groups many checks (spawning costs seconds): several (B, H, M), GQA shapes, p2p and
all-to-all exchange, float64 (tight) and float32/bf16 (FlashAttention's rule: error vs the float64
reference at most 2x (outputs) / 3x (gradients) that of plain PyTorch at the same precision).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from dist_utils import full_tensors, long_tail_lengths, max_err, reference_grads, run_ranks

from libra.sim.profiles import load_profile

pytestmark = pytest.mark.distributed

F64_TOL = 1e-10
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


def _window(dp: int, seq_len: int, seed: int):
    from libra.data.packing import PackedSequence  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    out = []
    for i in range(dp):
        # alternate heavy (few long samples) and light (many short) sequences: cross-group skew
        scale = 120.0 if i % 2 == 0 else 6.0
        lengths = long_tail_lengths(rng, seq_len, scale=scale)
        out.append(PackedSequence(i, lengths, np.arange(len(lengths))))
    return out


def _plan(case, dp, cp, seq_len, seed):
    from baselines.registry import get_planner, planner_class  # noqa: PLC0415
    from libra.config import ParallelConfig  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    shape = AttentionShape(case["hq"], case["hkv"], case["d"], 8)
    par = ParallelConfig(dp=dp, cp=cp, gbs=dp, seq_len=seq_len)
    name = case.get("planner", "libra")
    layout = {"pool_size": case["P"], "block_size": case["B"], "head_split": case["H"], "pipeline_chunks": case["M"]}
    takes = planner_class(name).option_names()  # DistCA and dynamic CP take only M of the TAP layout
    planner = get_planner(name, **{k: v for k, v in layout.items() if k in takes}, **case.get("options", {}))
    window = _window(dp, seq_len, seed) if "lengths" not in case else _explicit_window(case["lengths"], dp)
    return planner.plan_window(window, par, shape)[0].validate(), window, shape


def _explicit_window(lengths, dp: int):
    from libra.data.packing import PackedSequence  # noqa: PLC0415

    return [PackedSequence(i, lengths[i % len(lengths)], np.arange(len(lengths[i % len(lengths)]))) for i in range(dp)]


def _local(full, ranges):
    return [torch.cat([full[s][i][a:b] for s, a, b in ranges]) for i in range(4)]


def _moved_across_groups(plan, cp) -> int:
    return int(sum(np.sum(p.tiles.dest // cp != p.tiles.q_home // cp) for p in plan.pools))


def _kv_across_groups(plan, cp) -> int:
    from libra.plan import KV  # noqa: PLC0415

    return int(sum(np.sum((p.transfers.kind == KV) & (p.transfers.src // cp != p.transfers.dst // cp))
                   for p in plan.pools))


def _libra_case(rank, groups, case, dp, cp, seq_len, seed, dtypes):
    from libra.runtime.attention import prepare  # noqa: PLC0415

    plan, window, shape = _plan(case, dp, cp, seq_len, seed)
    pool = plan.pool_of_worker(groups.pool.worker)
    attn = prepare(plan, groups.pool, comm=case["comm"])
    ranges = [(pool.sequences[s].seq_id, a, b) for s, a, b in attn.program.local_ranges]
    lengths = {s.seq_id: s.sample_lengths for s in pool.sequences}
    # a planner that repacks the samples (dynamic CP) computes its own sequences: the data follows them
    packed = [s for p in plan.pools for s in p.sequences] if case.get("at_home") else window
    full = {w.seq_id: t for w, t in zip(packed, full_tensors([w.sample_lengths for w in packed], shape, seed))}
    res = {"moved": _moved_across_groups(plan, cp), "kv_across": _kv_across_groups(plan, cp), "tiles": int(sum(len(p.tiles) for p in plan.pools)),
           "chunkings": sorted({p.chunking for p in plan.pools}),
           "relayed": int(sum((p.transfers.hop > 0).sum() for p in plan.pools)),
           "rebalanced": sum("+rebalanced" in c for c in plan.meta.get("adaptive_choice", ())),
           "off_block": int(sum(np.sum((p.tiles.q_end - p.tiles.q_start) % case["B"] != 0) for p in plan.pools)),
           "my_relay_rounds": attn.program.hops, "chunks": attn.program.chunks}
    refs = {s: reference_grads(*full[s], lengths[s]) for s, _, _ in ranges}
    ref = [torch.cat([refs[s][i][a:b] for s, a, b in ranges]) for i in range(4)]
    for dtype in dtypes:
        q, k, v, do = (x.to(dtype).requires_grad_(i < 3) for i, x in enumerate(_local(full, ranges)))
        out = attn(q, k, v)
        out.backward(do)
        errs = {n: max_err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref)}
        entry = {"libra": errs}
        if dtype != torch.float64:  # plain PyTorch at the same precision, on the same rows
            plain = {s: reference_grads(*(x.to(dtype) for x in full[s]), lengths[s]) for s, _, _ in ranges}
            got = [torch.cat([plain[s][i][a:b] for s, a, b in ranges]) for i in range(4)]
            entry["plain"] = {n: max_err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
        res[str(dtype)] = entry
    st = attn.stats
    res["peak_transient_bytes"], res["unreleased_bytes"] = st.peak_transient_bytes, st.unreleased_bytes
    # the host time split (sim-check's exposed parts): each part inside the calls' wall time
    res["time_split"] = {"parts": st.compute_s + st.comm_wait_s + st.issue_s + st.unpack_s,
                         "calls": st.forward_s + st.backward_s, "issue": st.issue_s, "sent": sum(st.sent_bytes.values())}
    return res


def _ulysses_case(rank, groups, case, dp, cp, seq_len, seed, dtypes):
    from baselines.ulysses_runtime import UlyssesAttention  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    shape = AttentionShape(case["hq"], case["hkv"], case["d"], 8)
    window = _window(dp, seq_len, seed)
    dp_rank, cp_rank = divmod(groups.cp.worker, cp)
    seq = window[dp_rank]
    full = full_tensors([seq.sample_lengths], shape, seed)[0]
    n = seq_len // cp
    ranges = [(0, cp_rank * n, (cp_rank + 1) * n)]
    ref_full = reference_grads(*full, seq.sample_lengths)
    ref = [x[cp_rank * n:(cp_rank + 1) * n] for x in ref_full]
    attn = UlyssesAttention(seq.sample_lengths, groups.cp, shape.num_q_heads, shape.num_kv_heads)
    res = {}
    for dtype in dtypes:
        q, k, v, do = (x[ranges[0][1]:ranges[0][2]].to(dtype).requires_grad_(i < 3) for i, x in enumerate(full))
        out = attn(q, k, v)
        out.backward(do)
        errs = {nm: max_err(a, b) for nm, a, b in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref)}
        entry = {"ulysses": errs}
        if dtype != torch.float64:
            got = reference_grads(*(x.to(dtype) for x in full), seq.sample_lengths)
            entry["plain"] = {nm: max_err(a[cp_rank * n:(cp_rank + 1) * n], b)
                              for nm, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
        res[str(dtype)] = entry
    res["peak_transient_bytes"] = attn.stats["peak_transient_bytes"]
    return res


def _parity_rank(rank, world, grids, cases, seq_len, seed):
    from libra.runtime.groups import RankGrid, build_groups  # noqa: PLC0415

    out = []
    for dp, cp, pool_size in grids:
        groups = build_groups(RankGrid(dp=dp, cp=cp, pool_size=pool_size), timeout_s=60)
        for case in cases:
            case = {**case, "P": pool_size}
            dtypes = [getattr(torch, n) for n in case["dtypes"]]
            if case.get("method") == "ulysses":
                r = _ulysses_case(rank, groups, case, dp, cp, seq_len, seed, dtypes)
            else:
                r = _libra_case(rank, groups, case, dp, cp, seq_len, seed, dtypes)
            out.append(({"grid": (dp, cp, pool_size), **case}, r))
    return out


def _assert_results(results):
    for rank_res in results:
        for case, res in rank_res:
            for key, entry in res.items():
                if not key.startswith("torch."):
                    continue
                got = entry.get("libra", entry.get("ulysses"))
                if key == "torch.float64":
                    for name, err in got.items():
                        assert err < F64_TOL, f"{case}: float64 {name} error {err:.3g}"
                else:
                    floor = FLOOR[getattr(torch, key.split(".")[1])]
                    for name, err in got.items():
                        factor = 2.0 if name == "out" else 3.0
                        bound = factor * entry["plain"][name] + floor
                        assert err <= bound, f"{case}: {key} {name} error {err:.3g} > {bound:.3g} (plain {entry['plain'][name]:.3g})"
            if case.get("method") != "ulysses":
                assert res["unreleased_bytes"] == 0, f"{case}: transient buffers outlived the call"
                assert res["peak_transient_bytes"] > 0
                split = res["time_split"]
                assert 0 < split["parts"] <= split["calls"], f"{case}: host time parts exceed the calls: {split}"
                assert split["issue"] > 0 or split["sent"] == 0, f"{case}: messages sent in no issue time: {split}"
                if case.get("at_home"):  # dynamic CP computes every chunk where it lives; its groups span CP groups
                    assert res["moved"] == 0 and res["kv_across"] > 0, f"{case}: no KV crossed the static CP groups"
                else:
                    assert res["moved"] > 0, f"{case}: no tile moved across CP groups; the test would not exercise pooling"
            if case.get("split"):
                assert res["off_block"] > 0, f"{case}: no tile was cut; the test would not exercise split tiles"
            if "fine-retain-link-relay" in case.get("options", {}).get("candidates", ()):
                assert res["relayed"] > 0, f"{case}: no KV relay row; the test would not exercise relays"
            if case.get("deepened"):  # libra-adaptive's deeper Pipeliner (DEEPER_CHUNKS x the layout's M)
                assert res["chunks"] > case["M"], f"{case}: the plan runs the layout's M; the test would not exercise it"
            if case.get("rebalanced") == case["grid"]:
                assert res["rebalanced"] > 0, f"{case}: no pool re-placed for its exposed communication"
            pinned = case.get("options", {}).get("chunkings")
            if pinned:
                assert res["chunkings"] == sorted(pinned), f"{case}: ran {res['chunkings']} chunking"


BASE = {"hq": 8, "hkv": 2, "d": 16}
TWO_GPU_NODES = replace(load_profile("h100-roce-v1"), name="h100-roce-2gpu-nodes", gpus_per_node=2)
# kernel time proportional to FLOPs (no short-segment penalty, no launch cost): at these toy sizes the
# default kernel curve makes every tile cost about the same, so no tile would be heavy
# the length-curve profile, whose placement of these toy pools fans KV out for relays to carry
CURVE = "h100-roce-v1"
FLOPS_KERNEL = replace(load_profile("h100-roce-v1"), name="h100-roce-flops-kernel",
                       kernel=replace(load_profile("h100-roce-v1").kernel, half_length=1e-9, launch_ms=0.0,
                                      heads_half=0.0))
CASES_4 = [
    {**BASE, "B": 32, "H": 2, "M": 2, "comm": "p2p", "dtypes": ["float64", "float32", "bfloat16"]},
    {**BASE, "B": 64, "H": 1, "M": 4, "comm": "a2a", "dtypes": ["float64"]},
    {**BASE, "B": 32, "H": 4, "M": 2, "comm": "p2p", "dtypes": ["float64"]},
    {"hq": 4, "hkv": 4, "d": 8, "B": 16, "H": 2, "M": 1, "comm": "p2p", "dtypes": ["float64"]},
    # GQA groups of 3 straddling chunks of 2 heads unevenly: the per-query-head KV expansion path
    {"hq": 12, "hkv": 4, "d": 8, "B": 32, "H": 3, "M": 2, "comm": "p2p", "dtypes": ["float64"]},
    {**BASE, "method": "ulysses", "dtypes": ["float64", "float32", "bfloat16"]},
    # libra-adaptive: one KV head's query heads per tile, placed in the Q-home retention
    # order (pinned candidate: the cost model would often pick the paper's plan at this size)
    {**BASE, "planner": "libra-adaptive", "options": {"candidates": ("fine-retain",)},
     "B": 32, "H": 1, "M": 2, "comm": "p2p", "dtypes": ["float64", "bfloat16"]},
    # tile-grouped Pipeliner chunks (libra.extensions.adaptive.tile_chunks): whole tiles per chunk, KV rows cut by
    # the first chunk that reads each token and dK/dV by the last
    {**BASE, "planner": "libra-adaptive", "options": {"candidates": ("fine-retain",), "chunkings": ("tiles",)},
     "B": 32, "H": 1, "M": 4, "comm": "p2p", "dtypes": ["float64", "bfloat16"]},
    # KV relays (libra.extensions.adaptive.relay): destinations forward the KV they fetched, dK/dV summed back
    {**BASE, "planner": "libra-adaptive", "options": {"candidates": ("fine-retain-link-relay",), "profile": CURVE},
     "B": 16, "H": 1, "M": 1, "comm": "a2a", "dtypes": ["float64", "bfloat16"]},
    # one 256-token sample beside short ones: its last tiles outweigh a worker's mean and are cut into
    # token ranges that are not whole blocks (libra.extensions.adaptive.candidates.split_heavy_tiles); relayed and not;
    # run with the deeper Pipeliner (M = 4 for the layout's 2: libra.extensions.adaptive.planner.DEEPER_CHUNKS)
    {**BASE, "planner": "libra-adaptive", "options": {"candidates": ("fine-retain-link",), "profile": FLOPS_KERNEL},
     "split": True, "deepened": True, "lengths": [[256], [8] * 32], "B": 128, "H": 1, "M": 2, "comm": "a2a", "dtypes": ["float64"]},
    # DistCA's own planner: head/tail-pair layout, deficits filled by token pairs (B and H unused)
    {**BASE, "planner": "distca", "B": 32, "H": 1, "M": 2, "comm": "p2p", "dtypes": ["float64", "bfloat16"]},
    {**BASE, "planner": "distca", "options": {"nano_batches": 2, "tolerance": 0.0}, "B": 32, "H": 1, "M": 1,
     "comm": "a2a", "dtypes": ["float64"]},
    # Megatron's dynamic CP at 64 tokens per rank: a 200-token sample on a CP group of all 4 ranks (both
    # static CP groups), the next microbatches' on smaller ones; chunks computed at home, KV fetched in groups
    {**BASE, "planner": "dynamic-cp", "options": {"max_seqlen_per_rank": 64}, "at_home": True, "lengths": [[8, 8, 200, 40], [8] * 32], "B": 32, "H": 1,
     "M": 2, "comm": "p2p", "dtypes": ["float64", "float32"]},
]


def test_parity_smoke_two_ranks(tmp_path):
    """The fast tier's one multi-process check: libra_attention on one pool of two gloo ranks (DP 2,
    CP 1), output and q/k/v gradients, float64 against the reference and bf16 within FlashAttention's
    rule; the grids and cases below run in the slow tier."""
    case = {**BASE, "B": 32, "H": 2, "M": 2, "comm": "p2p", "dtypes": ["float64", "bfloat16"]}
    results = run_ranks(_parity_rank, 2, tmp_path, [(2, 1, 2)], [case], 256, 7, deadline_s=120)
    _assert_results(results)


@pytest.mark.slow
def test_parity_pool2_cp2(tmp_path):
    """(P 2, CP 2): libra over several B/H/M, GQA and MHA, p2p and a2a, three dtypes; Ulysses."""
    results = run_ranks(_parity_rank, 4, tmp_path, [(2, 2, 2)], CASES_4, 256, 7, deadline_s=150)
    _assert_results(results)


CASES_8 = [
    {**BASE, "B": 32, "H": 2, "M": 2, "comm": "p2p", "dtypes": ["float64"]},
    # tile chunks over coarse tiles (2 KV heads each) with all-to-all exchange
    {**BASE, "planner": "libra-adaptive", "options": {"candidates": ("alg2-flops",), "chunkings": ("tiles",)},
     "B": 32, "H": 2, "M": 2, "comm": "a2a", "dtypes": ["float64"]},
    {**BASE, "method": "ulysses", "dtypes": ["float64"]},
    # link-priced retention on 2-GPU 'nodes', so NVLink and RoCE bytes are priced apart
    {**BASE, "planner": "libra-adaptive",
     "options": {"candidates": ("fine-retain-link",), "profile": TWO_GPU_NODES},
     "B": 32, "H": 1, "M": 2, "comm": "p2p", "dtypes": ["float64"]},
    # the heaviest tiles of one long sample cut into token ranges, its KV fan-out relayed
    # (not re-placed for exposure: on (P 4, CP 2) that keeps every tile in its CP group)
    {**BASE, "planner": "libra-adaptive",
     "options": {"candidates": ("fine-retain-link-relay",), "profile": FLOPS_KERNEL, "rebalance_passes": 0},
     "split": True, "lengths": [[256], [8] * 32, [16] * 16, [32] * 8], "B": 64, "H": 2, "M": 2, "comm": "p2p",
     "dtypes": ["float64", "float32"]},
    # the same placement with its KV fan-out relayed (hops 1..H after chunk 0's dispatch); on the
    # (P 4, CP 2) grid re-placed for its exposed communication (libra.extensions.adaptive.rebalance.rebalance_exposed;
    # at M = 2 the overload repair of libra.extensions.adaptive.repair leaves nothing there for it to win)
    {**BASE, "planner": "libra-adaptive",
     "options": {"candidates": ("fine-retain-link-relay",), "profile": TWO_GPU_NODES, "ensemble": None},
     "B": 16, "H": 1, "M": 4, "comm": "p2p", "dtypes": ["float64", "float32"], "rebalanced": (4, 2, 4)},
    # DistCA over 8 attention servers, and dynamic CP with groups of up to 8 ranks
    {**BASE, "planner": "distca", "B": 32, "H": 1, "M": 2, "comm": "a2a", "dtypes": ["float64"]},
    {**BASE, "planner": "dynamic-cp", "options": {"max_seqlen_per_rank": 32}, "at_home": True, "B": 32, "H": 1,
     "M": 2, "comm": "p2p", "dtypes": ["float64"]},
]


@pytest.mark.slow
def test_parity_pool4_cp2_and_pool2_cp4(tmp_path):
    """(P 4, CP 2) and (P 2, CP 4) on one 8-rank world."""
    results = run_ranks(_parity_rank, 8, tmp_path, [(4, 2, 4), (2, 4, 2)], CASES_8, 256, 11, deadline_s=170)
    _assert_results(results)


CASES_SLOW = [
    {**BASE, "B": 16, "H": 4, "M": 2, "comm": "a2a", "dtypes": ["float64", "bfloat16"]},
    {**BASE, "B": 64, "H": 2, "M": 4, "comm": "p2p", "dtypes": ["float64", "float32"]},
    {"hq": 12, "hkv": 4, "d": 8, "B": 32, "H": 3, "M": 2, "comm": "a2a", "dtypes": ["float64"]},
    {"hq": 8, "hkv": 8, "d": 8, "B": 32, "H": 1, "M": 8, "comm": "p2p", "dtypes": ["float64"]},
    {"hq": 12, "hkv": 4, "d": 8, "method": "ulysses", "dtypes": ["float64", "bfloat16"]},
    # tile-grouped chunks: M = 4 over one-KV-head tiles of a GQA-3 shape, both exchange modes
    {"hq": 12, "hkv": 4, "d": 8, "planner": "libra-adaptive",
     "options": {"candidates": ("fine",), "chunkings": ("tiles",)}, "B": 32, "H": 1, "M": 4, "comm": "a2a",
     "dtypes": ["float64", "float32"]},
    {**BASE, "planner": "libra-adaptive", "options": {"candidates": ("fine-retain",), "chunkings": ("tiles",)},
     "B": 16, "H": 1, "M": 8, "comm": "p2p", "dtypes": ["float64"]},  # some workers have empty chunks
    # KV relays on a GQA-3 shape with M = 3 (each chunk one query head of the tile's one KV head)
    {"hq": 12, "hkv": 4, "d": 8, "planner": "libra-adaptive", "options": {"candidates": ("fine-retain-link-relay",),
                                                                             "profile": CURVE},
     "B": 16, "H": 1, "M": 3, "comm": "a2a", "dtypes": ["float64", "float32"]},
]


@pytest.mark.slow
def test_parity_larger_grids_more_cases(tmp_path):
    """(P 4, CP 2), (P 2, CP 4) and (P 8, CP 1) with more B/H/M, dtypes and exchange modes."""
    results = run_ranks(_parity_rank, 8, tmp_path, [(4, 2, 4), (2, 4, 2), (8, 1, 8)], CASES_SLOW, 512, 13,
                        deadline_s=900, pg_timeout_s=300)
    _assert_results(results)


# Ulysses head shards that cut a GQA group: rank 0 of hq=12, hkv=3, CP=2 holds query
# heads 0-5, which read KV heads 0,0,0,0,1,1 (not the kernels' contiguous grouping); hq=6, hkv=3,
# CP=2 gives 3 query heads over 2 KV heads. (grid, case) pairs: each shape only where CP | hq.
GQA_CUT = {"method": "ulysses", "d": 8}
ULYSSES_GQA_ITEMS = [
    ((2, 2, 2), {**GQA_CUT, "hq": 12, "hkv": 3, "dtypes": ["float64", "float32", "bfloat16"]}),
    ((2, 2, 2), {**GQA_CUT, "hq": 6, "hkv": 3, "dtypes": ["float64"]}),
    ((2, 2, 2), {**GQA_CUT, "hq": 24, "hkv": 6, "dtypes": ["float64"]}),   # aligned at CP 2
    ((1, 4, 1), {**GQA_CUT, "hq": 24, "hkv": 6, "dtypes": ["float64", "float32"]}),
    ((1, 4, 1), {**GQA_CUT, "hq": 12, "hkv": 3, "dtypes": ["float64"]}),   # 3 heads over 1-2 KV heads
]


def _ulysses_gqa_rank(rank, world, items, seq_len, seed):
    from libra.runtime.groups import RankGrid, build_groups  # noqa: PLC0415

    out, built = [], {}
    for grid, case in items:
        if grid not in built:
            built[grid] = build_groups(RankGrid(dp=grid[0], cp=grid[1], pool_size=grid[2]), timeout_s=60)
        dtypes = [getattr(torch, n) for n in case["dtypes"]]
        r = _ulysses_case(rank, built[grid], case, grid[0], grid[1], seq_len, seed, dtypes)
        out.append(({"grid": grid, **case}, r))
    return out


@pytest.mark.slow
def test_parity_ulysses_gqa_groups_cut_by_head_shards(tmp_path):
    """Ulysses where a rank's query-head shard starts or ends inside a GQA group, CP 2 and CP 4."""
    results = run_ranks(_ulysses_gqa_rank, 4, tmp_path, ULYSSES_GQA_ITEMS, 128, 17, deadline_s=150)
    _assert_results(results)


# links 1000x slower than NVLink with little latency, kernel time proportional to FLOPs: fetching one long
# sample's KV prefix to three light workers costs the holder's port three copies, which the KV relay
# (scatter + all-gather) cuts to about one -- so libra-adaptive picks the relayed candidate by itself
SLOW_LINKS = replace(FLOPS_KERNEL, name="flops-kernel-slow-links", links={
    c: replace(link, bandwidth_gbps=link.bandwidth_gbps / 1000, latency_ms=1e-4)
    for c, link in FLOPS_KERNEL.links.items()})
RELAY_UNPINNED = {"hq": 4, "hkv": 1, "d": 8, "planner": "libra-adaptive", "options": {"profile": SLOW_LINKS},
                  "lengths": [[256], [16] * 16, [16] * 16, [16] * 16], "B": 16, "H": 2, "M": 2, "comm": "p2p",
                  "dtypes": ["float64", "float32"]}


@pytest.mark.slow
def test_parity_relay_chosen_unpinned(tmp_path):
    """libra-adaptive with its default candidates (none pinned) picks a KV relay on slow links, and
    the relayed plan runs on 4 gloo ranks (DP 4, P 4) with outputs and q/k/v gradients matching the
    float64 reference (sim-check --nproc's relay case, small)."""
    results = run_ranks(_parity_rank, 4, tmp_path, [(4, 1, 4)], [RELAY_UNPINNED], 256, 5, deadline_s=150)
    _assert_results(results)
    for rank_res in results:
        (case, res), = rank_res
        assert "candidates" not in case["options"] and res["relayed"] > 0, "no relay chosen: the test would not run one"
    assert any(rank_res[0][1]["my_relay_rounds"] > 0 for rank_res in results)
