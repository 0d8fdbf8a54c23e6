"""Mesh shapes: named dims over worker-world ranks, and the shapes made from them.

A `MeshShape` is what a `palatine.tensor.client.mesh.DeviceMesh` covers: rank
``offset + Σ idx[d]·strides[d]`` for each index vector ``idx`` below ``sizes``, row-major
(the last dim varies fastest). Sub-meshes are new shapes over some or all of the same
ranks: `slice_shape` (an int removes a dim, a Python slice keeps it), `split` (one dim
becomes several), `rename`, and `flatten` (all dims become one). The worker builds its
view of a mesh from exactly these names, sizes and strides (``CreateDeviceMesh``), so
coordinates, process groups and reductions over the new names follow from them alone.

Nothing here does IO: pure functions, checked by unit tests, raising a ValueError (an
IndexError for an index out of range) that names the mesh, the dim and the sizes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "MeshShape",
    "dim_index",
    "flatten",
    "rename",
    "row_major_strides",
    "size_of",
    "slice_shape",
    "split",
]


@dataclass(frozen=True)
class MeshShape:
    """Named dims over ranks: ``offset + Σ idx[d]·strides[d]`` (one entry per dim)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @classmethod
    def row_major(cls, names: Sequence[str], sizes: Sequence[int], offset: int = 0) -> MeshShape:
        """Dense ranks ``offset ..`` over ``names`` (the last dim varies fastest)."""
        return cls(tuple(names), tuple(sizes), row_major_strides(sizes), offset)

    def describe(self) -> str:
        """``(host=2, gpu=4)``: the dims and their sizes, for messages."""
        return (
            "(" + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True)) + ")"
        )


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """The strides of dense row-major ``sizes``: ``[2, 4]`` → ``(4, 1)``."""
    return tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes)))


def _where(shape: MeshShape, mesh: str) -> str:
    return f"{mesh} {shape.describe()}"


def dim_index(shape: MeshShape, dim: str, mesh: str = "mesh") -> int:
    """The index of ``dim`` in ``shape`` (ValueError naming the mesh's dims if unknown)."""
    try:
        return shape.names.index(dim)
    except ValueError:
        raise ValueError(
            f"unknown dimension {dim!r}; {_where(shape, mesh)} has {list(shape.names)}"
        ) from None


def size_of(shape: MeshShape, dims: str | Sequence[str] | None = None, mesh: str = "mesh") -> int:
    """The size of ``dims``: one dim's size, the product of several's, or (None) the
    number of ranks."""
    if dims is None:
        return math.prod(shape.sizes)
    if isinstance(dims, str):
        return shape.sizes[dim_index(shape, dims, mesh)]
    return math.prod(shape.sizes[dim_index(shape, d, mesh)] for d in dims)


def slice_shape(shape: MeshShape, sel: Mapping[str, int | slice], mesh: str = "mesh") -> MeshShape:
    """Some of the ranks: an int (negative counts from the end) removes its dim, a
    Python slice keeps it with the ranks it selects; dims not named stay whole."""
    for name in sel:
        dim_index(shape, name, mesh)
    names, sizes, strides, offset = [], [], [], shape.offset
    for name, size, stride in zip(shape.names, shape.sizes, shape.strides, strict=True):
        if name not in sel:
            names.append(name)
            sizes.append(size)
            strides.append(stride)
            continue
        s = sel[name]
        if isinstance(s, slice):
            start, stop, step = s.indices(size)
            count = len(range(start, stop, step))
            if count == 0:
                raise IndexError(
                    f"empty slice {s} of dimension {name!r} (size {size}) of {_where(shape, mesh)}"
                )
            offset += start * stride
            names.append(name)
            sizes.append(count)
            strides.append(stride * step)
        elif isinstance(s, int) and not isinstance(s, bool):
            if not -size <= s < size:
                raise IndexError(
                    f"index {s} out of range for dimension {name!r} of size {size} "
                    f"of {_where(shape, mesh)}"
                )
            offset += (s % size) * stride
        else:
            raise TypeError(
                f"dimension {name!r} of {_where(shape, mesh)} takes an int or a slice, "
                f"not {type(s).__name__}"
            )
    return MeshShape(tuple(names), tuple(sizes), tuple(strides), offset)


