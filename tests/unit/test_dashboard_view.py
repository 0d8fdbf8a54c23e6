"""The dashboard's view of a job: failures noted once each, in words; user gauges averaged
over a world's live procs into one series per metric; the JSON the page reads."""

from __future__ import annotations

from typing import Any

from palatine.protocol.system import (
    FailedActorEntry,
    ProcEntry,
    StimulusEntry,
    StimulusLog,
    SystemSnapshot,
    WorldSnapshot,
)
from palatine.system.dashboard.view import JobView, describe_failure


def entry(pid: int, health: Any = "Alive", **kw: Any) -> ProcEntry:
    fields: dict[str, Any] = dict(labels={}, addr="", pid=pid, host="h1", health=health,
                                  exit_code=None, exit_signal=None, failed_actors=[])  # fmt: skip
    fields.update(kw)
    return ProcEntry(**fields)


def snap(procs: dict[str, ProcEntry]) -> SystemSnapshot:
    world = WorldSnapshot(status="Live", labels={}, host_procs=[], procs=procs)
    return SystemSnapshot(execution_id="ex1", worlds={"w": world})


def test_a_dead_proc_is_one_failure_in_words_and_its_row_says_why() -> None:
    view = JobView({"id": "job1"})
    view.observe(snap({"w[0]": entry(10), "w[1]": entry(11)}), now=1.0)
    assert view.state()["failures"] == []
    dead = entry(11, "Exited", exit_signal=9)
    view.observe(snap({"w[0]": entry(10), "w[1]": dead}), now=2.0)
    view.observe(snap({"w[0]": entry(10), "w[1]": dead}), now=3.0)
    state = view.state()
    assert state["failures"] == [
        {"time": 2.0, "proc": "w[1]", "text": "w[1] (pid 11 on h1) was killed by SIGKILL"}
    ]
    rows = {r["proc"]: r for r in state["worlds"][0]["procs"]}
    assert rows["w[1]"]["health"] == "Exited" and "SIGKILL" in rows["w[1]"]["reason"]
    assert state["worlds"][0]["alive"] == 1
    assert state["job"] == {"id": "job1", "execution_id": "ex1"}


def test_failure_words_prefer_the_systems_reason_and_name_failed_actors() -> None:
    gone = entry(5, "Exited", exit_code=3, reason="exited with status 3 in step 7")
    assert describe_failure("w[2]", gone) == "w[2] (pid 5 on h1): exited with status 3 in step 7"
    assert describe_failure("w[2]", entry(5, "Expired")).endswith("stopped sending heartbeats")
    actors = entry(5, failed_actors=[FailedActorEntry(actor_id="w[2].a[0]", status="Failed")])
    assert describe_failure("w[2]", actors) == "w[2] (pid 5 on h1): actors failed: w[2].a[0] Failed"


def test_a_gauge_is_averaged_over_the_worlds_live_procs_per_snapshot() -> None:
    view = JobView()
    for t, (a, b) in enumerate([(1.0, 3.0), (2.0, 4.0)]):
        view.observe(
            snap(
                {
                    "w[0]": entry(1, counters={"metric.gauge.loss": a}),
                    "w[1]": entry(2, counters={"metric.gauge.loss": b, "sent": 5.0}),
                }
            ),
            now=float(t),
        )
    assert view.state()["metrics"] == {"w: loss": [(0.0, 2.0), (1.0, 3.0)]}


def test_failures_come_from_the_systems_log_once_each_in_time_order_when_it_answers() -> None:
    def stim(n: int, t: float, subject: str, *lines: str) -> StimulusEntry:
        return StimulusEntry(stimulus_id=f"s-{n}", time=t, kind="k", subject=subject,
                             instructions=list(lines))  # fmt: skip

    log = StimulusLog(execution_id="ex1", size=100, handled=3, entries=[
        stim(1, 5.0, "w[1]", "Send ProcStop to w[1]", "Log WARNING: w[1] (pid 11 on h1) was killed by signal 9"),
        stim(2, 6.0, "w", "Log INFO: world w is live again"),
    ])  # fmt: skip
    view = JobView()
    view.observe_stimuli(log)
    view.observe_stimuli(log)  # the same entries again: noted once
    # a death the log told is not described a second time from the snapshot
    view.observe(snap({"w[0]": entry(10), "w[1]": entry(11, "Exited", exit_signal=9)}), now=7.0)
    later = StimulusLog(execution_id="ex1", size=100, handled=4, entries=[
        stim(3, 4.0, "w[0]", "Log ERROR: w[0] (pid 10 on h1) exited with status 1"),
    ])  # fmt: skip
    view.observe_stimuli(later)
    assert view.state()["failures"] == [
        {"time": 5.0, "proc": "w[1]", "text": "w[1] (pid 11 on h1) was killed by signal 9"},
        {"time": 4.0, "proc": "w[0]", "text": "w[0] (pid 10 on h1) exited with status 1"},
    ]
