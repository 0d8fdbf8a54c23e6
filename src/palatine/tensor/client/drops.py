"""Ref drops: freeing worker-side values whose last client handle went.

A `RemoteValue`'s finalizer (or ``value.drop()``) queues its ref here. Finalizers run
whenever the garbage collector decides, on any thread, possibly while that thread holds
one of the session's other locks, so queueing does no I/O and takes only this module's
own lock. That lock is reentrant: a garbage collection can start inside it too (any
allocation may start one), and its finalizers then queue drops on the thread that holds
it. The queue leaves with the next batch the outbox sends: per slice one
``DeleteRefs`` to the workers, and the refs as the batch's ``drop_refs`` to the
controller. A borrowed handle (``to_stream``) releases its borrow instead of deleting a
ref: ``BorrowLastUse`` then ``BorrowDrop``.
"""

from __future__ import annotations

import threading
from typing import Any

from palatine.protocol.worker import BorrowDrop, BorrowLastUse, DeleteRefs, Slice
from palatine.wire.codec import Message

__all__ = ["Drops", "slice_key"]


def slice_key(sl: Slice) -> tuple[Any, ...]:
    """A hashable key of a slice: equal for slices that name the same ranks the same way."""
    return (sl.offset, tuple(sl.sizes), tuple(sl.strides))


class Drops:
    """The refs (and borrows) to free with the next batch."""

    def __init__(self) -> None:
        # Guards `_queue` only; held for a list operation, never across anything else,
        # so a finalizer may take it on a thread that holds any other session lock.
        # An RLock, as a finalizer may also run on a thread inside it (a collection that
        # an allocation under it started): each section is one list operation, so an
        # `add` nested in it lands whole in the list that `take` hands out or keeps.
        self._lock = threading.RLock()
        self._queue: list[tuple[int, Slice, int | None]] = []
        #: ref -> the set its drop is also noted in: a recording's refs whose handles
        #: the client dropped (`palatine.compile` frees them after each replay).
        self._watched: dict[int, set[int]] = {}

    def add(self, ref: int, ranks: Slice, borrow: int | None = None) -> None:
        """Queue ``ref`` on ``ranks`` (``borrow``: release that borrow instead); from
        finalizers too: no I/O here."""
        with self._lock:
            self._queue.append((ref, ranks, borrow))
            noted = self._watched.get(ref)
            if noted is not None:
                noted.add(ref)

    def watch(self, refs: list[int], noted: set[int]) -> None:
        """Note in ``noted`` each of ``refs`` dropped from now on (a drop queued already
        is noted at once)."""
        with self._lock:
            for r in refs:
                self._watched[r] = noted
            queued = {r for r, _, _ in self._queue}
        noted.update(r for r in refs if r in queued)

    def unwatch(self, refs: list[int]) -> None:
        """Stop noting drops of ``refs``."""
        with self._lock:
            for r in refs:
                self._watched.pop(r, None)

    def empty(self) -> bool:
        """Whether no drop is queued."""
        with self._lock:
            return not self._queue

    def take(self) -> tuple[list[tuple[Slice, Message]], list[int]]:
        """Empty the queue: the commands that free its refs on the workers, and the refs
        for the controller (``Batch.drop_refs``)."""
        with self._lock:
            drops, self._queue = self._queue, []
        if not drops:
            return [], []
        return _commands(drops), [r for r, _, _ in drops]


def _commands(drops: list[tuple[int, Slice, int | None]]) -> list[tuple[Slice, Message]]:
    """One ``DeleteRefs`` per slice for the dropped refs; borrows are released instead."""
    by_slice: dict[tuple[Any, ...], tuple[Slice, list[int]]] = {}
    out: list[tuple[Slice, Message]] = []
    for ref, sl, borrow in drops:
        if borrow is not None:
            # the worker unbinds the borrowed ref itself (BorrowLastUse): no DeleteRefs
            out.append((sl, BorrowLastUse(borrow=borrow)))
            out.append((sl, BorrowDrop(borrow=borrow)))
            continue
        by_slice.setdefault(slice_key(sl), (sl, []))[1].append(ref)
    for sl, refs in by_slice.values():
        out.append((sl, DeleteRefs(refs=refs)))
    return out
