"""`libra-bench tile-overhead`: one worker's tiles run as the runtime runs them, against one varlen call.

TAP splits a worker's attention into SH-tile pieces and the Pipeliner runs them as ``M`` calls of
``width / M`` heads (Libra sec. 4.3-4.4); each call's inputs are gathered into packed buffers and its
outputs scattered back to their tokens. This command prices that against the least a kernel could
do with the same work: for one worker of one plan (default: the paper's 256K setting, window 0, GA
step 0, the worker with the most attention FLOPs), planned by each ``--methods`` planner, it times

* ``runtime``: per Pipeliner call, gather Q/K/V (backward: also dO and O) from the worker's token
  buffers into the call's packed inputs, one varlen call, scatter O (backward: dQ copied, dK/dV
  added onto the KV rows), as the runtime does on a GPU (``views=False``: one packed call per chunk
  and head width); what arrives over the network is already in the token buffers here;
* ``calls``: the same calls on inputs gathered beforehand (kernel time only: what ``sim-check``
  times and the cost model prices, whose prediction is in the rows);
* ``one-call``: the same segments at their tile's full width, one varlen call per tile width
  (usually one): the same FLOPs in the fewest launches and the most heads per call.

``runtime / one-call`` is the overhead of tiling and chunking (goal <= 1.05); ``calls / one-call``
is the part due to the kernel (heads per call, launches). Variants are timed in interleaved rounds
(CUDA events, medians). Outputs: ``tile_overhead.csv`` (method x variant x pass), ``.png``,
``run.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import click
import numpy as np
import pandas as pd
import torch

from experiments.common.options import given_layout, layout_options, quick_option, tap_options
from experiments.common.runner import RUNS_ROOT, ExperimentRun
from experiments.common.runs_table import run_caption
from experiments.common.sim_common import (
    SETTINGS,
    Setting,
    build_cost_model,
    check_settings,
    custom_setting,
    load_windows,
    make_planner,
    make_shape,
    setting_record,
    with_tap,
)
from experiments.measured.gpu_common import (
    MeasureOptions,
    cpu_threads,
    device_info,
    device_options,
    device_slug,
    dtype_name,
    resolve_backend,
    resolve_device,
    resolve_dtype,
    summarize_ms,
    time_calls_within,
    worker_pieces,
)
from libra.runtime.kernels import Segments
from libra.sim.profiles import DEFAULT_PROFILE, load_profile
from libra.tap.pipeline import schedule_for_pool
from libra.workload import attention_flops, kv_heads_per_call, sample_area

VARIANTS = ("runtime", "calls", "one-call")
TARGET_RATIO = 1.05


@dataclass(frozen=True)
class TileOverheadConfig:
    """Which worker to time and how.

    Attributes:
        setting: the layout (a paper setting from :data:`experiments.common.sim_common.SETTINGS` or a user's).
        worker: the worker to time (None: the one with the most forward FLOPs in GA step ``step``).

    Raises:
        ValueError: a bad count or an unknown method.
    """

    methods: tuple[str, ...] = ("libra", "libra-adaptive")
    workload: str = "libra-prod"
    setting: Setting = field(default_factory=lambda: SETTINGS["256k"])
    window: int = 0
    step: int = 0
    worker: int | None = None
    q_heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    seed: int = 0
    warmup: int = 2
    repeats: int = 5
    rounds: int = 3
    target_ms: float = 600.0

    def __post_init__(self) -> None:
        from baselines.registry import PLANNERS  # noqa: PLC0415

        unknown = [m for m in self.methods if m not in PLANNERS]
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown or '(none)'}; choose from {', '.join(PLANNERS)}")
        for name in ("q_heads", "kv_heads", "head_dim", "repeats", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("window", "step", "warmup", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        workers = self.setting.dp * self.setting.cp
        if self.worker is not None and not 0 <= self.worker < workers:
            raise ValueError(f"worker {self.worker} is not in the plan: the layout has workers 0..{workers - 1}")
        if not self.target_ms > 0:
            raise ValueError(f"target_ms must be > 0, got {self.target_ms}")
        make_shape(self.q_heads, self.kv_heads, self.head_dim)  # GQA check


class WorkerCall(NamedTuple):
    """One varlen call of a worker: its segments, heads, and the flat (token, head) rows of its
    packed inputs in the worker's token buffers (``q_idx``: ``(Tq, qh)``, ``kv_idx``: ``(Tk, kvh)``)."""

    seg: Segments
    qh: int
    kvh: int
    q_idx: torch.Tensor
    kv_idx: torch.Tensor


def _flat_rows(starts: np.ndarray, lens: np.ndarray, head0: np.ndarray, width: int, heads_total: int) -> np.ndarray:
    """``(sum(lens), width)`` flat indices ``row * heads_total + head`` of segments' rows and heads."""
    rows = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens) + np.arange(int(lens.sum()))
    h0 = np.repeat(head0, lens)
    return rows[:, None] * heads_total + h0[:, None] + np.arange(width)[None, :]


