"""`libra-bench compare RUN_DIR RUN_DIR [...]`: two or more result folders of one experiment side by side.

What users come for -- "compare methods on *my* cluster with *my* data" -- usually ends with two
runs: two clusters' profiles, two workloads, before and after a change. This command reads each
folder's ``run.json`` (they must record the same experiment) and its summary table
(``<experiment>_summary.csv`` when the experiment writes one, else ``<experiment>.csv``), lists the
config keys in which each run differs from the first, and puts the chosen metrics side by side:
one row per (key columns, metric) with each run's value and its ratio to the first run's.

Key columns are the text columns every table shares (``setting``, ``method``, ...); rows with the
same keys are averaged (a per-step CSV becomes per-key means). A key column that holds one value per
run, different between runs -- the usual case of two runs on two layouts, whose ``setting`` names
the layout -- names the runs rather than their rows, so rows are matched on the other keys
(:func:`run_naming_keys`; the output says so). Runs that still share no row are refused with one
line naming what each holds. Metrics default to each experiment's headline numbers
(:data:`DEFAULT_METRICS`) or ``--metrics``.

Outputs (``--out``, default ``runs/compare/<experiment>-<hash of the inputs>/``): ``compare.csv``,
``compare.png`` (one panel per metric, bars per key, one colour per run, values as printed) and
``run.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.common.runner import RUNS_ROOT, ExperimentRun, differing_keys, stable_hash
from experiments.common.runs_table import run_caption

DEFAULT_METRICS = {
    "straggler": ("mean_ms", "mean_speedup", "pool_balanced_ratio"),
    "pool-sweep": ("total_ms",),
    "tune": ("mean_ms", "speedup", "pool_size", "head_split", "block_size", "pipeline_chunks"),
    "plan-cost": ("median_ms",),
    "microbench": ("mean_ms", "ideal_ratio", "paired_ratio"),
    "grid-search": ("speedup",),
}
"""Headline metrics per experiment (others: the first three numeric columns)."""

ROW_CHOICE = {"tune": ("the recommended configuration", lambda t: t[t["recommended"].astype(bool)]
                        if "recommended" in t.columns else t)}
"""Per experiment, which rows of a table are compared (and how the output says so): a ``tune`` table
ranks every (P, H, B, M) candidate, and its mean over candidates means nothing; the recommended
configuration -- what tune says to run, not necessarily rank 1 (ties go to the smaller P) -- is
compared, its P, H, B and M among the metrics."""

CONFIG_METRICS = {"pool_size": "P", "head_split": "H", "block_size": "B", "pipeline_chunks": "M"}
"""Metrics that are a configuration's choices, not measurements: compared as values (no ratio: a
block size of 0.0625 of another means nothing) and drawn as a table, not as bars."""

IGNORED_KEYS = {"workload", "label"}
"""Text columns that name the run rather than a row (they differ between the runs compared)."""


def load_run(folder: Path) -> tuple[dict, pd.DataFrame]:
    """``(run.json record, summary table)`` of one result folder.

    Raises:
        click.UsageError: no ``run.json`` or no table in the folder.
    """
    record_path = folder / "run.json"
    if not record_path.is_file():
        raise click.UsageError(f"{folder} holds no run.json (not a libra-bench result folder)")
    try:
        record = json.loads(record_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise click.UsageError(f"{record_path} cannot be read: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise click.UsageError(f"{record_path} is not a run record (no config object)")
    name = record.get("experiment", "")
    for table in (folder / f"{name}_summary.csv", folder / f"{name}.csv"):
        if table.is_file():
            return record, pd.read_csv(table)
    raise click.UsageError(f"{folder} holds no {name}_summary.csv or {name}.csv")


def key_columns(tables: list[pd.DataFrame]) -> list[str]:
    """Text columns present in every table: the row keys (run-naming columns excluded)."""
    common = set.intersection(*(set(t.columns) for t in tables))
    first = tables[0]
    return [c for c in first.columns if c in common and c not in IGNORED_KEYS
            and not pd.api.types.is_numeric_dtype(first[c])]


def run_naming_keys(tables: list[pd.DataFrame], keys: list[str]) -> dict[str, list[str]]:
    """``{column: each run's value}`` for the ``keys`` that hold a single value in every table but
    not the same one in all: they name the runs (two layouts' ``setting``), so matching rows on
    them would pair nothing."""
    out = {}
    for c in keys:
        values = [t[c].dropna().unique() for t in tables]
        if all(len(v) == 1 for v in values) and len({str(v[0]) for v in values}) > 1:
            out[c] = [str(v[0]) for v in values]
    return out


def check_shared_rows(tables: list[pd.DataFrame], labels: list[str], keys: list[str]) -> int:
    """How many key rows some run lacks (its values are NaN there).

    Raises:
        click.UsageError: no key row is in every run (nothing would be compared), naming each
            run's values of the keys.
    """
    if not keys:
        return 0
    rows = [set(t[keys].astype(str).itertuples(index=False, name=None)) for t in tables]
    shared = set.intersection(*rows)
    if not shared:
        held = "; ".join(f"{lab}: " + ", ".join(f"{c} {_few(t[c])}" for c in keys) for lab, t in zip(labels, tables))
        raise click.UsageError(f"the runs share no ({', '.join(keys)}) row to compare ({held})")
    return len(set.union(*rows) - shared)


def _few(column: pd.Series, n: int = 6) -> str:
    """The first ``n`` sorted distinct values of ``column``, with how many more there are."""
    values = sorted(map(str, column.dropna().unique()))
    return "{" + ", ".join(values[:n]) + (f", ... {len(values) - n} more" if len(values) > n else "") + "}"


def choose_metrics(experiment: str, tables: list[pd.DataFrame], asked: tuple[str, ...]) -> list[str]:
    """``asked`` (each must be a numeric column of every table), else the experiment's defaults
    present in every table, else the first three shared numeric columns.

    Raises:
        click.UsageError: an asked metric missing from a table, or no numeric column to compare.
    """
    numeric = [c for c in tables[0].columns
               if all(c in t.columns and pd.api.types.is_numeric_dtype(t[c]) for t in tables)]
    if asked:
        missing = [m for m in asked if m not in numeric]
        if missing:
            raise click.UsageError(f"metric(s) {missing} are not numeric columns of every run; "
                                   f"shared ones: {', '.join(numeric)}")
        return list(asked)
    chosen = [m for m in DEFAULT_METRICS.get(experiment, ()) if m in numeric] or numeric[:3]
    if not chosen:
        raise click.UsageError("the runs share no numeric column to compare")
    return chosen


def side_by_side(tables: list[pd.DataFrame], labels: list[str], keys: list[str], metrics: list[str]) -> pd.DataFrame:
    """One row per (keys, metric): each run's value (mean over rows with those keys) and its ratio
    to the first run's (``ratio:<label>``; NaN for :data:`CONFIG_METRICS`); keys missing from a run
    give NaN."""
    per_run = []
    for t in tables:
        g = t.groupby(keys, sort=False)[metrics].mean() if keys else t[metrics].mean().to_frame().T
        per_run.append(g)
    index = per_run[0].index
    for g in per_run[1:]:
        index = index.append(g.index.difference(index))
    rows = []
    for key in index:
        for m in metrics:
            vals = [float(g[m].get(key, np.nan)) if key in g.index else np.nan for g in per_run]
            row = dict(zip(keys, key if isinstance(key, tuple) else (key,))) if keys else {}
            row["metric"] = m
            row.update({lab: v for lab, v in zip(labels, vals)})
            row.update({f"ratio:{lab}": v / vals[0] if vals[0] and m not in CONFIG_METRICS else np.nan
                        for lab, v in zip(labels[1:], vals[1:])})
            rows.append(row)
    return pd.DataFrame(rows)


def plot_compare(table: pd.DataFrame, labels: list[str], keys: list[str], path: Path, caption: str | None = None,
                 naming: dict[str, list[str]] | None = None) -> None:
    """One panel per measured metric: bars per key, one colour per run (the values of compare.csv),
    each bar labelled with its value; the :data:`CONFIG_METRICS` (P, H, B, M) as one table of values,
    under the run-naming keys (:func:`run_naming_keys`, e.g. each run's ``method``)."""
    from experiments.common.plotting import plt, save_figure, setup_style  # noqa: PLC0415  (Agg backend)

    setup_style()
    metrics = list(dict.fromkeys(table["metric"]))
    measured = [m for m in metrics if m not in CONFIG_METRICS]
    chosen = [m for m in metrics if m in CONFIG_METRICS]
    panels = len(measured) + bool(chosen)
    per = max(len(table) / max(len(metrics), 1), 1)
    fig, axes = plt.subplots(panels, 1, figsize=(max(6.0, 0.5 * per * len(labels) + 3), 3.2 * panels), squeeze=False)
    for ax, m in zip(axes[:, 0], measured):
        sub = table[table["metric"] == m]
        x = np.arange(len(sub))
        width = 0.8 / len(labels)
        for i, lab in enumerate(labels):
            bars = ax.bar(x + (i - (len(labels) - 1) / 2) * width, sub[lab].to_numpy(), width, label=lab)
            ax.bar_label(bars, fmt="%.4g", fontsize=7)
        ax.set_xticks(x, _row_names(sub, keys), rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(m)
        ax.set_title(f"{m} per {' / '.join(keys) or 'run'} (bars: runs compared)")
        ax.legend(fontsize=8)
    if chosen:
        ax = axes[-1, 0]
        sub = table[table["metric"].isin(chosen)]
        rows = [f"{CONFIG_METRICS[m]} ({m})" + (f" {name}" if keys else "") for m, name in
                zip(sub["metric"], _row_names(sub, keys))]
        cells = [[*(values[i] for values in (naming or {}).values()), *(_value(v) for v in sub[lab])]
                 for i, lab in enumerate(labels)]
        rows = [*(naming or {}), *rows]
        ax.axis("off")
        ax.table(cellText=np.array(cells).T.tolist(), rowLabels=rows, colLabels=labels, loc="center")
        ax.set_title("configuration chosen (values, not ratios)")
    save_figure(fig, path, caption=caption)


def _row_names(sub: pd.DataFrame, keys: list[str]) -> list[str]:
    return [" / ".join(str(v) for v in r) for r in sub[keys].itertuples(index=False)] if keys else ["all"] * len(sub)


def _value(v) -> str:
    return "-" if pd.isna(v) else str(int(v)) if float(v).is_integer() else f"{v:.4g}"


@click.command("compare")
@click.argument("runs", nargs=-1, type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--metrics", default=None, help="Comma list of numeric columns to compare (default: the "
                                              "experiment's headline metrics).")
@click.option("--labels", default=None, help="Comma list of names for the runs (default: folder names).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder (default runs/compare/<experiment>-<hash>/).")
def compare(runs, metrics, labels, out):
    """Compare two or more result folders of the same experiment side by side."""
    if len(runs) < 2:
        raise click.UsageError("give at least two result folders")
    loaded = [load_run(Path(r)) for r in runs]
    experiments = {rec.get("experiment") for rec, _ in loaded}
    if len(experiments) != 1:
        raise click.UsageError(f"the folders hold different experiments: {sorted(map(str, experiments))}")
    experiment = experiments.pop()
    names = [s.strip() for s in labels.split(",")] if labels else [Path(r).name or str(r) for r in runs]
    if len(names) != len(runs) or len(set(names)) != len(names):
        raise click.UsageError(f"--labels needs {len(runs)} distinct names, got {names}")
    choice, pick = ROW_CHOICE.get(experiment, (None, None))
    tables = [t if pick is None else pick(t) for _, t in loaded]
    keys = key_columns(tables)
    naming = run_naming_keys(tables, keys)
    keys = [k for k in keys if k not in naming]
    partial = check_shared_rows(tables, names, keys)
    chosen = choose_metrics(experiment, tables, tuple(m.strip() for m in metrics.split(",")) if metrics else ())
    table = side_by_side(tables, names, keys, chosen)
    diffs = {lab: differing_keys(loaded[0][0].get("config"), rec.get("config"), depth=4)
             for lab, (rec, _) in zip(names[1:], loaded[1:])}
    config = {"experiment": experiment, "runs": [str(Path(r).resolve()) for r in runs], "labels": names,
              "metrics": chosen, "keys": keys, "run_naming_keys": naming}
    out = out or RUNS_ROOT / "compare" / f"{experiment}-{stable_hash(config)[:10]}"
    run = ExperimentRun("compare", config, out_dir=out, quiet=True)
    caption = "\n".join(f"{lab}: {run_caption(rec['config'])}" for lab, (rec, _) in zip(names, loaded))
    paths = run.finish(table, plot=lambda d, p: plot_compare(d, names, keys, p, caption, naming),
                       extra={"config_differences": diffs})
    for lab, keys_ in diffs.items():
        click.echo(f"{lab} vs {names[0]}: config differs in {', '.join(keys_) if keys_ else 'nothing'}")
    for c, vals in naming.items():
        click.echo(f"{c} differs per run ({', '.join(f'{lab}: {v}' for lab, v in zip(names, vals))}): rows matched on "
                   f"{', '.join(keys) or 'nothing else'}")
    if partial:
        click.echo(f"{partial} ({', '.join(keys)}) row(s) are missing from some run: NaN there")
    if choice:
        click.echo(f"{experiment}: compared rows are {choice}")
    with pd.option_context("display.width", 200, "display.max_columns", 50, "display.max_rows", 500):
        click.echo(f"{experiment}: each run's value (mean over rows with the same keys) and ratio:<run> = "
                   f"run / {names[0]}")
        click.echo(table.to_string(index=False, float_format=lambda v: str(int(v)) if float(v).is_integer() else f"{v:.4g}"))
    click.echo(f"wrote {paths['csv']}, {paths.get('png')}, {paths['run']}")
