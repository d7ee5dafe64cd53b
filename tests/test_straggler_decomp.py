"""The straggler decomposition at the `libra-bench straggler` level: the decomposition columns, the
summary's geometric means and FLOPs-only limit, ``--no-jitter`` in the record, ``ulysses-sorted``
in the default list, and one experiment name (``straggler``) whatever the method list."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.common.sim_common import METHODS, OPTIONAL_METHODS, SETTINGS
from experiments.figures.straggler import FACTORS, all_methods, run_options

RUN = ["straggler", "--quick", "--settings", "1m", "--no-progress"]


@pytest.fixture(scope="module")
def nojitter(tmp_path_factory):
    out = tmp_path_factory.mktemp("s") / "nj"
    res = CliRunner().invoke(main, RUN + ["--methods", "ulysses-sorted,libra-kt", "--no-jitter", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out, res.output


def test_every_step_carries_bounds_and_factors_whose_product_is_the_bound_ratio(nojitter):
    out, _ = nojitter
    df = pd.read_csv(out / "straggler.csv")
    assert set(df["method"]) == {"ulysses", "ulysses-sorted", "libra-kt"}   # ulysses added for the normalisation
    product = np.prod([df[f] for f in FACTORS], axis=0)
    assert np.allclose(product, df["bound_ratio"], rtol=1e-9)
    assert np.allclose(df["pool_balanced_ratio"], df["comm_factor"] * df["placement_factor"], rtol=1e-12)
    # FLOPs-only stragglers: same unit as the bound, so never below the bound of a step with the same
    # sequences (Ulysses: production order; Libra's VRSP pools), the same for every method of a step
    uly, kt = df[df["method"] == "ulysses"], df[df["method"] == "libra-kt"]
    assert (uly["flops_ulysses_ms"] >= uly["balance_bound_ms"] * (1 - 1e-9)).all()
    assert (kt["flops_libra_ms"] >= kt["balance_bound_ms"] * (1 - 1e-9)).all()
    assert (df.groupby(["window", "step"])[["flops_ulysses_ms", "flops_libra_ms"]].nunique() == 1).all().all()
    assert (df["kernel_factor"] >= 1 - 1e-12).all()                 # jitter off: no GPU beats the best rate
    assert (df["placement_device_factor"] == 1.0).all()              # ... and the plan is all of placement
    assert np.allclose(df["placement_plan_factor"], df["placement_factor"], rtol=1e-12)


def test_summary_and_record(nojitter):
    out, output = nojitter
    s = pd.read_csv(out / "straggler_summary.csv").set_index("method")
    for m in s.index:
        assert np.prod([s.loc[m, f] for f in FACTORS]) == pytest.approx(s.loc[m, "bound_ratio_gmean"], rel=1e-9)
        assert s.loc[m, "flops_limit_speedup"] == pytest.approx(s.loc[m, "flops_ulysses_ms"] / s.loc[m, "flops_libra_ms"])
    assert s.loc["ulysses-sorted", "mean_speedup"] > 1.0              # cross-step sorting alone helps here
    run = json.loads((out / "run.json").read_text())
    assert run["experiment"] == "straggler" and run["config"]["jitter"] is False
    assert run["config"]["planner_options"]["1m"]["libra-kt"]["profile"] == "h100-roce-v2"
    assert not (out / "straggler-extension.csv").exists() and (out / "straggler.png").stat().st_size > 0
    for label in ("pool_balanced_ratio", *FACTORS, "flops_limit_speedup", "window_speedup_min", "loss decomposition"):
        assert label in output


def test_method_lists():
    assert "ulysses-sorted" in METHODS
    full = all_methods()
    assert full[:len(METHODS) + len(OPTIONAL_METHODS)] == METHODS + OPTIONAL_METHODS and len(set(full)) == len(full)
    from baselines.registry import PLANNERS

    assert set(full) == set(PLANNERS)
    from libra.sim.profiles import load_profile

    prof = load_profile("h100-roce-v1")
    assert run_options("libra-kt", SETTINGS["1m"], prof, "none")["profile"] is prof
    assert "profile" not in run_options("libra", SETTINGS["1m"], prof, "none")
    assert run_options("ulysses-sorted", SETTINGS["1m"], prof, "none") == {}


def test_an_unknown_method_is_refused(tmp_path):
    res = CliRunner().invoke(main, RUN + ["--methods", "nope", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "unknown method 'nope'" in res.output
