"""`libra-bench calibrate`: measure the attention kernel, reproduce Figure 5, write a hardware profile.

Libra sec. 3.3 (Figure 5): normalised FlashAttention throughput is less sensitive to fewer heads
per call than to shorter sequence blocks, which is why the Pipeliner chunks along the head axis.
This command measures, on one device with the chosen kernel backend (``auto``: flash-attn when it
imports, else torch's ``varlen_attn``, else plain PyTorch on CUDA; ATen's CPU flash kernel on CPU;
the resolved name is recorded):

* **length sweep** -- one causal document of ``L`` tokens per call at the reference heads per call
  (``--q-heads``), forward and backward (the geometry of the public calibration table, DESIGN.md
  sec. 5, and of :func:`libra.sim.kernel.fit_length_efficiency`);
* **heads sweep** -- calls of ``--heads-tokens`` tokens packed with documents of ``--heads-length``
  tokens (the geometry of a Pipeliner chunk's tile batch) with ``h`` query heads per call (KV heads
  ``h / group``, at least one). Packed, because a single document under-fills a GPU at few heads
  per call (``kernel-sweep``: on an H200 one 16K-token document at 1 head runs at 0.44 of 32 heads,
  four of them at 0.73) and a heads term fitted there over-prices tile batches (``sim-check``:
  28% median error against 3.5% with the packed fit). ``--heads-tokens`` equal to
  ``--heads-length`` measures one document per call, as before; the CPU default does (one thread
  has no occupancy to fill);
* **piece sweep** -- the second half and the last eighth of each length's document, reading
  their causal key prefix as a late tile does (:func:`piece_points`): which
  :data:`~libra.sim.kernel.PIECE_PRICINGS` rule prices them best becomes the profile's
  ``kernel.piece_pricing`` with ``--piece-pricing measured`` (:func:`fit_piece_pricing`; both
  rules' errors are in ``source.piece_pricing`` whichever rule is kept; the default keeps
  ``effective-length``);
* **launch probe** -- a 128-token, one-head call: the fixed per-call cost;
* **device copy** -- a large device-to-device copy: bytes copied per second on one device. It is
  a memory-bandwidth figure (each byte read and written once on the same device), not an
  NVLink/RoCE measurement;
* **link** (``--links``) -- a ping-pong between two spawned local ranks (gloo on CPU, NCCL between
  two GPUs of this node; :mod:`experiments.measured.link_probe`), whose fitted latency and bandwidth
  (:func:`experiments.common.link_fit.fit_latency_bandwidth`) replace the intra-node link class
  (``nvlink``); without it, and for the other classes, the links stay those of ``--base-profile``.

Timing: CUDA events after warm-up on GPU (``time.perf_counter`` on CPU), medians over repeats,
inputs rotated round-robin over several pre-allocated sets (fewer when a set is large; recorded).

The fitted :class:`~libra.sim.kernel.KernelModel` (``rate_inf, half_length, exponent`` from
``fit_length_efficiency`` on the forward length sweep; ``launch_ms`` from the probe;
``heads_half`` from the heads sweep; ``backward_time_ratio`` = median backward / forward time
of the length sweep; the backward curve ``backward_rate_inf_tflops, backward_half_length,
backward_exponent`` from ``fit_length_efficiency`` on the backward length sweep) replaces the base profile's kernel; links, cluster shape and variability
are kept. Outputs (``runs/gpu/<device>/calibrate/`` or ``--out``; ``scripts/gpu_check.sh`` writes
``results/gpu/<device>/calibrate/``): ``calibrate.csv`` (one row
per point and pass), ``calibrate.png`` (Figure 5), ``profile.json`` (loads with
``libra.sim.profiles.load_profile`` and ``--profile``) and ``run.json``.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import click
import numpy as np
import pandas as pd
import torch

from experiments.common.link_fit import fit_latency_bandwidth, with_link_bandwidth
from experiments.common.options import IntListType, SizeType, quick_option
from experiments.common.runner import RUNS_ROOT, ExperimentRun, git_sha
from experiments.common.runs_table import run_caption
from experiments.measured.gpu_common import (
    KernelGeometry,
    MeasureOptions,
    cpu_threads,
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
    time_calls,
)
from experiments.measured.occupancy_fit import calibrate_occupancy_fit
from libra.runtime.kernels import Segments
from libra.sim.kernel import (
    PIECE_PRICINGS,
    KernelModel,
    choose_piece_pricing,
    fit_length_efficiency,
    piece_pricing_errors,
)
from libra.sim.profiles import DEFAULT_PROFILE, LINK_CLASSES, HardwareProfile, load_profile
from libra.workload import attention_flops, kv_heads_per_call, sample_area

LAUNCH_PROBE_TOKENS = 128
PIECE_BLOCKS = 8
"""The piece sweep's thin piece is the last ``1 / PIECE_BLOCKS`` of a document (:func:`piece_points`)."""
PIECE_CHOICES = (*PIECE_PRICINGS, "measured")
"""``--piece-pricing``: a rule kept as is, or ``measured`` (:func:`fit_piece_pricing`)."""
CPU_DEFAULTS = {"lengths": [128, 256, 512, 1024, 2048, 4096, 8192], "heads": [1, 2, 4, 8], "q_heads": 8,
                "kv_heads": 2, "head_dim": 64, "heads_length": 2048, "heads_tokens": 2048, "copy_mb": 256, "warmup": 1,
                "repeats": 5, "rotate": 2}
