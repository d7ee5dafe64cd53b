"""`libra-bench e2e` (Figure 11): end-to-end tokens per GPU per second, simulated or measured.

Libra sec. 6.2: Ulysses, WLB-LLM and Libra on the three Qwen3 models at 64, 128 and 256 GPUs.
256K: CP 4, PP 4, GBS 128, DP 4 -> 16, P = min(8, DP); 1M: CP 16, PP 2, GBS 32, DP 2 -> 8,
P = min(4, DP) (the presets of ``--settings 256k,1m``). Each step is priced by
:class:`libra.sim.e2e.StepModel` from the Plans each method's planner produces for the same GBS
window (``--windows`` consecutive windows of ``--workload``); the printed table and the figure give
the same statistic, the mean tokens/GPU/s over the windows (:func:`throughput_frame`).

Your layout: ``--dp --cp --seq-len --gbs`` (all four; sizes accept ``K``/``M``; ``--pp``, default
1) instead of a preset. ``--dps`` lists the DP degrees priced (default: the layout's DP; the
presets': 256K 4,8,16 and 1M 2,4,8), CP, S, GBS and PP staying fixed. At DP = d Libra's pool is the
largest divisor of d up to the setting's pool size (``--pool-size``, P at the layout's own DP),
i.e. the paper's ``P = min(cap, DP)``. ``--q-heads``, ``--kv-heads`` and ``--head-dim`` replace the
models' head shape. The paper's ratios are printed only for the paper's presets, DP grid and
corpus (``libra-prod``); every run writes under ``runs/e2e/`` by default
(:func:`experiments.common.runner.default_out_dir`).

``--measure`` instead runs real training (``libra-bench train``'s loop) per method on a small CPU
configuration; its table and figure give the median tokens/GPU/s over the steps after the first
(:func:`experiments.measured.train.timed_steps`: step 0 carries the first plan and warm-up), labelled as such.

This module also holds what the other simulated end-to-end experiments (``dp-scaling``,
``pp-balance``) share: the click options (:func:`sim_options`: :func:`experiments.common.sim_common.common_options`,
``--settings``, the layout, head-shape and TAP options), their resolution into
:class:`experiments.common.sim_common.Setting` objects (:func:`sim_setup`), the checks of every point
before any work (:func:`check_points`) and one function that plans and prices one window.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path

import click
import pandas as pd

from baselines.registry import get_planner
from experiments.common.options import IntListType, given_layout, layout_options, settings_option, tap_options
from experiments.common.paper import NUMBERS
from experiments.common.runner import ExperimentRun, layout_tag
from experiments.common.runs_table import run_caption
from experiments.common.sim_common import (
    Setting,
    check_counts,
    chosen_settings,
    common_options,
    largest_divisor,
    paper_setting,
    resolve_profile,
    setting_record,
    settings_from_options,
)
from libra.config import ParallelConfig, TapConfig, check_layout
from libra.data.windows import gbs_windows
from libra.sim.e2e import E2EConfig, StepModel, StepTime
from libra.sim.models import MODELS, ModelShape

METHODS = ("ulysses", "wlb-llm", "libra")
PAPER_WORKLOAD = "libra-prod"
"""The corpus stand-in whose results the paper's numbers describe (paper marks need it)."""

# Libra sec. 6.2 (Figure 11) and 6.3 (block sizes: B = 4096 on 256K, 8192 on 1M; H = 2; M = 4,
# TapConfig's default). DP is the largest of the sweep; the pool size is the cap of P = min(cap, DP).
E2E_SETTINGS = {"256k": paper_setting("256k", dp=16, cp=4, gbs=128, pool_size=8),
                "1m": paper_setting("1m", dp=8, cp=16, gbs=32, pool_size=4)}
E2E_PP = {"256k": 4, "1m": 2}
E2E_DP = {"256k": (4, 8, 16), "1m": (2, 4, 8)}


def libra_tap(setting: Setting, dp: int) -> TapConfig:
    """Libra's TapConfig at ``dp`` replicas: P = the largest divisor of DP up to the setting's pool
    size (the paper's ``P = min(cap, DP)`` when both are powers of 2; the setting's own P at its DP)."""
    return replace(setting.tap, pool_size=largest_divisor(dp, setting.tap.pool_size))


