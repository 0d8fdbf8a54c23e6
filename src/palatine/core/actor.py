"""Actors: the `Actor` base class, ``@endpoint`` / ``@handler``, the registry.

An actor class declares endpoints (Python calls with pickled arguments, all on the one
`EndpointCall` port) and typed handlers (msgspec `Message` structs on their own ports).
Every subclass registers at class creation under ``__palatine_name__`` or
``module.qualname``, so a proc can spawn it by name. The runtime side of a live actor
is `palatine.core.instance.ActorInstance`.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol, TypeVar, overload

from palatine.core.mailbox import Mailbox, OncePort, ProcLink, StreamPort
from palatine.core.shape import Point
from palatine.errors import MeshFailure
from palatine.ids import ActorId, GangId, PortId, ProcId
from palatine.wire.codec import Message, register

if TYPE_CHECKING:
    import asyncio

    from palatine.wire.envelope import Envelope

__all__ = [
    "Actor",
    "endpoint",
    "concurrent_endpoint",
    "handler",
    "EndpointInfo",
    "SupervisionEvent",
    "lookup_actor_type",
    "actor_type_name",
    "context",
    "current_rank",
    "current_size",
    "ENDPOINT_CALL_TID",
]

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class _EndpointCall:
    """Marker type of the single endpoint port; payload is pickled (method, args, kwargs)."""

    __palatine_name__ = "palatine.EndpointCall"


ENDPOINT_CALL_TID = register(_EndpointCall)


class SupervisionEvent(Message, kw_only=True):
    """A child (or root) actor ended `Failed`."""

    actor_id: str
    status: str
    message: str
    traceback: str = ""
    caused_by: SupervisionEvent | None = None
    host: str = ""  # where it ran (filled in by the proc's agent for a mesh's owner)
    pid: int = 0

    def failure(self) -> MeshFailure:
        """This event as the `palatine.errors.MeshFailure` a user's code handles."""
        rank: int | None = None
        for kind in (ActorId, ProcId):  # an actor failed, or the proc under a mesh died
            try:
                rank = kind.parse(self.actor_id).rank
                break
            except ValueError:
                continue
        return MeshFailure(self.actor_id, self.message, self.traceback, rank, self.host, self.pid)


class EndpointInfo:
    """What ``@endpoint`` records on a method."""

    __slots__ = ("name", "is_async", "timeout_s", "explicit_port", "concurrent", "propagate")

    def __init__(
        self,
        name: str,
        is_async: bool,
        timeout_s: float | None,
        explicit_port: bool = False,
        concurrent: bool = False,
        propagate: Any = None,
    ) -> None:
        self.name = name
        self.is_async = is_async
        self.timeout_s = timeout_s
        self.explicit_port = explicit_port
        self.concurrent = concurrent
        #: How ``.rref`` learns the shapes of the endpoint's results (as `remote`'s).
        self.propagate = propagate


@overload
def endpoint(fn: F) -> F: ...
@overload
def endpoint(
    *,
    timeout: float | None = None,
    explicit_response_port: bool = False,
    concurrent: bool = False,
    propagate: Any = None,
) -> Callable[[F], F]: ...


def endpoint(
    fn: Any = None,
    *,
    timeout: float | None = None,
    explicit_response_port: bool = False,
    concurrent: bool = False,
    propagate: Any = None,
) -> Any:
    """Mark a ``def`` or ``async def`` method as an endpoint (callable through refs/meshes).

    ``timeout``: the callers' deadline for this endpoint (else `Config.call_timeout_s`).
    ``explicit_response_port``: the method gets its caller's reply port
    (`palatine.core.ports.Port`) as its first argument and answers by sending to it, at
    any time, instead of by returning; an exception it raises still reaches the caller.
    ``concurrent``: while a call waits (``await``, or a blocking palatine call in a plain
    ``def``), the actor goes on with its next messages instead of waiting for it: two
    actors that call each other back do not deadlock. Such calls may interleave, so
    they must not rely on the actor's state staying put across a wait.
    ``propagate``: the endpoint may also be called from a tensor engine on its actors'
    procs (``mesh.<name>.rref(...)``), its results mesh tensors shaped by this function
    of its arguments; ``"inspect"``: called for its effect (``rref`` returns None).
    """

    def mark(f: F) -> F:
        f.__palatine_endpoint__ = EndpointInfo(  # type: ignore[attr-defined]
            f.__name__,
            inspect.iscoroutinefunction(f),
            timeout,
            explicit_response_port,
            concurrent,
            propagate,
        )
        return f

    return mark(fn) if fn is not None else mark


