"""`LocalJob`: the job form of ``local_mesh``, for code written against `palatine.job`.

``LocalJob(hosts=1, procs_per_host=4)`` has the lifecycle of `SlurmJob` (`apply`,
`state`, `mesh`, `cancel`, ``with``), with every host a process on this machine, so the
same program runs on a laptop and on a cluster by changing one line. `apply` starts the
processes; the client attaches in `mesh` (or a program ``palatine launch`` runs does,
with `client_env`).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Self

from palatine.channel.token import token_env
from palatine.hosting.child_env import Handoff
from palatine.job.jobhosts import JobHosts
from palatine.job.metrics import MetricsEndpoint, metrics_endpoint
from palatine.job.records import announce, job_id_of
from palatine.tensor.client.local import (
    LocalCluster,
    check_shape,
    connect,
    mesh_options,
    start_checked,
)

if TYPE_CHECKING:
    from palatine.tensor.client.mesh import DeviceMesh

__all__ = ["LocalJob"]


class LocalJob:
    """``hosts`` × ``procs_per_host`` worker procs on this machine (``local_mesh`` options
    pass through, checked here: `palatine.tensor.client.local.mesh_options`)."""

    def __init__(self, hosts: int = 1, procs_per_host: int = 4, **options: Any) -> None:
        check_shape(hosts, procs_per_host)
        self.opts = mesh_options("LocalJob", options)  # checked once, here
        self._startup_s = self.opts.local.startup_timeout_s
        self.hosts = hosts
        self.procs_per_host = procs_per_host
        self.job_id: str | None = None
        self._cluster: LocalCluster | None = None
        self._mesh: DeviceMesh | None = None
        self._hosts: JobHosts | None = None

    def apply(self) -> str:
        """Start the processes (the worker world is up when this returns); the job id
        (its record's: ``palatine ps`` lists it, ``--job`` takes it)."""
        if self._cluster is None:
            self._cluster = start_checked(self.hosts, self.procs_per_host, self.opts)
            self.job_id = job_id_of(os.environ | self._cluster.env)
            announce(self.job_id)
        assert self.job_id is not None
        return self.job_id

    @property
    def metrics(self) -> MetricsEndpoint | None:
        """Where the job's system serves its metrics (``metrics_addr=``; None without it,
        or before `apply`), to the scrape token in its log dir's ``metrics-token``."""
        return metrics_endpoint(self._cluster)

    def state(self) -> str:
        """``"Live"`` once applied (starting it if needed)."""
        self.apply()
        return "Live"

    def client_env(self) -> dict[str, str]:
        """What a client program needs to attach with ``palatine.connect()``."""
        self.apply()
        assert self._cluster is not None
        handed = Handoff(
            system_addr=self._cluster.system_addr, worker_world="worker", job_id=self.job_id or ""
        )
        return handed.to_env() | token_env(self._cluster.env["PALATINE_CLUSTER_TOKEN"])

    def mesh(self) -> DeviceMesh:
        """The job's `DeviceMesh` (dims ``host`` and ``proc``)."""
        if self._mesh is None:
            self.apply()
            cluster = self._cluster
            assert cluster is not None
            self._mesh = connect(
                cluster.system_addr,
                "worker",
                timeout_s=self._startup_s,
                _local=cluster,
                _token=cluster.env["PALATINE_CLUSTER_TOKEN"],
            )
        return self._mesh

    def host_mesh(self) -> JobHosts:
        """The job's hosts (``{"hosts": hosts}``) for the actor API."""
        if self._hosts is None:
            self.apply()
            cluster = self._cluster
            assert cluster is not None
            self._hosts = JobHosts(
                cluster.system_addr,
                cluster.env["PALATINE_CLUSTER_TOKEN"],
                "hostworker",
                self.hosts,
                sys.executable,
            )
        return self._hosts

    def cancel(self, *, clean: bool = True) -> None:
        """Stop every process of the job."""
        hosts, self._hosts = self._hosts, None
        if hosts is not None:
            hosts.close()
        mesh, self._mesh = self._mesh, None
        cluster, self._cluster = self._cluster, None
        self.job_id = None
        if mesh is not None:
            mesh.shutdown()  # stops its cluster too
        elif cluster is not None:
            cluster.stop(5.0, clean=clean)

    def __enter__(self) -> Self:
        self.apply()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel(clean=exc[0] is None)
