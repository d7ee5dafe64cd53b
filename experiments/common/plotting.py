"""Shared seaborn style for every `libra-bench` figure: one look, one palette, one save function.

Import this module before pyplot in experiment code; it selects the non-interactive Agg backend.

* :func:`setup_style` -- seaborn ``whitegrid`` / ``paper`` context, applied once per figure.
* :data:`METHOD_PALETTE` -- a fixed colour per method / strategy name, so the same method has the
  same colour in every figure (unknown names fall back to a grey).
* :func:`palette_for` -- palette restricted to the names present in a plot.
* :func:`mark_reference` -- draw a paper reference value (hollow star with a label).
* :func:`strip_points` -- a seaborn-style strip plot whose jitter comes from a seeded generator.
* :func:`save_figure` -- the caption under the title, titles wrapped to their width (never cut at the
  figure's edges), log-axis ticks as plain numbers (``6``, not ``6x10^0``; ``16``, not ``2^4``),
  tight layout and bounding box, fixed DPI, close the figure.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless and deterministic; set before pyplot is imported anywhere

import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
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
    # extensions beyond the paper
    "ulysses-sorted": "#c7c7c7",
    "libra-kt": "#ff9896",
    "libra-adaptive": "#e377c2",
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


@dataclass(frozen=True)
class PointStyle:
    """How :func:`strip_points` draws its points: marker ``size`` (points), ``alpha`` and the
    ``seed`` of the jitter.

    Raises:
        ValueError: a non-positive size or an alpha outside ``[0, 1]``.
    """

    size: float = 5.0
    alpha: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.size > 0 or not 0 <= self.alpha <= 1:
            raise ValueError(f"point size must be > 0 and alpha in [0, 1], got {self.size!r}, {self.alpha!r}")


def strip_points(ax, df, x: str, y: str, order, hue: str | None = None, style: PointStyle = PointStyle()) -> None:
    """Points of ``df[y]`` over the categories ``order`` of ``df[x]`` (side by side per ``hue``
    level), as seaborn's stripplot draws them, but jittered by a seeded generator: stripplot draws
    its jitter from numpy's global RNG, so the same data gave a different PNG on every run."""
    size, alpha, seed = style.size, style.alpha, style.seed
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


def _chars(width_px: float, fontsize: float, dpi: float) -> int:
    """About how many characters of ``fontsize`` points fit in ``width_px`` pixels."""
    return max(20, int(width_px / dpi * 72 / (fontsize * 0.55)))


def _wrap(text: str, width: int) -> str:
    # a layout tag (dp8-cp4-s64k-...) or a path is never broken inside
    return "\n".join(textwrap.fill(line, width, break_on_hyphens=False, break_long_words=False)
                     if len(line) > width else line for line in text.split("\n"))


def wrap_titles(fig, caption: str | None = None) -> None:
    """Wrap every axes title to its axes' width and the figure title (with ``caption`` as its last
    line) to the figure's width, so no title runs past an edge and gets cut."""
    fig_px = fig.get_figwidth() * fig.dpi
    for ax in fig.axes:
        for loc in ("center", "left", "right"):
            title = ax.get_title(loc)
            if title:
                size = ax.title.get_fontsize()
                ax.set_title(_wrap(title, _chars(ax.get_position().width * fig_px, size, fig.dpi)), loc=loc)
    sup = fig._suptitle.get_text() if fig._suptitle is not None else ""  # noqa: SLF001 (no public getter)
    text = "\n".join(t for t in (sup, caption) if t)
    if text:
        size = fig._suptitle.get_fontsize() if sup else 11  # noqa: SLF001
        fig.suptitle(_wrap(text, _chars(fig_px * 0.95, size, fig.dpi)), fontsize=size)


class _PlainLogLabels(matplotlib.ticker.Formatter):
    """A log axis' own formatter deciding which ticks get a label, the label written as a plain number."""

    def __init__(self, inner):
        self.inner = inner

    def set_axis(self, axis):
        super().set_axis(axis)
        self.inner.set_axis(axis)

    def set_locs(self, locs):
        super().set_locs(locs)
        self.inner.set_locs(locs)  # where matplotlib picks the minor ticks it labels

    def __call__(self, x, pos=None):
        return f"{x:g}" if self.inner(x, pos) else ""


def readable_log_ticks(fig) -> None:
    """Log axes labelled with plain numbers where matplotlib labels a tick at all: ``6`` instead of
    ``6x10^0``, ``16`` instead of ``2^4``, ``0.5`` instead of ``5x10^-1``."""
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() != "log":
                continue
            for getter, setter in ((axis.get_major_formatter, axis.set_major_formatter),
                                   (axis.get_minor_formatter, axis.set_minor_formatter)):
                if not isinstance(getter(), _PlainLogLabels):
                    setter(_PlainLogLabels(getter()))


def save_figure(fig, path: str | Path, tight_bbox: bool = True, caption: str | None = None) -> Path:
    """Save ``fig`` as PNG at :data:`DPI` and close it: ``caption`` (:func:`experiments.common.runs_table.run_caption`) as the
    figure title's last line, titles wrapped (:func:`wrap_titles`), log ticks as plain numbers
    (:func:`readable_log_ticks`), a tight layout and -- unless ``tight_bbox=False`` -- cropped to
    what is drawn, so titles and legends outside the axes are kept whole."""
    path = Path(path)
    wrap_titles(fig, caption)
    readable_log_ticks(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, format="png", **({"bbox_inches": "tight"} if tight_bbox else {}))
    plt.close(fig)
    return path
