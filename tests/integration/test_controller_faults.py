"""Faults seen by a controller started through the CLI.

A late attach, a stack dump that never answers, a whole host lost, a SIGSTOPped worker,
two workers killed together, the worker world evicted, and the plain "was stopped" text.
The randomized History test is a unit test (tests/unit/test_history.py), not repeated
here.

Everything runs real processes with the `Cluster` of test_controller.py: ``palatine
system`` (update timeout 3 s, eviction after 2 s), two ``palatine host`` of
``hostworker`` (heartbeat 0.5 s) and ``palatine controller --program ...`` with
four fake workers (two per host), supervision query interval 0.5 s. Timings are small
test settings, shortened where longer waits (a 15 s late attach) would not fit CI. Process groups are killed by the fixture; stopped procs get SIGCONT first.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from controller_fakes import FakeQuery, TestClient
from test_controller import (  # the shared CLI cluster and its fixtures
    ALL,
    Cluster,
    cluster,
    env,
    last_line,
    proc_failures,
    slow_silence_cluster,
)

from palatine.protocol.controller import (
    AttachReply,
    Detach,
    Introspect,
    Node,
    Send,
    Serialized,
)
from palatine.protocol.worker import RequestStatus
from palatine.tensor.client.procs import palatine_cmd

__all__ = ["cluster", "env", "slow_silence_cluster"]  # fixtures imported for pytest

pytestmark = pytest.mark.timeout(60)

EVICTED = "worker world worker was stopped by the system (evicted after being unhealthy)"
STOPPED = "worker world worker was stopped"


def kinds(client: TestClient) -> list[str]:
    return [f.failure.kind for f in client.failures]


def world_gone(client: TestClient) -> list[Any]:
    return [f.failure for f in client.failures if f.failure.kind == "world_gone"]


def worker_pids(client: TestClient) -> dict[int, int]:
    return {r: client.ask(client.worker(r), FakeQuery()).pid for r in range(4)}


def both_worlds_gone(snap: dict[str, Any]) -> bool:
    return "worker" not in snap["worlds"] and "controller" not in snap["worlds"]


def evicted(snap: dict[str, Any]) -> bool:
    """`W` was removed; with its hosts still joined it is listed as AwaitingCreation again."""
    w = snap["worlds"].get("worker")
    return w is None or (w["status"] == "AwaitingCreation" and not w["procs"])


def assert_running(ctl: Any) -> None:
    code = ctl.popen.poll()
    assert code is None, f"controller exited {code}: {last_line(ctl.stderr())}"


@pytest.fixture
def stopped() -> Iterator[list[int]]:
    """Pids a test SIGSTOPped; each gets SIGCONT at the end (before the groups are killed)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_late_attach_works_normally(cluster: Cluster) -> None:
    """Shortened: the client attaches 3 s (3 liveness timeouts) after ready."""
    ctl = cluster.start_controller(env={"PALATINE_CLIENT_LIVENESS_TIMEOUT": "1"})
    client = cluster.client()
    time.sleep(3.0)
    # The liveness clock only runs once a client is attached: nobody is lost yet.
    assert_running(ctl)
    snap = cluster.snapshot()
    assert snap["worlds"]["worker"]["status"] == "Live"
    assert snap["worlds"]["controller"]["status"] == "Live"
    reply = client.attach()
    assert isinstance(reply, AttachReply), reply
    assert reply.world_size == 4 and reply.client_liveness_timeout_s == 1
    client.tell(Node(seq=0, defs=[1], label="late_op"))
    client.tell(Send(ranks=ALL, message=Serialized.of(RequestStatus(seq=1))))
    client.wait_for(lambda: bool(client.results), 5, "the Result of s0")
    assert [(r.seq, r.result) for r in client.results] == [(0, None)]
    assert not client.failures
    client.tell(Detach())
    assert ctl.wait(10) == 0
    cluster.wait_snapshot(both_worlds_gone, 5, "both worlds gone")


