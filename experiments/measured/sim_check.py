"""`libra-bench sim-check`: the simulator's compute time against measurement on one device.

For the tiles each worker of a pool computes in the paper's setting, scaled down to fit one device
(default: one pool of P = 2 replicas, CP = 4, S = 64K, libra-prod windows, the ``libra`` planner
with B = 4096, H = 2, M = 4; Libra sec. 6.3 runs P = 8, CP = 8, S = 256K), every worker's kernel
batch is built from ``PoolPlan.segments`` exactly as the runtime and the cost model see it: one
varlen call per Pipeliner chunk with ``tile heads / M`` query heads (``max(1, that / group)`` KV
heads), segments = the worker's (tile x sample) pieces, each query block attending to its sample's
KV prefix. Its compute time is

* **predicted** by :class:`libra.sim.cost.CostModel` with the given profile (use the one
  ``libra-bench calibrate`` measured on this device): ``compute_fwd_ms`` and ``compute_bwd_ms``;
* **measured** by running those calls on the device (forward, then backward from saved out/lse),
  timed like ``calibrate`` (CUDA events after warm-up, medians, rotated input sets).

Workers are run one after another on the one device (the single-GPU emulation of a pool; no
communication is timed -- that is the cost model's other half, which one device cannot check).
Outputs (``runs/gpu/<device>/sim-check/`` or ``--out``; ``scripts/gpu_check.sh`` writes
``results/gpu/<device>/sim-check/``): ``sim_check.csv`` (one row per window
and worker), ``sim_check.png`` (predicted vs measured, with y = x and a +-10 % band),
``run.json`` with the median and worst relative error (target: median within 10 %). Every worker
is also priced under the profile's other piece-pricing rule (``KernelModel.piece_pricing``:
``pred_ms_other_rule``, ``rel_err_other_rule``, and its median in ``run.json``), so one device run
says which rule that device's tile batches follow.

The TAP options (``--pool-size``, ``--block-size``, ``--head-split``, ``--tau``,
``--pipeline-chunks``, alias ``--chunks``) come from
:func:`experiments.common.options.tap_options`, with this command's defaults (:data:`DEFAULT_TAP`:
TapConfig's but P = 2); ``run.json`` records the layout under ``config.tap``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import click
import numpy as np
import pandas as pd
import torch

from experiments.common.options import SizeType, quick_option, tap_options
from experiments.common.runner import RUNS_ROOT, ExperimentRun
from experiments.common.runs_table import run_caption
from experiments.measured.gpu_common import (
    KernelGeometry,
    MeasureOptions,
    OnePoolLayout,
    cpu_threads,
    device_info,
    device_options,
    device_slug,
    dtype_name,
    make_inputs,
    other_device_profile,
    resolve_backend,
    resolve_device,
    resolve_dtype,
    rotation_sets,
    sim_check_verdict,
    summarize_ms,
    time_calls,
    worker_pieces,
)
from libra.config import TapConfig
from libra.runtime.kernels import Segments
from libra.sim.cost import CostModel
from libra.sim.kernel import PIECE_PRICINGS
from libra.sim.profiles import DEFAULT_PROFILE, load_profile
from libra.sim.topology import Topology
from libra.tap.pipeline import ChunkSchedule, schedule_for_pool
from libra.workload import AttentionShape, attention_flops, kv_heads_per_call

METHODS = ("libra", "libra-tap", "libra-tap-vrsp", "ulysses")
TARGET_MEDIAN_ERR = 0.10


DEFAULT_TAP = TapConfig(pool_size=2)
"""sim-check's TAP layout: TapConfig's (B = 4096, H = 2, tau, M = 4) in one pool of P = 2 replicas."""

TAP_FIELDS = ("pool_size", "block_size", "head_split", "tau", "pipeline_chunks")
"""The TapConfig fields sim-check takes as options."""


@dataclass(frozen=True)
class SimCheckConfig(OnePoolLayout):
    """The scaled-down pool setting (one pool: DP = GBS = P, so one Plan per window).

    Attributes:
        tap: the TAP layout (P, B, H, tau, M, ...); ``tap.pipeline_chunks`` is used by ``libra``
            only (the TAP-only variants run M = 1, Ulysses takes no TAP options).

    Raises:
        ValueError: a bad size or a layout ``libra.config.check_layout`` rejects (P, B, H, M).
    """

    method: str = "libra"
    workload: str = "libra-prod"
    seq_len: int = 65536
    cp: int = 4
    tap: TapConfig = DEFAULT_TAP
    q_heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    windows: int = 4
    seed: int = 0
    warmup: int = 2
    repeats: int = 5
    rotate: int = 2
    rotate_mb: int = 4096

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        for name in ("seq_len", "cp", "q_heads", "kv_heads", "head_dim", "windows", "repeats", "rotate", "rotate_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.warmup < 0 or self.seed < 0:
            raise ValueError(f"warmup and seed must be >= 0, got {self.warmup}, {self.seed}")
        if self.seq_len % self.cp:
            raise ValueError(f"CP={self.cp} must divide seq_len={self.seq_len}")
        self.check_tap()

    @property
    def chunks(self) -> int:
        """The Pipeliner's M the method runs, as its planner says (``libra``: ``tap.pipeline_chunks``;
        the TAP-only variants pin 1; Ulysses has no Pipeliner)."""
        from baselines.registry import planner_class  # noqa: PLC0415

        return planner_class(self.method).from_tap(self.tap).pipeline_chunks


def worker_calls(pieces: dict, shape: AttentionShape, schedule: ChunkSchedule) -> list[tuple[Segments, int, int]]:
    """The varlen calls of one worker: per chunk and heads per call, the schedule's calls of
    ``(segments, query heads per call, KV heads per call)`` (the cost model's geometry,
    :meth:`ChunkSchedule.segment_calls`)."""
    chunk, heads, ncalls = schedule.segment_calls(pieces)
    calls = []
    for c, qh, n in sorted({(int(c), int(h), int(k)) for c, h, k in zip(chunk, heads, ncalls)}):
        sel = (chunk == c) & (heads == qh) & (ncalls == n)
        seg = Segments(pieces["q_len"][sel], pieces["kv_len"][sel])
        calls.extend([(seg, qh, kv_heads_per_call(qh, shape.group_size))] * n)
    return calls


def measure_worker(backend, calls, head_dim: int, dtype, device, cfg: SimCheckConfig, seed: int) -> dict:
    """Median forward and backward ms of all of one worker's calls run back to back."""
    prepared = []
    for j, (seg, qh, kvh) in enumerate(calls):
        geom = KernelGeometry(qh, kvh, head_dim, dtype, device)
        n = rotation_sets(seg, geom, cfg.rotate, (cfg.rotate_mb << 20) // max(len(calls), 1))
        prepared.append((seg, make_inputs(seg, geom, n, seed + 7919 * j, backend)))

    def fwd(i):
        with torch.no_grad():
            for seg, sets in prepared:
                s = sets[i % len(sets)]
                backend.forward(s.q, s.k, s.v, seg)

    def bwd(i):
        for seg, sets in prepared:
            s = sets[i % len(sets)]
            backend.backward(s.dout, s.q, s.k, s.v, s.out, s.lse, seg)

    res = {"fwd": summarize_ms(time_calls(fwd, device, cfg.warmup, cfg.repeats)),
           "bwd": summarize_ms(time_calls(bwd, device, cfg.warmup, cfg.repeats)),
           "rotation": min(len(s) for _, s in prepared)}
    prepared.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def window_rows(w: int, plan, cost, backend, cfg: SimCheckConfig, dtype, device, other=None) -> list[dict]:
    """One row per worker of window ``w``'s plan: predicted vs measured compute (``other``: the same
    plan priced under the profile's other piece-pricing rule, :func:`other_rule_model`)."""
    shape = plan.shape
    rows = []
    for pool in plan.pools:
        sched = schedule_for_pool(pool, shape, plan.pipeline_chunks)
        for rank, worker in enumerate(pool.workers):
            pieces = worker_pieces(pool, shape, worker, sched)
            if not len(pieces["q_len"]):
                continue
            calls = worker_calls(pieces, shape, sched)
            meas = measure_worker(backend, calls, shape.head_dim, dtype, device, cfg,
                                  seed=cfg.seed * 100003 + w * 1009 + worker)
            pf, pb = float(cost.compute_fwd_ms[worker]), float(cost.compute_bwd_ms[worker])
            mf, mb = meas["fwd"]["ms"], meas["bwd"]["ms"]
            flops = float(np.sum(attention_flops(pieces["area"].astype(np.float64), 1, shape.head_dim)
                                 * pieces["heads"]))
            rows.append({
                "window": w, "ga_index": int(plan.ga_index), "pool": int(pool.pool_index), "worker": int(worker),
                "pool_rank": rank, "pieces": int(len(pieces["q_len"])), "tiles": int(np.sum(pool.tiles.dest == worker)),
                "calls": len(calls), "heads_per_call": int(calls[0][1]), "q_tokens": int(pieces["q_len"].sum()),
                "kv_tokens": int(pieces["kv_len"].sum()), "flops_fwd": flops,
                "pred_fwd_ms": pf, "pred_bwd_ms": pb, "pred_ms": pf + pb,
                "meas_fwd_ms": mf, "meas_bwd_ms": mb, "meas_ms": mf + mb,
                "meas_fwd_p10": meas["fwd"]["ms_p10"], "meas_fwd_p90": meas["fwd"]["ms_p90"],
                "meas_bwd_p10": meas["bwd"]["ms_p10"], "meas_bwd_p90": meas["bwd"]["ms_p90"],
                "rel_err_fwd": pf / mf - 1.0, "rel_err_bwd": pb / mb - 1.0, "rel_err": (pf + pb) / (mf + mb) - 1.0,
                "rotation": meas["rotation"],
                **({} if other is None else {
                    "pred_ms_other_rule": float(other.compute_ms[worker]),
                    "rel_err_other_rule": float(other.compute_ms[worker]) / (mf + mb) - 1.0}),
            })
    return rows


def summarize(df: pd.DataFrame) -> dict:
    """Median and worst |relative error| (total, fwd, bwd), and the straggler agreement per window."""
    out = {"workers": int(len(df))}
    for col, name in (("rel_err", "total"), ("rel_err_fwd", "fwd"), ("rel_err_bwd", "bwd")):
        err = df[col].abs()
        out[f"median_abs_err_{name}"] = float(err.median())
        out[f"worst_abs_err_{name}"] = float(err.max())
        out[f"mean_signed_err_{name}"] = float(df[col].mean())
    same = []
    ratio_err = []
    for _, g in df.groupby("window"):
        same.append(int(g.loc[g.pred_ms.idxmax(), "worker"] == g.loc[g.meas_ms.idxmax(), "worker"]))
        ratio_err.append(float((g.pred_ms.max() / g.pred_ms.mean()) / (g.meas_ms.max() / g.meas_ms.mean()) - 1))
    out["straggler_worker_agrees"] = f"{sum(same)}/{len(same)} windows"
    out["max_over_mean_rel_err_median"] = float(np.median(np.abs(ratio_err))) if ratio_err else float("nan")
    out["median_within_target"] = bool(out["median_abs_err_total"] <= TARGET_MEDIAN_ERR)
    if "rel_err_other_rule" in df:
        out["median_abs_err_other_rule"] = float(df["rel_err_other_rule"].abs().median())
    return out


def other_rule_model(profile, par) -> CostModel:
    """The cost model of ``profile`` with its kernel's other :data:`~libra.sim.kernel.PIECE_PRICINGS`
    rule: ``sim-check`` prices every worker both ways, so one device run says which rule its tile
    batches follow."""
    k = profile.kernel
    rule = next(r for r in PIECE_PRICINGS if r != k.piece_pricing)
    prof = replace(profile, kernel=replace(k, piece_pricing=rule))
    return CostModel(prof, Topology(prof, par))


def plot_scatter(df: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    """Predicted vs measured compute per worker (fwd, bwd, total), log axes, y = x and +-10 %."""
    from experiments.common.plotting import save_figure, setup_style  # noqa: PLC0415  (selects Agg first)

    setup_style()
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    long = pd.concat([pd.DataFrame({"pass": name, "measured_ms": df[m], "predicted_ms": df[p]})
                      for name, m, p in (("fwd", "meas_fwd_ms", "pred_fwd_ms"), ("bwd", "meas_bwd_ms", "pred_bwd_ms"),
                                         ("fwd+bwd", "meas_ms", "pred_ms"))], ignore_index=True)
    fig, ax = plt.subplots(figsize=(5, 4.6))
    sns.scatterplot(data=long, x="measured_ms", y="predicted_ms", hue="pass", style="pass", ax=ax)
    lo = float(min(long.measured_ms.min(), long.predicted_ms.min())) * 0.8
    hi = float(max(long.measured_ms.max(), long.predicted_ms.max())) * 1.25
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, color="black", lw=1, label="y = x")
    ax.fill_between(xs, xs * 0.9, xs * 1.1, color="grey", alpha=0.2, label="+-10 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured compute per worker (ms)")
    ax.set_ylabel("cost model prediction (ms)")
    ax.legend(fontsize=8)
    ax.set_title(f"sim-check: {df.attrs.get('device', '')}, {df.attrs.get('profile', '')}", fontsize=9)
    save_figure(fig, path, caption=caption)


def run_sim_check(cfg: SimCheckConfig, opts: MeasureOptions, profile: str = DEFAULT_PROFILE) -> dict:
    """Plan, price, measure and write (see the module docstring).

    Returns:
        ``{"df", "summary", "paths", "info", "out_dir"}``.

    Raises:
        ValueError: bad device/backend/dtype/profile/workload, or CUDA requested without CUDA.
    """
    from libra.data.windows import gbs_windows  # noqa: PLC0415

    dev = resolve_device(opts.device)
    dt = resolve_dtype(opts.dtype, dev)
    be = resolve_backend(opts.backend, dev)
    prof = load_profile(profile)
    info = device_info(dev, be)
    par, shape = cfg.par(), cfg.shape()
    windows = gbs_windows(cfg.workload, cfg.seq_len, par.gbs, cfg.windows, seed=cfg.seed)
    planner = cfg.planner()
    model = CostModel(prof, Topology(prof, par))
    other = other_rule_model(prof, par)
    out_dir = Path(opts.out) if opts.out is not None else RUNS_ROOT / "gpu" / device_slug(info) / "sim-check"
    config = {**asdict(cfg), "device": str(dev), "device_name": info.get("name"), "backend": be.name,
              "dtype": dtype_name(dt), "profile": prof.to_dict(), "torch": info["torch"],
              "cpu_threads": opts.cpu_threads if dev.type == "cpu" else None}
    run = ExperimentRun("sim_check", config, out_dir=out_dir, force=opts.force, quiet=opts.quiet)

    def point(w):
        rows = []
        for plan in planner.plan_window(windows[w], par, shape):
            rows.extend(window_rows(w, plan, model.price(plan), be, cfg, dt, dev, other.price(plan)))
        return rows

    with cpu_threads(dev, opts.cpu_threads):
        rows = run.map(range(cfg.windows), point, desc="sim-check")
    df = pd.DataFrame(rows)
    if df.empty:
        raise ValueError("no worker computed any tile: nothing to compare")
    df.attrs.update({"device": info.get("name"), "profile": prof.name})
    summary = {"device": info.get("name"), "backend": be.name, "dtype": dtype_name(dt), "profile": prof.name,
               "piece_pricing": prof.kernel.piece_pricing, "other_rule": other.profile.kernel.piece_pricing,
               "device_type": dev.type, "profile_device_type": prof.kernel_device_type, **summarize(df)}
    paths = run.finish(df, lambda d, p: plot_scatter(d, p, run_caption(run.config)), extra={"environment_device": info, "summary": summary,
                                               "profile": prof.to_dict()})
    return {"df": df, "summary": summary, "paths": paths, "info": info, "out_dir": run.out_dir}


STEPS_ONLY = ("methods", "dp", "gbs", "oversubscribe")
"""Options of the whole-step mode (``--nproc``) only."""
KERNEL_ONLY = ("method", "rotate", "rotate_mb", "cpu_threads", "quick")
"""Options of the one-device compute check only."""


def _given(ctx, name: str) -> bool:
    return ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


def _steps(ctx, nproc, layout: dict, run: tuple) -> None:
    """The whole-step mode (:mod:`experiments.measured.sim_check_steps`): check, run, print."""
    from experiments.measured.sim_check_steps import echo_steps, run_steps_check, steps_config  # noqa: PLC0415

    profile, out, force, quiet = run
    bad = [n for n in KERNEL_ONLY if _given(ctx, n)]
    if nproc is None or bad:
        raise click.UsageError(f"--{(bad or ['nproc'])[0].replace('_', '-')} "
                               + ("applies to the one-device check only, not with --nproc" if bad else
                                  "is needed with --methods/--dp/--gbs/--oversubscribe (the whole-step mode)"))
    if not layout["methods"]:
        raise click.UsageError("--nproc needs --methods (e.g. ulysses,libra,libra-adaptive)")
    cp = layout["cp"]
    layout = {**layout, "dp": layout["dp"] or max(nproc // cp, 1),
              "device": "cpu" if layout["device"] == "auto" else layout["device"],
              "dtype": "fp32" if layout["dtype"] == "auto" else layout["dtype"]}
    layout = {**layout, "gbs": layout["gbs"] or layout["dp"], "comm": "p2p", "backward": True, "timeout": 300.0}
    try:
        cfg = steps_config(layout, profile, nproc)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    echo_steps(run_steps_check(cfg, out, force=force, quiet=quiet))


@click.command("sim-check", context_settings={"default_map": {f: getattr(DEFAULT_TAP, f) for f in TAP_FIELDS}})
@device_options()
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True,
              help="hardware profile to predict with (a name or the profile.json `calibrate` wrote)")
@click.option("--method", default="libra", show_default=True, help=f"planner: {', '.join(METHODS)}")
@click.option("--workload", default="libra-prod", show_default=True, help="length preset or length file")
@click.option("--seq-len", type=SizeType(), default=65536, show_default=True, help="tokens per packed sequence S")
@click.option("--cp", type=int, default=4, show_default=True, help="context-parallel degree CP")
@tap_options(*TAP_FIELDS)
@click.option("--q-heads", type=int, default=32, show_default=True, help="query heads")
@click.option("--kv-heads", type=int, default=4, show_default=True, help="KV heads")
@click.option("--head-dim", type=int, default=128, show_default=True, help="head width")
@click.option("--windows", type=int, default=4, show_default=True, help="GBS windows (one plan each)")
@quick_option("tiny sizes (CPU smoke): S 2048, P 2, CP 2, B 256, 4 q heads, d 32")
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="whole steps instead: spawn this many gloo CPU ranks (= DP*CP), run every --methods plan measured, "
                   "methods interleaved, and compare compute, exposed communication and step time with the model")
