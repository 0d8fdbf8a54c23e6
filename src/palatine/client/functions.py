"""Small functions the client runs on workers by import path."""

from __future__ import annotations

from typing import Any

__all__ = ["coordinate", "identity"]


def coordinate(mesh: Any, dims: tuple[str, ...]) -> int:
    """This worker's row-major index over ``dims`` of its device-mesh view."""
    idx = 0
    for d in dims:
        idx = idx * mesh.size(d) + mesh.rank(d)
    return idx


def identity(value: Any) -> Any:
    return value


_store: Any = None


def open_store() -> str:
    """Rank 0: open a torch TCPStore master on a free loopback port; returns ``host:port``.

    The store lives as long as the worker process (it backs the session's process
    groups, 40-worker-client.md §1.6).
    """
    global _store
    import socket

    import torch.distributed as dist

    if _store is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        _store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    return f"127.0.0.1:{_store.port}"
