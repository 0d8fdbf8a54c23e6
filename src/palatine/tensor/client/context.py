"""Which mesh and stream remote calls run on: `Stream` and the active mesh and stream.

``with mesh.activate():`` and ``with stream.activate():`` set context variables, so
they nest and are per thread and per task. Below every other module of the client:
values, remote calls, collectives and meshes all ask here.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from palatine.tensor.client.mesh import DeviceMesh
    from palatine.tensor.client.session import Session

__all__ = ["Stream", "active_mesh", "active_stream", "activated"]

_active_mesh: contextvars.ContextVar[DeviceMesh | None] = contextvars.ContextVar(
    "palatine_mesh", default=None
)
_active_stream: contextvars.ContextVar[Stream | None] = contextvars.ContextVar(
    "palatine_stream", default=None
)


def active_mesh() -> DeviceMesh:
    mesh = _active_mesh.get()
    if mesh is None:
        raise RuntimeError("no active mesh: use 'with mesh.activate():'")
    return mesh


def active_stream(mesh: DeviceMesh) -> Stream:
    s = _active_stream.get()
    if s is not None and s.session is mesh.session:
        return s
    return mesh.stream("main")


class Stream:
    """A named stream of the session: one worker thread per rank, FIFO."""

    def __init__(self, session: Session, name: str, sid: int) -> None:
        self.session = session
        self.name = name
        self.id = sid

    def __repr__(self) -> str:
        return f"<Stream {self.name}>"

    @contextlib.contextmanager
    def activate(self) -> Iterator[Stream]:
        token = _active_stream.set(self)
        try:
            yield self
        finally:
            _active_stream.reset(token)


@contextlib.contextmanager
def activated(mesh: DeviceMesh) -> Iterator[DeviceMesh]:
    """Make ``mesh`` the active mesh for the block."""
    token = _active_mesh.set(mesh)
    try:
        yield mesh
    finally:
        _active_mesh.reset(token)
