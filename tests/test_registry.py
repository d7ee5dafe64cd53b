"""The planner registry: names, options, errors, and the Planner interface every method exposes."""

import pytest

from baselines.registry import PLANNERS, Planner, get_planner
from libra.config import ParallelConfig
from libra.data.packing import PackedSequence
from libra.workload import AttentionShape

NAMES = ["ulysses", "wlb-llm", "distca", "libra-tap", "libra-tap-vrsp", "libra", "libra-kt"]


def test_registry_lists_every_method():
    assert list(PLANNERS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_each_planner_has_the_interface(name):
    planner = get_planner(name)
    assert isinstance(planner, Planner)
    assert planner.name == name
    assert planner.pipeline_chunks == (4 if name in ("distca", "libra", "libra-kt") else 1)
    assert callable(planner.plan_window)


def test_unknown_name_lists_the_registered_names():
    with pytest.raises(ValueError, match="unknown planner 'ring'.*ulysses, wlb-llm, distca, libra-tap"):
        get_planner("ring")


def test_unknown_option_is_a_value_error():
    with pytest.raises(ValueError, match="takes no option"):
        get_planner("ulysses", block_size=4096)
    with pytest.raises(ValueError, match="takes no option.*pipeline_chunks"):
        get_planner("libra-tap", pipeline_chunks=4)     # TAP-only variants never overlap
    with pytest.raises(ValueError, match="takes no option.*pool_size"):
        get_planner("distca", pool_size=8)               # DistCA's pool is always DP


@pytest.mark.parametrize("name,opts,match", [
    ("libra", {"tau": -0.1}, "tau must be a number >= 0"),
    ("libra", {"pipeline_chunks": 0}, "pipeline_chunks must be a positive integer"),
    ("libra-tap", {"block_size": 0}, "block_size must be a positive integer"),
    ("distca", {"head_split": -1}, "head_split must be a positive integer"),
])
def test_bad_option_values(name, opts, match):
    with pytest.raises(ValueError, match=match):
        get_planner(name, **opts)


def test_options_reach_the_planner():
    planner = get_planner("libra", pipeline_chunks=2, pool_size=4)
    assert planner.pipeline_chunks == 2 and planner.config.pool_size == 4
    assert get_planner("distca", pipeline_chunks=8).pipeline_chunks == 8


@pytest.mark.parametrize("name,opts,par,shape,match", [
    ("libra", {"pool_size": 3, "block_size": 16}, ParallelConfig(4, 2, 4, 64), AttentionShape(8, 2, 8),
     "pool size P=3 must divide DP=4"),
    ("libra-tap", {"pool_size": 2, "block_size": 48}, ParallelConfig(2, 2, 2, 64), AttentionShape(8, 2, 8),
     "block size B=48 must divide S/CP=32"),
    ("libra", {"pool_size": 2, "block_size": 16, "head_split": 3}, ParallelConfig(2, 2, 2, 64),
     AttentionShape(8, 2, 8), "head split H=3 must divide num_q_heads=8"),
    ("libra", {"pool_size": 2, "block_size": 16, "pipeline_chunks": 3}, ParallelConfig(2, 2, 2, 64),
     AttentionShape(8, 2, 8), "M=3 must divide hq/H=4"),
    ("distca", {"block_size": 48}, ParallelConfig(2, 2, 2, 64), AttentionShape(8, 2, 8),
     "block size B=48 must divide S/CP=32"),
    ("ulysses", {}, ParallelConfig(1, 3, 1, 66), AttentionShape(8, 2, 8), "CP=3 to divide num_q_heads=8"),
])
def test_layout_errors_are_value_errors(name, opts, par, shape, match):
    window = [PackedSequence(i, [par.seq_len], [i]) for i in range(par.gbs)]
    with pytest.raises(ValueError, match=match):
        get_planner(name, **opts).plan_window(window, par, shape)
