"""The runtime side of a live actor: work queue, lifecycle, failures, teardown.

One message at a time from one work queue; stop requests and child supervision events
take priority. Status only moves forward and ``stopped``/``failed`` are set exactly once,
at the very end of teardown.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import traceback
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn, Protocol

from palatine import config
from palatine.core import suspend
from palatine.core.actor import (
    ENDPOINT_CALL_TID,
    Actor,
    SupervisionEvent,
    _current_cx,
    _warn_undeliverable,
)
from palatine.core.comm import cast_message
from palatine.core.mailbox import (
    ErrorReply,
    Mailbox,
    OncePort,
    ProcLink,
    StreamPort,
    Undeliverable,
)
from palatine.core.ports import Port
from palatine.errors import ActorAborted, ValueTooLarge
from palatine.ids import ActorId, GangId, PortId
from palatine.wire.codec import PICKLED_VALUE_TID, dumps, encode_message
from palatine.wire.envelope import ENC_MSGPACK, ENC_PICKLE, Envelope

__all__ = [
    "ActorInstance",
    "ActorContext",
    "ActorInstanceView",
    "ActorHost",
    "UNDELIVERABLE_TID",
]

log = logging.getLogger(__name__)

UNDELIVERABLE_TID: int = Undeliverable.__palatine_type_id__

# Work item kinds.
_ENDPOINT = 0
_HANDLER = 1
_UNDELIVERABLE = 2
_TASK_FAILED = 3
_FAILED = 4  # a failure raised while processing inline: the task re-raises it
_RESUME = 5  # the rest of an inline endpoint call that waits in a blocking call


class _Failure(Exception):
    """Internal: fail the actor with this exact status message."""

    def __init__(self, message: str, tb: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.tb = tb


class ActorHost(ProcLink, Protocol):
    """What a live actor needs of its proc beyond a mailbox's needs: spawning children,
    leaving the proc's table, and reporting a failed root actor.

    `palatine.core.proc.Proc` is the one implementation; it builds on this module.
    """

    async def spawn_child(
        self, parent: ActorInstance, cls: type[Actor], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ActorId:
        """Spawn ``cls`` as a child of ``parent`` in this proc."""
        ...

    def unregister(self, inst: ActorInstance, stopped: bool = True) -> None:
        """Forget ``inst`` (its id and mailbox)."""

    def root_failed(self, inst: ActorInstance, event: SupervisionEvent) -> None:
        """A root actor of the proc failed: escalate ``event``."""


class ActorContext:
    """The runtime's `palatine.core.actor.Context`: what an actor sees of it."""

    __slots__ = ("_inst", "env")

    def __init__(self, inst: ActorInstance) -> None:
        self._inst = inst
        self.env: Envelope | None = None

    @property
    def actor_id(self) -> ActorId:
        return self._inst.id

    @property
    def proc(self) -> ActorHost:
        return self._inst.proc

    @property
    def mailbox(self) -> Mailbox:
        return self._inst.mailbox

    @property
    def rank(self) -> dict[str, int]:
        return self._inst.rank

    @property
    def sender(self) -> ActorId | None:
        return self.env.sender if self.env is not None else None

    @property
    def message_rank(self) -> dict[str, int]:
        """Which rank of the called mesh the message being handled was cast to: a point
        over this actor's mesh (its own rank, for a call that named it alone)."""
        rank = self._inst.rank
        cast_rank = self.env.headers.get("cast_rank") if self.env and self.env.headers else None
        extent = getattr(rank, "extent", None)
        if (
            extent is None
            or not isinstance(cast_rank, int)
            or not 0 <= cast_rank < extent.nelements
        ):
            return rank
        point: dict[str, int] = extent.point(cast_rank)
        return point

    @property
    def headers(self) -> dict[str, str | int]:
        return (self.env.headers or {}) if self.env is not None else {}

    async def spawn(self, cls: type[Actor], *args: Any, name: str | None = None, **kw: Any) -> Any:
        """Spawn a child in this proc (same root name, next pid); returns its ref."""
        return await self._inst.proc.spawn_child(self._inst, cls, args, kw)

    def spawn_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A background task supervised like a one-way handler (an error fails the actor)."""
        return self._inst.spawn_task(coro)

    def open_port(self) -> StreamPort:
        return self._inst.mailbox.open_port()

    def open_once_port(self) -> OncePort:
        return self._inst.mailbox.open_once_port()

    def schedule(self, delay_s: float, msg: Any) -> asyncio.TimerHandle:
        """Send ``msg`` (a Message) to this actor after ``delay_s`` (timers)."""
        inst = self._inst
        return inst.proc.loop.call_later(delay_s, inst.tell_self, msg)

    def cast(self, gang: GangId, msg: Any, ranks: Any = None) -> None:
        """One-way typed message to ranks of a gang through the cast tree."""
        cast_message(self._inst.mailbox, gang, msg, ranks)

    def stop(self, reason: str = "stopped by itself") -> None:
        self._inst.request_stop("drain", reason)

    def abort(self, reason: str = "aborted by itself") -> NoReturn:
        """Fail this actor now, from one of its handlers: the call being handled fails,
        queued messages are returned, and its owner is told (``__supervise__``)."""
        raise _Failure(f"serving {self._inst.id}: aborted: {reason}")

    @property
    def actor_instance(self) -> ActorInstanceView:
        """Monarch's ``context().actor_instance``: the running actor's id, rank and proc,
        and ``abort`` / ``stop`` that end it once the message being handled is done."""
        return ActorInstanceView(self._inst)

    def reply(self, port: PortId, msg: Any, req: Envelope | None = None) -> None:
        """Post a typed message (a reply or an ErrorReply) to ``port``."""
        self._inst.reply(port, msg, req)

    def tell_self(self, msg: Any) -> None:
        """Send a typed message to this actor's own handler port (while it is open)."""
        self._inst.tell_self(msg)

    def supervision_port(self) -> PortId:
        """Where the failures of meshes this actor spawns are sent: they reach its
        ``handle_supervision_event`` (``__supervise__``) as its children's do."""
        return self._inst.supervision_port()


