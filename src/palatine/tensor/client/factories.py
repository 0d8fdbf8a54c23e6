"""Torch factories under ``mesh.activate()``: ``torch.rand(3, 4)`` makes a mesh tensor.

While a mesh is active, a ``TorchFunctionMode`` (`FactoryMode`) sees every torch call
made on the activating thread. The factories (`FACTORIES`: ``rand``, ``zeros``,
``arange``, ``tensor``, ...) called without a tensor argument become ops of the active
mesh: each rank runs the same call, and the caller gets a `palatine.Tensor` whose
metadata the client learned from a fake run of the call. Everything else passes through:
ops on mesh tensors reach `Tensor.__torch_dispatch__`; ops on local tensors only run
locally, as they would without a mesh. Inside ``palatine.no_mesh()`` factories make
local tensors again.

The ``*_like`` forms of a mesh tensor (``torch.zeros_like(t)``) need no mode: they are
ops on a mesh tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Final

import torch
from torch.overrides import TorchFunctionMode

from palatine.protocol.worker import FunctionPath
from palatine.tensor.client import known
from palatine.tensor.client.context import active_stream, mesh_disabled
from palatine.tensor.client.fake import propagate
from palatine.tensor.client.tensor import issue
from palatine.tensor.client.values import ValueMesh

__all__ = ["FACTORIES", "FactoryMode", "factory_mode", "from_local"]

FACTORIES: Final = frozenset(
    getattr(torch, name)
    for name in (
        "rand",
        "randn",
        "randint",
        "randperm",
        "zeros",
        "ones",
        "full",
        "arange",
        "empty",
        "empty_strided",
        "tensor",
        "eye",
        "linspace",
        "logspace",
    )
)
"""The torch functions that make a mesh tensor when called with no tensor argument."""

_UNCACHED: Final = frozenset({torch.tensor})  # data arguments: not worth keying


def _no_meta(x: Any) -> None:
    return None


def _has_tensor(x: Any) -> bool:
    t = type(x)
    if t is tuple or t is list:
        return any(_has_tensor(v) for v in x)
    if t is dict:
        return any(_has_tensor(v) for v in x.values())
    return isinstance(x, torch.Tensor)


def make(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: ValueMesh) -> Any:
    """Run factory ``func`` on every rank of ``mesh``: a mesh tensor, at once."""
    name = func.__name__
    if func in _UNCACHED:
        from_fake = propagate(lambda *a, **k: func(*a, **k), args, kwargs, _no_meta)
    else:
        from_fake = propagate(func, args, kwargs, _no_meta)
    stream = active_stream(mesh)
    # Autograd runs on the client (the mesh tensor requires grad); the workers' tensors
    # never do, so their in-place updates (an optimizer step under no_grad here) are
    # plain writes there.
    sent = {k: v for k, v in kwargs.items() if k != "requires_grad"}
    made = issue(
        FunctionPath(path=f"torch.{name}"),
        f"torch.{name}",
        args,
        sent,
        mesh,
        stream,
        from_fake,
        [],
    )
    made._known = known.factory_value(name, args, sent, made.shape)
    return made


def from_local(t: torch.Tensor, mesh: ValueMesh, stream: Any = None) -> Any:
    """A mesh tensor of ``mesh`` whose every rank holds a copy of local tensor ``t`` (sent
    with the op, by value), on ``stream`` (default: the active one): how local weights
    and data move onto a mesh (`palatine.to_mesh`). It requires grad as ``t`` does."""
    stream = active_stream(mesh) if stream is None else mesh.stream(stream.name)
    data = t.detach()
    spec = propagate(torch.clone, (data,), {}, _no_meta)
    made = issue(FunctionPath(path="torch.clone"), "to_mesh", (data,), {}, mesh, stream, spec, [])
    if data.numel() <= known.KNOWN_MAX_NUMEL and data.device.type == "cpu":
        made._known = data.clone()
    if t.requires_grad:
        made.requires_grad_(True)
    return made


class FactoryMode(TorchFunctionMode):
    """Makes torch factories mesh tensors of ``mesh`` (see the module)."""

    def __init__(self, mesh: ValueMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and not mesh_disabled() and not _has_tensor((args, kwargs)):
            return make(func, args, kwargs, self.mesh)
        return func(*args, **kwargs)


@contextlib.contextmanager
def factory_mode(mesh: ValueMesh) -> Iterator[None]:
    """`FactoryMode` for ``mesh``, on this thread, for a ``with`` block."""
    with FactoryMode(mesh):
        yield
