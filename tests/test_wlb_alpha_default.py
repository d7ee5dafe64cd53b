"""WLB-LLM's token cap defaults to 1x the average tokens per bucket.

DistCA's public WLB-LLM planner caps a bucket at ``2 * S * batch / DP * alpha_factor`` tokens for the
``2 * batch`` sequences it draws per step, i.e. ``alpha_factor`` times the average, and its run
scripts' ``--alpha-factor`` defaults to 1.0.
"""

import numpy as np
import pytest

import baselines.wlbllm as wlb
from baselines.registry import get_planner
from libra.config import ParallelConfig
from libra.data.packing import PackedSequence
from libra.workload import AttentionShape


def test_the_default_alpha_is_one():
    assert wlb.DEFAULT_ALPHA == 1.0 and wlb.WlbLlmConfig().alpha == 1.0
    assert get_planner("wlb-llm").config.alpha == 1.0
    doc = wlb.WlbLlmConfig.__doc__ + (wlb.__doc__ or "")
    assert "default 1" in doc and "default 2" not in doc


def test_the_default_cap_is_the_average_bucket():
    par = ParallelConfig(dp=2, cp=2, gbs=4, seq_len=64)
    window = [PackedSequence(i, np.array(r), np.arange(len(r)) + 10 * i)
              for i, r in enumerate([[64], [32, 32], [16] * 4, [8] * 8])]
    (plan, *_rest) = get_planner("wlb-llm", rejoin="none").plan_window(window, par, AttentionShape(4, 2, 8))
    assert plan.meta["alpha"] == 1.0 and plan.meta["lmax_tokens"] == pytest.approx(64.0)  # 256 tokens / 4 buckets


def test_the_default_cap_binds_at_the_average():
    lengths = np.array([7, 4, 4, 1])                       # 16 tokens over 2 buckets: average 8
    one = [lengths[b].sum() for b in wlb.wlb_pack(lengths, 2, bp=1)]
    two = [lengths[b].sum() for b in wlb.wlb_pack(lengths, 2, bp=1, alpha=2.0)]
    assert sorted(one) == [8, 8]                           # 1 goes to the 7-bucket: 4 + 4 + 1 = 9 > 8
    assert max(two) == 9                                   # 2x the average lets it through
