"""References and meshes: `ActorRef`, `ActorMesh`, endpoint handles, `ValueMesh`.

``x.<endpoint>`` offers ``call_one``, ``call``, ``stream``, ``broadcast``/``send`` and
``choose``. A single `ActorRef` sends directly; every mesh operation goes through the
cast path, so all operations from one sender reach each actor in order. Everything
here may be called from any thread: the work runs on the palatine loop.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import queue
import random
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic

from palatine import config
from palatine.core import runtime, suspend
from palatine.core.actor import ENDPOINT_CALL_TID, Actor, _current_cx
from palatine.core.comm import Cast, cast_envelope, normalize
from palatine.core.future import LOOP_THREAD_ERROR, Future, on_loop_thread
from palatine.core.mailbox import Mailbox
from palatine.core.ports import Port
from palatine.core.proc import StopActor
from palatine.core.sender import caller_mailbox, default_client
from palatine.core.shape import Extent, Point
from palatine.fastpath import lane
from palatine.ids import ActorId, GangId, PortId, ProcId
from palatine.wire.codec import dumps, encode_message
from palatine.wire.envelope import ENC_MSGPACK, ENC_PICKLE, Envelope

__all__ = ["ActorRef", "ActorMesh", "ValueMesh", "Endpoint", "send"]

# The types that make endpoint calls checkable (typing only: nothing here runs per call).
# ``Endpoint[P, R]``: an endpoint taking ``P`` and returning ``R``; ``ActorMesh[A]`` and
# ``ActorRef[A]``: actors of class ``A``. Each has a default, so a bare ``ActorMesh``
# means any actor and ``mesh.x`` any endpoint; `palatine.mesh.mypy_plugin` gives
# ``mesh.x`` the type of ``A``'s endpoint ``x`` instead.
if TYPE_CHECKING:
    from typing_extensions import ParamSpec, TypeVar

    P = ParamSpec("P", default=...)
    R = TypeVar("R", default=Any)
    A = TypeVar("A", bound=Actor, default=Actor, covariant=True)
    V = TypeVar("V", default=Any)
else:
    from typing import ParamSpec, TypeVar

    P = ParamSpec("P")
    R = TypeVar("R")
    A = TypeVar("A", bound=Actor, covariant=True)
    V = TypeVar("V")


def _self_call_check(mb: Mailbox, dest: ActorId) -> None:
    if mb.actor_id == dest:
        raise RuntimeError(
            f"{dest} called itself: a handler waiting on its own actor would deadlock"
        )


class ValueMesh(Generic[V]):
    """Replies of a mesh call, in rank order, with their coordinates."""

    def __init__(self, dims: Sequence[tuple[str, int]], ranks: Sequence[int], values: Sequence[V]):
        self._dims = list(dims)
        # A mesh of no dimensions (`this_proc`'s) is one point, whatever its proc's rank.
        self._ranks = list(ranks) if self._dims else [0] * len(ranks)
        self._values = list(values)

    def _coords(self, rank: int) -> Point:
        return Extent.of(self._dims).point(rank)

    @property
    def extent(self) -> Extent:
        """The dimensions of the mesh the values came from."""
        return Extent.of(self._dims)

    def items(self) -> Iterator[tuple[Point, V]]:
        """``(point, value)`` per rank that answered, in rank order."""
        extent = Extent.of(self._dims)
        for r, v in zip(self._ranks, self._values, strict=True):
            yield extent.point(r), v

    def slice(self, **sel: int | slice) -> ValueMesh[V]:
        """The values of some ranks, by dimension (``vm.slice(hosts=1)``,
        ``vm.slice(gpus=slice(0, 2))``), keeping the mesh's shape and the ranks' points."""
        keep = set(Extent.of(self._dims).select(self._ranks, **sel))
        pairs = [(r, v) for r, v in zip(self._ranks, self._values, strict=True) if r in keep]
        ranks, values = [r for r, _ in pairs], [v for _, v in pairs]
        return ValueMesh(self._dims, ranks, values)

    def flatten(self, name: str) -> ValueMesh[V]:
        """The same values over one dimension ``name``."""
        return ValueMesh([(name, math.prod(s for _, s in self._dims))], self._ranks, self._values)

    def rename(self, **names: str) -> ValueMesh[V]:
        """The same values with dimensions renamed."""
        known = [n for n, _ in self._dims]
        for old in names:
            if old not in known:
                raise ValueError(f"unknown dimension {old!r}; this mesh has {known}")
        return ValueMesh([(names.get(n, n), s) for n, s in self._dims], self._ranks, self._values)

    def item(self, **point: int) -> V:
        """The value at ``point``, which names every dimension (``vm.item(hosts=1, gpus=0)``);
        a mesh of one value takes no arguments."""
        if not point and len(self._values) == 1:
            return self._values[0]
        rank = Extent.of(self._dims).rank_of(point)
        try:
            return self._values[self._ranks.index(rank)]
        except ValueError:
            raise KeyError(f"no value at {point}: this mesh holds ranks {self._ranks}") from None

    def values(self) -> list[V]:
        return list(self._values)

    def __getitem__(self, key: int | dict[str, int]) -> V:
        if isinstance(key, dict):
            for r, v in zip(self._ranks, self._values, strict=True):
                if self._coords(r) == {**self._coords(r), **key}:
                    return v
            raise KeyError(key)
        return self._values[key]

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[V]:
        return iter(self._values)

    def __repr__(self) -> str:
        return f"ValueMesh({self._values!r})"


def _encode_call(
    method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bytes, list[Any]]:
    return dumps((method, args, kwargs))


def _encode_in_band(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """A cast's payload: one in-band pickle (casts do not carry out-of-band buffers)."""
    data, bufs = _encode_call(method, args, kwargs)
    if bufs:
        import pickle

        data = pickle.dumps((method, args, kwargs), protocol=5)
    return data