def point_par(setting: Setting, dp: int, pp: int) -> ParallelConfig:
    """The layout of one point: the setting's CP, GBS and S at ``dp`` replicas and ``pp`` stages."""
    return ParallelConfig(dp=dp, cp=setting.cp, gbs=setting.gbs, seq_len=setting.seq_len, pp=pp)


def price_window(method: str, window, setting: Setting, dp: int, pp: int, model: ModelShape, profile,
                 layers: int | None = None) -> StepTime:
    """Plan one GBS window with ``method`` at ``dp`` replicas (Libra's P: :func:`libra_tap`; Ulysses
    and WLB-LLM run with their defaults) and price the optimizer step (one PP stage's Plans)."""
    par = point_par(setting, dp, pp)
    planner = get_planner(method, tap=libra_tap(setting, dp))
    plans = planner.plan_window(window, par, model.attention_shape)
    return StepModel(E2EConfig(model, par, layers=layers), profile).step(plans)


@functools.lru_cache(maxsize=8)
def cached_windows(workload: str, seq_len: int, gbs: int, n_windows: int, seed: int):
    """``gbs_windows`` memoised per process (the sweep prices the same windows many times)."""
    return gbs_windows(workload, seq_len, gbs, n_windows, seed=seed)


# --------------------------------------------------------------------------------------------
# options shared by e2e, dp-scaling and pp-balance
# --------------------------------------------------------------------------------------------

TAP_OVERRIDES = ("pool_size", "block_size", "head_split", "tau", "pipeline_chunks")
"""TapConfig fields the simulated end-to-end commands take as options (default: each setting's)."""

HEAD_FIELDS = {"q_heads": "num_q_heads", "kv_heads": "num_kv_heads", "head_dim": "head_dim"}
"""Head-shape options -> the :class:`libra.sim.models.ModelShape` fields they replace."""


def sim_options(default_windows: int, presets_help: str):
    """Click options every simulated end-to-end experiment takes: the simulated experiments'
    :func:`experiments.common.sim_common.common_options` (``--profile --windows --seed --out --quick
    --force --overwrite --jobs --no-progress --workload``), ``--settings`` (alias ``--setting``),
    your layout (``--dp --cp --seq-len --gbs``), the head shape (``--q-heads --kv-heads
    --head-dim``, default the model's) and the TAP options (:data:`TAP_OVERRIDES`, default each
    setting's). ``presets_help`` describes the command's presets in ``--settings``' help. The
    command function takes them as ``**opts`` for :func:`sim_setup`."""
    heads = [click.option(f"--{name.replace('_', '-')}", name, type=click.IntRange(min=1), default=None,
                          help=f"{text} (default: the model's)")
             for name, text in (("q_heads", "query heads"), ("kv_heads", "KV heads"), ("head_dim", "head width"))]

    def wrap(fn):
        fn = tap_options(*TAP_OVERRIDES, per_setting=True)(fn)
        presets = settings_option(help_text=f"comma list of the paper's presets: {presets_help}; case-insensitive, "
                                            "repeatable; ignored with --dp/--cp/--seq-len/--gbs")
        for opt in reversed([presets, layout_options(), *heads]):
            fn = opt(fn)
        return common_options(default_windows, shape=False)(fn)

    return wrap


POOL_SIZE_HELP = ("Libra's pool size P at the layout's DP (must divide it); at a swept DP d, the largest divisor of d "
                  "up to P (the paper's P = min(P, DP))")


def set_help(command: click.Command, **helps: str) -> click.Command:
    """``command`` with the help of its options (by parameter name) replaced: the shared options'
    generic texts where a command's rules differ (``pool_size``)."""
    for param in command.params:
        if param.name in helps:
            param.help = helps[param.name]
    return command


def dps_option(help_default: str):
    """``--dps``: the DP degrees a command sweeps (comma list)."""
    return click.option("--dps", type=IntListType(), default=None,
                        help=f"comma list of DP degrees to price, CP, S and GBS fixed (each must divide GBS); "
                             f"default: {help_default}")


