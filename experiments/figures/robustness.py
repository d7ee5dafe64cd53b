"""`libra-bench robustness`: every method's speedup over Ulysses under a profile ensemble.

The cost model's unmeasured numbers (heads-per-call cost, link bandwidth and latency, the kernel's
length curve) decide how much a planner gains, and a planner that plans with the profile
(``libra-kt``, ``libra-adaptive``) optimises the very model that scores it. This command scores
every method's plans under each member of a profile ensemble (:mod:`libra.sim.profiles.ensemble`;
default ``default-v1``: the run's ``--profile`` and eleven transformations of it) in two variants:

* ``default-planned``: planned once with ``--profile``, scored by each member (the model is wrong
  the way the member differs);
* ``truth``: planned with the member's own profile and scored by it (a planner that knows the
  truth; ``libra-adaptive`` then plans without its ensemble guard, ``ensemble=None``). A planner whose plans do not depend on the profile (no ``profile`` option in the
  registry) is planned once per window; its truth is its default-planned run.

Per setting and method: the speedup over Ulysses (mean straggler over every step of every window,
Ulysses scored by the same member) under ``--profile`` and its [min, max] over the members in both
variants, and the worst ratio to ``libra`` over the members (``vs_libra_min``: libra's mean
straggler / the method's, both default-planned and scored by the member; ``vs_libra_window_min``:
the same per window, worst over members and windows). Device jitter is on, with the member's sigmas
and the same seed per window for every method and member.

Outputs (``runs/robustness/<workload>-<layouts>-<profile>/`` or ``--out``; ``make robustness``
writes ``results/robustness/<workload>/``): ``robustness.csv`` (one row per setting, method, window,
member, variant and step), ``robustness_summary.csv``, ``robustness_members.csv`` (per setting,
method, member and variant: mean straggler, speedup, ratio to libra), ``robustness.png`` and
``run.json`` (with the ensemble file's record).
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
    resolve_profile,
    setting_record,
    settings_from_options,
    workload_record,
)
from experiments.figures.straggler import all_methods
from libra.data.source import resolve_workload
from libra.sim.profiles.ensemble import DEFAULT_ENSEMBLE, Ensemble, load_ensemble
from libra.sim.simulator import price_window
from libra.workload import AttentionShape

DEFAULT_PLANNED, TRUTH = "default-planned", "truth"
REFERENCE = "(profile)"
"""Scoring entry of the run's own profile when no ensemble member is it (the speedup under it)."""


@dataclass(frozen=True, kw_only=True)
class RobustnessConfig(SimulatedRunConfig):
    """What one `libra-bench robustness` run simulates and where it writes."""

    methods: Sequence[str]
    shape: AttentionShape
    ensemble: Ensemble
    wlb_rejoin: str = WLB_REJOIN_DEFAULT


def plans_with_profile(method: str) -> bool:
    """Whether ``method``'s plans depend on the profile (the registry planner has a ``profile`` option)."""
    return takes_option(method, "profile")


def takes_option(method: str, option: str) -> bool:
    """Whether the registry planner ``method`` has ``option``."""
    from baselines.registry import planner_class  # noqa: PLC0415  (keeps `--help` fast)

    return option in planner_class(method).option_names()


def scorers(cfg: RobustnessConfig) -> tuple[dict, str]:
    """``({name: profile}, reference name)``: every ensemble member applied to ``cfg.profile``, led
    by the profile itself (:data:`REFERENCE`) when no member is it.

    Raises:
        ValueError: a member the profile cannot take.
    """
    profiles = cfg.ensemble.profiles(cfg.profile)
    ref = next((n for n, p in profiles.items() if p is cfg.profile), None)
    return ({REFERENCE: cfg.profile, **profiles}, REFERENCE) if ref is None else (profiles, ref)


