"""Actors and procs on in-process local channels."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import pytest

from palatine import config
from palatine.core.actor import Actor, SupervisionEvent, endpoint, handler
from palatine.core.supervision_hook import set_unhandled_fault_hook
from palatine.errors import ConfigError, DeliveryError, RemoteException, SpawnError
from palatine.ids import ActorId
from palatine.mesh.actor_mesh import ActorMesh, ActorRef
from palatine.testing.procs import proc_cluster
from palatine.wire.codec import Message

if TYPE_CHECKING:
    from collections.abc import Sized as CheckerOnly  # a name that is unbound at run time

pytestmark = pytest.mark.timeout(30)


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start
        self.inited = False

    async def init(self) -> None:
        self.inited = True

    @endpoint
    async def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def was_inited(self) -> bool:
        return self.inited

    @endpoint
    def boom(self) -> None:
        raise ValueError("nope")

    @endpoint
    def exit(self) -> None:
        raise SystemExit(3)

    @endpoint
    async def sleep(self, s: float) -> str:
        await asyncio.sleep(s)
        return "slept"

    @endpoint
    async def call_self(self) -> int:
        me = ActorRef(self.cx.actor_id, Counter)
        return await me.incr.call_one(1)


class BadInit(Actor):
    async def init(self) -> None:
        raise RuntimeError("no init for you")


async def test_status_walk_and_init_before_first_message() -> None:
    async with proc_cluster(1) as (procs, _client):
        p = procs[0]
        aid = await p.spawn("c", Counter)
        inst = p.instance(aid)
        assert inst is not None and inst.status == "idle"
        ref = ActorRef(aid, Counter)
        assert await ref.was_inited.call_one() is True
        fut = ref.sleep.call_one(0.3)
        await asyncio.sleep(0.1)
        assert inst.status.startswith("sleep: processing for ")
        assert await fut == "slept"
        assert inst.status == "idle"
        seen = []
        inst.request_stop("drain", "test")
        assert inst.status == "idle" or inst.status == "stopping"
        seen.append(await inst.terminal)
        assert seen == ["stopped"]


async def test_init_failure_fails_spawn_and_frees_nothing_else() -> None:
    async with proc_cluster(1) as (procs, _):
        with pytest.raises(
            SpawnError, match=r"failed|initialization error: RuntimeError: no init for you"
        ):
            await procs[0].spawn("b", BadInit)
        # the failed status text
        try:
            await procs[0].spawn("b2", BadInit)
        except SpawnError as e:
            assert (
                str(e) == "serving w[0].b2[0]: initialization error: RuntimeError: no init for you"
            )


async def test_endpoint_error_is_remote_exception_and_actor_keeps_serving() -> None:
    async with proc_cluster(2) as (procs, _):
        aid = await procs[1].spawn("c", Counter, 5)
        ref = ActorRef(aid, Counter)
        with pytest.raises(RemoteException) as ei:
            await ref.boom.call_one()
        assert ei.value.type_name == "ValueError"
        assert ei.value.message == "nope"
        assert "raise ValueError" in ei.value.traceback
        assert procs[1].instance(aid).status == "idle"  # type: ignore[union-attr]
        assert await ref.incr.call_one(2) == 7


async def test_broadcast_error_fails_actor_and_reaches_coordinator() -> None:
    async with proc_cluster(2) as (procs, _):
        events: list[SupervisionEvent] = []
        procs[1].set_supervision_coordinator(events.append)
        aid = await procs[1].spawn("c", Counter)
        mesh = ActorMesh(
            aid.proc.world.proc(1).actor("c").proc.world and ActorRef(aid)._as_mesh().gang,
            [("procs", 2)],
            [1],
            Counter,
        )
        assert mesh.boom.broadcast() is None
        inst = procs[1].instance(aid)
        while not events:
            await asyncio.sleep(0.01)
        assert events[0].actor_id == "w[1].c[0]"
        assert events[0].message == "serving w[1].c[0]: processing error: ValueError: nope"
        assert "raise ValueError" in events[0].traceback
        assert (
            inst is not None
            and inst.status == "failed: serving w[1].c[0]: processing error: ValueError: nope"
        )


async def test_system_exit_is_a_panic() -> None:
    async with proc_cluster(1) as (procs, _):
        events: list[SupervisionEvent] = []
        procs[0].set_supervision_coordinator(events.append)
        aid = await procs[0].spawn("c", Counter)
        with pytest.raises(RemoteException, match="actor failed"):
            await ActorRef(aid, Counter).exit.call_one()
        while not events:
            await asyncio.sleep(0.01)
        assert events[0].message.startswith("serving w[0].c[0]: panic: SystemExit: 3")
        assert "SystemExit" in events[0].traceback


async def test_bare_proc_root_failure_calls_unhandled_fault_hook() -> None:
    got: list[SupervisionEvent] = []
    set_unhandled_fault_hook(got.append)
    try:
        async with proc_cluster(1) as (procs, _):
            aid = await procs[0].spawn("c", Counter)
            ActorRef(aid, Counter).boom.broadcast()
            while not got:
                await asyncio.sleep(0.01)
            assert got[0].actor_id == "w[0].c[0]"
    finally:
        set_unhandled_fault_hook(None)


class Slow(Actor):
    def __init__(self) -> None:
        self.handled: list[int] = []

    @endpoint
    async def work(self, i: int) -> int:
        await asyncio.sleep(0.01)
        self.handled.append(i)
        return i


async def test_drain_and_stop_processes_queued_and_returns_later() -> None:
    async with proc_cluster(1) as (procs, _):
        aid = await procs[0].spawn("s", Slow)
        ref = ActorRef(aid, Slow)
        futs = [ref.work.call_one(i) for i in range(10)]
        await asyncio.sleep(0)  # let the posts happen
        inst = procs[0].instance(aid)
        assert inst is not None
        inst.request_stop("drain", "test")
        late = ref.work.call_one(99)
        assert [await f for f in futs] == list(range(10))
        with pytest.raises(
            DeliveryError, match=r"mailbox error: actor w\[0\].s\[0\] is (stopping|stopped)"
        ):
            await late
        assert await inst.terminal == "stopped"


async def test_stop_returns_queued_and_callers_fail_at_once() -> None:
    async with proc_cluster(1) as (procs, _):
        aid = await procs[0].spawn("s", Slow)
        ref = ActorRef(aid, Slow)
        first = ref.work.call_one(0)
        queued = [ref.work.call_one(i) for i in range(1, 5)]
        await asyncio.sleep(0.001)
        inst = procs[0].instance(aid)
        assert inst is not None
        inst.request_stop("stop", "test")
        assert await first == 0  # the running handler completes
        for f in queued:
            with pytest.raises(DeliveryError, match="is stopped"):
                await f
        assert await inst.terminal == "stopped"


class Parent(Actor):
    def __init__(self, handle: bool = False) -> None:
        self.handle = handle
        self.kids: list[ActorId] = []

    @endpoint
    async def make(self) -> list[str]:
        c1 = await self.cx.spawn(Child)
        c2 = await self.cx.spawn(Child)
        self.kids = [c1, c2]
        return [str(c1), str(c2)]

    @endpoint
    def fail_child(self) -> None:
        ActorRef(self.kids[0], Child).boom.broadcast()

    def handle_supervision_event(self, event: SupervisionEvent) -> bool:
        return self.handle


class Child(Actor):
    @endpoint
    def boom(self) -> None:
        raise KeyError("child broke")

    @endpoint
    async def grandchild(self) -> str:
        return str(await self.cx.spawn(Child))


async def test_children_ids_and_stop_cascades() -> None:
    async with proc_cluster(1) as (procs, _):
        p = procs[0]
        aid = await p.spawn("first", Parent)
        kids = await ActorRef(aid, Parent).make.call_one()
        assert kids == ["w[0].first[1]", "w[0].first[2]"]
        gc = await ActorRef(ActorId.parse(kids[0]), Child).grandchild.call_one()
        assert gc == "w[0].first[3]"
        insts = [p.instance(ActorId.parse(x)) for x in [str(aid), *kids, gc]]
        p.instance(aid).request_stop("drain", "test")  # type: ignore[union-attr]
        assert [await i.terminal for i in insts] == ["stopped"] * 4  # type: ignore[union-attr]
        with pytest.raises(DeliveryError, match="is stopped"):
            await ActorRef(ActorId.parse(kids[1]), Child).grandchild.call_one()


async def test_unhandled_child_failure_fails_parent_with_cause() -> None:
    async with proc_cluster(1) as (procs, _):
        events: list[SupervisionEvent] = []
        p = procs[0]
        p.set_supervision_coordinator(events.append)
        aid = await p.spawn("first", Parent)
        kids = await ActorRef(aid, Parent).make.call_one()
        await ActorRef(aid, Parent).fail_child.call_one()
        parent = p.instance(aid)
        other = p.instance(ActorId.parse(kids[1]))
        assert parent is not None and other is not None
        status = await parent.terminal
        assert status.startswith("failed: did not handle supervision event from w[0].first[1]: ")
        assert "KeyError" in status
        assert await other.terminal == "stopped"
        assert events[0].caused_by is not None
        assert events[0].caused_by.actor_id == "w[0].first[1]"


async def test_handled_child_failure_keeps_parent_idle() -> None:
    async with proc_cluster(1) as (procs, _):
        p = procs[0]
        aid = await p.spawn("first", Parent, True)
        await ActorRef(aid, Parent).make.call_one()
        await ActorRef(aid, Parent).fail_child.call_one()
        child = p.instance(ActorId.parse("w[0].first[1]"))
        if child is not None:
            await child.terminal
        await asyncio.sleep(0.05)
        assert p.instance(aid).status == "idle"  # type: ignore[union-attr]


async def test_spawn_names() -> None:
    async with proc_cluster(1) as (procs, _):
        p = procs[0]
        await p.spawn_by_type(f"{__name__}.Counter", "c")
        with pytest.raises(SpawnError, match=r"actor type 'x' is not registered in w\[0\]"):
            await p.spawn_by_type("x", "c2")
        with pytest.raises(SpawnError, match=r"an actor named 'c' already exists in w\[0\]"):
            await p.spawn("c", Counter)
        with pytest.raises(SpawnError, match="constructor error"):
            await p.spawn("d", Counter, "not", "valid", "args")
        await p.spawn("d", Counter)  # the name is free again
        with pytest.raises(SpawnError, match="reserved"):
            await p.spawn("proc", Counter)


async def test_proc_stop_aborts_busy_actors_in_time() -> None:
    async with proc_cluster(1) as (procs, _):
        p = procs[0]
        ids = [await p.spawn(f"s{i}", Slow) for i in range(4)]
        idle_stop = await p.stop(1.0)
        assert sorted(idle_stop[0]) == sorted(ids) and idle_stop[1] == []
    async with proc_cluster(1) as (procs, _):
        p = procs[0]
        ids = [await p.spawn(f"s{i}", Counter) for i in range(4)]
        busy = [ActorRef(i, Counter).sleep.call_one(5.0) for i in ids[:3]]
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        stopped, aborted = await p.stop(1.0)
        took = loop.time() - t0
        assert sorted(aborted) == sorted(ids[:3])
        assert stopped == [ids[3]]
        assert took < 2.0
        for f in busy:
            with pytest.raises(RemoteException, match="aborted"):
                await f


async def test_ledger_snapshot() -> None:
    async with proc_cluster(1) as (procs, _):
        p = procs[0]
        aid = await p.spawn("first", Parent)
        await ActorRef(aid, Parent).make.call_one()
        snap = p.snapshot()
        entry = snap["w[0].first[0]"]
        assert entry.processed == 1
        assert set(entry.children) == {"w[0].first[1]", "w[0].first[2]"}
        p.instance(aid).request_stop("drain", "x")  # type: ignore[union-attr]
        await p.instance(aid).terminal  # type: ignore[union-attr]
        assert "w[0].first[0]" not in p.snapshot()


async def test_self_call_raises_runtime_error() -> None:
    async with proc_cluster(1) as (procs, _):
        aid = await procs[0].spawn("c", Counter)
        with pytest.raises(RemoteException, match="RuntimeError"):
            await ActorRef(aid, Counter).call_self.call_one()


async def test_mesh_call_stream_broadcast() -> None:
    async with proc_cluster(4) as (procs, _):
        for p in procs:
            await p.spawn("counter", Counter)
        from palatine.ids import GangId

        mesh = ActorMesh(GangId.parse("w.counter"), [("procs", 4)], None, Counter)
        vm = await mesh.incr.call(1)
        assert vm.values() == [1, 1, 1, 1]
        assert [c for c, _ in vm.items()] == [{"procs": i} for i in range(4)]
        assert await mesh.slice(procs=2).incr.call_one(1) == 2
        assert mesh.incr.broadcast(10) is None
        got = sorted(await _collect(mesh.incr.stream(0)))
        assert got == [(0, 11), (1, 11), (2, 12), (3, 11)]
        items = await _collect(mesh.slice(procs=slice(0, 2)).boom.stream())
        assert sorted(r for r, _ in items) == [0, 1]
        assert all(isinstance(v, RemoteException) for _, v in items)


async def _collect(stream: object) -> list[tuple[int, object]]:
    return [x async for x in stream]  # type: ignore[attr-defined]


class Ping(Message, kw_only=True):
    i: int


class Pong(Message, kw_only=True):
    i: int


class Typed(Actor):
    def __init__(self) -> None:
        self.seen: list[str] = []

    @handler
    def on_ping(self, msg: Ping) -> Pong:
        self.seen.append(f"ping{msg.i}")
        return Pong(i=msg.i)

    @handler
    def on_pong(self, msg: Pong) -> None:
        self.seen.append(f"pong{msg.i}")

    @endpoint
    def log(self) -> list[str]:
        return self.seen


async def test_typed_messages_in_send_order_across_procs() -> None:
    async with proc_cluster(2) as (procs, _):
        aid = await procs[1].spawn("t", Typed)
        ref = ActorRef(aid, Typed)
        for i in range(1000):
            ref.tell(Ping(i=i) if i % 2 == 0 else Pong(i=i))
        reply = await ref.ask(Ping(i=-1))
        assert reply == Pong(i=-1)
        seen = await ref.log.call_one()
        assert seen[:1000] == [f"ping{i}" if i % 2 == 0 else f"pong{i}" for i in range(1000)]


class Unhandled(Message, kw_only=True):
    i: int


async def test_a_message_sent_to_a_handler_port_of_another_type_is_refused_and_the_actor_serves_on() -> (
    None
):
    # A peer may address any port with any type id: the port refuses a type its actor
    # has no handler for (before decoding it), and the sender hears why.
    from palatine.core.actor import ENDPOINT_CALL_TID
    from palatine.core.instance import UNDELIVERABLE_TID
    from palatine.ids import PortId
    from palatine.wire.codec import encode_message
    from palatine.wire.envelope import ENC_MSGPACK, Envelope

    async with proc_cluster(2) as (procs, client):
        aid = await procs[1].spawn("t", Typed)
        ref = ActorRef(aid, Typed)
        mb = client.mailbox
        ping_tid = Ping.__palatine_type_id__
        for port, msg in [
            (ping_tid, Unhandled(i=1)),  # no handler for it
            (UNDELIVERABLE_TID, Ping(i=2)),  # not an Undeliverable
            (ENDPOINT_CALL_TID, Ping(i=3)),  # not an endpoint call
        ]:
            p = mb.pending(aid, "raw", 5.0)
            tid = type(msg).__palatine_type_id__
            mb.proc.post(
                Envelope(
                    mb.actor_id, PortId(aid, port), tid, ENC_MSGPACK, encode_message(msg), p.id
                )
            )
            with pytest.raises(DeliveryError, match=f"takes .*, not {type(msg).__name__}"):
                await p.future
        # Another handler's port takes a type the actor handles (dispatch is by type).
        p = mb.pending(aid, "raw", 5.0)
        mb.proc.post(
            Envelope(
                mb.actor_id,
                PortId(aid, Pong.__palatine_type_id__),
                ping_tid,
                ENC_MSGPACK,
                encode_message(Ping(i=4)),
                p.id,
            )
        )
        assert await p.future == Pong(i=4)
        assert await ref.log.call_one() == ["ping4"]


class PongCounting:
    """A handler mixin whose ``self`` names a type only the type checker imports."""

    pongs: int

    @handler
    def on_pong(self: CheckerOnly, msg: Pong) -> None:
        self.pongs += 1  # type: ignore[attr-defined]


class TypedByMixin(PongCounting, Actor):
    def __init__(self) -> None:
        self.pongs = 0

    @endpoint
    def count(self) -> int:
        return self.pongs


async def test_handlers_from_a_mixin_resolve_only_their_message_type() -> None:
    async with proc_cluster(2) as (procs, _):
        aid = await procs[1].spawn("m", TypedByMixin)
        ref = ActorRef(aid, TypedByMixin)
        for i in range(3):
            ref.tell(Pong(i=i))
        assert await ref.count.call_one() == 3


async def test_ask_never_answered_times_out_without_leftovers() -> None:
    async with proc_cluster(2) as (procs, client):
        aid = await procs[1].spawn("t", Typed)
        with config.override(rpc_timeout_s=0.5):
            fut = ActorRef(aid, Typed).ask(Pong(i=1))  # on_pong returns None: no reply
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            from palatine.errors import CallTimeout

            with pytest.raises(CallTimeout, match=r"Pong to w\[1\].t\[0\] timed out"):
                await fut
            assert 0.45 < loop.time() - t0 < 1.5
        assert not [p for p in client.mailbox.ports if 1024 <= p < 2**63]


async def test_call_to_missing_actor_fails_fast() -> None:
    async with proc_cluster(2) as (_procs, _):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(
            DeliveryError, match=r"mailbox error: no actor w\[1\].nobody\[0\] in w\[1\]"
        ):
            await ActorRef(ActorId.parse("w[1].nobody[0]"), Counter).incr.call_one()
        assert loop.time() - t0 < 1.0  # a bounce, not the 30 s rpc timeout


async def test_rpc_timeout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PALATINE_RPC_TIMEOUT", "0.25")
    assert config.from_env().rpc_timeout_s == 0.25
    monkeypatch.setenv("PALATINE_RPC_TIMEOUT", "abc")
    with pytest.raises(ConfigError, match="PALATINE_RPC_TIMEOUT: expected seconds > 0, got 'abc'"):
        config.from_env()


class Noisy(Actor):
    def __init__(self, raise_on_return: bool = False) -> None:
        self.raise_on_return = raise_on_return
        self.returned: list[str] = []

    @endpoint
    def send_to_nobody(self) -> None:
        ActorRef(ActorId.parse("w[1].ghost[0]")).anything.broadcast()

    def handle_undeliverable(self, returned: object) -> None:
        if self.raise_on_return:
            raise RuntimeError("can't cope")
        super().handle_undeliverable(returned)  # type: ignore[arg-type]


async def test_undeliverable_hook_default_and_override(caplog: pytest.LogCaptureFixture) -> None:
    async with proc_cluster(2) as (procs, _):
        aid = await procs[0].spawn("n", Noisy)
        with caplog.at_level(logging.WARNING):
            await ActorRef(aid, Noisy).send_to_nobody.call_one()
            for _ in range(100):
                if any("undeliverable" in r.message for r in caplog.records):
                    break
                await asyncio.sleep(0.01)
        assert any("w[1].ghost[0]" in r.message for r in caplog.records)
        assert procs[0].instance(aid).status == "idle"  # type: ignore[union-attr]
        events: list[SupervisionEvent] = []
        procs[0].set_supervision_coordinator(events.append)
        bid = await procs[0].spawn("m", Noisy, True)
        await ActorRef(bid, Noisy).send_to_nobody.call_one()
        status = await procs[0].instance(bid).terminal  # type: ignore[union-attr]
        assert status.startswith(
            "failed: serving w[0].m[0]: processing error: a message from w[0].m[0] to "
        )
        assert (
            "was undeliverable and returned: mailbox error: no actor w[1].ghost[0] in w[1]"
            in status
        )


class CancelsItself(Actor):
    @endpoint
    def cancel(self) -> None:
        raise asyncio.CancelledError()

    @endpoint
    def ok(self) -> int:
        return 1


async def test_a_plain_endpoint_raising_cancelled_error_fails_only_its_actor() -> None:
    async with proc_cluster(2) as (procs, _):
        events: list[SupervisionEvent] = []
        procs[1].set_supervision_coordinator(events.append)
        bad = await procs[1].spawn("bad", CancelsItself)
        good = await procs[1].spawn("good", CancelsItself)
        ActorRef(bad, CancelsItself).cancel.broadcast()
        while not events:
            await asyncio.sleep(0.01)
        assert events[0].message.startswith("serving w[1].bad[0]: panic: CancelledError")
        # The connection that carried it still serves the proc's other actors.
        assert await ActorRef(good, CancelsItself).ok.call_one() == 1


class KnowsItself(Actor):
    """Records, in its constructor, what `context()` and `current_rank()` say."""

    def __init__(self) -> None:
        from palatine.core.actor import context, current_rank

        self.seen = (str(context().actor_id), dict(current_rank()))

    @endpoint
    def seen_in_init(self) -> tuple[str, dict[str, int]]:
        return self.seen


async def test_an_actors_constructor_sees_its_own_context_and_rank() -> None:
    async with proc_cluster(1) as (procs, _):
        p = procs[0]
        aid = await p.spawn("k", KnowsItself, _rank={"hosts": 1, "gpus": 3})
        got = await ActorRef(aid, KnowsItself).seen_in_init.call_one()
        assert got == (str(aid), {"hosts": 1, "gpus": 3})


class InitEndpoint(Actor):
    """A user endpoint named ``init`` (Monarch actors may have one): not a lifecycle hook."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    @endpoint
    async def init(self, x: int = 0) -> list[int]:
        self.calls.append(x)
        return self.calls


