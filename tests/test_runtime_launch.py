"""The local launcher: errors come back as records, hangs end at the deadline, bad arguments fail."""

import time

import pytest

from libra.runtime.launch import RankDeadlineError, run_local_ranks


def _rank_fails_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank * 10


def _rank_hangs(rank, world):
    time.sleep(600)


def test_results_and_errors_come_back_per_rank():
    out = run_local_ranks(_rank_fails_on_one, 2, deadline_s=60)
    assert out[0] == {"ok": 0}
    assert "ValueError: boom on rank 1" in out[1]["error"] and "Traceback" in out[1]["traceback"]


def test_a_hang_is_killed_at_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(RankDeadlineError, match="still running after 4 s"):
        run_local_ranks(_rank_hangs, 1, deadline_s=4)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("kwargs", [{"world": 0}, {"world": 2, "deadline_s": 0}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        run_local_ranks(_rank_fails_on_one, **kwargs)
