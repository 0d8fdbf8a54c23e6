"""`remote`, `fetch` and `inspect`: running functions on workers and getting values back.

A remote call returns at once: it allocates the seq and the
result refs, pickles the arguments (handles become refs: the call's ``uses``), and hands
``Node`` + ``CallFunction`` to the session. ``fetch`` issues a ``SendValue`` to one rank
and a ``RequestStatus`` to every rank (completion needs every rank).
"""

from __future__ import annotations

import functools
import inspect as _inspect
from collections.abc import Callable
from typing import Any

from palatine.core import runtime
from palatine.core.future import Future
from palatine.protocol.worker import CallFunction, FunctionRef, RequestStatus, SendValue, Slice
from palatine.tensor.client.context import active_mesh, active_stream, get_active_mesh
from palatine.tensor.client.session import Handle, Stream
from palatine.tensor.client.shapes import MeshShape, slice_shape
from palatine.tensor.client.sites import capture_site
from palatine.tensor.client.values import RemoteValue, ValueMesh, function_ref, pickle_args

__all__ = [
    "remote",
    "RemoteFunction",
    "fetch",
    "fetch_shard",
    "inspect",
    "show",
    "call_on_shard_and_fetch",
    "restore",
]


def _checker(
    mesh: ValueMesh, stream_id: int | None, stream_name: str = "", ranks: set[int] | None = None
) -> Callable[[Handle], None]:
    """What checks each handle a call on ``mesh`` (on ``ranks`` of it, when given) uses."""
    ranks = set(mesh.ranks) if ranks is None else ranks
    session = mesh.session
    records = session.recovery

    def check(h: Handle) -> None:
        if h.session is not session:
            raise TypeError(f"{h!r} belongs to another session than mesh {mesh!r}")
        if isinstance(h, RemoteValue):
            if h.dropped_at is not None:
                raise TypeError(f"{h!r} was dropped at {h.dropped_at.short()}")
            if not ranks <= set(h.mesh.ranks):
                raise TypeError(f"{h!r} does not live on every rank of {mesh!r}")
            records.check_not_lost(h, ranks)
            if stream_id is not None and h.stream.id != stream_id:
                raise TypeError(
                    f"{h!r} lives on stream {h.stream.name!r}, not the call's stream "
                    f"{stream_name!r}: use value.to_stream(stream)"
                )

    return check


