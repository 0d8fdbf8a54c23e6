"""Pytree forms of the tensor methods: `reduce`, `reduce_`, `slice_mesh`, `to_mesh`.

``palatine.reduce(tree, dims, ...)`` reduces every mesh tensor of a structure of
tensors (a dict of gradients, a list of parameters) and returns the same structure;
the others follow. Leaves that are not mesh tensors are left as they are.
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import tree_map

from palatine.tensor.client.session import Stream
from palatine.tensor.client.tensor import Tensor, move_tensor, reduce_tensor, slice_tensor

__all__ = ["reduce", "reduce_", "slice_mesh", "to_mesh"]


def _each(tree: Any, fn: Any) -> Any:
    return tree_map(lambda x: fn(x) if isinstance(x, Tensor) else x, tree)


def reduce(
    tree: Any,
    dims: str | tuple[str, ...],
    reduction: str = "sum",
    scatter: bool = False,
    mesh: Any = None,
    _inplace: bool = False,
) -> Any:
    """`Tensor.reduce` of every mesh tensor in ``tree``; the same structure back."""
    return _each(tree, lambda t: t.reduce(dims, reduction, scatter, mesh, _inplace))


def reduce_(
    tree: Any,
    dims: str | tuple[str, ...],
    reduction: str = "sum",
    scatter: bool = False,
    mesh: Any = None,
) -> Any:
    """`Tensor.reduce_` of every mesh tensor in ``tree`` (in place); ``tree`` back."""
    return _each(tree, lambda t: reduce_tensor(t, dims, reduction, scatter, True, None))


def slice_mesh(tree: Any, **coords: int | slice) -> Any:
    """`slice_tensor` of every mesh tensor in ``tree``."""
    return _each(tree, lambda t: slice_tensor(t, **coords))


def to_mesh(tree: Any, mesh: Any, stream: Stream | None = None) -> Any:
    """`move_tensor` of every mesh tensor in ``tree``."""
    return _each(tree, lambda t: move_tensor(t, mesh, stream))
