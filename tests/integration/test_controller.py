"""The controller started only through the CLI.

Every test runs real processes: ``palatine system``, two ``palatine host`` of
``hostworker`` and ``palatine controller --program "<python> -m palatine worker"``, so the
hosts exec four worker procs (two per host). Until the tensor WorkerActor exists the
controller spawns `controller_fakes.FakeWorker` (``PALATINE_CONTROLLER_WORKER_ACTOR_TYPE``);
the test talks to the controller as its client through `controller_fakes.TestClient`.
Process groups are always killed by the fixture.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from controller_fakes import FAKE_WORKER_TYPE, FakeConfig, FakeQuery, TestClient

from palatine.protocol.controller import (
    AttachRejected,
    AttachReply,
    Detach,
    KeepAlive,
    Node,
    Send,
    Serialized,
)
from palatine.protocol.worker import CallFunction, FunctionPath, Pickled, RequestStatus, Slice
from palatine.tensor.client.procs import RoleProcess, palatine_cmd

pytestmark = pytest.mark.timeout(90)

HERE = Path(__file__).resolve().parent
PROGRAM = f"{sys.executable} -m palatine worker"
ALL = [Slice(0, [4], [1])]


class Cluster:
    """System + two hosts; controllers and clients started by the tests."""

    def __init__(
        self, env: dict[str, str], hosts: int = 2, update_timeout: str = "3", interval: str = "0.5"
    ) -> None:
        self.interval = interval
        self.env = env
        self.procs: list[RoleProcess] = []
        self.popens: list[subprocess.Popen[bytes]] = []
        self.clients: list[TestClient] = []
        addr = f"unix:@palatine-ctl-{secrets.token_hex(4)}"
        self.system = self._role(
            [
                "system",
                "--system-addr",
                addr,
                "--supervision-update-timeout-in-sec",
                update_timeout,
                "--world-eviction-timeout-in-sec",
                "2",
            ]
        )
        self.addr = self.system.addr
        self.hosts = [self.start_host(h) for h in range(hosts)]

    def _role(self, args: list[str], env: dict[str, str] | None = None) -> RoleProcess:
        p = RoleProcess(args, {**self.env, **(env or {})}, ready_timeout_s=30)
        self.procs.append(p)
        return p

    def start_host(self, rank: int) -> RoleProcess:
        return self._role(
            [
                "host",
                "--system-addr",
                self.addr,
                "--host-world",
                "hostworker",
                "--host-rank",
                str(rank),
                "--supervision-update-interval-in-sec",
                self.interval,
            ]
        )

    def controller_args(
        self, *extra: str, program: bool = True, cpu_worker: bool = True
    ) -> list[str]:
        args = [
            "controller",
            "--worker-world",
            "worker",
            "--system-addr",
            self.addr,
            "--world-size",
            "4",
            "--num-procs-per-host",
            "2",
            "--supervision-query-interval-in-sec",
            "0.5",
            "--supervision-update-interval-in-sec",
            "0.5",
            *extra,
        ]
        if program:
            args += ["--program", PROGRAM]
        if cpu_worker:
            args.append("--is-cpu-worker")
        return args

    def start_controller(
        self, *extra: str, env: dict[str, str] | None = None, cpu_worker: bool = True
    ) -> RoleProcess:
        return self._role(self.controller_args(*extra, cpu_worker=cpu_worker), env)

    def popen(self, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            [*palatine_cmd(), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **self.env, **(env or {})},
            start_new_session=True,
        )
        self.popens.append(p)
        return p

    def client(self) -> TestClient:
        c = TestClient(self.addr)
        self.clients.append(c)
        return c

    def snapshot(self) -> dict[str, Any]:
        out = subprocess.run(
            [*palatine_cmd(), "snapshot", "--system-addr", self.addr, "--json"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **self.env},
        )
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    def wait_snapshot(self, pred: Any, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        snap: dict[str, Any] = {}
        while time.monotonic() < deadline:
            snap = self.snapshot()
            if pred(snap):
                return snap
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}: {json.dumps(snap)[:2000]}")

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for p in self.popens:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait(5)
        for r in reversed(self.procs):
            r.kill()


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    from palatine.channel import token

    e = {
        "PALATINE_CLUSTER_TOKEN": secrets.token_hex(16),
        "PALATINE_LOG_LEVEL": "WARNING",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "PALATINE_CONTROLLER_WORKER_ACTOR_TYPE": FAKE_WORKER_TYPE,
    }
    saved = {k: os.environ.get(k) for k in e}
    os.environ.update(e)
    token.reset_token_cache()
    try:
        yield e
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        token.reset_token_cache()


@pytest.fixture
def cluster(env: dict[str, str]) -> Iterator[Cluster]:
    c = Cluster(env)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def slow_silence_cluster(env: dict[str, str]) -> Iterator[Cluster]:
    """A cluster whose heartbeat-silence path is slow (10 s update timeout): a death that
    is pushed is then clearly faster than silence, even with bounds generous enough for a
    stalling machine."""
    c = Cluster(env, update_timeout="10")
    try:
        yield c
    finally:
        c.close()


def communicate(p: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, str]:
    _, err = p.communicate(timeout=timeout_s)
    return p.returncode, err.decode(errors="replace")


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def proc_failures(client: TestClient) -> list[Any]:
    return [f.failure for f in client.failures if f.failure.kind in ("proc_failed", "actor_failed")]


# --------------------------------------------------------------------------- usage (1, 2, 13)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--extra-proc-labels", "foo"], "invalid KEY=value: no '=' found in 'foo'"),
        (
            ["--world-size", "4", "--controller-actor-id", "controller[1].root"],
            "controller-actor-id",
        ),
        (["--world-size", "4", "--controller-actor-id", "controller[0].root[2]"], "pid 0"),
        (["--world-size", "4", "--controller-actor-id", "hostc[0].root"], "reserved"),
        (["--world-size", "4", "--controller-actor-id", "controller[0].comm"], "reserved"),
        (["--world-size", "0"], "--world-size must be in [1, 1,048,576], got 0"),
        (["--world-size", str(10**30)], "--world-size must be in [1, 1,048,576]"),
        (
            ["--world-size", "4", "--num-procs-per-host", "5000"],
            "--num-procs-per-host must be in [1, 4,096]",
        ),
        (
            ["--world-size", "4", "--operations-per-worker-progress-request", str(2**63)],
            "--operations-per-worker-progress-request must be in [1, 2**63)",
        ),
        (["--world-size", "4", "--extra-proc-labels", "proc.palatine.dev/role=x"], "reserved"),
        ([], "--world-size"),
    ],
)
def test_usage_errors_exit_2(extra: list[str], expected: str) -> None:
    args = [
        *palatine_cmd(),
        "controller",
        "--worker-world",
        "worker",
        "--system-addr",
        "unix:@nowhere",
        *extra,
    ]
    if "--world-size" not in extra and extra:
        args += ["--world-size", "4"]
    out = subprocess.run(args, check=False, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr


# --------------------------------------------------------------------------- bootstrap (3–7)


def test_bootstrap_labels_params_and_ready_line(cluster: Cluster) -> None:
    t0 = time.monotonic()
    ctl = cluster.start_controller("--extra-proc-labels", "k=v=3", "team=ml")
    assert time.monotonic() - t0 < 15
    assert (
        ctl.ready is not None and ctl.ready["role"] == "controller" and ctl.ready["pid"] == ctl.pid
    )
    snap = cluster.snapshot()
    w = snap["worlds"]["worker"]
    assert w["status"] == "Live"
    assert w["labels"] == {
        "world.palatine.dev/worker": "1",
        "world.palatine.dev/controllerActorId": "controller[0].root",
    }
    assert w["host_procs"] == ["hostworker[0]", "hostworker[1]"]
    x = snap["worlds"]["controller"]
    assert x["status"] == "Live"
    assert list(x["procs"]) == ["controller[0]"]
    assert x["procs"]["controller[0]"]["labels"] == {
        "proc.palatine.dev/role": "controller",
        "proc.palatine.dev/workerWorld": "worker",
        "k": "v=3",
        "team": "ml",
    }
    assert x["procs"]["controller[0]"]["addr"] == ctl.addr
    client = cluster.client()
    for rank in range(4):
        state = client.ask(client.worker(rank), FakeQuery())
        assert state.params.world_size == 4
        assert state.params.rank == rank
        assert state.params.device_index is None
        assert str(state.params.controller_actor) == "controller[0].root[0]"
    # exactly one ready line
    assert ctl.popen.stdout is not None
    os.set_blocking(ctl.popen.stdout.fileno(), False)
    assert b"ready" not in (ctl.popen.stdout.read() or b"")


def test_no_workers_times_out_with_hint(env: dict[str, str]) -> None:
    c = Cluster(env, hosts=0)
    try:
        t0 = time.monotonic()
        p = c.popen(
            c.controller_args(program=False), env={"PALATINE_CONTROLLER_WORLD_READY_TIMEOUT": "2"}
        )
        code, err = communicate(p, 20)
        took = time.monotonic() - t0
        assert code == 1, err
        assert took < 6, took
        line = last_line(err)
        assert "worker world worker did not become Live within 2 s" in line
        assert "0 of 4 procs joined" in line
        assert "start each worker with 'palatine worker --world-id worker" in line
        # cleanup after step 2: the world is gone
        c.wait_snapshot(lambda s: "worker" not in s["worlds"], 10, "worker world removed")
    finally:
        c.close()


def test_worker_exiting_at_start_fails_fast(cluster: Cluster) -> None:
    program = f"{sys.executable} -c 'import sys; sys.exit(1)'"
    t0 = time.monotonic()
    p = cluster.popen([*cluster.controller_args(program=False), "--program", program])
    code, err = communicate(p, 30)
    assert code == 1, err
    assert time.monotonic() - t0 < 10
    line = last_line(err)
    assert "worker proc worker[" in line and "exited with code 1 during startup" in line, line
    cluster.wait_snapshot(
        lambda s: "worker" not in s["worlds"] and "controller" not in s["worlds"],
        10,
        "worlds removed after the failed bootstrap",
    )


def test_the_controller_world_is_live_only_once_every_worker_actor_exists(
    env: dict[str, str],
) -> None:
    """Step 7 after step 6: the readiness signal (X Live) never precedes a worker actor."""
    # Rank 2's constructor blocks its proc for 3 s: heartbeats may pause that long.
    c = Cluster({**env, "FAKE_WORKER_SLOW_SPAWN": "2:3"}, update_timeout="10")
    try:
        client = c.client()
        p = c.popen(c.controller_args())
        worker_live = controller_live = None
        deadline = time.monotonic() + 30
        while controller_live is None and time.monotonic() < deadline and p.poll() is None:
            worlds = client.snapshot()["worlds"]
            now = time.monotonic()
            if worker_live is None and worlds.get("worker", {}).get("status") == "Live":
                worker_live = now
            if worlds.get("controller", {}).get("status") == "Live":
                controller_live = now
            time.sleep(0.02)
        assert worker_live is not None and controller_live is not None, p.poll()
        # Rank 2's actor takes 3 s to construct once the worker world is Live (a second of
        # slack for a late poll of the worker world).
        assert controller_live - worker_live >= 2.0, controller_live - worker_live
        for rank in range(4):
            assert client.ask(client.worker(rank), FakeQuery()).params.rank == rank
    finally:
        c.close()


def test_existing_world_is_an_error(cluster: Cluster) -> None:
    client = cluster.client()
    client.lt.run(lambda: client.sys.upsert_world("worker", [4], 2, None, {}))
    p = cluster.popen(cluster.controller_args())
    code, err = communicate(p, 30)
    assert code == 1, err
    assert "already exists" in last_line(err)
    assert "worker" in client.snapshot()["worlds"]  # the system still answers, untouched


def test_unknown_worker_actor_type_fails_naming_the_rank(cluster: Cluster) -> None:
    p = cluster.popen(
        cluster.controller_args(), env={"PALATINE_CONTROLLER_WORKER_ACTOR_TYPE": "no.such.Worker"}
    )
    code, err = communicate(p, 40)
    assert code == 1, err
    line = last_line(err)
    assert "cannot spawn worker actor worker on worker[" in line
    assert "not registered" in line
    cluster.wait_snapshot(
        lambda s: "worker" not in s["worlds"] and "controller" not in s["worlds"],
        10,
        "worlds removed after the failed bootstrap",
    )


# --------------------------------------------------------------------------- stopping (14, 15, 21, 22)


def test_sigterm_exits_0_and_removes_both_worlds(cluster: Cluster) -> None:
    ctl = cluster.start_controller()
    ctl.signal(signal.SIGTERM)
    assert ctl.wait(15) == 0
    cluster.wait_snapshot(
        lambda s: "worker" not in s["worlds"] and "controller" not in s["worlds"],
        10,
        "both worlds gone",
    )


def test_palatine_stop_of_controller_world_exits_0(cluster: Cluster) -> None:
    ctl = cluster.start_controller()
    out = subprocess.run(
        [*palatine_cmd(), "stop", "--system-addr", cluster.addr, "--world", "controller"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **cluster.env},
    )
    assert out.returncode == 0, out.stderr
    assert ctl.wait(15) == 0


def test_detach_stops_worlds_and_exits_0(cluster: Cluster) -> None:
    ctl = cluster.start_controller()
    client = cluster.client()
    assert isinstance(client.attach(), AttachReply)
    client.tell(Detach())
    assert ctl.wait(10) == 0
    cluster.wait_snapshot(
        lambda s: "worker" not in s["worlds"] and "controller" not in s["worlds"],
        5,
        "both worlds gone",
    )


def test_silent_client_is_lost(cluster: Cluster) -> None:
    ctl = cluster.start_controller(env={"PALATINE_CLIENT_LIVENESS_TIMEOUT": "2"})
    client = cluster.client()
    reply = client.attach()
    assert reply.client_liveness_timeout_s == 2
    t0 = time.monotonic()
    assert ctl.wait(10) == 1
    assert time.monotonic() - t0 < 7
    assert "lost" in last_line(ctl.stderr())
    cluster.wait_snapshot(
        lambda s: "worker" not in s["worlds"] and "controller" not in s["worlds"],
        5,
        "both worlds gone",
    )


# --------------------------------------------------------------------------- attach, results, casts


def test_a_node_before_any_attach_is_dropped_and_a_later_attach_works(cluster: Cluster) -> None:
    ctl = cluster.start_controller()
    stranger = cluster.client()
    stranger.tell(Node(seq=5, defs=[1], label="from a stranger"))
    client = cluster.client()
    assert isinstance(client.attach(), AttachReply)
    client.tell(Node(seq=0, defs=[1]))  # seq 0 after 5 would be refused had 5 been kept
    client.tell(Send(ranks=ALL, message=Serialized.of(RequestStatus(seq=0))))
    client.wait_for(lambda: len(client.results) >= 1, 10, "the Result of s0")
    assert [(r.seq, r.result) for r in client.results] == [(0, None)]
    assert not any("seqs must increase" in lg.message for lg in client.logs)
    ctl.signal(signal.SIGTERM)
    assert ctl.wait(15) == 0
    assert "Node" in ctl.stderr() and "dropped" in ctl.stderr()


def test_without_is_cpu_worker_workers_get_device_index_0(cluster: Cluster) -> None:
    cluster.start_controller(cpu_worker=False)
    client = cluster.client()
    got = [client.ask(client.worker(r), FakeQuery()).params.device_index for r in range(4)]
    assert got == [0] * 4  # "the first device this proc can see" (CPU here, with a warning)


def test_unreachable_system_fails_the_bootstrap_at_once(env: dict[str, str]) -> None:
    addr = f"unix:@palatine-test-nobody-{secrets.token_hex(4)}"
    t0 = time.monotonic()
    p = subprocess.Popen(
        [
            *palatine_cmd(),
            "controller",
            "--worker-world",
            "w",
            "--system-addr",
            addr,
            "--world-size",
            "2",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PALATINE_JOIN_TIMEOUT": "1", "PALATINE_RPC_TIMEOUT": "1"},
        start_new_session=True,
    )
    code, err = communicate(p, 30)
    assert code == 1, err
    assert f"cannot reach system at {addr}: " in last_line(err), err
    assert time.monotonic() - t0 < 15


def test_attach_nodes_sends_and_results(cluster: Cluster) -> None:
    cluster.start_controller()
    client = cluster.client()
    reply = client.attach()
    assert isinstance(reply, AttachReply)
    assert (
        reply.world_size,
        reply.num_procs_per_host,
        str(reply.worker_world),
        reply.worker_name,
    ) == (4, 2, "worker", "worker")
    other = cluster.client()
    rejected = other.attach()
    assert isinstance(rejected, AttachRejected)
    assert str(client.id) in rejected.message
    # a Node from the stranger is dropped; the controller keeps working
    other.tell(Node(seq=0, defs=[1]))
    call = CallFunction(
        seq=0, results=[1], function=FunctionPath("os.getpid"), args=Pickled(b""), stream=0
    )
    client.tell(Node(seq=0, defs=[1], label="os.getpid"))
    client.tell(Send(ranks=ALL, message=Serialized.of(call)))
    client.tell(Node(seq=1, uses=[1]))
    client.tell(
        Send(
            ranks=[Slice(2, [2], [1])],
            message=Serialized.of(
                CallFunction(
                    seq=1, results=[], function=FunctionPath("f"), args=Pickled(b""), stream=0
                )
            ),
        )
    )
    client.tell(Send(ranks=[Slice(9, [1], [1])], message=Serialized.of(call)))
    client.tell(Send(ranks=ALL, message=Serialized.of(RequestStatus(seq=1))))
    client.wait_for(lambda: len(client.results) >= 2, 10, "two Results")
    assert [(r.seq, r.result) for r in client.results] == [(0, None), (1, None)]
    assert any(
        lg.level == "error" and "rank 9 outside worker world worker of size 4" in lg.message
        for lg in client.logs
    )
    for rank in range(4):
        got = [
            (k, s) for k, s, ctl in client.ask(client.worker(rank), FakeQuery()).received if not ctl
        ]
        expected = [("CallFunction", 0)] + ([("CallFunction", 1)] if rank >= 2 else [])
        assert got == [*expected, ("RequestStatus", 1)], (rank, got)
    # a rejected (non-increasing) Node yields a Log(error), no Result
    client.tell(Node(seq=1))
    client.wait_for(lambda: any("seqs must increase" in lg.message for lg in client.logs), 5, "Log")
    client.tell(KeepAlive())
    assert len(client.results) == 2


def test_batch_is_handled_as_its_messages_in_order(cluster: Cluster) -> None:
    """A client flush (`Batch`): Nodes, then Sends (a CommandGroup and per-rank Sends),
    then drops; completions of one Status come back as one `Results`, one per seq."""
    from palatine.protocol.controller import Batch, Introspect
    from palatine.protocol.worker import CommandGroup

    cluster.start_controller()
    client = cluster.client()
    client.attach()

    def call(seq: int, results: list[int]) -> CallFunction:
        return CallFunction(
            seq=seq,
            results=results,
            function=FunctionPath("os.getpid"),
            args=Pickled(b""),
            stream=0,
        )

    group = CommandGroup(commands=[call(0, [1]), call(1, [2]), call(2, [3])])
    client.tell(
        Batch(
            nodes=[Node(seq=0, defs=[1]), Node(seq=1, defs=[2], uses=[1]), Node(seq=2, defs=[3])],
            sends=[
                Send(ranks=ALL, message=Serialized.of(group)),
                Send(ranks=[Slice(0, [1], [1])], message=Serialized.of(call(3, []))),
                Send(ranks=ALL, message=Serialized.of(RequestStatus(seq=2))),
            ],
            drop_refs=[1, 2],
        )
    )
    client.wait_for(lambda: len(client.results) >= 3, 10, "three Results")
    assert [(r.seq, r.result) for r in client.results] == [(0, None), (1, None), (2, None)]
    for rank in range(4):
        got = [
            (k, s) for k, s, ctl in client.ask(client.worker(rank), FakeQuery()).received if not ctl
        ]
        calls = [("CallFunction", 0), ("CallFunction", 1), ("CallFunction", 2)]
        extra = [("CallFunction", 3)] if rank == 0 else []
        assert got == [*calls, *extra, ("RequestStatus", 2)], (rank, got)
    # the dropped refs are gone from the history; the one still held is not
    history = client.ask(client.controller, Introspect()).history
    assert (history.live_invocations, history.ref_map_size) == (0, 1)
    # a Batch from a stranger is dropped whole
    other = cluster.client()
    other.tell(Batch(nodes=[Node(seq=5)]))
    client.tell(Node(seq=3))
    assert client.ask(client.controller, Introspect()).history.max_seq == 3


# --------------------------------------------------------------------------- supervision (19, 55, 59, 60)


def test_sigkilled_worker_is_reported_once(slow_silence_cluster: Cluster) -> None:
    cluster = slow_silence_cluster
    cluster.start_controller()
    client = cluster.client()
    client.attach()
    pid = client.ask(client.worker(1), FakeQuery()).pid
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    client.wait_for(lambda: bool(proc_failures(client)), 5, "a Failure")
    took = time.monotonic() - t0
    # The death is pushed: clearly faster than the heartbeat-silence path (10 s here).
    assert took < 4.0, took
    f = proc_failures(client)[0]
    assert f.kind == "proc_failed" and f.rank == 1 and f.proc_id == "worker[1]"
    assert f.world == "worker" and f.pid == pid and f.exit_signal == 9 and f.host
    assert "killed by signal 9 (SIGKILL)" in f.message
    assert f"worker rank 1 (worker[1], pid {pid} on host" in f.message
    assert ".none[0]" not in f.message
    time.sleep(2.0)  # several query intervals, and the world's eviction
    assert len(proc_failures(client)) == 1
    kinds = [x.failure.kind for x in client.failures]
    assert kinds.count("proc_failed") == 1


def test_failure_before_attach_is_delivered_after_it(cluster: Cluster) -> None:
    cluster.start_controller()
    client = cluster.client()
    pid = client.ask(client.worker(3), FakeQuery()).pid
    os.kill(pid, signal.SIGKILL)
    cluster.wait_snapshot(
        lambda s: (
            s["worlds"].get("worker", {}).get("procs", {}).get("worker[3]", {}).get("health")
            != "Alive"
        ),
        5,
        "worker[3] reported",
    )
    time.sleep(0.5)
    client.attach()
    client.wait_for(lambda: bool(proc_failures(client)), 5, "the queued Failure")
    assert proc_failures(client)[0].rank == 3


def test_failed_worker_actor_is_reported(cluster: Cluster) -> None:
    cluster.start_controller()
    client = cluster.client()
    client.attach()
    client.tell(FakeConfig(panic=True), dest=client.worker(2))
    client.wait_for(lambda: bool(proc_failures(client)), 5, "a Failure")
    f = proc_failures(client)[0]
    assert f.kind == "actor_failed" and f.rank == 2
    assert "__test_panic called" in f.message


def test_lost_system_is_reported_and_controller_exits_1(cluster: Cluster) -> None:
    ctl = cluster.start_controller()
    client = cluster.client()
    client.attach()
    cluster.system.kill()
    client.wait_for(
        lambda: any(f.failure.kind == "system_lost" for f in client.failures),
        10,
        "system_lost Failure",
    )
    assert ctl.wait(10) == 1
    assert "lost contact with system" in last_line(ctl.stderr())


# --------------------------------------------------------------------------- progress (44–47, 53)


def test_stall_warning_then_stuck_failure(cluster: Cluster) -> None:
    cluster.start_controller(
        "--operation-timeout-in-sec",
        "1",
        "--worker-progress-check-interval-in-sec",
        "0.5",
        "--fail-on-worker-timeout",
    )
    client = cluster.client()
    client.attach()
    client.tell(FakeConfig(hang_from=1), dest=client.worker(0))
    client.ask(client.worker(0), FakeQuery())  # the config is applied
    client.tell(Node(seq=0, defs=[1], label="first_op"))
    client.tell(Node(seq=1, uses=[1], label="train_step"))
    t0 = time.monotonic()
    client.wait_for(
        lambda: any(f.failure.kind == "stuck" for f in client.failures), 15, "a stuck Failure"
    )
    took = time.monotonic() - t0
    assert 1.0 <= took < 8, took
    warns = [lg for lg in client.logs if lg.level == "warn"]
    assert len(warns) == 1
    lines = warns[0].message.splitlines()
    # Rank 0 hangs; another rank may be listed too if its probe answer was late (a stall).
    assert re.fullmatch(
        r"ranks 0(, [123])* have operations that have not completed after 1 seconds", lines[0]
    ), lines[0]
    assert lines[1].startswith("rank 0 (worker[0], pid ")
    assert "executing s1 fake_op on stream main" in lines[1]
    assert "rank 0 stack (via in-process):" in warns[0].message
    assert "on_request_status" in warns[0].message or "Thread" in warns[0].message
    stuck = [f.failure for f in client.failures if f.failure.kind == "stuck"]
    assert len(stuck) == 1
    assert stuck[0].ranks[0] == 0 and set(stuck[0].ranks) <= {0, 1, 2, 3}
    assert stuck[0].expected_seq == 1
    assert stuck[0].message.startswith(f"workers stuck: {lines[0]}"), stuck[0].message
    assert "crashed" not in stuck[0].message
    assert not client.results  # no Result because of the stall
    # idle afterwards: no second report
    time.sleep(2.0)
    assert len([lg for lg in client.logs if lg.level == "warn"]) == 1
    assert len([f for f in client.failures if f.failure.kind == "stuck"]) == 1


def test_prompt_probes_produce_no_messages(cluster: Cluster) -> None:
    # The timeout is long enough that the probe's answers (sent a check interval after the
    # Node at most) always arrive well before the deadline, even on a stalling machine.
    cluster.start_controller(
        "--operation-timeout-in-sec", "5", "--worker-progress-check-interval-in-sec", "0.5"
    )
    client = cluster.client()
    client.attach()
    t0 = time.monotonic()
    client.tell(Node(seq=0, defs=[1]))

    def probed(rank: int) -> bool:
        received = client.ask(client.worker(rank), FakeQuery()).received
        return ("RequestStatus", 0, True) in received

    client.wait_for(lambda: all(probed(rank) for rank in range(4)), 10, "every rank probed")
    # Past the deadline, and a few checks beyond it: the answered probes keep it quiet.
    time.sleep(max(0.0, t0 + 5.0 + 1.5 - time.monotonic()))
    for rank in range(4):
        received = client.ask(client.worker(rank), FakeQuery()).received
        assert received.count(("RequestStatus", 0, True)) == 1  # never probed twice
    assert not client.logs and not client.failures and not client.results


# --------------------------------------------------------------------------- the real worker


def test_real_worker_actor(env: dict[str, str]) -> None:
    # torch is imported while the worker actor is built: allow for GIL-starved heartbeats
    c = Cluster(
        {**env, "PALATINE_CONTROLLER_WORKER_ACTOR_TYPE": ""}, update_timeout="20", interval="2"
    )
    try:
        ctl = c.start_controller()
        snap = c.snapshot()
        assert snap["worlds"]["worker"]["status"] == "Live"
        assert snap["worlds"]["controller"]["status"] == "Live"
        client = c.client()
        assert isinstance(client.attach(), AttachReply)
        for rank in range(4):
            entry = psutil.Process(snap["worlds"]["worker"]["procs"][f"worker[{rank}]"]["pid"])
            assert entry.is_running()
        client.tell(Detach())
        assert ctl.wait(15) == 0
    finally:
        c.close()


def test_real_workers_stall_report_names_the_function_and_its_stack(env: dict[str, str]) -> None:
    from palatine.protocol.worker import CreateStream
    from palatine.tensor.worker.values import dumps_args

    # torch is imported while the worker actor is built: allow for GIL-starved heartbeats
    c = Cluster(
        {**env, "PALATINE_CONTROLLER_WORKER_ACTOR_TYPE": ""}, update_timeout="20", interval="2"
    )
    try:
        c.start_controller(
            "--operation-timeout-in-sec",
            "2",
            "--worker-progress-check-interval-in-sec",
            "0.5",
            "--fail-on-worker-timeout",
        )
        client = c.client()
        client.attach()
        client.tell(
            Send(ranks=ALL, message=Serialized.of(CreateStream(id=0, name="main", default=True)))
        )
        call = CallFunction(
            seq=0,
            results=[1],
            function=FunctionPath("controller_fakes.sleepy"),
            args=dumps_args((8,), {}),
            stream=0,
        )
        client.tell(Node(seq=0, defs=[1], label="controller_fakes.sleepy"))
        client.tell(Send(ranks=ALL, message=Serialized.of(call)))
        t0 = time.monotonic()
        client.wait_for(
            lambda: any(lg.level == "warn" for lg in client.logs), 15, "a stall warning"
        )
        took = time.monotonic() - t0
        assert 2.0 <= took <= 10.0, took
        warn = next(lg for lg in client.logs if lg.level == "warn")
        lines = warn.message.splitlines()
        assert (
            lines[0] == "ranks 0, 1, 2, 3 have operations that have not completed after 2 seconds"
        )
        assert "executing s0 " in lines[1] and "sleepy" in lines[1] and "on stream main" in lines[1]
        assert "in sleepy" in warn.message  # a frame of the sleeping function
        client.wait_for(
            lambda: any(f.failure.kind == "stuck" for f in client.failures), 5, "the stuck Failure"
        )
        stuck = next(f.failure for f in client.failures if f.failure.kind == "stuck")
        assert stuck.ranks == [0, 1, 2, 3] and stuck.expected_seq == 0
        assert stuck.stacks is not None and "sleepy" in stuck.stacks[0]
    finally:
        c.close()


def test_spawn_timeout_names_the_missing_rank_and_cleans_up(cluster: Cluster) -> None:
    t0 = time.monotonic()
    p = cluster.popen(
        cluster.controller_args(),
        env={
            "PALATINE_CONTROLLER_WORKER_ACTOR_TYPE": "controller_fakes.SlowWorker",
            "PALATINE_CONTROLLER_SPAWN_TIMEOUT": "1",
        },
    )
    code, err = communicate(p, 30)
    assert code == 1, err
    line = last_line(err)
    assert "did not acknowledge their spawn within 1 s: missing ranks 2 of world worker" in line
    assert time.monotonic() - t0 < 15
    cluster.wait_snapshot(
        lambda s: "worker" not in s["worlds"] and "controller" not in s["worlds"],
        10,
        "worlds removed after the spawn timeout",
    )


def test_sends_to_alternating_subsets_arrive_in_order(cluster: Cluster) -> None:
    cluster.start_controller()
    client = cluster.client()
    client.attach()
    subsets = [ALL, [Slice(0, [2], [2])], [Slice(1, [2], [1]), Slice(2, [2], [1])]]
    members = [{0, 1, 2, 3}, {0, 2}, {1, 2, 3}]

    def issue() -> None:
        tell = client.sys.mailbox.tell
        for seq in range(1000):
            call = CallFunction(
                seq=seq, results=[], function=FunctionPath("f"), args=Pickled(b""), stream=0
            )
            tell(client.controller, Node(seq=seq))
            tell(client.controller, Send(ranks=subsets[seq % 3], message=Serialized.of(call)))

    client.lt.call(issue, timeout=30)
    expected = {r: [s for s in range(1000) if r in members[s % 3]] for r in range(4)}

    def got(rank: int) -> list[int]:
        received = client.ask(client.worker(rank), FakeQuery()).received
        return [s for kind, s, _ in received if kind == "CallFunction"]

    client.wait_for(lambda: all(len(got(r)) >= len(expected[r]) for r in range(4)), 20, "casts")
    for rank in range(4):
        assert got(rank) == expected[rank], rank
        # probes travel the same path: each arrives after the command of its seq
        received = client.ask(client.worker(rank), FakeQuery()).received
        for i, (kind, seq, ctl) in enumerate(received):
            if kind == "RequestStatus" and ctl and seq in expected[rank]:
                assert ("CallFunction", seq, False) in received[:i], (rank, seq)


def test_history_through_the_actor(cluster: Cluster) -> None:
    """The test client also plays the workers' replies (Status, failures, fetches)."""
    from palatine.protocol.controller import Introspect
    from palatine.protocol.worker import (
        FetchResult,
        Ok,
        RemoteFunctionFailed,
        Status,
        WorkerError,
    )

    cluster.start_controller()
    client = cluster.client()
    client.attach()
    client.tell(Node(seq=0, defs=[0]))
    client.tell(Node(seq=1, uses=[0], defs=[1, 2]))
    client.tell(Node(seq=20, defs=[3, 4]))
    for rank in range(4):
        client.tell(Status(seq=0, rank=rank))
    err = WorkerError(
        seq=1,
        rank=2,
        world="worker",
        proc_id="worker[2]",
        host="h",
        pid=1,
        stream="main",
        function="f",
        exc_type="ValueError",
        message="some failure happened!",
    )
    client.tell(RemoteFunctionFailed(seq=1, error=err))
    for rank in range(4):
        client.tell(Status(seq=2, rank=rank))
    client.tell(FetchResult(seq=20, value=Ok(Pickled(b"42"))))
    client.wait_for(lambda: len(client.results) >= 2, 10, "two Results")
    time.sleep(0.3)
    assert len(client.results) == 2  # s20's value waits for every rank to pass it
    for rank in range(4):
        client.tell(Status(seq=21, rank=rank))
    client.wait_for(lambda: len(client.results) >= 3, 10, "three Results")
    r0, r1, r20 = sorted(client.results, key=lambda r: r.seq)  # s1's error is eager
    assert (r0.seq, r0.result) == (0, None)
    assert r1.seq == 1 and r1.result.error.caused_by == 1
    assert r1.result.error.error.message == "some failure happened!"
    assert r20.seq == 20 and r20.result.value.data == b"42"
    state = client.ask(client.controller, Introspect())
    assert state.client_state == "attached" and state.history.live_invocations == 0
    # its recent stimuli: the first supervision check at init, the attach's first check
    kinds = [e.kind for e in state.stimuli]
    assert kinds[0] == "supervision-check" and "attach" in kinds, kinds
    first = state.stimuli[0]
    assert first.stimulus_id == "supervision-check-1" and abs(first.time - time.time()) < 60
    assert first.instructions[-1].startswith("Schedule CheckSupervision in ")
    # a Status naming a rank outside the world is dropped; the controller keeps working
    client.tell(Status(seq=30, rank=9))
    assert client.ask(client.controller, Introspect()).history.frontiers == [21, 21, 21, 21]


def test_sigterm_during_bootstrap_exits_0_and_cleans_up(env: dict[str, str]) -> None:
    c = Cluster(env, hosts=0)
    try:
        p = c.popen(c.controller_args())
        c.wait_snapshot(lambda s: "worker" in s["worlds"], 15, "the worker world upserted")
        p.send_signal(signal.SIGTERM)
        code, err = communicate(p, 15)
        assert code == 0, err
        c.wait_snapshot(lambda s: "worker" not in s["worlds"], 10, "worker world removed")
    finally:
        c.close()
