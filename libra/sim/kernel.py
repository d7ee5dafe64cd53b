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

**Pieces of a sample** (``piece_pricing``). A tile's segment is query rows ``[kv - q, kv)`` of a
sample reading its keys ``[0, kv)``. Two rules price it from the whole-document curve:

* ``effective-length`` (the default): the whole-document formula at ``L_eff = sqrt(2 * area)``;
* ``prefix-difference``: ``T(kv) - T(kv - q)``, ``T`` the time of a whole document of that many
  tokens. A flash kernel's work for a query row depends only on the keys it reads, so the rows of
  a piece cost what they cost inside the whole document; pieces of a sample then add up to the
  sample exactly, and a late block streams a long prefix at a long document's rate. Never below
  the best rate's time (an ``exponent > 2`` curve would otherwise price some pieces faster).

``libra-bench calibrate``'s piece sweep measures both rules' errors and records them in the
profile (``--piece-pricing measured`` keeps the smaller). On ATen's CPU flash kernel, pieces of one
8K (2K) document summed to within 3% (8%) of the whole document, as ``prefix-difference`` says,
and ``effective-length`` overpriced late blocks by up to 22% (59%); on ``libra``'s 8K tile batches
``sim-check`` measured 2.5% median error for ``prefix-difference`` against 8.5%. ``libra-kt``
nonetheless balanced the 8K microbench worse with it (one half-tile within Alg. 2's soft target
decides that two-worker pool; ``experiments.measured.calibrate.fit_piece_pricing``), so every profile keeps
the default unless told otherwise; no GPU piece measurement has been made yet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from libra.sim.occupancy import KERNEL_MODELS, OCCUPANCY, OccupancyModel, occupancy_terms
from libra.workload import attention_flops, sample_area

