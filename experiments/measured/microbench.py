"""`libra-bench microbench`: the isolated core-attention experiment of Libra sec. 6.3, measured.

Every worker runs its complete core-attention call for each step (GA index) of each GBS window:
forward + backward (or forward only), communication and computation, for every method:

* ``ulysses``: the deployed Ulysses runtime (:mod:`baselines.ulysses_runtime`, all-to-all);
* every other registry planner (``libra``, ``libra-tap``, ``libra-tap-vrsp``, ``distca``, ``distca-paper``,
  ``wlb-llm``): its Plans executed by :func:`libra.runtime.attention.libra_attention`.

A step's straggler is the slowest worker's time (median over ``--repeats`` barrier-aligned
repetitions of the per-repetition maximum). Every call's process CPU time is recorded too
(``cpu_ms``: forward + backward, per rank, mean over ranks): for the same attention work it is
the runtime's overhead beyond the kernels.

**The reference** (``ideal_*`` columns): for each DP rank, its packed sequence's whole-sequence attention (every
sample one causal segment of one backend call -- the CPU flash backend runs consecutive
equal-length samples as one batched call --, forward + backward, same backend, dtype and threads
as the ranks) timed alone on one process, divided by CP; a step's ``ideal_ms`` is the mean over its DP ranks, and
``ideal_ratio`` = straggler / reference is how far a method is from perfect balance at zero overhead.
It is a reference, not a bound: timed apart from the steps on a shared host, a method has measured
below it (ratios 0.69-0.97 under load).
It is measured before and after the ranks, each time in one fresh spawned process (under torchrun:
on rank 0 while the others wait), and ``ideal_ms`` uses the mean of the two: on a shared host whose
speed drifts during the run, ``ideal_drift`` (after / before - 1, per step and in the summary) says
by how much, so a ratio that moves by less than the drift is noise, not balance.

**The paired ideal** (on by default; ``--no-paired-ideal`` skips it): a shared host drifts by tens
of percent over the minutes between the ideal's two measurements, more than the balance left to
show, and its speed moves within seconds too. So every rank also times, right after *each*
repetition of a step (warm-up ones included, untimed), its own DP rank's packed sequence as one
whole-sequence call, all ranks at once -- one rank per core, as in the step. A repetition's paired
ideal is the mean over ranks divided by CP; ``paired_ratio`` is the median over repetitions of
that repetition's straggler / its paired ideal (``paired_ideal_ms``: the median paired ideal), so
each ratio compares two timings a moment apart under the same load. The paired ideal meets at most
the step's contention (a rank that finishes first idles while the others still run), so if anything
it is faster than the step's conditions allow and the ratio errs against the method. The pairing
has a cost of its own: a step repetition then follows a call on other buffers, not its own previous
repetition, and starts with colder caches. In three alternating pairs of 8K ``libra`` runs (5
repeats) the mean straggler was 0.1%, 3.0% and 6.7% higher with the paired ideal than without;
every method pays it alike, and ``--no-paired-ideal`` times the repetitions back to back.

**Honest CPU timing**: on CPU every rank runs one thread; more ranks than the cores this process
may use (``os.sched_getaffinity``) would time total CPU work / cores whatever the placement, so
balancing could not show. Such a run is refused before any process starts unless
``--oversubscribe`` is passed (recorded in ``run.json``'s config).

Launch:

* ``libra-bench microbench --nproc 4 ...``: spawns 4 local processes (gloo on CPU);
* ``torchrun --nnodes N --nproc-per-node 8 -m experiments.cli microbench --device cuda ...``:
  one process per GPU, NCCL (unverified in sessions without GPUs).

Outputs (``runs/microbench/<workload>-<layout>/`` or ``--out``): ``microbench.csv`` (the straggler CSV schema plus
``measured = True``, backend, device, dtype and per-step memory; bytes per link class are NaN, the
measured ``bytes_sent`` replaces them; ``balance_bound_ms`` is the measured mean worker compute), ``microbench_summary.csv``
(per method: mean / max straggler, speedup over Ulysses, ``ideal_ms``, ``ideal_ratio``, ``cpu_ms`` and
``cpu_vs_ulysses``), ``microbench.png`` and ``run.json``.

``--quick``: a smoke run (1 window, 1 repeat, no warm-up; S=1024, B=128, head_dim 16 unless given).

**First call of a method**: whatever ``--warmup``, each method's first step gets at least one
untimed repetition (:data:`FIRST_STEP_WARMUP`). A process's first call through a runtime pays
one-time costs no later step has -- the autograd engine's threads, the allocator, gloo's pair
connections, which open on first use. Untimed, with ``--warmup 0`` (``--quick``) the first method
measured was 11x its ideal on the smoke case (S=1024: 294 ms, then 26 ms with one warm-up), so the
printed speedups depended on the order of ``--methods``.
``--profile``: the hardware profile ``libra-kt`` balances kernel time with and ``libra-adaptive``
prices its candidates on (e.g. the ``profile.json`` of ``libra-bench calibrate --device cpu``);
needs one of them in ``--methods``.
Skewed length files for the CPU runs are in ``workloads/`` (e.g. ``skewed-8k.txt``: one 8192-token
sample, then eight of 1024).

The TAP options (``--pool-size``, ``--block-size``, ``--head-split``, ``--tau``,
``--pipeline-chunks``, alias ``--chunks``) come from
:func:`experiments.common.options.tap_options`, with this command's small defaults (:data:`DEFAULT_TAP`).
Every planner is given that one TapConfig whole (``get_planner(name, tap=...)``: Libra's variants
hold it as their config, ``distca`` reads its M); ``run.json`` records the layout under ``config.tap``.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.common.options import (
    DtypeType,
    SizeType,
    apply_quick,
    overwrite_option,
    quick_option,
    tap_options,
)
from experiments.common.progress import progress
from experiments.common.runner import ExperimentRun, stable_hash
from experiments.common.runs_table import run_caption
from experiments.measured.microbench_targets import reference_targets
from libra.config import ParallelConfig, TapConfig, check_layout

METHODS = ("ulysses", "wlb-llm", "distca", "distca-paper", "libra-tap", "libra-tap-vrsp", "libra", "libra-kt",
           "libra-adaptive")
PROFILED = ("libra-kt", "libra-adaptive")
"""The methods that plan with a hardware profile (``--profile``)."""
DTYPES = ("fp32", "bf16", "fp64", "fp16")
# `libra-bench straggler`'s CSV columns, in its order (measured extras follow them)
STRAGGLER_COLUMNS = ["workload", "setting", "method", "window", "step", "straggler_ms", "compute_ms",
                     "comm_exposed_ms", "straggler_worker", "straggler_pool", "comm_serial_ms", "mean_worker_ms",
                     "balance_bound_ms", "bytes_nvlink", "bytes_roce", "bytes_inter_supernode", "pipeline_chunks",
                     "bound_ratio"]
DEFAULT_TAP = TapConfig(pool_size=2, block_size=256, pipeline_chunks=2)
"""microbench's TAP layout at its CPU sizes: P = 2, B = 256, TapConfig's H and tau, M = 2."""
TAP_FIELDS = ("pool_size", "block_size", "head_split", "tau", "pipeline_chunks")
"""The TapConfig fields microbench takes as options."""
FIRST_STEP_WARMUP = 1
"""Untimed repetitions a method's first step gets at least (module docstring: one-time costs)."""

