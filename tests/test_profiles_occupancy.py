"""The default profile prices kernels with the occupancy model (libra.sim.occupancy), fitted to the
same public H100 table as the length-curve profile it replaces: refitting the table gives the
profile's constants, the fit reproduces the table, and fewer heads per call cost more per FLOP only
where a call has too few blocks to fill the SMs."""

import numpy as np
import pytest

from libra.sim.occupancy import OccupancyModel, PassCost, fit_pass_cost
from libra.sim.profiles import DEFAULT_PROFILE, load_profile

PROFILE = load_profile(DEFAULT_PROFILE)
TABLE = load_profile("h100-roce-v1").source["calibration_table"]


def test_the_default_profile_is_the_occupancy_fit_of_the_public_h100_table():
    occ = PROFILE.kernel.occupancy
    assert PROFILE.kernel.model == "occupancy" and PROFILE.source["calibration_table"] == TABLE
    start = OccupancyModel(occ.multiprocessors, occ.block_q, occ.block_k, occ.reference_head_dim,
                           PassCost(0.01, 0.001, 0.001), PassCost(0.01, 0.001, 0.001))
    calls = [(np.array([n]), np.array([n]), TABLE["heads"], TABLE["head_dim"]) for n in TABLE["lengths"]]
    fit, err = fit_pass_cost(start, calls, TABLE["times_ms"])
    for name in ("launch_ms", "block_ms", "tile_ms"):
        assert getattr(occ.forward, name) == pytest.approx(getattr(fit, name), rel=1e-5)
    assert np.abs(err).max() < 0.01  # the table within 1%
    ratio = PROFILE.kernel.backward_time_ratio
    assert occ.backward.tile_ms == pytest.approx(ratio * occ.forward.tile_ms, rel=1e-5)
    assert occ.backward.block_ms == pytest.approx(ratio * occ.forward.block_ms, rel=1e-5)
    assert PROFILE.kernel.heads_half == 0  # heads per call are priced through the blocks


@pytest.mark.parametrize("length, heads, slower", [(65536, 2, False), (2048, 2, True), (2048, 64, False)])
def test_few_heads_per_call_cost_more_only_where_the_sms_go_idle(length, heads, slower):
    occ = PROFILE.kernel.occupancy
    per_head = occ.call_ms([length], [length], heads, 128) / heads
    full = occ.call_ms([length], [length], 64, 128) / 64
    assert (per_head > 1.2 * full) == slower