@pytest.mark.timeout(60)
def test_failures_queued_before_a_late_attach_arrive_right_after_it(cluster: Cluster) -> None:
    """a worker dies and its world is evicted long before the client attaches;
    both Failures come, in order, right after the AttachReply, and the controller waited."""
    ctl = cluster.start_controller(env={"PALATINE_CLIENT_LIVENESS_TIMEOUT": "1"})
    client = cluster.client()
    pid = worker_pids(client)[2]
    t_ready = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    cluster.wait_snapshot(evicted, 10, "the worker world evicted")
    time.sleep(max(0.5, 3.0 - (time.monotonic() - t_ready)))  # ≥ 3 liveness timeouts
    assert_running(ctl)
    assert client.ask(client.controller, Introspect()).client_state == "waiting"
    reply = client.attach()
    t_attached = time.monotonic()
    assert isinstance(reply, AttachReply), reply
    client.wait_for(lambda: len(client.failures) >= 2, 5, "the queued Failures")
    # Sent in the Attach handler itself, right behind the reply.
    assert all(t - t_attached < 3.0 for t, _ in client.events), client.events
    assert kinds(client) == ["proc_failed", "world_gone"]
    f = client.failures[0].failure
    assert f.rank == 2 and f.proc_id == "worker[2]" and f.pid == pid
    assert "killed by signal 9 (SIGKILL)" in f.message
    assert world_gone(client)[0].message == EVICTED
    time.sleep(1.0)  # several query intervals: nothing is delivered twice
    assert kinds(client) == ["proc_failed", "world_gone"]
    assert not client.logs  # no "older failures were dropped" warning


# ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sigkill_of_a_whole_host_reports_each_of_its_workers_once(
    slow_silence_cluster: Cluster,
) -> None:
    """the host and its worker procs die together (SIGKILL); each worker of that
    host gets one Failure naming the host loss; the other host's workers none; then the
    world is evicted and one world_gone follows."""
    cluster = slow_silence_cluster
    cluster.start_controller()
    client = cluster.client()
    client.attach()
    pids = worker_pids(client)
    procs = cluster.snapshot()["worlds"]["worker"]["procs"]
    on_host0 = sorted(r for r in range(4) if procs[f"worker[{r}]"]["host_proc"] == "hostworker[0]")
    assert len(on_host0) == 2, procs
    host = psutil.Process(cluster.hosts[0].pid)
    children = {c.pid for c in host.children(recursive=True)}
    assert {pids[r] for r in on_host0} <= children
    for p in (host.pid, *children):  # the whole machine goes down at once
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    t0 = time.monotonic()
    client.wait_for(lambda: len(proc_failures(client)) >= 2, 8, "two Failures")
    # Found by the lost connections: clearly faster than heartbeat silence (10 s here).
    assert time.monotonic() - t0 < 5.0
    client.wait_for(lambda: bool(world_gone(client)), 10, "the world_gone Failure")
    time.sleep(1.0)  # further query intervals: nothing is repeated
    failures = proc_failures(client)
    assert sorted(f.rank for f in failures) == on_host0, [f.message for f in failures]
    for f in failures:
        assert f.kind == "proc_failed" and f.world == "worker"
        assert f.proc_id == f"worker[{f.rank}]" and f.pid == pids[f.rank] and f.host
        assert f"worker rank {f.rank} (worker[{f.rank}], pid {pids[f.rank]} on host" in f.message
        # The reason names the lost host.
        assert (
            f"connection lost (its host hostworker[0] on {f.host} was lost at the same time)"
            in f.message
        ), f.message
        assert ".none[0]" not in f.message
    assert kinds(client) == ["proc_failed", "proc_failed", "world_gone"]
    assert world_gone(client)[0].message == EVICTED
    state = client.ask(client.controller, Introspect())
    assert state.dead_ranks == on_host0
    assert sorted(str(p) for p in state.reported_procs) == [f"worker[{r}]" for r in on_host0]


# ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sigstopped_worker_is_reported_as_heartbeat_timeout(
    cluster: Cluster, stopped: list[int]
) -> None:
    """no heartbeat for the update timeout (3 s) → one Failure saying `stopped
    sending heartbeats` within update timeout + 2 query intervals; SIGCONT does not
    revive it or report it again."""
    cluster.start_controller()
    client = cluster.client()
    client.attach()
    client.tell(Node(seq=0, label="stopped_op"))  # names the op the rank has not done
    pid = worker_pids(client)[1]
    host = cluster.snapshot()["worlds"]["worker"]["procs"]["worker[1]"]["host"]
    os.kill(pid, signal.SIGSTOP)
    stopped.append(pid)
    t0 = time.monotonic()
    client.wait_for(lambda: bool(proc_failures(client)), 8, "the heartbeat Failure")
    took = time.monotonic() - t0
    # The silence path (not a death): most of the 3 s update timeout; then update timeout
    # + 2 query intervals, plus slack for a stalling machine.
    assert 2.0 <= took < 6.0, took
    f = proc_failures(client)[0]
    assert f.kind == "proc_failed" and f.rank == 1 and f.proc_id == "worker[1]" and f.pid == pid
    assert f.exit_code is None and f.exit_signal is None
    assert f"worker rank 1 (worker[1], pid {pid} on host {host}" in f.message
    assert "stopped sending heartbeats (none for " in f.message
    assert f"; it may be hung or its host unreachable; check the log on host {host}" in f.message
    assert "last op not completed by this rank: s0 stopped_op" in f.message
    os.kill(pid, signal.SIGCONT)  # late heartbeats of the zombie are ignored (sticky health)
    time.sleep(1.5)
    assert len(proc_failures(client)) == 1, [x.failure.message for x in client.failures]


# ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_two_workers_killed_together_are_each_reported_once(
    slow_silence_cluster: Cluster,
) -> None:
    """one Failure per proc, none twice (also not by the polls, nor after the
    eviction). Order: each death is pushed on its own, so rank order is only guaranteed
    within one batch; the test checks the set."""
    cluster = slow_silence_cluster
    cluster.start_controller()
    client = cluster.client()
    client.attach()
    pids = worker_pids(client)
    os.kill(pids[1], signal.SIGKILL)
    os.kill(pids[2], signal.SIGKILL)
    t0 = time.monotonic()
    client.wait_for(lambda: len(proc_failures(client)) >= 2, 5, "two Failures")
    assert time.monotonic() - t0 < 4.0  # pushed: clearly faster than silence (10 s here)
    time.sleep(2.5)  # 5 query intervals, and the world's eviction
    failures = proc_failures(client)
    assert sorted(f.rank for f in failures) == [1, 2], [f.message for f in failures]
    for f in failures:
        assert f.pid == pids[f.rank] and f.exit_signal == 9
        assert f"worker rank {f.rank} (worker[{f.rank}], pid {f.pid} on host" in f.message
        assert "killed by signal 9 (SIGKILL)" in f.message
    assert kinds(client).count("world_gone") <= 1
    state = client.ask(client.controller, Introspect())
    assert state.dead_ranks == [1, 2]


# --------------------------------------------------------------------------- worlds gone


@pytest.mark.timeout(60)
def test_evicted_worker_world_gives_one_world_gone(cluster: Cluster) -> None:
    """a failed worker makes the system evict the world after 2 s; the client
    gets exactly one `world_gone` with the stopped-world text, after the proc's Failure, and the
    controller stays up."""
    ctl = cluster.start_controller()
    client = cluster.client()
    client.attach()
    os.kill(worker_pids(client)[0], signal.SIGKILL)
    client.wait_for(lambda: bool(world_gone(client)), 10, "the world_gone Failure")
    assert evicted(cluster.snapshot())
    time.sleep(2.0)  # 4 polls answered "unknown world": still one
    assert kinds(client) == ["proc_failed", "world_gone"]
    gone = world_gone(client)[0]
    assert gone.message == EVICTED
    assert gone.world == "worker" and gone.reason and gone.reason.startswith("evicted")
    assert gone.rank is None and gone.proc_id is None
    assert_running(ctl)


