"""`libra-bench pool-sweep`: Figure 15, pool size vs compute and communication (Libra sec. 6.5).

For each paper setting, Libra's TAP layout (H, B as in sec. 6.3) runs at every pool size P in
{1, 2, 4, 8, 16, 32} that divides DP. Per step the straggler (slowest worker of the slowest pool)
is split into computation (its attention kernels) and communication: Libra (TAP) and Libra
(TAP+VRSP) run without overlap, so their communication is the whole transfer time; Libra (full)
overlaps with the Pipeliner, so its communication is the exposed part. Everything is normalised to
the mean straggler of Ulysses on the same windows (sec. 6.5). Larger P widens the exchange
domain: at CP = 8 a pool of more than 8 replicas crosses a supernode boundary of the default profile.

``--block-size``, ``--head-split``, ``--tau`` and ``--pipeline-chunks`` override the settings' TAP
layout (default: each setting's; recorded in ``run.json``).

Outputs: ``pool_sweep.csv`` (one row per setting, P, method, window, step), ``pool_sweep_summary.csv``
(means per setting, P, method, with the paper's quoted values where sec. 6.5 gives them),
``pool_sweep.png`` and ``run.json``.

``--score-profile`` prices (cost model and device jitter) with another profile than the one the
planners plan with (``--profile``: ``libra-kt``'s kernel-time estimate); see ``straggler``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.common.options import IntListType, given_layout, layout_options, settings_option, tap_options
from experiments.common.paper import fig15_marks
from experiments.common.runner import ExperimentRun
from experiments.common.runs_table import run_caption
from experiments.common.sim_common import (
    LABELS,
    TAP_METHODS,
    SimulatedRunConfig,
    build_cost_model,
    check_counts,
    check_settings,
    chosen_settings,
    common_options,
    format_table,
    jitter_seed,
    load_windows,
    make_planner,
    make_shape,
    parse_list,
    resolve_profile,
    resolve_score_profile,
    score_profile_option,
    score_record,
    setting_record,
    settings_from_options,
    workload_record,
)
from libra.data.source import resolve_workload
from libra.sim.simulator import simulate_window
from libra.workload import AttentionShape

POOL_SIZES = (1, 2, 4, 8, 16, 32)

PAPER_FIG15 = fig15_marks()  # Libra sec. 6.5: TAP+VRSP compute / comm over Ulysses mean, per (setting, P)


@dataclass(frozen=True, kw_only=True)
class PoolSweepConfig(SimulatedRunConfig):
    """What one `libra-bench pool-sweep` run simulates and where it writes (the command builds it once)."""

    pool_sizes: Sequence[int] | None
    methods: Sequence[str]
    shape: AttentionShape
    name: str = "pool_sweep"


def run_pool_sweep(cfg: PoolSweepConfig):
    """Simulate Ulysses once and each Libra variant at every P dividing DP; returns (steps, summary, run).

    ``tap_overrides``: TapConfig fields replacing every setting's (None values keep the setting's).
    """
    settings = cfg.settings
    chosen = chosen_settings(settings, cfg.tap_overrides)
    settings = list(chosen)
    check_settings(chosen, cfg.shape, cfg.pool_sizes)
    config = {"workload": cfg.workload, "workload_source": workload_record(cfg.workload), "profile": cfg.profile.to_dict(), "settings": [setting_record(chosen[s]) for s in settings],
              "pool_sizes": list(cfg.pool_sizes), "methods": list(cfg.methods), "windows": cfg.windows, "seed": cfg.seed,
              "shape": [cfg.shape.num_q_heads, cfg.shape.num_kv_heads, cfg.shape.head_dim, cfg.shape.dtype_bytes],
              **score_record(cfg.score_profile)}
    run = ExperimentRun(cfg.name, config, out_dir=cfg.out, force=cfg.force, quiet=cfg.quiet)
    cache: dict = {}

    def context(s):
        if s not in cache:
            st = chosen[s]
            cache[s] = (st, load_windows(cfg.workload, st, cfg.windows, cfg.seed), build_cost_model(cfg.scoring, st.par()))
        return cache[s]

    def point(key):
        s, p, method, w = key
        st, wins, cm = context(s)
        planner = make_planner(method, st, pool_size=None if method == "ulysses" else p, profile=cfg.profile)
        steps = simulate_window(planner, wins[w], st.par(), cfg.shape, cm, seed=jitter_seed(cfg.seed, w))
        label = resolve_workload(cfg.workload).name  # the file name (#column), or the preset
        return [{"workload": label, "setting": s, "pool_size": p, "method": method, "window": w, **r.to_row()}
                for r in steps]

    keys = []
    for s in settings:
        dp = chosen[s].dp
        if not any(dp % p == 0 for p in cfg.pool_sizes):
            raise ValueError(f"no pool size in {list(cfg.pool_sizes)} divides DP={dp} of setting {s}")
        keys += [[s, 0, "ulysses", w] for w in range(cfg.windows)]
        keys += [[s, p, m, w] for p in cfg.pool_sizes if dp % p == 0 for m in cfg.methods for w in range(cfg.windows)]
    df = pd.DataFrame(run.map(keys, point, desc="pool-sweep"))
    return df, summarize(df), run


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Mean straggler, compute and communication per (setting, P, method) / Ulysses mean."""
    rows = []
    for s, g in df.groupby("setting", sort=False):
        u_mean = g[g["method"] == "ulysses"]["straggler_ms"].mean()
        for (p, m), h in g[g["method"] != "ulysses"].groupby(["pool_size", "method"], sort=True):
            # split methods (M = 1): exposed == whole communication; full Libra: the exposed part
            row = {"setting": s, "pool_size": int(p), "method": m, "steps": len(h),
                   "straggler_norm": h["straggler_ms"].mean() / u_mean,
                   "compute_norm": h["compute_ms"].mean() / u_mean,
                   "comm_norm": h["comm_exposed_ms"].mean() / u_mean,
                   "comm_serial_norm": h["comm_serial_ms"].mean() / u_mean,
                   "inter_supernode_gb": h["bytes_inter_supernode"].mean() / 1e9,
                   "roce_gb": h["bytes_roce"].mean() / 1e9, "nvlink_gb": h["bytes_nvlink"].mean() / 1e9,
                   "ulysses_mean_ms": u_mean}
            paper = PAPER_FIG15.get((s, int(p)), {}) if m == "libra-tap-vrsp" else {}
            row["paper_compute"] = paper.get("paper_compute", np.nan)
            row["paper_comm"] = paper.get("paper_comm", np.nan)
            rows.append(row)
    return pd.DataFrame(rows)


