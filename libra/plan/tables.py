"""Struct-of-arrays tables of a Plan: placed tiles and forward transfers (DESIGN.md sec. 2).

Also the plan errors and the three transfer kinds (Q dispatch, KV fetch, O return; Libra sec.
4.3.3), which every consumer of a Plan shares.
"""

from __future__ import annotations

import numpy as np

Q, KV, O = 0, 1, 2  # noqa: E741  (the paper's names for the three transfer kinds)
KIND_NAMES = {Q: "q", KV: "kv", O: "o"}


class PlanMismatchError(RuntimeError):
    """Ranks of one pool hold plans with different hashes (raised before a plan's first use)."""


class PlanValidationError(ValueError):
    """A Plan violates one of its invariants; the message names the invariant and the offender."""


def frozen_array(values, dtype) -> np.ndarray:
    """``values`` as a contiguous read-only array of ``dtype`` (plan data is immutable once built).

    A copy only when a conversion is needed: an array already contiguous and of ``dtype`` is kept
    and made read-only in place, so whoever built it must not write to it (or to its base) later.
    """
    out = np.ascontiguousarray(np.asarray(values, dtype=dtype))
    out.setflags(write=False)
    return out



_TILE_FIELDS = {"seq": np.int32, "q_start": np.int64, "q_end": np.int64, "head_start": np.int32,
                "head_end": np.int32, "q_home": np.int32, "dest": np.int32, "flops": np.float64}
_TRANSFER_FIELDS = {"kind": np.int8, "src": np.int32, "dst": np.int32, "seq": np.int32,
                    "tok_start": np.int64, "tok_end": np.int64, "head_start": np.int32,
                    "head_end": np.int32, "nbytes": np.int64, "hop": np.int8}


class _Table:
    """Immutable struct of equal-length numpy columns, JSON-serialisable and hashable."""

    FIELDS: dict = {}
    OPTIONAL: frozenset = frozenset()
    """Columns that default to zeros when not given, and are left out of ``to_dict`` and the digest
    while all zero (so tables built before the column existed read and hash as before)."""

    def __init__(self, **columns):
        n_rows = next((len(columns[k]) for k in self.FIELDS if k in columns), 0)
        for name in self.OPTIONAL - set(columns):
            columns[name] = np.zeros(n_rows, dtype=self.FIELDS[name])
        missing = set(self.FIELDS) - set(columns)
        if missing:
            raise TypeError(f"{type(self).__name__} missing columns {sorted(missing)}")
        n = None
        cols = self.__dict__
        for name, dtype in self.FIELDS.items():
            col = columns[name]
            # fast path (the planners build columns in their final dtype): no conversion, no view.
            # Like frozen_array, a matching array is kept, not copied, and made read-only.
            if type(col) is np.ndarray and col.dtype == dtype and col.ndim == 1 and col.flags.c_contiguous:
                col.flags.writeable = False
            else:
                col = frozen_array(col, dtype).reshape(-1)
            if n is None:
                n = len(col)
            elif len(col) != n:
                raise ValueError(f"{type(self).__name__}.{name} has {len(col)} rows, expected {n}")
            cols[name] = col
        cols["_n"] = n or 0

    def __setattr__(self, key, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __len__(self) -> int:
        return self._n

    @classmethod
    def empty(cls):
        return cls(**{k: np.zeros(0, dtype=v) for k, v in cls.FIELDS.items()})

    @classmethod
    def concat(cls, tables):
        tables = list(tables)
        if not tables:
            return cls.empty()
        return cls(**{k: np.concatenate([getattr(t, k) for t in tables]) for k in cls.FIELDS})

    def select(self, mask_or_index):
        return type(self)(**{k: getattr(self, k)[mask_or_index] for k in self.FIELDS})

    def _stored(self):
        return [k for k in self.FIELDS if k not in self.OPTIONAL or getattr(self, k).any()]

    def to_dict(self) -> dict:
        return {k: getattr(self, k).tolist() for k in self._stored()}

    @classmethod
    def from_dict(cls, d: dict):
        return cls(**d)

    def digest_into(self, h) -> None:
        for k in self._stored():
            h.update(k.encode())
            h.update(getattr(self, k).tobytes())


class TileTable(_Table):
    """Placed attention work, one row per tile (or per tile piece for non-TAP methods).

    Columns (all ``(T,)``): ``seq`` index into the pool's sequences; ``q_start, q_end`` token
    range inside that packed sequence (within one holder range); ``head_start, head_end`` query
    heads; ``q_home`` global worker holding the range's Q and receiving its output; ``dest``
    global worker computing it; ``flops`` forward FLOPs (causal, block-diagonal).
    """

    FIELDS = _TILE_FIELDS


class TransferTable(_Table):
    """Forward tensor transfers, one row per (kind, src, dst, piece).

    Columns (all ``(X,)``): ``kind`` (``Q``, ``KV`` or ``O``); ``src, dst`` global workers
    (never equal); ``seq`` pool sequence index; ``tok_start, tok_end`` token range; ``head_start,
    head_end`` query heads for Q/O, KV heads for KV; ``nbytes`` bytes moved (K and V together);
    ``hop`` (optional, default 0) the relay round of a KV row: 0 sends from the holder of the
    tokens; ``h > 0`` is sent in round ``h`` by the holder or by a worker that received the tokens
    in a row of a smaller hop (a KV relay); Q and O rows have hop 0.
    """

    FIELDS = _TRANSFER_FIELDS
    OPTIONAL = frozenset({"hop"})

    def backward(self) -> TransferTable:
        """Backward transfers (Libra sec. 4.3.3): dO along Q, dQ along O, dK/dV reversed KV.

        The ``kind`` column keeps the forward kind whose path the gradient follows.
        """
        is_kv = self.kind == KV
        return TransferTable(kind=self.kind, src=np.where(is_kv, self.dst, self.src),
                             dst=np.where(is_kv, self.src, self.dst), seq=self.seq,
                             tok_start=self.tok_start, tok_end=self.tok_end,
                             head_start=self.head_start, head_end=self.head_end, nbytes=self.nbytes,
                             hop=self.hop)

    def bytes_by_kind(self) -> dict[str, int]:
        return {name: int(self.nbytes[self.kind == k].sum()) for k, name in KIND_NAMES.items()}