def worker_calls(pieces: dict, shape, sched, q_local: np.ndarray, kv_local: np.ndarray) -> list[WorkerCall]:
    """The worker's varlen calls as the runtime issues them: per (chunk, heads per call) group of
    :meth:`~libra.tap.pipeline.ChunkSchedule.segment_calls`, ``n`` calls whose ``k``-th takes heads
    ``[head_start + k * qh, + qh)`` of each segment's tile. ``q_local`` / ``kv_local``: each
    segment's first query / key row in the worker's token buffers."""
    chunk, hpc, ncalls = sched.segment_calls(pieces)
    calls = []
    for c, qh, n in sorted({(int(a), int(b), int(k)) for a, b, k in zip(chunk, hpc, ncalls)}):
        sel = np.flatnonzero((chunk == c) & (hpc == qh) & (ncalls == n))
        ql, kl = pieces["q_len"][sel], pieces["kv_len"][sel]
        kvh = kv_heads_per_call(qh, shape.group_size)
        for k in range(n):
            h0 = pieces["head_start"][sel] + k * qh
            kv0 = h0 // shape.group_size
            q_idx = _flat_rows(q_local[sel], ql, h0, qh, shape.num_q_heads)
            kv_idx = _flat_rows(kv_local[sel], kl, kv0, kvh, shape.num_kv_heads)
            calls.append(WorkerCall(Segments(ql, kl), qh, kvh, torch.as_tensor(q_idx), torch.as_tensor(kv_idx)))
    return calls


def local_rows(tok: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, int]:
    """Rows of the worker's token buffer: the union of the intervals ``[tok, tok + lens)`` of the pool
    token axis, compressed; returns each interval's first row and the buffer's length."""
    if not len(tok):
        return np.zeros(0, np.int64), 0
    order = np.argsort(tok, kind="stable")
    starts, ends = tok[order], tok[order] + lens[order]
    # merge overlapping intervals; an interval's local start is its offset in the merged union
    run_end = np.maximum.accumulate(ends)
    new = np.ones(len(starts), bool)
    new[1:] = starts[1:] >= run_end[:-1]
    run = np.cumsum(new) - 1
    run_start = starts[new]
    run_len = np.maximum.reduceat(ends, np.flatnonzero(new)) - run_start
    base = np.concatenate(([0], np.cumsum(run_len)[:-1]))
    first = np.empty(len(tok), np.int64)
    first[order] = base[run] + (starts - run_start[run])
    return first, int(run_len.sum())


def pick_worker(plan, shape, worker: int | None):
    """``(pool, worker, pieces, sched)`` of the chosen worker: ``worker``, or the one with the most
    forward FLOPs.

    Raises:
        ValueError: ``worker`` is not in the plan or computes nothing.
    """
    best = None
    for pool in plan.pools:
        sched = schedule_for_pool(pool, shape, plan.pipeline_chunks)
        for w in pool.workers:
            if worker is not None and w != worker:
                continue
            pieces = worker_pieces(pool, shape, w, sched)
            flops = float(np.sum(pieces["area"].astype(np.float64) * pieces["heads"]))
            if flops > 0 and (best is None or flops > best[0]):
                best = (flops, pool, w, pieces, sched)
    if best is None:
        raise ValueError(f"worker {worker} is not in the plan or computes no tile" if worker is not None
                         else "no worker of the plan computes any tile")
    return best[1:]


