"""DistCA's own planning algorithm, on its item model: the layout before attention and deficit filling.

Re-implemented from the DistCA authors' planner (``hao-ai-lab/DistCA``, ``distca/planner/planner.py``
read at commit ``04ceed7``: ``batch_to_items_general``, ``Item.get_priority``, ``Item.split_item``,
``Planner.plan_items``); the algorithm is theirs, the code and words are ours.

Item model. An *item* is a piece of one document (sample) held as a **head/tail pair**: a head
token range near the document's start and a tail range near its end. Its load is its causal cells
(query-key pairs: a row at position ``p`` of the document reads ``p + 1`` keys). Taking a head token
from the inside end of the head and a tail token from the inside start of the tail removes
``head_end + tail_start + 1`` cells, the same for every pair taken from the item, which is why
DistCA moves work in *token pairs*: for a document of even length ``L`` cut symmetrically this is
``L + 1`` cells per pair, so FLOPs move in exact quanta without cutting any head.

1. **Layout before attention** (:func:`layout_items`, DistCA's ``batch_to_items_general``): the
   documents of a nano-batch, in order, fill the workers one after another with
   ``tokens_per_worker`` tokens each. A document that fits where it starts is one whole item; a
   document that crosses a worker boundary is cut into chunks, and the chunk ``c`` a worker takes is
   held as the pair (next ``c // 2`` tokens from the front, next ``c - c // 2`` from the back).
2. **Deficit filling** (:func:`fill_deficits`, DistCA's ``plan_items``): with ``mean`` the mean
   worker load, workers below it are served most deficient first. A recipient pulls work while its
   remaining deficit exceeds ``tolerance * mean``: among all items on workers above the mean
   (donors) it takes the one with the fewest bytes per causal cell moved (:func:`move_priority`),
   moving ``f = min(deficit, item cells, donor surplus)`` cells -- the whole item when ``f`` covers
   it, else ``floor(f / pair cells)`` token pairs. The recipient stops when no donor or candidate is
   left or the best candidate cannot give one pair. A donor never drops below the mean, but nothing
   caps how far above the mean one may stay: the tolerance bounds recipients only.

Odd lengths. DistCA asserts even document lengths (its pair quantum is ``L + 1``, exact only for a
symmetric cut). Here every item keeps its own pair quantum ``head_end + tail_start + 1``, exact for
any cut: an odd whole document is held as head ``[0, ceil(L/2))`` and tail ``[ceil(L/2), L)`` (one
token more in the head, quantum ``L + 2``), an odd chunk as a tail one token longer than its head
(quantum ``L``), and a leftover unpaired token moves only with its whole item. The priority keeps
DistCA's ``L + 1`` (it is DistCA's estimate, used only to rank candidates). On even lengths the
moves are DistCA's exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra.workload import AttentionShape, causal_area

_COLUMNS = ("doc", "length", "head_start", "head_end", "tail_start", "tail_end", "home", "worker", "cells")


@dataclass
class Items:
    """Growable struct of arrays of items (rows ``[0, n)`` are in use, in creation order).

    Columns (int64): ``doc`` index into the nano-batch's documents, ``length`` its length ``L``,
    ``head_start/head_end`` and ``tail_start/tail_end`` the pair's ranges in document coordinates,
    ``home`` the worker holding the tokens before attention, ``worker`` the one computing them,
    ``cells`` the item's causal cells. A move appends the moved pair as a new row, as DistCA appends
    the split item to its list (candidates are ranked in this order, ties to the earlier row).
    """

    doc: np.ndarray
    length: np.ndarray
    head_start: np.ndarray
    head_end: np.ndarray
    tail_start: np.ndarray
    tail_end: np.ndarray
    home: np.ndarray
    worker: np.ndarray
    cells: np.ndarray
    n: int

    @classmethod
    def from_rows(cls, rows: list[tuple]) -> Items:
        """Items from ``(doc, length, head_start, head_end, tail_start, tail_end, worker)`` rows (home
        = worker: the layout before attention)."""
        cols = np.asarray(rows, dtype=np.int64).reshape(-1, 7).T
        doc, length, hs, he, ts, te, worker = cols
        cells = causal_area(hs, he) + causal_area(ts, te)
        return cls(doc, length, hs, he, ts, te, worker.copy(), worker.copy(), cells.astype(np.int64), len(rows))

    def copy(self) -> Items:
        return Items(**{c: getattr(self, c)[: self.n].copy() for c in _COLUMNS}, n=self.n)

    def used(self) -> dict[str, np.ndarray]:
        """The columns' rows in use."""
        return {c: getattr(self, c)[: self.n] for c in _COLUMNS}

    def append(self, i: int, head: tuple[int, int], tail: tuple[int, int], worker: int, cells: int) -> None:
        """Add the pair ``head``/``tail`` of item ``i``'s document (same home), computed on ``worker``."""
        if self.n == len(self.doc):
            for c in _COLUMNS:
                col = getattr(self, c)
                setattr(self, c, np.concatenate([col, np.zeros(max(len(col), 16), dtype=np.int64)]))
        j = self.n
        for c, v in (("doc", self.doc[i]), ("length", self.length[i]), ("head_start", head[0]),
                     ("head_end", head[1]), ("tail_start", tail[0]), ("tail_end", tail[1]),
                     ("home", self.home[i]), ("worker", worker), ("cells", cells)):
            getattr(self, c)[j] = v
        self.n += 1



