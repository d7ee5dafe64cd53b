"""`libra-bench sim-check --nproc N`: the cost model's whole step against measurement.

``sim-check`` alone checks the simulator's *compute* term on one device. With ``--nproc N`` it
checks the whole step instead: for every method of ``--methods`` (any registry planner, ``ulysses``
and ``libra-adaptive`` included) each GBS window is planned, its steps are run measured on ``N``
ranks (gloo on CPU), and the *same Plans* are priced by :class:`libra.sim.cost.CostModel` under
``--profile`` (a CPU profile with a fitted gloo link class: ``libra-bench calibrate --device cpu
--links``). Per method, step and rank (and the step's straggler) it compares

* **compute**: the model's ``compute_ms`` (forward + backward kernels) with the runtime's time in
  its compute events (``RuntimeStats.compute_s``);
* **exposed communication**: the model's ``exposed_comm_ms`` (the Pipeliner's overlap, Libra sec.
  4.4) with the rest of the rank's wall time (wall - compute: waits, packing, relay rounds), which
  rank rows split into ``meas_wait_ms`` (blocked receiving), ``meas_issue_ms`` (packing and
  posting), ``meas_unpack_ms`` (copying returns in) and ``meas_other_ms`` (the rest): the host work
  around the transfers, which the model does not price, apart from the waits;
* **step time**: ``total_ms`` with the rank's wall time of the forward + backward call;

each as ``pred / meas - 1``. A rank's measured exposed time includes waiting for a peer whose
compute ran late (its returns come after that peer's chunk), which the model, pricing each
worker's own links and compute, does not couple; so the step-level row (``role = straggler``)
splits the step on its critical path, on both sides alike: step time = the slowest worker's
total (measured: microbench's rule, the median over repetitions of the slowest rank), compute =
the largest worker compute (measured: of that repetition), exposed = step time - compute.

Measurement is microbench's (:mod:`experiments.measured.microbench`): its rank setup, planners,
runners, inputs and timed call (``_time_calls``), one implementation per algorithm. What differs is
the order: the methods run **interleaved**, one repetition of each in turn (m1, m2, m3, m1, m2, ...
for ``--repeats``), every one after a barrier, so drifts of a shared host's speed hit every method
alike; medians over repetitions are compared. Rank 0 prices each Plan it planned (the ranks plan
deterministically, as microbench's do) before any timing; ``plan_digest`` records which Plan.

**Order**: for every pair of methods whose predicted stragglers differ by at least
:data:`ORDER_GAP` (15 %) in a step, ``order_agrees`` says whether the measured medians put them in
the same order (``sim_check_order.csv``, and a summary line).

On CPU every rank is one thread; more ranks than usable cores is refused unless ``--oversubscribe``
(then the ranks share the cores: the model's compute, one core per worker, is turned into each
rank's finish time under equal sharing of the host's cores, :func:`processor_sharing`, before it is
compared; ``run.json`` records ``shared_cores``). Outputs (``--out``): ``sim_check_steps.csv``
(one row per method, window, step and rank, plus ``role = straggler`` rows), ``sim_check_order.csv``,
``sim_check_steps.png`` (predicted vs measured per term) and ``run.json`` (median and worst
|relative error| per method and term, order agreement, ``os.getloadavg()`` before and after).
Launch: local spawn only (``--nproc``; torchrun is microbench's, not wired here).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click
import numpy as np
import pandas as pd

from experiments.common.runner import ExperimentRun
from experiments.common.runs_table import run_caption
from experiments.measured.microbench import (
    FIRST_STEP_WARMUP,
    RANK_THREADS,
    MicrobenchConfig,
    _local_tensors,
    _runner,
    _setup,
    _time_calls,
    check_cpu_ranks,
    make_planner,
    usable_cores,
)

ORDER_GAP = 0.15
"""Predicted straggler gap (slower / faster - 1) from which a pair's measured order is checked."""
TERMS = ("compute", "exposed", "total")
"""The terms compared: kernel time, exposed communication, step time (all forward + backward, ms)."""


