"""Rank topology: worker ids -> nodes/supernodes and link classes."""

import numpy as np
import pytest

from libra.config import ParallelConfig
from libra.sim.profiles import load_profile
from libra.sim.topology import LOCAL, Topology


@pytest.fixture(scope="module")
def topo256k():
    return Topology(load_profile("h100-roce-v1"), ParallelConfig(dp=32, cp=8, gbs=128, seq_len=262144))


def test_cp_groups_packed_into_nodes(topo256k):
    t = topo256k
    assert t.num_workers == 256
    assert t.node[:8].tolist() == [0] * 8          # CP group of DP rank 0 fills node 0
    assert t.node[8] == 1 and t.node[255] == 31
    assert t.supernode[63] == 0 and t.supernode[64] == 1  # 8 nodes x 8 GPUs per supernode
    assert t.describe()["supernodes"] == 4


def test_link_classes(topo256k):
    t = topo256k
    assert t.link_class(0, 7) == "nvlink"
    assert t.link_class(0, 8) == "roce"
    assert t.link_class(3, 63) == "roce"
    assert t.link_class(0, 64) == "inter_supernode"
    assert t.link_class(5, 5) == "local"
    codes = t.link_code(np.array([0, 0, 0, 9]), np.array([1, 9, 200, 9]))
    assert codes.tolist() == [0, 1, 2, LOCAL]
    assert t.link_class(np.array([[0, 1]]), np.array([[8, 1]])).shape == (1, 2)


def test_byte_cost_is_relative_time_per_byte_of_the_link(topo256k):
    """NVLink 450, RoCE 50, spine 25 GB/s in the default profile: 1000, 9000, 18000 per byte."""
    got = topo256k.byte_cost(np.array([0, 0, 0, 5]), np.array([7, 8, 64, 5]))
    assert got.dtype == np.int64 and got.tolist() == [1000, 9000, 18000, 0]
    assert topo256k.byte_cost(3, 63) == 9000
    with pytest.raises(ValueError, match="outside"):
        topo256k.byte_cost(0, 10**6)


def test_pool_of_eight_replicas_stays_in_one_supernode(topo256k):
    pool = np.arange(8 * 8)  # P = 8 at CP = 8
    src, dst = np.meshgrid(pool, pool)
    assert not np.any(topo256k.link_code(src, dst) == 2)
    dist = np.arange(256)  # DistCA: P = DP = 32 spans all four supernodes
    src, dst = np.meshgrid(dist, dist)
    assert np.any(topo256k.link_code(src, dst) == 2)


def test_cp16_group_spans_two_nodes():
    t = Topology(load_profile("h100-roce-v1"), ParallelConfig(dp=16, cp=16, gbs=32, seq_len=1 << 20))
    assert t.link_class(0, 15) == "roce" and t.link_class(0, 7) == "nvlink"


def test_bad_ids_and_config(topo256k):
    with pytest.raises(ValueError, match="worker id 256 outside"):
        topo256k.link_code(0, 256)
    with pytest.raises(ValueError, match="worker id -1"):
        topo256k.link_class(-1, 0)
    with pytest.raises(ValueError, match="ParallelConfig"):
        Topology(load_profile("h100-roce-v1"), {"dp": 2})


def test_link_code_table_equals_the_node_comparisons(topo256k, monkeypatch):
    """The ``N x N`` table and the per-pair node / supernode comparisons (the path past
    ``CODE_TABLE_MAX_WORKERS``) give the same codes, broadcast and scalar, with int64 dtype."""
    import libra.sim.topology as topology

    t = topo256k
    ids = np.arange(t.num_workers)
    src, dst = np.meshgrid(ids, ids, indexing="ij")
    want = np.where(src == dst, LOCAL, np.where(t.node[src] == t.node[dst], 0,
                                                np.where(t.supernode[src] == t.supernode[dst], 1, 2)))
    table = t.link_code(src, dst)
    assert table.dtype == np.int64 and np.array_equal(table, want)
    assert np.array_equal(t.link_code(ids[:, None], ids[None, :]), want) and t.link_code(0, 64) == 2
    monkeypatch.setattr(topology, "CODE_TABLE_MAX_WORKERS", 0)
    assert np.array_equal(t.link_code(src, dst), want) and t.link_code(5, 5) == LOCAL
    with pytest.raises(ValueError, match="worker id 256 outside"):
        t.link_code(np.array([0]), np.array([256]))
