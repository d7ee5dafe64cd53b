"""Shared helpers of the simulated core-attention experiments (Figures 3, 12, 15).

* :data:`SETTINGS`: the paper's two isolated core-attention settings (Libra sec. 6.3).
* :func:`make_planner`: registry planner with the setting's TAP layout (its TapConfig) and a P override;
  :func:`with_tap` applies the commands' TAP options (:func:`experiments.common.options.tap_options`).
* :func:`load_windows`: GBS windows of fixed-token packed sequences from a preset or a file.
* WLB-LLM defaults to ``rejoin="none"`` (:data:`WLB_REJOIN_DEFAULT`): it repacks the causal
  segments every other method computes, so all methods do the same attention work.
* :func:`build_cost_model`: profile + topology + cost model for a layout.
* ``--score-profile`` (:func:`score_profile_option`, :func:`resolve_score_profile`): plan with
  ``--profile``, price (cost model and device jitter) with another profile.
* Click options shared by these commands (``--profile``, ``--workload``, ``--windows``, ``--seed``,
  ``--out``, ``--quick``, ``--force``, ``--overwrite``, head-shape overrides).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import click
import numpy as np

from experiments.common.options import jobs_option, overwrite_option, quick_option, size_text
from libra.config import ParallelConfig, TapConfig
from libra.sim.cost import CostModel
from libra.sim.profiles import DEFAULT_PROFILE, HardwareProfile, load_profile
from libra.sim.topology import Topology
from libra.workload import AttentionShape

METHODS = ("ulysses", "ulysses-sorted", "wlb-llm", "dynamic-cp", "distca-paper", "distca", "libra-tap",
           "libra-tap-vrsp", "libra")
"""Planner registry names of the default Figure 12 run: the paper's six in its order (its DistCA is
``distca-paper``, the paper's emulation) plus ``ulysses-sorted`` (not in the paper: Ulysses with the
window sorted across GA steps, which separates the gain of cross-step sorting from the gain of
pooling), ``dynamic-cp`` (Megatron Core's dynamic context parallelism) and ``distca`` (DistCA's own
planning algorithm)."""

OPTIONAL_METHODS = ("libra-kt", "libra-adaptive")
"""Registry planners beyond the paper's six that ``--methods`` accepts but no default list runs:
``libra-kt`` is Libra full with kernel-time-aware TAP placement, ``libra-adaptive`` picks per pool
the fastest of Alg. 2 and adaptive tilings/placements, then of the Pipeliner's head-sliced and
tile-grouped chunks, under the cost model (extensions, not in the
paper; both plan with the run's ``--profile``, which :func:`planner_options` passes them)."""

LABELS = {"ulysses": "Ulysses", "ulysses-sorted": "Ulysses (sorted)", "wlb-llm": "WLB-LLM",
          "dynamic-cp": "Dynamic CP (Megatron)", "distca-paper": "DistCA (paper's emulation)", "distca": "DistCA",
          "libra-tap": "Libra (TAP)", "libra-tap-vrsp": "Libra (TAP+VRSP)", "libra": "Libra (full)",
          "libra-kt": "Libra (kernel-time TAP)", "libra-adaptive": "Libra (adaptive)"}

TAP_METHODS = ("libra-tap", "libra-tap-vrsp", "libra", "libra-kt")


@dataclass(frozen=True)
class Setting:
    """One isolated core-attention setting (Libra sec. 6.3).

    Attributes:
        name: ``256k`` or ``1m``.
        dp, cp, gbs, seq_len: parallel layout (PP = 1).
        tap: Libra's TAP layout (P, B, H as in sec. 6.3; tau, M and the rest TapConfig's defaults).
    """

    name: str
    dp: int
    cp: int
    gbs: int
    seq_len: int
    tap: TapConfig = field(default_factory=TapConfig)

    def par(self) -> ParallelConfig:
        return ParallelConfig(dp=self.dp, cp=self.cp, gbs=self.gbs, seq_len=self.seq_len)


PAPER_SEQ_LEN = {"256k": 256 * 1024, "1m": 1024 * 1024}
PAPER_TAP = {"256k": TapConfig(block_size=4096, head_split=2), "1m": TapConfig(block_size=8192, head_split=2)}
"""Libra sec. 6.3's TAP layout per setting: B = 4096 / 8192, H = 2, M = TapConfig's default (4). Each
experiment keeps its own DP x CP layout and pool size (:func:`paper_setting`)."""


def paper_setting(name: str, dp: int, cp: int, gbs: int, pool_size: int) -> Setting:
    """The paper's setting ``name`` (``256k`` / ``1m``: S and :data:`PAPER_TAP`) in an experiment's own
    layout (``dp``, ``cp``, ``gbs``) with pool size ``pool_size``."""
    return Setting(name, dp=dp, cp=cp, gbs=gbs, seq_len=PAPER_SEQ_LEN[name],
                   tap=replace(PAPER_TAP[name], pool_size=pool_size))


SETTINGS: dict[str, Setting] = {"256k": paper_setting("256k", dp=32, cp=8, gbs=128, pool_size=8),
                                "1m": paper_setting("1m", dp=16, cp=16, gbs=32, pool_size=8)}


def largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is at most ``cap`` (a pool size P that fits DP = ``n``)."""
    return max(p for p in range(1, min(cap, n) + 1) if n % p == 0)


def custom_setting(dp: int, cp: int, seq_len: int, gbs: int) -> Setting:
    """A user's layout as a :class:`Setting` named ``dp{DP}-cp{CP}-s{S}-gbs{GBS}``: TapConfig's
    defaults except P = the largest divisor of DP up to 8 (the paper's pool size where it fits);
    the TAP options (``--pool-size``, ``--block-size``, ...) override them.

    Raises:
        ValueError: a non-positive size, DP not dividing GBS or CP not dividing S.
    """
    par = ParallelConfig(dp=dp, cp=cp, gbs=gbs, seq_len=seq_len)  # checks the layout rules
    if par.seq_len % par.cp:
        raise ValueError(f"CP={cp} must divide the sequence length S={seq_len}")
    pool = largest_divisor(dp, 8)
    return Setting(f"dp{dp}-cp{cp}-s{size_text(seq_len)}-gbs{gbs}", dp=dp, cp=cp, gbs=gbs, seq_len=seq_len,
                   tap=TapConfig(pool_size=pool))


@dataclass(frozen=True, kw_only=True)
class SimulatedRunConfig:
    """What every simulated command over paper settings takes: the workload, the hardware profile,
    the settings (names of :data:`SETTINGS` or :class:`Setting` objects), windows and seed, the
    TapConfig fields replacing every setting's (``tap_overrides``; None values keep the setting's),
    and the run folder with its ``--force`` / progress choices. Each command's config extends it."""

    workload: str
    profile: HardwareProfile
    settings: Sequence[str | Setting]
    windows: int
    seed: int
    out: str | None = None
    force: bool = False
    quiet: bool = False
    tap_overrides: dict | None = None
    score_profile: HardwareProfile | None = None

    @property
    def scoring(self) -> HardwareProfile:
        """The profile the cost model and the device jitter price with (``--score-profile``; None:
        the planning ``profile``)."""
        return self.score_profile or self.profile


def chosen_settings(settings, tap_overrides: dict | None = None) -> dict[str, Setting]:
    """``{name: Setting}`` of a run: paper setting names (:data:`SETTINGS`) or Setting objects (a
    user's layout, :func:`custom_setting`), each with the command's TAP options applied."""
    return {st.name: with_tap(st, **(tap_overrides or {}))
            for st in (SETTINGS[s] if isinstance(s, str) else s for s in settings)}


def check_settings(chosen: dict, shape, pool_sizes=None) -> None:
    """Every setting's TAP layout checked against its parallel layout and the head shape
    (:func:`libra.config.check_layout`: P | DP, B | S/CP, H | hq, M | hq/H) -- at each of
    ``pool_sizes`` that divides its DP when a command sweeps P, else at its own P -- before a run
    claims its folder, so a bad option leaves nothing behind.

    Raises:
        ValueError: naming the setting and the rule (``pool size P=3 must divide DP=32``).
    """
    from libra.config import check_layout  # noqa: PLC0415

    for name, st in chosen.items():
        sizes = [p for p in pool_sizes if st.dp % p == 0] if pool_sizes else [st.tap.pool_size]
        for p in sizes:
            try:
                check_layout(st.par(), replace(st.tap, pool_size=p), shape)
            except ValueError as exc:
                raise ValueError(f"setting {name}: {exc}") from exc


def settings_from_options(settings_text: str, layout: dict | None) -> list:
    """The settings a command runs: the user's layout (``layout``, from
    :func:`experiments.common.options.given_layout`) or the comma list of paper settings (case-insensitive).

    Raises:
        ValueError: an unknown setting name or an invalid layout.
    """
    if layout:
        return [custom_setting(**layout)]
    return list(parse_list(settings_text.lower(), tuple(SETTINGS), "setting"))


def with_tap(setting, **overrides):
    """``setting`` (any dataclass with a ``tap`` TapConfig) with the given TAP fields replaced;
    None values (TAP options not given on the command line) keep the setting's.

    Raises:
        ValueError: a value :class:`TapConfig` rejects.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(setting, tap=replace(setting.tap, **given)) if given else setting


def parse_list(text: str, allowed, what: str) -> tuple[str, ...]:
    """Comma-separated choices, validated (``ValueError`` names the bad entry and the choices)."""
    items = tuple(x.strip() for x in str(text).split(",") if x.strip())
    if not items:
        raise ValueError(f"empty {what} list {text!r}")
    for x in items:
        if x not in allowed:
            raise ValueError(f"unknown {what} {x!r}; choose from {', '.join(allowed)}")
    return items


def make_shape(q_heads: int, kv_heads: int, head_dim: int) -> AttentionShape:
    return AttentionShape(num_q_heads=q_heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=2)


WLB_REJOIN_DEFAULT = "none"
"""WLB-LLM's ``rejoin`` option in these experiments. Fixed-token packing cuts samples at sequence
boundaries and every piece is its own causal segment; that is the attention work Ulysses, DistCA
and Libra compute. ``"none"`` makes WLB-LLM repack exactly those segments (as the public code
repacks the documents its batches hold), so the straggler comparison is like for like;
``"context"``/``"full"`` re-join pieces into longer documents with more attention FLOPs than the
other methods compute for the same data (several times more at S = 256K with ~1M-token samples)."""


def planner_options(method: str, setting: Setting, pool_size: int | None = None,
                    wlb_rejoin: str = WLB_REJOIN_DEFAULT, profile=None) -> dict:
    """The flat record of ``method``'s options in ``setting`` that run configs store
    (:func:`baselines.registry.option_record`): the fields of the setting's TapConfig the planner
    takes (P override only affects Libra's variants), WLB-LLM's ``rejoin``, and ``profile`` for a
    planner that plans with one. A record only; :func:`make_planner` builds the planner."""
    from baselines.registry import option_record  # noqa: PLC0415  (keeps `--help` fast)

    return option_record(method, setting_tap(setting, pool_size), profile, **_own_options(method, wlb_rejoin))


def setting_tap(setting: Setting, pool_size: int | None = None) -> TapConfig:
    """The TapConfig ``setting`` plans with, at pool size ``pool_size`` (None: its own)."""
    return setting.tap if pool_size is None else replace(setting.tap, pool_size=pool_size)


def _own_options(method: str, wlb_rejoin: str) -> dict:
    return {"rejoin": wlb_rejoin} if method == "wlb-llm" else {}


def make_planner(method: str, setting: Setting, pool_size: int | None = None,
                 wlb_rejoin: str = WLB_REJOIN_DEFAULT, profile=None, **options):
    """The registry planner of ``method`` given ``setting``'s TapConfig whole (at pool size
    ``pool_size``), WLB-LLM's ``rejoin``, the run's ``profile`` (HardwareProfile or name; planners
    that plan with one, ``libra-kt`` and ``libra-adaptive``, must price with the run's) and the
    planner's own ``options`` (e.g. ``device_speeds``)."""
    from baselines.registry import get_planner  # noqa: PLC0415  (keeps `--help` fast)

    return get_planner(method, tap=setting_tap(setting, pool_size), profile=profile,
                       **_own_options(method, wlb_rejoin), **options)


def load_windows(workload: str, setting: Setting, n_windows: int, seed: int) -> list:
    """``n_windows`` GBS windows of ``setting`` from a preset name or a length file.

    Raises:
        ValueError: unknown workload or bad counts (from :func:`libra.data.windows.gbs_windows`).
    """
    from libra.data.windows import gbs_windows  # noqa: PLC0415

    return gbs_windows(workload, setting.seq_len, setting.gbs, n_windows, seed=seed)


def workload_record(workload: str) -> dict:
    """The workload's description plus the packing default, recorded in configs so that a changed
    preset or packing policy hashes to new points (never reuses stale cached ones).

    Raises:
        ValueError: unknown preset or unreadable file.
    """
    import inspect  # noqa: PLC0415

    from libra.data.source import resolve_workload  # noqa: PLC0415
    from libra.data.windows import gbs_windows  # noqa: PLC0415

    params = inspect.signature(gbs_windows).parameters
    packing = {k: params[k].default for k in ("policy", "lookahead") if k in params}
    return {**resolve_workload(workload).describe(), "packing": packing}


def build_cost_model(profile: HardwareProfile, par: ParallelConfig) -> CostModel:
    return CostModel(profile, Topology(profile, par))


def jitter_seed(seed: int, window: int) -> int:
    """Device-jitter seed of one window (same for every method of a comparison)."""
    return int(np.random.SeedSequence([int(seed), int(window)]).generate_state(1)[0])


def resolve_profile(profile: str, option: str = "--profile") -> HardwareProfile:
    """``--profile`` (or ``option``) value -> profile, as a click error on failure."""
    try:
        return load_profile(profile)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from exc


def score_profile_option():
    """``--score-profile``: the profile that prices the plans (the one declaration of the option)."""
    return click.option("--score-profile", default=None,
                        help="Score with this profile (cost model and device jitter; built-in name or .json "
                             "path) while planners plan with --profile. Default: the same as --profile.")


def resolve_score_profile(text: str | None, planned: HardwareProfile) -> HardwareProfile | None:
    """``--score-profile`` value -> the scoring profile, or None when it is not given or is the
    planning profile ``planned`` (then the run is the run without the option, byte for byte)."""
    if text is None:
        return None
    scoring = resolve_profile(text, "--score-profile")
    return None if scoring.to_dict() == planned.to_dict() else scoring


def score_record(score_profile: HardwareProfile | None) -> dict:
    """A config's ``score_profile`` entry: only when scoring differs from planning, so a run
    without it keeps its config (and run.json, point keys) as before."""
    return {} if score_profile is None else {"score_profile": score_profile.to_dict()}


def setting_record(setting: Setting) -> dict:
    return asdict(setting)


def common_options(default_windows: int, default_workload: str | None = "libra-prod", shape: bool = True):
    """Decorator adding the options every simulated experiment shares.

    ``shape=False`` leaves out ``--q-heads/--kv-heads/--head-dim`` for commands whose head shape
    defaults differ per setting (grid-search) and that declare them themselves.
    """

    def deco(fn):
        opts = [
            click.option("--profile", default=DEFAULT_PROFILE, show_default=True,
                         help="Hardware profile: a built-in name or a profile .json path."),
            click.option("--windows", type=int, default=default_windows, show_default=True,
                         help="GBS windows to simulate (results average over them)."),
            click.option("--seed", type=int, default=0, show_default=True,
                         help="Seed of the workload stream and the device jitter."),
            click.option("--out", type=click.Path(file_okay=False), default=None,
                         help="Output folder (default runs/<experiment>/<workload>-<layout>-<profile>/)."),
            quick_option("One window, for a smoke run (written under runs/ unless --out)."),
            click.option("--force", is_flag=True, help="Recompute cached points."),
            overwrite_option(),
            jobs_option(),
            click.option("--no-progress", is_flag=True, help="No progress bar."),
        ]
        if shape:
            opts[8:8] = [
                click.option("--q-heads", type=int, default=32, show_default=True, help="Query heads."),
                click.option("--kv-heads", type=int, default=4, show_default=True, help="KV heads."),
                click.option("--head-dim", type=int, default=128, show_default=True, help="Head width."),
            ]
        if default_workload is not None:
            opts.append(click.option("--workload", default=default_workload, show_default=True,
                                     help="Length preset name or a length file (.txt, .txt.gz, .json, ...)."))
        for opt in reversed(opts):
            fn = opt(fn)
        return fn

    return deco


def check_counts(windows: int, seed: int) -> None:
    """Click-level validation of ``--windows`` and ``--seed``."""
    if windows < 1:
        raise click.BadParameter(f"must be >= 1, got {windows}", param_hint="--windows")
    if seed < 0:
        raise click.BadParameter(f"must be >= 0, got {seed}", param_hint="--seed")


def format_table(df, columns, floatfmt: str = "{:.3f}") -> str:
    """Plain-text table of selected columns (printed summaries). A ``paper*`` column with no value
    (a layout or workload the paper did not run) is left out: the CSV keeps it, empty."""
    columns = [c for c in columns if not (str(c).startswith("paper") and df[c].isna().all())]
    rows = [[str(c) for c in columns]]
    for r in df[list(columns)].itertuples(index=False):
        rows.append([floatfmt.format(v) if isinstance(v, (float, np.floating)) else str(v) for v in r])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def tiles_per_sequence(seq_len: int, block_size: int, head_split: int) -> int:
    """SH-Tiles of one packed sequence: ``(S / B) * H`` (Libra sec. 4.3.1; the tile count of sec. 6.6)."""
    return (int(seq_len) // int(block_size)) * int(head_split)
