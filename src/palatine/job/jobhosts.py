"""`JobHosts`: the hosts of a job (`palatine.job.LocalJob`, `palatine.job.SlurmJob`) as a
host mesh of ``{"hosts": H}`` on which a client spawns proc meshes."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
from typing import Any

from palatine import config
from palatine.channel import token as token_mod
from palatine.channel.addr import ChannelAddr
from palatine.core import runtime
from palatine.core.actor import Context, _current_cx
from palatine.core.sender import set_default_client
from palatine.errors import SpawnError
from palatine.hosting.output import watch_output
from palatine.ids import WorldId
from palatine.job.procmesh import ProcMesh, abandon, per_host_dims, wait_live
from palatine.protocol.agent import StartHost, StopHost
from palatine.system.service import System, SystemClient

__all__ = ["JobHosts"]

log = logging.getLogger(__name__)


class JobHosts:
    """The hosts of a job, one per node (`palatine.job.SlurmJob.host_mesh`,
    `palatine.job.LocalJob.host_mesh`): a host mesh of ``{"hosts": H}``.

    The job's hosts already run (``palatine host`` in host world ``host_world``); for each
    `spawn_procs` every one of them starts, in its own process, a host of a fresh host
    world (`StartHost`), and the world upserted for it gets ``per_host`` procs on every
    node: a `ProcMesh` of dims ``hosts`` and the one ``per_host`` names. This process
    attaches to the job's system on first use, as the client its actor meshes send from.
    """

    def __init__(
        self,
        system_addr: str,
        token: str,
        host_world: str,
        hosts: int,
        python: str,
        names: str = "procs",
    ) -> None:
        self.system_addr = system_addr
        self._token = token
        self.host_world = WorldId(host_world)
        self.hosts = hosts
        self._python = python
        self._program = f"{python} -m palatine worker"
        self._client: SystemClient | None = None
        self._names = names  # the proc meshes' world names: <names><k>
        self._counter = itertools.count()
        self._meshes: list[ProcMesh] = []

    def __reduce__(self) -> tuple[Any, ...]:
        """The job's hosts, usable from another process (an actor spawns proc meshes on
        them): it attaches to the job's system itself, and names its worlds apart."""
        names = f"{self._names}{os.getpid()}x{next(self._counter)}p"
        args = (self.system_addr, self._token, self.host_world.name, self.hosts, self._python)
        return (JobHosts, (*args, names))

    @property
    def sizes(self) -> dict[str, int]:
        return {"hosts": self.hosts}

    def __len__(self) -> int:
        return self.hosts

    def __repr__(self) -> str:
        return f"HostMesh({self.host_world}, hosts={self.hosts})"

    def spawn_procs(self, per_host: dict[str, int] | None = None) -> ProcMesh:
        """Start ``per_host`` procs on every host; a `ProcMesh` of dimensions ``hosts`` and
        those ``per_host`` names (``{"gpus": 4}``, ``{"replicas": 2, "gpus": 2}``)."""
        dims = per_host_dims(per_host)
        owner = _current_cx.get()
        return runtime.submit(lambda: self._spawn_procs(dims, owner)).get()

    async def _attach(self) -> SystemClient:
        if self._client is None:
            token_mod.set_token(self._token)
            self._client = await System(ChannelAddr.parse(self.system_addr)).attach()
            set_default_client(self._client.client)
        return self._client

    async def _spawn_procs(
        self, dims: list[tuple[str, int]], owner: Context | None = None
    ) -> ProcMesh:
        n = math.prod(size for _, size in dims)
        client = await self._attach()
        k = next(self._counter)
        world = WorldId(f"{self._names}{k}")
        host_world = WorldId(f"host{world.name}")
        timeout = config.get().spawn_procs_timeout_s
        agents = [self.host_world.proc(h).actor("proc") for h in range(self.hosts)]
        mesh: ProcMesh | None = None

        async def release() -> None:
            stop = StopHost(host_world=host_world, reason=f"proc mesh {world} stopped")
            await asyncio.gather(
                *(client.mailbox.ask(a, stop, timeout) for a in agents), return_exceptions=True
            )
            if mesh in self._meshes:
                self._meshes.remove(mesh)

        try:
            started = await asyncio.gather(
                *(client.mailbox.ask(a, StartHost(host_world=host_world), timeout) for a in agents),
                return_exceptions=True,
            )
            for agent, res in zip(agents, started, strict=True):
                if isinstance(res, BaseException):
                    raise SpawnError(
                        f"host {agent.proc} could not start a host for {world}: {res}"
                    ) from res
            await client.upsert_world(world.name, [self.hosts * n], n, self._program)
            await wait_live(client, world, lambda pid: "")
            hosts = [host_world.proc(h) for h in range(self.hosts)]
            await watch_output(client.proc, client.mailbox, world.name, hosts)
        except BaseException:
            await abandon(client, world, release)
            raise
        mesh = ProcMesh(client, world, [("hosts", self.hosts), *dims], release, hosts)
        await mesh.watch_procs(owner)
        self._meshes.append(mesh)
        return mesh

    def close(self) -> None:
        """Stop every proc mesh spawned here and detach from the job's system."""
        if self._client is not None:
            runtime.submit(self._close).get(config.get().proc_stop_timeout_s + 30)

    async def _close(self) -> None:
        for mesh in list(self._meshes):
            await mesh._stop()
        client, self._client = self._client, None
        if client is not None:
            set_default_client(None)
            try:
                await client.close()
            except Exception as e:  # noqa: BLE001 - the system may be gone already
                log.debug("detaching from %s: %s", self.system_addr, e)