class ActorInstanceView:
    """What ``context().actor_instance`` gives (Monarch's ``Instance``)."""

    __slots__ = ("_inst",)

    def __init__(self, inst: ActorInstance) -> None:
        self._inst = inst

    @property
    def actor_id(self) -> ActorId:
        return self._inst.id

    @property
    def rank(self) -> dict[str, int]:
        return self._inst.rank

    @property
    def proc(self) -> ActorHost:
        return self._inst.proc

    def abort(self, reason: str | None = None) -> None:
        """Fail this actor once the message it is handling is done (Monarch's ``abort``:
        that call still returns to its caller): queued messages are returned, and its
        owner is told ``reason`` (``__supervise__``, or the unhandled-fault hook)."""
        inst = self._inst
        why = reason if reason else "no reason provided"
        inst.signal("fail", _Failure(f"serving {inst.id}: aborted: {why}"))

    def stop(self, reason: str | None = None) -> None:
        """Stop this actor once it has handled what it has queued (not a failure)."""
        self._inst.request_stop("drain", reason or "stopped by itself")

    def __repr__(self) -> str:
        return f"<actor instance {self._inst.id}>"


_STRENGTH = {"drain": 0, "stop": 1, "abort": 2}


class ActorInstance:
    """A live actor: mailbox, work queue, status, children, supervision."""

    def __init__(
        self,
        proc: ActorHost,
        actor_id: ActorId,
        actor: Actor | Callable[[], Actor],
        parent: ActorInstance | None = None,
        rank: dict[str, int] | None = None,
    ) -> None:
        """``actor`` is the actor, or what makes it (its class with the arguments bound):
        made by `construct`, with `palatine.core.actor.context` already this actor's own,
        so a constructor knows its id and rank (`current_rank`)."""
        self.proc = proc
        self.loop = proc.loop
        self.id = actor_id
        self.parent = parent
        self.root: ActorInstance = parent.root if parent is not None else self
        self.rank = rank or {}
        self.mailbox = Mailbox(actor_id, proc)
        self.cx = ActorContext(self)
        self._make: Callable[[], Actor] | None = None
        self.queue: collections.deque[tuple[int, Any, Any, Envelope | None]] = collections.deque()
        self.signals: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake: asyncio.Future[None] | None = None
        self.children: dict[ActorId, ActorInstance] = {}
        self.next_child_pid = 1  # used on roots only
        self.state = "created"  # created|initializing|idle|processing|stopping|stopped|failed
        self.failure: str | None = None
        self.failure_tb = ""
        self.caused_by: SupervisionEvent | None = None
        self.processed = 0
        self.current_handler: str | None = None
        self.processing_since: float | None = None
        self.stop_mode: str | None = None
        self.stop_reason = ""
        self._aborting = False
        self.task: asyncio.Task[None] | None = None
        self.terminal: asyncio.Future[str] = self.loop.create_future()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._supervision_port: PortId | None = None
        if isinstance(actor, Actor):
            self._adopt(actor)
        else:
            self._make = actor

    async def construct(self) -> None:
        """Make the actor (when given what makes it), then bind its ports.

        The constructor runs as a plain ``def`` endpoint does, in an endpoint greenlet of
        the loop (`palatine.core.suspend`): a blocking palatine call in it (spawning proc
        meshes or actors, ``.get()`` on a future) gives the loop back until its result is
        there, so the proc serves on meanwhile. Raises what the constructor raised."""
        make = self._make
        if make is None:
            return
        self._make = None
        token = _current_cx.set(self.cx)
        try:
            out = suspend.call(make, (), {})
        finally:
            _current_cx.reset(token)
        del make
        kind = type(out)
        if kind is suspend.Suspension:
            out = await out.outcome
        elif kind is suspend.Raised:
            error = out.error
            if isinstance(error, suspend.BadArguments):  # the arguments did not fit
                raise TypeError(str(error)) from None
            raise error
        if not isinstance(out, Actor):
            raise TypeError(f"{type(out).__name__} is not an Actor")
        self._adopt(out)

    def _adopt(self, actor: Actor) -> None:
        """Take ``actor`` as this instance's: its endpoints and handlers get their ports."""
        self.actor = actor
        cls = type(actor)
        self._endpoints = cls._palatine_endpoints
        self._handlers = cls._handler_table()
        self._type_name = cls.__name__
        actor.cx = self.cx
        mb = self.mailbox
        if self._endpoints:
            mb.bind_handler(ENDPOINT_CALL_TID, self._enqueue_endpoint, "EndpointCall")
        for tid, (_name, mtype, _) in self._handlers.items():
            mb.bind_handler(tid, self._enqueue_handler, mtype.__name__, self._handlers.__contains__)
        mb.bind_handler(UNDELIVERABLE_TID, self._enqueue_undeliverable, "Undeliverable")

    # ---------------------------------------------------------------- status
    @property
    def status(self) -> str:
        s = self.state
        if s == "processing":
            ms = int((self.loop.time() - (self.processing_since or 0.0)) * 1000)
            return f"{self.current_handler}: processing for {ms}ms"
        if s == "failed":
            return f"failed: {self.failure}"
        return s

    @property
    def terminated(self) -> bool:
        return self.state in ("stopped", "failed")

    # ---------------------------------------------------------------- inbound
    def _push(self, item: tuple[int, Any, Any, Envelope | None]) -> None:
        self.queue.append(item)
        w = self._wake
        if w is not None:
            self._wake = None
            w.set_result(None)

    def _enqueue_endpoint(self, payload: Any, env: Envelope) -> None:
        item = (_ENDPOINT, None, payload, env)
        if (
            self._wake is not None
            and not self.queue
            and not self.signals
            and self.stop_mode is None
        ):
            # Idle, parked and nothing ahead: a plain ``def`` endpoint runs right here,
            # from the channel's read callback, saving the task's loop turn. Never nested
            # inside another actor's handler (local sends queue as usual).
            try:
                info = self._endpoints.get(payload[0])
            except (TypeError, IndexError, KeyError):
                info = None
            if info is not None and not info.is_async and _current_cx.get() is None:
                self._process_inline(item)
                return
        self._push(item)

    def _process_inline(self, item: tuple[int, Any, Any, Envelope | None]) -> None:
        """Run a synchronous endpoint call now; its failure goes to the task (teardown), and
        so does the rest of a call that waits in a blocking palatine call (`_RESUME`, ahead
        of anything queued after it). The same steps as `_process`, without a coroutine."""
        env = item[3]
        self.processed += 1
        cx = self.cx
        cx.env = env
        token = _current_cx.set(cx)
        try:
            pending = self._start_endpoint(item[2], env)  # type: ignore[arg-type]
        except _Failure as f:
            pending = None
            self._push((_FAILED, None, f, None))
        except BaseException as e:  # noqa: BLE001 - (CancelledError and such) a panic, as on the task
            pending = None
            tb = traceback.format_exc()
            why = f"serving {self.id}: panic: {type(e).__name__}: {e}"
            self._push((_FAILED, None, _Failure(why, tb), None))
        finally:
            _current_cx.reset(token)
        if pending is not None:  # processing until `_finish_endpoint` is over
            self._push((_RESUME, pending, None, env))
            return
        if self.state == "processing":
            self.state = "idle"
        self.current_handler = None
        cx.env = None  # idle again: do not pin the message

    def _enqueue_handler(self, payload: Any, env: Envelope) -> None:
        self._push((_HANDLER, self._handlers[env.type_id], payload, env))

    def _enqueue_undeliverable(self, payload: Undeliverable, env: Envelope) -> None:
        self.undeliverable(payload.envelope)

    def undeliverable(self, returned: Envelope) -> None:
        """A message we sent came back: fail its pending call, then run the hook in turn."""
        if self.mailbox.answered(returned):
            log.debug("%s: an answered request came back: %s", self.id, returned.errors)
            return
        self.mailbox.returned(returned)
        if self.terminated:
            _warn_undeliverable(self.id, returned)
            return
        self._push((_UNDELIVERABLE, None, returned, None))

    def tell_self(self, msg: Any) -> None:
        if self.mailbox.state != "open":
            return
        tid = type(msg).__palatine_type_id__
        env = Envelope(self.id, PortId(self.id, tid), tid, ENC_MSGPACK, encode_message(msg))
        self.proc.post(env)

    def signal(self, kind: str, value: Any) -> None:
        self.signals.append((kind, value))
        w = self._wake
        if w is not None:
            self._wake = None
            w.set_result(None)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Run ``init``; raise on failure (the spawn fails, no supervision event)."""
        self.state = "initializing"
        token = _current_cx.set(self.cx)
        try:
            hook = type(self.actor).init
            # (an endpoint that happens to be named ``init`` is the user's, not the hook)
            if hook is not Actor.init and not hasattr(hook, "__palatine_endpoint__"):
                await self.actor.init()
        except BaseException as e:
            self.state = "failed"
            self.failure = f"serving {self.id}: initialization error: {type(e).__name__}: {e}"
            self.failure_tb = traceback.format_exc()
            self.mailbox.close(self.failure)
            if not self.terminal.done():
                self.terminal.set_result(self.status)
            raise
        finally:
            _current_cx.reset(token)
        self.state = "idle"
        self.task = self.loop.create_task(self._run(), name=f"actor {self.id}")

    def request_stop(self, mode: str, reason: str) -> None:
        """``drain`` (process queued), ``stop`` (return queued) or ``abort`` (cancel)."""
        if self.terminated:
            return
        if self.stop_mode is None or _STRENGTH[mode] > _STRENGTH[self.stop_mode]:
            self.stop_mode = mode
            self.stop_reason = reason
        if self.mailbox.state == "open":
            self.mailbox.state = "stopping"
        if mode == "abort" and self.state == "processing" and self.task is not None:
            self._aborting = True
            self.task.cancel()
        self.signal("stop", None)

    def spawn_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._push((_TASK_FAILED, None, exc, None))

    async def _run(self) -> None:
        try:
            while True:
                if self.signals:
                    kind, value = self.signals.popleft()
                    if kind == "supervision":
                        self.processed += 1
                        await self._on_child_event(value)
                    elif kind == "fail":  # `ActorInstanceView.abort`
                        raise value
                    continue  # "stop" signals only wake us; stop_mode says what to do
                mode = self.stop_mode
                if mode is not None and mode != "drain":
                    break
                if self.queue:
                    await self._process(self.queue.popleft())
                    continue
                if mode == "drain":
                    break
                # Idle: do not pin the last message (a fetched value's buffers) meanwhile.
                self.cx.env = None
                self._wake = self.loop.create_future()
                await self._wake
        except asyncio.CancelledError:
            if self.task is not None:
                self.task.uncancel()
            if not self._aborting:
                self.failure = f"serving {self.id}: panic: CancelledError: actor task cancelled"
                self.failure_tb = traceback.format_exc()
            elif self.cx.env is not None and self.cx.env.reply_to is not None:
                env = self.cx.env
                self.reply(
                    env.reply_to,  # type: ignore[arg-type]
                    ErrorReply(
                        type_name="ActorAborted",
                        message=f"actor {self.id} was aborted: {self.stop_reason}",
                        actor_id=str(self.id),
                    ),
                    env,
                )
        except _Failure as f:
            self.failure = f.message
            self.failure_tb = f.tb
        except BaseException as e:  # noqa: BLE001 - runtime code bug: a panic
            self.failure = f"serving {self.id}: panic: {type(e).__name__}: {e}"
            self.failure_tb = traceback.format_exc()
        self.cx.env = None
        await self._teardown()

    async def _process(self, item: tuple[int, Any, Any, Envelope | None]) -> None:
        kind, meta, payload, env = item
        if kind != _RESUME:
            self.processed += 1
        cx = self.cx
        cx.env = env
        token = _current_cx.set(cx)
        try:
            if kind == _ENDPOINT:
                await self._run_endpoint(payload, env)  # type: ignore[arg-type]
            elif kind == _RESUME:
                await self._finish_endpoint(meta, env)  # type: ignore[arg-type]
            elif kind == _HANDLER:
                await self._run_handler(meta, payload, env)  # type: ignore[arg-type]
            elif kind == _UNDELIVERABLE:
                self.current_handler = "handle_undeliverable"
                try:
                    self.actor.handle_undeliverable(payload)
                except Exception as e:
                    errs = "; ".join(payload.errors or ())
                    raise _Failure(
                        f"serving {self.id}: processing error: a message from "
                        f"{payload.sender} to {payload.dest} was undeliverable and returned: {errs}",
                        traceback.format_exc(),
                    ) from e
            elif kind == _FAILED:
                raise payload
            elif kind == _TASK_FAILED:
                raise _Failure(
                    f"serving {self.id}: processing error: {type(payload).__name__}: {payload}",
                    "".join(traceback.format_exception(payload)),
                )
        finally:
            _current_cx.reset(token)
            if self.state == "processing":
                self.state = "idle"
            self.current_handler = None

    async def _run_endpoint(
        self, payload: tuple[str, tuple[Any, ...], dict[str, Any]], env: Envelope
    ) -> None:
        susp = self._start_endpoint(payload, env)
        if susp is not None:
            await self._finish_endpoint(susp, env)

    def _start_endpoint(
        self, payload: tuple[str, tuple[Any, ...], dict[str, Any]], env: Envelope
    ) -> tuple[str, Any, bool] | None:
        """Run the endpoint call as far as it goes without waiting: None when it is over
        (replied to, or its failure raised), else what `_finish_endpoint` waits on: an
        async endpoint's coroutine, or a synchronous one suspended in a blocking palatine
        call (`palatine.core.suspend`)."""
        try:
            method, args, kwargs = payload
            info = self._endpoints.get(method)
        except (TypeError, ValueError):
            self._dispatch_error(env, "malformed endpoint call")
            return None
        if info is None:
            self._dispatch_error(
                env, f"actor {self.id} ({self._type_name}) has no endpoint {method!r}"
            )
            return None
        fn = getattr(self.actor, method)
        self.state = "processing"
        self.current_handler = method
        self.processing_since = self.loop.time()
        explicit = info.explicit_port
        if explicit:  # it answers through the port; what it returns is dropped
            rank = env.headers.get("cast_rank") if env.headers else None
            args = (Port(env.reply_to, rank if isinstance(rank, int) else None), *args)
        try:
            if info.is_async:
                pending = (method, fn(*args, **kwargs), explicit)
                return self._unless_concurrent(info.concurrent, pending, env)
            result = suspend.call(fn, args, kwargs)
        except TypeError as e:
            if e.__traceback__ is not None and e.__traceback__.tb_next is None:
                self._dispatch_error(env, f"bad arguments for {method}: {e}")
                return None
            self._handler_raised(e, env)
            return None
        except Exception as e:  # noqa: BLE001 - a handler's error is its caller's reply
            self._handler_raised(e, env)
            return None
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - anything else is a panic of the actor
            self._panic(e, env)
        kind = type(result)
        if kind is suspend.Suspension:
            return self._unless_concurrent(info.concurrent, (method, result, explicit), env)
        if kind is suspend.Raised:
            error = result.error
            if isinstance(error, _Failure):  # `abort`
                if env.reply_to is not None:
                    self._reply_error(env, "ActorAborted", error.message)
                raise error
            if isinstance(error, suspend.BadArguments):
                self._dispatch_error(env, f"bad arguments for {method}: {error}")
            elif isinstance(error, Exception):
                self._handler_raised(error, env)
            elif isinstance(error, asyncio.CancelledError):
                raise error
            else:
                self._panic(error, env)
            return None
        if env.reply_to is not None and not explicit:
            self._reply_value(env, result, method)
        return None

    def _unless_concurrent(
        self, concurrent: bool, pending: tuple[str, Any, bool], env: Envelope
    ) -> tuple[str, Any, bool] | None:
        """What is left of a call, for the actor to wait on; a concurrent endpoint's rest
        runs as a task of the actor's instead, and the actor goes on (None)."""
        if not concurrent:
            return pending
        self.spawn_task(self._finish_endpoint(pending, env, concurrent=True))
        return None

    async def _finish_endpoint(
        self, pending: tuple[str, Any, bool], env: Envelope, concurrent: bool = False
    ) -> None:
        """Wait for the rest of an endpoint call `_start_endpoint` began, then reply."""
        method, waiting, explicit = pending
        if not concurrent:
            self.state = "processing"
            self.current_handler = method
        try:
            if type(waiting) is suspend.Suspension:
                result = await waiting.outcome
            else:
                result = await waiting
        except _Failure as f:  # `abort`
            if env.reply_to is not None:
                self._reply_error(env, "ActorAborted", f.message)
            raise
        except Exception as e:  # noqa: BLE001 - a handler's error is its caller's reply
            self._handler_raised(e, env)
            return
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - anything else is a panic of the actor
            self._panic(e, env)
        if env.reply_to is not None and not explicit:
            self._reply_value(env, result, method)

    async def _run_handler(
        self, meta: tuple[str, type[Any], bool], payload: Any, env: Envelope
    ) -> None:
        name, _mtype, is_async = meta
        fn = getattr(self.actor, name)
        self.state = "processing"
        self.current_handler = _mtype.__name__
        self.processing_since = self.loop.time()
        try:
            result = fn(payload)
            if is_async:
                result = await result
        except _Failure as f:  # `abort`
            if env.reply_to is not None:
                self._reply_error(env, "ActorAborted", f.message)
            raise
        except Exception as e:  # noqa: BLE001 - a handler's error is its caller's reply
            self._handler_raised(e, env)
            return
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - anything else is a panic of the actor
            self._panic(e, env)
        if env.reply_to is not None and result is not None:
            self.reply(env.reply_to, result, env)

    def _dispatch_error(self, env: Envelope, what: str) -> None:
        """Not the actor's fault: an ErrorReply, or the message returned."""
        if env.reply_to is not None:
            self.reply(
                env.reply_to,
                ErrorReply(type_name="DispatchError", message=what, actor_id=str(self.id)),
                env,
            )
        else:
            self.proc.return_envelope(env, f"mailbox error: {what}")

    def _handler_raised(self, e: Exception, env: Envelope) -> None:
        if env.reply_to is not None:
            tb = "".join(traceback.format_exception(e))
            err = ErrorReply(
                type_name=f"{type(e).__module__}.{type(e).__qualname__}"
                if type(e).__module__ != "builtins"
                else type(e).__qualname__,
                message=str(e),
                traceback=tb,
                actor_id=str(self.id),
            )
            self.reply(env.reply_to, err, env)
            return
        raise _Failure(
            f"serving {self.id}: processing error: {type(e).__name__}: {e}",
            "".join(traceback.format_exception(e)),
        ) from e

    def _panic(self, e: BaseException, env: Envelope) -> None:
        msg = f"serving {self.id}: panic: {type(e).__name__}: {e}"
        if env.reply_to is not None:
            self.reply(
                env.reply_to,
                ErrorReply(
                    type_name="ActorFailed", message=f"actor failed: {msg}", actor_id=str(self.id)
                ),
                env,
            )
        raise _Failure(msg, "".join(traceback.format_exception(e)))

    # ---------------------------------------------------------------- replies
    def _reply_headers(self, req: Envelope | None) -> dict[str, str | int] | None:
        if req is not None and req.headers:
            rank = req.headers.get("cast_rank")
            if rank is not None:
                return {"cast_rank": rank}
        return None

    def _reply_value(self, req: Envelope, value: Any, method: str = "the call") -> None:
        kind = type(value)
        name = (
            kind.__qualname__
            if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}"
        )
        # Either failure is the caller's, not the actor's: the call fails, the actor serves on.
        try:
            data, bufs = dumps(value)
        except Exception as e:  # noqa: BLE001 - a result that cannot be sent is the caller's error
            why = f"{method} returned a {name}, which cannot be sent: {e}"
            self._reply_error(req, type(e).__qualname__, why, e)
            return
        nbytes = len(data) + sum(memoryview(b).nbytes for b in bufs)
        too_large = config.value_too_large(f"the result of {method} (a {name})", nbytes)
        if too_large is not None:
            del data, bufs
            self._reply_error(req, ValueTooLarge.__qualname__, too_large)
            return
        env = Envelope(
            self.id,
            req.reply_to,  # type: ignore[arg-type]
            PICKLED_VALUE_TID,
            ENC_PICKLE,
            data,
            None,
            self._reply_headers(req),
            None,
            bufs,
        )
        self.proc.post(env)

    def _reply_error(
        self, req: Envelope, type_name: str, message: str, exc: BaseException | None = None
    ) -> None:
        tb = "".join(traceback.format_exception(exc)) if exc is not None else ""
        err = ErrorReply(type_name=type_name, message=message, traceback=tb, actor_id=str(self.id))
        self.reply(req.reply_to, err, req)  # type: ignore[arg-type]

    def reply(self, port: PortId, msg: Any, req: Envelope | None = None) -> None:
        """Post a typed message (a reply or an ErrorReply) to ``port``."""
        tid = type(msg).__palatine_type_id__
        env = Envelope(
            self.id, port, tid, ENC_MSGPACK, encode_message(msg), None, self._reply_headers(req)
        )
        self.proc.post(env)

    # ---------------------------------------------------------------- supervision
    async def _on_child_event(self, event: SupervisionEvent) -> None:
        """Ask the actor (``__supervise__``) about a failure of what it owns. It runs as a
        plain ``def`` endpoint does (`palatine.core.suspend`), with the actor's context:
        it may wait on palatine calls, respawning the procs that died, say."""
        token = _current_cx.set(self.cx)
        try:
            out = suspend.call(self.actor.handle_supervision_event, (event,), {})
        finally:
            _current_cx.reset(token)
        try:
            if type(out) is suspend.Suspension:
                self.state = "processing"
                self.current_handler = "__supervise__"
                self.processing_since = self.loop.time()
                try:
                    handled = await out.outcome
                finally:
                    self.state = "idle" if self.state == "processing" else self.state
                    self.current_handler = None
            elif type(out) is suspend.Raised:
                raise out.error
            else:
                handled = out
        except Exception as e:
            raise _Failure(
                f"failed to handle supervision event: {type(e).__name__}: {e}",
                traceback.format_exc(),
            ) from e
        if handled is True:
            return
        if handled is False:
            self.caused_by = event
            raise _Failure(
                f"did not handle supervision event from {event.actor_id}: {event.message}"
            )
        raise _Failure(
            f"serving {self.id}: panic: handle_supervision_event returned {type(handled).__name__}, not bool"
        )

    def child_failed(self, event: SupervisionEvent) -> None:
        self.signal("supervision", event)

    def supervision_port(self) -> PortId:
        """A port of this actor for `SupervisionEvent`s from afar (opened once)."""
        port = self._supervision_port
        if port is None:
            port = self._supervision_port = self.mailbox.open_handler_port(
                SupervisionEvent.__palatine_type_id__,
                lambda event, _env: self.child_failed(event),
                "SupervisionEvent",
            )
        return port

    # ---------------------------------------------------------------- teardown
    async def _teardown(self) -> None:
        if self.mailbox.state == "open":
            self.mailbox.state = "stopping"
        self.state = "stopping"
        failed = self.failure is not None
        reason = self.failure or self.stop_reason or "stopped"
        # 1. children: drain, wait, abort stragglers
        if self.children:
            kids = list(self.children.values())
            for k in kids:
                k.request_stop("drain", f"parent {self.id} stopping")
            waits = [k.terminal for k in kids]
            _done, pending = await asyncio.wait(waits, timeout=config.get().stop_actor_timeout_s)
            if pending:
                for k in kids:
                    if not k.terminated:
                        k.request_stop("abort", f"parent {self.id} stopping")
                await asyncio.wait(waits, timeout=1.0)
        for t in list(self._tasks):
            t.cancel()
        # 2. on_stop
        if not failed and type(self.actor).on_stop is not Actor.on_stop:
            token = _current_cx.set(self.cx)
            try:
                await self.actor.on_stop(reason)
            except Exception as e:  # noqa: BLE001 - on_stop's error is the actor's failure
                self.failure = f"serving {self.id}: on_stop error: {type(e).__name__}: {e}"
                self.failure_tb = traceback.format_exc()
                failed = True
            finally:
                _current_cx.reset(token)
        cleanup = getattr(self.actor, "__cleanup__", None)
        if cleanup is not None:  # Monarch's hook: runs however the actor ends
            token = _current_cx.set(self.cx)
            try:
                done = cleanup(ActorAborted(self.failure) if failed else None)
                if inspect.isawaitable(done):
                    await done
            except Exception as e:  # noqa: BLE001 - __cleanup__'s error is the actor's failure
                if not failed:
                    self.failure = f"serving {self.id}: __cleanup__ error: {type(e).__name__}: {e}"
                    self.failure_tb = traceback.format_exc()
                    failed = True
            finally:
                _current_cx.reset(token)
        # 3. return queued messages, unbind ports, fail pending calls
        self.mailbox.state = "stopped"
        why = f"mailbox error: actor {self.id} is stopped"
        if failed and self.failure:
            why += f": it failed: {self.failure}"
        while self.queue:
            kind, _meta, _payload, env = self.queue.popleft()
            if env is not None and kind in (_ENDPOINT, _HANDLER, _RESUME):
                self.proc.return_envelope(env, why)
        self.mailbox.close(reason)
        self.proc.unregister(self)
        # 4. final status, exactly once
        self.state = "failed" if failed else "stopped"
        if self.parent is not None:
            self.parent.children.pop(self.id, None)
        if failed:
            event = SupervisionEvent(
                actor_id=str(self.id),
                status=self.status,
                message=self.failure or "",
                traceback=self.failure_tb,
                caused_by=self.caused_by,
            )
            if self.parent is not None and not self.parent.terminated:
                self.parent.child_failed(event)
            elif self.parent is None:
                self.proc.root_failed(self, event)
        if not self.terminal.done():
            self.terminal.set_result(self.status)
        # The actor object goes now (its ``__del__`` runs once nobody else holds it): the
        # proc keeps this record of how it ended, not the actor.
        self.__dict__.pop("actor", None)
