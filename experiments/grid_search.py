"""`libra-bench grid-search`: Figure 16, TAP's block size B x head split H grid (Libra sec. 6.6).

Both granularity knobs add schedulable SH-Tiles (``(S / B) * H`` per packed sequence), but they
differ in communication: a larger block lets one KV fetch serve more query work, while a head split
beyond ``h_kv`` fetches replicated KV. Sec. 6.6 grid-searches them with VRSP on and the Pipeliner
off (``libra-tap-vrsp``, M = 1) on layouts of its own:

* 256K: CP 8, DP 8, P 8, GBS 128, ``h_kv = 16``, B in {2048, 4096, 8192, 16384};
* 1M:   CP 16, DP 4, P 4, GBS 32, ``h_kv = 4``,  B in {4096, 8192, 16384, 32768};

each with H in {1, 2, 4, 8}. We use 32 query heads by default (``--q-heads``; the paper's
microbenchmarks use a synthetic head configuration it does not state, and ``h_kv = 16`` needs
``hq`` divisible by 16). A cell's value is the mean-straggler speedup over Ulysses on the same
layout, windows and device jitter. Cells the layout rules reject (B not dividing S/CP, H not
dividing hq, ...) are kept as rows with a ``reason`` instead of aborting the sweep.

Outputs (``results/grid-search/`` or ``--out``): ``grid-search.csv`` (one row per setting, method,
cell, window, step), ``grid-search_summary.csv`` (one row per cell, skipped cells included, with
the paper's quoted values), ``grid-search.png`` (one seaborn heatmap per setting, paper cells
outlined) and ``run.json`` (config, profile, git SHA). ``--tau`` overrides the settings' soft
load-target slack (TapConfig's default otherwise).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.options import tap_options
from experiments.runner import ExperimentRun, atomic_write_text, is_preset_workload
from experiments.sim_common import (
    Setting,
    build_cost_model,
    check_counts,
    common_options,
    format_table,
    jitter_seed,
    load_windows,
    make_planner,
    make_shape,
    parse_int_list,
    parse_list,
    resolve_profile,
    setting_record,
    tiles_per_sequence,
    with_tap,
    workload_record,
)
from libra.config import TapConfig, check_layout
from libra.sim.simulator import simulate_window

GRID_METHOD = "libra-tap-vrsp"
"""Sec. 6.6: VRSP enabled, Pipeliner overlap disabled (M = 1)."""

HEAD_SPLITS = (1, 2, 4, 8)
DEFAULT_Q_HEADS = 32


@dataclass(frozen=True)
class GridSetting:
    """One sec. 6.6 grid: a layout, its KV-head override and the block sizes it sweeps.

    Attributes:
        setting: parallel layout and TAP layout (its ``block_size``/``head_split`` are replaced per cell).
        kv_heads: ``h_kv`` this sweep alone uses (16 on 256K, 4 on 1M).
        block_sizes: the B axis of the grid.
    """

    setting: Setting
    kv_heads: int
    block_sizes: tuple[int, ...]


GRID_SETTINGS: dict[str, GridSetting] = {
    "256k": GridSetting(Setting("256k", dp=8, cp=8, gbs=128, seq_len=256 * 1024,
                                tap=TapConfig(pool_size=8, block_size=4096, head_split=2)),
                        kv_heads=16, block_sizes=(2048, 4096, 8192, 16384)),
    "1m": GridSetting(Setting("1m", dp=4, cp=16, gbs=32, seq_len=1024 * 1024,
                              tap=TapConfig(pool_size=4, block_size=8192, head_split=2)),
                      kv_heads=4, block_sizes=(4096, 8192, 16384, 32768)),
}

# Speedups over same-layout Ulysses that Libra sec. 6.6 quotes, as (low, high) per (setting, H, B).
# 256K: H=4,B=8192 1.89x and H=1,B=2048 1.75x (both 128 tiles); H=1 with 16 tiles (B=16384) 0.81x.
# 1M: "1.62x-1.63x at 256 tiles" for the diagonal cells with H <= h_kv = 4, and "1.58x vs 1.62x at
# H=8" -- our reading: the 256-tile cell H=8, B=32768 gives 1.58x (replicated KV since H > h_kv).
PAPER_FIG16: dict[tuple[str, int, int], tuple[float, float]] = {
    ("256k", 4, 8192): (1.89, 1.89),
    ("256k", 1, 2048): (1.75, 1.75),
    ("256k", 1, 16384): (0.81, 0.81),
    ("1m", 1, 4096): (1.62, 1.63),
    ("1m", 2, 8192): (1.62, 1.63),
    ("1m", 4, 16384): (1.62, 1.63),
    ("1m", 8, 32768): (1.58, 1.58),
}


def grid_shape(name: str, q_heads: int = DEFAULT_Q_HEADS, kv_heads: int | None = None, head_dim: int = 128):
    """Attention shape of grid ``name``: ``kv_heads`` defaults to the setting's sec. 6.6 override.

    Raises:
        ValueError: unknown setting, or ``h_kv`` not dividing ``hq`` (the message names both).
    """
    if name not in GRID_SETTINGS:
        raise ValueError(f"unknown setting {name!r}; choose from {', '.join(GRID_SETTINGS)}")
    hkv = GRID_SETTINGS[name].kv_heads if kv_heads is None else kv_heads
    try:
        return make_shape(q_heads, hkv, head_dim)
    except ValueError as exc:
        raise ValueError(f"setting {name}: h_kv={hkv}{' (the sec. 6.6 override)' if kv_heads is None else ''} "
                         f"with --q-heads={q_heads}: {exc}") from exc


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


def run_grid(workload: str, profile, settings, head_splits, windows: int, seed: int, shapes: dict,
             block_sizes: dict | None = None, out=None, force=False, quiet=False, name: str = "grid-search",
             tap_overrides: dict | None = None, profile_file: str | None = None):
    """Simulate Ulysses and every valid (B, H) cell per setting; returns (steps, summary, run).

    Args:
        shapes: setting name -> :class:`AttentionShape`.
        block_sizes: setting name -> B axis (default: the paper's per setting).
        tap_overrides: TapConfig fields replacing every setting's (None values keep the setting's).
        profile_file: the ``--profile`` value; when it is a file its bytes key the run too.

    Outputs go to ``out`` or, by default, ``results/<name>`` for the paper's grid (a built-in preset,
    no TAP override) and ``runs/<name>/...`` otherwise (:func:`experiments.runner.default_out_dir`).

    Raises:
        ValueError: unknown setting, bad workload, a setting without any valid cell, or a planner
            rejecting a layout.
    """
    block_sizes = block_sizes or {s: GRID_SETTINGS[s].block_sizes for s in settings}
    overrides = {k: v for k, v in (tap_overrides or {}).items() if v is not None}
    chosen = {s: with_tap(GRID_SETTINGS[s].setting, **overrides) for s in settings}
    keys, skipped = grid_keys(chosen, shapes, head_splits, block_sizes, windows)
    config = {"workload": workload, "workload_source": workload_record(workload), "profile": profile.to_dict(),
              "method": GRID_METHOD, "settings": [setting_record(chosen[s]) for s in settings],
              "block_sizes": {s: list(block_sizes[s]) for s in settings}, "head_splits": list(head_splits),
              "windows": windows, "seed": seed,
              "shapes": {s: [shapes[s].num_q_heads, shapes[s].num_kv_heads, shapes[s].head_dim,
                             shapes[s].dtype_bytes] for s in settings}}
    run = ExperimentRun(name, config, out_dir=out, force=force, quiet=quiet, files={"profile": profile_file},
                        paper=is_preset_workload(workload) and not overrides)
    cache: dict = {}
    label = Path(workload).name if Path(workload).exists() else workload

    def context(s):
        if s not in cache:
            st = chosen[s]
            cache[s] = (st, load_windows(workload, st, windows, seed), build_cost_model(profile, st.par()))
        return cache[s]

    def point(key):
        s, method, b, h, w = key
        st, wins, cm = context(s)
        cell = with_tap(st, block_size=b, head_split=h) if method == GRID_METHOD else st
        steps = simulate_window(make_planner(method, cell), wins[w], st.par(), shapes[s], cm,
                                seed=jitter_seed(seed, w))
        return [{"workload": label, "setting": s, "method": method, "block_size": b, "head_split": h,
                 "window": w, **r.to_row()} for r in steps]

    df = pd.DataFrame(run.map(keys, point, desc="grid-search"))
    return df, summarize(df, shapes, skipped, settings, head_splits, block_sizes), run


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


def summarize(df: pd.DataFrame, shapes: dict, skipped: list[dict], settings, head_splits,
              block_sizes: dict) -> pd.DataFrame:
    """One row per (setting, H, B): mean straggler, speedups over Ulysses, tiles, traffic, paper.

    ``speedup`` = Ulysses' mean straggler / the cell's (sec. 6.6's metric); ``max_speedup`` the same
    for the worst step of each window (averaged over windows). Skipped cells carry ``reason``.
    """
    skip = {(r["setting"], r["head_split"], r["block_size"]): r["reason"] for r in skipped}
    rows = []
    for s in settings:
        st, shape = GRID_SETTINGS[s].setting, shapes[s]
        g = df[df["setting"] == s]
        u = g[g["method"] == "ulysses"]
        u_mean = u["straggler_ms"].mean()
        u_max = u.groupby("window")["straggler_ms"].max().mean()
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
                    row.update(status="skipped", reason=reason or "no result")
                    for col in ("steps", "mean_ms", "max_ms", "compute_ms", "comm_serial_ms", "comm_gb_per_step",
                                "inter_node_gb_per_step", "speedup", "max_speedup"):
                        row[col] = np.nan
                else:
                    mean_ms = c["straggler_ms"].mean()
                    max_ms = c.groupby("window")["straggler_ms"].max().mean()
                    bytes_all = c["bytes_nvlink"] + c["bytes_roce"] + c["bytes_inter_supernode"]
                    row.update(status="ok", reason="", steps=len(c), mean_ms=mean_ms, max_ms=max_ms,
                               compute_ms=c["compute_ms"].mean(), comm_serial_ms=c["comm_serial_ms"].mean(),
                               comm_gb_per_step=bytes_all.mean() / 1e9,
                               inter_node_gb_per_step=(c["bytes_roce"] + c["bytes_inter_supernode"]).mean() / 1e9,
                               speedup=u_mean / mean_ms, max_speedup=u_max / max_ms)
                low, high = PAPER_FIG16.get((s, h, b), (np.nan, np.nan))
                row["paper_speedup_low"], row["paper_speedup_high"] = low, high
                rows.append(row)
    lead = ["setting", "head_split", "block_size", "tiles_per_sequence", "status", "speedup", "paper_speedup_low",
            "paper_speedup_high", "max_speedup", "mean_ms", "max_ms", "ulysses_mean_ms"]
    out = pd.DataFrame(rows)
    for col in ("tiles_per_sequence", "tiles_per_pool"):  # NaN only where B does not divide S
        out[col] = out[col].astype("Int64")
    return out[lead + [c for c in out.columns if c not in lead]]


def plot_grid(summary: pd.DataFrame, path: Path) -> None:
    """One heatmap per setting: speedup over Ulysses per (H, B), tile count in each cell; cells the
    paper quotes are outlined and carry its value; skipped cells are blank with 'skip'."""
    import seaborn as sns  # noqa: PLC0415

    from experiments.plotting import plt, save_figure, setup_style  # noqa: PLC0415  (Agg backend)

    setup_style()
    settings = list(dict.fromkeys(summary["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(6.4 * len(settings), 4.8), squeeze=False)
    for ax, s in zip(axes[0], settings):
        sub = summary[summary["setting"] == s]
        hs = sorted(set(sub["head_split"]))
        bs = sorted(set(sub["block_size"]))
        val = sub.pivot(index="head_split", columns="block_size", values="speedup").reindex(index=hs, columns=bs)
        text = np.empty(val.shape, dtype=object)
        for i, h in enumerate(hs):
            for j, b in enumerate(bs):
                r = sub[(sub["head_split"] == h) & (sub["block_size"] == b)].iloc[0]
                if r["status"] != "ok":
                    text[i, j] = "skip"
                    continue
                t = f"{r['speedup']:.2f}x\n{int(r['tiles_per_sequence'])} tiles"
                if np.isfinite(r["paper_speedup_low"]):
                    lo, hi = r["paper_speedup_low"], r["paper_speedup_high"]
                    t += f"\npaper {lo:.2f}x" if lo == hi else f"\npaper {lo:.2f}-{hi:.2f}x"
                text[i, j] = t
        sns.heatmap(val, annot=text, fmt="", cmap="RdYlGn", center=1.0, ax=ax, linewidths=0.5,
                    annot_kws={"fontsize": 7}, cbar_kws={"label": "mean-straggler speedup over Ulysses"})
        for i, h in enumerate(hs):
            for j, b in enumerate(bs):
                if (s, h, b) in PAPER_FIG16:
                    ax.add_patch(plt.Rectangle((j, i), 1, 1, fill=False, edgecolor="black", lw=2.2))
        r0 = sub.iloc[0]
        ax.set_title(f"{s}: DP {r0['dp']}, CP {r0['cp']}, P {r0['pool_size']}, "
                     f"hq {r0['q_heads']} / h_kv {r0['kv_heads']} (outlined: paper)", fontsize=9)
        ax.set_xlabel("block size B (tokens)")
        ax.set_ylabel("head split H")
    save_figure(fig, path)


@click.command("grid-search")
@common_options(default_windows=16, shape=False)  # 16 windows: ~1.5 min on 2 cores
@click.option("--setting", "settings_", default="256k,1m", show_default=True, help="Comma list: 256k, 1m.")
@click.option("--head-splits", default=",".join(map(str, HEAD_SPLITS)), show_default=True,
              help="H axis of the grid.")
@click.option("--block-sizes", default=None,
              help="B axis for every chosen setting (default: the paper's, 2048-16384 on 256k, 4096-32768 on 1m).")
@click.option("--q-heads", type=int, default=DEFAULT_Q_HEADS, show_default=True,
              help="Query heads (the paper does not state its synthetic head count; 32 fits both h_kv).")
@click.option("--kv-heads", type=int, default=None,
              help="KV heads for every setting (default: sec. 6.6's override, 16 on 256k and 4 on 1m).")
@click.option("--head-dim", type=int, default=128, show_default=True, help="Head width.")
@tap_options("tau", per_setting=True)
def grid_search(profile, windows, seed, out, quick, force, no_progress, workload, settings_, head_splits,
                block_sizes, q_heads, kv_heads, head_dim, tau):
    """Figure 16: speedup over Ulysses of every (block size B, head split H) cell, VRSP on, M = 1."""
    check_counts(windows, seed)
    prof = resolve_profile(profile)
    try:
        settings = parse_list(settings_, tuple(GRID_SETTINGS), "setting")
        hs = parse_int_list(head_splits, "head split")
        bs = {s: (parse_int_list(block_sizes, "block size") if block_sizes else GRID_SETTINGS[s].block_sizes)
              for s in settings}
        shapes = {s: grid_shape(s, q_heads, kv_heads, head_dim) for s in settings}
        t0 = time.perf_counter()
        df, summary, run = run_grid(workload, prof, settings, hs, 1 if quick else windows, seed, shapes,
                                    block_sizes=bs, out=out, force=force, quiet=no_progress,
                                    tap_overrides={"tau": tau}, profile_file=profile)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    atomic_write_text(run.out_dir / f"{run.name}_summary.csv", summary.to_csv(index=False))
    paths = run.finish(df, plot=lambda _d, p: plot_grid(summary, p),
                       extra={"profile": prof.to_dict()})
    ok = summary[summary["status"] == "ok"]
    click.echo(format_table(ok, ["setting", "head_split", "block_size", "tiles_per_sequence", "speedup",
                                 "paper_speedup_low", "max_speedup", "comm_gb_per_step"], "{:.2f}"))
    for r in summary[summary["status"] != "ok"].itertuples():
        click.echo(f"skipped {r.setting} H={r.head_split} B={r.block_size}: {r.reason}")
    click.echo(f"wall {time.perf_counter() - t0:.1f} s; wrote {paths['csv']}, {paths.get('png')}, "
               f"{run.out_dir / (run.name + '_summary.csv')}")
