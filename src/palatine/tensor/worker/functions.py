"""Small functions the client runs on workers by import path (cheap to import there)."""

from __future__ import annotations

from typing import Any

__all__ = ["coordinate", "identity", "identity_printing"]

# (The session's TCPStore master is palatine.tensor.worker.collectives.open_store.)


def coordinate(mesh: Any, dims: tuple[str, ...]) -> int:
    """This worker's row-major index over ``dims`` of its device-mesh view."""
    idx = 0
    for d in dims:
        idx = idx * mesh.size(d) + mesh.rank(d)
    return idx


def identity(value: Any) -> Any:
    return value


def identity_printing(value: Any) -> Any:
    """`identity`, printing one line (the benchmark of output streaming)."""
    print(f"call {value} done", flush=True)
    return value
