"""Tests of the controller's History.

Notation: ``s3{r3→r5}`` is seq 3 using ref 3 and defining ref 5. Errors
are plain strings standing for the worker's ``WorkerError``. Besides the worked example
and one test per invariant, a naive reference model (full scans, sets, no
incremental structures) is driven in lock-step with the History by a hypothesis state
machine over arbitrary interleavings and by a simulation of single-stream workers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from palatine.protocol.controller import Deadline, Error
from palatine.protocol.worker import Err, Ok
from palatine.tensor.controller.history import Errored, History, Invoked, Outcome, Report


def err(seq: int, caused_by: int, error: Any) -> Err[Error[Any]]:
    """The outcome ``Err(Error(seq, caused_by, error))`` (printed ``Err s{seq} ← s{cause}``)."""
    return Err(Error(seq, caused_by, error))


class Client:
    """A History plus everything sent to the client, checked for exactly-once on the fly."""

    def __init__(self, world_size: int = 1) -> None:
        self.h = History(world_size)
        self.results: dict[int, Outcome] = {}
        self.log: list[Report] = []

    def _take(self, reports: Any) -> list[Report]:
        out = list(reports)
        assert [s for s, _ in out] == sorted(s for s, _ in out), "reports not in seq order"
        for seq, outcome in out:
            assert seq not in self.results, f"second Result for s{seq}"
            if isinstance(outcome, Ok):
                assert self.h.min_frontier > seq, f"value of s{seq} before every rank passed"
            self.results[seq] = outcome
        self.log.extend(out)
        return out

    def node(self, seq: int, uses: Sequence[int] = (), defs: Sequence[int] = ()) -> list[Report]:
        return self._take(self.h.add_invocation(seq, uses, defs, f"op{seq}"))

    def failed(self, seq: int, error: Any) -> list[Report]:
        return self._take(self.h.propagate_exception(seq, error))

    def status(self, rank: int, seq: int) -> list[Report]:
        return self._take(self.h.rank_completed(rank, seq))

    def probe(self, rank: int, seq: int) -> None:
        self.h.update_deadline_tracking(rank, seq)

    def fetched(self, seq: int, value: Ok[Any] | Err[Any]) -> None:
        self.h.set_result(seq, value)

    def drop(self, *refs: int) -> None:
        self.h.delete_invocations_for_refs(refs)


# --------------------------------------------------------------------------- refs


def test_worked_example_step_by_step() -> None:
    c = Client(2)
    h = c.h
    e = "y = f(x) failed on rank 1"
    # 1. Nodes s0–s3: x = make(); y = f(x); z = g(x); w = h(y, z)
    assert c.node(0, defs=[1]) == []
    assert c.node(1, uses=[1], defs=[2]) == []
    assert c.node(2, uses=[1], defs=[3]) == []
    assert c.node(3, uses=[2, 3], defs=[4]) == []
    assert [h.ref_state(r) for r in (1, 2, 3, 4)] == [
        Invoked(0),
        Invoked(1),
        Invoked(2),
        Invoked(3),
    ]
    assert [h.invocation(s).users for s in (0, 1, 2)] == [[1, 2], [3], [3]]  # type: ignore[union-attr]
    # 2. rank 1: RemoteFunctionFailed(s1, e)
    assert c.failed(1, e) == [(1, err(1, 1, e)), (3, err(3, 1, e))]
    assert h.ref_state(2) == Errored(Error(1, 1, e))
    assert h.ref_state(4) == Errored(Error(1, 1, e))
    assert (h.frontier(0), h.frontier(1)) == (0, 0)
    # 3. Node s4 (fetch w from rank 0) uses the errored r4: fails at creation.
    assert c.node(4, uses=[4]) == [(4, err(4, 1, e))]
    # 4. rank 1 runs s2 and s3 (dependent error, silent on the worker): nothing arrives.
    # 5. rank 0 runs s1–s4 and sends its value: ignored, the error is sticky.
    c.fetched(4, Ok("w0"))
    assert h.invocation(4).result == err(4, 1, e)  # type: ignore[union-attr]
    # 6. Status(5) from rank 0: frontier [5, 0], minimum 0 → nothing purged.
    assert c.status(0, 5) == []
    assert (h.frontier(0), h.frontier(1), h.live_count) == (5, 0, 5)
    # 7. Status(5) from rank 1: everything is purged; s0 and s2 complete.
    assert c.status(1, 5) == [(0, None), (2, None)]
    assert h.live_count == 0
    # 8. Node s5 uses r2: still Errored after the purge.
    assert c.node(5, uses=[2]) == [(5, err(5, 1, e))]
    # 9. Node s6 uses r3: its producer s2 is purged, so no dependency; completes normally.
    assert c.node(6, uses=[3], defs=[5]) == []
    assert h.invocation(2) is None
    # 10. DropRefs r1–r4: purged producers' refs and Errored refs are all removed.
    c.drop(1, 2, 3, 4)
    assert [h.ref_state(r) for r in (1, 2, 3, 4)] == [None] * 4
    assert h.pending_drop_count == 0
    c.status(0, 7)
    c.status(1, 7)
    assert sorted(c.results) == [0, 1, 2, 3, 4, 5, 6]  # exactly one Result each
    assert c.results[6] is None


def test_worked_example_with_s4_issued_before_the_failure() -> None:
    c = Client(2)
    e = "boom"
    c.node(0, defs=[1])
    c.node(1, uses=[1], defs=[2])
    c.node(2, uses=[1], defs=[3])
    c.node(3, uses=[2, 3], defs=[4])
    c.node(4, uses=[4])
    assert c.failed(1, e) == [(1, err(1, 1, e)), (3, err(3, 1, e)), (4, err(4, 1, e))]


# --------------------------------------------------------------------------- results


def test_invariant_1_exactly_one_result_per_accepted_node() -> None:
    c = Client(2)
    c.node(0, defs=[1])
    c.node(1, uses=[1], defs=[2])
    c.node(2, uses=[2], defs=[3])
    c.node(3)
    c.node(4, uses=[9])  # unknown ref: no dependency
    c.failed(1, "e")  # eager errors for s1 and s2
    with pytest.raises(ValueError):
        c.node(4)  # rejected: no Result, ever
    c.node(5, uses=[3])  # fails at Node time
    c.fetched(3, Ok(7))
    c.failed(1, "again")  # nothing new
    for rank in (0, 1):
        c.status(rank, 6)
    c.status(0, 100)
    c.status(1, 100)
    assert sorted(c.results) == [0, 1, 2, 3, 4, 5]
    assert c.results[3] == Ok(7)
    assert len(c.log) == 6
    assert c.h.live_count == 0


def test_invariant_2_value_waits_for_every_rank_so_a_later_failure_overrides_it() -> None:
    c = Client(2)
    c.node(0, defs=[1])
    c.node(1, uses=[1])  # fetch from rank 0
    c.fetched(1, Ok("v0"))
    assert c.status(0, 2) == []  # rank 0 passed, rank 1 has not
    assert c.failed(1, "rank 1 failed the fetch") == [(1, err(1, 1, "rank 1 failed the fetch"))]
    assert c.status(1, 2) == [(0, None)]
    assert 1 in c.results and c.results[1] == err(1, 1, "rank 1 failed the fetch")


def test_invariant_3_errors_reach_known_dependents_at_once_later_ones_at_node_time() -> None:
    c = Client(1)
    c.node(0, defs=[1])
    c.node(1, uses=[1], defs=[2])
    c.node(2, uses=[2], defs=[3])
    c.node(3, defs=[4])  # independent
    assert c.failed(0, "e") == [(0, err(0, 0, "e")), (1, err(1, 0, "e")), (2, err(2, 0, "e"))]
    assert c.node(4, uses=[4, 3]) == [(4, err(4, 0, "e"))]
    assert c.node(5, uses=[4]) == []


def test_invariant_4_first_error_wins_and_is_sticky() -> None:
    c = Client(1)
    c.node(0, defs=[1])
    c.node(1, uses=[1], defs=[2])
    assert c.failed(1, "first") == [(1, err(1, 1, "first"))]
    assert c.failed(0, "second") == [(0, err(0, 0, "second"))]  # s1 keeps "first"
    assert c.h.invocation(1).result == err(1, 1, "first")  # type: ignore[union-attr]
    assert c.h.ref_state(2) == Errored(Error(1, 1, "first"))
    c.fetched(1, Ok("late value"))
    c.fetched(1, Err("late fetch error"))
    assert c.h.invocation(1).result == err(1, 1, "first")  # type: ignore[union-attr]
    assert c.status(0, 2) == []


def test_invariant_4_a_value_failed_on_any_rank_fails_as_a_whole() -> None:
    c = Client(3)
    c.node(0, defs=[1])
    c.fetched(0, Ok("rank 0 value"))
    c.failed(0, "failed on rank 2")
    for r in range(3):
        c.status(r, 1)
    assert c.results == {0: err(0, 0, "failed on rank 2")}


def test_invariant_5_errored_refs_survive_purge_and_droprefs_respects_live_producers() -> None:
    c = Client(1)
    h = c.h
    c.node(0, defs=[1, 2])
    c.failed(0, "e")
    c.status(0, 1)
    assert h.live_count == 0
    assert h.ref_state(1) == Errored(Error(0, 0, "e"))
    assert c.node(1, uses=[1]) == [(1, err(1, 0, "e"))]
    c.drop(1)
    assert h.ref_state(1) is None and h.ref_state(2) is not None
    # a live producer keeps its ref until purged, even after DropRefs
    c.node(2, defs=[3])
    c.drop(3)
    assert h.ref_state(3) == Invoked(2)
    c.node(3, uses=[3])
    assert h.invocation(2).users == [3]  # type: ignore[union-attr]
    c.status(0, 4)
    assert h.ref_state(3) is None
    assert h.ref_state(2) == Errored(Error(0, 0, "e"))  # applying those drops kept r2


def test_users_are_recorded_once_per_dependent() -> None:
    c = Client(1)
    c.node(0, defs=[1, 2])
    c.node(1, uses=[1, 2, 1])
    assert c.h.invocation(0).users == [1]  # type: ignore[union-attr]


def test_invariant_6_controller_probes_never_complete_anything() -> None:
    c = Client(2)
    c.node(0, defs=[1])
    c.fetched(0, Ok(1))
    for r in (0, 1):
        c.probe(r, 1)
    assert c.results == {} and c.h.live_count == 1
    assert c.h.min_progress == 1 and c.h.min_frontier == 0
    assert c.status(0, 1) == [] and c.status(1, 1) == [(0, Ok(1))]


def test_invariant_7_reports_in_seq_order_within_one_call() -> None:
    c = Client(1)
    c.node(0, defs=[1])
    c.node(1, uses=[1], defs=[2])  # depth-first order would be 0, 1, 3, 2
    c.node(2, uses=[1])
    c.node(3, uses=[2])
    assert [s for s, _ in c.failed(0, "e")] == [0, 1, 2, 3]


# --------------------------------------------------------------------------- scenarios


def test_item_23_one_rank_mixed_results() -> None:
    c = Client(1)
    c.node(0, defs=[0])
    c.node(1, uses=[0], defs=[1, 2])
    c.node(20, defs=[3, 4])
    assert c.status(0, 0) == []
    assert c.failed(1, "some failure happened!") == [(1, err(1, 1, "some failure happened!"))]
    assert c.status(0, 2) == [(0, None)]
    c.fetched(20, Ok(42))
    assert c.results.get(20) is None and 20 not in c.results  # not before Status(21)
    assert c.status(0, 21) == [(20, Ok(42))]
    assert c.log == [(1, err(1, 1, "some failure happened!")), (0, None), (20, Ok(42))]


def test_item_25_value_from_rank_0_waits_for_rank_1() -> None:
    c = Client(2)
    c.node(0, defs=[1])
    c.node(1, uses=[1])
    c.fetched(1, Ok("x"))
    assert c.status(0, 2) == []
    assert c.status(1, 1) == [(0, None)]
    assert c.status(1, 2) == [(1, Ok("x"))]


def test_item_26_both_ranks_fail_the_same_seq_first_error_kept() -> None:
    c = Client(2)
    for seq, uses, defs in [
        (0, [], [1, 2]),
        (1, [1], [3]),
        (2, [3], [4]),
        (3, [3], [5]),
        (4, [3], [6]),
        (5, [4], [7]),
        (6, [4], [8]),
    ]:
        c.node(seq, uses, defs)
    first = c.failed(2, "rank 1 error")
    assert [s for s, _ in first] == [2, 5, 6]
    assert c.failed(2, "rank 0 error") == []
    c.status(0, 7)
    c.status(1, 7)
    assert len(c.log) == 7 and sorted(c.results) == list(range(7))
    assert c.results[2] == err(2, 2, "rank 1 error")


def test_item_27_chain_with_two_failures() -> None:
    c = Client(1)
    c.node(0, defs=[0])
    for s in (1, 2, 3):
        c.node(s, uses=[s - 1], defs=[s])
    c.node(4, defs=[9])
    c.failed(0, "a")
    assert c.failed(3, "b") == []
    c.status(0, 5)
    assert len(c.log) == 5
    assert all(c.results[s] == err(s, 0, "a") for s in range(4))
    assert c.results[4] is None


def test_item_28_node_using_failed_ref_fails_before_any_status() -> None:
    c = Client(1)
    c.node(0, defs=[1])
    c.failed(0, "e")
    assert c.node(1, uses=[1]) == [(1, err(1, 0, "e"))]


def test_item_29_purged_failure_keeps_failing_until_droprefs() -> None:
    c = Client(1)
    c.node(0, defs=[1])
    c.failed(0, "e")
    c.status(0, 1)
    assert c.node(1, uses=[1]) == [(1, err(1, 0, "e"))]
    c.drop(1)
    assert c.node(2, uses=[1]) == []


def test_item_30_ok_after_error_keeps_error() -> None:
    c = Client(1)
    c.node(0)
    c.failed(0, "e")
    c.fetched(0, Ok(5))
    assert c.status(0, 1) == []
    assert c.results == {0: err(0, 0, "e")}


def test_item_31_failure_reaches_exactly_its_dependents() -> None:
    c = Client(1)
    h = c.h
    c.node(0, defs=[1, 2])
    c.node(1, uses=[1], defs=[3])
    c.node(2, uses=[3], defs=[4])
    c.node(3, uses=[2], defs=[5, 6])
    c.node(4, uses=[4], defs=[6])
    assert [s for s, _ in c.failed(1, "e")] == [1, 2, 4]
    c.status(0, 5)
    assert c.results[0] is None and c.results[3] is None
    root = Errored(Error(1, 1, "e"))
    assert [h.ref_state(r) for r in (3, 4, 6)] == [root, root, root]
    assert h.ref_state(5) == Invoked(3)


def test_item_32_redefinition_moves_the_dependency() -> None:
    c = Client(1)
    c.node(0, defs=[1])
    c.node(3, uses=[1], defs=[1])  # mutates r1
    c.node(4, uses=[1])
    assert c.h.invocation(0).users == [3]  # type: ignore[union-attr]
    assert c.h.invocation(3).users == [4]  # type: ignore[union-attr]
    assert [s for s, _ in c.failed(3, "e")] == [3, 4]
    assert c.failed(0, "e0") == [(0, err(0, 0, "e0"))]


def test_item_33_drop_of_live_producer_applies_at_purge() -> None:
    c = Client(2)
    c.node(0, defs=[1, 2])
    c.drop(1, 2)
    assert c.h.ref_count == 2 and c.h.pending_drop_count == 2
    c.status(0, 1)
    assert c.h.ref_count == 2
    c.status(1, 1)
    assert c.h.ref_count == 0 and c.h.pending_drop_count == 0


def test_redefinition_cancels_a_pending_drop_so_a_failed_redefiner_stays_errored() -> None:
    c = Client(1)
    h = c.h
    c.node(0, defs=[1])
    c.drop(1)
    assert h.is_pending_drop(1)
    c.node(2, defs=[1])  # a new binding of r1, not dropped
    assert not h.is_pending_drop(1) and h.pending_drop_count == 0
    c.failed(2, "e")
    c.status(0, 1)  # purges s0, whose binding of r1 was dropped
    assert h.ref_state(1) == Errored(Error(2, 2, "e"))
    c.status(0, 3)  # purges s2
    assert h.ref_state(1) == Errored(Error(2, 2, "e"))
    assert c.node(3, uses=[1]) == [(3, err(3, 2, "e"))]
    c.drop(1)
    assert h.ref_state(1) is None


def test_drop_of_a_redefined_ref_waits_for_its_new_producer() -> None:
    c = Client(1)
    h = c.h
    c.node(0, defs=[1])
    c.drop(1)
    c.node(2, defs=[1])
    c.drop(1)  # names s2's binding
    c.failed(2, "e")
    c.status(0, 1)
    assert h.ref_state(1) == Errored(Error(2, 2, "e")) and h.is_pending_drop(1)
    c.status(0, 3)
    assert h.ref_state(1) is None and h.pending_drop_count == 0


def test_removing_an_errored_ref_ends_its_pending_drop() -> None:
    c = Client(1)
    h = c.h
    c.node(0, defs=[1])
    c.drop(1)
    c.failed(0, "e")
    assert h.is_pending_drop(1)
    c.drop(1)  # Errored: removed now
    assert h.ref_state(1) is None and h.pending_drop_count == 0
    c.status(0, 1)
    assert (h.live_count, h.ref_count, h.pending_drop_count) == (0, 0, 0)


def test_item_34_drop_of_unknown_refs_changes_nothing() -> None:
    c = Client(1)
    c.drop(1, 2, 3)
    assert c.h.ref_count == 0 and c.h.pending_drop_count == 0


def test_item_35_non_increasing_seq_rejected() -> None:
    c = Client(1)
    c.node(9, defs=[1])
    with pytest.raises(ValueError, match=r"^Node s5 rejected: seqs must increase \(last was s9\)$"):
        c.node(5, defs=[2])
    with pytest.raises(ValueError, match="Node s9 rejected"):
        c.node(9)
    assert c.h.max_seq == 9 and c.h.ref_state(2) is None and c.h.live_count == 1
    c.node(10)
    assert c.status(0, 11) == [(9, None), (10, None)]


def test_item_36_failure_on_another_stream_does_not_purge_a_live_fetch() -> None:
    c = Client(1)
    for s in range(6):
        c.node(s)
    c.fetched(3, Ok("v"))
    assert c.failed(5, "e") == [(5, err(5, 5, "e"))]
    assert c.h.invocation(3) is not None and c.h.frontier(0) == 0
    assert c.status(0, 6) == [(s, None) for s in range(3)] + [(3, Ok("v")), (4, None)]


def test_item_37_sparse_seqs() -> None:
    c = Client(1)
    for s in (0, 5, 1000):
        c.node(s)
    assert c.status(0, 1001) == [(0, None), (5, None), (1000, None)]
    assert len(c.log) == 3


def test_item_39_throughput_of_chained_nodes() -> None:
    n = 100_000
    best = float("inf")
    for _ in range(3):
        h = History(4)
        t0 = time.perf_counter()
        add = h.add_invocation
        add(0, (), (0,), "op")
        for s in range(1, n):
            add(s, (s - 1,), (s,), "op")
        reports: list[Report] = []
        for r in range(4):
            reports.extend(h.rank_completed(r, n))
        best = min(best, time.perf_counter() - t0)
        assert len(reports) == n and h.live_count == 0
    assert best < 3.0, f"{n / best:,.0f} Nodes/s"  # linear: a quadratic history takes minutes


# --------------------------------------------------------------------------- other behaviour


def test_unknown_and_purged_seqs_are_ignored() -> None:
    c = Client(1)
    assert c.failed(3, "e") == []
    c.fetched(3, Ok(1))
    c.node(0, defs=[1])
    c.status(0, 1)
    assert c.failed(0, "late") == [] and c.h.ref_state(1) == Invoked(0)


def test_fetch_error_is_stored_not_propagated_and_reported_at_completion() -> None:
    c = Client(1)
    c.node(0, defs=[1])
    c.node(1, uses=[1], defs=[2])
    c.fetched(0, Err("unpicklable"))
    c.fetched(0, Ok(1))
    assert c.node(2, uses=[1]) == []
    assert c.status(0, 3) == [(0, err(0, 0, "unpicklable")), (1, None), (2, None)]


def test_fetch_error_then_remote_failure_reports_once() -> None:
    c = Client(1)
    c.node(0, defs=[1])
    c.node(1, uses=[1])
    c.fetched(0, Err("x"))
    assert c.failed(0, "x") == [(0, err(0, 0, "x")), (1, err(1, 0, "x"))]
    assert c.status(0, 2) == []


def test_ranks_outside_the_world_are_refused() -> None:
    h = History(2)
    for bad in (-1, 2):
        with pytest.raises(ValueError):
            h.rank_completed(bad, 1)
        with pytest.raises(ValueError):
            h.update_deadline_tracking(bad, 1)
    with pytest.raises(ValueError):
        History(0)
    h.add_invocation(0, (), ())
    with pytest.raises(TypeError):
        h.set_result(0, "raw")  # type: ignore[arg-type]


def test_frontier_is_monotone_and_progress_follows_it() -> None:
    c = Client(2)
    c.node(0)
    c.status(0, 5)
    c.status(0, 2)
    assert c.h.frontier(0) == 5 and c.h.progress(0) == 5
    c.probe(1, 3)
    c.probe(1, 1)
    assert c.h.progress(1) == 3 and c.h.frontier(1) == 0 and c.h.min_progress == 3


def test_min_frontier_memory_stays_bounded_when_one_rank_never_moves() -> None:
    h = History(3)
    for s in range(1, 20_000):
        h.rank_completed(1, s)
        h.rank_completed(2, s)
    assert h.min_frontier == 0
    assert len(h._frontier.heap) < 64
    h.rank_completed(0, 7)
    assert h.min_frontier == 7
    h.rank_completed(0, 30_000)
    assert h.min_frontier == 19_999


def test_arm_deadline() -> None:
    h = History(2)
    assert h.arm_deadline(0.0, 100, 3.0) is None
    h.add_invocation(0, (), ())
    h.add_invocation(1, (), ())
    d = h.arm_deadline(10.0, 100, 3.0)
    assert d == Deadline(expected=1, due=13.0, reported=False)
    h.update_deadline_tracking(0, 2)
    assert h.arm_deadline(11.0, 100, 3.0) is d  # not met: rank 1 is at 0
    h.update_deadline_tracking(1, 2)
    h.add_invocation(500, (), ())
    assert h.arm_deadline(12.0, 100, 3.0) == Deadline(expected=102, due=15.0)
    assert h.deadline is not None and h.snapshot().deadline == h.deadline


def test_labels_and_snapshot() -> None:
    h = History(2)
    h.add_invocation(3, (), (1,), "make")
    h.add_invocation(7, (1,), (2,), "train_step")
    assert h.op_at_or_after(4) == (7, "train_step") and h.op_at_or_after(8) is None
    h.delete_invocations_for_refs([1])
    assert h.is_pending_drop(1)
    snap = h.snapshot()
    assert (snap.max_seq, snap.live_invocations, snap.ref_map_size, snap.pending_drops) == (
        7,
        2,
        2,
        1,
    )
    assert snap.frontiers == [0, 0] and snap.progress == [0, 0]


def test_outcomes_round_trip_on_the_wire() -> None:
    class Result(msgspec.Struct, array_like=True):
        seq: int
        result: Outcome

    for outcome in (None, Ok(b"pickle"), err(4, 1, "w")):
        data = msgspec.msgpack.encode(Result(4, outcome))
        assert msgspec.msgpack.decode(data, type=Result) == Result(4, outcome)


# --------------------------------------------------------------------------- reference model


class Model:
    """A naive History: sets and full scans, recomputed dependents, no incremental state."""

    def __init__(self, n: int) -> None:
        self.frontier = [0] * n
        self.max_seq: int | None = None
        self.nodes: dict[int, dict[str, Any]] = {}  # live only
        self.refs: dict[int, tuple[str, Any]] = {}  # ("inv", seq) | ("err", (cause, error))
        self.pending: dict[int, int] = {}  # dropped ref -> live producer

    def add(self, seq: int, uses: list[int], defs: list[int]) -> list[tuple[int, Any]]:
        if self.max_seq is not None and seq <= self.max_seq:
            raise ValueError
        self.max_seq = seq
        deps: set[int] = set()
        root: tuple[int, Any] | None = None
        for ref in uses:
            kind, x = self.refs.get(ref, ("none", None))
            if kind == "inv" and x in self.nodes:
                deps.add(x)
            elif kind == "err" and root is None:
                root = x
        node: dict[str, Any] = {"deps": deps, "defs": list(defs), "result": None, "reported": False}
        self.nodes[seq] = node
        for ref in defs:
            self.refs[ref] = ("err", root) if root else ("inv", seq)
            # A pending drop named the previous binding, not this new value: cancel it.
            # (Moving it to this producer instead would, if this one fails, remove an
            # Errored ref nobody dropped, and with an earlier producer's purge even while
            # this one is live: an error is reported once, never twice.)
            self.pending.pop(ref, None)
        out = []
        if root is not None:
            node["result"], node["reported"] = ("err", seq, *root), True
            out.append((seq, node["result"]))
        return out + self.status(0, 0)  # a Node every rank already passed completes now

    def fail(self, seq: int, error: Any) -> list[tuple[int, Any]]:
        if seq not in self.nodes:
            return []
        closure = {seq}
        for s in sorted(self.nodes):
            if s > seq and self.nodes[s]["deps"] & closure:
                closure.add(s)
        out = []
        for s in sorted(closure):
            node = self.nodes[s]
            for ref in node["defs"]:
                if self.refs.get(ref) == ("inv", s):
                    self.refs[ref] = ("err", (seq, error))
            if node["result"] is None or node["result"][0] != "err":
                node["result"] = ("err", s, seq, error)
            if not node["reported"]:
                node["reported"] = True
                out.append((s, node["result"]))
        return out

    def status(self, rank: int, seq: int) -> list[tuple[int, Any]]:
        self.frontier[rank] = max(self.frontier[rank], seq)
        out = []
        for s in sorted(s for s in self.nodes if s < min(self.frontier)):
            node = self.nodes.pop(s)
            if not node["reported"]:
                out.append((s, node["result"]))
            for ref in [r for r, p in self.pending.items() if p == s]:
                del self.pending[ref]
                del self.refs[ref]  # still s's: Invoked(s), or Errored by s's failure
        return out

    def fetched(self, seq: int, value: tuple[str, Any]) -> None:
        node = self.nodes.get(seq)
        if node is None:
            return
        if value[0] == "ok" and node["result"] is None:
            node["result"] = value
        elif value[0] == "err" and (node["result"] is None or node["result"][0] != "err"):
            node["result"] = ("err", seq, seq, value[1])

    def drop(self, refs: list[int]) -> None:
        for ref in refs:
            kind, x = self.refs.get(ref, ("none", None))
            if kind == "inv" and x in self.nodes:
                self.pending[ref] = x
            elif kind != "none":
                del self.refs[ref]
                self.pending.pop(ref, None)  # its status is gone: nothing left to wait for

    def ref_view(self) -> dict[int, Any]:
        return {
            r: Invoked(x) if k == "inv" else Errored(Error(x[0], x[0], x[1]))
            for r, (k, x) in self.refs.items()
        }


def as_model(reports: Any) -> list[tuple[int, Any]]:
    """History reports in the model's tuple notation."""
    out: list[tuple[int, Any]] = []
    for seq, o in reports:
        if o is None:
            out.append((seq, None))
        elif isinstance(o, Ok):
            out.append((seq, ("ok", o.value)))
        else:
            out.append((seq, ("err", o.error.seq, o.error.caused_by, o.error.error)))
    return out


