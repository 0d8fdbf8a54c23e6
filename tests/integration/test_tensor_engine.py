"""Actors and mesh tensors in the same procs: `palatine.spawn_tensor_engine` and
`ProcMesh.activate()` on a real actor proc mesh (`this_host().spawn_procs`)."""

from __future__ import annotations

import os
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
