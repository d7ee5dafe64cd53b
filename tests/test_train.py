"""Training semantics: reference, Ulysses and Libra (VRSP sampler + TAP plans) train identically."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from experiments.measured.train import (
    STEP_MS,
    TOKENS,
    TrainConfig,
    draw,
    run_tap,
    run_training,
    sample_lengths,
    summary,
    summary_table,
    train,
)
from experiments.measured.training.config import CPU_TAP_DEFAULTS, TAP_FIELDS
from experiments.measured.training.data import IGNORE, PieceDataset, collate_packed
from experiments.measured.training.loop import _plans_for_step
from experiments.measured.training.model import ModelConfig
from libra.config import TapConfig
from libra.sampler import LibraSampler, SamplePiece

SMALL = ModelConfig(vocab_size=64, hidden=32, layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8, ffn=64)


def _cfg(attention, nproc, cp, dtype="float64", pool_size=None, tau=None, **kw):
    tap = run_tap(nproc, cp, pool_size=pool_size, block_size=32, head_split=2, tau=tau, pipeline_chunks=2)
    return TrainConfig(nproc=nproc, cp=cp, attention=attention, steps=2, seq_len=256, gbs=4, tap=tap, model=SMALL,
                       dtype=dtype, lr=1e-2, seed=7, timeout_s=60.0, **kw)


@pytest.mark.slow
@pytest.mark.distributed
def test_reference_ulysses_and_libra_train_identically():
    ref64 = run_training(_cfg("reference", 1, 1))[0]
    ref32 = run_training(_cfg("reference", 1, 1, dtype="float32"))[0]
    # one spawn of 4 ranks (DP 2 x CP 2) runs all distributed configs in turn
    uly64, lib64, lib32 = run_training([_cfg("ulysses", 4, 2), _cfg("libra", 4, 2, pool_size=2),
                                        _cfg("libra", 4, 2, dtype="float32", pool_size=2)], join_timeout_s=120)
    ref_loss = [r["loss"] for r in ref64["steps"]]
    assert ref_loss[1] < ref_loss[0]  # it learns
    for got in (uly64, lib64):
        np.testing.assert_allclose([r["loss"] for r in got["steps"]], ref_loss, rtol=1e-11, atol=0)
        for name, p in ref64["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-9, atol=1e-11, msg=name)
    np.testing.assert_allclose([r["loss"] for r in lib32["steps"]], [r["loss"] for r in ref32["steps"]], rtol=2e-5)
    for name, p in ref32["params"].items():
        torch.testing.assert_close(lib32["params"][name], p, rtol=1e-3, atol=2e-5, msg=name)
    # a change to the data is visible: the test can fail
    other = run_training(replace(_cfg("reference", 1, 1), seed=8))[0]
    assert abs(other["steps"][0]["loss"] - ref_loss[0]) > 1e-6


@pytest.mark.slow
@pytest.mark.distributed
def test_libra_kt_and_adaptive_planners_train_as_the_reference():
    """``--planner``: the same model trained with libra-kt's and libra-adaptive's plans (its tile
    chunks and re-placed pools among them, planned with speeds measured on the ranks) matches the
    unsharded reference as the paper's planner does."""
    ref = run_training(_cfg("reference", 1, 1))[0]
    adaptive = _cfg("libra", 4, 2, pool_size=2, planner="libra-adaptive", measure_speeds=True)
    choices = [c for step in range(adaptive.steps) for plan in _plans_for_step(
        adaptive.loop_config(), LibraSampler(sample_lengths(adaptive), 256, 4, 2, pool_size=2, seed=7).step(step),
        SMALL.attention_shape) for c in plan.meta["adaptive_choice"]]
    assert any(c.endswith("+tiles") for c in choices) and any(not c.startswith("alg2") for c in choices)
    kt, ad = run_training([_cfg("libra", 4, 2, pool_size=2, planner="libra-kt"), adaptive], join_timeout_s=120)
    for got in (kt, ad):
        np.testing.assert_allclose([r["loss"] for r in got["steps"]], [r["loss"] for r in ref["steps"]],
                                   rtol=1e-11, atol=0)
        for name, p in ref["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-9, atol=1e-11, msg=name)
    speeds = ad["device_speeds"]
    assert len(speeds) == 4 and all(s > 0 for s in speeds) and "device_speeds" not in kt


def test_libra_runs_move_tiles_across_cp_groups_and_keep_the_step_multiset():
    cfg = _cfg("libra", 4, 2, pool_size=2)
    lengths = sample_lengths(cfg)
    sampler = LibraSampler(lengths, cfg.seq_len, cfg.gbs, cfg.dp, pool_size=2, seed=cfg.seed)
    moved = 0
    for step in range(cfg.steps):
        a = sampler.step(step)
        plans = _plans_for_step(cfg.loop_config(), a, SMALL.attention_shape)
        for plan in plans:
            for pool in plan.pools:
                t = pool.tiles
                moved += int(np.sum(t.dest // cfg.cp != t.q_home // cfg.cp))
        off = LibraSampler(lengths, cfg.seq_len, cfg.gbs, cfg.dp, pool_size=1, seed=cfg.seed, use_vrsp=False).step(step)
        assert sorted(a.sequences) == sorted(off.sequences)
    assert moved > 0


def test_piece_dataset_labels_follow_the_sample_across_a_split():
    ds = PieceDataset(np.array([10, 3]), vocab_size=50, seed=1)
    full_x, full_y = ds[SamplePiece(0, 0, 10)]
    a_x, a_y = ds[SamplePiece(0, 0, 4)]
    b_x, b_y = ds[SamplePiece(0, 4, 10)]
    assert np.array_equal(np.concatenate([a_x, b_x]), full_x) and np.array_equal(np.concatenate([a_y, b_y]), full_y)
    assert full_y[-1] == IGNORE and a_y[-1] == full_x[4]
    assert ds.valid_targets([SamplePiece(0, 0, 4), SamplePiece(0, 4, 10), SamplePiece(1, 0, 3)]) == 9 + 2
    batch = collate_packed([ds[SamplePiece(0, 6, 10)], ds[SamplePiece(1, 0, 3)]])
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2] and batch.sample_lengths == (4, 3)
    with pytest.raises(ValueError, match="outside sample 1"):
        ds[SamplePiece(1, 0, 4)]
    with pytest.raises(ValueError, match="CP=3 must divide"):
        batch.local(0, 3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(attention="flash"), "unknown attention 'flash'"),
    (dict(nproc=4, cp=3), "CP=3 must divide nproc=4"),
    (dict(attention="reference", cp=2), "needs CP=1"),
    (dict(nproc=4, cp=2, gbs=3), "GBS=3 must be a positive multiple of DP=2"),
    (dict(nproc=8, cp=2, tap=run_tap(8, 2, pool_size=3)), "P=3 must divide DP=4"),
    (dict(tap=run_tap(4, 2, block_size=100)), "block size B=100 must divide S/CP=512"),
    (dict(tap={"pool_size": 2}), "TrainConfig.tap must be a TapConfig"),
    (dict(tap=run_tap(4, 2, comm_aware=False)), r"\['comm_aware'\] keep TapConfig's defaults"),
    (dict(dtype="float16"), "unknown dtype 'float16'"),
    (dict(steps=0), "steps must be a positive integer, got 0"),
    (dict(planner="libra-fast"), "unknown planner 'libra-fast'"),
    (dict(attention="ulysses", planner="libra-kt"), "planner 'libra-kt' plans Libra attention"),
    (dict(profile="h100-roce-v1"), "a profile is for libra-kt or libra-adaptive"),
    (dict(planner="libra-kt", profile="no-such-profile"), "unknown hardware profile 'no-such-profile'"),
    (dict(planner="libra-kt", measure_speeds=True), "measured speeds are for planner libra-adaptive"),
])
def test_bad_train_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_train_command_single_process_writes_results(tmp_path):
    res = CliRunner().invoke(train, ["--nproc", "1", "--cp", "1", "--attention", "reference", "--steps", "2",
                                     "--seq-len", "128", "--gbs", "2", "--layers", "1", "--hidden", "32",
                                     "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "tokens/GPU/s" in res.output
    import pandas as pd

    df = pd.read_csv(tmp_path / "train.csv")
    assert list(df.step) == [0, 1] and (df.tokens_per_gpu_s > 0).all() and (tmp_path / "train.png").exists()
    assert summary_table(df) in res.output  # the printed table is the summary of the CSV written
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["world_size"] == 1 and record["nodes"] == 1 and record["ranks"][0]["local_rank"] == 0
    bad = CliRunner().invoke(train, ["--nproc", "4", "--cp", "3", "--out", str(tmp_path)])
    assert bad.exit_code != 0 and "CP=3 must divide nproc=4" in bad.output
    bad = CliRunner().invoke(train, ["--nproc", "1", "--cp", "2", "--out", str(tmp_path)])  # CP above nproc: named as such
    assert bad.exit_code != 0 and "CP=2 must divide nproc=1" in bad.output


def test_tap_options_come_from_tapconfig_with_this_commands_defaults():
    res = CliRunner().invoke(train, ["--help"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for flag in ("--pool-size", "--block-size", "--head-split", "--tau", "--pipeline-chunks"):
        assert flag in text
    assert "soft load-target slack" in text and "[default: 0.03; x>=0.0]" in text
    assert "(accepts 4K) [default: 128]" in text and "[default: (DP); x>=1]" in text  # train's B and P


def test_tau_is_part_of_the_tap_layout_and_the_run_record(tmp_path):
    cfg = _cfg("libra", 4, 2, pool_size=2)
    assert cfg.tap.tau == TapConfig.tau and cfg.tap == TapConfig(pool_size=2, block_size=32, head_split=2,
                                                                 pipeline_chunks=2)
    res = CliRunner().invoke(train, ["--nproc", "1", "--cp", "1", "--attention", "reference", "--steps", "1",
                                     "--seq-len", "128", "--gbs", "2", "--layers", "1", "--hidden", "32",
                                     "--tau", "0.25", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    config = json.loads((tmp_path / "run.json").read_text())["config"]
    assert config["tau"] == 0.25 and config["block_size"] == 128 and config["pipeline_chunks"] == 2
    with pytest.raises(ValueError, match="tau must be a number >= 0"):
        _cfg("libra", 4, 2, tau=-1.0)
    assert _cfg("libra", 4, 2, tau=0.25).loop_config().tap.tau == 0.25  # the training planner gets it


def test_train_config_owns_its_tap_layout_and_records_it_flat():
    """A run's TapConfig defaults to P = DP with the CPU-sized B and M (TapConfig's H and tau); run.json
    records its fields flat beside the run's own, as records did before the config held a TapConfig."""
    cfg = TrainConfig(nproc=8, cp=2)
    assert cfg.tap == run_tap(8, 2) == TapConfig(pool_size=4, **CPU_TAP_DEFAULTS)
    assert CPU_TAP_DEFAULTS == {"block_size": 128, "pipeline_chunks": 2}
    record = replace(cfg, tap=run_tap(8, 2, pool_size=2, tau=0.25)).to_record()
    assert "tap" not in record and list(record)[:6] == ["nproc", "cp", "attention", "steps", "seq_len", "gbs"]
    assert {k: record[k] for k in TAP_FIELDS} == {"pool_size": 2, "block_size": 128, "head_split": 2, "tau": 0.25,
                                                  "pipeline_chunks": 2}
    assert list(record)[6:11] == list(TAP_FIELDS) and record["workload"] == "libra-prod"


def test_printed_table_and_png_bars_are_the_same_median_with_its_unit():
    """`train` prints the statistic its PNG plots (a median, not seaborn's default mean)."""
    import matplotlib.pyplot as plt
    import pandas as pd

    # step 0 carries the first plan and warm-up: it is not timed; the rest give medians, not means
    df = pd.DataFrame({"attention": ["libra"] * 4 + ["ulysses"] * 4, "step": [0, 1, 2, 3] * 2,
                       "loss": [5.0, 4.9, 4.8, 4.7] * 2,
                       "step_ms": [1000.0, 10.0, 14.0, 30.0, 900.0, 20.0, 30.0, 25.0],
                       "tokens_per_gpu_s": [100.0, 10000.0, 7000.0, 3000.0, 110.0, 5000.0, 3000.0, 4000.0]})
    stats = summary(df).set_index("attention")
    assert list(summary(df).columns) == ["attention", "steps", STEP_MS, TOKENS]
    assert STEP_MS == "median step time (ms)" and TOKENS == "median tokens/GPU/s"
    assert stats.loc["libra", "steps"] == 3  # steps 1-3
    assert stats.loc["libra", STEP_MS] == 14.0 and stats.loc["ulysses", TOKENS] == 4000.0
    table = summary_table(df)
    assert STEP_MS in table and TOKENS in table and "14.0" in table and "7000" in table
    assert "step 0 (first plan, warm-up) not timed" in table
    one = df[df["step"] == 0]  # a one-step run: step 0 is all there is
    assert summary(one).set_index("attention").loc["libra", STEP_MS] == 1000.0
    assert "one step only: step 0" in summary_table(one)
    fig = draw(df)
    try:
        for ax, col in zip(fig.axes[1:3], (STEP_MS, TOKENS)):
            assert ax.get_ylabel() == col and col in ax.get_title()
            heights = [bar.get_height() for bar in ax.patches]
            labels = [t.get_text() for t in ax.get_xticklabels()]
            assert dict(zip(labels, heights)) == stats[col].to_dict()  # the bars are the printed values
    finally:
        plt.close(fig)
