"""A run folder written as one unit, by one run at a time.

* :class:`FolderLock`: an exclusive ``flock`` on the folder, taken when a run claims it and held
  until the run has written it. A second run into the same folder (another
  config, another experiment, or the same one) is refused at its start, instead of both computing
  and the later one silently replacing the other's results.
* :func:`new_stage` / :func:`commit`: a run's files are first written into a hidden stage beside
  the folder; the folder's other entries (the point cache, nested run folders, files that are not
  the run's) are carried into the stage, and the two folders are exchanged with one
  ``renameat2(RENAME_EXCHANGE)`` (``renamex_np(RENAME_SWAP)`` on macOS). A kill at any instant
  leaves either the previous complete folder or the new complete one. Where the system or the file
  system cannot exchange folders (NFS, some overlay mounts), where the folder is the current
  directory, or where its parent is read-only, the files are moved in one by one: ``run.json``
  removed first and written last, so an interrupted write leaves a folder without a run record
  (never one whose record describes other files).
* :func:`recover`: a stage left by a killed run is removed (entries it had carried over are moved
  back first) by the next run that claims the folder.

A stage is removed when its run ends; one a SIGKILL left beside the folder is removed by the next
run of that folder (the folder itself never holds a temporary file).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import stat
import sys
import uuid
import weakref
from collections.abc import Iterable
from pathlib import Path

import click

RECORD_NAME = "run.json"
_STAGE_TAG = ".unit-"


class FolderBusy(click.ClickException):
    """Another live run holds the folder's lock (one ``Error:`` line, exit 1)."""


class FolderLock:
    """The exclusive lock of one run folder: a ``flock`` on the folder itself (no lock file to
    leave behind), released by :meth:`release`, when the object is collected or when the process
    exits (the kernel drops a killed process's lock). Where the file system cannot lock a folder
    (some NFS mounts), no lock is held.

    Raises:
        FolderBusy: (at construction) another run holds the lock.
        click.ClickException: the folder cannot be opened.
    """

    def __init__(self, folder: Path):
        while True:  # an exchange may replace the folder between our open and our flock
            try:
                fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            except OSError as exc:
                raise click.ClickException(f"cannot lock {folder}: {exc.strerror or exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise FolderBusy(f"{folder} is being written by another run; wait for it to end or pass "
                                 "--out DIR to write elsewhere") from None
            except OSError:  # a file system without flock on folders (some NFS mounts): no lock to hold
                os.close(fd)
                self._release = weakref.finalize(self, lambda: None)
                return
            if _same_file(fd, Path(folder)):
                break
            os.close(fd)
        self._release = weakref.finalize(self, _unlock, fd, os.getpid())

    def release(self) -> None:
        self._release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (here.st_dev, here.st_ino)


def _unlock(fd: int, owner: int) -> None:
    """Close the folder's descriptor, in the process that took the lock only (a forked ``--jobs``
    worker holds a copy that must not end the parent's lock early)."""
    if os.getpid() == owner:
        os.close(fd)


# -- stages ---------------------------------------------------------------------------------


def _stage_prefix(folder: Path) -> str:
    return f".{folder.name}{_STAGE_TAG}"


def _exchange_allowed(folder: Path) -> bool:
    """Whether the folder may be replaced by an exchange: not the current directory or one of its
    ancestors (the shell would be left in the removed old folder) and a writable parent."""
    try:
        here, target = Path.cwd().resolve(), folder.resolve()
    except OSError:
        return False
    return target != here and target not in here.parents and os.access(target.parent, os.W_OK)


def new_stage(folder: Path) -> Path:
    """An empty hidden folder for the run's new files: beside ``folder`` when the folder can be
    exchanged with it, else inside it."""
    folder = Path(folder).absolute()
    name = f"{_stage_prefix(folder)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    stage = folder.parent / name if _exchange_allowed(folder) else folder / name
    stage.mkdir()
    return stage


def discard(stage: Path) -> None:
    shutil.rmtree(stage, ignore_errors=True)


def abandon(folder: Path, stage: Path) -> None:
    """Remove a stage that will not be committed, after moving back into ``folder`` every folder
    it had carried away (a point cache, a nested run) that ``folder`` lacks."""
    with contextlib.suppress(OSError):
        for entry in stage.iterdir():
            if entry.is_dir() and not entry.is_symlink() and not (folder / entry.name).exists():
                os.rename(entry, folder / entry.name)
    discard(stage)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_file(stage: Path, name: str, data: bytes) -> Path:
    """Write one file of the unit into the stage (flushed to disk before the commit)."""
    path = stage / name
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return path


def _swap(a: Path, b: Path) -> bool:
    """Exchange two folders in one system call; False where the system or file system cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    src, dst = os.fsencode(a), os.fsencode(b)
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2
        rc = libc.renameat2(at_fdcwd, src, at_fdcwd, dst, rename_exchange)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rc = libc.renamex_np(src, dst, 0x2)  # RENAME_SWAP
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _carry(folder: Path, stage: Path, drop: set[str]) -> list[str] | None:
    """Give the stage every entry of ``folder`` it does not replace: regular files as hard links
    (the folder keeps them until the exchange), folders moved (the names returned). None when a
    file cannot be linked or a folder moved (the caller then replaces files one by one)."""
    moved: list[str] = []
    try:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.name in drop or entry.name.startswith(_stage_prefix(folder)) or (stage / entry.name).exists():
                continue
            if entry.is_dir(follow_symlinks=False):
                os.rename(entry.path, stage / entry.name)
                moved.append(entry.name)
            else:
                os.link(entry.path, stage / entry.name, follow_symlinks=False)
    except OSError:
        for name in moved:
            os.rename(stage / name, folder / name)
        return None
    return moved


def commit(folder: Path, stage: Path, drop: Iterable[str] = ()) -> None:
    """Make ``folder`` hold the stage's files plus its own other entries, minus ``drop`` (the
    previous run's outputs this run does not write), as one unit (see the module docstring).
    The stage is gone afterwards."""
    folder, stage, drop = Path(folder).absolute(), Path(stage).absolute(), set(drop)
    os.chmod(stage, stat.S_IMODE(os.stat(folder).st_mode))
    if stage.parent == folder.parent:
        moved = _carry(folder, stage, drop)
        if moved is not None:
            _fsync_dir(stage)
            if _swap(stage, folder):
                _fsync_dir(folder.parent)
                discard(stage)  # now the previous folder
                return
            for name in moved:
                os.rename(stage / name, folder / name)
    _replace_files(folder, stage, drop)


def _replace_files(folder: Path, stage: Path, drop: set[str]) -> None:
    """The fallback: the record removed first, the files moved in, the record moved in last (a
    staged file that is a link to the folder's own is moved back onto itself: a no-op)."""
    names = sorted((p.name for p in stage.iterdir() if not p.is_dir()), key=lambda n: (n == RECORD_NAME, n))
    record = folder / RECORD_NAME
    if RECORD_NAME in names and record.exists() and not os.path.samefile(stage / RECORD_NAME, record):
        os.unlink(record)
    for name in drop:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(folder / name)
    for name in names:
        os.replace(stage / name, folder / name)
    _fsync_dir(folder)
    discard(stage)


def recover(folder: Path) -> None:
    """:func:`abandon` the stages a killed run left beside or inside ``folder`` (the caller holds
    the folder's lock, so none of them is live)."""
    folder = Path(folder).absolute()
    prefix = _stage_prefix(folder)
    for place in (folder.parent, folder):
        with contextlib.suppress(OSError):
            for stage in [p for p in place.iterdir() if p.name.startswith(prefix) and p.is_dir()]:
                abandon(folder, stage)