@dataclass(frozen=True)
class StepsConfig:
    """A whole-step check: what the ranks run (``bench``, microbench's configuration, whose runners,
    inputs and timing they share) and what the pricing adds. :meth:`to_record` is ``run.json``'s
    ``config``.

    Attributes:
        bench: layout, methods, windows and timing of the measured steps.
        price_profile: the profile the Plans are priced under (``--profile``).
        nproc: ranks spawned (= DP * CP).
        shared_cores: the usable cores the ranks share when there are more ranks than cores (the
            model's compute is then priced with :func:`processor_sharing`); None: a core each.
    """

    bench: MicrobenchConfig
    price_profile: str
    nproc: int
    shared_cores: int | None = None

    def to_record(self) -> dict:
        """microbench's record plus the pricing's fields (``interleaved``: the methods always run in
        turn here, recorded so a run.json says how it was measured)."""
        return {**self.bench.to_record(), "price_profile": self.price_profile, "nproc": self.nproc,
                "interleaved": True, "shared_cores": self.shared_cores}


def steps_config(layout: dict, profile: str, nproc: int) -> StepsConfig:
    """The validated configuration of a whole-step check (raises ValueError naming the bad value).

    ``layout``: :class:`experiments.measured.microbench.MicrobenchConfig`'s fields but ``profile``
    (which the profiled planners also plan with here); ``nproc`` must equal DP*CP.
    """
    from experiments.measured.microbench import PROFILED  # noqa: PLC0415
    from libra.sim.profiles import load_profile  # noqa: PLC0415

    if not str(layout.get("device", "cpu")).startswith("cpu"):
        raise ValueError("sim-check --nproc spawns gloo CPU ranks; GPU ranks (NCCL) need torchrun, which only "
                         "microbench launches")
    load_profile(profile)  # an unknown name or a bad file fails here
    methods = layout["methods"]
    names = [m.strip() for m in methods.split(",")] if isinstance(methods, str) else list(methods)
    bench = MicrobenchConfig(**layout, profile=profile if set(PROFILED) & set(names) else None, paired_ideal=False)
    if nproc != bench.dp * bench.cp:
        raise ValueError(f"--nproc {nproc} must equal DP*CP = {bench.dp}*{bench.cp} = {bench.dp * bench.cp}")
    check_cpu_ranks(nproc, bench.device, bench.oversubscribe)
    cores = usable_cores()
    # more ranks than cores: the ranks share them (processor_sharing), which the model must price
    shared = cores if nproc * RANK_THREADS > cores else None
    return StepsConfig(bench=bench, price_profile=str(profile), nproc=nproc, shared_cores=shared)


def processor_sharing(compute_ms: np.ndarray, cores: int) -> np.ndarray:
    """Each rank's compute finish time when ``len(compute_ms)`` ranks share ``cores`` cores equally
    (egalitarian processor sharing; ``compute_ms`` is each rank's time alone on a core): while ``k``
    ranks still compute each runs at ``min(1, cores / k)`` of a core, so a balanced plan's ranks all
    finish at about total work / cores and a skewed plan's light ranks finish early and hand their
    core to the heavy one. Waits for peers are assumed to take no core (gloo blocks on its sockets)."""
    c = np.asarray(compute_ms, dtype=np.float64)
    order = np.argsort(c, kind="stable")
    finish = np.empty_like(c)
    t, done = 0.0, 0.0
    for i, w in enumerate(order):
        rate = min(1.0, cores / (len(c) - i))
        t += (c[w] - done) / rate
        done = c[w]
        finish[w] = t
    return finish


# --------------------------------------------------------------------------------------------
# the ranks
# --------------------------------------------------------------------------------------------