@dataclass(frozen=True)
class SimSetup:
    """The resolved common options of a simulated end-to-end run (:func:`sim_setup`).

    Attributes:
        settings: name -> :class:`Setting` (a preset of the command or your layout, TAP options applied).
        presets: names of the settings that are the command's paper presets, unmodified.
        heads: the head-shape options given (``q_heads``, ``kv_heads``, ``head_dim``).
    """

    workload: str
    profile: object
    windows: int
    seed: int
    settings: dict
    presets: frozenset = frozenset()
    heads: dict = field(default_factory=dict)
    out: str | None = None
    force: bool = False
    quiet: bool = False

    def windows_of(self, setting: Setting) -> list:
        return cached_windows(self.workload, setting.seq_len, setting.gbs, self.windows, self.seed)

    def paper_layout(self, name: str) -> bool:
        """Whether setting ``name`` is the command's paper preset, unmodified (TAP and head shape included)."""
        return name in self.presets and not self.heads

    def paper_marks(self, name: str) -> bool:
        """Whether the paper's numbers describe setting ``name``: its paper layout on the paper's corpus."""
        return self.workload == PAPER_WORKLOAD and self.paper_layout(name)

    def config(self) -> dict:
        """The config entries every simulated end-to-end run records (``settings`` as straggler's)."""
        return {"workload": self.workload, "profile": self.profile.to_dict(), "windows": self.windows,
                "seed": self.seed, "settings": [setting_record(st) for st in self.settings.values()],
                "heads": self.heads}

    def run(self, name: str, config: dict) -> ExperimentRun:
        """The run, in ``runs/<name>/<workload-stem>-<layout-tag>-<profile>`` unless ``--out``."""
        pp = config.get("pp")  # an int, or per setting: two runs differing only in PP get their own folders
        layouts = [{**setting_record(st), **({"pp": pp.get(n) if isinstance(pp, dict) else pp} if pp else {})}
                   for n, st in self.settings.items()]
        return ExperimentRun(name, config, out_dir=self.out, force=self.force, quiet=self.quiet, layouts=layouts)


def sim_setup(opts: dict, presets: dict[str, Setting]) -> SimSetup:
    """Resolve :func:`sim_options`' values: your layout (all four of ``--dp --cp --seq-len --gbs``)
    or the command's ``presets`` named by ``--settings``, the TAP options applied, the windows
    (``--quick``: one) checked against the workload.

    Raises:
        click.UsageError: a partial layout, an unknown setting, a layout or TAP value the rules reject.
        click.BadParameter: a bad ``--profile``, ``--workload``, ``--windows`` or ``--seed``.
    """
    check_counts(opts["windows"], opts["seed"])
    profile = resolve_profile(opts["profile"])
    layout = given_layout(opts["dp"], opts["cp"], opts["seq_len"], opts["gbs"])
    try:
        picked = settings_from_options(opts["settings_"], layout)
        chosen = chosen_settings([presets[s] if isinstance(s, str) else s for s in picked],
                                 {k: opts[k] for k in TAP_OVERRIDES})
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    windows = 1 if opts["quick"] else opts["windows"]
    for st in chosen.values():
        check_workload(opts["workload"], st.seq_len, st.gbs, windows, opts["seed"])
    return SimSetup(workload=opts["workload"], profile=profile, windows=windows, seed=opts["seed"], settings=chosen,
                    presets=frozenset(s for s, st in chosen.items() if presets.get(s) == st),
                    heads={k: opts[k] for k in HEAD_FIELDS if opts[k] is not None}, out=opts["out"],
                    force=opts["force"], quiet=opts["no_progress"])


def model_shapes(names, heads: dict) -> dict[str, ModelShape]:
    """The models priced, by name, each with the given head-shape options replacing its own.

    Raises:
        click.BadParameter: an unknown model; click.UsageError: a head shape the model rules reject.
    """
    for m in names:
        if m not in MODELS:
            raise click.BadParameter(f"unknown model {m!r}; known: {', '.join(MODELS)}", param_hint="--models")
    try:
        return {m: replace(MODELS[m], **{HEAD_FIELDS[k]: v for k, v in heads.items()}) for m in names}
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def check_points(setup: SimSetup, dps: dict, pps: dict, shapes: dict) -> None:
    """Check every (setting, DP, model) point before any work, as a click error naming the point:
    the setting's own layout (its P must divide its DP, B divide S/CP, ...) and each swept DP's
    (DP must divide GBS; PP at most the model's layers), so a bad option fails at once, not mid-sweep.

    Args:
        dps: setting name -> DP degrees; pps: setting name -> PP degree; shapes: :func:`model_shapes`.
    """
    for s, st in setup.settings.items():
        for dp in dict.fromkeys((st.dp, *dps[s])):
            for m, shape in shapes.items():
                try:
                    par = point_par(st, dp, pps[s])
                    check_layout(par, st.tap if dp == st.dp else libra_tap(st, dp), shape.attention_shape)
                    E2EConfig(shape, par)
                except ValueError as exc:
                    raise click.UsageError(f"setting {s}, DP={dp}, {m}: {exc}") from exc


