"""Launching training ranks: local spawn (gloo, CPU) or joining a ``torchrun`` world (NCCL).

Spawned ranks import only this module, the loop and torch (not click/pandas), which keeps the
start-up of a multi-process run short.
"""

from __future__ import annotations

import os

from experiments.training.config import TrainConfig, sample_lengths
from experiments.training.loop import RankContext, train_loop
from experiments.training.ranks import (
    gather_rank_records,
    single_process_record,
    spawn_coords,
    torchrun_coords,
)

# --------------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, cfgs: list[TrainConfig]) -> list[dict] | None:
    """One spawned rank (process group already initialised by the launcher); results on rank 0."""
    from libra.runtime.groups import RankGrid, build_groups

    results, built = [], {}
    for cfg in cfgs:
        key = (cfg.dp, cfg.cp, cfg.pool_size, cfg.timeout_s)
        if key not in built:  # creating groups is collective and slow under gloo: reuse them
            groups = build_groups(RankGrid(dp=cfg.dp, cp=cfg.cp, pool_size=cfg.pool_size), rank=rank,
                                  timeout_s=cfg.timeout_s)
            built[key] = groups, gather_rank_records(groups, spawn_coords(rank, world))
        groups, ranks = built[key]
        ctx = RankContext(rank=rank, dp_rank=rank // cfg.cp, cp_rank=rank % cfg.cp,
                          cp_group=groups.cp, pool_group=groups.pool)
        results.append({**train_loop(cfg.loop_config(), sample_lengths(cfg), ctx), "ranks": ranks})
    return results if rank == 0 else None


def run_training(cfgs, join_timeout_s: float | None = None) -> list[dict]:
    """Run one or more configurations (same ``nproc``) in one set of spawned ranks, in order.

    Single-process configurations (``nproc = 1``) run in this process. Returns one result per
    config: ``{"steps": [...], "params": {...}, "ranks": [...]}`` (see :func:`train_loop`; ``ranks``:
    every rank's :func:`experiments.training.ranks.rank_record`).

    Raises:
        ValueError: configurations with different ``nproc``.
        RuntimeError: a rank failed or the run exceeded its deadline (ranks are killed).
    """
    cfgs = [cfgs] if isinstance(cfgs, TrainConfig) else list(cfgs)
    nprocs = {c.nproc for c in cfgs}
    if len(nprocs) != 1:
        raise ValueError(f"run_training needs one nproc for all configs, got {sorted(nprocs)}")
    world = nprocs.pop()
    if world == 1:
        return [{**train_loop(c.loop_config(), sample_lengths(c), RankContext(0, 0, 0)),
                 "ranks": single_process_record()} for c in cfgs]
    from libra.runtime.launch import RankDeadlineError, run_local_ranks

    deadline = join_timeout_s or sum(c.timeout_s for c in cfgs) + 60
    try:
        records = run_local_ranks(_rank_main, world, cfgs, deadline_s=deadline,
                                  pg_timeout_s=max(c.timeout_s for c in cfgs), what="training ranks")
    except RankDeadlineError as exc:
        raise RuntimeError(str(exc)) from exc
    for r, rec in enumerate(records):
        if "error" in rec:
            raise RuntimeError(f"training rank {r} failed: {rec['error']}\n{rec['traceback']}")
    return records[0]["ok"]


def _torchrun(cfg: TrainConfig) -> dict | None:
    """Join a ``torchrun`` world (NCCL on CUDA); returns the result on rank 0, None elsewhere.

    The GPU is the launcher's ``LOCAL_RANK`` (with several nodes the global rank is not a device
    index); the result's ``ranks`` holds every rank's place (global / local rank, node, groups)."""
    import datetime

    import torch
    import torch.distributed as dist

    from libra.runtime.groups import RankGrid, build_groups

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout_s))
    try:
        if dist.get_world_size() != cfg.nproc:
            raise ValueError(f"--nproc {cfg.nproc} differs from the torchrun world size {dist.get_world_size()}")
        rank = dist.get_rank()
        device = "cpu"
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
            torch.cuda.set_device(local)
            device = f"cuda:{local}"
        groups = build_groups(RankGrid(dp=cfg.dp, cp=cfg.cp, pool_size=cfg.pool_size), rank=rank,
                              timeout_s=cfg.timeout_s)
        ranks = gather_rank_records(groups, torchrun_coords(), device)
        ctx = RankContext(rank, rank // cfg.cp, rank % cfg.cp, groups.cp, groups.pool, device)
        result = train_loop(cfg.loop_config(), sample_lengths(cfg), ctx)
        return {**result, "ranks": ranks} if rank == 0 else None
    finally:
        dist.destroy_process_group()
