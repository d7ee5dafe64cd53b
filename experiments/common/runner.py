"""The one experiment runner every `libra-bench` command uses: where a run's results live and how.

Contract:
* outputs go to ``--out DIR`` or, by default, to
  ``runs/<name>/<workload-stem>-<layout-tag>-<profile>/`` (:func:`default_out_dir`; ``runs/`` is
  git-ignored: only the make targets write the committed ``results/``, with ``--out``);
  ``<name>.csv`` (long format), ``<name>.png`` (seaborn) and ``run.json`` (resolved config, content
  hashes of the input files, seed, git SHA, package versions, host, hardware profile when one is
  used, command line, wall time, the files the run wrote);
* a run claims its folder before it computes anything: it takes the folder's lock, so a second run
  into the same folder while the first is running is refused (:mod:`experiments.common.run_folder`), and
  a folder that already holds the ``run.json`` of a different config (or experiment) is not written
  to unless ``overwrite`` (``--overwrite``): the error names the differing keys
  (:class:`RunFolderConflict`); a rerun of the same config (on edited input data too) is not a
  conflict;
* the folder is written as one unit (:meth:`ExperimentRun.finish`): a killed run leaves the
  previous complete folder or the new complete one. A rerun whose numbers are the folder's (same
  experiment, config and inputs; equal up to float rounding, :mod:`experiments.common.same_numbers`)
  keeps the folder's files and ``run.json``, which records the run that produced them: a new git
  SHA, host, CPU or wall time alone never rewrites a folder;
* each finished point of a sweep is stored under ``.points/<key>/`` as soon as it is computed, so
  an interrupted sweep resumes where it stopped and a rerun of the same config reuses finished
  points unless ``force=True`` (``--force``) is given. The key hashes the resolved config, the
  *contents* of its input files (:func:`input_fingerprints`: a length file edited or shuffled in
  place is a new input) *and* a fingerprint of the project's source (:func:`code_fingerprint`), so
  neither a different config, nor different data, nor a code change can mix stale points into a
  new run. A point file stores a hash of its rows; one that is unreadable, of the wrong shape or
  fails that check is recomputed with a warning. Ctrl-C during a sweep says how many points are
  cached and exits 130.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as _dt
import hashlib
import json
import multiprocessing
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import click
import pandas as pd

from experiments.common import run_folder
from experiments.common.options import CONFIG_META, JOBS_META, OVERWRITE_META, QUIET_META, size_text
from experiments.common.progress import progress
from experiments.common.same_numbers import same_csv_numbers

RESULTS_ROOT = Path("results")
"""The committed results: written by the make targets (``--out results/...``), never by default."""
RUNS_ROOT = Path("runs")
"""Default home of every run (``.gitignore`` lists it)."""

_PACKAGES = ("libra-bench", "torch", "numpy", "pandas", "seaborn", "matplotlib", "click", "flash-attn")


def _new_temp(folder: Path, stem: str, suffix: str) -> tuple[int, Path]:
    """Create a unique temporary file in ``folder`` (mode ``0666 & ~umask``, like any new file;
    ``mkstemp`` would make it 0600) and return ``(fd, path)``."""
    while True:
        tmp = folder / f".{stem}.{os.getpid()}.{uuid.uuid4().hex[:12]}{suffix}"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temp(path.parent, path.name, ".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def stable_hash(obj) -> str:
    """Short sha256 of a JSON-serialisable object (sorted keys); used for configs and point keys."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


_SOURCE_PACKAGES = ("libra", "baselines", "experiments")


