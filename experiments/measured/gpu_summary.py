"""`libra-bench gpu-summary`: ``summary.md`` of a device run (``scripts/gpu_check.sh``).

Every figure the steps measured, read from the ``run.json`` of each step folder (``calibrate``,
``kernel-sweep``, ``sim-check``, ``fidelity`` and ``fidelity-<backend>``, ``tile-overhead``; a step
that did not finish is listed as missing), the code fingerprint the steps ran (against this
checkout's), and, for each ``straggler-*`` folder beside them (``make fig12-h200``: Figure 12
simulated with the measured profile), each method's speedup and ``libra-adaptive``'s gain over
``libra`` under that profile against the same workload's run with the default profile under
``--results``. One function per section.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import pandas as pd

from experiments.measured.gpu_common import sim_check_verdict

ENV_KEYS = ("name", "device", "driver", "torch", "cuda", "kernel_backend", "kernel_version", "flash_attn", "triton",
            "capability", "multiprocessors", "memory_gib", "python")


def read_run(folder: Path) -> dict | None:
    """A step folder's ``run.json``, or None when the step did not finish."""
    path = Path(folder) / "run.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def environment_section(runs: list[dict | None], status: dict) -> list[str]:
    env = next((r.get("environment_device") for r in runs if r), None)
    lines = []
    if env:
        lines += ["## Environment", ""] + [f"- {k}: {env[k]}" for k in ENV_KEYS if env.get(k) is not None] + [""]
    if status:
        lines += ["## Steps", ""] + [f"- {k}: {v}" for k, v in status.items()] + [""]
    return lines


def calibrate_section(cal: dict | None) -> list[str]:
    lines = ["## Figure 5 (calibrate): throughput normalised to the best of each curve", ""]
    if not cal:
        return lines + ["missing (calibrate did not finish)", ""]
    s = cal["summary"]
    for curve, label in (("heads", "query heads per call"), ("length", "block (document) length, tokens")):
        fw, bw = s["figure5"][curve]["fwd"], s["figure5"][curve]["bwd"]
        lines += [f"{label} ({s['backend']}, {s['dtype']}):", "", "| x | fwd | bwd |", "|---|---|---|"]
        lines += [f"| {x} | {fw[x]:.3f} | {bw.get(x, float('nan')):.3f} |" for x in fw]
        lines.append("")
    f = s["fit"]
    lines.append(f"Fitted kernel model: rate_inf {f['rate_inf_tflops']:.4g} TFLOP/s, half_length "
                 f"{f['half_length']:.4g}, exponent {f['exponent']:.3g} (worst fit error "
                 f"{f['length_fit_max_rel_err']:.2%}), heads_half {f['heads_half']:.4g}, launch "
                 f"{f['launch_ms']:.4g} ms, bwd/fwd {f['backward_time_ratio']:.3f}.")
    if f.get("piece_median_abs_err"):
        errs = ", ".join(f"{r} {e:.1%}" for r, e in f["piece_median_abs_err"].items())
        lines.append(f"Late pieces of a document (piece sweep), median |error| per pricing rule: {errs}; the "
                     f"profile keeps `{f['piece_pricing']}` (docs/profile.md).")
    if f.get("device_copy_gbps") is not None:
        lines.append(f"Device-to-device copy: {f['device_copy_gbps']:.4g} GB/s (bytes copied per second on one "
                     "device; a memory figure, not a link).")
    return lines + [f"Profile: `{s['profile']}`", ""]


def sweep_section(sweep: dict | None) -> list[str]:
    lines = ["## Throughput against heads per call (kernel-sweep)", ""]
    if not sweep:
        return lines + ["missing (kernel-sweep did not finish)", ""]
    s = sweep["summary"]
    lines += [f"{s['backend']}, {s['dtype']}, {s['multiprocessors']} SMs; raw per-call rows in `kernel_sweep.csv`. "
              "heads_half c of h(n) = n / (n + c) per segment length (normalised at the most heads measured; "
              "c = 0: no heads effect), and the throughput of the fewest heads relative to the most:", "",
              "| layout | length | pass | c | worst fit error | fewest-heads ratio |", "|---|---|---|---|---|---|"]
    for r in s["heads_half_by_length"]:
        lines.append(f"| {r['layout']} | {r['length']} | {r['pass']} | {r['heads_half']:.3g} | "
                     f"{r['worst_rel_err']:.1%} | {r['min_heads_ratio']:.3f} ({r['min_heads']} vs "
                     f"{r['reference_heads']}) |")
    lines.append("")
    for pas, j in s["joint_heads_half"].items():
        lines.append(f"- one c over every single-document length ({pas}): {j['heads_half']:.4g} (median |error| "
                     f"{j['median_rel_err']:.1%} over {j['points']} points)")
    for m in s["mixed"]:
        lines.append(f"- mixed call ({m['length']} tokens + short documents, {m['heads']} heads, {m['pass']}): "
                     f"{m['ratio']:.3f} x its parts run alone")
    if s["skipped"]:
        lines.append(f"- skipped for the time budget ({s['budget_s']} s): "
                     + ", ".join(f"{k['layout']} {k['length']}x{k['heads']}" for k in s["skipped"]))
    return lines + [""]