def _direct_envelope(
    sender: ActorId,
    origin: str,
    dest: ActorId,
    rank: int,
    size: int,
    data: bytes,
    reply_to: PortId | None,
) -> Envelope:
    """One rank's endpoint call of a cast delivered directly (no tree step)."""
    return Envelope(
        sender,
        PortId(dest, ENDPOINT_CALL_TID),
        ENDPOINT_CALL_TID,
        ENC_PICKLE,
        data,
        reply_to,
        {"cast_rank": rank, "cast_size": size, "cast_origin": origin},
    )


def _call_via(dests: tuple[tuple[int, ActorId], ...], call: lane.Call) -> Future[Any]:
    """A call's future: over the calling thread's lanes when it may (`palatine.fastpath.lane`),
    else through the loop (``call.go`` runs there). ``dests``: as `palatine.fastpath.lane.try_call`."""
    if on_loop_thread():
        return runtime.call(call.go, call.transform)
    client = default_client()
    if client is not None and _current_cx.get() is None:
        on_lane = lane.try_call(client.mailbox, dests, call)
        if on_lane is not None:
            return on_lane
    fut = runtime.call(call.go, call.transform)
    lane.note_call(frozenset(dest.proc for _, dest in dests), fut)
    return fut


class _RefCall:
    """``ActorRef.x.call_one(...)``: one envelope straight to the actor (`palatine.fastpath.lane.Call`)."""

    __slots__ = ("dest", "data", "bufs", "what", "timeout_s")
    transform = None

    def __init__(
        self, dest: ActorId, data: bytes, bufs: list[Any], what: str, timeout_s: float
    ) -> None:
        self.dest = dest
        self.data = data
        self.bufs = bufs
        self.what = what
        self.timeout_s = timeout_s

    def envelope(self, mb: Mailbox, rank: int, reply_to: PortId) -> Envelope:
        dest = self.dest
        return Envelope(
            mb.actor_id,
            PortId(dest, ENDPOINT_CALL_TID),
            ENDPOINT_CALL_TID,
            ENC_PICKLE,
            self.data,
            reply_to,
            None,
            None,
            self.bufs,
        )

    def go(self) -> Any:
        mb = caller_mailbox()
        _self_call_check(mb, self.dest)
        p = mb.pending(self.dest, self.what, self.timeout_s)
        mb.proc.post(self.envelope(mb, -1, p.id))
        return p


