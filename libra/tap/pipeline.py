"""TAP Pipeliner: equal-head chunks and their overlap schedule (Libra sec. 3.3, 4.4).

Every SH-tile on a worker has ``hq / H`` query heads. The executor concatenates the worker's tiles
along the varlen (token) axis and cuts the head axis into ``M`` equal chunks; chunk ``m`` holds the
``m``-th head piece of every tile, so all chunks carry the same FLOPs, Q/O bytes and kernel
structure. Transfers of chunk ``i + 1`` are issued while chunk ``i`` computes, so only chunk 0's
dispatch and chunk ``M - 1``'s return are exposed.

Event vocabulary of :func:`schedule` (the runtime follows it; the simulator prices it):

* ``("issue_dispatch", i)``: post the non-blocking Q (and the KV heads first needed by chunk ``i``)
  transfers of chunk ``i``;
* ``("wait_dispatch", i)``: block until chunk ``i``'s inputs have arrived;
* ``("compute", i)``: run the attention kernel on chunk ``i``;
* ``("issue_return", i)``: post the non-blocking output return of chunk ``i``;
* ``("wait_return", i)``: block until chunk ``i``'s output has been delivered (all at the end).
"""

from __future__ import annotations

from libra.workload import AttentionShape

EVENTS = ("issue_dispatch", "wait_dispatch", "compute", "issue_return", "wait_return")


def _check_chunks(M) -> None:
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise ValueError(f"Pipeliner chunks M must be a positive integer, got {M!r}")


def chunk_heads(head_start: int, head_end: int, M: int) -> list[tuple[int, int]]:
    """Split query heads ``[head_start, head_end)`` into ``M`` equal contiguous chunks.

    Raises:
        ValueError: ``M < 1``, an empty head range, or ``M`` not dividing the width (``hq / H``).
    """
    _check_chunks(M)
    width = head_end - head_start
    if width < 1:
        raise ValueError(f"empty head range [{head_start}, {head_end})")
    if width % M:
        raise ValueError(f"Pipeliner chunks M={M} must divide the head-shard width {width} (hq/H)")
    step = width // M
    return [(head_start + m * step, head_start + (m + 1) * step) for m in range(M)]


def schedule(M: int) -> list[tuple[str, int]]:
    """The ordered Pipeliner events for ``M`` chunks (Libra sec. 4.4).

    ``issue_dispatch 0``; then for each chunk ``i``: ``wait_dispatch i``, ``issue_dispatch i+1``
    (if any), ``compute i``, ``issue_return i``; finally ``wait_return`` for every chunk. ``M = 1``
    degenerates to dispatch, compute, return with nothing overlapped.

    Raises:
        ValueError: ``M < 1``.
    """
    _check_chunks(M)
    events = [("issue_dispatch", 0)]
    for i in range(M):
        events.append(("wait_dispatch", i))
        if i + 1 < M:
            events.append(("issue_dispatch", i + 1))
        events.append(("compute", i))
        events.append(("issue_return", i))
    events.extend(("wait_return", i) for i in range(M))
    return events


def chunk_kv_heads(shape: AttentionShape, head_start: int, head_end: int, M: int) -> list[tuple[int, int]]:
    """KV heads ``[start, end)`` each chunk's query heads read under GQA (may repeat across chunks
    when a chunk is narrower than a GQA group)."""
    return [shape.kv_head_range(a, b) for a, b in chunk_heads(head_start, head_end, M)]


def chunk_kv_sends(shape: AttentionShape, head_start: int, head_end: int, M: int) -> list[tuple[int, int]]:
    """KV heads to *send* with each chunk so every KV head moves once, with the first chunk that
    reads it; a chunk whose KV heads already arrived gets an empty range ``(k, k)``.

    With ``hq / H`` a multiple of ``M * (hq / hkv)`` this is ``M`` equal KV pieces (the paper's
    "logical KV fetch transferred in M head pieces").
    """
    out, sent = [], None
    for k0, k1 in chunk_kv_heads(shape, head_start, head_end, M):
        start = k0 if sent is None else max(k0, sent)
        out.append((start, max(start, k1)))
        sent = max(k1, sent or k1)
    return out
