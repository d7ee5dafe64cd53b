"""Packed batches for real model code: collate sampler pieces, shard them over a CP group.

The :class:`~libra.sampler.LibraSampler` yields, per microbatch, one packed sequence as a list of
:class:`~libra.sampler.SamplePiece` (a whole sample or the part of one that fits). This module
turns those into what a Hugging Face style model takes, without importing ``transformers``:

* :class:`PieceFeatures` wraps a tokenized dataset (rows with an ``input_ids`` column, e.g. a
  ``datasets.Dataset``) so ``DataLoader(PieceFeatures(ds), batch_sampler=sampler, ...)`` reads
  the tokens ``[start, stop)`` of each piece;
* :func:`collate_packed` flattens one packed sequence into exactly the keys, dtypes and values of
  ``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` (every piece is its
  own causal document: positions restart at 0 and the first label of each is the separator), so
  code written for that collator keeps working;
* :func:`shard_packed_batch` cuts one packed sequence into this CP rank's contiguous ``S / CP``
  tokens -- the pre-attention layout Libra and Ulysses both start from (Libra sec. 2.1, 4.3), so
  neither token reordering nor position remapping is needed -- with the labels shifted *before*
  slicing, so the last token of a rank's slice still predicts the first token of the next rank's.

Loss normalisation is the caller's: the sum of token losses over the whole global batch divided by
its number of non-ignored labels gives the same gradient whatever the DP x CP layout.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100
"""Label of a token that has no target (HF's ``ignore_index`` and the collator's separator)."""


class PieceFeatures:
    """A tokenized dataset read by :class:`~libra.sampler.SamplePiece`.

    Args:
        dataset: indexable rows (dicts) holding ``columns``; ``len(dataset)`` samples.
        columns: per-token columns to slice (``labels`` is optional in the rows).

    ``features[SamplePiece(i, a, b)]`` returns ``{column: row[column][a:b]}`` for row ``i``;
    :meth:`lengths` gives the token length of every row, which the sampler plans with.
    """

    def __init__(self, dataset, columns: tuple[str, ...] = ("input_ids", "labels")):
        if "input_ids" not in columns:
            raise ValueError(f"columns must include 'input_ids', got {columns!r}")
        self.dataset, self.columns = dataset, tuple(columns)

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> np.ndarray:
        """int64 ``(N,)`` token length of every row (the :class:`~libra.sampler.LibraSampler` input)."""
        return np.array([len(self.dataset[i]["input_ids"]) for i in range(len(self.dataset))], dtype=np.int64)

    def __getitem__(self, piece) -> dict:
        index, start, stop = (int(x) for x in piece)
        row = self.dataset[index]
        n = len(row["input_ids"])
        if not 0 <= start < stop <= n:
            raise ValueError(f"piece {tuple(piece)} outside row {index} of {n} tokens")
        return {c: row[c][start:stop] for c in self.columns if c in row}


def _as_list(x) -> list[int]:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def collate_packed(features, separator_id: int = IGNORE_INDEX) -> dict:
    """One packed sequence in ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``'s form.

    Args:
        features: one dict per piece with ``input_ids`` and optionally ``labels`` (unshifted, as
            HF datasets hold them); every piece is its own causal document.
        separator_id: label given to the first token of each piece (so that, once shifted, the
            last token of a piece predicts nothing across the boundary).

    Returns:
        ``input_ids``, ``labels``, ``position_ids``: int64 ``(1, S)``; ``cu_seq_lens_q`` and
        ``cu_seq_lens_k``: int32 ``(n + 1,)`` document offsets; ``max_length_q`` and
        ``max_length_k``: Python ints.

    Raises:
        ValueError: no features, an empty piece, or labels of another length than the tokens.
    """
    if not features:
        raise ValueError("collate_packed needs at least one piece")
    ids, labels, pos, cu = [], [], [], [0]
    for f in features:
        toks = _as_list(f["input_ids"])
        lab = _as_list(f["labels"]) if f.get("labels") is not None else toks
        if not toks or len(lab) != len(toks):
            raise ValueError(f"a piece needs >= 1 token and as many labels, got {len(toks)} tokens, {len(lab)} labels")
        ids += toks
        labels += [separator_id, *lab[1:]]
        pos += range(len(toks))
        cu.append(cu[-1] + len(toks))
    cu_t = torch.tensor(cu, dtype=torch.int32)
    longest = int(np.max(np.diff(cu)))
    return {"input_ids": torch.tensor([ids], dtype=torch.int64), "labels": torch.tensor([labels], dtype=torch.int64),
            "position_ids": torch.tensor([pos], dtype=torch.int64), "cu_seq_lens_q": cu_t, "cu_seq_lens_k": cu_t.clone(),
            "max_length_q": longest, "max_length_k": longest}


def document_lengths(batch: dict) -> tuple[int, ...]:
    """Token length of every document of a packed ``(1, S)`` batch.

    Taken from ``cu_seq_lens_q`` when present (the collators' exact boundaries), else from the
    ``position_ids`` restarts at 0 (what ``DataCollatorWithFlattening`` without flash kwargs gives).

    Raises:
        ValueError: neither key, or boundaries that do not cover the ``S`` tokens.
    """
    s = int(batch["input_ids"].shape[-1])
    if batch.get("cu_seq_lens_q") is not None:
        cu = torch.as_tensor(batch["cu_seq_lens_q"]).reshape(-1).tolist()
    elif batch.get("position_ids") is not None:
        pos = torch.as_tensor(batch["position_ids"]).reshape(-1)
        cu = [*torch.nonzero(pos == 0).reshape(-1).tolist(), s]
    else:
        raise ValueError("the batch needs cu_seq_lens_q or position_ids to tell its documents apart")
    lengths = tuple(int(b - a) for a, b in zip(cu, cu[1:]))
    if not cu or cu[0] != 0 or cu[-1] != s or any(n < 1 for n in lengths):
        raise ValueError(f"document boundaries {cu[:8]}... do not split the {s} tokens into non-empty documents")
    return lengths


def shift_labels(labels: torch.Tensor, lengths) -> torch.Tensor:
    """Next-token targets of a packed ``(1, S)`` label row: ``out[i] = labels[i + 1]``, and
    :data:`IGNORE_INDEX` at the last token of every document (nothing to predict across it)."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[..., :-1] = labels[..., 1:]
    ends = torch.as_tensor(np.cumsum(np.asarray(lengths, dtype=np.int64)) - 1, device=labels.device)
    out[..., ends] = IGNORE_INDEX
    return out


def shard_packed_batch(batch: dict, cp_rank: int, cp_size: int) -> dict:
    """This CP rank's contiguous slice of one packed sequence (Libra's pre-attention layout).

    Args:
        batch: one packed sequence, ``(1, S)`` tensors as :func:`collate_packed` (or
            ``DataCollatorWithFlattening``) returns: ``input_ids``, ``position_ids`` and
            ``labels`` (unshifted; ``input_ids`` when absent), optionally ``cu_seq_lens_q``.
        cp_rank, cp_size: the rank's place in its CP group; ``cp_size`` must divide ``S``.

    Returns:
        ``input_ids``, ``position_ids``, ``shift_labels``: int64 ``(1, S / CP)`` tokens
        ``[r S/CP, (r+1) S/CP)``, the labels shifted over the whole sequence first (so a slice's
        last token keeps its target on the next rank, and every document's last token is
        :data:`IGNORE_INDEX`); ``sample_lengths``: the whole sequence's document lengths, what
        the Libra planner and ``UlyssesAttention`` take.

    Raises:
        ValueError: a batch dimension other than 1, ``cp_size`` not dividing ``S``, a rank out of
            range, or the errors of :func:`document_lengths`.
    """
    ids = batch["input_ids"]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"a packed batch is (1, S); got input_ids of shape {tuple(ids.shape)}")
    s = ids.shape[1]
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1 or s % cp_size:
        raise ValueError(f"cp_size={cp_size!r} must be a positive integer dividing S={s}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank!r} must be in [0, {cp_size})")
    lengths = document_lengths(batch)
    pos = batch.get("position_ids")
    if pos is None:  # positions restart at every document
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = batch.get("labels")
    targets = shift_labels(ids if labels is None else labels, lengths)
    lo, hi = cp_rank * s // cp_size, (cp_rank + 1) * s // cp_size
    return {"input_ids": ids[:, lo:hi], "position_ids": pos[:, lo:hi], "shift_labels": targets[:, lo:hi],
            "sample_lengths": lengths}