class _MeshCallOne:
    """``mesh.x.call_one(...)`` on a one-actor selection (`palatine.fastpath.lane.Call`)."""

    __slots__ = ("mesh", "dest", "rank", "data", "what", "timeout_s")
    transform = None

    def __init__(
        self, mesh: ActorMesh, rank: int, data: bytes, what: str, timeout_s: float
    ) -> None:
        self.mesh = mesh
        self.dest = mesh.gang.actor(rank)
        self.rank = rank
        self.data = data
        self.what = what
        self.timeout_s = timeout_s

    def envelope(self, mb: Mailbox, rank: int, reply_to: PortId) -> Envelope:
        return _direct_envelope(
            mb.actor_id, mb.actor_text, self.dest, self.rank, self.mesh._size, self.data, reply_to
        )

    def go(self) -> Any:
        mb = caller_mailbox()
        _self_call_check(mb, self.dest)
        p = mb.pending(self.dest, self.what, self.timeout_s)
        self.mesh._cast(mb, self.data, p.id)
        return p


class _MeshCall:
    """``mesh.x.call(...)``: one request per selected rank, replies gathered in rank order
    (`palatine.fastpath.lane.Call`)."""

    __slots__ = ("mesh", "ranks", "data", "what", "timeout_s")

    def __init__(
        self, mesh: ActorMesh, ranks: list[int], data: bytes, what: str, timeout_s: float
    ) -> None:
        self.mesh = mesh
        self.ranks = ranks
        self.data = data
        self.what = what
        self.timeout_s = timeout_s

    def envelope(self, mb: Mailbox, rank: int, reply_to: PortId) -> Envelope:
        m = self.mesh
        return _direct_envelope(
            mb.actor_id, mb.actor_text, m.gang.actor(rank), rank, m._size, self.data, reply_to
        )

    def go(self) -> Any:
        m, ranks = self.mesh, self.ranks
        mb = caller_mailbox()
        g = mb.gather(
            m.gang.actor(ranks[0]) if ranks else m.gang.actor(0),
            self.what,
            self.timeout_s,
            m._procs(),
        )
        if not ranks:
            g._complete()
        else:
            m._cast(mb, self.data, g.id)
        return g

    def transform(self, res: dict[int, Any]) -> ValueMesh[Any]:
        return ValueMesh(self.mesh._dims, self.ranks, [res[r] for r in self.ranks])


