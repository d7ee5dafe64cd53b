"""`libra-bench fit-links`: fit one link class's bandwidth of a profile to a target communication share.

The metric is exactly what `libra-bench pool-sweep` reports as ``comm_norm``: the straggler
communication of ``libra-tap-vrsp`` at one (setting, P), divided by Ulysses' mean straggler, on the
same windows. Windows are planned once (planning never reads the profile) and re-priced per
candidate bandwidth (:mod:`experiments.common.link_fit`, deterministic bisection on log-bandwidth).

Default use (``make paper-inferred``) derives ``libra/sim/profiles/paper-inferred-v1.json``:
``h100-roce-v1`` with the inter-supernode bandwidth fitted to ONE paper number (Libra sec. 6.5,
Figure 15: at 256K, TAP+VRSP's communication at P = 32 is 0.77 of Ulysses' mean). Users can fit
the same way to a number they measured on their own cluster. The profile's ``source`` records the
procedure; ``fit_log.json`` in ``--out`` records every probe and the per-supernode crossing traffic.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import click

from experiments.common.options import overwrite_option, quick_option
from experiments.common.runner import RESULTS_ROOT, RUNS_ROOT, atomic_write_text, overwrite_flag, stable_hash
from experiments.common.sim_common import (
    SETTINGS,
    jitter_seed,
    load_windows,
    make_planner,
    make_shape,
    resolve_profile,
)

BRACKET = (0.5, 50.0)  # GB/s per GPU searched; the metric must fall monotonically across it


@dataclass(frozen=True)
class LinkFit:
    """One fit's options; the defaults are the fit ``make paper-inferred`` runs (Libra Fig. 15's
    0.77 at 256K, P = 32).

    Attributes:
        base_profile: profile name or JSON file to start from.
        name: name of the fitted profile.
        link: link class whose bandwidth is fitted.
        target: target communication share (> 0).
        setting: paper setting (a key of :data:`~experiments.common.sim_common.SETTINGS`).
        pool_size: pool size ``P`` of the target point.
        workload: length preset or file.
        windows: GBS windows the metric averages over.
        seed: seed of the length stream.

    Raises:
        ValueError: a target not > 0, no window, or an unknown setting.
    """

    base_profile: str = "h100-roce-v1"
    name: str = "paper-inferred-v1"
    link: str = "inter_supernode"
    target: float = 0.77
    setting: str = "256k"
    pool_size: int = 32
    workload: str = "libra-prod"
    windows: int = 4
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.target:
            raise ValueError(f"target must be > 0, got {self.target}")
        if self.windows < 1:
            raise ValueError(f"windows must be >= 1, got {self.windows}")
        if self.setting not in SETTINGS:
            raise ValueError(f"unknown setting {self.setting!r}; choose one of {sorted(SETTINGS)}")


PAPER_FIT = LinkFit()
"""The fit ``make paper-inferred`` runs (every option's default). Only this fit writes into the
package's profiles (``libra/sim/profiles/paper-inferred-v1.json``) and ``results/fit-links`` by
default; any other -- ``--quick``, another target, your own cluster's number -- writes under
``runs/fit-links/<name>-<hash of the options>`` unless told where, so an ad-hoc fit never replaces
the committed profile that the paper-inferred results were computed with."""


def fit_profile(fit: LinkFit, digits: int = 2) -> tuple[dict, dict]:
    """Fit ``fit.link``'s bandwidth; returns ``(profile dict, log dict)``.

    Raises:
        ValueError: unknown link, a pool size not dividing DP (from the planner's layout check), or
            a target the bracket cannot reach (:func:`experiments.common.link_fit.bisect_bandwidth`).
    """
    from experiments.common.link_fit import (  # noqa: PLC0415
        bisect_bandwidth,
        comm_share,
        crossing_traffic,
        with_link_bandwidth,
    )
    from libra.sim.cost import CostModel  # noqa: PLC0415
    from libra.sim.topology import Topology  # noqa: PLC0415

    base_name, name, link, target, setting = fit.base_profile, fit.name, fit.link, fit.target, fit.setting
    pool_size, workload, windows, seed = fit.pool_size, fit.workload, fit.windows, fit.seed
    base = resolve_profile(base_name)
    if link not in base.links:
        raise ValueError(f"profile {base.name!r} has no link class {link!r}; it has {sorted(base.links)}")
    st = SETTINGS[setting]
    par = st.par()
    shape = make_shape(32, 4, 128)
    wins = load_windows(workload, st, windows, seed)
    method_plans = [make_planner("libra-tap-vrsp", st, pool_size=pool_size).plan_window(w, par, shape) for w in wins]
    base_plans = [make_planner("ulysses", st).plan_window(w, par, shape) for w in wins]
    seeds = [jitter_seed(seed, w) for w in range(windows)]

    def metric(bw: float) -> float:
        return comm_share(with_link_bandwidth(base, link, bw), par, method_plans, base_plans, seeds)

    found = bisect_bandwidth(metric, target, *BRACKET, rel_tol=1e-4)
    bw = round(found.bandwidth_gbps, digits)
    at_bw, at_base = metric(bw), metric(base.links[link].bandwidth_gbps)
    topo = Topology(base, par)
    cm = CostModel(base, topo)
    crossing = [row | {"window": w, "step": int(plan.ga_index)} for w, plans in enumerate(method_plans)
                for plan in plans for row in crossing_traffic(cm.price(plan), topo)]
    senders = [r["senders"] for r in crossing] or [0]
    procedure = (
        f"{link}.bandwidth_gbps FITTED (everything else copied from {base.name}) by `libra-bench fit-links`: "
        f"bisection on log-bandwidth over [{BRACKET[0]}, {BRACKET[1]}] GB/s of ONE number: libra-tap-vrsp's "
        f"straggler communication / Ulysses' mean straggler = {target} at setting {setting}, P = {pool_size} "
        f"(pool-sweep's comm_norm), workload {workload}, {windows} windows, seed {seed}, 32 q / 4 KV heads, "
        f"head_dim 128. Result {found.bandwidth_gbps:.4f} GB/s, stored as {bw} GB/s, where the metric is "
        f"{at_bw:.4f} ({base.name}'s {base.links[link].bandwidth_gbps} GB/s gives {at_base:.4f}). In these plans "
        f"{min(senders)}-{max(senders)} GPUs per supernode send across at once, so a shared-uplink term (capacity / "
        "concurrent senders) would change per-GPU rates by little; only the bandwidth is fitted. An inference from "
        "the target number, not a measurement of any cluster.")
    data = base.to_dict()
    data.update(name=name, version=1,
                description=(f"INFERRED, not public facts: {base.name} with the {link} bandwidth fitted to a "
                             f"communication share of {target} ({setting}, P={pool_size}); use {base.name} for the "
                             "public-fact default"))
    data["links"][link]["bandwidth_gbps"] = bw
    source = dict(base.source)
    source["links"] = (f"as {base.name}: " + str(base.source.get("links", "")) +
                       f" -- EXCEPT {link} bandwidth, fitted (see {link}_fit)")
    source[f"{link}_fit"] = procedure
    source["derived_from"] = base.name
    data["source"] = source
    log = {"base": base.name, "link": link, "target": target, "setting": setting, "pool_size": pool_size,
           "method": "libra-tap-vrsp", "workload": workload, "windows": windows, "seed": seed,
           "bracket": list(BRACKET), "fit": found.to_dict(), "stored_bandwidth_gbps": bw,
           "metric_at_stored": at_bw, f"metric_at_{base.name}": at_base, "crossing_traffic_per_supernode": crossing}
    return data, log


def default_paths(fit: LinkFit, quick: bool) -> tuple[Path, Path]:
    """``(profile JSON, fit-log folder)`` of ``fit`` (run with ``--quick`` or not)."""
    from libra.sim.profiles import PROFILE_DIR  # noqa: PLC0415

    if fit == PAPER_FIT and not quick:
        return PROFILE_DIR / f"{fit.name}.json", RESULTS_ROOT / "fit-links"
    folder = RUNS_ROOT / "fit-links" / f"{fit.name}-{stable_hash({**asdict(fit), 'quick': quick})[:10]}"
    return folder / f"{fit.name}.json", folder


def _write_profile(path: Path, text: str, overwrite: bool) -> None:
    """Write ``text`` to ``path`` atomically -- refused (one line) when ``path`` holds another profile
    and ``overwrite`` is not set."""
    if path.is_file() and path.read_text() != text and not overwrite:
        raise click.UsageError(f"{path} holds another profile; pass --overwrite to replace it, or --out-profile "
                               "another file")
    atomic_write_text(path, text)


def _check_name(_ctx, _param, value: str) -> str:
    """A profile name is one file-name component: it names ``<name>.json`` and its folder under
    ``runs/fit-links``, so a separator or ``..`` would write the profile outside them."""
    if not value or value.startswith(".") or any(sep in value for sep in ("/", "\\", "\0")):
        raise click.BadParameter(f"{value!r} is not a plain name: no path separators, no leading '.', no '..' "
                                 "(use --out-profile to choose where the profile goes)")
    return value


@click.command("fit-links")
@click.option("--base-profile", default=PAPER_FIT.base_profile, show_default=True,
              help="Profile name or JSON file to start from.")
@click.option("--name", default=PAPER_FIT.name, show_default=True, callback=_check_name,
              help="Name of the fitted profile (a plain name: its file is <name>.json).")
@click.option("--link", default=PAPER_FIT.link, show_default=True, help="Link class whose bandwidth is fitted.")
@click.option("--target", type=float, default=PAPER_FIT.target, show_default=True,
              help="Target communication share (Libra Fig. 15: 0.77 at 256K, P=32).")
@click.option("--setting", default=PAPER_FIT.setting, show_default=True, help="Paper setting (256k or 1m).")
@click.option("--pool-size", type=int, default=PAPER_FIT.pool_size, show_default=True,
              help="Pool size P of the target point.")
@click.option("--workload", default=PAPER_FIT.workload, show_default=True, help="Length preset or file.")
@click.option("--windows", type=click.IntRange(min=1), default=PAPER_FIT.windows, show_default=True,
              help="GBS windows each pool-sweep point averages over.")
@click.option("--seed", type=click.IntRange(min=0), default=PAPER_FIT.seed, show_default=True,
              help="Seed of the length stream.")
@quick_option("One window (a smoke run; the fit is then noisier).")
@click.option("--out-profile", type=click.Path(dir_okay=False), default=None,
              help="Where to write the profile JSON [default: libra/sim/profiles/<name>.json for the paper's fit "
                   "(all defaults), else runs/fit-links/<name>-<hash of the options>/<name>.json].")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder for fit_log.json [default: results/fit-links for the paper's fit, else the profile's "
                   "folder under runs/fit-links].")
@overwrite_option()
def fit_links(base_profile, name, link, target, setting, pool_size, workload, windows, seed, quick, out_profile, out):
    """Fit one link class's bandwidth so pool-sweep's communication share hits a target."""
    from libra.sim.profiles import load_profile  # noqa: PLC0415

    try:
        fit = LinkFit(base_profile, name, link, target, setting, pool_size, workload, windows, seed)
        profile_path, log_dir = default_paths(fit, quick)
        data, log = fit_profile(replace(fit, windows=1) if quick else fit)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    path = Path(out_profile) if out_profile else profile_path
    _write_profile(path, json.dumps(data, indent=2) + "\n", overwrite_flag())
    load_profile(path)  # validates what was written
    atomic_write_text(Path(out or log_dir) / "fit_log.json", json.dumps(log, indent=2) + "\n")
    base_share = log[f"metric_at_{log['base']}"]
    click.echo(f"fitted {link} bandwidth {log['fit']['bandwidth_gbps']:.4f} GB/s -> stored "
               f"{log['stored_bandwidth_gbps']} GB/s; share {log['metric_at_stored']:.4f} (target {target}; "
               f"{log['base']} gives {base_share:.4f}); wrote {path}")
