"""The tensor worker in real procs.

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

from palatine import config
from palatine.channel.addr import any_addr
from palatine.channel.token import resolve_token, token_env
from palatine.core.actor import SupervisionEvent
from palatine.core.proc import ClientInstance, Proc
from palatine.errors import SpawnError
from palatine.ids import ActorId, WorldId
from palatine.protocol.agent import Spawn, Spawned
from palatine.protocol.worker import (
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
    FunctionRef,
    GetRefUnitTestsOnly,
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
from palatine.system.service import System, SystemClient, SystemHandle
from palatine.tensor.worker import WorkerActor
from palatine.tensor.worker.collectives import open_store
from palatine.tensor.worker.values import (
    dumps_args,
    dumps_value,
    function_ref,
    loads_value,
    pickle_function,
)
from palatine.testing.procs import proc_cluster
from palatine.wire.codec import Message

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

    async def status(
        self, seq: int, ranks: Sequence[int] | None = None, timeout: float = 5.0
    ) -> None:
        """RequestStatus(seq) and wait for Status(seq + 1) from every rank."""
        ranks = list(range(len(self.workers))) if ranks is None else list(ranks)
        self.send(RequestStatus(seq=seq), ranks=ranks)
        await until(
            lambda: (
                {r for r in ranks for m in self.rec.of(Status, r) if m.seq == seq + 1} == set(ranks)
            ),
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
        assert not isinstance(m.value, Err), f"fetch s{seq} failed: {m.value.error.message}"
        return loads_value(m.value.value)

    async def failure(self, timeout: float = 5.0) -> SupervisionEvent:
        return await until(
            lambda: self.failures[0] if self.failures else None, timeout, "actor failure"
        )  # type: ignore[no-any-return]


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
    from palatine.tensor.worker import worker_info

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
        assert (
            "failed to resolve function i.dont.exist"
            in ctl.rec.of(RemoteFunctionFailed)[0].error.message
        )

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


async def test_traceback_of_cloudpickled_function_shows_source_of_deleted_file(
    tmp_path: Any,
) -> None:
    path = tmp_path / "gone_module.py"
    src = "def fail(x):\n    y = x * 2\n    raise RuntimeError(f'gone {y}')  # the line\n"
    path.write_text(src)
    ns: dict[str, Any] = {"__name__": "gone_module_not_importable"}
    exec(compile(src, str(path), "exec"), ns)  # noqa: S102 - a function from a file that goes away
    fn = pickle_function(ns["fail"])
    assert fn.sources.get(str(path)) == src
    path.unlink()

    async def body(ctl: Ctl) -> None:
        ctl.send(CallFunction(seq=0, results=[0], function=fn, args=dumps_args((4,), {}), stream=0))
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
            "local_rank": int(os.environ.get("LOCAL_RANK", "1")),
            "device": "cpu",
            "proc_id": "w[1]",
            "stream": "main",
        }

    await with_workers(2, body)


async def test_mesh_rank_inside_a_remote_function_on_a_2_rank_mesh() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(
            CreateDeviceMesh(result=1, names=["x"], ranks=Slice(0, [2], [1])),
            fetch_call(0, lambda m: m.rank("x"), Ref(1)),
            fetch_call(1, "palatine.tensor.worker.collectives.mesh_rank", Ref(1), "x"),
        )
        assert [await ctl.fetched(0, r) for r in (0, 1)] == [0, 1]
        assert [await ctl.fetched(1, r) for r in (0, 1)] == [0, 1]

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
        ctl.send(call(0, "time.sleep", 2.0, stream=0), call(1, "time.sleep", 2.0, stream=1))
        await ctl.status(1, timeout=8.0)
        assert time.monotonic() - t0 < 3.5  # one after the other would take 4 s

    await with_workers(1, body, streams=((0, "main"), (1, "side")))


async def test_progress_query_answers_while_a_stream_is_stuck() -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(call(0, "time.sleep", 0.0), call(7, "time.sleep", 5.0), call(8, "time.sleep", 0.0))
        deadline = time.monotonic() + 10.0
        while True:  # until the stream runs s7
            got = await ctl.client.mailbox.ask(ctl.workers[0], ProgressQuery(), 5.0)
            ex = got.streams[0].executing
            if ex is not None and ex.seq == 7:
                break
            assert time.monotonic() < deadline, f"s7 never started: {got}"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # s7 has run for a while
        t0 = time.monotonic()
        got = await ctl.client.mailbox.ask(ctl.workers[0], ProgressQuery(), 5.0)
        assert time.monotonic() - t0 < 1.0  # not after the ~4.5 s that s7 still sleeps
        assert isinstance(got, WorkerProgress)
        assert got.rank == 0 and got.pid == os.getpid()
        (s,) = got.streams
        assert s.id == 0 and s.name == "main"
        assert s.executing is not None
        assert s.executing.seq == 7 and s.executing.function == "time.sleep"
        assert 0.2 < s.executing.running_for_s < 5.0
        assert s.queued == 1 and s.last_completed_seq == 0
        await ctl.status(8, timeout=10.0)

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
        ctl.send(call(0, "time.sleep", 0.3), fetch(1, "after sleep"), Exit(error="client ended"))
        ctl.send(fetch(2, "ignored: sent after Exit"))
        late = await ctl.get_ref(1)  # an ask after Exit is answered, not left to time out
        assert late.found is False and late.error == "worker rank 0 is exiting"
        assert await ctl.fetched(1, timeout=5.0) == "after sleep"
        assert await asyncio.wait_for(asyncio.shield(inst.terminal), 5.0) == "stopped"
        assert ctl.failures == []
        assert ctl.rec.fetched(2, 0) is None

    await with_workers(1, body)


async def test_request_status_without_streams_answers_at_once() -> None:
    async def body(ctl: Ctl) -> None:
        await ctl.status(41)

    await with_workers(1, body, streams=())


# --------------------------------------------------------------------------- infrastructure errors


@pytest.mark.parametrize(
    ("cmds", "text"),
    [
        (
            [call(0, identity, 1, results=[0]), call(1, identity, 2, results=[0])],
            "duplicate definition of ref r0",
        ),
        ([call(0, identity, 1, results=[0], stream=3)], "invalid stream id 3"),
        ([call(0, "__test_panic")], "__test_panic called"),
        ([CreateStream(id=0, name="again")], "duplicate stream id 0"),
        (
            [CreateDeviceMesh(result=4, names=["x"], ranks=Slice(1, [2], [1]))],
            "rank 0 is outside device mesh r4",
        ),
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


async def test_a_command_port_refuses_a_type_the_worker_does_not_handle() -> None:
    from palatine.errors import DeliveryError
    from palatine.ids import PortId
    from palatine.protocol.system import SystemStopping  # registered; no worker handler
    from palatine.wire.codec import encode_message
    from palatine.wire.envelope import ENC_MSGPACK, Envelope

    async def body(ctl: Ctl) -> None:
        mb = ctl.client.mailbox
        p = mb.pending(ctl.workers[0], "raw", 10.0)
        msg = SystemStopping(reason="x")
        tid = CallFunction.__palatine_type_id__
        mb.proc.post(
            Envelope(
                mb.actor_id,
                PortId(ctl.workers[0], tid),
                SystemStopping.__palatine_type_id__,
                ENC_MSGPACK,
                encode_message(msg),
                p.id,
            )
        )
        with pytest.raises(DeliveryError, match="takes CallFunction, not SystemStopping"):
            await p.future
        inst = ctl.procs[0].instance(ctl.workers[0])
        assert inst is not None and not inst.terminated  # the worker serves on

    await with_workers(1, body)


async def test_spawn_checks_rank_and_params_decode_from_msgpack() -> None:
    async with proc_cluster(1) as (procs, client):
        bad = WorkerParams(world_size=2, rank=2, device_index=None, controller_actor=client.id)
        with pytest.raises(SpawnError, match="rank 2 is outside the worker world of size 2"):
            await procs[0].spawn("worker", WorkerActor, bad)
        good = WorkerParams(world_size=1, rank=0, device_index=None, controller_actor=client.id)
        raw = msgspec.msgpack.encode(good)
        assert msgspec.msgpack.decode(raw, type=WorkerActor.Params) == good


async def test_device_index_without_cuda_warns_and_uses_cpu(
    caplog: pytest.LogCaptureFixture,
) -> None:
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
        pending = sorted(expect)  # seqs not yet covered by a Status, ascending
        for _r, m in ctl.rec.snapshot():
            if type(m) is Status:
                covered = m.seq - 1
                while pending and pending[0] <= covered:
                    s = pending.pop(0)
                    assert seen.get(s, 0) == expect[s], (s, m.seq)
                n_status += 1
            else:
                seen[m.seq] = seen.get(m.seq, 0) + 1
        assert n_status == len(statuses)
        assert not pending and seen == expect

    await with_workers(1, body, streams=((0, "main"), (1, "side")))


# --------------------------------------------------------------------------- without torch

NO_TORCH_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # as if torch were not installed
    import asyncio, json, os
    from palatine.testing.procs import proc_cluster
    from palatine.tensor.worker import WorkerActor
    from palatine.protocol.worker import (
        CreateStream, FetchResult, FunctionPath, Reduce, RemoteFunctionFailed, RequestStatus,
        SendValue, Status, WorkerParams, CallFunction, Ok,
    )
    from palatine.tensor.worker.values import dumps_args, loads_value

    async def main():
        got = []
        async with proc_cluster(1) as (procs, client):
            for cls in (Status, RemoteFunctionFailed, FetchResult):
                client.mailbox.bind_handler(cls.__palatine_type_id__, lambda m, e: got.append(m))
            params = WorkerParams(world_size=1, rank=0, device_index=None, controller_actor=client.id)
            w = await procs[0].spawn("worker", WorkerActor, params)
            no_args = dumps_args((), {})
            for cmd in (
                CreateStream(id=0, name="main", default=True),
                SendValue(seq=0, function=FunctionPath("os.getpid"), args=no_args, stream=0),
                CallFunction(seq=1, results=[1], function=FunctionPath("torch.ones"), args=dumps_args((2,), {}), stream=0),
                Reduce(seq=2, result=2, value=1, mesh=9, dims=["x"], stream=0),
                RequestStatus(seq=2),
            ):
                client.mailbox.tell(w, cmd)
            for _ in range(500):
                if any(type(m) is Status for m in got):
                    break
                await asyncio.sleep(0.01)
        out = []
        for m in got:
            if type(m) is FetchResult:
                out.append(["fetch", m.seq, loads_value(m.value.value) if type(m.value) is Ok else None])
            elif type(m) is RemoteFunctionFailed:
                out.append(["failed", m.seq, m.error.message])
            else:
                out.append(["status", m.seq])
        print(json.dumps({"pid": os.getpid(), "got": out, "torch": sys.modules.get("torch") is not None}))

    asyncio.run(main())
    """
)