@click.option("--methods", default=None, help="with --nproc: comma list of methods (e.g. ulysses,libra,libra-adaptive)")
@click.option("--dp", type=click.IntRange(min=1), default=None, help="with --nproc: DP (default nproc / CP)")
@click.option("--gbs", type=click.IntRange(min=1), default=None, help="with --nproc: packed sequences per window "
              "(default DP)")
@click.option("--oversubscribe", is_flag=True, help="with --nproc: allow more CPU ranks than usable cores "
              "(times are then total CPU work / cores; recorded and printed)")
@click.pass_context
def sim_check(ctx, device, backend, dtype, warmup, repeats, rotate, rotate_mb, cpu_threads, seed, out, force,
              no_progress, profile, method, workload, seq_len, cp, pool_size, block_size, head_split, tau,
              pipeline_chunks, q_heads, kv_heads, head_dim, windows, quick, nproc, methods, dp, gbs, oversubscribe):
    """Cost-model compute time vs measured kernel time of each worker's tiles, on one device; with
    ``--nproc N`` the whole step (compute, exposed communication, step time) of every ``--methods``
    plan measured on N gloo ranks.

    P is also DP and GBS here (one pool); the Pipeliner's M applies to ``libra`` only."""
    if nproc is not None or any(_given(ctx, n) for n in STEPS_ONLY):
        _steps(ctx, nproc, {"dp": dp, "cp": cp, "seq_len": seq_len, "gbs": gbs, "q_heads": q_heads,
                            "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype, "device": device,
                            "backend": backend, "methods": methods, "windows": windows, "workload": workload,
                            "seed": seed, "repeats": repeats, "warmup": warmup, "oversubscribe": oversubscribe,
                            "tap": replace(DEFAULT_TAP, pool_size=pool_size, block_size=block_size,
                                           head_split=head_split, tau=tau, pipeline_chunks=pipeline_chunks)},
               (profile, out, force, no_progress))
        return
    if quick:
        seq_len, pool_size, cp, block_size, head_split, pipeline_chunks = 2048, 2, 2, 256, TapConfig.head_split, 2
        q_heads, kv_heads, head_dim, windows, warmup, repeats, rotate = 4, 2, 32, 2, 1, 3, 2
    try:
        tap = replace(DEFAULT_TAP, pool_size=pool_size, block_size=block_size, head_split=head_split, tau=tau,
                      pipeline_chunks=pipeline_chunks)
        cfg = SimCheckConfig(method=method, workload=workload, seq_len=seq_len, cp=cp, tap=tap, q_heads=q_heads,
                             kv_heads=kv_heads, head_dim=head_dim, windows=windows, seed=seed, warmup=warmup,
                             repeats=repeats, rotate=rotate, rotate_mb=rotate_mb)
        opts = MeasureOptions(device=device, backend=backend, dtype=dtype, out=out,
                              force=force, quiet=no_progress, cpu_threads=cpu_threads)
        res = run_sim_check(cfg, opts, profile=profile)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    s, df = res["summary"], res["df"]
    click.echo(f"sim-check: {s['device']} backend={s['backend']} dtype={s['dtype']} profile={s['profile']}")
    for r in df.itertuples():
        click.echo(f"  window {r.window} worker {r.worker:>2}: predicted {r.pred_ms:9.4g} ms  measured "
                   f"{r.meas_ms:9.4g} ms  err {r.rel_err:+.1%} (fwd {r.rel_err_fwd:+.1%}, bwd {r.rel_err_bwd:+.1%})")
    click.echo(f"median |err| {s['median_abs_err_total']:.1%} (fwd {s['median_abs_err_fwd']:.1%}, bwd "
               f"{s['median_abs_err_bwd']:.1%}); worst {s['worst_abs_err_total']:.1%}; target median <= "
               f"{TARGET_MEDIAN_ERR:.0%}: {sim_check_verdict(s)}; straggler worker agrees in {s['straggler_worker_agrees']}")
    if other_device_profile(s):
        click.echo(f"note: profile {s['profile']} models a {s['profile_device_type']} kernel and this run measured on "
                   f"{s['device_type']}: the errors compare two devices, not the model with this one (calibrate "
                   f"this device with `libra-bench calibrate --device {s['device_type']}` and pass its profile.json "
                   "as --profile)")
    click.echo(f"piece pricing: {s['piece_pricing']} (the profile's) median |err| {s['median_abs_err_total']:.1%}; "
               f"{s['other_rule']} would give {s['median_abs_err_other_rule']:.1%}")
    click.echo(f"wrote {res['paths']['csv']}, {res['paths']['png']}")
