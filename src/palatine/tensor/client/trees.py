"""Pytree forms of the tensor methods: `reduce`, `reduce_`, `slice_mesh`, `to_mesh`
(which also moves local tensors and modules onto a mesh).

``palatine.reduce(tree, dims, ...)`` reduces every mesh tensor of a structure of
tensors (a dict of gradients, a list of parameters) and returns the same structure;
the others follow. Leaves that are not mesh tensors are left as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from palatine.tensor.client.factories import from_local
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
    """``tree`` on ``mesh``: every mesh tensor in it moved there (`move_tensor`), every
    local tensor copied to each of its ranks (`from_local`); the same structure back.

    An ``nn.Module`` is moved in place, as ``module.to(device)`` is: its parameters
    become mesh parameters (requiring grad as before) and its buffers mesh tensors; the
    module itself is returned."""
    if isinstance(tree, torch.nn.Module):
        return _module_to_mesh(tree, mesh, stream)
    return tree_map(lambda x: _leaf_to_mesh(x, mesh, stream), tree)


def _leaf_to_mesh(x: Any, mesh: Any, stream: Stream | None) -> Any:
    if isinstance(x, Tensor):
        return move_tensor(x, mesh, stream)
    if isinstance(x, torch.Tensor):
        return from_local(x, getattr(mesh, "_device_mesh", mesh), stream)
    return x


def _module_to_mesh(module: torch.nn.Module, mesh: Any, stream: Stream | None) -> Any:
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(
                    _leaf_to_mesh(p.detach(), mesh, stream), requires_grad=p.requires_grad
                )
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = _leaf_to_mesh(b, mesh, stream)
    return module
