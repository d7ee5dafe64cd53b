"""The one experiment runner every `libra-bench` command uses.

Contract:
* outputs go to ``results/<name>/`` unless ``--out DIR``: ``<name>.csv`` (long format),
  ``<name>.png`` (seaborn) and ``run.json`` (resolved config, seed, git SHA, package versions,
  host, hardware profile when one is used, command line, wall time);
* every file is written atomically (temporary file in the same folder, then ``os.replace``);
* each finished point of a sweep is stored under ``.points/<key>/`` as soon as it is computed, so
  an interrupted sweep resumes where it stopped and a rerun of the same config reuses finished
  points unless ``force=True`` (``--force``) is given. The key hashes the resolved config *and* a
  fingerprint of the project's source (:func:`code_fingerprint`), so neither a different config nor
  a code change (a new preset, a fixed cost model) can mix stale points into a new run.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path

import pandas as pd

from experiments.progress import progress

RESULTS_ROOT = Path("results")
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
    root = Path(__file__).resolve().parent.parent
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
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!results"],
                               capture_output=True,
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


class ExperimentRun:
    """One run of one experiment: resumable points, atomic outputs, a run record.

    Args:
        name: experiment name; file stem of the CSV/PNG and default folder ``results/<name>``.
        config: the resolved configuration (JSON-serialisable); its hash keys the point cache.
        out_dir: output folder (default ``results/<name>``).
        force: drop cached points of this config and recompute everything.
        quiet: no progress bar.
    """

    def __init__(self, name: str, config: dict, out_dir: str | Path | None = None, force: bool = False,
                 quiet: bool = False):
        self.name = name
        self.config = json.loads(json.dumps(config, sort_keys=True, default=str))
        self.out_dir = Path(out_dir) if out_dir is not None else RESULTS_ROOT / name
        self.config_hash = stable_hash(self.config)
        self.code_hash = code_fingerprint()
        self.points_dir = self.out_dir / ".points" / f"{self.config_hash}-{self.code_hash}"
        self.quiet = quiet
        self.started = time.time()
        self.reused = 0
        self.computed = 0
        if force and self.points_dir.exists():
            shutil.rmtree(self.points_dir)

    # -- points --------------------------------------------------------------------------
    def _point_path(self, key) -> Path:
        return self.points_dir / f"{stable_hash(key)}.json"

    def cached(self, key) -> list[dict] | None:
        """Rows of a finished point, or None."""
        path = self._point_path(key)
        if not path.exists():
            return None
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None  # a torn file cannot exist (atomic writes) but a hand-edited one might
        return payload["rows"] if payload.get("key") == json.loads(json.dumps(key, default=str)) else None

    def record(self, key, rows: list[dict]) -> None:
        atomic_write_text(self._point_path(key), json.dumps({"key": key, "rows": rows}, default=str))

    def map(self, keys: Iterable, fn: Callable[[object], list[dict]], desc: str | None = None) -> list[dict]:
        """Compute ``fn(key)`` for every key not already finished; return all rows in key order."""
        keys = list(keys)
        rows: list[dict] = []
        with progress(total=len(keys), desc=desc or self.name, disable=self.quiet) as bar:
            for key in keys:
                got = self.cached(key)
                if got is None:
                    got = fn(key)
                    self.record(key, got)
                    self.computed += 1
                else:
                    self.reused += 1
                rows.extend(got)
                bar.advance()
        return rows

    # -- outputs -------------------------------------------------------------------------
    @property
    def csv_path(self) -> Path:
        return self.out_dir / f"{self.name}.csv"

    @property
    def png_path(self) -> Path:
        return self.out_dir / f"{self.name}.png"

    def finish(self, df: pd.DataFrame, plot: Callable[[pd.DataFrame, Path], None] | None = None,
               extra: dict | None = None) -> dict[str, Path]:
        """Write the CSV, the PNG (``plot(df, tmp_png)``) and ``run.json``, each atomically."""
        paths = {"csv": atomic_write_text(self.csv_path, df.to_csv(index=False))}
        if plot is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = _new_temp(self.out_dir, self.name, ".png")
            os.close(fd)
            try:
                plot(df, Path(tmp))
                os.replace(tmp, self.png_path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            paths["png"] = self.png_path
        record = {
            "experiment": self.name, "config": self.config, "config_hash": self.config_hash,
            "code_fingerprint": self.code_hash,
            "command": " ".join(sys.argv), "finished_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "wall_s": round(time.time() - self.started, 3), "points_computed": self.computed,
            "points_reused": self.reused, "rows": len(df), "environment": environment(),
        }
        if extra:
            record.update(extra)
        paths["run"] = atomic_write_text(self.out_dir / "run.json", json.dumps(record, indent=2, default=str))
        return paths
