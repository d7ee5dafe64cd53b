"""`libra-bench dp-scaling` (Figure 13): simulated throughput against DP, normalized to DP = 1.

Libra sec. 6.4: GBS fixed, only DP grows (PP = 1, DP in {1, 2, 4, 8, 16}); 256K: GBS 128, CP 8
(8-128 GPUs); 1M: GBS 32, CP 16 (16-256 GPUs); Libra (full) with ``P = min(8, DP)`` and the
sec. 6.3 TAP layout (H = 2, B = 4096 / 8192, M = 4); Qwen3-30B-A3B by default. Each method's
throughput (tokens/GPU/s times GPUs) is normalized to its own DP = 1, so the ideal is DP. The
baseline loses scaling because the heaviest DP replica stalls the optimizer boundary; the effect
grows as GA = GBS/DP shrinks and fewer sequences average out per replica.
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
    parse_dp,
    price_window,
    resolve_windows,
    sim_options,
    tap_settings,
)
from experiments.runner import ExperimentRun
from libra.config import TapConfig
from libra.sim.models import MODELS

SETTINGS = {
    "256k": Setting("256k", 262144, 128, cp=8, pp=1, tap=TapConfig(pool_size=8, block_size=4096, head_split=2)),
    "1m": Setting("1m", 1048576, 32, cp=16, pp=1, tap=TapConfig(pool_size=8, block_size=8192, head_split=2)),
}
DPS = (1, 2, 4, 8, 16)
METHODS = ("ulysses", "libra")
PAPER_DP16 = {("256k", "ulysses"): 7.63, ("1m", "ulysses"): 4.42, ("256k", "libra"): 13.66, ("1m", "libra"): 11.25}


def _plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    mean = df.groupby(["setting", "method", "dp"], as_index=False)["scaling"].first()
    settings = list(dict.fromkeys(mean.setting))
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.4), squeeze=False)
    for ax, s in zip(axes[0], settings):
        part = mean[mean.setting == s]
        sns.lineplot(data=part, x="dp", y="scaling", hue="method", marker="o", ax=ax)
        dps = sorted(part.dp.unique())
        ax.plot(dps, dps, "k--", lw=1, label="ideal")
        ax.set(xscale="log", yscale="log", xticks=dps, xticklabels=dps, title=f"{s}",
               xlabel="DP", ylabel="throughput / own DP=1")
        ax.legend(fontsize=8)
    fig.suptitle("DP scaling (Figure 13, simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)


@click.command("dp-scaling")
@sim_options(default_windows=4, quick_windows=1)
@click.option("--model", "model_name", type=click.Choice(sorted(MODELS)), default="qwen3-30b-a3b", show_default=True,
              help="model whose layers are priced (libra.sim.models)")
@click.option("--settings", "setting_names", default="256k,1m", show_default=True,
              help="comma-separated paper settings: 256k, 1m")
@click.option("--dp", "dp_filter", default=None, help="comma-separated subset of 1,2,4,8,16 (must include 1)")
def dp_scaling(workload, profile_name, windows, seed, out, quick, force, model_name, setting_names, dp_filter,
               **tap):
    """Figure 13: throughput vs DP (1..16), each method normalized to its own DP = 1."""
    settings = [s.strip() for s in setting_names.split(",") if s.strip()]
    for s in settings:
        if s not in SETTINGS:
            raise click.BadParameter(f"unknown setting {s!r}; known: {', '.join(SETTINGS)}", param_hint="--settings")
    dps = parse_dp(dp_filter, DPS)
    if 1 not in dps:
        raise click.BadParameter("--dp must include 1 (throughput is normalized to DP = 1)", param_hint="--dp")
    chosen = tap_settings(SETTINGS, settings, tap)
    check_tap_layouts(chosen, {s: dps for s in settings}, 1, [model_name])
    profile = check_profile(profile_name)
    n_windows = resolve_windows(windows, quick, 4, 1)
    for s in settings:
        check_workload(workload, chosen[s].seq_len, chosen[s].gbs, n_windows, seed)
    config = {"workload": workload, "profile": profile.to_dict(), "windows": n_windows, "seed": seed,
              "model": model_name, "settings": {s: asdict(chosen[s]) for s in settings}, "dp": dps,
              "methods": METHODS, "linear_mfu": 0.5}
    run = ExperimentRun("dp-scaling", config, out_dir=out, force=force)
    keys = [(s, method, dp) for s in settings for method in METHODS for dp in dps]

    def point(key):
        s, method, dp = key
        st = chosen[s]
        rows = []
        for w, window in enumerate(cached_windows(workload, st.seq_len, st.gbs, n_windows, seed)):
            t = price_window(method, window, st, dp, 1, model_name, profile)
            rows.append({"workload": workload, "setting": s, "model": model_name, "method": method, "dp": dp,
                         "cp": st.cp, "gbs": st.gbs, "pool_size": st.libra_tap(dp).pool_size if method == "libra" else 1,
                         "window": w, **t.summary()})
        return rows

    df = pd.DataFrame(run.map(keys, point, desc="dp-scaling"))
    # aggregate throughput over the windows (total tokens / total time), normalized to the method's DP = 1
    agg = df.groupby(["setting", "method", "dp"]).agg(tokens=("tokens", "sum"), step_ms=("step_ms", "sum"),
                                                     gpus=("gpus", "first"))
    agg["throughput"] = agg.tokens / (agg.step_ms / 1e3)
    base = agg.xs(1, level="dp")["throughput"]
    agg["scaling"] = agg.throughput / base.reindex(agg.index.droplevel("dp")).to_numpy()
    agg["efficiency"] = agg.scaling / agg.index.get_level_values("dp")
    df = df.merge(agg[["scaling", "efficiency"]].reset_index(), on=["setting", "method", "dp"])
    paths = run.finish(df, _plot, extra={"profile": profile.name})
    click.echo(agg[["scaling", "efficiency"]].round(3).unstack("method").to_string())
    for s in settings:
        for method in METHODS:
            if (s, method, 16) in agg.index:
                ours = agg.loc[(s, method, 16), "scaling"]
                click.echo(f"{s} {method}: DP=16 scaling {ours:.2f}x ({ours / 16:.1%}); "
                           f"paper {PAPER_DP16[(s, method)]:.2f}x ({PAPER_DP16[(s, method)] / 16:.1%})")
    click.echo(f"wrote {paths['csv']}")
