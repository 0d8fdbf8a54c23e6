"""`palatine.Future`: one result, usable from plain threads and from any asyncio loop.

Results are produced on the palatine loop. ``get``/``result`` block the calling thread
(never the loop thread: that raises instead of deadlocking); ``await`` works on the
palatine loop directly and on any other loop through a thread-safe hand-off.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from palatine.core import suspend

__all__ = ["Future", "LOOP_THREAD_ERROR"]

T = TypeVar("T")

log = logging.getLogger(__name__)

LOOP_THREAD_ERROR = "blocking palatine call on the event loop thread; use await"

_loop_thread_ids: set[int] = set()


def mark_loop_thread() -> None:
    """Declare the current thread a palatine loop thread (blocking calls raise there)."""
    _loop_thread_ids.add(threading.get_ident())


def unmark_loop_thread() -> None:
    _loop_thread_ids.discard(threading.get_ident())


def on_loop_thread() -> bool:
    return threading.get_ident() in _loop_thread_ids


_PENDING, _FINISHED = 0, 1
_state_lock = threading.Lock()  # guards every Future's state change (held for a few ops)


class Future(Generic[T]):
    """The result of a remote operation: ``get``/``result``, ``exception``, ``done``, await.

    A minimal thread-safe single-assignment cell (a `concurrent.futures.Future` costs a
    Condition and an RLock per instance, measurable at tens of thousands of calls per
    second): one process-wide lock guards state changes, and a waiting thread parks on a
    lock created only when somebody actually waits.
    """

    __slots__ = (
        "_state",
        "_value",
        "_exc",
        "_waiter",
        "_callbacks",
        "_afut",
        "_transform",
        "_loop",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._state = _PENDING
        self._value: Any = None
        self._exc: BaseException | None = None
        self._waiter: threading.Lock | None = None
        self._callbacks: list[Callable[[Future[T]], Any]] | None = None
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

    def chain(self, afut: asyncio.Future[Any], transform: Callable[[Any], T] | None = None) -> None:
        """Complete this future from ``afut`` (call on the loop thread)."""
        self._afut = afut
        self._transform = transform

        def done(f: asyncio.Future[Any]) -> None:
            if self._state:
                return
            if f.cancelled():
                self._finish(None, concurrent.futures.CancelledError())
                return
            exc = f.exception()
            if exc is not None:
                self._finish(None, exc)
                return
            if transform is None:
                self._finish(f.result(), None)
                return
            try:
                value = transform(f.result())
            except BaseException as e:  # noqa: BLE001 - surfaced to the waiter
                self._finish(None, e)
                return
            self._finish(value, None)

        afut.add_done_callback(done)

    def set_result(self, value: T) -> None:
        self._finish(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._finish(None, exc)

    def _finish(self, value: Any, exc: BaseException | None) -> None:
        """The first completion wins; later ones are ignored."""
        with _state_lock:
            if self._state:
                return
            self._value = value
            self._exc = exc
            self._state = _FINISHED
            waiter, callbacks = self._waiter, self._callbacks
            self._callbacks = None
        if waiter is not None:
            waiter.release()
        if callbacks:
            for fn in callbacks:
                try:
                    fn(self)
                except Exception:  # noqa: BLE001 - like concurrent.futures: log, go on
                    log.exception("future callback %r failed", fn)

    # -- consumer side ---------------------------------------------------------------
    def done(self) -> bool:
        return self._state == _FINISHED

    def _wait(self, timeout: float | None) -> None:
        if self._state:
            return
        if on_loop_thread():
            if not suspend.can_suspend():
                raise RuntimeError(LOOP_THREAD_ERROR)
            # a synchronous endpoint: the loop serves on until the result is here
            suspend.wait(self.add_done_callback, timeout)
            if not self._state:
                raise TimeoutError(f"no result within {timeout} s")
            return
        with _state_lock:
            if self._state:
                return
            waiter = self._waiter
            if waiter is None:
                waiter = self._waiter = threading.Lock()
                waiter.acquire()
        if waiter.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            waiter.release()  # wake the next waiting thread too
            return
        if not self._state:
            raise TimeoutError(f"no result within {timeout} s")

    def get(self, timeout: float | None = None) -> T:
        """Block until the result is there (``timeout`` bounds only this wait)."""
        if not self._state:
            self._wait(timeout)
        if self._exc is not None:
            raise self._exc
        return self._value  # type: ignore[no-any-return]

    result = get  # concurrent.futures' name for Monarch's get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        if isinstance(self._exc, concurrent.futures.CancelledError):
            raise self._exc
        return self._exc

    def with_timeout(self, timeout: float) -> Future[T]:
        """This result, or `TimeoutError` if it is not there within ``timeout`` seconds
        (counted from now). The operation itself goes on; only this view gives up."""
        out: Future[T] = Future(self._loop)
        loop = self._loop

        def expire() -> None:
            out._finish(None, TimeoutError(f"no result within {timeout:g} s"))

        def copy(f: Future[T]) -> None:
            out._finish(f._value, f._exc)

        self.add_done_callback(copy)
        if not out._state:
            loop.call_soon_threadsafe(loop.call_later, max(0.0, timeout), expire)
        return out

    def add_done_callback(self, fn: Callable[[Future[T]], Any]) -> None:
        with _state_lock:
            if not self._state:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        fn(self)

    def __await__(self) -> Generator[Any, None, T]:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        afut = self._afut
        if afut is not None and running is self._loop:
            value = yield from afut.__await__()
            return value if self._transform is None else self._transform(value)
        if not self._state:
            if running is None:
                raise RuntimeError("await a palatine Future inside a running event loop")
            waiter = running.create_future()

            def wake(_f: Future[T]) -> None:
                def settle() -> None:
                    if not waiter.done():
                        waiter.set_result(None)

                if running.is_closed():
                    return
                if running is self._loop and on_loop_thread():
                    settle()
                else:
                    running.call_soon_threadsafe(settle)

            self.add_done_callback(wake)
            yield from waiter.__await__()
        return self.get()

    def __repr__(self) -> str:
        state = "done" if self._state else "pending"
        return f"<palatine.Future {state}>"
