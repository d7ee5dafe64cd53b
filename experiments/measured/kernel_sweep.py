"""`libra-bench kernel-sweep`: per-call attention kernel times over segment length x heads per call.

Libra sec. 3.3 (Figure 5) says fewer heads per call cost less throughput than shorter blocks; how
much they cost decides whether a planner that runs thin head slices (``libra-adaptive``'s one-KV-head
tiles, 1 query head per call at M = 8) gains or loses. ``calibrate`` measures the two curves of
Figure 5 through one point each; this command measures the grid, as raw per-call rows from which
any kernel model (the profile's ``h(n)``, an occupancy model over thread blocks and waves) can be
fitted. Every call is causal and bottom-right aligned; ``h`` query heads read ``max(1, h / group)``
KV heads (contiguous GQA groups of ``--q-heads / --kv-heads``). Call layouts:

* ``single``: one document of ``L`` tokens per call;
* ``packed``: ``--packed-tokens / L`` documents of ``L`` tokens (a tile batch's shape; only for
  ``L < --packed-tokens``);
* ``mixed``: one document of ``L`` plus ``L / --mixed-short`` documents of ``--mixed-short``
  tokens, and ``short-batch``: those short documents alone. A FlashAttention varlen grid is sized
  by the call's longest segment and the blocks past a short segment exit early, so
  ``mixed / (single + short-batch)`` says whether a call costs the sum of its segments (the
  printout and ``run.json`` give it).

Timing as ``calibrate`` (CUDA events, medians, rotated inputs), except that each point's timed
calls are cut to about ``--target-ms`` of device time (:func:`~experiments.measured.gpu_common.time_calls_within`):
a 256K-token, 32-head backward is timed once after an untimed probe. Points run cheapest first;
with ``--budget-s`` a point whose estimated cost would pass the budget is skipped and recorded
(``status`` ``skipped``), so a time-boxed run still writes its CSV.

Fits (``run.json`` ``summary``): per layout, length and pass, the ``heads_half`` ``c`` of
``h(n) = n / (n + c)`` (normalised at the largest heads measured) and its worst error; and one
``c`` over every single-document length (median error), which ``--profile`` users can set.
Outputs: ``kernel_sweep.csv`` (one row per call geometry and pass, with backend, kernel version,
device and SM count), ``kernel_sweep.png`` and ``run.json``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import numpy as np
import pandas as pd
import torch

from experiments.common.options import IntListType, SizeType, quick_option
from experiments.common.runner import RUNS_ROOT, ExperimentRun
from experiments.common.runs_table import run_caption
from experiments.measured.calibrate import fit_heads_ratio
from experiments.measured.gpu_common import (
    KernelGeometry,
    device_info,
    device_options,
    device_slug,
    dtype_name,
    make_inputs,
    resolve_backend,
    resolve_device,
    resolve_dtype,
    rotation_sets,
    summarize_ms,
    synchronize,
    time_calls_within,
)
from libra.runtime.kernels import Segments
from libra.workload import attention_flops, kv_heads_per_call, sample_area

LAYOUTS = ("single", "packed", "mixed", "short-batch")
ESTIMATE_FLOPS = 1e13
"""Forward FLOPs of a point long enough (tens of ms on a GPU) to extrapolate the budget from."""


@dataclass(frozen=True)
class KernelSweepConfig:
    """What `kernel-sweep` measures (tokens; heads are query heads per call).

    Raises:
        ValueError: any bad value, naming it.
    """

    lengths: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
    heads: tuple[int, ...] = (1, 2, 4, 8, 32)
    q_heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    packed_tokens: int = 65536
    mixed_lengths: tuple[int, ...] = (16384, 65536)
    mixed_short: int = 1024
    warmup: int = 3
    repeats: int = 10
    target_ms: float = 300.0
    rotate: int = 4
    rotate_mb: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("q_heads", "kv_heads", "head_dim", "packed_tokens", "mixed_short", "repeats", "rotate",
                     "rotate_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if not self.target_ms > 0:
            raise ValueError(f"target_ms must be > 0, got {self.target_ms!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide q_heads={self.q_heads}")
        lengths = tuple(sorted({int(x) for x in self.lengths}))
        mixed = tuple(sorted({int(x) for x in self.mixed_lengths}))
        if not lengths or lengths[0] < 1:
            raise ValueError(f"lengths must be positive, got {list(self.lengths)}")
        heads = tuple(sorted({int(x) for x in self.heads}))
        if len(heads) < 2:
            raise ValueError(f"the heads fit needs >= 2 heads per call, got {list(self.heads)}")
        for h in heads:
            if h < 1 or h > self.q_heads:
                raise ValueError(f"heads per call {h} must be in 1..q_heads={self.q_heads}")
            kv_heads_per_call(h, self.q_heads // self.kv_heads)
        for L in mixed:
            if L <= self.mixed_short or L % self.mixed_short:
                raise ValueError(f"mixed length {L} must be a multiple of mixed_short={self.mixed_short} above it")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "heads", heads)
        object.__setattr__(self, "mixed_lengths", mixed)

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    def keys(self) -> list[dict]:
        """Every point, cheapest (fewest forward FLOPs) first."""
        keys = [{"layout": "single", "length": L, "heads": h} for L in self.lengths for h in self.heads]
        keys += [{"layout": "packed", "length": L, "heads": h} for L in self.lengths
                 if L < self.packed_tokens for h in self.heads]
        keys += [{"layout": lay, "length": L, "heads": h} for L in self.mixed_lengths for h in self.heads
                 for lay in ("mixed", "short-batch")]
        return sorted(keys, key=lambda k: (point_flops(k, self), LAYOUTS.index(k["layout"]), k["length"], k["heads"]))


def geometry(layout: str, length: int, cfg: KernelSweepConfig) -> Segments:
    """The varlen batch of one call of ``layout`` (module docstring)."""
    if layout == "single":
        lens = [length]
    elif layout == "packed":
        lens = [length] * max(1, cfg.packed_tokens // length)
    elif layout == "mixed":
        lens = [length] + [cfg.mixed_short] * (length // cfg.mixed_short)
    elif layout == "short-batch":
        lens = [cfg.mixed_short] * (length // cfg.mixed_short)
    else:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    return Segments(lens, lens)


def point_flops(key: dict, cfg: KernelSweepConfig) -> float:
    """Forward FLOPs of one point's call."""
    seg = geometry(key["layout"], int(key["length"]), cfg)
    return float(np.sum(attention_flops(sample_area(seg.q_lens).astype(np.float64), key["heads"], cfg.head_dim)))


