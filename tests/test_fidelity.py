"""`libra-bench fidelity` on CPU (tiny sizes): the pool emulation is exact up to rounding, the rule can
fail (a noisy backend, a dropped tile), bad input; the GPU run is marked."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.measured.fidelity import FidelityConfig, _head_groups, _rows, fidelity, window_rows
from experiments.measured.gpu_common import cpu_threads
from libra.config import TapConfig
from libra.data.windows import gbs_windows
from libra.plan import TileTable
from libra.runtime.kernels import get_backend
from libra.workload import AttentionShape

TINY = ["--device", "cpu", "--seq-len", "256", "--pool-size", "2", "--cp", "2", "--block-size", "32",
        "--head-split", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--windows", "1", "--no-progress"]
TAP = TapConfig(pool_size=2, block_size=32, head_split=2, pipeline_chunks=1)
CFG = FidelityConfig(seq_len=256, cp=2, tap=TAP, q_heads=4, kv_heads=2, head_dim=16, windows=1)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread (restored after each test): on a shared 2-core machine, multi-threaded
    tiny kernels stall on busy cores and take 100x longer."""
    with cpu_threads(CPU, 1):
        yield


@pytest.fixture(scope="module")
def plan():
    window = gbs_windows(CFG.workload, CFG.seq_len, CFG.par().gbs, 1, seed=0)[0]
    (p,) = CFG.planner().plan_window(window, CFG.par(), CFG.shape())
    return p


