"""`libra-bench straggler`: Figure 12, the straggler comparison of every method (Libra sec. 6.3).

For each paper setting (256K: DP 32, CP 8, GBS 128; 1M: DP 16, CP 16, GBS 32; Libra at P 8, H 2,
B 4096 / 8192) and each method of the planner registry, every GBS window is planned and every
step (GA index) priced by the cost model (:mod:`libra.sim`) under seeded device jitter shared by
all methods. A step's straggler is its slowest worker's forward + backward core-attention time
(compute + exposed communication). Per method we report the mean straggler over all steps and the
worst step of a window (averaged over windows), both normalised to Ulysses' mean, the speedups
over Ulysses, the paper's speedups where sec. 6.3 gives them, and the ratio of the straggler to
the perfect-balance bound (total attention compute of the step spread over all workers at the
kernel's best rate, ``bound_ratio``) and to the step's own kernel time spread evenly
(``balanced_ratio``: the same segments at their real efficiency, so it isolates placement and
communication from the short-segment kernel penalty every method pays).

Outputs (``results/straggler/`` or ``--out``): ``straggler.csv`` (one row per setting, method,
window, step), ``straggler_summary.csv``, ``straggler.png`` and ``run.json`` (with the profile).

``--block-size``, ``--head-split``, ``--tau`` and ``--pipeline-chunks`` override the settings' TAP
layout (default: each setting's; recorded in ``run.json``'s settings and planner options).

``--methods`` may also name :data:`experiments.sim_common.OPTIONAL_METHODS` (``libra-kt``, which
gets the run's ``--profile`` so its kernel-time estimate uses the curve the cost model prices
with). Such a run is recorded as experiment ``straggler-extension`` (files
``straggler-extension.csv/.png``, default folder ``results/straggler-extension``) so that the
report's Figure 12 rows keep reading the paper-methods run.
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.options import tap_options
from experiments.runner import ExperimentRun, atomic_write_text
from experiments.sim_common import (
    LABELS,
    METHODS,
    OPTIONAL_METHODS,
    SETTINGS,
    WLB_REJOIN_DEFAULT,
    build_cost_model,
    check_counts,
    common_options,
    format_table,
    jitter_seed,
    load_windows,
    make_planner,
    make_shape,
    parse_list,
    planner_options,
    resolve_profile,
    setting_record,
    with_tap,
    workload_record,
)
from libra.sim.simulator import simulate_window

# Speedups over Ulysses that Libra sec. 6.3 states or implies (mean = mean straggler, max = worst
# step). Libra's are quoted; the others follow from the quoted percentages: WLB-LLM mean = Libra
# x (1 - 0.159) (256K) / (1 - 0.421) (1M); DistCA = Libra x (1 - 0.537 | 0.642 | 0.077 | 0.079);
# TAP+VRSP max = Libra x (1 - 0.051 | 0.192); TAP max = TAP+VRSP x (1 - 0.096 | 0.262).
PAPER_SPEEDUP = {
    ("256k", "mean"): {"ulysses": 1.0, "wlb-llm": 2.91 * (1 - 0.159), "distca": 2.91 * (1 - 0.537), "libra": 2.91},
    ("1m", "mean"): {"ulysses": 1.0, "wlb-llm": 2.57 * (1 - 0.421), "distca": 2.57 * (1 - 0.077), "libra": 2.57},
    ("256k", "max"): {"ulysses": 1.0, "wlb-llm": 3.14 * (1 - 0.684), "distca": 3.14 * (1 - 0.642),
                      "libra-tap-vrsp": 3.14 * (1 - 0.051), "libra-tap": 3.14 * (1 - 0.051) * (1 - 0.096),
                      "libra": 3.14},
    ("1m", "max"): {"ulysses": 1.0, "wlb-llm": 2.90 * (1 - 0.656), "distca": 2.90 * (1 - 0.079),
                    "libra-tap-vrsp": 2.90 * (1 - 0.192), "libra-tap": 2.90 * (1 - 0.192) * (1 - 0.262),
                    "libra": 2.90},
}


def run_straggler(workload: str, profile, settings, methods, windows: int, seed: int, shape,
                  out: str | None = None, force: bool = False, quiet: bool = False,
                  wlb_rejoin: str = WLB_REJOIN_DEFAULT, tap_overrides: dict | None = None,
                  name: str = "straggler") -> tuple[pd.DataFrame, pd.DataFrame, ExperimentRun, dict]:
    """Simulate every (setting, method, window); returns (steps, summary, run, timings).

    Args:
        tap_overrides: TapConfig fields replacing every setting's (None values keep the setting's).

    Raises:
        ValueError: unknown setting/method, a bad workload or a layout the planners reject.
    """
    chosen = {s: with_tap(SETTINGS[s], **(tap_overrides or {})) for s in settings}
    config = {"workload": workload, "workload_source": workload_record(workload), "profile": profile.to_dict(), "settings": [setting_record(chosen[s]) for s in settings],
              "methods": list(methods), "windows": windows, "seed": seed, "wlb_rejoin": wlb_rejoin,
              "shape": {"num_q_heads": shape.num_q_heads, "num_kv_heads": shape.num_kv_heads,
                        "head_dim": shape.head_dim, "dtype_bytes": shape.dtype_bytes},
              "planner_options": {s: {m: planner_options(m, chosen[s], wlb_rejoin=wlb_rejoin) for m in methods}
                                  for s in settings}}
    for s in settings:  # libra-kt's estimate must use the profile the cost model prices with
        for m in methods:
            if m == "libra-kt":
                config["planner_options"][s][m]["profile"] = profile.name
    run = ExperimentRun(name, config, out_dir=out, force=force, quiet=quiet)
    cache: dict = {}
    timings: dict = {}

    def context(setting_name):
        if setting_name not in cache:
            st = chosen[setting_name]
            cache[setting_name] = (st, load_windows(workload, st, windows, seed), build_cost_model(profile, st.par()))
        return cache[setting_name]

    def point(key):
        setting_name, method, w = key
        st, wins, cost_model = context(setting_name)
        if method == "libra-kt":
            from baselines.registry import get_planner  # noqa: PLC0415

            planner = get_planner(method, **planner_options(method, st, wlb_rejoin=wlb_rejoin), profile=profile)
        else:
            planner = make_planner(method, st, wlb_rejoin=wlb_rejoin)
        t0 = time.perf_counter()
        steps = simulate_window(planner, wins[w], st.par(), shape, cost_model, seed=jitter_seed(seed, w))
        timings[(setting_name, method)] = timings.get((setting_name, method), 0.0) + time.perf_counter() - t0
        rows = []
        for r in steps:
            row = {"workload": Path(workload).name if Path(workload).exists() else workload,
                   "setting": setting_name, "method": method, "window": w, **r.to_row()}
            row["bound_ratio"] = r.straggler_ms / r.balance_bound_ms if r.balance_bound_ms > 0 else float("nan")
            row["balanced_ratio"] = (r.straggler_ms / r.balanced_compute_ms if r.balanced_compute_ms > 0
                                     else float("nan"))
            rows.append(row)
        return rows

    keys = [[s, m, w] for s in settings for m in methods for w in range(windows)]
    df = pd.DataFrame(run.map(keys, point, desc="straggler"))
    lead = ["workload", "setting", "method", "window", "step", "straggler_ms", "compute_ms", "comm_exposed_ms"]
    df = df[lead + [c for c in df.columns if c not in lead]]
    return df, summarize(df), run, timings


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, method): mean straggler, mean per-window worst step, both / Ulysses' mean."""
    rows = []
    for (setting, method), g in df.groupby(["setting", "method"], sort=False):
        per_window_max = g.groupby("window")["straggler_ms"].max()
        rows.append({"workload": g["workload"].iloc[0], "setting": setting, "method": method,
                     "steps": len(g), "windows": g["window"].nunique(),
                     "mean_ms": g["straggler_ms"].mean(), "max_ms": per_window_max.mean(),
                     "max_overall_ms": g["straggler_ms"].max(),
                     "compute_ms": g["compute_ms"].mean(), "comm_exposed_ms": g["comm_exposed_ms"].mean(),
                     "bound_ms": g["balance_bound_ms"].mean(), "bound_ratio": g["bound_ratio"].mean(),
                     # absent from CSVs written before this column existed
                     "balanced_compute_ms": g["balanced_compute_ms"].mean() if "balanced_compute_ms" in g else np.nan,
                     "balanced_ratio": g["balanced_ratio"].mean() if "balanced_ratio" in g else np.nan})
    out = pd.DataFrame(rows)
    for _setting, g in out.groupby("setting", sort=False):
        base = g[g["method"] == "ulysses"]
        if base.empty:
            continue
        u_mean, u_max = float(base["mean_ms"].iloc[0]), float(base["max_ms"].iloc[0])
        idx = g.index
        out.loc[idx, "mean_norm"] = out.loc[idx, "mean_ms"] / u_mean
        out.loc[idx, "max_norm"] = out.loc[idx, "max_ms"] / u_mean
        out.loc[idx, "mean_speedup"] = u_mean / out.loc[idx, "mean_ms"]
        out.loc[idx, "max_speedup"] = u_max / out.loc[idx, "max_ms"]
    out["paper_mean_speedup"] = [PAPER_SPEEDUP.get((s, "mean"), {}).get(m, np.nan)
                                 for s, m in zip(out["setting"], out["method"])]
    out["paper_max_speedup"] = [PAPER_SPEEDUP.get((s, "max"), {}).get(m, np.nan)
                                for s, m in zip(out["setting"], out["method"])]
    return out


