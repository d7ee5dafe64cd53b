"""Shared helpers of the device experiments (`calibrate`, `sim-check`, `fidelity`).

* device / dtype / backend resolution with clear errors (``--device cuda`` without CUDA fails
  before any work starts);
* :func:`time_calls`: warm-up, then one timing per repeat -- CUDA events on a GPU (the kernel
  stream's own clock, no host overhead between events), ``time.perf_counter`` on CPU -- with the
  caller rotating over several pre-allocated input sets so caches do not flatter the figures;
* :func:`make_inputs`: seeded, pre-allocated kernel input sets for one varlen batch of a
  :class:`KernelGeometry` (heads, head width, dtype, device); :class:`TimingOptions` says how a
  call is timed (warm-up, repeats, backward);
* :func:`worker_pieces`: a worker's kernel work list (its merged segments) with the token and
  head coordinates needed to gather its inputs from a pool's packed tensors;
* :func:`device_info`: device, driver, torch, CUDA and kernel versions recorded with every result;
* :class:`OnePoolLayout`: the one-pool layout of ``sim-check`` / ``fidelity`` and its planner, whose
  options come from the config's :class:`libra.config.TapConfig`.

Everything here runs on CPU too (tiny sizes), so CI exercises the same code paths as the GPU run.
"""

from __future__ import annotations

import contextlib
import platform
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import click
import numpy as np
import torch

from experiments.common.options import overwrite_option
from libra.config import ParallelConfig, TapConfig, check_layout
from libra.runtime.kernels import AttentionBackend, Segments, get_backend, resolve_backend_name
from libra.workload import AttentionShape

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


# --------------------------------------------------------------------------------------------
# device, dtype, backend
# --------------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: an unknown device string, or CUDA requested where torch sees no CUDA device.
    """
    text = str(name).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if re.fullmatch(r"cuda(:\d+)?", text):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available (torch "
                             f"{torch.__version__}, built for CUDA {torch.version.cuda}, "
                             f"{torch.cuda.device_count()} visible device(s))")
        dev = torch.device(text)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA device(s)")
        return dev
    raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = bf16 on CUDA (what training runs), fp32 on CPU (CPU bf16 kernels are slow
    emulations and would calibrate nothing useful); else one of :data:`DTYPES`.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto or one of {list(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def resolve_backend(name: str, device: torch.device) -> AttentionBackend:
    """The kernel backend (``auto``: flash-attn, then torch-varlen, then math on CUDA; cpu-flash
    on CPU); the returned ``.name`` is the resolved one, recorded with results.

    Raises:
        ValueError: unknown backend, a backend that cannot run on ``device``, or one whose
            library does not import here.
    """
    resolved = resolve_backend_name(name, device)  # ValueError for unknown / wrong device
    try:
        return get_backend(resolved, device)
    except ImportError as exc:
        raise ValueError(f"attention backend {resolved!r} is not usable here: {exc}") from exc


@contextlib.contextmanager
def cpu_threads(device: torch.device, threads: int | None):
    """Run the block with ``threads`` intra-op CPU threads (restored afterwards); no-op on CUDA or
    for ``None``. One thread keeps CPU timings stable on a shared machine, where a busy core
    stalls a multi-threaded kernel by a scheduler tick."""
    if device.type != "cpu" or threads is None:
        yield
        return
    if threads < 1:
        raise ValueError(f"cpu threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def time_calls(fn: Callable[[int], object], device: torch.device, warmup: int, repeats: int) -> np.ndarray:
    """Milliseconds of ``repeats`` calls of ``fn(i)`` after ``warmup`` untimed calls.

    ``fn(i)`` receives a running call index so the caller can pick input set ``i % n_sets``
    (rotation). On CUDA each call is bracketed by CUDA events on the current stream and the
    device is synchronised once after the last call (the events' elapsed times are the GPU's own
    timings, so host launch overhead between calls is hidden exactly as in training); on CPU each
    call is timed with ``time.perf_counter``.

    Returns:
        ``(repeats,)`` float64 milliseconds.

    Raises:
        ValueError: ``warmup < 0`` or ``repeats < 1``.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    for i in range(warmup):
        fn(i)
    synchronize(device)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for r in range(repeats):
            starts[r].record()
            fn(warmup + r)
            ends[r].record()
        torch.cuda.synchronize(device)
        return np.array([s.elapsed_time(e) for s, e in zip(starts, ends)], dtype=np.float64)
    out = np.empty(repeats, dtype=np.float64)
    for r in range(repeats):
        t0 = time.perf_counter()
        fn(warmup + r)
        out[r] = (time.perf_counter() - t0) * 1e3
    return out


