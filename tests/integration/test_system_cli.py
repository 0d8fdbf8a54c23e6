"""System, hosts and workers started only through the CLI.

1 system + 2 hosts + a world of 4 procs spread 2 per host via ``--program``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import psutil
import pytest

from palatine.channel.addr import parse
from palatine.system.service import System, SystemClient
from palatine.tensor.client.procs import RoleProcess, palatine_cmd

pytestmark = pytest.mark.timeout(90)


class LoopThread:
    """A private event loop on a thread, for a test's system client."""

    def __init__(self) -> None:
        from palatine.core.runtime import new_event_loop

        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, fn: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 20.0) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Cluster:
    def __init__(self, env: dict[str, str], system: RoleProcess, hosts: list[RoleProcess]) -> None:
        self.env = env
        self.system = system
        self.hosts = hosts
        self.lt = LoopThread()
        addr = parse(system.addr)
        self.client: SystemClient = self.lt.run(lambda: System(addr).attach(timeout_s=10))

    def snapshot(self) -> dict[str, Any]:
        import msgspec

        snap = self.lt.run(lambda: self.client.snapshot())
        return json.loads(msgspec.json.encode(snap))

    def upsert(self, world: str, n: int, per_host: int) -> None:
        program = f"{sys.executable} -m palatine worker"
        self.lt.run(lambda: self.client.upsert_world(world, [n], per_host, program))

    def wait_for(
        self, pred: Callable[[dict[str, Any]], bool], timeout_s: float, what: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        snap: dict[str, Any] = {}
        while time.monotonic() < deadline:
            snap = self.snapshot()
            if pred(snap):
                return snap
            time.sleep(0.02)
        raise AssertionError(
            f"timed out waiting for {what}; last snapshot: {json.dumps(snap)[:3000]}"
        )

    def close(self) -> None:
        try:
            self.lt.run(lambda: self.client.close(), timeout=5)
        except Exception:  # noqa: BLE001 - the system may be gone
            pass
        self.lt.close()
        for h in self.hosts:
            h.kill()
        self.system.kill()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    env = {
        "PALATINE_CLUSTER_TOKEN": secrets.token_hex(16),
        "PALATINE_LOG_LEVEL": "WARNING",
    }
    os.environ.update(env)
    from palatine.channel import token

    token.reset_token_cache()
    addr = f"unix:@palatine-test-{secrets.token_hex(4)}"
    started: list[RoleProcess] = []
    try:
        system = RoleProcess(
            [
                "system",
                "--system-addr",
                addr,
                "--supervision-update-timeout-in-sec",
                "1",
                "--world-eviction-timeout-in-sec",
                "2",
            ],
            env,
        )
        started.append(system)
        hosts = []
        for r in range(2):
            hosts.append(
                RoleProcess(
                    [
                        "host",
                        "--system-addr",
                        system.addr,
                        "--host-world",
                        "hostw",
                        "--host-rank",
                        str(r),
                        "--supervision-update-interval-in-sec",
                        "0.2",
                    ],
                    env,
                )
            )
            started.append(hosts[-1])
        c = Cluster(env, system, hosts)
    except BaseException:
        for rp in started:
            rp.kill()
        raise
    try:
        yield c
    finally:
        c.close()
        for k in env:
            os.environ.pop(k, None)
        token.reset_token_cache()


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie); it may go meanwhile."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def live(world: str) -> Callable[[dict[str, Any]], bool]:
    return lambda s: s["worlds"].get(world, {}).get("status") == "Live"


