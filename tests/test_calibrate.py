"""`libra-bench calibrate` on CPU (tiny sizes), its fits, the written profile, its CPU-sized sweep, bad input;
GPU run marked."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from experiments.measured.calibrate import (
    CPU_DEFAULTS,
    CalibrateConfig,
    _cpu_sized,
    calibrate,
    fit_heads_half,
    fit_profile,
    piece_points,
)
from experiments.measured.gpu_common import (
    KernelGeometry,
    MeasureOptions,
    TimingOptions,
    device_info,
    input_set_bytes,
    make_inputs,
    resolve_backend,
    resolve_device,
    resolve_dtype,
    rotation_sets,
    time_calls,
    time_whole_sequence,
)
from libra.sim.kernel import KernelModel
from libra.sim.profiles import load_profile
from libra.workload import attention_flops, kv_heads_per_call, sample_area

TINY = ["--device", "cpu", "--lengths", "64,128,256", "--heads", "1,2", "--q-heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--heads-length", "128", "--warmup", "0", "--repeats", "2", "--rotate", "2",
        "--copy-mb", "1", "--no-progress"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is absent")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("calibrate")
    res = CliRunner().invoke(calibrate, [*TINY, "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out, res.output


def test_cli_writes_csv_png_profile_run(tiny_run):
    out, output = tiny_run
    for name in ("calibrate.csv", "calibrate.png", "profile.json", "run.json"):
        assert (out / name).stat().st_size > 0, name
    df = pd.read_csv(out / "calibrate.csv")
    counts = df.groupby("sweep").size().to_dict()
    assert counts == {"launch": 2, "length": 6, "heads": 4, "piece": 12, "copy": 1}
    # the piece sweep: each document's second half and last eighth, FLOPs of those rows only
    pieces = df[(df.sweep == "piece") & (df["pass"] == "fwd")].sort_values(["length", "q_start"])
    assert list(zip(pieces["length"], pieces["q_start"])) == [(64, 32), (64, 56), (128, 64), (128, 112),
                                                              (256, 128), (256, 224)]
    row = pieces.iloc[-1]
    assert row.flops == pytest.approx(attention_flops(sample_area(256) - sample_area(224), 2, 16))
    kern = df[df.sweep.isin(["length", "heads"])]
    assert np.all(kern["ms"] > 0) and np.all(kern["rotation"] >= 1)
    # each Figure 5 curve is normalised to its own best point
    for _, g in kern.groupby(["sweep", "pass"]):
        assert g["normalized"].max() == pytest.approx(1.0)
        assert np.all(g["normalized"] > 0)
    # throughput is FLOPs / time with the FLOPs of libra.workload
    row = df[(df.sweep == "length") & (df["pass"] == "bwd") & (df.length == 256)].iloc[0]
    assert row.flops == pytest.approx(attention_flops(sample_area(256), 2, 16, backward=True))
    assert row.tflops == pytest.approx(row.flops / (row.ms * 1e-3) / 1e12)
    assert df[df.sweep == "copy"]["gbps"].iloc[0] > 0
    assert "Figure 5" in output and "fit: rate_inf" in output


def test_profile_loads_round_trips_and_keeps_base_links(tiny_run):
    out, _ = tiny_run
    data = json.loads((out / "profile.json").read_text())
    prof = load_profile(out / "profile.json")
    assert prof.to_dict() == data
    base = load_profile("h100-roce-v1")
    assert prof.links == base.links and prof.gpus_per_node == base.gpus_per_node
    assert prof.kernel.reference_heads == 2 and prof.kernel.launch_ms > 0
    src = prof.source
    assert src["kernel_backend"] == "cpu-flash" and src["torch"] == torch.__version__
    assert src["calibration_table"]["lengths"] == [64, 128, 256]
    assert "not a link" in src["device_copy"]["meaning"]
    run = json.loads((out / "run.json").read_text())
    assert run["summary"]["backend"] == "cpu-flash" and set(run["summary"]["figure5"]) == {"heads", "length"}


def test_rerun_reuses_finished_points(tiny_run):
    out, _ = tiny_run
    res = CliRunner().invoke(calibrate, [*TINY, "--out", str(out)])
    assert res.exit_code == 0, res.output
    run = json.loads((out / "run.json").read_text())
    assert run["points_computed"] == 0 and run["points_reused"] == 1 + 3 + 2 + 6 + 1


def _synthetic_df(model: KernelModel, cfg: CalibrateConfig) -> pd.DataFrame:
    """Rows calibrate would write if the device followed ``model`` exactly."""
    rows = [{"sweep": "launch", "pass": "fwd", "length": 128, "heads": 1, "ms": model.launch_ms * 1.5}]
    for L in cfg.lengths:
        ms = float(model.document_forward_ms([L], cfg.q_heads, cfg.head_dim)[0])
        rows += [{"sweep": "length", "pass": "fwd", "length": L, "heads": cfg.q_heads, "ms": ms},
                 {"sweep": "length", "pass": "bwd", "length": L, "heads": cfg.q_heads,
                  "ms": float(model.segment_backward_ms(sample_area(L), cfg.q_heads, cfg.head_dim))
                  + model.launch_ms * model.backward_time_ratio}]
    for h in cfg.heads:
        ms = float(model.document_forward_ms([cfg.heads_length], h, cfg.head_dim)[0]) - model.launch_ms
        fl = float(attention_flops(sample_area(cfg.heads_length), h, cfg.head_dim))
        rows.append({"sweep": "heads", "pass": "fwd", "length": cfg.heads_length, "heads": h, "ms": ms,
                     "tflops": fl / (ms * 1e-3) / 1e12})
    rows.append({"sweep": "copy", "pass": "copy", "ms": 1.0, "gbps": 123.0, "bytes": 1e9})
    return pd.DataFrame(rows)


def test_fit_recovers_a_known_kernel_model():
    truth = KernelModel(rate_inf_tflops=400.0, half_length=1500.0, exponent=1.2, launch_ms=0.02,
                        reference_heads=32, heads_half=0.5, backward_time_ratio=2.7)
    cfg = CalibrateConfig(lengths=(512, 1024, 2048, 4096, 8192, 16384, 32768, 65536))
    df = _synthetic_df(truth, cfg)
    info = {"device": "cuda:0", "name": "Fake GPU", "kernel_backend": "torch-varlen", "torch": "x"}
    prof, fit = fit_profile(df, cfg, load_profile("h100-roce-v1"), info, "bf16")
    k = prof.kernel
    assert fit["length_fit_max_rel_err"] < 0.02
    assert k.rate_inf_tflops == pytest.approx(400.0, rel=0.03)
    assert k.half_length == pytest.approx(1500.0, rel=0.1)
    assert k.heads_half == pytest.approx(0.5, rel=0.05)
    assert k.backward_time_ratio == pytest.approx(2.7)
    # the probe's time, capped at half the fastest length point so the fit's time - launch stays > 0
    t_min = float(truth.document_forward_ms([512], 32, 128)[0])
    assert k.launch_ms == pytest.approx(min(0.03, 0.5 * t_min), rel=1e-4)
    assert prof.name == "fake-gpu-torch-varlen-measured"
    assert prof.source["device_copy"]["gbps"] == 123.0


def test_fit_recovers_a_backward_curve_of_its_own():
    # a device whose backward runs relatively slower on short documents (as the CPU kernel does)
    truth = KernelModel(rate_inf_tflops=0.1, half_length=400.0, exponent=0.8, launch_ms=0.1, reference_heads=8,
                        heads_half=0.0, backward_time_ratio=2.0, backward_rate_inf_tflops=0.04,
                        backward_half_length=900.0, backward_exponent=1.1)
    cfg = CalibrateConfig(lengths=(128, 256, 512, 1024, 2048, 4096, 8192), q_heads=8, kv_heads=2, head_dim=64,
                          heads=(1, 2, 4, 8), heads_length=2048)
    prof, fit = fit_profile(_synthetic_df(truth, cfg), cfg, load_profile("h100-roce-v1"), {"name": "cpu"}, "fp32")
    k = prof.kernel
    assert k.has_backward_curve and fit["backward_fit_max_rel_err"] < 0.03
    assert k.backward_rate_inf_tflops == pytest.approx(0.04, rel=0.05)
    assert k.backward_half_length == pytest.approx(900.0, rel=0.15)
    lengths = np.array([128, 8192])
    ratio = k.segment_backward_ms(sample_area(lengths), 8, 64) / k.segment_forward_ms(sample_area(lengths), 8, 64)
    want = truth.segment_backward_ms(sample_area(lengths), 8, 64) / truth.segment_forward_ms(sample_area(lengths), 8, 64)
    np.testing.assert_allclose(ratio, want, rtol=0.05)  # the length dependence survives the fit
    from libra.sim.profiles import profile_from_dict  # noqa: PLC0415

    assert profile_from_dict(json.loads(json.dumps(prof.to_dict()))).kernel == k  # the JSON keeps the curve


def test_fit_heads_half_cases():
    heads = np.array([1, 2, 4, 8, 16, 32])
    rates = heads / (heads + 2.0)
    c, err = fit_heads_half(heads, rates, 32)
    assert c == pytest.approx(2.0, rel=0.01) and err < 1e-3
    c0, _ = fit_heads_half(heads, np.ones(6), 32)  # fewer heads not slower: no heads effect
    assert c0 == 0.0
    with pytest.raises(ValueError, match="reference heads 64"):
        fit_heads_half(heads, rates, 64)
    with pytest.raises(ValueError, match="positive"):
        fit_heads_half(heads, -rates, 32)


@pytest.mark.parametrize("kwargs, match", [
    ({"lengths": (0, 64, 128)}, "lengths must be positive, got 0"),
    ({"lengths": (64, 64, 128)}, ">= 3 distinct"),
    ({"heads": (3,), "q_heads": 4, "kv_heads": 2}, "heads per call 3"),
    ({"q_heads": 6, "kv_heads": 4}, "kv_heads=4 must divide q_heads=6"),
    ({"repeats": 0}, "repeats must be a positive integer"),
    ({"warmup": -1}, "warmup"),
    ({"links": "yes"}, "links must be True or False"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CalibrateConfig(**kwargs)


@pytest.mark.parametrize("args, match", [
    (["--backend", "nope"], "unknown attention backend 'nope'"),
    (["--backend", "torch-varlen"], "needs a CUDA device"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["--lengths", "0,64"], "must be >= 1"),
    (["--heads", "3"], "heads per call 3"),
    (["--base-profile", "no-such-profile"], "unknown hardware profile"),
])
def test_cli_bad_input(args, match, tmp_path):
    res = CliRunner().invoke(calibrate, [*TINY, *args, "--out", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert match in res.output


@NO_CUDA
def test_cuda_requested_without_cuda_is_a_clear_error(tmp_path):
    res = CliRunner().invoke(calibrate, [*TINY, "--device", "cuda", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "CUDA is not available" in res.output
    with pytest.raises(ValueError, match="'cuda:0' requested but CUDA is not available"):
        resolve_device("cuda:0")


def test_helpers():
    assert kv_heads_per_call(16, 8) == 2 and kv_heads_per_call(4, 8) == 1
    with pytest.raises(ValueError, match="3 query heads"):
        kv_heads_per_call(3, 2)
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_backend("auto", cpu).name == "cpu-flash"
    assert device_info(cpu)["device"] == "cpu"
    calls = []
    ms = time_calls(calls.append, cpu, warmup=2, repeats=3)
    assert calls == [0, 1, 2, 3, 4] and ms.shape == (3,) and np.all(ms >= 0)
    with pytest.raises(ValueError, match="repeats >= 1"):
        time_calls(calls.append, cpu, warmup=0, repeats=0)


def test_input_sets_and_the_ideal_follow_their_kernel_geometry_and_timing():
    from libra.runtime.kernels import Segments

    cpu = torch.device("cpu")
    seg = Segments([3, 5], [3, 5])
    geom = KernelGeometry(4, 2, 8, torch.float64, cpu)
    (a,), (b,) = make_inputs(seg, geom, 1, seed=7), make_inputs(seg, geom, 1, seed=7)
    assert a.q.shape == (8, 4, 8) and a.k.shape == (8, 2, 8) and a.q.dtype == torch.float64
    assert torch.equal(a.v, b.v) and a.out is None  # seeded; no backend, no forward
    per = input_set_bytes(seg, geom)
    assert per == (3 * 8 * 4 + 2 * 8 * 2) * 8 * 8 + 8 * 4 * 4  # q, dout, out and k, v; lse in float32
    assert rotation_sets(seg, geom, 4, 2 * per) == 2 and rotation_sets(seg, geom, 4, 1) == 1
    with pytest.raises(ValueError, match="head_dim must be a positive integer"):
        KernelGeometry(4, 2, 0, torch.float32, cpu)
    with pytest.raises(ValueError, match="repeats >= 1"):
        TimingOptions(warmup=0, repeats=0)
    fwd_only = TimingOptions(warmup=1, repeats=2, backward=False)
    t = time_whole_sequence(resolve_backend("auto", cpu), [16, 16], replace(geom, dtype=torch.float32), fwd_only, 0)
    assert t["ms"] > 0 and t["fwd_ms"] > 0 and t["bwd_ms"] == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibrate_on_cuda(tmp_path):
    args = ["--device", "cuda", "--lengths", "512,1024,2048,4096", "--heads", "1,2,4,8", "--q-heads", "8",
            "--kv-heads", "2", "--head-dim", "128", "--heads-length", "2048", "--repeats", "5", "--copy-mb", "256",
            "--no-progress", "--out", str(tmp_path)]
    res = CliRunner().invoke(calibrate, args)
    assert res.exit_code == 0, res.output
    prof = load_profile(tmp_path / "profile.json")
    assert prof.source["kernel_backend"] in ("flash-attn", "torch-varlen", "math")
    assert prof.kernel.rate_inf_tflops > 1.0 and prof.source["device_copy"]["gbps"] > 10


@pytest.mark.slow
def test_links_fit_the_intra_node_class_to_a_two_rank_probe(tmp_path):
    """``--links`` spawns two gloo ranks, times a ping-pong per size and replaces the ``nvlink`` class
    (the only one local ranks use) with the fitted latency and bandwidth; the others stay the base's."""
    res = CliRunner().invoke(calibrate, [*TINY, "--links", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "calibrate.csv")
    link = df[df.sweep == "link"].sort_values("bytes")
    assert len(link) == 5 and set(link["pass"]) == {"gloo"} and np.all(link["ms"] > 0)
    assert link["ms"].iloc[-1] > link["ms"].iloc[0]  # 32 MiB take longer than 4 KiB
    prof, base = load_profile(tmp_path / "profile.json"), load_profile("h100-roce-v1")
    run = json.loads((tmp_path / "run.json").read_text())
    fit = run["summary"]["fit"]
    assert prof.links["nvlink"].bandwidth_gbps == pytest.approx(fit["link_bandwidth_gbps"], rel=1e-5)
    assert prof.links["nvlink"].latency_ms == pytest.approx(fit["link_latency_ms"], rel=1e-5, abs=1e-12)
    assert prof.links["nvlink"].port == base.links["nvlink"].port
    assert prof.links["roce"] == base.links["roce"] and prof.links["inter_supernode"] == base.links["inter_supernode"]
    assert "calibrate --links" in prof.source["links"] and "link (nvlink class" in res.output


def test_fit_latency_bandwidth_recovers_a_link_and_refuses_bad_points():
    from experiments.common.link_fit import fit_latency_bandwidth  # noqa: PLC0415

    b = np.array([4e3, 6.4e4, 1e6, 1.6e7, 6.4e7])
    bw, lat, err = fit_latency_bandwidth(b, 0.05 + b / 2e6)  # 2 GB/s = 2e6 bytes per ms, 50 us
    assert (bw, lat) == (pytest.approx(2.0), pytest.approx(0.05)) and err < 1e-9
    big = np.array([1e6, 4e6, 1.6e7])
    bw, lat, _ = fit_latency_bandwidth(big, big / 4e6 - 0.01)  # a negative intercept: refitted through 0
    assert lat == 0.0 and bw == pytest.approx(4.0, rel=0.05)
    for args in (([1e3], [1.0]), ([1e3, 1e3], [1.0, 2.0]), ([1e3, 2e3], [1.0, -1.0]), ([1e3, 2e3], [1.0])):
        with pytest.raises(ValueError):
            fit_latency_bandwidth(*args)


def test_links_on_one_gpu_is_refused_before_any_measurement(tmp_path, monkeypatch):
    import experiments.measured.link_probe as probe  # noqa: PLC0415

    monkeypatch.setattr(probe.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="two GPUs"):
        probe.check_link_probe("cuda")
    probe.check_link_probe("cpu")
    with pytest.raises(ValueError, match="cpu or cuda"):
        probe.check_link_probe("mps")


def test_links_check_runs_before_the_sweep(tmp_path, monkeypatch):
    import experiments.measured.calibrate as cal  # noqa: PLC0415
    import experiments.measured.link_probe as probe  # noqa: PLC0415

    def refuse(device_type):
        raise ValueError("no link here")

    def measured(*args, **kwargs):
        raise AssertionError("the sweep ran before the link check")

    monkeypatch.setattr(probe, "check_link_probe", refuse)
    monkeypatch.setattr(cal, "kernel_point", measured)
    cfg = CalibrateConfig(lengths=(64, 128, 256), heads=(1,), q_heads=1, kv_heads=1, head_dim=16, heads_length=64,
                          warmup=0, repeats=1, rotate=1, copy_mb=1, links=True)
    with pytest.raises(ValueError, match="no link here"):
        cal.run_calibrate(cfg, MeasureOptions(device="cpu", out=str(tmp_path)))


@pytest.mark.parametrize("truth", ["effective-length", "prefix-difference"])
def test_the_piece_sweep_finds_the_rule_the_device_follows(truth):
    device = KernelModel(rate_inf_tflops=0.1, half_length=3000.0, exponent=0.8, launch_ms=0.01, reference_heads=8,
                         heads_half=0.0, backward_time_ratio=2.0, piece_pricing=truth)
    cfg = CalibrateConfig(lengths=(128, 256, 512, 1024, 2048, 4096, 8192), q_heads=8, kv_heads=2, head_dim=64,
                          heads=(1, 2, 4, 8), heads_length=2048)
    rows = []
    for L, a in piece_points(cfg.lengths):
        area = float(sample_area(L) - sample_area(a))
        for pas, price, launch in (("fwd", device.segment_forward_ms, 0.01), ("bwd", device.segment_backward_ms, 0.02)):
            rows.append({"sweep": "piece", "pass": pas, "length": L, "q_start": a, "heads": 8,
                         "ms": float(price(area, 8, 64, L)) + launch})
    df = pd.concat([_synthetic_df(device, cfg), pd.DataFrame(rows)], ignore_index=True)
    base = load_profile("h100-roce-v1")
    # --piece-pricing measured keeps the rule with the smaller median error: the device's
    prof, fit = fit_profile(df, replace(cfg, piece_pricing="measured"), base, {"name": "cpu"}, "fp32")
    rec = prof.source["piece_pricing"]
    assert prof.kernel.piece_pricing == fit["piece_pricing"] == rec["rule"] == rec["smaller_median_error"] == truth
    assert rec["measured"] and rec["chosen_by"] == "--piece-pricing measured"
    assert rec["length"][-2:] == [8192, 8192] and rec["q_start"][-2:] == [4096, 7168] and len(rec["errors"]) == 4
    other = next(r for r in rec["median_abs_err"] if r != truth)
    assert rec["median_abs_err"][truth] < 0.01 < rec["median_abs_err"][other]
    # the default keeps effective-length whatever the sweep says, and records what it said
    prof, _ = fit_profile(df, cfg, base, {"name": "cpu"}, "fp32")
    assert prof.kernel.piece_pricing == "effective-length" and prof.source["piece_pricing"]["smaller_median_error"] == truth
    # without a piece sweep (e.g. a profile measured before it existed) the rule is marked unmeasured
    prof, _ = fit_profile(_synthetic_df(device, cfg), replace(cfg, piece_pricing="measured"), base, {"name": "cpu"},
                          "fp32")
    assert prof.kernel.piece_pricing == "effective-length" and not prof.source["piece_pricing"]["measured"]


def test_piece_pricing_choice_is_checked():
    with pytest.raises(ValueError, match="piece_pricing must be one of"):
        CalibrateConfig(piece_pricing="tokens")
    res = CliRunner().invoke(calibrate, [*TINY, "--piece-pricing", "tokens"])
    assert res.exit_code != 0 and "tokens" in res.output


def test_heads_sweep_packs_documents_into_each_call(tmp_path):
    cfg = CalibrateConfig(lengths=(64, 128, 256), heads=(1, 2), q_heads=2, kv_heads=1, head_dim=16, heads_length=128,
                          heads_tokens=512, warmup=0, repeats=1, rotate=1, copy_mb=1)
    assert cfg.heads_documents == 4
    assert CalibrateConfig(heads_length=16384, heads_tokens=1000).heads_documents == 1
    import torch

    from experiments.measured.calibrate import kernel_point
    from libra.runtime.kernels import get_backend

    rows = kernel_point({"sweep": "heads", "length": 128, "heads": 2, "documents": 4}, get_backend("math"), cfg,
                        torch.device("cpu"), torch.float32)
    one = kernel_point({"sweep": "heads", "length": 128, "heads": 2}, get_backend("math"), cfg, torch.device("cpu"),
                       torch.float32)
    assert rows[0]["documents"] == 4 and one[0]["documents"] == 1
    assert rows[0]["flops"] == pytest.approx(4 * one[0]["flops"])  # four documents' work in one call
    with pytest.raises(ValueError, match="heads_tokens must be a positive integer"):
        CalibrateConfig(heads_tokens=0)


# --device cpu sizes its sweep for a CPU profile

CPU_ORDER = list(CPU_DEFAULTS)
GPU_VALUES = ([1024, 2048, 4096], [1, 2, 4, 8, 16, 32], 32, 4, 128, 16384, 65536, 1024, 3, 10, 4)


def _sized(args, device):
    ctx = calibrate.make_context("calibrate", list(args))
    with ctx:
        return dict(zip(CPU_ORDER, _cpu_sized(ctx, device, *GPU_VALUES)))


def test_cpu_device_gets_cpu_sizes_unless_given():
    got = _sized(["--device", "cpu"], "cpu")
    assert got == CPU_DEFAULTS
    got = _sized(["--device", "cpu", "--head-dim", "128", "--repeats", "10"], "cpu")
    assert got["head_dim"] == 128 and got["repeats"] == 10 and got["q_heads"] == 8


def test_gpu_device_keeps_its_sizes():
    assert tuple(_sized(["--device", "cuda"], "cuda").values()) == GPU_VALUES
