"""Split, renamed, flattened and sliced meshes on real workers: ranks, collectives over
the new dim names, calls on a sub-mesh, and ``exit()``."""

from __future__ import annotations

import os

import cloudpickle
import pytest
from meshes import module_mesh

from palatine import fetch, inspect, local_mesh, remote
from palatine.tensor.client.mesh import DeviceMesh

pytestmark = pytest.mark.timeout(120)

# Workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(__import__("sys").modules[__name__])


def tensor_of(rank: int) -> object:
    import torch

    return torch.full((2,), float(rank + 1))


def group_ranks(pg: object) -> list[int]:
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(pg))  # type: ignore[arg-type]


def all_reduce_sum(t: object, pg: object) -> object:
    import torch.distributed as dist

    dist.all_reduce(t, group=pg)
    return t


def mark(directory: str) -> int:
    """Leave a file named by this worker's pid in ``directory``; the pid."""
    pid = os.getpid()
    with open(os.path.join(directory, str(pid)), "w") as f:
        f.write("ran")
    return pid


def listing(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


mesh = module_mesh(2, 2)


def dp_pp(mesh: DeviceMesh) -> DeviceMesh:
    """The 2x2 mesh's four ranks as dp x pp (pp varies fastest: rank = 2·dp + pp)."""
    return mesh.flatten("r").split(r=("dp", "pp"), pp=2)


def test_split_mesh_ranks_are_the_coordinates_of_each_shard(mesh: DeviceMesh) -> None:
    assert mesh.names == ["host", "proc"] and mesh.sizes == [2, 2]
    sp = dp_pp(mesh)
    assert sp.names == ["dp", "pp"] and sp.sizes == [2, 2] and sp.strides == [2, 1]
    assert sp.ranks == [0, 1, 2, 3]
    assert sp.size("dp") == 2 and sp.size(("dp", "pp")) == 4 and sp.size() == 4
    assert sp.size(dim="pp") == 2  # Monarch's spelling
    world = mesh.session.worker_world
    with pytest.raises(ValueError, match=rf"'host' \(size 2\) of mesh of world {world} "):
        mesh.split(host=("a", "b"), b=3)
    with sp.activate():
        dp, pp, both = sp.rank("dp"), sp.rank("pp"), sp.rank(("dp", "pp"))
    for d in range(2):
        for p in range(2):
            shard = {"dp": d, "pp": p}
            assert inspect(dp, shard=shard) == d
            assert inspect(pp, shard=shard) == p
            assert inspect(both, shard=shard) == 2 * d + p
    # A split of a strided dim: host (stride 2) as a=1 (stride 4) x b=2 (stride 2).
    hs = mesh.split(host=("a", "b"), b=2)
    assert hs.names == ["a", "b", "proc"] and hs.sizes == [1, 2, 2] and hs.strides == [4, 2, 1]
    with hs.activate():
        b = hs.rank("b")
        members_b = remote(group_ranks)(hs.process_group("b"))
    assert [inspect(b, shard=r) for r in range(4)] == [0, 0, 1, 1]
    assert [inspect(members_b, shard=r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_reduce_and_process_groups_over_a_split_dim_take_the_right_ranks(
    mesh: DeviceMesh,
) -> None:
    sp = dp_pp(mesh)
    with sp.activate():
        t = remote(tensor_of)(sp.rank(("dp", "pp")))  # rank r holds r + 1
        over_dp = t.reduce("dp", op="sum")
        members_dp = remote(group_ranks)(sp.process_group("dp"))
        members_pp = remote(group_ranks)(sp.process_group(["pp"]))
        summed_pp = remote(all_reduce_sum)(remote(tensor_of)(sp.rank("pp")), sp.process_group("pp"))
    # Over dp: the ranks sharing pp (0 and 2: 1 + 3; 1 and 3: 2 + 4).
    for r, want in enumerate([4.0, 6.0, 4.0, 6.0]):
        assert inspect(over_dp, shard=r).tolist() == [want, want]
    assert [inspect(members_dp, shard=r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [inspect(members_pp, shard=r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # Over pp, each rank r holding pp + 1: 1 + 2 in both dp rows.
    assert [inspect(summed_pp, shard=r).tolist() for r in range(4)] == [[3.0, 3.0]] * 4
    # A renamed dim keeps its groups: dp is proc here, so its members share a host.
    swapped = mesh.rename(host="pp", proc="dp")
    with swapped.activate():
        members = remote(group_ranks)(swapped.process_group("dp"))
    assert [inspect(members, shard=r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_a_call_on_a_sliced_split_mesh_runs_only_on_its_ranks(
    mesh: DeviceMesh, tmp_path: object
) -> None:
    with mesh.activate():
        pid = remote(os.getpid)()
    pids = [inspect(pid, shard=r) for r in range(4)]
    sp = dp_pp(mesh)
    sub = sp(pp=1)
    assert sub.names == ["dp"] and sub.ranks == [1, 3] and sp.slice(pp=1).ranks == [1, 3]
    with sub.activate():
        ran = remote(mark)(str(tmp_path))
        dp = sub.rank("dp")
    assert [inspect(ran, shard=i) for i in range(2)] == [pids[1], pids[3]]
    assert [inspect(dp, shard=i) for i in range(2)] == [0, 1]
    # A call on every rank after it: each rank's stream ran what came before.
    with mesh.activate():
        seen = remote(listing)(str(tmp_path))
    assert [inspect(seen, shard=r) for r in range(4)] == [sorted([str(pids[1]), str(pids[3])])] * 4


def test_flatten_then_rank_numbers_the_ranks_in_row_major_order(mesh: DeviceMesh) -> None:
    flat = mesh.flatten("r")
    assert flat.names == ["r"] and flat.sizes == [4] and flat.ranks == [0, 1, 2, 3]
    column = mesh.slice(proc=slice(1, 2)).flatten("hosts")  # ranks 1 and 3: stride 2
    assert column.strides == [2] and column.ranks == [1, 3]
    with flat.activate():
        r = flat.rank("r")
    with column.activate():
        h = column.rank("hosts")
    assert [inspect(r, shard=i) for i in range(4)] == [0, 1, 2, 3]
    assert fetch(h, shard={"hosts": 1}).result(timeout=30) == 1


def test_exit_of_a_sub_mesh_ends_the_session_and_later_calls_raise() -> None:
    m = local_mesh(hosts=1, procs_per_host=2, startup_timeout_s=60)
    try:
        sub = m.split(proc=("a", "b"), b=1)
        with sub.activate():
            assert inspect(sub.rank("a"), shard={"a": 1, "b": 0}) == 1
        sub.exit()
        assert m.session.closed
        with pytest.raises(RuntimeError, match="mesh was shut down"), m.activate():
            remote(os.getpid)()
        sub.exit()  # idempotent, on either mesh
        m.exit()
    finally:
        m.shutdown()