def plot_pool_sweep(summary: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    """Per setting and method: the total straggler, its compute and its exposed communication vs P,
    each over Ulysses' mean straggler; the paper's compute and communication as X and P marks."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    settings = list(dict.fromkeys(summary["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(6.2 * len(settings), 4.2), squeeze=False)
    parts = {"straggler_norm": "total straggler", "compute_norm": "compute", "comm_norm": "exposed communication"}
    long = summary.melt(id_vars=["setting", "pool_size", "method"], value_vars=list(parts),
                        var_name="part of the straggler", value_name="norm")
    long["part of the straggler"] = long["part of the straggler"].map(parts)
    long["method"] = long["method"].map(lambda m: LABELS.get(m, m))
    for ax, s in zip(axes[0], settings):
        sub = long[long["setting"] == s]
        sns.lineplot(data=sub, x="pool_size", y="norm", hue="method", style="part of the straggler",
                     style_order=list(parts.values()), markers=True, ax=ax)
        ps = summary[(summary["setting"] == s) & (summary["method"] == "libra-tap-vrsp")]
        for col, mk in (("paper_compute", "X"), ("paper_comm", "P")):
            pts = ps[np.isfinite(ps[col])]
            if len(pts):
                ax.scatter(pts["pool_size"], pts[col], marker=mk, color="black", s=60, zorder=5,
                           label=f"paper {col.split('_')[1]} (TAP+VRSP)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(summary.loc[summary["setting"] == s, "pool_size"])))
        ax.set_xlabel("pool size P (DP replicas)")
        ax.set_ylabel("time / Ulysses mean straggler")
        ax.set_title(f"{s}: the straggler and its parts vs P")
        if s == settings[-1]:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.get_legend().remove()
    from experiments.common.plotting import save_figure  # noqa: PLC0415  (Agg backend)

    save_figure(fig, path, caption=caption)


@click.command("pool-sweep")
@common_options(default_windows=4)
@settings_option()
@layout_options()
@click.option("--pool-sizes", type=IntListType(), default=",".join(map(str, POOL_SIZES)), show_default=True,
              help="Comma list of P (those not dividing DP are skipped per setting).")
@click.option("--methods", default=",".join(TAP_METHODS), show_default=True,
              help="Comma list of Libra variants to sweep.")
@tap_options("block_size", "head_split", "tau", "pipeline_chunks", per_setting=True)
@score_profile_option()
def pool_sweep(profile, windows, seed, out, quick, force, q_heads, kv_heads, head_dim, no_progress, workload,
               settings_, dp, cp, seq_len, gbs, pool_sizes, methods, block_size, head_split, tau, pipeline_chunks,
               score_profile):
    """Figure 15: compute vs communication of the slowest pool as the pool size P grows."""
    check_counts(windows, seed)
    prof = resolve_profile(profile)
    scoring = resolve_score_profile(score_profile, prof)
    layout = given_layout(dp, cp, seq_len, gbs)
    try:
        settings = settings_from_options(settings_, layout)
        method_list = parse_list(methods, TAP_METHODS, "method")
        sizes = list(pool_sizes)
        shape = make_shape(q_heads, kv_heads, head_dim)
        t0 = time.perf_counter()
        cfg = PoolSweepConfig(workload=workload, profile=prof, settings=settings, pool_sizes=sizes,
                              methods=method_list, windows=1 if quick else windows, seed=seed, shape=shape,
                              out=out, force=force, quiet=no_progress, score_profile=scoring,
                              tap_overrides={"block_size": block_size, "head_split": head_split,
                                             "tau": tau, "pipeline_chunks": pipeline_chunks})
        df, summary, run = run_pool_sweep(cfg)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    paths = run.finish(df, plot=lambda _d, p: plot_pool_sweep(summary, p, run_caption(run.config)),
                       extra={"profile": prof.to_dict(), **score_record(scoring)},
                       files={"pool_sweep_summary.csv": summary.to_csv(index=False)})
    if scoring is not None:
        click.echo(f"planned with profile {prof.name}, scored with profile {scoring.name}")
    click.echo(format_table(summary, ["setting", "pool_size", "method", "straggler_norm", "compute_norm",
                                      "comm_norm", "paper_compute", "paper_comm", "inter_supernode_gb"], "{:.3f}"))
    click.echo(f"wall {time.perf_counter() - t0:.1f} s; wrote {paths['csv']}, {paths.get('png')}")
