"""`libra-bench variability`: Figure 3, FLOPs-balanced vs time-balanced as the pool grows.

Protocol (Libra sec. 3.2, "second cost" of a large pool; defined here because the paper's figure
text was lost):

1. Workload: ``--windows`` GBS windows of each chosen setting (``--settings``, default 256K: DP 32,
   CP 8, GBS 128; or your layout ``--dp --cp --seq-len --gbs``) from ``--workload``, fixed-token
   packed. For each pool size P (dividing DP) the window is cut into ``K = GBS / P`` pools of P
   consecutive sequences (production order); pool k runs at GA index ``k // (DP/P)`` on DP ranks
   ``(k % (DP/P)) * P ..``, i.e. on ``W = P * CP`` GPUs.
2. Work: the pool's SH-tiles (B, H of the setting, or ``--block-size``/``--head-split``;
   :func:`libra.tap.tiles.make_tiles`), each with its forward FLOPs from :mod:`libra.workload`.
3. Devices: the profile's seeded device jitter (:class:`libra.sim.variability.DeviceJitter`) gives
   every GPU of the cluster a speed for that GA index (persistent per-GPU factor x per-step
   factor); the same draws serve every P.
4. Two assignments, both greedy heaviest-tile-first (LPT): *FLOPs-balanced* puts each tile on the
   worker with the least FLOPs so far (what a FLOPs-aware placer does); *time-balanced* knows the
   speeds and puts it on the worker that would finish it first (load + FLOPs/speed).
5. A worker's time is its FLOPs / (speed x the kernel's best rate); kernel efficiency and
   communication are deliberately left out so the spread isolates device variability.
6. Per step (pool): ``spread = T_flops_balanced / T_time_balanced - 1`` with ``T`` the slowest
   worker. We report mean and max spread per P; the paper reports 7.01% mean and 15.07% max at
   its protocol.

The paper's two numbers are printed, plotted and given as ``paper_mean_spread`` /
``paper_max_spread`` summary columns only for a run of its protocol (the ``libra-prod`` workload,
a paper layout without TAP overrides and the paper's head shape,
:func:`experiments.common.paper.paper_settings`); any other run has no paper columns or lines.

Outputs (``runs/variability/<workload>-<layout>-<profile>/`` or ``--out``): ``variability.csv`` (one row per setting, P, window, pool),
``variability_summary.csv`` (one row per P; with a ``setting`` column when several settings run),
``variability.png`` (one panel per setting), ``run.json``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.common.options import IntListType, given_layout, layout_options, settings_option, tap_options
from experiments.common.paper import NUMBERS, paper_settings
from experiments.common.runner import ExperimentRun, flat_layout
from experiments.common.runs_table import run_caption
from experiments.common.sim_common import (
    SimulatedRunConfig,
    check_counts,
    chosen_settings,
    common_options,
    format_table,
    jitter_seed,
    load_windows,
    make_shape,
    resolve_profile,
    setting_record,
    settings_from_options,
    workload_record,
)
from libra.data.source import resolve_workload
from libra.sim.variability import DeviceJitter
from libra.workload import AttentionShape

POOL_SIZES = (1, 2, 4, 8, 16, 32)
PAPER_MEAN_SPREAD, PAPER_MAX_SPREAD = NUMBERS["fig3"]["mean"], NUMBERS["fig3"]["max"]


def greedy_assign(flops: np.ndarray, speed: np.ndarray, use_speed: bool) -> np.ndarray:
    """LPT: tiles heaviest first (ties by index), each to the worker finishing it first.

    Args:
        flops: ``(T,)`` tile FLOPs.
        speed: ``(W,)`` worker speeds (> 0).
        use_speed: False -> choose by FLOPs load (speeds unknown to the placer).

    Returns:
        ``(W,)`` FLOPs load per worker.
    """
    w = len(speed)
    load = np.zeros(w)
    inv = 1.0 / speed if use_speed else np.ones(w)
    for t in np.argsort(-flops, kind="stable"):
        i = int(np.argmin((load + flops[t]) * inv))
        load[i] += flops[t]
    return load


def pool_spreads(window, setting, shape, pool_size: int, speeds_by_ga, rate_flops_per_ms: float) -> list[dict]:
    """Spread of every pool of one window at pool size P (see the module docstring)."""
    from libra.plan import SequenceLayout  # noqa: PLC0415
    from libra.tap.tiles import make_tiles  # noqa: PLC0415

    cp, dp = setting.cp, setting.dp
    per_ga = dp // pool_size
    rows = []
    for k in range(setting.gbs // pool_size):
        seqs = [SequenceLayout.contiguous(j, j % pool_size, window[k * pool_size + j].sample_lengths, cp)
                for j in range(pool_size)]
        tiles = make_tiles(seqs, setting.tap.block_size, setting.tap.head_split, shape)
        ga, first = k // per_ga, (k % per_ga) * pool_size * cp
        speed = speeds_by_ga[ga][first:first + pool_size * cp]
        f_load = greedy_assign(tiles.flops, speed, use_speed=False)
        t_load = greedy_assign(tiles.flops, speed, use_speed=True)
        t_f = float(np.max(f_load / speed)) / rate_flops_per_ms
        t_t = float(np.max(t_load / speed)) / rate_flops_per_ms
        rows.append({"pool": k, "ga_index": ga, "workers": pool_size * cp, "flops_balanced_ms": t_f,
                     "time_balanced_ms": t_t, "spread": t_f / t_t - 1.0,
                     "speed_min": float(speed.min()), "speed_mean": float(speed.mean())})
    return rows


def check_tiles(chosen: dict, shape) -> None:
    """Fail before any work when a setting's B or H cannot tile its sequences (B must divide S/CP,
    H must divide hq). M is irrelevant here (no Pipeliner), so it is checked as 1.

    Raises:
        ValueError: naming the setting and the rule.
    """
    from libra.config import check_layout  # noqa: PLC0415

    for name, st in chosen.items():
        try:
            check_layout(st.par(), replace(st.tap, pipeline_chunks=1), shape)
        except ValueError as exc:
            raise ValueError(f"setting {name}: {exc}") from exc


def variability_keys(chosen: dict, pool_sizes, windows: int) -> list[list]:
    """``[setting, P, window]`` of every point; P not dividing a setting's DP is skipped there.

    Raises:
        ValueError: a setting none of whose pool sizes divides its DP.
    """
    keys = []
    for s, st in chosen.items():
        sizes = [p for p in pool_sizes if st.dp % p == 0]
        if not sizes:
            raise ValueError(f"no pool size in {list(pool_sizes)} divides DP={st.dp} of setting {s}")
        keys += [[s, p, w] for p in sizes for w in range(windows)]
    return keys


@dataclass(frozen=True, kw_only=True)
class VariabilityConfig(SimulatedRunConfig):
    """What one `libra-bench variability` run simulates and where it writes (the command builds it once)."""

    pool_sizes: Sequence[int] | None
    shape: AttentionShape
    name: str = "variability"


def run_variability(cfg: VariabilityConfig):
    """Spreads of every (setting, P, window); returns (rows, summary, run, paper settings).

    Args:
        settings: paper setting names or :class:`~experiments.common.sim_common.Setting` objects (a layout).
        tap_overrides: ``block_size``/``head_split`` replacing every setting's (None keeps its own).

    Raises:
        ValueError: unknown setting, bad workload, B/H not tiling a setting, or no P dividing DP.
    """
    chosen = chosen_settings(cfg.settings, cfg.tap_overrides)
    check_tiles(chosen, cfg.shape)
    records = [setting_record(st) for st in chosen.values()]
    # one setting keeps the `setting` key the paper run (and `libra-bench report`) always had
    config = {"workload": cfg.workload, "workload_source": workload_record(cfg.workload), "profile": cfg.profile.to_dict(),
              **({"setting": records[0]} if len(records) == 1 else {"settings": records}),
              "pool_sizes": list(cfg.pool_sizes), "windows": cfg.windows, "seed": cfg.seed,
              "shape": [cfg.shape.num_q_heads, cfg.shape.num_kv_heads, cfg.shape.head_dim, cfg.shape.dtype_bytes]}
    keys = variability_keys(chosen, cfg.pool_sizes, cfg.windows)
    # P is swept and M unused: leave them out of the run folder's layout tag
    layouts = [{k: v for k, v in flat_layout(r).items() if k not in ("pool_size", "pipeline_chunks")}
               for r in records]
    run = ExperimentRun(cfg.name, config, out_dir=cfg.out, force=cfg.force, quiet=cfg.quiet, layouts=layouts)
    cache: dict = {}
    rate = cfg.profile.kernel.best_rate_tflops() * 1e9  # FLOPs per ms
    label = resolve_workload(cfg.workload).name  # the file name (#column), or the preset

    def point(key):
        s, p, w = key
        st = chosen[s]
        if s not in cache:
            cache[s] = load_windows(cfg.workload, st, cfg.windows, cfg.seed)
        jit = DeviceJitter(cfg.profile.variability, st.dp * st.cp, jitter_seed(cfg.seed, w))
        speeds = [jit.speeds(g) for g in range(st.gbs // st.dp)]
        return [{"workload": label, "setting": s, "pool_size": p, "window": w, **r}
                for r in pool_spreads(cache[s][w], st, cfg.shape, p, speeds, rate)]

    df = pd.DataFrame(run.map(keys, point, desc="variability"))
    paper = paper_settings(cfg.workload, chosen, cfg.shape)
    return df, summarize(df, list(chosen), paper), run, paper


def summarize(df: pd.DataFrame, settings: list[str], paper: set[str]) -> pd.DataFrame:
    """Per (setting, P): workers, steps, mean and max spread, mean slowest-GPU speed.

    A ``setting`` column leads when several settings ran; ``paper_mean_spread`` /
    ``paper_max_spread`` (the paper's protocol-level numbers, the same on every P) exist only when
    some setting is in ``paper`` (NaN on the others), never on a run the paper does not describe."""
    parts = []
    for s in settings:
        g = (df[df["setting"] == s].groupby("pool_size", sort=True)
             .agg(workers=("workers", "first"), steps=("spread", "size"), mean_spread=("spread", "mean"),
                  max_spread=("spread", "max"), mean_speed_min=("speed_min", "mean"))
             .reset_index())
        if len(settings) > 1:
            g.insert(0, "setting", s)
        if paper:
            g["paper_mean_spread"] = PAPER_MEAN_SPREAD if s in paper else np.nan
            g["paper_max_spread"] = PAPER_MAX_SPREAD if s in paper else np.nan
        parts.append(g)
    return pd.concat(parts, ignore_index=True)


def plot_variability(df: pd.DataFrame, path: Path, paper: set[str] = frozenset(), caption: str | None = None) -> None:
    """Per setting: per-step spread vs pool size (box + mean); the paper's mean and max as
    reference lines on the settings in ``paper`` only."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    settings = list(dict.fromkeys(df["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(7 * len(settings), 4.2), squeeze=False)
    for ax, s in zip(axes[0], settings):
        sub = df[df["setting"] == s]
        d = sub.assign(spread_pct=100 * sub["spread"], workers=sub["workers"].astype(str))
        order = [str(w) for w in sorted(sub["workers"].unique())]
        sns.boxplot(data=d, x="workers", y="spread_pct", order=order, color="#9ecae1", fliersize=2, ax=ax)
        sns.pointplot(data=d, x="workers", y="spread_pct", order=order, color="black", errorbar=None,
                      markers="D", linestyles="-", ax=ax)
        if s in paper:
            ax.axhline(100 * PAPER_MEAN_SPREAD, color="tab:red", ls="--", label=f"paper mean {PAPER_MEAN_SPREAD:.2%}")
            ax.axhline(100 * PAPER_MAX_SPREAD, color="tab:red", ls=":", label=f"paper max {PAPER_MAX_SPREAD:.2%}")
            ax.legend(fontsize=8)
        ax.set_xlabel("pool workers W = P x CP")
        ax.set_ylabel("FLOPs-balanced / time-balanced - 1 (%)")
        ax.set_title(f"{s}: device variability, per-step spread vs pool size (black: mean)", fontsize=10)
    from experiments.common.plotting import save_figure  # noqa: PLC0415  (Agg backend)

    save_figure(fig, path, caption=caption)


