"""Tests of the controller's supervision.

`SupervisionMonitor` is fed what the system would send — ``Subscribed``/``WorldState``
answers as `SupervisionResult`, pushed ``ProcFailed``/``WorldGone`` events, failing
queries — on a fake clock, and every `Fail` it returns is checked for its text and for
exactly-once delivery per failed proc.
"""

from __future__ import annotations

from unittest.mock import ANY

import pytest

from palatine.ids import ActorId, ProcId, WorldId
from palatine.protocol.controller import (
    CheckSupervision,
    DeviceFailure,
    Fail,
    Instruction,
    LogLine,
    QueryWorldState,
    Schedule,
    SupervisionResult,
    WorkerProcRecord,
)
from palatine.protocol.supervision import ActorFailure, ProcSupervisionState
from palatine.protocol.system import (
    ProcFailed,
    SystemStopping,
    WorldGone,
    WorldStatus,
    WorldStatusChanged,
    WorldSupervisionState,
)
from palatine.tensor.controller.history import History
from palatine.tensor.controller.supervision import (
    PendingFailures,
    SupervisionMonitor,
    is_failed,
    proc_failure,
)

W = WorldId("worker")
ADDR = "tcp:10.0.0.1:29999"


def proc(
    rank: int,
    *,
    health: str = "Exited",
    exit_code: int | None = None,
    exit_signal: int | None = None,
    reason: str = "",
    actors: list[ActorFailure] | None = None,
    pid: int | None = None,
    host: str = "node3",
    addr: str | None = None,
    stderr: list[str] | None = None,
) -> ProcSupervisionState:
    return ProcSupervisionState(
        proc_id=ProcId(W, rank),
        addr=f"tcp:10.0.0.3:{41234 + rank}" if addr is None else addr,
        pid=4242 + rank if pid is None else pid,
        host=host,
        health=health,  # type: ignore[arg-type]
        exit_code=exit_code,
        exit_signal=exit_signal,
        reason=reason,
        failed_actors=actors or [],
        stderr_tail=stderr or [],
    )


def state(*procs: ProcSupervisionState) -> WorldSupervisionState:
    return WorldSupervisionState(
        world_id=W,
        status=WorldStatus(status="Unhealthy", since=1.0, reason="x"),
        procs={p.proc_id.rank: p for p in procs},
    )


def poll(*procs: ProcSupervisionState) -> SupervisionResult:
    return SupervisionResult(state=state(*procs))


def killed(rank: int) -> ProcSupervisionState:
    return proc(rank, exit_signal=9, reason="killed by signal 9 (SIGKILL)")


def panic(rank: int) -> ProcSupervisionState:
    actor = ActorId.parse(f"worker[{rank}].worker[0]")
    return proc(
        rank,
        health="Alive",
        actors=[
            ActorFailure(
                actor_id=actor,
                status=f"failed: serving {actor}: processing error: __test_panic called",
                message="__test_panic called",
            )
        ],
    )


def fails(instrs: list[Instruction]) -> list[DeviceFailure]:
    return [i.failure for i in instrs if isinstance(i, Fail)]


