"""Execution options are part of the pool's plan agreement.

Ranks that ``prepare`` one plan with different Pipeliner chunks, comm mode, kernel backend, scale or
finite check would deadlock, abort gloo or compute differently; ``prepare`` must instead raise
:class:`~libra.plan.PlanMismatchError` on every rank, quickly, naming the option and the ranks.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from dist_utils import long_tail_lengths, run_ranks

from libra.runtime.agreement import decode_options, encode_options

pytestmark = pytest.mark.distributed

# (name, rank 0's prepare kwargs, rank 1's) -- the first case agrees
CASES = [
    ("same", {}, {}),
    ("chunks", {"chunks": 2}, {"chunks": 1}),
    ("comm", {"comm": "p2p"}, {"comm": "a2a"}),
    ("backend", {"backend": "cpu-flash"}, {"backend": "math"}),
    ("scale", {}, {"scale": 0.5}),
    ("check_finite", {}, {"check_finite": False}),
    ("program_chunks", {"program_chunks": 2}, {"program_chunks": 1}),
]


def _plan():
    from baselines.registry import get_planner  # noqa: PLC0415
    from libra.config import ParallelConfig  # noqa: PLC0415
    from libra.data.packing import PackedSequence  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    shape = AttentionShape(4, 2, 8, 8)
    par = ParallelConfig(dp=2, cp=1, gbs=2, seq_len=128)
    rng = np.random.default_rng(0)
    window = []
    for i, scale in enumerate((100.0, 4.0)):
        lengths = long_tail_lengths(rng, 128, scale=scale)
        window.append(PackedSequence(i, lengths, np.arange(len(lengths))))
    planner = get_planner("libra", pool_size=2, block_size=16, head_split=2, pipeline_chunks=2)
    return shape, planner.plan_window(window, par, shape)[0]


def _options_rank(rank, world):
    import torch.distributed as dist  # noqa: PLC0415

    from libra.runtime.attention import prepare  # noqa: PLC0415
    from libra.runtime.groups import RankGrid, build_groups  # noqa: PLC0415
    from libra.runtime.program import compile_worker  # noqa: PLC0415

    groups = build_groups(RankGrid(dp=2, cp=1, pool_size=2), timeout_s=20.0)
    shape, plan = _plan()
    out = {}
    for name, *per_rank in CASES:
        kwargs = dict(per_rank[rank])
        target = plan
        if "program_chunks" in kwargs:  # a WorkerProgram compiled with another M (AsyncPlanner's path)
            pool = plan.pool_of_worker(groups.pool.worker)
            target = compile_worker(pool, shape, groups.pool.worker, kwargs.pop("program_chunks"),
                                    digest=plan.digest())
        dist.barrier()
        t0 = time.monotonic()
        try:
            prepare(target, groups.pool, **kwargs)
            out[name] = {"type": None, "msg": "", "s": time.monotonic() - t0}
        except Exception as exc:  # noqa: BLE001  (the parent checks type and message)
            out[name] = {"type": type(exc).__name__, "msg": str(exc), "s": time.monotonic() - t0}
    return out


@pytest.mark.slow
def test_option_mismatch_raises_on_every_rank_quickly(tmp_path):
    res = run_ranks(_options_rank, 2, tmp_path, deadline_s=120, pg_timeout_s=20.0)
    option = {"program_chunks": "chunks"}
    for r in res:
        assert r["same"]["type"] is None, r["same"]
        for name, *_ in CASES[1:]:
            got = r[name]
            assert got["type"] == "PlanMismatchError", (name, got)
            msg = got["msg"]
            assert f"{option.get(name, name)}: " in msg, (name, msg)
            assert "pool ranks [0]" in msg and "pool ranks [1]" in msg, msg
            assert got["s"] < 1.0, f"{name}: took {got['s']:.2f}s"
    # the message is the same on every rank
    assert [r["chunks"]["msg"] for r in res] == [res[0]["chunks"]["msg"]] * 2


def test_options_encoding_roundtrip_and_limits():
    opts = {"chunks": 2, "comm": "p2p", "backend": "x" * 100, "scale": None, "check_finite": True}
    raw = encode_options(opts)
    assert len(raw) == len(encode_options({})) and len(raw) == 480
    back = decode_options(raw)
    assert back["backend"] == "x" * 64 and back["chunks"] == 2 and back["scale"] is None
    with pytest.raises(ValueError, match="must be a scalar"):
        encode_options({"chunks": [1, 2]})
    with pytest.raises(ValueError, match="more than 480"):
        encode_options({f"o{i}": "y" * 64 for i in range(10)})
