"""`libra-bench vrsp` (Figure 8): pool imbalance R - 1 against pool size P for every grouping.

For each of ``--windows`` consecutive GBS windows of the workload (fixed-token 'split' packing,
Libra sec. 2.3) and each pool size ``P`` dividing GBS, every strategy of
:data:`baselines.grouping.GROUPINGS` groups the window's packed sequences into ``K = GBS / P``
pools, and the window's ``R - 1 = max pool / mean pool - 1`` is recorded (Libra sec. 3.2, 4.2),
with the grouping-independent lower bound of :func:`baselines.grouping.lower_bound_r_minus_1`.

Outputs (``runs/vrsp/<workload>-s<S>-gbs<GBS>/`` or ``--out``; ``make fig8`` writes
``results/vrsp/256k`` and ``results/vrsp/1m``): ``vrsp.csv`` (long format, one row per window x strategy
x P: ``workload, seq_len, gbs, strategy, pool_size, window, r_minus_1, r_minus_1_lower_bound``),
``vrsp.png`` (mean R - 1 vs P, log-x, one line per strategy, the lower bound dashed, the paper's
reference values as stars) and ``run.json``. A summary table (mean R - 1 per strategy and P) is
printed. Points (one per window) are cached, so an interrupted run resumes; ``--force`` recomputes;
``--overwrite`` replaces a folder's results of a different config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pandas as pd

from baselines.grouping import GROUPINGS, lower_bound_r_minus_1
from experiments.common.options import (
    check_pool_sizes,
    default_pool_sizes,
    grouping_sweep_options,
)
from experiments.common.paper import fig4_8_reference
from experiments.common.runner import ExperimentRun
from experiments.common.runs_table import run_caption
from libra.data.source import LengthSource
from libra.data.windows import gbs_windows, window_workloads
from libra.vrsp import pool_imbalance

CSV_COLUMNS = ["workload", "seq_len", "gbs", "strategy", "pool_size", "window", "r_minus_1",
               "r_minus_1_lower_bound"]
QUICK_WINDOWS = 4



def _random_seed(seed: int, window: int, pool_size: int) -> int:
    """Seed of the 'random' strategy for one (run seed, window, P): distinct and deterministic."""
    return int(np.random.SeedSequence([seed, window, pool_size]).generate_state(1)[0])


def window_rows(workloads: np.ndarray, strategies, pool_sizes, seed: int, window: int, base: dict) -> list[dict]:
    """CSV rows of one window: every strategy at every pool size."""
    rows = []
    for p in pool_sizes:
        bound = lower_bound_r_minus_1(workloads, p)
        for name in strategies:
            pools = GROUPINGS[name](workloads, p, seed=_random_seed(seed, window, p))
            rows.append({**base, "strategy": name, "pool_size": p, "window": window,
                         "r_minus_1": pool_imbalance(workloads, pools), "r_minus_1_lower_bound": bound})
    return rows


@dataclass(frozen=True, kw_only=True)
class GroupingSweepConfig:
    """One grouping sweep of `lln` or `vrsp`: what it groups and where it writes (the command builds it once)."""

    name: str
    strategies: Sequence[str]
    workload: LengthSource
    seq_len: int
    gbs: int
    pool_sizes: Sequence[int] | None
    windows: int
    seed: int
    out: str | None
    quick: bool
    force: bool
    quiet: bool = False


def run_grouping_sweep(cfg: GroupingSweepConfig) -> tuple[pd.DataFrame, dict]:
    """Shared body of `lln` and `vrsp`: resumable sweep, CSV/PNG/run.json, returns ``(df, paths)``."""
    pool_sizes = check_pool_sizes(list(cfg.pool_sizes) if cfg.pool_sizes else default_pool_sizes(cfg.gbs), cfg.gbs)
    windows = min(cfg.windows, QUICK_WINDOWS) if cfg.quick else cfg.windows
    config = {"experiment": cfg.name, "workload": cfg.workload.describe(), "seq_len": cfg.seq_len, "gbs": cfg.gbs,
              "pool_sizes": pool_sizes, "windows": windows, "seed": cfg.seed, "strategies": list(cfg.strategies),
              "packing_policy": "split", "quick": cfg.quick}
    run = ExperimentRun(cfg.name, config, out_dir=cfg.out, force=cfg.force, quiet=cfg.quiet, workload=cfg.workload,
                        layouts=[{"seq_len": cfg.seq_len, "gbs": cfg.gbs}])
    base = {"workload": cfg.workload.name, "seq_len": cfg.seq_len, "gbs": cfg.gbs}
    packed: list = []

    def point(window: int) -> list[dict]:
        if not packed:  # pack lazily: a fully cached rerun never touches the data
            packed.extend(gbs_windows(cfg.workload, cfg.seq_len, cfg.gbs, windows, cfg.seed))
        return window_rows(window_workloads(packed[window]), cfg.strategies, pool_sizes, cfg.seed, window, base)

    rows = run.map(range(windows), point, desc=f"{cfg.name} S={cfg.seq_len} GBS={cfg.gbs}")
    df = pd.DataFrame(rows, columns=CSV_COLUMNS)
    summary = summary_table(df)
    paths = run.finish(df, plot=lambda frame, path: plot_sweep(frame, path, cfg.name, run_caption(run.config)),
                       extra={"summary_mean_r_minus_1": summary.reset_index().to_dict(orient="records")})
    return df, paths


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """Mean R - 1 over windows: rows = pool size, columns = strategies then the lower bound."""
    table = df.pivot_table(index="pool_size", columns="strategy", values="r_minus_1", aggfunc="mean")
    order = [s for s in GROUPINGS if s in table.columns]
    table = table[order]
    table["lower-bound"] = df.groupby("pool_size")["r_minus_1_lower_bound"].mean()
    return table


def print_summary(df: pd.DataFrame, echo=click.echo) -> None:
    """Print the summary table and, where the paper reports a value at this S, the comparison."""
    table = summary_table(df)
    seq_len = int(df["seq_len"].iloc[0])
    echo(f"mean R - 1 over {df['window'].nunique()} windows ({df['workload'].iloc[0]}, S={seq_len}, "
         f"GBS={int(df['gbs'].iloc[0])})")
    echo(table.to_string(float_format=lambda v: f"{v:.4f}"))
    for strategy, p, value, label in fig4_8_reference(seq_len):
        if strategy in table.columns and p in table.index:
            echo(f"  {label}: paper {value:g}, here {table.loc[p, strategy]:.4f}")


def format_tokens(n: int) -> str:
    """``1048576 -> '1M'``, ``262144 -> '256K'``, other values unchanged."""
    if n % 2**20 == 0:
        return f"{n // 2**20}M"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def plot_sweep(df: pd.DataFrame, path: Path, title: str, caption: str | None = None) -> None:
    """Mean R - 1 (with standard-error band) vs P on log-x / symlog-y axes."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from experiments.common.plotting import (
        STRATEGY_ORDER,
        mark_reference,
        palette_for,
        save_figure,
        setup_style,
    )

    setup_style()
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    names = [s for s in STRATEGY_ORDER if s in set(df["strategy"])]
    sns.lineplot(data=df, x="pool_size", y="r_minus_1", hue="strategy", hue_order=names,
                 palette=palette_for(names), marker="o", errorbar="se", ax=ax)
    bound = df.groupby("pool_size")["r_minus_1_lower_bound"].mean()
    ax.plot(bound.index, bound.values, linestyle="--", color="black", linewidth=1.2, label="lower bound")
    seq_len = int(df["seq_len"].iloc[0])
    sizes = sorted(int(p) for p in df["pool_size"].unique())
    for strategy, p, value, label in fig4_8_reference(seq_len):
        if strategy in names and p in sizes:
            mark_reference(ax, p, value, label, color=palette_for([strategy])[strategy])
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(p) for p in sizes])
    ax.minorticks_off()
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("pool size P (DP replicas per pool)")
    ax.set_ylabel("R - 1 (max pool / mean pool - 1)")
    ax.set_title(f"{title}: {df['workload'].iloc[0]}, S={format_tokens(seq_len)}, GBS={int(df['gbs'].iloc[0])}")
    ax.legend(fontsize=7, loc="best")
    save_figure(fig, path, caption=caption)


@click.command("vrsp")
@grouping_sweep_options()
def vrsp(workload, seq_len, gbs, pool_sizes, windows, seed, out, quick, force):
    """Figure 8: R - 1 vs pool size for production, random, zigzag, zigzag-swap and VRSP."""
    df, paths = run_grouping_sweep(GroupingSweepConfig(
        name="vrsp", strategies=list(GROUPINGS), workload=workload, seq_len=seq_len, gbs=gbs,
        pool_sizes=pool_sizes, windows=windows, seed=seed, out=out, quick=quick, force=force))
    print_summary(df)
    click.echo(f"wrote {paths['csv']}, {paths['png']}, {paths['run']}")
