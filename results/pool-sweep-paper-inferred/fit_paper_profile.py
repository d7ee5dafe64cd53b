"""Derive libra/sim/profiles/paper-inferred-v1.json: h100-roce-v1 with the inter-supernode
bandwidth fitted to ONE paper number (Libra sec. 6.5, Figure 15: on 256K, Libra (TAP+VRSP)'s
straggler communication at P = 32 is 0.77 of Ulysses' mean straggler).

The metric is the one `libra-bench pool-sweep` reports (``comm_norm`` of ``libra-tap-vrsp`` at
setting 256k, P = 32) on the same data: workload libra-prod, 4 GBS windows, seed 0, 32 q / 4 KV
heads, head_dim 128. Windows are planned once (planning never reads the profile) and re-priced
per candidate bandwidth by libra.sim.fit_links (same jitter seeds as simulate_window).
Deterministic; run from the repository root:

    .venv/bin/python results/pool-sweep-paper-inferred/fit_paper_profile.py

Writes the profile JSON and results/pool-sweep-paper-inferred/fit_log.json (every probe).
Lives here because the fitting driver needs experiments/ and baselines/ (planners, settings),
which libra/ must not import; libra.sim.fit_links holds the tested logic.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.sim_common import SETTINGS, jitter_seed, load_windows, make_planner, make_shape  # noqa: E402
from libra.sim.cost import CostModel  # noqa: E402
from libra.sim.fit_links import bisect_bandwidth, comm_share, crossing_traffic, with_link_bandwidth  # noqa: E402
from libra.sim.profiles import PROFILE_DIR, load_profile  # noqa: E402
from libra.sim.topology import Topology  # noqa: E402

BASE = "h100-roce-v1"
NAME = "paper-inferred-v1"
TARGET = 0.77  # Libra sec. 6.5: 256K communication at P = 32
SETTING, POOL, METHOD, WORKLOAD, WINDOWS, SEED = "256k", 32, "libra-tap-vrsp", "libra-prod", 4, 0
BRACKET = (0.5, 50.0)  # GB/s per GPU; the metric falls monotonically across it (checked by the fit)
DIGITS = 2  # the profile stores the bandwidth rounded to 0.01 GB/s


def main() -> None:
    base = load_profile(BASE)
    st = SETTINGS[SETTING]
    par = st.par()
    shape = make_shape(32, 4, 128)
    wins = load_windows(WORKLOAD, st, WINDOWS, SEED)
    method = make_planner(METHOD, st, pool_size=POOL)
    ulysses = make_planner("ulysses", st)
    method_plans = [method.plan_window(w, par, shape) for w in wins]
    base_plans = [ulysses.plan_window(w, par, shape) for w in wins]
    seeds = [jitter_seed(SEED, w) for w in range(WINDOWS)]

    def metric(bw: float) -> float:
        return comm_share(with_link_bandwidth(base, "inter_supernode", bw), par, method_plans, base_plans, seeds)

    fit = bisect_bandwidth(metric, TARGET, *BRACKET, rel_tol=1e-4)
    bw = round(fit.bandwidth_gbps, DIGITS)
    at_bw = metric(bw)
    at_base = metric(base.links["inter_supernode"].bandwidth_gbps)
    # diagnosis: how many GPUs of each supernode send across at once (bandwidth-independent)
    topo = Topology(base, par)
    cm = CostModel(base, topo)
    crossing = [row | {"window": w, "step": int(plan.ga_index)} for w, plans in enumerate(method_plans)
                for plan in plans for row in crossing_traffic(cm.price(plan), topo)]
    senders = [r["senders"] for r in crossing]
    skew = [r["max_worker_bytes"] / r["mean_worker_bytes"] for r in crossing if r["mean_worker_bytes"] > 0]
    procedure = (
        f"inter_supernode.bandwidth_gbps FITTED (everything else copied from {BASE}): bisection on log-bandwidth "
        f"over [{BRACKET[0]}, {BRACKET[1]}] GB/s (libra.sim.fit_links.bisect_bandwidth, rel_tol 1e-4; driver "
        f"results/pool-sweep-paper-inferred/fit_paper_profile.py) of ONE paper number: Libra sec. 6.5 / Figure 15, "
        f"256K, Libra (TAP+VRSP) straggler communication at P = 32 = {TARGET} x Ulysses mean straggler. Metric = "
        f"libra-bench pool-sweep's comm_norm (setting {SETTING}, P = {POOL}, method {METHOD}) on workload {WORKLOAD}, "
        f"{WINDOWS} windows, seed {SEED}, 32 q / 4 KV heads, head_dim 128. Result {fit.bandwidth_gbps:.4f} GB/s, "
        f"stored rounded to {bw} GB/s, where the metric is {at_bw:.4f} (h100-roce-v1's 25 GB/s gives {at_base:.4f}). "
        f"Equivalent to a ~{50.0 / bw:.1f}:1 oversubscription of the 50 GB/s per-GPU RoCE NIC between supernodes. "
        f"Diagnosis behind fitting only the bandwidth: in these plans {min(senders)}-{max(senders)} of each "
        f"supernode's {crossing[0]['workers']} GPUs send across supernodes in every step (max/mean bytes per "
        f"sender {min(skew):.2f}-{max(skew):.2f}), so a per-GPU share of a shared, oversubscribed uplink (capacity / "
        f"concurrent senders) is at most {crossing[0]['workers'] / min(senders):.2f}x the all-GPUs-send per-GPU figure "
        "the profile states, and only ever faster: a shared-uplink term cannot explain a 4x underestimate, so no "
        "cost-model term was added and only the bandwidth is fitted. Not validated against any measurement; a paper "
        "inference, not a fact about any cluster.")
    data = base.to_dict()
    data["name"] = NAME
    data["version"] = 1
    data["description"] = ("PAPER-INFERRED, not public facts: h100-roce-v1 with the inter-supernode bandwidth fitted "
                           f"to Libra Figure 15 (256K comm at P=32 = {TARGET}); use h100-roce-v1 for the public-fact default")
    data["links"]["inter_supernode"]["bandwidth_gbps"] = bw
    source = dict(base.source)
    source["links"] = (f"nvlink and roce as {BASE}: " + str(base.source.get("links", "")) +
                       " -- EXCEPT inter_supernode bandwidth, fitted (see inter_supernode_fit)")
    source["inter_supernode_fit"] = procedure
    source["derived_from"] = BASE
    data["source"] = source
    out = PROFILE_DIR / f"{NAME}.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    load_profile(out)  # validates
    log = {"target": TARGET, "setting": SETTING, "pool_size": POOL, "method": METHOD, "workload": WORKLOAD,
           "windows": WINDOWS, "seed": SEED, "bracket": list(BRACKET), "fit": fit.to_dict(),
           "stored_bandwidth_gbps": bw, "metric_at_stored": at_bw, "metric_at_h100_roce_v1": at_base,
           "crossing_traffic_per_supernode": crossing}
    (Path(__file__).parent / "fit_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"fitted inter_supernode bandwidth {fit.bandwidth_gbps:.4f} GB/s -> stored {bw} GB/s; "
          f"comm share at P={POOL}: {at_bw:.4f} (target {TARGET}; {BASE}: {at_base:.4f}); "
          f"{len(fit.probes)} probes; wrote {out}")


if __name__ == "__main__":
    main()
