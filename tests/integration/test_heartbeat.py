"""The heartbeat thread against the real channel server.

The system side is ``palatine.channel.serve`` running in a separate process (this file,
run as a script: ``python test_heartbeat.py serve ADDR``), which decodes every envelope
it receives and writes one JSON line per beat. So these tests prove wire compatibility
(token handshake, frames, sessions, acks) with the asyncio channel, and they can kill,
stop and restart "the system" with real signals. Every subprocess runs in its own
session and its process group is killed by the fixture that started it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from palatine import config
from palatine.channel.addr import parse
from palatine.hosting.heartbeat import THREAD_NAME, HeartbeatSettings, HeartbeatThread
from palatine.ids import SYSTEM_ACTOR, ActorId, ProcId
from palatine.protocol.supervision import ActorFailure, ProcSupervisionState
from palatine.protocol.system import SupervisionUpdate

HERE = Path(__file__).resolve()
WAIT_S = 10.0  # upper bound of every wait for something that should happen quickly
PROC = ProcId.parse("hbworld[3]")
AGENT = ActorId(PROC, "proc", 0)
FAILED = ActorFailure(actor_id=ActorId(PROC, "worker", 0), status="failed: boom")
LOST_RE = re.compile(
    r"lost contact with system at (\S+): no heartbeat acknowledged for "
    r"(\d+\.\d) s \(limit ([\d.]+) s\); stopping"
)


# --------------------------------------------------------------------------------------
# Helpers: the system process, addresses, waiting
# --------------------------------------------------------------------------------------


def make_update() -> SupervisionUpdate:
    """What a proc agent's provider returns: a beat with one failed actor and a lag."""
    state = ProcSupervisionState(
        proc_id=PROC, addr="tcp:127.0.0.1:1", failed_actors=[FAILED], loop_lag_s=0.25
    )
    return SupervisionUpdate(state=state)