def sim_check_section(sim: dict | None) -> list[str]:
    lines = ["## Simulator vs measurement (sim-check): per-worker compute time", ""]
    if not sim:
        return lines + ["missing (sim-check did not finish)", ""]
    s = sim["summary"]
    lines += [f"- profile: {s['profile']}; workers compared: {s['workers']}",
              f"- median |error|: {s['median_abs_err_total']:.1%} (fwd {s['median_abs_err_fwd']:.1%}, bwd "
              f"{s['median_abs_err_bwd']:.1%}); target <= 10%: {sim_check_verdict(s)}",
              f"- worst |error|: {s['worst_abs_err_total']:.1%} (fwd {s['worst_abs_err_fwd']:.1%}, bwd "
              f"{s['worst_abs_err_bwd']:.1%})",
              f"- mean signed error: {s['mean_signed_err_total']:+.1%}; straggler worker agrees in "
              f"{s['straggler_worker_agrees']}"]
    if "median_abs_err_other_rule" in s:
        lines.append(f"- piece pricing: the profile's `{s['piece_pricing']}`; under `{s['other_rule']}` the "
                     f"median |error| would be {s['median_abs_err_other_rule']:.1%}")
    return lines + [""]


def fidelity_section(fids: dict[str, dict]) -> list[str]:
    """One table per backend (``fidelity`` is the backend every step ran, ``fidelity-<name>`` the others)."""
    lines = ["## Numerical fidelity and backend parity (fidelity): max error / max error of bf16 plain PyTorch", ""]
    if not fids:
        return lines + ["missing (fidelity did not finish)", ""]
    for folder, fid in fids.items():
        s = fid["summary"]
        lines += [f"`{folder}/`: backend {s['backend']}, {s['dtype']} vs {s['ref_dtype']} reference; limits: forward "
                  f"{s['fwd_limit']}x, gradients {s['grad_limit']}x", "", "| level.quantity | worst ratio |",
                  "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in sorted(s["worst_ratio"].items())]
        lines += ["", f"All within limits: {s['all_passed']}; all within 2x: {s['all_within_2x']}", ""]
    return lines


def tile_section(tile: dict | None) -> list[str]:
    lines = ["## Tiles against one varlen call (tile-overhead)", ""]
    if not tile:
        return lines + ["missing (tile-overhead did not finish)", ""]
    s = tile["summary"]
    lines += [f"Setting {s['setting']}, profile {s['profile']}; fwd + bwd of one worker (the most FLOPs); goal: "
              f"runtime / one call <= {s['target_ratio']}", "",
              "| method | worker | calls | runtime / one call | kernel calls / one call | one call (ms) | cost model vs calls |",
              "|---|---|---|---|---|---|---|"]
    for method, m in s["methods"].items():
        lines.append(f"| {method} | {m['worker']} | {m['calls']} | {m['runtime_ratio']:.3f} | {m['calls_ratio']:.3f} | "
                     f"{m['one_call_ms']:.4g} | {m['model_err_calls']:+.1%} |")
    return lines + [""]


def provenance_section(runs: list[dict | None]) -> list[str]:
    """The code the steps ran, by fingerprint (a device's copy of the repository may carry another
    commit's ``.git``, so the recorded git SHA can name the wrong commit)."""
    from experiments.common.runner import code_fingerprint  # noqa: PLC0415

    prints = sorted({r.get("code_fingerprint") for r in runs if r and r.get("code_fingerprint")})
    if not prints:
        return []
    here = code_fingerprint()
    same = "the same code as this checkout" if prints == [here] else f"this checkout's is {here}"
    shas = sorted({(r.get("environment") or {}).get("git_sha", "?")[:12] for r in runs if r})
    return ["## Code", "", f"Steps ran code fingerprint {', '.join(prints)} ({same}); their run records name git "
            f"{', '.join(shas)}.", ""]


def _default_counterpart(sources, workload: str, profile: str):
    """The latest default-profile straggler run of ``workload`` with ``libra`` and ``libra-adaptive``."""
    from experiments.common.report import latest  # noqa: PLC0415

    def fits(src) -> bool:
        methods = src.config.get("methods") or []
        return (src.workload == workload and src.profile_name == profile and src.config.get("jitter", True)
                and not src.config.get("known_speeds", False) and "libra" in methods and "libra-adaptive" in methods)

    return latest(sources, "straggler", fits)


def profile_section(out_dir: Path, results: Path | None) -> list[str]:
    """Figure 12 simulated with the measured profile (``straggler-*`` folders) against the default profile."""
    from experiments.common.report import Source, discover  # noqa: PLC0415
    from libra.sim.profiles import DEFAULT_PROFILE  # noqa: PLC0415

    runs = sorted(p for p in out_dir.glob("straggler-*") if (p / "run.json").exists())
    if not runs:
        return []
    others = discover(results)[0] if results is not None and Path(results).is_dir() else []
    lines = ["## Figure 12 simulated with this profile (make fig12-h200)", "",
             f"Mean-straggler speedup over Ulysses, each method planned and scored with the profile named; "
             f"`libra-adaptive` / `libra` is the extension's gain (its planner prices candidates with the same "
             f"profile that scores it). Default: {DEFAULT_PROFILE}.", "",
             "| workload | setting | profile | libra | libra-adaptive | libra-adaptive / libra | source |",
             "|---|---|---|---|---|---|---|"]
    for folder in runs:
        src = Source("straggler", folder, read_run(folder), str(folder))
        pairs = [(src, src.profile_name)]
        dflt = _default_counterpart(others, src.workload, DEFAULT_PROFILE)
        if dflt is not None:
            pairs.append((dflt, DEFAULT_PROFILE))
        for run, name in pairs:
            t = pd.read_csv(run.folder / "straggler_summary.csv").set_index(["setting", "method"])
            for st in dict.fromkeys(k[0] for k in t.index):
                lib, ada = t.loc[(st, "libra")], t.loc[(st, "libra-adaptive")]
                lines.append(f"| {src.workload} | {st} | {name} | {lib['mean_speedup']:.2f}x | {ada['mean_speedup']:.2f}x "
                             f"| {lib['mean_ms'] / ada['mean_ms']:.3f} | `{run.label}` |")
    return lines + [""]


def gpu_summary_markdown(out_dir, status: dict | None = None, title: str = "GPU check",
                         results: str | Path | None = None) -> str:
    """``summary.md`` of a device run (module docstring).

    Args:
        out_dir: folder holding the step folders.
        status: optional ``{step: "ok (40s)" | "FAILED ..." | ...}`` from the driver script.
        results: the results tree holding the default-profile runs the profile section compares with.
    """
    out_dir = Path(out_dir)
    cal, sweep, sim, tile = (read_run(out_dir / s) for s in ("calibrate", "kernel-sweep", "sim-check", "tile-overhead"))
    folders = ["fidelity"] + sorted(p.name for p in out_dir.glob("fidelity-*") if p.is_dir())
    fids = {f: r for f in folders if (r := read_run(out_dir / f))}
    steps = [cal, sweep, sim, *fids.values(), tile]
    lines = [f"# {title}", ""] + environment_section(steps, status or {}) + provenance_section(steps)
    for section in (calibrate_section(cal), sweep_section(sweep), sim_check_section(sim), fidelity_section(fids),
                    tile_section(tile), profile_section(out_dir, results)):
        lines += section
    log = (out_dir / "gpu_check.log").read_text() if (out_dir / "gpu_check.log").exists() else ""
    for said, note in (("rich missing", "rich was not installed; a no-op progress stand-in was used."),
                       ("numba hidden", "numba was hidden from the steps; planning ran on the numpy paths (the same "
                                        "plans).")):
        if said in log:
            lines += [f"Note: {note}", ""]
    for name in ("preflight.txt", "env.txt"):
        if (out_dir / name).exists():
            lines += [f"## {name}", "", "```", (out_dir / name).read_text().rstrip(), "```", ""]
    return "\n".join(lines)


def read_status(path: Path | None) -> dict:
    """``{step: status}`` from the driver script's ``steps.tsv`` (tab-separated), empty without one."""
    if path is None or not Path(path).exists():
        return {}
    return dict(line.split("\t", 1) for line in Path(path).read_text().splitlines() if "\t" in line)


@click.command("gpu-summary")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--title", default=None, help="heading (default: 'GPU check (<folder name>)')")
@click.option("--results", type=click.Path(file_okay=False), default="results", show_default=True,
              help="results tree with the default-profile Figure 12 runs the profile section compares with")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="markdown file (default FOLDER/summary.md)")
def gpu_summary(folder, title, results, out):
    """Write FOLDER/summary.md from a device run's step folders (scripts/gpu_check.sh calls this; rerun it
    after adding straggler-* runs with the measured profile)."""
    from experiments.common.runner import atomic_write_text  # noqa: PLC0415

    folder = Path(folder)
    text = gpu_summary_markdown(folder, read_status(folder / "steps.tsv"), title or f"GPU check ({folder.name})",
                                results)
    path = atomic_write_text(Path(out) if out else folder / "summary.md", text)
    click.echo(f"wrote {path}")
