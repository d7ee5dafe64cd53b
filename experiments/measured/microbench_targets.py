"""The targets for the CPU microbench, printed by ``libra-bench microbench`` (and recorded in
its ``run.json``) when a run measures one of their reference cases: the target lives in the
command that measures it, as ``plan-cost`` prints its own.

The reference command: 2 single-thread ranks, DP = 2, CP = 1, P = 2, GBS 2, H = 2, 8 query / 2 KV
heads, head_dim 64, fp32, forward + backward, the microbench's default Pipeliner chunks (M = 2):

* **skewed** windows -- one packed sequence holding a single S-token sample, the other S / 1024
  samples of 1024 tokens (``workloads/skewed-8k.txt``, ``workloads/skewed-16k.txt``): ``libra``'s
  ``ideal_ratio`` at most 1.08 at S = 8192 (B = 1024) and 1.05 at S = 16384 (B = 2048);
* **uniform** windows -- every sample 1024 tokens, S = 8192, B = 1024
  (``workloads/uniform-1024.txt``): ``libra``'s ``cpu_vs_ulysses`` at most 1.03 (the same attention
  work on every rank, so any excess is the runtime's overhead).

A target's figure is the median of at least three runs; one run's verdict says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

REFERENCE_LAYOUT = {"dp": 2, "cp": 1, "gbs": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 64, "dtype": "fp32",
                    "device": "cpu", "backward": True}
"""The reference command's layout (fields of ``microbench``'s configuration)."""
REFERENCE_TAP = {"pool_size": 2, "head_split": 2, "pipeline_chunks": 2}
"""Its TAP options besides the block size (the microbench's default M = 2)."""
SKEWED_IDEAL_RATIO = {(8192, 1024): 1.08, (16384, 2048): 1.05}
"""``libra``'s ``ideal_ratio`` bound on skewed windows, by (S, B)."""
UNIFORM = (8192, 1024, 1024)
"""(S, B, sample length) of the uniform case."""
UNIFORM_CPU_RATIO = 1.03
"""``libra``'s ``cpu_vs_ulysses`` bound on the uniform case."""


@dataclass(frozen=True)
class Target:
    """One bound on one summary column of one method, for the case it names."""

    method: str
    column: str
    bound: float
    case: str

    def line(self, summary: pd.DataFrame) -> str | None:
        """The printed verdict for ``summary`` (:func:`experiments.measured.microbench.summarize`), or None
        when the run has no such method or column."""
        rows = summary[summary["method"] == self.method]
        if rows.empty or self.column not in rows or not math.isfinite(float(rows[self.column].iloc[0])):
            return None
        value = float(rows[self.column].iloc[0])
        met = "met" if value <= self.bound else "NOT met"
        return (f"target ({self.case}): {self.method} {self.column} {value:.3f} <= {self.bound} ({met}; "
                f"one run -- the target's figure is the median of >= 3 runs)")


def _is_reference(cfg) -> bool:
    return (all(getattr(cfg, k) == v for k, v in REFERENCE_LAYOUT.items())
            and all(getattr(cfg.tap, k) == v for k, v in REFERENCE_TAP.items()))


def _skewed(windows, seq_len: int) -> bool:
    """Every window: one sequence of a single ``seq_len`` sample, one of ``seq_len / 1024`` 1024s."""
    want = sorted([[seq_len], [1024] * (seq_len // 1024)])
    return bool(windows) and all(sorted(list(map(int, s.sample_lengths)) for s in w) == want for w in windows)


def _uniform(windows, length: int) -> bool:
    return bool(windows) and all(int(n) == length for w in windows for s in w for n in s.sample_lengths)


def reference_targets(cfg, windows) -> list[Target]:
    """The targets that a run of configuration ``cfg`` (an
    :class:`experiments.measured.microbench.MicrobenchConfig`, not imported here: microbench imports
    this module) over ``windows`` (:func:`libra.data.windows.gbs_windows`' GBS windows) measures; []
    for any other run."""
    if not _is_reference(cfg):
        return []
    S, B = cfg.seq_len, cfg.tap.block_size
    bound = SKEWED_IDEAL_RATIO.get((S, B))
    if bound is not None and _skewed(windows, S):
        return [Target("libra", "ideal_ratio", bound, f"S={S}, one {S}-token sample against {S // 1024} x 1024")]
    if (S, B) == UNIFORM[:2] and _uniform(windows, UNIFORM[2]):
        return [Target("libra", "cpu_vs_ulysses", UNIFORM_CPU_RATIO, f"S={S}, every sample {UNIFORM[2]} tokens")]
    return []
