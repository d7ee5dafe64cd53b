"""`libra-bench tile-overhead`: a worker's calls as the runtime issues them, its token buffers, and a CPU run."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from experiments.cli import main
from experiments.common.sim_common import custom_setting, load_windows, make_planner, make_shape, with_tap
from experiments.measured import tile_overhead as to
from libra.runtime.kernels import get_backend
from libra.sim.profiles import load_profile
from libra.workload import attention_flops


def test_local_rows_compress_the_union_of_intervals():
    tok, lens = np.array([100, 0, 104, 50]), np.array([8, 4, 2, 3])
    first, n = to.local_rows(tok, lens)
    # union: [0, 4), [50, 53), [100, 108) -> 4 + 3 + 8 rows; [104, 106) lies inside [100, 108)
    assert n == 15 and first.tolist() == [7, 0, 11, 4]
    assert to.local_rows(np.zeros(0, np.int64), np.zeros(0, np.int64))[1] == 0


def _small_plan(method):
    st = with_tap(custom_setting(dp=2, cp=2, seq_len=2048, gbs=2), block_size=256, pipeline_chunks=2)
    shape = make_shape(4, 2, 16)
    window = load_windows("libra-prod", st, 1, 0)[0]
    plan = make_planner(method, st, profile=load_profile("h100-roce-v1")).plan_window(window, st.par(), shape)[0]
    return plan, shape


@pytest.mark.parametrize("method", ["libra", "libra-adaptive"])
def test_calls_carry_the_workers_flops_and_write_each_query_row_once(method):
    plan, shape = _small_plan(method)
    pool, worker, pieces, sched = to.pick_worker(plan, shape, None)
    q_local, n_q = to.local_rows(pieces["q_tok"], pieces["q_len"])
    kv_local, n_kv = to.local_rows(pieces["kv_tok"], pieces["kv_len"])
    calls = to.worker_calls(pieces, shape, sched, q_local, kv_local)
    flops = float(np.sum(attention_flops(pieces["area"].astype(np.float64), 1, shape.head_dim) * pieces["heads"]))
    assert sum(float(np.sum(attention_flops(to.segment_areas(c.seg), c.qh, shape.head_dim))) for c in calls) \
        == pytest.approx(flops)
    q_all = torch.cat([c.q_idx.reshape(-1) for c in calls])
    assert q_all.numel() == q_all.unique().numel() and int(q_all.max()) < n_q * shape.num_q_heads
    assert max(int(c.kv_idx.max()) for c in calls) < n_kv * shape.num_kv_heads


def test_runtime_variant_scatters_what_the_calls_compute():
    plan, shape = _small_plan("libra")
    pool, worker, pieces, sched = to.pick_worker(plan, shape, None)
    q_local, n_q = to.local_rows(pieces["q_tok"], pieces["q_len"])
    kv_local, n_kv = to.local_rows(pieces["kv_tok"], pieces["kv_len"])
    calls = to.worker_calls(pieces, shape, sched, q_local, kv_local)
    dev, backend = torch.device("cpu"), get_backend("math")
    bufs = to.WorkerBuffers(n_q, n_kv, shape, torch.float64, dev, seed=1)
    whole = to.one_call_batches(pieces, shape, bufs, torch.float64, dev, seed=1)
    fns = to.variant_fns(calls, whole, bufs, backend)
    fns[("runtime", "fwd")](0)
    fns[("runtime", "bwd")](0)
    d = shape.head_dim
    for c in calls:
        q, k, v = (b.view(-1, d)[i] for b, i in ((bufs.q, c.q_idx), (bufs.k, c.kv_idx), (bufs.v, c.kv_idx)))
        out, lse = backend.forward(q, k, v, c.seg)
        assert torch.allclose(bufs.o.view(-1, d)[c.q_idx], out)
        dq, _, _ = backend.backward(bufs.do.view(-1, d)[c.q_idx], q, k, v, out, lse, c.seg)
        assert torch.allclose(bufs.dq.view(-1, d)[c.q_idx], dq)
    assert sum(int(b[0].total_q) for b in whole) == int(pieces["q_len"].sum())


def test_bad_input_is_one_line_before_any_work(tmp_path):
    res = CliRunner().invoke(main, ["tile-overhead", "--quick", "--device", "cpu", "--methods", "libra,nope",
                                    "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "unknown method(s) ['nope']" in res.output
    assert not (tmp_path / "x").exists()
    res = CliRunner().invoke(main, ["tile-overhead", "--quick", "--device", "cpu", "--worker", "99",
                                    "--methods", "libra", "--out", str(tmp_path / "y")])
    assert res.exit_code == 2 and "worker 99 is not in the plan" in res.output
    assert not (tmp_path / "y").exists()


@pytest.mark.slow
def test_cli_quick_run_on_cpu(tmp_path):
    out = tmp_path / "to"
    res = CliRunner().invoke(main, ["tile-overhead", "--quick", "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "tile_overhead.csv")
    assert set(df.method) == {"libra", "libra-adaptive"} and set(df.variant) == set(to.VARIANTS)
    assert len(df) == 2 * len(to.VARIANTS) * 2 and (df.ms > 0).all()
    one = df[df.variant == "one-call"]
    assert np.allclose(one["ratio_to_one_call"], 1.0)
    assert df[df.variant == "calls"]["predicted_ms"].notna().all()
    summary = json.loads((out / "run.json").read_text())["summary"]
    assert set(summary["methods"]) == {"libra", "libra-adaptive"} and summary["target_ratio"] == to.TARGET_RATIO
    assert "x one call" in res.output and (out / "tile_overhead.png").stat().st_size > 0
