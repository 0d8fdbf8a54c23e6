"""`to_mesh`: move a worker-side tensor to another mesh of the same shape.

The pipeline-parallel pattern: a tensor on ``mesh.slice(pp=0)`` moves to
``mesh.slice(pp=1)``; the rank at row-major index ``i`` of the value's mesh sends its
shard to the rank at index ``i`` of the destination. It is one seq: its Node defines
the result and uses the value and the collective context (the controller's history
orders it after what made the value, and fails it, and what depends on it, when that
failed), and one `SendTensor` reaches every rank of both meshes once. The worker side
is `palatine.tensor.worker.transfer`.
"""

from __future__ import annotations

from typing import Any

from palatine.protocol.worker import SendTensor, Slice
from palatine.tensor.client.collectives import _factory, ensure_collectives
from palatine.tensor.client.session import Stream
from palatine.tensor.client.sites import capture_site
from palatine.tensor.client.values import RemoteValue, ValueMesh

__all__ = ["by_names", "casts", "to_mesh"]


def _shape(mesh: ValueMesh) -> str:
    dims = ", ".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.sizes, strict=True))
    return f"({dims}) over ranks {mesh.ranks}"


def casts(source: Slice, dest: Slice) -> list[Slice]:
    """The slices one command goes to so that it reaches every rank of ``source`` and
    ``dest`` exactly once: both when they are disjoint, one when they hold the same
    ranks, else the source and each destination rank outside it."""
    src = set(source.ranks())
    dst = dest.ranks()
    if src.isdisjoint(dst):
        return [source, dest]
    if src == set(dst):
        return [source]
    return [source] + [Slice(offset=r, sizes=[1], strides=[1]) for r in dst if r not in src]


def by_names(source: Slice, names: list[str], dest_names: list[str]) -> Slice:
    """``source`` with its dims in the order of ``dest_names`` when both meshes name the
    same dims (in another order): ranks then pair by coordinate *name*, as in Monarch
    (a tensor on ``(dp, pp)`` moved to a ``(pp, dp)`` mesh lands at the same ``dp`` and
    ``pp``); otherwise unchanged (ranks pair by row-major index)."""
    if names == dest_names or sorted(names) != sorted(dest_names):
        return source
    order = [names.index(n) for n in dest_names]
    return Slice(
        offset=source.offset,
        sizes=[source.sizes[i] for i in order],
        strides=[source.strides[i] for i in order],
    )


def to_mesh(
    value: RemoteValue, mesh: ValueMesh, stream: Stream | None = None, like: Any = None
) -> RemoteValue:
    """``value`` (a tensor on each rank of its mesh) moved to ``mesh``, whose sizes must
    be those of the value's mesh: the rank at row-major index ``i`` of the value's mesh
    sends its tensor to the rank at index ``i`` of ``mesh``; when both meshes name the
    same dims in another order, ranks pair by the coordinates of those names instead
    (`by_names`).

    The result lives on ``stream`` (default: the value's) and is a new tensor on every
    rank, a copy where a rank is paired with itself, so in-place changes to either side
    never reach the other; it has no autograd history, and lives on the destination
    worker's accelerator when the source's tensor was on one. ``like`` (a tensor of the
    shard's shape and dtype, or ``(shape, dtype)``) lets the destination receive without
    waiting for the source's metadata first; a shard that does not match it fails.

    A failed value makes the result fail with the same error; a source rank whose value
    is not a tensor fails the move (a `palatine.RemoteException` naming ``to_mesh``,
    the ranks and the stream). ValueError when the shapes differ, TypeError for a
    value, mesh or stream of another session or a dropped value."""
    if not isinstance(value, RemoteValue):
        raise TypeError(f"to_mesh() moves a remote value, not a {type(value).__name__}")
    session = value.session
    source = value.mesh
    if getattr(mesh, "session", None) is not session:
        raise TypeError(f"to_mesh(): {mesh!r} is not a mesh of the session of {value!r}")
    if value.dropped_at is not None:
        raise TypeError(f"{value!r} was dropped at {value.dropped_at.short()}")
    src_slice = by_names(source.slice_spec, list(source.names), list(mesh.names))
    if list(mesh.sizes) != list(src_slice.sizes):
        raise ValueError(
            f"to_mesh() needs a mesh of the value's shape: {value!r} is on a mesh of shape "
            f"{_shape(source)}, the destination has shape {_shape(mesh)}"
        )
    if stream is None:
        stream = value.stream
    elif not isinstance(stream, Stream) or stream.session is not session:
        raise TypeError(f"to_mesh(): {stream!r} is not a stream of the session of {value!r}")
    session.check_usable()
    session.recovery.check_not_lost(value, set(source.ranks))
    pairs = list(zip(src_slice.ranks(), mesh.ranks, strict=True))
    itself = [a for a, b in pairs if a == b]
    if itself and stream.id != value.stream.id:
        raise ValueError(
            f"to_mesh() onto stream {stream.name!r}: ranks {itself} are in both meshes at "
            f"the same place, which copies on the value's stream {value.stream.name!r}; "
            "move it there, then use .to_stream()"
        )
    factory = _factory(like)
    uses = [value.ref]
    if len(itself) < len(pairs):
        uses.append(ensure_collectives(mesh))
    result = session.ids.new_ref()
    from_stream = value.stream.id
    to_stream = None if stream.id == from_stream else stream.id
    targets = casts(source.slice_spec, mesh.slice_spec)

    def commands(seq: int) -> list[tuple[Slice, Any]]:
        msg = SendTensor(
            seq=seq,
            result=result,
            value=value.ref,
            from_ranks=src_slice,
            to_ranks=mesh.slice_spec,
            factory=factory,
            stream=from_stream,
            to_stream=to_stream,
        )
        return [(s, msg) for s in targets]

    seq = session.issue("to_mesh", [result], uses, [], site=capture_site(), make_commands=commands)
    return RemoteValue(session, result, mesh, stream, seq, "to_mesh")
