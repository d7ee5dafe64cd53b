"""Run a function on several local gloo ranks with a hard deadline (CPU tests, microbench).

``run_local_ranks(fn, world, *args)`` starts ``world`` processes with the ``spawn`` method,
initialises gloo through a ``file://`` store in a private temporary folder, pins each rank to
``threads`` threads, calls ``fn(rank, world, *args)`` and returns one record per rank:
``{"ok": value}`` or ``{"error": message, "traceback": text}``. The parent polls instead of
``join()``, because ``join`` kills the other ranks as soon as one exits non-zero and a caller that
tests a dead rank needs the survivors to report their own timeout errors; past ``deadline_s`` every
rank still alive is killed and :class:`RankDeadlineError` is raised, so a hang never blocks the
caller. ``fn`` and ``args`` must be picklable (a module-level function).
"""

from __future__ import annotations

import datetime as _dt
import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path


class RankDeadlineError(RuntimeError):
    """Local ranks were still running at the deadline (they have been killed)."""


def _entry(rank, fn, world, init_file, out_dir, pg_timeout_s, threads, args):
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=_dt.timedelta(seconds=pg_timeout_s))
        # every rank finishes connecting its gloo mesh before any runs fn: a rank that fails at
        # once and exits would otherwise close its sockets while a peer is still connecting, and
        # the peer would report a connect error instead of its own result
        dist.barrier()
        result = {"ok": fn(rank, world, *args)}
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which decides)
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    try:
        if "error" not in result:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (a peer may be gone already)
        pass
    # a failed rank exits without the shutdown barrier, so its peers cannot hang on it
    os._exit(0)


def run_local_ranks(fn, world: int, *args, deadline_s: float = 120.0, pg_timeout_s: float = 60.0,
                    threads: int = 1, what: str = "ranks") -> list[dict]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks.

    Args:
        fn: picklable callable; its return value must be picklable.
        world: number of ranks (>= 1).
        deadline_s: wall-clock limit for the whole run.
        pg_timeout_s: gloo collective timeout inside the ranks.
        threads: torch threads per rank.
        what: name used in error messages.

    Returns:
        ``world`` records, ``{"ok": value}`` or ``{"error": str, "traceback": str}``; a rank that
        died without writing one gets ``{"error": "died without a result", "traceback": ""}``.

    Raises:
        ValueError: ``world`` < 1 or a non-positive deadline/timeout.
        RankDeadlineError: ranks still running after ``deadline_s`` (all were killed).
    """
    import torch.multiprocessing as mp  # noqa: PLC0415

    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive integer, got {world!r}")
    if not (deadline_s > 0 and pg_timeout_s > 0):
        raise ValueError(f"deadline_s and pg_timeout_s must be > 0, got {deadline_s!r}, {pg_timeout_s!r}")
    with tempfile.TemporaryDirectory(prefix="libra-ranks-") as tmp:
        ctx = mp.start_processes(_entry, args=(fn, world, str(Path(tmp) / "store"), tmp, pg_timeout_s, threads, args),
                                 nprocs=world, join=False, start_method="spawn")
        end = time.monotonic() + deadline_s
        try:
            while any(p.is_alive() for p in ctx.processes):
                if time.monotonic() > end:
                    raise RankDeadlineError(f"{what} still running after {deadline_s:.0f} s: killed (hang?)")
                time.sleep(0.1)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        out = []
        for r in range(world):
            path = Path(tmp) / f"rank{r}.pkl"
            out.append(pickle.loads(path.read_bytes()) if path.exists()
                       else {"error": "died without a result", "traceback": ""})
        return out
