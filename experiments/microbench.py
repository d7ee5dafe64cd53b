"""`libra-bench microbench`: the isolated core-attention experiment of Libra sec. 6.3, measured.

Every worker runs its complete core-attention call for each step (GA index) of each GBS window:
forward + backward (or forward only), communication and computation, for every method:

* ``ulysses``: the deployed Ulysses runtime (:mod:`baselines.ulysses_runtime`, all-to-all);
* every other registry planner (``libra``, ``libra-tap``, ``libra-tap-vrsp``, ``distca``,
  ``wlb-llm``): its Plans executed by :func:`libra.runtime.attention.libra_attention`.

A step's straggler is the slowest worker's time (median over ``--repeats`` barrier-aligned
repetitions of the per-repetition maximum). Launch:

* ``libra-bench microbench --nproc 4 ...``: spawns 4 local processes (gloo on CPU);
* ``torchrun --nnodes N --nproc-per-node 8 -m experiments.cli microbench --device cuda ...``:
  one process per GPU, NCCL (unverified in sessions without GPUs).

Outputs (``results/microbench/`` or ``--out``): ``microbench.csv`` (the straggler CSV schema plus
``measured = True``, backend, device, dtype and per-step memory; bytes per link class are NaN, the
measured ``bytes_sent`` replaces them; ``balance_bound_ms`` is the measured mean worker compute), ``microbench_summary.csv``
(per method: mean / max straggler, speedup over Ulysses), ``microbench.png`` and ``run.json``.

The TAP options (``--pool-size``, ``--block-size``, ``--head-split``, ``--tau``,
``--pipeline-chunks``; ``--chunks`` is kept as an alias of the last) come from
:func:`experiments.options.tap_options`, with this command's small defaults (:data:`DEFAULT_TAP`).
Every planner gets the options of that one TapConfig it takes
(:func:`baselines.registry.options_from_tap`: P for Libra's variants, M for ``libra`` and
``distca``); ``run.json`` records the layout under ``config.tap``.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.options import tap_options
from experiments.runner import ExperimentRun, atomic_write_text, stable_hash
from libra.config import ParallelConfig, TapConfig, check_layout

METHODS = ("ulysses", "wlb-llm", "distca", "libra-tap", "libra-tap-vrsp", "libra")
DTYPES = ("fp32", "bf16", "fp64", "fp16")
# `libra-bench straggler`'s CSV columns, in its order (measured extras follow them)
STRAGGLER_COLUMNS = ["workload", "setting", "method", "window", "step", "straggler_ms", "compute_ms",
                     "comm_exposed_ms", "straggler_worker", "straggler_pool", "comm_serial_ms", "mean_worker_ms",
                     "balance_bound_ms", "bytes_nvlink", "bytes_roce", "bytes_inter_supernode", "pipeline_chunks",
                     "bound_ratio"]
DEFAULT_TAP = TapConfig(pool_size=2, block_size=256, pipeline_chunks=2)
"""microbench's TAP layout at its CPU sizes: P = 2, B = 256, TapConfig's H and tau, M = 2."""
TAP_FIELDS = ("pool_size", "block_size", "head_split", "tau", "pipeline_chunks")
"""The TapConfig fields microbench takes as options."""


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------


def make_config(*, dp, cp, seq_len, gbs, tap: TapConfig, q_heads, kv_heads, head_dim, dtype, device, backend, comm,
                methods, windows, workload, seed, repeats, warmup, backward, timeout) -> dict:
    """Validated, JSON-ready configuration (raises ValueError naming the bad value); the TAP layout
    is ``config["tap"]`` (:func:`tap_of` reads it back)."""
    from libra.runtime.executor import COMM_MODES  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    par = ParallelConfig(dp=dp, cp=cp, gbs=gbs, seq_len=seq_len)
    shape = AttentionShape(q_heads, kv_heads, head_dim, 2)
    check_layout(par, tap, shape)
    for name, value, low in (("windows", windows, 1), ("repeats", repeats, 1), ("warmup", warmup, 0),
                             ("seed", seed, 0)):
        if value < low:
            raise ValueError(f"--{name} must be >= {low}, got {value}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if comm not in COMM_MODES:
        raise ValueError(f"unknown comm mode {comm!r}; choose from {', '.join(COMM_MODES)}")
    if not timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {timeout}")
    method_list = tuple(m.strip() for m in methods.split(",") if m.strip()) if isinstance(methods, str) else tuple(methods)
    if not method_list:
        raise ValueError("empty --methods")
    for m in method_list:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if "ulysses" in method_list and q_heads % cp:
        raise ValueError(f"ulysses needs CP={cp} to divide q_heads={q_heads}")
    return {"dp": dp, "cp": cp, "seq_len": seq_len, "gbs": gbs, "tap": asdict(tap), "q_heads": q_heads,
            "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype, "device": device, "backend": backend,
            "comm": comm, "methods": list(method_list), "windows": windows, "workload": workload, "seed": seed,
            "repeats": repeats, "warmup": warmup, "backward": bool(backward), "timeout": float(timeout)}


def tap_of(cfg: dict) -> TapConfig:
    """The TapConfig of a :func:`make_config` configuration."""
    return TapConfig(**cfg["tap"])


def planner_options(method: str, cfg: dict) -> dict:
    """The registry options of ``method``: those the run's TapConfig sets for it."""
    from baselines.registry import options_from_tap  # noqa: PLC0415

    return options_from_tap(method, tap_of(cfg))


