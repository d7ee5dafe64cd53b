"""Where each rank of a training run sits: its launcher coordinates and its live process groups.

Every rank makes one record -- global rank; local rank, node and processes per node as the
launcher numbered them (torchrun's ``LOCAL_RANK``, ``GROUP_RANK`` and ``LOCAL_WORLD_SIZE``; a local
spawn is node 0 with local rank = rank); host and device; DP, CP and pool coordinates; and the
members of its CP, pool and DP groups *as the groups themselves report them* (an all-gather of the
global ranks over each group, so a group that spans the wrong ranks, or does not work across
nodes, shows in the record) -- and every rank receives all of them (``run.json``'s ``ranks``).

Numbering (``libra.runtime.groups``): rank = ``dp_rank * CP + cp_rank``; torchrun gives node ``n``
the global ranks ``[n * nproc_per_node, (n + 1) * nproc_per_node)``, so a CP group never spans
nodes when CP divides the processes per node.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from libra.runtime.groups import ProcessGroups, all_gather_single


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.strip().lstrip("-").isdigit() else None


def torchrun_coords() -> dict:
    """``local_rank``, ``node`` and ``local_world_size`` of this process from torchrun's environment
    (``LOCAL_RANK``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``); a value the launcher did not set is None
    (recorded as unknown, never guessed from the global rank)."""
    return {"local_rank": _env_int("LOCAL_RANK"), "node": _env_int("GROUP_RANK"),
            "local_world_size": _env_int("LOCAL_WORLD_SIZE")}


def spawn_coords(rank: int, world: int) -> dict:
    """The coordinates of a locally spawned rank: one node, local rank = rank."""
    return {"local_rank": rank, "node": 0, "local_world_size": world}


def group_members(group, rank: int, device) -> list[int]:
    """Global ranks of ``group``'s members in group-rank order, as the group's own all-gather returns them."""
    mine = torch.tensor([rank], dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    all_gather_single(out, mine, group=group)
    return [int(r) for r in out.cpu().tolist()]


def rank_record(groups: ProcessGroups, coords: dict, device="cpu") -> dict:
    """This rank's record (collective over its CP, pool and DP groups: every rank must call it)."""
    grid, rank = groups.grid, groups.rank
    _, dp_rank, cp_rank = grid.coords(rank)
    return {"rank": rank, **coords, "host": socket.gethostname(), "device": str(device),
            "dp_rank": dp_rank, "cp_rank": cp_rank, "pool": grid.pool_of_worker(grid.worker_of(rank)),
            "cp_group": group_members(groups.cp.group, rank, device),
            "pool_group": group_members(groups.pool.group, rank, device),
            "dp_group": group_members(groups.dp, rank, device)}


def gather_rank_records(groups: ProcessGroups, coords: dict, device="cpu") -> list[dict]:
    """Every rank's :func:`rank_record`, in global-rank order (collective: every rank calls it)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, rank_record(groups, coords, device))
    return out


def single_process_record() -> list[dict]:
    """The one record of a single-process run (no process groups: each is the rank itself)."""
    return [{"rank": 0, **spawn_coords(0, 1), "host": socket.gethostname(), "device": "cpu", "dp_rank": 0,
             "cp_rank": 0, "pool": 0, "cp_group": [0], "pool_group": [0], "dp_group": [0]}]


def nodes_of(records: list[dict]) -> int:
    """Distinct ``(host, node)`` pairs among the records (unknown nodes count per host)."""
    return len({(r["host"], r["node"]) for r in records})