def run_robustness(cfg: RobustnessConfig):
    """Simulate every (setting, method, window) under every member; returns (steps, summary,
    per-member table, run).

    Raises:
        ValueError: unknown setting/method, a bad workload, a layout the planners reject or an
            ensemble member the profile cannot take.
    """
    chosen = chosen_settings(cfg.settings, cfg.tap_overrides)
    check_settings(chosen, cfg.shape)
    profiles, ref = scorers(cfg)
    config = {"workload": cfg.workload, "workload_source": workload_record(cfg.workload),
              "profile": cfg.profile.to_dict(), "ensemble": cfg.ensemble.record,
              "settings": [setting_record(st) for st in chosen.values()], "methods": list(cfg.methods),
              "windows": cfg.windows, "seed": cfg.seed, "wlb_rejoin": cfg.wlb_rejoin,
              "shape": [cfg.shape.num_q_heads, cfg.shape.num_kv_heads, cfg.shape.head_dim, cfg.shape.dtype_bytes]}
    run = ExperimentRun("robustness", config, out_dir=cfg.out, force=cfg.force, quiet=cfg.quiet)
    label = resolve_workload(cfg.workload).name
    cache: dict = {}

    def context(s):
        if s not in cache:
            st = chosen[s]
            cache[s] = (st, load_windows(cfg.workload, st, cfg.windows, cfg.seed),
                        {n: build_cost_model(p, st.par()) for n, p in profiles.items()})
        return cache[s]

    def point(key):
        s, method, w, variant, member = key
        st, wins, models = context(s)
        planned = profiles[member] if variant == TRUTH else cfg.profile
        # a planner that knows the member plans for it alone: no hedge over an ensemble
        unguarded = {"ensemble": None} if variant == TRUTH and takes_option(method, "ensemble") else {}
        planner = make_planner(method, st, wlb_rejoin=cfg.wlb_rejoin, profile=planned, **unguarded)
        plans = planner.plan_window(wins[w], st.par(), cfg.shape)
        scored = [member] if variant == TRUTH else list(profiles)
        return [{"workload": label, "setting": s, "method": method, "window": w, "member": n, "variant": variant,
                 "step": r.step, "straggler_ms": r.straggler_ms, "compute_ms": r.compute_ms,
                 "comm_exposed_ms": r.comm_exposed_ms}
                for n in scored
                for r in price_window(plans, wins[w], st.par(), cfg.shape, models[n], seed=jitter_seed(cfg.seed, w))]

    truth = [n for n, p in profiles.items() if p is not cfg.profile]  # a member that is the profile: planned once
    keys = [[s, m, w, DEFAULT_PLANNED, None] for s in chosen for m in cfg.methods for w in range(cfg.windows)]
    keys += [[s, m, w, TRUTH, n] for s in chosen for m in cfg.methods if plans_with_profile(m)
             for w in range(cfg.windows) for n in truth]
    df = pd.DataFrame(run.map(keys, point, desc="robustness"))
    members = member_table(df, [n for n in profiles if n != REFERENCE])
    return df, summarize(members, df, ref), members, run


def member_table(df: pd.DataFrame, members: list[str]) -> pd.DataFrame:
    """Per (setting, method, member, variant): mean straggler over every step, the speedup over
    Ulysses (default-planned, scored by the same member) and the ratio to libra's (default-planned)
    mean straggler. A method or member without truth rows (plans that do not depend on the
    profile, or the member that is the profile) gets its default-planned numbers as its truth."""
    mean = df.groupby(["setting", "method", "member", "variant"], sort=False)["straggler_ms"].mean()
    rows = []
    for (s, m, n, v), ms in mean.items():
        rows.append({"setting": s, "method": m, "member": n, "variant": v, "mean_ms": ms})
        if v == DEFAULT_PLANNED and (s, m, n, TRUTH) not in mean.index:
            rows.append({"setting": s, "method": m, "member": n, "variant": TRUTH, "mean_ms": ms})
    out = pd.DataFrame(rows)
    out["in_range"] = out["member"].isin(members)
    base = out[out["variant"] == DEFAULT_PLANNED].set_index(["setting", "method", "member"])["mean_ms"]
    for other, col in (("ulysses", "speedup"), ("libra", "vs_libra")):
        ref = [base.get((s, other, n), np.nan) for s, n in zip(out["setting"], out["member"])]
        out[col] = np.asarray(ref, dtype=np.float64) / out["mean_ms"]
    return out


