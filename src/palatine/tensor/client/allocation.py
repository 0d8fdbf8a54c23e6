"""Id allocation: the numbers a session hands out (seqs, refs, stream ids, borrow ids).

Each counter counts 1, 2, 3, ... for the session's whole life; a number is never given
twice, not even across a recovery. Taking one is a single C call (`itertools.count`'s
``__next__``), atomic under the GIL, so any thread may take refs and borrow ids without
a lock. Seqs are the exception: `Session.issue` takes them under the session's lock,
together with queueing the seq's Node, so seq order is send order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

__all__ = ["Ids"]


class Ids:
    """The session's counters; each attribute, called, gives the next number."""

    __slots__ = ("next_seq", "new_ref", "new_stream", "new_borrow")

    def __init__(self) -> None:
        #: The next seq (the session's lock held: see the module).
        self.next_seq: Callable[[], int] = itertools.count(1).__next__
        #: A fresh ref: a value, device mesh or process group on the workers.
        self.new_ref: Callable[[], int] = itertools.count(1).__next__
        #: A fresh stream id (stream 0 is ``main``, given by name, not taken here).
        self.new_stream: Callable[[], int] = itertools.count(1).__next__
        #: A fresh borrow id (`RemoteValue.to_stream`).
        self.new_borrow: Callable[[], int] = itertools.count(1).__next__
