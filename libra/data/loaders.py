"""Loaders for user-supplied sample-length files (one token length per training sample).

Supported formats (chosen by file suffix):

* ``.txt`` / ``.txt.gz``: one integer per line; blank lines are skipped.
* ``.json``: a JSON list of integers (or ``{"lengths": [...]}``), or a list of objects when
  ``column`` names the key holding the length.
* ``.jsonl`` / ``.jsonl.gz``: one JSON value per line (what ``datasets.Dataset.to_json`` writes): an
  integer, or an object whose key ``column`` (default ``length`` or its only key) holds the length.
* ``.csv`` / ``.csv.gz``: a header row and a column named ``column`` (default ``length`` or the only
  column of a one-column file).
* ``.parquet``: same column rule as CSV (needs the ``parquet`` extra, ``pyarrow``).
* ``.npy``: a 1-D integer array.

Every length must be an integer in ``[1, MAX_LENGTH]`` (2^40) and a file's total below
``MAX_TOTAL`` (2^62), so every sum and cumulative sum of the data path fits int64 with room to
spare (a length of 1e19 or ten of 1e18 would wrap negative and stall the packing loops). Errors are
``ValueError`` naming the file and the line (text), index (JSON, .npy) or data row (CSV/Parquet,
1-based, header excluded) of the first bad value; empty files, unreadable files (a truncated or
non-gzip ``.gz``, bytes that are not UTF-8 text) and unknown suffixes are errors too. This module
never imports torch.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import numpy as np

SUFFIXES = (".txt", ".txt.gz", ".json", ".jsonl", ".jsonl.gz", ".csv", ".csv.gz", ".parquet", ".npy")
SUFFIX_LIST = ", ".join(SUFFIXES)
"""The supported suffixes as help texts and errors print them (one list for all of them)."""
DEFAULT_COLUMN = "length"
MAX_LENGTH = 2**40
"""Longest sample length accepted (about 10^12 tokens: far beyond any context, far below int64)."""
MAX_TOTAL = 2**62
"""A file's (or an array's) total tokens must stay below this, so its int64 sums cannot overflow."""


def file_kind(path: str | Path) -> str | None:
    """The supported suffix of ``path`` (e.g. ``".txt.gz"``) or None when it is not supported."""
    name = Path(path).name.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    return None


def check_lengths_in_range(values: np.ndarray, name, where) -> np.ndarray:
    """``values`` (numbers, any dtype) as int64 once each is an integer in ``[1, MAX_LENGTH]`` and
    their total is below ``MAX_TOTAL``; ``name`` (a file) and ``where(i)`` (its line, row or index)
    name the first bad value.

    Raises:
        ValueError: ``<name>: <where>: sample length must be a positive integer, got x`` for a
            non-integer or a value below 1, ``<name>: length x at <where> out of range [1, 2^40]``
            for a longer one, ``<name>: length total ... out of range`` for a total of 2^62 or more.
    """
    # float64 compares exactly around 2^40 and keeps every larger (or object-held) int far above it
    as_float = np.asarray(values).astype(np.float64)
    bad = ~np.isfinite(as_float) | (as_float != np.round(as_float)) | (as_float < 1)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(f"{name}: {where(i)}: sample length must be a positive integer, got {_shown(values[i])!r}")
    big = as_float > MAX_LENGTH
    if np.any(big):
        i = int(np.argmax(big))
        raise ValueError(f"{name}: length {_shown(values[i])!r} at {where(i)} out of range [1, 2^40]")
    total = float(as_float.sum())
    if total >= MAX_TOTAL:
        raise ValueError(f"{name}: length total {total:.4g} of {as_float.size} samples out of range "
                         "(must be below 2^62)")
    return as_float.astype(np.int64) if values.dtype.kind in "fO" else values.astype(np.int64)


def _shown(value):
    """A numpy scalar as the Python number it holds (an object array's items already are)."""
    return value.item() if hasattr(value, "item") else value


def _check_values(values: np.ndarray, path: Path, where) -> np.ndarray:
    """Validate a 1-D array of parsed numbers; ``where(i)`` names element ``i`` (line/row/index)."""
    if values.size == 0:
        raise ValueError(f"{path}: no sample lengths found (empty file)")
    return check_lengths_in_range(values, path, where)


def _nonblank_lines(path: Path, opener):
    """``(1-based line number, stripped text)`` of every non-blank line of a text file."""
    with opener(path, "rt") as fh:
        for lineno, raw in enumerate(fh, start=1):
            text = raw.strip()
            if text:
                yield lineno, text


def _load_text(path: Path, opener) -> np.ndarray:
    with opener(path, "rt") as fh:
        text = fh.read()
    try:
        # fast path (a 1M-line file in ~0.1 s); any problem falls through to the slow, precise pass
        fast = np.array([line for line in text.splitlines() if line.strip()], dtype=np.int64)
        if fast.size and fast.min() >= 1 and fast.max() <= MAX_LENGTH:
            return check_lengths_in_range(fast, path, lambda i: f"line {i + 1}")  # the total's bound
    except (ValueError, OverflowError):
        pass
    values: list[int] = []
    lines: list[int] = []
    for lineno, item in _nonblank_lines(path, opener):
        try:
            values.append(int(item))
        except ValueError:
            raise ValueError(
                f"{path}: line {lineno}: sample length must be a positive integer, got {item!r}"
            ) from None
        lines.append(lineno)
    if not values:
        raise ValueError(f"{path}: no sample lengths found (empty file)")
    # object dtype keeps integers beyond int64 exact for the message
    return check_lengths_in_range(np.array(values, dtype=object), path, lambda i: f"line {lines[i]}")


def _load_json(path: Path, column: str | None) -> np.ndarray:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        if not path.read_text().strip():
            raise ValueError(f"{path}: no sample lengths found (empty file)") from None
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict):
        key = column or "lengths"
        if key not in data:
            raise ValueError(f"{path}: JSON object has no key {key!r}; keys: {sorted(data)[:10]}")
        data = data[key]
        column = None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of sample lengths, got {type(data).__name__}")
    if not data:
        raise ValueError(f"{path}: no sample lengths found (empty list)")
    if column is not None:
        try:
            data = [item[column] for item in data]
        except (KeyError, TypeError):
            raise ValueError(f"{path}: not every JSON item has the key {column!r}") from None
    for i, item in enumerate(data):
        # bool is an int subclass; a string "12" is not a length. Name the first offender.
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise ValueError(f"{path}: index {i}: sample length must be a positive integer, got {item!r}")
    return _check_values(np.asarray(data), path, lambda i: f"index {i}")