class RemoteFunction:
    """``remote(fn)``: calling it runs ``fn`` on every rank of the active mesh."""

    def __init__(self, fn: Any, mutates: tuple[str, ...] = (), returns: int = 1) -> None:
        self.fn = fn
        self.mutates = tuple(mutates)
        self.returns = returns
        self._ref_label: tuple[Any, str] | None = None
        functools.update_wrapper(self, fn, updated=()) if callable(fn) else None

    def _function(self) -> tuple[Any, str]:
        if self._ref_label is None:
            self._ref_label = function_ref(self.fn)
        return self._ref_label

    def _mutated(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[RemoteValue]:
        if not self.mutates:
            return []
        bound = _inspect.signature(self.fn).bind(*args, **kwargs)
        out = []
        for name in self.mutates:
            v = bound.arguments.get(name)
            if not isinstance(v, RemoteValue):
                raise TypeError(
                    f"mutated argument {name!r} must be a remote value, got {type(v).__name__}"
                )
            v.check_mutable(name)
            out.append(v)
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mesh = active_mesh()
        session = mesh.session
        session.check_usable()
        stream = active_stream(mesh)
        site = capture_site()
        fref, label = self._function()
        mutated = self._mutated(args, kwargs)
        pickled, uses = pickle_args((args, kwargs), _checker(mesh, stream.id, stream.name))
        results = [session.ids.new_ref() for _ in range(self.returns)]
        mrefs = [v.ref for v in mutated]
        spec = mesh.slice_spec

        def commands(seq: int) -> list[tuple[Slice, Any]]:
            return [
                (
                    spec,
                    CallFunction(
                        seq=seq,
                        results=list(results),
                        mutates=mrefs,
                        function=fref,
                        args=pickled,
                        stream=stream.id,
                    ),
                )
            ]

        seq = session.issue(label, results + mrefs, uses, [], site=site, make_commands=commands)
        values = [RemoteValue(session, r, mesh, stream, seq, label) for r in results]
        if self.returns == 0:
            return None
        if self.returns == 1:
            return values[0]
        return tuple(values)


def remote(fn: Any = None, *, mutates: tuple[str, ...] = (), returns: int = 1) -> Any:
    """Make ``fn`` (a function or a dotted path) callable on every rank of the active mesh."""
    if fn is None:
        return lambda f: RemoteFunction(f, mutates, returns)
    return RemoteFunction(fn, mutates, returns)


def _shard_rank(mesh: ValueMesh, shard: Any, coords: dict[str, int] | None = None) -> int:
    """The worker-world rank of one shard of ``mesh``: ``shard`` None (the first), an int
    (an index into the mesh's ranks) or a dict of coordinates; ``coords`` are more
    coordinates (a dim not named is 0)."""
    if coords:
        if shard is not None and not isinstance(shard, dict):
            raise TypeError("give a shard either as shard= or as coordinates, not both")
        shard = {**(shard or {}), **coords}
    if shard is None:
        return mesh.ranks[0]
    if isinstance(shard, int):
        return mesh.ranks[shard]
    if isinstance(shard, dict):  # the rank at those coordinates (a dim not named: 0)
        whole = MeshShape(tuple(mesh.names), tuple(mesh.sizes), tuple(mesh.strides), mesh.offset)
        return slice_shape(whole, {**dict.fromkeys(mesh.names, 0), **shard}).offset
    raise TypeError(f"shard must be None, an int or a dict of dims, not {type(shard).__name__}")


def _send_value(
    label: str,
    function: FunctionRef | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mesh: ValueMesh | None,
    stream: Stream | None,
    shard: Any,
    coords: dict[str, int] | None,
) -> Future[Any]:
    """Run ``function(*args, **kwargs)`` (None: the single argument itself) on one shard
    and bring the result back: a Future. The remote values in the arguments must all
    live on that shard's rank and on one stream; ``mesh``/``stream`` default to theirs."""
    found: list[Handle] = []
    pickled, refs = pickle_args((args, kwargs), found.append)
    values = [h for h in found if isinstance(h, RemoteValue)]
    loop = runtime.get_loop()
    if not values and mesh is None:
        f: Future[Any] = Future(loop)
        if function is None:
            f.set_result(args[0])
        else:
            f.set_exception(RuntimeError(f"{label}: no active mesh and no mesh value to run on"))
        return f
    first = values[0] if values else None
    if mesh is None:
        assert first is not None
        mesh = first.mesh
    session = mesh.session
    session.check_usable()
    if stream is None:
        stream = first.stream if first is not None else active_stream(mesh)
    rank = _shard_rank(mesh, shard, coords)
    for v in values:
        if v.session is not session:
            raise TypeError(f"{v!r} belongs to another session")
        if v.dropped_at is not None:
            raise TypeError(f"{v!r} was dropped at {v.dropped_at.short()}")
        if rank not in v.mesh.ranks:
            raise TypeError(f"{v!r} does not live on rank {rank}")
        session.recovery.check_not_lost(v, {rank})
        if v.stream.id != stream.id:
            raise TypeError(
                f"WRONG_STREAM: {v!r} is on stream {v.stream.name!r}, the fetch runs on "
                f"{stream.name!r}"
            )
    site = capture_site()
    fut: Future[Any] = Future(loop)
    one = Slice(offset=rank, sizes=[1], strides=[1])
    world = Slice(offset=0, sizes=[session.world_size], strides=[1])
    sid = stream.id

    def commands(seq: int) -> list[tuple[Slice, Any]]:
        return [
            (
                one,
                SendValue(
                    seq=seq,
                    function=function,
                    args=pickled,
                    stream=sid,
                    deliver_to=session.actor.cx.actor_id,
                ),
            ),
            (world, RequestStatus(seq=seq, controller=False)),
        ]

    session.issue(label, [], refs, [], future=fut, site=site, make_commands=commands)
    return fut


def fetch_shard(obj: Any, shard: Any = None, **coords: int) -> Future[Any]:
    """A Future of ``obj`` (its mesh tensors and remote values substituted) as seen on
    one shard: ``shard`` is None (the first), an int or a dict of coordinates, or give
    the coordinates as keywords (``fetch_shard(t, host=1)``; a dim not named is 0)."""
    return _send_value("fetch", None, (obj,), {}, None, None, shard, coords)


def fetch(obj: Any, shard: Any = None) -> Future[Any]:
    """`fetch_shard` (the older name)."""
    return fetch_shard(obj, shard)


def inspect(obj: Any, shard: Any = None, **coords: int) -> Any:
    """``fetch_shard(obj, shard, **coords).result()``: the value, here."""
    return fetch_shard(obj, shard, **coords).result()


def call_on_shard_and_fetch(fn: Any, *args: Any, shard: Any = None, **kwargs: Any) -> Future[Any]:
    """Run ``fn(*args, **kwargs)`` on one shard of the active mesh (else of its mesh
    arguments' mesh) and bring the result back: a Future. ``fn``: a function, a dotted
    path or a ``remote(...)`` function; ``shard``: as in `fetch_shard`."""
    target = fn.fn if isinstance(fn, RemoteFunction) else fn
    fref, label = function_ref(target)
    return _send_value(label, fref, args, kwargs, get_active_mesh(), None, shard, None)


def show(obj: Any, shard: Any = None, **coords: int) -> None:
    """Print ``obj`` as one shard sees it (`inspect`), or every shard's value with its
    coordinates when no shard is named."""
    values: list[Handle] = []
    pickle_args(((obj,), {}), values.append)
    meshes = [v.mesh for v in values if isinstance(v, RemoteValue)]
    if shard is not None or coords or not meshes:
        print(inspect(obj, shard, **coords))
        return
    mesh = meshes[0]
    futures = []
    for i in range(len(mesh.ranks)):
        at = dict(zip(mesh.names, _coords(mesh, i), strict=True))
        futures.append((at, fetch_shard(obj, at)))
    for at, f in futures:
        where = ", ".join(f"{k}={v}" for k, v in at.items())
        print(f"[{where}] {f.result()!s}")


def _coords(mesh: ValueMesh, index: int) -> list[int]:
    """The coordinates of the ``index``-th rank of ``mesh`` (row-major)."""
    out = []
    for size in reversed(mesh.sizes):
        out.append(index % size)
        index //= size
    return out[::-1]


def restore(value: RemoteValue, fn: Any, *args: Any, **kwargs: Any) -> RemoteValue:
    """Make ``value`` again on the ranks a recovery lost it on: ``fn(*args, **kwargs)``
    runs on those ranks only and its result becomes ``value`` there (the other ranks keep
    theirs). Returns ``value``, usable on its whole mesh again. ``value.restore(fn, ...)``
    is the same."""
    session = value.session
    session.check_usable()
    lost = sorted(session.recovery.lost_ranks(value.ref) & set(value.mesh.ranks))
    if not lost:
        return value
    if value.borrow is not None:
        raise TypeError(f"{value!r} is borrowed: restore the value it borrows")
    site = capture_site()
    fref, label = RemoteFunction(fn)._function()
    checker = _checker(value.mesh, value.stream.id, value.stream.name, set(lost))
    pickled, uses = pickle_args((args, kwargs), checker)

    def commands(seq: int) -> list[tuple[Slice, Any]]:
        call = CallFunction(
            seq=seq,
            results=[value.ref],
            mutates=[],
            function=fref,
            args=pickled,
            stream=value.stream.id,
        )
        return [(Slice(offset=r, sizes=[1], strides=[1]), call) for r in lost]

    session.issue(f"restore {label}", [value.ref], uses, [], site=site, make_commands=commands)
    session.recovery.restored[value.ref] = len(session.recovery.lost)
    return value
