"""Rank placement: global worker ids -> GPUs, nodes and supernodes, and link classes between them.

Worker numbering follows docs/architecture.md: ``worker = dp_rank * CP + cp_rank`` within one PP
stage. GPUs are filled in worker order, so a CP group occupies consecutive GPUs (packed into nodes;
a CP group larger than a node spans ``CP / gpus_per_node`` whole nodes) and consecutive DP ranks
sit next to each other. A pool of P consecutive DP replicas therefore spans ``P * CP`` consecutive
GPUs: at CP = 8 and 8 nodes per supernode, a P = 8 pool fills exactly one supernode, and larger
pools (DistCA's P = DP) reach over the slower inter-supernode links (Libra sec. 3.2, 6.5).
"""

from __future__ import annotations

import numpy as np

from libra.config import ParallelConfig
from libra.sim.profiles import LINK_CLASSES, HardwareProfile

LOCAL = -1
"""Link code of a worker talking to itself (no transfer)."""

BYTE_COST_UNIT = 1000
""":meth:`Topology.byte_cost` of one byte on the fastest link class (finer integer resolution of
the bandwidth ratios; costs of a 1M-token pool stay far below 2**53)."""


CODE_TABLE_MAX_WORKERS = 4096
"""Up to this many workers :meth:`Topology.link_code` reads a precomputed ``N x N`` int8 table
(16 MiB at the limit): on a 6-million-row phase one gather takes 56 ms against 330 ms for the
node and supernode comparisons it replaces."""


class Topology:
    """Placement of one PP stage's ``DP * CP`` workers on the profile's cluster.

    Args:
        profile: cluster shape (``gpus_per_node``, ``nodes_per_supernode``) and link classes.
        par: parallel layout; ``par.workers`` GPUs are used.

    Attributes:
        num_workers: ``DP * CP``.
        node, supernode: ``(N,)`` int arrays indexed by worker id.
    """

    def __init__(self, profile: HardwareProfile, par: ParallelConfig):
        if not isinstance(par, ParallelConfig):
            raise ValueError(f"Topology needs a ParallelConfig, got {type(par).__name__}")
        self.profile = profile
        self.par = par
        self.num_workers = par.workers
        gpu = np.arange(self.num_workers, dtype=np.int64)
        self.node = gpu // profile.gpus_per_node
        self.supernode = self.node // profile.nodes_per_supernode
        self.class_names = LINK_CLASSES

    def check_ids(self, ids) -> np.ndarray:
        """``ids`` as int64, after checking each lies in ``[0, DP*CP)`` (ValueError names the first bad one)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_workers):
            bad = ids[(ids < 0) | (ids >= self.num_workers)][0]
            raise ValueError(f"worker id {int(bad)} outside [0, {self.num_workers}) for DP*CP = "
                             f"{self.par.dp}*{self.par.cp}")
        return ids

    def link_code(self, src, dst) -> np.ndarray:
        """Vectorised link class index into :data:`LINK_CLASSES` (``LOCAL`` = -1 when src == dst).

        Args:
            src, dst: broadcastable int arrays of global worker ids.

        Raises:
            ValueError: an id outside ``[0, DP*CP)``.
        """
        src, dst = self.check_ids(src), self.check_ids(dst)
        if self.num_workers <= CODE_TABLE_MAX_WORKERS:
            # one gather from the (N, N) table: a phase of a per-document CP plan has millions of rows
            return self._code_table()[src * self.num_workers + dst].astype(np.int64)
        return self._codes(src, dst)

    def _codes(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The link class index of each pair, from the node and supernode ids."""
        same_node = self.node[src] == self.node[dst]
        same_super = self.supernode[src] == self.supernode[dst]
        code = np.where(same_node, 0, np.where(same_super, 1, 2))
        return np.where(src == dst, LOCAL, code)

    def _code_table(self) -> np.ndarray:
        """int8 ``(N * N,)``: :meth:`_codes` of every pair, row-major by source (built once)."""
        table = self.__dict__.get("_table")
        if table is None:
            ids = np.arange(self.num_workers, dtype=np.int64)
            table = self._codes(ids[:, None], ids[None, :]).astype(np.int8).reshape(-1)
            self.__dict__["_table"] = table
        return table

    def link_class(self, src, dst):
        """Link class names (``"local"``, ``"nvlink"``, ``"roce"``, ``"inter_supernode"``).

        Scalar inputs give a str; array inputs an object array of the same shape.
        """
        names = np.array(("local",) + tuple(LINK_CLASSES), dtype=object)
        out = names[self.link_code(src, dst) + 1]
        return str(out) if np.ndim(out) == 0 else out

    def byte_cost(self, src, dst) -> np.ndarray:
        """Integer relative time of one byte from ``src`` to ``dst`` (broadcastable global worker
        ids): ``round(BYTE_COST_UNIT * fastest bandwidth / bandwidth)`` of the link class between
        them, so the fastest class costs :data:`BYTE_COST_UNIT` and a class at a ninth of its
        bandwidth nine times that; 0 from a worker to itself. What link-priced TAP placement
        weighs bytes with (``place_tiles(link_cost=...)``; integers keep its sums exact).

        Raises:
            ValueError: an id outside ``[0, DP*CP)``.
        """
        bw = np.array([self.profile.links[c].bandwidth_gbps for c in LINK_CLASSES], dtype=np.float64)
        per_class = np.rint(BYTE_COST_UNIT * bw.max() / bw).astype(np.int64)
        code = self.link_code(src, dst)
        return np.where(code == LOCAL, 0, per_class[np.maximum(code, 0)])

    def describe(self) -> dict:
        """Counts recorded with results: nodes and supernodes used, GPUs per pool domain."""
        return {"workers": self.num_workers, "nodes": int(self.node.max()) + 1,
                "supernodes": int(self.supernode.max()) + 1,
                "gpus_per_node": self.profile.gpus_per_node,
                "nodes_per_supernode": self.profile.nodes_per_supernode}