def steps_rank(rank: int, world: int, cfg: StepsConfig, window_ids: list[int], send=None) -> dict:
    """Every window of ``window_ids`` on this rank: plan it with every method, then run its steps
    with the methods interleaved (module docstring). Rank 0 prices the Plans and returns
    ``{str(window): rows}`` (and sends ``{"key", "rows"}`` through ``send`` per window); others ``{}``."""
    from libra.data.windows import gbs_windows  # noqa: PLC0415

    bench = cfg.bench
    device, backend, dtype, shape, groups = _setup(rank, bench)
    par = bench.par
    me = groups[1].cp.worker
    windows = gbs_windows(bench.workload, bench.seq_len, bench.gbs, bench.windows, seed=bench.seed)
    planners = {m: make_planner(m, bench) for m in bench.methods}
    cost = _cost_model(cfg, par) if rank == 0 else None
    out, first = {}, True
    for w in window_ids:
        plans = {m: planners[m].plan_window(windows[w], par, shape) for m in bench.methods}
        rows = []
        for i in range(len(plans[bench.methods[0]])):
            step = {m: plans[m][i] for m in bench.methods}
            priced = {m: _priced(cost, p) for m, p in step.items()} if rank == 0 else None
            warmup = max(bench.warmup, FIRST_STEP_WARMUP) if first else bench.warmup
            first = False
            gathered = _interleave(step, bench, (groups, backend, shape, me, dtype, device), warmup, world)
            if rank == 0:
                rows += _step_rows(w, step, priced, gathered, cfg)
        if rank == 0:
            out[str(w)] = rows
            if send is not None:
                send({"key": ["steps", w], "rows": rows})
    return out


def _cost_model(cfg: StepsConfig, par):
    from libra.sim.cost import CostModel  # noqa: PLC0415
    from libra.sim.profiles import load_profile  # noqa: PLC0415
    from libra.sim.topology import Topology  # noqa: PLC0415

    prof = load_profile(cfg.price_profile)
    return CostModel(prof, Topology(prof, par))


def _priced(cost, plan) -> dict:
    """The model's per-worker terms of ``plan`` (and which Plan it was)."""
    c = cost.price(plan)
    return {"compute": c.compute_ms, "exposed": c.exposed_comm_ms, "total": c.total_ms,
            "compute_fwd": c.compute_fwd_ms, "compute_bwd": c.compute_bwd_ms, "serial": c.comm_ms,
            "bytes": sum(c.bytes_sent.values()), "digest": plan.digest()[:16],
            "relay_rows": int(sum((p.transfers.hop > 0).sum() for p in plan.pools)),
            "hops": int(max([int(p.transfers.hop.max()) for p in plan.pools if len(p.transfers.hop)] or [0])),
            "choice": ";".join(plan.meta.get("adaptive_choice", ())), "chunks": int(plan.pipeline_chunks)}


def _interleave(step: dict, cfg: MicrobenchConfig, env: tuple, warmup: int, world: int) -> dict:
    """Run ``warmup + repeats`` rounds, each one call of every method in turn; returns per method
    the ``(world, k)`` matrix of every rank's measurements (microbench's layout, :func:`_step_row`)."""
    import torch  # noqa: PLC0415

    from libra.runtime.groups import all_gather_single  # noqa: PLC0415

    groups, backend, shape, me, dtype, device = env
    once = replace(cfg.timing, warmup=0, repeats=1)  # one call per method per round
    prepared = {}
    for m, plan in step.items():
        runner, ranges, seq_ids, chunks, P = _runner(m, plan, cfg, groups, backend, shape, me)
        prepared[m] = (runner, _local_tensors(ranges, seq_ids, shape, dtype, device, cfg.seed), chunks, P)
    got = {m: [] for m in step}
    for r in range(warmup + cfg.repeats):
        for m, (runner, inputs, _, _) in prepared.items():
            res = _time_calls(runner, inputs, once, device)
            if r >= warmup:  # the call's stats stay on the runner until the next call resets them
                got[m].append([float(x[0]) for x in res[:4]] + _host_parts(runner.stats))
    out = {}
    for m, (runner, _, _, P) in prepared.items():
        st = runner.stats
        sent = st["sent_bytes"] / (warmup + cfg.repeats) if isinstance(st, dict) else sum(st.sent_bytes.values())
        peak = st["peak_transient_bytes"] if isinstance(st, dict) else st.peak_transient_bytes
        t = np.array(got[m]).T  # (len(MEASURED), R)
        mine = np.concatenate([*t, [peak, sent, P]])
        allv = torch.zeros(world * mine.size, dtype=torch.float64, device=device)
        all_gather_single(allv, torch.tensor(mine, dtype=torch.float64).to(device))
        out[m] = allv.view(world, -1).cpu().numpy()
    return out


