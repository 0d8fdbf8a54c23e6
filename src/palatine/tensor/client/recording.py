"""What a recorded call issued (`palatine.compile`'s first repeatable call).

`Session.issue` hands each seq's commands to the active `Recorder` while the call runs on
the recording thread. Sans-IO: it keeps the commands by slice and the refs they define
and use, notes the defined refs the client drops (temporaries a replay frees again), and
the first reason the call cannot be replayed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from palatine.protocol.worker import (
    BackendNetworkInit,
    BorrowCreate,
    BorrowDrop,
    BorrowFirstUse,
    BorrowLastUse,
    CallFunction,
    CreateProcessGroup,
    Factory,
    FunctionPath,
    RecordedCommand,
    Reduce,
    RequestStatus,
    SendTensor,
    SendValue,
    Slice,
)
from palatine.tensor.client.drops import Drops, slice_key
from palatine.tensor.client.sites import capture_site
from palatine.tensor.worker.values import dumps_args
from palatine.wire.codec import Message

__all__ = ["RECORDABLE", "Recorder", "fuse_reduces"]

_PACK = FunctionPath(path="palatine.tensor.worker.functions.pack_flat")
_UNPACK = FunctionPath(path="palatine.tensor.worker.functions.unpack_flat")

#: The commands a recording holds (`RecordedCommand`), for isinstance.
RECORDABLE: tuple[type[Any], ...] = (
    CallFunction,
    Reduce,
    SendTensor,
    BorrowCreate,
    BorrowFirstUse,
    BorrowLastUse,
    BorrowDrop,
)


class Recorder:
    """What one recorded call issued: its commands by slice, and the refs they define
    and use (on the recording thread only: another thread's work is not the call's)."""

    def __init__(self, drops: Drops, start_ref: int) -> None:
        self._drops = drops
        self.thread = threading.get_ident()
        #: Refs below this existed before the call (captured tensors or arguments).
        self.start_ref = start_ref
        self.commands: list[tuple[Slice, RecordedCommand]] = []
        #: Per command, the refs its seq uses and defines (`fuse_reduces` reads them).
        self.touched: list[frozenset[int]] = []
        #: Refs the recorded commands define (results and what they write).
        self.defs: set[int] = set()
        #: Refs they use that existed before the call.
        self.uses: set[int] = set()
        #: Why this call cannot be replayed: the first reason, with where it was issued.
        self.refusal: str | None = None
        #: Refs it defined that the client has dropped since (`Drops.watch`).
        self.dead: set[int] = set()

    def capture(self, label: str, defs: list[int], uses: list[int], cmds: Any) -> None:
        """One seq of the recorded call (`Session.issue`, its lock held)."""
        touched = frozenset((*defs, *uses))
        for sl, cmd in cmds:
            if type(cmd) is RequestStatus:
                continue  # the session's own bookkeeping, not the call's
            if isinstance(cmd, RECORDABLE):
                self.commands.append((sl, cmd))
                self.touched.append(touched)
            else:
                self.refuse(_why(label, cmd))
        self.defs.update(defs)
        self._drops.watch(defs, self.dead)
        self.uses.update(u for u in uses if u < self.start_ref)

    def refuse(self, why: str) -> None:
        """Mark the call as not replayable (the first reason is kept)."""
        if self.refusal is None:
            self.refusal = why


def _fusable(cmd: Any) -> bool:
    """An in-place all-reduce (sum or avg) of a tensor whose metadata the client knew."""
    return (
        type(cmd) is Reduce
        and cmd.in_place
        and not cmd.scatter
        and cmd.out is None
        and cmd.factory is not None
        and cmd.op in ("sum", "avg")
    )


def fuse_reduces(
    commands: list[tuple[Slice, RecordedCommand]],
    touched: list[frozenset[int]],
    new_ref: Callable[[], int],
) -> tuple[list[tuple[Slice, RecordedCommand]], list[int]]:
    """``commands`` with runs of in-place all-reduces bucketed, as data-parallel
    training buckets its gradients: each reduce waits until a later command touches its
    tensor (or the end), and the reduces waiting together over the same ranks, dims, op
    and dtype become one all-reduce of their concatenation (``pack_flat``, `Reduce`,
    ``unpack_flat`` writing each back and binding its result). One collective's latency
    per bucket instead of per tensor. Decided on the client, from every seq's refs, so
    every rank of a group runs the same buckets. Also returns the refs the buckets add.
    """
    out: list[tuple[Slice, RecordedCommand]] = []
    added: list[int] = []
    pending: list[tuple[Slice, Reduce]] = []

    def flush() -> None:
        if len(pending) == 1:
            out.append(pending[0])
        elif pending:
            out.extend(_bucket(pending, new_ref, added))
        pending.clear()

    for (sl, cmd), refs in zip(commands, touched, strict=True):
        if pending and any(c.value in refs or c.result in refs for _, c in pending):
            flush()
        if _fusable(cmd):
            assert type(cmd) is Reduce
            if pending and _bucket_key(sl, cmd) != _bucket_key(*pending[0]):
                flush()
            pending.append((sl, cmd))
            continue
        if type(cmd) is not CallFunction:
            flush()  # borrows, transfers, other collectives: keep their order exactly
        out.append((sl, cmd))
    flush()
    return out, added


def _bucket_key(sl: Slice, cmd: Reduce) -> tuple[Any, ...]:
    f = cmd.factory
    assert f is not None
    return (slice_key(sl), cmd.mesh, tuple(cmd.dims), cmd.op, cmd.stream, f.dtype, f.device)


def _bucket(
    pending: list[tuple[Slice, Reduce]], new_ref: Callable[[], int], added: list[int]
) -> list[tuple[Slice, RecordedCommand]]:
    sl, first = pending[0]
    values = [c.value for _, c in pending]
    flat = new_ref()
    added.append(flat)
    f = first.factory
    assert f is not None
    total = sum(math.prod(c.factory.size) for _, c in pending if c.factory is not None)
    refs = tuple(_Ref(v) for v in values)
    pack = CallFunction(
        seq=first.seq,
        results=[flat],
        function=_PACK,
        args=dumps_args(refs, {}),
        stream=first.stream,
    )
    reduce = Reduce(
        seq=first.seq,
        result=flat,
        value=flat,
        factory=Factory(size=[total], dtype=f.dtype, layout=f.layout, device=f.device),
        mesh=first.mesh,
        dims=first.dims,
        op=first.op,
        in_place=True,
        stream=first.stream,
    )
    bind = tuple(i for i, (_, c) in enumerate(pending) if c.result != c.value)
    unpack = CallFunction(
        seq=first.seq,
        results=[pending[i][1].result for i in bind],
        mutates=values,
        function=_UNPACK,
        args=dumps_args((_Ref(flat), *refs), {"bind": bind}),
        stream=first.stream,
    )
    return [(sl, pack), (sl, reduce), (sl, unpack)]


class _Ref:
    """A ref in arguments built here: pickled as the ref it names."""

    __slots__ = ("__palatine_ref__",)

    def __init__(self, ref: int) -> None:
        self.__palatine_ref__ = ref


def _why(label: str, cmd: Message) -> str:
    site = capture_site()
    where = f" (at {site.short()})" if site is not None else ""
    if type(cmd) is SendValue:
        return f"fetches a value ({label}){where}: a replay would not bring it back"
    if type(cmd) is BackendNetworkInit or type(cmd) is CreateProcessGroup:
        return (
            f"sets up collectives ({label}){where}: let a plain call do that first "
            "(compile's warmup)"
        )
    return f"issues {type(cmd).__name__} ({label}){where}, which a recording cannot hold"