def layout_items(doc_lengths, tokens_per_worker: int, n_workers: int) -> Items:
    """DistCA's layout before attention (``batch_to_items_general``): documents fill workers in order.

    Args:
        doc_lengths: int ``(n_docs,)`` document lengths in order (every nano-batch sequence's
            samples, sequence after sequence).
        tokens_per_worker: token budget of each worker.
        n_workers: workers (attention servers) the documents fill.

    Returns:
        The items, one per (document, worker) it lands on: a whole document as head
        ``[0, ceil(L/2))`` + tail ``[ceil(L/2), L)``, a chunk ``c`` of a crossing document as the
        pair of its next ``c // 2`` front and next ``c - c // 2`` back tokens.

    Raises:
        ValueError: a non-positive length or budget, or more tokens than the workers hold.
    """
    lengths = np.asarray(doc_lengths, dtype=np.int64).reshape(-1)
    if tokens_per_worker < 1 or np.any(lengths < 1):
        raise ValueError(f"need a positive token budget and positive document lengths, got {tokens_per_worker} "
                         f"and {lengths[lengths < 1][:4].tolist()}")
    if int(lengths.sum()) > tokens_per_worker * n_workers:
        raise ValueError(f"{int(lengths.sum())} tokens do not fit {n_workers} workers of {tokens_per_worker} tokens")
    rows, worker, budget = [], 0, tokens_per_worker
    for d, length in enumerate(lengths.tolist()):
        left, front, back = length, 0, length
        while left:
            if not budget:
                worker, budget = worker + 1, tokens_per_worker
            chunk = min(left, budget)
            if chunk == length:
                half = (length + 1) // 2
                rows.append((d, length, 0, half, half, length, worker))
            else:
                h = chunk // 2
                rows.append((d, length, front, front + h, back - (chunk - h), back, worker))
                front, back = front + h, back - (chunk - h)
            budget -= chunk
            left -= chunk
    return Items.from_rows(rows)


def move_priority(cells_movable: np.ndarray, length: np.ndarray, shape: AttentionShape) -> np.ndarray:
    """DistCA's candidate rank (``Item.get_priority``): elements moved per causal cell, lower first.

    A move of ``m`` cells of a document of length ``L`` is priced as ``m / (L + 1)`` query tokens of
    all query heads plus ``L + 1`` tokens of K and V (the whole document's prefix, fetched once):
    ``(hq * d * m / (L + 1) + 2 * hkv * d * (L + 1)) / m``. Element counts, not bytes: the dtype
    cancels in the ranking.
    """
    per_pair = length + 1
    q_elems = shape.num_q_heads * shape.head_dim
    kv_elems = 2 * shape.num_kv_heads * shape.head_dim
    return (cells_movable / per_pair * q_elems + per_pair * kv_elems) / cells_movable


