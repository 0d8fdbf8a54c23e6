"""Actor meshes on real procs: stopping one mesh leaves its procs and the other actors on
them serving; flatten and rename reshape a mesh and its values."""

from __future__ import annotations

import sys

import cloudpickle
import pytest

from palatine import Actor, endpoint
from palatine.errors import DeliveryError
from palatine.job import LocalJob

pytestmark = pytest.mark.timeout(120)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Echo(Actor):
    @endpoint
    def echo(self, x: int) -> int:
        return x


def test_stopping_an_actor_mesh_leaves_its_procs_and_their_other_actors_serving() -> None:
    with LocalJob(hosts=1, procs_per_host=1) as job:
        procs = job.host_mesh().spawn_procs(per_host={"gpus": 2})
        first = procs.spawn("first", Echo)
        second = procs.spawn("second", Echo)
        assert first.echo.call(1).get(timeout=30).values() == [1, 1]
        first.stop().get(timeout=30)
        first.stop().get(timeout=30)  # again: nothing left to stop, no error
        with pytest.raises(DeliveryError, match=r"first\[0\] is stopped"):
            first.slice(gpus=1).echo.call_one(2).get(timeout=30)
        assert second.echo.call(3).get(timeout=30).values() == [3, 3]

        flat = second.flatten("ranks")
        assert flat.sizes == {"ranks": 2}
        assert flat.slice(ranks=1).echo.call_one(4).get(timeout=30) == 4
        renamed = second.rename(gpus="devices")
        assert renamed.sizes == {"hosts": 1, "devices": 2}
        values = renamed.echo.call(5).get(timeout=30)
        assert [dict(p) for p, _ in values.items()] == [
            {"hosts": 0, "devices": 0},
            {"hosts": 0, "devices": 1},
        ]
        assert values.flatten("n").item(n=1) == 5
        with pytest.raises(ValueError, match="unknown dimension 'x'"):
            second.rename(x="y")
