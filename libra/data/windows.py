"""GBS windows: a workload's arrival stream, packed and cut into optimizer-step windows.

This is where a workload *name* (a preset, a length file, or a
:class:`~libra.data.source.LengthSource`) becomes packed sequences: :func:`gbs_windows` resolves
the source (:mod:`libra.data.source`), takes enough of its seeded stream, packs it with
:func:`~libra.data.packing.pack_fixed_tokens` and cuts the packed stream into windows of ``GBS``
sequences (Libra sec. 2.3). :mod:`libra.data.packing` itself only turns lengths into packed
sequences and knows nothing about workloads.
"""

from __future__ import annotations

import logging

import numpy as np

from libra.data.loaders import MAX_TOTAL
from libra.data.packing import (
    DEFAULT_LOOKAHEAD,
    DEFAULT_POLICY,
    PackedSequence,
    check_policy,
    check_seq_len,
    pack_fixed_tokens,
)
from libra.data.source import FileSource, LengthSource, resolve_workload

_log = logging.getLogger(__name__)


def repeat_factor(source: LengthSource, n_tokens: int) -> float:
    """How many times ``n_tokens`` of stream use a length file's tokens (0.0 for a preset, whose
    stream never repeats); above 1 the file is cycled, so its samples recur."""
    if not isinstance(source, FileSource):
        return 0.0
    return int(n_tokens) / float(source.lengths.sum())


def warn_if_repeated(source: LengthSource, n_tokens: int, what: str) -> float:
    """Log a one-line warning when ``what`` (``n_tokens`` of stream) repeats a length file.

    Repetition is silent otherwise: a 3-sample file fills a 256K x 128 window by being cycled
    hundreds of times, and every window then holds the same few samples. The message goes to the
    ``libra.data.windows`` logger (WARNING): with no logging configured, Python prints exactly
    the message, one line, on stderr. Returns :func:`repeat_factor`.
    """
    times = repeat_factor(source, n_tokens)
    if times > 1:
        lengths = source.lengths
        _log.warning("warning: length file %s (%d samples, %d tokens) is repeated %.1f times to fill %s",
                     source.name, lengths.size, int(lengths.sum()), times, what)
    return times


def check_window_args(seq_len, gbs, n_windows) -> tuple[int, int, int]:
    """Validate ``(S, GBS, n_windows)``; each must be an integer >= 1."""
    seq_len = check_seq_len(seq_len)
    for name, value in (("GBS", gbs), ("number of windows", n_windows)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return seq_len, int(gbs), int(n_windows)


def gbs_windows(spec_or_source, seq_len: int, gbs: int, n_windows: int, seed: int = 0,
                policy: str = DEFAULT_POLICY, lookahead: int = DEFAULT_LOOKAHEAD) -> list[list[PackedSequence]]:
    """Consecutive GBS windows of fixed-token packed sequences from one arrival-order stream.

    The source (a preset name, a length-file path, or a :class:`~libra.data.source.LengthSource`)
    yields ``seed``-determined samples in arrival order; they are packed with
    :func:`~libra.data.packing.pack_fixed_tokens` (``policy``, ``lookahead``) and cut into
    ``n_windows`` windows of exactly ``gbs`` sequences.
    Window ``w`` holds stream sequences ``[w*gbs, (w+1)*gbs)`` with ``seq_id`` renumbered
    ``0..gbs-1``; ``sample_ids`` stay stream-global. A longer request extends a shorter one
    (window ``w`` does not depend on ``n_windows``). A length file too short for the request is
    cycled, with a one-line warning saying how many times (:func:`warn_if_repeated`).

    Returns:
        ``n_windows`` lists of ``gbs`` :class:`~libra.data.packing.PackedSequence`.

    Raises:
        ValueError: bad ``seq_len`` / ``gbs`` / ``n_windows`` / ``policy`` / ``lookahead``, or a
            bad source.
    """
    seq_len, gbs, n_windows = check_window_args(seq_len, gbs, n_windows)
    check_policy(policy, lookahead)
    source = resolve_workload(spec_or_source)
    count = n_windows * gbs
    need = count * seq_len
    warn_if_repeated(source, need, f"{n_windows} window(s) of GBS {gbs} x S {seq_len} tokens")
    seqs = _packed_stream(source, seq_len, count, seed, policy, lookahead)
    warn_if_cut(seqs, seq_len)
    windows = []
    for w in range(n_windows):
        chunk = seqs[w * gbs:(w + 1) * gbs]
        windows.append([PackedSequence(j, s.sample_lengths, s.sample_ids) for j, s in enumerate(chunk)])
    return windows


def _packed_stream(source: LengthSource, seq_len: int, count: int, seed: int, policy: str,
                   lookahead: int) -> list[PackedSequence]:
    """The first ``count`` packed sequences of ``source``'s seeded stream.

    Each round asks the source for strictly more tokens than the last (twice the slack), so the loop
    makes progress every round and ends within about 62 rounds: a request that would reach
    ``MAX_TOTAL`` tokens is an error instead of another round.
    """
    need = count * seq_len
    extra = seq_len  # 'defer' buffers up to `lookahead` samples past the last sequence: some slack
    while need + extra < MAX_TOTAL:
        lengths = source.take(need + extra, seed=seed)
        beyond = lengths.size - int(np.searchsorted(np.cumsum(lengths), need)) - 1
        if policy == "defer" and beyond < lookahead:  # a full buffer at the end keeps windows prefix-stable
            extra *= 2
            continue
        seqs = pack_fixed_tokens(lengths, seq_len, policy=policy, lookahead=lookahead, max_sequences=count)
        if len(seqs) == count:
            return seqs
        extra = 2 * extra + need  # 'truncate' drops tokens: ask for more until enough
    raise ValueError(f"{getattr(source, 'name', source)}: {count} packed sequences of S={seq_len} tokens need more "
                     f"than 2^62 tokens of stream (policy {policy!r})")


def warn_if_cut(seqs: list[PackedSequence], seq_len: int) -> int:
    """Log one warning line when samples longer than S were cut across packed sequences, saying
    into how many pieces (the longest's too): a 10^9-token document silently became ~4000 pieces
    of a 256K sequence. Returns the number of such samples."""
    if not seqs:
        return 0
    ids = np.concatenate([s.sample_ids for s in seqs])
    lengths = np.concatenate([s.sample_lengths for s in seqs])
    uniq, pieces = np.unique(ids, return_counts=True)
    tokens = np.bincount(np.searchsorted(uniq, ids), weights=lengths)
    cut = tokens > seq_len
    n = int(cut.sum())
    if n:
        worst = int(np.argmax(np.where(cut, tokens, -1)))
        _log.warning("warning: %d sample(s) longer than S=%d cut into %d pieces in all (the longest, %d tokens of it "
                     "packed, into %d)", n, seq_len, int(pieces[cut].sum()), int(tokens[worst]), int(pieces[worst]))
    return n


def window_workloads(window: list[PackedSequence]) -> np.ndarray:
    """float64 ``(len(window),)`` workload proxies ``w = sum l^2`` of a window's sequences."""
    return np.array([s.workload for s in window], dtype=np.float64)
