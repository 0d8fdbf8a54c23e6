"""The step-3 wait of the controller bootstrap, sans-IO:
verdicts of snapshots, fail-fast texts, timeout messages and hints, poll periods."""

from __future__ import annotations

from typing import Any

from palatine.ids import ProcId
from palatine.protocol.system import ProcEntry, WorldSnapshot
from palatine.tensor.controller.startup import (
    ControllerCommand,
    WaitState,
    format_ranks,
    inspect_worker_world,
    not_live_text,
    poll_delay,
    startup_failure_text,
    worker_records,
)


def entry(**kw: Any) -> ProcEntry:
    base: dict[str, Any] = {
        "labels": {},
        "addr": "unix:/tmp/x.sock",
        "pid": 812,
        "host": "node3",
        "health": "Alive",
        "exit_code": None,
        "exit_signal": None,
        "failed_actors": [],
    }
    base.update(kw)
    return ProcEntry(**base)


def world(
    status: str, procs: dict[str, ProcEntry], hosts: list[str] | None = None
) -> WorldSnapshot:
    return WorldSnapshot(status=status, labels={}, host_procs=hosts or [], procs=procs)  # type: ignore[arg-type]


def cmd(**kw: Any) -> ControllerCommand:
    base: dict[str, Any] = {
        "worker_world": "W",
        "system_addr": "unix:@sys",
        "world_size": 4,
        "num_procs_per_host": 2,
    }
    base.update(kw)
    return ControllerCommand(**base)


def test_absent_world_is_waiting_with_every_rank_missing() -> None:
    s = inspect_worker_world("W", 4, None)
    assert not s.present and not s.live and s.joined == 0 and s.missing == [0, 1, 2, 3]
    assert s.failure is None


def test_partial_world_counts_joined_ranks() -> None:
    s = inspect_worker_world(
        "W", 4, world("Unhealthy", {"W[0]": entry(), "W[2]": entry()}, ["hostW[0]"])
    )
    assert s.present and not s.live and s.joined == 2 and s.missing == [1, 3]
    assert s.host_procs == ["hostW[0]"]


def test_live_world() -> None:
    s = inspect_worker_world("W", 2, world("Live", {"W[0]": entry(), "W[1]": entry()}))
    assert s.live and s.joined == 2 and not s.missing and s.failure is None


def test_dead_proc_fails_at_once_lowest_rank_first() -> None:
    snap = world(
        "Unhealthy",
        {
            "W[0]": entry(),
            "W[3]": entry(health="Exited", exit_signal=9),
            "W[2]": entry(health="Exited", exit_code=1),
        },
    )
    s = inspect_worker_world("W", 4, snap)
    assert s.failed_rank == 2
    assert s.failure == (
        "worker proc W[2] exited with code 1 during startup (host node3, pid 812); see its stderr"
    )


def test_failure_texts() -> None:
    assert startup_failure_text("W[1]", "Exited", None, 9, "", "h", 5) == (
        "worker proc W[1] was killed by signal 9 (SIGKILL) during startup (host h, pid 5); "
        "see its stderr"
    )
    assert (
        startup_failure_text(
            "W[1]", "Exited", None, None, "cannot execute 'x': No such file or directory", "h", None
        )
        == "worker proc W[1] could not be started (host h): cannot execute 'x': No such file or directory"
    )
    assert "stopped sending heartbeats during startup" in startup_failure_text(
        "W[1]", "Expired", None, None, "", "", 3
    )
    assert "lost its connection" in startup_failure_text(
        "W[1]", "ConnectionFailure", None, None, "", "", 3
    )


def test_failed_rank_that_never_joined_is_reported() -> None:
    snap = world(
        "Unhealthy",
        {"W[1]": entry(addr="", pid=None, health="Exited", reason="cannot execute 'nope'")},
    )
    s = inspect_worker_world("W", 2, snap)
    assert s.failed_rank == 1 and "could not be started" in (s.failure or "")


def test_format_ranks() -> None:
    assert format_ranks([]) == ""
    assert format_ranks([3]) == "3"
    assert format_ranks([1, 2, 3]) == "1-3"
    assert format_ranks([7, 0, 2, 3, 4, 5]) == "0, 2-5, 7"
    assert format_ranks([1, 1, 2]) == "1-2"


def test_timeout_message_without_program_hints_at_palatine_worker() -> None:
    text = not_live_text(
        cmd(),
        WaitState(present=True, live=False, joined=1, missing=[1, 2, 3], host_procs=[]),
        300.0,
    )
    assert text.startswith(
        "worker world W did not become Live within 300 s: 1 of 4 procs joined (missing ranks 1-3)"
    )
    assert (
        "start each worker with 'palatine worker --world-id W --proc-id W[r] "
        "--bootstrap-addr unix:@sys'" in text
    )
    assert "\n" not in text


def test_timeout_message_with_program_and_no_host() -> None:
    state = WaitState(present=False, live=False, joined=0, missing=[0, 1, 2, 3], host_procs=[])
    text = not_live_text(cmd(program="palatine worker"), state, 2.0)
    assert "within 2 s: 0 of 4 procs joined (missing ranks 0-3)" in text
    assert "no host has joined host world hostW; start hosts with 'palatine host" in text
    assert "--host-world hostW" in text


def test_timeout_message_with_too_few_hosts() -> None:
    state = WaitState(present=True, live=False, joined=2, missing=[2, 3], host_procs=["hostW[0]"])
    text = not_live_text(cmd(program="palatine worker"), state, 0.5)
    assert "within 0.5 s" in text
    assert "only 1 of 2 hosts have joined host world hostW" in text


def test_poll_period() -> None:
    assert poll_delay(0.0) == 0.01
    assert poll_delay(0.99) == 0.01
    assert poll_delay(1.0) == 0.1
    assert poll_delay(100.0) == 0.1


def test_records_keep_pid_host_and_host_proc() -> None:
    snap = world(
        "Live", {"W[0]": entry(host_proc="hostW[0]"), "W[1]": entry(pid=9, host_proc=None)}
    )
    recs = worker_records("W", 3, snap)
    assert [r.rank for r in recs] == [0, 1]
    assert recs[0].host_proc == ProcId.parse("hostW[0]") and recs[0].pid == 812
    assert recs[0].host == "node3" and recs[0].addr == "unix:/tmp/x.sock"
    assert recs[1].host_proc is None and recs[1].pid == 9
    assert worker_records("W", 2, None) == []
