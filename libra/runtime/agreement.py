"""Cheap pool-wide agreement checks issued before a plan's first use (Libra sec. 5).

* :func:`check_plan_agreement`: all_gather of the 32-byte plan digest; ranks that disagree with
  pool rank 0 are named in :class:`~libra.plan.PlanMismatchError` on every rank, so no rank enters
  the exchange with a different plan (which would deadlock or silently mis-route tensors).
* :func:`check_finite_inputs`: all_gather of one non-finite flag per input tensor, so every rank
  raises the same ValueError together instead of the healthy ranks timing out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from libra.plan import checks as plan_checks
from libra.runtime.groups import CollectiveTimeoutError, PoolGroup, all_gather_single, wait_all


def _device(group: PoolGroup, like: torch.Tensor | None = None) -> torch.device:
    if like is not None:
        return like.device
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group.group) == "nccl" \
        else torch.device("cpu")


def _all_gather(t: torch.Tensor, group: PoolGroup, what: str) -> torch.Tensor:
    out = torch.empty(group.size * t.numel(), dtype=t.dtype, device=t.device)
    try:
        work = all_gather_single(out, t.reshape(-1), group=group.group, async_op=True)
    except RuntimeError as exc:
        raise CollectiveTimeoutError(f"worker {group.worker}: {what} failed: {exc}") from exc
    wait_all([work], group, what)
    return out.view(group.size, -1)


def check_plan_agreement(digest: str, group: PoolGroup, device: torch.device | None = None) -> None:
    """All pool ranks must hold the same plan digest (hex sha256).

    Raises:
        ValueError: ``digest`` is not a 64-character hex string.
        PlanMismatchError: names the pool ranks whose digest differs from this rank's (raised on
            every rank whose view disagrees, i.e. on all ranks when any two differ).
    """
    try:
        raw = bytes.fromhex(digest)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"plan digest must be a sha256 hex string, got {digest!r}")
    mine = torch.tensor(list(raw), dtype=torch.uint8, device=device or _device(group))
    got = _all_gather(mine, group, "plan digest all_gather").cpu()
    hexes = [bytes(row.tolist()).hex() for row in got]
    # the comparison (and its message naming the disagreeing ranks) lives with the other plan checks
    plan_checks.check_plan_agreement(digest, hexes)


def check_finite_inputs(tensors: dict[str, torch.Tensor], group: PoolGroup) -> None:
    """Raise on every rank if any rank's inputs hold NaN/Inf.

    Raises:
        ValueError: names the pool ranks and tensors with non-finite values.
    """
    names = list(tensors)
    first = next(iter(tensors.values()))
    flags = torch.stack([(~torch.isfinite(t)).any() for t in tensors.values()]).to(torch.int32)
    got = _all_gather(flags.to(_device(group, first)), group, "non-finite input check").cpu()
    bad = [(r, names[i]) for r in range(got.shape[0]) for i in range(got.shape[1]) if got[r, i]]
    if bad:
        what = ", ".join(f"{n} on pool rank {r} (worker {group.workers[r]})" for r, n in bad)
        raise ValueError(f"libra_attention inputs contain NaN/Inf: {what}")
