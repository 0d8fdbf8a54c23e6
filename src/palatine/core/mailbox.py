"""Mailboxes and ports: handler, once and streaming ports; pending requests.

A `Mailbox` is an actor's (or client instance's) port table. Handler ports sit at the
message type's ``type_id``; ephemeral ports count up from 1024 and are never reused.
Every request that expects a reply is a *pending* port: it fails on the first of a
returned request, the destination proc declared dead, the deadline, or the owner
stopping — nothing waits forever.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import math
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from palatine.errors import (
    ActorStopping,
    CallTimeout,
    DeliveryError,
    PeerGoneError,
    PortClosed,
    RemoteException,
)
from palatine.ids import ActorId, PortId, ProcId
from palatine.wire.codec import (
    Message,
    decode_payload,
    encode_message,
    encode_message_oob,
    type_name_of,
)
from palatine.wire.envelope import ENC_MSGPACK, Envelope

__all__ = [
    "Mailbox",
    "ProcLink",
    "Port",
    "OncePort",
    "StreamPort",
    "Pending",
    "Gather",
    "ErrorReply",
    "Undeliverable",
    "FIRST_EPHEMERAL_PORT",
]

FIRST_EPHEMERAL_PORT = 1024

log = logging.getLogger(__name__)


class ProcLink(Protocol):
    """What a mailbox needs of the proc it lives in: its loop and the way out.

    `palatine.core.proc.Proc` is the one implementation; naming only this much keeps the
    mailbox below the proc, which builds on it.
    """

    loop: asyncio.AbstractEventLoop

    def post(self, env: Envelope) -> None:
        """Route ``env`` (local delivery or the router); a failure returns it."""

    def return_envelope(self, env: Envelope, error: str) -> None:
        """Return ``env`` to its sender with ``error`` appended."""


# Deadlines this long (the call default is an hour) share one sweep per loop instead of
# a loop timer each: a timer costs about 2 µs to arm and cancel, most of a call's budget.
SWEPT_TIMEOUT_S = 60.0
SWEEP_EVERY_S = 0.5


class _Swept:
    """A long deadline in its loop's `_Sweep`; ``cancel()`` as on a timer handle."""

    __slots__ = ("sweep", "when", "fire")

    def __init__(self, sweep: _Sweep, when: float, fire: Callable[[], None]) -> None:
        self.sweep = sweep
        self.when = when
        self.fire = fire

    def cancel(self) -> None:
        self.sweep.due.discard(self)


class _Sweep:
    """Fires long deadlines, checked every `SWEEP_EVERY_S` while any is set (so each
    fires at most that late: under 1 % of its length)."""

    __slots__ = ("_loop", "due", "handle")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # (the loop keys `_sweeps`: do not keep it alive)
        self.due: set[_Swept] = set()
        self.handle: asyncio.TimerHandle | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("the loop of this deadline sweep is gone")
        return loop

    def add(self, delay_s: float, fire: Callable[[], None]) -> _Swept:
        loop = self.loop
        swept = _Swept(self, loop.time() + delay_s, fire)
        self.due.add(swept)
        if self.handle is None:
            self.handle = loop.call_later(SWEEP_EVERY_S, self._run)
        return swept

    def _run(self) -> None:
        self.handle = None
        loop = self.loop
        try:
            now = loop.time()
            for swept in [s for s in self.due if s.when <= now]:
                self.due.discard(swept)
                try:
                    swept.fire()
                except Exception:  # one failing expiry must not hold up the others
                    log.exception("a request's deadline handler failed")
        finally:
            if self.due:
                self.handle = loop.call_later(SWEEP_EVERY_S, self._run)


_sweeps: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Sweep] = weakref.WeakKeyDictionary()


def _sweep_of(loop: asyncio.AbstractEventLoop) -> _Sweep:
    sweep = _sweeps.get(loop)
    if sweep is None:
        sweep = _sweeps[loop] = _Sweep(loop)
    return sweep


class ErrorReply(Message, kw_only=True):
    """A handler raised: the caller raises `RemoteException` with these fields."""

    type_name: str
    message: str
    traceback: str = ""
    actor_id: str = ""

    def to_error(self) -> RemoteException:
        return RemoteException(self.type_name, self.message, self.traceback, self.actor_id)


