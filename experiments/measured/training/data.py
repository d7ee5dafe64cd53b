"""Synthetic token data for the training runs: real sample lengths, learnable synthetic tokens.

Sample *lengths* come from a workload (a preset such as ``libra-prod`` or a length file); the
*tokens* of sample ``i`` are a seeded arithmetic walk ``t_{j+1} = (t_j + step_i) mod V`` with a
per-sample start and step, so a model can learn them (the loss falls) and every rank regenerates
any sample from ``(seed, i)`` without shared storage.

:class:`PieceDataset` answers ``dataset[SamplePiece]`` for a :class:`libra.sampler.LibraSampler`
batch sampler; :func:`collate_packed` turns one batch (the pieces of one packed sequence) into
the tensors of a packed sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from libra.sampler import SamplePiece

IGNORE = -100
"""Label of a token with no next token in its sample (excluded from the loss)."""


class PieceDataset:
    """Token pieces of synthetic samples.

    Args:
        lengths: int ``(N,)`` sample lengths.
        vocab_size: token range ``[0, V)``.
        seed: token seed.

    ``dataset[SamplePiece(i, a, b)]`` returns ``(inputs, labels)`` int64 arrays of ``b - a``
    tokens: tokens ``a..b-1`` of sample ``i`` and their next tokens (``IGNORE`` after the sample's
    last token), so a split sample keeps its true targets across the cut.
    """

    def __init__(self, lengths, vocab_size: int, seed: int = 0):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.seed = int(seed)

    def __len__(self) -> int:
        return len(self.lengths)

    def _walk(self, index: int) -> tuple[int, int]:
        rng = np.random.default_rng([self.seed, int(index)])
        return int(rng.integers(self.vocab_size)), int(rng.integers(1, 8))

    def __getitem__(self, piece) -> tuple[np.ndarray, np.ndarray]:
        i, a, b = SamplePiece(*piece)
        if not 0 <= i < len(self.lengths) or not 0 <= a < b <= self.lengths[i]:
            raise ValueError(f"piece {tuple(piece)} outside sample {i} of length "
                             f"{self.lengths[i] if 0 <= i < len(self.lengths) else '?'}")
        start, step = self._walk(i)
        pos = np.arange(a, b + 1, dtype=np.int64)
        toks = (start + step * pos) % self.vocab_size
        labels = toks[1:].copy()
        if b == self.lengths[i]:
            labels[-1] = IGNORE
        return toks[:-1], labels

    def valid_targets(self, pieces) -> int:
        """Tokens of ``pieces`` that have a label (all but each sample's last token)."""
        return int(sum(p.stop - p.start - (p.stop == self.lengths[p.index]) for p in map(SamplePiece._make, pieces)))


@dataclass(frozen=True)
class PackedBatch:
    """One packed sequence: ``input_ids, labels, position_ids`` int64 ``(S,)`` and its pieces' lengths."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    sample_lengths: tuple[int, ...]

    def local(self, cp_rank: int, cp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This CP rank's contiguous token slice (pre-attention layout) of ids, labels, positions."""
        s = self.input_ids.shape[0]
        if s % cp:
            raise ValueError(f"CP={cp} must divide the packed length {s}")
        lo, hi = cp_rank * s // cp, (cp_rank + 1) * s // cp
        return self.input_ids[lo:hi], self.labels[lo:hi], self.position_ids[lo:hi]


def collate_packed(items) -> PackedBatch:
    """Concatenate ``(inputs, labels)`` pieces into one packed sequence; positions restart per piece."""
    ids = np.concatenate([x for x, _ in items])
    labels = np.concatenate([y for _, y in items])
    lengths = tuple(len(x) for x, _ in items)
    pos = np.concatenate([np.arange(n) for n in lengths])
    return PackedBatch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(pos), lengths)
