"""Mesh tensors on real workers: plain PyTorch under ``mesh.activate()``.

One 2 × 2 local mesh (dims ``host`` and ``proc``, ranks 0-3) serves every test; each
test makes its own tensors and checks them shard by shard.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import cloudpickle
import pytest
import torch
from meshes import module_mesh

import palatine
from palatine import (
    RemoteException,
    Stream,
    Tensor,
    call_on_shard_and_fetch,
    config,
    fetch_shard,
    get_active_mesh,
    get_active_stream,
    inspect,
    no_mesh,
    remote,
)
from palatine.core import runtime
from palatine.ids import ActorId, ProcId, WorldId
from palatine.protocol.worker import GetRefUnitTestsOnly, RefValue
from palatine.tensor.client.mesh import DeviceMesh

pytestmark = pytest.mark.timeout(180)

cloudpickle.register_pickle_by_value(__import__("sys").modules[__name__])

SHARDS = [{"host": h, "proc": p} for h in (0, 1) for p in (0, 1)]


mesh = module_mesh(2, 2)


def per_shard(t: Any) -> list[Any]:
    return [inspect(t, **s).tolist() for s in SHARDS]


def raise_on_rank(x: Any, rank: Any, bad: int) -> Any:
    if int(rank) == bad:
        raise ValueError(f"rank {int(rank)} refuses on purpose")
    return x + 1


def with_group(x: Any, pg: Any) -> Any:
    import torch.distributed as dist

    y = x.clone()
    dist.all_reduce(y, group=pg)
    return y


# ------------------------------------------------------------------ factories, ops


def test_factories_under_activate_make_mesh_tensors_with_client_side_metadata(
    mesh: DeviceMesh,
) -> None:
    with mesh.activate():
        made = {
            "zeros": torch.zeros(2, 3),
            "ones": torch.ones(4, dtype=torch.int32),
            "full": torch.full((2,), 7.5),
            "arange": torch.arange(6),
            "empty": torch.empty(3, 1),
            "tensor": torch.tensor([[1, 2], [3, 4]]),
            "rand": torch.rand(5),
            "randn": torch.randn(2, 2, dtype=torch.float64),
            "eye": torch.eye(3),
        }
        for name, t in made.items():
            assert isinstance(t, Tensor), name
            assert t.mesh is mesh and t.stream.name == "main", name
        assert made["zeros"].shape == (2, 3) and made["zeros"].dtype == torch.float32
        assert made["ones"].dtype == torch.int32 and made["arange"].dtype == torch.int64
        assert made["randn"].dtype == torch.float64 and made["empty"].shape == (3, 1)
        assert per_shard(made["tensor"]) == [[[1, 2], [3, 4]]] * 4
        assert per_shard(made["full"]) == [[7.5, 7.5]] * 4
        like = torch.ones_like(made["zeros"])
        assert isinstance(like, Tensor) and inspect(like).tolist() == [[1.0] * 3] * 2
        assert inspect(torch.zeros_like(made["eye"])).sum().item() == 0
        assert get_active_mesh() is mesh
        with no_mesh.activate():
            local = torch.zeros(2)
            assert get_active_mesh() is None
        assert type(local) is torch.Tensor
    assert get_active_mesh() is None


def test_ops_run_on_the_workers_in_issue_order(mesh: DeviceMesh) -> None:
    with mesh.activate():
        x = torch.zeros(64, 64)
        for _ in range(200):
            x = x + 1
        total = x.sum()
        assert isinstance(total, Tensor) and total.shape == ()
        assert inspect(total).item() == 64 * 64 * 200
        y = torch.arange(6.0).reshape(2, 3)
        assert y.shape == (2, 3) and y.stride() == (3, 1)
        z = y.t()
        assert z.shape == (3, 2) and z.stride() == (1, 3)
        back = y.add_(10)  # in place: the same object, and its view sees it
        assert back is y
        assert inspect(z).tolist() == [[10.0, 13.0], [11.0, 14.0], [12.0, 15.0]]
        std, mean = torch.std_mean(y)
        assert isinstance(std, Tensor) and isinstance(mean, Tensor)
        assert inspect(mean).item() == pytest.approx(12.5)
        values, idx = y.max(dim=1)
        assert inspect(values).tolist() == [12.0, 15.0] and inspect(idx).tolist() == [2, 2]
        out = torch.empty(2, 3)
        torch.mul(y, 2, out=out)
        assert inspect(out).tolist() == [[20.0, 22.0, 24.0], [26.0, 28.0, 30.0]]
        parts = torch.split(torch.arange(5), 2)
        assert [inspect(p).tolist() for p in parts] == [[0, 1], [2, 3], [4]]
        w = torch.zeros(4)
        w[1] = 5  # torch makes the 5 a 0-dim local tensor: it travels as the number
        with no_mesh.activate():
            two = torch.tensor(2.0)
        assert inspect(w * two).tolist() == [0.0, 10.0, 0.0, 0.0]
        as_double = w.to(torch.float64)
        assert as_double.dtype == torch.float64 and w.to(torch.float32) is w
        assert inspect(as_double).dtype == torch.float64


def test_mesh_rank_is_a_tensor_of_coordinates(mesh: DeviceMesh) -> None:
    with mesh.activate():
        proc = mesh.rank("proc")
        both = mesh.rank(("host", "proc"))
        assert isinstance(proc, Tensor) and proc.shape == () and proc.dtype == torch.int64
        assert per_shard(proc) == [0, 1, 0, 1]
        again = mesh.rank("proc")
        assert again.ref == both.ref + 1  # one op: its shape function sent nothing
        assert per_shard(both) == [0, 1, 2, 3]
        x = torch.ones(3) * mesh.rank("host") + 10 * mesh.rank("proc")
        assert per_shard(x) == [[0.0] * 3, [10.0] * 3, [1.0] * 3, [11.0] * 3]
    row = mesh(host=1)
    with row.activate():
        r = mesh.rank("host")  # on the active sub-mesh, coordinates of the whole mesh
        assert r.mesh is row and inspect(r, proc=1).item() == 1


# ------------------------------------------------------------------ errors


def test_the_three_argument_errors_name_the_problem(mesh: DeviceMesh) -> None:
    with mesh.activate():
        x = torch.ones(2)
        with no_mesh.activate():
            local = torch.ones(2)
        with pytest.raises(TypeError, match="LOCAL_TENSOR"):
            x + local
        with pytest.raises(TypeError, match="LOCAL_TENSOR"):
            local * x
        with pytest.raises(TypeError, match="LOCAL_TENSOR"):
            x.add(local)
        with pytest.raises(RuntimeError, match="broadcast"):
            x + torch.ones(3)  # caught on the client, before anything is sent
        assert (local + local).tolist() == [2.0, 2.0]  # local only: runs here
        with mesh(host=0).activate():
            y = torch.ones(2)
        with pytest.raises(TypeError, match="WRONG_MESH"):
            y + x
        with Stream("other").activate():
            with pytest.raises(TypeError, match="WRONG_STREAM"):
                x + 1
            with pytest.raises(TypeError, match="WRONG_STREAM"):
                x.reduce("proc")
        x.drop()
        with pytest.raises(TypeError, match="DROPPED"):
            x * 2
        scalar = torch.ones(()) + mesh.rank("proc")  # not known here (made from a rank)
        with pytest.raises(TypeError, match=r"palatine\.inspect"):
            scalar.item()
        with pytest.raises(TypeError, match=r"palatine\.inspect"):
            bool(scalar)
        with pytest.raises(TypeError, match=r"palatine\.inspect"):
            scalar.tolist()
        assert inspect(scalar, proc=1).item() == 2.0  # the session goes on


def test_a_failing_op_fails_its_dependents_with_the_op_and_line_while_others_fetch(
    mesh: DeviceMesh,
) -> None:
    with mesh.activate():
        x = torch.arange(4.0)
        index = torch.tensor([10])
        bad = x[index]  # out of range: only the workers can tell
        dependent = bad * 2
        fine = x + 1
        assert inspect(fine).tolist() == [1.0, 2.0, 3.0, 4.0]
        with pytest.raises(RemoteException) as info:
            inspect(dependent)
        e = info.value
        assert "aten.index.Tensor" in (e.function or "")
        assert "op 'aten.index.Tensor' failed" in str(e)
        assert "bad = x[index]" in e.client_traceback
        assert inspect(x * 3, host=1).tolist() == [0.0, 3.0, 6.0, 9.0]


def test_a_failing_remote_function_fails_its_dependents_while_others_fetch(
    mesh: DeviceMesh,
) -> None:
    with mesh.activate():
        x = torch.zeros(3)
        z = remote(raise_on_rank, propagate=lambda x, rank, bad: x + 1)(
            x, mesh.rank(("host", "proc")), 2
        )
        a = z + 1
        b = x + 5
        assert inspect(b).tolist() == [5.0, 5.0, 5.0]
        with pytest.raises(RemoteException, match="refuses on purpose") as info:
            inspect(a, host=0, proc=0)  # the failure is the value's, on every rank
        assert info.value.rank == 2
        assert "raise_on_rank" in info.value.client_traceback
        assert inspect(b, host=1, proc=1).tolist() == [5.0, 5.0, 5.0]


# ------------------------------------------------------------------ getting values back


def test_fetch_shard_inspect_show_and_call_on_shard(
    mesh: DeviceMesh, capsys: pytest.CaptureFixture[str]
) -> None:
    with mesh.activate():
        t = mesh.rank(("host", "proc")) * 10
        assert fetch_shard(t, host=1, proc=0).result(timeout=30).item() == 20
        assert fetch_shard(t, {"host": 1, "proc": 1}).result(timeout=30).item() == 30
        assert fetch_shard(t).result(timeout=30).item() == 0
        got = inspect({"t": t, "n": 3}, proc=1)
        assert got["n"] == 3 and type(got["t"]) is torch.Tensor and got["t"].item() == 10
        palatine.show(t)
        printed = capsys.readouterr().out
        assert "[host=1, proc=1] tensor(30)" in printed
        got = call_on_shard_and_fetch(lambda v, k: int(v) + k, t, 5, shard={"host": 1, "proc": 1})
        assert got.result(timeout=30) == 35


# ------------------------------------------------------------------ remote(propagate=)


def scaled(x: Any, k: float) -> Any:
    return {"scaled": x * k, "n": x.numel()}


def bump_in_place(x: Any) -> None:
    x.add_(1)


def test_remote_functions_propagate_results_as_mesh_tensors(mesh: DeviceMesh) -> None:
    with mesh.activate():
        x = torch.ones(2, 2)
        by_fn = remote(scaled, propagate=lambda x, k: {"scaled": x, "n": 4})(x, 3.0)
        assert isinstance(by_fn["scaled"], Tensor) and by_fn["n"] == 4
        assert inspect(by_fn["scaled"]).tolist() == [[3.0, 3.0], [3.0, 3.0]]
        looked = remote(scaled, propagate="inspect")(x, 2.0)
        assert looked["scaled"].shape == (2, 2) and looked["n"] == 4
        cached = remote(lambda t: t.sum(0), propagate="cached")
        first, second = cached(x), cached(x * 2)
        assert len(cached._cache) == 1  # the same input metadata: learned once
        assert inspect(first).tolist() == [2.0, 2.0] and inspect(second).tolist() == [4.0, 4.0]
        mocked = remote(lambda t: t.t() @ t, propagate="mocked")(torch.arange(6.0).reshape(3, 2))
        assert mocked.shape == (2, 2) and inspect(mocked).tolist() == [[20.0, 26.0], [26.0, 35.0]]
        y = torch.zeros(3)
        out = remote(bump_in_place, propagate=bump_in_place)(y)
        assert out is None and inspect(y).tolist() == [1.0, 1.0, 1.0]
        with pytest.raises(TypeError, match="process group"):
            remote(with_group, propagate="inspect")(x, mesh.process_group("host"))
        plain = remote(lambda t: t.shape)(x)  # without propagate: a RemoteValue, as before
        assert isinstance(plain, palatine.RemoteValue) and inspect(plain) == torch.Size([2, 2])


# ------------------------------------------------------------------ collectives


def test_reduce_as_tensor_methods_and_over_pytrees(mesh: DeviceMesh) -> None:
    with mesh.activate():
        r = mesh.rank(("host", "proc")).float()  # 0..3
        x = torch.ones(2) * (r + 1)  # 1..4
        assert per_shard(x.reduce("host")) == [[4.0, 4.0], [6.0, 6.0], [4.0, 4.0], [6.0, 6.0]]
        assert per_shard(x.reduce("proc", "avg")) == [[1.5] * 2, [1.5] * 2, [3.5] * 2, [3.5] * 2]
        assert inspect(x.reduce(("host", "proc"), "max")).tolist() == [4.0, 4.0]
        assert inspect(x.reduce((), "min"), host=1).tolist() == [1.0, 1.0]
        assert inspect(x.reduce("proc", "product"), host=1).tolist() == [12.0, 12.0]
        stacked = x.reduce("proc", "stack")
        assert stacked.shape == (2, 2)
        assert inspect(stacked, host=1).tolist() == [[3.0, 3.0], [4.0, 4.0]]
        rows = torch.arange(4.0).reshape(2, 2) + r  # rank r: [[r, r+1], [r+2, r+3]]
        scattered = rows.reduce("proc", "sum", scatter=True)
        assert scattered.shape == (2,)
        assert inspect(scattered, host=0, proc=1).tolist() == [5.0, 7.0]  # row 1 of the sum
        y = x.clone()
        assert y.reduce_("host") is y and per_shard(y)[0] == [4.0, 4.0]
        tree = palatine.reduce({"a": x, "b": [x * 2], "n": 1}, "proc")
        assert tree["n"] == 1 and inspect(tree["b"][0], host=1).tolist() == [14.0, 14.0]
        with pytest.raises(ValueError, match="multiple dimensions"):
            x.reduce(("host", "proc"), "stack")
        with pytest.raises(ValueError, match="in-place"):
            x.reduce_("proc", "stack")
        with pytest.raises(TypeError, match="outer most dimension"):
            torch.ones(3).reduce("proc", scatter=True)
        pg = mesh.process_group("host")
        summed = remote(with_group, propagate=lambda x, pg: x)(x, pg)
        assert per_shard(summed) == [[4.0, 4.0], [6.0, 6.0], [4.0, 4.0], [6.0, 6.0]]


# ------------------------------------------------------------------ mesh shapes, moves


def test_a_tensor_moves_across_pipeline_stages_of_a_dp_by_pp_split(mesh: DeviceMesh) -> None:
    grid = mesh.flatten("all").split(all=("dp", "pp"), pp=2)
    assert grid.names == ["dp", "pp"] and grid.sizes == [2, 2]
    first, second = grid(pp=0), grid(pp=1)
    with first.activate():
        a = torch.ones(3) * (grid.rank("dp") + 1)  # dp 0: 1s, dp 1: 2s
        assert a.mesh is first
    b = a.to_mesh(second)
    assert b.mesh is second and b.shape == (3,)
    with second.activate():
        c = b * 10
        assert inspect(c, dp=0).tolist() == [10.0] * 3
        assert inspect(c, dp=1).tolist() == [20.0] * 3
    a.add_(100)  # a copy: the moved tensor does not change
    assert inspect(b, dp=1).tolist() == [2.0] * 3
    moved = palatine.to_mesh({"b": b, "k": 1}, first)
    assert moved["k"] == 1 and inspect(moved["b"], dp=1).tolist() == [2.0] * 3
    with mesh.activate():
        whole = torch.arange(4.0) + mesh.rank("proc")
    row = palatine.slice_mesh(whole, host=1)
    assert row.mesh.ranks == [2, 3] and inspect(row, proc=1).tolist() == [1.0, 2.0, 3.0, 4.0]
    with mesh(host=1).activate():
        assert inspect(row + 1, proc=0).tolist() == [1.0, 2.0, 3.0, 4.0]


# ------------------------------------------------------------------ streams


def test_streams_by_name_borrows_and_their_errors(mesh: DeviceMesh) -> None:
    other = Stream("other")
    assert get_active_stream().name == "main"
    with mesh.activate():
        x = torch.ones(4)
        with other.activate():
            assert get_active_stream() is other
            y = torch.zeros(4)  # made on "other"
            assert y.stream.name == "other"
            borrowed, borrow = other.borrow(x)
            z = borrowed * 3 + y
            assert inspect(z).tolist() == [3.0] * 4
        with pytest.raises(TypeError, match="MUTATING_BORROW"):
            x.add_(1)  # lent read-only: neither side may be written
        assert inspect(x + 1).tolist() == [2.0] * 4  # reading is fine
        borrow.drop()
        x.add_(1)
        assert inspect(x).tolist() == [2.0] * 4
        with pytest.raises(TypeError, match="DROPPED"):
            borrowed + 1
        with other.borrow(x, mutable=True) as lent:
            with pytest.raises(TypeError, match="BORROWED"):
                x + 1
            with other.activate():
                lent.tensor.mul_(5)
        assert inspect(x).tolist() == [10.0] * 4


# ------------------------------------------------------------------ autograd


def test_autograd_runs_on_the_client_and_a_no_grad_step_updates_the_workers(
    mesh: DeviceMesh,
) -> None:
    with mesh.activate():
        w = torch.ones(3, requires_grad=True)
        loss = (w * (mesh.rank("proc") + 1)).sum()
        assert loss.requires_grad and loss.grad_fn is not None
        loss.backward()
        assert isinstance(w.grad, Tensor)
        assert inspect(w.grad, proc=1).tolist() == [2.0, 2.0, 2.0]
        with torch.no_grad():
            w -= 0.5 * w.grad
        assert inspect(w, proc=0).tolist() == [0.5, 0.5, 0.5]
        assert inspect(w, proc=1).tolist() == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------ lifetime


def ref_on(mesh: DeviceMesh, ref: int, rank: int) -> RefValue:
    """Read ``ref`` on the main stream of worker ``rank`` directly (its test hook)."""
    s = mesh.session
    worker = ActorId(ProcId(WorldId(s.worker_world), rank), s.worker_name, 0)
    ask = GetRefUnitTestsOnly(ref=ref, stream=0)
    got = runtime.call(lambda: s.mailbox.ask(worker, ask, 10.0)).result(timeout=15)
    assert isinstance(got, RefValue)
    return got


def wait_freed(mesh: DeviceMesh, ref: int) -> None:
    """Until no worker holds ``ref`` (a fetch sends what is queued, drops included)."""
    deadline = time.monotonic() + 15
    while any(ref_on(mesh, ref, rank).found for rank in range(4)):
        assert time.monotonic() < deadline, f"r{ref} still held by a worker"
        inspect(torch.zeros(1))
        time.sleep(0.05)


def test_a_tensors_ref_is_freed_on_the_workers_when_the_client_object_dies(
    mesh: DeviceMesh,
) -> None:
    with mesh.activate():
        x = torch.ones(8) * 2
        ref = x.ref
        assert inspect(x).sum().item() == 16
        assert all(ref_on(mesh, ref, rank).found for rank in range(4))
        del x
        gc.collect()
        wait_freed(mesh, ref)
        base = torch.ones(8)
        view = base[:4]  # a view keeps its base, as in torch
        base_ref, view_ref = base.ref, view.ref
        del base
        gc.collect()
        inspect(torch.zeros(1))
        assert ref_on(mesh, base_ref, 3).found
        assert inspect(view).tolist() == [1.0] * 4
        del view
        gc.collect()
        wait_freed(mesh, view_ref)
        wait_freed(mesh, base_ref)


# ------------------------------------------------------------------ backpressure


def slow_step(x: Any) -> Any:
    time.sleep(0.002)
    return x + 1


def test_a_loop_that_never_fetches_waits_for_the_workers_at_the_in_flight_limit() -> None:
    with config.override(client_in_flight_limit=100):
        m = palatine.local_mesh(hosts=1, procs_per_host=1, startup_timeout_s=90)
    try:
        step = remote(slow_step, propagate=lambda x: x)
        most = 0
        with m.activate():
            x = torch.zeros(2)
            for _ in range(600):  # the workers need >= 1.2 s; issuing takes far less
                x = step(x)
                most = max(most, len(m.session.results.pending))
            assert most <= 100, f"{most} calls were in flight past the limit of 100"
            assert inspect(x).tolist() == [600.0, 600.0]
    finally:
        m.shutdown()


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mesh_tensors_on_cuda_workers_compute_there_and_fetch_to_the_client() -> None:
    with palatine.local_mesh(hosts=1, procs_per_host=1, device="cuda", startup_timeout_s=120) as m:
        x = torch.ones(1024, device="cuda") * (m.rank("proc") + 2)
        assert x.device.type == "cuda"
        total = x.reduce("proc").sum()  # a collective over NCCL
        assert inspect(total).item() == 2048
        here = inspect(x)
        assert here.device.type == "cpu" and here[0].item() == 2
        moved = x.cpu()
        assert moved.device.type == "cpu" and inspect(moved.sum()).item() == 2048
