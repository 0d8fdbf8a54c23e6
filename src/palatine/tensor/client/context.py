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

__all__ = ["active_mesh", "active_stream", "activated"]

M = TypeVar("M", bound=ValueMesh)

_active_mesh: contextvars.ContextVar[ValueMesh | None] = contextvars.ContextVar(
    "palatine_mesh", default=None
)


def active_mesh() -> ValueMesh:
    mesh = _active_mesh.get()
    if mesh is None:
        raise RuntimeError("no active mesh: use 'with mesh.activate():'")
    return mesh


def active_stream(mesh: ValueMesh) -> Stream:
    s = current_stream()
    if s is not None and s.session is mesh.session:
        return s
    return mesh.stream("main")


@contextlib.contextmanager
def activated(mesh: M) -> Iterator[M]:
    """Make ``mesh`` the active mesh for the block."""
    token = _active_mesh.set(mesh)
    try:
        yield mesh
    finally:
        _active_mesh.reset(token)
