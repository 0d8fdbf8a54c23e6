"""`to_mesh` on a real local mesh of 2x2 workers: tensors move point to point between
sub-meshes of the same shape, as between the stages of a pipeline."""

from __future__ import annotations

import sys
from typing import Any

import cloudpickle
import pytest
from meshes import module_mesh

from palatine import RemoteException, fetch, remote
from palatine.tensor.client.mesh import DeviceMesh
from palatine.tensor.client.transfer import to_mesh

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(180)

# Workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def shard_of(i: int) -> Any:
    """A tensor that names the worker that made it and its coordinate ``i``."""
    import torch

    from palatine import worker_info

    rank = worker_info()["rank"]
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank + 10 * i


def ints_of(i: int) -> Any:
    import torch

    return torch.tensor([[i, -i], [7, 8]], dtype=torch.int16)


def fail_on(i: int, bad: int) -> Any:
    import torch

    if i == bad:
        raise ZeroDivisionError("the source failed on purpose")
    return torch.ones(2)


def add_in_place(t: Any, v: float) -> None:
    t.add_(v)


def where_am_i(t: Any) -> tuple[int, list[float]]:
    from palatine import worker_info

    return worker_info()["rank"], t.tolist()


mesh = module_mesh(2, 2)


def _shards(value: Any, dim: str) -> list[Any]:
    return [fetch(value, shard={dim: i}).result(timeout=60) for i in range(2)]


@pytest.mark.timeout(300)  # the first test starts the mesh and the collective group
def test_a_pipeline_stage_moves_each_shard_to_the_rank_at_the_same_coordinate(
    mesh: DeviceMesh,
) -> None:
    stage0, stage1 = mesh.slice(proc=0), mesh.slice(proc=1)  # ranks 0, 2 and 1, 3
    with stage0.activate():
        x = remote(shard_of)(stage0.rank("host"))
    moved = to_mesh(x, stage1)
    assert moved.mesh is stage1 and moved.stream.id == x.stream.id
    sent, got = _shards(x, "host"), _shards(moved, "host")
    assert [t[0, 0].item() for t in sent] == [0.0, 210.0]  # made on ranks 0 and 2
    assert all(torch.equal(a, b) for a, b in zip(sent, got, strict=True))
    with stage1.activate():  # the moved value is an ordinary value of stage 1
        seen = remote(where_am_i)(remote(torch.sum)(moved, 1))
    assert _shards(seen, "host") == [(1, [3.0, 12.0]), (3, [633.0, 642.0])]
    # Back again, with the metadata known to the client, and an integer dtype.
    back = to_mesh(moved, stage0, like=torch.empty(2, 3))
    assert all(torch.equal(a, b) for a, b in zip(sent, _shards(back, "host"), strict=True))
    with stage0.activate():
        small = remote(ints_of)(stage0.rank("host"))
    ints = _shards(to_mesh(small, stage1), "host")
    assert [t.dtype for t in ints] == [torch.int16] * 2
    assert [t.tolist() for t in ints] == [[[0, 0], [7, 8]], [[1, -1], [7, 8]]]


def test_meshes_that_share_a_rank_and_name_their_dims_differently(mesh: DeviceMesh) -> None:
    row, column = mesh.slice(host=0), mesh.slice(proc=1)  # ranks 0, 1 and 1, 3
    with row.activate():
        x = remote(shard_of)(row.rank("proc"))
    moved = to_mesh(x, column)  # rank 1 sends to 3 and receives from 0
    got = _shards(moved, "host")
    assert [t[0, 0].item() for t in got] == [0.0, 110.0]
    side = column.stream("side")
    later = to_mesh(x, column, stream=side)
    assert later.stream.id == side.id
    assert [t[0, 0].item() for t in _shards(later, "host")] == [0.0, 110.0]


def test_a_failed_source_fails_the_moved_value_with_the_original_error(mesh: DeviceMesh) -> None:
    stage0, stage1 = mesh.slice(proc=0), mesh.slice(proc=1)
    with stage0.activate():
        bad = remote(fail_on)(stage0.rank("host"), 1)  # fails on rank 2
    for like in (None, ((2,), torch.float32)):
        moved = to_mesh(bad, stage1, like=like)
        for i in range(2):
            with pytest.raises(RemoteException) as ei:
                fetch(moved, shard={"host": i}).result(timeout=60)
            assert ei.value.rank == 2 and "ZeroDivisionError" in ei.value.exc_type
            assert "the source failed on purpose" in str(ei.value)
    # Nobody waits for data that never came: the destination still moves and fetches.
    with stage0.activate():
        good = remote(shard_of)(stage0.rank("host"))
    assert [t[0, 0].item() for t in _shards(to_mesh(good, stage1), "host")] == [0.0, 210.0]