def _load_jsonl(path: Path, opener, column: str | None) -> np.ndarray:
    """One JSON value per line (blank lines skipped): a number, or an object holding the length under
    ``column`` -- picked once, from the first object, by :func:`_pick_column`'s rule."""
    values, lines, key = [], [], column
    for lineno, text in _nonblank_lines(path, opener):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {lineno}: not valid JSON ({exc.msg})") from None
        if isinstance(item, dict):
            key = key or _pick_column([str(k) for k in item], None, path)
            if key not in item:
                raise ValueError(f"{path}: line {lineno}: no key {key!r}; keys: {sorted(item)[:10]}")
            item = item[key]
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise ValueError(f"{path}: line {lineno}: sample length must be a positive integer, got {item!r}")
        values.append(item)
        lines.append(lineno)
    if not values:
        raise ValueError(f"{path}: no sample lengths found (empty file)")
    return _check_values(np.asarray(values), path, lambda i: f"line {lines[i]}")


def _pick_column(columns: list[str], column: str | None, path: Path) -> str:
    if column is not None:
        if column not in columns:
            raise ValueError(f"{path}: no column {column!r}; columns: {columns}")
        return column
    if DEFAULT_COLUMN in columns:
        return DEFAULT_COLUMN
    if len(columns) == 1:
        return columns[0]
    raise ValueError(f"{path}: several columns {columns}; name the length column (column=..., or PATH#COLUMN on the command line)")


