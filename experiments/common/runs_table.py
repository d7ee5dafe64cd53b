"""Your runs side by side: every result folder under a root, one row per method of each run.

``libra-bench report --results runs`` writes this beside its paper table (``runs.md`` and a
self-contained ``runs.html`` with every run's figures embedded); :func:`load_runs` is the Python
API, which only reads (no cache, no file written anywhere)::

    from experiments.common.runs_table import load_runs

    tables = load_runs("runs")
    tables.methods          # one row per (run, setting, method): straggler, speedup, bound
    tables.runs             # one row per run folder: experiment, workload, layout, profile, figures

``methods`` covers the experiments that price or measure each method's core-attention straggler:

* ``straggler`` (simulated): per setting and method, the mean straggler (ms), its speedup over
  Ulysses on the same windows with the per-window [min, max], and the perfect-balance bound (ms)
  with the straggler's ratio to it (``bound_ratio``, 1 = perfect balance at the kernel's best rate);
* ``tune``: each method's best-ranked candidate and the recommended one (``recommended``), its
  (P, H, B, M) in the layout, the same columns;
* ``microbench`` (measured): per method, the mean measured straggler, its speedup over Ulysses, and
  the measured reference (each rank's sequence as whole-sequence attention / CP): a reference, not a
  bound -- timed apart from the steps on a shared host, a method can beat it.

Every other experiment's folder is listed in ``runs`` with its figures. The layout is the run
folder's tag (``dp32-cp8-s256k-gbs128-p8-b4k-h2-m4``, :func:`experiments.common.runner.layout_tag`).
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common.runner import LAYOUT_TAG_FIELDS, layout_tag

METHOD_COLUMNS = ("folder", "experiment", "workload", "layout", "profile", "method", "straggler_ms", "speedup",
                  "speedup_min", "speedup_max", "bound_ms", "bound_ratio", "bound", "recommended")
"""Columns of :attr:`RunsTables.methods` (``bound`` says what the bound is: the simulated bound or the measured reference)."""
RUN_COLUMNS = ("folder", "experiment", "workload", "layout", "profile", "windows", "finished_utc", "figures", "path")
SIMULATED_BOUND = "perfect balance"
MEASURED_BOUND = "measured reference"


@dataclass(frozen=True)
class RunsTables:
    """What :func:`load_runs` returns: ``runs`` (one row per run folder), ``methods`` (one row per
    method of each run that has them) and ``problems`` (folders that could not be read, with why)."""

    runs: pd.DataFrame
    methods: pd.DataFrame
    problems: tuple[str, ...] = ()


def _profile(record: dict) -> str:
    for prof in (record.get("profile"), (record.get("config") or {}).get("profile")):
        if isinstance(prof, dict) and prof.get("name"):
            return str(prof["name"])
        if isinstance(prof, str) and prof:
            return Path(prof).stem if prof.endswith(".json") else prof
    return "-"


def _workload(config: dict) -> str:
    w = config.get("workload")
    if isinstance(w, dict):
        return str(w.get("name") or w.get("path") or "?")
    return Path(str(w)).name if w is not None else "-"


def _layouts(config: dict) -> dict[str, str]:
    """``{setting name: layout tag}`` of a run's config (``settings``, ``setting``, ``par``, or the
    flat ``dp/cp/seq_len/gbs/tap`` of a measured run; ``custom`` under the one name ``custom``)."""
    found = config.get("settings", config.get("setting", config.get("par")))
    records = found if isinstance(found, list) else [found] if isinstance(found, dict) else []
    if not records and any(isinstance(config.get(k), int) for k in ("dp", "seq_len", "gbs")):
        records = [{k: config[k] for k in (*(f for f, _ in LAYOUT_TAG_FIELDS), "tap") if k in config}]
    out = {}
    for r in records:
        if isinstance(r, dict):
            out[str(r.get("name") or "custom")] = layout_tag(r)
    return out


def describe_run(config: Mapping, record: dict | None = None) -> tuple[str, str, dict[str, str]]:
    """``(workload, profile, {setting: layout tag})`` of a run: what its figures' titles and the
    runs report name (``-`` for a profile the run does not have)."""
    return _workload(config), _profile({**(record or {}), "config": config}), _layouts(config)


def run_caption(config: Mapping, layout: str | None = None) -> str:
    """``workload W | profile P | layout L`` of a run's config (each always named: ``none`` where
    the run has none, e.g. a FLOPs-only sweep's profile; ``P (scored with Q)`` for a run planned
    with P and priced with ``--score-profile`` Q); several layouts by setting name.
    ``layout`` replaces the one read from the config."""
    workload, profile, layouts = describe_run(config)
    if layout is None:
        layout = "; ".join(f"{name}: {tag}" if len(layouts) > 1 else tag for name, tag in layouts.items()) or "none"
    scored = _profile({"profile": config.get("score_profile")}) if config.get("score_profile") else None
    profile = (profile if profile != "-" else "none") + (f" (scored with {scored})" if scored else "")
    return f"workload {workload} | profile {profile} | layout {layout}"


def _straggler_rows(folder: Path, config: dict) -> list[dict]:
    summary = pd.read_csv(folder / "straggler_summary.csv")
    layouts = _layouts(config)
    return [{"setting": r.setting, "layout": layouts.get(str(r.setting), str(r.setting)), "method": r.method,
             "straggler_ms": r.mean_ms, "speedup": r.mean_speedup, "speedup_min": r.window_speedup_min,
             "speedup_max": r.window_speedup_max, "bound_ms": r.bound_ms, "bound_ratio": r.bound_ratio,
             "bound": SIMULATED_BOUND} for r in summary.itertuples()]


def _tune_rows(folder: Path, config: dict) -> list[dict]:
    table = pd.read_csv(folder / "tune.csv")
    picked = table.loc[sorted(set(table.groupby("method")["rank"].idxmin()) | set(table.index[table["recommended"]]))]
    par = config.get("par") or {}
    rows = []
    for r in picked.itertuples():
        tap = {"pool_size": r.pool_size, "block_size": r.block_size, "head_split": r.head_split,
               "pipeline_chunks": r.pipeline_chunks}
        rows.append({"layout": layout_tag({**par, **tap}), "method": r.method, "straggler_ms": r.mean_ms,
                     "speedup": r.speedup, "speedup_min": getattr(r, "speedup_window_min", np.nan),
                     "speedup_max": getattr(r, "speedup_window_max", np.nan),
                     "bound_ms": r.mean_ms / r.bound_ratio, "bound_ratio": r.bound_ratio, "bound": SIMULATED_BOUND,
                     "recommended": bool(r.recommended)})
    return rows


def _microbench_rows(folder: Path, config: dict) -> list[dict]:
    summary = pd.read_csv(folder / "microbench_summary.csv")
    layout = next(iter(_layouts(config).values()), "custom")
    return [{"layout": layout, "method": r.method, "straggler_ms": r.mean_ms,
             "speedup": getattr(r, "mean_speedup", np.nan), "speedup_min": np.nan, "speedup_max": np.nan,
             "bound_ms": getattr(r, "ideal_ms", np.nan), "bound_ratio": getattr(r, "ideal_ratio", np.nan),
             "bound": MEASURED_BOUND} for r in summary.itertuples()]


METHOD_ROWS = {"straggler": _straggler_rows, "tune": _tune_rows, "microbench": _microbench_rows}
"""Experiments whose runs give per-method rows, and how."""


def _run_folders(root: Path):
    """``(folder, run record)`` of every run folder under ``root`` (outside point caches), or
    ``(folder, error text)`` for a ``run.json`` that is not a run record."""
    for path in sorted(root.rglob("run.json")):
        if ".points" in path.relative_to(root).parts:
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            yield path.parent, f"unreadable run.json ({exc})"
            continue
        if not isinstance(record, dict) or not isinstance(record.get("experiment"), str) \
                or not isinstance(record.get("config"), dict):
            yield path.parent, "run.json is not a run record (no experiment name or no config object)"
            continue
        yield path.parent, record


def results_folder(root: str | Path) -> Path:
    """``root`` as a Path, once it is a folder to read results from.

    Raises:
        ValueError: it does not exist or is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"results folder {str(root)!r} does not exist or is not a directory")
    return root