def monitor(n: int = 4, **kw: object) -> SupervisionMonitor:
    args: dict[str, object] = {
        "worker_world": W,
        "system_addr": ADDR,
        "world_size": n,
        "now": 0.0,
        "query_interval_s": 1.0,
        "system_loss_timeout_s": 5.0,
    }
    args.update(kw)
    return SupervisionMonitor(**args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- failures


def test_sigkill_gives_one_failure_naming_everything() -> None:
    sup = monitor()
    out = sup.on_proc_failed(ProcFailed(world=W, rank=1, state=killed(1)), 0.1)
    (f,) = fails(out)
    assert f.kind == "proc_failed"
    assert f.message == (
        "worker rank 1 (worker[1], pid 4243 on host node3, addr tcp:10.0.0.3:41235) was "
        "killed by signal 9 (SIGKILL)"
    )
    assert (f.world, f.rank, f.proc_id, f.host, f.pid, f.exit_signal, f.exit_code) == (
        "worker",
        1,
        "worker[1]",
        "node3",
        4243,
        9,
        None,
    )
    assert f.addr == "tcp:10.0.0.3:41235"
    assert sup.dead_ranks == {1} and sup.reported_procs == {ProcId(W, 1)} and sup.failed
    # The same proc again, by push or by poll: nothing.
    assert sup.on_proc_failed(ProcFailed(world=W, rank=1, state=killed(1)), 0.2) == []
    assert fails(sup.on_result(poll(killed(1)), 0.3)) == []


def test_after_a_recovery_only_the_new_incarnation_s_failure_is_reported() -> None:
    sup = monitor(procs=[WorkerProcRecord(rank=1, proc_id=ProcId(W, 1), pid=4243, host="node3")])
    assert fails(sup.on_proc_failed(ProcFailed(world=W, rank=1, state=killed(1)), 0.1))
    new = WorkerProcRecord(rank=1, proc_id=ProcId(W, 1), pid=9001, host="node3")
    sup.revive([1], {1: new})
    assert sup.dead_ranks == set() and not sup.failed
    # A late report of the replaced incarnation (its pid): nothing.
    assert sup.on_proc_failed(ProcFailed(world=W, rank=1, state=killed(1)), 0.2) == []
    (f,) = fails(
        sup.on_proc_failed(
            ProcFailed(
                world=W,
                rank=1,
                state=proc(1, pid=9001, exit_signal=9, reason="killed by signal 9 (SIGKILL)"),
            ),
            0.3,
        )
    )
    assert f.pid == 9001 and sup.dead_ranks == {1}


def test_poll_first_then_push_is_still_once() -> None:
    sup = monitor()
    assert len(fails(sup.on_result(poll(killed(2)), 1.0))) == 1
    assert sup.on_proc_failed(ProcFailed(world=W, rank=2, state=killed(2)), 1.1) == []


def test_subscribe_reply_is_fed_like_a_poll() -> None:
    sup = monitor()
    out = sup.on_result(SupervisionResult(source="subscribe", state=state(killed(0))), 0.0)
    assert [f.rank for f in fails(out)] == [0]
    assert not sup.query_pending


def test_host_lost_reports_each_proc_once_then_world_gone() -> None:
    sup = monitor(2)
    lost = "connection lost (its host hostworker[0] on node3 was lost at the same time)"
    procs = [proc(r, health="ConnectionFailure", reason=lost) for r in (1, 0)]
    out = sup.on_result(poll(*procs), 1.0)
    got = fails(out)
    assert [f.rank for f in got] == [0, 1]
    assert got[0].message == (
        "worker rank 0 (worker[0], pid 4242 on host node3, addr tcp:10.0.0.3:41234) "
        "connection lost (its host hostworker[0] on node3 was lost at the same time)"
    )
    for t in range(2, 12):
        assert fails(sup.on_result(poll(*procs), float(t))) == []
    gone = fails(sup.on_world_gone(WorldGone(world=W, reason="evicted: worker[0] ..."), 12.0))
    assert len(gone) == 1
    assert gone[0].kind == "world_gone"
    assert gone[0].message == (
        "worker world worker was stopped by the system (evicted after being unhealthy)"
    )
    assert fails(sup.on_result(SupervisionResult(state=None), 13.0)) == []
    assert sup.world_gone


def test_exit_code() -> None:
    (f,) = fails(monitor().on_result(poll(proc(3, exit_code=3, reason="exited with code 3")), 1))
    assert f.message.endswith("exited with code 3") and f.exit_code == 3


def test_heartbeat_silence() -> None:
    p = proc(1, health="Expired", reason="no heartbeat for 20.4 s (timeout 20 s)")
    (f,) = fails(monitor().on_result(poll(p), 1.0))
    assert f.kind == "proc_failed"
    assert f.message == (
        "worker rank 1 (worker[1], pid 4243 on host node3, addr tcp:10.0.0.3:41235) stopped "
        "sending heartbeats (none for 20.4 s); it may be hung or its host unreachable; "
        "check the log on host node3"
    )
    assert f.reason == "no heartbeat for 20.4 s (timeout 20 s)"


def test_failed_actor() -> None:
    sup = monitor()
    (f,) = fails(sup.on_proc_failed(ProcFailed(world=W, rank=1, state=panic(1)), 0.5))
    assert f.kind == "actor_failed"
    assert f.message == (
        "actor worker[1].worker[0] on worker rank 1 (pid 4243, host node3) failed: "
        "__test_panic called"
    )
    assert f.actor_id == "worker[1].worker[0]" and f.actor_error == "__test_panic called"
    assert sup.dead_ranks == {1}
    # The proc exits later: already reported, so no second Failure (decision 7).
    assert fails(sup.on_result(poll(proc(1, exit_code=1)), 2.0)) == []


def test_not_reported_again_and_a_later_proc_gets_its_own() -> None:
    sup = monitor()
    assert len(fails(sup.on_result(poll(killed(1)), 1.0))) == 1
    for t in range(2, 12):
        assert fails(sup.on_result(poll(killed(1)), float(t))) == []
    out = fails(sup.on_result(poll(killed(1), proc(3, exit_code=3)), 12.0))
    assert [f.rank for f in out] == [3]
    assert sup.dead_ranks == {1, 3}


def test_two_procs_together_ordered_by_rank() -> None:
    sup = monitor()
    st = WorldSupervisionState(
        world_id=W,
        status=WorldStatus(status="Unhealthy"),
        procs={3: killed(3), 0: killed(0)},
    )
    assert [f.rank for f in fails(sup.on_state(st, 1.0))] == [0, 3]


# --------------------------------------------------------------------------- worlds gone


def test_system_lost_once_after_the_loss_timeout() -> None:
    sup = monitor()  # interval 1 s, loss timeout 5 s, last contact at 0
    sent: list[DeviceFailure] = []
    logs: list[LogLine] = []
    for t in range(0, 15):
        now = float(t)
        out = sup.tick(now)
        sent += fails(out)
        if t >= 1:  # every query fails (a dead system's requests bounce)
            res = sup.on_result(SupervisionResult(error="connection refused"), now + 0.5)
            sent += fails(res)
            logs += [i for i in res if isinstance(i, LogLine)]
        if sent:
            assert now + 0.5 > 5.0, "system_lost before the loss timeout"
    assert len(sent) == 1
    f = sent[0]
    assert f.kind == "system_lost"
    assert f.message == (f"lost contact with system at {ADDR}; workers can no longer be supervised")
    # Each failing query is a warning up to the one that reports the loss (t = 5.5), then quiet.
    levels = [entry.level for entry in logs]
    assert levels == ["warning"] * 5 + ["debug"] * (len(levels) - 5), levels
    assert "connection refused" in logs[0].message
    # on_stop: already sent, so nothing more.
    assert sup.system_lost_failure() == []
    assert sup.system_lost


def test_a_restarted_system_still_rebuilding_the_world_counts_as_contact() -> None:
    sup = monitor()  # loss timeout 5 s
    sent: list[DeviceFailure] = []
    for t in range(0, 15):
        now = float(t)
        sent += fails(sup.tick(now))
        sent += fails(sup.on_result(SupervisionResult(rebuilding=True), now + 0.5))
    assert sent == []
    assert not sup.system_lost


def test_pending_query_counts_as_failing() -> None:
    sup = monitor()
    queries = 0
    sent: list[DeviceFailure] = []
    for t in range(0, 12):
        out = sup.tick(float(t))
        queries += sum(isinstance(i, QueryWorldState) for i in out)
        sent += fails(out)
    # The first query never came back: no pile-up, one retry once it is presumed lost.
    assert queries == 2
    assert [f.kind for f in sent] == ["system_lost"]


def test_answers_and_events_keep_the_system_alive() -> None:
    sup = monitor()
    for t in range(0, 30):
        now = float(t)
        out = sup.tick(now)
        assert QueryWorldState(stimulus_id=ANY) in out
        assert out[-1] == Schedule(1.0, CheckSupervision(), stimulus_id=ANY)
        sup.on_result(SupervisionResult(state=state()), now + 0.1)
    assert not sup.system_lost
    # A streak of failures shorter than the timeout, then recovery: logged, no Failure.
    for t in range(30, 33):
        sup.tick(float(t))
        sup.on_result(SupervisionResult(error="timed out"), t + 0.5)
    sup.tick(33.0)
    out = sup.on_result(SupervisionResult(state=state()), 33.5)
    assert [i.level for i in out if isinstance(i, LogLine)] == ["info"]
    assert not sup.system_lost


def test_on_stop_sends_system_lost_if_not_sent_yet() -> None:
    sup = monitor()
    (f,) = fails(sup.system_lost_failure())
    assert f.kind == "system_lost" and "lost contact with system at" in f.message
    assert sup.system_lost_failure() == []


def test_world_gone_texts() -> None:
    evicted = monitor().on_world_gone(
        WorldGone(world=W, reason="evicted: worker[3] (pid 812 on node3) was killed by signal 9"),
        1.0,
    )
    (f,) = fails(evicted)
    assert f.message == (
        "worker world worker was stopped by the system (evicted after being unhealthy)"
    )
    assert f.reason is not None and f.reason.startswith("evicted")
    stopped = monitor().on_result(SupervisionResult(state=None), 1.0)
    assert [g.message for g in fails(stopped)] == ["worker world worker was stopped"]
    # Unknown to a poll after a failure: it was evicted.
    sup = monitor()
    sup.on_result(poll(killed(0)), 1.0)
    (g,) = fails(sup.on_result(SupervisionResult(state=None), 12.0))
    assert "evicted after being unhealthy" in g.message
    # Pushed, then polled: once.
    sup2 = monitor()
    assert len(fails(sup2.on_world_gone(WorldGone(world=W, reason="stopped"), 1.0))) == 1
    assert fails(sup2.on_result(SupervisionResult(state=None), 2.0)) == []


def test_no_placeholder_ids_in_any_text() -> None:
    placeholder = ActorFailure(
        actor_id=ActorId.parse("worker[1].none[0]"), status="failed: boom", message=""
    )
    cases = [
        proc(1, health="Alive", actors=[placeholder]),
        proc(1, exit_code=1, actors=[placeholder]),
        killed(1),
        panic(1),
        proc(1, health="Expired", reason="no heartbeat for 3.1 s (timeout 3 s)"),
        proc(1, health="ConnectionFailure", reason="broken link: peer gone"),
    ]
    for p in cases:
        f = proc_failure(W, 1, p)
        assert ".none[" not in f.message and f.actor_id != "worker[1].none[0]"
    f = proc_failure(W, 1, cases[0])
    assert f.message == "the worker actor on worker rank 1 (pid 4243, host node3) failed: boom"


# --------------------------------------------------------------------------- texts and details


def test_last_op_and_stderr_tail_are_included() -> None:
    h = History(2)
    h.add_invocation(16, [], [], "load")
    h.add_invocation(17, [], [], "train_step")
    h.rank_completed(1, 17)
    sup = monitor(2, history=h)
    p = proc(1, exit_code=1, stderr=["Traceback (most recent call last):", "", "OSError: x"])
    (f,) = fails(sup.on_result(poll(p), 1.0))
    first, *rest = f.message.splitlines()
    assert first == (
        "worker rank 1 (worker[1], pid 4243 on host node3, addr tcp:10.0.0.3:41235) exited "
        "with code 1; last op not completed by this rank: s17 train_step"
    )
    assert rest == [
        "last stderr lines of worker[1]:",
        "  Traceback (most recent call last):",
        "  OSError: x",
    ]
    # Rank 0 has completed nothing: its first op is s16.
    (g,) = fails(sup.on_result(poll(killed(0)), 2.0))
    assert g.message.endswith("; last op not completed by this rank: s16 load")


def test_record_fills_what_the_system_lacks_and_pre_join_failures() -> None:
    rec = WorkerProcRecord(rank=2, proc_id=ProcId(W, 2), pid=812, host="node9", addr="unix:/x")
    p = proc(2, pid=0, host="", addr="", reason="cannot execute 'x': No such file or directory")
    p = ProcSupervisionState(
        proc_id=p.proc_id, health="Exited", reason=p.reason, addr="", pid=None, host=""
    )
    f = proc_failure(W, 2, p, record=rec)
    assert f.message == (
        "worker rank 2 (worker[2], pid 812 on host node9, addr unix:/x) exited: cannot "
        "execute 'x': No such file or directory"
    )
    bare = proc_failure(W, 2, p)
    assert bare.message.startswith("worker rank 2 (worker[2]) exited: cannot execute")
    assert bare.pid is None and bare.host is None and bare.addr is None


def test_dead_proc_with_failed_actor_mentions_both() -> None:
    p = panic(1)
    p = ProcSupervisionState(
        proc_id=p.proc_id,
        addr=p.addr,
        pid=p.pid,
        host=p.host,
        health="Exited",
        exit_signal=11,
        failed_actors=p.failed_actors,
    )
    f = proc_failure(W, 1, p)
    assert f.kind == "proc_failed"
    assert "was killed by signal 11 (SIGSEGV)" in f.message
    assert "; actor worker[1].worker[0] had failed: __test_panic called" in f.message


def test_healthy_procs_and_other_worlds_are_ignored() -> None:
    sup = monitor()
    assert not is_failed(proc(0, health="Alive"))
    assert fails(sup.on_result(poll(proc(0, health="Alive")), 1.0)) == []
    other = WorldId("other")
    ev = ProcFailed(world=other, rank=0, state=killed(0))
    assert sup.on_proc_failed(ev, 1.0) == []
    assert sup.on_world_gone(WorldGone(world=other, reason="stopped"), 1.0) == []
    st = WorldSupervisionState(world_id=other, status=WorldStatus(status="Live"), procs={})
    assert sup.on_state(st, 1.0) == []
    assert not sup.failed


def test_rank_outside_the_world_is_reported_but_not_marked_dead() -> None:
    sup = monitor(2)
    (f,) = fails(sup.on_proc_failed(ProcFailed(world=W, rank=7, state=killed(7)), 1.0))
    assert f.rank == 7 and sup.dead_ranks == set()


def test_handle_dispatches_every_input() -> None:
    sup = monitor()
    assert QueryWorldState(stimulus_id=ANY) in sup.handle(CheckSupervision(), 0.0)
    assert fails(sup.handle(SupervisionResult(state=state(killed(0))), 0.5))
    assert fails(sup.handle(ProcFailed(world=W, rank=1, state=killed(1)), 0.6))
    changed = sup.handle(WorldStatusChanged(world=W, status="Unhealthy", reason="r"), 0.7)
    assert changed == [LogLine("info", "worker world worker is Unhealthy: r", stimulus_id=ANY)]
    stopping = sup.handle(SystemStopping(reason="palatine stop"), 0.8)
    assert stopping == [
        LogLine("info", f"system at {ADDR} is stopping: palatine stop", stimulus_id=ANY)
    ]
    assert fails(sup.handle(WorldGone(world=W, reason="stopped"), 0.9))
    with pytest.raises(TypeError):
        sup.handle(object(), 1.0)  # type: ignore[arg-type]


def test_subscribe_failure_is_a_warning_and_polling_continues() -> None:
    sup = monitor()
    sup.tick(0.0)
    out = sup.on_result(SupervisionResult(source="subscribe", error="rejected: not_found"), 0.1)
    assert len(out) == 1 and isinstance(out[0], LogLine) and out[0].level == "warning"
    assert sup.query_pending  # the subscribe outcome does not complete the poll


def test_from_params() -> None:
    from palatine.protocol.controller import ControllerParams

    params = ControllerParams(
        world_size=2,
        worker_world=W,
        system_addr=ADDR,
        comm=ActorId.parse("controller[0].comm"),
        supervision_query_interval_s=0.5,
        system_loss_timeout_s=3.0,
    )
    sup = SupervisionMonitor.from_params(params, now=0.0)
    assert sup.tick(0.0)[-1] == Schedule(0.5, CheckSupervision(), stimulus_id=ANY)
    assert fails(sup.tick(3.5)) and sup.system_lost


# --------------------------------------------------------------------------- pending failures


def test_pending_failures_keep_order_and_count_drops() -> None:
    q = PendingFailures(limit=3)
    for i in range(5):
        q.push(DeviceFailure(kind="proc_failed", message=f"m{i}", rank=i))
    assert len(q) == 3
    items, dropped = q.drain()
    assert [f.message for f in items] == ["m2", "m3", "m4"] and dropped == 2
    assert q.drain() == ([], 0)


def test_failure_before_attach_is_queued_then_delivered_in_order() -> None:
    """The shell's part of a late attach: Fails produced before attach go through the queue."""
    sup = monitor()
    q = PendingFailures()
    for instr in sup.on_result(poll(killed(2), killed(0)), 1.0):
        if isinstance(instr, Fail):
            q.push(instr.failure)
    items, dropped = q.drain()
    assert [f.rank for f in items] == [0, 2] and dropped == 0
