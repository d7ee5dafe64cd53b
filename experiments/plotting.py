"""Shared seaborn style for every `libra-bench` figure: one look, one palette, one save function.

Import this module before pyplot in experiment code; it selects the non-interactive Agg backend.

* :func:`setup_style` -- seaborn ``whitegrid`` / ``paper`` context, applied once per figure.
* :data:`METHOD_PALETTE` -- a fixed colour per method / strategy name, so the same method has the
  same colour in every figure (unknown names fall back to a grey).
* :func:`palette_for` -- palette restricted to the names present in a plot.
* :func:`mark_reference` -- draw a paper reference value (hollow star with a label).
* :func:`strip_points` -- a seaborn-style strip plot whose jitter comes from a seeded generator.
* :func:`save_figure` -- tight layout, fixed DPI, close the figure.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless and deterministic; set before pyplot is imported anywhere

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import seaborn as sns  # noqa: E402

DPI = 150

METHOD_PALETTE: dict[str, str] = {
    # pool-grouping strategies (Figures 4, 8)
    "production": "#7f7f7f",
    "random": "#bcbd22",
    "zigzag": "#17becf",
    "zigzag-swap": "#1f77b4",
    "vrsp": "#d62728",
    "lower-bound": "#000000",
    # attention planners (Figures 12-16)
    "ulysses": "#7f7f7f",
    "wlb-llm": "#9467bd",
    "distca": "#2ca02c",
    "distca-paper": "#98df8a",
    "dynamic-cp": "#17becf",
    "libra-tap": "#ff7f0e",
    "libra-tap-vrsp": "#8c564b",
    "libra": "#d62728",
}
FALLBACK_COLOR = "#aaaaaa"

STRATEGY_ORDER = ("production", "random", "zigzag", "zigzag-swap", "vrsp")
"""Legend order of the grouping strategies."""


def setup_style() -> None:
    """Apply the shared seaborn theme (idempotent)."""
    sns.set_theme(context="paper", style="whitegrid", font_scale=1.1)


def palette_for(names) -> dict[str, str]:
    """``{name: colour}`` for the given method names (fallback grey for unknown names)."""
    return {n: METHOD_PALETTE.get(n, FALLBACK_COLOR) for n in names}


def mark_reference(ax, x, y, label: str, color: str = "black") -> None:
    """Mark one value reported in the paper: a hollow star at ``(x, y)`` with a legend label."""
    ax.scatter([x], [y], marker="*", s=160, facecolors="none", edgecolors=color, linewidths=1.4,
               zorder=5, label=label)


def strip_points(ax, df, x: str, y: str, order, hue: str | None = None, size: float = 5.0,
                 alpha: float = 1.0, seed: int = 0) -> None:
    """Points of ``df[y]`` over the categories ``order`` of ``df[x]`` (side by side per ``hue``
    level), as seaborn's stripplot draws them, but jittered by a seeded generator: stripplot draws
    its jitter from numpy's global RNG, so the same data gave a different PNG on every run."""
    rng = np.random.default_rng(seed)
    levels = list(dict.fromkeys(df[hue])) if hue else [None]
    colors = sns.color_palette(n_colors=max(len(order), len(levels)))
    width = 0.8 / len(levels)
    for i, cat in enumerate(order):
        for j, level in enumerate(levels):
            sel = (df[x] == cat) if hue is None else (df[x] == cat) & (df[hue] == level)
            values = df.loc[sel, y].to_numpy()
            center = i if hue is None else i - 0.4 + width * (j + 0.5)
            ax.scatter(center + rng.uniform(-width / 8, width / 8, len(values)), values, s=size**2,
                       color=colors[j if hue else i], alpha=alpha, linewidths=0,
                       label=str(level) if hue and i == 0 else None)
    ax.set_xticks(range(len(order)), [str(c) for c in order])


def save_figure(fig, path: str | Path, tight_bbox: bool = False) -> Path:
    """Save ``fig`` as PNG at :data:`DPI` with a tight layout and close it (``tight_bbox``: crop to
    what is drawn, for titles placed outside the axes grid)."""
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, format="png", **({"bbox_inches": "tight"} if tight_bbox else {}))
    plt.close(fig)
    return path
