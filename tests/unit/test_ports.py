"""Ports, channels, explicit response ports, `send` with a selection, `Accumulator`,
`Future.with_timeout`: Monarch's messaging shapes, on in-process procs."""

from __future__ import annotations

import asyncio
import operator
import time
from typing import Any

import pytest

from palatine import Accumulator, Channel, Port, send
from palatine.core.actor import Actor, context, endpoint
from palatine.errors import RemoteException
from palatine.ids import GangId
from palatine.mesh.actor_mesh import ActorMesh
from palatine.testing.procs import proc_cluster

pytestmark = pytest.mark.timeout(30)


class Queue(Actor):
    """Monarch's crawler queue shape: a ``get`` with no item parks its reply port until
    an ``insert`` answers it."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.waiters: list[Port[Any]] = []

    @endpoint
    def insert(self, item: Any) -> None:
        if self.waiters:
            self.waiters.pop(0).send(item)
        else:
            self.items.append(item)

    @endpoint(explicit_response_port=True)
    def get(self, port: Port[Any]) -> None:
        if self.items:
            port.send(self.items.pop(0))
        else:
            self.waiters.append(port)

    @endpoint(explicit_response_port=True)
    async def add(self, port: Port[int], b: int) -> int:
        port.send(3 + b)
        return -1  # dropped: the port answered

    @endpoint(explicit_response_port=True)
    def refuse(self, port: Port[int], how: str) -> None:
        if how == "send":
            port.exception(KeyError("no such key"))
        else:
            raise ValueError("raised, not sent")

    @endpoint
    def rank(self) -> int:
        return context().actor_id.rank

    @endpoint
    def report_to(self, port: Port[Any], tag: str) -> None:
        port.send((tag, context().actor_id.rank))

    @endpoint
    async def nap(self, s: float) -> float:
        await asyncio.sleep(s)
        return s


def _mesh(n: int) -> ActorMesh:
    return ActorMesh(GangId.parse("w.q"), [("procs", n)], None, Queue)


async def _spawn(procs: list[Any]) -> ActorMesh:
    for p in procs:
        await p.spawn("q", Queue)
    return _mesh(len(procs))


async def test_an_explicit_response_port_answers_the_call() -> None:
    async with proc_cluster(2) as (procs, _):
        mesh = await _spawn(procs)
        assert await mesh.slice(procs=1).add.call_one(2) == 5
        assert (await mesh.add.call(4)).values() == [7, 7]  # one port per rank


async def test_a_parked_reply_port_is_answered_by_a_later_message() -> None:
    async with proc_cluster(1) as (procs, _):
        q = (await _spawn(procs)).slice(procs=0)
        pending = q.get.call_one()
        await asyncio.sleep(0.1)
        assert not pending.done()
        q.insert.broadcast("item-1")
        assert await asyncio.wait_for(pending, 5) == "item-1"
        q.insert.broadcast("item-2")
        assert await q.get.call_one() == "item-2"


async def test_errors_through_an_explicit_port_reach_the_caller() -> None:
    async with proc_cluster(1) as (procs, _):
        q = (await _spawn(procs)).slice(procs=0)
        with pytest.raises(RemoteException) as sent:
            await q.refuse.call_one("send")
        assert sent.value.type_name == "KeyError"
        with pytest.raises(RemoteException, match="raised, not sent"):
            await q.refuse.call_one("raise")
        assert await q.rank.call_one() == 0  # the actor serves on


async def test_a_channel_receives_what_actors_send_to_its_port() -> None:
    async with proc_cluster(2) as (procs, _):
        mesh = await _spawn(procs)
        port, receiver = Channel.open()
        mesh.report_to.broadcast(port, "hello")
        got = sorted([await receiver.recv(5), await receiver.recv(5)])
        assert got == [("hello", 0), ("hello", 1)]
        with pytest.raises(TimeoutError):
            await receiver.recv(0.2)


async def test_send_with_a_port_delivers_each_reply_there_and_choose_picks_one() -> None:
    async with proc_cluster(3) as (procs, _):
        mesh = await _spawn(procs)
        port, receiver = Channel.open()
        send(mesh.rank, (), {}, port=port)
        assert sorted([await receiver.recv(5) for _ in range(3)]) == [0, 1, 2]
        send(mesh.rank, port=port, selection="choose")
        assert await receiver.recv(5) in (0, 1, 2)
        with pytest.raises(TimeoutError):
            await receiver.recv(0.3)  # "choose": exactly one
        with pytest.raises(ValueError, match="selection"):
            send(mesh.rank, selection="some")


async def test_a_port_pickles_and_a_value_sent_by_anyone_arrives() -> None:
    import pickle

    async with proc_cluster(1) as (procs, _):
        await _spawn(procs)
        port, receiver = Channel.open()
        again = pickle.loads(pickle.dumps(port))
        again.send({"from": "the test"})
        again.exception(RuntimeError("bad"))
        assert await receiver.recv(5) == {"from": "the test"}
        with pytest.raises(RemoteException, match="bad"):
            await receiver.recv(5)


async def test_an_accumulator_folds_the_replies_in_rank_order() -> None:
    async with proc_cluster(3) as (procs, _):
        mesh = await _spawn(procs)
        assert await Accumulator(mesh.rank, 0, operator.add).accumulate() == 3
        digits = Accumulator(mesh.rank, "", lambda acc, r: acc + str(r))
        assert await digits.accumulate() == "012"


async def test_with_timeout_gives_up_waiting_but_not_the_call() -> None:
    async with proc_cluster(1) as (procs, _):
        q = (await _spawn(procs)).slice(procs=0)
        t0 = time.monotonic()
        slow = q.nap.call_one(1.0)
        with pytest.raises(TimeoutError, match=r"no result within 0\.2 s"):
            await slow.with_timeout(0.2)
        assert time.monotonic() - t0 < 0.9
        assert await slow == 1.0
        assert await q.nap.call_one(0.0).with_timeout(5) == 0.0
