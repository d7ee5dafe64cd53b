"""The multi-node path, on one machine.

Two ``torchrun`` invocations (``--nnodes 2 --nproc-per-node 2 --node-rank {0,1}``, static
rendezvous on 127.0.0.1) form one world of 4 gloo ranks on two "nodes", exactly as two real nodes
would (only the address differs), and run ``microbench`` and ``train``. Checked: both launchers exit
0; the results record 4 ranks on 2 nodes; global ranks 2, 3 are local ranks 0, 1 of node 1; and the
DP x CP x pool groups hold the ranks the numbering says (CP groups inside a node, DP and pool groups
across the two nodes), as the groups' own all-gathers report them; the 2-node run trains the same
losses as a single-process reference run.

Slow (deselected by default): ``make multinode`` or ``pytest -m slow tests/test_multinode.py``;
about 30 s on an idle 2-core machine (4 ranks + 2 launcher agents per command).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
LAUNCH_TIMEOUT_S = 150  # seconds per command, both nodes together (~15 s when the machine is idle)
# what a launcher sets: a test run inside torchrun (or with a stale shell) must not leak it in
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(args: list[str], cwd, node1_args: list[str] | None = None) -> list[str]:
    """Run ``python -m experiments.cli ARGS`` (node 1: ``node1_args`` when given) as two torchrun
    "nodes" of 2 processes each; returns
    each node's output after asserting both exited 0. Past the timeout, or as soon as one node fails
    (its peer would wait out the rendezvous timeout), the launchers still running are killed."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even on a GPU machine
    port = _free_port()
    logs = [cwd / f"{args[0]}-node{node}.log" for node in range(NODES)]
    node_args = [args, node1_args or args]
    procs = []
    for node, log in enumerate(logs):
        with open(log, "w") as fh:  # a file, not a pipe: nothing blocks on a full pipe while we poll
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node",
                 str(PER_NODE), "--node-rank", str(node), "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
                 "--master-port", str(port), "-m", "experiments.cli", *node_args[node]],
                cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while (any(p.poll() is None for p in procs) and time.monotonic() < deadline
           and not any(p.poll() for p in procs)):  # poll() is None while running, 0 on success
        time.sleep(0.2)
    timed_out = any(p.poll() is None for p in procs) and time.monotonic() >= deadline
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher and its workers: this test's own processes
            p.wait()
    outs = [log.read_text() for log in logs]
    report = "\n".join(f"--- node {n} (exit {p.returncode}):\n{o[-3000:]}" for n, (p, o) in enumerate(zip(procs, outs)))
    assert not timed_out, f"two-node {args[0]} passed {LAUNCH_TIMEOUT_S}s:\n{report}"
    assert all(p.returncode == 0 for p in procs), report
    return outs


def test_microbench_runs_on_two_torchrun_nodes(tmp_path):
    out = tmp_path / "microbench"
    args = ["microbench", "--dp", "2", "--cp", "2", "--pool-size", "2", "--quick", "--methods", "ulysses,libra",
            "--device", "cpu", "--timeout", "60", "--oversubscribe", "--no-progress", "--out", str(out)]
    outs = _two_nodes(args, tmp_path)
    record = json.loads((out / "run.json").read_text())
    assert record["launch"] == "torchrun" and record["world_size"] == WORLD and record["nodes"] == NODES
    _check_ranks(record["ranks"], cp=2, dp=2, pool=2)
    df = pd.read_csv(out / "microbench.csv")
    assert set(df["method"]) == {"ulysses", "libra"} and df["measured"].all()
    assert df["straggler_worker"].between(0, WORLD - 1).all() and (df["straggler_ms"] > 0).all()
    assert "wrote" in outs[0] and "wrote" not in outs[1]  # rank 0 (node 0) is the one writer
    # every point cached on node 0 only (node 1 runs in another folder, as on a node without a shared
    # file system): rank 0 decides what runs and every rank still joins, so nobody waits for a peer
    elsewhere = [*args[:-1], str(tmp_path / "node1-cache")]  # node 1's own, empty point cache
    outs = _two_nodes(args, tmp_path, node1_args=elsewhere)
    assert "wrote" in outs[0] and "wrote" not in outs[1]
    assert json.loads((out / "run.json").read_text())["points_computed"] == 0


def _check_ranks(ranks: list[dict], cp: int, dp: int, pool: int) -> None:
    """Global rank r sits on node r // 2 as local rank r % 2, and its groups are the numbering's."""
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    for r in ranks:
        node, local = divmod(r["rank"], PER_NODE)  # torchrun: node n holds ranks [n * 2, n * 2 + 2)
        assert (r["node"], r["local_rank"], r["local_world_size"]) == (node, local, PER_NODE), r
        want = _expected_groups(r["rank"], cp, dp, pool)
        assert {k: r[k] for k in want} == want, r
    assert [(r["node"], r["local_rank"]) for r in ranks[2:]] == [(1, 0), (1, 1)]
    assert {r["node"] for r in ranks if r["rank"] in ranks[0]["dp_group"]} == {0, 1}  # DP spans the nodes


def _expected_groups(rank: int, cp: int, dp: int, pool_size: int) -> dict:
    """The groups of ``rank`` by the numbering of docs/architecture.md (rank = dp_rank * CP + cp_rank),
    written out independently of ``libra.runtime.groups``."""
    dp_rank, cp_rank = divmod(rank, cp)
    p0 = dp_rank // pool_size * pool_size
    return {"dp_rank": dp_rank, "cp_rank": cp_rank, "pool": dp_rank // pool_size,
            "cp_group": [dp_rank * cp + c for c in range(cp)],
            "pool_group": list(range(p0 * cp, (p0 + pool_size) * cp)),
            "dp_group": [d * cp + cp_rank for d in range(dp)]}


def test_train_runs_on_two_torchrun_nodes_with_cross_node_groups(tmp_path):
    from experiments.measured.train import TrainConfig, run_training  # noqa: PLC0415
    from experiments.measured.training.model import ModelConfig  # noqa: PLC0415

    out = tmp_path / "train"
    cp, dp, pool = 2, 2, 2
    outs = _two_nodes(["train", "--cp", str(cp), "--attention", "libra", "--pool-size", str(pool), "--steps", "2",
                       "--seq-len", "256", "--gbs", "4", "--block-size", "32", "--head-split", "2",
                       "--pipeline-chunks", "2", "--layers", "1", "--hidden", "32", "--dtype", "float64",
                       "--out", str(out)], tmp_path)
    assert f"{WORLD} rank(s) on {NODES} node(s)" in outs[0] and "wrote" not in outs[1]
    record = json.loads((out / "run.json").read_text())
    assert record["world_size"] == WORLD and record["nodes"] == NODES
    _check_ranks(record["ranks"], cp, dp, pool)
    df = pd.read_csv(out / "train.csv")
    assert df["nproc"].eq(WORLD).all() and df["nodes"].eq(NODES).all() and df["launch"].eq("torchrun").all()
    # the cross-node DP all-reduce and pool exchange train what one process trains (float64)
    ref = run_training(TrainConfig(nproc=1, cp=1, attention="reference", steps=2, seq_len=256, gbs=4,
                                   model=ModelConfig(layers=1, hidden=32), dtype="float64"))[0]
    np.testing.assert_allclose(df["loss"], [s["loss"] for s in ref["steps"]], rtol=1e-9)
