"""CUDA workers on a real local mesh.

One GPU is enough: one worker proc gets it alone (its collectives go through NCCL), and
two procs sharing it fall back to gloo, staging CUDA tensors through the CPU. With more
GPUs each proc sees one of its own (`PALATINE_DEVICES_PER_HOST`) and NCCL is used.
"""

from __future__ import annotations

from collections.abc import Iterator

import cloudpickle
import pytest

from palatine import fetch, inspect, local_mesh, remote, worker_info
from palatine.tensor.client.mesh import DeviceMesh

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

cloudpickle.register_pickle_by_value(__import__("sys").modules[__name__])


def where() -> dict[str, object]:
    import os

    import torch

    info = worker_info()
    return {
        "device": info["device"],
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "current": torch.cuda.current_device(),
        "uuid": str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid),
    }


def on_gpu(rank: int, n: int) -> object:
    import torch

    return torch.full((n,), float(rank + 1), device="cuda")


def device_of(t: object) -> str:
    return str(t.device)  # type: ignore[attr-defined]


def scale_(t: object, k: float) -> None:
    t.mul_(k)  # type: ignore[attr-defined]


def plus(t: object, k: float) -> object:
    return t + k  # type: ignore[operator]


def all_reduce_sum(t: object, pg: object) -> object:
    import torch.distributed as dist

    dist.all_reduce(t, group=pg)  # type: ignore[arg-type]
    return t


def backend() -> str:
    from palatine.tensor.worker.collectives import backend_name

    return backend_name()


@pytest.fixture(scope="module")
def shared() -> Iterator[DeviceMesh]:
    """Two worker procs; with one GPU they share it."""
    m = local_mesh(hosts=1, procs_per_host=2, device="cuda", startup_timeout_s=120)
    try:
        yield m
    finally:
        m.shutdown()


def test_each_proc_uses_cuda_0_of_what_it_sees(shared: DeviceMesh) -> None:
    gpus = torch.cuda.device_count()
    with shared.activate():
        w = remote(where)()
        got = [inspect(w, shard=i) for i in range(2)]
    assert all(g["device"] == "cuda:0" and g["current"] == 0 for g in got), got
    if gpus >= 2:
        assert got[0]["visible"] != got[1]["visible"] and got[0]["uuid"] != got[1]["uuid"], got
    else:
        assert got[0]["uuid"] == got[1]["uuid"], got


def test_a_fetched_cuda_tensor_arrives_on_the_cpu_as_a_snapshot(shared: DeviceMesh) -> None:
    with shared.activate():
        t = remote(on_gpu)(shared.rank("proc"), 1 << 20)
        assert inspect(remote(device_of)(t), shard=1) == "cuda:0"
        pending = fetch(t, shard=1)
        remote(scale_, mutates=("t",), returns=0)(t, 3.0)  # right behind the fetch
        before = pending.result(timeout=60)
        after = fetch(t, shard=1).result(timeout=60)
    assert before.device.type == "cpu" and torch.equal(before, torch.full((1 << 20,), 2.0))
    assert torch.equal(after, torch.full((1 << 20,), 6.0))


def test_reduce_of_cuda_tensors_on_a_shared_gpu(shared: DeviceMesh) -> None:
    with shared.activate():
        t = remote(on_gpu)(shared.rank("proc"), 4)
        total = t.reduce("proc", op="sum")
        assert inspect(remote(device_of)(total), shard=0) == "cuda:0"
        assert inspect(total, shard=0).tolist() == [3.0] * 4
        t.reduce("proc", op="max", in_place=True)
        assert inspect(t, shard=0).tolist() == [2.0] * 4
        want = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
        assert inspect(remote(backend)(), shard=0) == want


def test_a_borrow_between_cuda_streams(shared: DeviceMesh) -> None:
    side = shared.stream("side")
    with shared.activate():
        t = remote(on_gpu)(shared.rank("proc"), 1 << 16)
        with side.activate():
            b = t.to_stream(side)
            c = remote(plus)(b, 1.0)
        assert inspect(c, shard=1).tolist()[:2] == [3.0, 3.0]
        assert inspect(t, shard=1).tolist()[:2] == [2.0, 2.0]


def test_one_proc_per_gpu_uses_nccl() -> None:
    with local_mesh(hosts=1, procs_per_host=1, device="cuda", startup_timeout_s=120) as m:
        with m.activate():
            t = remote(on_gpu)(m.rank("proc"), 4)
            summed = remote(all_reduce_sum)(t, m.process_group())
            assert inspect(remote(backend)(), shard=0) == "nccl"
            assert inspect(summed, shard=0).tolist() == [1.0] * 4


def test_a_tensor_engine_on_an_actor_proc_mesh_runs_on_each_procs_gpu() -> None:
    # The engine's workers run in actor procs, which see every GPU of the host: each
    # takes the one of its local rank (both share it when there is one).
    from palatine import spawn_tensor_engine, this_host

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        engine = spawn_tensor_engine(procs, device="cuda")
        with engine.activate():
            got = [inspect(remote(where)(), gpus=i) for i in range(2)]
            t = torch.ones(4, device="cuda") * 3
            assert inspect(remote(device_of)(t), gpus=1).startswith("cuda:")
            assert inspect(t, gpus=1).tolist() == [3.0] * 4
        count = torch.cuda.device_count()
        assert [g["device"] for g in got] == [f"cuda:{i % count}" for i in range(2)], got
    finally:
        procs.stop().get()
