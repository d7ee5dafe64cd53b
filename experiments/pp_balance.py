"""`libra-bench pp-balance` (Figure 14): per-microbatch forward time within one pipeline stage.

Libra sec. 6.4: pipeline-parallel training (256K: DP 4, PP 2, CP 8, GBS 128; 1M: DP 4, PP 2,
CP 16, GBS 32), each microbatch's forward time on stage 0, aggregated over all replicas of the
stage and over ``--windows`` iterations (paper: 15), normalized by Libra's per-iteration mean (so
Libra's mean is 1). The forward time is the stage's layers times the per-layer time the
:class:`libra.sim.e2e.StepModel` prices (linear + MoE all-to-all + the pool's slowest attention
worker). Unequal microbatches are what create compute-induced pipeline bubbles; the slowest one in
the window is what matters.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click
import pandas as pd

from experiments.e2e import (
    Setting,
    cached_windows,
    check_profile,
    check_tap_layouts,
    check_workload,
    price_window,
    resolve_windows,
    sim_options,
    tap_settings,
)
from experiments.runner import ExperimentRun
from libra.config import TapConfig
from libra.sim.models import MODELS

SETTINGS = {
    "256k": Setting("256k", 262144, 128, cp=8, pp=2, tap=TapConfig(pool_size=8, block_size=4096, head_split=2)),
    "1m": Setting("1m", 1048576, 32, cp=16, pp=2, tap=TapConfig(pool_size=8, block_size=8192, head_split=2)),
}
DP = 4
METHODS = ("ulysses", "libra")
PAPER = {"1m": "baseline 0.02-23.1 (mean 4.14), Libra 0.52-1.57", "256k": "baseline max 6.98, Libra max 2.63"}


def _plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    settings = list(dict.fromkeys(df.setting))
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.4), squeeze=False)
    for ax, s in zip(axes[0], settings):
        part = df[df.setting == s]
        sns.boxplot(data=part, x="method", y="normalized_fwd", ax=ax, whis=(0, 100), color="0.85")
        sns.stripplot(data=part, x="method", y="normalized_fwd", ax=ax, size=2.5, alpha=0.6)
        ax.axhline(1.0, color="k", ls="--", lw=0.8)
        ax.set(yscale="log", title=s, ylabel="forward time / Libra mean", xlabel="")
    fig.suptitle("Per-microbatch forward time, stage 0 (Figure 14, simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)


@click.command("pp-balance")
@sim_options(default_windows=15, quick_windows=3)
@click.option("--model", "model_name", type=click.Choice(sorted(MODELS)), default="qwen3-30b-a3b", show_default=True,
              help="model whose layers are priced (libra.sim.models)")
@click.option("--settings", "setting_names", default="256k,1m", show_default=True,
              help="comma-separated paper settings: 256k, 1m")
def pp_balance(workload, profile_name, windows, seed, out, quick, force, model_name, setting_names, **tap):
    """Figure 14: per-microbatch stage-0 forward time under PP 2, normalized to Libra's mean."""
    settings = [s.strip() for s in setting_names.split(",") if s.strip()]
    for s in settings:
        if s not in SETTINGS:
            raise click.BadParameter(f"unknown setting {s!r}; known: {', '.join(SETTINGS)}", param_hint="--settings")
    chosen = tap_settings(SETTINGS, settings, tap)
    check_tap_layouts(chosen, {s: (DP,) for s in settings}, None, [model_name])
    profile = check_profile(profile_name)
    n_windows = resolve_windows(windows, quick, 15, 3)
    for s in settings:
        check_workload(workload, chosen[s].seq_len, chosen[s].gbs, n_windows, seed)
    config = {"workload": workload, "profile": profile.to_dict(), "windows": n_windows, "seed": seed,
              "model": model_name, "settings": {s: asdict(chosen[s]) for s in settings}, "dp": DP,
              "methods": METHODS, "linear_mfu": 0.5}
    run = ExperimentRun("pp-balance", config, out_dir=out, force=force)
    keys = [(s, method, w) for s in settings for method in METHODS for w in range(n_windows)]

    def point(key):
        s, method, w = key
        st = chosen[s]
        window = cached_windows(workload, st.seq_len, st.gbs, n_windows, seed)[w]
        t = price_window(method, window, st, DP, st.pp, model_name, profile)
        fwd = t.stage_fwd_ms[0]  # (DP, GA) on stage 0
        return [{"workload": workload, "setting": s, "model": model_name, "method": method, "window": w,
                 "dp_rank": r, "microbatch": g, "fwd_ms": float(fwd[r, g]),
                 "attention_fwd_ms": float(t.terms.attention_fwd[r, g]), "step_ms": t.step_ms,
                 "bubble_ms": t.bubble_ms}
                for r in range(fwd.shape[0]) for g in range(fwd.shape[1])]

    df = pd.DataFrame(run.map(keys, point, desc="pp-balance"))
    libra_mean = df[df.method == "libra"].groupby(["setting", "window"])["fwd_ms"].mean().rename("libra_mean")
    df = df.merge(libra_mean.reset_index(), on=["setting", "window"])
    df["normalized_fwd"] = df.fwd_ms / df.libra_mean
    paths = run.finish(df, _plot, extra={"profile": profile.name})
    summary = df.groupby(["setting", "method"])["normalized_fwd"].agg(["min", "mean", "max"])
    click.echo(summary.round(3).to_string())
    for s in settings:
        base = summary.loc[(s, "ulysses"), "max"]
        ours = summary.loc[(s, "libra"), "max"]
        click.echo(f"{s}: worst microbatch {base:.2f} -> {ours:.2f} ({base / ours:.1f}x); paper: {PAPER[s]}")
    click.echo(f"wrote {paths['csv']}")