class Undeliverable(Message, array_like=True):
    """A returned envelope, routed back to its sender's undeliverable port."""

    envelope: Envelope


class Port(abc.ABC):
    """A bound port: `deliver` returns None, or an error text for the return path."""

    __slots__ = ("mailbox", "index")

    def __init__(self, mailbox: Mailbox, index: int) -> None:
        self.mailbox = mailbox
        self.index = index

    @property
    def id(self) -> PortId:
        return PortId(self.mailbox.actor_id, self.index)

    @abc.abstractmethod
    def deliver(self, env: Envelope) -> str | None:
        """Accept ``env`` (None) or say why not (an error text; the envelope is returned)."""

    def returned(self, env: Envelope) -> None:  # noqa: B027 - optional: most ports ignore it
        """A request that named this port as ``reply_to`` came back undeliverable."""

    def unbind(self) -> None:
        self.mailbox.ports.pop(self.index, None)


class HandlerPort(Port):
    """A typed handler port: decodes and hands the payload to ``sink(payload, env)``.

    It takes messages of its own type (its index is the type id), and of the other types
    ``accepts`` names (an actor's handler ports take any type it has a handler for); any
    other message is refused before it is decoded, as the sender's error."""

    __slots__ = ("sink", "type_name", "accepts")

    def __init__(
        self,
        mailbox: Mailbox,
        index: int,
        sink: Callable[[Any, Envelope], None],
        type_name: str,
        accepts: Callable[[int], bool] | None = None,
    ) -> None:
        super().__init__(mailbox, index)
        self.sink = sink
        self.type_name = type_name
        self.accepts = accepts

    def refusal(self, type_id: int) -> str | None:
        """Why a message of ``type_id`` is not taken here (None: it is)."""
        if type_id != self.index and (self.accepts is None or not self.accepts(type_id)):
            return f"mailbox error: {self.id} takes {self.type_name}, not {type_name_of(type_id)}"
        return None

    def deliver(self, env: Envelope) -> str | None:
        if env.type_id != self.index:
            refused = self.refusal(env.type_id)
            if refused is not None:
                return refused
        try:
            payload = decode_payload(env)
        except Exception as e:  # noqa: BLE001 - any decode failure
            return self.undecodable(env, e)
        self.sink(payload, env)
        return None

    def undecodable(self, env: Envelope, error: Exception) -> str | None:
        """A payload that does not decode: the sender's fault, returned to it."""
        return f"mailbox error: cannot decode {self.type_name} for {self.id}: {error}"


