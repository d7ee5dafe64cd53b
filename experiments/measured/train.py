"""`libra-bench train`: train the small Qwen3-style model with DP x CP and a chosen core attention.

Launch modes:

* ``--nproc N`` (default 4) spawns N local processes (gloo on CPU; a ``file://`` rendezvous in a
  temporary folder; ``torch.set_num_threads(1)`` per rank) -- the CPU path.
* Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set by the launcher) each process joins the launcher's
  world (NCCL when CUDA is available, else gloo) and the world size comes from ``WORLD_SIZE``: no
  ``--nproc`` is needed (torchrun's own parser would take ``--nproc`` for its ``--nproc-per-node``
  anyway); a given ``--nproc`` that differs is an error before any process group starts.

Bad input (a length file that does not parse, a layout the TAP rules reject, an output folder
holding a different run) is a one-line ``Error:`` before any rank starts. A length file too short
for the run is cycled with a one-line warning saying how many times.

``--attention`` picks ``reference`` (single process, CP = 1), ``ulysses`` or ``libra`` (VRSP sampler
+ TAP plans + ``libra_attention``); ``--planner`` the TAP planner of ``libra`` attention (the paper's
``libra``, ``libra-kt`` or ``libra-adaptive``, priced with ``--profile``; with ``--measure-speeds``
``libra-adaptive`` times every rank's attention before step 0 and plans with those speeds, which
``run.json`` records as ``device_speeds``). Results go through :class:`experiments.common.runner.ExperimentRun`:
``train.csv`` (one row per step: loss, step time, tokens/GPU/s), ``train.png`` (loss curve and the
medians of :func:`summary`, the same table ``train`` prints) and ``run.json`` (with ``ranks``: every
rank's global and local rank, node, host, DP/CP/pool coordinates and group members, see
:mod:`experiments.measured.training.ranks`) under ``runs/train/<workload>-<layout-tag>/`` or ``--out``; ``--overwrite`` replaces a folder's
results of a different config.

Progress and interruption: every step's line is printed as the step finishes (with a progress line
on stderr at least every 10 s in a log, :mod:`experiments.common.progress`), and rank 0 checkpoints the
model and optimizer after every step (:mod:`experiments.measured.training.checkpoint`). Ctrl-C keeps the
finished steps and says how to resume: rerunning the same command trains the remaining steps from
the checkpoint (same data, plans and losses as an uninterrupted run); ``--force`` starts over. A
finished run drops its checkpoint, so a rerun measures again. A rank that fails or dies ends the run
within seconds with one line naming it (``Error: training ranks: rank 1 exited (code -9)``);
``--timeout`` bounds how long a rank waits on a peer.

The TAP options (``--pool-size``, ``--block-size``, ``--head-split``, ``--tau``,
``--pipeline-chunks``) come from :func:`experiments.common.options.tap_options`, with a training
run's defaults (:func:`~experiments.measured.training.config.run_tap`: P = DP, the CPU-sized B and M
of :data:`~experiments.measured.training.config.CPU_TAP_DEFAULTS`); the command builds the run's
TapConfig from them, which :class:`TrainConfig` holds and validates, and ``run.json`` records its
fields flat with the rest of the TrainConfig (:meth:`TrainConfig.to_record`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import click
import pandas as pd

from experiments.common.options import (
    DtypeType,
    SizeType,
    WorkloadType,
    apply_quick,
    no_progress_option,
    overwrite_option,
    quick_option,
    tap_options,
)
from experiments.measured.training.checkpoint import CHECKPOINT_NAME
from experiments.measured.training.config import CPU_TAP_DEFAULTS, TrainConfig, run_tap, sample_lengths
from experiments.measured.training.launch import run_training
from experiments.measured.training.loop import ATTENTION, DTYPES, PLANNERS
from experiments.measured.training.model import ModelConfig
from experiments.measured.training.ranks import nodes_of
from libra.data.loaders import SUFFIX_LIST

__all__ = ["TrainConfig", "draw", "run_tap", "run_training", "sample_lengths", "summary", "summary_table", "train"]


# --------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------


STEP_MS = "median step time (ms)"
TOKENS = "median tokens/GPU/s"
SUMMARY_COLUMNS = ("attention", "steps", STEP_MS, TOKENS)
"""The columns of :func:`summary`: the one statistic (the median over steps), named with its unit."""


def timed_steps(df: pd.DataFrame, step: str = "step") -> pd.DataFrame:
    """The rows timing statistics are taken over: every step after the first when there is one
    (step 0 carries the first plan, the process's one-time costs and the allocator's growth: 619 ms
    against 54 ms for step 1 in a ``--quick`` run, which a median of two steps would average in),
    else step 0 alone."""
    later = df[step] > 0
    return df[later] if later.any() else df


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per attention: timed steps (:func:`timed_steps`), median step time (ms) and median
    tokens/GPU/s over them. The printed table and the PNG's bars are both this frame."""
    g = timed_steps(df).groupby("attention", sort=False)
    out = pd.DataFrame({"steps": g["step"].count(), STEP_MS: g["step_ms"].median(),
                        TOKENS: g["tokens_per_gpu_s"].median()}).reset_index()
    return out[list(SUMMARY_COLUMNS)]