def check_workload(workload: str, seq_len: int, gbs: int, n_windows: int, seed: int):
    try:
        return cached_windows(workload, seq_len, gbs, n_windows, seed)
    except (ValueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint="--workload") from exc


# --------------------------------------------------------------------------------------------
# Figure 11
# --------------------------------------------------------------------------------------------


def throughput_frame(df: pd.DataFrame, stat: str) -> pd.DataFrame:
    """What the e2e figure draws and its table prints: ``stat`` (``mean``, ``median``) of
    ``tokens_per_gpu_s`` over the windows (steps) per setting, model, GPUs and method."""
    return df.groupby(["setting", "model", "gpus", "method"], as_index=False, sort=False)["tokens_per_gpu_s"].agg(stat)


def stat_label(stat: str) -> str:
    """Axis and table label of :func:`throughput_frame`'s value, e.g. ``median tokens/GPU/s``."""
    return f"{stat} tokens/GPU/s"


def throughput_table(frame: pd.DataFrame, stat: str) -> pd.DataFrame:
    """:func:`throughput_frame` with one column per method (labelled with the statistic), plus
    Libra's ratios over Ulysses and WLB-LLM where both were run."""
    table = frame.pivot_table(index=["setting", "model", "gpus"], columns="method", values="tokens_per_gpu_s",
                              sort=False)
    table = table[[m for m in METHODS if m in table.columns]]
    for base in ("ulysses", "wlb-llm"):
        if {"libra", base} <= set(table.columns):
            table[f"libra/{base}"] = table["libra"] / table[base]
    table.columns.name = stat_label(stat)
    return table


def plot_throughput(frame: pd.DataFrame, path: Path, stat: str, source: str, caption: str | None = None) -> None:
    """Bars of :func:`throughput_frame` (one value per bar, no error bar), y labelled with ``stat``."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import seaborn as sns  # noqa: PLC0415

    g = sns.catplot(data=frame, kind="bar", x="gpus", y="tokens_per_gpu_s", hue="method", col="model",
                    row="setting", hue_order=[m for m in METHODS if m in set(frame.method)], errorbar=None,
                    sharey=False, height=2.6, aspect=1.2)
    g.set_axis_labels("GPUs", stat_label(stat))
    g.figure.suptitle(f"End-to-end throughput (Figure 11; {source}; {stat_label(stat)})", y=1.02)
    from experiments.common.plotting import save_figure  # noqa: PLC0415  (Agg backend)

    save_figure(g.figure, path, caption=caption)


def finish_throughput(run: ExperimentRun, df: pd.DataFrame, stat: str, over: str, extra: dict | None = None,
                      rows: pd.DataFrame | None = None, layout: str | None = None):
    """Write the run (the PNG draws :func:`throughput_frame`) and print the same frame as a table;
    ``rows``: the rows of ``df`` the statistic is taken over (default all); ``layout``: the title's
    layout when the config does not say it (a measured run's training layout)."""
    frame = throughput_frame(df if rows is None else rows, stat)
    paths = run.finish(df, lambda _d, p: plot_throughput(frame, p, stat, str(df["source"].iloc[0]),
                                                        run_caption(run.config, layout)), extra=extra)
    click.echo(f"{stat_label(stat)} over {over}:")
    click.echo(throughput_table(frame, stat).round(3).to_string())
    return paths


@click.command("e2e")
@sim_options(default_windows=3, presets_help="256k (DP 4-16, CP 4, PP 4, GBS 128), 1m (DP 2-8, CP 16, PP 2, GBS 32)")
@click.option("--models", default=",".join(MODELS), show_default=True, help="comma-separated model names")
@dps_option("the layout's DP; the presets': 256k 4,8,16, 1m 2,4,8")
@click.option("--pp", type=click.IntRange(min=1), default=None,
              help="pipeline stages [default: the presets' (256k 4, 1m 2); 1 for your layout]")
@click.option("--measure", is_flag=True,
              help="run real training per method (small CPU configuration) instead of the model")
@click.option("--nproc", type=click.IntRange(min=2), default=4, show_default=True,
              help="--measure: processes (DP x CP = nproc)")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True, help="--measure: steps")
