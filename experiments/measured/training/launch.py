"""Launching training ranks: local spawn (gloo, CPU) or joining a ``torchrun`` world (NCCL).

Spawned ranks import only this module, the loop and torch (not click/pandas), which keeps the
start-up of a multi-process run short. While they train, rank 0 reports every finished step (and
every finished configuration) to the parent (:class:`StepReports`), which prints progress and,
for ``libra-bench train``, rank 0 writes a checkpoint after every step
(:mod:`experiments.measured.training.checkpoint`) so an interrupted run resumes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.measured.training.checkpoint import load_checkpoint, save_checkpoint
from experiments.measured.training.config import TrainConfig, sample_lengths
from experiments.measured.training.loop import RankContext, train_loop
from experiments.measured.training.ranks import (
    gather_rank_records,
    single_process_record,
    spawn_coords,
    torchrun_coords,
)


@dataclass
class StepReports:
    """What rank 0 does after each step: save a checkpoint (``checkpoint``, a run with one config)
    and tell the parent (``send``: a :class:`libra.runtime.launch.RankMessages`' ``send``, or a
    callback in the parent's own process). Messages: ``{"config": i, "step": record}`` per step,
    ``{"config": i, "done": result}`` per finished configuration (without its parameters)."""

    send: Callable | None = None
    checkpoint: Path | None = None

    def step_hook(self, index: int):
        def hook(record, model, opt, log, speeds):
            if self.checkpoint is not None:
                save_checkpoint(self.checkpoint, model, opt, log, None if speeds is None else list(speeds))
            if self.send is not None:
                self.send({"config": index, "step": record})
        return hook

    def done(self, index: int, result: dict) -> None:
        if self.send is not None:
            self.send({"config": index, "done": {k: v for k, v in result.items() if k != "params"}})


def _run_configs(cfgs: list[TrainConfig], ctx_of, reports: StepReports | None, resume: dict | None,
                 leader: bool) -> list[dict]:
    """Train every config in order on this rank (``ctx_of(cfg)``: its RankContext and rank records);
    the leader (rank 0) checkpoints and reports."""
    results = []
    for i, cfg in enumerate(cfgs):
        ctx, ranks = ctx_of(cfg)
        hook = reports.step_hook(i) if reports is not None and leader else None
        result = {**train_loop(cfg.loop_config(), sample_lengths(cfg), ctx, resume if i == 0 else None, hook),
                  "ranks": ranks}
        if reports is not None and leader:
            reports.done(i, result)
        results.append(result)
    return results


def _rank_main(rank: int, world: int, cfgs: list[TrainConfig], reports: StepReports | None = None,
               resume: dict | None = None) -> list[dict] | None:
    """One spawned rank (process group already initialised by the launcher); results on rank 0."""
    from libra.runtime.groups import RankGrid, build_groups

    built = {}

    def ctx_of(cfg):
        key = (cfg.dp, cfg.cp, cfg.tap.pool_size, cfg.timeout_s)
        if key not in built:  # creating groups is collective and slow under gloo: reuse them
            groups = build_groups(RankGrid(dp=cfg.dp, cp=cfg.cp, pool_size=cfg.tap.pool_size), rank=rank,
                                  timeout_s=cfg.timeout_s)
            built[key] = groups, gather_rank_records(groups, spawn_coords(rank, world))
        groups, ranks = built[key]
        return RankContext(rank=rank, dp_rank=rank // cfg.cp, cp_rank=rank % cfg.cp, cp_group=groups.cp,
                           pool_group=groups.pool), ranks

    results = _run_configs(cfgs, ctx_of, reports, resume, rank == 0)
    return results if rank == 0 else None


def run_training(cfgs, join_timeout_s: float | None = None, on_message: Callable[[dict], None] | None = None,
                 checkpoint: Path | None = None) -> list[dict]:
    """Run one or more configurations (same ``nproc``) in one set of spawned ranks, in order.

    Single-process configurations (``nproc = 1``) run in this process. Returns one result per
    config: ``{"steps": [...], "params": {...}, "ranks": [...]}`` (see :func:`train_loop`; ``ranks``:
    every rank's :func:`experiments.measured.training.ranks.rank_record`).

    Args:
        on_message: called in this process with every :class:`StepReports` message, as the steps finish.
        checkpoint: (one config) a checkpoint file written after every step; when it exists, training
            resumes from it (:mod:`experiments.measured.training.checkpoint`).

    Raises:
        ValueError: configurations with different ``nproc``, or a checkpoint with several configs.
        libra.runtime.launch.RankFailure: a rank failed (naming the rank that caused it).
        libra.runtime.launch.RankDeadlineError: the run exceeded its deadline (ranks are killed).
    """
    cfgs = [cfgs] if isinstance(cfgs, TrainConfig) else list(cfgs)
    nprocs = {c.nproc for c in cfgs}
    if len(nprocs) != 1:
        raise ValueError(f"run_training needs one nproc for all configs, got {sorted(nprocs)}")
    if checkpoint is not None and len(cfgs) != 1:
        raise ValueError("a checkpoint resumes one configuration")
    resume = load_checkpoint(checkpoint) if checkpoint is not None else None
    world = nprocs.pop()
    if world == 1:
        reports = StepReports(on_message, checkpoint)
        return _run_configs(cfgs, lambda c: (RankContext(0, 0, 0), single_process_record()), reports, resume, True)
    from libra.runtime.launch import raise_first_failure, relayed_messages, run_local_ranks

    deadline = join_timeout_s or sum(c.timeout_s * (c.steps + 2) for c in cfgs) + 60
    with relayed_messages(on_message) as (messages, poll):
        try:
            records = run_local_ranks(_rank_main, world, cfgs, StepReports(messages.send, checkpoint), resume,
                                      deadline_s=deadline, pg_timeout_s=max(c.timeout_s for c in cfgs),
                                      what="training ranks", poll=poll)
        finally:
            poll()  # the steps finished before an interrupt or a failure still count
    return raise_first_failure(records, "training ranks")[0]


def _torchrun(cfg: TrainConfig, on_message: Callable[[dict], None] | None = None,
              checkpoint: Path | None = None) -> dict | None:
    """Join a ``torchrun`` world (NCCL on CUDA); returns the result on rank 0, None elsewhere.

    The GPU is the launcher's ``LOCAL_RANK`` (with several nodes the global rank is not a device
    index); the result's ``ranks`` holds every rank's place (global / local rank, node, groups).
    Rank 0 reads the checkpoint (its node holds the run folder) and broadcasts it, so every rank
    resumes from the same state."""
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
        resume = [load_checkpoint(checkpoint) if rank == 0 and checkpoint is not None else None]
        dist.broadcast_object_list(resume, src=0)
        groups = build_groups(RankGrid(dp=cfg.dp, cp=cfg.cp, pool_size=cfg.tap.pool_size), rank=rank,
                              timeout_s=cfg.timeout_s)
        ranks = gather_rank_records(groups, torchrun_coords(), device)
        ctx = RankContext(rank, rank // cfg.cp, rank % cfg.cp, groups.cp, groups.pool, device)
        reports = StepReports(on_message, checkpoint)
        result = _run_configs([cfg], lambda _c: (ctx, ranks), reports, resume[0], rank == 0)[0]
        return result if rank == 0 else None
    finally:
        dist.destroy_process_group()