QUICK = {"windows": 1, "repeats": 1, "warmup": 0, "seq_len": 1024, "block_size": 128, "head_dim": 16}
"""``--quick``: these values for every option not given on the command line."""
RANK_THREADS = 1
"""torch threads of each spawned CPU rank (and of the ideal's process)."""


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MicrobenchConfig:
    """One microbench run's configuration, checked when it is built, so a bad value fails before any
    process starts (ValueError naming it). :meth:`to_record` is what ``run.json`` records as
    ``config`` (the TAP layout under ``config.tap``); the ranks get the object itself.

    Attributes:
        dp, cp, seq_len, gbs: the parallel layout (:attr:`par`).
        tap: the TAP layout every planner is given whole (:func:`make_planner`).
        q_heads, kv_heads, head_dim, dtype: the attention geometry; ``dtype`` one of :data:`DTYPES`.
        device, backend, comm: where the ranks run, their kernel backend (``auto`` resolves per
            device) and their exchange (a mode of :data:`libra.runtime.executor.COMM_MODES`).
        methods: of :data:`METHODS`, in the order they are measured (a comma list is split).
        windows, workload, seed: how many GBS windows of which length source, and the seed of the
            length stream and of the inputs.
        repeats, warmup, backward: timed and untimed repetitions per step, forward + backward or
            forward only (:attr:`timing`).
        timeout: collective timeout (s).
        profile: the hardware profile of the :data:`PROFILED` methods (None: their default).
        oversubscribe: more CPU ranks than cores was allowed.
        threads: torch threads of each CPU rank (:data:`RANK_THREADS`: recorded, not chosen).
        paired_ideal: each rank times the paired ideal after each repetition (module docstring).
    """

    dp: int
    cp: int
    seq_len: int
    gbs: int
    tap: TapConfig
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    device: str
    backend: str
    comm: str
    methods: tuple[str, ...]
    windows: int
    workload: str
    seed: int
    repeats: int
    warmup: int
    backward: bool
    timeout: float
    profile: str | None = None
    oversubscribe: bool = False
    threads: int = field(default=RANK_THREADS, init=False)
    paired_ideal: bool = True

    def __post_init__(self) -> None:
        from libra.workload import AttentionShape  # noqa: PLC0415

        check_layout(self.par, self.tap, AttentionShape(self.q_heads, self.kv_heads, self.head_dim, 2))
        self._check_options()
        methods = self.methods
        method_list = tuple(m.strip() for m in methods.split(",") if m.strip()) if isinstance(methods, str) \
            else tuple(methods)
        self._check_methods(method_list)
        # the record's types whatever the caller passed (run.json and the config hash see these)
        for name, value in (("methods", method_list), ("backward", bool(self.backward)),
                            ("timeout", float(self.timeout)), ("oversubscribe", bool(self.oversubscribe)),
                            ("profile", None if self.profile is None else str(self.profile)),
                            ("paired_ideal", bool(self.paired_ideal))):
            object.__setattr__(self, name, value)

    def _check_options(self) -> None:
        from libra.runtime.executor import COMM_MODES  # noqa: PLC0415

        for name, low in (("windows", 1), ("repeats", 1), ("warmup", 0), ("seed", 0)):
            value = getattr(self, name)
            if value < low:
                raise ValueError(f"--{name} must be >= {low}, got {value}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if self.comm not in COMM_MODES:
            raise ValueError(f"unknown comm mode {self.comm!r}; choose from {', '.join(COMM_MODES)}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")

    def _check_methods(self, method_list: tuple[str, ...]) -> None:
        if not method_list:
            raise ValueError("empty --methods")
        for m in method_list:
            if m not in METHODS:
                raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
        if "ulysses" in method_list and self.q_heads % self.cp:
            raise ValueError(f"ulysses needs CP={self.cp} to divide q_heads={self.q_heads}")
        if self.profile is not None:
            if not set(PROFILED) & set(method_list):
                raise ValueError(f"--profile sets the kernel model of {' and '.join(PROFILED)}: add one to --methods")
            from libra.sim.profiles import load_profile  # noqa: PLC0415

            load_profile(self.profile)  # an unknown name or a bad file fails here, before any process starts

    @property
    def par(self) -> ParallelConfig:
        """The parallel layout (DP, CP, GBS, S)."""
        return ParallelConfig(dp=self.dp, cp=self.cp, gbs=self.gbs, seq_len=self.seq_len)

    @property
    def timing(self):
        """How each step is timed: :class:`experiments.measured.gpu_common.TimingOptions` of
        ``warmup``, ``repeats`` and ``backward`` (a method's first step may warm up more)."""
        from experiments.measured.gpu_common import TimingOptions  # noqa: PLC0415  (imports torch)

        return TimingOptions(warmup=self.warmup, repeats=self.repeats, backward=self.backward)

    @property
    def torch_dtype(self):
        """The torch dtype of ``dtype``."""
        from experiments.measured.gpu_common import DTYPES as TORCH_DTYPES  # noqa: PLC0415  (imports torch)

        return TORCH_DTYPES[self.dtype]

    def geometry(self, device):
        """The :class:`experiments.measured.gpu_common.KernelGeometry` of this run's whole-sequence
        calls on ``device``: its heads, head width and :attr:`torch_dtype`."""
        from experiments.measured.gpu_common import KernelGeometry  # noqa: PLC0415

        return KernelGeometry(self.q_heads, self.kv_heads, self.head_dim, self.torch_dtype, device)

    def to_record(self) -> dict:
        """The JSON-ready record ``run.json`` keeps as ``config``: every field by name, ``tap`` as a dict."""
        return {**asdict(self), "methods": list(self.methods)}


def make_planner(method: str, cfg: MicrobenchConfig):
    """The registry planner of ``method`` given the run's TapConfig whole (and ``--profile``, which
    the :data:`PROFILED` methods plan with)."""
    from baselines.registry import get_planner  # noqa: PLC0415

    return get_planner(method, tap=cfg.tap, profile=cfg.profile)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_cpu_ranks(ranks: int, device: str, oversubscribe: bool, cores: int | None = None) -> None:
    """Refuse more single-thread CPU ranks than cores (see the module docstring).

    Raises:
        ValueError: ``ranks * RANK_THREADS`` exceeds the usable cores on CPU without ``oversubscribe``.
    """
    cores = usable_cores() if cores is None else cores
    if device.startswith("cpu") and ranks * RANK_THREADS > cores and not oversubscribe:
        raise ValueError(f"{ranks} single-thread CPU ranks on {cores} usable core(s) (os.sched_getaffinity) "
                         f"would time total CPU work / {cores}, not balance: use --nproc <= {cores} or pass "
                         f"--oversubscribe to run anyway (recorded in run.json)")


# --------------------------------------------------------------------------------------------
# the per-rank benchmark
# --------------------------------------------------------------------------------------------


def _local_tensors(ranges, seq_ids, shape, dtype, device, seed):
    """Deterministic inputs of one worker: each local range seeded by (seed, seq_id, start)."""
    import torch  # noqa: PLC0415

    parts = {n: [] for n in ("q", "k", "v", "do")}
    for (s, a, b) in ranges:
        g = torch.Generator().manual_seed(int(stable_hash([seed, int(seq_ids[s]), int(a)]), 16) % 2**62)
        n = b - a
        parts["q"].append(torch.randn(n, shape.num_q_heads, shape.head_dim, generator=g))
        parts["k"].append(torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=g))
        parts["v"].append(torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=g))
        parts["do"].append(torch.randn(n, shape.num_q_heads, shape.head_dim, generator=g))
    return [torch.cat(parts[n]).to(device=device, dtype=dtype) for n in ("q", "k", "v", "do")]


