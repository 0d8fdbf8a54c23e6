"""The Python client: local meshes, remote functions, fetch (40-worker-client.md §2).

``local_mesh`` / ``connect`` give a `DeviceMesh`; ``remote(fn)`` runs a function on
every rank of the active mesh and returns worker-side values at once; ``fetch`` brings
one back as a `palatine.Future`.
"""

from __future__ import annotations

from palatine.client.local import connect, local_mesh
from palatine.client.mesh import DeviceMesh, Stream
from palatine.client.remote import fetch, inspect, remote
from palatine.client.values import RemoteValue

__all__ = ["local_mesh", "connect", "DeviceMesh", "Stream", "remote", "fetch", "inspect", "RemoteValue"]