def wait_until(cond: Callable[[], bool], timeout_s: float = WAIT_S, what: str = "") -> None:
    """Wait for a condition another thread or process makes true; fail after the bound."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or cond}")
        time.sleep(0.01)


class SystemProc:
    """A ``channel.serve`` process standing in for the system; reports beats as JSON."""

    def __init__(self, addr: str, env: dict[str, str], log_dir: Path) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self._stderr = open(log_dir / f"system-{secrets.token_hex(4)}.log", "w+b")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), "serve", addr],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**os.environ, **env},
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        stdout = self.proc.stdout
        threading.Thread(target=self._pump, args=(stdout,), daemon=True).start()
        first = self._next_line()
        assert first.startswith("ready "), first
        self.addr = first.split(" ", 1)[1]

    def _pump(self, stdout: Any) -> None:
        for raw in stdout:
            self.lines.put(raw.decode().rstrip("\n"))
        self.lines.put("<eof>")

    def _next_line(self, timeout_s: float = WAIT_S) -> str:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"system process said nothing for {timeout_s} s") from None
        if line == "<eof>":
            raise AssertionError(f"system process ended: {self.stderr_text()}")
        return line

    def next_beat(self, timeout_s: float = WAIT_S) -> dict[str, Any]:
        """The next envelope the system received, decoded."""
        beat: dict[str, Any] = json.loads(self._next_line(timeout_s))
        return beat

    def received(self) -> list[dict[str, Any]]:
        """Every envelope reported so far (without waiting)."""
        out = []
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return out
            if line != "<eof>":
                out.append(json.loads(line))

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the process group and reap it: its sockets close, as on a crash."""
        self.signal(signal.SIGKILL)
        self.proc.wait(WAIT_S)

    def stderr_text(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def close(self) -> None:
        self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from palatine.testing.certs import make_test_pki

    return make_test_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for unix socket paths (sun_path is 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="hb-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def token() -> bytes:
    return secrets.token_hex(32).encode()


class Cluster:
    """Starts system processes and heartbeat threads; the fixture tears both down."""

    def __init__(
        self, log_dir: Path, token: bytes, pki: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self.log_dir = log_dir
        self.token = token
        self.pki = pki
        self.monkeypatch = monkeypatch
        self.systems: list[SystemProc] = []
        self.threads: list[HeartbeatThread] = []

    def system(self, addr: str, token: bytes | None = None) -> SystemProc:
        env = {"PALATINE_CLUSTER_TOKEN": (token or self.token).decode()}
        if addr.startswith("tls:"):
            from palatine.testing.certs import tls_env

            env.update(tls_env(self.pki, "server"))
        sp = SystemProc(addr, env, self.log_dir)
        self.systems.append(sp)
        return sp

    def heartbeat(self, addr: str, **kwargs: Any) -> HeartbeatThread:
        kwargs.setdefault("token", self.token)
        kwargs.setdefault("make_update", make_update)
        if addr.startswith("tls:") and "ssl_context" not in kwargs:
            from palatine.channel.tls import client_context
            from palatine.testing.certs import tls_env

            with self.monkeypatch.context() as m:
                for key, value in tls_env(self.pki, "client").items():
                    m.setenv(key, value)
                kwargs["ssl_context"] = client_context()
        hb = HeartbeatThread(parse(addr), sender=AGENT, **kwargs)
        self.threads.append(hb)
        return hb

    def close(self) -> None:
        for hb in self.threads:
            assert hb.stop(WAIT_S), "heartbeat thread did not stop"
        for sp in self.systems:
            sp.close()


@pytest.fixture
def cluster(
    tmp_path: Path, token: bytes, pki: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Cluster]:
    c = Cluster(tmp_path, token, pki, monkeypatch)
    try:
        yield c
    finally:
        c.close()


def serve_addr(transport: str, short_dir: Path) -> str:
    if transport == "tcp":
        return "tcp:127.0.0.1:0"
    if transport == "tls":
        return "tls:127.0.0.1:0"
    if transport == "unix":
        return f"unix:{short_dir / 'system.sock'}"
    return f"unix:@palatine-hb-{os.getpid()}-{secrets.token_hex(4)}"


def lost_flag() -> tuple[threading.Event, Callable[[], None]]:
    event = threading.Event()
    return event, event.set


# --------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------


def test_settings_follow_the_spec_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PALATINE_SYSTEM_LOSS_TIMEOUT", "PALATINE_HEARTBEAT_ACK_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    cfg = config.from_env({})
    s = HeartbeatSettings.from_config(cfg=cfg)
    assert (s.interval_s, s.ack_timeout_s, s.system_loss_timeout_s) == (2.0, 2.0, 10.0)
    assert s.proc_stop_timeout_s == 5.0
    s = HeartbeatSettings.from_config(interval_s=0.2, cfg=cfg)
    assert (s.ack_timeout_s, s.system_loss_timeout_s) == (0.2, 1.0)  # min(10, i), 5 × i
    assert HeartbeatSettings.from_config(interval_s=30, cfg=cfg).ack_timeout_s == 10.0

    monkeypatch.setenv("PALATINE_SYSTEM_LOSS_TIMEOUT", "3")
    monkeypatch.setenv("PALATINE_HEARTBEAT_ACK_TIMEOUT", "0.7")
    s = HeartbeatSettings.from_config(interval_s=0.2, cfg=config.from_env())
    assert (s.ack_timeout_s, s.system_loss_timeout_s) == (0.7, 3.0)
    s = HeartbeatSettings.from_config(
        interval_s=0.2, ack_timeout_s=0.1, system_loss_timeout_s=0.5, cfg=cfg
    )
    assert (s.ack_timeout_s, s.system_loss_timeout_s) == (0.1, 0.5)

    with pytest.raises(ValueError, match="interval_s must be > 0"):
        HeartbeatSettings.from_config(interval_s=0, cfg=cfg)


def test_constructor_checks_what_the_transport_needs(token: bytes) -> None:
    with pytest.raises(ValueError, match="post_via_loop"):
        HeartbeatThread(parse("local:7"), sender=AGENT, make_update=make_update)
    with pytest.raises(ValueError, match="make_update"):
        HeartbeatThread(parse("tcp:127.0.0.1:1"), sender=AGENT, token=token)
    with pytest.raises(ValueError, match="not a dialable address"):
        HeartbeatThread(
            parse("tcp:127.0.0.1:0"), sender=AGENT, make_update=make_update, token=token
        )
    # Never started: stop is a no-op.
    assert HeartbeatThread(parse("local:7"), sender=AGENT, post_via_loop=lambda: None).stop()


# --------------------------------------------------------------------------------------
# Beats, acks, transports
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "unix", "abstract", "tls"])
def test_beats_reach_the_system_and_are_acknowledged(
    cluster: Cluster, short_dir: Path, transport: str
) -> None:
    sp = cluster.system(serve_addr(transport, short_dir))
    lost, on_lost = lost_flag()
    hb = cluster.heartbeat(sp.addr, interval_s=0.1, system_loss_timeout_s=5, on_system_lost=on_lost)
    start = time.monotonic()
    hb.start()
    assert hb.last_ok >= start  # last_ok counts from start(), i.e. from Joined
    threads = [t for t in threading.enumerate() if t.name == THREAD_NAME]
    assert threads and all(t.daemon for t in threads)

    for _ in range(3):
        beat = sp.next_beat()
        assert beat["type"] == "SupervisionUpdate"
        assert beat["sender"] == str(AGENT)
        assert beat["dest"] == str(SYSTEM_ACTOR.port(SupervisionUpdate.__palatine_type_id__))
        assert beat["proc_id"] == str(PROC)
        assert beat["health"] == "Alive"
        assert beat["failed_actors"] == [str(FAILED.actor_id)]
        assert beat["loop_lag_s"] == 0.25
    wait_until(lambda: hb.acked_beats >= 3, what="three acknowledged beats")
    assert hb.connected and hb.connects == 1
    assert time.monotonic() - hb.last_ok < 2.0
    assert not lost.is_set() and not hb.lost

    t0 = time.monotonic()
    assert hb.stop(WAIT_S)
    assert time.monotonic() - t0 < 2.5
    assert not hb.is_alive()


# --------------------------------------------------------------------------------------
# Losing the system
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_killed_system_is_reported_lost_after_the_timeout(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    sp = cluster.system("tcp:127.0.0.1:0")
    lost, on_lost = lost_flag()
    hb = cluster.heartbeat(
        sp.addr, interval_s=0.1, system_loss_timeout_s=0.5, on_system_lost=on_lost
    )
    hb.start()
    sp.next_beat()
    wait_until(lambda: hb.acked_beats >= 1, what="an acknowledged beat")

    sp.kill()
    killed = time.monotonic()
    assert lost.wait(WAIT_S), "system loss was not reported"
    elapsed = time.monotonic() - killed
    # Not early: the reason's silence (checked below) is at least the 0.5 s limit.
    assert elapsed < 4.0, elapsed
    assert hb.lost and hb.lost_reason is not None
    m = LOST_RE.fullmatch(hb.lost_reason)
    assert m is not None, hb.lost_reason
    assert m.group(1) == sp.addr and m.group(3) == "0.5"
    assert 0.5 <= float(m.group(2)) < 1.5
    assert any(LOST_RE.match(r.getMessage()) and r.levelno == logging.ERROR for r in caplog.records)
    # The owner stopped the proc: stop() is its report, and the thread ends.
    assert hb.stop(WAIT_S)


@pytest.mark.timeout(30)
def test_stopped_system_that_never_acks_is_reported_lost(cluster: Cluster) -> None:
    """SIGSTOP keeps the connection open but silences acks: the ack path, not EOF."""
    sp = cluster.system("tcp:127.0.0.1:0")
    lost, on_lost = lost_flag()
    hb = cluster.heartbeat(
        sp.addr, interval_s=0.1, system_loss_timeout_s=0.5, on_system_lost=on_lost
    )
    hb.start()
    sp.next_beat()
    wait_until(lambda: hb.acked_beats >= 1, what="an acknowledged beat")
    sp.signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        assert lost.wait(WAIT_S), "system loss was not reported"
        assert time.monotonic() - stopped < 4.0
        assert hb.lost_reason is not None and "(limit 0.5 s); stopping" in hb.lost_reason
    finally:
        sp.signal(signal.SIGCONT)


@pytest.mark.timeout(30)
def test_silent_server_is_lost_at_the_loss_timeout_not_the_auth_timeout(
    cluster: Cluster,
) -> None:
    """A listener that never completes the handshake: every wait is bounded by the
    loss deadline, so the 5 s auth timeout does not delay the verdict."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        addr = f"tcp:127.0.0.1:{listener.getsockname()[1]}"
        lost, on_lost = lost_flag()
        hb = cluster.heartbeat(
            addr, interval_s=0.1, system_loss_timeout_s=0.5, on_system_lost=on_lost
        )
        started = time.monotonic()
        hb.start()
        assert lost.wait(WAIT_S)
        assert time.monotonic() - started < 4.0  # not after the 5 s auth timeout
        assert hb.connects == 0 and hb.acked_beats == 0


@pytest.mark.timeout(30)
def test_wrong_token_is_refused_and_reported(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    sp = cluster.system("tcp:127.0.0.1:0", token=secrets.token_hex(32).encode())
    lost = threading.Event()
    holder: list[HeartbeatThread] = []

    def on_lost() -> None:
        lost.set()
        holder[0].stop()  # the owner may stop from the callback itself: no deadlock

    hb = cluster.heartbeat(
        sp.addr, interval_s=0.1, system_loss_timeout_s=0.5, on_system_lost=on_lost
    )
    holder.append(hb)
    hb.start()
    assert lost.wait(WAIT_S)
    wait_until(lambda: not hb.is_alive(), what="the thread to end after its owner stopped")
    assert hb.connects == 0 and hb.acked_beats == 0
    assert hb.last_error is not None
    assert "server rejected connection: authentication failed (cluster token mismatch?" in (
        hb.last_error
    )
    refusals = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "authentication failed" in r.getMessage()
    ]
    assert refusals and sp.addr in refusals[0].getMessage()
    assert len(refusals) == 1  # reported once, not once per retry
    assert sp.received() == []  # nothing got past the handshake


# --------------------------------------------------------------------------------------
# Reconnecting
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_restarted_system_on_the_same_address_is_reconnected(
    cluster: Cluster, short_dir: Path, transport: str
) -> None:
    """EOF is noticed between beats and redialed at once: with a 5 s interval, the new
    system hears from the proc long before the next beat would be due."""
    sp = cluster.system(serve_addr(transport, short_dir))
    lost, on_lost = lost_flag()
    hb = cluster.heartbeat(
        sp.addr, interval_s=5.0, system_loss_timeout_s=30, on_system_lost=on_lost
    )
    hb.start()
    sp.next_beat()
    wait_until(lambda: hb.acked_beats == 1, what="the first acknowledged beat")

    sp.kill()
    killed = time.monotonic()
    wait_until(lambda: not hb.connected, timeout_s=5.0, what="EOF to be noticed")
    # Between beats: the next beat is due 2.5–5 s after the first one.
    assert time.monotonic() - killed < 2.0, time.monotonic() - killed

    sp2 = cluster.system(sp.addr)
    assert sp2.addr == sp.addr
    restarted = time.monotonic()
    beat = sp2.next_beat(timeout_s=4.0)
    assert beat["sender"] == str(AGENT)
    assert time.monotonic() - restarted < 4.0  # well before the 2.5–5 s beat period
    wait_until(lambda: hb.acked_beats == 2, what="the beat to the new system to be acked")
    assert hb.connects == 2 and hb.connected and not lost.is_set()


# --------------------------------------------------------------------------------------
# Self-stop: the process exits when its owner cannot stop
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_main_proc_exits_1_when_its_owner_does_not_stop(cluster: Cluster) -> None:
    sp = cluster.system("tcp:127.0.0.1:0")
    env = {**os.environ, "PALATINE_CLUSTER_TOKEN": cluster.token.decode()}
    client = subprocess.Popen(
        [sys.executable, str(HERE), "client", sp.addr],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        sp.next_beat(timeout_s=WAIT_S)  # the client process is beating
        sp.kill()
        out, err = client.communicate(timeout=WAIT_S)
    finally:
        try:
            os.killpg(client.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        client.wait(WAIT_S)
    text = err.decode(errors="replace")
    assert client.returncode == 1, text
    assert out.decode().split() == ["started", "on_system_lost"]
    assert LOST_RE.search(text), text
    assert "exiting with status 1" in text


# --------------------------------------------------------------------------------------
# Independence from the event loop
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_beats_flow_while_the_event_loop_is_blocked(cluster: Cluster) -> None:
    sp = await asyncio.to_thread(cluster.system, "tcp:127.0.0.1:0")
    lost, on_lost = lost_flag()
    hb = cluster.heartbeat(
        sp.addr, interval_s=0.1, system_loss_timeout_s=2.0, on_system_lost=on_lost
    )
    hb.start()
    await asyncio.to_thread(wait_until, lambda: hb.acked_beats >= 1)

    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.02)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.1)

    # A long synchronous, pure-Python handler: the loop runs nothing for 1.5 s.
    before = hb.acked_beats
    worst = 0.0
    began = time.monotonic()
    x = 0
    while (now := time.monotonic()) - began < 1.5:
        for i in range(2000):
            x = (x * 31 + i) % 1000003
        worst = max(worst, now - hb.last_ok)
    blocked_for = time.monotonic() - began
    acked = hb.acked_beats - before

    await asyncio.sleep(0.05)
    task.cancel()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert max(gaps) >= blocked_for - 0.05  # the loop really was blocked
    assert acked >= 2, acked  # ~1.5 s / 0.075 s mean period, under GIL contention
    assert worst < 1.5, worst  # below the 2 s loss timeout (typically ~0.1 s)
    assert not lost.is_set()
    assert len(sp.received()) >= acked - 1


@pytest.mark.timeout(30)
async def test_local_transport_posts_through_the_loop() -> None:
    from palatine.channel import serve
    from palatine.channel.local import dial_local
    from palatine.wire import codec
    from palatine.wire.envelope import ENC_MSGPACK, Envelope

    bound, rx = await serve(parse("local:0"))
    tx = dial_local(bound)
    loop = asyncio.get_running_loop()
    tid = SupervisionUpdate.__palatine_type_id__

    def post_beat() -> None:
        env = Envelope(
            AGENT, SYSTEM_ACTOR.port(tid), tid, ENC_MSGPACK, codec.encode_message(make_update())
        )
        tx.post(env)

    hb = HeartbeatThread(
        bound,
        sender=AGENT,
        post_via_loop=lambda: loop.call_soon_threadsafe(post_beat),
        interval_s=0.05,
        system_loss_timeout_s=5,
    )
    hb.start()
    try:
        async with asyncio.timeout(WAIT_S):
            for _ in range(3):
                env = await rx.recv()
                msg = codec.decode_payload(env)
                assert isinstance(msg, SupervisionUpdate) and msg.state.proc_id == PROC
        assert hb.acked_beats >= 3 and not hb.lost
    finally:
        assert await asyncio.to_thread(hb.stop, WAIT_S)
        await rx.stop()


# --------------------------------------------------------------------------------------
# Script mode: the system and client processes used above
# --------------------------------------------------------------------------------------


def _write(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _serve(addr: str) -> None:
    from palatine.channel import serve
    from palatine.wire import codec

    bound, rx = await serve(parse(addr))
    _write(f"ready {bound}")
    while True:
        env = await rx.recv()
        msg = codec.decode_payload(env)
        report: dict[str, Any] = {
            "type": type(msg).__name__,
            "sender": str(env.sender),
            "dest": str(env.dest),
        }
        if isinstance(msg, SupervisionUpdate):
            report.update(
                proc_id=str(msg.state.proc_id),
                health=msg.state.health,
                failed_actors=[str(f.actor_id) for f in msg.state.failed_actors],
                loop_lag_s=msg.state.loop_lag_s,
            )
        _write(json.dumps(report))


def _client(addr: str) -> None:
    """A main proc whose owner never stops: the thread must end the process."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def on_lost() -> None:
        _write("on_system_lost")

    hb = HeartbeatThread(
        parse(addr),
        sender=AGENT,
        make_update=make_update,
        on_system_lost=on_lost,
        exit_process=True,
        interval_s=0.1,
        system_loss_timeout_s=0.5,
        proc_stop_timeout_s=0.2,
    )
    hb.start()
    _write("started")
    threading.Event().wait(WAIT_S * 2)  # the "blocked loop"; exit 3 means no self-stop
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        from palatine.core.runtime import new_event_loop

        server_loop = new_event_loop()
        server_loop.run_until_complete(_serve(sys.argv[2]))
    elif sys.argv[1] == "client":
        _client(sys.argv[2])
