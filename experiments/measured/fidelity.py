"""`libra-bench fidelity`: numerical fidelity of Libra's tile computation (Libra sec. 6.7).

FlashAttention's own tolerance rule (DESIGN.md sec. 7): in low precision (bf16),
``max|out - ref| <= 2 x max|out_pt - ref|`` where ``ref`` is computed in high precision from the
same (bf16-rounded) inputs and ``out_pt`` is plain PyTorch in bf16 (the ``math`` backend, softmax
in float32); FlashAttention's varlen tests allow 3x for gradients. The reference is float32 on
CUDA and float64 on CPU. Per plan (default: the ``libra`` planner on libra-prod windows, one pool
of P = 2, CP = 2) two levels are checked, forward output and the three gradients:

* **worker** -- the kernel backend over one worker's tile pieces (each query block attending to its
  sample's KV prefix, bottom-right causal, group-aligned head ranges) against the reference and
  the bf16 plain-PyTorch implementation on the same batch;
* **pool** -- a single-process emulation of the whole pool plan: every worker's pieces are
  gathered from the pool's packed q/k/v, computed with the backend, outputs and dQ written back
  to their tokens and dK/dV summed in bf16 onto the KV rows (as the runtime does after the
  reversed KV transfers), then compared with whole-sample attention (reference and bf16 plain
  PyTorch). An output or dQ element no tile wrote is an error. Transfers are not executed here;
  the gloo parity tests cover that path.

Outputs (``runs/gpu/<device>/fidelity/`` or ``--out``; ``scripts/gpu_check.sh`` writes
``results/gpu/<device>/fidelity/``): ``fidelity.csv`` (one row per window,
level, worker and quantity: errors, ratio, limit, pass), ``fidelity.png`` and ``run.json``.

The TAP options (``--pool-size``, ``--block-size``, ``--head-split``, ``--tau``) come from
:func:`experiments.common.options.tap_options`, with this command's defaults (:data:`DEFAULT_TAP`: P = 2,
B = 1024); the planner runs M = 1 (whatever M is, each head's arithmetic is the same). ``run.json`` records the
layout under ``config.tap``.
"""

from __future__ import annotations

import contextlib
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
    DTYPES,
    MeasureOptions,
    OnePoolLayout,
    cpu_threads,
    device_info,
    device_options,
    device_slug,
    dtype_name,
    resolve_backend,
    resolve_device,
    worker_pieces,
)
from libra.config import TapConfig
from libra.runtime.kernels import Segments, get_backend
from libra.tap.pipeline import schedule_for_pool
from libra.workload import AttentionShape

METHODS = ("libra", "libra-tap", "libra-tap-vrsp", "ulysses")
QUANTITIES = ("out", "dq", "dk", "dv")


DEFAULT_TAP = TapConfig(pool_size=2, block_size=1024, pipeline_chunks=1)
"""fidelity's TAP layout: one pool of P = 2 replicas, B = 1024, TapConfig's H and tau, M = 1."""

TAP_FIELDS = ("pool_size", "block_size", "head_split", "tau")
"""The TapConfig fields fidelity takes as options (M is always 1 here)."""


