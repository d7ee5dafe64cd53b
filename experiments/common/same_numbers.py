"""When two simulated CSVs hold the same numbers: equal text, or floats equal to the last digits.

The simulator is deterministic on one machine, but its float results are not bit-for-bit the same
on every CPU: numpy picks a vectorised implementation of its ufuncs and reductions by the host's
instruction set at import time, and its AVX-512 versions round some results differently from the
AVX2 ones in the last bit. Measured: ``make fig12`` on an AVX-512 host rewrote 311 of the 13,050
cells of the committed ``results/straggler/straggler.csv`` (written on a host without AVX-512),
each by at most 4.0e-14 of its value; with numpy's AVX-512 paths switched off
(``NPY_DISABLE_CPU_FEATURES``) the same host recomputed every cell exactly.

So two cells are the same number when their text is equal, or both are floats and differ by at
most :data:`ROUNDING` of the larger of the two and of the column's largest magnitude (a number that
is a difference of larger ones carries their rounding). 1e-12 is 25x the largest rounding seen and
far below any effect the model prices (a millisecond figure moves by a femtosecond). Used by
``make check-results`` (:mod:`experiments.common.check_results`) and by a rerun into a folder
(:meth:`experiments.common.runner.ExperimentRun.finish`), which keeps the folder's files when only
such rounding moved, so regenerating a figure on another CPU does not rewrite committed results.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd

ROUNDING = 1e-12
"""Largest difference between two floats taken as rounding, relative to their magnitude."""


def _floats(frame: pd.DataFrame) -> np.ndarray:
    """A frame of text cells as floats (NaN where a cell is not a number)."""
    return frame.apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float)


def rounding_cells(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """For two frames of text cells with the same index and columns: ``(differs, rounding)``,
    boolean frames of the cells whose text differs and, among them, those that are both floats
    equal to :data:`ROUNDING`."""
    differs = a != b
    x, y = _floats(a), _floats(b)
    ax, ay = np.abs(x), np.abs(y)
    with np.errstate(invalid="ignore"):
        column = np.fmax(np.nanmax(ax, axis=0, initial=0.0), np.nanmax(ay, axis=0, initial=0.0))
        close = np.abs(x - y) <= ROUNDING * np.maximum(np.maximum(ax, ay), column)  # NaN (text) is never close
    return differs, differs & pd.DataFrame(close, index=a.index, columns=a.columns)


def relative_gap(a: pd.DataFrame, b: pd.DataFrame, cells: pd.DataFrame) -> float:
    """The largest ``|a - b| / max(|a|, |b|)`` over ``cells`` (0 when there are none)."""
    mask = cells.to_numpy(dtype=bool)
    if not mask.any():
        return 0.0
    x, y = _floats(a)[mask], _floats(b)[mask]
    return float(np.max(np.abs(x - y) / np.maximum(np.abs(x), np.abs(y))))


def read_text_csv(data: bytes) -> pd.DataFrame:
    """A CSV's cells as text (the digits it holds, no parsing of numbers or missing values)."""
    return pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False)


def same_csv_numbers(old: bytes, new: bytes) -> bool:
    """Whether two CSV files hold the same table up to float rounding: the same columns, the same
    number of rows, and every cell equal (:func:`rounding_cells`). Equal bytes are equal; a file
    that is not a CSV is the same only byte for byte."""
    if old == new:
        return True
    try:
        a, b = read_text_csv(old), read_text_csv(new)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError):
        return False
    if list(a.columns) != list(b.columns) or a.shape != b.shape:
        return False
    differs, rounding = rounding_cells(a, b)
    return bool((differs == rounding).to_numpy().all())
