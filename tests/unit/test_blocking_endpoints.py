"""Blocking palatine calls inside synchronous endpoints (`palatine.core.suspend`): the
endpoint waits, its proc's loop serves on."""

from __future__ import annotations

import asyncio
import time

import pytest

from palatine.core.actor import Actor, context, endpoint
from palatine.errors import RemoteException
from palatine.ids import GangId
from palatine.mesh.actor_mesh import ActorMesh, ActorRef
from palatine.testing.procs import proc_cluster

pytestmark = pytest.mark.timeout(30)


class Adder(Actor):
    def __init__(self) -> None:
        self.calls = 0

    @endpoint
    def add(self, x: int) -> int:
        self.calls += 1
        return x + 1

    @endpoint
    async def nap(self, s: float) -> float:
        await asyncio.sleep(s)
        return s


class Caller(Actor):
    """Plain ``def`` endpoints that wait on other actors, as a Monarch program writes them."""

    def __init__(self, other: ActorRef) -> None:
        self.other = other
        self.log: list[str] = []

    @endpoint
    def chain(self, x: int) -> tuple[int, int, str]:
        a = self.other.add.call_one(x).get()
        b = self.other.add.call_one(a).get()
        return a, b, str(context().actor_id)  # still this actor's context after the waits

    @endpoint
    def gather(self, mesh: ActorMesh) -> list[int]:
        return sorted(v for _, v in mesh.add.stream(10))

    @endpoint
    def wait_briefly(self, s: float) -> str:
        try:
            self.other.nap.call_one(s).get(timeout=0.2)
        except TimeoutError as e:
            return f"TimeoutError: {e}"
        return "no timeout"

    @endpoint
    def slow_then_note(self, s: float, note: str) -> None:
        self.other.nap.call_one(s).get()
        self.log.append(note)

    @endpoint
    def note(self, note: str) -> list[str]:
        self.log.append(note)
        return list(self.log)

    @endpoint
    def fails_after_wait(self) -> None:
        self.other.add.call_one(1).get()
        raise ValueError("after the wait")


async def _pair(procs: list, same_proc: bool) -> tuple[ActorRef, ActorRef]:
    adder = await procs[0].spawn("adder", Adder)
    caller_proc = procs[0] if same_proc else procs[1]
    caller = await caller_proc.spawn("caller", Caller, ActorRef(adder, Adder))
    return ActorRef(adder, Adder), ActorRef(caller, Caller)


@pytest.mark.parametrize("same_proc", [False, True], ids=["other_proc", "same_proc"])
async def test_a_plain_endpoint_waits_on_another_actor_with_get(same_proc: bool) -> None:
    # In the same proc the callee runs on the very loop the caller waits on: a wait that
    # blocked the loop would deadlock until the call timeout.
    async with proc_cluster(2) as (procs, _):
        _adder, caller = await _pair(procs, same_proc)
        a, b, me = await asyncio.wait_for(caller.chain.call_one(5), 5)
        assert (a, b) == (6, 7)
        assert me == str(caller.actor_id)


async def test_a_plain_endpoint_iterates_a_stream_synchronously() -> None:
    async with proc_cluster(2) as (procs, _):
        for p in procs:
            await p.spawn("adder", Adder)
        caller = ActorRef(await procs[1].spawn("caller", Caller, None), Caller)
        mesh = ActorMesh(GangId.parse("w.adder"), [("procs", 2)], None, Adder)
        assert await asyncio.wait_for(caller.gather.call_one(mesh), 5) == [11, 11]


async def test_a_wait_with_a_timeout_raises_timeout_error_and_the_actor_serves_on() -> None:
    async with proc_cluster(2) as (procs, _):
        _adder, caller = await _pair(procs, False)
        t0 = time.monotonic()
        got = await caller.wait_briefly.call_one(3.0)
        assert got == "TimeoutError: no result within 0.2 s"
        assert time.monotonic() - t0 < 2.0
        assert await caller.note.call_one("later") == ["later"]


async def test_messages_to_a_waiting_actor_run_after_its_endpoint_returns() -> None:
    # One message at a time, as with Monarch's actor thread: the second call waits for
    # the first one's endpoint to finish, though the loop serves others meanwhile.
    async with proc_cluster(2) as (procs, _):
        adder, caller = await _pair(procs, False)
        first = caller.slow_then_note.call_one(0.5, "first")
        await asyncio.sleep(0.1)
        assert await adder.add.call_one(1) == 2  # the callee's proc is not blocked
        second = await caller.note.call_one("second")
        await first
        assert second == ["first", "second"]


async def test_an_error_raised_after_a_wait_reaches_the_caller_and_the_actor_serves_on() -> None:

    async with proc_cluster(2) as (procs, _):
        _adder, caller = await _pair(procs, False)
        with pytest.raises(RemoteException, match="after the wait"):
            await caller.fails_after_wait.call_one()
        assert await caller.note.call_one("ok") == ["ok"]


async def test_stopping_an_actor_that_waits_fails_its_pending_call() -> None:
    async with proc_cluster(2) as (procs, _):
        _adder, caller = await _pair(procs, False)
        pending = caller.slow_then_note.call_one(10.0, "never")
        await asyncio.sleep(0.2)
        inst = procs[1].instance(caller.actor_id)
        assert inst is not None and inst.status.startswith("slow_then_note: processing")
        inst.request_stop("abort", "test")
        with pytest.raises(RemoteException, match="was aborted: test"):
            await asyncio.wait_for(pending, 5)


class Aborts(Actor):
    """Monarch's lifecycle hooks: ``abort`` from a handler, ``__cleanup__`` at the end."""

    cleaned: list[str] = []

    @endpoint
    def give_up(self, why: str) -> None:
        context().abort(why)

    @endpoint
    async def give_up_later(self, why: str) -> None:
        await asyncio.sleep(0)
        context().abort(why)

    @endpoint
    def ok(self) -> str:
        return "ok"

    async def __cleanup__(self, exc: Exception | None) -> None:
        Aborts.cleaned.append("none" if exc is None else f"{type(exc).__name__}: {exc}")


@pytest.mark.parametrize("method", ["give_up", "give_up_later"])
async def test_abort_fails_the_actor_and_cleanup_sees_why(method: str) -> None:
    from palatine.core.actor import SupervisionEvent

    Aborts.cleaned = []
    async with proc_cluster(1) as (procs, _):
        seen: list[SupervisionEvent] = []
        procs[0].set_supervision_coordinator(seen.append)
        ref = ActorRef(await procs[0].spawn("a", Aborts), Aborts)
        inst = procs[0].instance(ref.actor_id)
        assert inst is not None
        with pytest.raises(RemoteException, match="aborted: enough") as ei:
            await getattr(ref, method).call_one("enough")
        assert ei.value.type_name == "ActorAborted"
        await asyncio.wait_for(inst.terminal, 5)
        assert inst.status.startswith("failed: ") and "aborted: enough" in inst.status
        assert [e.actor_id for e in seen] == [str(ref.actor_id)]
        assert Aborts.cleaned == [f"ActorAborted: serving {ref.actor_id}: aborted: enough"]


async def test_cleanup_runs_with_none_when_an_actor_stops_cleanly() -> None:
    Aborts.cleaned = []
    async with proc_cluster(1) as (procs, _):
        ref = ActorRef(await procs[0].spawn("a", Aborts), Aborts)
        inst = procs[0].instance(ref.actor_id)
        assert inst is not None
        assert await ref.ok.call_one() == "ok"
        inst.request_stop("drain", "done")
        await asyncio.wait_for(inst.terminal, 5)
        assert Aborts.cleaned == ["none"]
