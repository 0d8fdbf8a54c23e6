"""Client-side values: `RemoteValue`, argument pickling, function transport.

Arguments are pickled once per command (protocol 5, out-of-band buffers); every client
handle inside them (a remote value, a device mesh, a process group) becomes the
persistent id ``("ref", n)`` that the worker maps back. The
refs met while pickling are the call's ``uses``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, Protocol

from palatine.protocol.worker import (
    BorrowCreate,
    BorrowFirstUse,
    FunctionPath,
    FunctionRef,
    Pickled,
)
from palatine.tensor.client.session import Handle, MeshView, Session, Stream
from palatine.tensor.client.sites import IssueSite, capture_site
from palatine.tensor.worker.values import dumps_args, function_label
from palatine.tensor.worker.values import function_ref as worker_function_ref

__all__ = ["RemoteValue", "SlicedValue", "ValueMesh", "pickle_args", "function_ref", "value_of"]


class ValueMesh(MeshView, Protocol):
    """A mesh as remote values see it: a `MeshView` that can also run a collective over
    one of its values (`palatine.tensor.client.mesh.DeviceMesh` hands it collectives')."""

    reduce_value: Callable[..., RemoteValue]
    """The collective a value's `RemoteValue.reduce` runs (`collectives.reduce`)."""

    restore_value: Callable[..., RemoteValue]
    """What a value's `RemoteValue.restore` runs (`remote.restore`)."""


class RemoteValue(Handle):
    """A value living on the workers of ``mesh`` (one per rank), on ``stream``.

    A handle made by `to_stream` is *borrowed* (``borrow`` is its borrow id): it names
    the source value on another stream, read-only; dropping it releases the borrow
    (``BorrowLastUse`` on its stream, ``BorrowDrop`` on the source's).
    """

    __slots__ = ("mesh", "stream", "seq", "label", "dropped_at", "borrow")

    def __init__(
        self,
        session: Session,
        ref: int,
        mesh: ValueMesh,
        stream: Stream,
        seq: int,
        label: str,
        borrow: int | None = None,
    ) -> None:
        super().__init__(session, ref)
        self.mesh = mesh
        self.stream = stream
        self.seq = seq
        self.label = label
        self.dropped_at: IssueSite | None = None
        self.borrow = borrow

    def __repr__(self) -> str:
        ranks = self.mesh.ranks
        span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"{ranks[0]}"
        borrowed = " (borrowed)" if self.borrow is not None else ""
        return (
            f"<RemoteValue r{self.ref} on {self.session.worker_world}[{span}] stream "
            f"{self.stream.name} from s{self.seq} {self.label}{borrowed}>"
        )

    @property
    def borrowed(self) -> bool:
        """True for a handle made by `to_stream` (it may not be passed in ``mutates``)."""
        return self.borrow is not None

    def check_mutable(self, name: str) -> None:
        """`TypeError` when this value may not be mutated (argument ``name``): borrowed."""
        if self.borrow is not None:
            raise TypeError(
                f"mutated argument {name!r} is {self!r}, borrowed from another stream with "
                f"to_stream(): a borrowed value is read-only"
            )

    def drop(self) -> None:
        """Free the worker-side value now (later use raises `TypeError`).

        A borrowed handle's release leaves at once, after what is queued: the source
        stream waits for it (``BorrowDrop``) before it may write the value again, so it
        must come before any command issued after this drop (queued drops leave after
        the next batch's own commands)."""
        if self.dropped_at is None:
            self.dropped_at = capture_site() or IssueSite([])
            self.session.drops.add(self.ref, self.mesh.slice_spec, self.borrow)
            if self.borrow is not None and not self.session.closed:
                self.session.outbox.send()

    def __del__(self) -> None:
        try:
            if self.dropped_at is None and not self.session.closed:
                self.session.drops.add(self.ref, self.mesh.slice_spec, self.borrow)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def to_stream(self, stream: Stream) -> RemoteValue:
        """This value, usable on ``stream`` (a borrow).

        Issues ``BorrowCreate`` (on this value's stream: snapshot the value, or its
        error) and ``BorrowFirstUse`` (on ``stream``: wait for the snapshot, bind the new
        ref) under one Node (defs: the new ref, uses: this one). The result is read-only
        (not allowed in ``mutates``); dropping it releases the borrow. A value already on
        ``stream`` is returned as is.
        """
        if not isinstance(stream, Stream):
            raise TypeError(
                f"to_stream() takes a Stream (mesh.stream(name)), not {type(stream).__name__}"
            )
        session = self.session
        if stream.session is not session:
            raise TypeError(f"{stream!r} belongs to another session than {self!r}")
        if self.dropped_at is not None:
            raise TypeError(f"{self!r} was dropped at {self.dropped_at.short()}")
        if stream.id == self.stream.id:
            return self
        session.check_usable()
        site = capture_site()
        bid = session.ids.new_borrow()
        result = session.ids.new_ref()
        spec = self.mesh.slice_spec
        cmds = [
            (
                spec,
                BorrowCreate(
                    borrow=bid,
                    result=result,
                    value=self.ref,
                    from_stream=self.stream.id,
                    to_stream=stream.id,
                ),
            ),
            (spec, BorrowFirstUse(borrow=bid)),
        ]
        seq = session.issue("to_stream", [result], [self.ref], cmds, site=site)
        return RemoteValue(session, result, self.mesh, stream, seq, self.label, borrow=bid)

    def reduce(
        self,
        dims: str | tuple[str, ...],
        op: str = "sum",
        scatter: bool = False,
        in_place: bool = False,
        out: RemoteValue | None = None,
        like: Any = None,
    ) -> RemoteValue:
        """A collective over ``dims`` of this value's mesh."""
        return self.mesh.reduce_value(self, dims, op, scatter, in_place, out, like)

    def restore(self, fn: Any, *args: Any, **kwargs: Any) -> RemoteValue:
        """After a recovery, make this value again on the ranks it was lost on, as
        ``fn(*args, **kwargs)`` there; the other ranks keep theirs."""
        return self.mesh.restore_value(self, fn, *args, **kwargs)


class SlicedValue(RemoteValue):
    """A value seen on a sub-mesh of the mesh that holds it (`slice_mesh`): the same ref
    on fewer ranks. It does not own the ref: the value it slices (kept alive here) does,
    and frees it when its last handle goes."""

    __slots__ = ("whole",)

    def __init__(self, whole: RemoteValue, mesh: ValueMesh) -> None:
        super().__init__(whole.session, whole.ref, mesh, whole.stream, whole.seq, whole.label)
        self.whole = whole

    def drop(self) -> None:
        self.whole.drop()

    def __del__(self) -> None:
        pass  # (the whole value frees the ref)


def value_of(obj: Any) -> RemoteValue | None:
    """The `RemoteValue` that ``obj`` is or wraps (a ``palatine.Tensor`` wraps one in
    ``_value``), else None."""
    if isinstance(obj, RemoteValue):
        return obj
    v = getattr(obj, "_value", None)
    return v if isinstance(v, RemoteValue) else None


_PLAIN = frozenset({int, float, bool, str, bytes, type(None)})


def pickle_args(args: Any, check: Callable[[Handle], None]) -> tuple[Pickled, list[int]]:
    """One pickle of ``(args, kwargs)`` with handles as refs; returns it and the refs used.

    Arguments that are all plain scalars hold no handle and no buffer: they take the
    C pickler directly (the common case of small control arguments).
    """
    a, k = args
    plain = _PLAIN
    if all(type(x) in plain for x in a) and (not k or all(type(v) in plain for v in k.values())):
        return Pickled(pickle.dumps((tuple(a), dict(k)), protocol=5), []), []
    refs: list[int] = []

    def on_ref(h: Any) -> None:
        if isinstance(h, Handle):
            check(h)
        else:
            v = value_of(h)  # a mesh tensor: checked as the value it wraps
            if v is not None:
                check(v)
        refs.append(h.__palatine_ref__)

    p = dumps_args(a, k, on_ref)
    if p.buffers:
        # The commands are encoded when the session flushes, on the loop thread: snapshot
        # the argument buffers now so a change the caller makes after the call is not sent.
        p = Pickled(p.data, [bytes(b) for b in p.buffers])
    return p, refs


def function_ref(fn: Any) -> tuple[FunctionRef, str]:
    """How a function travels (path when importable by name, else by value) and its label."""
    if isinstance(fn, str):
        return FunctionPath(path=fn), fn
    return worker_function_ref(fn), function_label(fn)