def concurrent_endpoint(fn: Any = None, *, timeout: float | None = None) -> Any:
    """``@endpoint(concurrent=True)`` (Monarch's ``concurrent_endpoint``)."""
    mark = endpoint(timeout=timeout, concurrent=True)
    return mark(fn) if fn is not None else mark


def _message_hint(fn: Callable[..., Any], param: str) -> Any:
    """The resolved annotation of one parameter (only that one: ``self`` may name a type
    imported under ``TYPE_CHECKING``, as in a mixin)."""
    hint = fn.__annotations__[param]
    if isinstance(hint, str):  # postponed evaluation: resolve it as typing.get_type_hints would
        hint = eval(hint, fn.__globals__)  # noqa: S307 - the module's own annotation text
    return hint


def handler(fn: F) -> F:
    """Mark a method ``(self, msg: T) -> R`` as the handler of message type ``T``."""
    fn.__palatine_handler__ = True  # type: ignore[attr-defined]
    return fn


_REGISTRY: dict[str, type[Actor]] = {}


def actor_type_name(cls: type[Actor]) -> str:
    return cls.__dict__.get("__palatine_name__") or f"{cls.__module__}.{cls.__qualname__}"


class Instance(Protocol):
    """``context().actor_instance`` (Monarch's name): the running actor itself."""

    @property
    def actor_id(self) -> ActorId: ...
    @property
    def rank(self) -> dict[str, int]: ...
    def abort(self, reason: str | None = None) -> None:
        """Fail this actor once the message being handled is done; its owner is told why."""
        ...

    def stop(self, reason: str | None = None) -> None:
        """Stop this actor once it has handled what it has queued."""
        ...


class Context(Protocol):
    """What an actor sees of the runtime (``self.cx``, `context()`): its id and rank, the
    message being handled, ports, spawn, timers, casts.

    A protocol, so that the actor base class sits below the runtime that runs it
    (`palatine.core.instance.ActorContext` is the implementation).
    """

    env: Envelope | None
    """The message being handled (None between messages)."""

    @property
    def actor_id(self) -> ActorId: ...
    @property
    def proc(self) -> ProcLink:
        """The proc this actor runs in (`palatine.core.proc.Proc.of` gives all of it)."""
        ...

    @property
    def mailbox(self) -> Mailbox: ...
    @property
    def rank(self) -> dict[str, int]: ...
    @property
    def sender(self) -> ActorId | None: ...
    @property
    def message_rank(self) -> dict[str, int]:
        """The point of the called mesh the handled message was cast to."""
        ...

    @property
    def headers(self) -> dict[str, str | int]: ...
    @property
    def actor_instance(self) -> Instance:
        """The running actor (Monarch's ``context().actor_instance``)."""
        ...

    async def spawn(
        self, cls: type[Actor], *args: Any, name: str | None = None, **kw: Any
    ) -> Any: ...
    def spawn_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...
    def open_port(self) -> StreamPort: ...
    def open_once_port(self) -> OncePort: ...
    def schedule(self, delay_s: float, msg: Any) -> asyncio.TimerHandle: ...
    def cast(self, gang: GangId, msg: Any, ranks: Any = None) -> None: ...
    def stop(self, reason: str = "stopped by itself") -> None: ...
    def abort(self, reason: str = "aborted by itself") -> NoReturn:
        """Fail this actor now (raises; from one of its own handlers)."""
        ...

    def reply(self, port: PortId, msg: Any, req: Envelope | None = None) -> None: ...
    def tell_self(self, msg: Any) -> None: ...
    def supervision_port(self) -> PortId:
        """Where the failures of meshes this actor spawns are sent (its supervision)."""
        ...


