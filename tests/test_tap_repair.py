"""``libra-adaptive``'s overload repair (:mod:`libra.extensions.adaptive.repair`): a repair never
raises the most loaded worker, never puts a worker above ``C``, and keeps every tile; under Q-home
retention on a pool with one long sample it brings the workers Alg. 2 left above ``C`` back within
it. (The compiled loop makes the Python loop's moves: ``tests/compiled_identity/``.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.extensions.adaptive.repair import repair_overload
from libra.extensions.adaptive.retention import place_retaining, retention_order
from libra.plan import SequenceLayout
from libra.tap.placement import PlacementPolicy, available_placers, place_tiles
from libra.tap.tiles import make_tiles
from libra.workload import AttentionShape


@st.composite
def placements(draw):
    """A random placement: tiles on W workers, loads with heavy ones and ties, some workers above C."""
    w = draw(st.integers(1, 9))
    t = draw(st.integers(1, 60))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    load = np.round(rng.pareto(1.5, t) * 4) / 4  # quarter steps: ties and zeros
    dest = rng.integers(0, w, t) if draw(st.booleans()) else np.minimum(rng.geometric(0.5, t) - 1, w - 1)
    base = np.round(rng.uniform(0, 2, w), 1) if draw(st.booleans()) else np.zeros(w)
    cap = (1 + draw(st.sampled_from([0.0, 0.03, 0.3]))) * (load.sum() + base.sum()) / w
    priority = rng.integers(0, 4, t).astype(np.float64)
    home = rng.integers(0, w, t)
    lw = rng.integers(0, 3, (w, w))
    np.fill_diagonal(lw, 0)
    return dest, load, base, cap, priority, home, lw


def _loads(dest, load, base):
    return np.bincount(dest, weights=load, minlength=len(base)) + base


@settings(max_examples=150, deadline=None)
@given(case=placements())
def test_repair_moves_never_overfill(case):
    dest, load, base, cap, priority, home, lw = case
    new, moved = repair_overload(dest, load, base, cap, priority, home, lw)
    before, after = _loads(dest, load, base), _loads(new, load, base)
    assert int((new != dest).sum()) == moved
    assert after.max() <= before.max() + 1e-9  # the most loaded worker never gets worse
    assert np.all(after[before <= cap] <= cap + 1e-9)  # a worker within C stays within it
    assert np.all(after[new[new != dest]] <= cap + 1e-9)  # every receiver within C
    assert abs(after.sum() - before.sum()) <= 1e-9 * max(1.0, before.sum())


def test_repair_takes_the_cheapest_worker_with_room_then_the_least_loaded():
    # worker 0 holds 3 + 1 + 1 (C = 2.75); the dense tile (priority 2) leaves first
    dest, load = np.array([0, 0, 0, 1]), np.array([3.0, 1.0, 1.0, 0.0])
    lw = np.array([[0, 2, 1, 1], [2, 0, 2, 2], [1, 2, 0, 2], [1, 2, 2, 0]])
    base = np.array([0.0, 0.0, 0.0, 0.0])
    cap = 2.75
    for placer in available_placers():
        new, moved = repair_overload(dest, load, base, cap, np.array([0.0, 2.0, 1.0, 0.0]), np.zeros(4, int), lw,
                                     placer=placer)
        # tile 1 (priority 2) goes to worker 2 (cost 1, the lowest id among the cost-1 workers 2 and 3, equal
        # load 0); worker 0 is then at 4 > C, so tile 2 leaves too: cost 1 on worker 3 (load 0) beats worker 2
        assert new.tolist() == [0, 2, 3, 1] and moved == 2, placer
        assert dest.tolist() == [0, 0, 0, 1]  # the input is left as it was


def test_nothing_above_the_target_is_nothing_to_repair():
    dest, load = np.array([0, 1, 1]), np.array([1.0, 0.5, 0.5])
    new, moved = repair_overload(dest, load, np.zeros(2), 1.0, np.ones(3), np.zeros(3, int), np.zeros((2, 2), int))
    assert moved == 0 and new.tolist() == [0, 1, 1]


@pytest.mark.parametrize("placer", available_placers())
def test_retention_with_a_long_sample_ends_within_the_target(placer):
    # one 4096-token sample over 8 workers beside short ones: its late blocks are heavy, and after
    # every Q-home has kept its light tiles Alg. 2 finds no room for them (fallbacks)
    shape = AttentionShape(8, 2, 64)
    cp = 8
    seqs = [SequenceLayout.contiguous(0, 0, np.array([4096]), cp),
            SequenceLayout.contiguous(1, 1, np.array([256] * 16), cp)]
    workers = list(range(2 * cp))
    tiles = make_tiles(seqs, 256, 4, shape)
    tau = 0.03
    plain, fallback = place_tiles(tiles, seqs, workers, shape, tau=tau, placer=placer, policy=PlacementPolicy(order=retention_order(tiles, shape, tiles.flops, len(workers), tau)))
    placed, fallback_after = place_retaining(tiles, seqs, workers, shape, tau, placer=placer)
    assert fallback == fallback_after > 0  # the count is Alg. 2's, before the repair
    cap = (1 + tau) * tiles.flops.sum() / len(workers)
    before = np.bincount(plain.dest, weights=tiles.flops, minlength=len(workers))
    after = np.bincount(placed.dest, weights=tiles.flops, minlength=len(workers))
    assert before.max() > cap and after.max() < before.max()
    assert (after > cap * (1 + 1e-12)).sum() < (before > cap * (1 + 1e-12)).sum()



def test_inconsistent_arrays_are_refused():
    ok = dict(dest=np.array([0, 1]), load=np.ones(2), base=np.zeros(2), cap=1.0, priority=np.ones(2),
              home=np.array([0, 1]), lw=np.zeros((2, 2), int))
    for bad in ({"load": np.ones(3)}, {"lw": np.zeros((3, 3), int)}, {"dest": np.array([0, 2])},
                {"home": np.array([-1, 0])}):
        with pytest.raises(ValueError, match="repair_overload"):
            repair_overload(**{**ok, **bad})