def e2e(models, dps, pp, measure, nproc, steps, **opts):
    """Figure 11: tokens/GPU/s of Ulysses, WLB-LLM and Libra on Qwen3 8B, 30B-A3B, 235B-A22B.

    Presets (--settings): 256k (DP 4-16, CP 4, PP 4, GBS 128, S 256K, P <= 8) and 1m (DP 2-8, CP 16,
    PP 2, GBS 32, S 1M, P <= 4); or your layout: --dp --cp --seq-len --gbs [--pp], --dps to sweep DP."""
    if measure:
        _check_measure_options(dps, pp, opts)
        _measure(opts["workload"], opts["seed"], opts["out"], opts["force"], nproc, steps, opts["no_progress"])
        return
    setup = sim_setup(opts, E2E_SETTINGS)
    shapes = model_shapes([m.strip() for m in models.split(",") if m.strip()], setup.heads)
    sweep = {s: tuple(dps) if dps else E2E_DP.get(s, (st.dp,)) for s, st in setup.settings.items()}
    pps = {s: pp or E2E_PP.get(s, 1) for s in setup.settings}
    check_points(setup, sweep, pps, shapes)
    config = {**setup.config(), "models": list(shapes), "dps": sweep, "pp": pps, "methods": METHODS,
              "linear_mfu": 0.5}
    run = setup.run("e2e", config)
    df = _simulate(run, setup, sweep, pps, shapes)
    finish_throughput(run, df, "mean", f"{setup.windows} window(s)", extra={"profile": setup.profile.name})
    paper = all(setup.paper_marks(s) and sweep[s] == E2E_DP[s] and pps[s] == E2E_PP[s] for s in setup.settings)
    _echo_ratios(throughput_table(throughput_frame(df, "mean"), "mean"), paper)
    click.echo(f"wrote {run.csv_path}")


set_help(e2e, pool_size=POOL_SIZE_HELP)


def _simulate(run: ExperimentRun, setup: SimSetup, sweep: dict, pps: dict, shapes: dict) -> pd.DataFrame:
    """Every (setting, model, DP, method) point of ``e2e``: one row per window."""
    def point(key):
        s, m, dp, method = key
        st = setup.settings[s]
        rows = []
        for w, window in enumerate(setup.windows_of(st)):
            t = price_window(method, window, st, dp, pps[s], shapes[m], setup.profile)
            rows.append({"workload": setup.workload, "setting": s, "model": m, "method": method, "dp": dp,
                         "cp": st.cp, "pp": pps[s], "pool_size": libra_tap(st, dp).pool_size if method == "libra"
                         else 1, "gpus": t.gpus, "window": w, "source": "simulated", **t.summary()})
        return rows

    keys = [(s, m, dp, method) for s in setup.settings for m in shapes for dp in sweep[s] for method in METHODS]
    return pd.DataFrame(run.map(keys, point, desc="e2e"))


def _echo_ratios(table: pd.DataFrame, paper: bool) -> None:
    """Libra's range over Ulysses and its margin over WLB-LLM at the largest scale; the paper's
    numbers only when ``paper`` (its presets, DP grid and corpus)."""
    ref = NUMBERS["fig11"]
    vu = table["libra/ulysses"]
    click.echo(f"Libra over Ulysses {vu.min():.2f}x-{vu.max():.2f}x"
               + (" (paper {:.2f}x-{:.2f}x)".format(*ref["vs_ulysses"]) if paper else ""))
    top = int(table.index.get_level_values("gpus").max())
    vw = table.xs(top, level="gpus")["libra/wlb-llm"]
    click.echo(f"Libra over WLB-LLM at {top} GPUs: mean {vw.mean():.2f}x, max {vw.max():.2f}x"
               + (f" (paper at 256 GPUs: {ref['vs_wlb_largest_mean']:.2f}x mean, {ref['vs_wlb_largest_max']:.2f}x max)"
                  if paper else ""))


def _check_measure_options(dps, pp, opts: dict) -> None:
    """``--measure`` trains with ``libra-bench train``'s own layout: the simulated layout options are errors."""
    simulated = {**{k: opts[k] for k in (*TAP_OVERRIDES, *HEAD_FIELDS, "dp", "cp", "seq_len", "gbs")},
                 "dps": dps, "pp": pp}
    given = sorted(f"--{k.replace('_', '-')}" for k, v in simulated.items() if v is not None)
    if given:
        raise click.UsageError(f"{', '.join(given)} set the simulated settings' layout; --measure "
                               "trains with libra-bench train's own layout")