_BACKWARD_CURVE = ("backward_rate_inf_tflops", "backward_half_length", "backward_exponent")
PIECE_PRICINGS = ("effective-length", "prefix-difference")
"""How a segment that is a piece of a sample is priced (module docstring); the first is the default."""


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
        model: ``"length-curve"`` (the default: this module's per-segment model) or
            ``"occupancy"``: the cost model prices kernel calls with :attr:`occupancy`
            (:mod:`libra.sim.occupancy`); the length curve then still sets the best rate (the
            balance bound's unit), and ``heads_half`` adds its factor on top (:meth:`occupancy_terms`).
        occupancy: the :class:`~libra.sim.occupancy.OccupancyModel` (a dict is accepted); needed by
            and only allowed with ``model = "occupancy"``.

    Raises:
        ValueError: a non-positive rate/length/exponent/ratio, negative launch or heads_half, or
            only some of the backward curve's fields, or an unknown ``piece_pricing`` or ``model``,
            or ``occupancy`` given without ``model = "occupancy"`` or missing with it.
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
    piece_pricing: str = PIECE_PRICINGS[0]
    model: str = KERNEL_MODELS[0]
    occupancy: OccupancyModel | None = None

    def __post_init__(self) -> None:
        if self.model not in KERNEL_MODELS:
            raise ValueError(f"kernel.model must be one of {', '.join(KERNEL_MODELS)}, got {self.model!r}")
        if (self.occupancy is None) != (self.model != OCCUPANCY):
            raise ValueError("kernel.occupancy is needed by, and only allowed with, kernel.model = 'occupancy'")
        if isinstance(self.occupancy, dict):
            try:
                object.__setattr__(self, "occupancy", OccupancyModel(**self.occupancy))
            except TypeError as exc:
                raise ValueError(f"kernel.occupancy: {exc}") from None
        if self.piece_pricing not in PIECE_PRICINGS:
            raise ValueError(f"kernel.piece_pricing must be one of {', '.join(PIECE_PRICINGS)}, "
                             f"got {self.piece_pricing!r}")
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

    def _whole_ms(self, area: np.ndarray, heads, head_dim: int, backward: bool) -> np.ndarray:
        """Time (ms) of segments priced as a whole document of the same causal area (``L_eff``)."""
        flops = attention_flops(area, 1, head_dim) * np.asarray(heads, dtype=np.float64)
        best = self.backward_rate_inf_tflops if backward else self.rate_inf_tflops
        rate = best * 1e12 * self.length_efficiency(np.sqrt(2.0 * area), backward=backward)
        rate = rate * self.heads_efficiency(heads)
        return np.where(area > 0, flops / np.where(area > 0, rate, 1.0) * 1e3, 0.0)

    def _segment_ms(self, area, heads, head_dim: int, kv_len, backward: bool) -> np.ndarray:
        """One pass's time of segments under :attr:`piece_pricing` (module docstring)."""
        area = np.asarray(area, dtype=np.float64)
        if self.piece_pricing == "effective-length" or kv_len is None:
            return self._whole_ms(area, heads, head_dim, backward)
        whole = np.asarray(sample_area(np.asarray(kv_len, dtype=np.int64)), dtype=np.float64)
        if np.any(area > whole):
            raise ValueError("a segment's causal area exceeds that of its whole key prefix (kv_len)")
        t = self._whole_ms(whole, heads, head_dim, backward) - self._whole_ms(whole - area, heads, head_dim, backward)
        best = self.backward_rate_inf_tflops if backward else self.rate_inf_tflops
        floor = attention_flops(area, 1, head_dim) * np.asarray(heads, dtype=np.float64) / (
            best * 1e12 * self.heads_efficiency(heads)) * 1e3
        return np.maximum(t, floor)

    def segment_forward_ms(self, area, heads, head_dim: int, kv_len=None) -> np.ndarray:
        """Forward time (ms, launch excluded) of causal segments.

        Args:
            area: ``(G,)`` causal (query, key) pairs per head of each segment.
            heads: ``(G,)`` or scalar query heads computed per call for the segment.
            head_dim: head width.
            kv_len: ``(G,)`` keys each segment reads (its query rows are the last rows of that
                prefix of its sample); None: whole samples. Only ``prefix-difference`` uses it.

        Returns:
            ``(G,)`` float64 milliseconds.
        """
        return self._segment_ms(area, heads, head_dim, kv_len, backward=False)

    def segment_backward_ms(self, area, heads, head_dim: int, kv_len=None) -> np.ndarray:
        """Backward time (ms, launch excluded) of causal segments: the backward curve where the
        profile has one, else ``backward_time_ratio`` x :meth:`segment_forward_ms`."""
        if not self.has_backward_curve:
            return self.backward_time_ratio * self.segment_forward_ms(area, heads, head_dim, kv_len)
        return self._segment_ms(area, heads, head_dim, kv_len, backward=True)

    def chunked_backward_ms(self, area, heads_per_call, head_dim: int, calls: int, kv_len=None) -> np.ndarray:
        """Backward counterpart of :meth:`chunked_forward_ms` (same calls, launch excluded)."""
        return calls * self.segment_backward_ms(area, heads_per_call, head_dim, kv_len)

    def best_backward_ratio(self) -> float:
        """Backward / forward time at the best rates (long segments): the balance bound's backward share."""
        if not self.has_backward_curve:
            return float(self.backward_time_ratio)
        return float(self.rate_inf_tflops / self.backward_rate_inf_tflops)

    def chunked_forward_ms(self, area, heads_per_call, head_dim: int, calls: int, kv_len=None) -> np.ndarray:
        """Forward time (ms, launch excluded) of segments run as ``calls`` kernel calls of
        ``heads_per_call`` heads each: the same FLOPs at the rate of fewer heads per call.

        The Pipeliner decides the split (Libra sec. 4.4: ``M`` calls of ``width / M`` heads,
        :meth:`libra.tap.pipeline.ChunkSchedule.heads_per_call`); the cost model and TAP's
        kernel-time weights both pass its numbers here, with each segment's ``kv_len``.
        """
        return calls * self.segment_forward_ms(area, heads_per_call, head_dim, kv_len)

    def document_forward_ms(self, lengths, heads: int, head_dim: int) -> np.ndarray:
        """Forward time of whole causal documents, one kernel call each (the calibration geometry)."""
        area = sample_area(np.asarray(lengths, dtype=np.int64))
        return self.launch_ms + self.segment_forward_ms(area, heads, head_dim)

    def occupancy_terms(self, seg: dict, heads, calls, head_dim: int, backward: bool, geometry: tuple | None = None):
        """``(work, floor)`` of kernel segments under :attr:`occupancy`
        (:func:`libra.sim.occupancy.occupancy_terms`, ``geometry`` its blocks where the caller has
        them), every block slowed by ``1 / h(n)`` where ``heads_half > 0``: a heads-per-call penalty
        on top of the occupancy model's own (fewer heads, fewer blocks to fill the SMs with)."""
        work, floor = occupancy_terms(self.occupancy, seg, heads, calls, head_dim, backward, geometry)
        if not self.heads_half:
            return work, floor
        slow = 1.0 / self.heads_efficiency(heads)
        return work * slow, floor * slow

    def best_rate_tflops(self) -> float:
        """Highest forward rate the model allows (long segments, reference heads)."""
        return float(self.rate_inf_tflops)

    def to_dict(self) -> dict:
        """The profile JSON's ``kernel`` object (the backward curve only where there is one, and
        ``piece_pricing``, ``model`` and ``occupancy`` only where they are not the default, so a
        profile without them records exactly what it did before they existed)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__
               if not (k in _BACKWARD_CURVE and getattr(self, k) is None)
               and not (k == "piece_pricing" and self.piece_pricing == PIECE_PRICINGS[0])
               and k not in ("model", "occupancy")}
        if self.occupancy is not None:
            out.update(model=self.model, occupancy=self.occupancy.to_dict())
        return out


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


def piece_pricing_errors(kernel: KernelModel, q_start, kv_len, times_ms, heads: int, head_dim: int,
                         backward: bool = False) -> dict[str, np.ndarray]:
    """Each :data:`PIECE_PRICINGS` rule's relative error (predicted / measured - 1) on measured pieces.

    Args:
        kernel: the model fitted to whole documents (its ``piece_pricing`` is ignored).
        q_start, kv_len: ``(n,)`` each piece is query rows ``[q_start, kv_len)`` of one causal
            document reading keys ``[0, kv_len)``.
        times_ms: ``(n,)`` measured time of each piece, one kernel call (launch included).
        heads, head_dim: query heads per call and head width of the measurement.
        backward: the times are backward passes.

    Returns:
        ``{rule: (n,) float64 errors}``.

    Raises:
        ValueError: mismatched shapes, ``q_start`` outside ``[0, kv_len)`` or a non-positive time.
    """
    q0, kv = np.asarray(q_start, dtype=np.int64), np.asarray(kv_len, dtype=np.int64)
    times = np.asarray(times_ms, dtype=np.float64)
    if not (q0.shape == kv.shape == times.shape) or q0.ndim != 1:
        raise ValueError(f"q_start, kv_len and times_ms must be matching 1-D arrays, got {q0.shape}, {kv.shape}, "
                         f"{times.shape}")
    if np.any(q0 < 0) or np.any(q0 >= kv) or not np.all(times > 0):
        raise ValueError("each piece needs 0 <= q_start < kv_len and a positive time")
    area = np.asarray(sample_area(kv) - sample_area(q0), dtype=np.float64)
    launch = kernel.launch_ms * (kernel.backward_time_ratio if backward else 1.0)
    out = {}
    for rule in PIECE_PRICINGS:
        k = replace(kernel, piece_pricing=rule)
        price = k.segment_backward_ms if backward else k.segment_forward_ms
        out[rule] = (price(area, heads, head_dim, kv) + launch) / times - 1.0
    return out


def choose_piece_pricing(errors: list[dict[str, np.ndarray]]) -> tuple[str, dict[str, float]]:
    """The rule with the smallest median absolute error over every piece of ``errors`` (one
    :func:`piece_pricing_errors` result per pass); ties keep the default.

    Returns:
        ``(rule, {rule: median |error|})``.
    """
    med = {rule: float(np.median(np.abs(np.concatenate([e[rule] for e in errors])))) for rule in PIECE_PRICINGS}
    best = min(PIECE_PRICINGS, key=lambda r: (med[r], PIECE_PRICINGS.index(r)))
    return best, med
