"""Run a function on several local gloo ranks with a hard deadline (CPU tests, microbench, training).

``run_local_ranks(fn, world, *args)`` starts ``world`` processes with the ``spawn`` method,
initialises gloo through a ``file://`` store in a private temporary folder, pins each rank to
``threads`` threads, calls ``fn(rank, world, *args)`` and returns one record per rank:
``{"ok": value}`` or ``{"error": message, "traceback": text, "at": wall time}``. The parent polls
instead of ``join()``, because ``join`` kills the other ranks as soon as one exits non-zero and a
caller that tests a dead rank needs the survivors to report their own timeout errors; so once a
rank has failed -- exited without a result (killed, crashed, ``os._exit``) or returned an error --
the survivors get ``grace_s`` to finish on their own and are then killed: a rank that dies before or
during the rendezvous ends the run within seconds, not at the gloo timeout. Past ``deadline_s``
every rank still alive is killed and :class:`RankDeadlineError` is raised, so a hang never blocks
the caller. ``fn`` and ``args`` must be picklable (a module-level function).

:func:`first_failure` names the rank that caused a failed run (a rank that died outright before
the ones whose collectives then failed), :class:`RankMessages` carries objects from the ranks to
the parent while they run (finished steps or points, for progress and for keeping them when the run
is interrupted), and ``poll`` is called in the parent's wait loop to read them.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import itertools
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FAILURE_GRACE_S = 10.0
"""Seconds the surviving ranks get, after one rank failed, to report their own errors."""
POLL_S = 0.1


class RankDeadlineError(RuntimeError):
    """Local ranks were still running at the deadline (they have been killed)."""


class RankFailure(RuntimeError):
    """A rank of a local run failed; ``rank`` is the one that caused it, ``traceback`` its traceback
    (empty for a rank that died without a word)."""

    def __init__(self, message: str, rank: int, traceback_text: str = ""):
        super().__init__(message)
        self.rank, self.traceback = rank, traceback_text


class RankMessages:
    """Objects sent by running ranks to the parent: one pickle per message in a private folder.

    ``send(obj)`` (in a rank) writes atomically; ``receive()`` (in the parent) returns the messages
    not yet read, in the order each sender sent them, and deletes their files. Picklable, so it
    travels to the ranks as an argument of ``fn``.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._count = itertools.count()

    def __getstate__(self) -> dict:
        return {"folder": self.folder}

    def __setstate__(self, state: dict) -> None:
        self.folder, self._count = state["folder"], itertools.count()

    def send(self, obj, rank: int = 0) -> None:
        name = f"{next(self._count):012d}-{rank:05d}.pkl"
        tmp = self.folder / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(pickle.dumps(obj))
        os.replace(tmp, self.folder / name)

    def receive(self) -> list:
        out = []
        for path in sorted(self.folder.glob("*.pkl")):
            out.append(pickle.loads(path.read_bytes()))
            path.unlink()
        return out


@contextlib.contextmanager
def relayed_messages(on_message: Callable[[object], None] | None):
    """``(messages, poll)``: a :class:`RankMessages` in a private temporary folder, to pass to the
    ranks, and the ``poll`` for :func:`run_local_ranks` that hands each message to ``on_message``
    in this process as it arrives (call it once more after the run: the last messages)."""
    with tempfile.TemporaryDirectory(prefix="libra-messages-") as folder:
        messages = RankMessages(folder)

        def poll() -> None:
            for message in messages.receive():
                if on_message is not None:
                    on_message(message)

        yield messages, poll


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
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(), "at": time.time()}
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    try:
        if "error" not in result:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (a peer may be gone already)
        pass
    # a failed rank exits without the shutdown barrier, so its peers cannot hang on it
    os._exit(0)


def _failed(path: Path, exitcode: int) -> bool:
    """Whether a rank process that exited failed: a non-zero code, or no result, or an error result."""
    if exitcode != 0 or not path.exists():
        return True
    try:
        return "error" in pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError):
        return True


def _wait(ctx, tmp: str, cfg: LaunchConfig, poll) -> dict[int, str]:
    """Poll the ranks until all have exited; once one has failed, kill the rest after ``cfg.grace_s``.
    Returns ``{rank: why}`` of the ranks killed here."""
    deadline_s, grace_s = cfg.deadline_s, cfg.grace_s
    end = time.monotonic() + deadline_s
    failed_at, seen, killed = None, set(), {}
    while any(p.is_alive() for p in ctx.processes):
        if poll is not None:
            poll()
        now = time.monotonic()
        if now > end:
            raise RankDeadlineError(f"{cfg.what} still running after {deadline_s:.0f} s: killed (hang?)")
        for r, p in enumerate(ctx.processes):
            if r not in seen and p.exitcode is not None:
                seen.add(r)
                if failed_at is None and _failed(Path(tmp) / f"rank{r}.pkl", p.exitcode):
                    failed_at = now
        if failed_at is not None and now - failed_at > grace_s:
            for r, p in enumerate(ctx.processes):
                if p.is_alive():
                    p.kill()
                    killed[r] = f"killed {grace_s:g} s after another rank failed"
            break
        time.sleep(POLL_S)
    return killed