def _time_calls(runner, inputs, timing, device, world_group=None, after_each=None):
    """Per repetition: barrier, then one complete core-attention call, then ``after_each()`` (when
    given; untimed here, it times itself: the paired ideal's ms).

    Args:
        inputs: this worker's ``(q, k, v, do)`` (:func:`_local_tensors`).
        timing: ``warmup`` untimed then ``repeats`` timed repetitions; ``backward``: each call runs
            ``out.backward(do)`` too (:class:`experiments.measured.gpu_common.TimingOptions`).
        world_group: the group of the barrier (None: the default group).

    Returns ``(wall s, process CPU s, compute s, comm wait s, after_each ms)`` arrays of the timed
    repetitions (the last NaN without ``after_each``) and the peak transient bytes.
    """
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    q, k, v, do = inputs
    warmup, backward = timing.warmup, timing.backward
    times, cpu, compute, wait, after, peak = [], [], [], [], [], 0
    for r in range(warmup + timing.repeats):
        qq, kk, vv = (x.detach().requires_grad_(backward) for x in (q, k, v))
        stats = runner.stats
        if isinstance(stats, dict):
            for key in ("compute_s", "comm_wait_s"):
                stats[key] = 0.0
        else:
            stats.reset()
        dist.barrier(group=world_group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        out = runner(qq, kk, vv)
        if backward:
            out.backward(do)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if r >= warmup:
            times.append(dt)
            cpu.append(dc)
            st = stats if isinstance(stats, dict) else vars(stats)
            compute.append(st["compute_s"])
            wait.append(st["comm_wait_s"])
            peak = max(peak, int(st["peak_transient_bytes"]))
        paired = np.nan if after_each is None else after_each()
        if r >= warmup:
            after.append(paired)
    return np.array(times), np.array(cpu), np.array(compute), np.array(wait), np.array(after), peak


def _runner(method, plan, cfg, groups, backend, shape, me):
    """This worker's prepared runner of ``plan`` and what it holds.

    Returns ``(runner, local ranges, seq ids of the ranges' sequences, chunks, P)``.
    """
    from baselines.ulysses_runtime import UlyssesAttention  # noqa: PLC0415
    from libra.runtime.attention import prepare  # noqa: PLC0415
    from libra.runtime.groups import RankGrid, build_groups  # noqa: PLC0415

    pool = plan.pool_of_worker(me)
    P = len(pool.workers) // cfg.cp
    if method == "ulysses":
        seq = pool.sequences[0]
        runner = UlyssesAttention(seq.sample_lengths, groups[1].cp, shape.num_q_heads, shape.num_kv_heads,
                                  backend=backend)
        n = cfg.seq_len // cfg.cp
        c = me % cfg.cp
        return runner, [(0, c * n, (c + 1) * n)], [seq.seq_id], 1, P
    if P not in groups:
        groups[P] = build_groups(RankGrid(dp=cfg.dp, cp=cfg.cp, pool_size=P), timeout_s=cfg.timeout)
    runner = prepare(plan, groups[P].pool, backend=backend, comm=cfg.comm, check_finite=False)
    return runner, runner.program.local_ranges, [s.seq_id for s in pool.sequences], runner.program.chunks, P


def _setup(rank: int, cfg: MicrobenchConfig):
    """Device, kernel backend, dtype, head shape and the process groups of one rank."""
    import torch  # noqa: PLC0415

    from libra.runtime.groups import RankGrid, build_groups  # noqa: PLC0415
    from libra.runtime.kernels import get_backend  # noqa: PLC0415
    from libra.workload import AttentionShape  # noqa: PLC0415

    dtype = cfg.torch_dtype
    device = torch.device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
        torch.cuda.set_device(device)
    backend = get_backend(cfg.backend, device)
    shape = AttentionShape(cfg.q_heads, cfg.kv_heads, cfg.head_dim, torch.empty(0, dtype=dtype).element_size())
    pool_sizes = sorted({1, cfg.tap.pool_size, cfg.dp})
    groups = {p: build_groups(RankGrid(dp=cfg.dp, cp=cfg.cp, pool_size=p), timeout_s=cfg.timeout)
              for p in pool_sizes}
    return device, backend, dtype, shape, groups


def bench_rank(rank: int, world: int, cfg: MicrobenchConfig, keys: list, coords: dict | None = None, send=None) -> dict:
    """Run every (method, window) point of ``keys`` on this rank (process group initialised).

    ``coords``: the launcher's place of this rank (:func:`experiments.measured.training.ranks.torchrun_coords`;
    None: a local spawn). ``send``: rank 0 sends ``{"key": key, "rows": rows}`` through it as each
    point finishes (:class:`libra.runtime.launch.RankMessages`), so the parent keeps the finished
    points of a run that is interrupted or fails.

    Returns ``{key_hash: rows}`` (rows of every step) and ``"ranks"`` (every rank's place and group
    members, :func:`experiments.measured.training.ranks.gather_rank_records`) on rank 0, ``{}`` elsewhere.
    """
    import torch  # noqa: PLC0415

    from experiments.measured.training.ranks import gather_rank_records, spawn_coords  # noqa: PLC0415
    from libra.data.windows import gbs_windows  # noqa: PLC0415
    from libra.runtime.groups import all_gather_single  # noqa: PLC0415

    device, backend, dtype, shape, groups = _setup(rank, cfg)
    par, geom = cfg.par, cfg.geometry(device)
    me = groups[1].cp.worker
    windows = gbs_windows(cfg.workload, cfg.seq_len, cfg.gbs, cfg.windows, seed=cfg.seed)
    ranks = gather_rank_records(groups[cfg.tap.pool_size], coords or spawn_coords(rank, world), device)
    out = {"ranks": ranks} if rank == 0 else {}
    warmed = set()  # methods whose first step ran (FIRST_STEP_WARMUP)
    for method, w in keys:
        planner = make_planner(method, cfg)
        rows = []
        for i, plan in enumerate(planner.plan_window(windows[w], par, shape)):
            warmup = max(cfg.warmup, FIRST_STEP_WARMUP) if i == 0 and method not in warmed else cfg.warmup
            warmed.add(method)
            runner, ranges, seq_ids, chunks, P = _runner(method, plan, cfg, groups, backend, shape, me)
            inputs = _local_tensors(ranges, seq_ids, shape, dtype, device, cfg.seed)
            ideal = partial(_paired_ideal_ms, plan, me, cfg, backend, geom) if cfg.paired_ideal else None
            times, cpu, compute, wait, paired, peak = _time_calls(runner, inputs, replace(cfg.timing, warmup=warmup),
                                                                  device, after_each=ideal)
            st = runner.stats
            sent = st["sent_bytes"] if isinstance(st, dict) else sum(st.sent_bytes.values())
            sent = sent / max(1, warmup + cfg.repeats) if isinstance(st, dict) else sent
            mine = torch.tensor(np.concatenate([times, cpu, compute, wait, paired, [peak, sent, P]]), dtype=torch.float64)
            allv = torch.zeros(world * mine.numel(), dtype=torch.float64, device=device)
            all_gather_single(allv, mine.to(device))
            if rank == 0:
                row = _step_row(method, w, plan.ga_index, allv.view(world, -1).cpu().numpy(), cfg, chunks,
                                backend.name, str(device))
                row["seq_ids"] = ";".join(str(s.seq_id) for pool in plan.pools for s in pool.sequences)
                rows.append(row)
        if rank == 0:
            out[stable_hash([method, w])] = rows
            if send is not None:
                send({"key": [method, w], "rows": rows})
    return out


def _step_row(method, window, step, allv, cfg, chunks, backend, device) -> dict:
    R = cfg.repeats
    times, cpu, compute, wait, paired = (allv[:, i * R:(i + 1) * R] for i in range(5))
    peak, sent, P = (allv[:, 5 * R + i] for i in range(3))
    ideal_rep = paired.mean(axis=0) / cfg.cp  # per repetition: mean over ranks of their sequence, / CP
    per_rep_max = times.max(axis=0)
    rep = int(np.argsort(per_rep_max)[len(per_rep_max) // 2])  # the median repetition
    w = int(np.argmax(times[:, rep]))
    return {"workload": cfg.workload, "setting": "custom", "method": method, "window": int(window),
            "step": int(step), "straggler_ms": float(per_rep_max[rep] * 1e3), "compute_ms": float(compute[w, rep] * 1e3),
            "comm_exposed_ms": float(max(times[w, rep] - compute[w, rep], 0.0) * 1e3),
            "straggler_worker": w, "straggler_pool": int(w // (cfg.cp * max(1, int(P[w])))),
            "comm_serial_ms": float("nan"), "comm_wait_ms": float(wait[w, rep] * 1e3),
            "mean_worker_ms": float(times[:, rep].mean() * 1e3), "min_worker_ms": float(times[:, rep].min() * 1e3),
            # measured analogue of the simulator's perfect-balance bound: mean worker compute
            "balance_bound_ms": float(compute[:, rep].mean() * 1e3),
            "bytes_nvlink": float("nan"), "bytes_roce": float("nan"), "bytes_inter_supernode": float("nan"),
            "bound_ratio": float(per_rep_max[rep] / max(compute[:, rep].mean(), 1e-12)),
            # process CPU time per rank (each rank's median repetition), mean over ranks
            "cpu_ms": float(np.median(cpu, axis=1).mean() * 1e3),
            "bytes_sent": int(sent.sum()), "peak_transient_bytes": int(peak.max()), "pipeline_chunks": int(chunks),
            "measured": True, "backend": backend, "device": device.split(":")[0], "dtype": cfg.dtype,
            "repeats": R, "backward": cfg.backward,
            "paired_ideal_ms": float(np.median(ideal_rep)),
            "paired_ratio": float(np.median(per_rep_max * 1e3 / ideal_rep))}


def _paired_ideal_ms(plan, me: int, cfg: MicrobenchConfig, backend, geom) -> float:
    """This rank's part of one repetition's paired ideal (module docstring): the time (ms) of one
    whole-sequence attention call of the packed sequence its DP rank holds in ``plan`` (``geom``:
    :meth:`MicrobenchConfig.geometry` on this rank's device)."""
    from experiments.measured.gpu_common import time_whole_sequence  # noqa: PLC0415

    seq = next(s for s in plan.pool_of_worker(me).sequences if me in s.holder_worker)
    once = replace(cfg.timing, warmup=0, repeats=1)  # one call right after each repetition
    return time_whole_sequence(backend, seq.sample_lengths, geom, once, seed=cfg.seed + seq.seq_id)["ms"]


# --------------------------------------------------------------------------------------------
# the ideal: each packed sequence's whole-sequence attention, alone
# --------------------------------------------------------------------------------------------


def measure_ideal(cfg: MicrobenchConfig, window_ids: list[int]) -> dict:
    """Whole-sequence attention time of every packed sequence of the given windows, on this process
    alone (:func:`experiments.measured.gpu_common.time_whole_sequence`; module docstring: the ideal).

    Returns ``{str(window): rows}``, one row per sequence: ``window, seq_id, ideal_seq_ms`` (forward
    + backward median), ``fwd_ms``, ``bwd_ms``.
    """
    import torch  # noqa: PLC0415

    from experiments.measured.gpu_common import time_whole_sequence  # noqa: PLC0415
    from libra.data.windows import gbs_windows  # noqa: PLC0415
    from libra.runtime.kernels import get_backend  # noqa: PLC0415

    device = torch.device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    backend = get_backend(cfg.backend, device)
    geom, timing = cfg.geometry(device), cfg.timing
    windows = gbs_windows(cfg.workload, cfg.seq_len, cfg.gbs, cfg.windows, seed=cfg.seed)
    out = {}
    for w in window_ids:
        rows = []
        for seq in windows[w]:
            t = time_whole_sequence(backend, seq.sample_lengths, geom, timing, seed=cfg.seed + seq.seq_id)
            rows.append({"window": int(w), "seq_id": int(seq.seq_id), "ideal_seq_ms": t["ms"],
                         "fwd_ms": t["fwd_ms"], "bwd_ms": t["bwd_ms"]})
        out[str(w)] = rows
    return out


def _ideal_rank(rank: int, world: int, cfg: MicrobenchConfig, window_ids: list[int]) -> dict:
    return measure_ideal(cfg, window_ids)


def add_ideal(rows: list[dict], ideal_rows: list[dict], cp: int) -> list[dict]:
    """Each step row with ``ideal_ms`` (mean over its DP ranks' sequences of their whole-sequence
    time, divided by CP) and ``ideal_ratio`` (straggler / ideal)."""
    def per_seq(key):
        return {(int(r["window"]), int(r["seq_id"])): float(r.get(key, r["ideal_seq_ms"])) for r in ideal_rows}

    seq_ms, before, after = per_seq("ideal_seq_ms"), per_seq("ideal_before_ms"), per_seq("ideal_after_ms")
    out = []
    for row in rows:
        keys = [(int(row["window"]), int(x)) for x in str(row["seq_ids"]).split(";")]
        ideal = float(np.mean([seq_ms[k] for k in keys])) / cp
        drift = float(np.mean([after[k] for k in keys]) / np.mean([before[k] for k in keys])) - 1.0
        out.append({**row, "ideal_ms": ideal, "ideal_ratio": row["straggler_ms"] / ideal, "ideal_drift": drift})
    return out


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------


def run_spawned(nproc: int, cfg: MicrobenchConfig, keys: list, ideal_windows: list[int], deadline_s: float,
                on_point=None) -> dict:
    """One process for the ideal, ``nproc`` gloo ranks, then the ideal again (:func:`merge_ideals`:
    a host whose speed drifts while the ranks run shows in ``ideal_drift``, and the ideal is the
    mean of both instead of one side of the drift). ``on_point(message)`` is called here with every
    point as rank 0 finishes it (``{"key", "rows"}``).

    Returns rank 0's rows per point and ``{"ideal": {window: rows}}``.

    Raises:
        libra.runtime.launch.RankFailure: a rank failed (naming the rank that caused it).
        libra.runtime.launch.RankDeadlineError: the run passed its deadline.
    """
    from libra.runtime.launch import raise_first_failure, relayed_messages, run_local_ranks  # noqa: PLC0415

    got, ideals = {}, []
    ideal_job = [(_ideal_rank, 1, ideal_windows, "microbench ideal")] if ideal_windows else []
    jobs = ideal_job + ([(bench_rank, nproc, keys, "microbench ranks")] + ideal_job if keys else [])
    with relayed_messages(on_point) as (messages, poll):
        for fn, world, todo, what in jobs:
            extra = (None, messages.send) if fn is bench_rank else ()
            try:
                results = run_local_ranks(fn, world, cfg, todo, *extra, deadline_s=deadline_s,
                                          pg_timeout_s=cfg.timeout, threads=RANK_THREADS, what=what, poll=poll)
            finally:
                poll()  # the points finished before an interrupt or a failure are kept
            values = raise_first_failure(results, what)
            if fn is bench_rank:
                got.update(values[0])
            else:
                ideals.append(values[0])
    if ideals:
        got["ideal"] = merge_ideals(ideals)
    return got


def merge_ideals(runs: list[dict]) -> dict:
    """The ideal measured before and after the ranks (``runs``: :func:`measure_ideal` results): each
    sequence's ``ideal_seq_ms`` is their mean, ``ideal_before_ms`` / ``ideal_after_ms`` the two
    (equal when it was measured once)."""
    first, last = runs[0], runs[-1]
    out = {}
    for w, rows in first.items():
        after = {r["seq_id"]: r for r in last[w]}
        out[w] = [{**r, "ideal_seq_ms": (r["ideal_seq_ms"] + after[r["seq_id"]]["ideal_seq_ms"]) / 2,
                   "ideal_before_ms": r["ideal_seq_ms"], "ideal_after_ms": after[r["seq_id"]]["ideal_seq_ms"]}
                  for r in rows]
    return out


def run_torchrun(cfg: MicrobenchConfig, keys: list, ideal_windows: list[int], on_point=None) -> dict | None:
    """Inside torchrun: init from the environment (NCCL on CUDA, gloo on CPU); rows on rank 0, which
    also measures the ideal while the other ranks wait, and calls ``on_point`` with each finished point.

    What to compute is rank 0's decision (its point cache), broadcast to every rank: on nodes without
    a shared file system the other nodes' caches differ, and ranks running different points would
    wait on collectives that never match."""
    import torch.distributed as dist  # noqa: PLC0415

    from experiments.measured.training.ranks import torchrun_coords  # noqa: PLC0415

    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, timeout=_dt.timedelta(seconds=cfg.timeout))
    try:
        rank = dist.get_rank()
        todo = [keys, ideal_windows]
        dist.broadcast_object_list(todo, src=0)
        keys, ideal_windows = todo
        before = measure_ideal(cfg, ideal_windows) if rank == 0 and ideal_windows else None
        dist.barrier()
        out = bench_rank(rank, dist.get_world_size(), cfg, keys, torchrun_coords(), on_point if rank == 0 else None)
        dist.barrier()
        if rank == 0 and ideal_windows:  # before and after the ranks, as run_spawned
            out["ideal"] = merge_ideals([before, measure_ideal(cfg, ideal_windows)] if keys else [before])
        dist.barrier()
        return out if rank == 0 else None
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# summary and plot
# --------------------------------------------------------------------------------------------


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """One row per method: straggler mean / max, the ideal and how far from it, CPU time per rank,
    and (with ulysses in the run) speedups and ratios over Ulysses."""
    rows = []
    for method, g in df.groupby("method", sort=False):
        row = {"method": method, "steps": len(g), "mean_ms": g["straggler_ms"].mean(),
               "max_ms": g["straggler_ms"].max(), "compute_ms": g["compute_ms"].mean(),
               "comm_exposed_ms": g["comm_exposed_ms"].mean(), "mean_worker_ms": g["mean_worker_ms"].mean(),
               "peak_transient_mib": g["peak_transient_bytes"].max() / 2**20,
               "backend": g["backend"].iloc[0], "device": g["device"].iloc[0]}
        if "ideal_ms" in g:
            row["ideal_ms"] = g["ideal_ms"].mean()
            row["ideal_ratio"] = row["mean_ms"] / row["ideal_ms"]
            row["ideal_drift"] = g["ideal_drift"].mean() if "ideal_drift" in g else np.nan
        if "paired_ideal_ms" in g and g["paired_ideal_ms"].notna().all():
            row["paired_ideal_ms"] = g["paired_ideal_ms"].mean()
            row["paired_ratio"] = g["paired_ratio"].mean()  # each step's median per-repetition ratio
        if "cpu_ms" in g:
            row["cpu_ms"] = g["cpu_ms"].mean()
        rows.append(row)
    out = pd.DataFrame(rows)
    if "ulysses" in set(out["method"]):
        base = out.set_index("method").loc["ulysses"]
        out["mean_speedup"] = base["mean_ms"] / out["mean_ms"]
        out["max_speedup"] = base["max_ms"] / out["max_ms"]
        out["peak_vs_ulysses"] = out["peak_transient_mib"] / base["peak_transient_mib"]
        if "cpu_ms" in out:
            out["cpu_vs_ulysses"] = out["cpu_ms"] / base["cpu_ms"]
    return out


def plot(df: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    summary = summarize(df)
    long = summary.melt(id_vars=["method"], value_vars=["mean_ms", "max_ms"], var_name="metric", value_name="ms")
    long["metric"] = long["metric"].str.replace("_ms", "")
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.barplot(data=long, x="method", y="ms", hue="metric", ax=ax)
    if "ideal_ms" in summary:
        ax.axhline(float(summary["ideal_ms"].iloc[0]), color="black", linestyle="--", linewidth=1, label="reference (whole-sequence attention / CP)")
    if "paired_ideal_ms" in summary:  # measured beside each method's steps: one marker per method
        ax.scatter(range(len(summary)), summary["paired_ideal_ms"], marker="_", s=400, color="black", zorder=3,
                   label="paired reference")
    if "ideal_ms" in summary or "paired_ideal_ms" in summary:
        ax.legend()
    ax.set_ylabel("straggler core-attention time per step (ms)")
    ax.set_title(f"measured: {df['backend'].iloc[0]} on {df['device'].iloc[0]}, {df['dtype'].iloc[0]}")
    ax.tick_params(axis="x", rotation=20)
    from experiments.common.plotting import save_figure  # noqa: PLC0415  (Agg backend)

    save_figure(fig, path, caption=caption)


# --------------------------------------------------------------------------------------------
# command
# --------------------------------------------------------------------------------------------


def _missing_point(key):
    raise RuntimeError(f"point {key} was neither cached nor computed by the ranks")


def _measure(run: ExperimentRun, cfg: MicrobenchConfig, world: int, under_torchrun: bool) -> tuple[list[dict], list] | None:
    """Compute the points (and ideals) not cached yet: every step row with its ideal and the ranks'
    records (empty when every point was cached and no rank ran), or None on a non-zero torchrun rank.

    Under torchrun every rank joins the process group even when rank 0 has every point cached
    (:func:`run_torchrun`: rank 0 decides). Each point is cached as soon as rank 0 finishes it, with
    a progress line in logs; Ctrl-C or a failed rank says how many are cached and that a rerun resumes."""
    from libra.runtime.launch import RankDeadlineError, RankFailure  # noqa: PLC0415

    windows = range(cfg.windows)
    keys = [[m, w] for m in cfg.methods for w in windows]
    todo = [k for k in keys if run.cached(k) is None]
    ideal_todo = [w for w in windows if run.cached(["ideal", w]) is None]
    got = {}
    with progress(total=len(keys), desc="microbench", disable=run.quiet) as bar:
        bar.advance(len(keys) - len(todo))

        def on_point(message: dict) -> None:
            run.record(message["key"], message["rows"])
            bar.advance()

        try:
            if under_torchrun:
                got = run_torchrun(cfg, todo, ideal_todo, on_point)
                if got is None:  # non-zero torchrun ranks write nothing
                    return None
            elif todo or ideal_todo:
                got = run_spawned(world, cfg, todo, ideal_todo, deadline_s=cfg.timeout * 4, on_point=on_point)
        except KeyboardInterrupt:
            click.echo(f"\ninterrupted: {_cached_text(run, keys)}", err=True)
            raise click.exceptions.Exit(130) from None
        except (RankFailure, RankDeadlineError) as exc:
            raise click.ClickException(f"{exc}; {_cached_text(run, keys)}") from None
    for k in todo:
        run.record(k, got[stable_hash(k)])
    for w in ideal_todo:
        run.record(["ideal", w], got["ideal"][str(w)])
    ideal_rows = [r for w in windows for r in run.cached(["ideal", w])]
    return add_ideal(run.map(keys, _missing_point, desc="microbench"), ideal_rows, cfg.cp), got.get("ranks", [])


def _cached_text(run: ExperimentRun, keys: list) -> str:
    done = sum(run.cached(k) is not None for k in keys)
    return (f"{done} of {len(keys)} points of microbench are cached in {run.points_dir}; rerun the same command "
            "to resume")


def _world(nproc, dp: int, cp: int, device: str, oversubscribe: bool) -> tuple[int, bool]:
    """The number of ranks and whether torchrun launched this process; checks them (ValueError)."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and nproc is None
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else nproc
    if world is None:
        raise ValueError("pass --nproc N (local spawn) or launch under torchrun")
    if world != dp * cp:
        raise ValueError(f"--nproc/WORLD_SIZE={world} must equal DP*CP={dp * cp}")
    if device.startswith("cuda") and not under_torchrun:
        raise ValueError("--device cuda needs one GPU per rank: launch under torchrun")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun else world
    check_cpu_ranks(local, device, oversubscribe)
    return world, under_torchrun


@click.command("microbench", context_settings={"default_map": {f: getattr(DEFAULT_TAP, f) for f in TAP_FIELDS}})
@click.option("--nproc", type=int, default=None, help="Spawn this many local gloo processes (= DP*CP). "
              "Omit under torchrun.")
@click.option("--dp", type=click.IntRange(min=1), default=2, show_default=True, help="Data-parallel degree DP.")
@click.option("--cp", type=click.IntRange(min=1), default=2, show_default=True, help="Context-parallel degree CP.")
@click.option("--seq-len", type=SizeType(), default=2048, show_default=True, help="Tokens per packed sequence S (accepts 16K).")
@click.option("--gbs", type=click.IntRange(min=1), default=4, show_default=True, help="Packed sequences per window.")
@tap_options(*TAP_FIELDS)
@click.option("--q-heads", type=click.IntRange(min=1), default=8, show_default=True, help="Query heads.")
@click.option("--kv-heads", type=click.IntRange(min=1), default=2, show_default=True, help="KV heads (divide the query heads).")
@click.option("--head-dim", type=click.IntRange(min=1), default=32, show_default=True, help="Head width.")
@click.option("--dtype", type=DtypeType(DTYPES), default="fp32", show_default=True,
              help=f"One of {', '.join(DTYPES)} (long names such as bfloat16 accepted).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda (one GPU per rank under torchrun).")
@click.option("--backend", default="auto", show_default=True, help="Kernel backend (auto resolves per device).")
@click.option("--comm", default="p2p", show_default=True, help="p2p (batch_isend_irecv) or a2a.")
@click.option("--methods", default="ulysses,libra-tap,libra", show_default=True,
              help=f"Comma list of {', '.join(METHODS)}.")
@click.option("--windows", type=click.IntRange(min=1), default=1, show_default=True, help="GBS windows to measure.")
@click.option("--workload", default="libra-prod", show_default=True,
              help="Length preset or length file (skewed CPU cases: workloads/skewed-8k.txt, ...).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the length stream and the inputs.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="Timed repetitions per step.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed repetitions per step first (a method's first step: at least 1).")
@click.option("--forward-only", is_flag=True, help="Time forward only (default: forward + backward).")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Collective timeout (s).")
@click.option("--profile", default=None, help="Hardware profile (name or .json, e.g. from `libra-bench calibrate "
              "--device cpu`) that libra-kt balances kernel time with and libra-adaptive prices with; needs one "
              "of them in --methods.")
@click.option("--oversubscribe", is_flag=True, help="Allow more single-thread CPU ranks than usable cores "
              "(timings then show total CPU work / cores, not balance; recorded in run.json).")
@click.option("--paired-ideal/--no-paired-ideal", default=True, show_default=True,
              help="Every rank also times its DP rank's whole sequence right after each repetition (paired_ratio: "
                   "median of straggler / that ideal, robust to host drift); costs about one more step per step.")
@quick_option("Smoke run: 1 window, 1 repeat, no warm-up, S=1024, B=128, "
              "head_dim 16 (each unless given).")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Output folder.")
@click.option("--force", is_flag=True, help="Recompute cached points.")
@overwrite_option()
@click.option("--no-progress", is_flag=True, help="No progress bar or progress lines.")
@click.pass_context
def microbench(ctx, nproc, dp, cp, seq_len, gbs, pool_size, block_size, head_split, tau, pipeline_chunks,
               q_heads, kv_heads, head_dim, dtype, device, backend, comm, methods, windows, workload, seed, repeats,
               warmup, forward_only, timeout, profile, oversubscribe, paired_ideal, quick, out, force, no_progress):
    """Measured core-attention straggler per step (Libra sec. 6.3) for Ulysses and Libra, with the
    measured ideal and CPU time per rank."""
    p = {"windows": windows, "repeats": repeats, "warmup": warmup, "seq_len": seq_len, "block_size": block_size,
         "head_dim": head_dim}
    p = apply_quick(ctx, p, QUICK) if quick else p
    try:
        tap = replace(DEFAULT_TAP, pool_size=pool_size, block_size=p["block_size"], head_split=head_split, tau=tau,
                      pipeline_chunks=pipeline_chunks)
        cfg = MicrobenchConfig(dp=dp, cp=cp, seq_len=p["seq_len"], gbs=gbs, tap=tap, q_heads=q_heads,
                               kv_heads=kv_heads, head_dim=p["head_dim"], dtype=dtype, device=device, backend=backend,
                               comm=comm, methods=methods, windows=p["windows"], workload=workload, seed=seed,
                               repeats=p["repeats"], warmup=p["warmup"], backward=not forward_only, timeout=timeout,
                               profile=profile, oversubscribe=oversubscribe, paired_ideal=paired_ideal)
        world, under_torchrun = _world(nproc, dp, cp, device, oversubscribe)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    record = cfg.to_record()
    run = ExperimentRun("microbench", record, out_dir=out, force=force, quiet=no_progress,
                        layouts=[{k: v for k, v in record.items() if k in ("dp", "cp", "seq_len", "gbs", "tap")}])
    if not under_torchrun or os.environ["RANK"] == "0":  # the folder rank 0 writes: checked before any rank starts
        run.claim_folder()
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    measured = _measure(run, cfg, world, under_torchrun)
    if measured is None:
        return
    rows, ranks = measured
    from experiments.measured.training.ranks import nodes_of  # noqa: PLC0415  (imports torch: keeps `--help` fast)

    _finish(run, cfg, rows, {"measured": True, "ranks": ranks, "nodes": nodes_of(ranks) if ranks else None, "launch": "torchrun" if under_torchrun else f"spawn --nproc {world}",
                        "world_size": world, "usable_cores": usable_cores(),
                        "bench_wall_s": round(time.perf_counter() - t0, 3),
                        # CPU timings on a shared host are only as quiet as the host: record its load
                        "loadavg_1m": [load_start, os.getloadavg()[0] if hasattr(os, "getloadavg") else None]})


def _finish(run: ExperimentRun, cfg: MicrobenchConfig, rows: list[dict], extra: dict) -> None:
    """Write the step CSV, the summary, the plot and run.json; print the summary."""
    from libra.data.windows import gbs_windows  # noqa: PLC0415

    df = pd.DataFrame(rows)
    df = df[STRAGGLER_COLUMNS + [c for c in df.columns if c not in STRAGGLER_COLUMNS]]
    summary = summarize(df)
    targets = reference_targets(cfg, gbs_windows(cfg.workload, cfg.seq_len, cfg.gbs, cfg.windows, seed=cfg.seed))
    extra = {**extra, "kernel_backend": df["backend"].iloc[0], "device": df["device"].iloc[0],
             "targets": [asdict(t) for t in targets]}
    paths = run.finish(df, plot=lambda d, p: plot(d, p, run_caption(run.config)), extra=extra,
                       files={"microbench_summary.csv": summary.to_csv(index=False)})
    cols = [c for c in ("method", "steps", "mean_ms", "max_ms", "ideal_ms", "ideal_ratio", "ideal_drift",
                        "paired_ideal_ms", "paired_ratio", "cpu_ms",
                        "cpu_vs_ulysses",
                        "comm_exposed_ms", "peak_transient_mib", "mean_speedup") if c in summary]
    click.echo(summary[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    for line in filter(None, (t.line(summary) for t in targets)):  # the CPU microbench's reference cases
        click.echo(line)
    click.echo(f"backend {extra['kernel_backend']} on {extra['device']}; wrote {paths['csv']}")