def time_calls_within(fn: Callable[[int], object], device: torch.device, warmup: int, repeats: int,
                      target_ms: float) -> np.ndarray:
    """:func:`time_calls` with the calls cut to about ``target_ms`` of device time: one untimed
    probe call (the first warm-up) sizes the rest, so a 5-second call is timed once after it and a
    50-microsecond call ``repeats`` times after ``warmup`` warm-ups.

    Returns:
        ``(n,)`` float64 milliseconds, ``1 <= n <= repeats``.
    """
    if warmup < 0 or repeats < 1 or not target_ms > 0:
        raise ValueError(f"need warmup >= 0, repeats >= 1 and target_ms > 0, got {warmup}, {repeats}, {target_ms}")
    probe = float(time_calls(fn, device, 0, 1)[0])
    fits = int(target_ms // max(probe, 1e-6))
    n = max(1, min(repeats, fits))
    return time_calls(fn, device, max(0, min(warmup - 1, fits - n)), n)


def summarize_ms(ms: np.ndarray) -> dict:
    """Median and spread of a timing sample (the median is the figure every experiment uses)."""
    ms = np.asarray(ms, dtype=np.float64)
    return {"ms": float(np.median(ms)), "ms_p10": float(np.percentile(ms, 10)),
            "ms_p90": float(np.percentile(ms, 90)), "ms_min": float(ms.min()), "repeats": int(len(ms))}


# --------------------------------------------------------------------------------------------
# kernel inputs
# --------------------------------------------------------------------------------------------


@dataclass
class KernelInputs:
    """One pre-allocated input set of a varlen batch: ``q, dout, out (Tq, qh, d)``,
    ``k, v (Tk, kvh, d)``, ``lse (qh, Tq)`` (out/lse only when a forward was run)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None


@dataclass(frozen=True)
class KernelGeometry:
    """What one varlen call's inputs are besides their lengths: query and KV heads per call, head
    width, dtype and device. One geometry serves every :class:`Segments` a sweep point or a run
    times, so the lengths stay apart (the caller's ``seg``).

    Raises:
        ValueError: a non-positive head count or width.
    """

    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        for name in ("q_heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class TimingOptions:
    """How a call is timed: ``warmup`` untimed calls, then ``repeats`` timed ones; ``backward``:
    each call runs the backward pass after its forward.

    Raises:
        ValueError: ``warmup < 0`` or ``repeats < 1``.
    """

    warmup: int = 0
    repeats: int = 1
    backward: bool = True

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={self.warmup}, repeats={self.repeats}")


def input_set_bytes(seg: Segments, geom: KernelGeometry) -> int:
    """Bytes of one :class:`KernelInputs` set (q, dout, out and k, v; lse in float32)."""
    el = torch.empty(0, dtype=geom.dtype).element_size()
    return (3 * seg.total_q * geom.q_heads + 2 * seg.total_k * geom.kv_heads) * geom.head_dim * el \
        + seg.total_q * geom.q_heads * 4


def rotation_sets(seg: Segments, geom: KernelGeometry, wanted: int, budget_bytes: int) -> int:
    """How many input sets to rotate over: ``wanted``, fewer if they would exceed ``budget_bytes``
    (at least 1; long segments are far larger than any cache anyway)."""
    per = max(input_set_bytes(seg, geom), 1)
    return int(max(1, min(wanted, budget_bytes // per)))


def make_inputs(seg: Segments, geom: KernelGeometry, n_sets: int, seed: int,
                backend: AttentionBackend | None = None) -> list[KernelInputs]:
    """``n_sets`` seeded input sets (standard normal, generated on ``geom.device``); with ``backend``,
    each set also holds the forward's ``out`` and ``lse`` so backward can be timed alone.

    Raises:
        ValueError: ``n_sets < 1``.
    """
    if n_sets < 1:
        raise ValueError(f"need at least one input set, got {n_sets}")
    device = geom.device
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    sets = []
    for _ in range(n_sets):
        def rnd(rows, heads):
            return torch.randn(rows, heads, geom.head_dim, generator=gen, device=device,
                               dtype=torch.float32).to(geom.dtype)

        s = KernelInputs(q=rnd(seg.total_q, geom.q_heads), k=rnd(seg.total_k, geom.kv_heads),
                         v=rnd(seg.total_k, geom.kv_heads), dout=rnd(seg.total_q, geom.q_heads))
        if backend is not None:
            with torch.no_grad():
                s.out, s.lse = backend.forward(s.q, s.k, s.v, seg)
        sets.append(s)
    synchronize(device)
    return sets


def time_whole_sequence(backend: AttentionBackend, sample_lengths, geom: KernelGeometry, timing: TimingOptions,
                        seed: int) -> dict:
    """Median time of one packed sequence's whole-sequence attention on this process alone.

    The measured *ideal* of a balanced runtime: every sample is one causal segment of
    one ``backend`` call (no tiles, no communication, no runtime around it), forward and, with
    ``timing.backward``, the backward of the same call; the caller sets threads and dtype as its ranks do.

    Returns:
        ``{"ms", "fwd_ms", "bwd_ms"}`` medians over ``timing.repeats`` (``bwd_ms`` 0 without backward).
    """
    seg = Segments(sample_lengths, sample_lengths)
    s = make_inputs(seg, geom, 1, seed)[0]
    device, warmup, backward = geom.device, timing.warmup, timing.backward
    fwd, bwd = [], []

    def call(i):
        t0 = time.perf_counter()
        with torch.no_grad():
            out, lse = backend.forward(s.q, s.k, s.v, seg)
        synchronize(device)
        t1 = time.perf_counter()
        if backward:
            backend.backward(s.dout, s.q, s.k, s.v, out, lse, seg)
            synchronize(device)
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)

    total = time_calls(call, torch.device("cpu"), warmup, timing.repeats)  # host clock around synchronised calls
    return {"ms": float(np.median(total)), "fwd_ms": float(np.median(fwd)) * 1e3,
            "bwd_ms": float(np.median(bwd)) * 1e3 if backward else 0.0}


# --------------------------------------------------------------------------------------------
# a worker's tile pieces
# --------------------------------------------------------------------------------------------


class OnePoolLayout:
    """Mixin for the configs of the one-device checks (sim-check, fidelity): one pool of
    ``tap.pool_size`` replicas x ``cp`` workers planned by ``method``.

    Expects the fields ``method, cp, seq_len, q_heads, kv_heads, head_dim`` and ``tap`` (the
    :class:`libra.config.TapConfig` the planner takes its options from: P, B, H, tau, M, ...).
    """

    @property
    def pool_size(self) -> int:
        """``P``, which is also DP and GBS here (one pool, one packed sequence per replica)."""
        return self.tap.pool_size

    def par(self) -> ParallelConfig:
        return ParallelConfig(dp=self.pool_size, cp=self.cp, gbs=self.pool_size, seq_len=self.seq_len)

    def shape(self) -> AttentionShape:
        return AttentionShape(num_q_heads=self.q_heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim)

    @property
    def chunks(self) -> int:
        """The Pipeliner's M the planner runs with (1 here; a config may take ``tap.pipeline_chunks``)."""
        return 1

    def check_tap(self) -> None:
        """Check ``tap`` is a TapConfig whose layout (with ``M =`` :attr:`chunks`) fits the pool.

        Raises:
            ValueError: not a TapConfig, or a layout :func:`libra.config.check_layout` rejects.
        """
        if not isinstance(self.tap, TapConfig):
            raise ValueError(f"tap must be a TapConfig, got {self.tap!r}")
        check_layout(self.par(), replace(self.tap, pipeline_chunks=self.chunks), self.shape())

    def planner(self):
        """The registry planner of ``method`` given ``tap`` whole, Pipeliner M = :attr:`chunks`."""
        from baselines.registry import get_planner  # noqa: PLC0415

        return get_planner(self.method, tap=replace(self.tap, pipeline_chunks=self.chunks))


def worker_pieces(pool, shape: AttentionShape, worker: int, sched) -> dict[str, np.ndarray]:
    """The kernel segments worker ``worker`` computes for ``pool``: ``PoolPlan.segments`` rows with
    ``dest == worker``, adjacent pieces merged under ``sched`` (:meth:`PoolPlan.kernel_segments`, as
    the runtime runs them and the cost model prices them), with pool-token-axis coordinates.

    Args:
        sched: the pool's Pipeliner schedule (``libra.tap.pipeline.schedule_for_pool``).

    Returns a dict of ``(G,)`` int64 arrays: ``tile`` (the first piece's), ``q_len``, ``kv_len``,
    ``heads``, ``area``, ``head_start``, ``head_end`` (query heads of the segment's tile), ``q_tok``
    (first query token on the pool token axis) and ``kv_tok`` (first key token = the sample's start
    on that axis).
    """
    segs, _ = pool.kernel_segments(sched, worker)
    tiles, tile = pool.tiles, segs["tile"]
    seq_off = pool.index().base[segs["seq"]]
    return {"tile": tile, "q_len": segs["q_len"], "kv_len": segs["kv_len"], "heads": segs["heads"],
            "area": segs["area"], "head_start": tiles.head_start[tile].astype(np.int64),
            "head_end": tiles.head_end[tile].astype(np.int64), "q_tok": seq_off + segs["q_start"],
            "kv_tok": seq_off + segs["sample_start"]}


# --------------------------------------------------------------------------------------------
# environment record
# --------------------------------------------------------------------------------------------


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        line = out.stdout.strip().splitlines()
        if out.returncode == 0 and line:
            return line[0].strip()
    with contextlib.suppress(OSError):
        with open("/proc/driver/nvidia/version") as fh:
            m = re.search(r"Kernel Module\s+(\S+)", fh.read())
            if m:
                return m.group(1)
    return None


def device_info(device: torch.device, backend: AttentionBackend | None = None) -> dict:
    """Device, driver, torch, CUDA and kernel-library versions (recorded in run.json and profiles)."""
    info = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "triton": _version("triton"), "flash_attn": _version("flash-attn")}
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        prop = torch.cuda.get_device_properties(idx)
        info.update({"name": torch.cuda.get_device_name(idx), "capability": f"{prop.major}.{prop.minor}",
                     "memory_gib": round(prop.total_memory / 2**30, 1),
                     "multiprocessors": prop.multi_processor_count, "driver": _nvidia_driver(),
                     "cudnn": torch.backends.cudnn.version()})
    else:
        info.update({"name": f"CPU {platform.processor() or platform.machine()}", "threads": torch.get_num_threads(),
                     "driver": None})
    if backend is not None:
        info["kernel_backend"] = backend.name
        info["kernel_version"] = {"flash-attn": f"flash-attn {info['flash_attn']}",
                                  "torch-varlen": f"torch {torch.__version__} torch.nn.attention.varlen",
                                  "aten-flash": f"torch {torch.__version__} aten flash (FlashAttention-2)",
                                  "cpu-flash": f"torch {torch.__version__} aten cpu flash",
                                  "math": f"torch {torch.__version__} plain PyTorch"}.get(backend.name, backend.name)
    return info


def device_slug(info: dict) -> str:
    """Folder name of a device: ``nvidia-h200``, ``cpu`` ... (lowercase, dashes)."""
    if not str(info.get("device", "")).startswith("cuda"):
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", str(info.get("name", "cuda")).lower()).strip("-")
    return slug or "cuda"


@dataclass(frozen=True, kw_only=True)
class MeasureOptions:
    """Where and how a measured command runs (the options of :func:`device_options` plus its run
    folder): device, kernel backend and dtype by name ("auto" resolves them), CPU threads, and the
    run folder with its ``--force`` / progress choices."""

    device: str = "auto"
    backend: str = "auto"
    dtype: str = "auto"
    out: str | Path | None = None
    force: bool = False
    quiet: bool = True
    cpu_threads: int | None = 1


def device_options(timing: bool = True):
    """Decorator adding the options shared by the device experiments (timing ones if ``timing``)."""
    opts = [
        click.option("--device", default="auto", show_default=True,
                     help="auto (CUDA if available), cpu, cuda or cuda:N; cuda without CUDA is an error"),
        click.option("--backend", default="auto", show_default=True,
                     help="kernel backend: auto, flash-attn, aten-flash, torch-varlen, math, cpu-flash"),
    ]
    if timing:
        opts += [
            click.option("--dtype", default="auto", show_default=True,
                         help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32, fp64"),
            click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
                         help="untimed calls per point"),
            click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True,
                         help="timed calls per point (median)"),
            click.option("--rotate", type=click.IntRange(min=1), default=4, show_default=True,
                         help="pre-allocated input sets used round-robin"),
            click.option("--rotate-mb", type=click.IntRange(min=1), default=4096, show_default=True,
                         help="cap on the rotated input sets' total size (MiB)"),
            click.option("--cpu-threads", type=click.IntRange(min=1), default=1, show_default=True,
                         help="intra-op threads while timing on CPU (1 = stable timings on a shared machine)"),
        ]
    opts += [
        click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="input seed"),
        click.option("--out", type=click.Path(file_okay=False), default=None,
                     help="output folder (default results/gpu/<device>/<experiment>)"),
        click.option("--force", is_flag=True, help="recompute cached points"),
        overwrite_option(),
        click.option("--no-progress", is_flag=True, help="no progress bar"),
    ]

    def deco(fn):
        for opt in reversed(opts):
            fn = opt(fn)
        return fn

    return deco


# --------------------------------------------------------------------------------------------
# sim-check's verdict (also read by experiments.measured.gpu_summary)
# --------------------------------------------------------------------------------------------


def other_device_profile(summary: dict) -> bool:
    """Whether a sim-check's profile kernel was measured on another device type than the run (a GPU
    profile timed against CPU kernels compares two devices, not the model with this one). Summaries
    written before the device types were recorded count as one device."""
    return summary.get("device_type", "") != summary.get("profile_device_type", summary.get("device_type", ""))


def sim_check_verdict(summary: dict) -> str:
    """``met`` / ``NOT met`` for sim-check's median-error target, or no verdict for
    :func:`other_device_profile`."""
    if other_device_profile(summary):
        return "no verdict (another device's profile)"
    return "met" if summary["median_within_target"] else "NOT met"
