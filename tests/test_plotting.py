"""Figures are deterministic: the same data gives the same PNG bytes (issue-agnostic rule: same
config and seed, same outputs)."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from experiments.plotting import save_figure, strip_points


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
