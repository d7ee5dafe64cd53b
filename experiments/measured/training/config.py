"""Training-run configuration (no click/pandas imports: spawned ranks unpickle it cheaply)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import numpy as np

from experiments.measured.training.loop import ATTENTION, DTYPES, PLANNERS, LoopConfig
from experiments.measured.training.model import ModelConfig
from libra.config import TapConfig

TAP_FIELDS = ("pool_size", "block_size", "head_split", "tau", "pipeline_chunks")
"""The :class:`TapConfig` fields a training run takes and records (its other fields keep TapConfig's
defaults)."""

# A training run's TAP defaults where they differ from TapConfig's (the paper's sec. 6.3 layout:
# B = 4096, M = 4), because the run trains a small model on CPU. B must divide S/CP: the default
# S = 1024 at CP = 2 leaves 512 tokens per rank, where the paper's 4096 does not fit and B = 128 makes
# four blocks (one at --quick's S = 256). M must divide hq/H: the small model's 4 query heads at H = 2
# leave 2, so M = 2 is the most it takes. P defaults to DP and H, tau to TapConfig's (:func:`run_tap`).
CPU_TAP_DEFAULTS = {"block_size": 128, "pipeline_chunks": 2}
"""A training run's CPU-sized B and M (the comment above says why they differ from the paper's)."""


def run_tap(nproc: int, cp: int, **given) -> TapConfig:
    """A training run's TAP layout: P = DP (``nproc / CP``), :data:`CPU_TAP_DEFAULTS`' B and M,
    TapConfig's H and tau, with the ``given`` TapConfig fields (None values keep these) replacing them.

    A CP above ``nproc`` still gets P = 1 here: :class:`TrainConfig` rejects that layout by name.

    Raises:
        ValueError: a value :class:`TapConfig` rejects.
    """
    layout = {"pool_size": max(nproc // cp, 1), **CPU_TAP_DEFAULTS}
    return TapConfig(**{**layout, **{k: v for k, v in given.items() if v is not None}})


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        nproc: processes = ``DP * CP`` (``reference`` needs ``CP = 1``).
        cp: context-parallel degree.
        attention: ``reference``, ``ulysses`` or ``libra``.
        steps: optimizer steps.
        seq_len: packed-sequence length ``S``; ``gbs``: packed sequences per step (default ``2 * DP``).
        tap: the TAP layout (Libra sec. 4.3, 4.4): pool size ``P``, block size ``B``, head split
            ``H``, tau (soft load-target slack), Pipeliner chunks ``M``; None: :func:`run_tap`'s
            (P = DP, CPU-sized B and M, TapConfig's H and tau). Its other fields keep TapConfig's
            defaults (the run records :data:`TAP_FIELDS` only).
        workload: length preset or file the sample lengths come from.
        model: the model shape; dtype: ``float64``, ``float32`` or ``bfloat16``.
        lr, seed: AdamW learning rate and the run's seed (data order, init, tokens).
        timeout_s: bound on every collective (a rank waiting this long on a peer fails); a spawned
            run's deadline is ``timeout_s x (steps + 2) + 60`` s.
        planner: the TAP planner of ``attention="libra"`` (:data:`~experiments.measured.training.loop.PLANNERS`:
            the paper's ``libra``, ``libra-kt`` or ``libra-adaptive``).
        profile: the hardware profile (name or .json) ``libra-kt`` weights tiles with and
            ``libra-adaptive`` prices candidates with (None: the planner's default).
        measure_speeds: ``libra-adaptive`` only: time every rank's attention once before step 0
            (:func:`libra.extensions.adaptive.speeds.measure_device_speeds`) and plan with those speeds.

    Raises:
        ValueError: naming the bad value (unknown attention/dtype, ``CP`` not dividing ``nproc``,
            ``DP`` not dividing ``gbs``, ``P`` not dividing ``DP``, ``CP`` not dividing ``S``, a
            ``tap`` that is no TapConfig or sets fields beyond :data:`TAP_FIELDS`, ...).
    """

    nproc: int = 4
    cp: int = 2
    attention: str = "libra"
    steps: int = 5
    seq_len: int = 1024
    gbs: int | None = None
    tap: TapConfig | None = None
    workload: str = "libra-prod"
    model: ModelConfig = field(default_factory=ModelConfig)
    dtype: str = "float32"
    lr: float = 3e-3
    seed: int = 0
    timeout_s: float = 120.0
    planner: str = PLANNERS[0]
    profile: str | None = None
    measure_speeds: bool = False

    def __post_init__(self) -> None:
        for name in ("nproc", "cp", "steps", "seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {v!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {ATTENTION}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {tuple(DTYPES)}")
        if self.nproc % self.cp:
            raise ValueError(f"CP={self.cp} must divide nproc={self.nproc} (nproc = DP x CP)")
        if self.attention == "reference" and self.cp != 1:
            raise ValueError(f"reference attention runs whole sequences: needs CP=1, got CP={self.cp}")
        if self.attention != "reference" and self.cp < 2:
            raise ValueError(f"{self.attention} attention needs CP >= 2, got CP={self.cp}")
        dp = self.nproc // self.cp
        gbs = 2 * dp if self.gbs is None else self.gbs
        tap = run_tap(self.nproc, self.cp) if self.tap is None else self.tap
        object.__setattr__(self, "gbs", gbs)
        object.__setattr__(self, "tap", tap)
        if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1 or gbs % dp:
            raise ValueError(f"GBS={gbs!r} must be a positive multiple of DP={dp}")
        self._check_tap()
        if dp % tap.pool_size:
            raise ValueError(f"pool size P={tap.pool_size!r} must divide DP={dp}")
        if self.seq_len % self.cp:
            raise ValueError(f"CP={self.cp} must divide S={self.seq_len}")
        if self.attention == "libra":
            from libra.config import ParallelConfig, check_layout

            check_layout(ParallelConfig(dp=dp, cp=self.cp, gbs=gbs, seq_len=self.seq_len), tap,
                         self.model.attention_shape)
        self._check_planner()
        if not self.lr > 0 or not self.timeout_s > 0:
            raise ValueError(f"lr={self.lr!r} and timeout_s={self.timeout_s!r} must be > 0")

    def _check_tap(self) -> None:
        """``tap`` is a TapConfig (which validated its own values) whose fields beyond
        :data:`TAP_FIELDS` keep TapConfig's defaults: run.json records only those."""
        if not isinstance(self.tap, TapConfig):
            raise ValueError(f"TrainConfig.tap must be a TapConfig, got {self.tap!r}")
        fixed = [f.name for f in fields(TapConfig) if f.name not in TAP_FIELDS
                 and getattr(self.tap, f.name) != f.default]
        if fixed:
            raise ValueError(f"a training run takes the TAP fields {TAP_FIELDS}; {fixed} keep TapConfig's defaults")

    def _check_planner(self) -> None:
        """The planner options: a known planner, only for Libra attention; a profile only for a
        planner that takes one (loaded now, so a bad one is an error before any rank starts);
        measured speeds only for ``libra-adaptive``."""
        if self.planner not in PLANNERS:
            raise ValueError(f"unknown planner {self.planner!r}; choose one of {PLANNERS}")
        if self.planner != PLANNERS[0] and self.attention != "libra":
            raise ValueError(f"planner {self.planner!r} plans Libra attention; attention is {self.attention!r}")
        if self.profile is not None:
            if self.planner == PLANNERS[0]:
                raise ValueError("a profile is for libra-kt or libra-adaptive; the paper's libra balances FLOPs")
            from libra.sim.profiles import load_profile

            load_profile(self.profile)
        if self.measure_speeds and self.planner != "libra-adaptive":
            raise ValueError(f"measured speeds are for planner libra-adaptive, got {self.planner!r}")

    @property
    def dp(self) -> int:
        return self.nproc // self.cp

    def loop_config(self) -> LoopConfig:
        return LoopConfig(attention=self.attention, dp=self.dp, cp=self.cp, seq_len=self.seq_len, gbs=self.gbs,
                          steps=self.steps, tap=self.tap, model=self.model, dtype=self.dtype, lr=self.lr,
                          seed=self.seed, planner=self.planner, profile=self.profile,
                          measure_speeds=self.measure_speeds)

    def to_record(self) -> dict:
        """The config as run.json records it: flat, the TAP layout's :data:`TAP_FIELDS` in place of
        ``tap`` (the record runs had before the config held a TapConfig, so existing run folders keep
        their content key and resume); the planner options only where set, so a run of the paper's
        planner keeps the content key it had before they existed."""
        out = {}
        for name, value in asdict(self).items():
            out.update({k: value[k] for k in TAP_FIELDS} if name == "tap" else {name: value})
        for name, default in (("planner", PLANNERS[0]), ("profile", None), ("measure_speeds", False)):
            if out[name] == default:
                del out[name]
        return out


def sample_lengths(cfg: TrainConfig) -> np.ndarray:
    """Sample lengths for ``cfg.steps`` steps (plus slack) from the workload, seeded."""
    from libra.data.source import resolve_workload

    need = (cfg.steps + 1) * cfg.gbs * cfg.seq_len
    return np.asarray(resolve_workload(cfg.workload).take(need, seed=cfg.seed), dtype=np.int64)
