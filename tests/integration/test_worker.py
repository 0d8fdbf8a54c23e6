"""The tensor worker in real procs (40-worker-client.md §5: worker and collective items).

Most tests run `WorkerActor`s in procs of a `proc_cluster` (one process, real channels)
and play the controller with the cluster's client instance, which records every
`Status`, `RemoteFunctionFailed` and `FetchResult` the workers send. Collectives need
one OS process per rank (torch.distributed has one default group per process), so
those tests start four ``palatine worker`` processes joined to an in-process system and
spawn the worker actors through their proc agents, exactly as the controller does.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import operator
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import msgspec
import pytest
import torch

from palatine.actor import SupervisionEvent
from palatine.channel.addr import any_addr
from palatine.channel.token import resolve_token, token_env
from palatine.errors import SpawnError
from palatine.ids import ActorId, WorldId
from palatine.proc import ClientInstance, Proc
from palatine.system.messages import Spawn, Spawned
from palatine.system.service import System, SystemClient, SystemHandle
from palatine.testing.procs import proc_cluster
from palatine.wire.codec import Message
from palatine.worker import WorkerActor
from palatine.worker.collectives import mesh_rank, open_store
from palatine.worker.messages import (
    BackendNetworkInit,
    BorrowCreate,
    BorrowDrop,
    BorrowFirstUse,
    BorrowLastUse,
    CallFunction,
    CommandGroup,
    CreateDeviceMesh,
    CreateProcessGroup,
    CreateStream,
    DeleteRefs,
    Err,
    Exit,
    Factory,
    FetchResult,
    FunctionPath,
    FunctionRef,
    GetRefUnitTestsOnly,
    Ok,
    ProgressQuery,
    Reduce,
    RefValue,
    RemoteFunctionFailed,
    RequestStatus,
    SendValue,
    SetRefUnitTestsOnly,
    Slice,
    Status,
    WorkerParams,
    WorkerProgress,
)
from palatine.worker.values import dumps_args, dumps_value, function_ref, loads_value, pickle_function

pytestmark = pytest.mark.timeout(60)

REPLY_TYPES: tuple[type[Message], ...] = (Status, RemoteFunctionFailed, FetchResult)


class Ref:
    """A stand-in for a client handle: pickles as the persistent id ``("ref", n)``."""

    def __init__(self, n: int) -> None:
        self.__palatine_ref__ = n


def fn_ref(fn: Callable[..., Any] | str, by_value: bool = False) -> FunctionRef:
    if by_value and not isinstance(fn, str):
        return pickle_function(fn)
    return function_ref(fn)


def call(
    seq: int,
    fn: Callable[..., Any] | str,
    *args: Any,
    results: Sequence[int | None] = (),
    mutates: Sequence[int] = (),
    stream: int = 0,
    by_value: bool = False,
    **kwargs: Any,
) -> CallFunction:
    return CallFunction(
        seq=seq,
        results=list(results),
        mutates=list(mutates),
        function=fn_ref(fn, by_value),
        args=dumps_args(args, kwargs),
        stream=stream,
    )


def fetch(seq: int, value: Any, *, stream: int = 0, mutates: Sequence[int] = ()) -> SendValue:
    """Identity SendValue: fetch ``value`` (refs substituted)."""
    return SendValue(seq=seq, mutates=list(mutates), args=dumps_args((value,), {}), stream=stream)


def fetch_call(
    seq: int,
    fn: Callable[..., Any] | str,
    *args: Any,
    stream: int = 0,
    mutates: Sequence[int] = (),
    by_value: bool = False,
    **kwargs: Any,
) -> SendValue:
    return SendValue(
        seq=seq,
        mutates=list(mutates),
        function=fn_ref(fn, by_value),
        args=dumps_args(args, kwargs),
        stream=stream,
    )


class Recorder:
    """The fake controller's inbox: what workers sent, with the sending rank."""

    def __init__(self) -> None:
        self.items: list[tuple[int, Any]] = []
        self.lock = threading.Lock()

    def bind(self, client: ClientInstance) -> None:
        for cls in REPLY_TYPES:
            client.mailbox.bind_handler(cls.__palatine_type_id__, self._sink, cls.__name__)

    def _sink(self, payload: Any, env: Any) -> None:
        with self.lock:
            self.items.append((env.sender.proc.rank, payload))

    def snapshot(self) -> list[tuple[int, Any]]:
        with self.lock:
            return list(self.items)

    def of(self, kind: type[Any], rank: int | None = None) -> list[Any]:
        return [m for r, m in self.snapshot() if type(m) is kind and (rank is None or r == rank)]

    def fetched(self, seq: int, rank: int) -> FetchResult | None:
        for m in self.of(FetchResult, rank):
            if m.seq == seq:
                return m  # type: ignore[no-any-return]
        return None


