"""Mailboxes, ports and routing."""

from __future__ import annotations

import asyncio
import logging
import pickle
import subprocess
import sys

import pytest

from palatine.channel.addr import ChannelAddr
from palatine.core.actor import Actor, endpoint
from palatine.core.mailbox import FIRST_EPHEMERAL_PORT, Mailbox
from palatine.core.proc import Proc
from palatine.core.router import Router
from palatine.errors import DeliveryError, PeerGoneError
from palatine.ids import ActorId, PortId, ProcId, WorldId
from palatine.mesh.actor_mesh import ActorRef
from palatine.testing.procs import proc_cluster
from palatine.wire.codec import Message, display, encode_message, type_id_for
from palatine.wire.envelope import ENC_MSGPACK, ENC_PICKLE, Envelope

pytestmark = pytest.mark.timeout(30)


class MyTest(Message, kw_only=True):
    __palatine_name__ = "MyTest"
    a: int
    b: str


def test_envelope_display() -> None:
    env = Envelope(
        ActorId.parse("source[0].actor[0]"),
        PortId.parse("dest[1].actor[0][123]"),
        MyTest.__palatine_type_id__,
        ENC_MSGPACK,
        encode_message(MyTest(a=123, b="hello")),
    )
    assert display(env) == 'source[0].actor[0] > dest[1].actor[0][123]: MyTest{"a":123,"b":"hello"}'
    env.returned("e1")
    env.returned("e2")
    assert display(env).endswith(": delivery error: e1; e2")


def test_handler_type_id_is_stable_across_processes() -> None:
    tid = type_id_for("palatine.protocol.system.Join")
    assert tid >> 63 == 1
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from palatine.protocol.system import Join; print(Join.__palatine_type_id__)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(out.stdout) == tid


def _env(dest: PortId, data: bytes = b"") -> Envelope:
    return Envelope(
        ActorId.parse("w[0].s[0]"),
        dest,
        MyTest.__palatine_type_id__,
        ENC_MSGPACK,
        encode_message(MyTest(a=1, b="x")),
    )


async def test_once_stream_and_ephemeral_ports() -> None:
    async with proc_cluster(1) as (_procs, client):
        mb: Mailbox = client.mailbox
        once = mb.open_once_port()
        assert once.index == FIRST_EPHEMERAL_PORT
        assert mb.deliver(_env(once.id)) is None
        assert mb.deliver(_env(once.id)) == f"mailbox error: port {once.id} not bound"
        assert await once.recv(1.0) == MyTest(a=1, b="x")
        stream = mb.open_port()
        assert stream.index == FIRST_EPHEMERAL_PORT + 1  # never reused, even after close
        assert stream.try_recv() is None
        for _i in range(3):
            mb.deliver(_env(stream.id))
        assert await stream.recv(1.0) == MyTest(a=1, b="x")
        assert len(stream.drain()) == 2
        stream.close()
        assert mb.deliver(_env(stream.id)) == f"mailbox error: port {stream.id} not bound"
        assert mb.open_port().index == FIRST_EPHEMERAL_PORT + 2
        with pytest.raises(TimeoutError):
            await mb.open_port().recv(0.05)


def test_router_longest_prefix() -> None:
    dialed: list[ChannelAddr] = []
    r = Router(lambda a: dialed.append(a))  # type: ignore[arg-type,func-returns-value]
    a, b, c = (ChannelAddr.parse(f"tcp:127.0.0.1:{p}") for p in (1, 2, 3))
    r.bind(WorldId("w"), a)
    r.bind(ProcId.parse("w[1]"), b)
    r.bind(ActorId.parse("w[1].a[0]"), c)
    assert r.lookup(ActorId.parse("w[1].a[0]")) == c
    assert r.lookup(ActorId.parse("w[1].z[0]")) == b
    assert r.lookup(ActorId.parse("w[7].a[0]")) == a
    r.unbind(ProcId.parse("w[1]"))
    assert r.lookup(ActorId.parse("w[1].a[0]")) == a
    r.bind(ProcId.parse("w[1]"), b)
    r.bind(ActorId.parse("w[1].a[0]"), c)
    r.unbind(WorldId("w"))
    assert r.lookup(ActorId.parse("w[1].a[0]")) is None
    # Only `w` and a sibling actor bound: the world binding still wins (the original got this wrong).
    r2 = Router(lambda a: None)  # type: ignore[arg-type,return-value]
    r2.bind(WorldId("w"), a)
    r2.bind(ActorId.parse("w[0].b[0]"), c)
    assert r2.lookup(ActorId.parse("w[0].a[0]")) == a


class Echo(Actor):
    @endpoint
    def ping(self, x: int) -> int:
        return x


async def test_no_route_and_no_system_returns_not_routable() -> None:
    async with proc_cluster(1) as (_procs, _):
        with pytest.raises(
            DeliveryError, match="address not routable: destination not found in routing table"
        ):
            await ActorRef(ActorId.parse("elsewhere[0].x[0]")).ping.call_one(1)