async def test_an_endpoint_named_init_runs_only_when_called() -> None:
    async with proc_cluster(1) as (procs, _):
        aid = await procs[0].spawn("i", InitEndpoint)
        assert await ActorRef(aid, InitEndpoint).init.call_one(7) == [7]


class StreamReader(Actor):
    """Iterates another mesh's stream synchronously, from its own (loop) thread."""

    @endpoint
    async def read(self, mesh: ActorMesh) -> str:
        try:
            for _ in mesh.sleep.stream(5.0):
                pass
        except RuntimeError as e:
            return str(e)
        return "no error"


async def test_iterating_a_stream_synchronously_on_the_loop_fails_at_once() -> None:
    from palatine.core.future import LOOP_THREAD_ERROR
    from palatine.ids import GangId

    async with proc_cluster(2) as (procs, _):
        await procs[0].spawn("counter", Counter)
        reader = await procs[1].spawn("reader", StreamReader)
        mesh = ActorMesh(GangId.parse("w.counter"), [("procs", 1)], None, Counter)
        t0 = asyncio.get_running_loop().time()
        got = await ActorRef(reader, StreamReader).read.call_one(mesh)
        assert got == LOOP_THREAD_ERROR
        assert asyncio.get_running_loop().time() - t0 < 1.0  # not the sleep, not the timeout


async def test_a_call_to_an_actor_that_failed_says_why_it_failed() -> None:
    async with proc_cluster(1) as (procs, _):
        procs[0].set_supervision_coordinator(lambda event: None)  # (handled: no panic)
        aid = await procs[0].spawn("c", Counter)
        ref = ActorRef(aid, Counter)
        inst = procs[0].instance(aid)
        assert inst is not None
        with pytest.raises(RemoteException, match="actor failed"):
            await ref.exit.call_one()
        await inst.terminal
        with pytest.raises(DeliveryError) as ei:
            await ref.incr.call_one(1)
        text = str(ei.value)
        assert f"actor {aid} is stopped: it failed: " in text, text
        assert "SystemExit" in text, text
