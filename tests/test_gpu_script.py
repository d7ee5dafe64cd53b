"""scripts/gpu_check.sh: syntax, refusal without CUDA, argument errors, the summary writer; the full
CPU smoke pipeline is a slow test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from experiments.cli import main
from experiments.measured.gpu_summary import gpu_summary_markdown

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def _run(*args, timeout=60):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    return subprocess.run([BASH, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_script_syntax():
    res = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal when CUDA is absent")
def test_script_refuses_without_cuda(tmp_path):
    out = tmp_path / "gpu"
    res = _run(str(out))
    assert res.returncode == 3, res.stdout + res.stderr
    assert "CUDA is not available" in res.stderr and "--cpu-smoke" in res.stderr
    assert not out.exists()  # refused before writing anything


def test_script_rejects_unknown_option():
    res = _run("--bogus")
    assert res.returncode == 2 and "unknown option --bogus" in res.stderr


def _fake_run(folder: Path, summary: dict) -> None:
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"summary": summary, "environment_device": {
        "name": "NVIDIA H200", "device": "cuda", "torch": "2.11.0", "cuda": "12.8", "driver": "570.1",
        "kernel_backend": "torch-varlen"}}))


def test_summary_markdown_quotes_every_figure(tmp_path):
    _fake_run(tmp_path / "calibrate", {
        "backend": "torch-varlen", "dtype": "bf16", "profile": "p.json",
        "figure5": {"heads": {"fwd": {"1": 0.81, "32": 1.0}, "bwd": {"1": 0.77, "32": 1.0}},
                    "length": {"fwd": {"1024": 0.38, "65536": 1.0}, "bwd": {"1024": 0.3, "65536": 1.0}}},
        "fit": {"rate_inf_tflops": 420.0, "half_length": 1500.0, "exponent": 1.1, "length_fit_max_rel_err": 0.02,
                "heads_half": 0.3, "launch_ms": 0.02, "backward_time_ratio": 3.1, "device_copy_gbps": 2100.0,
                "piece_pricing": "effective-length",
                "piece_median_abs_err": {"effective-length": 0.12, "prefix-difference": 0.031}}})
    _fake_run(tmp_path / "sim-check", {
        "profile": "nvidia-h200-torch-varlen-measured", "workers": 32, "median_abs_err_total": 0.061,
        "median_abs_err_fwd": 0.05, "median_abs_err_bwd": 0.07, "worst_abs_err_total": 0.19,
        "worst_abs_err_fwd": 0.2, "worst_abs_err_bwd": 0.18, "mean_signed_err_total": -0.02,
        "straggler_worker_agrees": "4/4 windows", "median_within_target": True,
        "piece_pricing": "effective-length", "other_rule": "prefix-difference", "median_abs_err_other_rule": 0.044})
    text = gpu_summary_markdown(tmp_path, {"calibrate": "ok (40s)"}, "GPU check (nvidia-h200)")
    assert "| 1 | 0.810 | 0.770 |" in text and "| 65536 | 1.000 | 1.000 |" in text
    assert "median |error|: 6.1%" in text and "worst |error|: 19.0%" in text and "target <= 10%: met" in text
    assert "under `prefix-difference` the median |error| would be 4.4%" in text
    assert "effective-length 12.0%, prefix-difference 3.1%" in text and "keeps `effective-length`" in text
    assert "missing (fidelity did not finish)" in text and "missing (tile-overhead did not finish)" in text
    assert "torch: 2.11.0" in text and "driver: 570.1" in text and "calibrate: ok (40s)" in text


def test_summary_markdown_quotes_the_sweep_parity_and_tile_overhead(tmp_path):
    _fake_run(tmp_path / "kernel-sweep", {
        "backend": "aten-flash", "dtype": "bf16", "multiprocessors": 132, "budget_s": 110.0,
        "skipped": [{"layout": "single", "length": 262144, "heads": 32}],
        "heads_half_by_length": [{"layout": "single", "length": 512, "pass": "fwd", "heads_half": 99.0,
                                  "worst_rel_err": 0.097, "min_heads": 1, "reference_heads": 32,
                                  "min_heads_ratio": 0.037}],
        "joint_heads_half": {"fwd": {"heads_half": 0.3257, "median_rel_err": 0.194, "points": 50}},
        "mixed": [{"length": 16384, "heads": 1, "pass": "fwd", "ratio": 0.887}]})
    for folder, backend in (("fidelity", "aten-flash"), ("fidelity-torch-varlen", "torch-varlen")):
        _fake_run(tmp_path / folder, {
            "backend": backend, "dtype": "bf16", "ref_dtype": "fp64", "fwd_limit": 2.0, "grad_limit": 3.0,
            "worst_ratio": {"pool.out": 0.614, "pool.dq": 0.746}, "all_passed": True, "all_within_2x": True})
    _fake_run(tmp_path / "tile-overhead", {
        "setting": "256k", "profile": "p", "target_ratio": 1.05,
        "methods": {"libra": {"worker": 172, "calls": 4, "runtime_ratio": 1.02, "calls_ratio": 1.004,
                              "one_call_ms": 313.3, "model_err_calls": 0.047}}})
    (tmp_path / "gpu_check.log").write_text("[gpu_check] numba hidden from the steps\n")
    text = gpu_summary_markdown(tmp_path, {}, "GPU check")
    assert "| single | 512 | fwd | 99 | 9.7% | 0.037 (1 vs 32) |" in text
    assert "one c over every single-document length (fwd): 0.3257" in text
    assert "0.887 x its parts run alone" in text and "single 262144x32" in text
    assert "`fidelity/`: backend aten-flash" in text and "`fidelity-torch-varlen/`: backend torch-varlen" in text
    assert "| libra | 172 | 4 | 1.020 | 1.004 | 313.3 | +4.7% |" in text
    assert "numba was hidden" in text and "rich was not installed" not in text


def test_gpu_summary_compares_the_profile_runs_with_the_default(tmp_path):
    import pandas as pd

    def straggler(folder, profile, gain):
        folder.mkdir(parents=True)
        rows = [{"setting": "256k", "method": m, "mean_ms": ms, "mean_speedup": 300.0 / ms}
                for m, ms in (("ulysses", 300.0), ("libra", 100.0), ("libra-adaptive", 100.0 / gain))]
        pd.DataFrame(rows).to_csv(folder / "straggler_summary.csv", index=False)
        (folder / "run.json").write_text(json.dumps({
            "experiment": "straggler", "finished_utc": "2026-01-01T00:00:00", "profile": {"name": profile},
            "config": {"workload": "libra-prod", "jitter": True, "methods": ["ulysses", "libra", "libra-adaptive"]}}))

    straggler(tmp_path / "gpu" / "straggler-libra-prod", "measured", 1.25)
    straggler(tmp_path / "results" / "straggler-extensions", "h100-roce-v2", 1.5)
    res = CliRunner().invoke(main, ["gpu-summary", str(tmp_path / "gpu"), "--results", str(tmp_path / "results")])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "gpu" / "summary.md").read_text()
    assert "| libra-prod | 256k | measured | 3.00x | 3.75x | 1.250 |" in text
    assert "| libra-prod | 256k | h100-roce-v2 | 3.00x | 4.50x | 1.500 |" in text


@pytest.mark.slow
def test_cpu_smoke_pipeline(tmp_path):
    res = _run("--cpu-smoke", str(tmp_path), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = (tmp_path / "summary.md").read_text()
    assert "NOT GPU figures" in text and "median |error|" in text and "All within limits: True" in text
    for step in ("calibrate", "sim-check", "fidelity"):
        assert (tmp_path / step / "run.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the default suite says without CUDA")
def test_the_default_suite_skips_gpu_tests_with_their_reason_not_silently():
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_runtime_kernels.py",
                          "-k", "cuda or gpu"], cwd=root, capture_output=True, text=True, timeout=300)
    assert "skipped" in run.stdout.splitlines()[-1], run.stdout[-2000:]  # not only deselected by a marker
    assert "SKIPPED" in run.stdout and "needs a CUDA device" in run.stdout, run.stdout[-2000:]
