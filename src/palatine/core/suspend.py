"""Blocking palatine calls inside a synchronous endpoint, without blocking the loop.

A plain ``def`` endpoint runs on its proc's event loop (that is what makes a small call
cheap), yet Monarch programs call other actors from one and wait:
``other.method.call_one(x).get()``. A thread per call would cost a hand-off on every
call; waiting on the loop thread would deadlock, since the reply arrives on that loop.

So a synchronous endpoint runs in a greenlet of the loop thread (`call`). A blocking wait
inside it (`palatine.Future.get`, iterating a stream) does not block: `wait` switches
back to the loop, which goes on serving, and switches into the endpoint again once the
result is there or the wait's timeout passed. The actor stays busy meanwhile (its other
messages wait, as with a thread), and the caller of the endpoint gets the reply when the
endpoint returns. Only palatine's own waits yield this way: ``time.sleep`` or a blocking
socket inside an endpoint still holds the loop, as it would hold any asyncio loop.

greenlet (the well-kept library that SQLAlchemy and gevent use) does the stack
switching; a coroutine could not, because the endpoint is plain ``def`` code.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import Any

import greenlet

__all__ = ["Suspension", "Raised", "BadArguments", "call", "can_suspend", "wait"]


class BadArguments(TypeError):
    """The endpoint could not be called with these arguments (the caller's error)."""


_SUSPENDED = object()  # what an endpoint's greenlet hands back when it waits
_RETURNED, _RAISED = 0, 1


class _EndpointLet(greenlet.greenlet):  # type: ignore[misc]
    """A greenlet that runs synchronous endpoint calls, one after another.

    Starting and ending a greenlet costs several microseconds; switching into a live one
    costs a fraction of one. So each lives on: it hands every outcome to its parent (the
    loop thread's main greenlet) and waits there for its next call. A call that waits in
    `wait` keeps its greenlet until it ends; the others take another one from the pool.
    """

    def __init__(self) -> None:
        super().__init__(self._serve)
        self.suspension: Suspension | None = None

    def _serve(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        main = self.parent
        while True:
            try:
                outcome: tuple[int, Any] = (_RETURNED, _enter(fn, args, kwargs))
            except BaseException as e:  # noqa: BLE001 - the endpoint's own error, for its caller
                outcome = (_RAISED, _from_the_endpoint(e))
            self.suspension = None
            # Idle, it holds nothing of the call (a bound method would keep its actor alive).
            fn = args = kwargs = None  # type: ignore[assignment]
            _idle().append(self)
            fn, args, kwargs = main.switch(outcome)
            del outcome


_per_thread = threading.local()


def _idle() -> list[_EndpointLet]:
    """This thread's live greenlets waiting for a call (a greenlet serves its own thread)."""
    try:
        idle: list[_EndpointLet] = _per_thread.idle
    except AttributeError:
        idle = _per_thread.idle = []
    return idle


def _from_the_endpoint(e: BaseException) -> BaseException:
    """``e`` with its traceback starting at the endpoint's own frame (not this module's)."""
    tb = e.__traceback__
    for _ in range(2):  # `_serve`, `_enter`
        if tb is None or tb.tb_next is None or tb.tb_frame.f_globals.get("__name__") != __name__:
            break
        tb = tb.tb_next
    return e.with_traceback(tb)


class Raised:
    """What `call` returns when the endpoint raised: the exception, traceback from the
    endpoint's own frame (raising it again would prepend the caller's frames)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Suspension:
    """An endpoint call waiting inside `wait`: ``outcome`` settles with its return value
    or exception once it ends."""

    __slots__ = ("_let", "outcome")

    def __init__(self, let: _EndpointLet, loop: asyncio.AbstractEventLoop) -> None:
        self._let = let
        self.outcome: asyncio.Future[Any] = loop.create_future()

    def resume(self) -> None:
        """Switch into the endpoint again (on the loop thread); settle ``outcome`` when it ends."""
        out = self._let.switch()
        if out is _SUSPENDED or self.outcome.done():
            return
        kind, value = out
        if kind == _RAISED:
            self.outcome.set_exception(value)
        else:
            self.outcome.set_result(value)


def _enter(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return fn(*args, **kwargs)
    except TypeError as e:
        if e.__traceback__ is not None and e.__traceback__.tb_next is None:
            raise BadArguments(str(e)) from None  # raised by the call itself: the arguments
        raise


def call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` in an endpoint greenlet of this (loop) thread: its return
    value, a `Suspension` when it is waiting in `wait`, or `Raised` with what it raised
    (`BadArguments` when the arguments do not fit its signature)."""
    if isinstance(greenlet.getcurrent(), _EndpointLet):  # nested: it may wait in the outer one
        try:
            return _enter(fn, args, kwargs)
        except BaseException as e:  # noqa: BLE001 - as from a greenlet of its own
            return Raised(e)
    idle = _idle()
    let = idle.pop() if idle else _EndpointLet()
    let.gr_context = contextvars.copy_context()  # the caller's context (the actor's) inside
    out = let.switch(fn, args, kwargs)
    if out is _SUSPENDED:
        return let.suspension
    kind, value = out
    return Raised(value) if kind == _RAISED else value


def can_suspend() -> bool:
    """Whether this code runs in a synchronous endpoint that `wait` may suspend."""
    return isinstance(greenlet.getcurrent(), _EndpointLet)


def wait(add_done_callback: Callable[[Callable[[Any], None]], None], timeout: float | None) -> None:
    """Give the loop back until the awaited thing calls its done callback (from any
    thread) or ``timeout`` seconds passed; the caller checks which. Only inside
    `can_suspend` code."""
    let = greenlet.getcurrent()
    assert isinstance(let, _EndpointLet)
    loop = asyncio.get_running_loop()
    susp = let.suspension
    if susp is None:
        susp = let.suspension = Suspension(let, loop)
    woken = False
    timer: asyncio.TimerHandle | None = None

    def wake() -> None:
        nonlocal woken
        if woken:
            return
        woken = True
        if timer is not None:
            timer.cancel()
        susp.resume()

    if timeout is not None:
        timer = loop.call_later(max(0.0, timeout), wake)

    def done(_x: Any) -> None:
        loop.call_soon_threadsafe(wake)

    add_done_callback(done)
    let.parent.switch(_SUSPENDED)