def segment_text(seg: Segments) -> str:
    """``65536``, ``1024x64`` or ``16384+1024x16``: the segment lengths of a call, run-length coded."""
    return "+".join(f"{lq}x{n}" if n > 1 else str(lq) for _, n, lq, _ in seg.runs())


def measure_point(key: dict, backend, cfg: KernelSweepConfig, device, dtype) -> list[dict]:
    """Rows (forward, backward) of one point; a point that does not fit in memory is NaN."""
    seg = geometry(key["layout"], int(key["length"]), cfg)
    heads = int(key["heads"])
    kvh = kv_heads_per_call(heads, cfg.group)
    geom = KernelGeometry(heads, kvh, cfg.head_dim, dtype, device)
    area = float(np.sum(sample_area(seg.q_lens)))
    res: dict = {}
    try:
        n = rotation_sets(seg, geom, cfg.rotate, cfg.rotate_mb << 20)
        sets = make_inputs(seg, geom, n,
                           seed=cfg.seed + 131 * int(key["length"]) + heads + 7 * LAYOUTS.index(key["layout"]),
                           backend=backend)

        def fwd(i):
            s = sets[i % n]
            with torch.no_grad():
                backend.forward(s.q, s.k, s.v, seg)

        def bwd(i):
            s = sets[i % n]
            backend.backward(s.dout, s.q, s.k, s.v, s.out, s.lse, seg)

        for pas, fn in (("fwd", fwd), ("bwd", bwd)):
            res[pas] = summarize_ms(time_calls_within(fn, device, cfg.warmup, cfg.repeats, cfg.target_ms))
        res["rotation"] = n
        status = "ok"
    except torch.OutOfMemoryError:
        status = "out of memory"
    finally:
        sets = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return point_rows(key, seg, heads, kvh, area, cfg, res, status)


def point_rows(key: dict, seg: Segments, heads: int, kvh: int, area: float, cfg: KernelSweepConfig, res: dict,
               status: str) -> list[dict]:
    """The CSV rows of one point (NaN times unless ``status`` is ``ok``)."""
    nan = {"ms": np.nan, "ms_p10": np.nan, "ms_p90": np.nan, "ms_min": np.nan, "repeats": 0}
    rows = []
    for pas in ("fwd", "bwd"):
        s = res.get(pas, nan)
        flops = float(attention_flops(area, heads, cfg.head_dim, backward=pas == "bwd"))
        rows.append({"layout": key["layout"], "length": int(key["length"]), "segments": len(seg),
                     "segment_lengths": segment_text(seg), "q_tokens": seg.total_q, "heads": heads, "kv_heads": kvh,
                     "head_dim": cfg.head_dim, "pass": pas, **s, "flops": flops,
                     "tflops": flops / (s["ms"] * 1e-3) / 1e12, "rotation": res.get("rotation", 0), "status": status})
    return rows


