"""Drops: a finalizer may queue a drop on a thread that is inside Drops' own lock."""

from __future__ import annotations

import threading
from collections.abc import Callable

from palatine.protocol.worker import DeleteRefs, Slice
from palatine.tensor.client.drops import Drops

SL = Slice(0, [2], [1])


def _finishes(fn: Callable[[], object]) -> None:
    """Run ``fn`` on a daemon thread; fail (rather than hang) if it deadlocks."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(5.0)
    assert not t.is_alive(), "deadlocked: a finalizer could not take Drops' lock"


class _Dying:
    """A RemoteValue's part that matters here: its finalizer queues its ref."""

    def __init__(self, drops: Drops, ref: int) -> None:
        self.drops = drops
        self.ref = ref

    def __del__(self) -> None:
        self.drops.add(self.ref, SL)


class _Queue(list):  # type: ignore[type-arg]
    """A queue whose append lets go of the last reference to a `_Dying`: its finalizer
    runs inside `Drops.add`'s lock, as one that a collection started there would."""

    victim: _Dying | None = None

    def append(self, item: object) -> None:
        self.victim = None
        super().append(item)


def test_a_finalizer_inside_add_queues_its_drop() -> None:
    d = Drops()
    q = _Queue()
    q.victim = _Dying(d, 2)
    d._queue = q
    _finishes(lambda: d.add(1, SL))
    cmds, refs = d.take()
    assert refs == [2, 1]
    assert cmds == [(SL, DeleteRefs(refs=[2, 1]))]


def test_a_drop_queued_by_the_thread_holding_the_lock_is_taken() -> None:
    # What a collection that started during `take`'s swap does: `add` on the same thread.
    d = Drops()
    d.add(1, SL)

    def inside() -> None:
        with d._lock:
            d.add(2, SL)
            assert not d.empty()

    _finishes(inside)
    assert d.take()[1] == [1, 2]
    assert d.empty()


def test_a_watched_ref_is_noted_when_dropped_before_or_after_the_watch() -> None:
    drops = Drops()
    drops.add(5, SL)  # queued before the watch began
    noted: set[int] = set()
    drops.watch([5, 6, 7], noted)
    assert noted == {5}
    drops.add(6, SL)
    drops.add(8, SL)  # not watched
    assert noted == {5, 6}
    drops.unwatch([7])
    drops.add(7, SL)
    assert noted == {5, 6}
    cmds, refs = drops.take()
    assert refs == [5, 6, 8, 7]
    assert isinstance(cmds[0][1], DeleteRefs)
