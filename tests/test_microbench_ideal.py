"""`libra-bench microbench` measures honestly by default.

* on CPU it refuses more single-thread ranks than usable cores (one line, before any process
  starts) unless ``--oversubscribe``, which run.json records;
* it measures the ideal (each DP rank's whole-sequence attention alone, / CP) and reports
  ``ideal_ms``, ``ideal_ratio`` and ``cpu_ms`` per method; ``--quick`` and ``--profile`` (libra-kt);
* the paired ideal: every rank times its DP rank's whole sequence right after each step, so
  ``paired_ratio`` is robust to a host whose speed drifts during the run.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.measured import microbench as mb


def _tiny(**over) -> mb.MicrobenchConfig:
    """A one-rank configuration (each test's changes in ``over``)."""
    args = dict(dp=1, cp=1, seq_len=512, gbs=2, tap=replace(mb.DEFAULT_TAP, pool_size=1, block_size=128), q_heads=4,
                kv_heads=2, head_dim=8, dtype="fp32", device="cpu", backend="auto", comm="p2p", methods="ulysses,libra",
                windows=1, workload="libra-prod", seed=0, repeats=1, warmup=0, backward=True, timeout=60.0,
                paired_ideal=False)
    return mb.MicrobenchConfig(**{**args, **over})


BASE = ["microbench", "--dp", "2", "--cp", "1", "--pool-size", "2", "--gbs", "2", "--head-split", "2",
        "--q-heads", "4", "--kv-heads", "2", "--no-progress", "--timeout", "60"]


def test_more_cpu_ranks_than_cores_is_refused_before_spawning(tmp_path, monkeypatch):
    monkeypatch.setattr(mb, "usable_cores", lambda: 2)
    res = CliRunner().invoke(main, BASE[:1] + ["--nproc", "4", "--dp", "4", "--cp", "1", "--gbs", "4",
                                               "--out", str(tmp_path / "x")])
    assert res.exit_code == 2, res.output
    assert "4 single-thread CPU ranks on 2 usable core(s)" in res.output and "--oversubscribe" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "x").exists()


def test_check_cpu_ranks():
    mb.check_cpu_ranks(2, "cpu", False, cores=2)
    mb.check_cpu_ranks(8, "cpu", True, cores=2)  # allowed, and recorded by the caller
    mb.check_cpu_ranks(8, "cuda", False, cores=2)  # one GPU per rank: cores do not matter
    with pytest.raises(ValueError, match="use --nproc <= 2"):
        mb.check_cpu_ranks(3, "cpu", False, cores=2)


@pytest.mark.parametrize("args,message", [
    (["--profile", "h100-roce-v1"], "add one to --methods"),
])
def test_profile_errors_before_spawning(tmp_path, args, message):
    res = CliRunner().invoke(main, BASE + ["--nproc", "2", "--out", str(tmp_path / "x")] + args)
    assert res.exit_code == 2, res.output
    assert message in res.output


