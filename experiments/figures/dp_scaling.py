"""`libra-bench dp-scaling` (Figure 13): simulated throughput against DP, normalized to DP = 1.

Libra sec. 6.4: GBS fixed, only DP grows (PP = 1, DP in {1, 2, 4, 8, 16}); 256K: GBS 128, CP 8
(8-128 GPUs); 1M: GBS 32, CP 16 (16-256 GPUs); Libra (full) with ``P = min(8, DP)`` and the
sec. 6.3 TAP layout (H = 2, B = 4096 / 8192, M = 4); Qwen3-30B-A3B by default. Each method's
throughput (tokens/GPU/s times GPUs) is normalized to its own DP = 1, so the ideal is DP. The
baseline loses scaling because the heaviest DP replica stalls the optimizer boundary; the effect
grows as GA = GBS/DP shrinks and fewer sequences average out per replica.

Your layout (``--dp --cp --seq-len --gbs``, all four) follows the same protocol: CP, S and GBS
stay fixed and DP takes the values of ``--dps`` (default: the powers of 2 below the layout's DP
that divide GBS, then DP itself; the presets: 1, 2, 4, 8, 16), which must include 1; Libra's P at
DP = d is the largest divisor of d up to the layout's pool size (``--pool-size``; default the
largest divisor of DP up to 8), the paper's ``P = min(8, DP)``. ``--q-heads``, ``--kv-heads``,
``--head-dim`` replace the model's head shape. The paper's DP = 16 scaling
(:mod:`experiments.common.paper`: the ``paper_scaling`` column of ``dp-scaling.csv``, black marks in the
figure, the printed comparison) appears only for an unmodified preset on ``libra-prod`` with the
paper's model. Runs write to ``runs/dp-scaling/<workload>-<layout>-<profile>/`` unless ``--out``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.common.paper import NUMBERS
from experiments.common.paper import label as paper_label
from experiments.common.runs_table import run_caption
from experiments.common.sim_common import SETTINGS as PAPER_SETTINGS
from experiments.figures.e2e import (
    POOL_SIZE_HELP,
    check_points,
    dps_option,
    libra_tap,
    model_shapes,
    price_window,
    set_help,
    sim_options,
    sim_setup,
)
from libra.sim.models import MODELS

SETTINGS = {name: replace(st, dp=16) for name, st in PAPER_SETTINGS.items()}
"""Figure 13's presets: the sec. 6.3 settings with DP = 16, the largest of the sweep."""
METHODS = ("ulysses", "libra")
PAPER_MODEL = "qwen3-30b-a3b"
PAPER_DP16 = {(name, m): NUMBERS["fig13"][paper_label(name)][m] for name in SETTINGS for m in METHODS}
"""Figure 13's scaling at DP = 16 per (setting, method) (:mod:`experiments.common.paper`)."""


def default_dps(setting) -> tuple[int, ...]:
    """The powers of 2 below the setting's DP that divide its GBS, then DP (presets: 1, 2, 4, 8, 16)."""
    lower = [d for d in (2 ** i for i in range(setting.dp.bit_length())) if d < setting.dp and setting.gbs % d == 0]
    return (*lower, setting.dp)


def scaling(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, method, DP): throughput over the windows (total tokens / total time), its
    ``scaling`` over the method's own DP = 1 and ``efficiency`` = scaling / DP."""
    agg = df.groupby(["setting", "method", "dp"], sort=False).agg(tokens=("tokens", "sum"), step_ms=("step_ms", "sum"))
    agg["throughput"] = agg.tokens / (agg.step_ms / 1e3)
    base = agg.xs(1, level="dp")["throughput"]
    agg["scaling"] = agg.throughput / base.reindex(agg.index.droplevel("dp")).to_numpy()
    agg["efficiency"] = agg.scaling / agg.index.get_level_values("dp")
    return agg


def with_paper(df: pd.DataFrame, paper: set[str]) -> pd.DataFrame:
    """``df`` with ``paper_scaling`` (the paper's DP = 16 scaling) on the DP = 16 rows of the
    ``paper`` settings; no column at all when no row gets a value."""
    values = [PAPER_DP16.get((s, m), np.nan) if s in paper and dp == 16 else np.nan
              for s, m, dp in zip(df.setting, df.method, df.dp)]
    return df.assign(paper_scaling=values) if np.isfinite(values).any() else df