@dataclass(frozen=True)
class FidelityConfig(OnePoolLayout):
    """One pool (DP = GBS = P) of the scaled setting, limits of the tolerance rule.

    Attributes:
        tap: the TAP layout (P, B, H, tau, ...); planned with M = 1 whatever ``tap.pipeline_chunks``.

    Raises:
        ValueError: a bad size, a layout ``check_layout`` rejects, a limit < 1 or a floor <= 0.
    """

    method: str = "libra"
    workload: str = "libra-prod"
    seq_len: int = 8192
    cp: int = 2
    tap: TapConfig = DEFAULT_TAP
    q_heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    windows: int = 2
    seed: int = 0
    fwd_limit: float = 2.0
    grad_limit: float = 3.0
    floor: float = 1e-6

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        for name in ("seq_len", "cp", "q_heads", "kv_heads", "head_dim", "windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.seq_len % self.cp:
            raise ValueError(f"CP={self.cp} must divide seq_len={self.seq_len}")
        for name in ("fwd_limit", "grad_limit"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.floor > 0:
            raise ValueError(f"floor must be > 0, got {self.floor!r}")
        # the Pipeliner's head chunks split calls along heads only; each head's arithmetic is the
        # same whatever M is, so the planner runs M = 1 (OnePoolLayout.chunks): the same numbers
        # for any tile width
        self.check_tap()


def ref_dtype_for(name: str, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CUDA, float64 on CPU (DESIGN.md sec. 7: in fp32 the rule needs fp64)."""
    if name == "auto":
        return torch.float32 if device.type == "cuda" else torch.float64
    if name not in ("fp32", "fp64"):
        raise ValueError(f"reference dtype must be auto, fp32 or fp64, got {name!r}")
    return DTYPES[name]


@contextlib.contextmanager
def full_fp32_matmul():
    """Full-precision fp32 matmuls for the block (restored afterwards): with TF32 enabled the fp32
    reference would carry ~1e-3 errors and the rule would compare against a poor reference."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _rows(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(start, start + len)`` of every piece (int64)."""
    if not len(lens):
        return np.zeros(0, dtype=np.int64)
    total = int(lens.sum())
    offs = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
    return np.arange(total, dtype=np.int64) + offs


def _head_groups(pieces: dict, shape: AttentionShape):
    """Pieces grouped by their tile's query-head range, with the KV-head range each reads.

    Raises:
        ValueError: a head range whose query heads do not map onto its KV heads as contiguous
            GQA groups of equal size (the kernel's head mapping would then be wrong).
    """
    keys = np.stack([pieces["head_start"], pieces["head_end"]], axis=1)
    for h0, h1 in np.unique(keys, axis=0):
        h0, h1 = int(h0), int(h1)
        kv0, kv1 = shape.kv_head_range(h0, h1)
        qh, kvh = h1 - h0, kv1 - kv0
        heads = np.arange(h0, h1)
        if qh % kvh or np.any(heads // shape.group_size - kv0 != (heads - h0) // (qh // kvh)):
            raise ValueError(f"query heads [{h0}, {h1}) do not map onto KV heads [{kv0}, {kv1}) as equal "
                             f"contiguous GQA groups (group size {shape.group_size})")
        yield (h0, h1, kv0, kv1), np.nonzero((keys[:, 0] == h0) & (keys[:, 1] == h1))[0]


def _maxerr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.to(ref.dtype) - ref).abs().max()) if x.numel() else 0.0


def _both(backend, q, k, v, dout, seg):
    out, lse = backend.forward(q, k, v, seg)
    return (out, *backend.backward(dout, q, k, v, out, lse, seg))


def window_rows(w: int, plan, cfg: FidelityConfig, backend, low: torch.dtype, ref: torch.dtype, device) -> list[dict]:
    """All rows of one window's plan (see the module docstring)."""
    shape = plan.shape
    d = shape.head_dim
    math_be = get_backend("math", device)
    rows: list[dict] = []
    for pool in plan.pools:
        lengths = np.concatenate([s.sample_lengths for s in pool.sequences]).astype(np.int64)
        T = int(lengths.sum())
        gen = torch.Generator(device=device)
        gen.manual_seed(cfg.seed * 1000003 + w * 997 + int(pool.pool_index))

        q, k, v, dout = (torch.randn(T, h, d, generator=gen, device=device, dtype=torch.float32).to(low)
                         for h in (shape.num_q_heads, shape.num_kv_heads, shape.num_kv_heads, shape.num_q_heads))
        up = [x.to(ref) for x in (q, k, v, dout)]
        whole = Segments(lengths, lengths)
        ref_all = _both(math_be, *up, whole)
        pt_all = _both(math_be, q, k, v, dout, whole)

        # single-process emulation of the pool plan
        out_i = torch.full_like(q, float("nan"))
        dq_i = torch.full_like(q, float("nan"))
        dk_i, dv_i = torch.zeros_like(k), torch.zeros_like(v)
        sched = schedule_for_pool(pool, shape, plan.pipeline_chunks)
        for worker in pool.workers:
            pieces = worker_pieces(pool, shape, worker, sched)
            if not len(pieces["q_len"]):
                continue
            werr = {name: [0.0, 0.0] for name in QUANTITIES}
            for (h0, h1, kv0, kv1), sel in _head_groups(pieces, shape):
                seg = Segments(pieces["q_len"][sel], pieces["kv_len"][sel])
                rq = torch.as_tensor(_rows(pieces["q_tok"][sel], pieces["q_len"][sel]), device=device)
                rk = torch.as_tensor(_rows(pieces["kv_tok"][sel], pieces["kv_len"][sel]), device=device)
                args = (q[rq, h0:h1].contiguous(), k[rk, kv0:kv1].contiguous(), v[rk, kv0:kv1].contiguous(),
                        dout[rq, h0:h1].contiguous())
                got = _both(backend, *args, seg)
                want = _both(math_be, *(a.to(ref) for a in args), seg)
                pt = _both(math_be, *args, seg)
                for name, g, r, p in zip(QUANTITIES, got, want, pt):
                    werr[name][0] = max(werr[name][0], _maxerr(g, r))
                    werr[name][1] = max(werr[name][1], _maxerr(p, r))
                out_i[rq, h0:h1] = got[0]
                dq_i[rq, h0:h1] = got[1]
                # dK/dV of every piece summed onto the KV rows in the working dtype, as the runtime does
                dk_i[:, kv0:kv1].index_add_(0, rk, got[2])
                dv_i[:, kv0:kv1].index_add_(0, rk, got[3])
            rows.extend(_rows_for(w, "worker", int(worker), werr, cfg))
        for name, t in (("out", out_i), ("dq", dq_i)):
            missing = int(torch.isnan(t).any(dim=-1).sum())
            if missing:
                raise ValueError(f"window {w}: the plan left {missing} (token, head) {name} rows uncomputed")
        perr = {name: [_maxerr(g, r), _maxerr(p, r)]
                for name, g, r, p in zip(QUANTITIES, (out_i, dq_i, dk_i, dv_i), ref_all, pt_all)}
        rows.extend(_rows_for(w, "pool", -1, perr, cfg))
    return rows


def _rows_for(w: int, level: str, worker: int, errs: dict, cfg: FidelityConfig) -> list[dict]:
    out = []
    for name in QUANTITIES:
        e_impl, e_pt = errs[name]
        ratio = e_impl / max(e_pt, cfg.floor)
        limit = cfg.fwd_limit if name == "out" else cfg.grad_limit
        out.append({"window": w, "level": level, "worker": worker, "quantity": name, "err_impl": e_impl,
                    "err_pt": e_pt, "ratio": ratio, "limit": limit, "passed": bool(ratio <= limit),
                    "within_2x": bool(ratio <= 2.0)})
    return out


def summarize(df: pd.DataFrame) -> dict:
    """Worst ratio per level and quantity, and whether every check passed."""
    worst = {f"{lvl}.{q}": float(g["ratio"].max()) for (lvl, q), g in df.groupby(["level", "quantity"])}
    return {"worst_ratio": worst, "all_passed": bool(df["passed"].all()), "all_within_2x": bool(df["within_2x"].all()),
            "checks": int(len(df)), "failed": int((~df["passed"]).sum())}


def plot_ratios(df: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    """Error ratio (impl / bf16 plain PyTorch) per quantity and level, with the limits."""
    from experiments.common.plotting import save_figure, setup_style, strip_points  # noqa: PLC0415  (selects Agg first)

    setup_style()
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 3.8))
    strip_points(ax, df, "quantity", "ratio", list(QUANTITIES), hue="level")
    ax.axhline(2.0, color="black", lw=1, ls="--", label="2x (forward)")
    ax.axhline(float(df["limit"].max()), color="grey", lw=1, ls=":", label="gradient limit")
    ax.set_ylabel("max err / max err of bf16 PyTorch")
    ax.set_ylim(0, max(3.3, float(df["ratio"].max()) * 1.1))
    ax.legend(fontsize=8)
    ax.set_title(f"fidelity: {df.attrs.get('device', '')}, {df.attrs.get('backend', '')}", fontsize=9)
    save_figure(fig, path, caption=caption)


def run_fidelity(cfg: FidelityConfig, opts: MeasureOptions, ref_dtype: str = "auto") -> dict:
    """Plan, compute, compare and write (see the module docstring).

    Returns:
        ``{"df", "summary", "paths", "info", "out_dir"}``.

    Raises:
        ValueError: bad device/backend/dtype/workload, CUDA requested without CUDA, or a plan
            that leaves outputs uncomputed.
    """
    from libra.data.windows import gbs_windows  # noqa: PLC0415

    dev = resolve_device(opts.device)
    if opts.dtype not in ("bf16", "fp16"):
        raise ValueError(f"fidelity checks a low precision: dtype must be bf16 or fp16, got {opts.dtype!r}")
    low, ref = DTYPES[opts.dtype], ref_dtype_for(ref_dtype, dev)
    be = resolve_backend(opts.backend, dev)
    info = device_info(dev, be)
    par, shape = cfg.par(), cfg.shape()
    windows = gbs_windows(cfg.workload, cfg.seq_len, par.gbs, cfg.windows, seed=cfg.seed)
    planner = cfg.planner()
    out_dir = Path(opts.out) if opts.out is not None else RUNS_ROOT / "gpu" / device_slug(info) / "fidelity"
    config = {**asdict(cfg), "device": str(dev), "device_name": info.get("name"), "backend": be.name,
              "dtype": opts.dtype, "ref_dtype": dtype_name(ref), "torch": info["torch"]}
    run = ExperimentRun("fidelity", config, out_dir=out_dir, force=opts.force, quiet=opts.quiet)

    def point(w):
        rows = []
        for plan in planner.plan_window(windows[w], par, shape):
            rows.extend(window_rows(w, plan, cfg, be, low, ref, dev))
        return rows

    with cpu_threads(dev, opts.cpu_threads), full_fp32_matmul():
        df = pd.DataFrame(run.map(range(cfg.windows), point, desc="fidelity"))
    df.attrs.update({"device": info.get("name"), "backend": be.name})
    summary = {"device": info.get("name"), "backend": be.name, "dtype": opts.dtype, "ref_dtype": dtype_name(ref),
               "fp32_matmul": "highest (TF32 off for the reference)",
               "fwd_limit": cfg.fwd_limit, "grad_limit": cfg.grad_limit, **summarize(df)}
    paths = run.finish(df, lambda d, p: plot_ratios(d, p, run_caption(run.config)), extra={"environment_device": info, "summary": summary})
    return {"df": df, "summary": summary, "paths": paths, "info": info, "out_dir": run.out_dir}


@click.command("fidelity", context_settings={"default_map": {f: getattr(DEFAULT_TAP, f) for f in TAP_FIELDS}})
@device_options(timing=False)
@click.option("--dtype", default="bf16", show_default=True, help="low precision under test: bf16 or fp16")
@click.option("--ref-dtype", default="auto", show_default=True, help="reference: auto (fp32 on CUDA, fp64 on CPU)")
@click.option("--method", default="libra", show_default=True, help=f"planner: {', '.join(METHODS)}")
@click.option("--workload", default="libra-prod", show_default=True, help="length preset or length file")
@click.option("--seq-len", type=SizeType(), default=8192, show_default=True, help="tokens per packed sequence S")
@click.option("--cp", type=int, default=2, show_default=True, help="context-parallel degree CP")
@tap_options(*TAP_FIELDS)
@click.option("--q-heads", type=int, default=16, show_default=True, help="query heads")
@click.option("--kv-heads", type=int, default=4, show_default=True, help="KV heads")
@click.option("--head-dim", type=int, default=128, show_default=True, help="head width")
@click.option("--windows", type=int, default=2, show_default=True, help="GBS windows (one plan each)")
@click.option("--fwd-limit", type=float, default=2.0, show_default=True, help="allowed forward error ratio")
@click.option("--grad-limit", type=float, default=3.0, show_default=True,
              help="allowed gradient error ratio (FlashAttention's varlen tests: 3; the paper states 2)")
@click.option("--cpu-threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="intra-op threads on CPU (1 avoids thread contention on a shared machine)")
@click.option("--check", is_flag=True, help="exit with status 1 when a ratio exceeds its limit")
@quick_option("tiny sizes (CPU smoke): S 512, P 2, CP 2, B 64, 4 q heads, d 32")
def fidelity(device, backend, seed, out, force, no_progress, dtype, ref_dtype, method, workload, seq_len, cp,
             pool_size, block_size, head_split, tau, q_heads, kv_heads, head_dim, windows, fwd_limit, grad_limit,
             cpu_threads, check, quick):
    """bf16 tile computation vs a high-precision reference, relative to bf16 plain PyTorch (sec. 6.7).

    P is also DP and GBS here (one pool)."""
    if quick:
        seq_len, pool_size, cp, block_size, head_split = 512, 2, 2, 64, TapConfig.head_split
        q_heads, kv_heads, head_dim, windows = 4, 2, 32, 1
    try:
        tap = replace(DEFAULT_TAP, pool_size=pool_size, block_size=block_size, head_split=head_split, tau=tau)
        cfg = FidelityConfig(method=method, workload=workload, seq_len=seq_len, cp=cp, tap=tap, q_heads=q_heads,
                             kv_heads=kv_heads, head_dim=head_dim, windows=windows, seed=seed, fwd_limit=fwd_limit,
                             grad_limit=grad_limit)
        opts = MeasureOptions(device=device, backend=backend, dtype=dtype, out=out,
                              force=force, quiet=no_progress, cpu_threads=cpu_threads)
        res = run_fidelity(cfg, opts, ref_dtype=ref_dtype)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    s, df = res["summary"], res["df"]
    click.echo(f"fidelity: {s['device']} backend={s['backend']} {s['dtype']} vs {s['ref_dtype']} reference")
    pool = df[df.level == "pool"].groupby("quantity")[["err_impl", "err_pt", "ratio"]].max()
    for name in QUANTITIES:
        wr = df[(df.level == "worker") & (df.quantity == name)]["ratio"].max()
        r = pool.loc[name]
        click.echo(f"  {name:>3}: pool max err {r.err_impl:.3e} vs bf16 PyTorch {r.err_pt:.3e} -> ratio "
                   f"{r.ratio:.3f} (worst worker ratio {wr:.3f})")
    verdict = "PASS" if s["all_passed"] else "FAIL"
    click.echo(f"{verdict}: forward limit {cfg.fwd_limit}x, gradient limit {cfg.grad_limit}x; all within 2x: "
               f"{s['all_within_2x']}")
    click.echo(f"wrote {res['paths']['csv']}, {res['paths']['png']}")
    if check and not s["all_passed"]:
        raise SystemExit(1)