def _measure(workload, seed, out, force, nproc, steps, quiet=False):
    """Measured Figure 11 on this machine: the real training loop (DP x CP = nproc, CP 2) per method.

    Ulysses and Libra run in one set of spawned gloo ranks from the same initialization and data;
    WLB-LLM has no runtime in this project (its variable-length repacking is simulated only). A
    Its default folder is under ``runs/e2e-measured/``. Each method is a point of the run's cache,
    kept as soon as its training finishes: Ctrl-C or a failed rank says how many are kept, and a
    rerun trains only the others.
    """
    from experiments.measured.train import TrainConfig, timed_steps  # noqa: PLC0415

    methods = ("ulysses", "libra")
    try:
        cfgs = [TrainConfig(nproc=nproc, cp=2, steps=steps, attention=m, workload=workload, seed=seed) for m in methods]
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    run = ExperimentRun("e2e-measured", {"workload": workload, "seed": seed, "nproc": nproc, "steps": steps,
                                         "train": [c.to_record() for c in cfgs]}, out_dir=out, force=force,
                        quiet=quiet, layouts=[{"dp": cfgs[0].dp, **cfgs[0].to_record()}])
    run.claim_folder()
    _train_points(run, methods, cfgs)
    results = [{"steps": run.cached(["method", m])} for m in methods]
    df = pd.DataFrame(measured_rows(workload, methods, cfgs, results))
    timed = timed_steps(df, "window")
    over = f"{timed['window'].nunique()} step(s)" + (" after the first" if len(timed) < len(df) else "")
    finish_throughput(run, df, "median", over, rows=timed, layout=layout_tag({"dp": cfgs[0].dp, **cfgs[0].to_record()}))
    click.echo(f"wrote {run.csv_path}")


def _train_points(run: ExperimentRun, methods, cfgs) -> None:
    """Train the methods not cached yet (one set of ranks), caching each method's step records as
    its training finishes, with progress over all their steps."""
    from experiments.common.progress import progress  # noqa: PLC0415
    from experiments.measured.train import run_training  # noqa: PLC0415
    from libra.runtime.launch import RankDeadlineError, RankFailure  # noqa: PLC0415

    todo = [i for i, m in enumerate(methods) if run.cached(["method", m]) is None]
    steps = sum(c.steps for c in cfgs)
    with progress(total=steps, desc="e2e --measure", disable=run.quiet, unit="steps") as bar:
        bar.advance(steps - sum(cfgs[i].steps for i in todo))

        def on_message(message: dict) -> None:
            if "step" in message:
                bar.advance()
            elif "done" in message:
                run.record(["method", methods[todo[message["config"]]]], message["done"]["steps"])

        try:
            if todo:
                run_training([cfgs[i] for i in todo], on_message=on_message)
        except KeyboardInterrupt:
            click.echo(f"\ninterrupted: {_kept_methods(run, methods)}", err=True)
            raise click.exceptions.Exit(130) from None
        except (RankFailure, RankDeadlineError) as exc:
            raise click.ClickException(f"{exc}; {_kept_methods(run, methods)}") from None


def _kept_methods(run: ExperimentRun, methods) -> str:
    kept = [m for m in methods if run.cached(["method", m]) is not None]
    return (f"{len(kept)} of {len(methods)} methods of e2e --measure are cached in {run.points_dir}"
            f"{' (' + ', '.join(kept) + ')' if kept else ''}; rerun the same command to resume")


def measured_rows(workload, methods, cfgs, results) -> list[dict]:
    """CSV rows of a measured run: one per method and step."""
    return [{"workload": workload, "setting": f"S={cfg.seq_len}", "model": "qwen3-small", "method": method,
             "dp": cfg.dp, "cp": cfg.cp, "pp": 1, "gpus": cfg.nproc, "window": r["step"],
             "source": "measured (CPU, gloo)", "tokens_per_gpu_s": r["tokens_per_gpu_s"], "loss": r["loss"],
             "step_ms": r["step_ms"]}
            for method, cfg, result in zip(methods, cfgs, results) for r in result["steps"]]

