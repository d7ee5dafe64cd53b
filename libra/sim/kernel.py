"""Attention kernel timing model: efficiency vs segment length and heads per call.

Libra sec. 3.3 / Figure 5 and DESIGN.md sec. 5: a FlashAttention varlen call runs short segments
far below its asymptotic rate, and fewer heads per call cost a little throughput. The model is

    t_fwd(segment) = flops / (rate_inf * e(L_eff) * h(heads))          [per segment]
    e(L) = 1 / (1 + (half_length / L) ** exponent)
    h(n) = (n / (n + heads_half)) / (n_ref / (n_ref + heads_half))      (h(n_ref) = 1)

plus ``launch_ms`` once per kernel call. Backward is ``backward_time_ratio`` x forward, or -- when
the profile carries a measured backward curve (``backward_rate_inf_tflops``, ``backward_half_length``,
``backward_exponent``, fitted by ``libra-bench calibrate`` to the backward length sweep) -- its own
``t_bwd = forward flops / (backward_rate_inf * e_bwd(L_eff) * h(heads))``: on CPU the measured
bwd/fwd ratio grows from about 1.6 at 128 tokens to 2.3 at 8K, and a planner that balances forward
time alone then leaves the backward pass unbalanced. ``L_eff = sqrt(2 * area)`` is the side of the causal
square with the segment's (query, key) area, so a whole sample of length L has ``L_eff ~= L``
(the geometry of the calibration table) and a late block of a long sample, which streams a long
KV prefix, counts as long. :func:`fit_length_efficiency` fits ``rate_inf, half_length, exponent``
to a table of (length, ms) measurements of whole causal documents; the default profile's numbers
come from running it on the public FlashAttention-2 H100 table (DESIGN.md sec. 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra.workload import attention_flops, sample_area

_BACKWARD_CURVE = ("backward_rate_inf_tflops", "backward_half_length", "backward_exponent")


@dataclass(frozen=True)
class KernelModel:
    """Parameters of the attention kernel timing model (see module docstring).

    Attributes:
        rate_inf_tflops: asymptotic forward rate of the kernel on long segments (TFLOP/s).
        half_length: segment length at which efficiency is 1/2 (tokens).
        exponent: steepness of the efficiency curve.
        launch_ms: fixed cost per kernel call (ms).
        reference_heads: heads per call of the calibration table (h = 1 there).
        heads_half: heads-per-call constant of ``h(n)``; 0 disables the heads factor.
        backward_time_ratio: backward time / forward time of the same segment (the backward model
            when there is no backward curve; the backward launch cost is ``launch_ms`` x it).
        backward_rate_inf_tflops, backward_half_length, backward_exponent: the backward pass's own
            length curve (rate in forward FLOPs per second of backward time); all three or none.

    Raises:
        ValueError: a non-positive rate/length/exponent/ratio, negative launch or heads_half, or
            only some of the backward curve's fields.
    """

    rate_inf_tflops: float
    half_length: float
    exponent: float
    launch_ms: float
    reference_heads: int
    heads_half: float
    backward_time_ratio: float
    backward_rate_inf_tflops: float | None = None
    backward_half_length: float | None = None
    backward_exponent: float | None = None

    def __post_init__(self) -> None:
        for name in ("rate_inf_tflops", "half_length", "exponent", "backward_time_ratio", "reference_heads"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"kernel.{name} must be a number > 0, got {value!r}")
        for name in ("launch_ms", "heads_half"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"kernel.{name} must be a number >= 0, got {value!r}")
        curve = [getattr(self, n) for n in _BACKWARD_CURVE]
        if any(v is not None for v in curve):
            for name, value in zip(_BACKWARD_CURVE, curve):
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                    raise ValueError(f"kernel.{name} must be a number > 0 (the backward curve needs all of "
                                     f"{', '.join(_BACKWARD_CURVE)}), got {value!r}")

    @property
    def has_backward_curve(self) -> bool:
        """Whether backward time has its own measured length curve (else ``backward_time_ratio``)."""
        return self.backward_rate_inf_tflops is not None

    def length_efficiency(self, eff_len, backward: bool = False) -> np.ndarray:
        """``e(L)`` in (0, 1) for an array of effective segment lengths (tokens, > 0); ``backward``:
        the backward curve's ``e_bwd(L)`` (needs :attr:`has_backward_curve`)."""
        eff_len = np.maximum(np.asarray(eff_len, dtype=np.float64), 1.0)
        half, exponent = ((self.backward_half_length, self.backward_exponent) if backward
                          else (self.half_length, self.exponent))
        return 1.0 / (1.0 + (half / eff_len) ** exponent)

    def heads_efficiency(self, heads) -> np.ndarray:
        """``h(n)`` relative to the calibration's heads per call (1 at ``reference_heads``)."""
        heads = np.asarray(heads, dtype=np.float64)
        ref = self.reference_heads / (self.reference_heads + self.heads_half)
        return heads / (heads + self.heads_half) / ref

    def segment_forward_ms(self, area, heads, head_dim: int) -> np.ndarray:
        """Forward time (ms, launch excluded) of causal segments.

        Args:
            area: ``(G,)`` causal (query, key) pairs per head of each segment.
            heads: ``(G,)`` or scalar query heads computed per call for the segment.
            head_dim: head width.

        Returns:
            ``(G,)`` float64 milliseconds.
        """
        area = np.asarray(area, dtype=np.float64)
        flops = attention_flops(area, 1, head_dim) * np.asarray(heads, dtype=np.float64)
        rate = self.rate_inf_tflops * 1e12 * self.length_efficiency(np.sqrt(2.0 * area))
        rate = rate * self.heads_efficiency(heads)
        return np.where(area > 0, flops / rate * 1e3, 0.0)

    def segment_backward_ms(self, area, heads, head_dim: int) -> np.ndarray:
        """Backward time (ms, launch excluded) of causal segments: the backward curve where the
        profile has one, else ``backward_time_ratio`` x :meth:`segment_forward_ms`."""
        if not self.has_backward_curve:
            return self.backward_time_ratio * self.segment_forward_ms(area, heads, head_dim)
        area = np.asarray(area, dtype=np.float64)
        flops = attention_flops(area, 1, head_dim) * np.asarray(heads, dtype=np.float64)
        eff = self.length_efficiency(np.sqrt(2.0 * area), backward=True)
        rate = self.backward_rate_inf_tflops * 1e12 * eff * self.heads_efficiency(heads)
        return np.where(area > 0, flops / rate * 1e3, 0.0)

    def chunked_backward_ms(self, area, heads_per_call, head_dim: int, calls: int) -> np.ndarray:
        """Backward counterpart of :meth:`chunked_forward_ms` (same calls, launch excluded)."""
        return calls * self.segment_backward_ms(area, heads_per_call, head_dim)

    def best_backward_ratio(self) -> float:
        """Backward / forward time at the best rates (long segments): the balance bound's backward share."""
        if not self.has_backward_curve:
            return float(self.backward_time_ratio)
        return float(self.rate_inf_tflops / self.backward_rate_inf_tflops)

    def chunked_forward_ms(self, area, heads_per_call, head_dim: int, calls: int) -> np.ndarray:
        """Forward time (ms, launch excluded) of segments run as ``calls`` kernel calls of
        ``heads_per_call`` heads each: the same FLOPs at the rate of fewer heads per call.

        The Pipeliner decides the split (Libra sec. 4.4: ``M`` calls of ``width / M`` heads,
        :meth:`libra.tap.pipeline.ChunkSchedule.heads_per_call`); the cost model and TAP's
        kernel-time weights both pass its numbers here.
        """
        return calls * self.segment_forward_ms(area, heads_per_call, head_dim)

    def document_forward_ms(self, lengths, heads: int, head_dim: int) -> np.ndarray:
        """Forward time of whole causal documents, one kernel call each (the calibration geometry)."""
        area = sample_area(np.asarray(lengths, dtype=np.int64))
        return self.launch_ms + self.segment_forward_ms(area, heads, head_dim)

    def best_rate_tflops(self) -> float:
        """Highest forward rate the model allows (long segments, reference heads)."""
        return float(self.rate_inf_tflops)

    def to_dict(self) -> dict:
        """The profile JSON's ``kernel`` object (the backward curve only where there is one, so a
        profile without it records exactly what it did before the curve existed)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__
                if not (k in _BACKWARD_CURVE and getattr(self, k) is None)}


def fit_length_efficiency(lengths, times_ms, heads: int, head_dim: int, launch_ms: float = 0.0):
    """Fit ``rate_inf, half_length, exponent`` to forward times of whole causal documents.

    Minimises the worst relative error over a log grid of ``half_length`` (16 .. 1M tokens) and a
    grid of ``exponent`` (0.3 .. 4); for each grid point the best ``1 / rate_inf`` is the
    closed-form relative least-squares solution. numpy only, deterministic.

    Args:
        lengths: ``(n,)`` document lengths (tokens), n >= 3.
        times_ms: ``(n,)`` measured forward times of one document per call (ms).
        heads, head_dim: query heads and head width of the measurement.
        launch_ms: fixed per-call cost assumed in the measurements.

    Returns:
        ``(rate_inf_tflops, half_length, exponent, max_rel_error)``.

    Raises:
        ValueError: fewer than 3 points, mismatched sizes, or non-positive values.
    """
    lengths = np.asarray(lengths, dtype=np.float64)
    times = np.asarray(times_ms, dtype=np.float64)
    if lengths.shape != times.shape or lengths.ndim != 1 or len(lengths) < 3:
        raise ValueError(f"need >= 3 matching (length, time) points, got {lengths.shape} and {times.shape}")
    if np.any(lengths <= 0) or np.any(times <= launch_ms):
        raise ValueError("lengths must be > 0 and times must exceed launch_ms")
    flops_ms = attention_flops(sample_area(lengths.astype(np.int64)), heads, head_dim) * 1e-9
    y = times - launch_ms
    exps = np.linspace(0.3, 4.0, 371)[:, None]  # (E, 1) broadcast against the n points
    best = None
    for half in np.exp(np.linspace(np.log(16.0), np.log(1 << 20), 600)):
        x = flops_ms * (1.0 + (half / lengths) ** exps)  # (E, n)
        a = np.sum(x * y / times**2, axis=1) / np.sum((x / times) ** 2, axis=1)  # 1 / rate_inf
        err = np.max(np.abs(x * a[:, None] - y) / times, axis=1)
        i = int(np.argmin(err))
        if best is None or err[i] < best[3]:
            best = (float(1.0 / a[i]), float(half), float(exps[i, 0]), float(err[i]))
    return best
