"""palatine: a single-controller distributed runtime for Python and PyTorch.

Layers, each importing only those below it (60-style.md):

    errors, ids, config -> wire -> channel -> mailbox, router -> actor, instance, proc
    -> comm, mesh -> supervision -> system, agent, host -> hostmesh -> controller,
    worker -> client, serve -> cli

Public names are loaded lazily, so ``import palatine`` stays cheap for worker procs.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "endpoint",
    "handler",
    "this_host",
    "context",
    "current_rank",
    "Future",
    "ActorRef",
    "ActorMesh",
    "ValueMesh",
    "System",
    "local_mesh",
    "connect",
    "remote",
    "fetch",
    "inspect",
    "DeviceMesh",
    "RemoteValue",
    "worker_info",
    "set_unhandled_fault_hook",
    "PalatineError",
    "RemoteException",
    "DeviceException",
    "StuckWorkersException",
    "TooManyOpenFiles",
]

_WHERE = {
    "Actor": "palatine.actor",
    "endpoint": "palatine.actor",
    "handler": "palatine.actor",
    "context": "palatine.actor",
    "current_rank": "palatine.actor",
    "this_host": "palatine.hostmesh",
    "Future": "palatine.future",
    "ActorRef": "palatine.mesh",
    "ActorMesh": "palatine.mesh",
    "ValueMesh": "palatine.mesh",
    "System": "palatine.system.service",
    "local_mesh": "palatine.client",
    "connect": "palatine.client",
    "remote": "palatine.client",
    "fetch": "palatine.client",
    "inspect": "palatine.client",
    "DeviceMesh": "palatine.client",
    "RemoteValue": "palatine.client",
    "worker_info": "palatine.worker",
    "set_unhandled_fault_hook": "palatine.supervision_hook",
    "PalatineError": "palatine.errors",
    "RemoteException": "palatine.errors",
    "DeviceException": "palatine.errors",
    "StuckWorkersException": "palatine.errors",
    "TooManyOpenFiles": "palatine.errors",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'palatine' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
