"""The controller's stimulus ids and log of recent stimuli (`palatine.tensor.controller.stimuli`):
every instruction a stimulus of its cores produces carries the stimulus's id, a Node that
decides nothing gets none, and the log is bounded."""

from __future__ import annotations

from typing import get_args

import pytest

from palatine.ids import ProcId, WorldId
from palatine.protocol.controller import (
    Fail,
    Instruction,
    RankStallData,
    RequestStacks,
    StallReport,
    SupervisionResult,
    Warn,
)
from palatine.protocol.supervision import ProcSupervisionState
from palatine.protocol.system import (
    ProcFailed,
    SystemStopping,
    WorldGone,
    WorldStatusChanged,
)
from palatine.tensor.controller.history import History
from palatine.tensor.controller.progress import ProgressMonitor
from palatine.tensor.controller.stimuli import Stimuli
from palatine.tensor.controller.supervision import SupervisionMonitor

W = WorldId("worker")


def cores(
    n: int = 2, size: int = 1000
) -> tuple[Stimuli, History, SupervisionMonitor, ProgressMonitor]:
    stimuli = Stimuli(size)
    history = History(n)
    sup = SupervisionMonitor(
        worker_world=W,
        system_addr="tcp:127.0.0.1:1",
        world_size=n,
        now=0.0,
        query_interval_s=1.0,
        system_loss_timeout_s=5.0,
        history=history,
        stimuli=stimuli,
    )
    progress = ProgressMonitor(
        history,
        worker_world=W,
        operation_timeout_s=1.0,
        check_interval_s=1.0,
        fail_on_worker_timeout=True,
        dead_ranks=sup.dead_ranks,
        stimuli=stimuli,
    )
    return stimuli, history, sup, progress


def test_every_instruction_type_has_a_required_stimulus_id() -> None:
    for cls in get_args(Instruction):
        assert "stimulus_id" in cls.__struct_fields__, cls
    with pytest.raises(TypeError, match="stimulus_id"):
        Warn("text")  # type: ignore[call-arg]


def test_every_instruction_a_controller_stimulus_produces_carries_that_stimulus_id() -> None:
    stimuli, history, sup, progress = cores()
    ids: list[str] = []

    def feed(out: list[Instruction]) -> list[Instruction]:
        assert out
        (sid,) = {i.stimulus_id for i in out}
        assert stimuli.entries(0.0, 0.0)[-1].stimulus_id == sid  # its log entry
        ids.append(sid)
        return out

    feed(sup.tick(0.0))
    feed(sup.handle(SupervisionResult(source="subscribe", error="boom"), 0.1))
    feed(sup.handle(SupervisionResult(source="poll", error="timed out"), 0.2))
    feed([progress.first_check(0.3)])
    history.add_invocation(0, [], [0], "step")
    node = feed(progress.on_node(0.4))  # arms the deadline: due-time check, first probe
    assert {type(i).__name__ for i in node} == {"Schedule", "SendProbe"}
    history.add_invocation(1, [], [1], "step")
    before = stimuli.handled
    assert progress.on_node(0.5) == []  # decides nothing: no id
    assert stimuli.handled == before
    out = feed(progress.check(2.0, client_attached=True, mesh_failed=False))
    (request,) = [i for i in out if isinstance(i, RequestStacks)]
    report = StallReport(
        report_id=request.report_id,
        expected_seq=request.expected_seq,
        ranks=[RankStallData(rank=r, stack_error="none") for r in request.ranks],
    )
    out = feed(progress.finish_stall_report(report, 2.5))
    assert [type(i) for i in out] == [Warn, Fail]
    state = ProcSupervisionState(proc_id=ProcId(W, 1), health="Exited", exit_code=3)
    feed(sup.handle(ProcFailed(world=W, rank=1, state=state), 3.0))
    feed(sup.handle(WorldStatusChanged(world=W, status="Unhealthy", reason="r"), 3.1))
    feed(sup.handle(SystemStopping(reason="stop"), 3.2))
    feed(sup.handle(WorldGone(world=W, reason="stopped"), 3.3))
    feed(sup.system_lost_failure(None))
    kinds = [sid.rpartition("-")[0] for sid in ids]
    assert kinds == [
        "supervision-check",
        "supervision-subscribe",
        "supervision-poll",
        "attach",
        "node",
        "check",
        "stall-report",
        "proc-failed",
        "world-status",
        "system-stopping",
        "world-gone",
        "system-lost",
    ]
    assert [int(sid.rpartition("-")[2]) for sid in ids] == list(range(1, len(ids) + 1))
    entries = stimuli.entries(10.0, 1000.0)
    assert [e.stimulus_id for e in entries] == ids
    by_kind = {e.kind: e for e in entries}
    assert by_kind["proc-failed"].subject == "worker[1]"
    assert by_kind["node"].subject == "s0" and by_kind["node"].time == 1000.0 - (10.0 - 0.4)
    assert by_kind["stall-report"].instructions[0].startswith("Warn: ranks 0, 1 have ")
    assert by_kind["system-lost"].time == by_kind["world-gone"].time  # (no time given)


def test_the_controller_stimulus_log_keeps_only_the_newest_entries_up_to_its_size() -> None:
    stimuli, _, sup, _ = cores(size=3)
    for t in range(6):
        sup.tick(float(t) * 10)  # a query and a reschedule each (the system answers none)
    entries = stimuli.entries(0.0, 0.0)
    assert stimuli.size == 3 and stimuli.handled == 6
    assert [e.stimulus_id for e in entries] == [f"supervision-check-{n}" for n in (4, 5, 6)]