def take(items: Items, i: int, cells: float, recipient: int) -> int:
    """Move up to ``cells`` causal cells of item ``i`` to ``recipient`` (DistCA's ``split_item``).

    The whole item moves when ``cells`` covers it; otherwise ``floor(cells / quantum)`` token pairs
    leave from the inside ends of its head and tail as a new item (quantum = ``head_end +
    tail_start + 1``). Returns the cells moved (0: not even one pair fits).
    """
    if cells >= items.cells[i]:
        items.worker[i] = recipient
        return int(items.cells[i])
    he, ts = int(items.head_end[i]), int(items.tail_start[i])
    quantum = he + ts + 1
    pairs = min(int(cells / quantum), he - int(items.head_start[i]), int(items.tail_end[i]) - ts)
    if pairs <= 0:
        return 0
    moved = pairs * quantum
    items.head_end[i] = he - pairs
    items.tail_start[i] = ts + pairs
    items.cells[i] -= moved
    items.append(i, (he - pairs, he), (ts, ts + pairs), recipient, moved)
    return moved


def fill_deficits(items: Items, n_workers: int, tolerance: float, shape: AttentionShape) -> Items:
    """DistCA's deficit filling (``Planner.plan_items``) on a copy of ``items``.

    Args:
        items: the layout before attention (:func:`layout_items`); left unchanged.
        n_workers: workers (their ids are ``0 .. n_workers - 1``).
        tolerance: a recipient stops once its remaining deficit is at most ``tolerance * mean``.
        shape: head geometry of the candidate ranking (:func:`move_priority`).

    Returns:
        The planned items with at least one cell (moved pairs appended after the layout's rows).
    """
    out = items.copy()
    load = np.bincount(out.worker[: out.n], weights=out.cells[: out.n], minlength=n_workers)
    mean = float(load.sum()) / n_workers
    surplus = load - mean
    threshold = mean * tolerance
    order = np.argsort(surplus, kind="stable")
    for r in order[surplus[order] < 0].tolist():
        need = -float(surplus[r])
        while need > threshold:
            pick = _best_candidate(out, surplus, need, shape)
            if pick < 0:
                break
            donor = int(out.worker[pick])
            moved = take(out, pick, min(need, float(out.cells[pick]), float(surplus[donor])), r)
            if moved <= 0:
                break
            surplus[donor] -= moved
            surplus[r] += moved
            need -= moved
    keep = np.flatnonzero(out.cells[: out.n] > 0)
    return Items(**{c: getattr(out, c)[keep] for c in _COLUMNS}, n=len(keep))


def _best_candidate(items: Items, surplus: np.ndarray, need: float, shape: AttentionShape) -> int:
    """Row of the lowest-priority item on a worker above the mean (-1: none); ties to the earlier row."""
    worker, cells = items.worker[: items.n], items.cells[: items.n]
    rows = np.flatnonzero((surplus[worker] > 0) & (cells > 0))
    if not len(rows):
        return -1
    movable = np.minimum(np.minimum(surplus[worker[rows]], need), cells[rows])
    return int(rows[np.argmin(move_priority(movable, items.length[rows], shape))])


def item_pieces(items: Items) -> tuple[np.ndarray, ...]:
    """The token ranges of every item, in document coordinates: ``(row, start, end)``, one range per
    non-empty head or tail, a head and tail that touch merged into one range."""
    u = items.used()
    touch = (u["head_end"] == u["tail_start"]) & (u["head_end"] > u["head_start"]) & (u["tail_end"] > u["tail_start"])
    rows = np.arange(items.n)
    head_end = np.where(touch, u["tail_end"], u["head_end"])
    has_head = head_end > u["head_start"]
    has_tail = (u["tail_end"] > u["tail_start"]) & ~touch
    row = np.concatenate([rows[has_head], rows[has_tail]])
    start = np.concatenate([u["head_start"][has_head], u["tail_start"][has_tail]])
    end = np.concatenate([head_end[has_head], u["tail_end"][has_tail]])
    order = np.lexsort((start, row))
    return row[order], start[order], end[order]