def summary_table(df: pd.DataFrame) -> str:
    """:func:`summary` as the text ``train`` prints, with the steps its medians are over."""
    table = summary(df).to_string(index=False, formatters={STEP_MS: "{:.1f}".format, TOKENS: "{:.0f}".format})
    first = "step 0 (first plan, warm-up) not timed" if len(timed_steps(df)) < len(df) else "one step only: step 0"
    return f"{table}\n(medians over the timed steps; {first})"


def draw(df: pd.DataFrame):
    """The figure of ``train.png``: the loss per step, then :func:`summary`'s two medians as bars
    (bar height = the frame's value, axis label = its column name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    stats = summary(df)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    sns.lineplot(data=df, x="step", y="loss", hue="attention", marker="o", ax=axes[0])
    axes[0].set_title("training loss")
    for ax, col in zip(axes[1:], (STEP_MS, TOKENS)):
        ax.bar(stats["attention"], stats[col])
        ax.set_ylabel(col)
        ax.set_title(f"{col}, {int(stats['steps'].max())} step(s)")
    fig.tight_layout()
    return fig


def _plot(df: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    fig = draw(df)
    from experiments.common.plotting import save_figure  # noqa: PLC0415  (Agg backend)

    save_figure(fig, path, caption=caption)


QUICK = {"steps": 2, "seq_len": 256, "layers": 1, "hidden": 32}
"""``--quick``'s values (each unless given)."""


@click.command("train", context_settings={"default_map": dict(CPU_TAP_DEFAULTS)})
@click.option("--nproc", type=click.IntRange(min=1), default=None, show_default="4; under torchrun WORLD_SIZE",
              help="processes = DP x CP (under torchrun leave it out: the world size is WORLD_SIZE)")
@click.option("--cp", type=click.IntRange(min=1), default=2, show_default=True, help="context-parallel degree CP")
@click.option("--attention", type=click.Choice(ATTENTION), default="libra", show_default=True,
              help="core-attention method (reference: unsharded, one process per sequence)")
@click.option("--planner", type=click.Choice(PLANNERS), default=PLANNERS[0], show_default=True,
              help="TAP planner of Libra attention: the paper's Alg. 2 (libra), kernel-time weights (libra-kt) "
                   "or the real-corpus planner (libra-adaptive)")
@click.option("--profile", default=None,
              help="hardware profile (name or .json, e.g. from `libra-bench calibrate`) libra-kt weights tiles "
                   "with and libra-adaptive prices with [the planner's default]")
@click.option("--measure-speeds", is_flag=True,
              help="libra-adaptive: time every rank's attention before step 0 and give slower GPUs less work")
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True, help="optimizer steps")
@click.option("--seq-len", type=SizeType(), default=1024, show_default=True,
              help="tokens per packed sequence S (accepts 4K)")
@click.option("--gbs", type=click.IntRange(min=1), default=None, help="packed sequences per step [2 x DP]")
@tap_options("pool_size", per_setting=True)
@tap_options("block_size", "head_split", "tau", "pipeline_chunks")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True, help="transformer layers")
@click.option("--hidden", type=click.IntRange(min=1), default=64, show_default=True, help="hidden size")
@click.option("--experts", type=click.IntRange(min=0), default=0, show_default=True, help="MoE experts (0 = dense)")
@click.option("--dtype", type=DtypeType(DTYPES), default="float32", show_default=True,
              help="float32, float64 or bfloat16 (short names such as bf16 accepted)")
