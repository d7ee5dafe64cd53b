"""The Plan contract: validation catches each broken invariant, hashing, JSON, backward, agreement."""

from __future__ import annotations

import numpy as np
import pytest

from libra.plan import (
    KV,
    O,
    Plan,
    PlanMismatchError,
    PlanValidationError,
    PoolPlan,
    Q,
    SequenceLayout,
    TileTable,
    TransferTable,
    check_plan_agreement,
    check_pool,
)
from libra.tap import build_transfers, make_tiles
from libra.workload import AttentionShape, attention_flops

SHAPE = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=2, dtype_bytes=2)


@pytest.fixture
def pool() -> PoolPlan:
    """Two sequences of 8 tokens, CP 2 (workers 0-3), B 2, H 2; tiles scattered so that every
    transfer kind occurs, including KV fetched across holders."""
    seqs = (SequenceLayout.contiguous(0, 0, [5, 3], 2), SequenceLayout.contiguous(1, 1, [1, 7], 2))
    tiles = make_tiles(seqs, 2, 2, SHAPE)
    dest = np.array([0, 1, 2, 3, 1, 1, 3, 0, 2, 3, 2, 2, 0, 3, 3, 3])
    cols = {k: getattr(tiles, k) for k in TileTable.FIELDS}
    cols["dest"] = dest
    placed = TileTable(**cols)
    return PoolPlan(0, (0, 1, 2, 3), seqs, placed, build_transfers(seqs, placed, SHAPE))


def _with(table, **changes):
    cols = {k: np.array(getattr(table, k)) for k in table.FIELDS}
    cols.update(changes)
    return type(table)(**cols)


def _replace(pool, tiles=None, transfers=None, workers=None):
    return PoolPlan(pool.pool_index, workers or pool.workers, pool.sequences, tiles or pool.tiles,
                    transfers if transfers is not None else pool.transfers, pool.fallback_tiles)


def _first(tr, kind):
    return int(np.nonzero(tr.kind == kind)[0][0])


def test_valid_plan_passes(pool):
    check_pool(pool, SHAPE)
    kinds = set(pool.transfers.kind.tolist())
    assert kinds == {Q, KV, O}


def test_missing_tile_and_double_computation(pool):
    with pytest.raises(PlanValidationError, match=r"pool 0: sequence 0: tokens \[0, 2\) x heads \[0, 2\) is computed 0"):
        check_pool(_replace(pool, tiles=pool.tiles.select(np.arange(1, len(pool.tiles)))), SHAPE)
    dup = TileTable.concat([pool.tiles, pool.tiles.select([3])])
    with pytest.raises(PlanValidationError, match="computed 2 times"):
        check_pool(_replace(pool, tiles=dup), SHAPE)


def test_wrong_flops_and_q_home(pool):
    flops = pool.tiles.flops.copy()
    flops[5] *= 1.5
    with pytest.raises(PlanValidationError, match="tile 5 records"):
        check_pool(_replace(pool, tiles=_with(pool.tiles, flops=flops)), SHAPE)
    home = pool.tiles.q_home.copy()
    home[0] = 1
    with pytest.raises(PlanValidationError, match="tile 0 .* has q_home 1 but its tokens are held by worker 0"):
        check_pool(_replace(pool, tiles=_with(pool.tiles, q_home=home)), SHAPE)


def test_dest_outside_pool(pool):
    dest = pool.tiles.dest.copy()
    dest[2] = 9
    with pytest.raises(PlanValidationError, match="tile 2 has dest 9 outside the pool"):
        check_pool(_replace(pool, tiles=_with(pool.tiles, dest=dest)), SHAPE)


@pytest.mark.parametrize("kind, msg", [(Q, "lacks its Q dispatch"), (O, "lacks its O return"),
                                       (KV, "no transfer brings it")])
def test_missing_transfer(pool, kind, msg):
    tr = pool.transfers
    drop = _first(tr, kind)
    with pytest.raises(PlanValidationError, match=msg):
        check_pool(_replace(pool, transfers=tr.select(np.arange(len(tr)) != drop)), SHAPE)


@pytest.mark.parametrize("kind, msg", [(Q, "moves .* 2 times"), (KV, "de-duplicated per destination")])
def test_duplicated_transfer(pool, kind, msg):
    tr = pool.transfers
    twice = TransferTable.concat([tr, tr.select([_first(tr, kind)])])
    with pytest.raises(PlanValidationError, match=msg):
        check_pool(_replace(pool, transfers=twice), SHAPE)


def test_self_transfer_and_bad_bytes(pool):
    tr = pool.transfers
    i = _first(tr, Q)
    dst = tr.dst.copy()
    dst[i] = tr.src[i]
    with pytest.raises(PlanValidationError, match=f"transfer {i} is a self-transfer"):
        check_pool(_replace(pool, transfers=_with(tr, dst=dst)), SHAPE)
    nbytes = tr.nbytes.copy()
    nbytes[i] += 1
    with pytest.raises(PlanValidationError, match=f"transfer {i} carries nbytes"):
        check_pool(_replace(pool, transfers=_with(tr, nbytes=nbytes)), SHAPE)