class StreamPort(Port):
    """A streaming port: any number of messages, FIFO; ``recv``/``try_recv``/``drain``."""

    __slots__ = ("_queue", "_waiter", "closed")

    def __init__(self, mailbox: Mailbox, index: int) -> None:
        super().__init__(mailbox, index)
        self._queue: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False

    def deliver(self, env: Envelope) -> str | None:
        if self.closed:
            return f"mailbox error: port {self.id} not bound"
        try:
            value = decode_payload(env)
        except Exception as e:  # noqa: BLE001 - a bad payload is the sender's error, not ours
            return f"mailbox error: cannot decode value for {self.id}: {e}"
        self._queue.append(value)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        return None

    def try_recv(self) -> Any:
        """The next queued value, or None when empty."""
        return self._queue.popleft() if self._queue else None

    def drain(self) -> list[Any]:
        """Everything queued now."""
        items = list(self._queue)
        self._queue.clear()
        return items

    async def recv(self, timeout: float | None = None) -> Any:
        """The next value; `TimeoutError` after ``timeout``; `PortClosed` once closed."""
        while not self._queue:
            if self.closed:
                raise PortClosed(f"port {self.id} is closed")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self._waiter
            finally:
                self._waiter = None
        return self._queue.popleft()

    def __aiter__(self) -> StreamPort:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.recv()
        except PortClosed:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Unbind: later deliveries are returned; a blocked ``recv`` raises `PortClosed`."""
        self.closed = True
        self.unbind()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class OncePort(StreamPort):
    """A once port: the first delivery unbinds it (a second is returned)."""

    __slots__ = ()

    def deliver(self, env: Envelope) -> str | None:
        if self.closed:
            return f"mailbox error: port {self.id} not bound"
        err = super().deliver(env)
        if err is None:
            self.closed = True
            self.unbind()
        return err

    async def recv(self, timeout: float | None = None) -> Any:
        if self._queue:
            return self._queue.popleft()
        if self.closed:
            raise PortClosed(f"port {self.id} is closed")
        self.closed = False
        return await super().recv(timeout)


class Pending(Port):
    """A request awaiting one reply; fails on return, peer death, deadline or stop."""

    __slots__ = ("future", "dest", "what", "timeout_s", "timer", "sink")

    def __init__(
        self,
        mailbox: Mailbox,
        index: int,
        dest: ActorId,
        what: str,
        timeout_s: float,
    ) -> None:
        super().__init__(mailbox, index)
        loop = mailbox.proc.loop
        self.future: asyncio.Future[Any] = loop.create_future()
        self.dest = dest
        self.what = what
        self.timeout_s = timeout_s
        self.timer: asyncio.TimerHandle | _Swept | None = None
        if timeout_s >= SWEPT_TIMEOUT_S:
            if math.isfinite(timeout_s):
                self.timer = _sweep_of(loop).add(timeout_s, self._expire)
        else:
            self.timer = loop.call_later(timeout_s, self._expire)
        # A thread-safe future completed synchronously with ours (saves a loop turn
        # for callers blocked in another thread): (future, transform or None).
        self.sink: tuple[Any, Callable[[Any], Any] | None] | None = None

    def set_sink(self, fut: Any, transform: Callable[[Any], Any] | None = None) -> None:
        """Also complete ``fut`` (a `palatine.Future`) the moment this request completes."""
        self.sink = (fut, transform)
        f = self.future
        if f.done():  # completed before the sink was attached
            if f.exception() is not None:
                fut.set_exception(f.exception())
            else:
                value = f.result()
                fut.set_result(value if transform is None else transform(value))

    def _resolve(self, value: Any) -> None:
        self.future.set_result(value)
        sink = self.sink
        if sink is not None:
            fut, transform = sink
            if transform is None:
                fut.set_result(value)
            else:
                try:
                    fut.set_result(transform(value))
                except Exception as e:  # noqa: BLE001 - surfaced to the waiter
                    fut.set_exception(e)

    def _reject(self, exc: BaseException) -> None:
        f = self.future
        f.set_exception(exc)
        if self.sink is not None:
            self.sink[0].set_exception(exc)
            # The caller holds the sink (its `.get()` raises there): the asyncio future is
            # only a spare for `await`, so its exception must not be logged as unretrieved.
            f.exception()

    def _finish(self) -> bool:
        if self.future.done():
            return False
        self.unbind()
        if self.timer is not None:
            self.timer.cancel()
        return True

    def deliver(self, env: Envelope) -> str | None:
        if self.future.done():
            return f"mailbox error: port {self.id} not bound"
        try:
            value = decode_payload(env)
        except Exception as e:  # noqa: BLE001 - a bad payload fails this call only
            self.fail(DeliveryError(f"mailbox error: cannot decode reply for {self.id}: {e}"))
            return None
        if self._finish():
            to_exc = getattr(type(value), "to_error", None)
            if to_exc is not None:
                self._reject(to_exc(value))
            else:
                self._resolve(value)
        return None

    def fail(self, exc: BaseException) -> None:
        if self._finish():
            self._reject(exc)

    def returned(self, env: Envelope) -> None:
        reason = "; ".join(env.errors or ()) or "returned"
        self.fail(DeliveryError(reason, env))

    def _expire(self) -> None:
        self.timer = None
        self.fail(
            CallTimeout(
                f"{self.what} to {self.dest} timed out: no reply within {self.timeout_s:g} s"
            )
        )

    def dest_procs(self) -> tuple[ProcId, ...]:
        return (self.dest.proc,)

    def peer_gone(self, proc: ProcId, exc: PeerGoneError) -> None:
        self.fail(exc)


class Gather(Pending):
    """A request cast to several ranks: one reply per selected rank (``call``/``stream``).

    Replies carry the ``cast_rank`` header. In gather mode the future completes with a
    dict rank -> value once all arrived (any failed rank fails it, naming the ranks);
    in stream mode each (rank, value-or-exception) is pushed to ``on_item`` as it comes.
    """

    __slots__ = ("expected", "results", "errors", "procs", "on_item")

    def __init__(
        self,
        mailbox: Mailbox,
        index: int,
        dest: ActorId,
        what: str,
        timeout_s: float,
        procs: dict[int, ProcId],
        on_item: Callable[[int, Any, BaseException | None], None] | None = None,
    ) -> None:
        super().__init__(mailbox, index, dest, what, timeout_s)
        self.procs = procs  # rank -> proc
        self.expected = len(procs)
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.on_item = on_item

    def _item(self, rank: int, value: Any, exc: BaseException | None) -> None:
        if rank in self.results or rank in self.errors or rank not in self.procs:
            return
        if exc is None:
            self.results[rank] = value
        else:
            self.errors[rank] = exc
        if self.on_item is not None:
            self.on_item(rank, value, exc)
        if len(self.results) + len(self.errors) >= self.expected:
            self._complete()

    def _complete(self) -> None:
        if not self._finish():
            return
        if self.errors and self.on_item is None:
            first = self.errors[min(self.errors)]
            if len(self.errors) > 1:
                ranks = ", ".join(str(r) for r in sorted(self.errors))
                first.add_note(f"{self.what} failed on ranks {ranks}")
            self._reject(first)
        else:
            self._resolve(self.results)

    def deliver(self, env: Envelope) -> str | None:
        if self.future.done():
            return f"mailbox error: port {self.id} not bound"
        rank = int((env.headers or {}).get("cast_rank", -1))
        try:
            value = decode_payload(env)
        except Exception as e:  # noqa: BLE001 - a bad payload fails this rank's item only
            self._item(rank, None, DeliveryError(f"cannot decode reply: {e}"))
            return None
        if type(value) is ErrorReply:
            self._item(rank, None, value.to_error())
        else:
            self._item(rank, value, None)
        return None

    def returned(self, env: Envelope) -> None:
        reason = "; ".join(env.errors or ()) or "returned"
        rank = (env.headers or {}).get("cast_rank")
        if rank is None:
            for r in list(self.procs):
                self._item(r, None, DeliveryError(reason, env))
        else:
            self._item(int(rank), None, DeliveryError(reason, env))

    def fail(self, exc: BaseException) -> None:
        # Deadline / owner stop: every rank still missing fails with ``exc``.
        for r in sorted(self.procs):
            if r not in self.results and r not in self.errors:
                self.errors[r] = exc
                if self.on_item is not None:
                    self.on_item(r, None, exc)
        self._complete()

    def dest_procs(self) -> tuple[ProcId, ...]:
        return tuple(self.procs.values())

    def peer_gone(self, proc: ProcId, exc: PeerGoneError) -> None:
        for r, p in self.procs.items():
            if p == proc:
                self._item(r, None, exc)


class Mailbox:
    """The port table of one actor or client instance."""

    __slots__ = ("actor_id", "actor_text", "proc", "ports", "_next_port", "state", "__weakref__")

    def __init__(self, actor_id: ActorId, proc: ProcLink) -> None:
        self.actor_id = actor_id
        self.actor_text = str(actor_id)  # for headers: formatting ids is not free
        self.proc = proc
        self.ports: dict[int, Port] = {}
        self._next_port = FIRST_EPHEMERAL_PORT
        # "open" | "stopping" | "stopped": governs what local delivery returns.
        self.state = "open"

    def _alloc(self) -> int:
        idx = self._next_port
        self._next_port = idx + 1
        return idx

    def bind_handler(
        self,
        type_id: int,
        sink: Callable[[Any, Envelope], None],
        type_name: str | None = None,
        accepts: Callable[[int], bool] | None = None,
    ) -> PortId:
        port = HandlerPort(self, type_id, sink, type_name or type_name_of(type_id), accepts)
        self.ports[type_id] = port
        return port.id

    def open_handler_port(
        self, type_id: int, sink: Callable[[Any, Envelope], None], type_name: str
    ) -> PortId:
        """A fresh port (index ≥ 1024) that hands messages of ``type_id`` to ``sink``."""
        port = HandlerPort(self, self._alloc(), sink, type_name, type_id.__eq__)
        self.ports[port.index] = port
        return port.id

    def open_port(self) -> StreamPort:
        """A streaming port (index ≥ 1024, never reused)."""
        port = StreamPort(self, self._alloc())
        self.ports[port.index] = port
        return port

    def open_once_port(self) -> OncePort:
        """A once port: accepts exactly one message."""
        port = OncePort(self, self._alloc())
        self.ports[port.index] = port
        return port

    def pending(self, dest: ActorId, what: str, timeout_s: float) -> Pending:
        """A pending single-reply request port (the caller posts with ``reply_to``)."""
        p = Pending(self, self._alloc(), dest, what, timeout_s)
        self.ports[p.index] = p
        return p

    def ask(self, dest: ActorId, msg: Any, timeout_s: float) -> asyncio.Future[Any]:
        """Typed request from this mailbox (loop thread); a loop future of the reply.

        A reply that is an error (`ErrorReply`, `Rejected`: any type with
        ``to_error``) fails the future with that exception.
        """
        tid = type(msg).__palatine_type_id__
        p = self.pending(dest, type(msg).__name__, timeout_s)
        env = Envelope(
            self.actor_id, PortId(dest, tid), tid, ENC_MSGPACK, encode_message(msg), p.id
        )
        self.proc.post(env)
        return p.future

    def tell(self, dest: ActorId | PortId, msg: Any) -> None:
        """One-way typed message to an actor's handler port, or to an explicit port."""
        self.proc.post(self.envelope(dest, msg))

    def envelope(self, dest: ActorId | PortId, msg: Any) -> Envelope:
        """The envelope `tell` sends (any thread)."""
        tid = type(msg).__palatine_type_id__
        port = dest if isinstance(dest, PortId) else PortId(dest, tid)
        data, buffers = encode_message_oob(msg)  # pickled values' buffers stay out of band
        env = Envelope(self.actor_id, port, tid, ENC_MSGPACK, data)
        if buffers:
            env.buffers = buffers
        return env

    def gather(
        self,
        dest: ActorId,
        what: str,
        timeout_s: float,
        procs: dict[int, ProcId],
        on_item: Callable[[int, Any, BaseException | None], None] | None = None,
    ) -> Gather:
        """A pending multi-reply port, one reply per rank in ``procs``."""
        g = Gather(self, self._alloc(), dest, what, timeout_s, procs, on_item)
        self.ports[g.index] = g
        return g

    def deliver(self, env: Envelope) -> str | None:
        """Local delivery checks (actor stopping, port bound, decode)."""
        if self.state != "open":
            return f"mailbox error: actor {self.actor_id} is {self.state}"
        port = self.ports.get(env.dest.port)
        if port is None:
            return f"mailbox error: port {env.dest} not bound"
        return port.deliver(env)

    def answered(self, env: Envelope) -> bool:
        """Whether ``env``, returned because its peer died, was a request of ours that had
        been answered already (its reply port is closed): the peer handled it, and died
        before acknowledging it on the channel. Nothing was lost; nobody needs telling."""
        rt = env.reply_to
        return (
            rt is not None
            and rt.actor == self.actor_id
            and rt.port >= FIRST_EPHEMERAL_PORT
            and rt.port not in self.ports
            and any(e.startswith("peer gone") for e in env.errors or ())
        )

    def returned(self, env: Envelope) -> bool:
        """A request we sent came back: fail the pending call it belonged to, if any."""
        rt = env.reply_to
        if rt is None or rt.actor != self.actor_id:
            return False
        port = self.ports.get(rt.port)
        if port is None:
            return False
        port.returned(env)
        return isinstance(port, Pending)

    def peer_gone(self, proc: ProcId, exc: PeerGoneError) -> None:
        for port in list(self.ports.values()):
            if isinstance(port, Pending) and proc in port.dest_procs():
                port.peer_gone(proc, exc)

    def close(self, reason: str = "stopped") -> None:
        """Unbind every port and fail pending calls with `ActorStopping`."""
        self.state = "stopped"
        for port in list(self.ports.values()):
            if isinstance(port, Pending):
                port.fail(ActorStopping(f"{self.actor_id} stopped while waiting: {reason}"))
            elif isinstance(port, StreamPort):
                port.close()
        self.ports.clear()
