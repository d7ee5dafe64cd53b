"""Fit a link class's bandwidth to one reported number by bisection (paper-inferred profiles).

The public-fact profile ``h100-roce-v1`` guesses the inter-supernode bandwidth (25 GB/s per GPU).
The paper reports quantities that depend on it, e.g. Figure 15's communication of the slowest
pool at P = 32 on 256K (Libra sec. 6.5: 0.77 of Ulysses' mean straggler). This module derives a
profile whose bandwidth reproduces one such number and leaves every other field unchanged:

* :func:`with_link_bandwidth`: a copy of a profile with one link class's bandwidth replaced.
* :func:`price_windows`: prices already planned GBS windows exactly as
  :func:`libra.sim.simulator.simulate_window` does (same per-window device jitter), so a fit can
  plan once and re-price many candidate profiles (planning never reads the profile).
* :func:`comm_share`: Figure 15's metric, mean exposed communication of a method's straggler over
  all steps / mean straggler of the baseline (Ulysses) on the same windows.
* :func:`bisect_bandwidth`: deterministic bisection on log-bandwidth of a metric that falls as
  bandwidth grows; returns every probe for the record.
* :func:`crossing_traffic`: per-supernode bytes and active senders of a priced Plan (the
  diagnosis of how crossing traffic is priced).
* :func:`fit_latency_bandwidth`: a link class's latency and bandwidth from point-to-point
  transfer times (``libra-bench calibrate --links``).

numpy only; planners are the caller's (``libra`` never imports ``baselines``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from libra.config import ParallelConfig
from libra.sim.cost import CostModel, PlanCost
from libra.sim.profiles import LINK_CLASSES, HardwareProfile, profile_from_dict
from libra.sim.simulator import StepResult, step_result
from libra.sim.topology import Topology
from libra.sim.variability import DeviceJitter


def with_link_bandwidth(profile: HardwareProfile, link_class: str, bandwidth_gbps: float, *,
                        name: str | None = None, description: str | None = None,
                        source: dict | None = None, latency_ms: float | None = None) -> HardwareProfile:
    """Copy of ``profile`` with ``links[link_class].bandwidth_gbps`` replaced (all else kept).

    Args:
        profile: the profile to derive from.
        link_class: one of :data:`libra.sim.profiles.LINK_CLASSES`.
        bandwidth_gbps: new GB/s per direction per GPU (> 0).
        name, description, source: optional replacements of those fields.
        latency_ms: optional new latency of the class (>= 0; the profile's check).

    Raises:
        ValueError: unknown link class or a bandwidth that is not a finite number > 0.
    """
    if link_class not in LINK_CLASSES:
        raise ValueError(f"unknown link class {link_class!r}; choose from {list(LINK_CLASSES)}")
    bad = isinstance(bandwidth_gbps, bool) or not isinstance(bandwidth_gbps, (int, float, np.floating))
    if bad or not math.isfinite(bandwidth_gbps) or bandwidth_gbps <= 0:
        raise ValueError(f"bandwidth_gbps must be a finite number > 0, got {bandwidth_gbps!r}")
    data = profile.to_dict()
    data["links"][link_class]["bandwidth_gbps"] = float(bandwidth_gbps)
    if latency_ms is not None:
        data["links"][link_class]["latency_ms"] = float(latency_ms)
    for key, value in (("name", name), ("description", description), ("source", source)):
        if value is not None:
            data[key] = value
    return profile_from_dict(data, origin=f"{profile.name} with {link_class}={bandwidth_gbps} GB/s")


def fit_latency_bandwidth(nbytes, times_ms) -> tuple[float, float, float]:
    """Fit ``t = latency + bytes / bandwidth`` to point-to-point transfer times (a link probe).

    Least squares on relative error (each point weighted by ``1 / t``), so small transfers fix the
    latency and large ones the bandwidth; a negative intercept is refitted through zero.

    Args:
        nbytes: ``(n,)`` bytes per transfer (>= 2 distinct sizes, each > 0).
        times_ms: ``(n,)`` measured one-way times (ms, > 0).

    Returns:
        ``(bandwidth_gbps, latency_ms, max_rel_err)``: GB/s (10^9 bytes per second), ms and the
        worst relative error of the fit over the points.

    Raises:
        ValueError: mismatched or too few points, or non-positive values.
    """
    b = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(times_ms, dtype=np.float64)
    if b.shape != t.shape or b.ndim != 1 or len(np.unique(b)) < 2:
        raise ValueError(f"need >= 2 distinct (bytes, ms) points of matching shape, got {b.shape} and {t.shape}")
    if not (np.all(b > 0) and np.all(t > 0) and np.all(np.isfinite(t))):
        raise ValueError("bytes and times must be finite numbers > 0")
    w = 1.0 / t
    (slope, lat), *_ = np.linalg.lstsq(np.stack([b * w, w], axis=1), t * w, rcond=None)
    if lat < 0 or slope <= 0:
        lat = 0.0
        slope = float(np.sum(b * t * w * w) / np.sum((b * w) ** 2))
    if slope <= 0:
        raise ValueError("transfer times do not grow with size: no bandwidth to fit")
    err = float(np.max(np.abs(lat + slope * b - t) / t))
    return float(1.0 / slope / 1e6), float(lat), err  # bytes per ms -> GB/s


def price_windows(profile: HardwareProfile, par: ParallelConfig, windows_plans: Sequence[Sequence],
                  seeds: Sequence[int], jitter: bool = True) -> list[StepResult]:
    """Price planned windows as :func:`libra.sim.simulator.simulate_window` would.

    Args:
        profile: hardware profile to price with.
        par: parallel layout the plans were made for.
        windows_plans: per window, its Plans (one per GA index).
        seeds: per window, its device-jitter seed (the experiments' ``jitter_seed(seed, w)``).
        jitter: apply the profile's device variability.

    Returns:
        One :class:`StepResult` per (window, GA index), windows in order.

    Raises:
        ValueError: ``seeds`` and ``windows_plans`` differ in length.
    """
    if len(seeds) != len(windows_plans):
        raise ValueError(f"{len(windows_plans)} planned windows but {len(seeds)} jitter seeds")
    cost_model = CostModel(profile, Topology(profile, par))
    out = []
    for plans, seed in zip(windows_plans, seeds):
        dev = DeviceJitter(profile.variability, par.workers, int(seed)) if jitter else None
        for plan in plans:
            speed = dev.speeds(int(plan.ga_index)) if dev is not None else None
            out.append(step_result(cost_model.price(plan, speed=speed)))
    return out


def comm_share(profile: HardwareProfile, par: ParallelConfig, method_plans: Sequence[Sequence],
               baseline_plans: Sequence[Sequence], seeds: Sequence[int]) -> float:
    """Figure 15's communication bar: mean straggler exposed comm / baseline mean straggler.

    Same definition as ``experiments.figures.pool_sweep.summarize``'s ``comm_norm`` (for methods without
    the Pipeliner the exposed communication is all of it, Libra sec. 6.5).

    Raises:
        ValueError: no steps, or the baseline's mean straggler is not positive.
    """
    method = price_windows(profile, par, method_plans, seeds)
    base = price_windows(profile, par, baseline_plans, seeds)
    if not method or not base:
        raise ValueError("comm_share needs at least one planned step for the method and the baseline")
    denom = float(np.mean([r.straggler_ms for r in base]))
    if not denom > 0:
        raise ValueError(f"baseline mean straggler must be > 0 ms, got {denom!r}")
    return float(np.mean([r.comm_exposed_ms for r in method])) / denom


@dataclass(frozen=True)
class LinkFit:
    """Result of :func:`bisect_bandwidth`.

    Attributes:
        bandwidth_gbps: the fitted bandwidth (geometric midpoint of the last bracket).
        value: the metric at ``bandwidth_gbps``.
        target: the number fitted to.
        probes: every ``(bandwidth_gbps, metric)`` evaluated, in order (bracket ends first).
    """

    bandwidth_gbps: float
    value: float
    target: float
    probes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"bandwidth_gbps": self.bandwidth_gbps, "value": self.value, "target": self.target,
                "probes": [[float(b), float(v)] for b, v in self.probes]}


def bisect_bandwidth(metric: Callable[[float], float], target: float, lo: float, hi: float,
                     rel_tol: float = 1e-4, max_iter: int = 100) -> LinkFit:
    """Bandwidth at which ``metric`` (non-increasing in bandwidth) equals ``target``.

    Bisects on log-bandwidth, so the bracket ``[lo, hi]`` may span decades; deterministic (the
    probes depend only on the arguments). Stops when ``hi / lo - 1 <= rel_tol``.

    Args:
        metric: bandwidth (GB/s) -> metric, e.g. a partial of :func:`comm_share`.
        target: metric value to reach.
        lo, hi: bracket, ``0 < lo < hi``; must satisfy ``metric(lo) >= target >= metric(hi)``.
        rel_tol: relative bracket width to stop at (> 0).
        max_iter: bisection steps at most (>= 1).

    Raises:
        ValueError: a bad bracket or tolerance, a non-finite metric value, or a target the bracket
            does not contain (the message gives both end values).
    """
    for name, v in (("lo", lo), ("hi", hi), ("target", target), ("rel_tol", rel_tol)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if not 0 < lo < hi:
        raise ValueError(f"bandwidth bracket must satisfy 0 < lo < hi, got lo={lo!r}, hi={hi!r}")
    if rel_tol <= 0:
        raise ValueError(f"rel_tol must be > 0, got {rel_tol!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}")
    probes: list = []

    def probe(bw: float) -> float:
        value = float(metric(bw))
        if not math.isfinite(value):
            raise ValueError(f"metric returned {value!r} at bandwidth {bw!r} GB/s")
        probes.append((bw, value))
        return value

    v_lo, v_hi = probe(float(lo)), probe(float(hi))
    if not v_lo >= target >= v_hi:
        raise ValueError(f"target {target!r} is outside the bracket: metric({lo!r} GB/s) = {v_lo:.6g}, "
                         f"metric({hi!r} GB/s) = {v_hi:.6g} (metric must fall as bandwidth grows)")
    a, b = float(lo), float(hi)
    for _ in range(max_iter):
        if b / a - 1 <= rel_tol:
            break
        mid = math.sqrt(a * b)
        if probe(mid) >= target:
            a = mid
        else:
            b = mid
    best = math.sqrt(a * b)
    return LinkFit(bandwidth_gbps=best, value=probe(best), target=float(target), probes=probes)


def crossing_traffic(cost: PlanCost, topology: Topology) -> list[dict]:
    """How much of a priced Plan's traffic crosses supernodes, per supernode (diagnosis).

    Returns:
        One dict per supernode holding plan workers: ``supernode``, ``workers``, ``senders``
        (workers with inter-supernode bytes > 0 over fwd + bwd), ``bytes_sent``, and the
        ``mean_worker_bytes`` / ``max_worker_bytes`` of inter-supernode bytes sent per worker.
        When ``senders == workers`` a per-GPU share of an oversubscribed uplink equals the
        all-GPUs-send figure that the profile's per-GPU bandwidth already states.
    """
    sent = cost.bytes_sent["inter_supernode"]
    active = cost.pool >= 0
    rows = []
    for k in range(int(topology.supernode.max()) + 1):
        m = active & (topology.supernode == k)
        if not m.any():
            continue
        rows.append({"supernode": k, "workers": int(m.sum()), "senders": int((sent[m] > 0).sum()),
                     "bytes_sent": float(sent[m].sum()), "mean_worker_bytes": float(sent[m].mean()),
                     "max_worker_bytes": float(sent[m].max())})
    return rows