# --------------------------------------------------------------------------------------------
# fits
# --------------------------------------------------------------------------------------------


def heads_fits(df: pd.DataFrame) -> pd.DataFrame:
    """Per (layout, length, pass): ``c`` of ``h(n)`` fitted to that length's heads, its worst error,
    and the throughput of the fewest heads relative to the most (``min_heads_ratio``)."""
    ok = df[(df.status == "ok") & np.isfinite(df["tflops"])]
    out = []
    for (lay, L, pas), g in ok.groupby(["layout", "length", "pass"]):
        if g["heads"].nunique() < 2:
            continue
        g = g.sort_values("heads")
        ref = int(g["heads"].max())
        ratio = g["tflops"].to_numpy() / float(g.loc[g["heads"] == ref, "tflops"].iloc[0])
        c, err = fit_heads_ratio(g["heads"].to_numpy(), ratio, ref)
        out.append({"layout": lay, "length": int(L), "pass": pas, "reference_heads": ref, "heads_half": c,
                    "worst_rel_err": err, "min_heads": int(g["heads"].min()), "min_heads_ratio": float(ratio[0])})
    out.sort(key=lambda r: (LAYOUTS.index(r["layout"]), r["length"], r["pass"] != "fwd"))
    return pd.DataFrame(out)


def joint_heads_half(df: pd.DataFrame, layout: str = "single") -> dict:
    """One ``c`` over every length of ``layout`` per pass (median relative error over all points)."""
    ok = df[(df.status == "ok") & (df.layout == layout) & np.isfinite(df["tflops"])]
    out = {}
    for pas, g in ok.groupby("pass"):
        heads, ratio, ref = [], [], int(g["heads"].max())
        for _, gl in g.groupby("length"):
            if ref not in set(gl["heads"]):
                continue
            base = float(gl.loc[gl["heads"] == ref, "tflops"].iloc[0])
            heads += gl["heads"].tolist()
            ratio += (gl["tflops"] / base).tolist()
        if heads:
            c, err = fit_heads_ratio(heads, ratio, ref, stat="median")
            out[pas] = {"heads_half": c, "median_rel_err": err, "reference_heads": ref, "points": len(heads)}
    return out


def mixed_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """``mixed / (single + short-batch)`` per length, heads and pass: below 1, a call with one long
    and many short segments costs less than its parts run alone."""
    ok = df[df.status == "ok"].set_index(["layout", "length", "heads", "pass"])["ms"]
    out = []
    for (lay, L, h, pas), ms in ok.items():
        if lay != "mixed" or ("single", L, h, pas) not in ok or ("short-batch", L, h, pas) not in ok:
            continue
        parts = ok[("single", L, h, pas)] + ok[("short-batch", L, h, pas)]
        out.append({"length": int(L), "heads": int(h), "pass": pas, "mixed_ms": float(ms), "parts_ms": float(parts),
                    "ratio": float(ms / parts)})
    return pd.DataFrame(out)


# --------------------------------------------------------------------------------------------
# figure and driver
# --------------------------------------------------------------------------------------------


def plot_sweep(df: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    """TFLOP/s against segment length, one line per heads per call; single and packed, fwd and bwd."""
    from experiments.common.plotting import save_figure, setup_style  # noqa: PLC0415  (selects Agg first)

    setup_style()
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    ok = df[(df.status == "ok") & df.layout.isin(["single", "packed"])]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for i, lay in enumerate(("single", "packed")):
        for j, pas in enumerate(("fwd", "bwd")):
            ax = axes[i, j]
            sub = ok[(ok.layout == lay) & (ok["pass"] == pas)]
            if len(sub):
                sns.lineplot(data=sub, x="length", y="tflops", hue="heads", style="heads", markers=True,
                             dashes=False, ax=ax, palette="viridis")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{lay} ({'one document' if lay == 'single' else df.attrs.get('packed', '')}), {pas}",
                         fontsize=9)
            ax.set_xlabel("segment length (tokens)")
            ax.set_ylabel("TFLOP/s")
    fig.suptitle(f"kernel-sweep: {df.attrs.get('device', '')}, {df.attrs.get('backend', '')}, "
                 f"{df.attrs.get('shape', '')}", fontsize=10)
    save_figure(fig, path, caption=caption)


