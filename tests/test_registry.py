"""The planner registry: names, options, errors, and the Planner interface every method exposes."""

from dataclasses import fields, replace

import pytest

from baselines.registry import PLANNERS, Planner, get_planner, option_record, planner_class
from libra.config import ParallelConfig, TapConfig
from libra.data.packing import PackedSequence
from libra.extensions.adaptive.candidates import DEFAULT_CANDIDATES
from libra.workload import AttentionShape

NAMES = ["ulysses", "ulysses-sorted", "wlb-llm", "distca", "distca-paper", "dynamic-cp", "libra-tap", "libra-tap-vrsp",
         "libra", "libra-kt", "libra-adaptive"]


def test_registry_lists_every_method():
    assert list(PLANNERS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_each_planner_has_the_interface(name):
    planner = get_planner(name)
    assert isinstance(planner, Planner)
    assert planner.name == name
    assert planner.pipeline_chunks == (4 if name in ("distca", "distca-paper", "dynamic-cp", "libra", "libra-kt",
                                                     "libra-adaptive") else 1)
    assert callable(planner.plan_window)


def test_unknown_name_lists_the_registered_names():
    with pytest.raises(ValueError, match="unknown planner 'ring'.*ulysses, ulysses-sorted, wlb-llm, distca, distca-paper"):
        get_planner("ring")


def test_unknown_option_is_a_value_error():
    with pytest.raises(ValueError, match="takes no option"):
        get_planner("ulysses", block_size=4096)
    with pytest.raises(ValueError, match="takes no option.*pipeline_chunks"):
        get_planner("libra-tap", pipeline_chunks=4)     # TAP-only variants never overlap
    with pytest.raises(ValueError, match="takes no option.*pool_size"):
        get_planner("distca-paper", pool_size=8)         # the emulation's pool is always DP
    with pytest.raises(ValueError, match="takes no option.*tolerance"):
        get_planner("distca", block_size=4096)           # DistCA plans items, not TAP tiles


@pytest.mark.parametrize("name,opts,match", [
    ("libra", {"tau": -0.1}, "tau must be a number >= 0"),
    ("libra", {"pipeline_chunks": 0}, "pipeline_chunks must be a positive integer"),
    ("libra-tap", {"block_size": 0}, "block_size must be a positive integer"),
    ("distca-paper", {"head_split": -1}, "head_split must be a positive integer"),
    ("distca", {"tolerance": -0.1}, "tolerance must be a finite number >= 0"),
    ("distca", {"nano_batches": 0}, "nano_batches must be a positive integer"),
    ("distca", {"buffer_gib": 0}, "buffer_gib must be a finite number > 0"),
    ("distca", {"buffer_retry": 1}, "buffer_retry must be True or False"),
    ("dynamic-cp", {"min_cp_size": 0}, "min_cp_size must be a positive integer"),
    ("dynamic-cp", {"max_seqlen_per_rank": 0}, "max_seqlen_per_rank must be a positive integer"),
    ("dynamic-cp", {"delta": 1.0}, r"delta must be a number in \[0, 1\)"),
])
def test_bad_option_values(name, opts, match):
    with pytest.raises(ValueError, match=match):
        get_planner(name, **opts)


def test_options_reach_the_planner():
    planner = get_planner("libra", pipeline_chunks=2, pool_size=4)
    assert planner.pipeline_chunks == 2 and planner.config.pool_size == 4
    assert get_planner("distca-paper", pipeline_chunks=8).pipeline_chunks == 8
    assert get_planner("distca", pipeline_chunks=8).pipeline_chunks == 8
    assert get_planner("dynamic-cp", pipeline_chunks=2).pipeline_chunks == 2


@pytest.mark.parametrize("name,opts,par,shape,match", [
    ("libra", {"pool_size": 3, "block_size": 16}, ParallelConfig(4, 2, 4, 64), AttentionShape(8, 2, 8),
     "pool size P=3 must divide DP=4"),
    ("libra-tap", {"pool_size": 2, "block_size": 48}, ParallelConfig(2, 2, 2, 64), AttentionShape(8, 2, 8),
     "block size B=48 must divide S/CP=32"),
    ("libra", {"pool_size": 2, "block_size": 16, "head_split": 3}, ParallelConfig(2, 2, 2, 64),
     AttentionShape(8, 2, 8), "head split H=3 must divide num_q_heads=8"),
    ("libra", {"pool_size": 2, "block_size": 16, "pipeline_chunks": 3}, ParallelConfig(2, 2, 2, 64),
     AttentionShape(8, 2, 8), "M=3 must divide hq/H=4"),
    ("distca-paper", {"block_size": 48}, ParallelConfig(2, 2, 2, 64), AttentionShape(8, 2, 8),
     "block size B=48 must divide S/CP=32"),
    ("distca", {"nano_batches": 3}, ParallelConfig(4, 2, 4, 64), AttentionShape(8, 2, 8),
     "nano_batches=3 must divide DP=4"),
    ("distca", {"pipeline_chunks": 3}, ParallelConfig(2, 2, 2, 64), AttentionShape(8, 2, 8),
     "pipeline_chunks=3 must divide num_q_heads=8"),
    ("dynamic-cp", {"max_seqlen_per_rank": 8}, ParallelConfig(3, 1, 3, 64), AttentionShape(8, 2, 8),
     "a sample of 64 tokens needs more than 3 ranks of 8 tokens"),
    ("ulysses", {}, ParallelConfig(1, 3, 1, 66), AttentionShape(8, 2, 8), "CP=3 to divide num_q_heads=8"),
])
def test_layout_errors_are_value_errors(name, opts, par, shape, match):
    window = [PackedSequence(i, [par.seq_len], [i]) for i in range(par.gbs)]
    with pytest.raises(ValueError, match=match):
        get_planner(name, **opts).plan_window(window, par, shape)


# --------------------------------------------------------------------------------------------
# TAP planners: the config is a TapConfig (one declaration of the layout and its defaults)
# --------------------------------------------------------------------------------------------

TAP_NAMES = ["distca-paper", "libra-tap", "libra-tap-vrsp", "libra", "libra-kt", "libra-adaptive"]
PINNED = {"distca-paper": {"load_estimate": "flops", "comm_aware": False},
          "libra-tap": {"load_estimate": "flops", "pipeline_chunks": 1},
          "libra-tap-vrsp": {"load_estimate": "flops", "pipeline_chunks": 1},
          "libra": {"load_estimate": "flops"},
          "libra-kt": {"load_estimate": "kernel-time"},
          "libra-adaptive": {"load_estimate": "kernel-time"}}


@pytest.mark.parametrize("name", TAP_NAMES)
def test_tap_planners_hold_a_tapconfig_with_its_defaults(name):
    planner = get_planner(name)
    assert isinstance(planner.tap, TapConfig)
    assert planner.tap == replace(TapConfig(), **PINNED[name])
    assert planner.pipeline_chunks == planner.tap.pipeline_chunks


@pytest.mark.parametrize("name", TAP_NAMES)
def test_tap_planner_options_are_the_tapconfig_fields_it_does_not_pin(name):
    expected = {f.name for f in fields(TapConfig)} - set(PINNED[name])
    if name == "distca-paper":
        expected -= {"pool_size"}  # P = DP, set per window
    if name == "libra-kt":
        expected |= {"profile"}
    if name == "libra-adaptive":
        expected |= {"profile", "candidates", "chunkings", "heavy_tile_limits", "rebalance_passes",
                     "fine_tau", "deepen_pipeline", "device_speeds", "ensemble", "robust_margin"}
    assert set(planner_class(name).option_names()) == expected


def test_planners_take_the_run_tapconfig_whole():
    tap = TapConfig(pool_size=4, block_size=2048, head_split=4, tau=0.1, pipeline_chunks=2, comm_aware=False)
    assert get_planner("libra", tap=tap).config == tap
    assert get_planner("libra-tap", tap=tap).tap == replace(tap, pipeline_chunks=1)
    kt = get_planner("libra-kt", tap=tap)
    assert kt.tap == replace(tap, load_estimate="kernel-time") and kt.config.profile == "h100-roce-v2"
    assert get_planner("libra-kt", tap=tap, profile="h100-roce-v1").config.profile == "h100-roce-v1"
    distca = get_planner("distca-paper", tap=tap).tap
    assert (distca.block_size, distca.head_split, distca.tau, distca.pipeline_chunks, distca.comm_aware) == \
        (2048, 4, 0.1, 2, False)
    # DistCA's own planner and dynamic CP take only the Pipeliner depth; Ulysses ignores the layout
    assert get_planner("distca", tap=tap).pipeline_chunks == 2
    assert get_planner("dynamic-cp", tap=tap, profile="h100-roce-v1").pipeline_chunks == 2
    assert get_planner("ulysses", tap=tap, profile="h100-roce-v1").pipeline_chunks == 1
    with pytest.raises(ValueError, match="besides its TapConfig"):
        get_planner("libra", tap=tap, block_size=1024)  # a TAP field goes in the TapConfig


def test_option_record_is_the_flat_form_runs_record():
    tap = TapConfig(pool_size=4, block_size=2048, head_split=4, tau=0.1, pipeline_chunks=2, comm_aware=False)
    assert option_record("ulysses", tap) == {} and option_record("wlb-llm", tap, rejoin="none") == {"rejoin": "none"}
    assert get_planner("libra", **option_record("libra", tap)).config == get_planner("libra", tap=tap).config
    assert "pipeline_chunks" not in option_record("libra-tap", tap)
    assert "pool_size" not in option_record("distca-paper", tap)
    assert option_record("libra-kt", tap, "h100-roce-v1")["profile"] == "h100-roce-v1"
    assert "profile" not in option_record("libra", tap, "h100-roce-v1")
    assert option_record("distca", tap) == {"pipeline_chunks": 2}
    assert option_record("dynamic-cp", tap) == {"pipeline_chunks": 2}


def test_tap_planner_takes_a_tapconfig_and_pins_its_fields():
    from baselines.libra_planners import LibraKtConfig, LibraKtPlanner, LibraTapPlanner

    assert LibraTapPlanner(TapConfig(pipeline_chunks=4, block_size=8192)).tap == \
        TapConfig(pipeline_chunks=1, block_size=8192)
    assert LibraKtPlanner(LibraKtConfig(TapConfig(pool_size=2))).tap == TapConfig(pool_size=2,
                                                                                 load_estimate="kernel-time")
    with pytest.raises(ValueError, match="takes a TapConfig"):
        LibraTapPlanner({"pool_size": 8})
    with pytest.raises(ValueError, match="LibraKtConfig.tap must be a TapConfig"):
        LibraKtConfig(tap={"pool_size": 8})


@pytest.mark.parametrize("name", TAP_NAMES)
def test_layout_is_checked_once_per_window_not_per_pool(monkeypatch, name):
    import baselines.libra_planners as lp
    import libra.extensions.adaptive.candidates as adaptive
    import libra.tap.planner as tp

    checks, flags = [], []
    real_check, real_pool = lp.check_layout, lp.plan_pool

    def counting_check(*args):
        checks.append(args)
        return real_check(*args)

    def recording_pool(*args, **kwargs):
        flags.append(kwargs.get("checked") is not None)
        return real_pool(*args, **kwargs)

    def no_pool_check(*_args):
        raise AssertionError("plan_pool re-checked a layout the planner had checked")

    monkeypatch.setattr(lp, "check_layout", counting_check)
    monkeypatch.setattr(lp, "plan_pool", recording_pool)
    monkeypatch.setattr(adaptive, "plan_pool", recording_pool)  # libra-adaptive's Alg. 2 candidates
    monkeypatch.setattr(tp, "check_block", no_pool_check)
    monkeypatch.setattr(tp, "check_heads", no_pool_check)
    par = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=64)
    window = [PackedSequence(i, [40, 24], [2 * i, 2 * i + 1]) for i in range(par.gbs)]
    opts = {"block_size": 16} | ({} if name == "distca-paper" else {"pool_size": 2})
    plans = get_planner(name, **opts).plan_window(window, par, AttentionShape(8, 2, 8))
    assert len(plans) == par.ga and len(checks) == 1
    pools = sum(len(p.pools) for p in plans)
    per_pool = sum(c.startswith("alg2") for c in DEFAULT_CANDIDATES) if name == "libra-adaptive" else 1
    assert len(flags) == per_pool * pools and pools > 1 and all(flags)
