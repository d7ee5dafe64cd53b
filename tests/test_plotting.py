"""Figures are deterministic: the same data gives the same PNG bytes (the project's rule: same
config and seed, same outputs)."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from experiments.common.plotting import save_figure, strip_points


def _png(tmp_path, name: str, df: pd.DataFrame, hue=None) -> str:
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots()
    strip_points(ax, df, "method", "value", ["a", "b"], hue=hue)
    path = save_figure(fig, tmp_path / name)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_strip_points_jitter_is_seeded_not_global(tmp_path):
    rng = np.random.default_rng(1)
    df = pd.DataFrame({"method": np.repeat(["a", "b"], 50), "value": rng.random(100),
                       "level": np.tile(["x", "y"], 50)})
    first = _png(tmp_path, "1.png", df)
    np.random.random(7)  # numpy's global RNG moved (seaborn's stripplot jitter drew from it)
    assert _png(tmp_path, "2.png", df) == first
    assert _png(tmp_path, "3.png", df, hue="level") == _png(tmp_path, "4.png", df, hue="level")


# -- what a figure says: workload, profile and layout in every title; nothing cut; plain log ticks ------


def _saved_figures(monkeypatch) -> list[dict]:
    """Spy on every figure saved: its title, its axes' titles, tick labels and legend texts."""
    import matplotlib.figure  # noqa: PLC0415

    seen, real = [], matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        fig.canvas.draw()
        seen.append({"title": fig._suptitle.get_text() if fig._suptitle else "",  # noqa: SLF001
                     "axes": [ax.get_title() for ax in fig.axes],
                     "ticks": [t.get_text() for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels()],
                     "legend": [t.get_text() for ax in fig.axes if ax.get_legend()
                                for t in ax.get_legend().get_texts()]})
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return seen


def test_two_runs_differing_only_in_profile_have_titles_naming_workload_profile_and_layout(tmp_path, monkeypatch):
    from click.testing import CliRunner  # noqa: PLC0415

    from experiments.cli import main  # noqa: PLC0415

    seen = _saved_figures(monkeypatch)
    (tmp_path / "mine.txt").write_text("".join(f"{n}\n" for n in [300, 9000, 120, 2200, 700] * 40))
    base = ["straggler", "--workload", str(tmp_path / "mine.txt"), "--dp", "4", "--cp", "2", "--seq-len", "16K",
            "--gbs", "8", "--windows", "1", "--methods", "ulysses,libra", "--block-size", "2048", "--no-progress"]
    for profile in ("h100-roce-v1", "paper-inferred-v1"):
        res = CliRunner().invoke(main, [*base, "--profile", profile, "--out", str(tmp_path / profile)])
        assert res.exit_code == 0, res.output
    a, b = (s["title"] for s in seen)
    assert a != b
    for title, profile in ((a, "h100-roce-v1"), (b, "paper-inferred-v1")):
        flat = title.replace("\n", " ")
        assert "workload mine.txt" in flat and f"profile {profile}" in flat
        assert "layout dp4-cp2-s16k-gbs8-p4-b2k-h2-m4" in flat


def test_long_titles_are_wrapped_inside_the_figure(tmp_path):
    from experiments.common.plotting import plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([1, 2], [1, 2])
    ax.set_title("dp8-cp4-s64k-gbs32: loss factors (geometric means over steps); log axis, top = bound ratio")
    fig.suptitle("a figure title that is far longer than this small figure is wide, as a user's layout tag makes it")
    from experiments.common.plotting import wrap_titles  # noqa: PLC0415

    wrap_titles(fig, "workload my_lengths.parquet#num_tokens | profile my-cluster | layout dp8-cp4-s64k-gbs32-p8")
    fig.canvas.draw()
    width = fig.bbox.width
    for text in (ax.title, fig._suptitle):  # noqa: SLF001
        box = text.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= width, text.get_text()
    assert "my-cluster" in fig._suptitle.get_text()  # noqa: SLF001
    plt.close(fig)


def test_log_ticks_are_plain_numbers(tmp_path):
    from experiments.common.plotting import plt, readable_log_ticks  # noqa: PLC0415

    fig, (a, b) = plt.subplots(1, 2)
    a.plot([0, 1], [0.17, 7.5])
    a.set_yscale("log")
    b.plot([1, 2, 4, 8, 16], [1, 2, 3, 4, 5])
    b.set_xscale("log", base=2)
    readable_log_ticks(fig)
    fig.canvas.draw()
    labels = [t.get_text() for ax in (a, b) for t in ax.get_yticklabels() + ax.get_xticklabels()
              + ax.get_yticklabels(minor=True) if t.get_text()]
    assert not any("times" in x or "^" in x or "$" in x for x in labels), labels
    assert {"0.2", "1", "6"} <= set(labels) and {"1", "2", "4", "8", "16"} <= set(labels), labels
    plt.close(fig)


def test_pool_sweep_plots_the_total_straggler_with_readable_labels(tmp_path, monkeypatch):
    from experiments.figures.pool_sweep import plot_pool_sweep  # noqa: PLC0415

    seen = _saved_figures(monkeypatch)
    rows = [{"setting": "256k", "pool_size": p, "method": m, "straggler_norm": 0.5 + 0.01 * p, "compute_norm": 0.45,
             "comm_norm": 0.05 + 0.01 * p, "paper_compute": np.nan, "paper_comm": np.nan}
            for p in (1, 2, 4, 8, 16) for m in ("libra-tap-vrsp", "libra")]
    plot_pool_sweep(pd.DataFrame(rows), tmp_path / "p.png", "workload w | profile p | layout l")
    (fig,) = seen
    assert {"total straggler", "compute", "exposed communication", "method", "part of the straggler"} <= set(
        fig["legend"])
    assert not {"compute_norm", "comm_norm", "label", "part"} & set(fig["legend"])
    assert {"1", "2", "4", "8", "16"} <= set(fig["ticks"]) and not any("^" in t for t in fig["ticks"])