async def test_undeliverable_of_undeliverable_is_dropped_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with proc_cluster(1) as (procs, _):
        p = procs[0]
        from palatine.core.instance import UNDELIVERABLE_TID
        from palatine.core.mailbox import Undeliverable

        inner = _env(PortId.parse("w[0].nobody[0][5]"))
        wrapper = Envelope(
            ActorId.parse("ghost[0].g[0]"),
            PortId(ActorId.parse("w[0].nobody[0]"), UNDELIVERABLE_TID),
            UNDELIVERABLE_TID,
            ENC_MSGPACK,
            encode_message(Undeliverable(inner)),
        )
        with caplog.at_level(logging.WARNING, logger="palatine"):
            p.post(wrapper)
            await asyncio.sleep(0.05)
        drops = [r for r in caplog.records if "dropping an undeliverable" in r.message]
        assert len(drops) == 1


async def test_envelope_for_another_proc_is_returned_not_forwarded() -> None:
    async with proc_cluster(2) as (procs, client):
        await procs[1].spawn("echo", Echo)
        # Route w[1] to w[0]'s address: w[0]'s mailbox server must refuse, not forward.
        assert procs[0].addr is not None
        client.proc.router.bind(ProcId.parse("w[1]"), procs[0].addr)
        with pytest.raises(
            DeliveryError,
            match=r"address not routable: w\[1\] is not served at .* \(this is w\[0\]\)",
        ):
            await ActorRef(ActorId.parse("w[1].echo[0]")).ping.call_one(1)


async def test_call_bounce_fails_fast() -> None:
    async with proc_cluster(2) as (_procs, _):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(DeliveryError):
            await ActorRef(ActorId.parse("w[1].missing[0]")).ping.call_one(1)
        assert loop.time() - t0 < 1.0  # a bounce, not the 30 s rpc timeout


async def test_peer_gone_fails_pending_calls_and_watch() -> None:
    class Sleepy(Actor):
        @endpoint
        async def nap(self) -> None:
            await asyncio.sleep(10)

    async with proc_cluster(2) as (procs, client):
        await procs[1].spawn("s", Sleepy)
        fut = ActorRef(ActorId.parse("w[1].s[0]")).nap.call_one()
        watch = client.proc.watch(ProcId.parse("w[1]"))
        await asyncio.sleep(0.05)

        class Notice:
            proc_id = ProcId.parse("w[1]")
            reason = "killed by signal 9 (SIGKILL)"
            exit_code = None
            exit_signal = 9
            pid = 812
            host = "node3"

        client.proc.peer_gone(Notice())  # type: ignore[arg-type]
        with pytest.raises(
            PeerGoneError, match=r"w\[1\] \(pid 812 on node3\): killed by signal 9"
        ) as ei:
            await fut
        assert ei.value.details["world"] == "w" and ei.value.details["rank"] == 1
        assert (await watch).exit_signal == 9


def test_proc_routes_to_itself_without_channels() -> None:
    async def main() -> None:
        p = Proc(ProcId.parse("solo[0]"))
        await p.spawn("echo", Echo)
        client = p.attach("client")
        from palatine.core import runtime
        from palatine.core.sender import set_default_client

        runtime.adopt_current_loop()
        set_default_client(client)
        try:
            assert await ActorRef(ActorId.parse("solo[0].echo[0]")).ping.call_one(7) == 7
        finally:
            set_default_client(None)
            runtime.release_current_loop()
            await p.stop(1.0)

    asyncio.run(main())


async def test_long_deadlines_share_one_sweep_and_still_fire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests with long timeouts are timed by one sweep per loop, not a timer each:
    they still time out (a little late, never early), and an answered request leaves
    the sweep at once."""
    import palatine.core.mailbox as mailbox_mod
    from palatine.errors import CallTimeout

    monkeypatch.setattr(mailbox_mod, "SWEPT_TIMEOUT_S", 0.2)
    monkeypatch.setattr(mailbox_mod, "SWEEP_EVERY_S", 0.05)
    loop = asyncio.get_running_loop()
    async with proc_cluster(1) as (_procs, client):
        mb = client.mailbox
        dest = ActorId.parse("w[0].nobody[0]")
        t0 = loop.time()
        late = mb.pending(dest, "call slow", 0.3)
        quick = mb.pending(dest, "call quick", 0.05)  # short: an ordinary timer
        answered = mb.pending(dest, "call answered", 0.3)
        sweep = mailbox_mod._sweeps[loop]
        assert {late.timer, answered.timer} == sweep.due and quick.timer not in sweep.due
        answered.deliver(Envelope(dest, answered.id, 0, ENC_PICKLE, pickle.dumps(7)))
        assert answered.future.result() == 7 and answered.timer not in sweep.due
        with pytest.raises(CallTimeout, match=r"call quick to w\[0\].nobody\[0\] timed out"):
            await quick.future
        with pytest.raises(
            CallTimeout, match=r"call slow to w\[0\].nobody\[0\] timed out: no reply within 0.3 s"
        ):
            await asyncio.wait_for(late.future, 5)
        # never early (up to float rounding of the loop clock); late only by the sweep
        assert 0.3 - 1e-6 <= loop.time() - t0 < 2.0
        assert not sweep.due and sweep.handle is None  # nothing left: the sweep stops