def test_add_ideal_and_summary_columns():
    rows = [{"method": m, "window": 0, "step": 0, "seq_ids": "0;1", "straggler_ms": s, "compute_ms": 1.0,
             "comm_exposed_ms": 0.0, "mean_worker_ms": s, "peak_transient_bytes": 1, "backend": "b",
             "device": "cpu", "cpu_ms": c} for m, s, c in (("ulysses", 30.0, 10.0), ("libra", 22.0, 10.5))]
    ideal = [{"window": 0, "seq_id": 0, "ideal_seq_ms": 30.0}, {"window": 0, "seq_id": 1, "ideal_seq_ms": 10.0}]
    got = mb.add_ideal(rows, ideal, cp=2)
    assert got[0]["ideal_ms"] == pytest.approx(10.0)  # mean over DP ranks (20) / CP (2)
    assert got[1]["ideal_ratio"] == pytest.approx(2.2)
    summary = mb.summarize(pd.DataFrame(got)).set_index("method")
    assert summary.loc["libra", "ideal_ratio"] == pytest.approx(2.2)
    assert summary.loc["libra", "cpu_vs_ulysses"] == pytest.approx(1.05)


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_run_with_ideal_cpu_time_and_profile(tmp_path):
    out = tmp_path / "mb"
    args = BASE + ["--nproc", "2", "--quick", "--seq-len", "256", "--block-size", "32", "--methods",
                   "ulysses,libra,libra-kt,libra-adaptive", "--profile", "h100-roce-v1", "--out", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    run = json.loads((out / "run.json").read_text())
    cfg = run["config"]
    assert cfg["oversubscribe"] is False and cfg["profile"] == "h100-roce-v1" and cfg["threads"] == 1
    assert cfg["repeats"] == 1 and cfg["warmup"] == 0 and cfg["head_dim"] == 16  # --quick, S and B given
    assert cfg["seq_len"] == 256 and cfg["tap"]["block_size"] == 32
    summary = pd.read_csv(out / "microbench_summary.csv").set_index("method")
    assert list(summary.index) == ["ulysses", "libra", "libra-kt", "libra-adaptive"]
    for col in ("ideal_ms", "ideal_ratio", "paired_ideal_ms", "paired_ratio", "cpu_ms", "cpu_vs_ulysses"):
        assert (summary[col] > 0).all(), col
    assert summary["ideal_drift"].between(-0.9, 9.0).all()  # after / before - 1: either sign, finite
    assert summary["ideal_ms"].nunique() == 1  # one ideal per window, whatever the method
    steps = pd.read_csv(out / "microbench.csv")
    assert {"ideal_ms", "ideal_ratio", "paired_ideal_ms", "paired_ratio", "cpu_ms", "seq_ids"} <= set(steps.columns)
    again = CliRunner().invoke(main, args)  # everything (the ideal included) comes from the cache
    assert again.exit_code == 0, again.output
    assert json.loads((out / "run.json").read_text())["points_reused"] == 4


def test_ideal_before_and_after_the_ranks_gives_its_mean_and_the_drift():
    from experiments.measured import microbench as mb

    before = {"0": [{"window": 0, "seq_id": 0, "ideal_seq_ms": 10.0}, {"window": 0, "seq_id": 1, "ideal_seq_ms": 30.0}]}
    after = {"0": [{"window": 0, "seq_id": 1, "ideal_seq_ms": 36.0}, {"window": 0, "seq_id": 0, "ideal_seq_ms": 12.0}]}
    merged = mb.merge_ideals([before, after])["0"]
    assert [r["ideal_seq_ms"] for r in merged] == [11.0, 33.0]
    assert [(r["ideal_before_ms"], r["ideal_after_ms"]) for r in merged] == [(10.0, 12.0), (30.0, 36.0)]
    rows = [{"method": "libra", "window": 0, "straggler_ms": 22.0, "seq_ids": "0;1"}]
    got = mb.add_ideal(rows, merged, cp=1)[0]
    assert got["ideal_ms"] == pytest.approx(22.0) and got["ideal_ratio"] == pytest.approx(1.0)
    assert got["ideal_drift"] == pytest.approx(48.0 / 40.0 - 1.0)  # the host got 20% slower
    once = mb.merge_ideals([before])["0"]  # measured once: no drift
    assert mb.add_ideal(rows, once, cp=1)[0]["ideal_drift"] == pytest.approx(0.0)


def _allv(times_s, paired_ms):
    """``_step_row``'s gathered matrix from per-rank repetition times (s) and paired-ideal times (ms):
    per rank its R times, CPU, compute, wait and paired ideals, then peak, bytes sent and P."""
    import numpy as np

    t, p = np.asarray(times_s, dtype=float), np.asarray(paired_ms, dtype=float)
    tail = np.tile([0.0, 0.0, 2.0], (len(t), 1))
    return np.hstack([t, t, t / 2, np.zeros_like(t), p, tail])


def test_step_row_paired_ratio_is_the_median_per_repetition_ratio():
    cfg = _tiny(dp=2, cp=2, gbs=2, tap=replace(mb.DEFAULT_TAP, block_size=128), workload="w", repeats=3)
    # 4 ranks x 3 repetitions; the host is twice as slow in repetition 1, for the step and its ideal alike
    times = [[0.030, 0.060, 0.033], [0.020, 0.040, 0.020], [0.010, 0.020, 0.010], [0.010, 0.020, 0.010]]
    ideal = [[40.0, 80.0, 44.0], [40.0, 80.0, 44.0], [8.0, 16.0, 8.8], [8.0, 16.0, 8.8]]
    row = mb._step_row("libra", 0, 0, _allv(times, ideal), cfg, 2, "cpu-flash", "cpu")
    assert row["straggler_ms"] == pytest.approx(33.0)  # the median repetition's max (unchanged)
    assert row["paired_ideal_ms"] == pytest.approx(13.2)  # median over reps of mean(ranks) / CP: 12, 24, 13.2
    assert row["paired_ratio"] == pytest.approx(2.5)  # 30/12, 60/24, 33/13.2: each repetition 2.5
    # a ratio of the medians (33 / 13.2) would also give 2.5 here; make the ideal drift within the step
    ideal[0] = [40.0, 80.0, 88.0]
    ideal[1] = [40.0, 80.0, 88.0]
    drift = mb._step_row("libra", 0, 0, _allv(times, ideal), cfg, 2, "cpu-flash", "cpu")
    assert drift["paired_ratio"] == pytest.approx(2.5)  # median of 2.5, 2.5, 33/24.2
    off = mb._step_row("libra", 0, 0, _allv([[0.03], [0.02]], [[float("nan")]] * 2), replace(cfg, cp=1, repeats=1),
                       2, "b", "cpu")
    assert off["paired_ratio"] != off["paired_ratio"]  # --no-paired-ideal: NaN, and the summary drops it
    rows = [{**off, "seq_ids": "0", "mean_worker_ms": 1.0, "peak_transient_bytes": 1, "cpu_ms": 1.0}]
    assert "paired_ratio" not in mb.summarize(pd.DataFrame(rows))
    summary = mb.summarize(pd.DataFrame([{**r, "seq_ids": "0", "mean_worker_ms": 1.0, "peak_transient_bytes": 1,
                                          "cpu_ms": 1.0} for r in (row, drift)]))
    assert summary["paired_ratio"].iloc[0] == pytest.approx(2.5)  # mean over steps of the step ratios


def test_paired_ideal_times_the_sequence_this_rank_holds(monkeypatch):
    """Each rank times its own DP rank's packed sequence of the step's plan (VRSP regroups them)."""
    from baselines.registry import get_planner
    from experiments.measured import gpu_common
    from libra.config import ParallelConfig
    from libra.data.windows import gbs_windows
    from libra.workload import AttentionShape

    timed = []
    monkeypatch.setattr(gpu_common, "time_whole_sequence",
                        lambda backend, lengths, geom, timing, seed:
                        timed.append((seed, timing.warmup, timing.repeats)) or {"ms": float(sum(lengths))})
    cfg = _tiny(warmup=2, repeats=3, seed=100)  # the paired ideal is one call whatever the step's timing
    par = ParallelConfig(dp=2, cp=2, gbs=4, seq_len=512)
    window = gbs_windows("libra-prod", 512, 4, 1, seed=3)[0]
    for plan in get_planner("libra", pool_size=2, block_size=64, pipeline_chunks=2).plan_window(
            window, par, AttentionShape(8, 2, 8, 4)):
        for me in range(4):
            ms = mb._paired_ideal_ms(plan, me, cfg, None, None)
            (seq,) = [s for pool in plan.pools for s in pool.sequences if me in s.holder_worker.tolist()]
            assert me // 2 == seq.holder_worker[0] // 2 and ms == seq.num_tokens
            assert timed[-1] == (100 + seq.seq_id, 0, 1)  # one untimed-warm-up-free call per repetition


def _warmups_of_bench_rank(rank, world, cfg, keys):
    """bench_rank with _time_calls recording the warm-up each step got (in the spawned rank)."""
    seen = []
    real = mb._time_calls

    def recording(runner, inputs, timing, *args, **kwargs):
        seen.append(timing.warmup)
        return real(runner, inputs, timing, *args, **kwargs)

    mb._time_calls = recording
    mb.bench_rank(rank, world, cfg, keys)
    return seen


@pytest.mark.slow
def test_each_methods_first_step_is_warmed_up_whatever_warmup(tmp_path):
    # one-time costs of a process's first call (autograd threads, gloo pair connections) made the
    # first method of a --warmup 0 run (--quick) 11x its ideal, so its speedups followed --methods' order
    from dist_utils import run_ranks

    cfg = _tiny()
    keys = [("ulysses", 0), ("libra", 0)]
    (seen,) = run_ranks(_warmups_of_bench_rank, 1, tmp_path, cfg, keys)
    assert seen == [1, 0, 1, 0]  # two steps per method: the first of each warmed once, the rest as asked