@dataclass(frozen=True)
class LaunchConfig:
    """Limits of one :func:`run_local_ranks` run.

    Attributes:
        deadline_s: wall-clock limit for the whole run.
        pg_timeout_s: gloo collective timeout inside the ranks.
        threads: torch threads per rank.
        what: name used in error messages.
        grace_s: once a rank has failed, how long the others may still run (then they are killed).

    Raises:
        ValueError: a non-positive deadline/timeout or a negative grace.
    """

    deadline_s: float = 120.0
    pg_timeout_s: float = 60.0
    threads: int = 1
    what: str = "ranks"
    grace_s: float = FAILURE_GRACE_S

    def __post_init__(self):
        if not (self.deadline_s > 0 and self.pg_timeout_s > 0 and self.grace_s >= 0):
            raise ValueError(f"deadline_s and pg_timeout_s must be > 0 (grace_s >= 0), got {self.deadline_s!r}, "
                             f"{self.pg_timeout_s!r}, {self.grace_s!r}")


def run_local_ranks(fn, world: int, *args, config: LaunchConfig | None = None,
                    poll: Callable[[], None] | None = None, **options) -> list[dict]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks.

    Args:
        fn: picklable callable; its return value must be picklable.
        world: number of ranks (>= 1).
        config: the run's limits as one :class:`LaunchConfig`; or pass its fields as keywords
            (``deadline_s=``, ``pg_timeout_s=``, ``threads=``, ``what=``, ``grace_s=``), not both.
        poll: called about every 0.1 s while the ranks run (e.g. to read :class:`RankMessages`).

    Returns:
        ``world`` records, ``{"ok": value}`` or ``{"error": str, "traceback": str, "at": time}``; a
        rank that died without writing one gets ``{"error": "exited (code X)", "exitcode": X}``, one
        killed after another failed ``{"error": "killed ...", "killed": True}``.

    Raises:
        ValueError: ``world`` < 1 or a bad :class:`LaunchConfig` value.
        TypeError: ``config`` together with option keywords, or an unknown keyword.
        RankDeadlineError: ranks still running after ``deadline_s`` (all were killed).
    """
    import torch.multiprocessing as mp  # noqa: PLC0415

    if config is not None and options:
        raise TypeError(f"run_local_ranks() takes config= or option keywords, not both (got {sorted(options)})")
    cfg = LaunchConfig(**options) if config is None else config
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive integer, got {world!r}")
    with tempfile.TemporaryDirectory(prefix="libra-ranks-") as tmp:
        entry_args = (fn, world, str(Path(tmp) / "store"), tmp, cfg.pg_timeout_s, cfg.threads, args)
        ctx = mp.start_processes(_entry, args=entry_args, nprocs=world, join=False, start_method="spawn")
        try:
            killed = _wait(ctx, tmp, cfg, poll)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
        out = []
        for r, p in enumerate(ctx.processes):
            path = Path(tmp) / f"rank{r}.pkl"
            if path.exists():
                out.append(pickle.loads(path.read_bytes()))
            elif r in killed:
                out.append({"error": killed[r], "traceback": "", "killed": True})
            else:
                out.append({"error": f"exited (code {p.exitcode})", "traceback": "", "exitcode": p.exitcode})
        return out


def first_failure(records: list[dict]) -> tuple[int, dict] | None:
    """``(rank, record)`` of the rank that caused a failed run, None when every rank succeeded.

    A rank that died without a result comes first (its peers' errors -- a closed connection, a
    timeout -- are the consequence), then the earliest error a rank reported; ranks killed after
    another failed never are the cause."""
    died = [(r, rec) for r, rec in enumerate(records) if "exitcode" in rec]
    if died:
        return died[0]
    errors = [(r, rec) for r, rec in enumerate(records) if "error" in rec and not rec.get("killed")]
    return min(errors, key=lambda x: (x[1].get("at", float("inf")), x[0])) if errors else None


def raise_first_failure(records: list[dict], what: str = "") -> list:
    """Every rank's value, or :class:`RankFailure` naming the rank that caused the failure:
    ``<what>: rank 1 exited (code -9)`` or ``<what>: rank 1 failed: ValueError: ...``."""
    found = first_failure(records)
    if found is None:
        return [rec["ok"] for rec in records]
    rank, rec = found
    how = f"exited (code {rec['exitcode']})" if "exitcode" in rec else f"failed: {rec['error']}"
    raise RankFailure(f"{what + ': ' if what else ''}rank {rank} {how}", rank, rec.get("traceback", ""))