@click.option("--lr", type=click.FloatRange(min=0.0, min_open=True), default=3e-3, show_default=True,
              help="AdamW learning rate")
@click.option("--workload", type=WorkloadType(as_source=False), default="libra-prod", show_default=True,
              help=f"length preset or a length file ({SUFFIX_LIST})")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="seed of the length stream and the model")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="output folder (default runs/train/<workload>-<layout>/)")
@quick_option("smoke run: 2 steps, S=256, 1 layer, hidden 32 (each unless given)")
@click.option("--timeout", type=click.FloatRange(min=0.0, min_open=True), default=TrainConfig.timeout_s,
              show_default=True, help="seconds a rank waits on a peer before failing (the whole run: "
                                      "timeout x (steps + 2) + 60)")
@click.option("--force", is_flag=True, help="start over instead of resuming an interrupted run's checkpoint "
                                            "(a finished run always trains again)")
@no_progress_option()
@overwrite_option()
@click.pass_context
def train(ctx, nproc, cp, attention, planner, profile, measure_speeds, steps, seq_len, gbs, pool_size, block_size,
          head_split, tau, pipeline_chunks, layers, hidden, experts, dtype, lr, workload, seed, out, quick, timeout,
          force):
    """Train the small Qwen3-style model with DP x CP; log loss and tokens/GPU/s per step."""
    if quick:
        q = apply_quick(ctx, {"steps": steps, "seq_len": seq_len, "layers": layers, "hidden": hidden}, QUICK)
        steps, seq_len, layers, hidden = q["steps"], q["seq_len"], q["layers"], q["hidden"]
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # started by torchrun
    nproc = _world_size(nproc, launched)
    try:
        model = ModelConfig(layers=layers, hidden=hidden, num_experts=experts)
        tap = run_tap(nproc, cp, pool_size=pool_size, block_size=block_size, head_split=head_split, tau=tau,
                      pipeline_chunks=pipeline_chunks)
        cfg = TrainConfig(nproc=nproc, cp=cp, attention=attention, steps=steps, seq_len=seq_len, gbs=gbs, tap=tap,
                          workload=workload, model=model, dtype=dtype, lr=lr, seed=seed, planner=planner,
                          profile=profile, measure_speeds=measure_speeds, timeout_s=timeout)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    writer = not launched or os.environ["RANK"] == "0"
    run = _prepare_run(cfg, out, force) if writer else None  # refuses a clobber before any rank starts
    result = _train_with_progress(cfg, run, launched)
    if result is None:  # a torchrun rank other than 0
        return
    source = "torchrun" if launched else "spawn-gloo" if nproc > 1 else "single-process"
    _write(run, result, cfg, source)
    with contextlib.suppress(OSError):  # finished: a rerun measures again
        os.unlink(run.points_dir / CHECKPOINT_NAME)
        os.rmdir(run.points_dir)
        os.rmdir(run.points_dir.parent)


def _train_with_progress(cfg: TrainConfig, run, launched: bool) -> dict | None:
    """Train (spawned ranks, this process, or this torchrun rank), printing every step as it
    finishes; Ctrl-C or a failed rank says how many steps are kept and how to resume."""
    from experiments.common.progress import progress  # noqa: PLC0415
    from experiments.measured.training.checkpoint import load_checkpoint  # noqa: PLC0415
    from experiments.measured.training.launch import _torchrun, run_training  # noqa: PLC0415
    from libra.runtime.launch import RankDeadlineError, RankFailure  # noqa: PLC0415

    checkpoint = run.points_dir / CHECKPOINT_NAME if run is not None else None
    kept = (load_checkpoint(checkpoint) or {}).get("steps", []) if checkpoint is not None else []
    if kept:
        click.echo(f"resuming after step {len(kept) - 1}: {len(kept)} of {cfg.steps} steps kept from an interrupted "
                   f"run ({checkpoint}; --force starts over)")
        for r in kept:
            click.echo(_step_line(r))
    done = [len(kept)]
    quiet = run is None or run.quiet
    try:
        with progress(total=cfg.steps, desc="train", disable=quiet, unit="steps") as bar:
            bar.advance(len(kept))

            def on_message(message: dict) -> None:
                if "step" in message:
                    done[0] += 1
                    click.echo(_step_line(message["step"]))
                    bar.advance()

            if launched:
                return _torchrun(cfg, on_message if run is not None else None, checkpoint)
            return run_training(cfg, on_message=on_message, checkpoint=checkpoint)[0]
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted: {_kept_text(done[0], cfg, checkpoint)}", err=True)
        raise click.exceptions.Exit(130) from None
    except (RankFailure, RankDeadlineError) as exc:
        raise click.ClickException(f"{exc}; {_kept_text(done[0], cfg, checkpoint)}") from None


