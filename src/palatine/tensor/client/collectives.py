"""Process groups and reductions from the client.

The first of them in a session initialises collectives: rank 0 opens a TCPStore (an
ordinary remote call + fetch), then ``BackendNetworkInit`` goes to every rank. Its Node
defines the session's collective-context ref, which every later process group and
reduce lists in its ``uses``: a failed initialisation fails them as dependents.
"""

from __future__ import annotations

from typing import Any, cast

from palatine import config
from palatine.errors import LostValue, RemoteException
from palatine.protocol.worker import (
    REDUCE_OPS,
    BackendNetworkInit,
    CreateProcessGroup,
    Factory,
    Reduce,
    ReduceOp,
    Slice,
)
from palatine.tensor.client.context import active_stream
from palatine.tensor.client.recovery import RecoveryRecords
from palatine.tensor.client.remote import call_on_shard_and_fetch, fetch, remote
from palatine.tensor.client.sites import capture_site
from palatine.tensor.client.values import RemoteValue, ValueMesh, value_of
from palatine.tensor.worker.functions import broadcast_state, ready

__all__ = ["ensure_collectives", "process_group", "reduce", "resync"]


def ensure_collectives(mesh: ValueMesh) -> int:
    """The session's collective-context ref, initialising collectives on first use (and
    after each recovery). The set-up is the session's, not part of a call that
    `palatine.compile` is recording: it happens once, and replays use its context."""
    session = mesh.session
    records = session.recovery
    with session.lock:
        if records.collective_ref is not None:
            return records.collective_ref
        recorder, session.recorder = session.recorder, None
        try:
            return _init_collectives(session, records)
        finally:
            session.recorder = recorder


def _init_collectives(session: Any, records: RecoveryRecords) -> int:
    """`ensure_collectives`' set-up (the session's lock held)."""
    root = session.root_mesh
    assert root is not None, "a session's root mesh is set when it connects"
    first = root.slice(**{n: 0 for n in root.names})
    with first.activate():
        addr_value = remote("palatine.tensor.worker.collectives.open_store")()
    store_addr = fetch(addr_value).result()
    ctx: int = session.ids.new_ref()
    world = Slice(offset=0, sizes=[session.world_size], strides=[1])
    main = root.stream("main")

    def commands(seq: int) -> list[tuple[Slice, Any]]:
        return [
            (
                world,
                BackendNetworkInit(
                    seq=seq,
                    result=ctx,
                    store_addr=store_addr,
                    stream=main.id,
                    generation=records.generation,
                ),
            )
        ]

    session.issue("BackendNetworkInit", [ctx], [], [], site=capture_site(), make_commands=commands)
    records.collective_ref = ctx
    return ctx


def _dims(mesh: ValueMesh, dims: str | tuple[str, ...] | None) -> list[str]:
    if dims is None:
        return list(mesh.names)
    out = [dims] if isinstance(dims, str) else list(dims)
    for d in out:
        mesh._dim(d)
    return out


def process_group(mesh: ValueMesh, dims: str | tuple[str, ...] | None = None) -> RemoteValue:
    """A remote value that is a torch ProcessGroup over ``dims`` of ``mesh``."""
    session = mesh.session
    session.check_usable()
    names = _dims(mesh, dims)
    ctx = ensure_collectives(mesh)
    handle = mesh.handle()
    stream = active_stream(mesh)
    pg = session.ids.new_ref()

    def commands(seq: int) -> list[tuple[Slice, Any]]:
        return [
            (
                mesh.slice_spec,
                CreateProcessGroup(
                    seq=seq, result=pg, mesh=handle.ref, dims=names, stream=stream.id
                ),
            )
        ]

    seq = session.issue(
        "process_group", [pg], [ctx, handle.ref], [], site=capture_site(), make_commands=commands
    )
    return RemoteValue(session, pg, mesh, stream, seq, "process_group")


def _factory(like: Any) -> Factory | None:
    if like is None:
        return None
    if isinstance(like, tuple) and len(like) == 2:
        shape, dtype = like
        return Factory(size=list(shape), dtype=str(dtype).removeprefix("torch."))
    return Factory(
        size=list(like.shape),
        dtype=str(like.dtype).removeprefix("torch."),
        layout=str(like.layout).removeprefix("torch."),
        device=str(like.device),
    )


