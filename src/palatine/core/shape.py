"""Shapes of meshes: `Extent` (named dimensions and their sizes) and `Point` (one rank's
coordinates over an extent).

Ranks are laid out row-major: over ``Extent(["hosts", "gpus"], [2, 4])`` rank 5 is the
point ``{"hosts": 1, "gpus": 1}``. An actor's `palatine.current_rank()` is its `Point`,
a value mesh's `items()` pair points with values, and `ValueMesh.item(hosts=1, gpus=1)`
picks one; the names are a Monarch user's (``monarch.actor.Point`` / ``Extent``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["Extent", "Point"]


class Extent:
    """Named dimensions and their sizes, outermost first."""

    __slots__ = ("labels", "sizes")

    def __init__(self, labels: Iterable[str], sizes: Iterable[int]) -> None:
        self.labels = list(labels)
        self.sizes = [int(s) for s in sizes]
        if len(self.labels) != len(self.sizes):
            raise ValueError(f"{len(self.labels)} labels for {len(self.sizes)} sizes")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"a dimension is named twice in {self.labels}")
        if any(s < 1 for s in self.sizes):
            raise ValueError(f"dimension sizes must be >= 1, got {self.sizes}")

    @classmethod
    def of(cls, dims: Sequence[tuple[str, int]]) -> Extent:
        """From ``[(name, size), ...]``."""
        return cls((n for n, _ in dims), (s for _, s in dims))

    @property
    def nelements(self) -> int:
        """How many ranks the extent covers."""
        return math.prod(self.sizes)

    def items(self) -> list[tuple[str, int]]:
        return list(zip(self.labels, self.sizes, strict=True))

    def point(self, rank: int) -> Point:
        """Rank ``rank``'s point (an `IndexError` outside the extent)."""
        return Point(rank, self)

    def select(self, ranks: Iterable[int], /, **sel: int | slice) -> list[int]:
        """Those of ``ranks`` whose point matches ``sel`` (a dimension's index, or a
        `slice` of its indices): what every mesh's ``slice`` keeps. `ValueError` for an
        unknown dimension, `IndexError` for an index out of range."""
        sizes = dict(self.items())
        for k, v in sel.items():
            if k not in sizes:
                raise ValueError(f"unknown dimension {k!r}; this mesh has {self.labels}")
            if not isinstance(v, slice) and not 0 <= v < sizes[k]:
                raise IndexError(f"index {v} out of range for dimension {k!r} of size {sizes[k]}")
        wanted = {
            k: set(range(sizes[k])[v]) if isinstance(v, slice) else {v} for k, v in sel.items()
        }
        keep = []
        for r in ranks:
            point = self.point(r)
            if all(point[k] in ok for k, ok in wanted.items()):
                keep.append(r)
        return keep

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The rank at ``coords``, which name every dimension."""
        if set(coords) != set(self.labels):
            raise KeyError(f"a point of {self} names {self.labels}, got {sorted(coords)}")
        rank = 0
        for name, size in zip(self.labels, self.sizes, strict=True):
            i = coords[name]
            if not 0 <= i < size:
                raise IndexError(f"index {i} out of range for dimension {name!r} of size {size}")
            rank = rank * size + i
        return rank

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Extent) and self.labels == other.labels and self.sizes == other.sizes
        )

    def __hash__(self) -> int:
        return hash((tuple(self.labels), tuple(self.sizes)))

    def __repr__(self) -> str:
        return f"Extent({dict(self.items())})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Extent, (self.labels, self.sizes))


class Point(dict[str, int]):
    """A rank's coordinates: a dict ``{dimension: index}`` that also knows its flat
    ``rank`` and its ``extent``."""

    __slots__ = ("rank", "extent")

    def __init__(self, rank: int, extent: Extent) -> None:
        if not 0 <= rank < extent.nelements:
            raise IndexError(f"rank {rank} is outside {extent}")
        coords: list[tuple[str, int]] = []
        left = rank
        for name, size in reversed(extent.items()):
            left, i = divmod(left, size)
            coords.append((name, i))
        super().__init__(reversed(coords))
        self.rank = rank
        self.extent = extent

    def __repr__(self) -> str:
        return f"Point({dict(self)!r}, rank={self.rank})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Point, (self.rank, self.extent))