class WorkerBuffers:
    """The worker's token buffers (inputs random, outputs written by the variants)."""

    def __init__(self, n_q: int, n_kv: int, shape, dtype, device, seed: int):
        gen = torch.Generator(device=device).manual_seed(int(seed))
        d = shape.head_dim

        def rnd(rows, heads):
            return torch.randn(rows, heads, d, generator=gen, device=device, dtype=torch.float32).to(dtype)

        self.q, self.do = rnd(n_q, shape.num_q_heads), rnd(n_q, shape.num_q_heads)
        self.k, self.v = rnd(n_kv, shape.num_kv_heads), rnd(n_kv, shape.num_kv_heads)
        self.o, self.dq = torch.zeros_like(self.q), torch.zeros_like(self.q)
        self.dk, self.dv = torch.zeros_like(self.k), torch.zeros_like(self.v)
        self.d = d


def _gather(buf: torch.Tensor, idx: torch.Tensor, d: int) -> torch.Tensor:
    return buf.view(-1, d)[idx]


def variant_fns(calls: list[WorkerCall], whole: list[tuple], bufs: WorkerBuffers, backend) -> dict:
    """``{(variant, pass): fn(i)}`` of :data:`VARIANTS`; ``whole``: the one-call batches
    ``(Segments, q, k, v, dout)`` at full tile width."""
    d = bufs.d
    pre = []
    for c in calls:  # inputs gathered once, and each call's O / lse for the backward passes
        q, k, v = (_gather(b, i, d) for b, i in ((bufs.q, c.q_idx), (bufs.k, c.kv_idx), (bufs.v, c.kv_idx)))
        with torch.no_grad():
            o, lse = backend.forward(q, k, v, c.seg)
        pre.append((q, k, v, _gather(bufs.do, c.q_idx, d), o, lse))
    whole_out = []
    for seg, q, k, v, _ in whole:
        with torch.no_grad():
            whole_out.append(backend.forward(q, k, v, seg))

    def runtime_fwd(i):
        with torch.no_grad():
            for c in calls:
                q, k, v = (_gather(b, ix, d) for b, ix in ((bufs.q, c.q_idx), (bufs.k, c.kv_idx), (bufs.v, c.kv_idx)))
                o, _ = backend.forward(q, k, v, c.seg)
                bufs.o.view(-1, d).index_copy_(0, c.q_idx.reshape(-1), o.reshape(-1, d))

    def runtime_bwd(i):
        for c, (_, _, _, _, _, lse) in zip(calls, pre):
            q, do, o = (_gather(b, c.q_idx, d) for b in (bufs.q, bufs.do, bufs.o))
            k, v = _gather(bufs.k, c.kv_idx, d), _gather(bufs.v, c.kv_idx, d)
            dq, dk, dv = backend.backward(do, q, k, v, o, lse, c.seg)
            bufs.dq.view(-1, d).index_copy_(0, c.q_idx.reshape(-1), dq.reshape(-1, d))
            bufs.dk.view(-1, d).index_add_(0, c.kv_idx.reshape(-1), dk.reshape(-1, d))
            bufs.dv.view(-1, d).index_add_(0, c.kv_idx.reshape(-1), dv.reshape(-1, d))

    def calls_fwd(i):
        with torch.no_grad():
            for c, (q, k, v, _, _, _) in zip(calls, pre):
                backend.forward(q, k, v, c.seg)

    def calls_bwd(i):
        for c, (q, k, v, do, o, lse) in zip(calls, pre):
            backend.backward(do, q, k, v, o, lse, c.seg)

    def one_fwd(i):
        with torch.no_grad():
            for seg, q, k, v, _ in whole:
                backend.forward(q, k, v, seg)

    def one_bwd(i):
        for (seg, q, k, v, do), (o, lse) in zip(whole, whole_out):
            backend.backward(do, q, k, v, o, lse, seg)

    return {("runtime", "fwd"): runtime_fwd, ("runtime", "bwd"): runtime_bwd, ("calls", "fwd"): calls_fwd,
            ("calls", "bwd"): calls_bwd, ("one-call", "fwd"): one_fwd, ("one-call", "bwd"): one_bwd}


