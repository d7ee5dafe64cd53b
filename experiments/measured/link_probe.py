"""Point-to-point link probe between two local ranks (``libra-bench calibrate --links``).

A measured profile otherwise keeps its base profile's links (one device measures no link), so a
CPU profile prices gloo traffic between two processes of one host as NVLink: the planners that
price communication (``libra-adaptive``) and the simulator then take the microbench's exposed
waits for free. This probe spawns two processes on this machine -- gloo on CPU, NCCL on two GPUs
of this node -- and times a ping-pong (rank 0 sends ``n`` bytes, rank 1 sends them back; one way
is half the round trip) for each size; :func:`experiments.common.link_fit.fit_latency_bandwidth` fits the
intra-node link class's latency and bandwidth to the medians. Timing: ``time.perf_counter``
around blocking ``send``/``recv`` (CUDA synchronised), after untimed warm-up round trips.
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

LINK_SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20)
"""Bytes per transfer of the probe: small sizes fix the latency, large ones the bandwidth."""


def probe_link(device_type: str, sizes=LINK_SIZES, warmup: int = 2, repeats: int = 10, threads: int = 1,
               timeout_s: float = 120.0) -> list[dict]:
    """One-way transfer times between two spawned local ranks.

    Args:
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL between GPUs 0 and 1 of this node).
        sizes: bytes per transfer; warmup, repeats: untimed and timed round trips per size.
        threads: torch threads per CPU rank.
        timeout_s: the pair's collective timeout.

    Returns:
        One dict per size: ``bytes``, ``ms`` (median one-way time), ``ms_min``, ``repeats``, ``backend``.

    Raises:
        ValueError: an unknown device type, or ``cuda`` with fewer than two GPUs.
    """
    check_link_probe(device_type)
    with tempfile.TemporaryDirectory(prefix="libra-link-") as d:
        torch.multiprocessing.spawn(_rank, args=(device_type, tuple(int(n) for n in sizes), warmup, repeats,
                                                 threads, d, timeout_s), nprocs=2, join=True)
        return json.loads(Path(d, "link.json").read_text())


def check_link_probe(device_type: str) -> None:
    """ValueError unless :func:`probe_link` can run here (what ``calibrate --links`` checks before
    it measures anything): cpu, or cuda with two GPUs on this node."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"the link probe runs on cpu or cuda, got {device_type!r}")
    if device_type == "cuda" and torch.cuda.device_count() < 2:
        raise ValueError("--links on cuda needs two GPUs on this node (it times the link between two of them)")


def _rank(rank: int, device_type: str, sizes, warmup: int, repeats: int, threads: int, d: str,
          timeout_s: float) -> None:
    """One rank of the probe; rank 0 writes the rows to ``d/link.json``."""
    cpu = device_type == "cpu"
    if cpu:
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(rank)
    backend = "gloo" if cpu else "nccl"
    dist.init_process_group(backend, init_method=f"file://{d}/store", rank=rank, world_size=2,
                            timeout=_dt.timedelta(seconds=timeout_s))
    try:
        rows = [_time_size(rank, n, torch.device("cpu" if cpu else f"cuda:{rank}"), warmup, repeats) | {"backend": backend}
                for n in sizes]
        if rank == 0:
            tmp = Path(d, "link.json.tmp")
            tmp.write_text(json.dumps(rows))
            tmp.replace(Path(d, "link.json"))
    finally:
        dist.destroy_process_group()


def _time_size(rank: int, nbytes: int, device, warmup: int, repeats: int) -> dict:
    """Median and minimum one-way time of ``nbytes`` (half a ping-pong round trip)."""
    x = torch.ones(nbytes, dtype=torch.uint8, device=device)
    peer = 1 - rank
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3 / 2)
    return {"bytes": nbytes, "ms": statistics.median(times), "ms_min": min(times), "repeats": repeats}