def _kept_text(reported: int, cfg: TrainConfig, checkpoint) -> str:
    """What an interrupted run keeps. The checkpoint is the truth: the ranks have been stopped by
    now, and rank 0 may have saved a step whose message never reached this process."""
    from experiments.measured.training.checkpoint import load_checkpoint  # noqa: PLC0415

    saved = (load_checkpoint(checkpoint) or {}).get("steps") if checkpoint is not None else None
    done = reported if saved is None else len(saved)
    if not done or checkpoint is None:
        return "no step finished; rerun the same command to start again"
    return (f"{done} of {cfg.steps} steps of train are kept in {checkpoint}; rerun the same command to resume "
            f"from step {done}")


def _step_line(r: dict) -> str:
    return f"step {r['step']}: loss {r['loss']:.4f}  {r['step_ms']:.0f} ms  {r['tokens_per_gpu_s']:.0f} tokens/GPU/s"


def _write(run, result: dict, cfg: TrainConfig, source: str) -> None:
    """The step CSV, PNG and run.json (with every rank's place: ``ranks``, ``nodes``); the printed
    steps and the :func:`summary` table."""
    ranks = result["ranks"]
    df = pd.DataFrame(result["steps"])
    df.insert(0, "attention", cfg.attention)
    df["dp"], df["cp"], df["nproc"], df["launch"] = cfg.dp, cfg.cp, cfg.nproc, source
    df["nodes"] = nodes_of(ranks)
    speeds = {"device_speeds": result["device_speeds"]} if "device_speeds" in result else {}
    from experiments.common.runner import layout_tag  # noqa: PLC0415
    from experiments.common.runs_table import run_caption  # noqa: PLC0415

    caption = run_caption(run.config, layout_tag({"dp": cfg.dp, **cfg.to_record()}))
    paths = run.finish(df, lambda d, p: _plot(d, p, caption), extra={"world_size": cfg.nproc, "nodes": nodes_of(ranks), "ranks": ranks, **speeds})
    if speeds:
        click.echo("measured attention speed per rank: " + " ".join(f"{v:.3f}" for v in speeds["device_speeds"]))
    click.echo(summary_table(df))
    click.echo(f"{cfg.nproc} rank(s) on {nodes_of(ranks)} node(s); wrote {paths['csv']}")


def _world_size(nproc: int | None, launched: bool) -> int:
    """Processes of the run: ``WORLD_SIZE`` under torchrun (a differing ``--nproc`` is an error),
    else ``--nproc`` (default 4)."""
    if not launched:
        return 4 if nproc is None else nproc
    try:
        world = int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise click.UsageError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None
    if nproc is not None and nproc != world:
        raise click.UsageError(f"--nproc {nproc} differs from the torchrun world size {world} (WORLD_SIZE); "
                               "under torchrun leave --nproc out")
    return world


def _prepare_run(cfg: TrainConfig, out, force: bool):
    """The run's :class:`ExperimentRun` (folder checked, input hashed) and the repeat warning."""
    from experiments.common.runner import ExperimentRun  # noqa: PLC0415
    from libra.data.source import resolve_workload  # noqa: PLC0415
    from libra.data.windows import warn_if_repeated  # noqa: PLC0415

    warn_if_repeated(resolve_workload(cfg.workload), (cfg.steps + 1) * cfg.gbs * cfg.seq_len,
                     f"{cfg.steps} step(s) of GBS {cfg.gbs} x S {cfg.seq_len} tokens")
    layout = {"dp": cfg.dp, **cfg.to_record()}
    run = ExperimentRun("train", cfg.to_record(), out_dir=out, force=force, layouts=[layout])
    run.claim_folder()
    return run


next(p for p in train.params if p.name == "pool_size").show_default = "DP"  # run_tap resolves None to DP
