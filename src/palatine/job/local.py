"""`LocalJob`: the job form of ``local_mesh``, for code written against `palatine.job`.

``LocalJob(hosts=1, procs_per_host=4)`` has the lifecycle of `SlurmJob` (`apply`,
`state`, `mesh`, `cancel`, ``with``), with every host a process on this machine, so the
same program runs on a laptop and on a cluster by changing one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

from palatine.tensor.client.local import local_mesh

if TYPE_CHECKING:
    from palatine.tensor.client.mesh import DeviceMesh

__all__ = ["LocalJob"]


class LocalJob:
    """``hosts`` × ``procs_per_host`` worker procs on this machine (``local_mesh`` options
    pass through)."""

    def __init__(self, hosts: int = 1, procs_per_host: int = 4, **options: Any) -> None:
        self.hosts = hosts
        self.procs_per_host = procs_per_host
        self.options = options
        self._mesh: DeviceMesh | None = None

    def apply(self) -> str:
        """Start the processes (the mesh is up when this returns); ``"local"``."""
        if self._mesh is None:
            self._mesh = local_mesh(self.hosts, self.procs_per_host, **self.options)
        return "local"

    def state(self) -> str:
        """``"Live"`` once applied (starting it if needed)."""
        self.apply()
        return "Live"

    def mesh(self) -> DeviceMesh:
        """The job's `DeviceMesh` (dims ``host`` and ``proc``)."""
        self.apply()
        assert self._mesh is not None
        return self._mesh

    def cancel(self) -> None:
        """Stop every process of the job."""
        mesh, self._mesh = self._mesh, None
        if mesh is not None:
            mesh.shutdown()

    def __enter__(self) -> Self:
        self.apply()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()
