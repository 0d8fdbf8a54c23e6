"""The Python client: local meshes, remote functions, fetch.

``local_mesh`` / ``connect`` give a `DeviceMesh`; ``remote(fn)`` runs a function on
every rank of the active mesh and returns worker-side values at once; ``fetch`` brings
one back as a `palatine.Future`.
"""

from __future__ import annotations

from palatine.tensor.client.collectives import resync
from palatine.tensor.client.local import connect, local_mesh
from palatine.tensor.client.mesh import DeviceMesh, Recovery
from palatine.tensor.client.propagation import remote
from palatine.tensor.client.remote import fetch, inspect
from palatine.tensor.client.session import Stream
from palatine.tensor.client.values import RemoteValue

__all__ = [
    "local_mesh",
    "connect",
    "DeviceMesh",
    "Stream",
    "remote",
    "fetch",
    "inspect",
    "RemoteValue",
    "Recovery",
    "resync",
]
