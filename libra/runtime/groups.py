"""Process groups from one rank grid (DP x CP per PP stage, pools of P DP replicas).

Numbering (docs/architecture.md): within one PP stage the global worker id is
``dp_rank * CP + cp_rank``; process rank = ``stage * DP * CP + worker``. A pool of ``P`` replicas
owns workers ``[p0 * CP, (p0 + P) * CP)`` with ``p0 = pool * P`` (Libra sec. 4.1). Everything is
passed explicitly: :func:`build_groups` returns the groups of the calling rank, nothing is stored
in module globals.

Timeouts: every group gets ``timeout_s``; the runtime waits on its handles with the same bound, so
a dead or hung peer turns into :class:`CollectiveTimeoutError` naming the pool ranks involved
instead of a hang.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass

import torch.distributed as dist


class CollectiveTimeoutError(RuntimeError):
    """A collective or point-to-point transfer did not complete within the group's timeout."""


@dataclass(frozen=True)
class RankGrid:
    """DP x CP (x PP) rank grid with pools of ``pool_size`` DP replicas.

    Raises:
        ValueError: non-positive sizes or ``pool_size`` not dividing ``dp``.
    """

    dp: int
    cp: int
    pool_size: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "pool_size", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RankGrid.{name} must be a positive integer, got {value!r}")
        if self.dp % self.pool_size:
            raise ValueError(f"pool size P={self.pool_size} must divide DP={self.dp}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp

    @property
    def num_pools(self) -> int:
        return self.dp // self.pool_size

    def coords(self, rank: int) -> tuple[int, int, int]:
        """Process rank -> ``(stage, dp_rank, cp_rank)``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        stage, worker = divmod(rank, self.dp * self.cp)
        return stage, worker // self.cp, worker % self.cp

    def worker_of(self, rank: int) -> int:
        """Process rank -> global worker id within its stage."""
        return rank % (self.dp * self.cp)

    def rank_of(self, worker: int, stage: int = 0) -> int:
        return stage * self.dp * self.cp + worker

    def pool_of_worker(self, worker: int) -> int:
        return (worker // self.cp) // self.pool_size

    def pool_workers(self, pool: int) -> tuple[int, ...]:
        """Global worker ids of pool ``pool`` in pool-rank order."""
        if not 0 <= pool < self.num_pools:
            raise ValueError(f"pool {pool} outside 0..{self.num_pools - 1}")
        p0 = pool * self.pool_size
        return tuple(range(p0 * self.cp, (p0 + self.pool_size) * self.cp))

    def cp_workers(self, dp_rank: int) -> tuple[int, ...]:
        return tuple(dp_rank * self.cp + r for r in range(self.cp))


@dataclass(frozen=True, eq=False)
class PoolGroup:
    """A process group whose members are listed as global worker ids in group-rank order.

    Attributes:
        group: the torch process group (group rank ``i`` is ``workers[i]``).
        workers: global worker ids in group-rank order (a pool: ``PoolPlan.workers``).
        ranks: process ranks in group-rank order (what the world knows them by).
        worker: the calling process's worker id (must be in ``workers``).
        timeout_s: bound on every wait issued against this group.
    """

    group: object
    workers: tuple[int, ...]
    ranks: tuple[int, ...]
    worker: int
    timeout_s: float

    def __post_init__(self) -> None:
        if self.worker not in self.workers:
            raise ValueError(f"worker {self.worker} is not a member of group {self.workers}")
        if len(self.workers) != len(self.ranks):
            raise ValueError("workers and ranks must have the same length")

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def rank(self) -> int:
        """This process's rank in the group (its pool rank)."""
        return self.workers.index(self.worker)

    def group_rank(self, worker: int) -> int:
        """Global worker id -> group rank; raises ValueError for non-members."""
        try:
            return self.workers.index(int(worker))
        except ValueError:
            raise ValueError(f"worker {worker} is not in this group {self.workers}") from None


@dataclass(frozen=True, eq=False)
class ProcessGroups:
    """The calling rank's groups: its CP group, its pool group, and its DP group."""

    grid: RankGrid
    rank: int
    cp: PoolGroup
    pool: PoolGroup
    dp: object
    timeout_s: float


def build_groups(grid: RankGrid, rank: int | None = None, backend: str | None = None,
                 timeout_s: float = 60.0) -> ProcessGroups:
    """Create every CP, pool and DP group of ``grid`` (all ranks must call this, same order).

    Args:
        grid: the rank grid; its world size must equal the initialised world size.
        rank: this process's rank (default: ``dist.get_rank()``).
        backend: process-group backend (default: the world's).
        timeout_s: per-group collective timeout in seconds.

    Raises:
        ValueError: world size mismatch or non-positive timeout.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if dist.get_world_size() != grid.world_size:
        raise ValueError(f"grid needs {grid.world_size} ranks, world has {dist.get_world_size()}")
    rank = dist.get_rank() if rank is None else rank
    timeout = _dt.timedelta(seconds=timeout_s)
    stage, dp_rank, cp_rank = grid.coords(rank)
    me = grid.worker_of(rank)
    cp_group = pool_group = dp_group = None
    for s in range(grid.pp):
        for d in range(grid.dp):
            workers = grid.cp_workers(d)
            ranks = [grid.rank_of(w, s) for w in workers]
            g = dist.new_group(ranks, timeout=timeout, backend=backend)
            if s == stage and d == dp_rank:
                cp_group = PoolGroup(g, workers, tuple(ranks), me, timeout_s)
        for p in range(grid.num_pools):
            workers = grid.pool_workers(p)
            ranks = [grid.rank_of(w, s) for w in workers]
            g = dist.new_group(ranks, timeout=timeout, backend=backend)
            if s == stage and p == grid.pool_of_worker(me):
                pool_group = PoolGroup(g, workers, tuple(ranks), me, timeout_s)
        for c in range(grid.cp):
            ranks = [grid.rank_of(d * grid.cp + c, s) for d in range(grid.dp)]
            g = dist.new_group(ranks, timeout=timeout, backend=backend)
            if s == stage and c == cp_rank:
                dp_group = g
    return ProcessGroups(grid, rank, cp_group, pool_group, dp_group, timeout_s)


def wait_all(works, group: PoolGroup, what: str) -> None:
    """Wait on async work handles with the group's timeout; failures name the group and step.

    Raises:
        CollectiveTimeoutError: a handle timed out or its peer died (message names ``what``, this
            worker and the group's workers).
    """
    timeout = _dt.timedelta(seconds=group.timeout_s)
    for w in works:
        try:
            ok = w.wait(timeout)
        except RuntimeError as exc:  # gloo reports timeouts and dead peers as RuntimeError
            raise CollectiveTimeoutError(
                f"worker {group.worker} (pool rank {group.rank} of workers {list(group.workers)}): "
                f"{what} failed or timed out after {group.timeout_s:g}s -- a peer is dead or hung: {exc}"
            ) from exc
        if ok is False:
            raise CollectiveTimeoutError(
                f"worker {group.worker} (pool rank {group.rank} of workers {list(group.workers)}): "
                f"{what} timed out after {group.timeout_s:g}s -- a peer is dead or hung")


def all_gather_single(output, input, group=None, async_op: bool = False):
    """``dist.all_gather_single`` (torch >= 2.13, where ``all_gather_into_tensor`` is a deprecated
    alias that warns on every call), or ``all_gather_into_tensor`` on the older CUDA builds a GPU
    image may keep (the project installs there with ``--no-deps``)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)