"""``--device cpu``: the sizes of a CPU profile (each unless given): the CPU microbench's head
geometry (8 q / 2 kv heads, head_dim 64) and the sample lengths it runs (128 to 8K), where a CPU
kernel is far from its long-segment rate (``libra-kt`` with this profile balances
measured time, not FLOPs). The GPU defaults' 64K, 32-head calls would take hours on one core."""


@dataclass(frozen=True)
class CalibrateConfig:
    """What `calibrate` measures (sizes in tokens, heads are query heads per kernel call).

    Attributes:
        lengths: document lengths of the length sweep (>= 3 distinct, each > 0).
        heads: heads per call of the heads sweep (each divides ``q_heads``; ``q_heads`` is added).
        q_heads, kv_heads, head_dim: reference call geometry (``kv_heads | q_heads``).
        heads_length: document length of the heads sweep.
        heads_tokens: tokens of one heads-sweep call (``heads_tokens // heads_length`` documents,
            at least one).
        warmup, repeats: untimed and timed calls per point.
        rotate: input sets rotated over per point; ``rotate_mb`` caps their total size.
        copy_mb: size of the device-to-device copy.
        seed: input generator seed.
        links: also probe the link between two local ranks (:mod:`experiments.measured.link_probe`).
        piece_pricing: the profile's ``kernel.piece_pricing``: a rule of
            :data:`~libra.sim.kernel.PIECE_PRICINGS`, or ``"measured"`` for the one with the smaller
            median error on the piece sweep (:func:`fit_piece_pricing`; both rules' errors are
            recorded whichever is kept).

    Raises:
        ValueError: any bad value, naming it.
    """

    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    heads: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    q_heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    heads_length: int = 16384
    heads_tokens: int = 65536
    warmup: int = 3
    repeats: int = 10
    rotate: int = 4
    rotate_mb: int = 4096
    copy_mb: int = 1024
    seed: int = 0
    links: bool = False
    piece_pricing: str = PIECE_PRICINGS[0]

    def __post_init__(self) -> None:
        if self.piece_pricing not in PIECE_CHOICES:
            raise ValueError(f"piece_pricing must be one of {', '.join(PIECE_CHOICES)}, got {self.piece_pricing!r}")
        for name in ("q_heads", "kv_heads", "head_dim", "heads_length", "heads_tokens", "repeats", "rotate", "rotate_mb",
                     "copy_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.links, bool):
            raise ValueError(f"links must be True or False, got {self.links!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        lengths = tuple(int(x) for x in self.lengths)
        bad = [x for x in lengths if x < 1]
        if bad:
            raise ValueError(f"lengths must be positive, got {bad[0]}")
        if len(set(lengths)) < 3:
            raise ValueError(f"the length fit needs >= 3 distinct lengths, got {list(lengths)}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide q_heads={self.q_heads}")
        heads = tuple(int(x) for x in self.heads)
        for h in heads:
            if h < 1 or self.q_heads % h:
                raise ValueError(f"heads per call {h} must be a positive divisor of q_heads={self.q_heads}")
            kv_heads_per_call(h, self.q_heads // self.kv_heads)
        object.__setattr__(self, "lengths", tuple(sorted(set(lengths))))
        object.__setattr__(self, "heads", tuple(sorted(set(heads) | {self.q_heads})))

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def heads_documents(self) -> int:
        """Documents of ``heads_length`` tokens in one heads-sweep call."""
        return max(1, self.heads_tokens // self.heads_length)


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------


def measure_call(backend, seg: Segments, qh: int, kvh: int, cfg: CalibrateConfig, device, dtype,
                 seed: int) -> dict:
    """Median forward and backward ms of one varlen call (see :func:`experiments.measured.gpu_common.time_calls`).

    Returns:
        ``{"fwd": summary, "bwd": summary, "rotation": n_sets}`` (summaries of
        :func:`experiments.measured.gpu_common.summarize_ms`).
    """
    geom = KernelGeometry(qh, kvh, cfg.head_dim, dtype, device)
    n = rotation_sets(seg, geom, cfg.rotate, cfg.rotate_mb << 20)
    sets = make_inputs(seg, geom, n, seed, backend=backend)

    def fwd(i):
        s = sets[i % n]
        with torch.no_grad():
            backend.forward(s.q, s.k, s.v, seg)

    def bwd(i):
        s = sets[i % n]
        backend.backward(s.dout, s.q, s.k, s.v, s.out, s.lse, seg)

    out = {"fwd": summarize_ms(time_calls(fwd, device, cfg.warmup, cfg.repeats)),
           "bwd": summarize_ms(time_calls(bwd, device, cfg.warmup, cfg.repeats)), "rotation": n}
    sets.clear()  # free the inputs before the next point allocates its own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def measure_copy(nbytes: int, device, warmup: int, repeats: int) -> dict:
    """Median time of copying ``nbytes`` between two buffers on ``device`` and its GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    res = summarize_ms(time_calls(lambda i: dst.copy_(src), device, warmup, repeats))
    synchronize(device)
    res["gbps"] = nbytes / (res["ms"] * 1e-3) / 1e9
    return res


def kernel_point(key: dict, backend, cfg: CalibrateConfig, device, dtype) -> list[dict]:
    """Rows (one per pass) of one sweep point ``key`` = ``{"sweep", "length", "heads"}`` (and
    ``"q_start"`` for a piece: query rows ``[q_start, length)`` of the document, keys ``[0, length)``;
    ``"documents"``: that many such documents in the call, default one)."""
    length, heads, q0 = int(key["length"]), int(key["heads"]), int(key.get("q_start", 0))
    docs = int(key.get("documents", 1))
    kvh = kv_heads_per_call(heads, cfg.group)
    seg = Segments([length - q0] * docs, [length] * docs)
    area = float(sample_area(length) - sample_area(q0)) * docs
    try:
        res = measure_call(backend, seg, heads, kvh, cfg, device, dtype,
                           seed=cfg.seed + length * 131 + heads + q0 * 7)
    except torch.OutOfMemoryError:
        # e.g. the plain-PyTorch fallback materialises (heads, L, L) scores: record the point as
        # unmeasured (NaN, left out of the fit) instead of losing the whole sweep
        if device.type == "cuda":
            torch.cuda.empty_cache()
        nan = {"ms": np.nan, "ms_p10": np.nan, "ms_p90": np.nan, "ms_min": np.nan, "repeats": 0}
        res = {"fwd": nan, "bwd": nan, "rotation": 0}
    rows = []
    for pas in ("fwd", "bwd"):
        flops = float(attention_flops(area, heads, cfg.head_dim, backward=pas == "bwd"))
        s = res[pas]
        rows.append({"sweep": key["sweep"], "pass": pas, "length": length, "q_start": q0, "documents": docs, "heads": heads,
                     "kv_heads": kvh, "flops": flops, **s, "tflops": flops / (s["ms"] * 1e-3) / 1e12, "rotation": res["rotation"],
                     "gbps": np.nan, "bytes": np.nan})
    return rows


def copy_point(cfg: CalibrateConfig, device) -> list[dict]:
    nbytes = cfg.copy_mb << 20
    s = measure_copy(nbytes, device, cfg.warmup, cfg.repeats)
    return [{"sweep": "copy", "pass": "copy", "length": np.nan, "heads": np.nan, "kv_heads": np.nan,
             "flops": np.nan, **s, "tflops": np.nan, "rotation": 1, "bytes": float(nbytes)}]


def link_point(cfg: CalibrateConfig, device, threads: int | None) -> list[dict]:
    """Rows (one per transfer size) of the two-rank link probe on ``device``'s type."""
    from experiments.measured.link_probe import probe_link  # noqa: PLC0415  (spawns processes: only when asked)

    out = []
    for r in probe_link(device.type, warmup=max(cfg.warmup, 1), repeats=cfg.repeats, threads=threads or 1):
        out.append({"sweep": "link", "pass": r["backend"], "length": np.nan, "heads": np.nan, "kv_heads": np.nan,
                    "flops": np.nan, "ms": r["ms"], "ms_min": r["ms_min"], "repeats": r["repeats"],
                    "tflops": np.nan, "rotation": 1, "bytes": float(r["bytes"]),
                    "gbps": r["bytes"] / (r["ms"] * 1e-3) / 1e9})
    return out


def fit_link(df: pd.DataFrame, profile: HardwareProfile, base: HardwareProfile) -> tuple[HardwareProfile, dict]:
    """``profile`` with its intra-node link class fitted to the probe's rows (unchanged without
    any), and the fit's numbers (``link_*``, None without a probe)."""
    rows = df[df.sweep == "link"].sort_values("bytes")
    if not len(rows):
        return profile, {"link_bandwidth_gbps": None, "link_latency_ms": None, "link_fit_max_rel_err": None}
    bw, lat, err = fit_latency_bandwidth(rows["bytes"].to_numpy(), rows["ms"].to_numpy())
    intra = LINK_CLASSES[0]
    note = (f"{intra}: measured by libra-bench calibrate --links, a ping-pong between two local ranks "
            f"({rows['pass'].iloc[0]}; bytes {rows['bytes'].astype(int).tolist()}, median one-way ms "
            f"{[round(x, 5) for x in rows['ms']]}), fit t = latency + bytes / bandwidth: {bw:.4g} GB/s, "
            f"{lat:.4g} ms (worst relative error {err:.1%}); the other classes kept from base profile "
            f"{base.name!r}: {base.source.get('links', 'see base profile')}")
    profile = with_link_bandwidth(profile, intra, _sig(bw), latency_ms=_sig(lat),
                                  source={**profile.source, "links": note},
                                  description=profile.description.replace("links and cluster shape",
                                                                          f"{intra} measured; other links and cluster shape"))
    return profile, {"link_bandwidth_gbps": bw, "link_latency_ms": lat, "link_fit_max_rel_err": err}


def add_normalized(df: pd.DataFrame) -> pd.DataFrame:
    """Throughput normalised to the best point of each (sweep, pass) curve (Figure 5's y axis)."""
    df = df.copy()
    df["normalized"] = np.nan
    kern = df["sweep"].isin(["length", "heads"])
    best = df[kern].groupby(["sweep", "pass"])["tflops"].transform("max")
    df.loc[kern, "normalized"] = df.loc[kern, "tflops"] / best
    return df


# --------------------------------------------------------------------------------------------
# fitting
# --------------------------------------------------------------------------------------------


def fit_heads_half(heads, rates, reference_heads: int) -> tuple[float, float]:
    """Fit ``heads_half`` of ``h(n) = n/(n+c) / (ref/(ref+c))`` to measured rates vs heads per call.

    Args:
        heads: ``(n,)`` heads per call; must contain ``reference_heads``.
        rates: ``(n,)`` measured throughput at those heads (any unit).

    Returns:
        ``(heads_half, worst relative error of the model on the measured ratios)``; ``c = 0``
        (no heads effect) when fewer heads are not slower.

    Raises:
        ValueError: mismatched sizes, non-positive rates, or the reference missing.
    """
    heads = np.asarray(heads, dtype=np.float64)
    rates = np.asarray(rates, dtype=np.float64)
    if heads.shape != rates.shape or heads.ndim != 1 or np.any(rates <= 0) or np.any(heads <= 0):
        raise ValueError(f"need matching positive heads and rates, got {heads} and {rates}")
    ref = np.nonzero(heads == reference_heads)[0]
    if not len(ref):
        raise ValueError(f"reference heads {reference_heads} not among measured heads {heads.tolist()}")
    return fit_heads_ratio(heads, rates / rates[ref[0]], reference_heads)


def fit_heads_ratio(heads, ratio, reference_heads: int, stat: str = "max") -> tuple[float, float]:
    """``heads_half`` ``c`` of ``h(n) = n/(n+c) / (ref/(ref+c))`` fitted to throughput ratios (each
    point's rate over the rate at ``reference_heads`` of the same geometry; several geometries may be
    pooled), minimising the ``stat`` (``max`` or ``median``) relative error over a log grid of ``c``
    (0 and 1e-3 .. 1e3).

    Returns:
        ``(c, that error)``.

    Raises:
        ValueError: mismatched or non-positive inputs, or an unknown ``stat``.
    """
    heads = np.asarray(heads, dtype=np.float64)
    ratio = np.asarray(ratio, dtype=np.float64)
    if heads.shape != ratio.shape or heads.ndim != 1 or not len(heads) or np.any(ratio <= 0) or np.any(heads <= 0):
        raise ValueError(f"need matching positive heads and ratios, got {heads} and {ratio}")
    if stat not in ("max", "median"):
        raise ValueError(f"stat must be max or median, got {stat!r}")
    grid = np.concatenate(([0.0], np.geomspace(1e-3, 1e3, 3000)))[:, None]
    model = heads / (heads + grid) / (reference_heads / (reference_heads + grid))
    rel = np.abs(model - ratio) / ratio
    err = np.max(rel, axis=1) if stat == "max" else np.median(rel, axis=1)
    i = int(np.argmin(err))
    return float(grid[i, 0]), float(err[i])


def _sig(x: float, digits: int = 6) -> float:
    """``x`` to ``digits`` significant digits (a CPU rate of 0.0358 TFLOP/s keeps its precision)."""
    return float(f"{x:.{digits}g}")


def fit_profile(df: pd.DataFrame, cfg: CalibrateConfig, base: HardwareProfile, info: dict,
                dtype_label: str) -> tuple[HardwareProfile, dict]:
    """Fit the kernel model to the measured rows and build the measured profile.

    Returns:
        ``(profile, fit)``, ``fit`` being the fitted numbers and their errors (for run.json).

    Raises:
        ValueError: measurements the model cannot be fitted to (e.g. non-positive times).
    """
    df = df[~(df.sweep.isin(["length", "heads", "launch"]) & ~np.isfinite(df["ms"]))]  # unmeasured (OOM)
    lf = df[(df.sweep == "length") & (df["pass"] == "fwd")].sort_values("length")
    lb = df[(df.sweep == "length") & (df["pass"] == "bwd")].sort_values("length")
    hf = df[(df.sweep == "heads") & (df["pass"] == "fwd")].sort_values("heads")
    if len(lf) < 3 or len(lb) != len(lf):
        raise ValueError(f"only {len(lf)} length points were measured; the fit needs >= 3")
    probe = df[(df.sweep == "launch") & (df["pass"] == "fwd")]
    times = lf["ms"].to_numpy()
    # the probe is a real (tiny) kernel: cap it below the fastest sweep point so the fit's
    # "time minus launch" stays positive
    launch = float(min(probe["ms"].iloc[0], 0.5 * times.min())) if len(probe) else 0.0
    rate, half, expo, err = fit_length_efficiency(lf["length"].to_numpy(), times, cfg.q_heads, cfg.head_dim,
                                                  launch_ms=launch)
    heads_half, heads_err = fit_heads_half(hf["heads"].to_numpy(), hf["tflops"].to_numpy(), cfg.q_heads)
    bwd_ratio = float(np.median(lb["ms"].to_numpy() / times))
    bwd_times = lb["ms"].to_numpy()
    b_rate, b_half, b_expo, b_err = fit_length_efficiency(lf["length"].to_numpy(), bwd_times, cfg.q_heads,
                                                          cfg.head_dim, launch_ms=min(launch * bwd_ratio,
                                                                                      0.5 * bwd_times.min()))
    kernel = KernelModel(rate_inf_tflops=_sig(rate), half_length=_sig(half), exponent=_sig(expo),
                         launch_ms=_sig(launch), reference_heads=cfg.q_heads, heads_half=_sig(heads_half),
                         backward_time_ratio=_sig(bwd_ratio), backward_rate_inf_tflops=_sig(b_rate),
                         backward_half_length=_sig(b_half), backward_exponent=_sig(b_expo))
    kernel, pieces = fit_piece_pricing(df, kernel, cfg)
    copy = df[df.sweep == "copy"]
    copy_gbps = float(copy["gbps"].iloc[0]) if len(copy) else None
    peak = base.peak_tflops
    peak_note = f"kept from base profile {base.name!r} (a datasheet figure; recorded only)"
    if kernel.rate_inf_tflops > peak:
        peak = kernel.rate_inf_tflops
        peak_note = f"raised to the fitted rate (base profile {base.name!r} had {base.peak_tflops})"
    fit = {"rate_inf_tflops": rate, "half_length": half, "exponent": expo, "length_fit_max_rel_err": err,
           "launch_ms": launch, "heads_half": heads_half, "heads_fit_max_rel_err": heads_err,
           "backward_time_ratio": bwd_ratio, "backward_rate_inf_tflops": b_rate, "backward_half_length": b_half,
           "backward_exponent": b_expo, "backward_fit_max_rel_err": b_err, "device_copy_gbps": copy_gbps,
           "piece_pricing": kernel.piece_pricing, "piece_median_abs_err": pieces.get("median_abs_err")}
    slug = device_slug(info)
    source = _measured_source(cfg, base, info, dtype_label, fit, (lf, lb, hf, copy), pieces, peak_note)
    occupancy = calibrate_occupancy_fit(df, info, cfg.head_dim)  # GPU only; the profile keeps its model
    if occupancy is not None:
        source["occupancy_fit"] = occupancy
    profile = replace(base, name=f"{slug}-{info.get('kernel_backend')}-measured", version=1,
                      description=(f"measured by libra-bench calibrate on {info.get('name')} "
                                   f"({info.get('kernel_backend')}, {dtype_label}); links and cluster shape "
                                   f"from {base.name}"),
                      source=source, peak_tflops=float(peak), kernel=kernel)
    return profile, fit


def _measured_source(cfg: CalibrateConfig, base: HardwareProfile, info: dict, dtype_label: str, fit: dict,
                     tables: tuple, pieces: dict, peak_note: str) -> dict:
    """The measured profile's ``source``: where each fitted number comes from (``fit``: :func:`fit_profile`'s
    numbers; ``tables``: the forward and backward length sweeps, the heads sweep and the copy rows)."""
    lf, lb, hf, copy = tables
    return {
        "measured_by": "libra-bench calibrate", "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "git_sha": git_sha(), "device": info.get("name"), "driver": info.get("driver"), "torch": info.get("torch"),
        "cuda": info.get("cuda"), "kernel_backend": info.get("kernel_backend"),
        "kernel_version": info.get("kernel_version"), "dtype": dtype_label, "environment": info,
        "kernel_fit": (f"rate_inf_tflops, half_length, exponent = libra.sim.kernel.fit_length_efficiency on the "
                       f"measured forward length sweep (one causal document per call, {cfg.q_heads} q heads, "
                       f"{cfg.kv_heads} kv heads, head_dim {cfg.head_dim}); worst relative error {fit['length_fit_max_rel_err']:.2%}"),
        "calibration_table": {"lengths": lf["length"].astype(int).tolist(),
                              "times_ms": [round(x, 6) for x in lf["ms"].tolist()],
                              "backward_times_ms": [round(x, 6) for x in lb["ms"].tolist()],
                              "heads": cfg.q_heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim},
        "launch_ms": f"median forward time of a {LAUNCH_PROBE_TOKENS}-token, 1-head call, capped at half the fastest "
                     f"sweep point: {fit['launch_ms']:.6f} ms",
        "heads_half": (f"fitted to the forward heads sweep ({cfg.heads_documents} document(s) of {cfg.heads_length} tokens "
                       f"per call, heads "
                       f"{hf['heads'].astype(int).tolist()}); worst relative error {fit['heads_fit_max_rel_err']:.2%}"),
        "heads_table": {"heads": hf["heads"].astype(int).tolist(), "tflops": [round(x, 4) for x in hf["tflops"]],
                        "length": cfg.heads_length, "documents": cfg.heads_documents},
        "backward_time_ratio": f"median backward / forward time over the length sweep: {fit['backward_time_ratio']:.4f} (the "
                               f"backward launch cost is launch_ms x it)",
        "backward_curve": (f"backward_rate_inf_tflops, backward_half_length, backward_exponent = "
                           f"fit_length_efficiency on the measured backward length sweep (rate in forward FLOPs per "
                           f"second of backward time); worst relative error {fit['backward_fit_max_rel_err']:.2%}"),
        "device_copy": ({"gbps": round(fit["device_copy_gbps"], 3), "bytes": int(copy["bytes"].iloc[0]),
                         "meaning": "device-to-device copy on one GPU: bytes copied per second (each byte read "
                                    "once and written once on the same memory, so memory traffic is twice "
                                    "this); a local-memory figure, not a link measurement"}
                        if fit["device_copy_gbps"] is not None else None),
        "peak_tflops": peak_note,
        "piece_pricing": pieces,
        "links": f"kept from base profile {base.name!r} (one device measures no link): "
                 f"{base.source.get('links', 'see base profile')}",
        "base_profile": base.name,
    }


def piece_points(lengths) -> list[tuple[int, int]]:
    """``(length, q_start)`` of the piece sweep: per document length ``L`` of the length sweep, its
    second half ``[L/2, L)`` and its last eighth ``[L - L/8, L)``, each reading keys ``[0, L)``
    (a late tile of a sample; the whole document is the length sweep's point)."""
    return [(int(L), q0) for L in lengths if L >= PIECE_BLOCKS for q0 in (L // 2, L - L // PIECE_BLOCKS)]


def fit_piece_pricing(df: pd.DataFrame, kernel: KernelModel, cfg: CalibrateConfig) -> tuple[KernelModel, dict]:
    """``kernel`` with ``cfg.piece_pricing`` (``measured``: the :data:`~libra.sim.kernel.PIECE_PRICINGS`
    rule with the smaller median error on the piece sweep, :func:`~libra.sim.kernel.choose_piece_pricing`)
    and the record of both rules' errors (the profile's ``source.piece_pricing``).

    The default keeps ``effective-length``: on this project's CPU host the measured choice,
    ``prefix-difference`` (median piece error 20% against 45%; 2.5% against 8.5% on ``libra``'s 8K
    tile batches in ``sim-check``), made ``libra-kt``'s 8K microbench balance worse (``ideal_ratio``
    1.129-1.138 against 1.024-1.057 in three alternating pairs). Both plans are within Alg. 2's soft
    target under their own model, and on that two-worker pool one half-tile decides which lands
    balanced: a more accurate rule has not yet made a better plan."""
    rule = cfg.piece_pricing
    sub = df[(df.sweep == "piece") & np.isfinite(df["ms"])]
    fwd, bwd = ((sub[sub["pass"] == p].sort_values(["length", "q_start"]) if len(sub) else sub)
                for p in ("fwd", "bwd"))
    if not len(fwd) or len(bwd) != len(fwd):
        rule = kernel.piece_pricing if rule == "measured" else rule
        return replace(kernel, piece_pricing=rule), {
            "rule": rule, "measured": False, "meaning": "no piece sweep in this calibration: the rule is unmeasured"}
    errors = [piece_pricing_errors(kernel, t["q_start"].to_numpy(), t["length"].to_numpy(), t["ms"].to_numpy(),
                                   cfg.q_heads, cfg.head_dim, backward=p == "bwd")
              for p, t in (("fwd", fwd), ("bwd", bwd))]
    best, med = choose_piece_pricing(errors)
    rule = best if rule == "measured" else rule
    return replace(kernel, piece_pricing=rule), {
        "rule": rule, "measured": True, "chosen_by": f"--piece-pricing {cfg.piece_pricing}",
        "smaller_median_error": best, "median_abs_err": med,
        "meaning": ("query rows [q_start, length) of one length-token document reading keys [0, length), "
                    "forward and backward, priced from the fitted whole-document curves by each rule"),
        "q_start": fwd["q_start"].astype(int).tolist(), "length": fwd["length"].astype(int).tolist(),
        "times_ms": [round(x, 6) for x in fwd["ms"].tolist()],
        "backward_times_ms": [round(x, 6) for x in bwd["ms"].tolist()],
        "errors": {f"{p}:{r}": [round(float(x), 4) for x in e[r]] for p, e in zip(("fwd", "bwd"), errors)
                   for r in e}}


# --------------------------------------------------------------------------------------------
# figure
# --------------------------------------------------------------------------------------------


def plot_figure5(df: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    """Figure 5: normalised throughput vs heads per call (left) and vs block length (right)."""
    from experiments.common.plotting import save_figure, setup_style  # noqa: PLC0415  (selects Agg first)

    setup_style()
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, sweep, x, label in ((axes[0], "heads", "heads", "query heads per call"),
                                (axes[1], "length", "length", "block length (tokens)")):
        sub = df[df.sweep == sweep]
        sns.lineplot(data=sub, x=x, y="normalized", hue="pass", style="pass", markers=True, dashes=False,
                     ax=ax, hue_order=["fwd", "bwd"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("throughput / best")
        ax.set_ylim(0, 1.05)
    backend = df.attrs.get("backend", "")
    fig.suptitle(f"Figure 5: kernel efficiency ({df.attrs.get('device', '')}, {backend})", fontsize=10)
    save_figure(fig, path, caption=caption)


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def run_calibrate(cfg: CalibrateConfig, opts: MeasureOptions, base_profile: str = DEFAULT_PROFILE) -> dict:
    """Measure, fit and write everything (see the module docstring) where ``opts`` says.

    Returns:
        ``{"df", "profile", "fit", "paths", "info", "out_dir"}``.

    Raises:
        ValueError: bad device/backend/dtype/profile, or CUDA requested without CUDA.
    """
    dev = resolve_device(opts.device)
    dt = resolve_dtype(opts.dtype, dev)
    be = resolve_backend(opts.backend, dev)
    base = load_profile(base_profile)
    cpu_threads_n = opts.cpu_threads
    if cfg.links:  # before any measurement: a one-GPU node cannot probe a link
        from experiments.measured.link_probe import check_link_probe  # noqa: PLC0415

        check_link_probe(dev.type)
    info = device_info(dev, be)
    out_dir = Path(opts.out) if opts.out is not None else RUNS_ROOT / "gpu" / device_slug(info) / "calibrate"
    config = {**asdict(cfg), "device": str(dev), "cpu_threads": cpu_threads_n if dev.type == "cpu" else None, "device_name": info.get("name"), "backend": be.name,
              "dtype": dtype_name(dt), "base_profile": base.name, "torch": info["torch"]}
    run = ExperimentRun("calibrate", config, out_dir=out_dir, force=opts.force, quiet=opts.quiet)
    keys = ([{"sweep": "launch", "length": LAUNCH_PROBE_TOKENS, "heads": 1}]
            + [{"sweep": "length", "length": L, "heads": cfg.q_heads} for L in cfg.lengths]
            + [{"sweep": "heads", "length": cfg.heads_length, "heads": h, "documents": cfg.heads_documents}
               for h in cfg.heads]
            + [{"sweep": "piece", "length": L, "q_start": a, "heads": cfg.q_heads} for L, a in piece_points(cfg.lengths)]
            + [{"sweep": "copy"}] + ([{"sweep": "link"}] if cfg.links else []))

    def point(key):
        if key["sweep"] == "copy":
            return copy_point(cfg, dev)
        if key["sweep"] == "link":
            return link_point(cfg, dev, cpu_threads_n)
        if key["sweep"] == "launch":
            launch_cfg = replace(cfg, kv_heads=1, q_heads=1, heads=(1,))
            return kernel_point(key, be, launch_cfg, dev, dt)
        return kernel_point(key, be, cfg, dev, dt)

    with cpu_threads(dev, cpu_threads_n):
        info["threads"] = torch.get_num_threads() if dev.type == "cpu" else None
        rows = run.map(keys, point, desc="calibrate")
    df = add_normalized(pd.DataFrame(rows))
    df.attrs.update({"device": info.get("name"), "backend": be.name})
    profile, fit = fit_profile(df, cfg, base, info, dtype_name(dt))
    profile, link_fit = fit_link(df, profile, base)
    fit.update(link_fit)
    load_profile_check = profile.to_dict()
    profile_path = run.out_dir / "profile.json"
    curves = {s: {p: {int(x): round(float(v), 4) for x, v in
                      df[(df.sweep == s) & (df["pass"] == p)][[s, "normalized"]].itertuples(index=False)}
                  for p in ("fwd", "bwd")} for s in ("heads", "length")}
    summary = {"device": info.get("name"), "backend": be.name, "dtype": dtype_name(dt), "fit": fit,
               "figure5": curves, "profile": str(profile_path)}
    paths = run.finish(df, lambda d, p: plot_figure5(d, p, run_caption(run.config)),
                       extra={"environment_device": info, "summary": summary, "profile": profile.to_dict()},
                       files={profile_path.name: _json(load_profile_check)})
    paths["profile"] = profile_path
    return {"df": df, "profile": profile, "fit": fit, "paths": paths, "info": info, "out_dir": run.out_dir,
            "summary": summary}


def _json(obj) -> str:
    import json  # noqa: PLC0415

    return json.dumps(obj, indent=2, default=str) + "\n"


def format_curves(df: pd.DataFrame) -> str:
    """Figure 5's two curves as text (normalised throughput and TFLOP/s per point)."""
    lines = []
    for sweep, x, label in (("heads", "heads", "heads/call"), ("length", "length", "length")):
        sub = df[df.sweep == sweep]
        lines.append(f"  vs {label}:")
        for xv in sorted(sub[x].unique()):
            f = sub[(sub[x] == xv) & (sub["pass"] == "fwd")].iloc[0]
            b = sub[(sub[x] == xv) & (sub["pass"] == "bwd")].iloc[0]
            lines.append(f"    {int(xv):>7}  fwd {f.normalized:.3f} ({f.tflops:.4g} TFLOP/s, {f.ms:.4g} ms)  "
                         f"bwd {b.normalized:.3f} ({b.tflops:.4g} TFLOP/s, {b.ms:.4g} ms)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# click
# --------------------------------------------------------------------------------------------


def _cpu_sized(ctx: click.Context, device: str, *values):
    """The values of :data:`CPU_DEFAULTS`' options (in its order), CPU-sized on a CPU device for
    every option the command line does not set; unchanged on a GPU."""
    names = list(CPU_DEFAULTS)
    try:
        on_cpu = resolve_device(device).type == "cpu"
    except ValueError:
        on_cpu = False  # run_calibrate reports the bad device
    if not on_cpu:
        return values
    given = {click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT}
    return tuple(v if ctx.get_parameter_source(n) in given else CPU_DEFAULTS[n] for n, v in zip(names, values))


@click.command("calibrate")
@device_options()
@click.option("--lengths", type=IntListType(), default="1024,2048,4096,8192,16384,32768,65536", show_default=True,
              help="document lengths of the length sweep (accepts 4K, 64K)")
@click.option("--heads", type=IntListType(), default="1,2,4,8,16,32", show_default=True,
              help="query heads per call of the heads sweep (each divides --q-heads)")
@click.option("--q-heads", type=int, default=32, show_default=True, help="reference heads per call")
@click.option("--kv-heads", type=int, default=4, show_default=True, help="KV heads at the reference")
@click.option("--head-dim", type=int, default=128, show_default=True, help="head width")
@click.option("--heads-length", type=SizeType(), default=16384, show_default=True,
              help="document length of the heads sweep")
@click.option("--heads-tokens", type=SizeType(), default=65536, show_default=True,
              help="tokens of one heads-sweep call, packed with --heads-length documents (a tile batch's geometry; "
                   "equal to --heads-length: one document per call)")
@click.option("--copy-mb", type=click.IntRange(min=1), default=1024, show_default=True,
              help="size of the device-to-device copy (MiB)")
@click.option("--base-profile", default=DEFAULT_PROFILE, show_default=True,
              help="profile whose links / cluster shape the measured profile keeps (name or .json)")
@quick_option("tiny sizes (CPU smoke): lengths 128..1024, heads 1,2,4 of 4, 5 repeats")
@click.option("--piece-pricing", type=click.Choice(PIECE_CHOICES), default=PIECE_PRICINGS[0], show_default=True,
              help="how the profile prices a tile's piece of a sample (docs/profile.md); 'measured' keeps the rule "
                   "with the smaller median error on the piece sweep (both rules' errors are recorded either way)")
@click.option("--links", is_flag=True,
              help="also time the link between two local ranks (gloo on CPU, NCCL on 2 GPUs) and fit the "
                   "profile's intra-node class to it")
def calibrate(device, backend, dtype, warmup, repeats, rotate, rotate_mb, cpu_threads, seed, out, force, no_progress, lengths,
              heads, q_heads, kv_heads, head_dim, heads_length, heads_tokens, copy_mb, base_profile, quick, piece_pricing,
              links):
    """Measure the attention kernel (Figure 5), device copy bandwidth, and write a measured profile.

    On ``--device cpu`` the sweep is CPU-sized unless given (:data:`CPU_DEFAULTS`: lengths 128..8K,
    8 q / 2 kv heads, head_dim 64); its ``profile.json`` is what ``libra-bench microbench --methods
    ...,libra-kt --profile PATH`` balances kernel time with."""
    if quick:
        lengths, heads, q_heads, kv_heads, head_dim = [128, 256, 512, 1024], [1, 2, 4], 4, 2, 32
        heads_length, heads_tokens, warmup, repeats, rotate, copy_mb = 512, 512, 1, 5, 2, 16
    else:
        (lengths, heads, q_heads, kv_heads, head_dim, heads_length, heads_tokens, copy_mb, warmup, repeats,
         rotate) = _cpu_sized(click.get_current_context(), device, lengths, heads, q_heads, kv_heads, head_dim,
                              heads_length, heads_tokens, copy_mb, warmup, repeats, rotate)
    try:
        cfg = CalibrateConfig(lengths=tuple(lengths), heads=tuple(heads), q_heads=q_heads, kv_heads=kv_heads,
                              head_dim=head_dim, heads_length=heads_length, heads_tokens=heads_tokens, warmup=warmup,
                              repeats=repeats,
                              rotate=rotate, rotate_mb=rotate_mb, copy_mb=copy_mb, seed=seed, links=links,
                              piece_pricing=piece_pricing)
        opts = MeasureOptions(device=device, backend=backend, dtype=dtype, out=out, force=force, quiet=no_progress,
                              cpu_threads=cpu_threads)
        res = run_calibrate(cfg, opts, base_profile=base_profile)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    fit, s = res["fit"], res["summary"]
    click.echo(f"calibrate: {s['device']} backend={s['backend']} dtype={s['dtype']}")
    click.echo("Figure 5 (throughput normalised to the best of each curve):")
    click.echo(format_curves(res["df"]))
    click.echo(f"fit: rate_inf {fit['rate_inf_tflops']:.4g} TFLOP/s, half_length {fit['half_length']:.4g}, "
               f"exponent {fit['exponent']:.3g} (worst err {fit['length_fit_max_rel_err']:.2%}); heads_half "
               f"{fit['heads_half']:.4g} (worst err {fit['heads_fit_max_rel_err']:.2%}); launch "
               f"{fit['launch_ms']:.4g} ms; bwd/fwd {fit['backward_time_ratio']:.3f}")
    if fit.get("piece_median_abs_err"):
        errs = ", ".join(f"{r} {e:.1%}" for r, e in fit["piece_median_abs_err"].items())
        click.echo(f"late pieces (piece sweep), median |error|: {errs}; profile keeps {fit['piece_pricing']}")
    if fit["device_copy_gbps"] is not None:
        click.echo(f"device copy: {fit['device_copy_gbps']:.4g} GB/s (bytes copied per second on one device)")
    if fit["link_bandwidth_gbps"] is not None:
        click.echo(f"link ({LINK_CLASSES[0]} class, two local ranks): {fit['link_bandwidth_gbps']:.4g} GB/s, latency "
                   f"{fit['link_latency_ms']:.4g} ms (worst err {fit['link_fit_max_rel_err']:.1%})")
    click.echo(f"wrote {res['paths']['csv']}, {res['paths']['png']}, {res['paths']['profile']}")
