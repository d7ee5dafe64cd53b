"""Synthetic length presets (libra/data/presets.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from experiments.figures.preset_calibration import window_r_minus_1
from libra.data.presets import LIBRA_PROD, PRESETS, get_preset


def test_presets_registered_and_unknown_name():
    assert {"libra-prod", "libra-prod-light", "libra-prod-heavy"} <= set(PRESETS)
    assert get_preset("libra-prod") is LIBRA_PROD
    with pytest.raises(ValueError, match=r"unknown preset 'prod'; presets: libra-prod, libra-prod-heavy"):
        get_preset("prod")


def test_libra_prod_shape_median_and_longest():
    stream = LIBRA_PROD.stream(2**29, seed=0)  # 512M tokens
    assert abs(np.median(stream) / 644 - 1) < 0.02
    assert stream.max() <= 2**20 and stream.max() > 0.9e6  # longest samples near 1M
    assert stream.min() >= 1 and stream.dtype == np.int64
    # token shares follow the mixer
    long_tokens = stream[(stream >= LIBRA_PROD.long_min) & (stream <= LIBRA_PROD.long_max)].sum()
    assert abs(long_tokens / stream.sum() - LIBRA_PROD.long_share) < 0.08


def test_stream_deterministic_and_prefix_stable():
    a = LIBRA_PROD.stream(10**7, seed=3)
    b = LIBRA_PROD.stream(10**7, seed=3)
    c = LIBRA_PROD.stream(5 * 10**7, seed=3)
    d = LIBRA_PROD.stream(10**7, seed=4)
    assert np.array_equal(a, b)
    assert np.array_equal(a, c[: a.size])
    assert not np.array_equal(a[:100], d[:100])
    assert a.sum() >= 10**7 and a[:-1].sum() < 10**7  # the shortest prefix


@pytest.mark.parametrize("kwargs, match", [
    ({"sigma": 0}, "sigma must be in"),
    ({"long_share": 0.7, "giant_share": 0.4}, "shares must be >= 0"),
    ({"giant_share": -0.1}, "shares must be >= 0"),
    ({"long_min": 100}, "median <= long_min < long_max"),
    ({"long_max": 2**21}, "median <= long_min < long_max <= max_len"),
    ({"giant_min": 10}, "giant_min=10 must lie in"),
    ({"long_alpha": 0}, "long_alpha must be > 0"),
    ({"max_len": 0}, "max_len must be an integer >= 1"),
    ({"median": float("nan")}, "median must be a number"),
    ({"name": ""}, "name must be a non-empty string"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        replace(LIBRA_PROD, **kwargs)


def test_stream_bad_args():
    with pytest.raises(ValueError, match="n_tokens must be an integer >= 1, got 0"):
        LIBRA_PROD.stream(0)
    with pytest.raises(ValueError, match="seed must be an integer >= 0, got -1"):
        LIBRA_PROD.stream(10, seed=-1)


def test_variants_order_the_skew():
    r = {name: window_r_minus_1(PRESETS[name], 262144, 128, [8], 8, seed=0)[8]
         for name in ("libra-prod-light", "libra-prod", "libra-prod-heavy")}
    assert r["libra-prod-light"] < r["libra-prod"] < r["libra-prod-heavy"]
    assert PRESETS["libra-prod-light"].stream(2**27, seed=0).max() <= LIBRA_PROD.long_max


def test_giants_arrive_in_bursts():
    stream = LIBRA_PROD.stream(2**28, seed=1)
    giant = np.flatnonzero(stream >= LIBRA_PROD.giant_min)
    assert giant.size >= LIBRA_PROD.giant_burst
    # positions of giants come in runs of exactly giant_burst consecutive documents
    runs = np.split(giant, np.flatnonzero(np.diff(giant) != 1) + 1)
    assert all(len(r) % LIBRA_PROD.giant_burst == 0 for r in runs[:-1])
    single = replace(LIBRA_PROD, giant_burst=1).stream(2**28, seed=1)
    g1 = np.flatnonzero(single >= LIBRA_PROD.giant_min)
    assert np.all(np.diff(g1) > 1)
