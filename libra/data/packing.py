"""Fixed-token packing of sample lengths into packed sequences (Libra sec. 2.3).

Libra defaults to *fixed-token* packing: samples are concatenated in arrival order into packed
sequences of exactly ``S`` tokens each, with a block-diagonal causal mask (each sample, or piece of
a sample, is its own causal segment). The paper keeps each optimizer step's sample multiset intact,
so nothing is reordered, deferred or dropped inside the packed stream.

Overflow policy (argument ``policy``)
-------------------------------------
Every policy keeps exactly ``S`` tokens per sequence (no padding) and makes every piece of a cut
sample its own causal segment (pieces of one sample never attend to each other).

* ``"defer"`` (default): first-fit with a bounded lookahead, the way production packers avoid
  fragmenting documents. A sample that does not fit the room left in the current sequence is
  *deferred*: the room is filled with the first of the next ``lookahead`` buffered samples that
  fit, in arrival order. If none fits, the shortest buffered sample is cut to fill the room
  exactly and its remainder stays buffered. Each new sequence starts with the oldest buffered
  sample, so a deferred sample waits at most one sequence, and a sample longer than ``S`` starts
  at a sequence boundary and is cut into full ``S``-token pieces plus a remainder. Tokens and the
  multiset of sample ids are preserved; arrival order changes only within the lookahead. (Why it
  is the default: cutting a ~1M-token sample at a random offset of a 1M-token sequence throws
  away about a third of its quadratic workload, which the paper's production numbers do not show.)
* ``"split"``: strict arrival order; a sample that does not fit the room is cut at the boundary
  and continues in the next sequence; a sample longer than ``S`` is cut into as many pieces as
  needed. Tokens and the multiset of sample ids are preserved exactly. Vectorised.
* ``"truncate"``: like ``"split"``, but a sample longer than ``S`` keeps only its first ``S``
  tokens (the rest is dropped). The sample multiset is kept, tokens are not.
* ``"error"``: like ``"split"``, but a sample longer than ``S`` raises ``ValueError`` naming it.

The tokens after the last full sequence (a partial sequence) are not returned: every
:class:`PackedSequence` has exactly ``S`` tokens. :func:`libra.data.windows.gbs_windows` asks its
source for enough tokens that this never removes a window's data.

This module is pure: lengths in, packed sequences out. Turning a workload name into GBS windows
of packed sequences lives in :mod:`libra.data.windows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra.data.loaders import check_lengths_in_range
from libra.workload import packed_workload

POLICIES = ("defer", "split", "truncate", "error")
DEFAULT_POLICY = "defer"
DEFAULT_LOOKAHEAD = 64


@dataclass(frozen=True, eq=False)
class PackedSequence:
    """One packed sequence: its samples (or sample pieces) in packing order.

    Attributes:
        seq_id: index of the sequence in its GBS window (or in the packed stream for
            :func:`pack_fixed_tokens`).
        sample_lengths: int64 ``(n_pieces,)`` token lengths of the causal segments, in order.
        sample_ids: int64 ``(n_pieces,)`` arrival index of the original sample each piece came
            from; pieces of one split sample share an id (consecutive sequences), so they can be
            rejoined.
    """

    seq_id: int
    sample_lengths: np.ndarray
    sample_ids: np.ndarray

    def __post_init__(self) -> None:
        lengths = np.asarray(self.sample_lengths, dtype=np.int64)
        ids = np.asarray(self.sample_ids, dtype=np.int64)
        if lengths.ndim != 1 or lengths.shape != ids.shape:
            raise ValueError(
                f"PackedSequence {self.seq_id}: sample_lengths {lengths.shape} and sample_ids {ids.shape} "
                "must be 1-D arrays of equal length"
            )
        if lengths.size == 0 or lengths.min() < 1:
            raise ValueError(f"PackedSequence {self.seq_id}: segments must be non-empty with length >= 1")
        lengths.setflags(write=False)
        ids.setflags(write=False)
        object.__setattr__(self, "sample_lengths", lengths)
        object.__setattr__(self, "sample_ids", ids)

    @property
    def num_tokens(self) -> int:
        """Total tokens (``S`` for every sequence built here)."""
        return int(self.sample_lengths.sum())

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``(n_pieces + 1,)`` cumulative segment starts ``[0, l_0, l_0 + l_1, ..., S]``."""
        return np.concatenate(([0], np.cumsum(self.sample_lengths)))

    @property
    def workload(self) -> float:
        """Workload proxy ``w = sum_j l_j^2`` (Libra sec. 3.1)."""
        return packed_workload(self.sample_lengths)

    def __repr__(self) -> str:
        return (f"PackedSequence(seq_id={self.seq_id}, tokens={self.num_tokens}, "
                f"pieces={self.sample_lengths.size}, max_piece={int(self.sample_lengths.max())})")


MAX_LOOKAHEAD = 65536


def check_policy(policy, lookahead) -> None:
    """Raise ``ValueError`` for an unknown policy or a lookahead outside ``[1, MAX_LOOKAHEAD]``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown packing policy {policy!r}; choose one of {POLICIES}")
    if (isinstance(lookahead, bool) or not isinstance(lookahead, (int, np.integer))
            or not 1 <= lookahead <= MAX_LOOKAHEAD):
        raise ValueError(f"lookahead must be an integer in [1, {MAX_LOOKAHEAD}], got {lookahead!r}")


def check_seq_len(seq_len) -> int:
    """Return ``seq_len`` as int or raise ``ValueError`` when it is not an integer >= 1."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"sequence length S must be an integer >= 1, got {seq_len!r}")
    return int(seq_len)


