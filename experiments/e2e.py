"""`libra-bench e2e` (Figure 11): end-to-end tokens per GPU per second, simulated or measured.

Libra sec. 6.2: Ulysses, WLB-LLM and Libra on the three Qwen3 models at 64, 128 and 256 GPUs.
256K: CP 4, PP 4, GBS 128, DP 4 -> 16, P = min(8, DP); 1M: CP 16, PP 2, GBS 32, DP 2 -> 8,
P = min(4, DP). Each step is priced by :class:`libra.sim.e2e.StepModel` from the Plans each method's
planner produces for the same GBS window (``--windows`` consecutive windows of ``--workload``).
``--measure`` instead runs real training (``libra-bench train``'s loop) per method on a small CPU
configuration and reports its measured tokens/GPU/s.

This module also holds the helpers the other simulated end-to-end experiments share
(``dp-scaling``, ``pp-balance``): the paper settings, common click options (including the TAP
overrides ``--block-size``, ``--head-split``, ``--tau``, ``--pipeline-chunks``, default each
setting's) and one function that plans and prices one window.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import click
import pandas as pd

from baselines.registry import get_planner, options_from_tap
from experiments.options import no_progress_option, overwrite_option, tap_options
from experiments.runner import ExperimentRun
from experiments.sim_common import with_tap
from libra.config import ParallelConfig, TapConfig, check_layout
from libra.data.windows import gbs_windows
from libra.sim.e2e import E2EConfig, StepModel, StepTime
from libra.sim.models import MODELS, get_model
from libra.sim.profiles import DEFAULT_PROFILE, load_profile

METHODS = ("ulysses", "wlb-llm", "libra")


@dataclass(frozen=True)
class Setting:
    """One paper dataset setting: packed length, GBS, CP, PP and Libra's TAP layout.

    Attributes:
        tap: Libra's TapConfig; its ``pool_size`` is the pool-size cap, ``P = min(cap, DP)``
            (:meth:`libra_tap`).
    """

    name: str
    seq_len: int
    gbs: int
    cp: int
    pp: int
    tap: TapConfig

    def libra_tap(self, dp: int) -> TapConfig:
        """Libra's TapConfig at ``dp`` replicas: ``P = min(tap.pool_size, DP)``."""
        return replace(self.tap, pool_size=min(self.tap.pool_size, dp))


# Libra sec. 6.2 (Figure 11) and 6.3 (block sizes: B = 4096 on 256K, 8192 on 1M; H = 2; M = 4,
# TapConfig's default).
E2E_SETTINGS = {
    "256k": Setting("256k", 262144, 128, cp=4, pp=4, tap=TapConfig(pool_size=8, block_size=4096, head_split=2)),
    "1m": Setting("1m", 1048576, 32, cp=16, pp=2, tap=TapConfig(pool_size=4, block_size=8192, head_split=2)),
}
E2E_DP = {"256k": (4, 8, 16), "1m": (2, 4, 8)}


def planner_for(method: str, setting: Setting, dp: int):
    """The registry planner of ``method`` with the setting's TAP layout at ``P = min(cap, DP)``
    (only the TAP planners take it; Ulysses and WLB-LLM run with their defaults)."""
    return get_planner(method, **options_from_tap(method, setting.libra_tap(dp)))


def price_window(method: str, window, setting: Setting, dp: int, pp: int, model_name: str, profile,
                 layers: int | None = None) -> StepTime:
    """Plan one GBS window with ``method`` and price the optimizer step (one PP stage's Plans)."""
    model = get_model(model_name)
    par = ParallelConfig(dp=dp, cp=setting.cp, gbs=setting.gbs, seq_len=setting.seq_len, pp=pp)
    plans = planner_for(method, setting, dp).plan_window(window, par, model.attention_shape)
    return StepModel(E2EConfig(model, par, layers=layers), profile).step(plans)


@functools.lru_cache(maxsize=8)
def cached_windows(workload: str, seq_len: int, gbs: int, n_windows: int, seed: int):
    """``gbs_windows`` memoised per process (the sweep prices the same windows many times)."""
    return gbs_windows(workload, seq_len, gbs, n_windows, seed=seed)


TAP_OVERRIDES = ("block_size", "head_split", "tau", "pipeline_chunks")
"""TapConfig fields the simulated end-to-end commands take as options (default: each setting's)."""