def run_kernel_sweep(cfg: KernelSweepConfig, device: str = "auto", backend: str = "auto", dtype: str = "auto",
                     out: str | Path | None = None, force: bool = False, quiet: bool = True,
                     budget_s: float | None = None) -> dict:
    """Measure every point (cheapest first, within ``budget_s``), fit and write (module docstring).

    Returns:
        ``{"df", "summary", "paths", "info", "out_dir"}``.

    Raises:
        ValueError: bad device/backend/dtype, CUDA requested without CUDA, or a non-positive budget.
    """
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s!r}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    be = resolve_backend(backend, dev)
    info = device_info(dev, be)
    out_dir = Path(out) if out is not None else RUNS_ROOT / "gpu" / device_slug(info) / "kernel-sweep"
    config = {**asdict(cfg), "device": str(dev), "device_name": info.get("name"), "backend": be.name,
              "dtype": dtype_name(dt), "torch": info["torch"]}
    run = ExperimentRun("kernel_sweep", config, out_dir=out_dir, force=force, quiet=quiet)
    rows, skipped = measure_all(run, cfg, be, dev, dt, budget_s)
    df = pd.DataFrame(rows)
    for col, value in (("backend", be.name), ("kernel_version", info.get("kernel_version")),
                       ("device", info.get("name")), ("multiprocessors", info.get("multiprocessors")),
                       ("dtype", dtype_name(dt))):
        df[col] = value
    df.attrs.update({"device": info.get("name"), "backend": be.name, "packed": f"{cfg.packed_tokens} tokens per call",
                     "shape": f"{cfg.q_heads} q / {cfg.kv_heads} kv heads, d {cfg.head_dim}, {dtype_name(dt)}"})
    fits = heads_fits(df)
    summary = {"device": info.get("name"), "backend": be.name, "dtype": dtype_name(dt),
               "multiprocessors": info.get("multiprocessors"), "points": len(cfg.keys()), "skipped": skipped,
               "budget_s": budget_s, "joint_heads_half": joint_heads_half(df),
               "heads_half_by_length": fits.to_dict("records"), "mixed": mixed_ratios(df).to_dict("records")}
    paths = run.finish(df, lambda d, p: plot_sweep(d, p, run_caption(run.config)), extra={"environment_device": info, "summary": summary})
    return {"df": df, "summary": summary, "paths": paths, "info": info, "out_dir": run.out_dir}


def measure_all(run: ExperimentRun, cfg: KernelSweepConfig, backend, device, dtype,
                budget_s: float | None) -> tuple[list[dict], list[dict]]:
    """Every point's rows, cheapest first (cached points reused); a point whose estimated cost would
    pass ``budget_s`` is skipped and recorded in the rows, never in the point cache. The estimate is
    the point's FLOPs at the wall seconds per FLOP of the last measured point of at least
    :data:`ESTIMATE_FLOPS` (inputs, probe and timed calls included; below that, per-call overheads
    dominate and would over-estimate the long calls)."""
    from experiments.common.progress import progress  # noqa: PLC0415

    run.claim_folder()
    t0, rows, skipped = time.monotonic(), [], []
    sec_per_flop = 0.0
    keys = cfg.keys()
    with progress(total=len(keys), desc="kernel-sweep", disable=run.quiet) as bar:
        for key in keys:
            got = run.cached(key)
            flops = point_flops(key, cfg)
            if got is not None:
                run.reused += 1
            elif budget_s is not None and time.monotonic() - t0 + flops * sec_per_flop > budget_s:
                skipped.append(key)
                seg = geometry(key["layout"], int(key["length"]), cfg)
                heads = int(key["heads"])
                got = point_rows(key, seg, heads, kv_heads_per_call(heads, cfg.group),
                                 float(np.sum(sample_area(seg.q_lens))), cfg, {}, "skipped (budget)")
            else:
                t1 = time.monotonic()
                got = measure_point(key, backend, cfg, device, dtype)
                synchronize(device)
                run.record(key, got)
                run.computed += 1
                if flops >= ESTIMATE_FLOPS:
                    sec_per_flop = (time.monotonic() - t1) / flops
            rows += got
            bar.advance()
    return rows, skipped