class Actor:
    """Base class of actors. Hooks: ``init``, ``on_stop``, supervision, undeliverables.

    ``self.cx`` is the actor's `Context` (set before ``init`` runs).
    """

    __palatine_name__: ClassVar[str | None] = None
    _palatine_endpoints: ClassVar[dict[str, EndpointInfo]] = {}
    _palatine_handler_names: ClassVar[list[str]] = []
    _palatine_handlers: ClassVar[dict[int, tuple[str, type[Any], bool]] | None] = None
    cx: Context

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        eps: dict[str, EndpointInfo] = {}
        hnames: list[str] = []
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                info = getattr(value, "__palatine_endpoint__", None)
                if info is not None:
                    eps[name] = info
                if getattr(value, "__palatine_handler__", False) and name not in hnames:
                    hnames.append(name)
        cls._palatine_endpoints = eps
        cls._palatine_handler_names = hnames
        cls._palatine_handlers = None
        _REGISTRY[actor_type_name(cls)] = cls

    @classmethod
    def _handler_table(cls) -> dict[int, tuple[str, type[Any], bool]]:
        """type_id -> (method name, message type, is_async); resolved on first spawn."""
        known: dict[int, tuple[str, type[Any], bool]] | None = cls.__dict__.get(
            "_palatine_handlers"
        )
        if known is not None:
            return known
        table: dict[int, tuple[str, type[Any], bool]] = {}
        for name in cls._palatine_handler_names:
            fn = getattr(cls, name)
            params = [p for p in inspect.signature(fn).parameters if p != "self"]
            if not params or params[0] not in fn.__annotations__:
                raise TypeError(f"handler {cls.__qualname__}.{name} needs an annotated message")
            mtype = _message_hint(fn, params[0])
            tid = getattr(mtype, "__palatine_type_id__", None)
            if tid is None:
                raise TypeError(f"handler {cls.__qualname__}.{name}: {mtype!r} is not a Message")
            table[tid] = (name, mtype, inspect.iscoroutinefunction(fn))
        cls._palatine_handlers = table
        return table

    async def init(self) -> None:
        """Runs in ``initializing``, before the first message; raising fails the spawn."""

    async def on_stop(self, reason: str) -> None:
        """Runs during teardown, after children stopped; raising fails the actor."""

    def handle_supervision_event(self, event: SupervisionEvent) -> bool:
        """A child, or an actor of a mesh this actor spawned, failed. True: handled. False:
        this actor fails too, and its own owner hears of it. The default asks
        ``__supervise__(failure: MeshFailure) -> bool`` (Monarch's name) when the class
        defines it, else returns False."""
        supervise = getattr(self, "__supervise__", None)
        if supervise is None:
            return False
        return bool(supervise(event.failure()))

    def handle_undeliverable(self, returned: Envelope) -> None:
        """A message this actor sent was returned; the default logs (rate-limited)."""
        _warn_undeliverable(self.cx.actor_id, returned)


_warned: dict[tuple[Any, Any], list[float]] = {}


def _warn_undeliverable(owner: Any, env: Envelope) -> None:
    """WARNING at most once per destination proc per 10 s, with a suppressed count; a
    message to a world that was stopped (the job ending) is routine: DEBUG."""
    if any("peer gone: removed: " in e for e in env.errors or ()):
        log.debug("%s: a message to %s was returned: %s", owner, env.dest, env.errors)
        return
    key = (owner, env.dest.actor.proc)
    now = time.monotonic()
    slot = _warned.get(key)
    if slot is not None and now - slot[0] < 10.0:
        slot[1] += 1
        return
    suppressed = int(slot[1]) if slot else 0
    _warned[key] = [now, 0]
    extra = f" ({suppressed} similar suppressed)" if suppressed else ""
    errors = "; ".join(env.errors or ())
    log.warning(
        "%s: a message to %s was undeliverable and returned: %s%s",
        owner,
        env.dest,
        errors,
        extra,
    )


def lookup_actor_type(name: str) -> type[Actor] | None:
    """The registered actor class for ``name``, importing its module if needed."""
    cls = _REGISTRY.get(name)
    if cls is not None:
        return cls
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        break
    return _REGISTRY.get(name)


_current_cx: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "palatine_context", default=None
)


def context() -> Context:
    """The `Context` of the actor whose handler is running (RuntimeError outside one)."""
    cx = _current_cx.get()
    if cx is None:
        raise RuntimeError("palatine.context() called outside an actor")
    return cx


def current_rank() -> Point | dict[str, int]:
    """The running actor's coordinates in its mesh: a `palatine.core.shape.Point`
    (``{"hosts": 1, "gpus": 3}``, with ``.rank`` and ``.extent``) for actors a proc
    mesh spawned; a plain dict (``{}`` for an actor outside any mesh) otherwise."""
    return context().rank


def current_size() -> dict[str, int]:
    """The sizes of the running actor's mesh by dimension (``{"hosts": 2, "gpus": 4}``)."""
    extent = getattr(context().rank, "extent", None)
    return dict(extent.items()) if extent is not None else {}