def test_world_of_four_on_two_hosts_then_sigkill_and_eviction(cluster: Cluster) -> None:
    cluster.upsert("w", 4, 2)
    snap = cluster.wait_for(live("w"), 20, "world w Live")
    w = snap["worlds"]["w"]
    assert w["host_procs"] == ["hostw[0]", "hostw[1]"]
    assert sorted(w["procs"]) == ["w[0]", "w[1]", "w[2]", "w[3]"]
    assert [w["procs"][f"w[{r}]"]["host_proc"] for r in range(4)] == ["hostw[0]"] * 2 + [
        "hostw[1]"
    ] * 2
    pids = {r: w["procs"][f"w[{r}]"]["pid"] for r in range(4)}
    assert all(psutil.pid_exists(p) for p in pids.values())

    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    snap = cluster.wait_for(
        lambda s: s["worlds"]["w"]["procs"]["w[1]"]["health"] == "Exited", 5, "w[1] Exited"
    )
    took = time.monotonic() - t0
    entry = snap["worlds"]["w"]["procs"]["w[1]"]
    assert entry["exit_signal"] == 9
    assert "killed by signal 9 (SIGKILL)" in (entry["reason"] or "")
    # Reported as a death (Exited, not the heartbeat path's Expired), and promptly.
    assert took < 3.0, f"SIGKILL reported after {took:.3f} s"
    assert snap["worlds"]["w"]["status"] == "Unhealthy"

    # Unhealthy past the eviction timeout: evicted, survivors stopped, hosts keep running.
    # Hosts stay joined, so the evicted world is listed again as AwaitingCreation.
    cluster.wait_for(
        lambda s: (
            "w" not in s["worlds"]
            or (s["worlds"]["w"]["status"] == "AwaitingCreation" and not s["worlds"]["w"]["procs"])
        ),
        10,
        "world w evicted",
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(running(p) for p in pids.values()):
        time.sleep(0.05)
    assert not [p for p in pids.values() if running(p)]
    assert all(h.popen.poll() is None for h in cluster.hosts)


def test_sigstop_expires_after_heartbeat_timeout(cluster: Cluster) -> None:
    cluster.upsert("w", 4, 2)
    snap = cluster.wait_for(live("w"), 20, "world w Live")
    pid = snap["worlds"]["w"]["procs"]["w[2]"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        snap = cluster.wait_for(
            lambda s: s["worlds"]["w"]["procs"]["w[2]"]["health"] == "Expired", 5, "w[2] Expired"
        )
        took = time.monotonic() - t0
        assert 0.5 <= took <= 4.0, took
        assert "no heartbeat" in snap["worlds"]["w"]["procs"]["w[2]"]["reason"]
    finally:
        os.kill(pid, signal.SIGCONT)


def test_palatine_stop_stops_everything(cluster: Cluster) -> None:
    cluster.upsert("w", 4, 2)
    snap = cluster.wait_for(live("w"), 20, "world w Live")
    pids = [e["pid"] for e in snap["worlds"]["w"]["procs"].values()]
    out = subprocess.run(
        [*palatine_cmd(), "stop", "--system-addr", cluster.system.addr],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **cluster.env},
    )
    assert out.returncode == 0, out.stderr
    assert cluster.system.wait(15) == 0
    for h in cluster.hosts:
        assert h.wait(15) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.05)
    alive = [p for p in pids if running(p)]
    assert not alive


def test_killed_host_takes_its_procs_and_they_are_reported(cluster: Cluster) -> None:
    cluster.upsert("w", 4, 2)
    snap = cluster.wait_for(live("w"), 20, "world w Live")
    pids = {r: snap["worlds"]["w"]["procs"][f"w[{r}]"]["pid"] for r in range(4)}
    cluster.hosts[1].kill()
    snap = cluster.wait_for(
        lambda s: (
            "w" in s["worlds"]
            and all(s["worlds"]["w"]["procs"][f"w[{r}]"]["health"] != "Alive" for r in (2, 3))
        ),
        5,
        "w[2], w[3] reported",
    )
    for r in (2, 3):
        assert (
            not psutil.pid_exists(pids[r])
            or psutil.Process(pids[r]).status() == psutil.STATUS_ZOMBIE
        )
    assert snap["worlds"]["w"]["status"] == "Unhealthy"