def plot_straggler(summary: pd.DataFrame, path: Path) -> None:
    """Bars: mean and worst-step straggler / Ulysses mean; black marks: the paper's values.

    The paper gives speedups, so its mean mark is ``1 / paper mean speedup`` and its max mark is
    our Ulysses worst step (normalised) divided by the paper's worst-step speedup.
    """
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    long = summary.melt(id_vars=["setting", "method"], value_vars=["mean_norm", "max_norm"],
                        var_name="metric", value_name="norm")
    long["metric"] = long["metric"].map({"mean_norm": "mean", "max_norm": "max"})
    long["label"] = long["method"].map(LABELS)
    settings = list(dict.fromkeys(summary["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(6.5 * len(settings), 4.2), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        sub = long[long["setting"] == setting]
        order = [LABELS[m] for m in summary[summary["setting"] == setting]["method"]]
        sns.barplot(data=sub, x="label", y="norm", hue="metric", order=order, hue_order=["mean", "max"], ax=ax)
        srow = summary[summary["setting"] == setting].set_index("method")
        u_max = float(srow["max_norm"].get("ulysses", np.nan)) if "ulysses" in srow.index else np.nan
        for i, method in enumerate(srow.index):
            for j, (metric, off) in enumerate((("mean", -0.2), ("max", 0.2))):
                sp = PAPER_SPEEDUP.get((setting, metric), {}).get(method)
                if sp is None or not np.isfinite(u_max):
                    continue
                y = 1.0 / sp if metric == "mean" else u_max / sp
                ax.plot(i + off, y, marker="_", color="black", markersize=18, mew=2.5,
                        label="paper" if (i, j) == (0, 0) else None)
        ax.set_title(f"{setting}: straggler / Ulysses mean (black: paper)")
        ax.set_xlabel("")
        ax.set_ylabel("normalised straggler time")
        ax.tick_params(axis="x", rotation=25)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)


@click.command("straggler")
@common_options(default_windows=8)
@click.option("--settings", "settings_", default="256k,1m", show_default=True, help="Comma list: 256k, 1m.")
@click.option("--methods", default=",".join(METHODS), show_default=True,
              help=f"Comma list of planner names; also {', '.join(OPTIONAL_METHODS)} (not in the paper).")
@click.option("--wlb-rejoin", type=click.Choice(["none", "context", "full"]), default=WLB_REJOIN_DEFAULT,
              show_default=True,
              help="WLB-LLM's rejoin option; anything but 'none' gives it more attention work than the others.")
@tap_options("block_size", "head_split", "tau", "pipeline_chunks", per_setting=True)
def straggler(profile, windows, seed, out, quick, force, q_heads, kv_heads, head_dim, no_progress, workload,
              settings_, methods, wlb_rejoin, block_size, head_split, tau, pipeline_chunks):
    """Figure 12: mean and worst-step straggler of every method in both paper settings."""
    check_counts(windows, seed)
    prof = resolve_profile(profile)
    try:
        settings = parse_list(settings_, tuple(SETTINGS), "setting")
        method_list = parse_list(methods, METHODS + OPTIONAL_METHODS, "method")
        shape = make_shape(q_heads, kv_heads, head_dim)
        if "ulysses" not in method_list:
            method_list = ("ulysses",) + method_list  # the normalisation needs it
        t0 = time.perf_counter()
        df, summary, run, timings = run_straggler(workload, prof, settings, method_list, 1 if quick else windows,
                                                  seed, shape, out=out, force=force, quiet=no_progress,
                                                  wlb_rejoin=wlb_rejoin,
                                                  tap_overrides={"block_size": block_size, "head_split": head_split,
                                                                 "tau": tau, "pipeline_chunks": pipeline_chunks},
                                                  name="straggler-extension" if set(method_list) - set(METHODS)
                                                  else "straggler")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    wall = time.perf_counter() - t0
    atomic_write_text(run.out_dir / "straggler_summary.csv", summary.to_csv(index=False))
    per_setting = {s: round(sum(v for (ss, _), v in timings.items() if ss == s), 3) for s in settings}
    paths = run.finish(df, plot=lambda _d, p: plot_straggler(summary, p),
                       extra={"profile": prof.to_dict(), "simulate_seconds_per_setting": per_setting,
                              "simulate_seconds": {f"{s}/{m}": round(v, 3) for (s, m), v in timings.items()}})
    click.echo(format_table(summary, ["setting", "method", "mean_ms", "max_ms", "mean_norm", "max_norm",
                                      "mean_speedup", "paper_mean_speedup", "max_speedup", "paper_max_speedup",
                                      "bound_ratio", "balanced_ratio"], "{:.2f}"))
    click.echo(f"simulation seconds per setting (computed points only): {per_setting}; wall {wall:.1f} s")
    click.echo(f"wrote {paths['csv']}, {paths.get('png')}, {run.out_dir / 'straggler_summary.csv'}")
