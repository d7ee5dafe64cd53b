"""`libra-bench train`: train the small Qwen3-style model with DP x CP and a chosen core attention.

Launch modes:

* ``--nproc N`` spawns N local processes (gloo on CPU; a ``file://`` rendezvous in a temporary
  folder; ``torch.set_num_threads(1)`` per rank) -- the CPU path.
* Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set by the launcher) each process joins the launcher's
  world with NCCL when CUDA is available (``--nproc`` must equal the world size).

``--attention`` picks ``reference`` (single process, CP = 1), ``ulysses`` or ``libra`` (VRSP sampler
+ TAP plans + ``libra_attention``). Results go through :class:`experiments.runner.ExperimentRun`:
``train.csv`` (one row per step: loss, step time, tokens/GPU/s), ``train.png`` (loss curve) and
``run.json`` under ``results/train/`` unless ``--out``.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.training.loop import ATTENTION, DTYPES, LoopConfig, RankContext, train_loop
from experiments.training.model import ModelConfig


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        nproc: processes = ``DP * CP`` (``reference`` needs ``CP = 1``).
        cp: context-parallel degree.
        attention: ``reference``, ``ulysses`` or ``libra``.
        steps: optimizer steps.
        seq_len: packed-sequence length ``S``; ``gbs``: packed sequences per step (default ``2 * DP``).
        pool_size: Libra's ``P`` (default ``DP``); block_size ``B``, head_split ``H``,
            pipeline_chunks ``M`` (Libra sec. 4.3, 4.4).
        workload: length preset or file the sample lengths come from.
        model: the model shape; dtype: ``float64``, ``float32`` or ``bfloat16``.
        lr, seed: AdamW learning rate and the run's seed (data order, init, tokens).
        timeout_s: bound on every collective and on the whole spawned run.

    Raises:
        ValueError: naming the bad value (unknown attention/dtype, ``CP`` not dividing ``nproc``,
            ``DP`` not dividing ``gbs``, ``P`` not dividing ``DP``, ``CP`` not dividing ``S``, ...).
    """

    nproc: int = 4
    cp: int = 2
    attention: str = "libra"
    steps: int = 5
    seq_len: int = 1024
    gbs: int | None = None
    pool_size: int | None = None
    block_size: int = 128
    head_split: int = 2
    pipeline_chunks: int = 2
    workload: str = "libra-prod"
    model: ModelConfig = field(default_factory=ModelConfig)
    dtype: str = "float32"
    lr: float = 3e-3
    seed: int = 0
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("nproc", "cp", "steps", "seq_len", "block_size", "head_split", "pipeline_chunks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {v!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {ATTENTION}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {tuple(DTYPES)}")
        if self.nproc % self.cp:
            raise ValueError(f"CP={self.cp} must divide nproc={self.nproc} (nproc = DP x CP)")
        if self.attention == "reference" and self.cp != 1:
            raise ValueError(f"reference attention runs whole sequences: needs CP=1, got CP={self.cp}")
        if self.attention != "reference" and self.cp < 2:
            raise ValueError(f"{self.attention} attention needs CP >= 2, got CP={self.cp}")
        dp = self.nproc // self.cp
        gbs = 2 * dp if self.gbs is None else self.gbs
        pool = dp if self.pool_size is None else self.pool_size
        object.__setattr__(self, "gbs", gbs)
        object.__setattr__(self, "pool_size", pool)
        if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1 or gbs % dp:
            raise ValueError(f"GBS={gbs!r} must be a positive multiple of DP={dp}")
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1 or dp % pool:
            raise ValueError(f"pool size P={pool!r} must divide DP={dp}")
        if self.seq_len % self.cp:
            raise ValueError(f"CP={self.cp} must divide S={self.seq_len}")
        if self.attention == "libra":
            from libra.config import ParallelConfig, TapConfig, check_layout

            check_layout(ParallelConfig(dp=dp, cp=self.cp, gbs=gbs, seq_len=self.seq_len),
                         TapConfig(pool_size=pool, block_size=self.block_size, head_split=self.head_split,
                                   pipeline_chunks=self.pipeline_chunks), self.model.attention_shape)
        if not self.lr > 0 or not self.timeout_s > 0:
            raise ValueError(f"lr={self.lr!r} and timeout_s={self.timeout_s!r} must be > 0")

    @property
    def dp(self) -> int:
        return self.nproc // self.cp

    def loop_config(self) -> LoopConfig:
        return LoopConfig(attention=self.attention, dp=self.dp, cp=self.cp, seq_len=self.seq_len, gbs=self.gbs,
                          steps=self.steps, pool_size=self.pool_size, block_size=self.block_size,
                          head_split=self.head_split, pipeline_chunks=self.pipeline_chunks, model=self.model,
                          dtype=self.dtype, lr=self.lr, seed=self.seed)

    def to_dict(self) -> dict:
        return asdict(self)


def sample_lengths(cfg: TrainConfig) -> np.ndarray:
    """Sample lengths for ``cfg.steps`` steps (plus slack) from the workload, seeded."""
    from libra.data.source import resolve_workload

    need = (cfg.steps + 1) * cfg.gbs * cfg.seq_len
    return np.asarray(resolve_workload(cfg.workload).take(need, seed=cfg.seed), dtype=np.int64)


# --------------------------------------------------------------------------------------------
# launching
# --------------------------------------------------------------------------------------------