def _span(g: pd.DataFrame, col: str, prefix: str) -> dict:
    """Min, max and the member at the min of ``col`` over ``g``'s range members."""
    g = g[g["in_range"] & np.isfinite(g[col])]
    if g.empty:
        return {f"{prefix}_min": np.nan, f"{prefix}_max": np.nan, f"{prefix}_min_member": ""}
    worst = g.loc[g[col].idxmin()]
    return {f"{prefix}_min": float(worst[col]), f"{prefix}_max": float(g[col].max()),
            f"{prefix}_min_member": worst["member"]}


def summarize(members: pd.DataFrame, df: pd.DataFrame, ref: str) -> pd.DataFrame:
    """Per (setting, method): the speedup under the reference profile, its [min, max] over the
    members default-planned and truth, and the worst ratio to libra over members (and windows)."""
    window = df[df["variant"] == DEFAULT_PLANNED].groupby(["setting", "method", "member", "window"])["straggler_ms"].mean()
    rows = []
    for (s, m), g in members.groupby(["setting", "method"], sort=False):
        dp, tr = g[g["variant"] == DEFAULT_PLANNED], g[g["variant"] == TRUTH]
        at_ref = dp[dp["member"] == ref]
        row = {"setting": s, "method": m, "plans_with_profile": plans_with_profile(m),
               "speedup": float(at_ref["speedup"].iloc[0]) if len(at_ref) else np.nan,
               **_span(dp, "speedup", "speedup"), **_span(tr, "speedup", "truth_speedup"),
               **_span(dp, "vs_libra", "vs_libra"), **_span(tr, "vs_libra", "truth_vs_libra")}
        if "libra" in set(members["method"]):
            ratio = window.loc[(s, "libra")] / window.loc[(s, m)]
            in_range = ratio[ratio.index.get_level_values("member").isin(set(g.loc[g["in_range"], "member"]))]
            row["vs_libra_window_min"] = float(in_range.min()) if len(in_range) else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def plot_robustness(summary: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    """Per setting: each method's speedup over Ulysses under the profile (dot) and its range over
    the ensemble, planned with the profile (left bar) and with the member's own (right bar)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    settings = list(dict.fromkeys(summary["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(7.0 * len(settings), 4.4), squeeze=False)
    for ax, s in zip(axes[0], settings):
        g = summary[summary["setting"] == s].reset_index(drop=True)
        x = np.arange(len(g))
        for off, prefix, color, name in ((-0.12, "speedup", "#1f77b4", DEFAULT_PLANNED),
                                         (0.12, "truth_speedup", "#ff7f0e", "planned with the member (truth)")):
            lo, hi = g[f"{prefix}_min"].to_numpy(float), g[f"{prefix}_max"].to_numpy(float)
            ax.vlines(x + off, lo, hi, color=color, lw=4, label=f"range over the ensemble, {name}")
        ax.plot(x, g["speedup"], "ko", label="under the profile")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(x, [LABELS.get(m, m) for m in g["method"]], rotation=25)
        ax.set_ylabel("mean-straggler speedup over Ulysses")
        ax.set_title(f"{s}: speedup over Ulysses and its range over the profile ensemble")
        ax.legend(fontsize=7)
    from experiments.common.plotting import save_figure  # noqa: PLC0415  (Agg backend)

    save_figure(fig, path, caption=caption)


def echo_summary(summary: pd.DataFrame, ensemble: Ensemble) -> None:
    """The printed table and the line on libra-adaptive's worst ratio to libra."""
    click.echo(f"speedup over Ulysses under the profile; [min, max] over the {len(ensemble.members)} members of "
               f"ensemble {ensemble.name}, planned with the profile (speedup_*) and with the member's own "
               "(truth_speedup_*); vs_libra = libra's mean straggler / the method's, both scored by the member")
    cols = ["setting", "method", "speedup", "speedup_min", "speedup_max", "speedup_min_member", "truth_speedup_min",
            "truth_speedup_max", "vs_libra_min", "vs_libra_min_member", "vs_libra_window_min"]
    click.echo(format_table(summary, [c for c in cols if c in summary], "{:.3f}"))
    for r in summary[summary["method"] == "libra-adaptive"].itertuples():
        if np.isfinite(getattr(r, "vs_libra_min", np.nan)):
            click.echo(f"{r.setting}: libra-adaptive's worst ratio to libra over the ensemble (planned with the "
                       f"profile): {r.vs_libra_min:.3f} ({r.vs_libra_min_member}); worst window "
                       f"{r.vs_libra_window_min:.3f}; planned with the member's own profile: {r.truth_vs_libra_min:.3f}")


@click.command("robustness")
@common_options(default_windows=8)
@settings_option()
@layout_options()
@click.option("--methods", default=",".join(METHODS + OPTIONAL_METHODS), show_default=True,
              help="Comma list of registered planner names, or 'all'.")
@click.option("--ensemble", "ensemble_", default=DEFAULT_ENSEMBLE, show_default=True,
              help="Profile ensemble: a built-in name (libra/sim/profiles/ensembles/) or an ensemble .json path; "
                   "its members transform --profile.")
@tap_options("pool_size", "block_size", "head_split", "tau", "pipeline_chunks", per_setting=True)
def robustness(profile, windows, seed, out, quick, force, q_heads, kv_heads, head_dim, no_progress, workload,
               settings_, dp, cp, seq_len, gbs, methods, ensemble_, pool_size, block_size, head_split, tau,
               pipeline_chunks):
    """Every method's speedup over Ulysses under a profile ensemble: planned with --profile and with
    each member's own profile, with libra-adaptive's worst ratio to libra."""
    check_counts(windows, seed)
    prof = resolve_profile(profile)
    try:
        ensemble = load_ensemble(ensemble_)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--ensemble") from exc
    try:
        settings = settings_from_options(settings_, given_layout(dp, cp, seq_len, gbs))
        known = all_methods()
        method_list = known if methods.strip() == "all" else parse_list(methods, known, "method")
        method_list = method_list if "ulysses" in method_list else ("ulysses",) + method_list
        t0 = time.perf_counter()
        cfg = RobustnessConfig(workload=workload, profile=prof, settings=settings, methods=method_list,
                               windows=1 if quick else windows, seed=seed, shape=make_shape(q_heads, kv_heads, head_dim),
                               out=out, force=force, quiet=no_progress, ensemble=ensemble,
                               tap_overrides={"pool_size": pool_size, "block_size": block_size,
                                              "head_split": head_split, "tau": tau, "pipeline_chunks": pipeline_chunks})
        df, summary, members, run = run_robustness(cfg)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    caption = f"{run_caption(run.config)} | ensemble {ensemble.name}"
    paths = run.finish(df, plot=lambda _d, p: plot_robustness(summary, p, caption),
                       extra={"profile": prof.to_dict()},
                       files={"robustness_summary.csv": summary.to_csv(index=False),
                              "robustness_members.csv": members.to_csv(index=False)})
    echo_summary(summary, ensemble)
    click.echo(f"wall {time.perf_counter() - t0:.1f} s; wrote {paths['csv']}, {paths.get('png')}, "
               f"{run.out_dir / 'robustness_summary.csv'}, {run.out_dir / 'robustness_members.csv'}")
