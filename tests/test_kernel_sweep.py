"""`libra-bench kernel-sweep`: call geometries, the heads fits, the time budget, and a CPU run."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.common.runner import ExperimentRun
from experiments.measured import kernel_sweep as ks
from experiments.measured.calibrate import fit_heads_ratio
from experiments.measured.gpu_common import time_calls_within


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="heads per call 64"):
        ks.KernelSweepConfig(heads=(1, 64))
    with pytest.raises(ValueError, match="needs >= 2 heads"):
        ks.KernelSweepConfig(heads=(4,))
    with pytest.raises(ValueError, match="multiple of mixed_short"):
        ks.KernelSweepConfig(mixed_lengths=(1500,), mixed_short=1024)
    with pytest.raises(ValueError, match="neither divide nor"):
        ks.KernelSweepConfig(heads=(1, 3), q_heads=24, kv_heads=3)


def test_geometries_and_their_order():
    cfg = ks.KernelSweepConfig(lengths=(1024, 4096), heads=(1, 8), packed_tokens=4096, mixed_lengths=(4096,),
                               mixed_short=1024)
    assert ks.segment_text(ks.geometry("single", 4096, cfg)) == "4096"
    assert ks.segment_text(ks.geometry("packed", 1024, cfg)) == "1024x4"
    assert ks.segment_text(ks.geometry("mixed", 4096, cfg)) == "4096+1024x4"
    assert ks.segment_text(ks.geometry("short-batch", 4096, cfg)) == "1024x4"
    keys = cfg.keys()
    # packed only below packed_tokens (one document at it is the single layout)
    assert {(k["layout"], k["length"]) for k in keys if k["layout"] == "packed"} == {("packed", 1024)}
    flops = [ks.point_flops(k, cfg) for k in keys]
    assert flops == sorted(flops)  # cheapest first: a time box cuts the most expensive points


def _synthetic(c_by_length: dict, layout="single") -> pd.DataFrame:
    rows = []
    for L, c in c_by_length.items():
        for h in (1, 2, 4, 8, 32):
            eff = h / (h + c) / (32 / (32 + c))
            for pas in ("fwd", "bwd"):
                rows.append({"layout": layout, "length": L, "heads": h, "pass": pas, "tflops": 300.0 * eff,
                             "ms": 1.0 / eff, "status": "ok"})
    return pd.DataFrame(rows)


def test_heads_fits_recover_the_heads_term_per_length_and_jointly():
    df = _synthetic({1024: 2.0, 65536: 0.1})
    fits = ks.heads_fits(df).set_index(["length", "pass"])
    assert fits.loc[(1024, "fwd"), "heads_half"] == pytest.approx(2.0, rel=0.01)
    assert fits.loc[(65536, "fwd"), "heads_half"] == pytest.approx(0.1, rel=0.01)
    assert fits.loc[(1024, "fwd"), "worst_rel_err"] < 0.005
    joint = ks.joint_heads_half(_synthetic({1024: 0.5, 4096: 0.5, 65536: 0.5}))
    assert joint["fwd"]["heads_half"] == pytest.approx(0.5, rel=0.01) and joint["fwd"]["points"] == 15


def test_fit_heads_ratio_checks_its_inputs():
    with pytest.raises(ValueError, match="stat must be"):
        fit_heads_ratio([1, 32], [0.5, 1.0], 32, stat="mean")
    with pytest.raises(ValueError, match="matching positive"):
        fit_heads_ratio([1, 32], [0.0, 1.0], 32)
    assert fit_heads_ratio([1, 2, 32], [1.0, 1.0, 1.0], 32) == (0.0, 0.0)


def test_mixed_ratio_is_the_call_over_its_parts():
    df = pd.DataFrame([{"layout": lay, "length": 4096, "heads": 8, "pass": "fwd", "ms": ms, "status": "ok"}
                       for lay, ms in (("mixed", 9.0), ("single", 6.0), ("short-batch", 4.0))])
    got = ks.mixed_ratios(df)
    assert got["ratio"].tolist() == [pytest.approx(0.9)]


def test_time_calls_within_cuts_repeats_to_the_target():
    import time

    import torch

    calls = []

    def slow(i):  # about 2 ms per call
        calls.append(i)
        time.sleep(0.002)

    got = time_calls_within(slow, torch.device("cpu"), warmup=3, repeats=10, target_ms=5.0)
    assert 1 <= len(got) <= 2 and len(calls) <= 1 + 1 + len(got)  # probe, at most one more warm-up, timed
    fast = time_calls_within(lambda i: None, torch.device("cpu"), warmup=3, repeats=10, target_ms=5.0)
    assert len(fast) == 10
    with pytest.raises(ValueError, match="target_ms"):
        time_calls_within(slow, torch.device("cpu"), 0, 1, 0.0)


def test_budget_skips_points_and_never_caches_them(tmp_path, monkeypatch):
    cfg = ks.KernelSweepConfig(lengths=(128, 256, 512), heads=(1, 2), q_heads=2, kv_heads=1, head_dim=16,
                               packed_tokens=128, mixed_lengths=(), mixed_short=64)
    clock = iter(np.arange(0.0, 1000.0, 1.0))
    monkeypatch.setattr(ks.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(ks, "ESTIMATE_FLOPS", 0.0)
    monkeypatch.setattr(ks, "measure_point", lambda key, *a: ks.point_rows(
        key, ks.geometry(key["layout"], key["length"], cfg), key["heads"], 1, 1.0, cfg,
        {"fwd": {"ms": 1.0, "ms_p10": 1.0, "ms_p90": 1.0, "ms_min": 1.0, "repeats": 1},
         "bwd": {"ms": 2.0, "ms_p10": 2.0, "ms_p90": 2.0, "ms_min": 2.0, "repeats": 1}}, "ok"))
    run = ExperimentRun("kernel_sweep", {"test": 1}, out_dir=tmp_path / "ks", quiet=True)
    rows, skipped = ks.measure_all(run, cfg, None, __import__("torch").device("cpu"), None, budget_s=4.0)
    assert skipped and len(rows) == 2 * len(cfg.keys())
    status = {r["status"] for r in rows}
    assert status == {"ok", "skipped (budget)"}
    assert all(run.cached(k) is None for k in skipped)
    assert all(run.cached(k) is not None for k in cfg.keys() if k not in skipped)


@pytest.mark.slow
def test_cli_quick_run_on_cpu(tmp_path):
    out = tmp_path / "ks"
    res = CliRunner().invoke(main, ["kernel-sweep", "--quick", "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "kernel_sweep.csv")
    assert set(df.layout) == set(ks.LAYOUTS) and set(df["pass"]) == {"fwd", "bwd"}
    assert {"segment_lengths", "heads", "kv_heads", "backend", "kernel_version", "multiprocessors"} <= set(df.columns)
    assert (df.status == "ok").all() and (df.ms > 0).all()
    summary = json.loads((out / "run.json").read_text())["summary"]
    assert summary["heads_half_by_length"] and summary["mixed"] and not summary["skipped"]
    assert (out / "kernel_sweep.png").stat().st_size > 0
    assert "heads_half c" in res.output and "x its parts run alone" in res.output
    record = (out / "run.json").read_bytes()
    points = {p: p.stat().st_mtime_ns for p in out.glob(".points/*/*.json")}
    again = CliRunner().invoke(main, ["kernel-sweep", "--quick", "--device", "cpu", "--out", str(out)])
    assert again.exit_code == 0 and points and {p: p.stat().st_mtime_ns for p in points} == points  # resumed
    assert (out / "run.json").read_bytes() == record  # the same measured points: the same record