def load_runs(root: str | Path) -> RunsTables:
    """Every run folder under ``root`` side by side (module docstring). Reads only.

    Raises:
        ValueError: ``root`` is not a directory.
    """
    root = results_folder(root)
    runs, methods, problems = [], [], []
    for folder, record in _run_folders(root):
        label = str(folder.relative_to(root.parent)) if folder != root else root.name
        if isinstance(record, str):
            problems.append(f"{label}: {record}")
            continue
        config, experiment = record["config"], record["experiment"]
        base = {"folder": label, "experiment": experiment, "workload": _workload(config), "profile": _profile(record)}
        layouts = _layouts(config)
        runs.append({**base, "layout": " + ".join(dict.fromkeys(layouts.values())) or "-",
                     "windows": config.get("windows", np.nan), "finished_utc": str(record.get("finished_utc", ""))[:19],
                     "figures": ", ".join(p.name for p in sorted(folder.glob("*.png"))), "path": str(folder.resolve())})
        if experiment in METHOD_ROWS:
            try:
                methods += [{**base, **row} for row in METHOD_ROWS[experiment](folder, config)]
            except (OSError, KeyError, AttributeError, ValueError, pd.errors.ParserError) as exc:
                problems.append(f"{label}: its {experiment} table cannot be read ({type(exc).__name__}: {exc})")
    method_frame = pd.DataFrame(methods, columns=[*METHOD_COLUMNS, "setting"])
    method_frame["recommended"] = method_frame["recommended"].fillna(False).astype(bool)
    return RunsTables(pd.DataFrame(runs, columns=list(RUN_COLUMNS)), method_frame[list(METHOD_COLUMNS)],
                      tuple(problems))


