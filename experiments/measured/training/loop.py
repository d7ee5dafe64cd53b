"""The DP x CP training loop one rank runs (gloo on CPU, NCCL on GPUs); no globals, no env flags.

Per optimizer step (Libra sec. 1, 5, 6.7):

1. Every rank builds the step's :class:`~libra.sampler.StepAssignment` from the same seeded
   sampler state (the sampler is deterministic, so no broadcast is needed) and, for ``libra``,
   plans every GA index from its sequence-length metadata: VRSP pools come from the sampler, TAP
   placement from :func:`baselines.libra_planners.plan_grouped_window`. The
   :class:`~libra.runtime.async_planner.AsyncPlanner` plans step ``s + 1`` while step ``s`` trains
   and also compiles this rank's :class:`~libra.runtime.program.WorkerProgram` of every GA index
   (``compile_for``), so on the step's path ``libra.runtime.attention.prepare`` only builds the
   runner (reused by every layer); the pool's ranks check that plan digests agree on the first step.
2. A ``DataLoader`` over :class:`PieceDataset` with the sampler as ``batch_sampler`` hands this DP
   rank its packed sequences in GA order; each CP rank keeps its contiguous ``S / CP`` slice.
3. Loss = sum of token cross-entropies / the step's total labelled tokens (counted over the whole
   GBS window), so the summed gradients over ranks and GA equal the gradient of the global mean
   loss whatever the DP x CP layout or sample order: reference, Ulysses and Libra train the same
   objective on the same multiset of samples.
4. Gradients are all-reduced (sum) over all ranks (parameters are replicated over DP and CP), then
   AdamW steps.
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from experiments.measured.training.attention import (
    libra_core_attention,
    reference_attention,
    ulysses_core_attention,
)
from experiments.measured.training.data import IGNORE, PieceDataset, collate_packed
from experiments.measured.training.model import ModelConfig, Qwen3Small
from libra.config import TapConfig
from libra.sampler import LibraSampler

ATTENTION = ("reference", "ulysses", "libra")
PLANNERS = ("libra", "libra-kt", "libra-adaptive")
"""The TAP planners ``attention="libra"`` can plan with: the registry's VRSP-pooled ones (the
sampler makes VRSP pools), the paper's Alg. 2 first (the default)."""
PLAN_WAIT_S = 300.0
"""Bound on waiting for a step's plans (planning takes milliseconds at these sizes)."""
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoopConfig:
    """What one training run needs (validated by :class:`experiments.measured.train.TrainConfig`;
    ``tap``: its TAP layout, which the planner is given whole)."""

    attention: str
    dp: int
    cp: int
    seq_len: int
    gbs: int
    steps: int
    tap: TapConfig
    model: ModelConfig
    dtype: str
    lr: float
    seed: int
    planner: str = PLANNERS[0]
    profile: str | None = None
    measure_speeds: bool = False


@dataclass(frozen=True)
class RankContext:
    """The calling rank's place in the grid and its process groups (None when single-process)."""

    rank: int
    dp_rank: int
    cp_rank: int
    cp_group: object = None
    pool_group: object = None
    device: str = "cpu"


def step_metadata(assignment) -> dict:
    """What the planner needs of one step: every packed sequence's sample lengths and the (GA, DP) groups."""
    return {"step": assignment.step, "groups": assignment.groups,
            "lengths": [assignment.sample_lengths(i) for i in range(len(assignment.sequences))]}


def make_planner(cfg: LoopConfig, device_speeds=None):
    """The run's TAP planner (:data:`PLANNERS`, from the registry) with its TAP layout, profile and
    -- ``libra-adaptive`` -- the measured ``device_speeds`` (None: equal speeds)."""
    from baselines.registry import get_planner

    speeds = {} if device_speeds is None else {"device_speeds": tuple(device_speeds)}
    return get_planner(cfg.planner, tap=cfg.tap, profile=cfg.profile, **speeds)