def format_table(df: pd.DataFrame, layout: str = "single", pas: str = "fwd") -> str:
    """TFLOP/s per length (rows) and heads per call (columns), and each length's ``c``."""
    ok = df[(df.status == "ok") & (df.layout == layout) & (df["pass"] == pas)]
    if ok.empty:
        return f"  ({layout} {pas}: nothing measured)"
    table = ok.pivot_table(index="length", columns="heads", values="tflops")
    fits = heads_fits(df)
    fits = fits[(fits.layout == layout) & (fits["pass"] == pas)].set_index("length")
    lines = [f"  {layout} {pas}, TFLOP/s by heads per call:  " + " ".join(f"{int(h):>7}" for h in table.columns)
             + "   heads_half c"]
    for L, r in table.iterrows():
        c = f"{fits.loc[L, 'heads_half']:.3g}" if L in fits.index else "-"
        lines.append(f"  {int(L):>36}  " + " ".join(f"{v:7.4g}" if np.isfinite(v) else "      -" for v in r)
                     + f"   {c}")
    return "\n".join(lines)


@click.command("kernel-sweep")
@device_options()
@click.option("--lengths", type=IntListType(), default="512,1024,2048,4096,8192,16384,32768,65536,131072,262144",
              show_default=True, help="segment lengths (accepts 4K, 256K)")
@click.option("--heads", type=IntListType(), default="1,2,4,8,32", show_default=True, help="query heads per call")
@click.option("--q-heads", type=int, default=32, show_default=True, help="the model's query heads (GQA group with --kv-heads)")
@click.option("--kv-heads", type=int, default=4, show_default=True, help="the model's KV heads")
@click.option("--head-dim", type=int, default=128, show_default=True, help="head width")
@click.option("--packed-tokens", type=SizeType(), default=65536, show_default=True,
              help="tokens of a packed call (documents of one length)")
@click.option("--mixed-lengths", type=IntListType(), default="16384,65536", show_default=True,
              help="long document of the mixed calls")
@click.option("--mixed-short", type=SizeType(), default=1024, show_default=True, help="short documents of the mixed calls")
@click.option("--target-ms", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="device time the timed calls of one point and pass aim at")
@click.option("--budget-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="skip (and record) the points that would pass this many seconds")
@quick_option("tiny sizes (CPU smoke): lengths 128..1024, heads 1,2,4 of 4")
def kernel_sweep(device, backend, dtype, warmup, repeats, rotate, rotate_mb, cpu_threads, seed, out, force, no_progress,
                 lengths, heads, q_heads, kv_heads, head_dim, packed_tokens, mixed_lengths, mixed_short, target_ms,
                 budget_s, quick):
    """Per-call kernel time over segment length x heads per call x call layout (raw rows for a kernel model)."""
    if quick:
        lengths, heads, q_heads, kv_heads, head_dim, packed_tokens = [128, 256, 512, 1024], [1, 2, 4], 4, 2, 32, 1024
        mixed_lengths, mixed_short, warmup, repeats, rotate, target_ms = [512], 128, 1, 3, 2, 50.0
    try:
        cfg = KernelSweepConfig(lengths=tuple(lengths), heads=tuple(heads), q_heads=q_heads, kv_heads=kv_heads,
                                head_dim=head_dim, packed_tokens=packed_tokens, mixed_lengths=tuple(mixed_lengths),
                                mixed_short=mixed_short, warmup=warmup, repeats=repeats, target_ms=target_ms,
                                rotate=rotate, rotate_mb=rotate_mb, seed=seed)
        from experiments.measured.gpu_common import cpu_threads as threads  # noqa: PLC0415

        with threads(resolve_device(device), cpu_threads):
            res = run_kernel_sweep(cfg, device=device, backend=backend, dtype=dtype, out=out, force=force,
                                   quiet=no_progress, budget_s=budget_s)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    s, df = res["summary"], res["df"]
    click.echo(f"kernel-sweep: {s['device']} backend={s['backend']} dtype={s['dtype']} SMs={s['multiprocessors']}")
    for lay in ("single", "packed"):
        for pas in ("fwd", "bwd"):
            click.echo(format_table(df, lay, pas))
    for pas, j in s["joint_heads_half"].items():
        click.echo(f"one heads_half over every single-document length ({pas}): c = {j['heads_half']:.4g} "
                   f"(median |err| {j['median_rel_err']:.1%} over {j['points']} points)")
    for m in s["mixed"]:
        click.echo(f"mixed call {m['length']} + short, {m['heads']} heads, {m['pass']}: {m['ratio']:.3f} x its parts run alone")
    if s["skipped"]:
        click.echo(f"skipped {len(s['skipped'])} of {s['points']} points (--budget-s {s['budget_s']}): "
                   + ", ".join(f"{k['layout']} {k['length']}x{k['heads']}" for k in s["skipped"]))
    click.echo(f"wrote {res['paths']['csv']}, {res['paths']['png']}")
