"""The competitors section of ``results/REPRODUCTION.md``: where each competitor comes from, and how
far Libra leads it.

Two tables. The first is :data:`baselines.origins.ORIGINS` as markdown: for every competitor the
repository, paths and commit its algorithm was read from (or the paper, when no code was), and how
the row relates to the DistCA number the Libra paper quotes. The second gives, per straggler run
(workload and setting), every competitor's mean straggler per step and per window and the speedup
of ``libra`` and ``libra-adaptive`` over it. The per-window total (a window's step stragglers
summed) is the figure that compares a planner forming another number of microbatches than GA
(``dynamic-cp``); the per-step mean is what Figure 12 plots.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from baselines.origins import Origin, competitors

LEADERS = ("libra", "libra-adaptive")
"""The methods whose lead over every competitor the speedup table gives."""


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _source_text(o: Origin) -> str:
    if o.repository is None:
        return f"{o.reference} (no code read)"
    return f"`{o.repository}`: " + "; ".join(o.paths) + f" ({o.reference})"


def origin_lines() -> list[str]:
    """The origin table: one row per competitor of :data:`baselines.origins.ORIGINS`."""
    lines = ["| method | what it runs | from (repository: paths, or the paper) | commit | "
             "the paper's DistCA number | documented in |",
             "|---|---|---|---|---|---|"]
    for o in competitors():
        commit = f"`{o.commit}`" if o.commit else ("not recorded (the paths are cited)" if o.repository else "-")
        lines.append("| " + " | ".join(_cell(c) for c in (f"`{o.method}`", o.algorithm, _source_text(o), commit,
                                                            o.paper_distca or "-", f"`{o.doc}`")) + " |")
    return lines


def _speedups(summ: pd.DataFrame, method: str, leader: str) -> str:
    if leader not in summ.index:
        return "not in this run"
    step = summ.loc[method, "mean_ms"] / summ.loc[leader, "mean_ms"]
    window = summ.loc[method, "window_ms"] / summ.loc[leader, "window_ms"]
    return f"{step:.2f}x / {window:.2f}x"


def speedup_lines(runs: list[tuple[str, str, str, pd.DataFrame]]) -> list[str]:
    """The speedup table of ``runs``: ``(workload, setting, source label, summary)`` with the summary
    of :func:`experiments.figures.straggler.summarize` for that setting, indexed by method."""
    names = [o.method for o in competitors()]
    lines = ["| workload | setting | method | mean straggler per step (ms) | per window (ms) | "
             + " | ".join(f"{m} speedup (step / window)" for m in LEADERS) + " | source |",
             "|---|---|---|---|---|" + "---|" * len(LEADERS) + "---|"]
    for workload, setting, label, summ in runs:
        for method in [m for m in names if m in summ.index] + [m for m in LEADERS if m in summ.index]:
            lead = [_speedups(summ, method, m) if method not in LEADERS else "-" for m in LEADERS]
            window = summ.loc[method, "window_ms"]
            cells = (workload, setting, f"`{method}`", f"{summ.loc[method, 'mean_ms']:.1f}",
                     f"{window:.1f}" if np.isfinite(window) else "-", *lead, f"`{label}`")
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def section(runs: list[tuple[str, str, str, pd.DataFrame]]) -> list[str]:
    """The markdown section: the origin table, then the speedup table of ``runs`` (when any)."""
    lines = ["", "## Competitors", "",
             "Where each competitor's algorithm comes from (`baselines/origins.py`), and how each row relates to "
             "the DistCA number the paper quotes: the paper ran its own emulation of DistCA (`distca-paper`); "
             "`distca` is DistCA's own planner, priced by the same cost model.", ""] + origin_lines()
    if runs:
        lines += ["", "Libra's and libra-adaptive's speedup over each competitor: the competitor's mean straggler "
                  "over the leader's, per step (what Figure 12 plots) and per window (a window's step stragglers "
                  "summed, the figure that compares `dynamic-cp`, which forms its own number of microbatches). "
                  "Simulated (cost model), from the straggler run of each workload with the most methods. "
                  "`libra-adaptive` chooses each pool's plan with the same cost model and profile that score it here "
                  "(libra's plan is one of its candidates), so its lead over libra holds under this model by "
                  "construction; how it holds under a different profile is not shown by this table.", ""]
        lines += speedup_lines(runs)
    return lines