def _load_table(path: Path, kind: str, column: str | None) -> np.ndarray:
    import pandas as pd  # deferred: pandas is only needed for tabular files

    if kind == ".parquet":
        try:
            frame = pd.read_parquet(path)
        except ImportError as exc:
            raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install '.[parquet]'): {exc}") from None
        except (ValueError, TypeError) as exc:  # pyarrow's ArrowInvalid is a ValueError naming no file
            raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None
    else:
        try:
            frame = pd.read_csv(path)
        except pd.errors.EmptyDataError:
            raise ValueError(f"{path}: no sample lengths found (empty file)") from None
        except pd.errors.ParserError as exc:
            raise ValueError(f"{path}: not a readable CSV table ({exc})") from None
    name = _pick_column([str(c) for c in frame.columns], column, path)
    series = frame[name]
    if len(series) == 0:
        raise ValueError(f"{path}: no sample lengths found (empty column {name!r})")
    numeric = pd.to_numeric(series, errors="coerce")
    if numeric.isna().any():
        i = int(np.argmax(numeric.isna().to_numpy()))
        raise ValueError(
            f"{path}: row {i + 1} of column {name!r}: sample length must be a positive integer, "
            f"got {series.iloc[i]!r}"
        )
    return _check_values(numeric.to_numpy(), path, lambda i: f"row {i + 1} of column {name!r}")


def _load_npy(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path}: not a readable .npy array ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{path}: expected a 1-D array of sample lengths, got shape {arr.shape}")
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{path}: expected an integer array, got dtype {arr.dtype}")
    return _check_values(arr, path, lambda i: f"index {i}")


def load_lengths(path: str | Path, column: str | None = None) -> np.ndarray:
    """Read sample lengths from ``path`` in file order.

    Args:
        path: a file of one of the :data:`SUFFIXES`.
        column: CSV/Parquet column (or JSON / JSON-lines object key) holding the lengths; defaults to
            ``length`` or the only column.

    Returns:
        int64 array ``(n_samples,)``, every value in ``[1, MAX_LENGTH]``, summing below ``MAX_TOTAL``.

    Raises:
        ValueError: missing file, unknown suffix, empty or unreadable file (truncated or non-gzip
            ``.gz``, not UTF-8 text), a non-positive / non-integer length or one out of range (the
            message names the file and line, row or index), or a total of 2^62 or more.
    """
    path = Path(path)
    kind = file_kind(path)
    if kind is None:
        raise ValueError(f"{path}: unknown length-file type; supported suffixes: {SUFFIX_LIST}")
    if not path.is_file():
        raise ValueError(f"{path}: no such length file")
    try:
        return _load(path, kind, column)
    except EOFError:
        raise ValueError(f"{path}: truncated compressed file (it ends before its end-of-stream marker)") from None
    except gzip.BadGzipFile:
        raise ValueError(f"{path}: not a gzip file, though its name ends in .gz") from None
    except zlib.error as exc:
        raise ValueError(f"{path}: corrupt gzip data ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.object[exc.start:exc.start + 1].hex()} at offset "
                         f"{exc.start}); a length file holds numbers as text, or is .npy / .parquet") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def _load(path: Path, kind: str, column: str | None) -> np.ndarray:
    """:func:`load_lengths` of a file known to exist, by its ``kind`` (suffix)."""
    if kind == ".txt":
        return _load_text(path, open)
    if kind == ".txt.gz":
        return _load_text(path, gzip.open)
    if kind == ".json":
        return _load_json(path, column)
    if kind in (".jsonl", ".jsonl.gz"):
        return _load_jsonl(path, gzip.open if kind == ".jsonl.gz" else open, column)
    if kind == ".npy":
        return _load_npy(path)
    return _load_table(path, kind, column)
