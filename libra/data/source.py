"""Where sample lengths come from: a synthetic preset or a user length file, as an arrival stream.

``resolve_workload(spec)`` turns what a user types after ``--workload`` into a
:class:`LengthSource`: a registered preset name (see :mod:`libra.data.presets`) or a path to a
length file (see :mod:`libra.data.loaders`). Every source offers one method,
``take(n_tokens, seed)``: the shortest arrival-order prefix of the seed's stream holding at least
``n_tokens`` tokens. It is deterministic (same seed => same array) and prefix-stable (a larger
request extends a smaller one), so window ``w`` of a sweep is the same however many windows run.

* Preset: the preset's seeded mixed stream (:meth:`LengthDistribution.stream`).
* File: arrival order is file order starting at a seed-chosen offset, wrapping around to the
  start (cycling) when more tokens are needed than the file holds. Different seeds therefore see
  different, deterministic slices of the same data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from libra.data.loaders import MAX_TOTAL, SUFFIX_LIST, file_kind, load_lengths
from libra.data.presets import PRESETS, LengthDistribution, get_preset

MAX_TAKE_SAMPLES = 2**28
"""Most samples one :meth:`FileSource.take` returns (2 GiB of int64): a file of tiny lengths cycled
to fill a large request would otherwise exhaust memory instead of failing."""


def _check_take(n_tokens, seed) -> tuple[int, int]:
    if (isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1
            or n_tokens >= MAX_TOTAL):
        raise ValueError(f"n_tokens must be an integer in [1, 2^62), got {n_tokens!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    return int(n_tokens), int(seed)


class LengthSource:
    """An arrival-order stream of sample lengths (abstract)."""

    name: str

    def take(self, n_tokens: int, seed: int = 0) -> np.ndarray:
        """int64 ``(n,)``: the shortest prefix of the seed's stream with ``sum >= n_tokens``."""
        raise NotImplementedError

    def describe(self) -> dict:
        """JSON-ready description for run records."""
        return {"name": self.name}


@dataclass
class PresetSource(LengthSource):
    """The seeded stream of a :class:`LengthDistribution`."""

    distribution: LengthDistribution

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.distribution.name

    def take(self, n_tokens: int, seed: int = 0) -> np.ndarray:
        n_tokens, seed = _check_take(n_tokens, seed)
        return self.distribution.stream(n_tokens, seed)

    def describe(self) -> dict:
        return {"name": self.name, "kind": "preset", "params": self.distribution.params()}


@dataclass
class FileSource(LengthSource):
    """Lengths read once from a file; arrival order = file order from a seed-chosen offset, cycling."""

    path: Path
    column: str | None = None
    _lengths: np.ndarray | None = field(default=None, repr=False)

    @property
    def name(self) -> str:  # type: ignore[override]
        """The file's name, with ``#column`` when a column was named (as ``--workload`` spells it)."""
        return f"{self.path.name}#{self.column}" if self.column else self.path.name

    @property
    def lengths(self) -> np.ndarray:
        """All lengths in file order (loaded on first use)."""
        if self._lengths is None:
            self._lengths = load_lengths(self.path, self.column)
        return self._lengths

    def offset(self, seed: int) -> int:
        """Index of the stream's first sample for ``seed`` (seed 0 starts at the file's start)."""
        return 0 if seed == 0 else int(np.random.default_rng(seed).integers(self.lengths.size))

    def take(self, n_tokens: int, seed: int = 0) -> np.ndarray:
        n_tokens, seed = _check_take(n_tokens, seed)
        arr = self.lengths
        rotated = np.roll(arr, -self.offset(seed))
        reps = -(-n_tokens // int(arr.sum())) + 1
        if reps > 1 and reps * arr.size > MAX_TAKE_SAMPLES:
            raise ValueError(f"{self.path}: {n_tokens} tokens of stream need more than {MAX_TAKE_SAMPLES} samples of "
                             f"this file (mean length {arr.mean():.1f}): use shorter or fewer sequences")
        stream = np.tile(rotated, reps) if reps > 1 else rotated
        return stream[: int(np.searchsorted(np.cumsum(stream), n_tokens)) + 1]

    def describe(self) -> dict:
        return {"name": self.name, "kind": "file", "path": str(self.path), "column": self.column,
                "samples": int(self.lengths.size), "tokens": int(self.lengths.sum())}


def resolve_workload(spec, column: str | None = None) -> LengthSource:
    """A :class:`LengthSource` for a preset name, a length-file path, or an existing source.

    A path may end in ``#COLUMN`` to name the length column of a CSV/Parquet file (or the key of a
    JSON list of records or of JSON-lines objects), e.g. ``lengths.parquet#num_tokens``; ``column=`` does the same.

    Raises:
        ValueError: ``spec`` is neither a registered preset nor an existing file of a supported
            type; the message lists the presets and the supported suffixes.
    """
    if isinstance(spec, LengthSource):
        return spec
    if isinstance(spec, LengthDistribution):
        return PresetSource(spec)
    if not isinstance(spec, (str, Path)) or not str(spec).strip():
        raise ValueError(f"workload must be a preset name or a length-file path, got {spec!r}")
    text = str(spec)
    if isinstance(spec, str) and text in PRESETS:
        return PresetSource(get_preset(text))
    if column is None and "#" in text and not Path(text).expanduser().exists():
        # ``lengths.csv#num_tokens``: the column of a CSV/Parquet/JSON-records file, so a CLI
        # ``--workload`` string alone can name it
        text, column = text.rsplit("#", 1)
        if not column:
            raise ValueError(f"workload {spec!r}: empty column name after '#'")
    path = Path(text).expanduser()
    if file_kind(path) is not None or path.exists():
        if not path.is_file():
            raise ValueError(f"workload file {text!r} does not exist or is not a file")
        if file_kind(path) is None:
            raise ValueError(f"workload file {text!r} has an unknown type; supported: {SUFFIX_LIST}")
        return FileSource(path, column)
    raise ValueError(f"unknown workload {text!r}: not a preset ({', '.join(sorted(PRESETS))}) "
                     f"and not a length file ({SUFFIX_LIST})")