def code_fingerprint() -> str:
    """Short sha256 over every ``.py``/``.json`` file of the project's packages (content + path).

    Part of the point-cache key: points computed by other code are never reused. Reading ~150
    small files costs a few milliseconds.
    """
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for pkg in _SOURCE_PACKAGES:
        for path in sorted((root / pkg).rglob("*")):
            if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        sha = out.stdout.strip()
        if not sha:
            return None
        # results/ is excluded: regenerating committed outputs must not mark the code as dirty
        # from the repository root: run from experiments/, "." would cover that folder only and a
        # change to libra/ or baselines/ would not mark the code dirty
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                ":(top,exclude)results"], capture_output=True,
                               text=True, timeout=5, cwd=Path(__file__).resolve().parent).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Package versions, interpreter, host and git SHA for the run record."""
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"git_sha": git_sha(), "python": sys.version.split()[0], "platform": platform.platform(),
            "host": socket.gethostname(), "cpu_count": os.cpu_count(), "packages": versions}


# -- run identity: input contents, default folder, conflicts -------------------------------


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _workload_spec(workload):
    """What ``resolve_workload`` takes for a config's ``workload`` entry: a preset name or path
    (str/Path), a :class:`~libra.data.source.LengthSource`, or a ``describe()`` dict of a file
    source (``{"kind": "file", "path": ..., "column": ...}``); None for anything else."""
    if isinstance(workload, Mapping):
        if workload.get("kind") == "file" and workload.get("path"):
            column = workload.get("column")
            return f"{workload['path']}#{column}" if column else str(workload["path"])
        return None
    if isinstance(workload, (str, Path)):
        return workload
    from libra.data.source import LengthSource  # noqa: PLC0415

    return workload if isinstance(workload, LengthSource) else None


def input_fingerprints(workload=None, files: Mapping[str, str | Path] | None = None) -> dict:
    """Content hashes of a run's input files, part of its point-cache key and ``run.json``.

    * ``workload`` (a length file; presets have no file): sha256 of the *loaded* lengths (int64,
      file order), so a file shuffled or edited in place is a new input while re-encoding the same
      lengths (``.txt`` -> ``.npy``) is not;
    * ``files`` (e.g. ``{"profile": "my-cluster.json"}``): sha256 of each existing file's bytes
      (names of built-ins, which are not files, are skipped).

    Raises:
        click.BadParameter: an unreadable length file (``--workload``), so every command that
            builds a run fails with one ``Error:`` line before any work starts.
    """
    import numpy as np  # noqa: PLC0415

    from libra.data.source import FileSource, resolve_workload  # noqa: PLC0415

    out: dict = {}
    spec = _workload_spec(workload)
    if spec is not None:
        try:
            source = resolve_workload(spec)
            if isinstance(source, FileSource):
                lengths = np.ascontiguousarray(source.lengths, dtype="<i8")
                out["workload"] = {"path": str(source.path), "column": source.column,
                                   "samples": int(lengths.size), "lengths_sha256": _sha256(lengths.tobytes())}
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--workload") from exc
    for key, path in sorted((files or {}).items()):
        if path is not None and Path(path).is_file():
            out[key] = {"path": str(path), "sha256": _sha256(Path(path).read_bytes())}
    return out


LAYOUT_TAG_FIELDS = (("dp", "dp"), ("cp", "cp"), ("seq_len", "s"), ("gbs", "gbs"), ("pool_size", "p"),
                     ("block_size", "b"), ("head_split", "h"), ("pipeline_chunks", "m"), ("pp", "pp"))
"""Layout fields of a run folder's ``<layout-tag>``, in order, with their tag prefixes."""


def flat_layout(record: Mapping) -> dict:
    """A layout record (a setting's ``asdict``, a ``par`` dict, a TrainConfig dict...) reduced to
    its ``name`` and the :data:`LAYOUT_TAG_FIELDS` it carries (a nested ``tap`` is flattened)."""
    merged = {**dict(record.get("tap") or {}), **{k: v for k, v in record.items() if k != "tap"}}
    out = {k: merged[k] for k, _ in LAYOUT_TAG_FIELDS if isinstance(merged.get(k), int)}
    if isinstance(record.get("name"), str):
        out["name"] = record["name"]
    return out


def layout_tag(layout: Mapping) -> str:
    """``dp{DP}-cp{CP}-s{S}-gbs{GBS}-p{P}-b{B}-h{H}-m{M}`` of the fields ``layout`` carries
    (sizes as ``256k``/``1m``), e.g. ``dp8-cp4-s128k-gbs32-p4-b4k-h2-m4``."""
    flat = flat_layout(layout)
    parts = [f"{prefix}{size_text(flat[k]) if k in ('seq_len', 'block_size') else flat[k]}"
             for k, prefix in LAYOUT_TAG_FIELDS if k in flat]
    return "-".join(parts) or "custom"


def layouts_of(config: Mapping) -> list[dict]:
    """The layouts a config names: its ``settings`` (list or name -> record), ``setting`` or ``par``."""
    found = config.get("settings", config.get("setting", config.get("par")))
    if isinstance(found, Mapping):
        found = list(found.values()) if all(isinstance(v, Mapping) for v in found.values()) else [found]
    return [flat_layout(r) for r in (found or []) if isinstance(r, Mapping)]


