"""`libra-bench tune`: pick Libra's (P, H, B) for your own data and cluster (Libra sec. 5).

Sec. 5: "An offline simulator replays VRSP and TAP on corpus sequence-length metadata to select
fixed (P, H, B)". This command is that step. Given a length workload (preset or file), a hardware
profile and the parallel layout (``--dp --cp --seq-len --gbs``, or one of the paper's settings
``--settings 256k|1m`` whose fields those flags then override; head shape ``--q-heads --kv-heads
--head-dim``), it enumerates candidates

* pool size P: divisors of DP (``--pool-sizes`` to restrict);
* head split H: powers of two up to 8 dividing ``hq`` with ``M | hq/H`` (``--head-splits``);
* block size B: ``S/CP, S/(2 CP), ... , S/(16 CP)``, at least 1024 tokens (``--block-sizes``);
* Pipeliner chunks M: ``--pipeline-chunks`` alone, or each of ``--chunk-counts`` (an extension:
  the paper uses M = 4), every (H, M) with ``M | hq/H``;

simulates each with every planner of ``--methods`` -- by default the full Libra planner (VRSP + TAP +
Pipeliner with ``M`` chunks, ``--pipeline-chunks``; soft load target ``--tau``; both TapConfig's defaults
unless given) and ``libra-adaptive`` (per pool the fastest of Alg. 2 and adaptive tilings, and of two
Pipeliner chunkings, under the profile's cost model; an extension, not in the paper) -- over a few GBS
windows, and Ulysses on the
same windows and device jitter as the reference. Explicit values
that break a layout rule (P not dividing DP, B not dividing S/CP, H not dividing hq, M not dividing
hq/H) are errors, not silently dropped.

Recommendation rule (:func:`recommend`): the lowest mean straggler (``--objective max``: worst step) wins; candidates within
``--tie-tolerance`` (default 1%) of the best are ties, broken by smaller P (fewer replicas exchange
data, less inter-node traffic and a smaller pool to plan), then the planner (``libra`` before
``libra-adaptive``: cheaper to plan), then fewer tiles per packed sequence (cheaper placement), then
the lower worst step, then smaller H and B, then smaller M. If even the recommendation
is slower than Ulysses the command says so.

Spread over windows: each candidate's speedup over Ulysses is also computed per GBS window (Ulysses'
straggler over the candidate's, both on that window; the mean straggler for ``--objective mean``, the
worst step for ``max``) and reported as its mean and [min, max] over windows. When the per-window
ranges of the top-ranked candidate and others overlap (:func:`within_noise`), the command says that
those candidates are within the window-to-window spread: their order rests on differences smaller
than the spread between windows. Because every candidate sees the same windows, the command also
says which of those are behind rank 1 on every window (``windows_behind_rank1``, a paired
comparison the spread does not blur). With one window there is no spread and the check is off.

The printed table is narrow (``--wide``: every column). Outputs (``runs/tune/<workload>-<layout>-<profile>/``
or ``--out``; see
:func:`experiments.common.runner.default_out_dir`): ``tune.csv`` (one row per candidate, ranked, with the
per-window ``*_window_mean/min/max`` columns, ``windows``, ``within_noise``, ``windows_behind_rank1``
and the loss decomposition of ``libra-bench straggler`` -- ``comm_factor``, ``placement_factor``,
``pooling_factor``, ``kernel_factor`` and ``pool_balanced_ratio`` = comm x placement as geometric
means over steps, ``bound_ratio_gmean`` their product, ``flops_limit_speedup``; the printout's
``pool bal.``: how far the candidate's pools are from finishing together),
``tune_steps.csv`` (every simulated step), ``tune.png`` (ranking) and ``run.json`` (config,
profile, the recommendation).

``--score-profile`` prices the candidates (cost model and device jitter) with another profile than
the one ``libra-adaptive`` plans with (``--profile``): how the ranking holds when the model is wrong.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.common.options import IntListType, given_layout, layout_options, tap_options
from experiments.common.runner import ExperimentRun
from experiments.common.runs_table import run_caption
from experiments.common.sim_common import (
    OPTIONAL_METHODS,
    SETTINGS,
    TAP_METHODS,
    build_cost_model,
    check_counts,
    common_options,
    jitter_seed,
    make_shape,
    parse_list,
    resolve_profile,
    resolve_score_profile,
    score_profile_option,
    score_record,
    settings_from_options,
    tiles_per_sequence,
    workload_record,
)
from experiments.figures.straggler import loss_decomposition, step_ratios
from libra.config import ParallelConfig, TapConfig, check_layout
from libra.data.source import resolve_workload
from libra.sim.profiles import HardwareProfile
from libra.sim.simulator import simulate_window
from libra.workload import AttentionShape

TUNE_METHODS = ("libra", "libra-adaptive")
"""Planners ``tune`` compares by default, in tie-break order (the paper's first)."""
MAX_HEAD_SPLIT = 8
MIN_BLOCK = 1024
BLOCK_HALVINGS = 4


def default_pool_sizes(dp: int) -> tuple[int, ...]:
    """Every divisor of DP (P = DP is a cluster-wide pool, DistCA's scope)."""
    return tuple(p for p in range(1, dp + 1) if dp % p == 0)


def default_head_splits(q_heads: int, chunks: int) -> tuple[int, ...]:
    """Powers of two ``H <= 8`` with ``H | hq`` and ``M | hq/H`` (Libra sec. 4.4)."""
    return tuple(h for h in (1, 2, 4, 8) if h <= MAX_HEAD_SPLIT and q_heads % h == 0 and (q_heads // h) % chunks == 0)


def default_block_sizes(tokens_per_rank: int) -> tuple[int, ...]:
    """``S/CP`` halved up to four times, keeping integral blocks of at least 1024 tokens."""
    out = []
    for k in range(BLOCK_HALVINGS + 1):
        b = tokens_per_rank >> k
        if b << k != tokens_per_rank or b < MIN_BLOCK:
            break
        out.append(b)
    return tuple(out) or (tokens_per_rank,)


def candidate_grid(par: ParallelConfig, shape, tap: TapConfig, pool_sizes=None, head_splits=None,
                   block_sizes=None, chunk_counts=None) -> list[tuple[int, int, int, int]]:
    """All (P, H, B, M) to simulate, each checked by :func:`libra.config.check_layout` with the other
    fields (tau, ...) of ``tap``. M is ``tap.pipeline_chunks`` unless ``chunk_counts`` lists several;
    an (H, M) pair with ``M`` not dividing ``hq/H`` is skipped, but every H and every M must pair
    with at least one of the other.

    Raises:
        ValueError: an explicitly given value breaking a layout rule (the message names it), or no
            valid candidate at all.
    """
    ms = tuple(chunk_counts) if chunk_counts else (tap.pipeline_chunks,)
    hq = shape.num_q_heads
    per_rank = par.tokens_per_rank  # raises for CP not dividing S
    ps = tuple(pool_sizes) if pool_sizes else default_pool_sizes(par.dp)
    hs = tuple(head_splits) if head_splits else tuple(dict.fromkeys(h for m in ms for h in default_head_splits(hq, m)))
    bs = tuple(block_sizes) if block_sizes else default_block_sizes(per_rank)
    for p in ps:
        if par.dp % p:
            raise ValueError(f"pool size P={p} must divide DP={par.dp}")
    for b in bs:
        if per_rank % b:
            raise ValueError(f"block size B={b} must divide S/CP={per_rank} (S={par.seq_len}, CP={par.cp})")
    for h in hs:
        if hq % h:
            raise ValueError(f"head split H={h} must divide --q-heads={hq}")
        if all((hq // h) % m for m in ms):
            raise ValueError(f"Pipeliner chunks M={_listed(ms)} must divide hq/H={hq // h} "
                             f"(hq={hq}, H={h}); lower --pipeline-chunks or H")
    if not hs:
        raise ValueError(f"no head split H <= {MAX_HEAD_SPLIT} satisfies H | hq={hq} and "
                         f"M={_listed(ms)} | hq/H; lower --pipeline-chunks")
    for m in ms:
        if all((hq // h) % m for h in hs):
            raise ValueError(f"Pipeliner chunks M={m} divides hq/H for no head split H of {list(hs)} (hq={hq})")
    grid = [(p, h, b, m) for p in ps for h in hs for b in bs for m in ms if (hq // h) % m == 0]
    for p, h, b, m in grid:
        check_layout(par, replace(tap, pool_size=p, block_size=b, head_split=h, pipeline_chunks=m), shape)
    return grid


def _listed(values) -> str:
    return str(values[0]) if len(values) == 1 else "any of " + ",".join(map(str, values))


OBJECTIVES = ("mean", "max")
"""``mean``: mean straggler (throughput without PP); ``max``: worst step (the PP bottleneck proxy, sec. 6.3)."""


def recommend(table: pd.DataFrame, tie_tolerance: float = 0.01, objective: str = "mean") -> int:
    """Index (label) of the recommended candidate of ``table``.

    Rule: the lowest ``<objective>_ms`` wins; every candidate within ``best * (1 + tie_tolerance)``
    ties and the tie goes to the smaller ``pool_size``, then the planner earlier in
    :data:`TUNE_METHODS`, then fewer ``tiles_per_sequence``, then the lower other metric
    (``max_ms`` for ``mean``), then smaller ``head_split``, ``block_size`` and ``pipeline_chunks``
    (fewer kernel launches and messages).

    Raises:
        ValueError: empty table, unknown objective, NaN values, or a negative tolerance.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
    if table.empty:
        raise ValueError("no candidate to recommend")
    if not (tie_tolerance >= 0):
        raise ValueError(f"tie tolerance must be >= 0, got {tie_tolerance!r}")
    col, other = f"{objective}_ms", ("max_ms" if objective == "mean" else "mean_ms")
    if table[col].isna().any():
        raise ValueError(f"a candidate has no {col} (NaN)")
    best = float(table[col].min())
    ties = table[table[col] <= best * (1.0 + tie_tolerance)]
    methods = ties["method"] if "method" in ties else pd.Series("libra", index=ties.index)
    planner_rank = methods.map(lambda m: TUNE_METHODS.index(m) if m in TUNE_METHODS else len(TUNE_METHODS))
    order = ties.assign(planner_rank=planner_rank).sort_values(
        ["pool_size", "planner_rank", "tiles_per_sequence", other, "head_split", "block_size",
         *(["pipeline_chunks"] if "pipeline_chunks" in ties else [])], kind="mergesort")
    return order.index[0]


WINDOW_STATS = ("mean", "min", "max")
"""Statistics over windows of the per-window speedups (columns ``<speedup>_window_<stat>``)."""


def speedup_column(objective: str) -> str:
    """The speedup column that goes with ``objective``: ``speedup`` (mean straggler) or ``max_speedup``."""
    return "speedup" if objective == "mean" else "max_speedup"


def window_speedups(u_windows: pd.DataFrame, g: pd.DataFrame) -> tuple[dict[str, float], pd.DataFrame]:
    """Per-window speedups of one candidate's steps ``g`` over Ulysses' per-window mean and worst
    straggler ``u_windows`` (columns ``mean``, ``max``, indexed by window).

    Returns (their summary over windows: ``speedup_window_{mean,min,max}`` for the mean straggler,
    ``max_speedup_window_{...}`` for the worst step, and ``windows``; the per-window speedups,
    columns ``speedup`` and ``max_speedup`` indexed by window)."""
    c = g.groupby("window")["straggler_ms"].agg(["mean", "max"])
    per_window = pd.DataFrame({"speedup": u_windows["mean"] / c["mean"],
                               "max_speedup": u_windows["max"] / c["max"]}).dropna()
    out = {f"{col}_window_{stat}": float(per_window[col].agg(stat))
           for col in ("speedup", "max_speedup") for stat in WINDOW_STATS}
    out["windows"] = int(per_window.shape[0])
    return out, per_window


def within_noise(table: pd.DataFrame, objective: str = "mean") -> list[int]:
    """Ranks of the candidates within the window-to-window spread of the top-ranked one: those whose
    per-window speedup range ``[<speedup>_window_min, <speedup>_window_max]`` overlaps rank 1's
    (:func:`speedup_column` of ``objective``), rank 1 first. Empty when none does, or with fewer than
    two windows (no spread to judge).

    ``table``: ranked candidates (first row the best), with those columns and ``windows``."""
    if table.empty or int(table["windows"].min()) < 2:
        return []
    col = speedup_column(objective)
    lo, hi = table[f"{col}_window_min"], table[f"{col}_window_max"]
    overlap = (hi >= lo.iloc[0]) & (lo <= hi.iloc[0])
    ranks = [int(r) for r in table.loc[overlap, "rank"]] if "rank" in table else list(np.flatnonzero(overlap) + 1)
    return ranks if len(ranks) > 1 else []


def rank_candidates(steps: pd.DataFrame, par: ParallelConfig, tap: TapConfig, tie_tolerance: float,
                    objective: str = "mean") -> pd.DataFrame:
    """One row per candidate from the simulated steps, ranked by ``objective``, with speedups over
    Ulysses (same windows; overall and per window: :func:`window_speedups`), the ``recommended``
    flag from :func:`recommend` and ``within_noise`` (:func:`within_noise`)."""
    u = steps[steps["method"] == "ulysses"]
    u_mean = u["straggler_ms"].mean()
    u_windows = u.groupby("window")["straggler_ms"].agg(["mean", "max"])
    u_max = u_windows["max"].mean()
    rows, per_window = [], []
    cands = steps[steps["method"] != "ulysses"]
    for (m, p, h, b, chunks), g in cands.groupby(["method", "pool_size", "head_split", "block_size", "pipeline_chunks"],
                                                sort=False):
        all_bytes = g["bytes_nvlink"] + g["bytes_roce"] + g["bytes_inter_supernode"]
        mean_ms = g["straggler_ms"].mean()
        max_ms = g.groupby("window")["straggler_ms"].max().mean()
        spread, windows = window_speedups(u_windows, g)
        per_window.append(windows)
        rows.append({"method": m, "pool_size": int(p), "head_split": int(h), "block_size": int(b),
                     "pipeline_chunks": int(chunks), "tau": tap.tau,
                     "tiles_per_sequence": tiles_per_sequence(par.seq_len, b, h), "mean_ms": mean_ms,
                     "max_ms": max_ms, "speedup": u_mean / mean_ms, "max_speedup": u_max / max_ms,
                     "compute_ms": g["compute_ms"].mean(), "comm_exposed_ms": g["comm_exposed_ms"].mean(),
                     "comm_gb_per_step": all_bytes.mean() / 1e9,
                     "inter_node_gb_per_step": (g["bytes_roce"] + g["bytes_inter_supernode"]).mean() / 1e9,
                     "bound_ratio": g["bound_ratio"].mean(),
                     "ulysses_mean_ms": u_mean, "ulysses_max_ms": u_max, "steps": len(g),
                     **loss_decomposition(g), **spread})
    table = pd.DataFrame(rows)
    col = f"{objective}_ms"
    order = table.sort_values([col, "pool_size", "tiles_per_sequence"], kind="mergesort").index
    table = table.loc[order].reset_index(drop=True)
    table.insert(0, "rank", np.arange(1, len(table) + 1))
    table["recommended"] = False
    table.loc[recommend(table, tie_tolerance, objective), "recommended"] = True
    table["within_noise"] = table["rank"].isin(within_noise(table, objective))
    table["windows_behind_rank1"] = windows_behind_best([per_window[i] for i in order], speedup_column(objective))
    return table


def windows_behind_best(per_window: list[pd.DataFrame], col: str) -> list[int]:
    """For each candidate (ranked; the first is rank 1), the windows in which its per-window ``col``
    speedup is below rank 1's on the same window: a paired comparison, free of the spread between
    windows that every candidate shares."""
    best = per_window[0][col]
    return [int((w[col] < best.reindex(w.index) * (1 - 1e-12)).sum()) for w in per_window]


class _PlanDigests:
    """A planner that remembers what each of its plans runs: the digest of its pools (tiles,
    transfers, sequences; not the header's planner options) and its M. Candidates whose plans are
    bit-identical -- ``libra-adaptive`` choosing its one-KV-head tiles in every pool plans the same
    whatever H -- are then one candidate, not several that happen to price alike."""

    def __init__(self, planner):
        self.planner, self.digests = planner, []

    def __getattr__(self, name):
        return getattr(self.planner, name)

    def plan_window(self, *args, **kwargs):
        plans = self.planner.plan_window(*args, **kwargs)
        self.digests = [hashlib.sha256((str(plan.pipeline_chunks) + "".join(pool.digest() for pool in plan.pools))
                                       .encode()).hexdigest()[:16] for plan in plans]
        return plans


CANDIDATE = ["method", "pool_size", "head_split", "block_size", "pipeline_chunks"]


def same_plan_head_splits(steps: pd.DataFrame) -> tuple[pd.DataFrame, list[dict]]:
    """``steps`` without the candidates whose plans, on every window and step, are bit-identical to
    those of the same (method, P, B, M) at a smaller H (``plan_digest``), and the merged groups
    ``{method, pool_size, block_size, pipeline_chunks, head_splits}`` (listed once, at the smallest H)."""
    if "plan_digest" not in steps:
        return steps, []
    cands = steps[steps["method"] != "ulysses"].sort_values(["window", "step"], kind="mergesort")
    sig = cands.groupby(CANDIDATE, sort=False)["plan_digest"].agg(tuple).reset_index()
    drop, merged = set(), []
    for (m, p, b, c, _), g in sig.groupby(["method", "pool_size", "block_size", "pipeline_chunks", "plan_digest"],
                                          sort=False):
        hs = sorted(int(h) for h in g["head_split"])
        if len(hs) > 1:
            drop |= {(m, p, h, b, c) for h in hs[1:]}
            merged.append({"method": m, "pool_size": int(p), "block_size": int(b), "pipeline_chunks": int(c),
                           "head_splits": hs})
    keep = [tuple(k) not in drop for k in steps[CANDIDATE].itertuples(index=False)]
    return steps[keep], merged


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """What one `libra-bench tune` run simulates and where it writes (the command builds it once)."""

    workload: str
    profile: HardwareProfile
    par: ParallelConfig
    shape: AttentionShape
    grid: Sequence[tuple[int, int, int, int]]
    tap: TapConfig
    windows: int
    seed: int
    tie_tolerance: float = 0.01
    objective: str = "mean"
    out: str | None = None
    force: bool = False
    quiet: bool = False
    name: str = "tune"
    methods: Sequence[str] = TUNE_METHODS
    score_profile: HardwareProfile | None = None
    """The profile that prices the candidates (cost model and jitter); None: ``profile``, which the
    planners always plan with."""


def run_tune(cfg: TuneConfig):
    """Simulate Ulysses and every candidate of ``grid`` (its (P, H, B, M) in ``tap``) with every planner
    of ``methods``; returns (ranked table, steps, run, the merged candidates of
    :func:`same_plan_head_splits`). A recommended planner that deepens its Pipeliner outside tune
    (``deepen_pipeline``, as ``straggler`` runs it) is priced that way too: ``table.attrs["as_straggler_ms"]``.

    Raises:
        ValueError: a bad workload or a layout a planner rejects.
    """
    from baselines.registry import get_planner, planner_class  # noqa: PLC0415  (keeps `--help` fast)
    from libra.data.windows import gbs_windows  # noqa: PLC0415

    config = {"workload": cfg.workload, "workload_source": workload_record(cfg.workload), "profile": cfg.profile.to_dict(),
              "par": {"dp": cfg.par.dp, "cp": cfg.par.cp, "gbs": cfg.par.gbs, "seq_len": cfg.par.seq_len},
              "shape": [cfg.shape.num_q_heads, cfg.shape.num_kv_heads, cfg.shape.head_dim, cfg.shape.dtype_bytes],
              "methods": list(cfg.methods), "pipeline_chunks": cfg.tap.pipeline_chunks, "tau": cfg.tap.tau,
              "candidates": [list(c) for c in cfg.grid],  # (P, H, B, M)
              **({"chunk_counts": sorted({c[3] for c in cfg.grid})} if {c[3] for c in cfg.grid} != {cfg.tap.pipeline_chunks}
                 else {}),
              "windows": cfg.windows, "seed": cfg.seed, "tie_tolerance": cfg.tie_tolerance,
              "objective": cfg.objective, **score_record(cfg.score_profile)}
    run = ExperimentRun(cfg.name, config, out_dir=cfg.out, force=cfg.force, quiet=cfg.quiet)
    wins = gbs_windows(cfg.workload, cfg.par.seq_len, cfg.par.gbs, cfg.windows, seed=cfg.seed)
    cost_model = build_cost_model(cfg.score_profile or cfg.profile, cfg.par)
    label = resolve_workload(cfg.workload).name  # the file name (#column), or the preset

    def point(key):
        as_straggler = key[0] == "as-straggler"
        method, p, h, b, chunks, w = key[1:] if as_straggler else key
        opts = {}
        if "deepen_pipeline" in planner_class(method).option_names() and not as_straggler:
            opts["deepen_pipeline"] = False  # the grid searches M itself: each candidate runs its own
        tap = replace(cfg.tap, pool_size=p, head_split=h, block_size=b, pipeline_chunks=chunks) if p else None
        planner = _PlanDigests(get_planner(method, tap=tap, profile=cfg.profile, **opts) if tap else get_planner(method))
        steps = simulate_window(planner, wins[w], cfg.par, cfg.shape, cost_model,
                                seed=jitter_seed(cfg.seed, w), flops_pool_size=p or None)  # Ulysses: p = 0
        return [{"workload": label, "method": method, "pool_size": p, "head_split": h, "block_size": b,
                 "pipeline_chunks": chunks, "window": w, **r.to_row(), **step_ratios(r), "plan_digest": d}
                for r, d in zip(steps, planner.digests)]

    keys = [["ulysses", 0, 0, 0, 0, w] for w in range(cfg.windows)]
    keys += [[m, p, h, b, c, w] for m in cfg.methods for p, h, b, c in cfg.grid for w in range(cfg.windows)]
    steps = pd.DataFrame(run.map(keys, point, desc="tune"))
    kept, merged = same_plan_head_splits(steps)
    table = rank_candidates(kept, cfg.par, cfg.tap, cfg.tie_tolerance, cfg.objective)
    rec = table[table["recommended"]].iloc[0]
    if "deepen_pipeline" in planner_class(rec["method"]).option_names():
        # straggler runs this planner with its deeper Pipeliner; price the recommendation that way too
        cand = [rec["method"], int(rec["pool_size"]), int(rec["head_split"]), int(rec["block_size"]),
                int(rec["pipeline_chunks"])]
        rows = run.map([["as-straggler", *cand, w] for w in range(cfg.windows)], point, desc="tune")
        table.attrs["as_straggler_ms"] = float(pd.DataFrame(rows)["straggler_ms"].mean())
    return table, steps.drop(columns="plan_digest"), run, merged


def plot_tune(table: pd.DataFrame, path: Path, top: int = 15, objective: str = "mean",
              caption: str | None = None) -> None:
    """Left: the ``top`` candidates, each as how much slower its ``objective`` straggler is than
    rank 1's (%, so the few-percent gaps that decide the ranking show), colour and marker per
    method, its speedup over Ulysses written beside it, the recommended one ringed. Right: every
    candidate's speedup over Ulysses against its communication volume, colour per method, marker per P."""
    import seaborn as sns  # noqa: PLC0415

    from experiments.common.plotting import palette_for, plt, save_figure, setup_style  # noqa: PLC0415  (Agg backend)

    setup_style()
    t = table.copy()
    col = f"{objective}_ms"
    t["gap_pct"] = (t[col] / t[col].min() - 1.0) * 100.0
    t["candidate"] = [f"P{p} H{h} B{b} M{c}" for p, h, b, c in
                      zip(t["pool_size"], t["head_split"], t["block_size"], t["pipeline_chunks"])]
    methods = list(dict.fromkeys(t["method"]))
    colors, markers = palette_for(methods), dict(zip(methods, "oDs^v<>"))
    head = t.head(top).reset_index(drop=True)
    fig, axes = plt.subplots(1, 2, figsize=(13, max(4.0, 0.34 * len(head) + 1.8)))
    ax = axes[0]
    for m in methods:
        sub = head[head["method"] == m]
        ax.scatter(sub["gap_pct"], sub.index, color=colors[m], marker=markers[m], s=55, label=m, zorder=3)
    for i, r in head.iterrows():
        ax.annotate(f"{r['speedup']:.2f}x", (r["gap_pct"], i), xytext=(7, 0), textcoords="offset points",
                    va="center", fontsize=8)
        if r["recommended"]:
            ax.scatter([r["gap_pct"]], [i], s=260, facecolors="none", edgecolors="black", linewidths=1.5, zorder=4,
                       label="recommended")
    span = max(float(head["gap_pct"].max()), 0.5)
    ax.set_xlim(-0.05 * span, span * 1.25)
    ax.set_yticks(head.index, [f"{r.rank}. {r.candidate}" for r in head.itertuples()], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"{objective} straggler above rank 1 (%); text: speedup over Ulysses")
    ax.set_title(f"top {len(head)} candidates (ranked by {objective} straggler)")
    ax.legend(fontsize=8, loc="upper right")  # the gaps grow downwards: the top right is empty
    t["P"] = t["pool_size"].astype(str)
    sns.scatterplot(data=t, x="comm_gb_per_step", y="speedup", hue="method", palette=colors, style="P",
                    style_order=[str(p) for p in sorted(set(t["pool_size"]))], s=55, ax=axes[1])
    rec = t[t["recommended"]]
    axes[1].scatter(rec["comm_gb_per_step"], rec["speedup"], s=260, facecolors="none", edgecolors="black",
                    linewidths=1.6, label="recommended")
    axes[1].axhline(1.0, color="black", lw=1, ls="--")
    axes[1].set_xlabel("communication per step, all links, fwd + bwd (GB)")
    axes[1].set_ylabel("speedup over Ulysses (dashed: parity)")
    axes[1].set_title("every candidate: speedup vs traffic (colour: method, marker: P)")
    axes[1].legend(fontsize=7, ncol=2)
    save_figure(fig, path, caption=caption)


SPREAD = "spread"
"""Label of the per-window speedup column (mean [min, max] over windows; its header names the metric)."""
NARROW = ("rank", "method", "P", "H", "B", "M", "tiles/seq", "mean ms", "speedup", SPREAD, "comm GB/step", "/ bound",
          "pool bal.", "")
"""Columns of the printed ranking without ``--wide``."""


def _spread_header(objective: str) -> str:
    metric = "speedup" if objective == "mean" else "worst-step speedup"
    return f"{metric} per window\nmean \\[min, max]"  # \\[: a literal bracket, not rich markup


def _cells(r, objective: str = "mean") -> dict[str, str]:
    """Every printable cell of one ranked candidate (column label -> text)."""
    col = speedup_column(objective)
    spread = (f"{getattr(r, col + '_window_mean'):.2f} [{getattr(r, col + '_window_min'):.2f}, "
              f"{getattr(r, col + '_window_max'):.2f}]")
    return {"rank": str(r.rank), "method": r.method, "P": str(r.pool_size), "H": str(r.head_split),
            "B": str(r.block_size), "M": str(r.pipeline_chunks), "tiles/seq": str(r.tiles_per_sequence),
            "mean ms": f"{r.mean_ms:.1f}", "max ms": f"{r.max_ms:.1f}", "speedup": f"{r.speedup:.2f}x",
            "max speedup": f"{r.max_speedup:.2f}x", SPREAD: spread, "comm GB/step": f"{r.comm_gb_per_step:.1f}",
            "inter-node GB": f"{r.inter_node_gb_per_step:.1f}", "exposed comm ms": f"{r.comm_exposed_ms:.1f}",
            "/ bound": f"{r.bound_ratio:.2f}", "pool bal.": f"{r.pool_balanced_ratio:.2f}",
            "comm factor": f"{r.comm_factor:.2f}", "placement factor": f"{r.placement_factor:.2f}",
            "pooling factor": f"{r.pooling_factor:.2f}", "kernel factor": f"{r.kernel_factor:.2f}",
            "": "<- recommended" if r.recommended else ""}


def _print_table(table: pd.DataFrame, top: int, profile_name: str, objective: str, wide: bool = False) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(width=None if sys.stdout.isatty() else 200, highlight=False)
    shown = table.head(top)
    if not shown["recommended"].any():
        shown = pd.concat([shown, table[table["recommended"]]])
    rows = [_cells(r, objective) for r in shown.itertuples()]
    columns = list(rows[0]) if wide else list(NARROW)
    windows = int(table["windows"].max())
    t = Table(title=f"candidates ranked by predicted {objective} straggler (profile {profile_name}; "
                    f"ms = one layer fwd+bwd; {windows} window(s))")
    for col in columns:
        t.add_column(_spread_header(objective) if col == SPREAD else col,
                     justify="left" if col in ("method", "") else "right")
    for cells, rec in zip(rows, shown["recommended"]):
        t.add_row(*(cells[c] for c in columns), style="bold green" if rec else None)
    console.print(t)


def _rank_list(ranks: list[int], shown: int = 10) -> str:
    return ", ".join(map(str, ranks[:shown])) + (", ..." if len(ranks) > shown else "")


def noise_line(table: pd.DataFrame, objective: str = "mean") -> str:
    """Whether the top-ranked candidates differ by more than the window-to-window spread of their
    per-window speedups (:func:`within_noise`), and, for those that do not, which are nevertheless
    behind rank 1 on every window (``windows_behind_rank1``, a paired comparison)."""
    col = speedup_column(objective)
    windows = int(table["windows"].min())
    metric = "speedup" if objective == "mean" else "worst-step speedup"
    best = table.iloc[0]
    span = f"[{best[col + '_window_min']:.2f}, {best[col + '_window_max']:.2f}]"
    if windows < 2:
        return (f"Spread: {windows} window, so no window-to-window spread to tell the top candidates apart "
                "(use --windows 2 or more).")
    ranks = within_noise(table, objective)
    if not ranks:
        return (f"Spread: rank 1's per-window {metric} range {span} over {windows} windows overlaps no other "
                "candidate's: the top of the ranking is outside the window-to-window spread.")
    who = f"top {len(ranks)} candidates" if ranks == list(range(1, len(ranks) + 1)) else f"{len(ranks)} candidates"
    line = (f"Noise: the {who} are within the window-to-window spread (noise): ranks {_rank_list(ranks)} have "
            f"per-window {metric} ranges [min, max] overlapping rank 1's {span} over {windows} windows: their "
            "ranking rests on differences smaller than the spread between windows.")
    if "windows_behind_rank1" in table:
        behind = table[table["rank"].isin(ranks[1:])]
        behind = [int(r) for r in behind.loc[behind["windows_behind_rank1"] == windows, "rank"]]
        if behind:
            line += (f" Paired by window (the same data for every candidate), rank 1 is ahead of "
                     f"rank{'s' if len(behind) > 1 else ''} {_rank_list(behind)} on every one of the {windows} "
                     "windows.")
    return line


def tune_layout(settings_: str | None, dp, cp, seq_len, gbs) -> ParallelConfig:
    """The layout to tune: the paper setting ``settings_`` names (one; case-insensitive) with the
    given ``--dp/--cp/--seq-len/--gbs`` replacing its fields, or all four flags without a setting.

    Raises:
        click.UsageError: no layout, a partial one without a setting, or several settings.
        ValueError: an unknown setting name or an invalid layout.
    """
    flags = {"dp": dp, "cp": cp, "seq_len": seq_len, "gbs": gbs}
    if not settings_:
        layout = given_layout(dp, cp, seq_len, gbs)
        if layout is None:
            raise click.UsageError("tune needs a layout: --dp, --cp, --seq-len and --gbs, or --settings 256k|1m")
        return ParallelConfig(**layout)
    names = settings_from_options(settings_, None)
    if len(names) != 1:
        raise click.UsageError(f"tune tunes one layout; --settings names {len(names)} ({', '.join(names)})")
    preset = SETTINGS[names[0]]
    base = {"dp": preset.dp, "cp": preset.cp, "seq_len": preset.seq_len, "gbs": preset.gbs}
    return ParallelConfig(**(base | {k: v for k, v in flags.items() if v is not None}))


def echo_summary(table: pd.DataFrame, objective: str, tie_tolerance: float) -> None:
    """Print Ulysses' reference, the recommendation and its rule, the spread verdict and the legend."""
    rec = table[table["recommended"]].iloc[0]
    click.echo(f"Ulysses on the same windows: mean straggler {rec['ulysses_mean_ms']:.1f} ms, "
               f"worst step {rec['ulysses_max_ms']:.1f} ms.")
    click.echo(f"Recommended: {rec['method']} with P={rec['pool_size']}, H={rec['head_split']}, B={rec['block_size']}, M={rec['pipeline_chunks']} "
               f"({rec['tiles_per_sequence']} tiles per packed sequence): predicted mean straggler "
               f"{rec['mean_ms']:.1f} ms ({rec['speedup']:.2f}x over Ulysses), worst step {rec['max_ms']:.1f} ms "
               f"({rec['max_speedup']:.2f}x), {rec['comm_gb_per_step']:.1f} GB moved per step.")
    click.echo(f"Rule: lowest {objective} straggler (--objective); candidates within {tie_tolerance:.0%} of the "
               "best tie and go to the smaller P (less traffic, smaller pool to plan), then libra before "
               "libra-adaptive (cheaper to plan), then fewer tiles per sequence (cheaper placement), then the "
               f"lower {'worst step' if objective == 'mean' else 'mean'}.")
    click.echo(noise_line(table, objective))
    if rec["speedup"] < 1.0:
        click.echo("Warning: no candidate beats Ulysses on this workload and cluster; Libra is not predicted "
                   "to help here.")
    click.echo("Columns: straggler = slowest worker's forward + backward core-attention time of one layer in "
               "one step (compute + exposed communication) as the cost model predicts it; max = worst step "
               "per window; speedup = Ulysses / candidate on the same windows and device jitter (mean over all "
               "steps); per window = that ratio on each window alone, its mean and [min, max] over windows; "
               "comm GB = bytes over all links per step; / bound = straggler over the perfect-balance bound.")


def straggler_command(rec, workload, profile, par: ParallelConfig, shape, windows: int, seed: int, tau: float) -> str:
    """The ``libra-bench straggler`` command that runs the recommended configuration on the same
    windows, jitter and profile as tune priced it."""
    return (f"libra-bench straggler --workload {workload} --profile {profile} --dp {par.dp} --cp {par.cp} "
            f"--seq-len {par.seq_len} --gbs {par.gbs} --q-heads {shape.num_q_heads} --kv-heads {shape.num_kv_heads} "
            f"--head-dim {shape.head_dim} --windows {windows} --seed {seed} --methods ulysses,{rec['method']} "
            f"--pool-size {rec['pool_size']} --head-split {rec['head_split']} --block-size {rec['block_size']} "
            f"--chunks {rec['pipeline_chunks']} --tau {tau}")


def echo_reproduction(rec, command: str, as_straggler_ms: float | None, merged: list[dict]) -> None:
    """How to rerun the recommendation in ``straggler`` and what it will predict there (a planner that
    deepens its Pipeliner does so in straggler, which tune, searching M itself, does not let it do),
    and which H values gave bit-identical plans (listed once)."""
    click.echo(f"Rerun it: {command}")
    if as_straggler_ms is not None:
        click.echo(f"  straggler predicts {as_straggler_ms:.1f} ms for {rec['method']} there, not {rec['mean_ms']:.1f} "
                   f"ms: it runs {rec['method']} with deepen_pipeline (M={rec['pipeline_chunks']} doubled in the pools whose plan "
                   "the planner prices faster that way); tune searches M itself and prices every candidate at its own M.")
    for g in merged:
        click.echo(f"Same plans: {g['method']} at P={g['pool_size']}, B={g['block_size']}, M={g['pipeline_chunks']} "
                   f"plans bit-identically for H={','.join(map(str, g['head_splits']))}; listed once, as "
                   f"H={g['head_splits'][0]}.")


@click.command("tune")
@common_options(default_windows=2)
@click.option("--settings", "--setting", "settings_", default=None,
              help="One of the paper's layouts as the starting point: 256k (DP32 CP8 S256K GBS128) or 1m "
                   "(DP16 CP16 S1M GBS32), case-insensitive; --dp/--cp/--seq-len/--gbs override its fields. "
                   "Without it all four are required.")
@layout_options()
@click.option("--pool-sizes", type=IntListType(), default=None, help="Comma list of P (default: every divisor of DP).")
@click.option("--head-splits", type=IntListType(), default=None,
              help="Comma list of H (default: 1, 2, 4, 8 where valid).")
@click.option("--block-sizes", type=IntListType(), default=None,
              help="Comma list of B, e.g. 4K,8K (default: S/CP halved up to 4 times, >= 1024).")
@tap_options("tau", "pipeline_chunks")
@click.option("--chunk-counts", type=IntListType(), default=None,
              help="Comma list of Pipeliner chunks M to search as well, e.g. 4,8 (default: --pipeline-chunks "
                   "alone; the paper uses M = 4).")
@click.option("--tie-tolerance", type=float, default=0.01, show_default=True,
              help="Candidates within this fraction of the best mean straggler count as ties.")
@click.option("--objective", type=click.Choice(OBJECTIVES), default="mean", show_default=True,
              help="Rank by mean straggler (throughput without PP) or worst step (PP bottleneck).")
@click.option("--top", type=int, default=15, show_default=True, help="Rows of the printed ranking.")
@click.option("--methods", default=",".join(TUNE_METHODS), show_default=True,
              help="Comma list of TAP planners to tune (libra-adaptive plans with --profile).")
@click.option("--wide", is_flag=True, help="Print every column of the ranking (default: the narrow table).")
@score_profile_option()
def tune(profile, windows, seed, out, quick, force, q_heads, kv_heads, head_dim, no_progress, workload, settings_,
         dp, cp, seq_len, gbs, pool_sizes, head_splits, block_sizes, tau, pipeline_chunks, chunk_counts, tie_tolerance,
         objective, top, methods, wide, score_profile):
    """Search Libra's (P, H, B) -- and M with --chunk-counts -- for your workload and cluster (--dp --cp
    --seq-len --gbs, or --settings 256k|1m) and recommend one configuration."""
    check_counts(windows, seed)
    if top < 1:
        raise click.BadParameter(f"must be >= 1, got {top}", param_hint="--top")
    if not (tie_tolerance >= 0):
        raise click.BadParameter(f"must be >= 0, got {tie_tolerance}", param_hint="--tie-tolerance")
    prof = resolve_profile(profile)
    scoring = resolve_score_profile(score_profile, prof)
    try:
        par = tune_layout(settings_, dp, cp, seq_len, gbs)
        shape = make_shape(q_heads, kv_heads, head_dim)
        tap = TapConfig(tau=tau, pipeline_chunks=pipeline_chunks)  # (P, H, B) come from each candidate
        grid = candidate_grid(par, shape, tap, pool_sizes, head_splits, block_sizes, chunk_counts)
        n_windows = 1 if quick else windows
        method_list = parse_list(methods, tuple(dict.fromkeys(TAP_METHODS + OPTIONAL_METHODS)), "method")
        click.echo(f"simulating Ulysses + {len(grid)} (P, H, B, M) candidates x {', '.join(method_list)} "
                   f"x {n_windows} window(s) "
                   f"(DP {par.dp}, CP {par.cp}, S {par.seq_len}, GBS {par.gbs}, GA {par.ga}; hq {q_heads}, "
                   f"h_kv {kv_heads}, d {head_dim}; M {_listed(sorted({c[3] for c in grid}))}, tau {tap.tau}) ...")
        t0 = time.perf_counter()
        cfg = TuneConfig(workload=workload, profile=prof, par=par, shape=shape, grid=grid, tap=tap,
                         windows=n_windows, seed=seed, tie_tolerance=tie_tolerance, objective=objective, out=out,
                         force=force, quiet=no_progress, methods=method_list, score_profile=scoring)
        table, steps, run, merged = run_tune(cfg)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    rec = table[table["recommended"]].iloc[0]
    recommendation = {k: (v.item() if hasattr(v, "item") else v) for k, v in rec.items()}
    command = straggler_command(rec, workload, profile, par, shape, n_windows, seed, tap.tau)
    command += f" --score-profile {score_profile}" if scoring is not None else ""
    as_straggler = {"as_straggler_ms": table.attrs["as_straggler_ms"]} if "as_straggler_ms" in table.attrs else {}
    paths = run.finish(table, plot=lambda d, p: plot_tune(d, p, top, objective, run_caption(run.config)),
                       extra={"profile": prof.to_dict(), **score_record(scoring), "recommendation": {**recommendation, **as_straggler},
                              "recommendation_in_straggler": command, "same_plan_head_splits": merged,
                              "within_noise_ranks": within_noise(table, objective)},
                       files={f"{run.name}_steps.csv": steps.to_csv(index=False)})
    _print_table(table, top, prof.name + (f", scored with {scoring.name}" if scoring else ""), objective, wide)
    echo_summary(table, objective, tie_tolerance)
    echo_reproduction(rec, command, as_straggler.get("as_straggler_ms"), merged)
    click.echo(f"wall {time.perf_counter() - t0:.1f} s; wrote {paths['csv']}, {paths.get('png')}, "
               f"{run.out_dir / (run.name + '_steps.csv')}, {paths['run']}")