def history_refs(h: History, refs: range) -> dict[int, Any]:
    return {r: s for r in refs if (s := h.ref_state(r)) is not None}


REFS = range(8)


class HistoryMachine(RuleBasedStateMachine):
    """Arbitrary interleavings of Nodes, failures, fetches, Status, probes and DropRefs."""

    @initialize(n=st.integers(1, 3))
    def setup(self, n: int) -> None:
        self.n = n
        self.c = Client(n)
        self.m = Model(n)
        self.accepted: list[int] = []
        self.errors = 0
        self.first_error: dict[int, Error[Any]] = {}
        self.errored_refs: dict[int, Any] = {}

    def _check(self, got: Any, want: list[tuple[int, Any]]) -> None:
        assert as_model(got) == want

    def _errored_refs_survive(self, touched: set[int]) -> None:
        now = history_refs(self.c.h, REFS)
        for ref, state in self.errored_refs.items():
            if ref not in touched:
                assert now.get(ref) == state, f"errored r{ref} changed"
        # A ref dropped while its producer was live goes at the purge, Errored or not.
        self.errored_refs = {
            r: s
            for r, s in now.items()
            if isinstance(s, Errored) and not self.c.h.is_pending_drop(r)
        }

    @rule(
        gap=st.integers(1, 3),
        uses=st.lists(st.sampled_from(REFS), max_size=3),
        defs=st.lists(st.sampled_from(REFS), max_size=2, unique=True),
    )
    def node(self, gap: int, uses: list[int], defs: list[int]) -> None:
        seq = (self.c.h.max_seq or 0) + gap
        self._check(self.c.node(seq, uses, defs), self.m.add(seq, uses, defs))
        self.accepted.append(seq)
        self._errored_refs_survive(set(defs))

    @rule(back=st.integers(0, 3))
    def stale_node(self, back: int) -> None:
        if self.c.h.max_seq is None:
            return
        seq = self.c.h.max_seq - back
        with pytest.raises(ValueError):
            self.c.node(seq, [0], [1])
        with pytest.raises(ValueError):
            self.m.add(seq, [0], [1])

    @rule(pick=st.integers(0, 1000))
    def fail(self, pick: int) -> None:
        seq = self.accepted[pick % len(self.accepted)] if self.accepted else pick
        self.errors += 1
        e = f"e{self.errors}"
        self._check(self.c.failed(seq, e), self.m.fail(seq, e))
        self._errored_refs_survive(set())

    @rule(pick=st.integers(0, 1000), ok=st.booleans())
    def fetch(self, pick: int, ok: bool) -> None:
        seq = self.accepted[pick % len(self.accepted)] if self.accepted else pick
        self.errors += 1
        self.c.fetched(seq, Ok(seq * 10) if ok else Err(f"f{self.errors}"))
        self.m.fetched(seq, ("ok", seq * 10) if ok else ("err", f"f{self.errors}"))

    @rule(rank=st.integers(0, 2), delta=st.integers(-2, 4))
    def status(self, rank: int, delta: int) -> None:
        rank %= self.n
        seq = max(0, self.c.h.frontier(rank) + delta)
        self._check(self.c.status(rank, seq), self.m.status(rank, seq))
        self._errored_refs_survive(set())

    @rule(rank=st.integers(0, 2), seq=st.integers(0, 40))
    def probe(self, rank: int, seq: int) -> None:
        live, frontier = self.c.h.live_count, self.c.h.min_frontier
        self.c.probe(rank % self.n, seq)
        assert (self.c.h.live_count, self.c.h.min_frontier) == (live, frontier)
        assert self.c.h.progress(rank % self.n) >= max(seq, self.c.h.frontier(rank % self.n))

    @rule(refs=st.lists(st.sampled_from(REFS), max_size=4))
    def drop(self, refs: list[int]) -> None:
        self.c.drop(*refs)
        self.m.drop(refs)
        self._errored_refs_survive(set(refs))

    @invariant()
    def agrees_with_model(self) -> None:
        if not hasattr(self, "c"):
            return
        h = self.c.h
        assert history_refs(h, REFS) == self.m.ref_view()
        assert h.live_count == len(self.m.nodes)
        assert h.min_frontier == min(self.m.frontier)
        assert {r for r in REFS if h.is_pending_drop(r)} == set(self.m.pending)
        assert h.pending_drop_count == len(self.m.pending)
        assert set(self.m.pending) <= set(self.m.refs)  # only refs that still have a status

    @invariant()
    def passed_seqs_have_their_result_and_errors_stay_first(self) -> None:
        if not hasattr(self, "c"):
            return
        h = self.c.h
        for seq in self.accepted:
            if seq < h.min_frontier:
                assert seq in self.c.results
            inv = h.invocation(seq)
            if inv is not None and isinstance(inv.result, Err):
                first = self.first_error.setdefault(seq, inv.result.error)
                assert inv.result.error == first
            reported = self.c.results.get(seq)
            if isinstance(reported, Err) and seq in self.first_error:
                assert reported.error == self.first_error[seq]

    def teardown(self) -> None:
        if not hasattr(self, "c"):
            return
        end = (self.c.h.max_seq or 0) + 1
        for r in range(self.n):
            self._check(self.c.status(r, end), self.m.status(r, end))
        assert sorted(self.c.results) == self.accepted  # exactly one Result per Node
        assert len(self.c.log) == len(self.accepted)
        self.c.drop(*REFS)
        h = self.c.h
        assert (h.live_count, h.ref_count, h.pending_drop_count) == (0, 0, 0)


