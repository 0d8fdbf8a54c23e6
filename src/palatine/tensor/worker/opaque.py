"""`OpaqueRef`: any Python object kept on the workers, held by reference from the client.

A remote function makes one on every rank (``return OpaqueRef(model)``) and the client
gets a handle at once; later remote functions that take the handle receive, on each
rank, that rank's same `OpaqueRef` object, and read or replace its ``value``. The
object is freed on the workers when the client drops its last handle. Nothing here
adds to the engine: the handle is a reference the engine already has.

* **Through ``remote(fn, propagate=...)``** (results that are mesh tensors), an
  `OpaqueRef` is a torch pytree node whose one leaf is a *key*: a 0-element int64 CPU
  tensor made when the worker flattens the result, carrying the `OpaqueRef` as an
  attribute. The worker binds the key to a ref like any tensor leaf; the client's handle
  is an `OpaqueRef` holding the key's mesh tensor. A shape function says where one is
  returned with a placeholder, ``propagate=lambda *a: OpaqueRef()``. Passed to a remote
  function, the handle travels as its key's ref, and the worker gives the function the
  object the key carries. Dropping the handle drops the key's ref, and with it the
  worker's object.
* **Through plain ``remote(fn)``** the call returns a `RemoteValue` that holds the
  worker's `OpaqueRef` itself; later functions receive the same object.

``palatine.inspect(ref)`` brings a copy of one rank's `OpaqueRef`, value included. Reading
``value`` of a client handle is a `TypeError` that says so. The object lives on the mesh
and stream of the call that made it (a borrow by another stream keeps it; a copy to
another mesh does not).
"""

from __future__ import annotations

import reprlib
import threading
from typing import Any, Final

from palatine.tensor.worker.values import import_torch

__all__ = ["OpaqueRef"]

_CARRIED: Final = "_palatine_opaque"
"""The attribute of a key tensor that holds its `OpaqueRef` (on the worker)."""

_UNSET: Final = object()


class OpaqueRef:
    """A worker-side box for any object (``OpaqueRef(value)``), named from the client.

    On a worker (and in a local copy) it holds ``value``, which remote functions read
    and may replace (``ref.value = new``). On the client, a handle returned by a remote
    function holds instead a ``key``, the mesh tensor that names the box on the workers
    (see the module)."""

    __slots__ = ("_value", "_key")

    def __init__(self, value: Any = None) -> None:
        self._value = value
        self._key: Any = None
        _register()

    @classmethod
    def of_key(cls, key: Any) -> OpaqueRef:
        """The `OpaqueRef` that ``key`` stands for: on a worker, the one its key tensor
        carries; elsewhere a handle holding ``key`` (a mesh tensor on the client)."""
        carried = getattr(key, _CARRIED, None)
        if isinstance(carried, OpaqueRef):
            return carried
        ref = cls.__new__(cls)
        ref._value = _UNSET
        ref._key = key
        _register()
        return ref

    @property
    def key(self) -> Any:
        """The 0-element mesh tensor naming this object on the workers (a client
        handle), or None for an `OpaqueRef` that holds its value."""
        return self._key

    @property
    def value(self) -> Any:
        """The object (on a worker or in a local copy); `TypeError` on a handle."""
        if self._key is not None:
            raise TypeError(self._elsewhere("read"))
        return self._value

    @value.setter
    def value(self, value: Any) -> None:
        if self._key is not None:
            raise TypeError(self._elsewhere("set"))
        self._value = value

    def _elsewhere(self, what: str) -> str:
        return (
            f"cannot {what} the value of {self!r} here: it lives on the workers; use it in "
            "a remote function (which receives the OpaqueRef holding it), or fetch a copy "
            "with palatine.inspect(ref).value"
        )

    def drop(self) -> None:
        """Free the worker-side object now (a handle; later use raises `TypeError`)."""
        drop = getattr(self._key, "drop", None)
        if drop is not None:
            drop()

    def __reduce_ex__(self, protocol: Any) -> Any:
        key = self._key
        if key is None:  # a box travels with its value (a fetch, a local copy sent)
            return (OpaqueRef, (self._value,))
        if getattr(key, "dropped", False):
            raise TypeError(f"{self!r} was dropped")
        return (OpaqueRef.of_key, (key,))  # a handle travels as its key's ref

    def __repr__(self) -> str:
        if self._key is not None:
            return f"OpaqueRef({self._key!r})"
        return f"OpaqueRef({reprlib.repr(self._value)})"


# ----------------------------------------------------------------------- pytree node


def _flatten(ref: OpaqueRef) -> tuple[list[Any], None]:
    key = ref._key
    if key is None:  # a box in a result: a fresh key tensor carries it
        torch = import_torch()
        # (no torch-function mode: under an active mesh, a factory would make a mesh tensor)
        with torch._C.DisableTorchFunction():
            key = torch.empty(0, dtype=torch.int64, device="cpu")
        setattr(key, _CARRIED, ref)
    return [key], None


def _unflatten(leaves: Any, context: None) -> OpaqueRef:
    return OpaqueRef.of_key(next(iter(leaves)))


_registered = False
_registering = threading.Lock()


def _register() -> None:
    """Make `OpaqueRef` a torch pytree node (once per process, where torch is
    installed): then a propagated remote function's worker binds its key as a tensor
    leaf, and the client rebuilds the handle around the key's mesh tensor."""
    global _registered
    if _registered:
        return
    with _registering:
        if _registered:
            return
        if import_torch() is not None:
            from torch.utils._pytree import register_pytree_node

            register_pytree_node(
                OpaqueRef, _flatten, _unflatten, serialized_type_name="palatine.OpaqueRef"
            )
        _registered = True
