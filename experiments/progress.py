"""Progress bars for long sweeps (rich), silent when disabled or when stderr is not a terminal.

rich is imported lazily: on a machine without it (e.g. a GPU image where the project was installed
with ``--no-deps``) sweeps still run, just without a bar.
"""

from __future__ import annotations

import contextlib
import sys


class _Bar:
    def __init__(self, prog, task):
        self._prog, self._task = prog, task

    def advance(self, n: int = 1) -> None:
        if self._prog is not None:
            self._prog.advance(self._task, n)


@contextlib.contextmanager
def progress(total: int, desc: str, disable: bool = False):
    """Context manager yielding an object with ``advance()``; a rich bar on stderr."""
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        disable = True
    if disable:
        yield _Bar(None, None)
        return
    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=not sys.stderr.isatty(), disable=not sys.stderr.isatty())
    with prog:
        task = prog.add_task(desc, total=total)
        yield _Bar(prog, task)
