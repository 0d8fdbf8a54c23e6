"""The client on a real local mesh of 4 workers."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import SupportsInt

import cloudpickle
import pytest

from palatine import (
    DeviceException,
    RemoteException,
    StuckWorkersException,
    fetch,
    inspect,
    local_mesh,
    remote,
)
from palatine.tensor.client.mesh import DeviceMesh

pytestmark = pytest.mark.timeout(120)

# Workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(__import__("sys").modules[__name__])


def divide(a: float, b: float) -> float:
    return a / b


def fail_on_rank(r: int, bad: int) -> int:
    if r == bad:
        raise ZeroDivisionError("division by zero on purpose")
    return r


def plus_one(x: int) -> int:
    return x + 1


def tensor_of(rank: int) -> object:
    import torch

    return torch.full((3,), float(rank + 1))


def all_reduce_sum(t: object, pg: object) -> object:
    import torch.distributed as dist

    dist.all_reduce(t, group=pg)  # type: ignore[arg-type]
    return t


def seeded_tensor(rank: SupportsInt, n: int) -> object:
    """Seeded by ``rank`` (an int, or ``mesh.rank``'s 0-dim tensor on a worker)."""
    import torch

    return torch.rand(n, generator=torch.Generator().manual_seed(int(rank)))


def seeded_array(rank: SupportsInt, n: int) -> object:
    """Seeded by ``rank`` (an int, or ``mesh.rank``'s 0-dim tensor on a worker)."""
    import numpy as np

    return np.random.default_rng(int(rank)).standard_normal(n)


def add_in_place(t: object, v: float) -> None:
    t.add_(v)  # type: ignore[attr-defined]


def spin(seconds: float) -> str:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "done"


def spin_on_world_rank(rank: int, seconds: float) -> str:
    """`spin` on world rank ``rank`` (its ``RANK`` variable), "ok" at once elsewhere."""
    return spin(seconds) if os.environ["RANK"] == str(rank) else "ok"


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    m = local_mesh(hosts=1, procs_per_host=4, startup_timeout_s=60)
    try:
        yield m
    finally:
        m.shutdown()


def test_remote_calls_and_fetches_on_four_workers(mesh: DeviceMesh) -> None:
    with mesh.activate():
        pid = remote(os.getpid)()
        r = mesh.rank("proc")
        y = remote(lambda a, b: a * b)(r, 10)
        assert fetch(y, shard={"host": 0, "proc": 2}).result(timeout=30) == 20
        pids = [inspect(pid, shard={"host": 0, "proc": p}) for p in range(4)]
        assert len(set(pids)) == 4 and os.getpid() not in pids
        z = remote(plus_one)(y)
        assert [inspect(z, shard=i) for i in range(4)] == [1, 11, 21, 31]
        assert inspect({"a": [r, 5]}, shard=3) == {"a": [3, 5]}


def touch(path: str) -> None:
    with open(path, "w") as f:
        f.write("ran")


def _switch_interval_in_a_forked_child() -> float:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, repr(sys.getswitchinterval()).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return float(f.read())


def test_calls_nobody_fetches_still_run_and_fetches_go_out_at_once(
    mesh: DeviceMesh, tmp_path: object
) -> None:
    session = mesh.session
    assert session.direct is not None  # a local mesh: calls leave on the direct session
    with mesh.activate():
        r = mesh.rank("proc")
        # Workers run SCHED_BATCH (they do not preempt the controller when it wakes them).
        policy = remote(os.sched_getscheduler)(0)
        assert [inspect(policy, shard=i) for i in range(4)] == [os.SCHED_BATCH] * 4
        # ... and switch the GIL every 1 ms: the loop thread answers while a stream spins.
        switch = remote(sys.getswitchinterval)()
        assert [inspect(switch, shard=i) for i in range(4)] == [0.001] * 4
        forked = remote(
            _switch_interval_in_a_forked_child
        )()  # ... which their children do not inherit
        assert inspect(forked, shard=0) == 0.005
        remote(lambda rank, d: touch(f"{d}/{rank}"))(r, str(tmp_path))
        # No fetch, no wait: the sweep sends the call within milliseconds.
        deadline = time.monotonic() + 10
        while len(os.listdir(str(tmp_path))) < 4:
            assert time.monotonic() < deadline, "a call nobody fetched never ran"
            time.sleep(0.005)
        t0 = time.monotonic()
        assert fetch(remote(plus_one)(r), shard=3).result(timeout=30) == 4
        assert time.monotonic() - t0 < 5


def test_without_lanes_batch_scheduling_or_gil_switching_the_loop_sends_for_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from palatine import config

    monkeypatch.setenv("PALATINE_LANES", "0")
    monkeypatch.setenv("PALATINE_WORKER_SCHED_BATCH", "0")
    monkeypatch.setenv("PALATINE_WORKER_SWITCH_INTERVAL_US", "0")
    with config.override(lanes=False):
        m = local_mesh(hosts=1, procs_per_host=2, startup_timeout_s=60)
        try:
            assert m.session.direct is None
            with m.activate():
                r = m.rank("proc")
                y = remote(plus_one)(r)
                remote(plus_one)(y)
                assert [inspect(y, shard=i) for i in range(2)] == [1, 2]
                policy = remote(os.sched_getscheduler)(0)
                assert [inspect(policy, shard=i) for i in range(2)] == [os.SCHED_OTHER] * 2
                switch = remote(sys.getswitchinterval)()
                assert [inspect(switch, shard=i) for i in range(2)] == [0.005] * 2  # Python's own
        finally:
            m.shutdown()


def test_each_worker_proc_sees_one_device_of_its_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """PALATINE_DEVICES_PER_HOST narrows CUDA_VISIBLE_DEVICES per proc before torch loads
    ; here on CPU workers, which only carry the setting."""
    monkeypatch.setenv("PALATINE_DEVICES_PER_HOST", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7,9")
    with local_mesh(hosts=1, procs_per_host=3, device="cpu", startup_timeout_s=60) as m:
        with m.activate():
            seen = remote(os.getenv)("CUDA_VISIBLE_DEVICES")
            assert [inspect(seen, shard=i) for i in range(3)] == ["5", "7", "5"]


def test_user_error_on_one_rank_has_both_tracebacks_and_independents_survive(
    mesh: DeviceMesh,
) -> None:
    with mesh.activate():
        r = mesh.rank("proc")
        bad = remote(fail_on_rank)(r, 1)  # issued here
        dependent = remote(plus_one)(bad)
        fine = remote(plus_one)(r)
        with pytest.raises(RemoteException) as ei:
            fetch(bad, shard=0).result(timeout=30)  # failed on rank 1: failed as a whole
        e = ei.value
        assert e.rank == 1 and e.world == "worker"
        assert "ZeroDivisionError" in e.exc_type
        assert "fail_on_rank" in e.traceback and "raise ZeroDivisionError" in e.traceback
        assert "test_client.py" in e.client_traceback and "bad = remote(fail_on_rank)" in str(e)
        assert "failed at s" in str(e) and "on rank 1 of world worker" in str(e)
        with pytest.raises(RemoteException) as dep:
            fetch(dependent, shard=2).result(timeout=30)
        assert dep.value.caused_by == e.caused_by
        assert any("which depends on" in n for n in getattr(dep.value, "__notes__", []))
        assert fetch(fine, shard=2).result(timeout=30) == 3


def test_all_reduce_across_four_workers(mesh: DeviceMesh) -> None:
    with mesh.activate():
        t = remote(tensor_of)(mesh.rank("proc"))
        summed = remote(all_reduce_sum)(t, mesh.process_group())
        for rank in range(4):
            assert inspect(summed, shard=rank).tolist() == [10.0, 10.0, 10.0]
        reduced = remote(tensor_of)(mesh.rank("proc")).reduce("proc", op="sum")
        assert inspect(reduced, shard=0).tolist() == [10.0, 10.0, 10.0]


def test_invalid_reduce_arguments_raise_before_anything_is_sent(mesh: DeviceMesh) -> None:
    with mesh.activate():
        t = remote(tensor_of)(mesh.rank("proc"))
        first = t.reduce("proc")  # the mesh's first collective also sets up its group
        bad = [
            ({"op": "median"}, "unknown reduce op 'median'"),
            ({"op": "stack", "in_place": True}, "op 'stack' cannot be in_place"),
            ({"scatter": True, "in_place": True}, "scatter and in_place cannot be combined"),
        ]
        for kwargs, text in bad:
            with pytest.raises(ValueError, match=text):
                t.reduce("proc", **kwargs)
        with pytest.raises(ValueError, match="dimension 'gpu' is not in the value's mesh"):
            t.reduce("gpu")
        summed = t.reduce("proc")
        assert summed.seq == first.seq + 1  # the refused ones took no seq: nothing was issued
        assert inspect(summed, shard=0).tolist() == [10.0, 10.0, 10.0]


def test_large_values_fetch_exactly_as_private_snapshots(mesh: DeviceMesh) -> None:
    """Tensors and arrays of several MiB travel out of band (worker → controller →
    client); each fetched value is exact, writable, and a snapshot of its own."""
    import numpy as np
    import torch

    n = 2**21  # 8 MiB of float32, 16 MiB of float64
    want = seeded_tensor(2, n)
    with mesh.activate():
        r = mesh.rank("proc")
        t = remote(seeded_tensor)(r, n)
        first = fetch(t, shard=2).result(timeout=60)
        assert isinstance(first, torch.Tensor) and torch.equal(first, want)
        pending = fetch(t, shard=2)
        remote(add_in_place, mutates=("t",), returns=0)(t, 1.0)  # right behind the fetch
        third = fetch(t, shard=2).result(timeout=60)
        second = pending.result(timeout=60)
        assert torch.equal(second, want)  # the value when it was fetched
        assert torch.equal(third, want + 1)
        first.mul_(0)  # a private, writable copy: the others are unaffected
        assert torch.equal(second, want) and torch.equal(third, want + 1)
        arrays = [fetch(remote(seeded_array)(r, n), shard=k) for k in (1, 3)]
        for k, fut in zip((1, 3), arrays, strict=True):
            got = fut.result(timeout=60)
            assert got.dtype == np.float64 and np.array_equal(got, seeded_array(k, n))


def test_sigkilled_worker_raises_device_exception_fast() -> None:
    with local_mesh(hosts=1, procs_per_host=4, startup_timeout_s=60):
        pids = [inspect(remote(os.getpid)(), shard=p) for p in range(4)]
        pending = fetch(remote(spin)(30.0), shard=0)
        t0 = time.monotonic()
        os.kill(pids[2], signal.SIGKILL)
        with pytest.raises(DeviceException) as ei:
            pending.result(timeout=10)
        took = time.monotonic() - t0
        e = ei.value
        assert took < 5.0, f"took {took:.2f} s"  # the spin would run 30 s
        assert e.kind == "proc_failed"
        assert e.rank == 2 and e.exit_signal == 9 and e.pid == pids[2]
        assert "SIGKILL" in str(e) and "worker[2]" in str(e)
        with pytest.raises(DeviceException):
            remote(os.getpid)()  # the session is failed: later calls raise at once


def test_stuck_worker_fails_with_rank_op_and_stack(caplog: pytest.LogCaptureFixture) -> None:
    with local_mesh(
        hosts=1,
        procs_per_host=4,
        operation_timeout_s=1.0,
        worker_progress_check_interval_s=0.3,
        fail_on_worker_timeout=True,
        startup_timeout_s=60,
    ):
        # The world rank from the worker's RANK variable, not mesh.rank: that is a tensor,
        # and the workers' first torch import would itself outlast the 1 s timeout.
        stuck = remote(spin_on_world_rank)(3, 60.0)
        with (
            caplog.at_level(logging.WARNING, logger="palatine"),
            pytest.raises(StuckWorkersException) as ei,
        ):
            fetch(stuck, shard=0).result(timeout=30)
        text = str(ei.value)
        assert "3" in text and "spin" in text


def test_only_failures_no_fetch_raised_are_warned_of_as_not_fetched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="palatine"):
        with local_mesh(hosts=1, procs_per_host=2) as m:
            r = m.rank("proc")
            fetched = remote(fail_on_rank)(r, 1)
            with pytest.raises(RemoteException):
                fetch(fetched, shard={"host": 0, "proc": 1}).result()
            # A value computed from a failed one: fetching it raises the root failure.
            derived = remote(plus_one)(remote(fail_on_rank)(r, 1))
            with pytest.raises(RemoteException):
                fetch(derived, shard={"host": 0, "proc": 1}).result()
            never = remote(fail_on_rank)(r, 1)  # noqa: F841 - never fetched
            assert fetch(remote(plus_one)(r), shard={"host": 0, "proc": 0}).result() == 1
            assert not [rec for rec in caplog.records if "not fetched" in rec.getMessage()]
    warned = [rec.getMessage() for rec in caplog.records if "not fetched" in rec.getMessage()]
    assert len(warned) == 1, warned
    assert warned[0].startswith("remote function ") and "fail_on_rank" in warned[0]
    assert "on rank 1 (not fetched): ZeroDivisionError: division by zero on purpose" in warned[0]


def test_a_failed_mesh_keeps_its_logs_and_says_where(
    caplog: pytest.LogCaptureFixture, tmp_path: object
) -> None:
    from pathlib import Path

    from palatine import config

    base = Path(str(tmp_path))
    with config.override(log_dir=str(base)), caplog.at_level(logging.WARNING, logger="palatine"):
        with local_mesh(hosts=1, procs_per_host=2) as m:
            logs = m._local.logs.path
            assert logs.parent == base
            pid = fetch(remote(os.getpid)(), shard={"host": 0, "proc": 1}).result()
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(DeviceException):
                fetch(remote(os.getpid)(), shard={"host": 0, "proc": 0}).result()
    kept = [
        rec.getMessage()
        for rec in caplog.records
        if "logs of this mesh are kept" in rec.getMessage()
    ]
    assert kept == [f"the logs of this mesh are kept in {logs}"]
    assert {p.name for p in logs.iterdir()} >= {"system.log", "host-0.log", "controller.log"}
    worker_logs = sorted(p.name for p in logs.glob("*/*/*.log"))
    assert worker_logs == ["worker_0.log", "worker_1.log"]
    assert "killed by signal 9" in (logs / "host-0.log").read_text()


def test_a_lost_controller_is_reported_with_its_log_file() -> None:
    with local_mesh(hosts=1, procs_per_host=2) as m:
        assert fetch(remote(plus_one)(m.rank("proc")), shard={"host": 0, "proc": 1}).result() == 2
        (ctl,) = [rp for rp in m._local.procs if rp.args[0] == "controller"]
        os.kill(ctl.pid, signal.SIGKILL)
        with pytest.raises(DeviceException) as ei:
            fetch(remote(plus_one)(m.rank("proc")), shard={"host": 0, "proc": 0}).result()
        log_file = m._local.logs.file("controller.log")
        text = str(ei.value)
        assert text.startswith("controller controller[0].root[0] (controller[0]) is gone: ")
        assert text.endswith(f" (its log: {log_file})")


def test_a_local_job_has_the_job_lifecycle_and_the_mesh_of_local_mesh() -> None:
    from palatine.job import LocalJob

    with LocalJob(hosts=1, procs_per_host=2) as job:
        assert job.state() == "Live"
        mesh = job.mesh()
        assert (mesh.names, mesh.sizes) == (["host", "proc"], [1, 2])
        with mesh.activate():
            assert (
                fetch(remote(plus_one)(mesh.rank("proc")), shard={"host": 0, "proc": 1}).result()
                == 2
            )
    assert job._mesh is None
