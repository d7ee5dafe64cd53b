"""`libra-bench straggler`: Figure 12, the straggler comparison of every method (Libra sec. 6.3).

For each paper setting (256K: DP 32, CP 8, GBS 128; 1M: DP 16, CP 16, GBS 32; Libra at P 8, H 2,
B 4096 / 8192) and each method of the planner registry, every GBS window is planned and every
step (GA index) priced by the cost model (:mod:`libra.sim`) under seeded device jitter shared by
all methods (``--no-jitter``: every GPU at speed 1, recorded as ``jitter`` in ``run.json``'s
config). A step's straggler is its slowest worker's forward + backward core-attention time
(compute + exposed communication). Per method we report the mean straggler over all steps and the
worst step of a window (averaged over windows), both normalised to Ulysses' mean, the speedups
over Ulysses (and their spread over windows), the window total (a window's step stragglers summed:
the one comparable figure for a planner that forms another number of microbatches than GA, such
as ``dynamic-cp``) and its speedup, the paper's speedups where sec. 6.3 gives them, and
the ratio of the straggler to the perfect-balance bound (total attention compute of the step
spread over all workers at the kernel's best rate, ``bound_ratio``) and to the step's own kernel
time spread evenly (``balanced_ratio``).

Bounds and loss decomposition (every step, every method; all times in ms of one layer's forward +
backward core attention, FLOPs converted at the profile's best kernel rate as ``balance_bound_ms``
is):

* ``flops_ulysses_ms`` / ``flops_libra_ms``: the window's FLOPs-only stragglers at that GA index
  (:func:`libra.sim.simulator.flops_stragglers`: Ulysses' heaviest packed sequence / CP in
  production order; Libra's heaviest VRSP pool / (P * CP) at the setting's P). They depend on the
  window only, so every method's row of a step repeats them.
* ``comm_factor x placement_factor x pooling_factor x kernel_factor = bound_ratio`` exactly
  (:meth:`libra.sim.cost.PlanCost.loss_factors`; "mean worker compute" is over every worker of
  the plan's pools, the workers ``balance_bound_ms`` divides by).
* ``placement_plan_factor x placement_device_factor = placement_factor``
  (:meth:`libra.sim.cost.PlanCost.placement_split`): the imbalance the plan leaves at speed 1,
  and how much the step's device speed draw moves it (1 with ``--no-jitter``).

``straggler_summary.csv`` gives each factor, ``pool_balanced_ratio = comm x placement`` and
``bound_ratio_gmean`` as geometric means over steps (so the product stays exact:
``comm x placement x pooling x kernel = bound_ratio_gmean``) and ``flops_limit_speedup`` = mean
``flops_ulysses_ms`` / mean ``flops_libra_ms``.

Outputs (``runs/straggler/<workload>-<layouts>-<profile>/`` or ``--out``; ``make fig12`` writes
``results/straggler/``): ``straggler.csv`` (one row per setting, method,
window, step), ``straggler_summary.csv``, ``straggler.png`` (speedups, and the four factors per
method stacked on a log axis) and ``run.json`` (with the profile). The experiment is ``straggler``
whatever ``--methods`` holds.

``--block-size``, ``--head-split``, ``--tau`` and ``--pipeline-chunks`` override the settings' TAP
layout (default: each setting's; recorded in ``run.json``'s settings and planner options).

``--methods`` takes any registered planner (``all``: the default list, then
:data:`experiments.common.sim_common.OPTIONAL_METHODS`, then any other registered planner). A planner
with a ``profile`` option (``libra-kt``, ``libra-adaptive``) gets the run's ``--profile``, so its
kernel-time estimate uses the curve the cost model prices with -- unless ``--score-profile`` names
another: then planners plan with ``--profile`` and the cost model and the device jitter (and
``--known-speeds``' persistent speeds) come from the score profile, the model being wrong the way
the two differ (``run.json`` records ``score_profile`` only then; captions and the printout name it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.common.options import given_layout, layout_options, settings_option, tap_options
from experiments.common.paper import fig12_speedups, paper_settings
from experiments.common.runner import ExperimentRun
from experiments.common.runs_table import run_caption
from experiments.common.sim_common import (
    LABELS,
    METHODS,
    OPTIONAL_METHODS,
    WLB_REJOIN_DEFAULT,
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
    planner_options,
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
from libra.sim.variability import DeviceJitter
from libra.workload import AttentionShape

# Speedups over Ulysses that Libra sec. 6.3 states or implies (mean = mean straggler, max = worst step)
PAPER_SPEEDUP = fig12_speedups()


def all_methods() -> tuple[str, ...]:
    """``--methods all``: the default list, the optional ones, then every other registered planner."""
    from baselines.registry import PLANNERS  # noqa: PLC0415  (keeps `--help` fast)

    head = METHODS + OPTIONAL_METHODS
    return head + tuple(m for m in PLANNERS if m not in head)


def run_options(method: str, setting, profile, wlb_rejoin: str) -> dict:
    """The recorded registry options of ``method`` in ``setting`` (the run config's
    ``planner_options``); profile-taking planners record the run's profile."""
    return planner_options(method, setting, wlb_rejoin=wlb_rejoin, profile=profile)