async def until(pred: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    """Poll ``pred`` (bounded) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


class Ctl:
    """A fake controller over an in-process `proc_cluster`: spawn workers, send, wait."""

    def __init__(self, procs: list[Proc], client: ClientInstance) -> None:
        self.procs = procs
        self.client = client
        self.rec = Recorder()
        self.rec.bind(client)
        self.workers: list[ActorId] = []
        self.failures: list[SupervisionEvent] = []
        for p in procs:
            p.set_supervision_coordinator(self.failures.append)

    async def spawn(self, n: int, streams: Sequence[tuple[int, str]] = ((0, "main"),)) -> None:
        for r in range(n):
            params = WorkerParams(
                world_size=n, rank=r, device_index=None, controller_actor=self.client.id
            )
            self.workers.append(await self.procs[r].spawn("worker", WorkerActor, params))
        for sid, name in streams:
            self.send(CreateStream(id=sid, name=name, default=sid == 0))

    def send(self, *cmds: Message, ranks: Sequence[int] | None = None) -> None:
        for r in range(len(self.workers)) if ranks is None else ranks:
            for cmd in cmds:
                self.client.mailbox.tell(self.workers[r], cmd)

    async def status(self, seq: int, ranks: Sequence[int] | None = None, timeout: float = 5.0) -> None:
        """RequestStatus(seq) and wait for Status(seq + 1) from every rank."""
        ranks = list(range(len(self.workers))) if ranks is None else list(ranks)
        self.send(RequestStatus(seq=seq), ranks=ranks)
        await until(
            lambda: {r for r in ranks for m in self.rec.of(Status, r) if m.seq == seq + 1} == set(ranks),
            timeout,
            f"Status {seq + 1}",
        )

    async def get_ref(self, ref: int, rank: int = 0, stream: int = 0) -> RefValue:
        got = await self.client.mailbox.ask(
            self.workers[rank], GetRefUnitTestsOnly(ref=ref, stream=stream), 5.0
        )
        assert isinstance(got, RefValue)
        return got

    async def value(self, ref: int, rank: int = 0, stream: int = 0) -> Any:
        got = await self.get_ref(ref, rank, stream)
        assert got.found and got.error is None, got
        assert got.value is not None
        return loads_value(got.value)

    async def fetched(self, seq: int, rank: int = 0, timeout: float = 5.0) -> Any:
        """The fetched value of ``seq`` from ``rank`` (raises on an Err)."""
        m = await until(lambda: self.rec.fetched(seq, rank), timeout, f"FetchResult s{seq}")
        if isinstance(m.value, Err):
            raise AssertionError(f"fetch s{seq} failed: {m.value.error.message}")
        return loads_value(m.value.value)

    async def failure(self, timeout: float = 5.0) -> SupervisionEvent:
        return await until(lambda: self.failures[0] if self.failures else None, timeout, "actor failure")  # type: ignore[no-any-return]


async def with_workers(
    n: int,
    body: Callable[[Ctl], Coroutine[Any, Any, None]],
    streams: Sequence[tuple[int, str]] = ((0, "main"),),
) -> None:
    async with proc_cluster(n) as (procs, client):
        ctl = Ctl(procs, client)
        await ctl.spawn(n, streams)
        await body(ctl)


# --------------------------------------------------------------------------- helpers run on workers

_DONE: list[int] = []


def record(i: int) -> int:
    _DONE.append(i)
    return i


def boom(x: Any = None) -> None:
    raise ZeroDivisionError("division by zero on purpose")


def three() -> tuple[int, int, int]:
    return (1, 2, 3)


def pair() -> tuple[str, str]:
    return ("a", "b")


def exit_now() -> None:
    raise SystemExit(3)


def identity(x: Any) -> Any:
    return x


def whoami() -> dict[str, Any]:
    from palatine.worker import worker_info

    return worker_info()


def fail_if(x: Any, bad: Any) -> Any:
    if x == bad:
        raise ValueError(f"bad input {x}")
    return x


def add(a: Any, b: Any) -> Any:
    return a + b


# --------------------------------------------------------------------------- calls and errors


async def test_ones_sub_zeros_allclose_binds_true_and_reports_nothing() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(
            call(0, "torch.ones", 2, 3, results=[0]),
            call(1, "torch.ones", 2, 3, results=[1]),
            call(2, "torch.Tensor.sub_", Ref(0), Ref(1), mutates=[0]),
            call(3, "torch.zeros", 2, 3, results=[2]),
            call(4, "torch.allclose", Ref(0), Ref(2), results=[3]),
        )
        await ctl.status(4)
        assert await ctl.value(3) is True
        assert torch.equal(await ctl.value(0), torch.zeros(2, 3))
        assert [type(m) for _r, m in ctl.rec.snapshot()] == [Status]

    await with_workers(1, body)


async def test_torch_error_is_one_remote_function_failed_with_torch_message() -> None:
    try:
        torch.rand()  # type: ignore[call-overload]
    except TypeError as e:
        expected = str(e)

    async def body(ctl: Ctl) -> None:
        ctl.send(call(0, "torch.rand", results=[0]))
        await ctl.status(0)
        msgs = ctl.rec.snapshot()
        assert [type(m) for _r, m in msgs] == [RemoteFunctionFailed, Status]
        rff = msgs[0][1]
        assert rff.seq == 0 and rff.error.seq == 0
        assert rff.error.message == expected
        assert rff.error.exc_type == "builtins.TypeError"
        assert rff.error.function == "torch.rand"
        assert rff.error.rank == 0 and rff.error.world == "w" and rff.error.proc_id == "w[0]"
        assert rff.error.pid == os.getpid() and rff.error.stream == "main"

    await with_workers(1, body)


async def test_unresolvable_function_poisons_mutated_ref_with_one_report() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(
            SetRefUnitTestsOnly(ref=0, value=dumps_value(5), stream=0),
            call(0, "i.dont.exist", Ref(0), mutates=[0]),
        )
        await ctl.status(0)
        got = await ctl.get_ref(0)
        assert got.found and got.error is not None
        assert "failed to resolve function i.dont.exist" in got.error
        assert [type(m) for _r, m in ctl.rec.snapshot()] == [RemoteFunctionFailed, Status]
        assert "failed to resolve function i.dont.exist" in ctl.rec.of(RemoteFunctionFailed)[0].error.message

    await with_workers(1, body)


async def test_dependent_call_runs_nothing_poisons_with_root_and_is_silent() -> None:
    async def body(ctl: Ctl) -> None:
        _DONE.clear()
        ctl.send(
            call(0, boom, results=[0]),
            call(1, record, Ref(0), results=[1, None]),
            call(2, add, Ref(1), 1, results=[2], mutates=[7]),
            call(3, record, 42, results=[3]),
        )
        await ctl.status(3)
        assert _DONE == [42]
        rffs = ctl.rec.of(RemoteFunctionFailed)
        assert [m.seq for m in rffs] == [0]
        for ref in (1, 2, 7):
            got = await ctl.get_ref(ref)
            assert got.error is not None and got.error.startswith("s0 failed on rank 0"), got
        assert await ctl.value(3) == 42

    await with_workers(1, body)


async def test_multiple_results_bind_in_order_and_none_discards() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(
            call(0, "os.path.split", "/fbs/fbc/foo/bar", results=[0, 1]),
            call(1, "os.path.split", "/x/y", results=[None, 2]),
        )
        await ctl.status(1)
        assert await ctl.value(0) == "/fbs/fbc/foo"
        assert await ctl.value(1) == "bar"
        assert await ctl.value(2) == "y"
        assert ctl.rec.of(RemoteFunctionFailed) == []

    await with_workers(1, body)


async def test_wrong_result_count_is_a_user_error() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(call(0, three, results=[0, 1]))
        await ctl.status(0)
        (rff,) = ctl.rec.of(RemoteFunctionFailed)
        assert rff.error.message == f"expected 2 results from {__name__}.three, got 3"
        assert (await ctl.get_ref(1)).error is not None

    await with_workers(1, body)


async def test_missing_ref_names_ref_stream_and_rank() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(call(0, identity, Ref(5), results=[0]), ranks=[2])
        await ctl.status(0, ranks=[2])
        (rff,) = ctl.rec.of(RemoteFunctionFailed)
        assert rff.error.message == "ref r5 not found on stream main of rank 2"
        assert rff.error.exc_type == "builtins.LookupError"

    await with_workers(3, body)


async def test_system_exit_in_user_code_is_a_user_error_and_worker_keeps_running() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(call(0, exit_now, results=[0]), call(1, identity, 7, results=[1]))
        await ctl.status(1)
        (rff,) = ctl.rec.of(RemoteFunctionFailed)
        assert rff.error.exc_type == "builtins.SystemExit" and rff.error.message == "3"
        assert await ctl.value(1) == 7
        assert ctl.failures == []

    await with_workers(1, body)


async def test_worker_traceback_has_user_frames_only_and_pickled_exception() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(call(0, boom, results=[0]))
        await ctl.status(0)
        (rff,) = ctl.rec.of(RemoteFunctionFailed)
        tb = rff.error.traceback
        assert 'raise ZeroDivisionError("division by zero on purpose")' in tb
        assert "palatine/worker" not in tb
        import pickle

        exc = pickle.loads(rff.error.exception)
        assert type(exc) is ZeroDivisionError and str(exc) == "division by zero on purpose"

    await with_workers(1, body)


async def test_traceback_of_cloudpickled_function_shows_source_of_deleted_file(tmp_path: Any) -> None:
    path = tmp_path / "gone_module.py"
    src = "def fail(x):\n    y = x * 2\n    raise RuntimeError(f'gone {y}')  # the line\n"
    path.write_text(src)
    ns: dict[str, Any] = {"__name__": "gone_module_not_importable"}
    exec(compile(src, str(path), "exec"), ns)
    fn = pickle_function(ns["fail"])
    assert fn.sources.get(str(path)) == src
    path.unlink()

    async def body(ctl: Ctl) -> None:
        ctl.send(
            CallFunction(seq=0, results=[0], function=fn, args=dumps_args((4,), {}), stream=0)
        )
        await ctl.status(0)
        (rff,) = ctl.rec.of(RemoteFunctionFailed)
        assert rff.error.message == "gone 8"
        assert "raise RuntimeError(f'gone {y}')  # the line" in rff.error.traceback
        assert str(path) in rff.error.traceback

    await with_workers(1, body)


async def test_worker_info_inside_a_remote_function() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(fetch_call(0, whoami), ranks=[1])
        info = await ctl.fetched(0, rank=1)
        assert info == {
            "world": "w",
            "rank": 1,
            "world_size": 2,
            "local_rank": int(os.environ.get("LOCAL_RANK", 1)),
            "device": "cpu",
            "proc_id": "w[1]",
            "stream": "main",
        }

    await with_workers(2, body)


# --------------------------------------------------------------------------- fetches


async def test_identity_fetch_substitutes_refs_and_var_mean_is_a_pair() -> None:
    async def body(ctl: Ctl) -> None:
        t = torch.arange(6.0).reshape(2, 3)
        ctl.send(
            SetRefUnitTestsOnly(ref=0, value=dumps_value(t), stream=0),
            fetch(0, ("x", Ref(0), [Ref(0)])),
            fetch_call(1, "torch.var_mean", Ref(0)),
        )
        got = await ctl.fetched(0)
        assert got[0] == "x" and torch.equal(got[1], t) and torch.equal(got[2][0], t)
        vm = await ctl.fetched(1)
        assert isinstance(vm, tuple) and len(vm) == 2
        var, mean = torch.var_mean(t)
        assert torch.equal(vm[0], var) and torch.equal(vm[1], mean)

    await with_workers(1, body)


async def test_fetch_with_unresolvable_function_then_fetch_of_mutated_ref() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(
            SetRefUnitTestsOnly(ref=2, value=dumps_value([1]), stream=0),
            fetch_call(0, "no.such.fn", Ref(2), mutates=[2]),
            fetch(1, Ref(2)),
        )
        await ctl.status(1)
        results = ctl.rec.of(FetchResult)
        assert [m.seq for m in results] == [0, 1]
        for m in results:
            assert isinstance(m.value, Err)
            assert "failed to resolve function no.such.fn" in m.value.error.message
            assert m.value.error.seq == 0
        assert [m.seq for m in ctl.rec.of(RemoteFunctionFailed)] == [0]

    await with_workers(1, body)


async def test_unpicklable_fetch_is_a_user_error_naming_the_type() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(
            call(0, "threading.Lock", results=[0]),
            fetch(1, Ref(0)),
            fetch(2, "still fine"),
        )
        await ctl.status(2)
        (rff,) = ctl.rec.of(RemoteFunctionFailed)
        assert rff.seq == 1
        assert "cannot pickle a value of type _thread.lock" in rff.error.message
        m = ctl.rec.fetched(1, 0)
        assert m is not None and isinstance(m.value, Err)
        assert await ctl.fetched(2) == "still fine"

    await with_workers(1, body)


# --------------------------------------------------------------------------- refs and streams


async def test_set_ref_and_get_ref_absent_errored_value() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(SetRefUnitTestsOnly(ref=1, value=dumps_value({"a": 1}), stream=0))
        ctl.send(call(0, boom, results=[2]))
        absent = await ctl.get_ref(9)
        assert absent.found is False and absent.error is None and absent.value is None
        errored = await ctl.get_ref(2)
        assert errored.found and errored.error is not None and "ZeroDivisionError" in errored.error
        assert await ctl.value(1) == {"a": 1}

    await with_workers(1, body)


async def test_delete_refs_on_every_stream_keeps_others_and_ignores_unknown() -> None:
    async def body(ctl: Ctl) -> None:
        for sid in (0, 1):
            ctl.send(
                SetRefUnitTestsOnly(ref=1, value=dumps_value("one"), stream=sid),
                SetRefUnitTestsOnly(ref=2, value=dumps_value("two"), stream=sid),
            )
        ctl.send(CreateDeviceMesh(result=5, names=["x"], ranks=Slice(0, [1], [1])))
        ctl.send(DeleteRefs(refs=[1, 5, 999]))
        for sid in (0, 1):
            assert (await ctl.get_ref(1, stream=sid)).found is False
            assert await ctl.value(2, stream=sid) == "two"
        ctl.send(call(0, identity, Ref(5), results=[3]))
        await ctl.status(0)
        (rff,) = ctl.rec.of(RemoteFunctionFailed)
        assert rff.error.message == "ref r5 not found on stream main of rank 0"

    await with_workers(1, body, streams=((0, "main"), (1, "side")))


async def test_earlier_commands_still_see_deleted_refs() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(
            call(0, "time.sleep", 0.2),
            call(1, "torch.ones", 2, results=[0]),
            fetch(2, Ref(0)),
            DeleteRefs(refs=[0]),
        )
        assert torch.equal(await ctl.fetched(2), torch.ones(2))
        assert (await ctl.get_ref(0)).found is False

    await with_workers(1, body)


async def test_status_after_100_calls_over_two_streams_comes_once_after_all() -> None:
    async def body(ctl: Ctl) -> None:
        _DONE.clear()
        done_at_status: list[int] = []
        orig = ctl.rec._sink

        def sink(payload: Any, env: Any) -> None:
            if type(payload) is Status:
                done_at_status.append(len(_DONE))
            orig(payload, env)

        for cls in REPLY_TYPES:
            ctl.client.mailbox.bind_handler(cls.__palatine_type_id__, sink, cls.__name__)
        for i in range(100):
            ctl.send(call(i, record, i, stream=i % 2))
        ctl.send(RequestStatus(seq=100))
        await until(lambda: ctl.rec.of(Status), what="Status")
        await asyncio.sleep(0.1)
        assert [m.seq for m in ctl.rec.of(Status)] == [101]
        assert done_at_status == [100]
        assert sorted(_DONE) == list(range(100))

    await with_workers(1, body, streams=((0, "main"), (1, "side")))


async def test_two_streams_sleeping_one_second_run_in_parallel() -> None:
    async def body(ctl: Ctl) -> None:
        t0 = time.monotonic()
        ctl.send(call(0, "time.sleep", 1.0, stream=0), call(1, "time.sleep", 1.0, stream=1))
        await ctl.status(1, timeout=3.0)
        assert time.monotonic() - t0 < 1.8

    await with_workers(1, body, streams=((0, "main"), (1, "side")))


async def test_progress_query_answers_while_a_stream_is_stuck() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(call(0, "time.sleep", 0.0), call(7, "time.sleep", 2.0), call(8, "time.sleep", 0.0))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        got = await ctl.client.mailbox.ask(ctl.workers[0], ProgressQuery(), 2.0)
        assert time.monotonic() - t0 < 0.1
        assert isinstance(got, WorkerProgress)
        assert got.rank == 0 and got.pid == os.getpid()
        (s,) = got.streams
        assert s.id == 0 and s.name == "main"
        assert s.executing is not None
        assert s.executing.seq == 7 and s.executing.function == "time.sleep"
        assert 0.2 < s.executing.running_for_s < 2.0
        assert s.queued == 1 and s.last_completed_seq == 0
        await ctl.status(8, timeout=5.0)

    await with_workers(1, body)


async def test_command_group_is_like_separate_sends() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(
            CommandGroup(
                commands=[
                    call(0, "os.path.split", "/a/b", results=[0, 1]),
                    call(1, boom, results=[2]),
                    call(2, add, Ref(1), "!", results=[3]),
                ]
            ),
            RequestStatus(seq=2),
        )
        await until(lambda: ctl.rec.of(Status), what="Status")
        assert [type(m) for _r, m in ctl.rec.snapshot()] == [RemoteFunctionFailed, Status]
        assert await ctl.value(3) == "b!"

    await with_workers(1, body)


async def test_borrow_moves_a_value_between_streams() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(
            call(0, "torch.ones", 3, results=[0], stream=0),
            call(1, boom, results=[1], stream=0),
            BorrowCreate(borrow=1, result=10, value=0, from_stream=0, to_stream=1),
            BorrowFirstUse(borrow=1),
            call(2, "torch.mul", Ref(10), 2, results=[11], stream=1),
            BorrowCreate(borrow=2, result=12, value=1, from_stream=0, to_stream=1),
            BorrowFirstUse(borrow=2),
            call(3, identity, Ref(12), results=[13], stream=1),
            BorrowLastUse(borrow=1),
            BorrowDrop(borrow=1),
            BorrowLastUse(borrow=2),
            BorrowDrop(borrow=2),
        )
        await ctl.status(3)
        assert torch.equal(await ctl.value(11, stream=1), torch.full((3,), 2.0))
        assert (await ctl.get_ref(10, stream=1)).found is False
        dep = await ctl.get_ref(13, stream=1)
        assert dep.error is not None and dep.error.startswith("s1 failed")
        assert [m.seq for m in ctl.rec.of(RemoteFunctionFailed)] == [1]
        assert torch.equal(await ctl.value(0, stream=0), torch.ones(3))

    await with_workers(1, body, streams=((0, "main"), (1, "side")))


async def test_exit_lets_queued_work_finish_then_stops_the_actor() -> None:
    async def body(ctl: Ctl) -> None:
        inst = ctl.procs[0].instance(ctl.workers[0])
        assert inst is not None
        ctl.send(call(0, "time.sleep", 0.3), fetch(1, "after sleep"), Exit(error=None))
        assert await ctl.fetched(1, timeout=5.0) == "after sleep"
        assert await asyncio.wait_for(asyncio.shield(inst.terminal), 5.0) == "stopped"
        assert ctl.failures == []

    await with_workers(1, body)


async def test_request_status_without_streams_answers_at_once() -> None:
    async def body(ctl: Ctl) -> None:
        await ctl.status(41)

    await with_workers(1, body, streams=())


# --------------------------------------------------------------------------- infrastructure errors


@pytest.mark.parametrize(
    ("cmds", "text"),
    [
        ([call(0, identity, 1, results=[0]), call(1, identity, 2, results=[0])], "duplicate definition of ref r0"),
        ([call(0, identity, 1, results=[0], stream=3)], "invalid stream id 3"),
        ([call(0, "__test_panic")], "__test_panic called"),
        ([CreateStream(id=0, name="again")], "duplicate stream id 0"),
        ([CreateDeviceMesh(result=4, names=["x"], ranks=Slice(1, [2], [1]))], "rank 0 is outside device mesh r4"),
        ([BorrowFirstUse(borrow=77)], "unknown borrow 77"),
    ],
)
async def test_infrastructure_errors_fail_the_worker_actor(cmds: list[Message], text: str) -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(*cmds)
        ev = await ctl.failure()
        assert ev.actor_id == "w[0].worker[0]"
        assert text in ev.message, ev.message
        inst = ctl.procs[0].instance(ctl.workers[0])
        assert inst is None or inst.terminated

    await with_workers(1, body)


async def test_undecodable_command_fails_the_worker_actor() -> None:
    from palatine.ids import PortId
    from palatine.wire.envelope import ENC_MSGPACK, Envelope

    async def body(ctl: Ctl) -> None:
        tid = CallFunction.__palatine_type_id__
        env = Envelope(ctl.client.id, PortId(ctl.workers[0], tid), tid, ENC_MSGPACK, b"\xc1garbage")
        ctl.client.proc.post(env)
        ev = await ctl.failure()
        assert "undecodable CallFunction command" in ev.message

    await with_workers(1, body)


async def test_spawn_checks_rank_and_params_decode_from_msgpack() -> None:
    async with proc_cluster(1) as (procs, client):
        bad = WorkerParams(world_size=2, rank=2, device_index=None, controller_actor=client.id)
        with pytest.raises(SpawnError, match="rank 2 is outside the worker world of size 2"):
            await procs[0].spawn("worker", WorkerActor, bad)
        good = WorkerParams(world_size=1, rank=0, device_index=None, controller_actor=client.id)
        raw = msgspec.msgpack.encode(good)
        assert msgspec.msgpack.decode(raw, type=WorkerActor.Params) == good


async def test_device_index_without_cuda_warns_and_uses_cpu(caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    async with proc_cluster(1) as (procs, client):
        ctl = Ctl(procs, client)
        params = WorkerParams(world_size=1, rank=0, device_index=0, controller_actor=client.id)
        ctl.workers.append(await procs[0].spawn("worker", WorkerActor, params))
        ctl.send(CreateStream(id=0, name="main", default=True), fetch_call(0, whoami))
        assert (await ctl.fetched(0))["device"] == "cpu"
        assert "device_index 0 requested but CUDA is not available; using CPU" in caplog.text


# --------------------------------------------------------------------------- ordering


async def test_errors_and_fetches_always_precede_the_status_covering_them() -> None:
    """10,000 randomized commands over two streams: for every Status{s+1}, each
    RemoteFunctionFailed / FetchResult of a seq <= s arrived before it."""
    rng = random.Random(1234)

    async def body(ctl: Ctl) -> None:
        expect: dict[int, int] = {}  # seq -> number of messages it must produce
        statuses: list[int] = []
        seq = 0
        for _ in range(10_000):
            stream = rng.randrange(2)
            k = rng.random()
            if k < 0.1:
                ctl.send(RequestStatus(seq=seq - 1 if seq else 0))
                statuses.append(seq - 1 if seq else 0)
                continue
            if k < 0.35:
                ctl.send(call(seq, boom, stream=stream))
                expect[seq] = 1
            elif k < 0.55:
                ctl.send(fetch(seq, seq, stream=stream))
                expect[seq] = 1
            elif k < 0.6:
                ctl.send(fetch_call(seq, boom, stream=stream))
                expect[seq] = 2
            else:
                ctl.send(call(seq, identity, seq, stream=stream))
            seq += 1
        ctl.send(RequestStatus(seq=seq))
        statuses.append(seq)
        await until(lambda: any(m.seq == seq + 1 for m in ctl.rec.of(Status)), 30.0, "final Status")
        seen: dict[int, int] = {}
        n_status = 0
        for _r, m in ctl.rec.snapshot():
            if type(m) is Status:
                covered = m.seq - 1
                for s, want in expect.items():
                    if s <= covered:
                        assert seen.get(s, 0) == want, (s, m.seq)
                n_status += 1
            else:
                seen[m.seq] = seen.get(m.seq, 0) + 1
        assert n_status == len(statuses)

    await with_workers(1, body, streams=((0, "main"), (1, "side")))
