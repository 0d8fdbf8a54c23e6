"""The process-wide runtime: the event loop (a ``palatine-loop`` thread for user code).

Synchronous scripts need no asyncio: on first use palatine starts one daemon thread
running the loop (uvloop when available). Blocking methods submit work to it and wait;
role processes (``palatine system|host|worker|controller``) run the loop in their main
thread instead and declare it with `adopt_current_loop`.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from palatine import config
from palatine.core.future import Future, mark_loop_thread, on_loop_thread, unmark_loop_thread

__all__ = [
    "new_event_loop",
    "get_loop",
    "adopt_current_loop",
    "submit",
    "call",
    "post",
    "at_exit",
    "run_exit_hooks",
    "unless_stopped",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop: uvloop when configured and importable, else asyncio's default."""
    if config.get().event_loop == "uvloop":
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:
            pass
    return asyncio.new_event_loop()


_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_thread_loop: asyncio.AbstractEventLoop | None = None  # the palatine-loop thread's, once started
_exit_hooks: list[Callable[[], Coroutine[Any, Any, Any]]] = []


def adopt_current_loop() -> asyncio.AbstractEventLoop:
    """Make the running loop (a role process's main thread) the palatine loop."""
    global _loop
    loop = asyncio.get_running_loop()
    with _lock:
        _loop = loop
    mark_loop_thread()
    return loop


def release_current_loop() -> None:
    """Undo `adopt_current_loop` (tests that run several loops in one thread).

    The palatine loop is again the ``palatine-loop`` thread's, if that thread was started.
    """
    global _loop
    with _lock:
        _loop = _thread_loop
    unmark_loop_thread()


def get_loop() -> asyncio.AbstractEventLoop:
    """The palatine loop, starting the ``palatine-loop`` thread on first use."""
    global _loop, _thread, _thread_loop
    loop = _loop
    if loop is not None:
        return loop
    with _lock:
        if _loop is not None:
            return _loop
        loop = new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            mark_loop_thread()
            loop.call_soon(ready.set)
            loop.run_forever()

        _thread = threading.Thread(target=run, name="palatine-loop", daemon=True)
        _thread.start()
        ready.wait()
        _loop = _thread_loop = loop
        atexit.register(_shutdown)
        return loop


def submit(coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> Future[T]:
    """Run ``coro_fn()`` on the palatine loop; a `Future` of its result."""
    loop = get_loop()
    fut: Future[T] = Future(loop)

    def start() -> None:
        try:
            task = loop.create_task(coro_fn())
        except BaseException as e:  # noqa: BLE001 - the caller's future carries it
            fut.set_exception(e)
            return
        fut.chain(task)

    post(start)
    return fut


_queue: collections.deque[Callable[[], None]] = collections.deque()
_drain_scheduled = False
_queue_lock = threading.Lock()


def _drain() -> None:
    global _drain_scheduled
    with _queue_lock:
        _drain_scheduled = False
    pop = _queue.popleft
    while _queue:
        pop()()


_tls = threading.local()


def set_post_hook(hook: Callable[[], None] | None) -> None:
    """Run ``hook()`` before each `post` from the calling (non-loop) thread (`palatine.fastpath.lane`)."""
    _tls.hook = hook


def post(fn: Callable[[], Any]) -> None:
    """Run ``fn()`` on the loop thread (now, if already there); no result.

    Submissions from other threads are queued and drained in one loop callback, so a
    burst of calls costs one wake-up of the loop, not one each. The thread's post hook,
    if any, runs first.
    """
    global _drain_scheduled
    if on_loop_thread():
        fn()
        return
    hook = getattr(_tls, "hook", None)
    if hook is not None:
        hook()
    loop = get_loop()
    _queue.append(fn)
    with _queue_lock:
        if _drain_scheduled:
            return
        _drain_scheduled = True
    loop.call_soon_threadsafe(_drain)


def call(
    fn: Callable[[], Any],
    transform: Callable[[Any], T] | None = None,
) -> Future[T]:
    """Run ``fn`` on the loop thread; its (asyncio or palatine) future becomes ours."""
    out: Future[T] = Future(get_loop())
    call_into(out, fn, transform)
    return out


def call_into(
    out: Future[T],
    fn: Callable[[], Any],
    transform: Callable[[Any], T] | None = None,
) -> None:
    """`call`, completing the given future ``out`` instead of a new one."""
    post(_runner(out, fn, transform))


def call_all_into(
    calls: list[tuple[Future[Any], Callable[[], Any], Callable[[Any], Any] | None]],
) -> None:
    """`call_into` for each ``(out, fn, transform)``, in order, as one post: no other
    post from any thread lands between them."""
    runners = [_runner(out, fn, transform) for out, fn, transform in calls]

    def run_all() -> None:
        for run in runners:
            run()

    post(run_all)


def _runner(
    out: Future[T],
    fn: Callable[[], Any],
    transform: Callable[[Any], T] | None,
) -> Callable[[], None]:
    """What `call_into` runs on the loop thread."""

    def run() -> None:
        try:
            inner = fn()
        except BaseException as e:  # noqa: BLE001 - surfaced to the caller's future
            out.set_exception(e)
            return
        if isinstance(inner, Future):
            inner.add_done_callback(lambda f: _copy(f, out, transform))
        elif hasattr(inner, "set_sink"):  # a mailbox request: completes `out` directly
            out._afut = inner.future
            out._transform = transform
            inner.set_sink(out, transform)
        else:
            out.chain(inner, transform)

    return run


def _copy(
    src: Future[Any], dst: Future[Any], transform: Callable[[Any], Any] | None = None
) -> None:
    exc = src._exc
    if exc is not None:
        dst.set_exception(exc)
        return
    try:
        value = src._value if transform is None else transform(src._value)
    except BaseException as e:  # noqa: BLE001 - surfaced to the caller's future
        dst.set_exception(e)
        return
    dst.set_result(value)


def at_exit(hook: Callable[[], Coroutine[Any, Any, Any]]) -> None:
    """Register a coroutine to run on the loop at interpreter exit (bounded to 2 s each)."""
    _exit_hooks.append(hook)


async def run_exit_hooks() -> None:
    """Run (once) the hooks `at_exit` registered, newest first, each bounded to 2 s: at
    interpreter exit, or when a role process's main proc stops (its loop is not ours)."""
    while _exit_hooks:
        hook = _exit_hooks.pop()
        try:
            async with asyncio.timeout(2.0):
                await hook()
        except BaseException as e:  # noqa: BLE001 - best effort at exit
            log.debug("exit hook failed: %s", e)


def _shutdown() -> None:
    loop = _loop
    if loop is None or _thread is None or not loop.is_running():
        return
    try:
        asyncio.run_coroutine_threadsafe(run_exit_hooks(), loop).result(timeout=5.0)
    except BaseException as e:  # noqa: BLE001 - best effort at exit
        log.debug("palatine shutdown: %s", e)
    loop.call_soon_threadsafe(loop.stop)
    _thread.join(timeout=2.0)


_CANCEL_WAIT_S = 10.0  # how long a cancelled wait gets to clean up


async def unless_stopped(aw: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``await aw``, unless ``stop`` is set first (a signal during a join, say): then
    ``aw`` is cancelled, given `_CANCEL_WAIT_S` to clean up, and the result is None.
    A result that arrived anyway is returned, for the caller to release as usual."""
    task = asyncio.ensure_future(aw)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        stopper.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=_CANCEL_WAIT_S)
        if not task.done() or task.cancelled():
            return None
    return task.result()
