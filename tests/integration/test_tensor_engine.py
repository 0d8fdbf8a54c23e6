"""Actors and mesh tensors in the same procs: `palatine.spawn_tensor_engine` and
`ProcMesh.activate()` on a real actor proc mesh (`this_host().spawn_procs`)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest
import torch

import palatine
from palatine import Actor, endpoint, inspect, remote, this_host

pytestmark = pytest.mark.timeout(180)

cloudpickle.register_pickle_by_value(__import__("sys").modules[__name__])


class Holder(Actor):
    """Reads and writes the shard of a mesh tensor it is given."""

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def total(self, t: Any) -> float:
        assert type(t) is torch.Tensor  # the proc's own shard, a plain tensor
        return float(t.sum())

    @endpoint
    def double(self, t: Any) -> None:
        t.mul_(2)


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        yield pm
    finally:
        pm.stop().get()


def test_torch_ops_under_a_proc_mesh_run_in_the_procs_of_its_actors(procs: Any) -> None:
    actors = procs.spawn("holder", Holder)
    actor_pids = list(actors.pid.call().get().values())
    with procs.activate():
        mesh = palatine.get_active_mesh()
        assert mesh.names == ["gpus"] and mesh.sizes == [2]
        x = torch.ones(3) * (mesh.rank("gpus") + 1)
        assert inspect(x, gpus=1).tolist() == [2.0, 2.0, 2.0]
        worker_pids = [palatine.fetch(remote(os.getpid)(), shard=i).result() for i in (0, 1)]
    assert worker_pids == actor_pids


def test_a_mesh_tensor_reaches_an_actor_as_its_procs_shard_after_the_ops_before(
    procs: Any,
) -> None:
    actors = procs.spawn("holder2", Holder)
    with procs.activate():
        x = torch.arange(4.0) + palatine.get_active_mesh().rank("gpus") * 10
        for _ in range(50):  # still running on the workers when the call is made
            x = x + 1
        assert list(actors.total.call(x).get().values()) == [206.0, 246.0]
        actors.double.call(x).get()  # in place, in the stream's own tensor
        assert inspect(x, gpus=0).tolist() == [100.0, 102.0, 104.0, 106.0]
        assert inspect(x, gpus=1).tolist() == [120.0, 122.0, 124.0, 126.0]


def test_a_mesh_tensor_of_another_mesh_cannot_be_sent_to_an_actor(procs: Any) -> None:
    actors = procs.spawn("holder3", Holder)
    with palatine.local_mesh(1, 1) as other, other.activate():
        y = torch.ones(2)
        with pytest.raises(TypeError, match="cannot be pickled"):
            actors.total.call(y).get()


class Linear(Actor):
    """Monarch's rref example: an actor's state used and updated in order with the
    engine's ops."""

    def __init__(self, n: int, m: int) -> None:
        self.weight = torch.zeros((n, m))

    @endpoint
    def forward(self, x: Any) -> Any:
        return x @ self.weight

    @endpoint(propagate="inspect")
    def update(self, w: Any) -> None:
        self.weight += w


def test_an_endpoint_called_from_the_engine_returns_mesh_tensors_in_order(procs: Any) -> None:
    linear = procs.spawn("linear", Linear, 3, 4)
    with procs.activate():
        y = torch.ones((4, 3))
        forward = palatine.as_endpoint(linear.forward, propagate=lambda x: torch.rand(4, 4))
        t = forward.rref(y)
        assert isinstance(t, palatine.Tensor)
        assert inspect(t.sum()).item() == 0
        linear.update.rref(torch.ones((3, 4)))  # runs before the next op on its stream
        t = forward.rref(y)
        assert inspect(t.sum()).item() == 4 * 4 * 3
        assert inspect(t.sum(), gpus=1).item() == 4 * 4 * 3
        with pytest.raises(ValueError, match="propagate"):
            linear.forward.rref(y)  # no shapes declared for it


class AddWithState(Actor):
    def __init__(self, state: Any) -> None:
        self.state = state.clone()  # its proc's shard, given to the constructor

    @endpoint
    def forward(self, x: Any) -> float:
        return float((x + self.state).sum())


class Counter(Actor):
    def __init__(self) -> None:
        self.c = 0

    @endpoint
    def incr(self, x: Any) -> int:
        self.c += 1
        return self.c - 1


def test_actors_take_shards_in_constructors_and_calls_keep_their_order(procs: Any) -> None:
    with procs.activate():
        adders = procs.spawn("adder", AddWithState, torch.ones(()))
        assert list(adders.forward.call(torch.ones(())).get().values()) == [2.0, 2.0]
        counter = procs.spawn("counter", Counter)
        calls = []
        for _ in range(5):
            calls.append(counter.incr.call(torch.ones(())))  # with a mesh tensor
            calls.append(counter.incr.call(1))  # without
        assert [c.get().item(gpus=0) for c in calls] == list(range(10))


def _kill_rank_1(holders: Any, mesh: Any) -> int:
    """SIGKILL the proc of rank 1; its old pid, once the engine has seen it die."""
    pid = holders.slice(gpus=1).pid.call_one().get(timeout=30)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(palatine.DeviceException, match=rf"rank 1 .*pid {pid}"):
        inspect(torch.ones(()), gpus=1)
    return int(pid)


def test_an_engines_recovery_brings_back_its_worker_and_the_actors_of_the_lost_proc() -> None:
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        holders = pm.spawn("holder", Holder)
        with pm.activate() as mesh:
            kept = torch.full((2,), 3.0)
            inspect(kept, gpus=0)
            old = _kill_rank_1(holders, mesh)
            assert mesh.recover().ranks == [1]
            # tensors: the rank is back; what lived on it is lost there, not elsewhere
            assert inspect(torch.ones(2).sum(), gpus=1).item() == 2.0
            assert inspect(kept, gpus=0).tolist() == [3.0, 3.0]
            with pytest.raises(palatine.LostValue):
                inspect(kept, gpus=1)
            # actors: the proc mesh's actors run on the new incarnation, beside its worker
            new = holders.slice(gpus=1).pid.call_one().get(timeout=30)
            assert new != old
            assert inspect(remote(os.getpid)(), gpus=1) == new
            assert list(holders.total.call(torch.ones(4)).get(timeout=30).values()) == [4.0, 4.0]
    finally:
        pm.stop().get()


def test_respawning_a_proc_mesh_with_an_engine_recovers_the_engine_too() -> None:
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        holders = pm.spawn("holder", Holder)
        with pm.activate() as mesh:
            _kill_rank_1(holders, mesh)
            assert pm.respawn().get(timeout=120) == [1]
            assert inspect(torch.ones(3).sum(), gpus=1).item() == 3.0
            pid = holders.slice(gpus=1).pid.call_one().get(timeout=30)
            assert inspect(remote(os.getpid)(), gpus=1) == pid
    finally:
        pm.stop().get()


def test_a_proc_mesh_whose_engine_was_shut_down_activates_a_new_one() -> None:
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        with pm.activate() as first:
            assert inspect(torch.ones(2).sum(), gpus=0).item() == 2.0
        first.shutdown()
        with pm.activate() as second:
            assert second is not first
            assert inspect(torch.ones(3).sum(), gpus=1).item() == 3.0
    finally:
        pm.stop().get()
