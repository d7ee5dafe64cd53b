"""Training-run configuration (no click/pandas imports: spawned ranks unpickle it cheaply)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from experiments.measured.training.loop import ATTENTION, DTYPES, PLANNERS, LoopConfig
from experiments.measured.training.model import ModelConfig
from libra.config import TapConfig

TAP_FIELDS = ("pool_size", "block_size", "head_split", "tau", "pipeline_chunks")
"""The :class:`TapConfig` fields a training run takes (its other fields keep TapConfig's defaults)."""



@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        nproc: processes = ``DP * CP`` (``reference`` needs ``CP = 1``).
        cp: context-parallel degree.
        attention: ``reference``, ``ulysses`` or ``libra``.
        steps: optimizer steps.
        seq_len: packed-sequence length ``S``; ``gbs``: packed sequences per step (default ``2 * DP``).
        pool_size: Libra's ``P`` (default ``DP``); block_size ``B``, head_split ``H``, tau (soft
            load-target slack), pipeline_chunks ``M`` (Libra sec. 4.3, 4.4): the TAP layout,
            :attr:`tap`. B and M default to CPU-sized values; H and tau to TapConfig's.
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
            ``DP`` not dividing ``gbs``, ``P`` not dividing ``DP``, ``CP`` not dividing ``S``, ...).
    """

    nproc: int = 4
    cp: int = 2
    attention: str = "libra"
    steps: int = 5
    seq_len: int = 1024
    gbs: int | None = None
    pool_size: int | None = None
    block_size: int = 128  # CPU-sized (the paper: 4096)
    head_split: int = TapConfig.head_split
    tau: float = TapConfig.tau
    pipeline_chunks: int = 2  # the small model's hq/H = 2 (the paper: 4)
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
        pool = dp if self.pool_size is None else self.pool_size
        object.__setattr__(self, "gbs", gbs)
        object.__setattr__(self, "pool_size", pool)
        if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1 or gbs % dp:
            raise ValueError(f"GBS={gbs!r} must be a positive multiple of DP={dp}")
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1 or dp % pool:
            raise ValueError(f"pool size P={pool!r} must divide DP={dp}")
        if self.seq_len % self.cp:
            raise ValueError(f"CP={self.cp} must divide S={self.seq_len}")
        tap = self.tap  # validates B, H, tau and M
        if self.attention == "libra":
            from libra.config import ParallelConfig, check_layout

            check_layout(ParallelConfig(dp=dp, cp=self.cp, gbs=gbs, seq_len=self.seq_len), tap,
                         self.model.attention_shape)
        self._check_planner()
        if not self.lr > 0 or not self.timeout_s > 0:
            raise ValueError(f"lr={self.lr!r} and timeout_s={self.timeout_s!r} must be > 0")

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

    @property
    def tap(self) -> TapConfig:
        """The run's TAP layout (P resolved; fields the run does not set keep TapConfig's defaults).

        Raises:
            ValueError: a value :class:`TapConfig` rejects.
        """
        return TapConfig(**{name: getattr(self, name) for name in TAP_FIELDS})

    def loop_config(self) -> LoopConfig:
        return LoopConfig(attention=self.attention, dp=self.dp, cp=self.cp, seq_len=self.seq_len, gbs=self.gbs,
                          steps=self.steps, pool_size=self.pool_size, block_size=self.block_size,
                          head_split=self.head_split, pipeline_chunks=self.pipeline_chunks, model=self.model,
                          dtype=self.dtype, lr=self.lr, seed=self.seed, tau=self.tau, planner=self.planner,
                          profile=self.profile, measure_speeds=self.measure_speeds)

    def to_dict(self) -> dict:
        """The config as run.json records it; the planner options only where set, so a run of the
        paper's planner keeps the content key it had before they existed."""
        out = asdict(self)
        for name, default in (("planner", PLANNERS[0]), ("profile", None), ("measure_speeds", False)):
            if out[name] == default:
                del out[name]
        return out


def sample_lengths(cfg: TrainConfig) -> np.ndarray:
    """Sample lengths for ``cfg.steps`` steps (plus slack) from the workload, seeded."""
    from libra.data.source import resolve_workload

    need = (cfg.steps + 1) * cfg.gbs * cfg.seq_len
    return np.asarray(resolve_workload(cfg.workload).take(need, seed=cfg.seed), dtype=np.int64)
