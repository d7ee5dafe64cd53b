"""One registry for every attention planner: Libra, its ablations and the baselines.

Every method is a *planner* (DESIGN.md sec. 2): it turns one GBS window of packed sequences into
one :class:`libra.plan.Plan` per GA index, so the simulator, the runtime and the tests consume all
methods through the same contract. Planners are looked up by name (registry pattern, as in vidur):

>>> planner = get_planner("libra", tap=TapConfig(block_size=4096, head_split=2))
>>> plans = planner.plan_window(window, par, shape)   # len(plans) == par.ga

A run's TAP layout reaches every planner whole: ``get_planner(name, tap=TapConfig(...))`` hands it
to :meth:`Planner.from_tap`, where the TAP planners (the ``libra`` family, ``distca-paper``) take it
as their config with their pinned fields applied, ``distca`` and ``dynamic-cp`` read its ``M``, and
Ulysses and WLB-LLM ignore it. The TapConfig fields are also plain keyword options
(``get_planner("libra", block_size=4096)``). :func:`option_record` is the flat form a run records.

Planner modules are imported lazily on first lookup, so importing the registry stays cheap and the
planning path never imports torch.

Shared conventions (the microbatch-group mapping every planner uses)
--------------------------------------------------------------------
* Production order puts ``window[i]`` at GA index ``i // DP`` on DP rank ``i % DP``.
* A pool of ``P`` replicas whose first DP rank is ``p0`` owns workers ``[p0*CP, (p0+P)*CP)``
  (worker id = ``dp_rank * CP + cp_rank``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence

import numpy as np

from libra.config import ParallelConfig, TapConfig
from libra.plan import Plan
from libra.workload import AttentionShape

# name -> "module:Class"; every class implements the Planner interface below.
PLANNERS: dict[str, str] = {
    "ulysses": "baselines.ulysses:UlyssesPlanner",
    # Ulysses with the window sorted across GA steps (VRSP at P = 1); a baseline, not in the paper
    "ulysses-sorted": "baselines.ulysses:UlyssesSortedPlanner",
    "wlb-llm": "baselines.wlbllm:WlbLlmPlanner",
    # DistCA's own planning algorithm (hao-ai-lab/DistCA's planner), and the Libra paper's emulation of it
    "distca": "baselines.distca:DistCAPlanner",
    "distca-paper": "baselines.distca_paper:DistCAPaperPlanner",
    # Megatron Core's dynamic context parallelism (DefaultDynamicCPScheduler); may form another
    # number of microbatches than GA
    "dynamic-cp": "baselines.dynamic_cp:DynamicCPPlanner",
    "libra-tap": "baselines.libra_planners:LibraTapPlanner",
    "libra-tap-vrsp": "baselines.libra_planners:LibraTapVrspPlanner",
    "libra": "baselines.libra_planners:LibraPlanner",
    # Libra full + kernel-time-aware TAP; an extension, not in the paper (option ``profile``)
    "libra-kt": "baselines.libra_planners:LibraKtPlanner",
    # per pool the fastest of Alg. 2 and adaptive tilings/placements under the profile's cost
    # model; an extension for real corpora, not in the paper (options ``profile``, ``max_tile_share``)
    "libra-adaptive": "baselines.libra_planners:LibraAdaptivePlanner",
}


class Planner:
    """Interface of every planner.

    Attributes:
        name: registry name, recorded as ``Plan.method``.
        pipeline_chunks: Pipeliner chunks ``M`` the runtime/simulator must use (1 = no overlap).
        config: the validated options dataclass (``Config`` of the subclass).
    """

    name: str = ""
    Config: type = type(None)

    def __init__(self, config=None):
        self.config = config if config is not None else self.Config()

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The keyword options :func:`get_planner` accepts: by default the ``Config`` fields."""
        return tuple(f.name for f in dataclasses.fields(cls.Config))

    @classmethod
    def from_options(cls, **options) -> Planner:
        """The planner configured by ``options`` (names already checked against :meth:`option_names`)."""
        return cls(cls.Config(**options))

    @classmethod
    def from_tap(cls, tap: TapConfig, profile=None, **options) -> Planner:
        """The planner of a run whose TAP layout is ``tap`` and whose pricing profile is ``profile``:
        here the TapConfig fields this planner takes as options (``M`` for ``distca`` and
        ``dynamic-cp``, none for Ulysses and WLB-LLM) plus ``options``; ``profile`` is ignored by a
        planner that plans without one. The TAP planners take ``tap`` whole (:class:`TapPlanner
        <baselines.libra_planners.TapPlanner>`)."""
        return cls.from_options(**tap_options(cls, tap, profile), **options)

    @property
    def pipeline_chunks(self) -> int:
        return 1

    def plan_window(self, window: Sequence, par: ParallelConfig, shape: AttentionShape) -> list[Plan]:
        """Plan one GBS window.

        Args:
            window: ``par.gbs`` packed sequences (``libra.data.packing.PackedSequence``: ``seq_id``,
                ``sample_lengths``, ``sample_ids``) in production (arrival) order.
            par: the parallel layout.
            shape: attention head geometry.

        Returns:
            ``par.ga`` Plans, ``plans[g].ga_index == g``.

        Raises:
            ValueError: a window that does not match ``par`` or a layout the method cannot run.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


def planner_class(name: str) -> type[Planner]:
    """The class registered as ``name`` (its module is imported on first use).

    Raises:
        ValueError: unknown name (the message lists the registered names).
    """
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; registered planners: {', '.join(PLANNERS)}")
    module, attr = PLANNERS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def get_planner(name: str, tap: TapConfig | None = None, **options) -> Planner:
    """Instantiate the planner registered as ``name``.

    Args:
        name: a registered planner.
        tap: the run's TAP layout, handed whole to :meth:`Planner.from_tap` (None: ``options`` alone
            configure the planner, TapConfig fields included).
        options: the planner's own options; with ``tap`` given, no TapConfig field (it is in
            ``tap``), and ``profile`` is the run's pricing profile, ignored by planners without one.

    Raises:
        ValueError: unknown name (the message lists the registered names), an option the planner
            does not take, or an option value its config rejects.
    """
    cls = planner_class(name)
    names = set(cls.option_names())
    if tap is not None:
        names = (names - {f.name for f in dataclasses.fields(TapConfig)}) | {"profile"}
    unknown = sorted(set(options) - names)
    if unknown:
        given = " besides its TapConfig" if tap is not None else ""
        raise ValueError(f"planner {name!r} takes no option(s) {unknown}{given}; its options are {sorted(names)}")
    return cls.from_options(**options) if tap is None else cls.from_tap(tap, **options)


def tap_options(cls: type[Planner], tap: TapConfig, profile=None) -> dict:
    """The options of planner class ``cls`` that ``tap`` sets (the TapConfig fields among its
    options) and ``profile`` when the planner plans with one."""
    names = set(cls.option_names())
    options = {f.name: getattr(tap, f.name) for f in dataclasses.fields(TapConfig) if f.name in names}
    if profile is not None and "profile" in names:
        options["profile"] = profile
    return options


def option_record(name: str, tap: TapConfig, profile=None, **options) -> dict:
    """The flat record of planner ``name``'s options in a run with TAP layout ``tap``, as run configs
    and point-cache keys store them: the TapConfig fields the planner takes as options (none for
    Ulysses and WLB-LLM; no ``pipeline_chunks`` for the TAP-only variants, no ``pool_size`` for
    ``distca-paper``), ``profile`` (a name, path or HardwareProfile) when given and the planner
    plans with one (``libra-kt``, ``libra-adaptive``), then ``options``. A record only: planners are
    built from the TapConfig itself (``get_planner(name, tap=tap, ...)``).

    Raises:
        ValueError: unknown name.
    """
    return {**tap_options(planner_class(name), tap, profile), **options}


# --------------------------------------------------------------------------------------------
# helpers shared by the planners
# --------------------------------------------------------------------------------------------


def window_lengths(window: Sequence, par: ParallelConfig, fixed_tokens: bool = True) -> list[np.ndarray]:
    """Sample-length arrays of a window, after checking it fits ``par``.

    Args:
        window: packed sequences (anything with a ``sample_lengths`` attribute).
        par: parallel layout; the window must hold exactly ``par.gbs`` sequences.
        fixed_tokens: also require ``par.seq_len`` tokens per sequence (fixed-token packing).

    Returns:
        ``gbs`` int64 arrays ``(n_samples_i,)``.

    Raises:
        ValueError: wrong window size, a non-positive sample length, or (``fixed_tokens``) a
            sequence whose token count differs from ``S``.
    """
    if len(window) != par.gbs:
        raise ValueError(f"window holds {len(window)} packed sequences, expected GBS={par.gbs}")
    out = []
    for i, seq in enumerate(window):
        lengths = np.asarray(seq.sample_lengths, dtype=np.int64).reshape(-1)
        if lengths.size == 0 or np.any(lengths < 1):
            raise ValueError(f"window[{i}] has an empty or non-positive sample length: {lengths.tolist()[:8]}")
        if fixed_tokens and int(lengths.sum()) != par.seq_len:
            raise ValueError(f"window[{i}] holds {int(lengths.sum())} tokens, expected S={par.seq_len}")
        out.append(lengths)
    return out


def production_groups(par: ParallelConfig) -> np.ndarray:
    """``(GA, DP)`` window indices in production order: ``groups[g, d] = g * DP + d``."""
    return np.arange(par.gbs, dtype=np.int64).reshape(par.ga, par.dp)


def pool_workers(p0: int, pool_size: int, cp: int) -> tuple[int, ...]:
    """Global workers of the pool whose first DP rank is ``p0``: ``[p0*CP, (p0+P)*CP)``."""
    return tuple(range(p0 * cp, (p0 + pool_size) * cp))
