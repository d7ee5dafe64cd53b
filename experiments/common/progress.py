"""Progress of long sweeps and measured runs: a rich bar on a terminal, one-line records in logs.

* stderr is a terminal: a rich progress bar (rich is imported lazily: on a machine without it,
  e.g. a GPU image where the project was installed with ``--no-deps``, the log records below are
  used instead);
* stderr is not a terminal (a Slurm log, a pipe, CI): a plain line such as
  ``grid-search: 12/96 points (12%), 40 s elapsed, ~280 s left`` at most every ``every_s``
  seconds, a closing ``done`` line when any record was written, and -- while nothing finishes,
  e.g. a measured run's ranks starting or one long point -- a line at least every
  :data:`HEARTBEAT_S` seconds, so a log shows the work is alive without filling up with bar
  redraws. Runs shorter than ``every_s`` print nothing.
* ``disable=True`` (``--no-progress``): nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable

LOG_EVERY_S = 5.0
"""Seconds between two progress records in a log (non-terminal stderr)."""
HEARTBEAT_S = 9.0
"""Most (wall-clock) seconds a log goes without a progress line while the work runs."""


class _Bar:
    def __init__(self, prog, task):
        self._prog, self._task = prog, task

    def advance(self, n: int = 1) -> None:
        if self._prog is not None:
            self._prog.advance(self._task, n)


class _LogRecords:
    """``advance()`` writes ``desc: done/total unit (pct), elapsed, ~left`` at most every ``every_s``;
    a heartbeat thread writes the same line when :data:`HEARTBEAT_S` wall seconds passed without one."""

    def __init__(self, total: int, desc: str, every_s: float, stream, clock: Callable[[], float], unit: str):
        self.total, self.desc, self.every_s, self.stream, self.clock = total, desc, every_s, stream, clock
        self.unit = unit
        self.done = 0
        self.start = self.last = clock()
        self.written = 0
        self._lock = threading.Lock()
        self._wall = time.monotonic()  # the heartbeat's own clock: tests drive `clock` by hand
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"progress {desc}", daemon=True)
        self._thread.start()

    def _write(self, text: str) -> None:
        with self._lock:
            print(text, file=self.stream, flush=True)
            self.written += 1
            self._wall = time.monotonic()

    def _line(self, now: float) -> str:
        elapsed = now - self.start
        if not self.done:
            return f"{self.desc}: 0/{self.total} {self.unit}, {elapsed:.0f} s elapsed (the first is running)"
        left = elapsed / self.done * (self.total - self.done)
        pct = 100 * self.done // max(self.total, 1)
        return (f"{self.desc}: {self.done}/{self.total} {self.unit} ({pct}%), {elapsed:.0f} s elapsed, "
                f"~{left:.0f} s left")

    def _beat(self) -> None:
        while not self._stop.wait(1.0):
            if time.monotonic() - self._wall >= HEARTBEAT_S and self.done < self.total:
                self.last = self.clock()
                self._write(self._line(self.last))

    def advance(self, n: int = 1) -> None:
        if n <= 0:  # nothing finished (e.g. no cached point to count): no record
            return
        self.done += n
        now = self.clock()
        if now - self.last < self.every_s or self.done >= self.total:
            return
        self.last = now
        self._write(self._line(now))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def close(self) -> None:
        self.stop()
        if self.written:
            self._write(f"{self.desc}: done, {self.done}/{self.total} {self.unit} in {self.clock() - self.start:.0f} s")


@contextlib.contextmanager
def progress(total: int, desc: str, disable: bool = False, every_s: float | None = None, stream=None,
             clock: Callable[[], float] = time.monotonic, unit: str = "points"):
    """Context manager yielding an object with ``advance()``: a rich bar on a terminal, log records
    (every ``every_s`` seconds, default :data:`LOG_EVERY_S`, and a heartbeat, to ``stream``, default
    stderr) otherwise, nothing when ``disable``. ``unit`` names what is counted (``points``, ``steps``)."""
    stream = sys.stderr if stream is None else stream
    every_s = LOG_EVERY_S if every_s is None else every_s
    if disable:
        yield _Bar(None, None)
        return
    rich_progress = None
    if getattr(stream, "isatty", lambda: False)():
        try:
            from rich import console as rich_console  # noqa: PLC0415
            from rich import progress as rich_progress  # noqa: PLC0415
        except ImportError:
            rich_progress = None
    if rich_progress is None:
        records = _LogRecords(total, desc, every_s, stream, clock, unit)
        try:
            yield records
        except BaseException:
            records.stop()  # an interrupted run is not "done"
            raise
        records.close()
        return
    prog = rich_progress.Progress(rich_progress.TextColumn("[bold]{task.description}"), rich_progress.BarColumn(),
                                  rich_progress.MofNCompleteColumn(), rich_progress.TimeElapsedColumn(),
                                  console=rich_console.Console(file=stream))
    with prog:
        task = prog.add_task(desc, total=total)
        yield _Bar(prog, task)
