"""`libra-bench plan-cost`: how long Libra's CPU planning takes, and what the plans it makes buy.

Libra sec. 5 reports, on one CPU core, workload estimation + VRSP at 2.2 ms (256K, GBS 128) and
0.6 ms (1M, GBS 32) per optimizer step, and TAP placement at 2.4 ms (256K) and 10.7 ms (1M) per
microbatch per rank. This command measures the same two stages on ``libra-prod`` windows in the
paper's sec. 6.3 settings:

* ``vrsp``: :func:`libra.workload.packed_workloads` + :func:`libra.vrsp.vrsp` +
  :func:`libra.vrsp.microbatch_groups` for one GBS window (once per optimizer step);
* ``tap``: :func:`libra.tap.planner.plan_pool` for one pool of one microbatch group (SH-tiles,
  Algorithm 2 placement and exchange planning), over every VRSP pool of the window; the rows
  ``tap.tiles``, ``tap.placement`` and ``tap.exchange`` time its three parts separately.

Each timing sample is one call (``time.perf_counter``); the CSV gives per (setting, stage) the
median, the inter-quartile range, the sample count and the paper's number. Besides timing, the
command plans every window with ``ulysses``, ``wlb-llm``, ``libra`` and ``distca`` and reports per
method the max/mean worker FLOPs (over the PP stage at the worst GA index, and inside the worst
pool, next to the floor the heaviest indivisible tile sets) and the forward bytes moved per
optimizer step (``plan-cost-quality.csv`` one row per window and method; ``run.json`` aggregated).
Timings on a shared machine are noisy: compare medians, and read the IQR. ``--block-size``,
``--head-split``, ``--tau`` and ``--pipeline-chunks`` override the settings' TAP layout.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from functools import partial

import click
import numpy as np
import pandas as pd

from baselines.libra_planners import vrsp_groups
from baselines.registry import get_planner, options_from_tap, pool_workers
from experiments.options import tap_options
from experiments.runner import ExperimentRun, atomic_write_text
from experiments.sim_common import with_tap
from libra.config import ParallelConfig, TapConfig, check_layout
from libra.data.windows import gbs_windows
from libra.plan import SequenceLayout
from libra.tap.exchange import build_transfers
from libra.tap.placement import place_tiles
from libra.tap.planner import plan_pool
from libra.tap.tiles import make_tiles
from libra.vrsp import microbatch_groups, vrsp
from libra.workload import AttentionShape, packed_workloads

SHAPE = AttentionShape(num_q_heads=32, num_kv_heads=4, head_dim=128)
"""Head geometry of the paper's planning-cost setting (32 query heads, 4 KV heads, d = 128)."""


@dataclass(frozen=True)
class Setting:
    """One of the paper's two sec. 6.3 settings: layout, Libra's TAP layout and the paper's timings."""

    name: str
    seq_len: int
    gbs: int
    dp: int
    cp: int
    tap: TapConfig
    paper_vrsp_ms: float
    paper_tap_ms: float

    @property
    def par(self) -> ParallelConfig:
        return ParallelConfig(dp=self.dp, cp=self.cp, gbs=self.gbs, seq_len=self.seq_len)


SETTINGS = (
    Setting("256K", 262144, 128, 32, 8, TapConfig(pool_size=8, block_size=4096, head_split=2), 2.2, 2.4),
    Setting("1M", 1048576, 32, 16, 16, TapConfig(pool_size=8, block_size=8192, head_split=2), 0.6, 10.7),
)
QUALITY_METHODS = ("ulysses", "wlb-llm", "libra", "distca")


def _time_ms(fn, repeats: int) -> list[float]:
    """``repeats`` wall-clock samples of ``fn()`` in milliseconds (GC off while timing)."""
    out = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    finally:
        if enabled:
            gc.enable()
    return out


