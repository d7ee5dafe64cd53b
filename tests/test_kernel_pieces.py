"""Piece pricing of the kernel model (``KernelModel.piece_pricing``): a tile's segment is query rows
``[kv - q, kv)`` of a sample; ``prefix-difference`` prices it as the whole document's ``T(kv) -
T(kv - q)``, ``effective-length`` at ``L_eff = sqrt(2 area)``; calibrate measures which fits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.plan import SequenceLayout, TileTable
from libra.sim.kernel import PIECE_PRICINGS, KernelModel, choose_piece_pricing, piece_pricing_errors
from libra.sim.profiles import load_profile, profile_from_dict
from libra.tap.weights import kernel_time_weights
from libra.workload import AttentionShape, attention_flops, sample_area

# a CPU-like curve with its own backward curve, and the H100 profile's (backward = ratio x forward)
CPU = KernelModel(rate_inf_tflops=0.4, half_length=7000.0, exponent=0.6, launch_ms=0.1, reference_heads=8,
                  heads_half=0.06, backward_time_ratio=2.4, backward_rate_inf_tflops=0.07,
                  backward_half_length=16000.0, backward_exponent=0.5, piece_pricing="prefix-difference")
H100 = replace(load_profile("h100-roce-v1").kernel, piece_pricing="prefix-difference")


def _pieces(cuts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Areas and kv_len of the pieces ``[cuts[i], cuts[i + 1])`` of one sample."""
    a, b = np.array(cuts[:-1]), np.array(cuts[1:])
    return (sample_area(b) - sample_area(a)).astype(np.float64), b


@pytest.mark.parametrize("kernel", [CPU, H100], ids=["cpu-curve", "h100"])
def test_whole_samples_price_the_same_under_both_rules(kernel):
    lengths = np.array([1, 128, 1000, 8192, 1 << 20])
    area = sample_area(lengths).astype(np.float64)
    old = replace(kernel, piece_pricing="effective-length")
    for price in ("segment_forward_ms", "segment_backward_ms"):
        np.testing.assert_array_equal(getattr(kernel, price)(area, 8, 64, lengths), getattr(old, price)(area, 8, 64))
        np.testing.assert_array_equal(getattr(kernel, price)(area, 8, 64), getattr(old, price)(area, 8, 64, lengths))


@settings(max_examples=60, deadline=None)
@given(length=st.integers(2, 1 << 20), data=st.data())
def test_pieces_of_a_sample_add_up_to_the_sample(length, data):
    inner = data.draw(st.lists(st.integers(1, length - 1), max_size=12, unique=True))
    area, kv = _pieces([0, *sorted(inner), length])
    for kernel in (CPU, H100):
        for price in (kernel.segment_forward_ms, kernel.segment_backward_ms):
            whole = float(price(float(sample_area(length)), 4, 64))
            assert float(np.sum(price(area, 4, 64, kv))) == pytest.approx(whole, rel=1e-9)


def test_a_late_block_streams_at_a_long_documents_rate():
    area, kv = _pieces([0, 1024, 7168, 8192])
    pd = CPU.segment_forward_ms(area, 8, 64, kv)
    el = replace(CPU, piece_pricing="effective-length").segment_forward_ms(area, 8, 64, kv)
    assert pd[0] == el[0]  # the first block is a whole document
    assert pd[2] < el[2] * 0.9  # the last block: its prefix, not its own 1024 rows, sets its rate
    doc = CPU.segment_forward_ms(float(sample_area(8192)), 8, 64)
    assert pd[2] / area[2] < doc / sample_area(8192)  # faster per pair than the whole 8K document


def test_prefix_difference_never_beats_the_best_rate():
    # a curve steeper than L^2 would make T(kv) - T(kv - q) smaller than the FLOPs at the best rate
    steep = replace(CPU, exponent=3.0, half_length=50000.0, heads_half=0.0)
    area, kv = _pieces([0, 2000, 30000, 30100])
    floor = attention_flops(area, 1, 64) * 8 / (steep.rate_inf_tflops * 1e12) * 1e3
    t = steep.segment_forward_ms(area, 8, 64, kv)
    assert np.all(t >= floor * (1 - 1e-12)) and t[2] == pytest.approx(floor[2])


def test_bad_piece_input_and_rule_are_refused():
    with pytest.raises(ValueError, match="exceeds that of its whole key prefix"):
        CPU.segment_forward_ms([float(sample_area(100))], 8, 64, [99])
    with pytest.raises(ValueError, match="piece_pricing must be one of"):
        replace(CPU, piece_pricing="tokens")


def test_profile_json_records_the_rule_only_when_not_the_default():
    base = load_profile("h100-roce-v1")
    assert "piece_pricing" not in base.kernel.to_dict()
    d = replace(base, kernel=H100).to_dict()
    assert d["kernel"]["piece_pricing"] == "prefix-difference"
    assert profile_from_dict(d).kernel.piece_pricing == "prefix-difference"


def test_kernel_time_weights_of_one_samples_tiles_add_up_to_the_sample():
    seq = SequenceLayout(seq_id=0, dp_rank=0, sample_lengths=(6000, 2192), holder_start=(0,), holder_end=(8192,),
                         holder_worker=(0,))
    starts = np.arange(0, 8192, 1024)
    n = len(starts)
    tiles = TileTable(seq=np.zeros(n), q_start=starts, q_end=starts + 1024, head_start=np.zeros(n),
                      head_end=np.full(n, 8), q_home=np.zeros(n), dest=np.zeros(n), flops=np.zeros(n))
    shape = AttentionShape(8, 2, 64, 4)
    w = kernel_time_weights(tiles, [seq], shape, CPU)
    whole = CPU.segment_forward_ms(sample_area(np.array([6000, 2192])).astype(np.float64), 8, 64)
    whole = whole + CPU.segment_backward_ms(sample_area(np.array([6000, 2192])).astype(np.float64), 8, 64)
    assert w.sum() == pytest.approx(whole.sum(), rel=1e-9)
    old = kernel_time_weights(tiles, [seq], shape, replace(CPU, piece_pricing="effective-length"))
    assert old.sum() > w.sum() * 1.05  # L_eff overprices the blocks after the first of each sample


@pytest.mark.parametrize("truth", PIECE_PRICINGS)
def test_the_measured_rule_is_the_one_chosen(truth):
    device = replace(CPU, piece_pricing=truth)
    q0 = np.arange(1, 8) * 1024
    area, kv = (sample_area(q0 + 1024) - sample_area(q0)).astype(np.float64), q0 + 1024
    rng = np.random.default_rng(0)
    errors = []
    for backward, price in ((False, device.segment_forward_ms), (True, device.segment_backward_ms)):
        launch = device.launch_ms * (device.backward_time_ratio if backward else 1.0)
        measured = (price(area, 8, 64, kv) + launch) * rng.uniform(0.97, 1.03, len(q0))  # 3% noise
        errors.append(piece_pricing_errors(device, q0, kv, measured, 8, 64, backward=backward))
    rule, med = choose_piece_pricing(errors)
    assert rule == truth and med[truth] < 0.03 < max(med.values())


def test_piece_errors_refuse_bad_measurements():
    with pytest.raises(ValueError, match="matching 1-D"):
        piece_pricing_errors(CPU, [1, 2], [4], [1.0], 8, 64)
    with pytest.raises(ValueError, match="0 <= q_start < kv_len"):
        piece_pricing_errors(CPU, [4], [4], [1.0], 8, 64)
    with pytest.raises(ValueError, match="positive time"):
        piece_pricing_errors(CPU, [1], [4], [0.0], 8, 64)