@pytest.mark.timeout(60)
def test_without_torch_python_functions_work_and_torch_paths_fail() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH_SCRIPT],
        check=False,
        capture_output=True,
        text=True,
        timeout=50,
        cwd=os.getcwd(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["torch"] is False
    assert out["got"] == [
        ["fetch", 0, out["pid"]],
        ["failed", 1, "torch is not installed on worker rank 0"],
        ["failed", 2, "torch is not installed on worker rank 0"],
        ["status", 3],
    ]


# --------------------------------------------------------------------------- collectives (gloo, 4 processes)


class LoopThread:
    """A private event loop on a thread for the module's system and fake controller."""

    def __init__(self) -> None:
        from palatine.core.runtime import new_event_loop

        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

    def run(self, fn: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _start_worker_proc(
    world: str, rank: int, addr: str, env: dict[str, str], log_path: str
) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as errf:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "palatine",
                "worker",
                "--proc-id",
                f"{world}[{rank}]",
                "--bootstrap-addr",
                addr,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errf,
            env=env,
            start_new_session=True,
        )


def _wait_ready(p: subprocess.Popen[bytes], timeout: float, log_path: str) -> None:
    import select

    assert p.stdout is not None
    fd = p.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.05)
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            if b'"ready"' in buf:
                return
        elif p.poll() is not None:
            break
    with open(log_path, errors="replace") as f:
        raise RuntimeError(f"worker printed no ready line (exit {p.poll()}):\n{f.read()[-3000:]}")


