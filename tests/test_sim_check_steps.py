"""`libra-bench sim-check --nproc`: the whole-step check (bad input before any work, the order and
summary arithmetic; a 2-rank run with every term in the slow tier)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.measured.sim_check import sim_check
from experiments.measured.sim_check_steps import (
    ORDER_GAP,
    TERMS,
    heaviest_rank_parts,
    order_table,
    summarize_steps,
)

TINY = ["--nproc", "2", "--cp", "1", "--seq-len", "512", "--pool-size", "2", "--block-size", "64", "--head-split", "2",
        "--chunks", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "8", "--windows", "1", "--warmup", "0",
        "--repeats", "2", "--workload", "workloads/skewed-2k.txt", "--profile", "h100-roce-v1", "--no-progress"]


@pytest.mark.parametrize("args, message", [
    (["--methods", "ulysses,nope"], "unknown method 'nope'"),
    (["--methods", "libra", "--dp", "4"], "--nproc 2 must equal DP*CP = 4*1 = 4"),
    (["--methods", "libra", "--method", "libra"], "--method applies to the one-device check only"),
    ([], "--nproc needs --methods"),
    (["--methods", "libra", "--profile", "no-such-profile"], "no-such-profile"),
    (["--methods", "libra", "--gbs", "3"], "GBS=3 must be a multiple of DP=2"),
])
def test_bad_input_is_one_line_before_work(tmp_path, args, message):
    res = CliRunner().invoke(sim_check, [*TINY, *args, "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert not (tmp_path / "out").exists()  # refused before any folder or rank


def test_steps_options_need_nproc(tmp_path):
    res = CliRunner().invoke(sim_check, ["--methods", "libra", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--nproc is needed with --methods" in res.output


def _rows(pred: dict, meas: dict) -> pd.DataFrame:
    rows = []
    for m in pred:
        row = {"method": m, "window": 0, "step": 0, "role": "straggler", "worker": 0}
        for t in TERMS:
            row[f"pred_{t}_ms"], row[f"meas_{t}_ms"] = pred[m], meas[m]
            row[f"rel_err_{t}"] = pred[m] / meas[m] - 1
        row["exposed_err_of_step"] = 0.0
        rows.append(row)
    return pd.DataFrame(rows)


def test_order_table_checks_only_pairs_the_model_separates():
    # a vs b: predicted 50% apart, measured the other way; a vs c within the gap; b vs c agree
    df = _rows({"a": 100.0, "b": 150.0, "c": 110.0}, {"a": 120.0, "b": 100.0, "c": 130.0})
    order = order_table(df).set_index(["method_a", "method_b"])
    assert order.loc[("a", "b"), "checked"] and order.loc[("a", "b"), "order_agrees"] is False
    assert order.loc[("a", "b"), "pred_gap"] == pytest.approx(0.5)
    assert not order.loc[("a", "c"), "checked"] and order.loc[("a", "c"), "order_agrees"] is None
    assert order.loc[("b", "c"), "pred_gap"] == pytest.approx(150 / 110 - 1) and 150 / 110 - 1 >= ORDER_GAP
    assert order.loc[("b", "c"), "order_agrees"] is False  # predicted c faster, measured b faster
    s = summarize_steps(df)
    assert s["a"]["straggler"]["median_abs_err_total"] == pytest.approx(abs(100 / 120 - 1))
    json.dumps(s)  # run.json material


def test_the_compute_heaviest_rank_is_where_the_link_is_judged():
    # rank 0 finishes last (waiting for rank 1's late returns); rank 1 computes the most
    base = {"method": "libra", "window": 0, "step": 0, "role": "rank", "pred_comm_serial_ms": 20.0}
    ranks = [{**base, "worker": 0, "meas_compute_ms": 100.0, "meas_wait_ms": 150.0, "meas_issue_ms": 14.0,
              "meas_unpack_ms": 5.0, "meas_other_ms": 1.0},
             {**base, "worker": 1, "meas_compute_ms": 240.0, "meas_wait_ms": 10.0, "meas_issue_ms": 12.0,
              "meas_unpack_ms": 0.0, "meas_other_ms": 2.0}]
    top = _rows({"libra": 260.0}, {"libra": 270.0}).assign(meas_worker=0)
    df = pd.concat([pd.DataFrame(ranks), top], ignore_index=True)
    for t in TERMS:
        df[f"rel_err_{t}"] = df[f"rel_err_{t}"].fillna(0.0)
    df["exposed_err_of_step"] = 0.0
    assert heaviest_rank_parts(df).worker.tolist() == [1]
    got = summarize_steps(df)["libra"]["straggler"]["rank"]
    assert got == {"pred_comm_serial_ms": 20.0, "meas_wait_ms": 10.0, "meas_issue_ms": 12.0, "meas_unpack_ms": 0.0,
                   "meas_other_ms": 2.0}


@pytest.mark.slow
def test_two_ranks_every_term_and_file(tmp_path):
    """2 gloo ranks, tiny sizes: every method's rank and straggler rows carry every term, the
    predictions are the cost model's for the Plans the parent plans the same way."""
    from baselines.registry import get_planner
    from libra.config import ParallelConfig, TapConfig
    from libra.data.windows import gbs_windows
    from libra.sim.cost import CostModel
    from libra.sim.profiles import load_profile
    from libra.sim.topology import Topology
    from libra.workload import AttentionShape

    out = tmp_path / "out"
    res = CliRunner().invoke(sim_check, [*TINY, "--methods", "ulysses,libra,libra-adaptive", "--out", str(out)])
    assert res.exit_code == 0, res.output
    for name in ("sim_check_steps.csv", "sim_check_steps.png", "sim_check_order.csv", "run.json"):
        assert (out / name).stat().st_size > 0
    df = pd.read_csv(out / "sim_check_steps.csv")
    assert set(df.method) == {"ulysses", "libra", "libra-adaptive"}
    assert sorted(df[df.role == "rank"].worker.unique()) == [0, 1]
    for t in TERMS:
        assert df[f"pred_{t}_ms"].notna().all() and df[f"meas_{t}_ms"].notna().all()
    assert (df.meas_total_ms > 0).all() and (df.meas_compute_ms > 0).all()
    ranks = df[df.role == "rank"]  # exposed split into waits and the host work around transfers
    parts = ranks[["meas_wait_ms", "meas_issue_ms", "meas_unpack_ms", "meas_other_ms"]]
    assert (parts >= 0).all().all()
    assert (ranks.meas_wait_ms <= ranks.meas_exposed_ms + 1e-9).all()  # a wait lies inside wall - compute
    ulysses = ranks[ranks.method == "ulysses"]  # one rank per sequence: nothing sent or received
    assert (ulysses[["meas_wait_ms", "meas_issue_ms", "meas_unpack_ms"]] == 0).all().all()
    assert (ranks[ranks.method == "libra"].meas_issue_ms > 0).all()  # libra's pool sends KV and returns
    assert df[df.role == "straggler"].meas_wait_ms.isna().all()
    rec = json.loads((out / "run.json").read_text())
    assert rec["config"]["interleaved"] and len(rec["summary"]["loadavg_before"]) == 3
    assert rec["summary"]["methods"]["libra-adaptive"]["straggler"]["worst_abs_err_total"] >= 0
    assert rec["summary"]["methods"]["libra"]["rank"]["meas_wait_ms"] >= 0
    assert "of it waits" in res.output and "the compute-heaviest rank waits" in res.output
    par, shape = ParallelConfig(dp=2, cp=1, gbs=2, seq_len=512), AttentionShape(4, 2, 8, 4)
    prof = load_profile("h100-roce-v1")
    tap = TapConfig(pool_size=2, block_size=64, head_split=2, pipeline_chunks=2)
    (plan,) = get_planner("libra", tap=tap).plan_window(gbs_windows("workloads/skewed-2k.txt", 512, 2, 1)[0], par, shape)
    cost = CostModel(prof, Topology(prof, par)).price(plan)
    mine = df[(df.method == "libra") & (df.role == "rank")].sort_values("worker")
    assert np.allclose(mine.pred_total_ms, cost.total_ms) and np.allclose(mine.pred_exposed_ms, cost.exposed_comm_ms)
    assert mine.plan_digest.iloc[0] == plan.digest()[:16]


def test_processor_sharing_prices_ranks_that_share_the_hosts_cores():
    from experiments.measured.sim_check_steps import processor_sharing  # noqa: PLC0415

    assert processor_sharing(np.array([10.0, 10.0]), cores=2).tolist() == [10.0, 10.0]  # a core each
    # four equal ranks on two cores: each at half a core, all done at total work / cores
    assert processor_sharing(np.array([10.0] * 4), cores=2).tolist() == [20.0] * 4
    # a skewed plan: the light ranks finish early and hand their cores to the heavy one
    got = processor_sharing(np.array([40.0, 10.0, 10.0, 10.0]), cores=2)
    assert got.tolist() == [50.0, 20.0, 20.0, 20.0]