def test_kv_from_wrong_source_and_unneeded_kv(pool):
    tr = pool.transfers
    i = _first(tr, KV)
    src = tr.src.copy()
    others = [w for w in pool.workers if w not in (tr.src[i], tr.dst[i])]
    src[i] = others[0]
    with pytest.raises(PlanValidationError, match=f"KV transfer {i} sends .* which does not hold them"):
        check_pool(_replace(pool, transfers=_with(tr, src=src)), SHAPE)
    # worker 0 needs nothing of sequence 1's tokens [6, 8) (held by worker 3) for KV head 1 beyond
    # what is planned: add the whole range and the check names the surplus row
    extra = TransferTable(kind=[KV], src=[3], dst=[0], seq=[1], tok_start=[6], tok_end=[8], head_start=[0],
                          head_end=[2], nbytes=[2 * 2 * 2 * 2 * 2])
    with pytest.raises(PlanValidationError, match=r"KV transfer \d+ sends .* to worker 0"):
        check_pool(_replace(pool, transfers=TransferTable.concat([tr, extra])), SHAPE)


def test_kv_to_its_holder_is_rejected(pool):
    # worker 1 holds sequence 0's [4, 8): a KV row bringing it there (even from "itself") is invalid
    extra = TransferTable(kind=[KV], src=[0], dst=[1], seq=[0], tok_start=[4], tok_end=[6], head_start=[0],
                          head_end=[1], nbytes=[2 * 1 * 2 * 2 * 2])
    with pytest.raises(PlanValidationError):
        check_pool(_replace(pool, transfers=TransferTable.concat([pool.transfers, extra])), SHAPE)


def test_plan_json_digest_backward_segments(pool):
    plan = Plan(method="test", ga_index=1, shape=SHAPE, cp=2, pipeline_chunks=2, pools=(pool,), meta={"B": 2})
    assert plan.validate() is plan
    again = Plan.from_json(plan.to_json())
    assert again.digest() == plan.digest() and again.to_json() == plan.to_json()
    # digest changes with content
    other = Plan(method="test", ga_index=1, shape=SHAPE, cp=2, pipeline_chunks=2,
                 pools=(_replace(pool, tiles=_with(pool.tiles, dest=pool.tiles.q_home),
                                 transfers=build_transfers(pool.sequences, _with(pool.tiles, dest=pool.tiles.q_home),
                                                           SHAPE)),), meta={"B": 2})
    assert other.digest() != plan.digest()
    bwd = pool.transfers.backward()
    assert bwd.bytes_by_kind() == pool.transfers.bytes_by_kind()
    seg = pool.segments()
    flops = attention_flops(seg["area"], 1, SHAPE.head_dim) * seg["heads"]
    assert np.isclose(flops.sum(), pool.tiles.flops.sum())
    assert plan.pool_of_worker(3) is pool
    with pytest.raises(KeyError):
        plan.pool_of_worker(7)


def test_plan_agreement():
    check_plan_agreement("ab" * 32, ["ab" * 32] * 4)
    with pytest.raises(PlanMismatchError, match=r"ranks \[2\] have cdcd"):
        check_plan_agreement("ab" * 32, ["ab" * 32, "ab" * 32, "cd" * 32, "ab" * 32])
    with pytest.raises(ValueError, match="at least one rank"):
        check_plan_agreement("ab", [])


def test_worker_flops_unsorted_workers_and_disjoint_pools(pool):
    flipped = _replace(pool, workers=(3, 2, 1, 0))
    assert np.allclose(flipped.worker_flops(), pool.worker_flops()[::-1])
    plan = Plan(method="test", ga_index=0, shape=SHAPE, cp=2, pipeline_chunks=1, pools=(pool, pool))
    with pytest.raises(PlanValidationError, match="worker 0 is in pool 0 and pool 0"):
        plan.validate()


def test_table_columns_are_read_only_and_converted_once():
    """Columns already of the column's dtype are kept (made read-only, no copy); others are
    converted into fresh read-only arrays."""
    kind = np.array([KV], dtype=np.int8)
    src = np.array([3], dtype=np.int64)  # converted to int32: a copy
    tr = TransferTable(kind=kind, src=src, dst=[0], seq=[1], tok_start=[6], tok_end=[8], head_start=[0],
                       head_end=[2], nbytes=[32])
    assert tr.kind is kind and not kind.flags.writeable
    assert tr.src.dtype == np.int32 and not np.shares_memory(tr.src, src) and src.flags.writeable
    for name in TransferTable.FIELDS:
        assert not getattr(tr, name).flags.writeable and getattr(tr, name).flags.c_contiguous
    strided = np.arange(4, dtype=np.int64)[::2]  # right dtype, not contiguous: copied
    t = TileTable(seq=[0, 0], q_start=strided, q_end=strided + 1, head_start=[0, 0], head_end=[1, 1],
                  q_home=[0, 0], dest=[0, 0], flops=[1.0, 1.0])
    assert t.q_start.flags.c_contiguous and not np.shares_memory(t.q_start, strided)
    with pytest.raises(ValueError, match="rows, expected"):
        TileTable(seq=[0], q_start=[0, 1], q_end=[1], head_start=[0], head_end=[1], q_home=[0], dest=[0],
                  flops=[1.0])