def test_cli_passes_and_writes(tmp_path):
    res = CliRunner().invoke(fidelity, [*TINY, "--check", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "fidelity.csv")
    assert set(df.level) == {"worker", "pool"} and set(df.quantity) == {"out", "dq", "dk", "dv"}
    assert np.all(np.isfinite(df.ratio)) and np.all(df.err_pt > 0)
    assert df.passed.all()
    assert (tmp_path / "fidelity.png").stat().st_size > 0
    s = json.loads((tmp_path / "run.json").read_text())["summary"]
    assert s["ref_dtype"] == "fp64" and s["all_passed"] is True
    assert "PASS" in res.output


def test_pool_emulation_is_exact_in_float64(plan):
    """With the backend in float64 the tile decomposition must equal whole-sample attention to
    rounding: the check compares against the same float64 reference, so errors are ~1e-15."""
    rows = window_rows(0, plan, CFG, get_backend("cpu-flash", CPU), torch.float64, torch.float64, CPU)
    pool = pd.DataFrame([r for r in rows if r["level"] == "pool"])
    assert pool.err_impl.max() < 1e-12


class _NoisyBackend:
    """cpu-flash with a bf16-sized error added to its output (the rule must catch it)."""

    name = "noisy"

    def __init__(self):
        self.inner = get_backend("cpu-flash", CPU)

    def forward(self, q, k, v, seg, scale=None):
        out, lse = self.inner.forward(q, k, v, seg, scale)
        return out + 0.05, lse

    def backward(self, *args, **kwargs):
        return self.inner.backward(*args, **kwargs)


def test_rule_fails_for_a_noisy_backend(plan):
    rows = pd.DataFrame(window_rows(0, plan, CFG, _NoisyBackend(), torch.bfloat16, torch.float64, CPU))
    out = rows[rows.quantity == "out"]
    assert not out.passed.any() and out.ratio.min() > 2.0


def test_dropped_tile_is_reported(plan):
    (pool,) = plan.pools
    t = pool.tiles
    fewer = TileTable(**{name: getattr(t, name)[1:] for name in TileTable.FIELDS})
    broken = dataclasses.replace(plan, pools=(dataclasses.replace(pool, tiles=fewer),))
    with pytest.raises(ValueError, match="uncomputed"):
        window_rows(0, broken, CFG, get_backend("cpu-flash", CPU), torch.bfloat16, torch.float64, CPU)


def test_rows_and_head_groups():
    assert _rows(np.array([5, 0]), np.array([2, 3])).tolist() == [5, 6, 0, 1, 2]
    shape = AttentionShape(num_q_heads=8, num_kv_heads=4, head_dim=8)  # group 2
    pieces = {"head_start": np.array([0, 4, 0]), "head_end": np.array([4, 8, 4])}
    groups = {k: v.tolist() for k, v in _head_groups(pieces, shape)}
    assert groups == {(0, 4, 0, 2): [0, 2], (4, 8, 2, 4): [1]}
    with pytest.raises(ValueError, match=r"query heads \[1, 4\)"):
        list(_head_groups({"head_start": np.array([1]), "head_end": np.array([4])}, shape))


@pytest.mark.parametrize("kwargs, match", [
    ({"fwd_limit": 0.5}, "fwd_limit must be >= 1"),
    ({"floor": 0.0}, "floor must be > 0"),
    ({"tap": dataclasses.replace(TAP, head_split=3)}, "head split H=3"),
    ({"tap": (2, 32, 2)}, "tap must be a TapConfig"),
    ({"method": "distca"}, "unknown method 'distca'"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **kwargs)


def test_tap_options_come_from_tapconfig_with_this_commands_defaults():
    res = CliRunner().invoke(fidelity, ["--help"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for flag in ("--pool-size", "--block-size", "--head-split", "--tau"):
        assert flag in text
    assert "--pipeline-chunks" not in text  # fidelity always plans M = 1
    assert "soft load-target slack" in text and "[default: 0.03; x>=0.0]" in text
    assert "(accepts 4K) [default: 1024]" in text  # fidelity's B, not TapConfig's 4096


def test_tau_reaches_the_planner_and_the_run_record(tmp_path, planner_calls):
    seen = planner_calls
    res = CliRunner().invoke(fidelity, [*TINY, "--tau", "0.5", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert seen == [("libra", {"pool_size": 2, "block_size": 32, "head_split": 2, "tau": 0.5,
                               "pipeline_chunks": 1, "comm_aware": True})]
    tap = json.loads((tmp_path / "run.json").read_text())["config"]["tap"]
    assert tap["tau"] == 0.5 and tap["block_size"] == 32 and tap["pool_size"] == 2
    assert FidelityConfig().tap.tau == TapConfig.tau


@pytest.mark.parametrize("args, match", [
    (["--dtype", "fp32"], "dtype must be bf16 or fp16"),
    (["--ref-dtype", "bf16"], "reference dtype must be auto, fp32 or fp64"),
    (["--backend", "flash-attn"], "needs a CUDA device"),
])
def test_cli_bad_input(args, match, tmp_path):
    res = CliRunner().invoke(fidelity, [*TINY, *args, "--out", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert match in res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is absent")
def test_cuda_without_cuda(tmp_path):
    res = CliRunner().invoke(fidelity, [*TINY, "--device", "cuda", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "CUDA is not available" in res.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fidelity_on_cuda(tmp_path):
    args = ["--device", "cuda", "--seq-len", "4096", "--block-size", "512", "--q-heads", "8", "--kv-heads", "2",
            "--windows", "1", "--check", "--no-progress", "--out", str(tmp_path)]
    res = CliRunner().invoke(fidelity, args)
    assert res.exit_code == 0, res.output
    s = json.loads((tmp_path / "run.json").read_text())["summary"]
    assert s["ref_dtype"] == "fp32" and s["all_passed"]


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), method=st.sampled_from(["libra", "libra-tap-vrsp", "ulysses"]),
       block=st.sampled_from([16, 32, 64]))
def test_property_emulation_exact_for_any_plan(seed, method, block):
    """In float64 the tiled computation of any planner's plan equals whole-sample attention."""
    cfg = dataclasses.replace(CFG, method=method, tap=dataclasses.replace(TAP, block_size=block), seed=seed)
    window = gbs_windows(cfg.workload, cfg.seq_len, cfg.par().gbs, 1, seed=seed)[0]
    for plan in cfg.planner().plan_window(window, cfg.par(), cfg.shape()):
        rows = window_rows(0, plan, cfg, get_backend("cpu-flash", CPU), torch.float64, torch.float64, CPU)
        assert max(r["err_impl"] for r in rows if r["level"] == "pool") < 1e-12