def sim_options(default_windows: int, quick_windows: int):
    """Click options every simulated end-to-end experiment takes (the TAP ones: :data:`TAP_OVERRIDES`)."""

    def wrap(fn):
        opts = [
            click.option("--workload", default="libra-prod", show_default=True,
                         help="length preset name or a length file (.txt/.txt.gz/.json/.csv/.parquet/.npy)"),
            click.option("--profile", "profile_name", default=DEFAULT_PROFILE, show_default=True,
                         help="hardware profile name or JSON path"),
            click.option("--windows", type=click.IntRange(min=1), default=None,
                         help=f"GBS windows (optimizer steps) per point [default {default_windows}; "
                              f"--quick {quick_windows}]"),
            click.option("--seed", type=int, default=0, show_default=True, help="seed of the length stream"),
            click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
                         help="output folder (default results/<name>)"),
            click.option("--quick", is_flag=True, help="fewer windows (smoke run)"),
            click.option("--force", is_flag=True, help="recompute cached points"),
            overwrite_option(),
            no_progress_option(),
        ]
        for opt in reversed(opts):
            fn = opt(fn)
        return tap_options(*TAP_OVERRIDES, per_setting=True)(fn)

    return wrap


def check_tap_layouts(chosen: dict, dps: dict, pp: int | None, model_names) -> None:
    """Check Libra's layout at every (setting, DP, model) point before any work (a click error
    naming the point), so a TAP option the layout rules reject fails at once, not mid-sweep.

    Args:
        chosen: setting name -> :class:`Setting`; dps: setting name -> DP degrees; pp: the PP degree
            the command prices with (None: each setting's).
    """
    for s, st in chosen.items():
        for dp in dps[s]:
            par = ParallelConfig(dp=dp, cp=st.cp, gbs=st.gbs, seq_len=st.seq_len, pp=st.pp if pp is None else pp)
            for m in model_names:
                try:
                    check_layout(par, st.libra_tap(dp), get_model(m).attention_shape)
                except ValueError as exc:
                    raise click.UsageError(f"setting {s}, DP={dp}, {m}: {exc}") from exc


def tap_settings(settings: dict, names, overrides: dict) -> dict:
    """``{name: settings[name]}`` with the TAP options given on the command line applied
    (:func:`experiments.sim_common.with_tap`), as a click error when TapConfig rejects a value."""
    try:
        return {s: with_tap(settings[s], **overrides) for s in names}
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def resolve_windows(windows: int | None, quick: bool, default: int, quick_default: int) -> int:
    return windows if windows is not None else (quick_default if quick else default)


def parse_dp(text: str | None, allowed) -> tuple[int, ...]:
    """Parse ``--dp`` (comma-separated ints) and keep it within ``allowed``; None -> all of them."""
    if text is None:
        return tuple(allowed)
    try:
        wanted = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise click.BadParameter(f"--dp must be comma-separated integers, got {text!r}", param_hint="--dp") from exc
    bad = [d for d in wanted if d not in allowed]
    if bad or not wanted:
        raise click.BadParameter(f"DP {bad or text!r} not in this experiment's {list(allowed)}", param_hint="--dp")
    return wanted


def check_profile(profile_name: str):
    try:
        return load_profile(profile_name)
    except (ValueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint="--profile") from exc


def check_workload(workload: str, seq_len: int, gbs: int, n_windows: int, seed: int):
    try:
        return cached_windows(workload, seq_len, gbs, n_windows, seed)
    except (ValueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint="--workload") from exc


# --------------------------------------------------------------------------------------------
# Figure 11
# --------------------------------------------------------------------------------------------


def _plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import seaborn as sns

    mean = df.groupby(["setting", "model", "gpus", "method"], as_index=False)["tokens_per_gpu_s"].mean()
    g = sns.catplot(data=mean, kind="bar", x="gpus", y="tokens_per_gpu_s", hue="method", col="model",
                    row="setting", hue_order=[m for m in METHODS if m in set(mean.method)],
                    sharey=False, height=2.6, aspect=1.2)
    g.set_axis_labels("GPUs", "tokens / GPU / s")
    g.figure.suptitle("End-to-end throughput (Figure 11; " + str(df["source"].iloc[0]) + ")", y=1.02)
    g.figure.savefig(path, dpi=130, bbox_inches="tight", format="png")


@click.command("e2e")
@sim_options(default_windows=3, quick_windows=1)
@click.option("--models", default=",".join(MODELS), show_default=True, help="comma-separated model names")
@click.option("--settings", "setting_names", default="256k,1m", show_default=True,
              help="comma-separated paper settings: 256k, 1m")
@click.option("--dp", "dp_filter", default=None,
              help="comma-separated DP degrees to keep from the paper's (256K: 4,8,16; 1M: 2,4,8)")
@click.option("--measure", is_flag=True,
              help="run real training per method (small CPU configuration) instead of the model")
@click.option("--nproc", type=click.IntRange(min=2), default=4, show_default=True,
              help="--measure: processes (DP x CP = nproc)")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True, help="--measure: steps")