HistoryMachine.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHistoryMachine = HistoryMachine.TestCase


# --------------------------------------------------------------------------- worker simulation


def simulate(rng: random.Random) -> None:
    """Client issues a random program; single-stream workers run it and report.

    Workers obey the real ordering rules (a Node is recorded before a worker runs it; a
    rank's RemoteFunctionFailed/FetchResult precede its Status covering the seq), so the
    outcome is predictable: a Node fails iff it or a dataflow ancestor failed on some
    rank, and then its error's root is one of those failures.
    """
    n = rng.randint(1, 3)
    c, m = Client(n), Model(n)
    program: list[tuple[int, list[int], list[int], bool, set[int]]] = []
    next_ref, seq = 0, -1
    for _ in range(rng.randint(1, 25)):
        seq += rng.choice((1, 1, 1, 2, 7))
        refs = list(range(next_ref))
        uses = rng.sample(refs, min(len(refs), rng.randint(0, 2)))
        fetch = bool(uses) and rng.random() < 0.2
        defs = [] if fetch else [next_ref + i for i in range(rng.randint(0, 2))]
        if uses and not fetch and rng.random() < 0.2:
            defs.append(uses[0])  # mutation: redefines an input
        next_ref += len([d for d in defs if d >= next_ref])
        fails_on = {r for r in range(n) if rng.random() < 0.08}
        program.append((seq, uses, defs, fetch, fails_on))
    issued = 0
    cursor = [0] * n
    poisoned: list[dict[int, int]] = [{} for _ in range(n)]
    outbox: list[list[tuple[str, int, Any]]] = [[] for _ in range(n)]
    dropped: set[int] = set()

    def deliver(r: int) -> None:
        kind, s, x = outbox[r].pop(0)
        if kind == "failed":
            assert as_model(c.failed(s, x)) == m.fail(s, x)
        elif kind == "fetched":
            c.fetched(s, x)
            m.fetched(s, ("ok", x.value) if isinstance(x, Ok) else ("err", x.error))
        else:
            assert as_model(c.status(r, s)) == m.status(r, s)

    def run_next(r: int) -> None:
        s, uses, defs, fetch, fails_on = program[cursor[r]]
        cursor[r] += 1
        bad = next((poisoned[r][u] for u in uses if u in poisoned[r]), None)
        if bad is None and r in fails_on:
            bad = s
            if fetch and r == 0:
                outbox[r].append(("fetched", s, Err(f"s{s} failed on rank {r}")))
            outbox[r].append(("failed", s, f"s{s} failed on rank {r}"))
        elif bad is None and fetch and r == 0:
            outbox[r].append(("fetched", s, Ok(f"value of s{s}")))
        for d in defs:
            if bad is None:
                poisoned[r].pop(d, None)
            else:
                poisoned[r][d] = bad
        nxt = program[cursor[r]][0] if cursor[r] < len(program) else seq + 1
        if rng.random() < 0.3:
            outbox[r].append(("status", nxt, None))

    while True:
        moves = ["node"] if issued < len(program) else []
        moves += [f"run{r}" for r in range(n) if cursor[r] < issued]
        moves += [f"out{r}" for r in range(n) if outbox[r]]
        # The client drops a ref once no issued or future Node uses it.
        droppable = sorted(set(range(next_ref)) - dropped - {u for p in program for u in p[1]})
        if droppable and rng.random() < 0.3:
            moves.append("drop")
        if not moves:
            break
        move = rng.choice(moves)
        if move == "drop":
            refs = rng.sample(droppable, rng.randint(1, len(droppable)))
            dropped.update(refs)
            c.drop(*refs)
            m.drop(refs)
            assert history_refs(c.h, range(next_ref)) == m.ref_view()
        elif move == "node":
            s, uses, defs, _, _ = program[issued]
            assert as_model(c.node(s, uses, defs)) == m.add(s, uses, defs)
            issued += 1
        elif move.startswith("run"):
            run_next(int(move[3:]))
        else:
            deliver(int(move[3:]))
    for r in range(n):
        assert as_model(c.status(r, seq + 1)) == m.status(r, seq + 1)

    assert sorted(c.results) == [p[0] for p in program] and len(c.log) == len(program)
    assert history_refs(c.h, range(next_ref)) == m.ref_view()
    c.drop(*range(next_ref))
    assert (c.h.live_count, c.h.ref_count, c.h.pending_drop_count) == (0, 0, 0)
    failed_roots: dict[int, set[int]] = {}  # seq -> failing seqs it depends on (or is)
    producer: dict[int, int] = {}
    poison: list[set[int]] = [set() for _ in range(n)]  # refs holding an error, per rank
    for s, uses, defs, fetch, fails_on in program:
        roots = {x for u in uses for x in failed_roots[producer[u]]}
        for r in range(n):
            bad = any(u in poison[r] for u in uses)
            if not bad and r in fails_on:
                roots.add(s)  # a root failure on rank r: RemoteFunctionFailed(s)
            poison[r].difference_update(defs)
            if bad or r in fails_on:
                poison[r].update(defs)
        failed_roots[s] = roots
        for d in defs:
            producer[d] = s
        outcome = c.results[s]
        if roots:
            assert isinstance(outcome, Err) and outcome.error.caused_by in roots, (s, outcome)
        elif fetch:
            assert outcome == Ok(f"value of s{s}")
        else:
            assert outcome is None


def test_item_38_randomized_workers_agree_with_reference_model() -> None:
    rng = random.Random(20240601)
    for _ in range(1000):
        simulate(rng)


def test_node_below_the_frontier_completes_at_once() -> None:
    c = Client(2)
    c.node(0, defs=[1])
    c.failed(0, "e")
    c.status(0, 5)
    c.status(1, 5)  # a client protocol error: later Nodes should be >= 5
    assert c.node(2) == [(2, None)]
    assert c.node(3, uses=[1]) == [(3, err(3, 0, "e"))]
    assert c.h.live_count == 0