def _window(setting: Setting, workload: str, index: int, seed: int):
    """Window ``index`` of the ``seed`` stream (windows extend each other, so this is cheap to reuse)."""
    return gbs_windows(workload, setting.seq_len, setting.gbs, index + 1, seed)[index]


def timing_rows(setting: Setting, workload: str, index: int, seed: int, repeats: int) -> list[dict]:
    """Timing samples of the VRSP stage and of TAP per pool on window ``index``."""
    window = _window(setting, workload, index, seed)
    lengths = [s.sample_lengths for s in window]
    par, tap = setting.par, setting.tap
    check_layout(par, tap, SHAPE)  # once, as a planner's plan_window does; plan_pool is told so

    def vrsp_step():
        pools = vrsp(packed_workloads(lengths), tap.pool_size)
        return microbatch_groups(pools, par.dp)

    rows = [{"setting": setting.name, "window": index, "stage": "vrsp", "ms": ms}
            for ms in _time_ms(vrsp_step, repeats)]
    groups, _ = vrsp_groups(lengths, par, tap.pool_size)
    P = tap.pool_size
    for g in range(par.ga):
        for k in range(par.dp // P):
            p0 = k * P
            seqs = [SequenceLayout.contiguous(int(groups[g, p0 + j]), p0 + j, lengths[int(groups[g, p0 + j])], par.cp)
                    for j in range(P)]
            workers = pool_workers(p0, P, par.cp)
            tiles = make_tiles(seqs, tap.block_size, tap.head_split, SHAPE)
            placed, _ = place_tiles(tiles, seqs, workers, SHAPE, tau=tap.tau, comm_aware=tap.comm_aware)
            parts = {  # partial binds this pool's arguments now (timed right below)
                "tap": partial(plan_pool, k, seqs, workers, tap, SHAPE, layout_checked=True),
                "tap.tiles": partial(make_tiles, seqs, tap.block_size, tap.head_split, SHAPE),
                "tap.placement": partial(place_tiles, tiles, seqs, workers, SHAPE, tau=tap.tau,
                                         comm_aware=tap.comm_aware),
                "tap.exchange": partial(build_transfers, seqs, placed, SHAPE),
            }
            for stage, fn in parts.items():
                rows += [{"setting": setting.name, "window": index, "stage": stage, "ms": ms}
                         for ms in _time_ms(fn, repeats)]
    return rows


def quality_rows(setting: Setting, workload: str, index: int, seed: int, method: str) -> list[dict]:
    """Balance and traffic of ``method``'s plans for window ``index``.

    Returns one row: ``stage_max_over_mean`` (max over GA indices of max worker FLOPs / mean worker
    FLOPs over the whole PP stage), ``pool_max_over_mean`` (worst pool's max/mean), forward bytes
    moved per optimizer step (total and per kind) and the number of fallback tiles.
    """
    window = _window(setting, workload, index, seed)
    plans = get_planner(method, **options_from_tap(method, setting.tap)).plan_window(window, setting.par, SHAPE)
    target = 1.0 + setting.tap.tau
    stage_ratio, pool_ratio, tile_bound, kinds, fallback = [], [], [], {"q": 0, "kv": 0, "o": 0}, 0
    for plan in plans:
        loads = np.concatenate([pool.worker_flops() for pool in plan.pools])
        stage_ratio.append(float(loads.max() / loads.mean()))
        for pool in plan.pools:
            f = pool.worker_flops()
            pool_ratio.append(float(f.max() / f.mean()))
            # no placement can beat the heaviest indivisible tile: max/mean >= max tile / mean
            tile_bound.append(float(pool.tiles.flops.max() / f.mean()))
            for kind, b in pool.transfers.bytes_by_kind().items():
                kinds[kind] += b
            fallback += pool.fallback_tiles
    over = [r > target + 1e-9 for r in pool_ratio]
    return [{"setting": setting.name, "window": index, "method": method,
             "stage_max_over_mean": max(stage_ratio), "pool_max_over_mean": max(pool_ratio),
             "pools": len(pool_ratio), "pools_over_1_plus_tau": int(sum(over)),
             "pools_over_with_tile_above_target": int(sum(o and b > target for o, b in zip(over, tile_bound))),
             "worst_pool_tile_bound": max(tile_bound),
             "bytes_total": sum(kinds.values()), "bytes_q": kinds["q"], "bytes_kv": kinds["kv"],
             "bytes_o": kinds["o"], "fallback_tiles": fallback}]


def summarize(samples: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, stage): median, IQR, count of timing samples and the paper's number."""
    paper = {(s.name, "vrsp"): s.paper_vrsp_ms for s in SETTINGS} | {(s.name, "tap"): s.paper_tap_ms for s in SETTINGS}
    out = []
    for (setting, stage), g in samples.groupby(["setting", "stage"], sort=False):
        q1, med, q3 = np.percentile(g["ms"], [25, 50, 75])
        out.append({"setting": setting, "stage": stage, "median_ms": round(float(med), 4),
                    "iqr_ms": round(float(q3 - q1), 4), "repeats": len(g),
                    "paper_ms": paper.get((setting, stage), float("nan"))})
    return pd.DataFrame(out)


def summarize_quality(quality: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, method) over windows: mean stage max/mean, worst pool, mean bytes, pool counts."""
    return quality.groupby(["setting", "method"], sort=False).agg(
        windows=("window", "count"), stage_max_over_mean=("stage_max_over_mean", "mean"),
        stage_max_over_mean_worst=("stage_max_over_mean", "max"), pool_max_over_mean=("pool_max_over_mean", "max"),
        worst_pool_tile_bound=("worst_pool_tile_bound", "max"), bytes_total=("bytes_total", "mean"),
        pools=("pools", "sum"), pools_over_1_plus_tau=("pools_over_1_plus_tau", "sum"),
        pools_over_with_tile_above_target=("pools_over_with_tile_above_target", "sum"),
        fallback_tiles=("fallback_tiles", "sum")).reset_index()


def plot(df: pd.DataFrame, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    main = df[df["stage"].isin(["vrsp", "tap"])].copy()
    long = pd.concat([main.assign(source="measured", ms=main["median_ms"]),
                      main.assign(source="paper", ms=main["paper_ms"])])
    long["what"] = long["setting"] + " " + long["stage"].map({"vrsp": "VRSP/step", "tap": "TAP/pool"})
    sns.set_theme(style="whitegrid")
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.barplot(data=long, x="what", y="ms", hue="source", ax=ax)
    ax.set_xlabel("")
    ax.set_yscale("log")                  # VRSP (sub-ms) and TAP (tens of ms) on one axis
    ax.set_ylabel("planning time (ms, median, log)")
    ax.set_title("Libra planning cost (libra-prod; paper: Libra sec. 5)")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


@click.command("plan-cost")
@click.option("--quick", is_flag=True, help="1 window, 2 repeats per call: a smoke run in seconds.")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="timing samples per call (default 5; --quick: 2).")
@click.option("--windows", type=click.IntRange(min=1), default=None,
              help="GBS windows per setting (default 8; --quick: 1).")
@click.option("--workload", default="libra-prod", show_default=True,
              help="length preset name or length file (see libra.data.source).")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the sample stream.")
@click.option("--setting", "settings", multiple=True, type=click.Choice([s.name for s in SETTINGS]),
              help="restrict to one setting (repeatable; default: both).")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="output folder (default results/plan-cost).")
@click.option("--force", is_flag=True, help="recompute cached points.")
@tap_options("block_size", "head_split", "tau", "pipeline_chunks", per_setting=True)
def plan_cost(quick, repeats, windows, workload, seed, settings, out, force, block_size, head_split, tau,
              pipeline_chunks):
    """Planning time of VRSP (per step) and TAP (per microbatch per pool), Libra sec. 5.

    Also prints, per setting, max/mean worker FLOPs and bytes moved for Ulysses, Libra and DistCA.
    """
    repeats = repeats or (2 if quick else 5)
    windows = windows or (1 if quick else 8)
    try:
        chosen = [with_tap(s, block_size=block_size, head_split=head_split, tau=tau, pipeline_chunks=pipeline_chunks)
                  for s in SETTINGS if not settings or s.name in settings]
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    config = {"workload": workload, "seed": seed, "repeats": repeats, "windows": windows,
              "settings": [asdict(s) for s in chosen], "shape": SHAPE.__dict__, "quality_methods": QUALITY_METHODS}
    run = ExperimentRun("plan-cost", config, out_dir=out, force=force, quiet=True)
    try:
        keys = [("timing", s.name, w) for s in chosen for w in range(windows)]
        by_name = {s.name: s for s in chosen}
        samples = pd.DataFrame(run.map(keys, lambda key: timing_rows(by_name[key[1]], workload, key[2], seed, repeats)))
        qkeys = [("quality", s.name, w, m) for s in chosen for w in range(windows) for m in QUALITY_METHODS]
        quality = pd.DataFrame(run.map(qkeys, lambda key: quality_rows(by_name[key[1]], workload, key[2], seed, key[3])))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    df = summarize(samples)
    run.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run.out_dir / "plan-cost-quality.csv", quality.to_csv(index=False))
    paths = run.finish(df, plot=plot, extra={"quality": summarize_quality(quality).to_dict(orient="records")})
    for s in chosen:
        sub = df[df["setting"] == s.name].set_index("stage")
        click.echo(f"{s.name}: S={s.seq_len} GBS={s.gbs} DP={s.dp} CP={s.cp} P={s.tap.pool_size} "
                   f"B={s.tap.block_size} H={s.tap.head_split} tau={s.tap.tau} M={s.tap.pipeline_chunks}, "
                   f"{SHAPE.num_q_heads}q/{SHAPE.num_kv_heads}kv heads d={SHAPE.head_dim}, "
                   f"{workload}, {windows} window(s), {repeats} repeat(s)")
        for stage, label in (("vrsp", "VRSP + workload estimation per step"), ("tap", "TAP per microbatch per pool")):
            r = sub.loc[stage]
            click.echo(f"  {label:38s} median {r.median_ms:8.3f} ms  IQR {r.iqr_ms:7.3f} ms  "
                       f"(n={r.repeats})  paper {r.paper_ms} ms")
        parts = ", ".join(f"{st.split('.')[1]} {sub.loc[st].median_ms:.3f}" for st in
                          ("tap.tiles", "tap.placement", "tap.exchange"))
        click.echo(f"    TAP parts (median ms): {parts}")
        q = summarize_quality(quality[quality["setting"] == s.name]).set_index("method")
        click.echo(f"  {'method':8s} {'max/mean FLOPs (stage)':>22s} {'worst pool max/mean':>20s} "
                   f"{'(tile bound)':>12s} {'bytes moved/step':>17s} {'pools > 1+tau':>14s} {'(big tile)':>10s}")
        for m in QUALITY_METHODS:
            r = q.loc[m]
            click.echo(f"  {m:8s} {r.stage_max_over_mean:22.3f} {r.pool_max_over_mean:20.3f} "
                       f"{r.worst_pool_tile_bound:12.3f} {r.bytes_total / 2**30:13.2f} GiB "
                       f"{int(r.pools_over_1_plus_tau):8d}/{int(r.pools):<5d} {int(r.pools_over_with_tile_above_target):10d}")
        click.echo("  (stage: mean over windows of the worst GA index; bytes: mean forward bytes per step;"
                   " tile bound: heaviest tile / mean worker FLOPs")
        click.echo("   of the worst pool, a floor no placement can beat; big tile: pools over 1+tau holding a tile"
                   " heavier than (1+tau) x mean)")
    click.echo(f"wrote {paths['csv']}, {paths['png']}, {run.out_dir / 'plan-cost-quality.csv'}, {paths['run']}")
