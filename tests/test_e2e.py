"""End-to-end step-time model: 1F1B schedule, per-layer terms, DP synchronisation, model shapes."""

from __future__ import annotations

import numpy as np
import pytest

from baselines.registry import get_planner
from libra.config import ParallelConfig
from libra.data.packing import PackedSequence
from libra.sim.e2e import E2EConfig, StepModel, one_f_one_b
from libra.sim.models import MODELS, ModelShape, get_model
from libra.sim.profiles import load_profile

TINY = ModelShape("tiny", hidden=256, layers=4, num_q_heads=8, num_kv_heads=2, head_dim=32, ffn=512, vocab_size=1000)
TINY_MOE = ModelShape("tiny-moe", hidden=256, layers=4, num_q_heads=8, num_kv_heads=2, head_dim=32, num_experts=8,
                      top_k=2, expert_ffn=128, vocab_size=1000)


def _window(lengths_per_seq):
    return [PackedSequence(i, np.array(ls), np.arange(len(ls)) + 100 * i) for i, ls in enumerate(lengths_per_seq)]


def test_1f1b_matches_closed_form_and_penalises_a_slow_microbatch():
    f = np.full((4, 6), 2.0)
    b = np.full((4, 6), 3.0)
    assert one_f_one_b(f, b) == pytest.approx((6 + 4 - 1) * 5.0)
    assert one_f_one_b(f[:1], b[:1]) == pytest.approx(6 * 5.0)  # PP = 1: plain sum
    slow_f, slow_b = f.copy(), b.copy()
    slow_f[:, 2] *= 5
    slow_b[:, 2] *= 5
    # the slow microbatch costs every stage: more than its own extra work on one stage
    assert one_f_one_b(slow_f, slow_b) - one_f_one_b(f, b) > 4 * 5.0
    assert one_f_one_b(f, b, p2p_ms=1.0) > one_f_one_b(f, b)
    with pytest.raises(ValueError, match="must both be"):
        one_f_one_b(f, b[:, :3])


def test_step_terms_balanced_window_and_linear_term_by_hand():
    prof = load_profile()
    par = ParallelConfig(dp=2, cp=2, gbs=4, seq_len=8192)
    sm = StepModel(E2EConfig(TINY, par), prof)
    win = _window([[4096, 4096]] * 4)
    st = sm.step(get_planner("ulysses").plan_window(win, par, TINY.attention_shape))
    assert st.tokens == 4 * 8192 and st.gpus == 4
    assert st.step_ms == pytest.approx(st.pipeline_ms + st.grad_sync_ms)
    assert np.allclose(st.replica_ms, st.replica_ms[0])  # identical sequences -> identical replicas
    rate = prof.peak_tflops * 1e9 * 0.5
    assert st.terms.linear_fwd[0, 0] == pytest.approx(4096 * TINY.linear_flops_per_token() / rate)
    assert (st.terms.attention_fwd > 0).all() and (st.terms.attention_bwd > st.terms.attention_fwd).all()
    assert st.terms.moe_a2a_fwd.sum() == 0  # dense model
    assert st.tokens_per_gpu_s == pytest.approx(st.tokens / (st.step_ms / 1e3) / 4)


def test_skewed_window_libra_shortens_the_step_and_moe_adds_all_to_all():
    prof = load_profile()
    par = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=65536)
    # two sequences hold one long sample each, the rest many short ones: the baseline's DP ranks skew
    win = _window([[65536], [65536]] + [[1024] * 64] * 6)
    uly = StepModel(E2EConfig(TINY, par), prof).step(get_planner("ulysses").plan_window(win, par, TINY.attention_shape))
    lib_planner = get_planner("libra", pool_size=4, block_size=4096, head_split=2, pipeline_chunks=2)
    lib = StepModel(E2EConfig(TINY, par), prof).step(lib_planner.plan_window(win, par, TINY.attention_shape))
    assert uly.replica_ms.max() / uly.replica_ms.min() > 1.5
    assert lib.step_ms < uly.step_ms
    moe = StepModel(E2EConfig(TINY_MOE, par), prof).step(get_planner("ulysses").plan_window(win, par, TINY_MOE.attention_shape))
    assert (moe.terms.moe_a2a_fwd > 0).all()


def test_pipeline_and_grad_sync_terms():
    prof = load_profile()
    win = _window([[8192]] * 4)
    one = ParallelConfig(dp=1, cp=2, gbs=4, seq_len=8192)
    sm1 = StepModel(E2EConfig(TINY, one), prof)
    pp2 = ParallelConfig(dp=1, cp=2, gbs=4, seq_len=8192, pp=2)
    sm2 = StepModel(E2EConfig(TINY, pp2), prof)
    plans = get_planner("ulysses").plan_window(win, one, TINY.attention_shape)
    s1, s2 = sm1.step(plans), sm2.step(get_planner("ulysses").plan_window(win, pp2, TINY.attention_shape))
    assert s2.stage_fwd_ms.shape == (2, 1, 4) and s2.bubble_ms > 0
    assert s2.pipeline_ms < s1.pipeline_ms  # half the layers per stage, overlapped across stages
    big = StepModel(E2EConfig(TINY, ParallelConfig(dp=8, cp=2, gbs=8, seq_len=8192)), prof)
    assert big.grad_sync_ms() > sm1.grad_sync_ms() > 0
    assert E2EConfig(TINY, pp2, layers=3).stage_layers().tolist() == [2, 1]


def test_model_shapes_match_public_sizes():
    counts = {n: m.layers * (m.attn_proj_params + m.mlp_params) + 2 * m.hidden * m.vocab_size
              for n, m in MODELS.items()}
    assert counts["qwen3-8b"] == pytest.approx(8.19e9, rel=0.01)
    assert counts["qwen3-30b-a3b"] == pytest.approx(30.5e9, rel=0.01)
    assert counts["qwen3-235b-a22b"] == pytest.approx(235e9, rel=0.01)
    m = get_model("qwen3-30b-a3b")
    active = m.layers * m.linear_flops_per_token() / 2 + 2 * m.hidden * m.vocab_size
    assert active == pytest.approx(3.35e9, rel=0.02)


@pytest.mark.parametrize("build, match", [
    (lambda: get_model("llama"), "unknown model 'llama'"),
    (lambda: ModelShape("x", 64, 2, 4, 3, 16, ffn=8), "num_kv_heads=3 must divide"),
    (lambda: ModelShape("x", 64, 2, 4, 2, 16), "needs a dense ffn or routed experts"),
    (lambda: ModelShape("x", 64, 2, 4, 2, 16, num_experts=4, top_k=5, expert_ffn=8), "top_k=5"),
    (lambda: E2EConfig(TINY, ParallelConfig(1, 1, 1, 8), layers=9), "layers=9"),
    (lambda: E2EConfig(TINY, ParallelConfig(1, 1, 1, 8), linear_mfu=1.5), "linear_mfu=1.5"),
    (lambda: E2EConfig(TINY, ParallelConfig(1, 1, 1, 8), ep=0), "ep=0"),
])
def test_bad_shapes_and_configs(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_step_rejects_wrong_plan_count():
    prof = load_profile()
    par = ParallelConfig(dp=2, cp=2, gbs=4, seq_len=8192)
    plans = get_planner("ulysses").plan_window(_window([[8192]] * 4), par, TINY.attention_shape)
    with pytest.raises(ValueError, match="expected GA=2"):
        StepModel(E2EConfig(TINY, par), prof).step(plans[:1])