@click.command("variability")
@common_options(default_windows=4)
@settings_option(default="256k")
@layout_options()
@click.option("--pool-sizes", type=IntListType(), default=",".join(map(str, POOL_SIZES)), show_default=True,
              help="Comma list of P (those not dividing a setting's DP are skipped there).")
@tap_options("block_size", "head_split", per_setting=True)
def variability(profile, windows, seed, out, quick, force, q_heads, kv_heads, head_dim, no_progress, workload,
                settings_, dp, cp, seq_len, gbs, pool_sizes, block_size, head_split):
    """Figure 3: FLOPs-balanced vs time-balanced spread under device jitter as the pool grows (paper
    settings, or your layout: --dp --cp --seq-len --gbs)."""
    check_counts(windows, seed)
    prof = resolve_profile(profile)
    layout = given_layout(dp, cp, seq_len, gbs)
    try:
        settings = settings_from_options(settings_, layout)
        shape = make_shape(q_heads, kv_heads, head_dim)
        t0 = time.perf_counter()
        cfg = VariabilityConfig(workload=workload, profile=prof, settings=settings, pool_sizes=pool_sizes,
                                windows=1 if quick else windows, seed=seed, shape=shape, out=out, force=force,
                                quiet=no_progress,
                                tap_overrides={"block_size": block_size, "head_split": head_split})
        df, summary, run, paper = run_variability(cfg)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    paths = run.finish(df, plot=lambda d, p: plot_variability(d, p, paper, run_caption(run.config)),
                       extra={"profile": prof.to_dict()},
                       files={"variability_summary.csv": summary.to_csv(index=False)})
    lead = ["setting"] if "setting" in summary else []
    click.echo(format_table(summary, [*lead, "pool_size", "workers", "steps", "mean_spread", "max_spread",
                                      "mean_speed_min"], "{:.4f}"))
    for s, g in df.groupby("setting", sort=False):
        ref = f" (paper: {PAPER_MEAN_SPREAD:.2%}, {PAPER_MAX_SPREAD:.2%})" if s in paper else ""
        click.echo(f"{s + ': ' if lead else ''}all steps: mean spread {g['spread'].mean():.2%}, "
                   f"max {g['spread'].max():.2%}{ref}")
    click.echo(f"wall {time.perf_counter() - t0:.1f} s; wrote {paths['csv']}, {paths.get('png')}")
