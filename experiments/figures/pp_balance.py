"""`libra-bench pp-balance` (Figure 14): per-microbatch forward time within one pipeline stage.

Libra sec. 6.4: pipeline-parallel training (256K: DP 4, PP 2, CP 8, GBS 128; 1M: DP 4, PP 2,
CP 16, GBS 32; Libra at P = 4, the sec. 6.3 B and H), each microbatch's forward time on stage 0,
aggregated over all replicas of the stage and over ``--windows`` iterations (paper: 15),
normalized by Libra's per-iteration mean (so Libra's mean is 1). The forward time is the stage's
layers times the per-layer time the :class:`libra.sim.e2e.StepModel` prices (linear + MoE
all-to-all + the pool's slowest attention worker). Unequal microbatches are what create
compute-induced pipeline bubbles; the slowest one in the window is what matters.

Your layout: ``--dp --cp --seq-len --gbs`` (all four) instead of a preset, ``--pp`` stages
(default 2, the paper's), Libra's P from ``--pool-size`` (default: the largest divisor of DP up
to 8); ``--q-heads``, ``--kv-heads``, ``--head-dim`` replace the model's head shape.

Outputs: ``pp-balance.csv`` (one row per setting, method, window, DP rank, microbatch),
``pp-balance_summary.csv`` (min, mean and max normalized forward time per setting and method),
``pp-balance.png`` and ``run.json``. The paper's values (:mod:`experiments.common.paper`: the
``paper_min``/``paper_max`` columns of the summary, black marks in the figure, the printed
comparison) appear only for an unmodified preset at PP 2 on ``libra-prod`` with the paper's model.
Runs write to ``runs/pp-balance/<workload>-<layout>-<profile>/`` unless ``--out``.
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
from experiments.common.sim_common import format_table
from experiments.figures.e2e import check_points, model_shapes, price_window, sim_options, sim_setup
from libra.sim.models import MODELS

SETTINGS = {name: replace(st, dp=4, tap=replace(st.tap, pool_size=4)) for name, st in PAPER_SETTINGS.items()}
"""Figure 14's presets: the sec. 6.3 settings at DP = 4 (P = min(8, DP) = 4)."""
PAPER_PP = 2
PAPER_MODEL = "qwen3-30b-a3b"
METHODS = ("ulysses", "libra")
PAPER_COLUMNS = ("paper_min", "paper_mean", "paper_max")


def paper_value(setting: str, method: str, column: str) -> float:
    """Libra sec. 6.4's normalized forward time of ``method`` in ``setting`` (``column`` one of
    :data:`PAPER_COLUMNS`; :mod:`experiments.common.paper`'s ``fig14``), NaN where the paper gives none."""
    key = f"{method}_{column.removeprefix('paper_')}"
    return float(NUMBERS["fig14"].get(paper_label(setting), {}).get(key, np.nan))


def summarize(df: pd.DataFrame, paper: set[str]) -> pd.DataFrame:
    """Min, mean and max normalized forward time per (setting, method); the paper's values as
    ``paper_*`` columns for the ``paper`` settings (NaN where sec. 6.4 gives none); a column the
    paper gives no value of for these settings is left out (so none on a run that is not the paper's)."""
    out = df.groupby(["setting", "method"], sort=False)["normalized_fwd"].agg(["min", "mean", "max"]).reset_index()
    for col in PAPER_COLUMNS:
        values = [paper_value(s, m, col) if s in paper else np.nan for s, m in zip(out.setting, out.method)]
        if np.isfinite(values).any():
            out[col] = values
    return out


def _plot(df: pd.DataFrame, summary: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    from experiments.common.plotting import PointStyle, save_figure, strip_points  # noqa: PLC0415

    settings = list(dict.fromkeys(df.setting))
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.4), squeeze=False)
    for ax, s in zip(axes[0], settings):
        part = df[df.setting == s]
        order = list(dict.fromkeys(part.method))
        sns.boxplot(data=part, x="method", y="normalized_fwd", order=order, ax=ax, whis=(0, 100), color="0.85")
        strip_points(ax, part, "method", "normalized_fwd", order, style=PointStyle(size=2.5, alpha=0.6))
        ax.axhline(1.0, color="k", ls="--", lw=0.8)
        _paper_marks(ax, summary[summary.setting == s].set_index("method"), order)
        ax.set(yscale="log", title=s, ylabel="forward time / Libra mean", xlabel="")
    fig.suptitle("Per-microbatch forward time, stage 0 (Figure 14, simulated)")

    save_figure(fig, path, caption=caption)