def _rank_main(rank: int, cfgs: list[TrainConfig], world: int, init: str, out_file: str, backend: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from libra.runtime.groups import RankGrid, build_groups

    torch.set_num_threads(1)
    timeout = max(c.timeout_s for c in cfgs)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        results = []
        for cfg in cfgs:
            groups = build_groups(RankGrid(dp=cfg.dp, cp=cfg.cp, pool_size=cfg.pool_size), rank=rank,
                                  timeout_s=cfg.timeout_s)
            ctx = RankContext(rank=rank, dp_rank=rank // cfg.cp, cp_rank=rank % cfg.cp,
                              cp_group=groups.cp, pool_group=groups.pool)
            results.append(train_loop(cfg.loop_config(), sample_lengths(cfg), ctx))
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


def run_training(cfgs, join_timeout_s: float | None = None) -> list[dict]:
    """Run one or more configurations (same ``nproc``) in one set of spawned ranks, in order.

    Single-process configurations (``nproc = 1``) run in this process. Returns one result per
    config: ``{"steps": [...], "params": {...}}`` (see :func:`train_loop`).

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
        return [train_loop(c.loop_config(), sample_lengths(c), RankContext(0, 0, 0)) for c in cfgs]
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="libra-train-") as tmp:
        out_file = os.path.join(tmp, "result.pt")
        ctx = mp.start_processes(_rank_main, args=(cfgs, world, f"file://{tmp}/store", out_file, "gloo"),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + (join_timeout_s or sum(c.timeout_s for c in cfgs) + 60)
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"training ranks did not finish within {join_timeout_s or 'the deadline'} s")
        except mp.ProcessRaisedException as exc:
            raise RuntimeError(f"a training rank failed: {exc}") from exc
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return torch.load(out_file)


def _torchrun(cfg: TrainConfig) -> dict | None:
    """Join a ``torchrun`` world (NCCL on CUDA); returns the result on rank 0, None elsewhere."""
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
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        groups = build_groups(RankGrid(dp=cfg.dp, cp=cfg.cp, pool_size=cfg.pool_size), rank=rank,
                              timeout_s=cfg.timeout_s)
        ctx = RankContext(rank, rank // cfg.cp, rank % cfg.cp, groups.cp, groups.pool)
        result = train_loop(cfg.loop_config(), sample_lengths(cfg), ctx)
        return result if rank == 0 else None
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------


def _plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    sns.lineplot(data=df, x="step", y="loss", hue="attention", marker="o", ax=axes[0])
    sns.barplot(data=df, x="attention", y="tokens_per_gpu_s", ax=axes[1], errorbar=None)
    axes[0].set_title("training loss")
    axes[1].set_title("tokens / GPU / s (median step)")
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")
    plt.close(fig)


@click.command("train")
@click.option("--nproc", type=click.IntRange(min=1), default=4, show_default=True, help="processes = DP x CP")
@click.option("--cp", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--attention", type=click.Choice(ATTENTION), default="libra", show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--gbs", type=click.IntRange(min=1), default=None, help="packed sequences per step [2 x DP]")
@click.option("--pool-size", type=click.IntRange(min=1), default=None, help="Libra P [DP]")
@click.option("--block-size", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--head-split", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--pipeline-chunks", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--hidden", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--experts", type=click.IntRange(min=0), default=0, show_default=True, help="MoE experts (0 = dense)")
@click.option("--dtype", type=click.Choice(tuple(DTYPES)), default="float32", show_default=True)
@click.option("--lr", type=float, default=3e-3, show_default=True)
@click.option("--workload", default="libra-prod", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--force", is_flag=True, help="accepted for symmetry; training always reruns")
def train(nproc, cp, attention, steps, seq_len, gbs, pool_size, block_size, head_split, pipeline_chunks, layers,
          hidden, experts, dtype, lr, workload, seed, out, force):
    """Train the small Qwen3-style model with DP x CP; log loss and tokens/GPU/s per step."""
    from experiments.runner import ExperimentRun

    try:
        model = ModelConfig(layers=layers, hidden=hidden, num_experts=experts)
        cfg = TrainConfig(nproc=nproc, cp=cp, attention=attention, steps=steps, seq_len=seq_len, gbs=gbs,
                          pool_size=pool_size, block_size=block_size, head_split=head_split,
                          pipeline_chunks=pipeline_chunks, workload=workload, model=model, dtype=dtype, lr=lr,
                          seed=seed)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # started by torchrun
    if launched:
        result = _torchrun(cfg)
        if result is None:
            return
        source = "torchrun"
    else:
        result = run_training(cfg)[0]
        source = "spawn-gloo" if nproc > 1 else "single-process"
    df = pd.DataFrame(result["steps"])
    df.insert(0, "attention", attention)
    df["dp"], df["cp"], df["nproc"], df["launch"] = cfg.dp, cfg.cp, nproc, source
    run = ExperimentRun("train", cfg.to_dict(), out_dir=out, force=force, quiet=True)
    paths = run.finish(df, _plot)
    for r in result["steps"]:
        click.echo(f"step {r['step']}: loss {r['loss']:.4f}  {r['step_ms']:.0f} ms  "
                   f"{r['tokens_per_gpu_s']:.0f} tokens/GPU/s")
    click.echo(f"median tokens/GPU/s {df.tokens_per_gpu_s.median():.0f}; wrote {paths['csv']}")