def one_call_batches(pieces: dict, shape, bufs: WorkerBuffers, dtype, device, seed: int) -> list[tuple]:
    """The worker's segments at their tile's full width, one batch per width: ``(Segments, q, k, v, dout)``."""
    gen = torch.Generator(device=device).manual_seed(int(seed) + 1)
    out = []
    for width in sorted(set(pieces["heads"].tolist())):
        sel = pieces["heads"] == width
        seg = Segments(pieces["q_len"][sel], pieces["kv_len"][sel])
        kvh = kv_heads_per_call(int(width), shape.group_size)

        def rnd(rows, heads):
            return torch.randn(rows, heads, bufs.d, generator=gen, device=device, dtype=torch.float32).to(dtype)

        out.append((seg, rnd(seg.total_q, int(width)), rnd(seg.total_k, kvh), rnd(seg.total_k, kvh),
                    rnd(seg.total_q, int(width))))
    return out


def time_variants(fns: dict, device, cfg: TileOverheadConfig) -> dict:
    """Median ms of every ``(variant, pass)``: ``cfg.rounds`` interleaved rounds, each of
    :func:`~experiments.measured.gpu_common.time_calls_within` (``target_ms / rounds``)."""
    got: dict = {k: [] for k in fns}
    for r in range(cfg.rounds):
        for key, fn in fns.items():
            got[key] += time_calls_within(fn, device, cfg.warmup if r == 0 else 0, cfg.repeats,
                                          cfg.target_ms / cfg.rounds).tolist()
    return {k: summarize_ms(np.asarray(v)) for k, v in got.items()}


def method_rows(method: str, cfg: TileOverheadConfig, window, profile, backend, dtype, device) -> list[dict]:
    """Plan ``window`` with ``method``, pick the worker, time the three variants (module docstring)."""
    st, shape = cfg.setting, make_shape(cfg.q_heads, cfg.kv_heads, cfg.head_dim)
    plans = make_planner(method, st, profile=profile).plan_window(window, st.par(), shape)
    if cfg.step >= len(plans):
        raise ValueError(f"step {cfg.step} out of range: the window has {len(plans)} GA steps")
    plan = plans[cfg.step]
    pool, worker, pieces, sched = pick_worker(plan, shape, cfg.worker)
    q_local, n_q = local_rows(pieces["q_tok"], pieces["q_len"])
    kv_local, n_kv = local_rows(pieces["kv_tok"], pieces["kv_len"])
    calls = worker_calls(pieces, shape, sched, q_local, kv_local)
    calls = [c._replace(q_idx=c.q_idx.to(device), kv_idx=c.kv_idx.to(device)) for c in calls]
    bufs = WorkerBuffers(n_q, n_kv, shape, dtype, device, cfg.seed)
    whole = one_call_batches(pieces, shape, bufs, dtype, device, cfg.seed)
    flops = float(np.sum(attention_flops(pieces["area"].astype(np.float64), 1, shape.head_dim) * pieces["heads"]))
    call_flops = sum(float(np.sum(attention_flops(segment_areas(c.seg), c.qh, shape.head_dim))) for c in calls)
    if not np.isclose(call_flops, flops, rtol=1e-9):
        raise ValueError(f"the calls carry {call_flops:.6g} FLOPs but the worker's segments {flops:.6g}")
    times = time_variants(variant_fns(calls, whole, bufs, backend), device, cfg)
    cost = build_cost_model(profile, st.par()).price(plan)
    pred = {"fwd": float(cost.compute_fwd_ms[worker]), "bwd": float(cost.compute_bwd_ms[worker])}
    base = {"method": method, "pool": int(pool.pool_index), "worker": int(worker), "pipeline_chunks": int(plan.pipeline_chunks),
            "segments": len(pieces["q_len"]), "tile_widths": " ".join(str(w) for w in sorted(set(pieces["heads"].tolist()))),
            "q_tokens": int(pieces["q_len"].sum()), "kv_tokens": int(pieces["kv_len"].sum()), "flops_fwd": flops}
    rows = []
    for variant in VARIANTS:
        ncalls = len(calls) if variant != "one-call" else len(whole)
        hpc = sorted({c.qh for c in calls}) if variant != "one-call" else sorted({int(w) for w in pieces["heads"]})
        for pas in ("fwd", "bwd"):
            t = times[(variant, pas)]
            rows.append({**base, "variant": variant, "pass": pas, "calls": ncalls,
                         "heads_per_call": " ".join(map(str, hpc)), **t,
                         "ratio_to_one_call": t["ms"] / times[("one-call", pas)]["ms"],
                         "predicted_ms": pred[pas] if variant == "calls" else np.nan})
    return rows


