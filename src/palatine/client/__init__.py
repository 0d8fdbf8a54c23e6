"""The Python client: local meshes, remote functions, fetch (40-worker-client.md §2).

``local_mesh`` / ``connect`` give a `DeviceMesh`; ``remote(fn)`` runs a function on
every rank of the active mesh and returns worker-side values at once; ``fetch`` brings
one back as a `palatine.Future`. Names load lazily: workers import
``palatine.client.functions`` by path and must not pay for the whole client.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["local_mesh", "connect", "DeviceMesh", "Stream", "remote", "fetch", "inspect", "RemoteValue"]

_WHERE = {
    "local_mesh": "palatine.client.local",
    "connect": "palatine.client.local",
    "DeviceMesh": "palatine.client.mesh",
    "Stream": "palatine.client.mesh",
    "remote": "palatine.client.remote",
    "fetch": "palatine.client.remote",
    "inspect": "palatine.client.remote",
    "RemoteValue": "palatine.client.values",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'palatine.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
