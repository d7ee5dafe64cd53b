"""The local launcher: errors come back as records, a dead or failed rank ends the run within seconds
naming the rank that caused it, hangs end at the deadline, messages reach the parent, bad arguments fail."""

import os
import time

import pytest

from libra.runtime.launch import (
    RankDeadlineError,
    RankFailure,
    RankMessages,
    first_failure,
    raise_first_failure,
    run_local_ranks,
)


def _rank_fails_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank * 10


def _rank_hangs(rank, world):
    time.sleep(600)


@pytest.mark.slow
def test_results_and_errors_come_back_per_rank():
    out = run_local_ranks(_rank_fails_on_one, 2, deadline_s=60)
    assert out[0] == {"ok": 0}
    assert "ValueError: boom on rank 1" in out[1]["error"] and "Traceback" in out[1]["traceback"]


@pytest.mark.slow
def test_a_hang_is_killed_at_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(RankDeadlineError, match="still running after 4 s"):
        run_local_ranks(_rank_hangs, 1, deadline_s=4)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("kwargs", [{"world": 0}, {"world": 2, "deadline_s": 0}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        run_local_ranks(_rank_fails_on_one, **kwargs)


def _rank_dies_while_the_other_waits(rank, world):
    import torch.distributed as dist  # noqa: PLC0415

    if rank == 1:
        os._exit(3)  # killed, crashed: no result, no word
    dist.barrier()  # never completes: the gloo timeout is 120 s
    return "unreachable"


def _rank_raises_while_the_other_waits(rank, world):
    import torch.distributed as dist  # noqa: PLC0415

    if rank == 1:
        raise ValueError("boom on rank 1")
    time.sleep(0.5)
    dist.barrier()
    return "unreachable"


@pytest.mark.slow
def test_a_dead_rank_ends_the_run_within_seconds_naming_it():
    t0 = time.monotonic()
    out = run_local_ranks(_rank_dies_while_the_other_waits, 2, deadline_s=110, pg_timeout_s=120)
    assert time.monotonic() - t0 < 30
    assert out[1] == {"error": "exited (code 3)", "traceback": "", "exitcode": 3}
    assert first_failure(out)[0] == 1
    with pytest.raises(RankFailure, match=r"^training ranks: rank 1 exited \(code 3\)$") as info:
        raise_first_failure(out, "training ranks")
    assert info.value.rank == 1


@pytest.mark.slow
def test_the_rank_that_raised_is_named_not_the_peer_whose_collective_then_failed():
    t0 = time.monotonic()
    out = run_local_ranks(_rank_raises_while_the_other_waits, 2, deadline_s=110, pg_timeout_s=120)
    assert time.monotonic() - t0 < 30
    with pytest.raises(RankFailure, match=r"^rank 1 failed: ValueError: boom on rank 1$") as info:
        raise_first_failure(out)
    assert "Traceback" in info.value.traceback and "boom on rank 1" in info.value.traceback


def test_first_failure_prefers_a_rank_that_died_over_its_peers_errors():
    records = [{"error": "RuntimeError: Connection closed by peer", "traceback": "", "at": 1.0},
               {"error": "exited (code -9)", "traceback": "", "exitcode": -9},
               {"error": "killed 10 s after another rank failed", "traceback": "", "killed": True}]
    assert first_failure(records)[0] == 1
    assert first_failure([{"ok": 1}, {"ok": 2}]) is None
    assert raise_first_failure([{"ok": 1}, {"ok": 2}]) == [1, 2]


def _rank_sends(rank, world, messages):
    for i in range(3):
        messages.send({"rank": rank, "i": i}, rank)
    return rank


@pytest.mark.slow
def test_rank_messages_reach_the_parent_in_order_while_the_ranks_run(tmp_path):
    messages, got = RankMessages(tmp_path), []
    out = run_local_ranks(_rank_sends, 2, messages, deadline_s=60, poll=lambda: got.extend(messages.receive()))
    got.extend(messages.receive())
    assert [r["ok"] for r in out] == [0, 1]
    for rank in (0, 1):
        assert [m["i"] for m in got if m["rank"] == rank] == [0, 1, 2]
    assert list(tmp_path.iterdir()) == []