def segment_areas(seg: Segments) -> np.ndarray:
    """Causal (query, key) pairs per head of each segment (its rows are the last of its key prefix)."""
    return (sample_area(seg.kv_lens) - sample_area(seg.kv_lens - seg.q_lens)).astype(np.float64)


def summarize(df: pd.DataFrame) -> dict:
    """Per method: fwd+bwd ratios of ``runtime`` and ``calls`` to ``one-call``, and the goal."""
    out = {}
    for method, g in df.groupby("method", sort=False):
        tot = g.groupby("variant")["ms"].sum()
        out[method] = {"worker": int(g["worker"].iloc[0]), "calls": int(g[g.variant == "calls"]["calls"].iloc[0]),
                       "runtime_ratio": float(tot["runtime"] / tot["one-call"]),
                       "calls_ratio": float(tot["calls"] / tot["one-call"]),
                       "one_call_ms": float(tot["one-call"]), "runtime_ms": float(tot["runtime"]),
                       "model_err_calls": float(g[g.variant == "calls"]["predicted_ms"].sum() / tot["calls"] - 1),
                       "within_goal": bool(tot["runtime"] / tot["one-call"] <= TARGET_RATIO)}
    return out


def plot_overhead(df: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    """Forward and backward ms per variant and method, with each bar's ratio to one call."""
    from experiments.common.plotting import save_figure, setup_style  # noqa: PLC0415  (selects Agg first)

    setup_style()
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, pas in zip(axes, ("fwd", "bwd")):
        sub = df[df["pass"] == pas]
        sns.barplot(data=sub, x="method", y="ms", hue="variant", hue_order=list(VARIANTS), ax=ax)
        for cont, variant in zip(ax.containers, VARIANTS):
            ratios = sub[sub.variant == variant].set_index("method")["ratio_to_one_call"]
            ax.bar_label(cont, labels=[f"{ratios.get(m, np.nan):.2f}x" for m in sub["method"].unique()], fontsize=7)
        ax.set_title(f"{pas}: one worker's attention", fontsize=9)
        ax.set_ylabel("ms (median)")
    fig.suptitle(f"tile-overhead: {df.attrs.get('device', '')}, {df.attrs.get('backend', '')}, "
                 f"{df.attrs.get('what', '')}", fontsize=9)
    save_figure(fig, path, caption=caption)


def run_tile_overhead(cfg: TileOverheadConfig, opts: MeasureOptions, profile: str = DEFAULT_PROFILE) -> dict:
    """Plan, time and write (module docstring).

    Returns:
        ``{"df", "summary", "paths", "info", "out_dir"}``.

    Raises:
        ValueError: bad device/backend/dtype/profile/workload, or a worker that is not in the plan.
    """
    dev = resolve_device(opts.device)
    dt = resolve_dtype(opts.dtype, dev)
    be = resolve_backend(opts.backend, dev)
    prof = load_profile(profile)
    info = device_info(dev, be)
    check_settings({cfg.setting.name: cfg.setting}, make_shape(cfg.q_heads, cfg.kv_heads, cfg.head_dim))
    windows = load_windows(cfg.workload, cfg.setting, cfg.window + 1, cfg.seed)
    out_dir = Path(opts.out) if opts.out is not None else RUNS_ROOT / "gpu" / device_slug(info) / "tile-overhead"
    config = {**asdict(cfg), "setting": setting_record(cfg.setting), "device": str(dev), "device_name": info.get("name"),
              "backend": be.name, "dtype": dtype_name(dt), "profile": prof.to_dict(), "torch": info["torch"]}
    run = ExperimentRun("tile_overhead", config, out_dir=out_dir, force=opts.force, quiet=opts.quiet)
    with cpu_threads(dev, opts.cpu_threads):
        rows = run.map(list(cfg.methods), lambda m: method_rows(m, cfg, windows[cfg.window], prof, be, dt, dev),
                       desc="tile-overhead")
    df = pd.DataFrame(rows)
    df.attrs.update({"device": info.get("name"), "backend": be.name,
                     "what": f"{cfg.workload} {cfg.setting.name} window {cfg.window} step {cfg.step}"})
    summary = {"device": info.get("name"), "backend": be.name, "dtype": dtype_name(dt), "profile": prof.name,
               "setting": cfg.setting.name, "target_ratio": TARGET_RATIO, "methods": summarize(df)}
    paths = run.finish(df, lambda d, p: plot_overhead(d, p, run_caption(run.config)), extra={"environment_device": info, "summary": summary})
    return {"df": df, "summary": summary, "paths": paths, "info": info, "out_dir": run.out_dir}


@click.command("tile-overhead")
@device_options()
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True,
              help="profile the planners plan with and the prediction uses (name or profile.json)")
