"""``remote(fn, propagate=...)``: remote functions whose results are mesh tensors.

A plain ``remote(fn)`` returns `RemoteValue`s: opaque worker-side values. With
``propagate``, the client learns what ``fn`` returns (a tensor, or any pytree of
tensors and other values) and hands the caller mesh tensors (`palatine.Tensor`) at
once, as an op would. How it learns it:

* a callable: the shape function, run on the client on fake tensors with the same
  arguments (``propagate=lambda x: x`` for a function that returns a tensor like its
  input). A fake input it writes in place is a mutation of that mesh tensor;
* ``"mocked"``: ``fn`` itself is its own shape function (it must run on fake tensors:
  plain torch code does);
* ``"inspect"``: ``fn`` runs once for real on the first rank of the mesh, and the
  structure, shapes and dtypes of its result are brought back (the call waits for it);
* ``"cached"``: as ``"inspect"``, once for each set of input metadata and other
  arguments; later calls like it reuse the answer.

The function then runs on every rank of the mesh as one seq, and the worker binds the
tensor leaves of its result (`palatine.protocol.worker.CallFunction.flatten`). The mesh
is the first mesh tensor argument's, else the active mesh.

``palatine.remote`` is this module's `remote`, and a program that never asks for
mesh tensors never loads torch: the modules that need it (`palatine.tensor.client.tensor`,
`palatine.tensor.client.fake`) load with the first `TensorFunction`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

from palatine.tensor.client.context import active_stream, get_active_mesh
from palatine.tensor.client.remote import RemoteFunction, call_on_shard_and_fetch
from palatine.tensor.worker.functions import META_TAG, result_meta

if TYPE_CHECKING:
    from palatine.tensor.client.fake import Meta, OpSpec

__all__ = ["PROPAGATORS", "TensorFunction", "rank_tensor", "remote"]

PROPAGATORS: Final = ("inspect", "cached", "mocked")
"""The named ways of learning a remote function's result (or pass a callable)."""


def _meta(x: Any) -> Meta | None:
    return getattr(x, "_meta", None) if hasattr(x, "_value") else None


_modules: tuple[ModuleType, ModuleType] | None = None


def _engine() -> tuple[ModuleType, ModuleType]:
    """The torch-side modules (`fake`, `tensor`), loaded on first use (see the module)."""
    global _modules
    if _modules is None:
        _modules = (
            importlib.import_module("palatine.tensor.client.fake"),
            importlib.import_module("palatine.tensor.client.tensor"),
        )
    return _modules