class Endpoint(Generic[P, R]):
    """``ref.<name>`` / ``mesh.<name>``: the ways to invoke one endpoint, which takes
    ``P`` and returns ``R`` (for type checkers: `palatine.mesh.mypy_plugin`)."""

    __slots__ = ("_target", "_name")

    def __init__(self, target: ActorRef | ActorMesh, name: str) -> None:
        self._target = target
        self._name = name

    def _timeout(self) -> float:
        info = self._target._endpoint_info(self._name)
        if info is not None and info.timeout_s is not None:
            return float(info.timeout_s)
        return config.get().call_timeout_s

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call exactly one actor; a Future of its reply."""
        return self._target._call_one(self._name, args, kwargs, self._timeout())

    def call(self, *args: P.args, **kwargs: P.kwargs) -> Future[ValueMesh[R]]:
        """Call every selected actor; a Future of a `ValueMesh` in rank order."""
        return self._target._as_mesh()._call(self._name, args, kwargs, self._timeout())

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call one arbitrary actor of the selection."""
        mesh = self._target._as_mesh()
        r = random.choice(mesh._ranks)
        return mesh._slice_ranks([r])._call_one(self._name, args, kwargs, self._timeout())

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """One-way to every selected actor; handler errors go to supervision."""
        if isinstance(self._target, ActorRef):
            self._target._send(self._name, args, kwargs)
        else:
            self._target._broadcast(self._name, args, kwargs)

    send = broadcast  # Monarch's earlier name for a one-way call to every actor

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> _Stream[R]:
        """Replies as ``(rank, reply)`` in arrival order (sync and async iterator)."""
        return self._target._as_mesh()._stream(self._name, args, kwargs, self._timeout())

    def rref(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """Call the endpoint from the active tensor engine on its actors' procs, in order
        with the engine's ops: its results are mesh tensors (shapes from the endpoint's
        ``propagate``). Monarch's ``rref``; the tensor layer provides it (`RREF`)."""
        if RREF[0] is None:
            raise RuntimeError("rref needs a tensor engine: activate one (procs.activate())")
        info = self._target._endpoint_info(self._name)
        propagate = info.propagate if info is not None else None
        return RREF[0](self._target._as_mesh(), self._name, propagate, args, kwargs)


#: How `Endpoint.rref` calls an endpoint from a tensor engine, set by the tensor layer
#: above this one when it loads (``palatine.tensor.client.actor_calls``).
RREF: list[Callable[..., Any] | None] = [None]


def send(
    endpoint: Endpoint[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    port: Port[Any] | None = None,
    selection: str = "all",
) -> None:
    """Invoke ``endpoint`` one-way on its mesh's actors (``selection="all"``) or on one
    of them (``"choose"``); with ``port``, every reply is sent there (read it with the
    port's `palatine.PortReceiver`). Monarch's ``monarch.actor.send``."""
    mesh = endpoint._target._as_mesh()
    if selection == "choose":
        mesh = mesh._slice_ranks([random.choice(mesh._ranks)])
    elif selection != "all":
        raise ValueError(f"selection must be 'all' or 'choose', not {selection!r}")
    reply_to = port.port_id if port is not None else None
    mesh._broadcast(endpoint._name, tuple(args), dict(kwargs or {}), reply_to)


class _Stream(Generic[R]):
    """Items ``(rank, value)``; a failed rank yields its exception as the value."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self._q: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._aq: asyncio.Queue[tuple[int, Any]] | None = None
        self._seen = 0
        self._on_push: Callable[[Any], None] | None = None  # a suspended endpoint's wake-up

    def push(self, rank: int, value: Any, exc: BaseException | None) -> None:
        self._q.put((rank, exc if exc is not None else value))
        wake = self._on_push
        if wake is not None:
            self._on_push = None
            wake(None)

    def _when_pushed(self, fn: Callable[[Any], None]) -> None:
        self._on_push = fn

    def __iter__(self) -> Iterator[tuple[int, R]]:
        while self._seen < self.expected:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                if on_loop_thread():
                    item = self._next_on_loop()
                else:
                    item = self._q.get(timeout=_stream_wait_s())
            self._seen += 1
            yield item

    def _next_on_loop(self) -> tuple[int, Any]:
        """The next item, on the loop thread the items arrive on: a synchronous endpoint
        gives the loop back meanwhile (`palatine.core.suspend`); anywhere else, waiting
        would block the items (and everything else on the loop) until the timeout, so it
        fails at once, as a blocking `Future.get` does there."""
        if not suspend.can_suspend():
            raise RuntimeError(LOOP_THREAD_ERROR) from None
        timeout = _stream_wait_s()
        suspend.wait(self._when_pushed, timeout)
        self._on_push = None
        try:
            return self._q.get_nowait()
        except queue.Empty:
            raise TimeoutError(f"no stream item within {timeout} s") from None

    def __aiter__(self) -> AsyncIterator[tuple[int, R]]:
        return self._agen()

    async def _agen(self) -> AsyncIterator[tuple[int, R]]:
        while self._seen < self.expected:
            self._seen += 1
            try:
                yield self._q.get_nowait()
            except queue.Empty:
                yield await asyncio.to_thread(self._q.get, True, _stream_wait_s())


def _stream_wait_s() -> float | None:
    """How long a stream's reader waits for the next item: past the call timeout (the
    gather fails each missing rank by then); None (no bound) for an endless one."""
    t = config.get().call_timeout_s
    return None if math.isinf(t) else t + 5


class ActorRef(Generic[A]):
    """A reference to one actor (of class ``A``); behaves like a mesh of one but sends
    directly."""

    __slots__ = ("actor_id", "_cls")

    def __init__(self, actor_id: ActorId, cls: type[A] | None = None) -> None:
        self.actor_id = actor_id
        self._cls = cls

    def __getattr__(self, name: str) -> Endpoint[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        return Endpoint(self, name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and other.actor_id == self.actor_id

    def __hash__(self) -> int:
        return hash(self.actor_id)

    def __repr__(self) -> str:
        return f"ActorRef({str(self.actor_id)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ActorRef, (self.actor_id, self._cls))

    def _endpoint_info(self, name: str) -> Any:
        return self._cls._palatine_endpoints.get(name) if self._cls is not None else None

    def port(self, mtype: type[Any]) -> PortId:
        return PortId(self.actor_id, mtype.__palatine_type_id__)

    def ask(self, msg: Any, timeout: float | None = None) -> Future[Any]:
        """Typed request/reply; a Future of the reply (deadline ``rpc_timeout`` by default)."""
        t = timeout if timeout is not None else config.get().rpc_timeout_s
        dest = self.actor_id

        def go() -> asyncio.Future[Any]:
            mb = caller_mailbox()
            _self_call_check(mb, dest)
            return mb.ask(dest, msg, t)

        return runtime.call(go)

    def tell(self, msg: Any) -> None:
        """One-way typed message."""
        dest = self.actor_id
        data = encode_message(msg)
        tid = type(msg).__palatine_type_id__

        def go() -> None:
            mb = caller_mailbox()
            mb.proc.post(Envelope(mb.actor_id, PortId(dest, tid), tid, ENC_MSGPACK, data))

        runtime.post(go)

    def _call_one(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float
    ) -> Future[Any]:
        data, bufs = _encode_call(method, args, kwargs)
        dest = self.actor_id
        return _call_via(((-1, dest),), _RefCall(dest, data, bufs, f"call {method}", timeout_s))

    def _send(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        data, bufs = _encode_call(method, args, kwargs)
        dest = self.actor_id

        def go() -> None:
            mb = caller_mailbox()
            env = Envelope(
                mb.actor_id,
                PortId(dest, ENDPOINT_CALL_TID),
                ENDPOINT_CALL_TID,
                ENC_PICKLE,
                data,
                None,
                None,
                None,
                bufs,
            )
            mb.proc.post(env)

        runtime.post(go)

    def _as_mesh(self) -> ActorMesh[A]:
        if self.actor_id.pid != 0:
            raise ValueError(f"{self.actor_id} is a child actor: only direct calls reach it")
        gang = GangId(self.actor_id.proc.world, self.actor_id.name)
        r = self.actor_id.rank
        return ActorMesh(gang, [("rank", r + 1)], [r], self._cls)


class ActorMesh(Generic[A]):
    """Actors (of class ``A``) of one gang over a mesh of procs; ``slice`` narrows the
    selection."""

    def __init__(
        self,
        gang: GangId,
        dims: Sequence[tuple[str, int]],
        ranks: Sequence[int] | None = None,
        cls: type[A] | None = None,
    ) -> None:
        self.gang = gang
        self._dims = list(dims)
        self._size = math.prod(s for _, s in self._dims)
        self._ranks = list(range(self._size)) if ranks is None else sorted(ranks)
        self._cls = cls

    def __getattr__(self, name: str) -> Endpoint[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        ep = self.__dict__[name] = Endpoint(self, name)  # later lookups skip __getattr__
        return ep

    def __len__(self) -> int:
        return len(self._ranks)

    def __repr__(self) -> str:
        return f"ActorMesh({self.gang}, dims={self._dims}, ranks={self._ranks})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ActorMesh, (self.gang, self._dims, self._ranks, self._cls))

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._dims)

    def _endpoint_info(self, name: str) -> Any:
        return self._cls._palatine_endpoints.get(name) if self._cls is not None else None

    def _as_mesh(self) -> ActorMesh[A]:
        return self

    def _coords(self, rank: int) -> dict[str, int]:
        return Extent.of(self._dims).point(rank)

    def slice(self, **sel: int | slice) -> ActorMesh[A]:
        """Narrow the selection: ``mesh.slice(procs=2)`` or ``mesh.slice(procs=slice(0, 2))``."""
        keep = Extent.of(self._dims).select(self._ranks, **sel)
        return self._slice_ranks(keep)

    def flatten(self, name: str) -> ActorMesh[A]:
        """The same actors over one dimension ``name`` (ranks keep their row-major order)."""
        return ActorMesh(self.gang, [(name, self._size)], self._ranks, self._cls)

    def rename(self, **names: str) -> ActorMesh[A]:
        """The same actors with dimensions renamed: ``mesh.rename(procs="gpus")``."""
        known = [n for n, _ in self._dims]
        for old in names:
            if old not in known:
                raise ValueError(f"unknown dimension {old!r}; this mesh has {known}")
        dims = [(names.get(n, n), s) for n, s in self._dims]
        return ActorMesh(self.gang, dims, self._ranks, self._cls)

    def stop(self, timeout: float | None = None) -> Future[None]:
        """Stop the selected actors (each handles what it has queued, and is aborted after
        ``timeout``, `Config.stop_actor_timeout_s` by default); their procs and the
        other actors on them serve on. Later calls to them fail with "is stopped"."""
        t = config.get().stop_actor_timeout_s if timeout is None else timeout
        world, name = self.gang.world, self.gang.name
        ranks = list(self._ranks)

        async def go() -> None:
            mb = caller_mailbox()
            msg = StopActor(name=name, timeout_s=t)
            await asyncio.gather(*(mb.ask(world.proc(r).actor("proc"), msg, t + 5) for r in ranks))

        return runtime.submit(go)

    def _slice_ranks(self, ranks: list[int]) -> ActorMesh[A]:
        return ActorMesh(self.gang, self._dims, ranks, self._cls)

    def _cast(self, mb: Mailbox, data: bytes, reply_to: PortId | None) -> None:
        """Cast ``data`` (`_encode_in_band`) to the selection."""
        fanout = config.get().cast_fanout
        if self._size <= fanout:
            # Root step of a tree whose blocks are all single ranks: direct deliveries.
            sender = mb.actor_id
            origin = mb.actor_text
            post = mb.proc.post
            world = self.gang.world
            name = self.gang.name
            for r in self._ranks:
                dest = ActorId(ProcId(world, r), name, 0)
                post(_direct_envelope(sender, origin, dest, r, self._size, data, reply_to))
            return
        cast = Cast(
            origin=mb.actor_id,
            gang=self.gang,
            gang_size=self._size,
            ranks=normalize(self._ranks, self._size),
            fanout=fanout,
            type_id=ENDPOINT_CALL_TID,
            encoding=ENC_PICKLE,
            data=data,
            reply_to=reply_to,
        )
        cast_envelope(mb, cast)

    def _procs(self) -> dict[int, ProcId]:
        w = self.gang.world
        return {r: w.proc(r) for r in self._ranks}

    def _call(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float
    ) -> Future[ValueMesh]:
        ranks = list(self._ranks)
        call = _MeshCall(
            self, ranks, _encode_in_band(method, args, kwargs), f"call {method}", timeout_s
        )
        if not ranks or self._size > config.get().cast_fanout:  # the cast tree: never lanes
            return runtime.call(call.go, call.transform)
        gang = self.gang
        return _call_via(tuple((r, gang.actor(r)) for r in ranks), call)

    def _call_one(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float
    ) -> Future[Any]:
        if len(self._ranks) != 1:
            raise ValueError(
                f"call_one needs a selection of exactly one actor, this one has {len(self._ranks)}"
            )
        call = _MeshCallOne(
            self, self._ranks[0], _encode_in_band(method, args, kwargs), f"call {method}", timeout_s
        )
        if self._size > config.get().cast_fanout:  # through the cast tree: never a lane
            return runtime.call(call.go)
        return _call_via(((-1, call.dest),), call)

    def _broadcast(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reply_to: PortId | None = None,
    ) -> None:
        data = _encode_in_band(method, args, kwargs)

        def go() -> None:
            self._cast(caller_mailbox(), data, reply_to)

        runtime.post(go)

    def _stream(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float
    ) -> _Stream:
        st = _Stream(len(self._ranks))
        data = _encode_in_band(method, args, kwargs)

        def go() -> None:
            mb = caller_mailbox()
            g = mb.gather(
                self.gang.actor(self._ranks[0]),
                f"stream {method}",
                timeout_s,
                self._procs(),
                st.push,
            )
            self._cast(mb, data, g.id)

        runtime.post(go)
        return st


_counter = itertools.count()