# --------------------------------------------------------------------------------------------
# the per-rank benchmark
# --------------------------------------------------------------------------------------------


def _local_tensors(ranges, seq_ids, shape, dtype, device, seed):
    """Deterministic inputs of one worker: each local range seeded by (seed, seq_id, start)."""
    import torch  # noqa: PLC0415

    parts = {n: [] for n in ("q", "k", "v", "do")}
    for (s, a, b) in ranges:
        g = torch.Generator().manual_seed(int(stable_hash([seed, int(seq_ids[s]), int(a)]), 16) % 2**62)
        n = b - a
        parts["q"].append(torch.randn(n, shape.num_q_heads, shape.head_dim, generator=g))
        parts["k"].append(torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=g))
        parts["v"].append(torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=g))
        parts["do"].append(torch.randn(n, shape.num_q_heads, shape.head_dim, generator=g))
    return [torch.cat(parts[n]).to(device=device, dtype=dtype) for n in ("q", "k", "v", "do")]


def _time_calls(runner, q, k, v, do, repeats, warmup, backward, device, world_group):
    """Per repetition: barrier, then one complete core-attention call; returns seconds and stats."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    times, compute, wait, peak = [], [], [], 0
    for r in range(warmup + repeats):
        qq, kk, vv = (x.detach().requires_grad_(backward) for x in (q, k, v))
        stats = runner.stats
        if isinstance(stats, dict):
            for key in ("compute_s", "comm_wait_s"):
                stats[key] = 0.0
        else:
            stats.reset()
        dist.barrier(group=world_group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = runner(qq, kk, vv)
        if backward:
            out.backward(do)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if r >= warmup:
            times.append(dt)
            st = stats if isinstance(stats, dict) else vars(stats)
            compute.append(st["compute_s"])
            wait.append(st["comm_wait_s"])
            peak = max(peak, int(st["peak_transient_bytes"]))
    return np.array(times), np.array(compute), np.array(wait), peak


def bench_rank(rank: int, world: int, cfg: dict, keys: list) -> dict:
    """Run every (method, window) point of ``keys`` on this rank (process group initialised).

    Returns ``{key_hash: rows}`` on rank 0 (rows of every step) and ``{}`` elsewhere.
    """
    import torch  # noqa: PLC0415

    from baselines.registry import get_planner  # noqa: PLC0415
    from baselines.ulysses_runtime import UlyssesAttention  # noqa: PLC0415
    from libra.config import ParallelConfig  # noqa: PLC0415
    from libra.data.windows import gbs_windows  # noqa: PLC0415
    from libra.runtime.attention import prepare  # noqa: PLC0415
    from libra.runtime.groups import RankGrid, all_gather_single, build_groups  # noqa: PLC0415
    from libra.runtime.kernels import get_backend  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64, "fp16": torch.float16}[cfg["dtype"]]
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
        torch.cuda.set_device(device)
    backend = get_backend(cfg["backend"], device)
    par = ParallelConfig(dp=cfg["dp"], cp=cfg["cp"], gbs=cfg["gbs"], seq_len=cfg["seq_len"])
    shape = AttentionShape(cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"], torch.empty(0, dtype=dtype).element_size())
    pool_sizes = sorted({1, tap_of(cfg).pool_size, cfg["dp"]})
    groups = {p: build_groups(RankGrid(dp=cfg["dp"], cp=cfg["cp"], pool_size=p), timeout_s=cfg["timeout"])
              for p in pool_sizes}
    world_group = None
    me = groups[1].cp.worker
    windows = gbs_windows(cfg["workload"], cfg["seq_len"], cfg["gbs"], cfg["windows"], seed=cfg["seed"])
    out = {}
    for method, w in keys:
        planner = get_planner(method, **planner_options(method, cfg))
        plans = planner.plan_window(windows[w], par, shape)
        rows = []
        for plan in plans:
            pool = plan.pool_of_worker(me)
            P = len(pool.workers) // cfg["cp"]
            if method == "ulysses":
                seq = pool.sequences[0]
                runner = UlyssesAttention(seq.sample_lengths, groups[1].cp, shape.num_q_heads, shape.num_kv_heads,
                                          backend=backend)
                n = cfg["seq_len"] // cfg["cp"]
                c = me % cfg["cp"]
                ranges, seq_ids = [(0, c * n, (c + 1) * n)], [seq.seq_id]
                chunks = 1
            else:
                if P not in groups:
                    groups[P] = build_groups(RankGrid(dp=cfg["dp"], cp=cfg["cp"], pool_size=P), timeout_s=cfg["timeout"])
                runner = prepare(plan, groups[P].pool, backend=backend, comm=cfg["comm"], check_finite=False)
                ranges = runner.program.local_ranges
                seq_ids = [s.seq_id for s in pool.sequences]
                chunks = runner.program.chunks
            q, k, v, do = _local_tensors(ranges, seq_ids, shape, dtype, device, cfg["seed"])
            times, compute, wait, peak = _time_calls(runner, q, k, v, do, cfg["repeats"], cfg["warmup"],
                                                     cfg["backward"], device, world_group)
            st = runner.stats
            sent = st["sent_bytes"] if isinstance(st, dict) else sum(st.sent_bytes.values())
            sent = sent / max(1, cfg["warmup"] + cfg["repeats"]) if isinstance(st, dict) else sent
            mine = torch.tensor(np.concatenate([times, compute, wait, [peak, sent, P]]), dtype=torch.float64)
            allv = torch.zeros(world * mine.numel(), dtype=torch.float64, device=device)
            all_gather_single(allv, mine.to(device))
            allv = allv.view(world, -1).cpu()
            if rank == 0:
                rows.append(_step_row(method, w, plan.ga_index, allv.numpy(), cfg, chunks, backend.name, str(device)))
        if rank == 0:
            out[stable_hash([method, w])] = rows
    return out


def _step_row(method, window, step, allv, cfg, chunks, backend, device) -> dict:
    R = cfg["repeats"]
    times, compute, wait = allv[:, :R], allv[:, R:2 * R], allv[:, 2 * R:3 * R]
    peak, sent, P = allv[:, 3 * R], allv[:, 3 * R + 1], allv[:, 3 * R + 2]
    per_rep_max = times.max(axis=0)
    rep = int(np.argsort(per_rep_max)[len(per_rep_max) // 2])  # the median repetition
    w = int(np.argmax(times[:, rep]))
    return {"workload": cfg["workload"], "setting": "custom", "method": method, "window": int(window),
            "step": int(step), "straggler_ms": float(per_rep_max[rep] * 1e3), "compute_ms": float(compute[w, rep] * 1e3),
            "comm_exposed_ms": float(max(times[w, rep] - compute[w, rep], 0.0) * 1e3),
            "straggler_worker": w, "straggler_pool": int(w // (cfg["cp"] * max(1, int(P[w])))),
            "comm_serial_ms": float("nan"), "comm_wait_ms": float(wait[w, rep] * 1e3),
            "mean_worker_ms": float(times[:, rep].mean() * 1e3), "min_worker_ms": float(times[:, rep].min() * 1e3),
            # measured analogue of the simulator's perfect-balance bound: mean worker compute
            "balance_bound_ms": float(compute[:, rep].mean() * 1e3),
            "bytes_nvlink": float("nan"), "bytes_roce": float("nan"), "bytes_inter_supernode": float("nan"),
            "bound_ratio": float(per_rep_max[rep] / max(compute[:, rep].mean(), 1e-12)),
            "bytes_sent": int(sent.sum()), "peak_transient_bytes": int(peak.max()), "pipeline_chunks": int(chunks),
            "measured": True, "backend": backend, "device": device.split(":")[0], "dtype": cfg["dtype"],
            "repeats": R, "backward": cfg["backward"]}


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------


def run_spawned(nproc: int, cfg: dict, keys: list, deadline_s: float) -> dict:
    """Spawn ``nproc`` gloo ranks locally; returns rank 0's rows per point.

    Raises:
        RuntimeError: a rank failed (its traceback included) or the run passed its deadline.
    """
    from libra.runtime.launch import RankDeadlineError, run_local_ranks  # noqa: PLC0415

    try:
        results = run_local_ranks(bench_rank, nproc, cfg, keys, deadline_s=deadline_s, pg_timeout_s=cfg["timeout"],
                                  what="microbench ranks")
    except RankDeadlineError as exc:
        raise RuntimeError(str(exc)) from exc
    for r, res in enumerate(results):
        if "error" in res:
            raise RuntimeError(f"microbench rank {r} failed: {res['error']}\n{res['traceback']}")
    return results[0]["ok"]


def run_torchrun(cfg: dict, keys: list) -> dict | None:
    """Inside torchrun: init from the environment (NCCL on CUDA, gloo on CPU); rows on rank 0."""
    import torch.distributed as dist  # noqa: PLC0415

    backend = "nccl" if cfg["device"].startswith("cuda") else "gloo"
    dist.init_process_group(backend, timeout=_dt.timedelta(seconds=cfg["timeout"]))
    try:
        out = bench_rank(dist.get_rank(), dist.get_world_size(), cfg, keys)
        return out if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# summary and plot
# --------------------------------------------------------------------------------------------


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for method, g in df.groupby("method", sort=False):
        rows.append({"method": method, "steps": len(g), "mean_ms": g["straggler_ms"].mean(),
                     "max_ms": g["straggler_ms"].max(), "compute_ms": g["compute_ms"].mean(),
                     "comm_exposed_ms": g["comm_exposed_ms"].mean(), "mean_worker_ms": g["mean_worker_ms"].mean(),
                     "peak_transient_mib": g["peak_transient_bytes"].max() / 2**20,
                     "backend": g["backend"].iloc[0], "device": g["device"].iloc[0]})
    out = pd.DataFrame(rows)
    if "ulysses" in set(out["method"]):
        base = out.set_index("method").loc["ulysses"]
        out["mean_speedup"] = base["mean_ms"] / out["mean_ms"]
        out["max_speedup"] = base["max_ms"] / out["max_ms"]
        out["peak_vs_ulysses"] = out["peak_transient_mib"] / base["peak_transient_mib"]
    return out


def plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    summary = summarize(df)
    long = summary.melt(id_vars=["method"], value_vars=["mean_ms", "max_ms"], var_name="metric", value_name="ms")
    long["metric"] = long["metric"].str.replace("_ms", "")
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.barplot(data=long, x="method", y="ms", hue="metric", ax=ax)
    ax.set_ylabel("straggler core-attention time per step (ms)")
    ax.set_title(f"measured: {df['backend'].iloc[0]} on {df['device'].iloc[0]}, {df['dtype'].iloc[0]}")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# command
# --------------------------------------------------------------------------------------------


def _missing_point(key):
    raise RuntimeError(f"point {key} was neither cached nor computed by the ranks")



@click.command("microbench", context_settings={"default_map": {f: getattr(DEFAULT_TAP, f) for f in TAP_FIELDS}})
@click.option("--nproc", type=int, default=None, help="Spawn this many local gloo processes (= DP*CP). "
              "Omit under torchrun.")
@click.option("--dp", type=int, default=2, show_default=True)
@click.option("--cp", type=int, default=2, show_default=True)
@click.option("--seq-len", type=int, default=2048, show_default=True, help="Tokens per packed sequence S.")
@click.option("--gbs", type=int, default=4, show_default=True, help="Packed sequences per window.")
@tap_options(*TAP_FIELDS)
@click.option("--chunks", type=click.IntRange(min=1), default=None, hidden=True, help="Alias of --pipeline-chunks.")
@click.option("--q-heads", type=int, default=8, show_default=True)
@click.option("--kv-heads", type=int, default=2, show_default=True)
@click.option("--head-dim", type=int, default=32, show_default=True)
@click.option("--dtype", default="fp32", show_default=True, help=f"One of {', '.join(DTYPES)}.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda (one GPU per rank under torchrun).")
@click.option("--backend", default="auto", show_default=True, help="Kernel backend (auto resolves per device).")
@click.option("--comm", default="p2p", show_default=True, help="p2p (batch_isend_irecv) or a2a.")
@click.option("--methods", default="ulysses,libra-tap,libra", show_default=True, help="Comma list.")
@click.option("--windows", type=int, default=1, show_default=True)
@click.option("--workload", default="libra-prod", show_default=True, help="Length preset or length file.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed repetitions per step.")
@click.option("--warmup", type=int, default=1, show_default=True)
@click.option("--forward-only", is_flag=True, help="Time forward only (default: forward + backward).")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Collective timeout (s).")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Output folder.")
@click.option("--force", is_flag=True, help="Recompute cached points.")
@click.option("--no-progress", is_flag=True)
@click.pass_context
def microbench(ctx, nproc, dp, cp, seq_len, gbs, pool_size, block_size, head_split, tau, pipeline_chunks, chunks,
               q_heads, kv_heads, head_dim, dtype, device, backend, comm, methods, windows, workload, seed, repeats,
               warmup, forward_only, timeout, out, force, no_progress):
    """Measured core-attention straggler per step (Libra sec. 6.3) for Ulysses and Libra."""
    from experiments.gpu_common import chunks_alias  # noqa: PLC0415  (imports torch: keeps `--help` fast)

    pipeline_chunks = chunks_alias(ctx, pipeline_chunks, chunks)
    try:
        tap = replace(DEFAULT_TAP, pool_size=pool_size, block_size=block_size, head_split=head_split, tau=tau,
                      pipeline_chunks=pipeline_chunks)
        cfg = make_config(dp=dp, cp=cp, seq_len=seq_len, gbs=gbs, tap=tap, q_heads=q_heads, kv_heads=kv_heads,
                          head_dim=head_dim, dtype=dtype, device=device, backend=backend, comm=comm,
                          methods=methods, windows=windows, workload=workload, seed=seed, repeats=repeats,
                          warmup=warmup, backward=not forward_only, timeout=timeout)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and nproc is None
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else nproc
    if world is None:
        raise click.UsageError("pass --nproc N (local spawn) or launch under torchrun")
    if world != dp * cp:
        raise click.UsageError(f"--nproc/WORLD_SIZE={world} must equal DP*CP={dp * cp}")
    if device.startswith("cuda") and not under_torchrun:
        raise click.UsageError("--device cuda needs one GPU per rank: launch under torchrun")
    run = ExperimentRun("microbench", cfg, out_dir=out, force=force, quiet=no_progress)
    keys = [[m, w] for m in cfg["methods"] for w in range(windows)]
    todo = [k for k in keys if run.cached(k) is None]
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if todo:
        got = run_torchrun(cfg, todo) if under_torchrun else run_spawned(world, cfg, todo, deadline_s=timeout * 4)
        if got is None:  # non-zero torchrun ranks write nothing
            return
        for k in todo:
            run.record(k, got[stable_hash(k)])
    rows = run.map(keys, _missing_point, desc="microbench")
    df = pd.DataFrame(rows)
    df = df[STRAGGLER_COLUMNS + [c for c in df.columns if c not in STRAGGLER_COLUMNS]]
    summary = summarize(df)
    extra = {"measured": True, "launch": "torchrun" if under_torchrun else f"spawn --nproc {world}",
             "world_size": world, "kernel_backend": df["backend"].iloc[0], "device": df["device"].iloc[0],
             "bench_wall_s": round(time.perf_counter() - t0, 3),
             # CPU timings on a shared host are only as quiet as the host: record its load
             "loadavg_1m": [load_start, os.getloadavg()[0] if hasattr(os, "getloadavg") else None]}
    paths = run.finish(df, plot=plot, extra=extra)
    atomic_write_text(run.out_dir / "microbench_summary.csv", summary.to_csv(index=False))
    cols = [c for c in ("method", "steps", "mean_ms", "max_ms", "compute_ms", "comm_exposed_ms", "peak_transient_mib",
                        "mean_speedup", "max_speedup") if c in summary]
    click.echo(summary[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    click.echo(f"backend {extra['kernel_backend']} on {extra['device']}; wrote {paths['csv']}")