@dataclass(frozen=True, kw_only=True)
class StragglerConfig(SimulatedRunConfig):
    """What one `libra-bench straggler` run simulates and where it writes (the command builds it once)."""

    methods: Sequence[str]
    shape: AttentionShape
    wlb_rejoin: str = WLB_REJOIN_DEFAULT
    jitter: bool = True
    known_speeds: bool = False


def run_straggler(cfg: StragglerConfig) -> tuple[pd.DataFrame, pd.DataFrame, ExperimentRun, dict]:
    """Simulate every (setting, method, window); returns (steps, summary, run, timings).

    Args:
        settings: paper setting names (:data:`SETTINGS`) or :class:`Setting` objects (a user's layout).
        tap_overrides: TapConfig fields replacing every setting's (None values keep the setting's).
        jitter: apply the profile's device variability (False: every GPU at speed 1).
        known_speeds: tell planners that take ``device_speeds`` (``libra-adaptive``) each GPU's
            persistent speed factor of the window's jitter draw
            (:meth:`libra.sim.variability.DeviceJitter.persistent_speeds`); needs ``jitter``.

    Raises:
        ValueError: unknown setting/method, a bad workload, a layout the planners reject, or
            ``known_speeds`` without ``jitter`` or without a method that takes device speeds.
    """
    settings = cfg.settings
    from baselines.registry import PLANNERS, planner_class  # noqa: PLC0415

    def takes_speeds(method: str) -> bool:  # the one rule: a planner with a device_speeds option
        return "device_speeds" in planner_class(method).option_names()

    if cfg.known_speeds and not cfg.jitter:
        raise ValueError("--known-speeds tells planners the jitter model's per-GPU speeds: drop --no-jitter")
    if cfg.known_speeds and not any(map(takes_speeds, cfg.methods)):
        raise ValueError(f"--known-speeds informs planners that take device speeds, and none of "
                         f"{', '.join(cfg.methods)} does: add {' or '.join(filter(takes_speeds, PLANNERS))} to --methods")

    chosen = chosen_settings(settings, cfg.tap_overrides)
    settings = list(chosen)
    check_settings(chosen, cfg.shape)
    options = {s: {m: {k: (v.name if k == "profile" else v)
                       for k, v in run_options(m, chosen[s], cfg.profile, cfg.wlb_rejoin).items()}
                   for m in cfg.methods}
               for s in settings}
    config = {"workload": cfg.workload, "workload_source": workload_record(cfg.workload),
              "profile": cfg.profile.to_dict(),
              "settings": [setting_record(chosen[s]) for s in settings], "methods": list(cfg.methods),
              "windows": cfg.windows, "seed": cfg.seed, "wlb_rejoin": cfg.wlb_rejoin, "jitter": bool(cfg.jitter),
              **({"known_speeds": True} if cfg.known_speeds else {}), **score_record(cfg.score_profile),
              "shape": {"num_q_heads": cfg.shape.num_q_heads, "num_kv_heads": cfg.shape.num_kv_heads,
                        "head_dim": cfg.shape.head_dim, "dtype_bytes": cfg.shape.dtype_bytes},
              "planner_options": options}
    run = ExperimentRun("straggler", config, out_dir=cfg.out, force=cfg.force, quiet=cfg.quiet)
    cache: dict = {}
    label = resolve_workload(cfg.workload).name  # the file name (#column), or the preset

    def context(setting_name):
        if setting_name not in cache:
            st = chosen[setting_name]
            cache[setting_name] = (st, load_windows(cfg.workload, st, cfg.windows, cfg.seed),
                                   build_cost_model(cfg.scoring, st.par()))
        return cache[setting_name]

    def point(key):
        setting_name, method, w = key
        st, wins, cost_model = context(setting_name)
        speeds = {}
        if cfg.known_speeds and takes_speeds(method):
            dev = DeviceJitter(cfg.scoring.variability, st.par().workers, jitter_seed(cfg.seed, w))
            speeds["device_speeds"] = tuple(dev.persistent_speeds().tolist())
        planner = make_planner(method, st, wlb_rejoin=cfg.wlb_rejoin, profile=cfg.profile, **speeds)
        steps = simulate_window(planner, wins[w], st.par(), cfg.shape, cost_model, seed=jitter_seed(cfg.seed, w),
                                jitter=cfg.jitter, flops_pool_size=st.tap.pool_size)
        return [step_row(r, label, setting_name, w) for r in steps]

    keys = [[s, m, w] for s in settings for m in cfg.methods for w in range(cfg.windows)]
    df = pd.DataFrame(run.map(keys, point, desc="straggler"))
    lead = ["workload", "setting", "method", "window", "step", "straggler_ms", "compute_ms", "comm_exposed_ms"]
    df = df[lead + [c for c in df.columns if c not in lead]]
    timings: dict = {}  # computed points' seconds (timed where they ran, --jobs workers included)
    for (setting_name, method, _), seconds in run.point_seconds:
        timings[(setting_name, method)] = timings.get((setting_name, method), 0.0) + seconds
    return df, summarize(df, paper_settings(cfg.workload, chosen, cfg.shape)), run, timings