MEASURED = ("wall", "cpu", "compute", "wait", "issue", "unpack")
"""Seconds a rank measures per call, in the order :func:`_interleave` gathers them (each ``R``
repetitions), followed by its peak transient bytes, bytes sent and pool size."""


def _host_parts(stats) -> list[float]:
    """A call's host seconds issuing and unpacking messages (0 for a runner that records none)."""
    st = stats if isinstance(stats, dict) else vars(stats)
    return [float(st.get("issue_s", 0.0)), float(st.get("unpack_s", 0.0))]


def _measured(allv: np.ndarray, R: int) -> dict:
    """The gathered ``(world, ...)`` matrix as ``{name: (world, R) ms}`` for :data:`MEASURED` plus
    ``sent`` (bytes per rank)."""
    out = {name: allv[:, i * R:(i + 1) * R] * 1e3 for i, name in enumerate(MEASURED)}
    return {**out, "sent": allv[:, len(MEASURED) * R + 1]}


def _step_rows(window: int, step: dict, priced: dict, gathered: dict, cfg: StepsConfig) -> list[dict]:
    """One row per (method, rank) and one straggler row per method of one step."""
    R, rows = cfg.bench.repeats, []
    for m, plan in step.items():
        allv = gathered[m]
        pr = priced[m]
        if cfg.shared_cores:  # the host's ranks share its cores: the model priced one core each
            compute = processor_sharing(pr["compute"], cfg.shared_cores)
            pr = {**pr, "compute": compute, "total": compute + pr["exposed"]}
        got = _measured(allv, R)
        wall, compute = got["wall"], got["compute"]
        head = {"method": m, "window": int(window), "step": int(plan.ga_index), "plan_digest": pr["digest"],
                "choice": pr["choice"], "relay_rows": pr["relay_rows"], "hops": pr["hops"],
                "pipeline_chunks": pr["chunks"]}
        for w in range(allv.shape[0]):
            meas = {"compute": float(np.median(compute[w])),
                    "exposed": float(np.median(np.maximum(wall[w] - compute[w], 0.0))),
                    "total": float(np.median(wall[w]))}
            rows.append(_compare({**head, "role": "rank", "worker": w, "pred_bytes_sent": float(pr["bytes"][w]),
                                  "meas_bytes_sent": float(got["sent"][w]),
                                  "pred_comm_serial_ms": float(pr["serial"][w]),
                                  **_exposed_parts({k: v[w] for k, v in got.items() if k != "sent"})}, pr, w, meas))
        step_ms = wall.max(axis=0)
        rep = int(np.argsort(step_ms)[len(step_ms) // 2])  # microbench's median repetition
        slowest = float(compute[:, rep].max())
        meas = {"compute": slowest, "exposed": float(step_ms[rep]) - slowest, "total": float(step_ms[rep])}
        top = float(pr["compute"].max())
        pred = {"compute": [top], "exposed": [float(pr["total"].max()) - top], "total": [float(pr["total"].max())]}
        rows.append(_compare({**head, "role": "straggler", "worker": int(np.argmax(pr["total"])),
                              "meas_worker": int(np.argmax(wall[:, rep]))},
                             pred, 0, meas))
    return rows


def _exposed_parts(got: dict) -> dict:
    """Where a rank's measured exposed time went (medians over repetitions, ms): ``meas_wait_ms``,
    blocked in a receive or a relay round (``RuntimeStats.comm_wait_s``); ``meas_issue_ms``, packing
    send buffers and posting messages; ``meas_unpack_ms``, copying returns into outputs and
    gradients; ``meas_other_ms``, the rest of wall - compute (the backward's gradient buffers,
    autograd, Python between events). The model prices transfers only: a large wait is a link
    slower than priced or a late peer, the other three are host work it does not see."""
    rest = got["wall"] - got["compute"] - got["wait"] - got["issue"] - got["unpack"]
    return {"meas_wait_ms": float(np.median(got["wait"])), "meas_issue_ms": float(np.median(got["issue"])),
            "meas_unpack_ms": float(np.median(got["unpack"])), "meas_other_ms": float(np.median(np.maximum(rest, 0.0)))}


def _compare(row: dict, pred: dict, w: int, meas: dict) -> dict:
    for t in TERMS:
        p, m = float(pred[t][w]), meas[t]
        row[f"pred_{t}_ms"], row[f"meas_{t}_ms"] = p, m
        row[f"rel_err_{t}"] = p / m - 1.0 if m > 0 else float("nan")
    # exposed comm is often a sliver of the step: its error as a share of the measured step too
    row["exposed_err_of_step"] = (row["pred_exposed_ms"] - row["meas_exposed_ms"]) / row["meas_total_ms"]
    return row


# --------------------------------------------------------------------------------------------
# summary, order, plot
# --------------------------------------------------------------------------------------------


def heaviest_rank_parts(df: pd.DataFrame) -> pd.DataFrame:
    """Per method and step, the rank row with the most measured compute: the critical path's rank.
    Its waits against the transfer time the model prices (``pred_comm_serial_ms``) tell a link
    priced too fast from host work the model does not price (issue, unpack, other). (The rank that
    finishes last is often a lighter one, waiting for this rank's late returns.)"""
    ranks = df[df.role == "rank"]
    if ranks.empty or "meas_wait_ms" not in ranks:
        return ranks
    top = ranks.groupby(["method", "window", "step"], sort=False)["meas_compute_ms"].idxmax()
    return ranks.loc[top.to_numpy()]


def summarize_steps(df: pd.DataFrame) -> dict:
    """Per method and role (rank / straggler): median and worst |relative error| of each term; for
    the straggler role also the medians of :func:`heaviest_rank_parts`."""
    out = {}
    top_rank = heaviest_rank_parts(df)
    for (method, role), g in df.groupby(["method", "role"], sort=False):
        entry = {"rows": int(len(g))}
        for t in TERMS:
            err = g[f"rel_err_{t}"].abs()
            entry[f"median_abs_err_{t}"] = float(err.median())
            entry[f"worst_abs_err_{t}"] = float(err.max())
            entry[f"median_signed_err_{t}"] = float(g[f"rel_err_{t}"].median())
            entry[f"pred_{t}_ms"] = float(g[f"pred_{t}_ms"].median())
            entry[f"meas_{t}_ms"] = float(g[f"meas_{t}_ms"].median())
        entry["median_exposed_err_of_step"] = float(g["exposed_err_of_step"].median())
        if role == "rank":
            entry.update({f"meas_{part}_ms": float(g[f"meas_{part}_ms"].median())
                          for part in ("wait", "issue", "unpack", "other")})
        mine = top_rank[top_rank.method == method]
        if role == "straggler" and len(mine):
            entry["rank"] = {c: float(mine[c].median()) for c in ("pred_comm_serial_ms", "meas_wait_ms", "meas_issue_ms",
                                                                 "meas_unpack_ms", "meas_other_ms")}
        out.setdefault(method, {})[role] = entry
    return out


def order_table(df: pd.DataFrame, gap: float = ORDER_GAP) -> pd.DataFrame:
    """Every pair of methods per step: predicted and measured straggler, the predicted gap (slower /
    faster - 1) and, where it is at least ``gap``, whether the measured order agrees."""
    s = df[df.role == "straggler"]
    rows = []
    for (w, step), g in s.groupby(["window", "step"], sort=True):
        by = g.set_index("method")
        for a, b in itertools.combinations(list(by.index), 2):
            pa, pb = float(by.loc[a, "pred_total_ms"]), float(by.loc[b, "pred_total_ms"])
            ma, mb = float(by.loc[a, "meas_total_ms"]), float(by.loc[b, "meas_total_ms"])
            pred_gap = max(pa, pb) / min(pa, pb) - 1.0
            checked = pred_gap >= gap
            rows.append({"window": int(w), "step": int(step), "method_a": a, "method_b": b,
                         "pred_a_ms": pa, "pred_b_ms": pb, "meas_a_ms": ma, "meas_b_ms": mb,
                         "pred_gap": pred_gap, "meas_gap": max(ma, mb) / min(ma, mb) - 1.0,
                         "pred_faster": a if pa < pb else b, "meas_faster": a if ma < mb else b, "checked": checked,
                         "order_agrees": (pa < pb) == (ma < mb) if checked else None})
    return pd.DataFrame(rows)


def plot_steps(df: pd.DataFrame, path: Path, caption: str | None = None) -> None:
    """Predicted vs measured per term (rank rows small, straggler rows large), log axes, y = x."""
    from experiments.common.plotting import save_figure, setup_style  # noqa: PLC0415  (selects Agg first)

    setup_style()
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(TERMS), figsize=(12, 4))
    for ax, t in zip(axes, TERMS):
        d = df.assign(meas=df[f"meas_{t}_ms"].clip(lower=1e-3), pred=df[f"pred_{t}_ms"].clip(lower=1e-3))
        sns.scatterplot(data=d, x="meas", y="pred", hue="method", style="role", size="role",
                        sizes={"rank": 30, "straggler": 90}, ax=ax, legend=t == TERMS[-1])
        lo, hi = float(min(d.meas.min(), d.pred.min())) * 0.8, float(max(d.meas.max(), d.pred.max())) * 1.25
        xs = np.geomspace(lo, hi, 50)
        ax.plot(xs, xs, color="black", lw=1)
        ax.fill_between(xs, xs * 0.8, xs * 1.2, color="grey", alpha=0.2)
        ax.set(xscale="log", yscale="log", xlabel=f"measured {t} (ms)", ylabel=f"predicted {t} (ms)", title=t)
    if axes[-1].get_legend() is not None:
        axes[-1].legend(fontsize=7, loc="upper left")
    fig.suptitle("sim-check --nproc: cost model vs measured whole steps (band +-20 %)", fontsize=9)
    save_figure(fig, path, caption=caption)


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def run_steps_check(cfg: StepsConfig, out: str | None, force: bool = False, quiet: bool = False) -> dict:
    """Measure the windows not cached yet, price, and write (module docstring).

    Returns ``{"df", "order", "summary", "paths", "out_dir"}``.

    Raises:
        click.ClickException: a rank failed or the run passed its deadline.
    """
    from libra.runtime.launch import (  # noqa: PLC0415
        RankDeadlineError,
        RankFailure,
        raise_first_failure,
        relayed_messages,
        run_local_ranks,
    )

    run = ExperimentRun("sim_check_steps", cfg.to_record(), out_dir=out, force=force, quiet=quiet)
    run.claim_folder()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    keys = [["steps", w] for w in range(cfg.bench.windows)]
    todo = [k[1] for k in keys if run.cached(k) is None]
    if todo:
        with relayed_messages(lambda msg: run.record(msg["key"], msg["rows"])) as (messages, poll):
            try:
                res = run_local_ranks(steps_rank, cfg.nproc, cfg, todo, messages.send,
                                      deadline_s=cfg.bench.timeout * 4, pg_timeout_s=cfg.bench.timeout,
                                      threads=RANK_THREADS, what="sim-check ranks", poll=poll)
            finally:
                poll()
            try:
                got = raise_first_failure(res, "sim-check ranks")[0]
            except (RankFailure, RankDeadlineError) as exc:
                raise click.ClickException(str(exc)) from None
        for w in todo:
            run.record(["steps", w], got[str(w)])
    df = pd.DataFrame([r for k in keys for r in run.cached(k)])
    order = order_table(df)
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    checked = order[order.checked] if len(order) else order
    summary = {"methods": summarize_steps(df), "order_gap": ORDER_GAP,
               "order_pairs_checked": int(len(checked)),
               "order_pairs_agree": int(checked.order_agrees.astype(bool).sum()) if len(checked) else 0,
               "oversubscribed": cfg.nproc * RANK_THREADS > usable_cores(), "shared_cores": cfg.shared_cores,
               "loadavg_before": list(load_before) if load_before else None,
               "loadavg_after": list(load_after) if load_after else None,
               "bench_wall_s": round(time.perf_counter() - t0, 3)}
    paths = run.finish(df, lambda d, p: plot_steps(d, p, run_caption(run.config)),
                       extra={"summary": summary, "usable_cores": usable_cores(), "launch": f"spawn --nproc {cfg.nproc}"},
                       files={"sim_check_order.csv": order.to_csv(index=False)})
    return {"df": df, "order": order, "summary": summary, "paths": paths, "out_dir": run.out_dir}


def echo_steps(res: dict) -> None:
    """Print the per-method comparison, the order pairs and the summary lines."""
    df, order, s = res["df"], res["order"], res["summary"]
    cols = ["method", "window", "step", "role", "worker", *[f"{a}_{t}_ms" for t in TERMS for a in ("pred", "meas")],
            *[f"rel_err_{t}" for t in TERMS]]
    click.echo(df[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    for method, roles in s["methods"].items():
        for role, e in roles.items():
            parts = (f"; measured exposed {e['meas_exposed_ms']:.4g} ms, of it waits {e['meas_wait_ms']:.4g}, "
                     f"issue {e['meas_issue_ms']:.4g}, unpack {e['meas_unpack_ms']:.4g}, other {e['meas_other_ms']:.4g} "
                     f"(medians of each)" if "meas_wait_ms" in e else "")
            if "rank" in e:
                r = e["rank"]
                parts += (f"; the compute-heaviest rank waits {r['meas_wait_ms']:.4g} ms against a priced transfer of "
                          f"{r['pred_comm_serial_ms']:.4g} ms, and spends issue {r['meas_issue_ms']:.4g} + unpack "
                          f"{r['meas_unpack_ms']:.4g} + other {r['meas_other_ms']:.4g} ms on host work the model "
                          f"does not price")
            click.echo(f"{method:>15} {role:>9}: " + "; ".join(
                f"{t} median |err| {e[f'median_abs_err_{t}']:.1%} (worst {e[f'worst_abs_err_{t}']:.1%})" for t in TERMS)
                + parts)
    if len(order):
        click.echo(order[["window", "step", "method_a", "method_b", "pred_gap", "meas_gap", "pred_faster",
                          "meas_faster", "order_agrees"]].to_string(index=False, float_format=lambda x: f"{x:+.1%}"))
    click.echo(f"order: the measured medians agree with {s['order_pairs_agree']} of {s['order_pairs_checked']} "
               f"pairs the model separates by >= {s['order_gap']:.0%}")
    if s["oversubscribed"]:
        click.echo(f"note: more ranks than usable cores (--oversubscribe): the model's compute is priced as the ranks "
                   f"sharing {s['shared_cores']} cores (processor_sharing)")
    click.echo(f"loadavg before {s['loadavg_before']} after {s['loadavg_after']}")
    click.echo(f"wrote {res['paths']['csv']}, {res['paths']['png']}, {res['out_dir'] / 'sim_check_order.csv'}")
