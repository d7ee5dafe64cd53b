"""`libra-bench plan-cost`: how long Libra's CPU planning takes, and what the plans it makes buy.

Libra sec. 5 reports, on one CPU core, workload estimation + VRSP at 2.2 ms (256K, GBS 128) and
0.6 ms (1M, GBS 32) per optimizer step, and TAP placement at 2.4 ms (256K) and 10.7 ms (1M) per
microbatch per rank. This command measures every stage between sequence lengths and the first
kernel launch on ``libra-prod`` windows in the paper's sec. 6.3 settings (``--settings 256k,1m``;
case-insensitive, ``--setting`` repeatable) or on a layout of your own (``--dp --cp --seq-len --gbs``,
all four; :func:`experiments.common.sim_common.custom_setting`), with the head shape of ``--q-heads
--kv-heads --head-dim`` (default the paper's 32 / 4 / 128):

* ``vrsp``: :func:`libra.workload.packed_workloads` + :func:`libra.vrsp.vrsp` +
  :func:`libra.vrsp.microbatch_groups` for one GBS window (once per optimizer step);
* ``tap``: :func:`libra.tap.planner.plan_pool` for one pool of one microbatch group (SH-tiles,
  Algorithm 2 placement and exchange planning), over every VRSP pool of the window; the rows
  ``tap.tiles``, ``tap.placement`` and ``tap.exchange`` time its three parts separately;
  ``tap@<method>`` times another TAP planner's per-pool call (``--methods``), and
  ``tap@<method>.<part>`` the parts a planner names (:func:`method_parts`; ``libra-adaptive``:
  ``candidates``, building every candidate plan, ``pricing``, choosing among them,
  ``rebalance``, re-placing the chosen one for its exposed communication, and ``depth``, pricing
  the paper's plan at the layout's M, the guard of its deeper Pipeliner);
* ``compile``: :func:`libra.runtime.program.compile_worker` for one worker -- the planner-side call
  (run by :class:`~libra.runtime.async_planner.AsyncPlanner` with ``compile_for``) whose program
  ``forward``/``backward`` execute with no further index construction -- over ``--compile-workers``
  workers spread over the pool ranks of the window's first pool;
* ``prepare``: everything on the step's path between ``AsyncPlanner.get()`` returning and the first
  kernel launch, for the same programs: ``pickle.loads`` of the program (what ``get()`` does in
  process mode; ``prepare.unpickle``), :func:`libra.runtime.attention.prepare` on the program
  (runner built, no compilation; ``prepare.runner``) and the pool's digest agreement
  (:func:`libra.runtime.agreement.check_plan_agreement`; ``prepare.digest``), timed on a 1-process
  gloo group (CPU device). ``prepare`` itself is one timed call of all three.

JIT compilation (every :data:`WARMUP`: the compiled TAP kernels' and the cost model's) runs once per
process before any timing and is reported separately (``run.json`` ``jit_warmup_ms``), never in a
stage. The placer that ran (:func:`libra.tap.placement.default_placer`) and the cost model's
implementation that priced ``libra-adaptive``'s candidates (:func:`libra.sim.cost.cost_impl`) are
printed and recorded in ``run.json``.

Each timing sample is one call (``time.perf_counter``); the CSV gives per (setting, stage) the
median, the inter-quartile range, the sample count and the paper's number; the printout puts each
median next to its target (goals for this 2-core machine class). The paper's numbers and
the targets belong to the paper's runs only (``libra-prod``, a paper layout with its TAP layout, the
paper's head shape; :func:`experiments.common.paper.paper_settings`): any other run has ``paper_ms``
NaN and prints no targets. Runs write to ``runs/plan-cost/<workload>-<layout>/``
unless ``--out`` says otherwise (:func:`experiments.common.runner.default_out_dir`). Besides timing, the
command plans every window with ``ulysses``, ``wlb-llm``, ``libra``, ``distca-paper`` and ``distca`` and reports per
method the max/mean worker FLOPs (over the PP stage at the worst GA index, and inside the worst
pool, next to the floor the heaviest indivisible tile sets) and the forward bytes moved per
optimizer step (``plan-cost-quality.csv`` one row per window and method; ``run.json`` aggregated).
Timings on a shared machine are noisy: compare medians, and read the IQR. ``--pool-size``,
``--block-size``, ``--head-split``, ``--tau`` and ``--chunks`` (``--pipeline-chunks``) override the
settings' TAP layout.
"""

