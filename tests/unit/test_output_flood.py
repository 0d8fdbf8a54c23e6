"""A host's output to a client is bounded (`palatine.hosting.output`): past the bound,
ordinary lines are dropped and counted; warnings and errors have a second bound of their
own, so the warning a rank logs after a flood of prints still reaches the user."""

from __future__ import annotations

from typing import Any, cast

from palatine.hosting.output import _Watcher
from palatine.ids import ActorId

WARNING = "2026-12-06 21:00:00,000 WARNING user.train: LOUD-WARNING from rank 1\n"


def watcher(max_bytes: int) -> _Watcher:
    return _Watcher(cast(Any, None), "worker", ActorId.parse("user[0].sink[0]"), max_bytes)


def test_a_flood_past_the_bound_is_dropped_and_counted_and_a_warning_after_it_kept() -> None:
    w = watcher(4096)
    line = "e" * 99 + "\n"
    for _ in range(100):  # 10 kB of prints
        w._queue(1, line)
    assert w.bytes <= 4096 and w.dropped == 100 - len(w.pending)
    w._queue(1, WARNING)
    assert w.pending[-1] == (1, WARNING)


def test_warnings_are_bounded_too() -> None:
    w = watcher(4096)
    for _ in range(200):
        w._queue(0, WARNING)
    assert w.bytes <= 2 * 4096 and w.dropped > 0
