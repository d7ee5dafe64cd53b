"""Fit the occupancy kernel model (:mod:`libra.sim.occupancy`) to measured kernel calls and compare
it with a profile's length-curve model, per pass and per layout.

Two sources of calls: a ``kernel-sweep`` CSV (layouts single / packed / mixed / short-batch, one
row per call and pass) and ``libra-bench calibrate``'s sweep table (length, heads, piece and launch
sweeps; :func:`calibrate_calls`), which is how ``calibrate`` fits it where a GPU exists.

    python -m experiments.measured.occupancy_fit results/gpu/nvidia-h200/kernel-sweep/kernel_sweep.csv \\
        results/gpu/nvidia-h200/calibrate/profile.json
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from libra.sim.kernel import KernelModel
from libra.sim.occupancy import OccupancyModel, PassCost, fit_pass_cost
from libra.sim.profiles import load_profile
from libra.workload import sample_area

PASSES = ("fwd", "bwd")

FA2_SM90_HDIM128_BLOCKS = (128, 64)
"""FlashAttention-2's forward block (query rows, keys) for head_dim 128 on sm90: ``run_mha_fwd_hdim128``
in ``csrc/flash_attn/src/flash_fwd_launch_template.h`` (``docs/profile.md`` cites the commit)."""


def segment_lengths(text: str) -> np.ndarray:
    """``"16384+1024x16"`` -> one length per segment (the kernel sweep's ``segment_lengths``)."""
    out = []
    for part in str(text).split("+"):
        length, _, count = part.partition("x")
        out += [int(length)] * (int(count) if count else 1)
    return np.array(out, dtype=np.int64)


def sweep_calls(df: pd.DataFrame) -> list[tuple]:
    """``(q_lens, kv_lens, heads, head_dim)`` of every row of a kernel-sweep table (whole documents)."""
    calls = []
    for row in df.itertuples(index=False):
        lengths = segment_lengths(row.segment_lengths)
        calls.append((lengths, lengths, int(row.heads), int(row.head_dim)))
    return calls


def calibrate_calls(df: pd.DataFrame, head_dim: int) -> list[tuple]:
    """Calls of ``libra-bench calibrate``'s length, heads, piece and launch sweep rows (``documents``
    documents of ``length`` tokens, queries from ``q_start``; NaN ``q_start``: whole documents)."""
    calls = []
    for row in df.itertuples(index=False):
        docs = int(row.documents) if np.isfinite(row.documents) else 1
        kv = np.full(docs, int(row.length), dtype=np.int64)
        q0 = int(row.q_start) if np.isfinite(getattr(row, "q_start", np.nan)) else 0
        calls.append((kv - q0, kv, int(row.heads), head_dim))
    return calls


def calibrate_occupancy_fit(df: pd.DataFrame, info: dict, head_dim: int) -> dict | None:
    """The occupancy model fitted to ``libra-bench calibrate``'s kernel rows, for the measured
    profile's ``source`` (the profile keeps the length-curve model); None without a device SM count
    (a CPU run: the CPU profile keeps its own fit) or with fewer than 3 measured calls per pass."""
    sms = info.get("multiprocessors")
    if not sms:
        return None
    rows = df[df["sweep"].isin(["length", "heads", "piece", "launch"]) & np.isfinite(df["ms"])]
    calls, times = {}, {}
    for p in PASSES:
        sub = rows[rows["pass"] == p]
        if len(sub) < 3:
            return None
        calls[p], times[p] = calibrate_calls(sub, head_dim), sub["ms"].to_numpy(dtype=np.float64)
    model, errors = fit_occupancy(calls, times, int(sms), head_dim=head_dim)
    return {"occupancy": model.to_dict(),
            "median_abs_err": {p: float(np.median(np.abs(e))) for p, e in errors.items()},
            "worst_abs_err": {p: float(np.max(np.abs(e))) for p, e in errors.items()},
            "meaning": "experiments.measured.occupancy_fit.fit_occupancy on the length, heads, piece and launch sweeps; "
                       "block sizes are FlashAttention-2's sm90 head_dim-128 forward blocks; to use it, copy "
                       "`occupancy` into kernel with model = 'occupancy'"}


def length_curve_ms(kernel: KernelModel, calls: list[tuple], backward: bool) -> np.ndarray:
    """Each call's time under the length-curve model: launch (x ``backward_time_ratio`` backward) plus
    every segment priced per segment, as the cost model prices one call."""
    out = []
    for q, kv, heads, d in calls:
        area = (sample_area(kv) - sample_area(kv - q)).astype(np.float64)
        price = kernel.segment_backward_ms if backward else kernel.segment_forward_ms
        launch = kernel.launch_ms * (kernel.backward_time_ratio if backward else 1.0)
        out.append(launch + float(np.sum(price(area, heads, d, kv))))
    return np.array(out)


def fit_occupancy(calls: dict, times: dict, multiprocessors: int, blocks=FA2_SM90_HDIM128_BLOCKS,
                  head_dim: int = 128) -> tuple[OccupancyModel, dict]:
    """Fit both passes' constants (:func:`libra.sim.occupancy.fit_pass_cost`).

    Args:
        calls, times: ``{"fwd"|"bwd": calls}`` and ``{pass: (n,) ms}``.
        multiprocessors: the device's SM count.
        blocks: ``(block_q, block_k)`` of the kernel.
        head_dim: the head width the constants are fitted at.

    Returns:
        ``(model, {pass: relative errors})``.
    """
    start = PassCost(0.03, 0.005, 0.002)
    model = OccupancyModel(multiprocessors, blocks[0], blocks[1], head_dim, start, start)
    fitted, errors = {}, {}
    for p in PASSES:
        fitted[p], errors[p] = fit_pass_cost(model, calls[p], times[p], backward=p == "bwd")
    return OccupancyModel(multiprocessors, blocks[0], blocks[1], head_dim, fitted["fwd"], fitted["bwd"]), errors


def compare_table(df: pd.DataFrame, kernel: KernelModel, occupancy: OccupancyModel) -> pd.DataFrame:
    """Median and worst |relative error| of both models per pass and layout (and ``all``)."""
    rows = []
    for p in PASSES:
        sub = df[df["pass"] == p]
        calls = sweep_calls(sub)
        t = sub["ms"].to_numpy(dtype=np.float64)
        occ = np.array([occupancy.call_ms(q, kv, h, d, backward=p == "bwd") for q, kv, h, d in calls])
        err = {"occupancy": np.abs(occ / t - 1), "length-curve": np.abs(length_curve_ms(kernel, calls, p == "bwd") / t - 1)}
        layouts = sub["layout"].to_numpy()
        for layout in ["all", *sorted(set(layouts))]:
            sel = np.ones(len(t), bool) if layout == "all" else layouts == layout
            row = {"pass": p, "layout": layout, "calls": int(sel.sum())}
            for name, e in err.items():
                row[f"{name} median"], row[f"{name} worst"] = float(np.median(e[sel])), float(e[sel].max())
            rows.append(row)
    return pd.DataFrame(rows)


def main(argv: list[str]) -> int:
    """Fit on a kernel-sweep CSV, print the constants and the comparison with ``argv[1]``'s profile."""
    if len(argv) != 2:
        print("usage: python -m experiments.measured.occupancy_fit KERNEL_SWEEP_CSV PROFILE_JSON", file=sys.stderr)
        return 2
    df = pd.read_csv(argv[0])
    df = df[df["status"] == "ok"]
    kernel = load_profile(argv[1]).kernel
    sms = int(df["multiprocessors"].iloc[0])
    calls = {p: sweep_calls(df[df["pass"] == p]) for p in PASSES}
    times = {p: df[df["pass"] == p]["ms"].to_numpy(dtype=np.float64) for p in PASSES}
    model, _ = fit_occupancy(calls, times, sms)
    print(f"multiprocessors {sms}, block {model.block_q} x {model.block_k}")
    for p in PASSES:
        c = model.pass_cost(p == "bwd")
        print(f"{p}: launch {c.launch_ms * 1e3:.2f} us, block {c.block_ms * 1e3:.3f} us, tile {c.tile_ms * 1e3:.4f} us")
    with pd.option_context("display.width", 200, "display.precision", 3):
        print(compare_table(df, kernel, model).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
