"""Casting through the fan-out tree: tree shape, delivery, per-sender FIFO."""

from __future__ import annotations

import pytest

from palatine.core.actor import Actor, endpoint
from palatine.core.comm import CommActor, split_blocks
from palatine.ids import GangId
from palatine.mesh.actor_mesh import ActorMesh
from palatine.testing.procs import proc_cluster

pytestmark = pytest.mark.timeout(60)


def test_split_blocks_near_equal_larger_first() -> None:
    assert split_blocks(0, 12, 8) == [
        (0, 2),
        (2, 4),
        (4, 6),
        (6, 8),
        (8, 9),
        (9, 10),
        (10, 11),
        (11, 12),
    ]
    assert split_blocks(1, 4, 8) == [(1, 2), (2, 3), (3, 4)]
    assert split_blocks(0, 100, 8)[0] == (0, 13) and len(split_blocks(0, 100, 8)) == 8
    assert split_blocks(5, 5, 8) == []


class Recorder(Actor):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    @endpoint
    def note(self, origin: str, i: int) -> int:
        from palatine.core.actor import context

        self.seen.append((origin, i))
        return int(context().headers["cast_rank"])

    @endpoint
    def log(self) -> list[tuple[str, int]]:
        return self.seen


async def test_cast_to_20_ranks_through_comm_actors_keeps_sender_order() -> None:
    n = 20
    async with proc_cluster(n) as (procs, _client):
        for p in procs:
            await p.spawn_instance("comm", CommActor(), internal=True)
            await p.spawn("rec", Recorder)
        mesh = ActorMesh(GangId.parse("w.rec"), [("procs", n)], None, Recorder)
        vm = await mesh.note.call("a", -1)
        assert vm.values() == list(range(n))  # each reply carries its cast rank
        for i in range(200):
            mesh.note.broadcast("a", i)
        sub = mesh.slice(procs=slice(9, 20, 3))
        assert (await sub.note.call("b", 0)).values() == [9, 12, 15, 18]
        logs = (await mesh.log.call()).values()
        for r, seen in enumerate(logs):
            mine = [i for o, i in seen if o == "a"]
            assert mine == [-1, *range(200)], f"rank {r} saw {mine[:5]}..."
        # Ranks behind a forwarding hop (block heads) really went through comm actors.
        comm = procs[3].instance(procs[3].proc_id.actor("comm"))  # head of block [3, 6)
        assert comm is not None and comm.processed > 0
