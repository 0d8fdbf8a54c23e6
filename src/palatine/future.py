"""`palatine.Future`: one result, usable from plain threads and from any asyncio loop.

Results are produced on the palatine loop. ``get``/``result`` block the calling thread
(never the loop thread: that raises instead of deadlocking); ``await`` works on the
palatine loop directly and on any other loop through a thread-safe hand-off.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

__all__ = ["Future", "LOOP_THREAD_ERROR"]

T = TypeVar("T")

LOOP_THREAD_ERROR = "blocking palatine call on the event loop thread; use await"

_loop_thread_ids: set[int] = set()


def mark_loop_thread() -> None:
    """Declare the current thread a palatine loop thread (blocking calls raise there)."""
    _loop_thread_ids.add(threading.get_ident())


def unmark_loop_thread() -> None:
    _loop_thread_ids.discard(threading.get_ident())


def on_loop_thread() -> bool:
    return threading.get_ident() in _loop_thread_ids


class Future(Generic[T]):
    """The result of a remote operation: ``get``/``result``, ``exception``, ``done``, await."""

    __slots__ = ("_cf", "_afut", "_transform", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._cf: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._afut: asyncio.Future[Any] | None = None
        self._transform: Callable[[Any], T] | None = None

    # -- producer side (palatine loop thread) ------------------------------------
    @classmethod
    def from_asyncio(
        cls,
        afut: asyncio.Future[Any],
        transform: Callable[[Any], T] | None = None,
    ) -> Future[T]:
        """Wrap a loop-side future (call on the loop thread)."""
        self: Future[T] = cls(afut.get_loop())
        self.chain(afut, transform)
        return self

    def chain(
        self, afut: asyncio.Future[Any], transform: Callable[[Any], T] | None = None
    ) -> None:
        """Complete this future from ``afut`` (call on the loop thread)."""
        self._afut = afut
        self._transform = transform
        cf = self._cf

        def done(f: asyncio.Future[Any]) -> None:
            if cf.done():
                return
            if f.cancelled():
                cf.cancel()
                return
            exc = f.exception()
            if exc is not None:
                cf.set_exception(exc)
                return
            if transform is None:
                cf.set_result(f.result())
                return
            try:
                cf.set_result(transform(f.result()))
            except BaseException as e:  # noqa: BLE001 - surfaced to the waiter
                cf.set_exception(e)

        afut.add_done_callback(done)

    def set_result(self, value: T) -> None:
        if not self._cf.done():
            self._cf.set_result(value)

    def set_exception(self, exc: BaseException) -> None:
        if not self._cf.done():
            self._cf.set_exception(exc)

    # -- consumer side ---------------------------------------------------------------
    def done(self) -> bool:
        return self._cf.done()

    def get(self, timeout: float | None = None) -> T:
        """Block until the result is there (``timeout`` bounds only this wait)."""
        if not self._cf.done() and on_loop_thread():
            raise RuntimeError(LOOP_THREAD_ERROR)
        return self._cf.result(timeout)

    result = get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._cf.done() and on_loop_thread():
            raise RuntimeError(LOOP_THREAD_ERROR)
        return self._cf.exception(timeout)

    def add_done_callback(self, fn: Callable[[Future[T]], Any]) -> None:
        self._cf.add_done_callback(lambda _cf: fn(self))

    def __await__(self) -> Generator[Any, None, T]:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        afut = self._afut
        if afut is not None and running is self._loop:
            value = yield from afut.__await__()
            return value if self._transform is None else self._transform(value)
        return (yield from asyncio.wrap_future(self._cf).__await__())

    def __repr__(self) -> str:
        state = "done" if self._cf.done() else "pending"
        return f"<palatine.Future {state}>"
