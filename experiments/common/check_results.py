"""`make check-results`: recompute a slice of the committed simulated results and compare it digit by digit.

The simulator is deterministic (same config and seed: same plans, same CSV), so the committed
numbers are checked by recomputing part of them rather than by committing every rerun:

* Figure 12 on ``libra-prod`` (``results/straggler``, ``make fig12``): the first window of both
  settings, every method of the committed run;
* Figure 12 on the FlexSP Wikipedia lengths (``results/straggler-wikipedia``, ``make fig12-real``):
  one point, Libra at 1M in the first window (with the Ulysses rows the command always adds),
  when ``--workloads`` holds the corpus; otherwise the check is skipped with its reason printed.

Each check runs the figure's command as its make target does, plus ``--windows 1`` and the
point's ``--settings`` / ``--methods``, into a temporary folder (nothing under ``results/`` is
written). It then requires that the recomputed run is the committed one restricted to that slice
(the run records' configs agree but for windows, settings, methods and their planner options,
which must be the committed ones; the workload's lengths hash agrees) and compares every
simulated column of ``straggler.csv`` with the committed rows of the slice as text, i.e. the
CSV's own digits: one differing cell, row or column fails the check. The one exception is float
rounding: numpy's vectorised math rounds the last bit differently on some CPUs (AVX-512 against
AVX2), so a float cell that differs by at most :data:`experiments.common.same_numbers.ROUNDING` of
its value is counted and reported, not failed. :data:`TIMING_COLUMNS` lists the clock readings a
CSV may carry, which are ignored.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import pandas as pd

from experiments.common.same_numbers import ROUNDING, relative_gap, rounding_cells

TIMING_COLUMNS: tuple[str, ...] = ()
"""Columns of the compared CSVs that read a clock (ignored). None today: ``straggler.csv`` holds
only simulated numbers; the run's timings are in ``run.json`` (``wall_s``, ``simulate_seconds``),
which is compared by its config only."""

KEY_COLUMNS = ("setting", "method", "window", "step")
SUBSET_KEYS = ("windows", "settings", "methods", "planner_options", "workload", "workload_source")
"""Config entries a slice may narrow (checked separately) or name differently (the workload's path)."""


@dataclass(frozen=True)
class Check:
    """One recomputed slice of a committed folder.

    Attributes:
        title: what is checked, as printed.
        folder: the committed folder under ``--results``.
        args: the make target's command line without ``--out`` / ``--overwrite``; ``{workloads}``
            stands for ``--workloads``.
        needs: a file under ``--workloads`` the check reads (None: a built-in preset).
    """

    title: str
    folder: str
    args: tuple[str, ...]
    needs: str | None = None


CHECKS = (
    Check("Figure 12, libra-prod, first window of both settings", "straggler",
          ("straggler", "--workload", "libra-prod")),
    Check("Figure 12, Wikipedia lengths, Libra at 1M in the first window", "straggler-wikipedia",
          ("straggler", "--workload", "{workloads}/flexsp_wikipedia.txt.gz", "--settings", "1m", "--methods", "libra"),
          needs="flexsp_wikipedia.txt.gz"),
)


@dataclass(frozen=True)
class RowComparison:
    """What :func:`compare_rows` found.

    Attributes:
        problems: columns present in one only, rows present in one only, then cells that differ by
            more than float rounding (at most ``limit`` lines of each kind); empty: the same numbers.
        rounded: cells whose digits differ only by float rounding
            (:data:`experiments.common.same_numbers.ROUNDING`: another CPU's vectorised numpy math).
        worst_rounding: the largest relative difference among those cells (0 without any).
    """

    problems: list[str]
    rounded: int = 0
    worst_rounding: float = 0.0


def compare_rows(committed: pd.DataFrame, recomputed: pd.DataFrame, key=KEY_COLUMNS,
                 ignore=TIMING_COLUMNS, limit: int = 10) -> RowComparison:
    """Two CSVs read as text (``dtype=str``) compared cell by cell, rows matched by ``key``;
    ``ignore``: columns not compared."""
    cols = [c for c in committed.columns if c not in ignore]
    other = [c for c in recomputed.columns if c not in ignore]
    out = [f"column {c} is {'only committed' if c in cols else 'only recomputed'}"
           for c in sorted(set(cols) ^ set(other))]
    a, b = committed.set_index(list(key)), recomputed.set_index(list(key))
    for idx, where in ((a.index.difference(b.index), "committed"), (b.index.difference(a.index), "recomputed")):
        out += [f"row {dict(zip(key, i))} is only {where}" for i in list(idx)[:limit]]
    both = a.index.intersection(b.index)
    shared = [c for c in cols if c in other and c not in key]
    a, b = a.loc[both, shared], b.loc[both, shared]
    differs, rounding = rounding_cells(a, b)
    cells = (differs & ~rounding).stack()
    for (*i, col), _ in list(cells[cells].items())[:limit]:
        out.append(f"{dict(zip(key, i))} {col}: committed {a.loc[tuple(i), col]}, recomputed {b.loc[tuple(i), col]}")
    return RowComparison(out, int(rounding.to_numpy().sum()), relative_gap(a, b, rounding))


def _read(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def config_differences(committed: dict, recomputed: dict) -> list[str]:
    """Why a recomputed run is not a slice of the committed one (empty: it is)."""
    old, new = committed.get("config") or {}, recomputed.get("config") or {}
    out = [f"config {k} differs" for k in sorted(set(old) | set(new), key=str)
           if k not in SUBSET_KEYS and old.get(k) != new.get(k)]
    names = [s.get("name") for s in old.get("settings", [])]
    out += [f"setting {s.get('name')} is not the committed run's" for s in new.get("settings", [])
            if s not in old.get("settings", [])]
    out += [f"method {m} is not in the committed run" for m in new.get("methods", []) if m not in old.get("methods", [])]
    out += [f"planner options of {s}/{m} differ" for s, per in (new.get("planner_options") or {}).items()
            for m, opts in per.items() if s in names and (old.get("planner_options") or {}).get(s, {}).get(m) != opts]
    lengths = [(r.get("inputs") or {}).get("workload", {}).get("lengths_sha256") for r in (committed, recomputed)]
    if lengths[0] != lengths[1] or (lengths[0] is None and old.get("workload") != new.get("workload")):
        out.append("the workload's lengths differ")
    return out


def run_check(check: Check, results: Path, workloads: Path) -> tuple[bool | None, str]:
    """``(passed, line)``; ``passed`` is None for a skipped check."""
    folder = results / check.folder
    if check.needs is not None and not (workloads / check.needs).is_file():
        return None, f"{workloads / check.needs} not found (pass --workloads DIR holding it)"
    for need in ("run.json", "straggler.csv"):
        if not (folder / need).is_file():
            return False, f"{folder / need} is missing"
    with tempfile.TemporaryDirectory(prefix="check-results-") as tmp:
        args = [a.format(workloads=workloads) for a in check.args]
        cmd = [sys.executable, "-m", "experiments.cli", *args, "--windows", "1", "--no-progress", "--out", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return False, f"`{' '.join(cmd[2:])}` failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        recomputed = _read(Path(tmp) / "straggler.csv")
        problems = config_differences(json.loads((folder / "run.json").read_text()),
                                      json.loads((Path(tmp) / "run.json").read_text()))
    committed = _read(folder / "straggler.csv")
    committed = committed[(committed["window"] == "0") & committed["setting"].isin(set(recomputed["setting"]))
                          & committed["method"].isin(set(recomputed["method"]))]
    found = compare_rows(committed, recomputed)
    problems += found.problems
    if problems:
        return False, "differs from the committed results:\n  " + "\n  ".join(problems)
    compared = [c for c in recomputed.columns if c not in TIMING_COLUMNS and c not in KEY_COLUMNS]
    rounded = (f" but {found.rounded} cells that differ only by float rounding (at most {found.worst_rounding:.1e} "
               f"of their value, within {ROUNDING:g}: this CPU's vectorised numpy math)" if found.rounded else "")
    return True, (f"{len(recomputed)} rows x {len(compared)} simulated columns identical{rounded} "
                  f"(timing columns ignored: {', '.join(TIMING_COLUMNS) or 'none'})")


@click.command("check-results")
@click.option("--results", type=click.Path(file_okay=False, exists=True, path_type=Path), default=Path("results"),
              show_default=True, help="Folder holding the committed results.")
@click.option("--workloads", type=click.Path(file_okay=False, path_type=Path), default=Path("../shared/workloads"),
              show_default=True, help="Folder of the public length corpora (a check that needs a missing one is skipped).")
def check_results(results: Path, workloads: Path) -> None:
    """Recompute Figure 12's first window (libra-prod) and one Wikipedia point; fail on any difference
    from the committed simulated numbers."""
    failed = 0
    for check in CHECKS:
        t0 = time.perf_counter()
        passed, line = run_check(check, results, workloads)
        failed += passed is False
        verdict = {True: "ok", False: "FAILED", None: "skipped"}[passed]
        click.echo(f"check-results: {check.title} ({results / check.folder}): {verdict} "
                   f"({time.perf_counter() - t0:.1f} s): {line}")
    if failed:
        raise click.ClickException(f"{failed} of {len(CHECKS)} checks differ from the committed results; "
                                   "rerun their make targets if the change is intended")


if __name__ == "__main__":
    check_results()
