"""Cheap pool-wide agreement checks issued before a plan's first use (Libra sec. 5).

* :func:`check_plan_agreement`: all_gather of the 32-byte plan digest and of the execution options
  (Pipeliner chunks ``M``, comm mode, kernel backend, scale, finite check; :func:`encode_options`);
  ranks that disagree are named in :class:`~libra.plan.PlanMismatchError` on every rank, so no rank
  enters the exchange with a different plan or a different way of executing it (either would
  deadlock, abort gloo or silently mis-route tensors: a different ``M`` changes the message tags and
  sizes, a different comm mode pairs p2p sends with an all-to-all).
* :func:`check_finite_inputs`: all_gather of one non-finite flag per input tensor, so every rank
  raises the same ValueError together instead of the healthy ranks timing out.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from libra.plan import PlanMismatchError
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


OPTIONS_BYTES = 480
"""Fixed width of the encoded execution options (every rank gathers the same number of bytes)."""
_VALUE_CHARS = 64  # longest option value kept (a custom backend's name); longer ones are cut


def encode_options(options: dict | None) -> bytes:
    """The execution options as fixed-width bytes: compact JSON (sorted keys) padded with zeros.

    Values are JSON scalars; strings longer than 64 characters are cut (they only name things).

    Raises:
        ValueError: a non-scalar value, or more options than fit in :data:`OPTIONS_BYTES`.
    """
    clean = {}
    for name, value in sorted((options or {}).items()):
        if isinstance(value, str):
            value = value[:_VALUE_CHARS]
        elif value is not None and not isinstance(value, (bool, int, float)):
            raise ValueError(f"execution option {name!r} must be a scalar, got {type(value).__name__}")
        clean[str(name)[:_VALUE_CHARS]] = value
    raw = json.dumps(clean, separators=(",", ":"), sort_keys=True).encode()
    if len(raw) > OPTIONS_BYTES:
        raise ValueError(f"execution options take {len(raw)} bytes, more than {OPTIONS_BYTES}: {sorted(clean)}")
    return raw.ljust(OPTIONS_BYTES, b"\0")


def decode_options(raw: bytes) -> dict:
    """Inverse of :func:`encode_options`."""
    return json.loads(bytes(raw).rstrip(b"\0").decode() or "{}")


def options_mismatch(gathered: list[dict], group: PoolGroup) -> str | None:
    """The text naming every option whose value differs between pool ranks (same on every rank),
    or None when all ranks agree."""
    parts = []
    for name in sorted({k for opts in gathered for k in opts}):
        ranks_of: dict[str, list[int]] = {}
        for r, opts in enumerate(gathered):
            ranks_of.setdefault(json.dumps(opts.get(name)), []).append(r)
        if len(ranks_of) > 1:
            parts.append(f"{name}: " + ", ".join(
                f"{value} on pool ranks {ranks} (workers {[group.workers[r] for r in ranks]})"
                for value, ranks in ranks_of.items()))
    if not parts:
        return None
    return ("execution options differ across the pool -- " + "; ".join(parts)
            + ": every rank of a pool must prepare the plan with the same options")


def check_plan_agreement(digest: str, group: PoolGroup, device: torch.device | None = None,
                         options: dict | None = None) -> None:
    """All pool ranks must hold the same plan digest (hex sha256) and the same execution options.

    One all_gather carries both, so a mismatch is caught in one collective on every rank before
    any exchange is issued (Libra sec. 5: ranks agree on the plan before executing it).

    Args:
        options: execution options that must agree (``prepare`` passes ``chunks``, ``comm``,
            ``backend``, ``scale``, ``check_finite``); None: only the digest.

    Raises:
        ValueError: ``digest`` is not a 64-character hex string, or options that cannot be encoded.
        PlanMismatchError: names the pool ranks whose digest differs from this rank's, and every
            option whose value differs with the ranks holding each value (raised on every rank
            whose view disagrees, i.e. on all ranks when any two differ).
    """
    try:
        raw = bytes.fromhex(digest)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"plan digest must be a sha256 hex string, got {digest!r}")
    payload = raw + encode_options(options)
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device or _device(group))
    got = _all_gather(mine, group, "plan digest all_gather").cpu().numpy()
    hexes = [bytes(row[:32]).hex() for row in got]
    opts_msg = options_mismatch([decode_options(row[32:].tobytes()) for row in got], group)
    # the digest comparison (and its message naming the disagreeing ranks) lives with the other
    # plan checks; an options mismatch is added to it or raised on its own
    try:
        plan_checks.check_plan_agreement(digest, hexes)
    except PlanMismatchError as exc:
        raise PlanMismatchError(f"{exc}; {opts_msg}" if opts_msg else str(exc)) from None
    if opts_msg:
        raise PlanMismatchError(opts_msg)


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
