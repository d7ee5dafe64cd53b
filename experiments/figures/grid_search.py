"""`libra-bench grid-search`: Figure 16, TAP's block size B x head split H grid (Libra sec. 6.6).

Both granularity knobs add schedulable SH-Tiles (``(S / B) * H`` per packed sequence), but they
differ in communication: a larger block lets one KV fetch serve more query work, while a head split
beyond ``h_kv`` fetches replicated KV. Sec. 6.6 grid-searches them with VRSP on and the Pipeliner
off (``libra-tap-vrsp``, M = 1) on layouts of its own (``--settings``, :data:`GRID_SETTINGS`):

* 256K: CP 8, DP 8, P 8, GBS 128, ``h_kv = 16``, B in {2048, 4096, 8192, 16384};
* 1M:   CP 16, DP 4, P 4, GBS 32, ``h_kv = 4``,  B in {4096, 8192, 16384, 32768};

each with H in {1, 2, 4, 8} (``--head-splits``, ``--block-sizes`` replace the axes). Your own layout
(``--dp --cp --seq-len --gbs``) runs instead of the presets: P is the largest divisor of DP up to 8,
``h_kv`` 4, and B ``S/CP`` halved one to four times (the rule the presets' axes follow).
``--pool-size`` and ``--tau`` override every setting's P and soft load-target slack. We use 32
query heads by default (``--q-heads``; the paper's microbenchmarks use a synthetic head
configuration it does not state, and ``h_kv = 16`` needs ``hq`` divisible by 16). A cell's value is
the mean-straggler speedup over Ulysses on the same layout, windows and device jitter. Cells the
layout rules reject (B not dividing S/CP, H not dividing hq, ...) are kept as rows with a
``reason`` instead of aborting the sweep; a setting without any valid cell is an error (exit 2).

Outputs (``runs/grid-search/<workload>-<layout>-<profile>/`` or ``--out``): ``grid-search.csv`` (one row per
setting, method, cell, window, step), ``grid-search_summary.csv`` (one row per cell, skipped cells
included), ``grid-search.png`` (one seaborn heatmap per setting) and ``run.json`` (config, profile,
git SHA). The paper's quoted values (``paper_speedup_low``/``_high`` columns, outlined cells) appear
only on a run sec. 6.6 describes (:func:`paper_grid`: ``libra-prod``, a preset unchanged, its head
shape); other runs have no such columns.
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
from experiments.common.paper import NUMBERS, PRESET_KEYS
from experiments.common.runner import ExperimentRun, flat_layout
from experiments.common.runs_table import run_caption
from experiments.common.sim_common import (
    Setting,
    SimulatedRunConfig,
    build_cost_model,
    check_counts,
    chosen_settings,
    common_options,
    format_table,
    jitter_seed,
    load_windows,
    make_planner,
    make_shape,
    paper_setting,
    resolve_profile,
    setting_record,
    settings_from_options,
    tiles_per_sequence,
    with_tap,
    workload_record,
)
from libra.config import check_layout
from libra.data.source import resolve_workload
from libra.sim.simulator import simulate_window

GRID_METHOD = "libra-tap-vrsp"
"""Sec. 6.6: VRSP enabled, Pipeliner overlap disabled (M = 1)."""

HEAD_SPLITS = (1, 2, 4, 8)
DEFAULT_Q_HEADS = 32
DEFAULT_KV_HEADS = 4
"""``h_kv`` of a layout of your own unless ``--kv-heads`` (the project's default head shape, 32/4/128)."""

GRID_SETTINGS: dict[str, Setting] = {"256k": paper_setting("256k", dp=8, cp=8, gbs=128, pool_size=8),
                                     "1m": paper_setting("1m", dp=4, cp=16, gbs=32, pool_size=4)}
"""Sec. 6.6's own layouts (not sec. 6.3's :data:`experiments.common.sim_common.SETTINGS` of the same names);
each cell replaces ``block_size``/``head_split``."""

GRID_KV_HEADS: dict[str, int] = {"256k": 16, "1m": 4}
"""``h_kv`` sec. 6.6 uses on each preset (this sweep alone)."""

GRID_BLOCK_SIZES: dict[str, tuple[int, ...]] = {"256k": (2048, 4096, 8192, 16384), "1m": (4096, 8192, 16384, 32768)}
"""Sec. 6.6's B axis per preset (:func:`default_block_sizes` gives the same by its rule)."""

MIN_BLOCK = 1024


def default_block_sizes(setting: Setting) -> tuple[int, ...]:
    """B axis of ``setting`` without ``--block-sizes``: sec. 6.6's for its presets; for a layout of
    your own the rule both of those follow, ``S/CP`` halved one to four times (ascending, blocks of
    at least :data:`MIN_BLOCK` tokens; ``S/CP`` itself when none is left)."""
    if setting.name in GRID_BLOCK_SIZES:
        return GRID_BLOCK_SIZES[setting.name]
    per_rank = setting.seq_len // setting.cp
    out = [per_rank >> k for k in range(4, 0, -1) if (per_rank >> k) << k == per_rank and per_rank >> k >= MIN_BLOCK]
    return tuple(out) or (per_rank,)


def grid_settings(settings, tap_overrides: dict | None = None) -> dict[str, Setting]:
    """``{name: Setting}`` of a run: preset names map to :data:`GRID_SETTINGS`, Setting objects (your
    layout, :func:`experiments.common.sim_common.custom_setting`) stay; the TAP options are applied.

    Raises:
        ValueError: a name that is no grid preset, or a TAP value TapConfig rejects.
    """
    unknown = [s for s in settings if isinstance(s, str) and s not in GRID_SETTINGS]
    if unknown:
        raise ValueError(f"unknown setting {unknown[0]!r}; choose from {', '.join(GRID_SETTINGS)}")
    return chosen_settings([GRID_SETTINGS[s] if isinstance(s, str) else s for s in settings], tap_overrides)


def paper_grid(workload: str, chosen: dict, shapes: dict) -> set[str]:
    """The settings whose cells sec. 6.6 quotes (:data:`PAPER_FIG16`): the paper's corpus stand-in
    (``libra-prod``), the preset's own layout (no ``--pool-size``/``--tau`` change) and sec. 6.6's
    head shape. (Its layouts are not sec. 6.3's, so :func:`experiments.common.paper.paper_settings`,
    which checks those, does not decide this.) Other settings get no paper values or outlines."""
    if workload != "libra-prod":
        return set()
    return {s for s, st in chosen.items() if GRID_SETTINGS.get(s) == st
            and (shapes[s].num_q_heads, shapes[s].num_kv_heads, shapes[s].head_dim)
            == (DEFAULT_Q_HEADS, GRID_KV_HEADS[s], 128)}


# Speedups over same-layout Ulysses that Libra sec. 6.6 quotes, as (low, high) per (setting, H, B)
PAPER_FIG16: dict[tuple[str, int, int], tuple[float, float]] = {
    (name, h, b): quoted for key, name in PRESET_KEYS
    for (h, b), quoted in NUMBERS["fig16"][key].items()}


def grid_shape(name: str, q_heads: int = DEFAULT_Q_HEADS, kv_heads: int | None = None, head_dim: int = 128):
    """Attention shape of setting ``name``: ``kv_heads`` defaults to sec. 6.6's override on its
    presets (:data:`GRID_KV_HEADS`) and to :data:`DEFAULT_KV_HEADS` on a layout of your own.

    Raises:
        ValueError: ``h_kv`` not dividing ``hq`` (the message names both).
    """
    hkv = GRID_KV_HEADS.get(name, DEFAULT_KV_HEADS) if kv_heads is None else kv_heads
    try:
        return make_shape(q_heads, hkv, head_dim)
    except ValueError as exc:
        why = " (the sec. 6.6 override)" if kv_heads is None and name in GRID_KV_HEADS else ""
        raise ValueError(f"setting {name}: h_kv={hkv}{why} with --q-heads={q_heads}: {exc}") from exc


def cell_reason(setting: Setting, shape, block_size: int, head_split: int) -> str:
    """Why cell (B, H) cannot run on ``setting`` (``""`` when it can): the layout rules of
    :func:`libra.config.check_layout` for the TapConfig :data:`GRID_METHOD` plans with (M = 1)."""
    from baselines.registry import planner_class  # noqa: PLC0415  (keeps `--help` fast)

    try:
        tap = planner_class(GRID_METHOD)(with_tap(setting, block_size=block_size, head_split=head_split).tap).tap
        check_layout(setting.par(), tap, shape)
    except ValueError as exc:
        return str(exc)
    return ""


def grid_layouts(chosen: dict) -> list[dict]:
    """The run folder's layouts (:func:`experiments.common.runner.default_out_dir`): each setting without
    B and H (the grid's axes) and M (always 1 here), so the tag names what the run fixed."""
    return [{k: v for k, v in flat_layout(setting_record(st)).items()
             if k not in ("block_size", "head_split", "pipeline_chunks")} for st in chosen.values()]


@dataclass(frozen=True, kw_only=True)
class GridConfig(SimulatedRunConfig):
    """What one `libra-bench grid-search` run simulates and where it writes (the command builds it once)."""

    head_splits: Sequence[int]
    shapes: dict
    block_sizes: Sequence[int] | None = None
    name: str = "grid-search"
    profile_file: str | None = None


def run_grid(cfg: GridConfig):
    """Simulate Ulysses and every valid (B, H) cell per setting; returns (steps, summary, run).

    Args:
        settings: preset names (:data:`GRID_SETTINGS`) or :class:`Setting` objects (your layout).
        shapes: setting name -> :class:`AttentionShape`.
        block_sizes: the B axis of every setting (default: :func:`default_block_sizes` per setting).
        tap_overrides: TapConfig fields replacing every setting's (None values keep the setting's).
        profile_file: the ``--profile`` value; when it is a file its bytes key the run too.

    Outputs go to ``out`` or, by default, ``runs/<name>/...`` (:func:`experiments.common.runner.default_out_dir`).

    Raises:
        ValueError: unknown setting, bad workload, a setting without any valid cell, or a planner
            rejecting a layout.
    """
    settings = cfg.settings
    chosen = grid_settings(settings, cfg.tap_overrides)
    settings = list(chosen)
    axes = {s: tuple(cfg.block_sizes) if cfg.block_sizes else default_block_sizes(chosen[s]) for s in settings}
    keys, skipped = grid_keys(chosen, cfg.shapes, cfg.head_splits, axes, cfg.windows)
    config = {"workload": cfg.workload, "workload_source": workload_record(cfg.workload), "profile": cfg.profile.to_dict(),
              "method": GRID_METHOD, "settings": [setting_record(chosen[s]) for s in settings],
              "block_sizes": {s: list(axes[s]) for s in settings}, "head_splits": list(cfg.head_splits),
              "windows": cfg.windows, "seed": cfg.seed,
              "shapes": {s: [cfg.shapes[s].num_q_heads, cfg.shapes[s].num_kv_heads, cfg.shapes[s].head_dim,
                             cfg.shapes[s].dtype_bytes] for s in settings}}
    run = ExperimentRun(cfg.name, config, out_dir=cfg.out, force=cfg.force, quiet=cfg.quiet, files={"profile": cfg.profile_file},
                        layouts=grid_layouts(chosen))
    cache: dict = {}
    label = resolve_workload(cfg.workload).name  # the file name (#column), or the preset

    def context(s):
        if s not in cache:
            st = chosen[s]
            cache[s] = (st, load_windows(cfg.workload, st, cfg.windows, cfg.seed), build_cost_model(cfg.profile, st.par()))
        return cache[s]

    def point(key):
        s, method, b, h, w = key
        st, wins, cm = context(s)
        cell = with_tap(st, block_size=b, head_split=h) if method == GRID_METHOD else st
        steps = simulate_window(make_planner(method, cell), wins[w], st.par(), cfg.shapes[s], cm,
                                seed=jitter_seed(cfg.seed, w))
        return [{"workload": label, "setting": s, "method": method, "block_size": b, "head_split": h,
                 "window": w, **r.to_row()} for r in steps]

    df = pd.DataFrame(run.map(keys, point, desc="grid-search"))
    paper = paper_grid(cfg.workload, chosen, cfg.shapes)
    return df, summarize(df, chosen, cfg.shapes, skipped, cfg.head_splits, axes, paper), run


def grid_keys(chosen: dict, shapes: dict, head_splits, block_sizes: dict, windows: int) -> tuple[list, list[dict]]:
    """Point keys of the sweep (Ulysses per window, then every valid cell per window) and the
    skipped cells with their reasons.

    Raises:
        ValueError: a setting none of whose (B, H) cells the layout rules accept (the sweep would
            be an empty heatmap); the message names the setting and each cell's reason.
    """
    keys, skipped = [], []
    for s, st in chosen.items():
        keys += [[s, "ulysses", 0, 0, w] for w in range(windows)]
        valid = 0
        for h in head_splits:
            for b in block_sizes[s]:
                reason = cell_reason(st, shapes[s], b, h)
                if reason:
                    skipped.append({"setting": s, "block_size": b, "head_split": h, "reason": reason})
                else:
                    valid += 1
                    keys += [[s, GRID_METHOD, b, h, w] for w in range(windows)]
        if not valid:
            why = "; ".join(dict.fromkeys(r["reason"] for r in skipped if r["setting"] == s))
            raise ValueError(f"no valid (B, H) cell on setting {s}, nothing to grid-search ({why})")
    return keys, skipped


CELL_RESULTS = ("steps", "mean_ms", "max_ms", "compute_ms", "comm_serial_ms", "comm_gb_per_step",
                "inter_node_gb_per_step", "speedup", "max_speedup")


def cell_results(c: pd.DataFrame, u_mean: float, u_max: float) -> dict:
    """Result columns of one computed cell (its steps ``c``) against Ulysses' mean and worst step."""
    mean_ms = c["straggler_ms"].mean()
    max_ms = c.groupby("window")["straggler_ms"].max().mean()
    bytes_all = c["bytes_nvlink"] + c["bytes_roce"] + c["bytes_inter_supernode"]
    return dict(status="ok", reason="", steps=len(c), mean_ms=mean_ms, max_ms=max_ms,
                compute_ms=c["compute_ms"].mean(), comm_serial_ms=c["comm_serial_ms"].mean(),
                comm_gb_per_step=bytes_all.mean() / 1e9,
                inter_node_gb_per_step=(c["bytes_roce"] + c["bytes_inter_supernode"]).mean() / 1e9,
                speedup=u_mean / mean_ms, max_speedup=u_max / max_ms)


def summarize(df: pd.DataFrame, chosen: dict, shapes: dict, skipped: list[dict], head_splits,
              block_sizes: dict, paper: set[str] = frozenset()) -> pd.DataFrame:
    """One row per (setting, H, B): mean straggler, speedups over Ulysses, tiles, traffic.

    ``speedup`` = Ulysses' mean straggler / the cell's (sec. 6.6's metric); ``max_speedup`` the same
    for the worst step of each window (averaged over windows). Skipped cells carry ``reason``.
    ``paper_speedup_low``/``_high`` (sec. 6.6's quoted values) exist only when a setting is in
    ``paper`` (:func:`paper_grid`); a run the paper does not describe has no such columns.
    """
    skip = {(r["setting"], r["head_split"], r["block_size"]): r["reason"] for r in skipped}
    rows = []
    for s, st in chosen.items():
        shape, g = shapes[s], df[df["setting"] == s]
        u = g[g["method"] == "ulysses"]
        u_mean, u_max = u["straggler_ms"].mean(), u.groupby("window")["straggler_ms"].max().mean()
        for h in head_splits:
            for b in block_sizes[s]:
                row = {"setting": s, "head_split": h, "block_size": b,
                       "tiles_per_sequence": tiles_per_sequence(st.seq_len, b, h) if st.seq_len % b == 0 else np.nan,
                       "pool_size": st.tap.pool_size, "dp": st.dp, "cp": st.cp, "gbs": st.gbs,
                       "q_heads": shape.num_q_heads, "kv_heads": shape.num_kv_heads,
                       "kv_replicated": h > shape.num_kv_heads, "ulysses_mean_ms": u_mean}
                row["tiles_per_pool"] = row["tiles_per_sequence"] * st.tap.pool_size
                c = g[(g["method"] == GRID_METHOD) & (g["block_size"] == b) & (g["head_split"] == h)]
                reason = skip.get((s, h, b), "")
                if reason or c.empty:
                    row.update(status="skipped", reason=reason or "no result", **dict.fromkeys(CELL_RESULTS, np.nan))
                else:
                    row.update(cell_results(c, u_mean, u_max))
                if paper:
                    quoted = PAPER_FIG16.get((s, h, b), (np.nan, np.nan)) if s in paper else (np.nan, np.nan)
                    row["paper_speedup_low"], row["paper_speedup_high"] = quoted
                rows.append(row)
    lead = ["setting", "head_split", "block_size", "tiles_per_sequence", "status", "speedup", "paper_speedup_low",
            "paper_speedup_high", "max_speedup", "mean_ms", "max_ms", "ulysses_mean_ms"]
    out = pd.DataFrame(rows)
    for col in ("tiles_per_sequence", "tiles_per_pool"):  # NaN only where B does not divide S
        out[col] = out[col].astype("Int64")
    lead = [c for c in lead if c in out]
    return out[lead + [c for c in out.columns if c not in lead]]


def cell_text(r) -> str:
    """Heatmap annotation of one summary row: speedup, tiles and the paper's value where quoted."""
    if r["status"] != "ok":
        return "skip"
    t = f"{r['speedup']:.2f}x\n{int(r['tiles_per_sequence'])} tiles"
    lo, hi = r.get("paper_speedup_low", np.nan), r.get("paper_speedup_high", np.nan)
    if np.isfinite(lo):
        t += f"\npaper {lo:.2f}x" if lo == hi else f"\npaper {lo:.2f}-{hi:.2f}x"
    return t


def plot_grid(summary: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    """One heatmap per setting: speedup over Ulysses per (H, B), tile count in each cell; cells with
    a paper value (paper runs only, :func:`paper_grid`) are outlined and carry it; skipped cells are
    blank with 'skip'."""
    import seaborn as sns  # noqa: PLC0415

    from experiments.common.plotting import plt, save_figure, setup_style  # noqa: PLC0415  (Agg backend)

    setup_style()
    settings = list(dict.fromkeys(summary["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(6.4 * len(settings), 4.8), squeeze=False)
    for ax, s in zip(axes[0], settings):
        sub = summary[summary["setting"] == s]
        hs = sorted(set(sub["head_split"]))
        bs = sorted(set(sub["block_size"]))
        val = sub.pivot(index="head_split", columns="block_size", values="speedup").reindex(index=hs, columns=bs)
        cells = sub.set_index(["head_split", "block_size"])
        text = np.array([[cell_text(cells.loc[(h, b)]) for b in bs] for h in hs], dtype=object)
        sns.heatmap(val, annot=text, fmt="", cmap="RdYlGn", center=1.0, ax=ax, linewidths=0.5,
                    annot_kws={"fontsize": 7}, cbar_kws={"label": "mean-straggler speedup over Ulysses"})
        outlined = 0
        for i, h in enumerate(hs):
            for j, b in enumerate(bs):
                if np.isfinite(cells.loc[(h, b)].get("paper_speedup_low", np.nan)):
                    ax.add_patch(plt.Rectangle((j, i), 1, 1, fill=False, edgecolor="black", lw=2.2))
                    outlined += 1
        r0 = sub.iloc[0]
        ax.set_title(f"{s}: DP {r0['dp']}, CP {r0['cp']}, P {r0['pool_size']}, hq {r0['q_heads']} / "
                     f"h_kv {r0['kv_heads']}" + (" (outlined: paper)" if outlined else ""), fontsize=9)
        ax.set_xlabel("block size B (tokens)")
        ax.set_ylabel("head split H")
    save_figure(fig, path, caption=caption)


@click.command("grid-search")
@common_options(default_windows=16, shape=False)  # 16 windows: ~1.5 min on 2 cores
@settings_option(help_text="comma list of sec. 6.6's layouts: 256k (DP 8, CP 8, P 8), 1m (DP 4, CP 16, P 4); "
                           "case-insensitive, repeatable; ignored with --dp/--cp/--seq-len/--gbs")
@layout_options()
@click.option("--head-splits", "--head-split", "head_splits", type=IntListType(),
              default=",".join(map(str, HEAD_SPLITS)), show_default=True,
              help="H axis of the grid (--head-split 2: a one-value axis).")
@click.option("--block-sizes", "--block-size", "block_sizes", type=IntListType(), default=None,
              help="B axis for every setting, accepts 8K; --block-size 8K is a one-value axis (default: the "
                   "paper's, 2048-16384 on 256k and 4096-32768 on 1m; on your layout S/CP halved 1-4 times).")
@click.option("--q-heads", type=int, default=DEFAULT_Q_HEADS, show_default=True,
              help="Query heads (the paper does not state its synthetic head count; 32 fits both h_kv).")
@click.option("--kv-heads", type=int, default=None,
              help=f"KV heads for every setting (default: sec. 6.6's override, 16 on 256k and 4 on 1m; "
                   f"{DEFAULT_KV_HEADS} on your layout).")
@click.option("--head-dim", type=int, default=128, show_default=True, help="Head width.")
@tap_options("pool_size", "tau", per_setting=True)
def grid_search(profile, windows, seed, out, quick, force, no_progress, workload, settings_, dp, cp, seq_len, gbs,
                head_splits, block_sizes, q_heads, kv_heads, head_dim, pool_size, tau):
    """Figure 16: speedup over Ulysses of every (block size B, head split H) cell, VRSP on, M = 1 (sec.
    6.6's layouts, or your layout: --dp --cp --seq-len --gbs)."""
    check_counts(windows, seed)
    prof = resolve_profile(profile)
    layout = given_layout(dp, cp, seq_len, gbs)
    try:
        settings = settings_from_options(settings_, layout)
        shapes = {n: grid_shape(n, q_heads, kv_heads, head_dim) for n in (getattr(s, "name", s) for s in settings)}
        t0 = time.perf_counter()
        cfg = GridConfig(workload=workload, profile=prof, settings=settings, head_splits=head_splits,
                         windows=1 if quick else windows, seed=seed, shapes=shapes, block_sizes=block_sizes,
                         out=out, force=force, quiet=no_progress,
                         tap_overrides={"pool_size": pool_size, "tau": tau}, profile_file=profile)
        df, summary, run = run_grid(cfg)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    paths = run.finish(df, plot=lambda _d, p: plot_grid(summary, p, run_caption(run.config)),
                       extra={"profile": prof.to_dict()},
                       files={f"{run.name}_summary.csv": summary.to_csv(index=False)})
    ok = summary[summary["status"] == "ok"]
    paper = ["paper_speedup_low"] if "paper_speedup_low" in summary else []
    click.echo(format_table(ok, ["setting", "head_split", "block_size", "tiles_per_sequence", "speedup", *paper,
                                 "max_speedup", "comm_gb_per_step"], "{:.2f}"))
    for r in summary[summary["status"] != "ok"].itertuples():
        click.echo(f"skipped {r.setting} H={r.head_split} B={r.block_size}: {r.reason}")
    click.echo(f"wall {time.perf_counter() - t0:.1f} s; wrote {paths['csv']}, {paths.get('png')}, "
               f"{run.out_dir / (run.name + '_summary.csv')}")
