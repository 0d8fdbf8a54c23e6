"""When `palatine torchrun`'s launcher ends a group's run: the sans-IO `GroupOutcome`."""

from __future__ import annotations

from palatine.spmd.launcher import GATHER_S, POLL_S, GroupOutcome, RankFailure


def failure(rank: int, *, died: bool = False) -> RankFailure:
    return RankFailure(rank, rank % 2, "node0", 1000 + rank, -9 if died else 1, "boom", died=died)


def test_a_group_runs_until_every_rank_succeeded() -> None:
    outcome = GroupOutcome(2)
    assert outcome.wait_s(0.0) == POLL_S
    outcome.succeeded(0)
    assert outcome.wait_s(0.0) == POLL_S and outcome.running() == [1]
    outcome.succeeded(1)
    assert outcome.wait_s(0.0) is None and outcome.failures == []


def test_a_failure_that_is_not_a_death_gathers_the_others_for_a_moment() -> None:
    outcome = GroupOutcome(4)
    assert outcome.failed(failure(1), 10.0)
    assert outcome.wait_s(10.0) == GATHER_S
    assert outcome.failed(failure(3), 10.1)  # (the gathering is not extended)
    assert outcome.wait_s(10.0 + GATHER_S) is None
    assert [f.rank for f in outcome.failures] == [1, 3] and outcome.running() == [0, 2]


def test_a_death_ends_the_wait_at_once_even_after_its_peers_failed_first() -> None:
    # A SIGKILLed rank's peers see their collectives break before the supervision of the
    # dead proc reports it: the death, when it comes, needs no more gathering.
    outcome = GroupOutcome(4)
    outcome.failed(failure(0), 5.0)
    outcome.failed(failure(1), 5.001)
    assert outcome.wait_s(5.002) is not None
    outcome.failed(failure(2, died=True), 5.003)
    assert outcome.wait_s(5.003) is None


def test_a_ranks_second_failure_is_not_counted_again() -> None:
    outcome = GroupOutcome(2)
    assert outcome.failed(failure(1), 0.0)
    assert not outcome.failed(failure(1, died=True), 0.1)
    assert len(outcome.failures) == 1 and outcome.wait_s(0.1) == GATHER_S - 0.1
