"""An actor's object lives as long as the actor: made by a constructor that may wait on
palatine calls, released (``__del__`` runs) as soon as the actor stops."""

from __future__ import annotations

import gc

import pytest

from palatine.core.actor import Actor, endpoint
from palatine.errors import SpawnError
from palatine.mesh.actor_mesh import ActorRef
from palatine.testing.procs import proc_cluster

pytestmark = pytest.mark.timeout(30)

finalized: list[str] = []


class Mortal(Actor):
    def __init__(self, tag: str) -> None:
        self.tag = tag

    @endpoint
    def ping(self) -> str:
        return self.tag

    @endpoint
    async def aping(self) -> str:
        return self.tag

    def __del__(self) -> None:
        finalized.append(self.tag)


class Asker(Actor):
    """Its constructor blocks on a call to another actor (the loop serves meanwhile)."""

    def __init__(self, other: ActorRef) -> None:
        self.answer = other.ping.call_one().get(timeout=10)

    @endpoint
    def answer_was(self) -> str:
        return str(self.answer)


class NeedsArgs(Actor):
    def __init__(self, x: int) -> None:
        self.x = x


async def test_an_actors_object_is_released_when_it_stops_without_waiting_for_gc() -> None:
    gc.disable()  # no cycle collection: only what still refers to the actor keeps it
    try:
        async with proc_cluster(1) as (procs, _):
            p = procs[0]
            aid = await p.spawn("m", Mortal, "m")
            ref = ActorRef(aid, Mortal)
            assert await ref.ping.call_one() == "m"  # a plain def endpoint (a greenlet)
            assert await ref.aping.call_one() == "m"
            inst = p.instance(aid)
            assert inst is not None
            inst.request_stop("drain", "test")
            assert await inst.terminal == "stopped"
            del inst
            assert finalized == ["m"]
    finally:
        gc.enable()


async def test_a_constructor_waits_on_a_call_while_its_proc_serves_on() -> None:
    async with proc_cluster(1) as (procs, _):
        p = procs[0]
        other = ActorRef(await p.spawn("other", Mortal, "answered"), Mortal)
        asker = ActorRef(await p.spawn("asker", Asker, other), Asker)
        assert await asker.answer_was.call_one() == "answered"


async def test_a_constructor_error_fails_the_spawn_and_frees_the_name() -> None:
    async with proc_cluster(1) as (procs, _):
        p = procs[0]
        with pytest.raises(SpawnError, match=r"w\[0\]\.n\[0\]: constructor error: TypeError"):
            await p.spawn("n", NeedsArgs)
        aid = await p.spawn("n", NeedsArgs, 1)
        assert p.instance(aid) is not None