def _folder_safe(text: str, fallback: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text) or fallback


def workload_stem(workload) -> str:
    """Folder-safe short name of a workload: the preset name or the file name without its suffix."""
    from libra.data.loaders import file_kind  # noqa: PLC0415

    if isinstance(workload, Mapping):
        text = str(workload.get("path") or workload.get("name") or "workload")
    elif isinstance(workload, (str, Path)):
        text = str(workload)
    else:
        text = str(getattr(workload, "path", None) or getattr(workload, "name", "workload"))
    name = Path(text.split("#", 1)[0]).name
    kind = file_kind(name)
    return _folder_safe(name[: -len(kind)] if kind else name, "workload")


def profile_stem(profile) -> str | None:
    """Folder-safe name of a config's hardware profile (its record's ``name``, a built-in's name or a
    profile file's name without ``.json``); None for a run without one."""
    if isinstance(profile, Mapping):
        profile = profile.get("name")
    if not isinstance(profile, (str, Path)) or not str(profile):
        return None
    name = Path(str(profile)).name
    return _folder_safe(name[: -len(".json")] if name.endswith(".json") else name, "profile")


def default_out_dir(name: str, workload, layouts: Sequence[Mapping] = (), profile=None) -> Path:
    """``runs/<name>/<workload-stem>-<layout-tag>[-<profile>]``: one layout gets its full
    :func:`layout_tag`; several (e.g. ``--settings 256k,1m``) their names joined with ``+`` (each's
    tag when it has no name); a run priced with a hardware profile ends with its name, so runs that
    differ only in ``--profile`` get their own folders."""
    layouts = [flat_layout(x) for x in layouts]
    folder = name.replace("_", "-")  # the command's name (`pool-sweep` writes pool_sweep.csv)
    if len(layouts) == 1:
        tag = layout_tag(layouts[0])
    else:
        tag = "+".join(x.get("name") or layout_tag(x) for x in layouts) or "custom"
    prof = profile_stem(profile)
    return RUNS_ROOT / folder / "-".join(filter(None, (workload_stem(workload), tag, prof)))


def differing_keys(old, new, prefix: str = "", depth: int = 3) -> list[str]:
    """Dotted paths where two JSON values differ (dicts descended ``depth`` levels)."""
    if old == new:
        return []
    if depth and isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            out += differing_keys(old.get(k), new.get(k), f"{prefix}{k}.", depth - 1)
        return out
    return [prefix.rstrip(".") or "(all)"]


class RunFolderConflict(click.ClickException):
    """The output folder holds the run record of a different run (one ``Error:`` line, exit 1)."""


def _identity(record: Mapping) -> dict:
    """What must match for a run to write into a folder: the experiment and its resolved config.

    Input *contents* are not part of it: a length file edited in place is the same run on new data,
    whose results supersede the folder's (its points are new: the contents key the cache)."""
    return {"experiment": record.get("experiment"), **dict(record.get("config") or {})}


def make_out_dir(out_dir: Path) -> None:
    """Create the output folder (and its parents) now, so a folder that cannot be made fails as one
    ``Error:`` line before a command computes or spawns anything, not as a traceback at its first write.

    Raises:
        click.ClickException: the folder cannot be created (a read-only or virtual file system, a
            parent that is a file, ...).
    """
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.ClickException(f"cannot create output folder {out_dir}: {exc.strerror or exc}") from None
    try:  # an existing read-only folder: found now, not at the first write after the work
        fd, probe = _new_temp(Path(out_dir), "write-check", ".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise click.ClickException(f"cannot write to output folder {out_dir}: {exc.strerror or exc}") from None


def check_run_folder(out_dir: Path, name: str, config: dict) -> None:
    """Refuse a folder whose ``run.json`` records a different run (see :class:`RunFolderConflict`).

    Raises:
        RunFolderConflict: naming the differing keys (an unreadable ``run.json`` too).
    """
    path = Path(out_dir) / "run.json"
    if not path.exists():
        return
    hint = "pass --overwrite to replace it, or --out DIR to write elsewhere"
    try:
        old = json.loads(path.read_text())
        if not isinstance(old, dict) or not isinstance(old.get("config"), dict):
            raise ValueError("no config object")
    except (OSError, ValueError) as exc:
        raise RunFolderConflict(f"{out_dir} holds a run.json that is not a run record ({exc}); {hint}") from None
    diff = differing_keys(_identity(old), _identity({"experiment": name, "config": config}))
    if diff:
        shown = ", ".join(diff[:8]) + (f" and {len(diff) - 8} more" if len(diff) > 8 else "")
        raise RunFolderConflict(f"{out_dir} holds a different run ({shown} differ); {hint}")


def overwrite_flag(overwrite: bool | None = None) -> bool:
    """``overwrite``, or the running click command's ``--overwrite`` flag when it is None."""
    if overwrite is not None:
        return bool(overwrite)
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get(OVERWRITE_META))


