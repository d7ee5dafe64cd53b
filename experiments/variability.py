"""`libra-bench variability`: Figure 3, FLOPs-balanced vs time-balanced as the pool grows.

Protocol (Libra sec. 3.2, "second cost" of a large pool; defined here because the paper's figure
text was lost):

1. Workload: ``--windows`` GBS windows of the chosen setting (default 256K: DP 32, CP 8, GBS 128)
   from ``--workload``, fixed-token packed. For each pool size P (dividing DP) the window is cut
   into ``K = GBS / P`` pools of P consecutive sequences (production order); pool k runs at GA
   index ``k // (DP/P)`` on DP ranks ``(k % (DP/P)) * P ..``, i.e. on ``W = P * CP`` GPUs.
2. Work: the pool's SH-tiles (B, H of the setting; :func:`libra.tap.tiles.make_tiles`), each with
   its forward FLOPs from :mod:`libra.workload`.
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

Outputs: ``variability.csv`` (one row per P, window, pool), ``variability_summary.csv``,
``variability.png``, ``run.json``.
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.runner import ExperimentRun, atomic_write_text
from experiments.sim_common import (
    SETTINGS,
    check_counts,
    common_options,
    format_table,
    jitter_seed,
    load_windows,
    make_shape,
    resolve_profile,
    setting_record,
    workload_record,
)
from libra.sim.variability import DeviceJitter

POOL_SIZES = (1, 2, 4, 8, 16, 32)
PAPER_MEAN_SPREAD, PAPER_MAX_SPREAD = 0.0701, 0.1507


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


def run_variability(workload, profile, setting_name, pool_sizes, windows, seed, shape, out=None, force=False,
                    quiet=False, name: str = "variability"):
    setting = SETTINGS[setting_name]
    config = {"workload": workload, "workload_source": workload_record(workload), "profile": profile.to_dict(), "setting": setting_record(setting),
              "pool_sizes": list(pool_sizes), "windows": windows, "seed": seed,
              "shape": [shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes]}
    run = ExperimentRun(name, config, out_dir=out, force=force, quiet=quiet)
    wins = []
    rate = profile.kernel.best_rate_tflops() * 1e9  # FLOPs per ms

    def point(key):
        p, w = key
        if not wins:
            wins.extend(load_windows(workload, setting, windows, seed))
        jit = DeviceJitter(profile.variability, setting.dp * setting.cp, jitter_seed(seed, w))
        speeds = [jit.speeds(g) for g in range(setting.gbs // setting.dp)]
        label = Path(workload).name if Path(workload).exists() else workload
        return [{"workload": label, "setting": setting_name, "pool_size": p, "window": w, **r}
                for r in pool_spreads(wins[w], setting, shape, p, speeds, rate)]

    keys = [[p, w] for p in pool_sizes if setting.dp % p == 0 for w in range(windows)]
    if not keys:
        raise ValueError(f"no pool size in {list(pool_sizes)} divides DP={setting.dp} of setting {setting_name}")
    df = pd.DataFrame(run.map(keys, point, desc="variability"))
    summary = (df.groupby("pool_size", sort=True)
               .agg(workers=("workers", "first"), steps=("spread", "size"), mean_spread=("spread", "mean"),
                    max_spread=("spread", "max"), mean_speed_min=("speed_min", "mean"))
               .reset_index())
    return df, summary, run


def plot_variability(df: pd.DataFrame, path: Path) -> None:
    """Per-step spread vs pool size (box + mean), paper's mean and max as reference lines."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    d = df.assign(spread_pct=100 * df["spread"], workers=df["workers"].astype(str))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    order = [str(w) for w in sorted(df["workers"].unique())]
    sns.boxplot(data=d, x="workers", y="spread_pct", order=order, color="#9ecae1", fliersize=2, ax=ax)
    sns.pointplot(data=d, x="workers", y="spread_pct", order=order, color="black", errorbar=None,
                  markers="D", linestyles="-", ax=ax)
    ax.axhline(100 * PAPER_MEAN_SPREAD, color="tab:red", ls="--", label="paper mean 7.01%")
    ax.axhline(100 * PAPER_MAX_SPREAD, color="tab:red", ls=":", label="paper max 15.07%")
    ax.set_xlabel("pool workers W = P x CP")
    ax.set_ylabel("FLOPs-balanced / time-balanced - 1 (%)")
    ax.set_title("Device variability: per-step spread vs pool size (black: mean)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)


@click.command("variability")
@common_options(default_windows=4)
@click.option("--setting", "setting_", default="256k", show_default=True, type=click.Choice(list(SETTINGS)),
              help="Paper setting whose layout (DP, CP, GBS, B, H) is used.")
@click.option("--pool-sizes", default=",".join(map(str, POOL_SIZES)), show_default=True,
              help="Comma list of P (those not dividing DP are skipped).")
def variability(profile, windows, seed, out, quick, force, q_heads, kv_heads, head_dim, no_progress, workload,
                setting_, pool_sizes):
    """Figure 3: FLOPs-balanced vs time-balanced spread under device jitter as the pool grows."""
    check_counts(windows, seed)
    prof = resolve_profile(profile)
    try:
        sizes = []
        for x in str(pool_sizes).split(","):
            if not x.strip().isdigit() or int(x) < 1:
                raise ValueError(f"pool size {x.strip()!r} is not a positive integer")
            sizes.append(int(x))
        shape = make_shape(q_heads, kv_heads, head_dim)
        t0 = time.perf_counter()
        df, summary, run = run_variability(workload, prof, setting_, sizes, 1 if quick else windows, seed, shape,
                                           out=out, force=force, quiet=no_progress)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    atomic_write_text(run.out_dir / "variability_summary.csv", summary.to_csv(index=False))
    paths = run.finish(df, plot=plot_variability, extra={"profile": prof.to_dict()})
    click.echo(format_table(summary, ["pool_size", "workers", "steps", "mean_spread", "max_spread",
                                      "mean_speed_min"], "{:.4f}"))
    click.echo(f"all steps: mean spread {df['spread'].mean():.2%}, max {df['spread'].max():.2%} "
               f"(paper: {PAPER_MEAN_SPREAD:.2%}, {PAPER_MAX_SPREAD:.2%}); wall {time.perf_counter() - t0:.1f} s")
    click.echo(f"wrote {paths['csv']}, {paths.get('png')}")
