"""End-to-end step-time model: per-layer costs -> 1F1B pipeline -> DP synchronisation (Libra sec. 6.2, 6.4).

One optimizer step of a model with layout ``DP x PP x CP`` is priced from the Plans one attention
method produced for the step's GBS window (one Plan per GA index, identical for every PP stage):

* **Per layer, per worker, per microbatch** (named terms of :class:`LayerTerms`):
  ``linear`` (QKV/O projections and dense MLP or the activated experts, ``tokens/CP *
  model.linear_flops_per_token()`` at ``linear_mfu`` of the profile's peak; backward 2x),
  ``moe_a2a`` (MoE dispatch + combine all-to-all inside an EP group of ``ep`` GPUs of one node,
  forward 2 and backward 2 of them, ``(ep-1)/ep`` of the ``top_k`` copies leave the GPU over
  NVLink) and ``attention`` (core attention from :meth:`libra.sim.cost.CostModel.price`: the
  worker's kernel time plus exposed communication; the cost model reports forward+backward, its
  exposed communication is split between the passes in proportion to their compute).
* **Layer synchronisation.** Every layer exchanges tensors inside the attention pool (the CP group
  for Ulysses/WLB-LLM, ``P`` CP groups for Libra), so a pool advances at its slowest worker: a
  microbatch's per-layer time on a replica is the max over its pool's workers. Replicas in
  different pools do not wait for each other inside a microbatch.
* **Pipeline.** Stage ``s`` holds ``layers / PP`` layers (remainder on the first stages), the
  last stage also the LM head. Per-microbatch stage times feed an exact event simulation of the
  1F1B schedule (warm-up ``PP - s - 1`` forwards, one-forward-one-backward steady state,
  cool-down), with an activation send of ``tokens/CP * hidden * 2`` bytes between stages.
* **DP synchronisation.** The optimizer boundary waits for the slowest replica (Libra sec. 2.1),
  then all-reduces the stage's gradients (``grad_bytes`` per parameter; dense weights over the
  stage's ``DP * CP`` ranks, experts over ``DP * CP / ep`` ranks) with a ring over the slowest link
  class the group spans; not overlapped with compute (conservative, same for every method).

``step_ms = max_replica(pipeline_ms) + grad_sync_ms``; throughput is tokens per GPU per second.
Every number comes from the profile, the model shape and the Plans: nothing is fitted to the paper.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from libra.config import ParallelConfig
from libra.plan import Plan
from libra.sim.cost import CostModel
from libra.sim.models import ModelShape
from libra.sim.profiles import HardwareProfile
from libra.sim.topology import Topology


@dataclass(frozen=True)
class E2EConfig:
    """Layout and modelling knobs of one end-to-end configuration.

    Attributes:
        model: the model shape.
        par: parallel layout of one PP stage plus ``pp``.
        layers: layers actually trained (default: all of the model's; the paper truncates models
            to fit its cluster, sec. 6.2).
        linear_mfu: fraction of ``profile.peak_tflops`` the linear layers attain (assumption,
            typical of large bf16 GEMMs; recorded with results).
        ep: expert-parallel group size for MoE models (default ``min(CP, gpus_per_node)``, so the
            EP group stays inside one CP group and one node).
        grad_bytes: bytes per gradient element in the DP all-reduce (4: fp32 reduction).

    Raises:
        ValueError: bad layer count (below ``PP`` or above the model's), ``linear_mfu`` outside
            (0, 1], non-positive ``ep`` or ``grad_bytes``.
    """

    model: ModelShape
    par: ParallelConfig
    layers: int | None = None
    linear_mfu: float = 0.5
    ep: int | None = None
    grad_bytes: int = 4

    def __post_init__(self) -> None:
        layers = self.model.layers if self.layers is None else self.layers
        if isinstance(layers, bool) or not isinstance(layers, int) or not self.par.pp <= layers <= self.model.layers:
            raise ValueError(f"layers={layers!r} must be an integer in [PP={self.par.pp}, {self.model.layers}]")
        object.__setattr__(self, "layers", layers)
        if not isinstance(self.linear_mfu, (int, float)) or not 0 < self.linear_mfu <= 1:
            raise ValueError(f"linear_mfu={self.linear_mfu!r} must be in (0, 1]")
        if self.ep is not None and (isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1):
            raise ValueError(f"ep={self.ep!r} must be a positive integer")
        if isinstance(self.grad_bytes, bool) or not isinstance(self.grad_bytes, int) or self.grad_bytes < 1:
            raise ValueError(f"grad_bytes={self.grad_bytes!r} must be a positive integer")

    def stage_layers(self) -> np.ndarray:
        """int ``(PP,)`` layers per stage (remainder on the first stages)."""
        pp = self.par.pp
        return np.array([self.layers // pp + (s < self.layers % pp) for s in range(pp)], dtype=np.int64)

    def ep_size(self, profile: HardwareProfile) -> int:
        return self.ep if self.ep is not None else min(self.par.cp, profile.gpus_per_node)


@dataclass(frozen=True, eq=False)
class LayerTerms:
    """Per-layer times of one microbatch, ``(DP, GA)`` arrays indexed by replica and GA index (ms).

    ``*_fwd`` / ``*_bwd`` are one layer's forward / backward; ``attention_*`` is already the pool's
    slowest worker (compute + exposed communication), ``linear_*`` and ``moe_a2a_*`` the replica's.
    ``tokens`` is ``(DP, GA)`` tokens of each replica's microbatch.
    """

    tokens: np.ndarray
    linear_fwd: np.ndarray
    linear_bwd: np.ndarray
    moe_a2a_fwd: np.ndarray
    moe_a2a_bwd: np.ndarray
    attention_fwd: np.ndarray
    attention_bwd: np.ndarray
    layer_fwd: np.ndarray
    layer_bwd: np.ndarray


@dataclass(frozen=True, eq=False)
class StepTime:
    """Price of one optimizer step (ms unless named otherwise).

    Attributes:
        step_ms: ``pipeline_ms + grad_sync_ms``.
        pipeline_ms: slowest replica's 1F1B makespan (the DP boundary waits for it).
        grad_sync_ms: gradient all-reduce after the boundary.
        replica_ms: ``(DP,)`` each replica's makespan.
        linear_ms, moe_a2a_ms, attention_ms: the slowest replica's stage-0 work per term
            (forward + backward over its GA microbatches and stage-0 layers).
        bubble_ms: ``pipeline_ms`` minus the slowest replica's stage-0 work (pipeline and DP waits).
        tokens: tokens trained in the step; gpus: ``DP * PP * CP``.
        tokens_per_gpu_s: throughput.
        stage_fwd_ms, stage_bwd_ms: ``(PP, DP, GA)`` per-microbatch stage times.
        terms: the per-layer :class:`LayerTerms`.
    """

    step_ms: float
    pipeline_ms: float
    grad_sync_ms: float
    replica_ms: np.ndarray
    linear_ms: float
    moe_a2a_ms: float
    attention_ms: float
    bubble_ms: float
    tokens: int
    gpus: int
    tokens_per_gpu_s: float
    stage_fwd_ms: np.ndarray = field(repr=False)
    stage_bwd_ms: np.ndarray = field(repr=False)
    terms: LayerTerms = field(repr=False)

    def summary(self) -> dict:
        """Scalar terms as a flat dict (CSV rows)."""
        return {"step_ms": self.step_ms, "pipeline_ms": self.pipeline_ms, "grad_sync_ms": self.grad_sync_ms,
                "linear_ms": self.linear_ms, "moe_a2a_ms": self.moe_a2a_ms, "attention_ms": self.attention_ms,
                "bubble_ms": self.bubble_ms, "tokens": self.tokens, "gpus": self.gpus,
                "tokens_per_gpu_s": self.tokens_per_gpu_s}


# --------------------------------------------------------------------------------------------
# pipeline schedule
# --------------------------------------------------------------------------------------------


def one_f_one_b(fwd_ms, bwd_ms, p2p_ms: float = 0.0) -> float:
    """Makespan of the non-interleaved 1F1B schedule (PipeDream-Flush) with per-microbatch times.

    Args:
        fwd_ms, bwd_ms: ``(PP, M)`` forward / backward time of microbatch ``m`` on stage ``s``.
        p2p_ms: activation (or gradient) send between adjacent stages.

    Returns:
        Time from the first forward to the last backward (ms).

    Raises:
        ValueError: mismatched or non-2-D shapes, negative times.
    """
    f = np.asarray(fwd_ms, dtype=np.float64)
    b = np.asarray(bwd_ms, dtype=np.float64)
    if f.ndim != 2 or f.shape != b.shape or f.shape[1] < 1:
        raise ValueError(f"fwd/bwd must both be (PP, M) with M >= 1, got {f.shape} and {b.shape}")
    if np.any(f < 0) or np.any(b < 0) or p2p_ms < 0:
        raise ValueError("stage times and p2p_ms must be >= 0")
    pp, m = f.shape
    orders = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        seq = [("F", i) for i in range(warm)]
        nf, nb = warm, 0
        while nb < m:
            if nf < m:
                seq.append(("F", nf))
                nf += 1
            seq.append(("B", nb))
            nb += 1
        orders.append(seq)
    f_end = np.full((pp, m), np.nan)
    b_end = np.full((pp, m), np.nan)
    free = np.zeros(pp)
    ptr = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while ptr[s] < len(orders[s]):
                kind, i = orders[s][ptr[s]]
                if kind == "F":
                    dep = 0.0 if s == 0 else f_end[s - 1, i] + p2p_ms
                    if np.isnan(dep):
                        break
                    f_end[s, i] = max(free[s], dep) + f[s, i]
                    free[s] = f_end[s, i]
                else:
                    dep = f_end[s, i] if s == pp - 1 else b_end[s + 1, i] + p2p_ms
                    if np.isnan(dep) or np.isnan(f_end[s, i]):
                        break
                    b_end[s, i] = max(free[s], dep) + b[s, i]
                    free[s] = b_end[s, i]
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for a valid 1F1B order; guards against an infinite loop
            raise RuntimeError("1F1B schedule deadlocked")
    return float(np.nanmax(b_end))


# --------------------------------------------------------------------------------------------
# the step model
# --------------------------------------------------------------------------------------------


class StepModel:
    """Prices optimizer steps of one configuration from the Plans of an attention method.

    Args:
        cfg: model and layout.
        profile: hardware profile (peak rate, links, cluster shape).
    """

    def __init__(self, cfg: E2EConfig, profile: HardwareProfile):
        self.cfg = cfg
        self.profile = profile
        self.topology = Topology(profile, cfg.par)
        self.cost_model = CostModel(profile, self.topology)
        self.ep = cfg.ep_size(profile)
        if cfg.model.is_moe and self.ep > profile.gpus_per_node:
            raise ValueError(f"ep={self.ep} exceeds gpus_per_node={profile.gpus_per_node} "
                             "(the model keeps an EP group inside one node)")

    # -- per-layer terms -----------------------------------------------------------------
    def _bandwidth(self, link: str) -> tuple[float, float]:
        lk = self.profile.links[link]
        return lk.bandwidth_gbps * 1e6, lk.latency_ms  # bytes per ms, ms

    def layer_terms(self, plans: list[Plan]) -> LayerTerms:
        """Per-layer forward/backward terms of every replica at every GA index.

        Raises:
            ValueError: plans that do not cover ``GA`` indices and every DP replica exactly once.
        """
        par, model = self.cfg.par, self.cfg.model
        if len(plans) != par.ga:
            raise ValueError(f"got {len(plans)} plans, expected GA={par.ga}")
        dp, ga, cp = par.dp, par.ga, par.cp
        tokens = np.zeros((dp, ga))
        attn_fwd = np.full((dp, ga), np.nan)
        attn_bwd = np.full((dp, ga), np.nan)
        lin_rate = self.profile.peak_tflops * 1e9 * self.cfg.linear_mfu  # FLOPs per ms
        lin_fwd = np.zeros((dp, ga))
        a2a = np.zeros((dp, ga))
        for g, plan in enumerate(plans):
            if plan.ga_index != g:
                raise ValueError(f"plans[{g}] has ga_index {plan.ga_index}")
            cost = self.cost_model.price(plan)
            comp = np.maximum(cost.compute_ms, 1e-30)
            fwd_w = cost.compute_fwd_ms + cost.exposed_comm_ms * cost.compute_fwd_ms / comp
            bwd_w = cost.compute_bwd_ms + cost.exposed_comm_ms * cost.compute_bwd_ms / comp
            for pool in plan.pools:
                replicas = sorted({w // cp for w in pool.workers})
                tok = {r: 0 for r in replicas}
                for seq in pool.sequences:
                    tok[int(seq.dp_rank)] += seq.num_tokens
                workers = np.asarray(pool.workers)
                # per-worker layer time = own linear + a2a + own attention; the pool syncs per layer
                per_gpu = np.array([tok[w // cp] / cp for w in pool.workers], dtype=np.float64)
                lin_w = per_gpu * model.linear_flops_per_token() / lin_rate
                a2a_w = self._a2a_ms(per_gpu)
                pool_fwd = float(np.max(lin_w + a2a_w + fwd_w[workers]))
                pool_bwd = float(np.max(2 * lin_w + a2a_w + bwd_w[workers]))
                for r in replicas:
                    if not np.isnan(attn_fwd[r, g]):
                        raise ValueError(f"replica {r} appears in two pools of plans[{g}]")
                    tokens[r, g] = tok[r]
                    lin_fwd[r, g] = tok[r] / cp * model.linear_flops_per_token() / lin_rate
                    a2a[r, g] = float(self._a2a_ms(np.array([tok[r] / cp]))[0])
                    # attention term = what the pool's slowest worker adds beyond this replica's own linear work
                    attn_fwd[r, g] = pool_fwd - lin_fwd[r, g] - a2a[r, g]
                    attn_bwd[r, g] = pool_bwd - 2 * lin_fwd[r, g] - a2a[r, g]
        if np.isnan(attn_fwd).any():
            r, g = np.argwhere(np.isnan(attn_fwd))[0]
            raise ValueError(f"replica {r} is in no pool of plans[{g}]")
        return LayerTerms(tokens=tokens, linear_fwd=lin_fwd, linear_bwd=2 * lin_fwd, moe_a2a_fwd=a2a,
                          moe_a2a_bwd=a2a.copy(), attention_fwd=attn_fwd, attention_bwd=attn_bwd,
                          layer_fwd=lin_fwd + a2a + attn_fwd, layer_bwd=2 * lin_fwd + a2a + attn_bwd)

    def _a2a_ms(self, tokens_per_gpu: np.ndarray) -> np.ndarray:
        """Two all-to-alls (dispatch + combine) of one MoE layer pass, per GPU (ms)."""
        model = self.cfg.model
        if not model.is_moe or self.ep == 1:
            return np.zeros_like(tokens_per_gpu, dtype=np.float64)
        bw, lat = self._bandwidth("nvlink")
        nbytes = tokens_per_gpu * model.moe_dispatch_bytes_per_token() * (self.ep - 1) / self.ep
        return 2 * (nbytes / bw + lat)

    # -- gradient synchronisation ------------------------------------------------------------
    def _group_link(self, ranks: int) -> str:
        """Slowest link class a group of ``ranks`` consecutive GPUs spans."""
        if ranks <= self.profile.gpus_per_node:
            return "nvlink"
        if ranks <= self.profile.gpus_per_supernode:
            return "roce"
        return "inter_supernode"

    def grad_sync_ms(self) -> float:
        """Ring all-reduce of the heaviest stage's gradients after the optimizer boundary."""
        cfg, model, par = self.cfg, self.cfg.model, self.cfg.par
        n_layers = int(cfg.stage_layers().max())
        dense = n_layers * (model.attn_proj_params + (model.hidden * model.num_experts if model.is_moe
                                                     else model.mlp_params))
        dense += model.hidden * model.vocab_size  # embedding (first stage) or LM head (last stage)
        experts = n_layers * (model.mlp_params - model.hidden * model.num_experts) / self.ep if model.is_moe else 0
        total = 0.0
        for params, ranks in ((dense, par.dp * par.cp), (experts, par.dp * par.cp // self.ep)):
            if params <= 0 or ranks <= 1:
                continue
            bw, lat = self._bandwidth(self._group_link(par.dp * par.cp))
            total += 2 * (ranks - 1) / ranks * params * cfg.grad_bytes / bw + 2 * (ranks - 1) * lat
        return total

    # -- one step ---------------------------------------------------------------------------
    def step(self, plans: list[Plan]) -> StepTime:
        """Price one optimizer step from one method's Plans of the step's window (``GA`` Plans)."""
        cfg, model, par = self.cfg, self.cfg.model, self.cfg.par
        terms = self.layer_terms(plans)
        layers = cfg.stage_layers()
        lin_rate = self.profile.peak_tflops * 1e9 * cfg.linear_mfu
        head = terms.tokens / par.cp * model.head_flops_per_token() / lin_rate  # (DP, GA)
        pp = par.pp
        fwd = layers[:, None, None] * terms.layer_fwd[None]
        bwd = layers[:, None, None] * terms.layer_bwd[None]
        fwd[-1] += head
        bwd[-1] += 2 * head
        link = "roce" if pp > 1 else "nvlink"
        bw, lat = self._bandwidth(link)
        p2p = float(terms.tokens.max() / par.cp * model.hidden * 2 / bw + lat) if pp > 1 else 0.0
        replica = np.array([one_f_one_b(fwd[:, r, :], bwd[:, r, :], p2p) for r in range(par.dp)])
        slow = int(np.argmax(replica))
        pipeline = float(replica[slow])
        sync = self.grad_sync_ms()
        step = pipeline + sync
        tokens = int(terms.tokens.sum())
        gpus = par.dp * par.cp * pp
        l0 = int(layers[0])
        lin = l0 * float((terms.linear_fwd[slow] + terms.linear_bwd[slow]).sum())
        a2a = l0 * float((terms.moe_a2a_fwd[slow] + terms.moe_a2a_bwd[slow]).sum())
        att = l0 * float((terms.attention_fwd[slow] + terms.attention_bwd[slow]).sum())
        return StepTime(step_ms=step, pipeline_ms=pipeline, grad_sync_ms=sync, replica_ms=replica,
                        linear_ms=lin, moe_a2a_ms=a2a, attention_ms=att,
                        bubble_ms=max(pipeline - float(fwd[0, slow].sum() + bwd[0, slow].sum()), 0.0),
                        tokens=tokens, gpus=gpus, tokens_per_gpu_s=tokens / (step / 1e3) / gpus,
                        stage_fwd_ms=fwd, stage_bwd_ms=bwd, terms=terms)
