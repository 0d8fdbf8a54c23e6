"""Streams, borrows, value lifetime on a real local mesh.

Covers: streams of one mesh run in parallel and keep order within a stream; a value on
another stream is a `TypeError` until borrowed with ``to_stream``; a borrow gives the
right value (waiting for the source), stays errored when the source failed, is
read-only (not in ``mutates``), and releases its slot when dropped or collected;
dropped values raise `TypeError` naming where they were dropped and are deleted on the
workers (read back with ``GetRefUnitTestsOnly``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest

from palatine import RemoteException, fetch, inspect, local_mesh, remote
from palatine.core import runtime
from palatine.ids import ActorId, ProcId, WorldId
from palatine.protocol.worker import GetRefUnitTestsOnly, RefValue
from palatine.tensor.client.mesh import DeviceMesh
from palatine.tensor.client.values import RemoteValue

pytestmark = pytest.mark.timeout(60)

# Workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(__import__("sys").modules[__name__])


def after(seconds: float, value: Any) -> Any:
    time.sleep(seconds)
    return value


def stamped_sleep(seconds: float) -> tuple[float, float]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


def plus_one(x: int) -> int:
    return x + 1


def divide(a: float, b: float) -> float:
    return a / b


def new_list() -> list[int]:
    return []


def append_slowly(lst: list[int], i: int, delay: float) -> None:
    time.sleep(delay)
    lst.append(i)


def rank_times(r: int, k: int) -> int:
    return r * k


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    m = local_mesh(hosts=1, procs_per_host=2, startup_timeout_s=60)
    try:
        yield m
    finally:
        m.shutdown()


def get_ref(mesh: DeviceMesh, ref: int, stream: int, rank: int = 0) -> RefValue:
    """Read ``ref`` on ``stream`` of worker ``rank`` directly (the worker's test hook)."""
    s = mesh.session
    worker = ActorId(ProcId(WorldId(s.worker_world), rank), s.worker_name, 0)
    ask = GetRefUnitTestsOnly(ref=ref, stream=stream)
    got = runtime.call(lambda: s.mailbox.ask(worker, ask, 10.0)).result(timeout=15)
    assert isinstance(got, RefValue)
    return got


def wait_gone(mesh: DeviceMesh, ref: int, stream: int, timeout: float = 5.0) -> None:
    """Poll until ``ref`` is absent on ``stream`` of every rank (drops flush within 1 s)."""
    deadline = time.monotonic() + timeout
    for rank in mesh.ranks:
        while get_ref(mesh, ref, stream, rank).found:
            assert time.monotonic() < deadline, f"r{ref} still on stream {stream} of rank {rank}"
            time.sleep(0.05)


@pytest.mark.timeout(30)
def test_a_slow_side_stream_does_not_block_main(mesh: DeviceMesh) -> None:
    side = mesh.stream("side")
    with mesh.activate():
        with side.activate():
            slow = remote(stamped_sleep)(3.0)
        assert slow.stream.name == "side"
        t0 = time.monotonic()
        quick = remote(stamped_sleep)(0.0)
        assert quick.stream.name == "main"
        assert time.monotonic() - t0 < 2.0  # issuing never waits (for the 3 s side call)
        # a fetch completes once every stream passed its seq, so
        # compare the workers' own clocks: main ran while side was still sleeping
        for shard in range(len(mesh)):
            (s0, s1), (q0, _) = inspect(slow, shard=shard), inspect(quick, shard=shard)
            assert s0 <= q0 + 1.5 and q0 < s1 - 1.5, (s0, s1, q0)


@pytest.mark.timeout(30)
def test_order_holds_within_a_stream(mesh: DeviceMesh) -> None:
    side = mesh.stream("order")
    app = remote(append_slowly, mutates=("lst",), returns=0)
    with mesh.activate(), side.activate():
        lst = remote(new_list)()
        for i in range(8):
            app(lst, i, 0.04 * (8 - i))  # earlier calls sleep longer
        assert [inspect(lst, shard=r) for r in range(len(mesh))] == [list(range(8))] * len(mesh)


@pytest.mark.timeout(30)
def test_other_stream_needs_to_stream_which_gives_the_right_value(mesh: DeviceMesh) -> None:
    side = mesh.stream("side")
    with mesh.activate():
        r = mesh.rank("proc")
        x = remote(rank_times)(r, 10)
        with side.activate():
            with pytest.raises(TypeError, match="stream 'main'"):
                remote(plus_one)(x)
            y = x.to_stream(side)
            assert isinstance(y, RemoteValue) and y.borrowed and not x.borrowed
            assert y.stream.name == "side" and y.mesh is x.mesh and y.ref != x.ref
            assert "stream side" in repr(y) and "borrowed" in repr(y)
            z = remote(plus_one)(y)
            assert [inspect(z, shard=i) for i in range(len(mesh))] == [1, 11]
            assert [inspect(y, shard=i) for i in range(len(mesh))] == [0, 10]
        # the source is untouched and still usable where it lives
        assert inspect(x, shard=1) == 10
        assert x.to_stream(mesh.stream("main")) is x
        with pytest.raises(TypeError, match="Stream"):
            x.to_stream("side")  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_borrow_waits_for_a_slow_source(mesh: DeviceMesh) -> None:
    side = mesh.stream("side")
    with mesh.activate():
        slow = remote(after)(1.0, 7)  # on main
        with side.activate():
            b = slow.to_stream(side)
            c = remote(plus_one)(b)
        assert inspect(c, shard=1) == 8
        # back from side to main (a borrow of a borrow)
        back = c.to_stream(mesh.stream("main"))
        assert inspect(remote(plus_one)(back)) == 9


@pytest.mark.timeout(30)
def test_an_errored_value_borrowed_stays_errored(mesh: DeviceMesh) -> None:
    side = mesh.stream("side")
    with mesh.activate():
        bad = remote(divide)(1.0, 0.0)
        with side.activate():
            b = bad.to_stream(side)
            dependent = remote(plus_one)(b)
        for v in (b, dependent):
            with pytest.raises(RemoteException) as ei:
                fetch(v).result(timeout=15)
            assert ei.value.caused_by == bad.seq
            assert "ZeroDivisionError" in str(ei.value)
        with side.activate():
            assert inspect(remote(plus_one)(1)) == 2  # the session keeps working


@pytest.mark.timeout(30)
def test_a_borrowed_value_is_read_only(mesh: DeviceMesh) -> None:
    side = mesh.stream("side")
    with mesh.activate():
        lst = remote(new_list)()
        b = lst.to_stream(side)
        with pytest.raises(TypeError, match="borrowed"):
            b.check_mutable("lst")
        lst.check_mutable("lst")  # an owned value may be mutated


@pytest.mark.timeout(30)
def test_a_borrowed_value_in_mutates_is_a_type_error_before_sending(mesh: DeviceMesh) -> None:
    side = mesh.stream("side")
    with mesh.activate():
        lst = remote(new_list)()
        b = lst.to_stream(side)
        with side.activate():
            before = mesh.session.results.pending.copy()
            with pytest.raises(TypeError, match="borrowed"):
                remote(append_slowly, mutates=("lst",), returns=0)(b, 1, 0.0)
            assert set(mesh.session.results.pending) <= set(before)


@pytest.mark.timeout(30)
def test_dropped_values_raise_and_are_deleted_on_the_workers(mesh: DeviceMesh) -> None:
    side = mesh.stream("side")
    main_id, side_id = mesh.stream("main").id, side.id
    with mesh.activate():
        x = remote(plus_one)(1)
        b = x.to_stream(side)
        assert inspect(b) == 2
        assert get_ref(mesh, b.ref, side_id).found
        assert not get_ref(mesh, b.ref, main_id).found  # refs are stream-local

        # dropping the borrowed handle: BorrowLastUse unbinds it on side, BorrowDrop frees it
        b.drop()
        line = test_dropped_values_raise_and_are_deleted_on_the_workers.__code__.co_firstlineno
        with pytest.raises(TypeError, match=r"dropped at test_client_streams\.py:\d+") as ei:
            fetch(b)
        assert int(str(ei.value).rsplit(":", 1)[1]) > line
        with side.activate(), pytest.raises(TypeError, match="dropped"):
            remote(plus_one)(b)
        with pytest.raises(TypeError, match="dropped"):
            b.to_stream(mesh.stream("main"))
        wait_gone(mesh, b.ref, side_id)
        assert inspect(x) == 2  # the source lives on

        # dropping an owned value: DeleteRefs reaches every rank
        x.drop()
        x.drop()  # idempotent
        with pytest.raises(TypeError, match="dropped at"):
            remote(plus_one)(x)
        with pytest.raises(TypeError, match="dropped at"):
            x.to_stream(side)
        wait_gone(mesh, x.ref, main_id)
        assert inspect(remote(plus_one)(5)) == 6


@pytest.mark.timeout(30)
def test_collected_borrows_are_released(mesh: DeviceMesh) -> None:
    side = mesh.stream("side")
    side_id = side.id
    with mesh.activate():
        x = remote(plus_one)(10)
        refs = []
        for _ in range(20):
            b = x.to_stream(side)
            with side.activate():
                assert inspect(b, shard=1) == 11
            refs.append(b.ref)
        del b
        gc.collect()
        # no further send: the idle flush (≤ 1 s) carries BorrowLastUse/BorrowDrop
        for ref in refs:
            wait_gone(mesh, ref, side_id)
        # the source stream passed every BorrowDrop: a new borrow and new work still run
        y = x.to_stream(side)
        with side.activate():
            assert inspect(remote(plus_one)(y), shard=1) == 12
        assert inspect(x) == 11
