"""Per-rank monotone counters with their minimum (the History's frontiers)."""

from __future__ import annotations

from heapq import heapify, heappop, heappush

__all__ = ["MinTracker"]


class MinTracker:
    """Per-rank monotone values with their minimum, kept by a counted lazy min-heap.

    ``values[r]`` only grows. ``count`` maps each present value to how many ranks hold
    it; ``heap`` holds every present value, plus stale ones that are dropped when they
    reach the top or when the heap grows past a bound (so memory stays O(ranks) even if
    one rank never moves while the others do).
    """

    __slots__ = ("count", "heap", "min", "values")

    def __init__(self, n: int) -> None:
        self.values = [0] * n
        self.count = {0: n}
        self.heap = [0]
        self.min = 0

    def raise_to(self, rank: int, value: int) -> None:
        """Set ``values[rank] = value`` (caller ensures it is larger) and fix the minimum."""
        values = self.values
        count = self.count
        old = values[rank]
        values[rank] = value
        left = count[old] - 1
        if left:
            count[old] = left
        else:
            del count[old]
        c = count.get(value)
        if c is None:
            count[value] = 1
            heap = self.heap
            heappush(heap, value)
            if len(heap) > 2 * len(count) + 16:
                heap[:] = count
                heapify(heap)
        else:
            count[value] = c + 1
        if not left and old == self.min:
            heap = self.heap
            while heap[0] not in count:
                heappop(heap)
            self.min = heap[0]