def _paper_marks(ax, summary: pd.DataFrame, order: list[str]) -> None:
    """Black ticks at the paper's min and max of each method (only where the summary has them)."""
    first = True
    for i, method in enumerate(order):
        for col in ("paper_min", "paper_max"):
            v = summary[col].get(method, np.nan) if col in summary else np.nan
            if np.isfinite(v):
                ax.plot(i, v, marker="_", color="black", markersize=18, mew=2.5, label="paper" if first else None)
                first = False
    if not first:
        ax.legend(fontsize=8)


@click.command("pp-balance")
@sim_options(default_windows=15, presets_help="256k (DP 4, CP 8, GBS 128), 1m (DP 4, CP 16, GBS 32), both P 4")
@click.option("--model", "model_name", type=click.Choice(sorted(MODELS)), default=PAPER_MODEL, show_default=True,
              help="model whose layers are priced (libra.sim.models)")
@click.option("--pp", type=click.IntRange(min=1), default=PAPER_PP, show_default=True,
              help="pipeline stages (stage 0's microbatches are timed)")
def pp_balance(model_name, pp, **opts):
    """Figure 14: per-microbatch stage-0 forward time under PP, normalized to Libra's mean.

    Presets (--settings): 256k (DP 4, CP 8, GBS 128, S 256K) and 1m (DP 4, CP 16, GBS 32, S 1M),
    P 4; or your layout: --dp --cp --seq-len --gbs."""
    setup = sim_setup(opts, SETTINGS)
    shapes = model_shapes([model_name], setup.heads)
    check_points(setup, {s: (st.dp,) for s, st in setup.settings.items()}, dict.fromkeys(setup.settings, pp), shapes)
    config = {**setup.config(), "model": model_name, "pp": pp, "methods": METHODS, "linear_mfu": 0.5}
    run = setup.run("pp-balance", config)

    def point(key):
        s, method, w = key
        st = setup.settings[s]
        t = price_window(method, setup.windows_of(st)[w], st, st.dp, pp, shapes[model_name], setup.profile)
        fwd = t.stage_fwd_ms[0]  # (DP, GA) on stage 0
        return [{"workload": setup.workload, "setting": s, "model": model_name, "method": method, "window": w,
                 "dp_rank": r, "microbatch": g, "fwd_ms": float(fwd[r, g]),
                 "attention_fwd_ms": float(t.terms.attention_fwd[r, g]), "step_ms": t.step_ms,
                 "bubble_ms": t.bubble_ms}
                for r in range(fwd.shape[0]) for g in range(fwd.shape[1])]

    keys = [(s, method, w) for s in setup.settings for method in METHODS for w in range(setup.windows)]
    df = pd.DataFrame(run.map(keys, point, desc="pp-balance"))
    libra_mean = df[df.method == "libra"].groupby(["setting", "window"])["fwd_ms"].mean().rename("libra_mean")
    df = df.merge(libra_mean.reset_index(), on=["setting", "window"])
    df["normalized_fwd"] = df.fwd_ms / df.libra_mean
    paper = {s for s in setup.settings if setup.paper_marks(s) and model_name == PAPER_MODEL and pp == PAPER_PP}
    summary = summarize(df, paper)
    paths = run.finish(df, lambda d, p: _plot(d, summary, p, run_caption(run.config)), extra={"profile": setup.profile.name},
                       files={"pp-balance_summary.csv": summary.to_csv(index=False)})
    click.echo(format_table(summary, [c for c in ("setting", "method", "min", "mean", "max", *PAPER_COLUMNS)
                                      if c in summary], "{:.3f}"))
    _echo_worst(summary, paper)
    click.echo(f"wrote {paths['csv']}, {run.out_dir / 'pp-balance_summary.csv'}")


def _echo_worst(summary: pd.DataFrame, paper: set[str]) -> None:
    """The worst microbatch of Ulysses and Libra per setting, with the paper's for ``paper`` settings."""
    worst = summary.set_index(["setting", "method"])["max"]
    for s in dict.fromkeys(summary.setting):
        base, ours = worst[(s, "ulysses")], worst[(s, "libra")]
        line = f"{s}: worst microbatch {base:.2f} -> {ours:.2f} ({base / ours:.1f}x)"
        if s in paper:
            line += f"; paper {paper_value(s, 'ulysses', 'paper_max')} -> {paper_value(s, 'libra', 'paper_max')}"
        click.echo(line)
