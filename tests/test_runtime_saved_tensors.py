"""The runtime's autograd bridge saves every backward tensor through ``ctx.save_for_backward``.

Libra (a pooled plan with remote work, M = 2 Pipeliner chunks) and the Ulysses runtime on 2 gloo
ranks, float64, against the single-process reference: plain, under non-reentrant activation
checkpointing, and under ``saved_tensors_hooks`` whose pack copies each tensor (as CPU offload
does). In the hooked run the originals of the runner's saved tensors are poisoned with NaN after
forward, so backward must use the unpacked copies: state kept on ctx outside the hooks would
either not be packed (count check) or yield NaN gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_utils import full_tensors, long_tail_lengths, max_err, reference_grads, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

F64_TOL = 1e-10
SHAPE = {"hq": 8, "hkv": 2, "d": 8}
MODES = ("plain", "checkpoint", "hooks")


def _window(seq_len: int, seed: int):
    from libra.data.packing import PackedSequence  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    out = []
    for i, scale in enumerate((120.0, 6.0)):  # one heavy, one light sequence: cross-worker skew
        lengths = long_tail_lengths(rng, seq_len, scale=scale)
        out.append(PackedSequence(i, lengths, np.arange(len(lengths))))
    return out


def _run(mode: str, attn, q, k, v, do) -> dict:
    """One forward/backward of ``attn`` under ``mode``; returns out, grads and hook facts."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    info = {"packed": 0, "packed_other_numel": 0}
    if mode == "plain":
        out = attn(q, k, v)
    elif mode == "checkpoint":
        out = torch.utils.checkpoint.checkpoint(attn, q, k, v, use_reentrant=False)
    else:
        originals = []

        def pack_hook(t):
            info["packed"] += 1
            if not any(t is x for x in (q, k, v)):
                originals.append(t)
                info["packed_other_numel"] += t.numel()
            return t.device, t.detach().to("cpu", copy=True)  # an offload-style copy

        def unpack_hook(packed):
            device, t = packed
            return t.to(device)

        with torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook):
            out = attn(q, k, v)
        with torch.no_grad():
            for t in originals:  # backward must read the unpacked copies, never these
                t.fill_(float("nan"))
        originals.clear()
    out.backward(do)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, **info}


def _compare(mode, got, ref, stats_fn) -> dict:
    res = {n: max_err(got[n], r) for n, r in zip(("out", "dq", "dk", "dv"), ref)}
    res.update(packed=got["packed"], packed_other_numel=got["packed_other_numel"], **stats_fn())
    return res


def _libra(groups, seq_len, seed) -> dict:
    from baselines.registry import get_planner  # noqa: PLC0415
    from libra.config import ParallelConfig  # noqa: PLC0415
    from libra.runtime.attention import prepare  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    shape = AttentionShape(SHAPE["hq"], SHAPE["hkv"], SHAPE["d"], 8)
    window = _window(seq_len, seed)
    planner = get_planner("libra", pool_size=2, block_size=16, head_split=2, pipeline_chunks=2)
    plan = planner.plan_window(window, ParallelConfig(dp=2, cp=1, gbs=2, seq_len=seq_len), shape)[0].validate()
    pool = plan.pool_of_worker(groups.pool.worker)
    attn = prepare(plan, groups.pool)
    ranges = [(pool.sequences[s].seq_id, a, b) for s, a, b in attn.program.local_ranges]
    full = {w.seq_id: t for w, t in zip(window, full_tensors([w.sample_lengths for w in window], shape, seed))}
    lengths = {w.seq_id: w.sample_lengths for w in window}
    refs = {s: reference_grads(*full[s], lengths[s]) for s, _, _ in ranges}
    ref = [torch.cat([refs[s][i][a:b] for s, a, b in ranges]) for i in range(4)]
    q, k, v, do = (torch.cat([full[s][i][a:b] for s, a, b in ranges]) for i in range(4))
    moved = int(sum(np.sum(p.tiles.dest != p.tiles.q_home) for p in plan.pools))

    def stats():
        st = attn.stats
        return {"unreleased": st.unreleased_bytes, "peak": st.peak_transient_bytes,
                "held": st.held_for_backward_bytes, "calls": st.calls}

    res = {"moved": moved, "chunks": attn.program.chunks}
    for mode in MODES:
        before = attn.stats.calls
        res[mode] = _compare(mode, _run(mode, attn, q, k, v, do), ref, stats)
        res[mode]["calls"] -= before
    res["index_builds"] = _index_builds(lambda: _run("plain", attn, q, k, v, do))
    return res