def _jobs(jobs: int | None) -> int:
    """``jobs``, or the running click command's ``--jobs`` when it is None (1 outside a command)."""
    if jobs is not None:
        return int(jobs)
    ctx = click.get_current_context(silent=True)
    return int(ctx.meta.get(JOBS_META, 1)) if ctx is not None else 1


_POINT_FN: Callable | None = None
"""In a ``--jobs`` worker process only: the sweep's point function, installed once by
:func:`_install_point_fn` (forked, so closures need no pickling); the parent never sets it."""


def _install_point_fn(fn: Callable) -> None:
    global _POINT_FN  # noqa: PLW0603 - per worker process, see _POINT_FN
    _POINT_FN = fn


def _call_point(key):
    return _timed(_POINT_FN, key)


def _timed(fn: Callable, key) -> tuple[list[dict], float]:
    """``(fn(key), seconds it took)``, timed in the process that computes the point."""
    t0 = time.perf_counter()
    rows = fn(key)
    return rows, time.perf_counter() - t0


def _point_text(key, rows) -> str:
    """The canonical JSON of a point (sorted keys; what its stored hash covers)."""
    return json.dumps({"key": key, "rows": rows}, sort_keys=True, default=str)


def _point_problem(payload, key) -> str | None:
    """Why a loaded point file cannot be trusted for ``key`` (None: it can)."""
    if not isinstance(payload, dict) or not {"key", "rows", "sha256"} <= set(payload):
        return "not a point record (key, rows, sha256)"
    if payload["key"] != json.loads(json.dumps(key, default=str)):
        return "holds another point's key"
    rows = payload["rows"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return "its rows are not a list of records"
    if payload["sha256"] != _sha256(_point_text(payload["key"], rows).encode()):
        return "its rows do not match their stored hash"
    return None


def _read_record(folder: Path) -> dict | None:
    """The folder's run record, or None when it has none or an unreadable one."""
    try:
        record = json.loads((Path(folder) / run_folder.RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@dataclass(frozen=True)
class RunOptions:
    """How an :class:`ExperimentRun` treats its folder and computes its points.

    Attributes:
        out_dir: output folder (default :func:`default_out_dir`:
            ``runs/<name>/<workload-stem>-<layout-tag>-<profile>``).
        force: drop cached points of this config and recompute everything.
        quiet: no progress.
        overwrite: write into a folder holding a different run's ``run.json``; None = the running
            command's ``--overwrite`` flag (:data:`experiments.common.options.OVERWRITE_META`).
        jobs: processes computing the points (:meth:`ExperimentRun.map`); None = the running
            command's ``--jobs`` (:data:`experiments.common.options.JOBS_META`), 1 outside a command.

    Raises:
        ValueError: ``jobs`` not a positive integer.
    """

    out_dir: str | Path | None = None
    force: bool = False
    quiet: bool = False
    overwrite: bool | None = None
    jobs: int | None = None

    def __post_init__(self):
        j = self.jobs
        if j is not None and (isinstance(j, bool) or not isinstance(j, int) or j < 1):
            raise ValueError(f"jobs must be a positive integer, got {j!r}")


class ExperimentRun:
    """One run of one experiment: resumable points, a run folder written as one unit, a run record.

    Args:
        name: experiment name; file stem of the CSV/PNG and of the default folder.
        config: the resolved configuration (JSON-serialisable); with the input contents its hash
            keys the point cache.
        options: the folder and point options as one :class:`RunOptions`; or pass its fields as
            keywords (``out_dir=``, ``force=``, ``quiet=``, ``overwrite=``, ``jobs=``), not both.
        workload: the run's workload (name, path or source; default ``config["workload"]``): its
            lengths' content hash joins the key, and it names the default folder.
        layouts: the run's layouts (records as in :func:`layouts_of`; default read from config).
        files: other input files whose bytes key the run, e.g. ``{"profile": path}``; a config
            ``profile`` that is a path to a file is included by default.

    Raises:
        click.BadParameter: an unreadable length file.
        TypeError: ``options`` together with option keywords, or an unknown keyword.
        RunFolderConflict: (from :meth:`map`, :meth:`finish` or :meth:`claim_folder`, before anything
            is written) ``out_dir`` holds a different run and overwrite is off.
        experiments.common.run_folder.FolderBusy: (from the same) another run is writing ``out_dir``.
        click.ClickException: (from the same, as early) ``out_dir`` cannot be created or locked.
    """

    def __init__(self, name: str, config: dict, *, options: RunOptions | None = None, workload=None,
                 layouts: Sequence[Mapping] | None = None, files: Mapping[str, str | Path] | None = None,
                 **option_fields):
        if options is not None and option_fields:
            raise TypeError(f"ExperimentRun takes options= or option keywords, not both (got {sorted(option_fields)})")
        opts = RunOptions(**option_fields) if options is None else options
        out_dir = opts.out_dir
        self.name = name
        self.config = json.loads(json.dumps(config, sort_keys=True, default=str))
        workload = config.get("workload") if workload is None else workload
        profile = config.get("profile")
        files = {**({"profile": profile} if isinstance(profile, (str, Path)) else {}), **(files or {})}
        self.inputs = json.loads(json.dumps(input_fingerprints(workload, files), sort_keys=True))
        if out_dir is None:
            if config.get("score_profile"):  # planned with one profile, scored with another: its own folder
                profile = f"{profile_stem(profile)}-scored-{profile_stem(config['score_profile'])}"
            out_dir = default_out_dir(name, workload, layouts_of(config) if layouts is None else layouts, profile)
        self.out_dir = Path(out_dir)
        self._overwrite = overwrite_flag(opts.overwrite)
        self.jobs = _jobs(opts.jobs)
        self._force = opts.force
        self._lock: run_folder.FolderLock | None = None
        # inputs join the key only when there are any: preset runs keep their point folders
        self.config_hash = stable_hash({**self.config, "__inputs__": self.inputs} if self.inputs else self.config)
        self.code_hash = code_fingerprint()
        self.points_dir = self.out_dir / ".points" / f"{self.config_hash}-{self.code_hash}"
        ctx = click.get_current_context(silent=True)
        self.quiet = opts.quiet or bool(ctx is not None and ctx.meta.get(QUIET_META))  # --no-progress via meta
        self.started = time.time()
        self.reused = 0
        self.computed = 0
        self.point_seconds: list[tuple[object, float]] = []  # (key, seconds) of each point computed

    def claim_folder(self) -> None:
        """Create the output folder (:func:`make_out_dir`), take its lock until :meth:`finish` (or
        :meth:`release`), remove what a killed run left (:func:`experiments.common.run_folder.recover`) and
        check that the folder holds no other run's record (:func:`check_run_folder`). :meth:`map`
        and :meth:`finish` call it before writing, so a command's own argument checks between
        construction and the sweep report first. A command that measures or spawns processes
        outside :meth:`map` calls it before it starts them.

        Raises:
            RunFolderConflict: the folder holds a different run and overwrite is off.
            experiments.common.run_folder.FolderBusy: another run holds the folder's lock.
            click.ClickException: the folder cannot be created or locked.
        """
        if self._lock is not None:
            return
        make_out_dir(self.out_dir)
        self._lock = run_folder.FolderLock(self.out_dir)
        try:
            run_folder.recover(self.out_dir)
            if not self._overwrite:
                check_run_folder(self.out_dir, self.name, self.config)
        except BaseException:
            self.release()
            raise
        if self._force and self.points_dir.exists():
            shutil.rmtree(self.points_dir, ignore_errors=True)
            self._force = False

    def release(self) -> None:
        """Give up the folder's lock (:meth:`finish` does; a process's exit does too)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- points --------------------------------------------------------------------------
    def _point_path(self, key) -> Path:
        return self.points_dir / f"{stable_hash(key)}.json"

    def cached(self, key) -> list[dict] | None:
        """Rows of a finished point, or None; a point file that cannot be trusted (unreadable, of
        the wrong shape, another key, rows that fail their stored hash) is None with one warning
        line, and is replaced when the point is recomputed."""
        path = self._point_path(key)
        if not path.exists():
            return None
        try:
            payload = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            problem = f"unreadable ({exc})"
        else:
            problem = _point_problem(payload, key)
        if problem is None:
            return payload["rows"]
        click.echo(f"warning: cached point {path} {problem}; recomputing it", err=True)
        return None

    def record(self, key, rows: list[dict]) -> None:
        """Store a finished point with the hash of its rows (:meth:`cached` checks it)."""
        digest = _sha256(_point_text(key, rows).encode())  # over sorted keys; the file keeps the rows' column order
        atomic_write_text(self._point_path(key), json.dumps({"key": key, "rows": rows, "sha256": digest}, default=str))

    def map(self, keys: Iterable, fn: Callable[[object], list[dict]], desc: str | None = None) -> list[dict]:
        """Compute ``fn(key)`` for every key not already finished; return all rows in key order.

        Ctrl-C (KeyboardInterrupt) stops the sweep with a line saying how many of its points are
        cached and that rerunning the command resumes, and exit code 130 (the shell's for SIGINT).
        """
        self.claim_folder()
        keys = list(keys)
        rows: list[dict] = []
        try:
            with progress(total=len(keys), desc=desc or self.name, disable=self.quiet) as bar:
                found = {i: self.cached(k) for i, k in enumerate(keys)}
                todo = [i for i, got in found.items() if got is None]
                self.reused += len(keys) - len(todo)
                if len(todo) < len(keys):
                    bar.advance(len(keys) - len(todo))
                for i, (got, seconds) in self._compute([keys[i] for i in todo], todo, fn):
                    self.point_seconds.append((keys[i], seconds))
                    self.record(keys[i], got)
                    self.computed += 1
                    found[i] = got
                    bar.advance()
                for i in range(len(keys)):
                    rows.extend(found[i])
        except (KeyboardInterrupt, concurrent.futures.BrokenExecutor) as exc:
            done = sum(self._point_path(k).exists() for k in keys)
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else "a --jobs worker process died"
            click.echo(f"\n{why}: {done} of {len(keys)} points of {self.name} are cached in "
                       f"{self.points_dir}; rerun the same command to resume", err=True)
            raise click.exceptions.Exit(130 if isinstance(exc, KeyboardInterrupt) else 1) from None
        return rows

    def _compute(self, keys: list, index: list[int], fn: Callable):
        """Yield ``(index, (fn(key), seconds))`` for the points to compute, in key order: in this
        process, or with ``--jobs N`` in N forked processes (each point is a pure function of its key,
        so the rows are the same; only side effects of ``fn`` on the parent's state are lost, which is
        why each point's compute time comes back with its rows)."""
        jobs = min(self.jobs, len(keys))
        if jobs <= 1:
            for i, key in zip(index, keys):
                yield i, _timed(fn, key)
            return
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_install_point_fn,
                                                    initargs=(fn,)) as pool:
            yield from zip(index, pool.map(_call_point, keys))

    # -- outputs -------------------------------------------------------------------------
    @property
    def csv_path(self) -> Path:
        return self.out_dir / f"{self.name}.csv"

    @property
    def png_path(self) -> Path:
        return self.out_dir / f"{self.name}.png"

    def finish(self, df: pd.DataFrame, plot: Callable[[pd.DataFrame, Path], None] | None = None,
               extra: dict | None = None, files: Mapping[str, str | bytes] | None = None) -> dict[str, Path]:
        """Write the CSV, the run's other ``files`` (name -> contents, e.g. a summary CSV), the PNG
        (``plot(df, path)``) and ``run.json`` into the folder as one unit
        (:func:`experiments.common.run_folder.commit`), then release the folder's lock.

        The previous run's files that this run does not write are removed. A file whose bytes equal
        the folder's, or a data file (the CSV and ``files``) whose numbers equal the folder's up to
        float rounding, is not rewritten; when every data file the folder holds is so and the
        record's experiment, config and inputs are this run's, the folder's ``run.json`` is kept (it
        records the run that produced these numbers): a rerun that changed no number changes no
        file but a re-rendered PNG or a data file the folder lacked.
        """
        self.claim_folder()
        data = {self.csv_path.name: df.to_csv(index=False), **(files or {})}
        data = {name: blob.encode() if isinstance(blob, str) else bytes(blob) for name, blob in data.items()}
        outputs = sorted([*data, *([self.png_path.name] if plot is not None else [])])
        old = _read_record(self.out_dir)
        stage = run_folder.new_stage(self.out_dir)
        try:
            for name, blob in data.items():
                run_folder.write_file(stage, name, blob)
            if plot is not None:
                plot(df, stage / self.png_path.name)
            if self._same_numbers(old, data):
                click.echo(f"{self.out_dir}: numbers unchanged since its run of {old.get('finished_utc', '?')}; "
                           "run.json kept", err=True)
            else:
                record = self._record(len(df), outputs, extra)
                run_folder.write_file(stage, run_folder.RECORD_NAME, json.dumps(record, indent=2, default=str).encode())
            drop = _previous_outputs(old, self.out_dir) - set(outputs)
            if _unstage_unchanged(stage, self.out_dir) or drop:
                run_folder.commit(self.out_dir, stage, drop)
            else:
                run_folder.discard(stage)
        except BaseException:
            run_folder.abandon(self.out_dir, stage)
            raise
        finally:
            self.release()
        paths = {"csv": self.csv_path, **({"png": self.png_path} if plot is not None else {})}
        return {**paths, "run": self.out_dir / run_folder.RECORD_NAME}

    def _same_numbers(self, old: dict | None, data: Mapping[str, bytes]) -> bool:
        """Whether ``old`` records this run (experiment, config, inputs) and the folder's data files
        hold ``data``'s numbers up to float rounding (at least one present; missing ones, e.g.
        git-ignored per-step CSVs in a fresh clone, are only added)."""
        if old is None or (old.get("experiment"), old.get("config"), old.get("inputs")) != (
                self.name, self.config, self.inputs):
            return False
        present = [name for name in data if (self.out_dir / name).is_file()]
        return bool(present) and all(_same_data(name, (self.out_dir / name).read_bytes(), data[name])
                                     for name in present)

    def _record(self, rows: int, outputs: list[str], extra: dict | None) -> dict:
        """The run record: what ran (config, inputs, command), on what, how long, and its files."""
        record = {
            "experiment": self.name, "config": self.config, "inputs": self.inputs,
            "config_hash": self.config_hash, "code_fingerprint": self.code_hash,
            "command": " ".join(sys.argv), "finished_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "wall_s": round(time.time() - self.started, 3), "points_computed": self.computed,
            "points_reused": self.reused, "rows": rows, "outputs": outputs, "environment": environment(),
        }
        ctx = click.get_current_context(silent=True)
        if ctx is not None and CONFIG_META in ctx.meta:
            record["config_file"] = ctx.meta[CONFIG_META]  # --config: the file and the values it gave
        return {**record, **(extra or {})}


def _previous_outputs(record: dict | None, folder: Path) -> set[str]:
    """The files of ``folder`` its record lists as the run's outputs (plain names only: a record is
    data, never a path to follow)."""
    names = record.get("outputs") if isinstance(record, dict) else None
    return {n for n in names if isinstance(n, str) and n == Path(n).name and n not in (".", "..")
            and (folder / n).is_file()} if isinstance(names, list) else set()


def _same_data(name: str, old: bytes, new: bytes) -> bool:
    """Whether a data file holds the same numbers: equal bytes, or for a CSV equal numbers up to
    float rounding (:func:`experiments.common.same_numbers.same_csv_numbers`)."""
    return old == new or (name.endswith(".csv") and same_csv_numbers(old, new))


def _unstage_unchanged(stage: Path, folder: Path) -> bool:
    """Remove from the stage each file that is the folder's (which is kept as it is): the same
    bytes, or for a CSV the same numbers up to float rounding (:func:`_same_data`: another CPU's
    rounding of the same run rewrites nothing); whether any staged file is left."""
    left = False
    for staged in list(stage.iterdir()):
        here = folder / staged.name
        # a CSV's digits may differ in length; any other file differs whenever its size does
        if here.is_file() and (staged.name.endswith(".csv") or here.stat().st_size == staged.stat().st_size) \
                and _same_data(staged.name, here.read_bytes(), staged.read_bytes()):
            staged.unlink()
        else:
            left = True
    return left