@pytest.mark.timeout(60)
def test_worker_world_stopped_by_someone_else_is_world_gone_stopped(cluster: Cluster) -> None:
    """No failure preceded it → `worker world W was stopped`; the workers' expected
    exits are not failures."""
    cluster.start_controller()
    client = cluster.client()
    client.attach()
    out = subprocess.run(
        [*palatine_cmd(), "stop", "--system-addr", cluster.addr, "--world", "worker"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **cluster.env},
    )
    assert out.returncode == 0, out.stderr
    client.wait_for(lambda: bool(world_gone(client)), 10, "the world_gone Failure")
    time.sleep(1.5)
    assert kinds(client) == ["world_gone"], [f.failure.message for f in client.failures]
    assert world_gone(client)[0].message == STOPPED


# ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_stall_report_completes_when_the_stack_dump_never_answers(
    env: dict[str, str], tmp_path: Path, stopped: list[int]
) -> None:
    """rank 0 is SIGSTOPped, so neither its progress query nor its in-process
    dump answers, and the host's outside dump hangs ("py-spy" that sleeps; faulthandler's
    signal stays pending). The warning still comes within the stall-report bound (2 s)
    + 1 s of the report's start, saying `stack unavailable`."""
    hang = tmp_path / "py-spy"
    hang.write_text("#!/bin/sh\nexec sleep 60\n")
    hang.chmod(0o755)
    # Heartbeat silence must not fail rank 0 during the test: update timeout 20 s.
    c = Cluster({**env, "PALATINE_PYSPY": str(hang)}, update_timeout="20")
    try:
        c.start_controller(
            "--operation-timeout-in-sec",
            "1",
            "--worker-progress-check-interval-in-sec",
            "0.5",
            env={"PALATINE_STALL_REPORT_TIMEOUT": "2"},
        )
        client = c.client()
        client.attach()
        pid = worker_pids(client)[0]
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        t0 = time.monotonic()
        client.tell(Node(seq=0, defs=[1], label="stuck_op"))
        started: float | None = None
        while not client.logs:
            now = time.monotonic()
            assert now - t0 < 10, "no stall warning within 10 s"
            if (
                started is None
                and client.ask(client.controller, Introspect()).stall_report_in_flight
            ):
                started = now
            time.sleep(0.02)
        arrived = client.events[0][0]
        assert started is not None, "the report was never seen in flight"
        # Nothing answers, so the report waits for its whole bound, and not longer.
        # (`started` is seen by polling, so it can lag the report's real start.)
        assert 1.0 <= arrived - started <= 2.0 + 1.0, arrived - started
        assert arrived - t0 <= 7.0, arrived - t0
        warn = client.logs[0]
        assert warn.level == "warn"
        lines = warn.message.splitlines()
        # Rank 0 is stopped; another rank may be listed too if its probe answer was late.
        assert re.fullmatch(
            r"ranks 0(, [123])* have operations that have not completed after 1 seconds",
            lines[0],
        ), lines[0]
        assert lines[1].startswith(f"rank 0 (worker[0], pid {pid}, host "), lines[1]
        assert lines[1].endswith(
            "not known to have completed s0 stuck_op; no progress answer within 2 s"
        ), lines[1]
        assert "rank 0: stack unavailable (" in warn.message, warn.message
        assert warn.details["ranks"][0] == 0 and warn.details["expected_seq"] == 0
        assert warn.details["stacks"][0].startswith("stack unavailable (")
        time.sleep(1.0)
        assert len(client.logs) == 1 and not client.failures and not client.results
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        c.close()