# -- rendering -------------------------------------------------------------------------------------


def _text(value, digits: int = 3) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else ""
    if isinstance(value, (float, np.floating)):
        return "-" if np.isnan(value) else f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def shown_methods(tables: RunsTables) -> pd.DataFrame:
    """The methods table as the report prints it: the speedup with its per-window range, the bound
    with what it is, ``*`` on tune's recommended candidate."""
    m = tables.methods
    speed = [("-" if np.isnan(s) else f"{s:.2f}x") + ("" if np.isnan(lo) else f" [{lo:.2f}, {hi:.2f}]")
             for s, lo, hi in zip(m["speedup"], m["speedup_min"], m["speedup_max"])]
    bound = [("-" if np.isnan(b) else f"{b:.1f} ms") + ("" if np.isnan(r) else f" (x{r:.2f}, {what})")
             for b, r, what in zip(m["bound_ms"], m["bound_ratio"], m["bound"])]
    return pd.DataFrame({"run": m["folder"], "workload": m["workload"], "layout": m["layout"], "profile": m["profile"],
                         "method": [f"{x} *" if rec else x for x, rec in zip(m["method"], m["recommended"])],
                         "straggler ms": [_text(x, 4) for x in m["straggler_ms"]],
                         "speedup over Ulysses [window min, max]": speed, "bound (straggler / bound)": bound})


def markdown_table(frame: pd.DataFrame) -> str:
    """``frame`` as a GitHub Markdown table (cells as :func:`_text` writes them)."""
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(_text(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


INTRO = ("Each method's core-attention straggler (the slowest worker's forward + backward time of one layer per "
         "step, mean over steps), its speedup over Ulysses on the same windows with the per-window [min, max], and "
         "its bound: the perfect-balance bound of the simulated runs (all attention compute spread evenly at the "
         "kernel's best rate) or the measured reference of `microbench` (each rank's sequence as whole-sequence "
         "attention / CP; a reference, not a bound: a method can beat it on a shared host); `*` marks `tune`'s recommended configuration.")


def runs_markdown(tables: RunsTables, root: str) -> str:
    """The Markdown report of :func:`load_runs`' tables."""
    lines = [f"# Your runs under `{root}`", "", INTRO, ""]
    lines += [markdown_table(shown_methods(tables)) if len(tables.methods) else "No straggler, tune or microbench run.",
              "", "## Run folders", "", markdown_table(tables.runs.drop(columns="path").fillna("-"))]
    if tables.problems:
        lines += ["", "Not read: " + "; ".join(tables.problems) + "."]
    return "\n".join(lines) + "\n"


def _figure(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure><img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(path.name)}</figcaption></figure>")


STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;font-size:13px}"
         "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f3f3f3}"
         "img{max-width:100%;border:1px solid #eee}figure{margin:1em 0}")


def runs_html(tables: RunsTables, root: str) -> str:
    """A self-contained HTML page of :func:`load_runs`' tables and every run's figures (PNG files
    embedded as data URIs: one file to open, mail or archive)."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Your runs under {html.escape(str(root))}</title>"
             f"<style>{STYLE}</style></head><body>", f"<h1>Your runs under <code>{html.escape(str(root))}</code></h1>",
             f"<p>{html.escape(INTRO)}</p>", shown_methods(tables).to_html(index=False, escape=True),
             "<h2>Run folders</h2>", tables.runs.drop(columns="path").fillna("-").to_html(index=False, escape=True)]
    for run in tables.runs.itertuples():
        pngs = sorted(Path(run.path).glob("*.png"))
        if pngs:
            parts.append(f"<h2>{html.escape(run.folder)} ({html.escape(run.experiment)})</h2>")
            parts += [_figure(p) for p in pngs]
    if tables.problems:
        parts.append("<p>Not read: " + html.escape("; ".join(tables.problems)) + "</p>")
    return "\n".join(parts) + "\n</body></html>\n"