def test_a_source_that_is_not_a_tensor_or_not_like_its_metadata_fails_naming_the_op_ranks_and_stream(
    mesh: DeviceMesh,
) -> None:
    stage0, stage1 = mesh.slice(proc=0), mesh.slice(proc=1)
    with stage0.activate():
        words = remote(str)(stage0.rank("host"))
    moved = to_mesh(words, stage1)
    with pytest.raises(RemoteException) as ei:
        fetch(moved, shard={"host": 0}).result(timeout=60)
    text = str(ei.value)
    assert "to_mesh" in text and "needs a tensor, got a str" in text
    assert "rank 0 to rank 1" in text or "rank 2 to rank 3" in text
    assert "on stream main" in text
    with stage0.activate():
        fine = remote(shard_of)(stage0.rank("host"))
    with pytest.raises(RemoteException, match=r"float32\[2, 3\], not the float32\[6\]"):
        fetch(to_mesh(fine, stage1, like=((6,), torch.float32)), shard=1).result(timeout=60)
    assert [t[0, 0].item() for t in _shards(to_mesh(fine, stage1), "host")] == [0.0, 210.0]


def test_moving_to_a_mesh_of_another_shape_is_a_value_error(mesh: DeviceMesh) -> None:
    stage0 = mesh.slice(proc=0)
    with stage0.activate():
        x = remote(shard_of)(stage0.rank("host"))
    with pytest.raises(ValueError, match=r"shape \(host=2\).*shape \(host=2, proc=2\)"):
        to_mesh(x, mesh)
    with pytest.raises(ValueError, match=r"shape \(host=2\).*shape \(proc=1\)"):
        to_mesh(x, mesh.slice(host=0, proc=slice(1, 2)))


def test_a_mesh_moved_to_itself_is_an_independent_copy(mesh: DeviceMesh) -> None:
    with mesh.activate():
        x = remote(shard_of)(mesh.rank("proc"))
        copy = to_mesh(x, mesh)
        remote(add_in_place, mutates=("t",))(x, 1000.0)
        remote(add_in_place, mutates=("t",))(copy, -1.0)
        for r in range(4):
            original = fetch(x, shard=r).result(timeout=60)
            copied = fetch(copy, shard=r).result(timeout=60)
            assert torch.equal(original - 1000.0, copied + 1.0), r
    with pytest.raises(ValueError, match="same place"):
        to_mesh(x, mesh, stream=mesh.stream("side"))


def test_a_source_lost_while_its_peer_waits_ends_the_wait_and_recovery_moves_again() -> None:
    """Rank 0 is killed while rank 2 waits in `to_mesh` for what rank 0 sends: the wait
    ends (it does not last the collective timeout), and after `recover()` rank 2's
    stream moves the restored value at once."""
    from user_scripts import MESH_HELPERS, run_script

    lines, _ = run_script(
        MESH_HELPERS
        + """
    from palatine.tensor.client.transfer import to_mesh

    def ones(i):
        import torch
        return torch.ones(3) * float(i + 1)

    def busy(i):
        if int(i) == 0:
            time.sleep(60)  # rank 0 stays busy: rank 2 waits for it in what follows
        return 0

    with local_mesh(1, 4) as mesh:
        src, dst = mesh.slice(proc=slice(0, 2)), mesh.slice(proc=slice(2, 4))
        with mesh.activate():
            pids = pids_of(mesh)
        with src.activate():
            v = remote(ones)(src.rank("proc"))
            assert fetch(to_mesh(v, dst), shard=1).result(timeout=60).tolist() == [2.0] * 3
            remote(busy)(src.rank("proc"))
        fut = fetch(to_mesh(v, dst), shard=0)
        time.sleep(0.5)  # rank 2 waits for rank 0 by now
        os.kill(pids[0], signal.SIGKILL)
        try:
            fut.result(timeout=60)
            print("SEEN", "ok")
        except DeviceException as e:
            print("SEEN", f"DeviceException:{e.rank}")
        print("RECOVERED", mesh.recover().ranks)
        v.restore(ones, src.rank("proc"))
        t0 = time.monotonic()
        again = to_mesh(v, dst)
        print("AGAIN", [fetch(again, shard=i).result(timeout=30).tolist() for i in range(2)])
        print("TOOK", f"{time.monotonic() - t0:.2f}")
    """
    )
    assert lines["SEEN"] == "DeviceException:0", lines
    assert lines["RECOVERED"] == "[0]", lines
    assert lines["AGAIN"] == "[[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]", lines
    assert float(lines["TOOK"]) < 20.0, lines