def step_row(r, workload: str, setting: str, window: int) -> dict:
    """One CSV row of a step: its StepResult plus the ratios to the two balance references."""
    return {"workload": workload, "setting": setting, "method": r.method, "window": window, **r.to_row(),
            **step_ratios(r)}


def step_ratios(r) -> dict:
    """A StepResult's straggler over the two balance references and its pool-balanced ratio (the
    per-step columns :func:`loss_decomposition` reads; ``tune``'s steps carry them too)."""
    return {"bound_ratio": r.straggler_ms / r.balance_bound_ms if r.balance_bound_ms > 0 else float("nan"),
            "balanced_ratio": r.straggler_ms / r.balanced_compute_ms if r.balanced_compute_ms > 0 else float("nan"),
            "pool_balanced_ratio": r.comm_factor * r.placement_factor}


FACTORS = ("comm_factor", "placement_factor", "pooling_factor", "kernel_factor")
"""The loss decomposition's factors, straggler side first (their product is ``bound_ratio``)."""
PLACEMENT_SPLIT = ("placement_plan_factor", "placement_device_factor")
"""``placement_factor`` split into the plan's own imbalance and the device speed draw's share."""


def gmean(values) -> float:
    """Geometric mean; NaN when a value is missing, not finite or not positive (no silent drop)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0 or not np.all(np.isfinite(v)) or np.any(v <= 0):
        return float("nan")
    return float(np.exp(np.log(v).mean()))


def _col(g: pd.DataFrame, name: str, how) -> float:
    """``how(g[name])``, NaN for CSVs written before the column existed (the report reads those)."""
    return how(g[name]) if name in g else float("nan")


def loss_decomposition(g: pd.DataFrame) -> dict:
    """Geometric-mean factors, their products and the FLOPs-only limit of one group of steps (a
    (setting, method) here, a candidate layout in ``tune``)."""
    out = {f: _col(g, f, gmean) for f in FACTORS + PLACEMENT_SPLIT}
    out["pool_balanced_ratio"] = out["comm_factor"] * out["placement_factor"]
    out["bound_ratio_gmean"] = gmean(g["bound_ratio"])
    out["flops_ulysses_ms"] = _col(g, "flops_ulysses_ms", lambda c: float(c.mean()))
    out["flops_libra_ms"] = _col(g, "flops_libra_ms", lambda c: float(c.mean()))
    out["flops_limit_speedup"] = out["flops_ulysses_ms"] / out["flops_libra_ms"]
    return out


def summarize(df: pd.DataFrame, paper: set[str] | None = None) -> pd.DataFrame:
    """Per (setting, method): mean straggler, mean per-window worst step, both / Ulysses' mean, the
    window total (``window_ms``: a window's step stragglers summed, mean over windows, and
    ``window_speedup`` = Ulysses' / the method's), and the loss decomposition (geometric means over
    steps) with the FLOPs-only limit.

    ``paper``: the settings that get the paper's speedups (``paper_mean_speedup``,
    ``paper_max_speedup``; None: every setting the paper reports). An empty set leaves the
    columns out (a run on other data or another layout is not comparable to the paper's)."""
    rows = []
    for (setting, method), g in df.groupby(["setting", "method"], sort=False):
        per_window_max = g.groupby("window")["straggler_ms"].max()
        rows.append({"workload": g["workload"].iloc[0], "setting": setting, "method": method,
                     "steps": len(g), "windows": g["window"].nunique(),
                     "mean_ms": g["straggler_ms"].mean(), "max_ms": per_window_max.mean(),
                     "window_ms": g.groupby("window")["straggler_ms"].sum().mean(),
                     "max_overall_ms": g["straggler_ms"].max(),
                     "compute_ms": g["compute_ms"].mean(), "comm_exposed_ms": g["comm_exposed_ms"].mean(),
                     "bound_ms": g["balance_bound_ms"].mean(), "bound_ratio": g["bound_ratio"].mean(),
                     "balanced_compute_ms": _col(g, "balanced_compute_ms", lambda c: float(c.mean())),
                     "balanced_ratio": _col(g, "balanced_ratio", lambda c: float(c.mean())),
                     **loss_decomposition(g)})
    out = pd.DataFrame(rows)
    for setting, g in out.groupby("setting", sort=False):
        base = g[g["method"] == "ulysses"]
        if base.empty:
            continue
        u_mean, u_max = float(base["mean_ms"].iloc[0]), float(base["max_ms"].iloc[0])
        idx = g.index
        out.loc[idx, "window_speedup"] = float(base["window_ms"].iloc[0]) / out.loc[idx, "window_ms"]
        out.loc[idx, "mean_norm"] = out.loc[idx, "mean_ms"] / u_mean
        out.loc[idx, "max_norm"] = out.loc[idx, "max_ms"] / u_mean
        out.loc[idx, "mean_speedup"] = u_mean / out.loc[idx, "mean_ms"]
        out.loc[idx, "max_speedup"] = u_max / out.loc[idx, "max_ms"]
        spread = window_speedups(df[df["setting"] == setting])
        out.loc[idx, "window_speedup_min"] = out.loc[idx, "method"].map(spread["min"])
        out.loc[idx, "window_speedup_max"] = out.loc[idx, "method"].map(spread["max"])
    if paper is None or paper:
        keep = (lambda s: True) if paper is None else paper.__contains__
        for metric in ("mean", "max"):
            out[f"paper_{metric}_speedup"] = [PAPER_SPEEDUP.get((s, metric), {}).get(m, np.nan) if keep(s) else np.nan
                                              for s, m in zip(out["setting"], out["method"])]
    return out


def window_speedups(df: pd.DataFrame) -> pd.DataFrame:
    """Per method of one setting: min and max over windows of the window's mean-straggler speedup
    over Ulysses (the spread a few-window mean hides)."""
    means = df.groupby(["method", "window"])["straggler_ms"].mean().unstack("window")
    if "ulysses" not in means.index:
        return pd.DataFrame(columns=["min", "max"])
    sp = means.loc["ulysses"] / means
    return pd.DataFrame({"min": sp.min(axis=1), "max": sp.max(axis=1)})


def plot_straggler(summary: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    """Top: mean and worst-step straggler / Ulysses mean, black marks the paper's values. Bottom:
    the four loss factors per method stacked on a log axis (:func:`plot_factors`).

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
    long["label"] = long["method"].map(lambda m: LABELS.get(m, m))
    settings = list(dict.fromkeys(summary["setting"]))
    fig, axes = plt.subplots(2, len(settings), figsize=(7.5 * len(settings), 8.4), squeeze=False)
    for ax, fax, setting in zip(axes[0], axes[1], settings):
        sub = long[long["setting"] == setting]
        order = [LABELS.get(m, m) for m in summary[summary["setting"] == setting]["method"]]
        sns.barplot(data=sub, x="label", y="norm", hue="metric", order=order, hue_order=["mean", "max"], ax=ax)
        srow = summary[summary["setting"] == setting].set_index("method")
        u_max = float(srow["max_norm"].get("ulysses", np.nan)) if "ulysses" in srow.index else np.nan
        marks = 0
        for i, method in enumerate(srow.index):
            for metric, off in (("mean", -0.2), ("max", 0.2)):
                sp = srow[f"paper_{metric}_speedup"].get(method, np.nan) if f"paper_{metric}_speedup" in srow else np.nan
                if not (np.isfinite(sp) and np.isfinite(u_max)):
                    continue
                y = 1.0 / sp if metric == "mean" else u_max / sp
                ax.plot(i + off, y, marker="_", color="black", markersize=18, mew=2.5,
                        label="paper" if marks == 0 else None)
                marks += 1
        ax.set_title(f"{setting}: straggler / Ulysses mean" + (" (black: paper)" if marks else ""))
        ax.set_xlabel("")
        ax.set_ylabel("normalised straggler time")
        ax.tick_params(axis="x", rotation=25)
        ax.legend(fontsize=8)
        plot_factors(fax, summary[summary["setting"] == setting], setting)
    from experiments.common.plotting import save_figure  # noqa: PLC0415  (Agg backend)

    save_figure(fig, path, caption=caption)


FACTOR_COLORS = {"kernel_factor": "#9467bd", "pooling_factor": "#2ca02c", "placement_factor": "#ff7f0e",
                 "comm_factor": "#1f77b4"}


def plot_factors(ax, summary: pd.DataFrame, setting: str) -> None:
    """Stacked loss factors of one setting: per method, segments kernel, pooling, placement, comm
    from 1 upward on a log axis, so each segment's length is its factor's share of the log of
    ``bound_ratio_gmean`` (the bar's top). A factor below 1 draws downward, hatched."""
    labels = [LABELS.get(m, m) for m in summary["method"]]
    x = np.arange(len(labels))
    level = np.ones(len(labels))
    for f in reversed(FACTORS):
        v = summary[f].to_numpy(dtype=np.float64)
        v = np.where(np.isfinite(v) & (v > 0), v, 1.0)
        top = level * v
        lo, hi = np.minimum(level, top), np.maximum(level, top)
        ax.bar(x, hi - lo, bottom=lo, color=FACTOR_COLORS[f], width=0.6, label=f.replace("_factor", ""),
               edgecolor="white")
        down = v < 1
        if down.any():
            ax.bar(x[down], (hi - lo)[down], bottom=lo[down], fill=False, hatch="//", width=0.6)
        level = top
    from matplotlib.ticker import FormatStrFormatter  # noqa: PLC0415

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, labels, rotation=25)
    ax.set_ylabel("straggler / balance bound (log)")
    ax.set_title(f"{setting}: loss factors (geometric means over steps); log axis, top = bound ratio")
    ax.legend(fontsize=8, title="factor", title_fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


@click.command("straggler")
@common_options(default_windows=8)
@settings_option()
@layout_options()
@click.option("--methods", default=",".join(METHODS), show_default=True,
              help=f"Comma list of registered planner names (e.g. {', '.join(OPTIONAL_METHODS)}, not in the paper), "
                   "or 'all'.")
@click.option("--wlb-rejoin", type=click.Choice(["none", "context", "full"]), default=WLB_REJOIN_DEFAULT,
              show_default=True,
              help="WLB-LLM's rejoin option; anything but 'none' gives it more attention work than the others.")
@click.option("--no-jitter", is_flag=True,
              help="Every GPU at speed 1 (no device variability): shows how much the jitter model contributes.")
@click.option("--known-speeds", is_flag=True,
              help="Tell speed-aware planners (libra-adaptive's device_speeds) each GPU's persistent speed factor "
                   "of the jitter model, as measuring the cluster would; each step's own draw stays unknown.")
@tap_options("pool_size", "block_size", "head_split", "tau", "pipeline_chunks", per_setting=True)
@score_profile_option()
def straggler(profile, windows, seed, out, quick, force, q_heads, kv_heads, head_dim, no_progress, workload,
              settings_, dp, cp, seq_len, gbs, methods, wlb_rejoin, no_jitter, known_speeds, pool_size, block_size,
              head_split, tau, pipeline_chunks, score_profile):
    """Figure 12: mean and worst-step straggler of every method in both paper settings (or your layout:
    --dp --cp --seq-len --gbs)."""
    check_counts(windows, seed)
    prof = resolve_profile(profile)
    scoring = resolve_score_profile(score_profile, prof)
    layout = given_layout(dp, cp, seq_len, gbs)
    try:
        settings = settings_from_options(settings_, layout)
        known = all_methods()
        method_list = known if methods.strip() == "all" else parse_list(methods, known, "method")
        shape = make_shape(q_heads, kv_heads, head_dim)
        if "ulysses" not in method_list:
            method_list = ("ulysses",) + method_list  # the normalisation needs it
        t0 = time.perf_counter()
        cfg = StragglerConfig(workload=workload, profile=prof, settings=settings, methods=method_list,
                              windows=1 if quick else windows, seed=seed, shape=shape, out=out, force=force,
                              quiet=no_progress, wlb_rejoin=wlb_rejoin, jitter=not no_jitter,
                              known_speeds=known_speeds, score_profile=scoring,
                              tap_overrides={"pool_size": pool_size, "block_size": block_size,
                                             "head_split": head_split, "tau": tau,
                                             "pipeline_chunks": pipeline_chunks})
        df, summary, run, timings = run_straggler(cfg)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    wall = time.perf_counter() - t0
    names = [s if isinstance(s, str) else s.name for s in settings]
    per_setting = {s: round(sum(v for (ss, _), v in timings.items() if ss == s), 3) for s in names}
    paths = run.finish(df, plot=lambda _d, p: plot_straggler(summary, p, run_caption(run.config)),
                       extra={"profile": prof.to_dict(), **score_record(scoring),
                              "simulate_seconds_per_setting": per_setting,
                              "simulate_seconds": {f"{s}/{m}": round(v, 3) for (s, m), v in timings.items()}},
                       files={"straggler_summary.csv": summary.to_csv(index=False)})
    echo_tables(summary, prof, scoring)
    click.echo(f"simulation seconds per setting (computed points only): {per_setting}; wall {wall:.1f} s")
    click.echo(f"wrote {paths['csv']}, {paths.get('png')}, {run.out_dir / 'straggler_summary.csv'}")


def echo_tables(summary: pd.DataFrame, profile=None, score_profile=None) -> None:
    """Print the speedup table and the loss-decomposition table (headed by the scoring profile when
    it is not the planning one)."""
    if score_profile is not None:
        click.echo(f"planned with profile {profile.name}, scored with profile {score_profile.name}")
    paper = [c for c in ("paper_mean_speedup", "paper_max_speedup") if c in summary]
    click.echo(format_table(summary, ["setting", "method", "mean_ms", "max_ms", "window_ms", "mean_norm", "max_norm",
                                      "mean_speedup", *paper[:1], "max_speedup", *paper[1:], "window_speedup",
                                      "window_speedup_min", "window_speedup_max", "bound_ratio",
                                      "balanced_ratio"], "{:.2f}"))
    click.echo("\nloss decomposition, geometric means over steps (comm x placement x pooling x kernel = "
               "bound_ratio_gmean; pool_balanced_ratio = comm x placement); flops_limit_speedup = mean "
               "Ulysses / mean Libra FLOPs-only straggler (ms at the best kernel rate)")
    click.echo(format_table(summary, ["setting", "method", "mean_speedup", "pool_balanced_ratio", *FACTORS,
                                      "bound_ratio_gmean", "flops_ulysses_ms", "flops_libra_ms",
                                      "flops_limit_speedup"], "{:.3f}"))
    click.echo("\nplacement_factor = plan x device: the plan's own imbalance at speed 1 and the share of the "
               "step's device speed draw (1 without jitter), geometric means over steps")
    click.echo(format_table(summary, ["setting", "method", "placement_factor", *PLACEMENT_SPLIT], "{:.3f}"))