def reduce(
    value: RemoteValue,
    dims: str | tuple[str, ...],
    op: str = "sum",
    scatter: bool = False,
    in_place: bool = False,
    out: RemoteValue | None = None,
    like: Any = None,
) -> RemoteValue:
    """A collective of ``value`` over ``dims`` of its mesh; validated before sending."""
    mesh = value.mesh
    session = value.session
    session.check_usable()
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(REDUCE_OPS)}")
    names = [dims] if isinstance(dims, str) else list(dims)
    for d in names:
        if d not in mesh.names:
            raise ValueError(f"dimension {d!r} is not in the value's mesh {mesh.names}")
    if op == "stack" and in_place:
        raise ValueError("op 'stack' cannot be in_place")
    if scatter and in_place:
        raise ValueError("scatter and in_place cannot be combined: the result has another shape")
    if op == "stack" and scatter and len(names) > 1:
        raise ValueError("op 'stack' with scatter works over one dimension only")
    if value.dropped_at is not None:
        raise TypeError(f"{value!r} was dropped at {value.dropped_at.short()}")
    if in_place:
        value.check_mutable("value")
    if out is not None:
        out.check_mutable("out")
    ctx = ensure_collectives(mesh)
    handle = mesh.handle()
    result = value.ref if in_place else session.ids.new_ref()
    uses = [value.ref, ctx, handle.ref] + ([out.ref] if out is not None else [])
    defs = [result]
    factory = _factory(like)

    def commands(seq: int) -> list[tuple[Slice, Any]]:
        return [
            (
                mesh.slice_spec,
                Reduce(
                    seq=seq,
                    result=result,
                    value=value.ref,
                    factory=factory,
                    mesh=handle.ref,
                    dims=names,
                    op=cast(ReduceOp, op),
                    scatter=scatter,
                    in_place=in_place,
                    out=out.ref if out is not None else None,
                    stream=value.stream.id,
                ),
            )
        ]

    seq = session.issue(f"reduce {op}", defs, uses, [], site=capture_site(), make_commands=commands)
    if in_place:
        return value
    return RemoteValue(session, result, mesh, value.stream, seq, f"reduce {op}")


def resync(value: Any, src: int | None = None) -> None:
    """After a recovery, make ``value`` on every rank of its mesh what it is on rank
    ``src`` (by default the first rank the last recovery did not bring back): a model's
    parameters and buffers, an optimizer's state, tensors, and dicts or lists of them
    (`palatine.tensor.worker.functions.broadcast_state`), over the new collective group,
    so data-parallel replicas are identical again. The lost ranks need a value of the
    same structure first (``value.restore(make)``; a mesh tensor's ``t.restore()``).

    ``value`` is a remote value, a mesh tensor, or a list, tuple or dict of them (a
    model's ``list(model.parameters())``): each is resynced in turn.

    The source is checked first, every value in one round trip: a value that failed
    there (a step that failed on the survivors too poisons what it wrote) cannot be
    copied, and the broadcast would leave the other ranks waiting in it; that is a
    `ValueError` naming the value and the source's error, and nothing is broadcast."""
    handles: list[RemoteValue] = []
    _collect(value, handles)
    sources = [_source(h, src) for h in handles]
    timeout = config.get().call_timeout_s
    checks = [
        call_on_shard_and_fetch(ready, h, shard=h.mesh.ranks.index(s))
        for h, s in zip(handles, sources, strict=True)
    ]
    for h, s, check in zip(handles, sources, checks, strict=True):
        try:
            check.result(timeout=timeout)
        except (LostValue, TimeoutError):
            raise
        except RemoteException as e:
            short = e.type_name.rsplit(".", 1)[-1]
            raise ValueError(
                f"cannot resync {h!r} from rank {s}: it failed there: "
                f"{e.headline or e.actor_id}: {short}: {e.message}; make it again on every "
                "rank (from a checkpoint) instead"
            ) from e
    for h, s in zip(handles, sources, strict=True):
        ensure_collectives(h.mesh)
        with h.mesh.activate():
            remote(broadcast_state, mutates=("value",))(h, s)


def _collect(value: Any, out: list[RemoteValue]) -> None:
    """The remote values of ``value`` (lists, tuples and dicts walked), in order."""
    if isinstance(value, list | tuple):
        for v in value:
            _collect(v, out)
        return
    if isinstance(value, dict):
        for v in value.values():
            _collect(v, out)
        return
    handle = value_of(value)
    if handle is None:
        raise TypeError(
            f"resync takes remote values, mesh tensors, or lists and dicts of them; "
            f"not {type(value).__name__}"
        )
    out.append(handle)


def _source(value: RemoteValue, src: int | None) -> int:
    """The rank ``value`` is copied from: ``src``, or its first rank the last recovery
    did not bring back."""
    session = value.session
    session.check_usable()
    ranks = value.mesh.ranks
    if src is None:
        lost = session.recovery.lost
        fresh = lost[-1][1] if lost else frozenset()
        survivors = [r for r in ranks if r not in fresh]
        if not survivors:
            raise ValueError(f"no rank of {value!r} survived the last recovery to copy from")
        src = survivors[0]
    if src not in ranks:
        raise ValueError(f"rank {src} is not a rank of {value!r}")
    return src