from __future__ import annotations

import contextlib
import gc
import pickle
import time
from dataclasses import dataclass
from functools import partial

import click
import numpy as np
import pandas as pd

from baselines.libra_planners import vrsp_groups
from baselines.registry import get_planner, pool_workers
from experiments.common.options import (
    given_layout,
    layout_options,
    no_progress_option,
    overwrite_option,
    quick_option,
    settings_option,
    tap_options,
)
from experiments.common.paper import NUMBERS, paper_settings
from experiments.common.paper import label as paper_label
from experiments.common.runner import ExperimentRun
from experiments.common.runs_table import run_caption
from experiments.common.sim_common import (
    Setting,
    chosen_settings,
    make_shape,
    setting_record,
    settings_from_options,
)
from libra import jit as jit_modules
from libra.config import check_layout
from libra.data.windows import gbs_windows
from libra.plan import SequenceLayout, pool_index
from libra.runtime.program import compile_worker
from libra.sim import cost as _cost
from libra.tap import exchange as _exchange
from libra.tap import placement as _placement
from libra.tap import tiles as _tiles
from libra.tap.exchange import build_transfers
from libra.tap.placement import PlacementPolicy, place_tiles
from libra.tap.planner import plan_pool
from libra.tap.tiles import make_tiles
from libra.vrsp import vrsp_schedule
from libra.workload import AttentionShape, packed_workloads

SHAPE = AttentionShape(num_q_heads=32, num_kv_heads=4, head_dim=128)
"""Head geometry of the paper's planning-cost setting (32 query heads, 4 KV heads, d = 128); the
default of ``--q-heads --kv-heads --head-dim``."""