def test_snapshot_cli_json_and_table(cluster: Cluster) -> None:
    cluster.upsert("w", 4, 2)
    cluster.wait_for(live("w"), 20, "world w Live")
    env = {**os.environ, **cluster.env}
    out = subprocess.run(
        [*palatine_cmd(), "snapshot", "--system-addr", cluster.system.addr, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    w = doc["worlds"]["w"]
    assert w["status"] == "Live"
    for entry in w["procs"].values():
        assert list(entry)[:8] == [
            "labels",
            "addr",
            "pid",
            "host",
            "health",
            "exit_code",
            "exit_signal",
            "failed_actors",
        ]
    table = subprocess.run(
        [*palatine_cmd(), "snapshot", "--system-addr", cluster.system.addr],
        capture_output=True,
        text=True,
        timeout=30,
        env={**env, "COLUMNS": "200"},
    )
    assert table.returncode == 0, table.stderr
    assert "w[3]" in table.stdout and "Live" in table.stdout
    # several worlds after one --world, as documented (`--world W ...`)
    some = subprocess.run(
        [
            *palatine_cmd(),
            "snapshot",
            "--system-addr",
            cluster.system.addr,
            "--json",
            "--world",
            "w",
            "nope",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert some.returncode == 0, some.stderr
    assert list(json.loads(some.stdout)["worlds"]) == ["w"]


def test_snapshot_stimuli_prints_what_the_system_heard_and_decided(cluster: Cluster) -> None:
    from palatine.errors import SystemRequestError
    from palatine.protocol.system import Stimuli, StimulusLog

    cluster.upsert("w", 4, 2)
    cluster.wait_for(live("w"), 20, "world w Live")
    env = {**os.environ, **cluster.env}
    cmd = [*palatine_cmd(), "snapshot", "--system-addr", cluster.system.addr, "--stimuli"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    header, *lines = out.stdout.splitlines()
    assert header.startswith("execution ") and "newest last" in header
    (upsert,) = [ln for ln in lines if " upsert-world-" in ln]
    assert " w: WorldUpserted; " in upsert and "Ask SpawnProc of hostw[0].proc[0]" in upsert
    joins = [ln for ln in lines if " join-" in ln and " w[3]: Joined; Bind w[3] to " in ln]
    assert len(joins) == 1, lines
    assert lines.index(upsert) < lines.index(joins[0])  # newest last
    doc = json.loads(
        subprocess.run(
            [*cmd, "--json", "--last", "2"], capture_output=True, text=True, timeout=30, env=env
        ).stdout
    )
    assert doc["size"] == 1000 and doc["handled"] >= len(lines)
    assert len(doc["entries"]) == 2
    assert list(doc["entries"][0]) == [
        "stimulus_id",
        "time",
        "kind",
        "subject",
        "reply",
        "instructions",
    ]
    # a malformed request is refused with its reason, and the system serves on
    with pytest.raises(SystemRequestError, match="invalid limit -1"):
        cluster.lt.run(lambda: cluster.client.ask(Stimuli(limit=-1)))
    got = cluster.lt.run(lambda: cluster.client.ask(Stimuli(limit=5)))
    assert isinstance(got, StimulusLog)
    said = "Rejected invalid_argument: invalid limit -1"
    assert any(e.kind == "stimuli" and e.reply.startswith(said) for e in got.entries)
    assert live("w")(cluster.snapshot())


def test_palatine_system_given_address_text_attaches_to_a_running_system(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``palatine.System`` is public: it takes the address as text too, parsed there."""
    import palatine

    env = {"PALATINE_CLUSTER_TOKEN": secrets.token_hex(16), "PALATINE_LOG_LEVEL": "WARNING"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from palatine.channel import token

    token.reset_token_cache()
    system = RoleProcess(["system", "--system-addr", "unix:"], env)
    lt = LoopThread()
    try:
        text = system.addr
        assert isinstance(text, str)

        async def attach_and_ask() -> Any:
            client = await palatine.System(text).attach(timeout_s=10)
            try:
                return await client.snapshot()
            finally:
                await client.close()

        snap = lt.run(attach_and_ask)
        assert snap.execution_id
    finally:
        lt.close()
        system.kill()
        token.reset_token_cache()  # (the next test reads its own token)


def test_a_role_stops_when_its_launcher_is_gone() -> None:
    """The lifeline pipe (PALATINE_LIFELINE_FD) reaching EOF stops a role as SIGTERM does."""
    env = {"PALATINE_CLUSTER_TOKEN": secrets.token_hex(16), "PALATINE_LOG_LEVEL": "WARNING"}
    addr = f"unix:@palatine-test-{secrets.token_hex(4)}"
    system = RoleProcess(["system", "--system-addr", addr], env)
    try:
        system.cut_lifeline()  # what the launcher's death does to the pipe
        assert system.wait(15) == 0
        assert "launcher gone (lifeline closed); stopping" in system.stderr()
    finally:
        system.kill()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["system", "--system-addr", "bogus"], "--system-addr 'bogus'"),
        (
            ["system", "--system-addr", "unix:", "--supervision-update-timeout-in-sec", "-1"],
            "--supervision-update-timeout-in-sec must be a finite number > 0, got -1",
        ),
        (
            ["system", "--system-addr", "unix:", "--world-eviction-timeout-in-sec", "nan"],
            "--world-eviction-timeout-in-sec must be a finite number > 0, got nan",
        ),
        (
            ["host", "--system-addr", "unix:@nobody", "--host-world", "hostw", "--host-rank", "-3"],
            "--host-rank must be in [0, 2**64), got -3",
        ),
        (
            ["host", "--system-addr", "unix:@nobody", "--host-world", "host w", "--host-rank", "0"],
            "--host-world 'host w'",
        ),
        (
            [
                "host",
                "--system-addr",
                "unix:@nobody",
                "--host-world",
                "hostw",
                "--host-rank",
                "0",
                "--supervision-update-interval-in-sec",
                "inf",
            ],
            "--supervision-update-interval-in-sec must be a finite number > 0, got inf",
        ),
        (["worker", "--proc-id", "w[x]", "--bootstrap-addr", "unix:@nobody"], "--proc-id 'w[x]'"),
        (["worker", "--proc-id", "w[0]", "--bootstrap-addr", "bogus"], "--bootstrap-addr 'bogus'"),
        (
            [
                "worker",
                "--world-id",
                "alpha",
                "--proc-id",
                "beta[0]",
                "--bootstrap-addr",
                "unix:@nobody",
            ],
            "--proc-id 'beta[0]' is not in --world-id 'alpha'",
        ),
        (
            ["snapshot", "--system-addr", "unix:@nobody", "--world-label", "foo"],
            "no '=' found in 'foo'",
        ),
        (["snapshot", "--system-addr", "unix:@nobody", "--last", "3"], "--last needs --stimuli"),
        (
            ["system", "--system-addr", "unix:@palatine-bad-metrics", "--metrics-addr", "nohost"],
            "cannot serve metrics at 'nohost'",
        ),
        (
            ["system", "--system-addr", "unix:@palatine-bad-port", "--metrics-addr", ":99999"],
            "cannot serve metrics at ':99999'",
        ),
        (
            ["snapshot", "--system-addr", "unix:@nobody", "--stimuli", "--last", "0"],
            "--last must be >= 1, got 0",
        ),
        (
            ["snapshot", "--system-addr", "unix:@nobody", "--stimuli", "--world", "w"],
            "--stimuli lists the system's recent stimuli, not worlds",
        ),
    ],
)
def test_bad_role_flags_are_a_usage_error_named_at_once(argv: list[str], says: str) -> None:
    t0 = time.monotonic()
    proc = subprocess.run([*palatine_cmd(), *argv], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 15  # refused before any join attempt


def test_snapshot_with_the_wrong_token_is_refused_at_once(cluster: Cluster) -> None:
    env = {**os.environ, **cluster.env, "PALATINE_CLUSTER_TOKEN": secrets.token_hex(16)}
    t0 = time.monotonic()
    out = subprocess.run(
        [*palatine_cmd(), "snapshot", "--system-addr", cluster.system.addr],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    took = time.monotonic() - t0
    assert out.returncode == 1
    assert "authentication failed (cluster token mismatch?" in out.stderr
    assert took < 3.0, took  # a refused handshake is final: no waiting out the timeout
    assert "Traceback" not in out.stderr


def test_snapshot_of_an_unreachable_system_says_so() -> None:
    proc = subprocess.run(
        [*palatine_cmd(), "snapshot", "--system-addr", "tcp:127.0.0.1:1", "--timeout-in-sec", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert "palatine snapshot: no answer from system at tcp:127.0.0.1:1 within 1 s" in proc.stderr
    assert "Traceback" not in proc.stderr and "Task was destroyed" not in proc.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["host", "--system-addr", "tcp:127.0.0.1:1", "--host-world", "hostw", "--host-rank", "0"],
        ["worker", "--proc-id", "w[0]", "--bootstrap-addr", "tcp:127.0.0.1:1"],
        [
            "controller",
            "--worker-world",
            "w",
            "--system-addr",
            "tcp:127.0.0.1:1",
            "--world-size",
            "1",
        ],
    ],
    ids=["host", "worker", "controller"],
)
def test_sigterm_while_joining_stops_the_role_at_once(argv: list[str]) -> None:
    # Nothing answers at this address, so the role is still joining when the signal comes.
    proc = subprocess.Popen(
        [*palatine_cmd(), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        time.sleep(1.5)  # let it start its join (nothing to wait for: this only lets it begin)
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_refused_join_is_heard_at_once_and_the_first_proc_keeps_its_place(
    cluster: Cluster,
) -> None:
    # hostw[0] is running: a second hostw[0] is refused, and so is a worker in a reserved
    # world. Neither is routable from the system, yet each hears why in well under its
    # join timeout (30 s), and the running host keeps its record.
    env = {**os.environ, **cluster.env}
    cases = [
        (
            [
                "host",
                "--system-addr",
                cluster.system.addr,
                "--host-world",
                "hostw",
                "--host-rank",
                "0",
            ],
            "proc hostw[0] is already joined from ",
        ),
        (
            ["worker", "--proc-id", "unknown[0]", "--bootstrap-addr", cluster.system.addr],
            "world name 'unknown' is reserved",
        ),
    ]
    for argv, says in cases:
        t0 = time.monotonic()
        proc = subprocess.run(
            [*palatine_cmd(), *argv], capture_output=True, text=True, timeout=60, env=env
        )
        assert proc.returncode == 1 and says in proc.stderr, proc.stderr
        assert time.monotonic() - t0 < 10
    snap = cluster.snapshot()
    assert sorted(snap["worlds"]["w"]["host_procs"]) == ["hostw[0]", "hostw[1]"]
    assert cluster.hosts[0].popen.poll() is None
