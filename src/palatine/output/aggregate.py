"""Aggregating the output of many ranks: identical lines become one (sans-IO).

Eight ranks printing ``epoch 1 done`` should cost the reader one line, not eight:
``[worker 0-7] epoch 1 done``. `OutputAggregator` holds each line for a short window;
the same text from other ranks of the same world arriving within it joins the line's
group; when the window has passed, the group is written once with its ranks. Groups are
written in the order their first line arrived, so each rank's lines keep their order.
A window of 0 writes every line at once, prefixed with its rank.

Memory is bounded: past ``max_pending`` held lines, the oldest groups are written early.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

__all__ = ["OutputAggregator", "rank_ranges"]


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3,5"``."""
    out: list[str] = []
    start = prev = None
    for r in sorted(set(ranks)):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out)


class _Group:
    __slots__ = ("world", "text", "ranks", "since")

    def __init__(self, world: str, text: str, rank: int, since: float) -> None:
        self.world = world
        self.text = text
        self.ranks = [rank]
        self.since = since

    def line(self) -> str:
        return f"[{self.world} {rank_ranges(self.ranks)}] {self.text}\n"


class OutputAggregator:
    """Lines in, ``[world ranks] text`` lines out; see the module docstring."""

    def __init__(self, window_s: float = 0.5, max_pending: int = 10_000) -> None:
        self.window_s = window_s
        self.max_pending = max_pending
        self._groups: collections.deque[_Group] = collections.deque()
        self._open: dict[tuple[str, str], _Group] = {}  # groups a rank may still join
        self._held = 0

    def add(self, world: str, rank: int, text: str, now: float) -> list[str]:
        """Take one line; what is to be written now (early, when too much is held)."""
        if self.window_s <= 0:
            return [f"[{world} {rank}] {text}\n"]
        key = (world, text)
        group = self._open.get(key)
        if group is not None and rank not in group.ranks and now - group.since < self.window_s:
            group.ranks.append(rank)
        else:
            group = _Group(world, text, rank, now)
            self._groups.append(group)
            self._open[key] = group  # (a rank repeating a line starts a new group)
        self._held += 1
        out: list[str] = []
        while self._held > self.max_pending and self._groups:
            out.append(self._pop())
        return out

    def due(self, now: float) -> list[str]:
        """The groups whose window has passed, oldest first."""
        out: list[str] = []
        while self._groups and now - self._groups[0].since >= self.window_s:
            out.append(self._pop())
        return out

    def next_due(self) -> float | None:
        """When the oldest held group is due (None: nothing held)."""
        return self._groups[0].since + self.window_s if self._groups else None

    def flush(self) -> list[str]:
        """Everything held, now."""
        out = [self._pop() for _ in range(len(self._groups))]
        return out

    def _pop(self) -> str:
        group = self._groups.popleft()
        if self._open.get((group.world, group.text)) is group:
            del self._open[(group.world, group.text)]
        self._held -= len(group.ranks)
        return group.line()