@dataclass(frozen=True)
class PlanCostConfig:
    """What a ``plan-cost`` run times and plans, besides its settings.

    Attributes:
        workload: length preset name or length file.
        seed: seed of the sample stream.
        windows: GBS windows per setting.
        repeats: timing samples per call.
        compile_workers: workers of the first pool per window whose compile / prepare is timed.
        methods: TAP planners whose per-pool planning is timed, ``libra`` first
            (:func:`parse_tap_methods`).
        shape: the head shape planned for.

    Raises:
        ValueError: ``windows``, ``repeats`` or ``compile_workers`` below 1, or ``methods`` not
            starting with ``libra``.
    """

    workload: str = "libra-prod"
    seed: int = 0
    windows: int = 8
    repeats: int = 5
    compile_workers: int = 4
    methods: tuple[str, ...] = ("libra",)
    shape: AttentionShape = SHAPE

    def __post_init__(self):
        for name in ("windows", "repeats", "compile_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.methods or self.methods[0] != "libra":
            raise ValueError(f"the timed TAP methods must start with 'libra', got {list(self.methods)}")

PAPER_MS = {name: NUMBERS["sec5"][paper_label(name)] for name in ("256k", "1m")}  # Libra sec. 5 (experiments.common.paper)
"""Libra sec. 5's timings (ms, one CPU core) of the paper's settings (:data:`experiments.common.sim_common.SETTINGS`)."""
QUALITY_METHODS = ("ulysses", "wlb-llm", "libra", "distca-paper", "distca")
STAGES = ("vrsp", "tap", "compile", "prepare")
"""Main stages (one CSV row each per setting); ``tap.*`` and ``prepare.*`` rows are their parts."""
TARGETS_MS = {"256k": {"vrsp": 2.2, "tap": 1.2, "compile": 50.0, "prepare": 5.0},
              "1m": {"vrsp": 0.6, "tap": 5.4, "compile": 50.0, "prepare": 5.0}}
"""Targets (medians on a 2-core machine) of the paper's settings only: TAP at half the
paper's time, compile per worker, prepare on the step's path (CPU), VRSP at or below the paper's."""
TAP_RATIO_TARGETS = {"libra-adaptive": 2.0}
"""Targets of another planner's per-pool TAP time as a multiple of ``libra``'s, same placer,
on any run: printed next to the measured ratio."""
WARMUP = {"libra.tap.placement": _placement.warmup, "libra.tap.tiles": _tiles.warmup,
          "libra.tap.exchange": _exchange.warmup, "libra.plan.layout": partial(jit_modules.warmup, "layout"),
          "libra.sim.cost": partial(jit_modules.warmup, "cost")}
"""The compiled kernels' ``warmup()`` (JIT compilation: TAP's and the cost model's, which
``libra-adaptive`` prices candidates with), run before any timing."""


def parse_tap_methods(text: str) -> tuple[str, ...]:
    """``--methods``: registered TAP planners (those with a per-pool planner), ``libra`` first.

    Raises:
        click.BadParameter: an unknown name or a planner that does not plan pools with TAP.
    """
    from baselines.libra_planners import TapPlanner  # noqa: PLC0415
    from baselines.registry import planner_class  # noqa: PLC0415

    names = [m.strip() for m in text.split(",") if m.strip()]
    for m in names:
        try:
            cls = planner_class(m)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--methods") from None
        if not issubclass(cls, TapPlanner):
            raise click.BadParameter(f"{m!r} does not plan pools with TAP", param_hint="--methods")
    return ("libra",) + tuple(dict.fromkeys(m for m in names if m != "libra"))


def placer_name() -> str:
    """The TAP placer ``place_tiles`` runs in this process (``"python"`` without a compiled one)."""
    return _placement.default_placer()


def jit_warmup() -> dict[str, float]:
    """Run every :data:`WARMUP`; ms spent per module (the first call in a process compiles, later
    ones cost ~0)."""
    out = {}
    for name, fn in WARMUP.items():
        t0 = time.perf_counter()
        fn()
        out[name] = (time.perf_counter() - t0) * 1e3
    return out


@contextlib.contextmanager
def one_process_group():
    """A 1-process gloo group for the ``prepare`` timings (this process's world when it already
    has a 1-rank one; created, and destroyed on exit, otherwise).

    Raises:
        click.UsageError: this process is already part of a larger world.
    """
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise click.UsageError("plan-cost times prepare on a 1-process group; run it outside a larger world")
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def sample_ranks(n_workers: int, n: int) -> list[int]:
    """About ``n`` pool ranks spread evenly over ``0 .. n_workers - 1`` (the middle one for ``n = 1``,
    every rank for ``n >= n_workers``)."""
    if n >= n_workers:
        return list(range(n_workers))
    return sorted({int(round(x)) for x in np.linspace(0, n_workers - 1, n + 2)[1:-1]})


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


def step_path_fns(program, world) -> dict:
    """The ``prepare`` stage and its parts for one compiled ``program``, as zero-argument calls.

    ``world`` is a 1-process group: the runner gets a PoolGroup naming the program's pool (no
    collective is issued while building it) and the digest agreement runs on ``world``.
    """
    from libra.runtime.agreement import check_plan_agreement  # noqa: PLC0415
    from libra.runtime.attention import prepare  # noqa: PLC0415
    from libra.runtime.groups import PoolGroup  # noqa: PLC0415

    blob = pickle.dumps(program, protocol=pickle.HIGHEST_PROTOCOL)
    ranks = tuple(range(len(program.workers)))
    solo = PoolGroup(world, (program.worker,), (0,), program.worker, 60.0)

    def runner(prog):
        pool = PoolGroup(world, tuple(prog.workers), ranks, prog.worker, 60.0)
        return prepare(prog, pool, verify_plan=False, device="cpu")

    def step_path():
        prog = pickle.loads(blob)
        attn = runner(prog)
        check_plan_agreement(prog.digest, solo)
        return attn

    return {"prepare": step_path, "prepare.unpickle": partial(pickle.loads, blob),
            "prepare.runner": partial(runner, program),
            "prepare.digest": partial(check_plan_agreement, program.digest, solo)}


def method_parts(planners: dict, k: int, seqs, workers) -> dict:
    """``{"tap@<method>.<part>": call}`` for every per-pool planner of ``planners`` that names the
    parts of its call (a ``stages(k, sequences, workers)`` method, e.g. ``libra-adaptive``'s
    candidates, their pricing and the chosen plan's rebalancing), each part timed alone."""
    return {f"{tap_stage(m)}.{part}": call for m, fn in planners.items() if hasattr(fn, "stages")
            for part, call in fn.stages(k, seqs, workers).items()}


def tap_stage(method: str) -> str:
    """The stage name of ``method``'s per-pool planning: ``tap`` for ``libra`` (the paper's TAP),
    ``tap@<method>`` for another TAP planner timed beside it (``--methods``)."""
    return "tap" if method == "libra" else f"tap@{method}"


def pool_planners(setting: Setting, methods, shape: AttentionShape = SHAPE) -> dict:
    """``{method: plan_one}``: each TAP planner's per-pool call
    (:meth:`baselines.libra_planners.TapPlanner.pool_planner`) for ``setting``'s layout."""
    out = {}
    for m in methods:
        planner = get_planner(m, tap=setting.tap)
        out[m] = planner.pool_planner(setting.par(), shape)[0]
    return out


def timing_rows(setting: Setting, index: int, cfg: PlanCostConfig, world=None) -> list[dict]:
    """Timing samples of VRSP, of TAP per pool (per method of ``cfg.methods``), and of compile /
    prepare for sampled workers of the first pool on window ``index`` (``world``: a 1-process
    group; None skips ``prepare``), for heads ``cfg.shape``."""
    workload, seed, repeats, shape = cfg.workload, cfg.seed, cfg.repeats, cfg.shape
    compile_workers, methods = cfg.compile_workers, cfg.methods
    warm = jit_warmup()  # JIT compilation never lands in a sample
    window = _window(setting, workload, index, seed)
    lengths = [s.sample_lengths for s in window]
    par, tap = setting.par(), setting.tap
    checked = check_layout(par, tap, shape)  # once, as a planner's plan_window does; plan_pool reuses it

    def vrsp_step():
        return vrsp_schedule(packed_workloads(lengths), tap.pool_size, par.dp)

    rows = [{"setting": setting.name, "window": index, "stage": f"warmup:{name}", "ms": ms}
            for name, ms in warm.items()]
    rows += [{"setting": setting.name, "window": index, "stage": "vrsp", "ms": ms}
             for ms in _time_ms(vrsp_step, repeats)]
    groups, _ = vrsp_groups(lengths, par, tap.pool_size)
    P = tap.pool_size
    others = {m: fn for m, fn in pool_planners(setting, methods, shape).items() if m != "libra"}
    for g in range(par.ga):
        for k in range(par.dp // P):
            p0 = k * P
            seqs = [SequenceLayout.contiguous(int(groups[g, p0 + j]), p0 + j, lengths[int(groups[g, p0 + j])], par.cp)
                    for j in range(P)]
            workers = pool_workers(p0, P, par.cp)
            pool = pool_index(seqs)  # the parts run as plan_pool runs them: one index, make_tiles' tiles
            tiles = make_tiles(seqs, tap.block_size, tap.head_split, shape, index=pool)
            policy = PlacementPolicy(comm_aware=tap.comm_aware)
            placed, _ = place_tiles(tiles, seqs, workers, shape, tap.tau, policy=policy)
            parts = {  # partial binds this pool's arguments now (timed right below)
                "tap": partial(plan_pool, k, seqs, workers, tap, shape, checked=checked),
                "tap.tiles": partial(make_tiles, seqs, tap.block_size, tap.head_split, shape, index=pool),
                "tap.placement": partial(place_tiles, tiles, seqs, workers, shape, tap.tau, policy=policy),
                "tap.exchange": partial(build_transfers, seqs, placed, shape, index=pool),
                **{tap_stage(m): partial(fn, k, seqs, workers) for m, fn in others.items()},
                **method_parts(others, k, seqs, workers),
            }
            for stage, fn in parts.items():
                rows += [{"setting": setting.name, "window": index, "stage": stage, "ms": ms}
                         for ms in _time_ms(fn, repeats)]
            if g == 0 and k == 0:
                first_pool = parts["tap"]()
    digest = first_pool.digest()  # what a Plan-derived program carries; not part of compile
    for r in sample_ranks(len(first_pool.workers), compile_workers):
        w = first_pool.workers[r]
        fn = partial(compile_worker, first_pool, shape, w, tap.pipeline_chunks, digest=digest)
        rows += [{"setting": setting.name, "window": index, "stage": "compile", "ms": ms, "worker": w}
                 for ms in _time_ms(fn, repeats)]
        if world is not None:
            for stage, call in step_path_fns(fn(), world).items():
                rows += [{"setting": setting.name, "window": index, "stage": stage, "ms": ms, "worker": w}
                         for ms in _time_ms(call, repeats)]
    return rows


def quality_rows(setting: Setting, workload: str, index: int, seed: int, method: str,
                 shape: AttentionShape = SHAPE) -> list[dict]:
    """Balance and traffic of ``method``'s plans for window ``index``.

    Returns one row: ``stage_max_over_mean`` (max over GA indices of max worker FLOPs / mean worker
    FLOPs over the whole PP stage), ``pool_max_over_mean`` (worst pool's max/mean), forward bytes
    moved per optimizer step (total and per kind) and the number of fallback tiles.
    """
    window = _window(setting, workload, index, seed)
    plans = get_planner(method, tap=setting.tap).plan_window(window, setting.par(), shape)
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


def summarize(samples: pd.DataFrame, paper: set[str] | None = None) -> pd.DataFrame:
    """Per (setting, stage): median, IQR, count of timing samples and the paper's number (JIT
    warmup rows excluded: see :func:`warmups`).

    ``paper``: the settings whose ``paper_ms`` is the paper's (:data:`PAPER_MS`; None: every setting
    it names); the others' is NaN (another layout, head shape or workload is not the paper's run)."""
    paper = set(PAPER_MS) if paper is None else set(paper)
    out = []
    timed = samples[~samples["stage"].str.startswith("warmup:")]
    for (setting, stage), g in timed.groupby(["setting", "stage"], sort=False):
        q1, med, q3 = np.percentile(g["ms"], [25, 50, 75])
        ms = PAPER_MS.get(setting, {}).get(stage, float("nan")) if setting in paper else float("nan")
        out.append({"setting": setting, "stage": stage, "median_ms": round(float(med), 4),
                    "iqr_ms": round(float(q3 - q1), 4), "repeats": len(g), "paper_ms": ms})
    return pd.DataFrame(out)


def warmups(samples: pd.DataFrame) -> dict[str, float]:
    """JIT warmup ms per module: the largest over points (the first call in a process compiles)."""
    w = samples[samples["stage"].str.startswith("warmup:")]
    return {stage.split(":", 1)[1]: round(float(g["ms"].max()), 3) for stage, g in w.groupby("stage")}


def summarize_quality(quality: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, method) over windows: mean stage max/mean, worst pool, mean bytes, pool counts."""
    return quality.groupby(["setting", "method"], sort=False).agg(
        windows=("window", "count"), stage_max_over_mean=("stage_max_over_mean", "mean"),
        stage_max_over_mean_worst=("stage_max_over_mean", "max"), pool_max_over_mean=("pool_max_over_mean", "max"),
        worst_pool_tile_bound=("worst_pool_tile_bound", "max"), bytes_total=("bytes_total", "mean"),
        pools=("pools", "sum"), pools_over_1_plus_tau=("pools_over_1_plus_tau", "sum"),
        pools_over_with_tile_above_target=("pools_over_with_tile_above_target", "sum"),
        fallback_tiles=("fallback_tiles", "sum")).reset_index()


def plot(df: pd.DataFrame, path, paper: set[str] | None = None, caption: str | None = None) -> None:
    """Median per main stage and setting on a log axis, next to the paper's number and the target
    where the setting has them (``paper``: as in :func:`summarize`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    paper = set(PAPER_MS) if paper is None else set(paper)
    main = df[df["stage"].isin(STAGES)].copy()
    targets = [TARGETS_MS[s].get(st, np.nan) if s in paper and s in TARGETS_MS else np.nan
               for s, st in zip(main["setting"], main["stage"])]
    long = pd.concat([main.assign(source="measured", ms=main["median_ms"]),
                      main.assign(source="paper", ms=main["paper_ms"]),
                      main.assign(source="target", ms=targets)], ignore_index=True)
    long = long[np.isfinite(long["ms"].astype(float))]
    long["what"] = long["setting"] + " " + long["stage"].map(
        {"vrsp": "VRSP/step", "tap": "TAP/pool", "compile": "compile/worker", "prepare": "prepare"})
    sns.set_theme(style="whitegrid")
    fig, ax = plt.subplots(figsize=(9, 4))
    sns.barplot(data=long, x="what", y="ms", hue="source", ax=ax)
    ax.set_xlabel("")
    ax.set_yscale("log")                  # VRSP (sub-ms) and compile (tens of ms) on one axis
    ax.tick_params(axis="x", labelsize=8, labelrotation=20)
    ax.set_ylabel("planning time (ms, median, log)")
    ax.set_title("Libra planning cost" + (" (libra-prod; paper: Libra sec. 5)" if paper & set(main["setting"])
                                          else " (not the paper's setting: no paper numbers or targets)"))
    from experiments.common.plotting import save_figure  # noqa: PLC0415  (Agg backend)

    save_figure(fig, path, caption=caption)


def plan_cost_settings(settings_: str, layout: dict | None, overrides: dict, shape: AttentionShape) -> list[Setting]:
    """The run's settings (the paper's named ones, or ``layout``) with the TAP ``overrides``, each
    checked against ``shape`` (:func:`libra.config.check_layout`) before anything runs.

    Raises:
        ValueError: an unknown setting name, an invalid layout or a TAP layout it rejects.
    """
    chosen = list(chosen_settings(settings_from_options(settings_, layout), overrides).values())
    for s in chosen:
        check_layout(s.par(), s.tap, shape)
    return chosen


def measure(run: ExperimentRun, chosen, cfg: PlanCostConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Timing samples and plan-quality rows of every (setting, window) (points resumable in ``run``)."""
    keys = [("timing", s.name, w) for s in chosen for w in range(cfg.windows)]
    by_name = {s.name: s for s in chosen}
    with one_process_group() as world:
        samples = pd.DataFrame(run.map(keys, lambda key: timing_rows(by_name[key[1]], key[2], cfg, world)))
    qkeys = [("quality", s.name, w, m) for s in chosen for w in range(cfg.windows) for m in QUALITY_METHODS]
    quality = pd.DataFrame(run.map(qkeys, lambda key: quality_rows(by_name[key[1]], cfg.workload, key[2], cfg.seed,
                                                                   key[3], cfg.shape)))
    return samples, quality


STAGE_LABELS = (("vrsp", "VRSP + workload estimation per step"), ("tap", "TAP per microbatch per pool"),
                ("compile", "compile per worker"), ("prepare", "prepare (step path, CPU, 1-proc gloo)"))


def echo_timings(s: Setting, sub: pd.DataFrame, paper: bool, placer: str, methods) -> None:
    """Print one setting's stage medians (next to the target and the paper's number on a paper
    setting) and their parts (``sub``: the summary rows of ``s``, indexed by stage)."""
    for stage, label in STAGE_LABELS:
        r = sub.loc[stage]
        line = f"  {label:38s} median {r.median_ms:8.3f} ms  IQR {r.iqr_ms:7.3f} ms  (n={r.repeats})"
        if paper:
            target = TARGETS_MS[s.name][stage]
            met = "met" if r.median_ms <= target else "NOT met"
            line += f"  target <= {target:g} ms ({met})"
            line += f"  paper {r.paper_ms} ms" if np.isfinite(r.paper_ms) else ""
        click.echo(line)
    parts = ", ".join(f"{st.split('.')[1]} {sub.loc[st].median_ms:.3f}" for st in
                      ("tap.tiles", "tap.placement", "tap.exchange"))
    click.echo(f"    TAP parts (median ms): {parts}")
    tap = sub.loc["tap"].median_ms
    for m in methods[1:]:
        r = sub.loc[tap_stage(m)]
        ratio, target = r.median_ms / tap, TAP_RATIO_TARGETS.get(m)
        goal = "" if target is None else f"  target <= {target:g}x ({'met' if ratio <= target else 'NOT met'})"
        click.echo(f"  TAP per pool, {m} (placer {placer}): median {r.median_ms:8.3f} ms  IQR {r.iqr_ms:7.3f} ms "
                   f" = {ratio:.2f}x libra's{goal}")
        parts = [st for st in sub.index if st.startswith(tap_stage(m) + ".")]
        if parts:
            click.echo("    parts (median ms, x libra's TAP): " + ", ".join(
                f"{st.rsplit('.', 1)[1]} {sub.loc[st].median_ms:.3f} ({sub.loc[st].median_ms / tap:.1f}x)" for st in parts))
    parts = ", ".join(f"{st.split('.')[1]} {sub.loc[st].median_ms:.3f}" for st in
                      ("prepare.unpickle", "prepare.runner", "prepare.digest"))
    click.echo(f"    prepare parts (median ms): {parts}")


def echo_quality(quality: pd.DataFrame) -> None:
    """Print one setting's plan balance and traffic per method of :data:`QUALITY_METHODS`."""
    q = summarize_quality(quality).set_index("method")
    click.echo(f"  {'method':12s} {'max/mean FLOPs (stage)':>22s} {'worst pool max/mean':>20s} "
               f"{'(tile bound)':>12s} {'bytes moved/step':>17s} {'pools > 1+tau':>14s} {'(big tile)':>10s}")
    for m in QUALITY_METHODS:
        r = q.loc[m]
        click.echo(f"  {m:12s} {r.stage_max_over_mean:22.3f} {r.pool_max_over_mean:20.3f} "
                   f"{r.worst_pool_tile_bound:12.3f} {r.bytes_total / 2**30:13.2f} GiB "
                   f"{int(r.pools_over_1_plus_tau):8d}/{int(r.pools):<5d} {int(r.pools_over_with_tile_above_target):10d}")
    click.echo("  (stage: mean over windows of the worst GA index; bytes: mean forward bytes per step;"
               " tile bound: heaviest tile / mean worker FLOPs")
    click.echo("   of the worst pool, a floor no placement can beat; big tile: pools over 1+tau holding a tile"
               " heavier than (1+tau) x mean)")


@click.command("plan-cost")
@quick_option("1 window, 2 repeats per call: a smoke run in seconds.")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="timing samples per call (default 5; --quick: 2).")
@click.option("--windows", type=click.IntRange(min=1), default=None,
              help="GBS windows per setting (default 8; --quick: 1).")
@click.option("--workload", default="libra-prod", show_default=True,
              help="length preset name or length file (see libra.data.source).")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the sample stream.")
@settings_option()
@layout_options()
@click.option("--q-heads", type=click.IntRange(min=1), default=SHAPE.num_q_heads, show_default=True,
              help="query heads")
@click.option("--kv-heads", type=click.IntRange(min=1), default=SHAPE.num_kv_heads, show_default=True,
              help="KV heads (must divide --q-heads)")
@click.option("--head-dim", type=click.IntRange(min=1), default=SHAPE.head_dim, show_default=True,
              help="head width d")
@click.option("--compile-workers", type=click.IntRange(min=1), default=None,
              help="workers of the first pool per window whose compile/prepare is timed (default 4; --quick: 2).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="output folder (default runs/plan-cost/<workload>-<layout>/).")
@click.option("--force", is_flag=True, help="recompute cached points.")
@overwrite_option()
@no_progress_option()
@click.option("--methods", default="libra", show_default=True,
              help="comma list of TAP planners whose per-pool planning is timed: 'tap' is libra's, "
                   "'tap@<method>' another's (e.g. libra,libra-adaptive), same placer for all.")
@tap_options("pool_size", "block_size", "head_split", "tau", "pipeline_chunks", per_setting=True)
def plan_cost(quick, repeats, windows, workload, seed, settings_, dp, cp, seq_len, gbs, q_heads, kv_heads, head_dim,
              compile_workers, out, force, methods, pool_size, block_size, head_split, tau, pipeline_chunks):
    """Planning time of VRSP (per step), TAP (per microbatch per pool), compile (per worker) and
    prepare (the step's path), Libra sec. 5, in the paper's settings or your layout (--dp --cp
    --seq-len --gbs).

    Also prints, per setting, max/mean worker FLOPs and bytes moved for Ulysses, WLB-LLM, Libra and
    DistCA.
    """
    repeats = repeats or (2 if quick else PlanCostConfig.repeats)
    windows = windows or (1 if quick else PlanCostConfig.windows)
    compile_workers = compile_workers or (2 if quick else PlanCostConfig.compile_workers)
    placer = placer_name()
    method_list = parse_tap_methods(methods)
    layout = given_layout(dp, cp, seq_len, gbs)
    overrides = {"pool_size": pool_size, "block_size": block_size, "head_split": head_split, "tau": tau,
                 "pipeline_chunks": pipeline_chunks}
    try:
        shape = make_shape(q_heads, kv_heads, head_dim)
        chosen = plan_cost_settings(settings_, layout, overrides, shape)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc

    paper = paper_settings(workload, {s.name: s for s in chosen}, shape)
    config = {"workload": workload, "seed": seed, "repeats": repeats, "windows": windows,
              "compile_workers": compile_workers, "placer": placer,
              "settings": [setting_record(s) for s in chosen], "shape": shape.__dict__,
              "quality_methods": QUALITY_METHODS, "tap_methods": list(method_list)}
    run = ExperimentRun("plan-cost", config, out_dir=out, force=force, quiet=True,
                        layouts=[setting_record(s) for s in chosen])
    try:
        samples, quality = measure(run, chosen, PlanCostConfig(workload, seed, windows, repeats, compile_workers,
                                                               method_list, shape))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    df = summarize(samples, paper)
    warm = warmups(samples)
    paths = run.finish(df, plot=lambda d, p: plot(d, p, paper, run_caption(run.config)),
                       files={"plan-cost-quality.csv": quality.to_csv(index=False)},
                       extra={"placer": placer, "cost_impl": _cost.cost_impl(), "jit_warmup_ms": warm, "paper_settings": sorted(paper),
                              "targets_ms": {s.name: TARGETS_MS[s.name] for s in chosen if s.name in paper},
                              "quality": summarize_quality(quality).to_dict(orient="records")})
    jit = ", ".join(f"{m.rsplit('.', 1)[-1]} {ms:.0f} ms" for m, ms in warm.items()) or "none"
    click.echo(f"placer: {placer}; cost model: {_cost.cost_impl()}; JIT warmup (once per process, excluded from every timing): {jit}")
    for s in chosen:
        click.echo(f"{s.name}: S={s.seq_len} GBS={s.gbs} DP={s.dp} CP={s.cp} P={s.tap.pool_size} "
                   f"B={s.tap.block_size} H={s.tap.head_split} tau={s.tap.tau} M={s.tap.pipeline_chunks}, "
                   f"{shape.num_q_heads}q/{shape.num_kv_heads}kv heads d={shape.head_dim}, "
                   f"{workload}, {windows} window(s), {repeats} repeat(s)")
        echo_timings(s, df[df["setting"] == s.name].set_index("stage"), s.name in paper, placer, method_list)
        echo_quality(quality[quality["setting"] == s.name])
    if paper:
        click.echo("targets: goals for a 2-core machine (tap half the paper's; vrsp the paper's), "
                   "not the paper's figures")
    others = [s.name for s in chosen if s.name not in paper]
    if others:
        click.echo(f"no targets or paper numbers for {', '.join(others)}: not the paper's run (libra-prod, "
                   "its layout and TAP layout, 32q/4kv heads d=128)")
    click.echo(f"wrote {paths['csv']}, {paths['png']}, {run.out_dir / 'plan-cost-quality.csv'}, {paths['run']}")
