"""Transfer executor: moves a WorkerProgram's messages over a pool process group.

Each (phase, chunk) is one exchange in which this worker sends at most one packed buffer to each
peer and receives at most one from each (DESIGN.md sec. 2: one buffer per (src, dst) pair). Modes:

* ``p2p``: ``batch_isend_irecv`` on slices of one flat send/recv buffer (peers in pool-rank order);
  tags are distinct per (phase, chunk), so exchanges in flight together never cross-match.
* ``a2a``: ``all_to_all_single`` with uneven splits (every pool rank joins every exchange).

gloo cannot send to self; self rows never appear in messages (local pieces are gathered directly).
Group rank ``i`` is ``PoolGroup.workers[i]``; the process rank passed to torch is ``ranks[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from libra.runtime.blocks import N_HEADS as N_HEADS_COL
from libra.runtime.blocks import N_TOK as N_TOK_COL
from libra.runtime.blocks import Blocks
from libra.runtime.groups import CollectiveTimeoutError, PoolGroup, wait_all
from libra.runtime.program import PHASES, Message

COMM_MODES = ("p2p", "a2a")


@dataclass
class MemoryMeter:
    """Bytes of transient runtime buffers alive now / at peak (receive, send, kernel packs).

    Buffers kept from forward to backward (fetched Q/KV, tile outputs, lse) stay in ``current``
    until backward frees them.
    """

    current: int = 0
    peak: int = 0

    def alloc(self, *tensors: torch.Tensor) -> None:
        self.current += sum(t.numel() * t.element_size() for t in tensors)
        self.peak = max(self.peak, self.current)

    def free(self, *tensors: torch.Tensor) -> None:
        self.current -= sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Handle:
    """An exchange in flight: its buffers and torch work handles."""

    send: torch.Tensor
    recv: torch.Tensor
    works: list = field(default_factory=list)
    what: str = ""


def _stores_get(stores: dict, key) -> torch.Tensor:
    try:
        return stores[key]
    except KeyError:
        raise RuntimeError(f"runtime buffer {key!r} is not available (program/plan inconsistency)") from None


def _rect(buf: torch.Tensor, off: int, stride: int, h0: int, n: int, nh: int) -> torch.Tensor:
    """The ``n`` x ``nh`` rectangle of a flat row buffer (:mod:`libra.runtime.blocks`), as a view
    (one ``as_strided``: the runtime builds several per kernel call, each a Python-level op)."""
    if off + n * stride > buf.shape[0] or h0 + nh > stride:
        raise RuntimeError(f"block of {n} x {nh} rows at {off} (stride {stride}, head {h0}) is outside a buffer "
                           f"of {buf.shape[0]} rows (program/plan inconsistency)")
    rs, cs = buf.stride()
    return buf.as_strided((n, nh, buf.shape[-1]), (stride * rs, rs, cs), buf.storage_offset() + (off + h0) * rs)


def copy_blocks(target: torch.Tensor, blocks: Blocks, stores: dict, reverse: bool = False,
                add: bool = False) -> torch.Tensor:
    """Execute a block table on the flat row buffer ``target`` (one strided copy per block).

    Forward: ``target[dst] = stores[key][src]``. ``reverse``: ``stores[key][src] = target[dst]``
    (``add``: ``+=``, for gradients of rows that several kernel inputs read).
    """
    for k, so, ss, sh, do, ds, dh, n, nh in blocks.rows():
        src = _rect(_stores_get(stores, blocks.keys[k]), so, ss, sh, n, nh)
        dst = _rect(target, do, ds, dh, n, nh)
        if not reverse:
            dst.copy_(src)
        elif add:
            src.add_(dst)
        else:
            src.copy_(dst)
    return target


def pack(dst: torch.Tensor, blocks: Blocks, stores: dict) -> torch.Tensor:
    """Fill ``dst`` from ``stores`` (every row of ``dst`` is written: compile_worker checked it)."""
    return copy_blocks(dst, blocks, stores)


def gather(blocks: Blocks, stores: dict, n: int, heads: int, like: torch.Tensor,
           meter: MemoryMeter | None = None) -> tuple[torch.Tensor, bool]:
    """The packed ``(n, heads, d)`` input that ``blocks`` describe, and whether it was allocated.

    When the blocks are one rectangle of one buffer (:meth:`Blocks.as_view`: e.g. a chunk's query
    heads of every local token) the result is a strided view of that buffer and nothing is copied;
    otherwise a new buffer is packed (and counted on ``meter``).
    """
    d = like.shape[-1]
    rect = blocks.as_view()
    if rect is not None and rect[N_TOK_COL] == n and rect[N_HEADS_COL] == heads:
        k, so, ss, sh = rect[:4]
        return _rect(_stores_get(stores, blocks.keys[k]), so, ss, sh, n, heads), False
    buf = pack(like.new_empty(n * heads, d), blocks, stores)
    if meter is not None:
        meter.alloc(buf)
    return buf.view(n, heads, d), True


class Exchanger:
    """Starts the exchanges of one pool group in ``p2p`` or ``a2a`` mode.

    Raises:
        ValueError: unknown mode.
    """

    def __init__(self, group: PoolGroup, mode: str = "p2p"):
        if mode not in COMM_MODES:
            raise ValueError(f"comm mode must be one of {COMM_MODES}, got {mode!r}")
        self.group, self.mode = group, mode

    def start_group(self, exchanges) -> list:
        """Start ``(msg, send, recv, phase, chunk)`` exchanges together; returns their work handles.

        ``p2p``: one ``batch_isend_irecv`` over all of them (one NCCL group: its transfers progress
        concurrently; ops to one peer keep their order, the same on both sides). ``a2a``: one
        ``all_to_all_single`` each, in order.
        """
        g = self.group
        what = " and ".join(f"{phase} exchange of Pipeliner chunk {chunk}" for _, _, _, phase, chunk in exchanges)
        try:
            if self.mode == "a2a":
                if g.size == 1:
                    return []
                return [dist.all_to_all_single(recv, send, output_split_sizes=msg.recv_rows.tolist(),
                                               input_split_sizes=msg.send_rows.tolist(), group=g.group,
                                               async_op=True) for msg, send, recv, _, _ in exchanges]
            ops = [op for ex in exchanges for op in self._p2p_ops(*ex)]
            return dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as exc:
            raise CollectiveTimeoutError(f"worker {g.worker}: starting {what} failed: {exc}") from exc

    def _p2p_ops(self, msg: Message, send: torch.Tensor, recv: torch.Tensor, phase: str, chunk: int) -> list:
        """One exchange's receives, then its sends, peers in pool-rank order; its tag is distinct per
        (phase, chunk), so exchanges in flight together never cross-match."""
        g, me = self.group, self.group.rank
        tag = PHASES.index(phase) * 100_000 + chunk
        ops = []
        s_off = np.concatenate(([0], np.cumsum(msg.send_rows)))
        r_off = np.concatenate(([0], np.cumsum(msg.recv_rows)))
        for p in range(g.size):
            if p != me and msg.recv_rows[p]:
                ops.append(dist.P2POp(dist.irecv, recv[r_off[p]:r_off[p + 1]], g.ranks[p], g.group, tag))
        for p in range(g.size):
            if p != me and msg.send_rows[p]:
                ops.append(dist.P2POp(dist.isend, send[s_off[p]:s_off[p + 1]], g.ranks[p], g.group, tag))
        return ops

    def issue(self, msg: Message, stores: dict, like: torch.Tensor, phase: str, chunk: int,
              meter: MemoryMeter) -> Handle:
        """Pack ``msg`` from ``stores`` and start it; returns the in-flight handle."""
        return self.issue_group([(msg, phase, chunk)], stores, like, meter)[0]

    def issue_group(self, exchanges, stores: dict, like: torch.Tensor, meter: MemoryMeter) -> list[Handle]:
        """Pack every ``(msg, phase, chunk)`` from ``stores`` and start them as one group
        (:meth:`start_group`); one handle each, all waiting on the group's work."""
        d = like.shape[-1]
        bufs = []
        for msg, phase, chunk in exchanges:
            send = pack(like.new_empty(msg.n_send, d), msg.pack, stores)
            recv = like.new_empty(msg.n_recv, d)
            meter.alloc(send, recv)
            bufs.append((msg, send, recv, phase, chunk))
        works = self.start_group(bufs)
        return [Handle(send, recv, works, f"{phase} exchange of chunk {chunk}") for _, send, recv, phase, chunk in bufs]

    def finish(self, h: Handle, meter: MemoryMeter) -> torch.Tensor:
        """Wait (bounded by the group timeout), free the send buffer, return the receive buffer
        (a grouped handle waits for its whole group, once: its handles share one works list, emptied
        here, because a gloo work must not be waited on twice)."""
        wait_all(h.works, self.group, h.what)
        h.works.clear()
        meter.free(h.send)
        h.send = None
        return h.recv
