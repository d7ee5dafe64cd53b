"""DistCA's own planner (``distca``): its head/tail-pair layout, deficit filling and tolerance, and
the Plans it yields (cells conserved, every token once, deterministic)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_baselines_planners import deterministic_plans, make_window

from baselines.distca import TOLERANCE_STEPS, DistCAConfig, buffer_need
from baselines.distca_items import fill_deficits, item_pieces, layout_items, move_priority, take
from baselines.registry import get_planner
from libra.config import ParallelConfig
from libra.workload import AttentionShape, causal_area, packed_flops

SHAPE = AttentionShape(8, 2, 8)


def loads(items, n_workers: int) -> np.ndarray:
    u = items.used()
    return np.bincount(u["worker"], weights=u["cells"], minlength=n_workers)


def test_layout_holds_crossing_documents_as_head_tail_pairs():
    # DistCA's own example (batch_to_items_general): [[32], [8, 8], [4] * 4] at 16 tokens per rank, 4 ranks
    items = layout_items([32, 8, 8, 4, 4, 4, 4], 16, 4).used()
    rows = list(zip(items["doc"].tolist(), items["head_start"].tolist(), items["head_end"].tolist(),
                    items["tail_start"].tolist(), items["tail_end"].tolist(), items["worker"].tolist()))
    assert rows[:2] == [(0, 0, 8, 24, 32, 0), (0, 8, 16, 16, 24, 1)]       # head q=8 kv=8 / tail q=8 kv=32 ...
    assert rows[2:4] == [(1, 0, 4, 4, 8, 2), (2, 0, 4, 4, 8, 2)]           # whole documents, split in halves
    assert [r[5] for r in rows[4:]] == [3, 3, 3, 3]
    assert np.array_equal(items["home"], items["worker"])
    assert items["cells"].sum() == sum(n * (n + 1) // 2 for n in [32, 8, 8, 4, 4, 4, 4])


def test_odd_chunks_put_the_extra_token_in_the_tail():
    items = layout_items([7, 5], 6, 2).used()   # 7 crosses: chunk 6 on worker 0, chunk 1 on worker 1
    assert (items["head_start"][0], items["head_end"][0], items["tail_start"][0], items["tail_end"][0]) == (0, 3, 4, 7)
    assert (items["head_start"][1], items["head_end"][1], items["tail_start"][1], items["tail_end"][1]) == (3, 3, 3, 4)


def test_layout_rejects_too_many_tokens():
    with pytest.raises(ValueError, match="do not fit 2 workers of 4 tokens"):
        layout_items([5, 4], 4, 2)


def test_a_pair_costs_length_plus_one_cells_and_leaves_from_the_middle():
    items = layout_items([10, 2], 12, 1)          # document 10: head [0, 5), tail [5, 10)
    assert take(items, 0, 2 * 11 + 5, recipient=3) == 22   # two pairs of L + 1 = 11 cells
    u = items.used()
    assert (u["head_end"][0], u["tail_start"][0]) == (3, 7)
    new = items.n - 1
    assert (u["head_start"][new], u["head_end"][new], u["tail_start"][new], u["tail_end"][new]) == (3, 5, 5, 7)
    assert u["worker"][new] == 3 and u["home"][new] == 0
    assert u["cells"][new] == causal_area(3, 7) == 22
    assert take(items, 0, 10, recipient=3) == 0    # less than one pair: nothing moves
    assert take(items, 1, 10, recipient=2) == 3    # covers the whole item: it moves whole
    assert items.worker[1] == 2


def test_odd_documents_move_exact_cells():
    items = layout_items([9], 9, 1)               # head [0, 5), tail [5, 9): a pair is 5 + 5 + 1 = 11 cells
    assert take(items, 0, 40, recipient=1) == 33
    assert items.cells[0] + items.cells[1] == 45 == causal_area(0, 9)


def test_priority_is_elements_per_cell():
    shape = AttentionShape(4, 2, 8)
    got = move_priority(np.array([30.0]), np.array([9]), shape)[0]
    assert got == pytest.approx((30 / 10 * 32 + 10 * 2 * 2 * 8) / 30)
    # the document's KV is fetched once per move: moving more cells of it amortises it
    few, many = move_priority(np.array([1e3, 1e6]), np.array([1000, 1000]), shape)
    assert many < few


def skewed(n_workers=4, per=64, seed=0):
    rng = np.random.default_rng(seed)
    docs = []
    for w in range(n_workers):
        left = per
        while left:
            n = int(min(left, rng.integers(1, per if w % 2 == 0 else 6)))
            docs.append(n)
            left -= n
    return layout_items(docs, per, n_workers)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), tolerance=st.sampled_from([0.0, 0.05, 0.2]))
def test_deficit_filling_conserves_cells_and_serves_recipients(seed, tolerance):
    items = skewed(seed=seed)
    before = loads(items, 4)
    planned = fill_deficits(items, 4, tolerance, SHAPE)
    after = loads(planned, 4)
    assert after.sum() == before.sum()                          # every causal cell computed once
    mean = before.mean()
    donors = before > mean
    assert np.all(after[donors] >= mean - 1e-9)                 # a donor never drops below the mean
    assert np.all(after[~donors] <= mean + 1e-9)                # a recipient never overshoots it
    u = planned.used()
    assert np.all(u["cells"] > 0)
    row, a, b = item_pieces(planned)
    for doc in np.unique(u["doc"]):                             # each document's tokens are covered once
        sel = u["doc"][row] == doc
        covered = np.zeros(u["length"][u["doc"] == doc][0], dtype=int)
        for x, y in zip(a[sel], b[sel]):
            covered[x:y] += 1
        assert np.all(covered == 1)


@pytest.mark.parametrize("tolerance", [0.0, 0.05, 0.2])
def test_recipients_fill_to_the_tolerance_when_work_is_divisible(tolerance):
    # one worker holds a 400-token document (pairs of 401 cells), three hold 400 one-token documents:
    # every recipient can pull pairs until its deficit is within the tolerance or below one pair
    items = layout_items([400] + [1] * 1200, 400, 4)
    planned = fill_deficits(items, 4, tolerance, SHAPE)
    before, after = loads(items, 4), loads(planned, 4)
    mean = before.mean()
    assert np.all(mean - after[1:] <= max(tolerance * mean, 401))
    assert np.all(mean - after[1:] > 0) or tolerance == 0.0
    moved = (planned.used()["worker"] != planned.used()["home"]).sum()
    assert moved == 3                                           # one pair run per recipient, all from the long one


def test_tolerance_one_moves_nothing_and_zero_moves_most():
    items = skewed(seed=3)
    assert np.array_equal(loads(fill_deficits(items, 4, 1.0, SHAPE), 4), loads(items, 4))
    spread = [np.ptp(loads(fill_deficits(items, 4, t, SHAPE), 4)) for t in (0.0, 0.05, 0.3)]
    assert spread[0] <= spread[1] <= spread[2] < np.ptp(loads(items, 4))


PAR = ParallelConfig(dp=4, cp=2, gbs=8, seq_len=512)


def test_plans_are_valid_conserve_flops_and_are_deterministic():
    window = make_window(8, 512, 5)
    for g, plan in enumerate(deterministic_plans("distca", window, PAR)):
        plan.validate()                            # every (token, head) once, Q-homes, exact KV fetches
        (pool,) = plan.pools
        assert pool.workers == tuple(range(8)) and plan.pipeline_chunks == 4
        assert np.all(pool.tiles.head_end - pool.tiles.head_start == SHAPE.num_q_heads)  # full-head tiles
        flops = sum(packed_flops(window[g * 4 + d].sample_lengths, SHAPE) for d in range(4))
        assert pool.tiles.flops.sum() == pytest.approx(flops)
        assert [s.seq_id for s in pool.sequences] == [g * 4 + d for d in range(4)]
        for d, s in enumerate(pool.sequences):     # one nano-batch: sequence d stays on its CP group
            assert set(s.holder_worker.tolist()) <= {2 * d, 2 * d + 1}
        assert plan.meta["tolerance"] == 0.05 and plan.meta["nano_batches"] == 1


def test_nano_batches_lay_each_half_over_all_workers():
    plan = get_planner("distca", nano_batches=2).plan_window(make_window(8, 512, 2), PAR, SHAPE)[0].validate()
    (pool,) = plan.pools
    held = [np.bincount(s.holder_worker, weights=s.holder_end - s.holder_start, minlength=8) for s in pool.sequences]
    assert np.array_equal(held[0] + held[1], np.full(8, 128))   # nano-batch 0: 2 sequences at 128 tokens/worker
    assert np.array_equal(held[2] + held[3], np.full(8, 128))


def test_buffer_retry_steps_the_tolerance_up_until_the_all_to_all_fits():
    window = make_window(8, 512, 4)
    free = get_planner("distca").plan_window(window, PAR, SHAPE)
    need = max(p.meta["buffer_need_gib"] for p in free)
    fits = get_planner("distca", buffer_retry=True, buffer_gib=2 * need).plan_window(window, PAR, SHAPE)
    assert [p.digest() for p in fits] != [] and all(p.meta["tolerance"] == 0.05 for p in fits)
    tight = get_planner("distca", buffer_retry=True, buffer_gib=need / 2).plan_window(window, PAR, SHAPE)
    worst = max(range(len(free)), key=lambda g: free[g].meta["buffer_need_gib"])
    t = tight[worst].meta["tolerance"]
    assert t > 0.05 and t in TOLERANCE_STEPS
    assert tight[worst].meta["buffer_need_gib"] <= need / 2 or t == TOLERANCE_STEPS[-1]


def test_buffer_need_is_the_larger_of_sent_and_received_per_all_to_all():
    from libra.plan import KV, O, Q, TransferTable

    tr = TransferTable(kind=[Q, KV, O, Q], src=[0, 1, 2, 0], dst=[2, 2, 0, 1], seq=[0, 0, 0, 1], tok_start=[0] * 4,
                       tok_end=[1] * 4, head_start=[0] * 4, head_end=[1] * 4, nbytes=[10, 5, 10, 7])
    need = buffer_need(tr, np.array([0, 1]), 3)
    assert need[0].tolist() == [10, 5, 15] and need[1].tolist() == [7, 7, 0]


def test_config_tolerances():
    assert DistCAConfig().tolerances() == (0.05,)
    assert DistCAConfig(tolerance=0.15, buffer_retry=True).tolerances()[:3] == (0.15, 0.2, 0.3)
