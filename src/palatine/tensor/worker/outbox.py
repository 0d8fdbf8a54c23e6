"""A worker's outbox: what its streams and its loop send, in the order they made it.

Stream threads encode what they produce for the controller (`WorkerState.send`) and
queue it here without waking anybody; at their flush points (before user code, before a
wait, after each work item: `palatine.tensor.worker.stream`) they send what is queued for the
controller's proc themselves, on the worker's direct session
(`palatine.fastpath.direct_tx`). Everything else — messages for other procs, the actor's
failure, and everything when there is no direct session — the actor's loop drains, in
order. The direct session and the loop never interleave: a flush backs off while a
drain is scheduled, and the drain sends on the direct session under the same lock.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from palatine.errors import InfrastructureError
from palatine.fastpath.direct_tx import DirectTx
from palatine.ids import ActorId, PortId, ProcId
from palatine.tensor.worker.state import OutItem, current_stream
from palatine.wire.envelope import ENC_MSGPACK, Envelope

__all__ = ["Outbox"]

log = logging.getLogger(__name__)


class Outbox:
    """One worker actor's ordered outbox (module doc)."""

    def __init__(self, controller: ProcId, fail: Callable[[InfrastructureError], None]) -> None:
        self._controller = controller
        self._fail = fail
        self._items: collections.deque[OutItem] = collections.deque()
        self._lock = threading.Lock()
        self._drain_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sender: ActorId | None = None
        self._post: Callable[[Envelope], None] | None = None
        self.direct: DirectTx | None = None  # the session to the controller's proc, if local

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        sender: ActorId,
        post: Callable[[Envelope], None],
        direct: DirectTx | None,
    ) -> None:
        """Begin sending (the actor's loop, once its proc is known)."""
        self._loop = loop
        self._sender = sender
        self._post = post
        self.direct = direct
        with self._lock:
            pending = bool(self._items)  # emitted before the start: the loop sends it now
            self._drain_scheduled = self._drain_scheduled or pending
        if pending:
            loop.call_soon(self.drain)

    def emit(self, item: OutItem) -> None:
        """Queue ``item`` (any thread). A stream thread only queues: it sends at its next
        flush point (`flush`); any other thread has the loop drain it."""
        with self._lock:
            self._items.append(item)
            if self._drain_scheduled or current_stream() is not None:
                return
            self._drain_scheduled = True
        self._wake_drain()

    def flush(self) -> None:
        """A stream's flush point: send the queued messages for the controller's proc on
        the direct session from this thread, and have the loop drain anything else."""
        if not self._items or self._drain_scheduled:
            return
        with self._lock:
            items = self._items
            if not items or self._drain_scheduled:
                return
            direct = self.direct
            if direct is not None:
                envs = []
                while items and self._is_direct(items[0]):
                    envs.append(self._envelope(items.popleft()))  # type: ignore[arg-type]
                if envs:
                    direct.send(envs)  # under the lock: in outbox order
                if not items:
                    return
            self._drain_scheduled = True
        self._wake_drain()

    def drain(self) -> None:
        """Send everything queued (loop thread)."""
        self._drain(self.direct)

    async def close(self, timeout_s: float) -> None:
        """Send what is queued and close the direct session (loop thread). What is
        emitted afterwards goes through the loop."""
        with self._lock:
            direct, self.direct = self.direct, None
        self._drain(direct)
        if direct is not None:
            await direct.aclose(timeout_s)

    def _drain(self, direct: DirectTx | None) -> None:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._drain_scheduled = False
            if direct is not None:
                envs, rest = [], []
                for i in items:
                    if self._is_direct(i):
                        envs.append(self._envelope(i))  # type: ignore[arg-type]
                    else:
                        rest.append(i)
                if envs:
                    direct.send(envs)  # under the lock: after what streams sent
                items = rest
        post = self._post
        assert post is not None
        for item in items:
            if isinstance(item, InfrastructureError):
                self._fail(item)
                continue
            post(self._envelope(item))

    def _is_direct(self, item: OutItem) -> bool:
        return type(item) is tuple and item[0].actor.proc == self._controller

    def _envelope(self, item: tuple[PortId, int, bytes, list[Any]]) -> Envelope:
        port, tid, data, buffers = item
        assert self._sender is not None
        env = Envelope(self._sender, port, tid, ENC_MSGPACK, data)
        if buffers:
            env.buffers = buffers
        return env

    def _wake_drain(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self.drain)
        except RuntimeError:  # the loop is closed: the process is going away
            log.debug("worker outbox: loop closed; %d items dropped", len(self._items))
