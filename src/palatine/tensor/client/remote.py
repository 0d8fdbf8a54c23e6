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
from palatine.protocol.worker import CallFunction, RequestStatus, SendValue, Slice
from palatine.tensor.client.context import active_mesh, active_stream
from palatine.tensor.client.session import Handle
from palatine.tensor.client.sites import capture_site
from palatine.tensor.client.values import RemoteValue, ValueMesh, function_ref, pickle_args

__all__ = ["remote", "RemoteFunction", "fetch", "inspect", "restore"]


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


def _shard_rank(mesh: ValueMesh, shard: Any) -> int:
    if shard is None:
        return mesh.ranks[0]
    if isinstance(shard, int):
        return mesh.ranks[shard]
    if isinstance(shard, dict):
        offset = mesh.offset
        for name in shard:
            mesh._dim(name)
        for i, name in enumerate(mesh.names):
            idx = shard.get(name, 0)
            if not 0 <= idx < mesh.sizes[i]:
                raise IndexError(
                    f"index {idx} out of range for dimension {name!r} of size {mesh.sizes[i]}"
                )
            offset += idx * mesh.strides[i]
        return offset
    raise TypeError(f"shard must be None, an int or a dict of dims, not {type(shard).__name__}")


def fetch(obj: Any, shard: Any = None) -> Future[Any]:
    """A Future of ``obj`` (remote values inside it substituted) as seen on one rank."""
    found: list[Handle] = []
    pickled, refs = pickle_args(((obj,), {}), found.append)
    values = [h for h in found if isinstance(h, RemoteValue)]
    loop = runtime.get_loop()
    if not values:
        f: Future[Any] = Future(loop)
        f.set_result(obj)
        return f
    first = values[0]
    mesh, session, stream = first.mesh, first.session, first.stream
    rank = _shard_rank(mesh, shard)
    for v in values:
        if v.session is not session:
            raise TypeError(f"{v!r} belongs to another session")
        if v.dropped_at is not None:
            raise TypeError(f"{v!r} was dropped at {v.dropped_at.short()}")
        if rank not in v.mesh.ranks:
            raise TypeError(f"{v!r} does not live on rank {rank}")
        session.recovery.check_not_lost(v, {rank})
        if v.stream.id != stream.id:
            raise TypeError(f"{v!r} is on stream {v.stream.name!r}, {first!r} on {stream.name!r}")
    site = capture_site()
    fut: Future[Any] = Future(loop)
    one = Slice(offset=rank, sizes=[1], strides=[1])
    world = Slice(offset=0, sizes=[session.world_size], strides=[1])

    def commands(seq: int) -> list[tuple[Slice, Any]]:
        return [
            (
                one,
                SendValue(
                    seq=seq,
                    function=None,
                    args=pickled,
                    stream=stream.id,
                    deliver_to=session.actor.cx.actor_id,
                ),
            ),
            (world, RequestStatus(seq=seq, controller=False)),
        ]

    session.issue("fetch", [], refs, [], future=fut, site=site, make_commands=commands)
    return fut


def inspect(obj: Any, shard: Any = None) -> Any:
    """``fetch(obj, shard).result()``."""
    return fetch(obj, shard).result()


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
