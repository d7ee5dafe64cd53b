"""Hardware profiles: the default profile's fit to the public FA2 table, loading and validation."""

import json

import numpy as np
import pytest

from libra.sim.kernel import KernelModel, fit_length_efficiency
from libra.sim.profiles import DEFAULT_PROFILE, available_profiles, load_profile, profile_from_dict

FA2_H100 = {1024: 0.13, 4096: 1.06, 8192: 3.7, 16384: 13.5, 32768: 51.9, 65536: 206.0}
"""DESIGN.md sec. 5: FlashAttention-2 varlen causal forward, H100, 64 q heads, head_dim 128."""


def test_default_profile_reproduces_fa2_table_within_2_percent():
    prof = load_profile(DEFAULT_PROFILE)
    lengths = np.array(list(FA2_H100))
    model = prof.kernel.document_forward_ms(lengths, heads=64, head_dim=128)
    rel = np.abs(model / np.array(list(FA2_H100.values())) - 1)
    assert rel.max() < 0.02, rel
    # the asymptote is ~340-350 TFLOP/s and 1K runs at about 130 TFLOP/s, as the table says
    assert 330 < prof.kernel.rate_inf_tflops < 370
    flops_1k = 4 * 1024 * 1025 / 2 * 64 * 128
    assert 120 < flops_1k / (model[0] * 1e9) < 140


def test_refit_gives_the_profile_parameters():
    prof = load_profile(DEFAULT_PROFILE)
    table = prof.source["calibration_table"]
    rate, half, p, err = fit_length_efficiency(table["lengths"], table["times_ms"], table["heads"],
                                               table["head_dim"], prof.kernel.launch_ms)
    assert rate == pytest.approx(prof.kernel.rate_inf_tflops, rel=0.01)
    assert half == pytest.approx(prof.kernel.half_length, rel=0.02)
    assert p == pytest.approx(prof.kernel.exponent, abs=0.02)
    assert err < 0.01


def test_fit_rejects_bad_tables():
    with pytest.raises(ValueError, match=">= 3"):
        fit_length_efficiency([1024, 2048], [0.1, 0.3], 64, 128)
    with pytest.raises(ValueError, match="exceed launch_ms"):
        fit_length_efficiency([1024, 2048, 4096], [0.1, 0.3, -1.0], 64, 128)


def test_profile_contents_and_roundtrip(tmp_path):
    prof = load_profile(DEFAULT_PROFILE)
    assert DEFAULT_PROFILE in available_profiles()
    assert prof.gpus_per_node == 8 and prof.nodes_per_supernode == 8
    assert prof.links["nvlink"].bandwidth_gbps == pytest.approx(450)
    assert prof.links["roce"].bandwidth_gbps == pytest.approx(50)  # 400 Gb/s
    assert prof.links["inter_supernode"].bandwidth_gbps < prof.links["roce"].bandwidth_gbps
    assert prof.links["roce"].port == prof.links["inter_supernode"].port != prof.links["nvlink"].port
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(prof.to_dict()))
    again = load_profile(path)
    assert again.to_dict() == prof.to_dict()
    assert load_profile(prof) is prof


def test_heads_factor_is_one_at_reference_and_lower_below():
    assert load_profile(DEFAULT_PROFILE).kernel.heads_efficiency(2) == pytest.approx(1.0)  # default: none
    k = KernelModel(350.0, 1500.0, 1.0, 0.0, 64, 0.25, 2.9)
    assert k.heads_efficiency(64) == pytest.approx(1.0)
    assert 0.85 < k.heads_efficiency(4) < 1.0
    assert k.heads_efficiency(2) < k.heads_efficiency(4)


def _raw():
    return load_profile(DEFAULT_PROFILE).to_dict()


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("links"), r"missing field\(s\) \['links'\]"),
    (lambda d: d.pop("kernel"), "missing field"),
    (lambda d: d["links"]["roce"].update(bandwidth_gbps=-5), r"links\[.roce.\]: link.bandwidth_gbps must be a number > 0, got -5"),
    (lambda d: d["links"]["nvlink"].update(latency_ms=-1), "latency_ms must be a number >= 0"),
    (lambda d: d["links"].pop("inter_supernode"), "lacks link classes"),
    (lambda d: d["kernel"].update(half_length=0), "half_length must be a number > 0"),
    (lambda d: d["kernel"].update(bogus=1), "unexpected keyword"),
    (lambda d: d.update(gpus_per_node=0), "gpus_per_node must be a positive integer"),
    (lambda d: d.update(schema=99), "schema 99 not supported"),
    (lambda d: d["variability"].update(sigma_gpu=-0.1), "sigma_gpu"),
    (lambda d: d["kernel"].update(rate_inf_tflops=5000.0), "exceeds peak_tflops"),
])
def test_invalid_profiles_raise_clear_errors(mutate, match):
    d = _raw()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        profile_from_dict(d, origin="test.json")


def test_bad_files_and_names(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown hardware profile 'a100-nope'"):
        load_profile("a100-nope")
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_profile(arr)


def test_kernel_model_validation():
    with pytest.raises(ValueError, match="backward_time_ratio"):
        KernelModel(300.0, 1000.0, 1.0, 0.0, 64, 0.25, 0.0)