def split(
    shape: MeshShape, spec: Mapping[str, Sequence[str] | int], mesh: str = "mesh"
) -> MeshShape:
    """Dims split into new dims: ``split(host=("dp", "pp"), pp=2)``.

    A key that is a dim of ``shape`` names the dims it becomes (a sequence of names,
    outermost first); any other key is the size of one of those new dims. Per split dim
    at most one new size may be left out: it is the dim's size divided by the others',
    and the sizes must multiply to the dim's. Row-major: the last new dim varies fastest,
    so with dim stride ``s`` and new sizes ``[a, b, c]`` the new strides are
    ``[s·b·c, s·c, s]``. Dims not named stay as they are; a dim split into one name is
    renamed. Every resulting name must be unique."""
    splits: dict[str, tuple[str, ...]] = {}
    given: dict[str, int] = {}
    for key, value in spec.items():
        if key in shape.names:
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise ValueError(
                    f"split of dimension {key!r} of {_where(shape, mesh)} needs a sequence "
                    f"of new dimension names (e.g. {key}=('a', 'b')), not {value!r}; an int "
                    f"sizes a new dimension, not one the mesh has"
                )
            new = tuple(value)
            if not new:
                raise ValueError(
                    f"split of dimension {key!r} of {_where(shape, mesh)} names no new dimension"
                )
            for n in new:
                if not isinstance(n, str) or not n:
                    raise ValueError(
                        f"split of dimension {key!r} of {_where(shape, mesh)}: new dimension "
                        f"names must be non-empty strings, not {n!r}"
                    )
            splits[key] = new
        elif isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise ValueError(f"split of {_where(shape, mesh)}: size {key}={value} must be >= 1")
            given[key] = value
        else:
            raise ValueError(
                f"{key!r} is not a dimension of {_where(shape, mesh)}: to split a dimension "
                f"give it a sequence of new names; to size a new dimension give an int, "
                f"not {value!r}"
            )
    result = [n for name in shape.names for n in splits.get(name, (name,))]
    twice = sorted({n for n in result if result.count(n) > 1})
    if twice:
        raise ValueError(
            f"split of {_where(shape, mesh)} would name dimension(s) {twice} more than once "
            f"(resulting dims {result})"
        )
    unused = sorted(set(given) - set(result))
    if unused:
        raise ValueError(
            f"split of {_where(shape, mesh)}: size(s) given for {unused}, which no split "
            f"names (resulting dims {result})"
        )
    names: list[str] = []
    sizes: list[int] = []
    strides: list[int] = []
    for name, size, stride in zip(shape.names, shape.sizes, shape.strides, strict=True):
        new = splits.get(name, (name,))
        missing = [n for n in new if n not in given]
        if len(missing) > 1:
            raise ValueError(
                f"cannot split dimension {name!r} (size {size}) of {_where(shape, mesh)} into "
                f"{new}: the sizes of {missing} are all unknown; give all but one, "
                f"e.g. {missing[-1]}=..."
            )
        known = math.prod(given[n] for n in new if n in given)
        shown = tuple(given.get(n, "?") for n in new)
        if missing:
            if size % known:
                raise ValueError(
                    f"cannot split dimension {name!r} (size {size}) of {_where(shape, mesh)} "
                    f"into {new} with sizes {shown}: {size} is not divisible by {known}"
                )
            new_sizes = [given.get(n, size // known) for n in new]
        else:
            if known != size:
                raise ValueError(
                    f"cannot split dimension {name!r} (size {size}) of {_where(shape, mesh)} "
                    f"into {new} with sizes {shown}: they multiply to {known}, not {size}"
                )
            new_sizes = [given[n] for n in new]
        names.extend(new)
        sizes.extend(new_sizes)
        strides.extend(stride * inner for inner in row_major_strides(new_sizes))
    return MeshShape(tuple(names), tuple(sizes), tuple(strides), shape.offset)


def rename(shape: MeshShape, renames: Mapping[str, str], mesh: str = "mesh") -> MeshShape:
    """The same ranks with dims renamed (``old="new"``); dims not named keep their name.
    Names may be swapped (``rename(a="b", b="a")``); an unknown old name, or a new name
    that is not a non-empty string or that another dim keeps, is a ValueError."""
    for old, new in renames.items():
        dim_index(shape, old, mesh)
        if not isinstance(new, str) or not new:
            raise ValueError(
                f"rename of dimension {old!r} of {_where(shape, mesh)}: the new name must be "
                f"a non-empty string, not {new!r}"
            )
    result = [renames.get(n, n) for n in shape.names]
    twice = sorted({n for n in result if result.count(n) > 1})
    if twice:
        raise ValueError(
            f"rename of {_where(shape, mesh)} would name dimension(s) {twice} more than once "
            f"(resulting dims {result})"
        )
    return MeshShape(tuple(result), shape.sizes, shape.strides, shape.offset)


def flatten(shape: MeshShape, name: str, mesh: str = "mesh") -> MeshShape:
    """All dims as one dim ``name``, the ranks in the same (row-major) order.

    Possible when the ranks are one arithmetic progression: each dim's stride is the
    next one's stride times its size (dims of size 1 do not count), as in a whole mesh
    or a slice of its outermost dim; the one dim has the innermost stride. Otherwise
    (e.g. two columns of a 2×4 mesh: ranks 0, 1, 4, 5) a ValueError."""
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"flatten of {_where(shape, mesh)}: the new name must be a non-empty string, "
            f"not {name!r}"
        )
    used = [(sz, st) for sz, st in zip(shape.sizes, shape.strides, strict=True) if sz > 1]
    for (_, outer), (size, inner) in itertools.pairwise(used):
        if outer != inner * size:
            raise ValueError(
                f"cannot flatten {_where(shape, mesh)} (strides {list(shape.strides)}) into "
                f"{name!r}: its ranks are not evenly spaced in row-major order"
            )
    stride = used[-1][1] if used else 1
    return MeshShape((name,), (math.prod(shape.sizes),), (stride,), shape.offset)