class Gang:
    """Four ``palatine worker`` processes with WorkerActors spawned through their agents,
    collectives initialised; the test process plays the controller."""

    N = 4
    WORLD = "cw"
    MESH_2X2 = 1  # names host, proc
    MESH_1D = 2  # names proc
    CTX = 3

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.lt = LoopThread()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.rec = Recorder()
        self.system: SystemHandle = self.lt.run(lambda: System.serve(any_addr("unix")))
        self.client: SystemClient = self.lt.run(
            lambda: System(self.system.addr).attach(timeout_s=10)
        )
        self.lt.run(self._bind)
        self._seq = itertools.count(10)
        self._ref = itertools.count(100)
        self.workers = [WorldId(self.WORLD).proc(r).actor("worker") for r in range(self.N)]

    async def _bind(self) -> None:
        self.rec.bind(self.client.client)

    def start(self) -> None:
        env = dict(os.environ)
        env.update(token_env(resolve_token()))
        env["PALATINE_COLLECTIVE_TIMEOUT"] = "30"
        addr = str(self.system.addr)
        logs = [os.path.join(self.tmp, f"worker{r}.log") for r in range(self.N)]
        for r in range(self.N):
            self.procs.append(_start_worker_proc(self.WORLD, r, addr, env, logs[r]))
        for p, lp in zip(self.procs, logs, strict=True):
            _wait_ready(p, 30.0, lp)
        self.lt.run(self._spawn, timeout=60)
        self.send(
            CreateStream(id=0, name="main", default=True),
            CreateDeviceMesh(
                result=self.MESH_2X2, names=["host", "proc"], ranks=Slice(0, [2, 2], [2, 1])
            ),
            CreateDeviceMesh(result=self.MESH_1D, names=["proc"], ranks=Slice(0, [4], [1])),
        )
        s = self.seq()
        self.send(fetch_call(s, open_store), ranks=[0])
        # Rank 0 imports torch for this: in a fresh venv with a cold page cache that alone
        # has taken over 10 s (see the status wait below).
        store_addr = self.fetched(s, 0, timeout=80.0)
        assert isinstance(store_addr, str) and store_addr.startswith("127.0.0.1:")
        s = self.seq()
        self.send(BackendNetworkInit(seq=s, result=self.CTX, store_addr=store_addr, stream=0))
        # Four workers import torch here at once; on a fresh machine with a cold page cache
        # that alone has taken well over 10 s: leave room (the first test allows 120 s).
        self.status(timeout=80.0)
        assert not self.rec.of(RemoteFunctionFailed), self.rec.of(RemoteFunctionFailed)

    async def _spawn(self) -> None:
        async def one(r: int) -> None:
            params = WorkerParams(
                world_size=self.N, rank=r, device_index=None, controller_actor=self.client.client.id
            )
            msg = Spawn(
                actor_type="palatine.tensor.worker.WorkerActor",
                actor_name="worker",
                params=msgspec.msgpack.encode(params),
                params_encoding="msgpack",
            )
            agent = WorldId(self.WORLD).proc(r).actor("proc")
            got = await self.client.mailbox.ask(agent, msg, 60.0)
            assert isinstance(got, Spawned) and got.rank == r

        await asyncio.gather(*(one(r) for r in range(self.N)))

    def seq(self) -> int:
        return next(self._seq)

    def ref(self) -> int:
        return next(self._ref)

    def send(self, *cmds: Message, ranks: Sequence[int] | None = None) -> None:
        async def go() -> None:
            for r in range(self.N) if ranks is None else ranks:
                for cmd in cmds:
                    self.client.mailbox.tell(self.workers[r], cmd)

        self.lt.run(go)

    def wait(self, pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
        return self.lt.run(lambda: until(pred, timeout, what), timeout + 5)

    def status(self, timeout: float = 10.0) -> None:
        s = self.seq()
        self.send(RequestStatus(seq=s))
        self.wait(
            lambda: (
                {r for r, m in self.rec.snapshot() if type(m) is Status and m.seq == s + 1}
                == set(range(self.N))
            ),
            timeout,
            f"Status {s + 1}",
        )

    def result(self, seq: int, rank: int, timeout: float = 10.0) -> FetchResult:
        return self.wait(
            lambda: self.rec.fetched(seq, rank), timeout, f"FetchResult s{seq} from rank {rank}"
        )  # type: ignore[no-any-return]

    def fetched(self, seq: int, rank: int, timeout: float = 10.0) -> Any:
        m = self.result(seq, rank, timeout)
        assert not isinstance(m.value, Err), (
            f"fetch s{seq} on rank {rank} failed: {m.value.error.message}"
        )
        return loads_value(m.value.value)

    def fetch_all(self, ref: int, timeout: float = 10.0) -> list[Any]:
        s = self.seq()
        self.send(fetch(s, Ref(ref)))
        return [self.fetched(s, r, timeout) for r in range(self.N)]

    def make(self, fn: Callable[..., Any], *args: Any) -> int:
        """Run cloudpickled ``fn(*args)`` on every rank; the result's ref."""
        ref = self.ref()
        self.send(call(self.seq(), fn, *args, results=[ref], by_value=True))
        return ref

    def reduce(
        self, value: int, dims: Sequence[str], mesh: int = MESH_1D, **kw: Any
    ) -> tuple[int, int]:
        ref, s = self.ref(), self.seq()
        self.send(
            Reduce(seq=s, result=ref, value=value, mesh=mesh, dims=list(dims), stream=0, **kw)
        )
        return ref, s

    def close(self) -> None:
        try:
            self.send(Exit(error=None))
            time.sleep(0.3)
            self.lt.run(lambda: self.system.stop(2.0), timeout=15)
        except Exception:  # noqa: BLE001, S110 - killing below anyway
            pass
        try:
            self.lt.run(self.client.close, timeout=10)
        except Exception:  # noqa: BLE001, S110 - the system is gone already
            pass
        for p in self.procs:
            try:
                os.killpg(p.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait(5)
            if p.stdout is not None:
                p.stdout.close()
        self.lt.close()


@pytest.fixture(scope="module")
def gang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gang]:
    import cloudpickle

    # The worker processes cannot import this test module: ship its functions by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    g = Gang(str(tmp_path_factory.mktemp("gang")))
    try:
        g.start()
        yield g
    finally:
        g.close()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _rank_tensor(m: Any) -> Any:
    return torch.tensor([float(m.rank("proc"))])


def _rank_bits(m: Any) -> Any:
    return torch.tensor([16 | (1 << m.rank("proc"))], dtype=torch.int64)  # 17, 18, 20, 24


def _rank_offset_arange(m: Any) -> Any:
    return torch.arange(4.0) + 10 * m.rank("proc")


@pytest.mark.timeout(240)  # the first one also starts the gang (cold torch imports)
def test_reduce_ops_across_four_gloo_workers(gang: Gang) -> None:
    x = gang.make(_rank_tensor, Ref(Gang.MESH_1D))
    expected = {"sum": [6.0], "avg": [1.5], "max": [3.0], "min": [0.0], "product": [0.0]}
    for op, want in expected.items():
        ref, _ = gang.reduce(x, ["proc"], op=op)
        assert [t.tolist() for t in gang.fetch_all(ref)] == [want] * 4, op
    ref, _ = gang.reduce(x, ["proc"], op="stack")
    assert [t.tolist() for t in gang.fetch_all(ref)] == [[[0.0], [1.0], [2.0], [3.0]]] * 4
    y = gang.make(_rank_offset_arange, Ref(Gang.MESH_1D))
    ref, _ = gang.reduce(y, ["proc"], op="sum", scatter=True)
    assert [t.tolist() for t in gang.fetch_all(ref)] == [[60.0], [64.0], [68.0], [72.0]]
    ref, _ = gang.reduce(y, ["proc"], op="stack", scatter=True)
    assert [t.tolist() for t in gang.fetch_all(ref)] == [
        [float(i), 10.0 + i, 20.0 + i, 30.0 + i] for i in range(4)
    ]
    bits = gang.make(_rank_bits, Ref(Gang.MESH_1D))
    for op, want in {"band": 16, "bor": 31, "bxor": 15}.items():
        ref, _ = gang.reduce(bits, ["proc"], op=op)
        assert [t.tolist() for t in gang.fetch_all(ref)] == [[want]] * 4, op
    s = gang.seq()
    gang.send(fetch_call(s, "palatine.tensor.worker.collectives.backend_name"), ranks=[0])
    assert gang.fetched(s, 0) == "gloo"
    assert gang.rec.of(RemoteFunctionFailed) == []


@pytest.mark.timeout(240)  # the first one also starts the gang (cold torch imports)
def test_reduce_over_each_dim_of_a_2x2_mesh(gang: Gang) -> None:
    x = gang.make(_rank_tensor, Ref(Gang.MESH_1D))  # rank r holds [r]
    ref, _ = gang.reduce(x, ["proc"], mesh=Gang.MESH_2X2)
    assert [t.item() for t in gang.fetch_all(ref)] == [1.0, 1.0, 5.0, 5.0]
    ref, _ = gang.reduce(x, ["host"], mesh=Gang.MESH_2X2)
    assert [t.item() for t in gang.fetch_all(ref)] == [2.0, 4.0, 2.0, 4.0]
    ref, _ = gang.reduce(x, ["host", "proc"], mesh=Gang.MESH_2X2)
    assert [t.item() for t in gang.fetch_all(ref)] == [6.0] * 4


@pytest.mark.timeout(240)  # the first one also starts the gang (cold torch imports)
def test_reduce_in_place_and_into_out(gang: Gang) -> None:
    x = gang.make(_rank_tensor, Ref(Gang.MESH_1D))
    ref, _ = gang.reduce(x, ["proc"], in_place=True)
    assert [t.item() for t in gang.fetch_all(x)] == [6.0] * 4
    assert [t.item() for t in gang.fetch_all(ref)] == [6.0] * 4
    # The client may name the in-place result like its input (it is the same tensor).
    y = gang.make(_rank_tensor, Ref(Gang.MESH_1D))
    gang.send(
        Reduce(
            seq=gang.seq(),
            result=y,
            value=y,
            mesh=Gang.MESH_1D,
            dims=["proc"],
            op="max",
            in_place=True,
            stream=0,
        )
    )
    assert [t.item() for t in gang.fetch_all(y)] == [3.0] * 4
    out = gang.make(lambda: torch.zeros(1))
    src = gang.make(_rank_tensor, Ref(Gang.MESH_1D))
    ref, _ = gang.reduce(src, ["proc"], op="max", out=out)
    assert [t.item() for t in gang.fetch_all(out)] == [3.0] * 4
    bad_out = gang.make(lambda: torch.zeros(2))
    before = len(gang.rec.of(RemoteFunctionFailed))
    _ref, s = gang.reduce(src, ["proc"], out=bad_out)
    gang.status()
    fails = [m for m in gang.rec.of(RemoteFunctionFailed)[before:] if m.seq == s]
    assert len(fails) == 4
    assert "reduce out tensor has shape [2] but the result has shape [1]" in fails[0].error.message


def _fail_on_rank_1(m: Any) -> Any:
    if m.rank("proc") == 1:
        raise ValueError("input failed on rank 1")
    return torch.ones(1)


@pytest.mark.timeout(240)  # the first one also starts the gang (cold torch imports)
def test_reduce_whose_input_failed_on_one_rank_completes_everywhere(gang: Gang) -> None:
    before = len(gang.rec.of(RemoteFunctionFailed))
    x_seq = gang.seq()
    x = gang.ref()
    gang.send(call(x_seq, _fail_on_rank_1, Ref(Gang.MESH_1D), results=[x], by_value=True))
    t0 = time.monotonic()
    ref, _ = gang.reduce(x, ["proc"])
    s = gang.seq()
    gang.send(fetch(s, Ref(ref)))
    results = [gang.result(s, r, timeout=5.0) for r in range(4)]
    assert time.monotonic() - t0 < 5.0
    for r, m in enumerate(results):
        assert isinstance(m.value, Err), r
    assert results[1].value.error.message == "input failed on rank 1"
    assert results[1].value.error.seq == x_seq
    assert "failed on rank 1" in results[0].value.error.message
    assert results[0].value.error.seq == x_seq
    gang.status()
    fails = gang.rec.of(RemoteFunctionFailed)[before:]
    assert [(m.seq, m.error.rank) for m in fails] == [(x_seq, 1)]
    # With a factory the failed rank takes part with zeros; peers keep a value.
    ref, _ = gang.reduce(x, ["proc"], factory=Factory(size=[1], dtype="float32"))
    s = gang.seq()
    gang.send(fetch(s, Ref(ref)))
    got = [gang.result(s, r, timeout=5.0) for r in range(4)]
    assert isinstance(got[1].value, Err) and got[1].value.error.seq == x_seq
    assert [loads_value(got[r].value.value).item() for r in (0, 2, 3)] == [3.0] * 3
    # The mesh is still usable.
    y = gang.make(_rank_tensor, Ref(Gang.MESH_1D))
    ref, _ = gang.reduce(y, ["proc"])
    assert [t.item() for t in gang.fetch_all(ref)] == [6.0] * 4


def _shape_by_rank(m: Any) -> Any:
    return torch.ones(1 + m.rank("proc") % 2)


@pytest.mark.timeout(240)  # the first one also starts the gang (cold torch imports)
def test_inconsistent_reduce_inputs_are_a_user_error_on_every_rank(gang: Gang) -> None:
    before = len(gang.rec.of(RemoteFunctionFailed))
    x = gang.make(_shape_by_rank, Ref(Gang.MESH_1D))
    _ref, s = gang.reduce(x, ["proc"])
    gang.status()
    fails = [m for m in gang.rec.of(RemoteFunctionFailed)[before:] if m.seq == s]
    assert sorted(m.error.rank for m in fails) == [0, 1, 2, 3]
    assert "reduce inputs differ across ranks" in fails[0].error.message
    y = gang.make(_rank_tensor, Ref(Gang.MESH_1D))
    ref, _ = gang.reduce(y, ["proc"])
    assert [t.item() for t in gang.fetch_all(ref)] == [6.0] * 4


def _all_reduce_rank(pg: Any, m: Any) -> float:
    import torch.distributed as dist

    t = torch.tensor([float(m.rank("proc"))])
    dist.all_reduce(t, group=pg)
    return float(t.item())


@pytest.mark.timeout(240)  # the first one also starts the gang (cold torch imports)
def test_process_groups_in_remote_functions(gang: Gang) -> None:
    before = len(gang.rec.of(RemoteFunctionFailed))
    pg1, pg2, sub = gang.ref(), gang.ref(), gang.ref()
    gang.send(
        CreateProcessGroup(seq=gang.seq(), result=pg1, mesh=Gang.MESH_1D, dims=["proc"], stream=0),
        CreateProcessGroup(seq=gang.seq(), result=pg2, mesh=Gang.MESH_1D, dims=[], stream=0),
        CreateProcessGroup(seq=gang.seq(), result=sub, mesh=Gang.MESH_2X2, dims=["proc"], stream=0),
    )
    total = gang.make(_all_reduce_rank, Ref(pg1), Ref(Gang.MESH_1D))
    assert gang.fetch_all(total) == [6.0] * 4
    per_host = gang.make(_all_reduce_rank, Ref(sub), Ref(Gang.MESH_1D))
    assert gang.fetch_all(per_host) == [1.0, 1.0, 5.0, 5.0]
    distinct = gang.make(lambda a, b: a is not b and a.size() == b.size() == 4, Ref(pg1), Ref(pg2))
    assert gang.fetch_all(distinct) == [True] * 4
    world = gang.make(lambda g: g.size(), Ref(Gang.CTX))
    assert gang.fetch_all(world) == [4] * 4
    assert len(gang.rec.of(RemoteFunctionFailed)) == before


async def test_a_stream_abandoned_while_waiting_for_an_init_reports_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exit gives up on busy streams after its timeout; a stream that was waiting for a
    collective init on another stream unwinds quietly, not as a user error."""

    async def body(ctl: Ctl) -> None:
        inst = ctl.procs[0].instance(ctl.workers[0])
        assert inst is not None
        ctl.send(
            CreateDeviceMesh(result=1, names=["x"], ranks=Slice(0, [1], [1])),
            call(0, "time.sleep", 3.0),
            BackendNetworkInit(seq=1, result=2, store_addr="127.0.0.1:1", stream=0),
            CreateProcessGroup(seq=2, result=3, mesh=1, dims=["x"], stream=1),  # waits
            Exit(error="client ended"),
        )
        assert await asyncio.wait_for(asyncio.shield(inst.terminal), 5.0) == "stopped"
        await asyncio.sleep(0.5)  # the waiting stream checks every 0.1 s
        assert ctl.rec.of(RemoteFunctionFailed) == []
        assert ctl.failures == []

    with config.override(worker_exit_timeout_s=0.5):
        await with_workers(1, body, streams=((0, "main"), (1, "side")))


async def test_failed_collective_init_makes_later_groups_dependent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def body(ctl: Ctl) -> None:
        ctl.send(
            CreateDeviceMesh(result=1, names=["x"], ranks=Slice(0, [1], [1])),
            BackendNetworkInit(seq=0, result=2, store_addr="127.0.0.1:1", stream=0),
            CreateProcessGroup(seq=1, result=3, mesh=1, dims=["x"], stream=0),
            call(2, identity, Ref(3), results=[4]),
            call(3, identity, Ref(2), results=[5]),
        )
        await ctl.status(3, timeout=10.0)
        (rff,) = ctl.rec.of(RemoteFunctionFailed)
        assert rff.seq == 0 and rff.error.function == "backend_network_init"
        for ref in (4, 5):
            got = await ctl.get_ref(ref)
            assert got.error is not None and got.error.startswith("s0 failed"), got

    with config.override(collective_timeout_s=0.5):
        await with_workers(1, body)