def _plot(df: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    cols = ["scaling", *(["paper_scaling"] if "paper_scaling" in df else [])]
    mean = df.groupby(["setting", "method", "dp"], as_index=False, sort=False)[cols].first()
    settings = list(dict.fromkeys(mean.setting))
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.4), squeeze=False)
    for ax, s in zip(axes[0], settings):
        part = mean[mean.setting == s]
        sns.lineplot(data=part, x="dp", y="scaling", hue="method", marker="o", ax=ax)
        dps = sorted(part.dp.unique())
        ax.plot(dps, dps, "k--", lw=1, label="ideal")
        marks = part[np.isfinite(part["paper_scaling"])] if "paper_scaling" in part else part.iloc[:0]
        if len(marks):
            ax.scatter(marks.dp, marks.paper_scaling, marker="X", color="black", s=50, zorder=5, label="paper")
        ax.set(xscale="log", yscale="log", xticks=dps, xticklabels=dps, title=f"{s}",
               xlabel="DP", ylabel="throughput / own DP=1")
        ax.legend(fontsize=8)
    fig.suptitle("DP scaling (Figure 13, simulated)")
    from experiments.common.plotting import save_figure  # noqa: PLC0415  (Agg backend)

    save_figure(fig, path, caption=caption)


@click.command("dp-scaling")
@sim_options(default_windows=4, presets_help="256k (DP 1-16, CP 8, GBS 128), 1m (DP 1-16, CP 16, GBS 32)")
@click.option("--model", "model_name", type=click.Choice(sorted(MODELS)), default=PAPER_MODEL, show_default=True,
              help="model whose layers are priced (libra.sim.models)")
@dps_option("the powers of 2 below the layout's DP that divide GBS, then DP (presets: 1,2,4,8,16); must "
            "include 1")
def dp_scaling(model_name, dps, **opts):
    """Figure 13: throughput vs DP with GBS, CP and S fixed, each method normalized to its own DP = 1.

    Presets (--settings): 256k (DP 1-16, CP 8, GBS 128, S 256K) and 1m (DP 1-16, CP 16, GBS 32,
    S 1M), P = min(8, DP); or your layout: --dp --cp --seq-len --gbs, --dps to choose the DPs."""
    setup = sim_setup(opts, SETTINGS)
    if dps is not None and 1 not in dps:
        raise click.BadParameter("must include 1 (throughput is normalized to DP = 1)", param_hint="--dps")
    sweep = {s: tuple(dps) if dps else default_dps(st) for s, st in setup.settings.items()}
    shapes = model_shapes([model_name], setup.heads)
    check_points(setup, sweep, dict.fromkeys(sweep, 1), shapes)
    config = {**setup.config(), "model": model_name, "dps": sweep, "methods": METHODS, "linear_mfu": 0.5}
    run = setup.run("dp-scaling", config)

    def point(key):
        s, method, dp = key
        st = setup.settings[s]
        return [{"workload": setup.workload, "setting": s, "model": model_name, "method": method, "dp": dp,
                 "cp": st.cp, "gbs": st.gbs, "pool_size": libra_tap(st, dp).pool_size if method == "libra" else 1,
                 "window": w, **price_window(method, window, st, dp, 1, shapes[model_name], setup.profile).summary()}
                for w, window in enumerate(setup.windows_of(st))]

    df = pd.DataFrame(run.map([(s, m, dp) for s in sweep for m in METHODS for dp in sweep[s]], point,
                              desc="dp-scaling"))
    agg = scaling(df)
    df = df.merge(agg[["scaling", "efficiency"]].reset_index(), on=["setting", "method", "dp"])
    paper = {s for s in setup.settings if setup.paper_marks(s) and model_name == PAPER_MODEL}
    df = with_paper(df, paper)
    paths = run.finish(df, lambda d, p: _plot(d, p, run_caption(run.config)), extra={"profile": setup.profile.name})
    click.echo(agg[["scaling", "efficiency"]].round(3).unstack("method").to_string())
    _echo_top(agg, sweep, paper)
    click.echo(f"wrote {paths['csv']}")


set_help(dp_scaling, pool_size=POOL_SIZE_HELP)


def _echo_top(agg: pd.DataFrame, sweep: dict, paper: set[str]) -> None:
    """Each method's scaling at its setting's largest DP, with the paper's at DP = 16 for ``paper`` settings."""
    for s, dps in sweep.items():
        top = max(dps)
        for method in METHODS:
            ours = agg.loc[(s, method, top), "scaling"]
            line = f"{s} {method}: DP={top} scaling {ours:.2f}x ({ours / top:.1%})"
            if s in paper and top == 16:
                line += f"; paper {PAPER_DP16[(s, method)]:.2f}x ({PAPER_DP16[(s, method)] / 16:.1%})"
            click.echo(line)