def plan_step(cfg: LoopConfig, shape, metadata: dict, planner=None):
    """TAP plans of every GA index from sequence-length metadata (VRSP pools come from the sampler),
    by ``planner`` (default :func:`make_planner`'s)."""
    from libra.config import ParallelConfig

    par = ParallelConfig(dp=cfg.dp, cp=cfg.cp, gbs=cfg.gbs, seq_len=cfg.seq_len)
    planner = make_planner(cfg) if planner is None else planner
    return planner.plan_groups(metadata["lengths"], metadata["groups"], par, shape,
                               {"source": "LibraSampler", "step": metadata["step"]})


def _plans_for_step(cfg: LoopConfig, assignment, shape):
    return plan_step(cfg, shape, step_metadata(assignment))


@dataclass
class _RankState:
    """What one rank's steps share: the model and optimizer, the data, the planner."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sampler: LibraSampler
    dataset: PieceDataset
    batches: object
    planner: object
    first_step: int


def train_loop(cfg: LoopConfig, lengths: np.ndarray, ctx: RankContext, resume: dict | None = None,
               on_step=None) -> dict:
    """Run ``cfg.steps`` optimizer steps on this rank -- from ``resume["next_step"]`` on when given.

    Args:
        resume: a checkpoint (:func:`experiments.measured.training.checkpoint.load_checkpoint`): the model and
            optimizer state after its ``next_step`` steps, their records and (``--measure-speeds``)
            the device speeds planned with, so the resumed steps are the ones an uninterrupted run
            takes (same data, same plans, same losses).
        on_step: called after every step with ``(record, model, opt, records so far, device speeds)``.

    Returns:
        ``{"steps": [{"step", "loss", "step_ms", "tokens", "tokens_per_gpu_s", "plan_ms", "compile_ms",
        "plan_wait_ms"}],
        "params": {name: tensor}}`` (params on every rank; identical across ranks).
    """
    dtype = DTYPES[cfg.dtype]
    model = Qwen3Small(cfg.model)
    model.reset_parameters(cfg.seed)
    model = model.to(device=ctx.device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, log = 0, []
    if resume is not None:
        model.load_state_dict(resume["model"])
        # a copy: AdamW keeps loaded state tensors as they are, and spawned ranks receive theirs in
        # shared memory -- every rank would step the same exp_avg in place
        opt.load_state_dict(copy.deepcopy(resume["opt"]))
        start, log = int(resume["next_step"]), list(resume["steps"])
    use_vrsp = cfg.attention == "libra"
    sampler = LibraSampler(lengths, cfg.seq_len, cfg.gbs, cfg.dp, pool_size=cfg.tap.pool_size if use_vrsp else 1,
                           dp_rank=ctx.dp_rank, seed=cfg.seed, use_vrsp=use_vrsp)
    if cfg.steps > sampler.steps_per_epoch:
        raise ValueError(f"steps={cfg.steps} exceeds the {sampler.steps_per_epoch} steps the data holds")
    sampler.load_state_dict({"epoch": 0, "next_micro": start * sampler.ga})  # the batches of the steps to run
    dataset = PieceDataset(lengths, cfg.model.vocab_size, seed=cfg.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_packed, num_workers=0)
    planner, speeds = None, None
    if cfg.attention == "libra":
        # Libra sec. 5: plans of step s+1 are built -- and this rank's programs compiled -- on a CPU
        # thread while step s trains
        from libra.runtime.async_planner import AsyncPlanner

        worker = ctx.pool_group.worker if ctx.pool_group is not None else ctx.rank
        if cfg.measure_speeds:
            kept = (resume or {}).get("device_speeds")
            speeds = tuple(kept) if kept is not None else _measured_speeds(cfg, ctx, dtype)
        plan = functools.partial(plan_step, cfg, cfg.model.attention_shape, planner=make_planner(cfg, speeds))
        planner = AsyncPlanner(plan, mode="thread", max_pending=2, compile_for=worker, keep_plans=False)
        if start < cfg.steps:
            planner.submit(start, step_metadata(sampler.step(start)))
    state = _RankState(model, opt, sampler, dataset, iter(loader), planner, start)
    try:
        for step in range(start, cfg.steps):
            log.append(_train_step(cfg, step, state, ctx, dtype))
            if on_step is not None:
                on_step(log[-1], model, opt, log, speeds)
    finally:
        if planner is not None:
            planner.close()
    out = {"steps": log, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out if not cfg.measure_speeds else {**out, "device_speeds": list(speeds)}


def _measured_speeds(cfg: LoopConfig, ctx: RankContext, dtype) -> tuple[float, ...]:
    """Every rank's attention speed (:func:`libra.extensions.adaptive.speeds.measure_device_speeds` over the
    world, whose rank order is the DP x CP worker order ``libra-adaptive`` indexes), measured once
    before step 0 with the model's heads (the probe's default length: a toy ``S`` would time noise)."""
    from libra.extensions.adaptive.speeds import measure_device_speeds

    return measure_device_speeds(cfg.model.attention_shape, device=ctx.device, dtype=dtype)


def _train_step(cfg: LoopConfig, step: int, state: _RankState, ctx: RankContext, dtype) -> dict:
    world = cfg.dp * cfg.cp
    ga = cfg.gbs // cfg.dp
    model, opt, sampler, planner = state.model, state.opt, state.sampler, state.planner
    distributed = world > 1
    if distributed:
        dist.barrier()
    t0 = time.perf_counter()
    assignment = sampler.step(step)
    total_targets = sum(state.dataset.valid_targets(s) for s in assignment.sequences)
    programs, wait_ms, plan_ms, compile_ms = None, 0.0, 0.0, 0.0
    if planner is not None:
        if step + 1 < cfg.steps:
            planner.submit(step + 1, step_metadata(sampler.step(step + 1)))
        programs = planner.get(step, timeout=PLAN_WAIT_S).programs  # this rank's, one per GA index
        rec = planner.records[step]
        wait_ms, plan_ms, compile_ms = rec.wait_s * 1e3, rec.plan_s * 1e3, rec.compile_s * 1e3
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for g in range(ga):
        batch = next(state.batches)
        ids, labels, pos = (t.to(ctx.device) for t in batch.local(ctx.cp_rank, cfg.cp))
        if cfg.attention == "reference":
            attn = reference_attention(batch.sample_lengths)
        elif cfg.attention == "ulysses":
            attn = ulysses_core_attention(batch.sample_lengths, ctx.cp_group, cfg.model.num_q_heads,
                                          cfg.model.num_kv_heads, device=ctx.device)
        else:
            attn = libra_core_attention(programs[g], ctx.pool_group, verify_plan=(step == state.first_step))
        logits = model(ids, pos, attn)
        loss = F.cross_entropy(logits.float() if dtype == torch.bfloat16 else logits, labels,
                               ignore_index=IGNORE, reduction="sum") / total_targets
        loss.backward()
        loss_sum += loss.detach().to(torch.float64)
    if distributed:
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([gr.reshape(-1) for gr in grads])
        dist.all_reduce(flat)
        offset = 0
        for gr in grads:
            gr.copy_(flat[offset:offset + gr.numel()].view_as(gr))
            offset += gr.numel()
        dist.all_reduce(loss_sum)
    opt.step()
    opt.zero_grad(set_to_none=False)
    dt = time.perf_counter() - t0
    tokens = cfg.gbs * cfg.seq_len
    return {"step": step, "loss": float(loss_sum), "step_ms": dt * 1e3, "tokens": tokens,
            "tokens_per_gpu_s": tokens / dt / world, "plan_ms": plan_ms, "compile_ms": compile_ms,
            "plan_wait_ms": wait_ms}