class TensorFunction(RemoteFunction):
    """``remote(fn, propagate=...)``: calling it returns mesh tensors (see the module)."""

    def __init__(self, fn: Any, propagate: Any, mutates: tuple[str, ...] = ()) -> None:
        if not callable(propagate) and propagate not in PROPAGATORS:
            raise ValueError(
                f"propagate must be a callable or one of {PROPAGATORS}, not {propagate!r}"
            )
        if propagate == "mocked" and not callable(fn):
            raise TypeError(f"propagate='mocked' runs the function itself: {fn!r} is a path")
        super().__init__(fn, mutates)
        self._fake, self._tensor = _engine()
        self.propagate = propagate
        self._cache: dict[Any, OpSpec] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensor = self._tensor
        tensors = tensor.mesh_tensors(args, kwargs)
        mesh = tensors[0].mesh if tensors else get_active_mesh()
        if mesh is None:
            raise TypeError(
                f"remote function {self._function()[1]} has no mesh tensor argument and "
                "no mesh is active: use 'with mesh.activate():'"
            )
        stream = active_stream(mesh)
        tensor.check_tensors(tensors, mesh, stream)
        spec = self._spec(args, kwargs)
        if self.mutates:  # named writes a real run (inspect, cached) cannot show
            named = {id(v) for v in self._named(args, kwargs)}
            extra = [i for i, t in enumerate(tensors) if id(t) in named]
            spec = self._fake.OpSpec(spec.outs, spec.rebuild, sorted({*spec.mutated, *extra}))
        fref, label = self._function()
        return tensor.issue(fref, label, args, kwargs, mesh, stream, spec, tensors, flatten=True)

    def _named(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The arguments ``mutates`` names (each must be a mesh tensor)."""
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        out = []
        for name in self.mutates:
            v = bound.arguments.get(name)
            if _meta(v) is None:
                raise TypeError(
                    f"mutated argument {name!r} must be a mesh tensor, got {type(v).__name__}"
                )
            out.append(v)
        return out

    def _spec(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpSpec:
        p = self.propagate
        fake = self._fake
        if callable(p):
            return fake.fake_call(p, args, kwargs, _meta)  # type: ignore[no-any-return]
        if p == "mocked":
            return fake.fake_call(self.fn, args, kwargs, _meta)  # type: ignore[no-any-return]
        from torch.utils._pytree import tree_leaves  # (torch is loaded: see _engine)

        if any(getattr(v, "label", None) == "process_group" for v in tree_leaves((args, kwargs))):
            # (the one real run could not complete a collective alone: refuse, not hang)
            raise TypeError(
                f"remote function {self._function()[1]} takes a process group: its "
                f"propagate={p!r} would run it on one rank alone, where a collective "
                "never completes; give a shape function (propagate=callable) instead"
            )
        key = fake.op_key(self.fn, args, kwargs, _meta) if p == "cached" else None
        if key is not None:
            hit = self._cache.get(key)
            if hit is not None:
                return hit
        spec = self._learn(args, kwargs)
        if key is not None:
            self._cache[key] = spec
        return spec

    def _learn(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpSpec:
        """Run the function once on the first rank; the `OpSpec` of what it returned."""
        import torch
        from torch.utils._pytree import tree_map

        fake = self._fake
        described = call_on_shard_and_fetch(result_meta, self.fn, *args, **kwargs).result()

        def described_tensor(x: Any) -> bool:
            return type(x) is tuple and len(x) == 5 and x[0] == META_TAG

        def fake_of(x: Any) -> Any:  # a fake for each tensor's description
            if described_tensor(x):
                _, shape, stride, dtype, device = x
                dt = getattr(torch, dtype.removeprefix("torch."))
                m = fake.Meta(tuple(shape), tuple(stride), dt, torch.device(device))
                return fake.fake_like(m)
            return x

        out = tree_map(fake_of, described, is_leaf=described_tensor)
        return fake.spec_of(out, [], [])  # type: ignore[no-any-return]


def remote(
    fn: Any = None,
    *,
    propagate: str | Callable[..., Any] | None = None,
    mutates: tuple[str, ...] = (),
    returns: int = 1,
) -> Any:
    """Make ``fn`` (a function, or a dotted path such as ``"pkg.mod.fn"``) callable on
    every rank of a mesh; as a decorator too (``@remote`` or ``@remote(propagate=...)``).

    Without ``propagate`` a call returns `palatine.RemoteValue`s (``returns`` of them);
    with it, mesh tensors shaped as ``propagate`` says (see the module)."""

    def make(f: Any) -> Any:
        if propagate is None:
            return RemoteFunction(f, mutates, returns)
        return TensorFunction(f, propagate, mutates)

    if fn is None:
        return make
    return make(fn)


def _int_scalar(mesh: Any, dims: Any) -> Any:
    import torch

    return torch.zeros((), dtype=torch.int64)


_coordinates: TensorFunction | None = None


def rank_tensor(handle: Any, dims: tuple[str, ...]) -> Any:
    """``mesh.rank(dims)`` on the active mesh: a 0-dim int64 mesh tensor per rank."""
    global _coordinates
    if _coordinates is None:
        _coordinates = TensorFunction(
            "palatine.tensor.worker.functions.coordinate_tensor", _int_scalar
        )
    return _coordinates(handle, dims)
