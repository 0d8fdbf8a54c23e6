"""Ports and channels: a place a value can be sent to, by whoever holds it, from anywhere.

A `Port` names a port of some actor's mailbox (and, for one rank of a mesh call, that
rank). It pickles, so it travels as an argument: an endpoint declared with
``@endpoint(explicit_response_port=True)`` receives its caller's reply port as its first
argument and answers through it when it likes (now, from a later message, from another
actor it passed the port to), instead of by returning. `Channel.open` makes a port and
the `PortReceiver` that reads what is sent to it, in send order per sender.

These are Monarch's names (``monarch.actor.Channel``, ``Port``, ``PortReceiver``).
"""

from __future__ import annotations

import asyncio
import traceback
from typing import Any, Generic, TypeVar

from palatine import config
from palatine.core import runtime
from palatine.core.future import Future, on_loop_thread
from palatine.core.mailbox import ErrorReply, StreamPort
from palatine.core.sender import caller_mailbox
from palatine.errors import ValueTooLarge
from palatine.ids import PortId
from palatine.wire.codec import PICKLED_VALUE_TID, dumps, encode_message
from palatine.wire.envelope import ENC_MSGPACK, ENC_PICKLE, Envelope

__all__ = ["Port", "PortReceiver", "Channel"]

T = TypeVar("T")


def _type_name(kind: type) -> str:
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


class Port(Generic[T]):
    """Where to send one kind of value: ``port.send(value)``, ``port.exception(exc)``.

    Sending never blocks and works from any thread, inside an actor or not; messages one
    sender sends to one port arrive in order. A port whose receiver is gone returns the
    message to its sender (a warning there), as any undeliverable message.
    """

    __slots__ = ("port_id", "rank")

    def __init__(self, port_id: PortId | None, rank: int | None = None) -> None:
        self.port_id = port_id
        self.rank = rank  # the mesh rank a reply through this port stands for

    def __reduce__(self) -> tuple[Any, ...]:
        return (Port, (self.port_id, self.rank))

    def __repr__(self) -> str:
        return f"Port({self.port_id}{'' if self.rank is None else f', rank={self.rank}'})"

    def send(self, value: T) -> None:
        """Send ``value`` (any picklable object) to the port."""
        if self.port_id is None:
            return  # the reply port of a one-way call: nobody waits
        try:
            data, bufs = dumps(value)
        except Exception as e:
            raise TypeError(f"cannot send a {_type_name(type(value))} to {self}: {e}") from e
        nbytes = len(data) + sum(memoryview(b).nbytes for b in bufs)
        too_large = config.value_too_large(f"a value sent to {self}", nbytes)
        if too_large is not None:
            raise ValueTooLarge(too_large)
        self._post(PICKLED_VALUE_TID, ENC_PICKLE, data, bufs)

    def exception(self, exc: BaseException) -> None:
        """Send ``exc``: the receiver (or the caller waiting on the reply) raises it as a
        `palatine.RemoteException` with its type, message and traceback."""
        if self.port_id is None:
            return
        kind = type(exc)
        err = ErrorReply(
            type_name=_type_name(kind),
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
        )
        self._post(ErrorReply.__palatine_type_id__, ENC_MSGPACK, encode_message(err), [])

    def _post(self, type_id: int, encoding: int, data: bytes, bufs: list[Any]) -> None:
        dest = self.port_id
        assert dest is not None
        headers: dict[str, str | int] | None = (
            None if self.rank is None else {"cast_rank": self.rank}
        )

        def go() -> None:
            mb = caller_mailbox()
            env = Envelope(mb.actor_id, dest, type_id, encoding, data, None, headers, None, bufs)
            mb.proc.post(env)

        runtime.post(go)


class PortReceiver(Generic[T]):
    """The reading end of a `Channel`: ``recv()`` is a `palatine.Future` of the next value
    (a value sent with `Port.exception` raises there)."""

    __slots__ = ("_port",)

    def __init__(self, port: StreamPort) -> None:
        self._port = port

    def recv(self, timeout: float | None = None) -> Future[T]:
        """The next value; `TimeoutError` when none came within ``timeout`` seconds."""
        port = self._port

        def go() -> asyncio.Task[Any]:
            return asyncio.get_running_loop().create_task(port.recv(timeout))

        return runtime.call(go, _raise_error_reply)

    def close(self) -> None:
        """Stop receiving: later sends to the port are returned to their senders."""
        runtime.post(self._port.close)


def _raise_error_reply(value: Any) -> Any:
    if isinstance(value, ErrorReply):
        raise value.to_error()
    return value


class Channel(Generic[T]):
    """``port, receiver = Channel.open()``: a fresh port in the caller's mailbox (the
    running actor's, or this process's client) and what reads it."""

    @staticmethod
    def open() -> tuple[Port[T], PortReceiver[T]]:
        if on_loop_thread():
            stream = caller_mailbox().open_port()
        else:  # (a mailbox belongs to its loop)
            made: Future[StreamPort] = runtime.call(lambda: _done(caller_mailbox().open_port()))
            stream = made.get(config.get().rpc_timeout_s)
        return Port(stream.id), PortReceiver(stream)


def _done(value: T) -> Future[T]:
    fut: Future[T] = Future(runtime.get_loop())
    fut.set_result(value)
    return fut
