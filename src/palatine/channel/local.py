"""The in-process transport: ``local:N`` channels between procs of one process.

A process-global registry maps port N to its `LocalRx`; ports come from a counter that
starts at 1 and never reuses a number, so a stale address can never reach a newer
server. `LocalTx.post` hands the envelope object itself to the receiver (its payload is
already encoded, so later mutations by the sender are invisible): there is no framing,
no ack and no authentication, and failures are synchronous. Delivery to a handler is
batched per event-loop iteration, so a handler that posts again never recurses.

`InboundQueue` — the receiver-side queue behind ``Rx.recv`` — lives here too and is
shared with `palatine.channel.net`, which bounds it for back-pressure.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
from collections import deque
from collections.abc import Callable

from palatine.channel.addr import ChannelAddr
from palatine.channel.base import (
    EnvelopeHandler,
    PeerLostHandler,
    ReturnCallback,
    Rx,
    Tx,
    TxStatus,
)
from palatine.errors import AddrParseError, ChannelClosed
from palatine.wire.envelope import Envelope

__all__ = ["InboundQueue", "LocalRx", "LocalTx", "dial_local", "serve_local"]

logger = logging.getLogger(__name__)

_ports = itertools.count(1)
_served: dict[int, LocalRx] = {}

_SERVE_ANY_ONLY = "invalid local addr: serve local:0 to get a port"


class InboundQueue:
    """The FIFO of delivered envelopes behind ``Rx.recv``.

    ``limit`` (None = unbounded) is advisory: `put` always succeeds and reports whether
    the queue is now full, so a network receiver can pause reading. When a `get` brings
    the length back under half the limit, ``on_space`` runs (resume reading). After
    `close`, `get` drains what is left, then raises `ChannelClosed`.
    """

    __slots__ = ("_closed", "_items", "_low", "_waiters", "limit", "on_space")

    def __init__(self, limit: int | None = None) -> None:
        self._items: deque[Envelope] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False
        self.limit = limit
        self._low = 0 if limit is None else max(limit // 2, 1)
        self.on_space: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    def put(self, env: Envelope) -> bool:
        """Append ``env`` and wake one waiting `get`; True when the queue is now full."""
        self._items.append(env)
        waiters = self._waiters
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(None)
                break
        return self.limit is not None and len(self._items) >= self.limit

    def take_all(self) -> list[Envelope]:
        """Remove and return everything queued (used when a handler is installed)."""
        items = list(self._items)
        self._items.clear()
        return items

    async def get(self) -> Envelope:
        """The oldest envelope, waiting if there is none; `ChannelClosed` once closed and empty."""
        while not self._items:
            if self._closed:
                raise ChannelClosed("channel closed: the receiver was stopped")
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                # Pass a wake-up we cannot use on to the next waiter.
                if waiter.done() and not waiter.cancelled() and self._items:
                    self._wake_one()
                raise
        env = self._items.popleft()
        if self.on_space is not None and len(self._items) == self._low:
            self.on_space()
        return env

    def _wake_one(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    def close(self) -> None:
        """Refuse to wait any longer: wake every `get` (they drain, then raise)."""
        self._closed = True
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)


class LocalRx(Rx):
    """The serving end of ``local:N``: an unbounded queue or a synchronous handler."""

    def __init__(self, port: int) -> None:
        self.addr = ChannelAddr.local(port)
        self._port = port
        self._loop = asyncio.get_running_loop()
        self._queue = InboundQueue()
        self._handler: EnvelopeHandler | None = None
        self._batch: list[Envelope] = []
        self._scheduled = False
        self._stopped = False
        self._txs: weakref.WeakSet[LocalTx] = weakref.WeakSet()

    @property
    def stopped(self) -> bool:
        """Whether `stop` was called (the port is then freed for good)."""
        return self._stopped

    def _deliver(self, env: Envelope) -> None:
        if self._handler is None:
            self._queue.put(env)
            return
        self._batch.append(env)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._scheduled = False
        batch, self._batch = self._batch, []
        handler = self._handler
        if handler is None:  # pragma: no cover - a handler is never removed
            for env in batch:
                self._queue.put(env)
            return
        for env in batch:
            try:
                handler(env)
            except Exception:
                logger.exception("envelope handler of %s failed", self.addr)

    async def recv(self) -> Envelope:
        """The next delivered envelope; raises `ChannelClosed` after `stop` (once drained)."""
        return await self._queue.get()

    def set_handler(
        self, on_envelope: EnvelopeHandler, on_peer_lost: PeerLostHandler | None = None
    ) -> None:
        """Dispatch envelopes to ``on_envelope`` (once per loop iteration, in order).

        Local channels have no connections, so ``on_peer_lost`` is never called.
        """
        self._handler = on_envelope
        queued = self._queue.take_all()
        if queued:
            self._batch[:0] = queued
            if not self._scheduled:
                self._scheduled = True
                self._loop.call_soon(self._dispatch)

    async def stop(self) -> None:
        """Free the port for good and close every Tx dialed to it."""
        if self._stopped:
            return
        self._stopped = True
        if _served.get(self._port) is self:
            del _served[self._port]
        self._queue.close()
        reason = f"{self.addr} stopped"
        for tx in list(self._txs):
            tx._mark_closed(reason)


class LocalTx(Tx):
    """The sending end of ``local:N``: `post` enqueues at the receiver synchronously."""

    def __init__(self, rx: LocalRx) -> None:
        self.addr = rx.addr
        self._rx = rx
        self._status = TxStatus()
        self._callbacks: list[Callable[[str], None]] = []
        rx._txs.add(self)

    @property
    def status(self) -> TxStatus:
        """``Active``, or ``Closed(reason)`` once closed or once the receiver stopped."""
        return self._status

    def post(self, env: Envelope, on_return: ReturnCallback | None = None) -> None:
        """Enqueue ``env`` at the receiver; `ChannelClosed` (carrying it) when closed."""
        if self._status.closed:
            raise ChannelClosed(f"channel to {self.addr} is closed", envelope=env)
        rx = self._rx
        if rx._stopped:
            reason = f"{self.addr} stopped"
            self._mark_closed(reason)
            raise ChannelClosed(f"channel to {self.addr} is closed: {reason}", envelope=env)
        rx._deliver(env)

    async def send(self, env: Envelope) -> None:
        """Post ``env``; complete right after the enqueue (local channels have no acks)."""
        self.post(env)

    def on_closed(self, cb: Callable[[str], None]) -> None:
        """Call ``cb(reason)`` when this Tx closes (at once if it already has)."""
        if self._status.closed:
            cb(self._status.reason or "channel closed")
        else:
            self._callbacks.append(cb)

    async def close(self, flush_timeout_s: float = 1.0) -> list[Envelope]:
        """Close this Tx; nothing is ever unacknowledged, so this returns ``[]``."""
        self._mark_closed("channel closed")
        return []

    def _mark_closed(self, reason: str) -> None:
        if self._status.closed:
            return
        self._status = TxStatus(True, reason)
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(reason)
            except Exception:
                logger.exception("on_closed callback of the channel to %s failed", self.addr)


def serve_local(addr: ChannelAddr) -> tuple[ChannelAddr, LocalRx]:
    """Serve ``local:0`` on a fresh port (1, 2, 3, … never reused); needs a running loop.

    Raises `AddrParseError` (``invalid local addr: serve local:0 to get a port``) for
    any other port.
    """
    if addr.transport != "local":
        raise AddrParseError(f"not a local address: {addr}")
    if addr.port != 0:
        raise AddrParseError(_SERVE_ANY_ONLY)
    port = next(_ports)
    rx = LocalRx(port)
    _served[port] = rx
    return rx.addr, rx


def dial_local(addr: ChannelAddr) -> LocalTx:
    """A Tx to ``local:N``; raises `ChannelClosed` at once if nothing is served there."""
    logger.debug("dialing channel %s", addr)
    rx = _served.get(addr.port) if addr.transport == "local" else None
    if rx is None or rx.stopped:
        raise ChannelClosed(f"no channel is served at {addr}")
    return LocalTx(rx)
