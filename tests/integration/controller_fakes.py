"""Test doubles for controller tests: a fake worker actor and a test client.

`FakeWorker` speaks the controller side of the worker protocol:
it answers ``RequestStatus`` with ``Status{seq + 1}`` (or holds the answers while told to
hang), answers ``ProgressQuery``, records the commands it receives, and can fail on
demand. Worker procs import this module by name (``controller_fakes.FakeWorker``): the
tests put this directory on ``PYTHONPATH`` and set ``PALATINE_CONTROLLER_WORKER_ACTOR_TYPE``.

`TestClient` is a client proc attached to the system from a private loop thread; it
attaches to the controller and collects the Results, Logs and Failures sent to it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from palatine.core.actor import Actor, handler
from palatine.ids import ActorId, ProcId
from palatine.protocol.worker import (
    CallFunction,
    CommandGroup,
    ExecutingOp,
    ProgressQuery,
    RequestStatus,
    Status,
    StreamProgress,
    WorkerParams,
    WorkerProgress,
)
from palatine.wire.codec import Message

__all__ = [
    "FakeConfig",
    "FakeQuery",
    "FakeState",
    "FakeWorker",
    "LoopThread",
    "SlowWorker",
    "TestClient",
    "sleepy",
]

FAKE_WORKER_TYPE = "controller_fakes.FakeWorker"


def sleepy(seconds: float) -> float:
    """A remote function for real workers: sleeps, so a stall report shows this frame."""
    time.sleep(seconds)
    return seconds


class FakeConfig(Message, kw_only=True):
    """Hold ``RequestStatus`` answers for seqs ≥ ``hang_from`` (None: answer, release
    held ones); ``panic`` fails the actor."""

    __palatine_name__ = "controller_fakes.FakeConfig"
    hang_from: int | None = None
    panic: bool = False


class FakeQuery(Message, kw_only=True):
    """Ask a fake worker what it was spawned with and what it received."""

    __palatine_name__ = "controller_fakes.FakeQuery"


class FakeState(Message, kw_only=True):
    """Reply to `FakeQuery`."""

    __palatine_name__ = "controller_fakes.FakeState"
    params: WorkerParams
    pid: int
    received: list[tuple[str, int, bool]]


class FakeWorker(Actor):
    """A worker actor that answers probes and progress queries and records commands."""

    __palatine_name__ = FAKE_WORKER_TYPE
    Params = WorkerParams

    def __init__(self, params: WorkerParams) -> None:
        if not 0 <= params.rank < params.world_size:
            raise ValueError(f"rank {params.rank} out of range for world size {params.world_size}")
        slow = os.environ.get("FAKE_WORKER_SLOW_SPAWN")  # "RANK:SECONDS": a slow constructor
        if slow and int(slow.split(":")[0]) == params.rank:
            time.sleep(float(slow.split(":")[1]))
        self.params = params
        self.hang_from: int | None = None
        self.hang_since = 0.0
        self.held: list[RequestStatus] = []
        self.received: list[tuple[str, int, bool]] = []

    def _answer(self, msg: RequestStatus) -> None:
        status = Status(seq=msg.seq + 1, rank=self.params.rank, controller=msg.controller)
        self.cx.mailbox.tell(self.params.controller_actor, status)

    @handler
    def on_request_status(self, msg: RequestStatus) -> None:
        self.received.append(("RequestStatus", msg.seq, msg.controller))
        if self.hang_from is not None and msg.seq >= self.hang_from:
            self.held.append(msg)
        else:
            self._answer(msg)

    @handler
    def on_call_function(self, msg: CallFunction) -> None:
        self.received.append(("CallFunction", msg.seq, False))

    @handler
    def on_command_group(self, msg: CommandGroup) -> None:
        for c in msg.commands:  # the fake handles the kinds it knows, in order
            if isinstance(c, RequestStatus):
                self.on_request_status(c)
            elif isinstance(c, CallFunction):
                self.on_call_function(c)
            else:
                self.received.append((type(c).__name__, getattr(c, "seq", -1), False))

    @handler
    def on_progress_query(self, msg: ProgressQuery) -> WorkerProgress:
        executing = None
        if self.hang_from is not None:
            executing = ExecutingOp(
                seq=self.hang_from,
                function="fake_op",
                running_for_s=time.monotonic() - self.hang_since,
            )
        stream = StreamProgress(id=0, name="main", executing=executing)
        return WorkerProgress(rank=self.params.rank, pid=os.getpid(), streams=[stream])

    @handler
    def on_fake_config(self, msg: FakeConfig) -> None:
        if msg.panic:
            raise RuntimeError("__test_panic called")
        self.hang_from = msg.hang_from
        self.hang_since = time.monotonic()
        if msg.hang_from is None:
            held, self.held = self.held, []
            for m in held:
                self._answer(m)

    @handler
    def on_fake_query(self, msg: FakeQuery) -> FakeState:
        return FakeState(params=self.params, pid=os.getpid(), received=list(self.received))


class SlowWorker(FakeWorker):
    """A fake worker whose ``init`` on rank 2 takes 3 s (a spawn that does not acknowledge)."""

    __palatine_name__ = "controller_fakes.SlowWorker"

    async def init(self) -> None:
        if self.params.rank == 2:
            await asyncio.sleep(3.0)


class LoopThread:
    """A private event loop on a daemon thread, for a test's system client."""

    def __init__(self) -> None:
        from palatine.core.runtime import new_event_loop

        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, fn: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 20.0) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        async def wrapped() -> Any:
            return fn()

        return self.run(wrapped, timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class TestClient:
    """A system client that can act as the controller's client and poke fake workers."""

    __test__ = False

    def __init__(self, system_addr: str, controller: str = "controller[0].root") -> None:
        from palatine.channel.addr import parse
        from palatine.protocol.controller import Failure, Log, Result, Results
        from palatine.system.service import System

        self.lt = LoopThread()
        self.controller = ActorId.parse(controller)
        self.sys = self.lt.run(lambda: System(parse(system_addr)).attach(timeout_s=10))
        self.id: ActorId = self.sys.client.id
        self.results: list[Any] = []
        self.logs: list[Any] = []
        self.failures: list[Any] = []
        self.events: list[tuple[float, Any]] = []
        mb = self.sys.mailbox
        for cls, sink in ((Result, self.results), (Log, self.logs), (Failure, self.failures)):

            def on(payload: Any, env: Any, sink: list[Any] = sink) -> None:
                sink.append(payload)
                self.events.append((time.monotonic(), payload))

            mb.bind_handler(cls.__palatine_type_id__, on, cls.__name__)

        def on_results(payload: Any, env: Any) -> None:
            now = time.monotonic()
            for r in payload.results:  # completions batched per Status: one Result each
                self.results.append(r)
                self.events.append((now, r))

        mb.bind_handler(Results.__palatine_type_id__, on_results, "Results")

    def snapshot(self, **kw: Any) -> dict[str, Any]:
        import json

        import msgspec

        snap = self.lt.run(lambda: self.sys.snapshot(**kw))
        return dict(json.loads(msgspec.json.encode(snap)))

    def ask(self, dest: ActorId, msg: Any, timeout_s: float = 10.0) -> Any:
        async def go() -> Any:
            return await self.sys.mailbox.ask(dest, msg, timeout_s)

        return self.lt.run(go, timeout_s + 5)

    def tell(self, msg: Any, dest: ActorId | None = None) -> None:
        self.lt.call(lambda: self.sys.mailbox.tell(dest or self.controller, msg))

    def attach(self) -> Any:
        from palatine.protocol.controller import Attach

        return self.ask(self.controller, Attach(client=self.id))

    def worker(self, rank: int, world: str = "worker", name: str = "worker") -> ActorId:
        return ProcId.parse(f"{world}[{rank}]").actor(name)

    def wait_for(self, pred: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout_s} s waiting for {what}; results={self.results} "
                    f"logs={self.logs} failures={self.failures}"
                )
            time.sleep(0.01)

    def close(self) -> None:
        try:
            self.lt.run(lambda: self.sys.close(), timeout=5)
        except Exception:  # noqa: BLE001, S110 - the system may be gone
            pass
        self.lt.close()
