"""Device-runtime variability: seeded per-GPU, per-step speed multipliers (Libra sec. 3.2, Fig. 3).

A GPU's speed in one step is ``exp(sigma_gpu * z_gpu + sigma_step * z_step)``: a persistent factor
drawn once per GPU (silicon and thermal lottery) times a fresh factor per step (clocks, contention).
Speed 1 is the profile's kernel model; a worker's compute time is divided by its speed. Draws
depend only on ``(seed, worker)`` and ``(seed, step, worker)``, never on the method priced, so every
method of a comparison sees the same devices.
"""

from __future__ import annotations

import numpy as np

from libra.sim.profiles import Variability


def check_speeds(speeds, n: int | None = None, what: str = "speeds") -> np.ndarray:
    """``speeds`` as float64 ``(N,)`` speed multipliers (a worker's compute time is divided by its
    speed): the one check of :meth:`libra.sim.cost.CostModel.price`'s ``speed``, ``libra-adaptive``'s
    ``device_speeds`` and :func:`libra.extensions.adaptive.retention.speed_reserve`.

    Raises:
        ValueError: not a non-empty 1-D array of finite numbers > 0 (bools are not numbers here), or
            not ``n`` of them when ``n`` is given; the message names ``what``.
    """
    arr = np.asarray(speeds)
    ok = arr.ndim == 1 and len(arr) > 0 and arr.dtype.kind in "iuf" and (n is None or len(arr) == n)
    arr = arr.astype(np.float64) if ok else arr
    if not ok or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        count = "one finite multiplier > 0 per worker" if n is None else f"{n} finite multipliers > 0"
        raise ValueError(f"{what} must be {count}, got shape {arr.shape}, dtype {arr.dtype}")
    return arr


class DeviceJitter:
    """Seeded speed multipliers for ``num_workers`` GPUs.

    Args:
        variability: the profile's sigmas.
        num_workers: GPUs (global worker ids ``0 .. N-1``).
        seed: non-negative integer; same seed, same speeds.

    Raises:
        ValueError: non-positive ``num_workers`` or a negative / non-integer seed.
    """

    def __init__(self, variability: Variability, num_workers: int, seed: int):
        if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.variability = variability
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0]))
        self._gpu = variability.sigma_gpu * rng.standard_normal(self.num_workers)

    def persistent_speeds(self) -> np.ndarray:
        """``(N,)`` float64 persistent factor of every GPU, ``exp(sigma_gpu * z_gpu)``: what a planner
        that measured the cluster knows (e.g. ``libra-adaptive``'s ``device_speeds``); a step's own
        factor is not predictable and stays out."""
        return np.exp(self._gpu)

    def speeds(self, step: int) -> np.ndarray:
        """``(N,)`` float64 speed multipliers (> 0) of every GPU in ``step`` (a non-negative int)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 1, int(step)]))
        return np.exp(self._gpu + self.variability.sigma_step * rng.standard_normal(self.num_workers))