@click.option("--methods", default="libra,libra-adaptive", show_default=True, help="planners, comma-separated")
@click.option("--workload", default="libra-prod", show_default=True, help="length preset or length file")
@click.option("--setting", type=click.Choice(sorted(SETTINGS)), default="256k", show_default=True,
              help="the paper's layout (or give --dp --cp --seq-len --gbs)")
@layout_options()
@tap_options("pool_size", "block_size", "head_split", "pipeline_chunks", per_setting=True)
@click.option("--window", type=click.IntRange(min=0), default=0, show_default=True, help="GBS window")
@click.option("--step", type=click.IntRange(min=0), default=0, show_default=True, help="GA step of the window")
@click.option("--worker", type=click.IntRange(min=0), default=None, help="worker to time (default: the most FLOPs)")
@click.option("--q-heads", type=int, default=32, show_default=True, help="query heads")
@click.option("--kv-heads", type=int, default=4, show_default=True, help="KV heads")
@click.option("--head-dim", type=int, default=128, show_default=True, help="head width")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="interleaved timing rounds")
@click.option("--target-ms", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="device time each variant and pass aims at, over all rounds")
@quick_option("tiny sizes (CPU smoke): DP 2, CP 2, S 2048, B 256, 4 q / 2 kv heads, d 32")
def tile_overhead(device, backend, dtype, warmup, repeats, rotate, rotate_mb, cpu_threads, seed, out, force, no_progress,
                  profile, methods, workload, setting, dp, cp, seq_len, gbs, pool_size, block_size, head_split,
                  pipeline_chunks, window, step, worker, q_heads, kv_heads, head_dim, rounds, target_ms, quick):
    """One worker's tiles run as the runtime runs them (gathers, Pipeliner calls, scatters) vs one varlen call."""
    del rotate, rotate_mb  # every variant reads the same buffers: nothing to rotate
    try:
        if quick:
            dp, cp, seq_len, gbs, block_size = 2, 2, 2048, 2, block_size or 256
            pipeline_chunks = pipeline_chunks or 2
            q_heads, kv_heads, head_dim, repeats, rounds, target_ms = 4, 2, 32, 2, 2, 50.0
        layout = given_layout(dp, cp, seq_len, gbs)
        st = custom_setting(**layout) if layout else SETTINGS[setting]
        st = with_tap(st, pool_size=pool_size, block_size=block_size, head_split=head_split,
                      pipeline_chunks=pipeline_chunks)
        cfg = TileOverheadConfig(methods=tuple(m.strip() for m in methods.split(",") if m.strip()), workload=workload,
                                 setting=st, window=window, step=step, worker=worker, q_heads=q_heads,
                                 kv_heads=kv_heads, head_dim=head_dim, seed=seed, warmup=warmup, repeats=repeats,
                                 rounds=rounds, target_ms=target_ms)
        opts = MeasureOptions(device=device, backend=backend, dtype=dtype, out=out,
                              force=force, quiet=no_progress, cpu_threads=cpu_threads)
        res = run_tile_overhead(cfg, opts, profile=profile)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    s = res["summary"]
    click.echo(f"tile-overhead: {s['device']} backend={s['backend']} dtype={s['dtype']} profile={s['profile']} "
               f"({workload}, {st.name}, window {window}, step {step})")
    for method, m in s["methods"].items():
        click.echo(f"  {method:>15} worker {m['worker']}: runtime {m['runtime_ms']:.4g} ms = {m['runtime_ratio']:.3f}x one "
                   f"call ({m['one_call_ms']:.4g} ms; goal <= {TARGET_RATIO}: {'met' if m['within_goal'] else 'NOT met'}); "
                   f"its {m['calls']} kernel calls alone {m['calls_ratio']:.3f}x; cost model vs those calls "
                   f"{m['model_err_calls']:+.1%}")
    click.echo(f"wrote {res['paths']['csv']}, {res['paths']['png']}")