def e2e(workload, profile_name, windows, seed, out, quick, force, models, setting_names, dp_filter, measure, nproc,
        steps, **tap):
    """Figure 11: tokens/GPU/s of Ulysses, WLB-LLM and Libra on Qwen3 8B, 30B-A3B, 235B-A22B."""
    if measure:
        given = sorted(f"--{k.replace('_', '-')}" for k, v in tap.items() if v is not None)
        if given:
            raise click.UsageError(f"{', '.join(given)} set the simulated settings' TAP layout; --measure "
                                   "trains with libra-bench train's own layout")
        _measure(workload, seed, out, force, nproc, steps)
        return
    model_names = [m.strip() for m in models.split(",") if m.strip()]
    for m in model_names:
        if m not in MODELS:
            raise click.BadParameter(f"unknown model {m!r}; known: {', '.join(MODELS)}", param_hint="--models")
    settings = [s.strip() for s in setting_names.split(",") if s.strip()]
    for s in settings:
        if s not in E2E_SETTINGS:
            raise click.BadParameter(f"unknown setting {s!r}; known: {', '.join(E2E_SETTINGS)}",
                                     param_hint="--settings")
    dps = {s: parse_dp(dp_filter, E2E_DP[s]) for s in settings}
    chosen = tap_settings(E2E_SETTINGS, settings, tap)
    check_tap_layouts(chosen, dps, None, model_names)
    profile = check_profile(profile_name)
    n_windows = resolve_windows(windows, quick, 3, 1)
    config = {"workload": workload, "profile": profile.to_dict(), "windows": n_windows, "seed": seed,
              "models": model_names, "settings": {s: asdict(chosen[s]) for s in settings},
              "dp": dps, "methods": METHODS, "linear_mfu": 0.5}
    run = ExperimentRun("e2e", config, out_dir=out, force=force)
    for s in settings:
        st = chosen[s]
        check_workload(workload, st.seq_len, st.gbs, n_windows, seed)
    keys = [(s, m, dp, method) for s in settings for m in model_names for dp in dps[s] for method in METHODS]

    def point(key):
        s, m, dp, method = key
        st = chosen[s]
        rows = []
        for w, window in enumerate(cached_windows(workload, st.seq_len, st.gbs, n_windows, seed)):
            t = price_window(method, window, st, dp, st.pp, m, profile)
            rows.append({"workload": workload, "setting": s, "model": m, "method": method, "dp": dp,
                         "cp": st.cp, "pp": st.pp, "gpus": t.gpus, "window": w, "source": "simulated",
                         **t.summary()})
        return rows

    df = pd.DataFrame(run.map(keys, point, desc="e2e"))
    paths = run.finish(df, _plot, extra={"profile": profile.name})
    mean = df.groupby(["setting", "model", "gpus", "method"])["tokens_per_gpu_s"].mean().unstack("method")
    mean["libra/ulysses"] = mean["libra"] / mean["ulysses"]
    mean["libra/wlb-llm"] = mean["libra"] / mean["wlb-llm"]
    click.echo(mean.round(3).to_string())
    click.echo(f"Libra over Ulysses {mean['libra/ulysses'].min():.2f}x-{mean['libra/ulysses'].max():.2f}x "
               "(paper 1.58x-3.24x)")
    top = mean.xs(int(df.gpus.max()), level="gpus")["libra/wlb-llm"]
    click.echo(f"Libra over WLB-LLM at {int(df.gpus.max())} GPUs: mean {top.mean():.2f}x, max {top.max():.2f}x "
               "(paper at 256 GPUs: 1.44x mean, 1.68x max)")
    click.echo(f"wrote {paths['csv']}")


def _measure(workload, seed, out, force, nproc, steps):
    """Measured Figure 11 on this machine: the real training loop (DP x CP = nproc, CP 2) per method.

    Ulysses and Libra run in one set of spawned gloo ranks from the same initialization and data;
    WLB-LLM has no runtime in this project (its variable-length repacking is simulated only).
    """
    from experiments.train import TrainConfig, run_training

    methods = ("ulysses", "libra")
    try:
        cfgs = [TrainConfig(nproc=nproc, cp=2, steps=steps, attention=m, workload=workload, seed=seed) for m in methods]
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    results = run_training(cfgs)
    rows = []
    for method, cfg, result in zip(methods, cfgs, results):
        for r in result["steps"]:
            rows.append({"workload": workload, "setting": f"S={cfg.seq_len}", "model": "qwen3-small",
                         "method": method, "dp": cfg.dp, "cp": cfg.cp, "pp": 1, "gpus": nproc,
                         "window": r["step"], "source": "measured (CPU, gloo)",
                         "tokens_per_gpu_s": r["tokens_per_gpu_s"], "loss": r["loss"], "step_ms": r["step_ms"]})
    run = ExperimentRun("e2e-measured", {"workload": workload, "seed": seed, "nproc": nproc, "steps": steps,
                                         "train": [c.to_dict() for c in cfgs]}, out_dir=out, force=force, quiet=True)
    df = pd.DataFrame(rows)
    paths = run.finish(df, _plot)
    click.echo(df.groupby("method")["tokens_per_gpu_s"].median().round(1).to_string())
    click.echo(f"wrote {paths['csv']}")
