"""Which mesh and stream remote calls run on: the active mesh and stream.

``with mesh.activate():`` and ``with stream.activate():`` set context variables, so
they nest and are per thread and per task. Remote calls and collectives ask here; the
stream's own selection lives with `palatine.tensor.client.session.Stream`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

from palatine.tensor.client.session import Stream, current_stream
from palatine.tensor.client.values import ValueMesh

__all__ = [
    "active_mesh",
    "active_stream",
    "activated",
    "get_active_mesh",
    "get_active_stream",
    "mesh_disabled",
    "no_mesh",
]

M = TypeVar("M", bound=ValueMesh)

_active_mesh: contextvars.ContextVar[ValueMesh | None] = contextvars.ContextVar(
    "palatine_mesh", default=None
)


_no_mesh: contextvars.ContextVar[bool] = contextvars.ContextVar("palatine_no_mesh", default=False)


class _NoMesh:
    """``palatine.no_mesh``: inside an active mesh, torch factories make local tensors
    again: ``with palatine.no_mesh.activate():`` (Monarch's spelling) or ``with
    palatine.no_mesh():``. Ops on mesh tensors still run on their mesh."""

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        token = _no_mesh.set(True)
        try:
            yield
        finally:
            _no_mesh.reset(token)

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        return self.activate()

    def __repr__(self) -> str:
        return "palatine.no_mesh"


no_mesh = _NoMesh()


def mesh_disabled() -> bool:
    """Whether a ``palatine.no_mesh()`` block is open."""
    return _no_mesh.get()


def get_active_mesh() -> ValueMesh | None:
    """The mesh of the innermost open ``with mesh.activate():`` block (None outside; and
    None inside ``palatine.no_mesh``)."""
    if _no_mesh.get():
        return None
    return _active_mesh.get()


def active_mesh() -> ValueMesh:
    mesh = _active_mesh.get()
    if mesh is None:
        raise RuntimeError("no active mesh: use 'with mesh.activate():'")
    return mesh


def active_stream(mesh: ValueMesh) -> Stream:
    """The stream a call on ``mesh`` runs on: the active one (made on the mesh's session
    when first used there), else ``main``."""
    s = current_stream()
    if s is None:
        return mesh.stream("main")
    if s.session is mesh.session:
        return s
    return mesh.stream(s.name)


def get_active_stream() -> Stream:
    """The stream of the innermost open ``with stream.activate():`` block, else ``main``."""
    s = current_stream()
    return s if s is not None else Stream("main")


@contextlib.contextmanager
def activated(mesh: M) -> Iterator[M]:
    """Make ``mesh`` the active mesh for the block."""
    token = _active_mesh.set(mesh)
    try:
        yield mesh
    finally:
        _active_mesh.reset(token)