def _index_builds(fn) -> int:
    """How many numpy arrays ``fn`` turns into tensors (index construction on the step's path)."""
    from unittest import mock  # noqa: PLC0415

    calls = [0]

    def counting(real):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs)
        return wrapper

    with mock.patch.object(torch, "as_tensor", counting(torch.as_tensor)), \
            mock.patch.object(torch, "from_numpy", counting(torch.from_numpy)):
        fn()
    return calls[0]


def _ulysses(groups, seq_len, seed) -> dict:
    from baselines.ulysses_runtime import UlyssesAttention  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    shape = AttentionShape(SHAPE["hq"], SHAPE["hkv"], SHAPE["d"], 8)
    seq = _window(seq_len, seed)[0]
    full = full_tensors([seq.sample_lengths], shape, seed)[0]
    n, c = seq_len // 2, groups.cp.rank
    ref = [x[c * n:(c + 1) * n] for x in reference_grads(*full, seq.sample_lengths)]
    q, k, v, do = (x[c * n:(c + 1) * n] for x in full)
    attn = UlyssesAttention(seq.sample_lengths, groups.cp, shape.num_q_heads, shape.num_kv_heads)

    def stats():
        return {"peak": attn.stats["peak_transient_bytes"], "calls": attn.stats["calls"]}

    res = {}
    for mode in MODES:
        before = attn.stats["calls"]
        res[mode] = _compare(mode, _run(mode, attn, q, k, v, do), ref, stats)
        res[mode]["calls"] -= before
    return res


def _rank(rank, world, seq_len, seed):
    from libra.runtime.groups import RankGrid, build_groups  # noqa: PLC0415

    libra_groups = build_groups(RankGrid(dp=2, cp=1, pool_size=2), timeout_s=60)
    ulysses_groups = build_groups(RankGrid(dp=1, cp=2, pool_size=1), timeout_s=60)
    return {"libra": _libra(libra_groups, seq_len, seed), "ulysses": _ulysses(ulysses_groups, seq_len, seed)}


def test_saved_tensors_visible_to_hooks_and_checkpoint(tmp_path):
    results = run_ranks(_rank, 2, tmp_path, 128, 5, deadline_s=120)
    assert sum(r["libra"]["moved"] for r in results) > 0, "no tile left its Q-home: no remote work exercised"
    for rank, res in enumerate(results):
        assert res["libra"]["chunks"] == 2
        # a prepared runner's forward and backward execute block copies: no index arrays are built
        assert res["libra"]["index_builds"] == 0, f"rank {rank}: {res['libra']['index_builds']} index tensors built"
        for method in ("libra", "ulysses"):
            for mode in MODES:
                got = res[method][mode]
                for name in ("out", "dq", "dk", "dv"):
                    assert got[name] < F64_TOL, f"rank {rank} {method} {mode}: float64 {name} error {got[name]:.3g}"
                assert got["peak"] > 0
                if method == "libra":
                    assert got["unreleased"] == 0, f"rank {rank} {mode}: transient buffers outlived the call"
                    assert got["held"] > 0
                # checkpointing recomputes the forward in backward; the other modes run it once
                assert got["calls"] == (2 if mode == "checkpoint" else 1), f"rank {rank} {method} {mode}"
            hooked = res[method]["hooks"]
            # q, k, v plus the runner's tensors (Libra: fd0, fd1 and each computing chunk's o, lse;
            # Ulysses: head-sharded q, k, v, out, lse)
            want = 8 if method == "ulysses" else 6
            assert hooked["packed"] >= want, f"rank {rank} {method}: only {hooked['packed']} tensors packed"
            assert hooked["packed_other_numel"] > 0