def _check_lengths(lengths) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"sample lengths must be a 1-D array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind != "f" or np.any(arr != np.round(arr)):
            bad = int(np.argmax(arr != np.round(arr))) if arr.dtype.kind == "f" else 0
            raise ValueError(f"sample {bad}: length must be a positive integer, got {arr[bad]!r}")
    if arr.size and arr.min() < 1:
        bad = int(np.argmin(arr))
        raise ValueError(f"sample {bad}: length must be a positive integer, got {arr[bad].item()}")
    # lengths and their total in range before any int64 cast or cumsum: a wrapped sum would stall
    # the packing loops (and 'defer' counts sequences from it)
    return check_lengths_in_range(arr, "sample lengths", lambda i: f"sample {i}") if arr.size else arr.astype(np.int64)


def pack_fixed_tokens(lengths, seq_len: int, policy: str = DEFAULT_POLICY, first_sample_id: int = 0,
                      first_seq_id: int = 0, lookahead: int = DEFAULT_LOOKAHEAD,
                      max_sequences: int | None = None) -> list[PackedSequence]:
    """Pack samples in arrival order into packed sequences of exactly ``seq_len`` tokens.

    Args:
        lengths: int ``(n_samples,)`` sample lengths in arrival order (each >= 1).
        seq_len: tokens per packed sequence ``S`` (>= 1).
        policy: ``"defer"`` (default), ``"split"``, ``"truncate"`` or ``"error"`` (see the module
            docstring).
        first_sample_id: arrival id of ``lengths[0]`` (ids are ``first_sample_id + index``).
        first_seq_id: ``seq_id`` of the first packed sequence.
        lookahead: samples buffered by ``"defer"`` (>= 1; with 1 it packs exactly like ``"split"``).
        max_sequences: stop after this many sequences (None: as many as the tokens allow).

    Returns:
        Packed sequences of exactly ``S`` tokens each (``floor(total_tokens / S)`` of them unless
        ``max_sequences`` stops earlier); the trailing partial sequence is dropped. ``"split"``,
        ``"truncate"`` and ``"error"`` are vectorised, O(n log n); ``"defer"`` is a Python loop,
        O(n * lookahead) worst case and about O(n) on long-tailed data.

    Raises:
        ValueError: ``seq_len < 1``, unknown ``policy``, bad ``lookahead``, a non-positive or
            non-integer length, or (``policy="error"``) a sample longer than ``S``; messages name
            the bad value.
    """
    seq_len = check_seq_len(seq_len)
    check_policy(policy, lookahead)
    arr = _check_lengths(lengths)
    if policy == "defer":
        return _pack_defer(arr, seq_len, int(lookahead), first_sample_id, first_seq_id, max_sequences)
    if policy == "error" and arr.size and arr.max() > seq_len:
        bad = int(np.argmax(arr > seq_len))
        raise ValueError(
            f"sample {first_sample_id + bad} has {int(arr[bad])} tokens, longer than S={seq_len} "
            "(packing policy 'error'; use 'split' or 'truncate')"
        )
    if policy == "truncate":
        arr = np.minimum(arr, seq_len)
    ends = np.cumsum(arr)
    n_seq = int(ends[-1] // seq_len) if arr.size else 0
    if max_sequences is not None:
        n_seq = min(n_seq, int(max_sequences))
    if n_seq == 0:
        return []
    limit = n_seq * seq_len
    # Cut points = sample ends and sequence boundaries; the pieces between consecutive cut points
    # are the causal segments. Boundaries at multiples of S split straddling samples.
    points = np.union1d(ends[ends < limit], np.arange(seq_len, limit + 1, seq_len, dtype=np.int64))
    piece_start = np.concatenate(([0], points[:-1]))
    piece_len = points - piece_start
    piece_sample = np.searchsorted(ends, piece_start, side="right") + first_sample_id
    bounds = np.searchsorted(piece_start, np.arange(0, limit + 1, seq_len, dtype=np.int64))
    bounds[-1] = piece_start.size
    return [
        PackedSequence(first_seq_id + k, piece_len[bounds[k]:bounds[k + 1]], piece_sample[bounds[k]:bounds[k + 1]])
        for k in range(n_seq)
    ]


def _pack_defer(arr: np.ndarray, seq_len: int, lookahead: int, first_sample_id: int, first_seq_id: int,
                max_sequences: int | None) -> list[PackedSequence]:
    """The ``"defer"`` policy (module docstring): first-fit over a buffer of ``lookahead`` samples."""
    lengths = arr.tolist()
    n = len(lengths)
    limit = int(arr.sum()) // seq_len
    if max_sequences is not None:
        limit = min(limit, int(max_sequences))
    rem: list[int] = []  # remaining tokens of the buffered samples, in arrival order
    ids: list[int] = []  # their arrival index
    nxt = 0  # next sample of the stream to buffer
    out: list[PackedSequence] = []
    while len(out) < limit:
        room = seq_len
        seg_len: list[int] = []
        seg_id: list[int] = []
        while room:
            while len(rem) < lookahead and nxt < n:
                rem.append(lengths[nxt])
                ids.append(nxt)
                nxt += 1
            if room == seq_len:
                pick = 0  # a new sequence starts with the oldest sample: nothing waits longer
            else:
                pick = -1
                for i, r in enumerate(rem):
                    if r <= room:
                        pick = i
                        break
                if pick < 0:  # nothing fits: cut the shortest buffered sample to fill the room
                    pick = rem.index(min(rem))
            r = rem[pick]
            take = r if r <= room else room
            seg_len.append(take)
            seg_id.append(ids[pick] + first_sample_id)
            room -= take
            if take == r:
                del rem[pick]
                del ids[pick]
            else:
                rem[pick] = r - take
        out.append(PackedSequence(first_seq_id + len(out), np.array(seg_len, dtype=np.int64),
                                  np.array(seg_id, dtype=np.int64)))
    return out
