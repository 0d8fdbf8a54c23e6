"""Local proc meshes: `this_host()`, `HostMesh.spawn_procs`, `ProcMesh`.

On first use the calling process starts, on its palatine loop, a private embedded
system (a unix path socket in the per-user 0700 directory, a freshly generated cluster
token) and attaches a detached client proc ``user[R]``. Each ``spawn_procs`` creates
world ``mesh<k>`` whose in-process host ``hostmesh<k>[0]`` starts the procs as real OS
processes (``python -m palatine worker``, forked by the process's one fork server,
`palatine.hosting.forkserver`, started with the embedded system), and waits until the world is
Live — a child that exits first fails the call at once with its stderr tail.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import sys
from typing import Any

from palatine import config
from palatine.channel import token as token_mod
from palatine.channel.addr import any_addr
from palatine.core import runtime
from palatine.core.actor import Actor, actor_type_name
from palatine.core.future import Future
from palatine.errors import PalatineError, SpawnError
from palatine.hosting.agent import ProcHandle, bootstrap_proc
from palatine.hosting.forkserver import ForkServer, fork_server_supported
from palatine.hosting.host import HostAgent
from palatine.hosting.limits import check_open_files
from palatine.ids import GangId, WorldId
from palatine.mesh.actor_mesh import ActorMesh, set_default_client
from palatine.output.logs import LogSession
from palatine.protocol.agent import Spawn, Spawned
from palatine.system.service import System, SystemClient, SystemHandle
from palatine.wire.codec import dumps

__all__ = ["this_host", "HostMesh", "ProcMesh"]

log = logging.getLogger(__name__)


class _Cluster:
    """The process's private embedded system plus its attached client proc."""

    def __init__(
        self,
        system: SystemHandle,
        client: SystemClient,
        fork_server: ForkServer | None,
        logs: LogSession,
    ) -> None:
        self.system = system
        self.client = client
        # The procs' log files; removed at exit unless a proc failed (palatine.output.logs).
        self.logs = logs
        # One fork server for every mesh of this process (palatine.hosting.forkserver).
        self.fork_server = fork_server
        self.hosts: list[ProcHandle] = []
        self.meshes: list[ProcMesh] = []
        self.counter = itertools.count()


_cluster: _Cluster | None = None
_cluster_lock: asyncio.Lock | None = None


async def _get_cluster() -> _Cluster:
    global _cluster, _cluster_lock
    if _cluster is not None:
        return _cluster
    if _cluster_lock is None:
        _cluster_lock = asyncio.Lock()
    async with _cluster_lock:
        if _cluster is None:
            token_mod.set_token(token_mod.generate_token())
            fork_server = None
            if fork_server_supported():
                # Started first: its imports overlap the system's start-up.
                fork_server = ForkServer()
                fork_server.start()
            logs = LogSession.create("procs")
            system = await System.serve(any_addr("unix"))
            client = await System(system.addr).attach()
            set_default_client(client.client)
            _cluster = _Cluster(system, client, fork_server, logs)
            runtime.at_exit(_shutdown)
    return _cluster


async def _shutdown() -> None:
    global _cluster
    c = _cluster
    if c is None:
        return
    _cluster = None
    set_default_client(None)
    try:
        await c.system.stop(1.0)
    finally:
        for h in c.hosts:
            agent = h.agent
            if isinstance(agent, HostAgent):
                agent.children.kill_now()
        if c.fork_server is not None:
            await c.fork_server.close(1.0)
        failed = [
            child
            for h in c.hosts
            if isinstance(h.agent, HostAgent)
            for child in h.agent.children.children
            if child.exit is not None and not child.exit.requested and child.exit.exit_code != 0
        ]
        if failed and c.logs.owned:
            log.warning("the logs of this process's procs are kept in %s", c.logs.path)
        c.logs.close(clean=not failed)


class ProcMesh:
    """Procs of one world, with one named dimension (``{"procs": 4}``)."""

    def __init__(
        self, cluster: _Cluster, world: WorldId, dims: list[tuple[str, int]], host: ProcHandle
    ) -> None:
        self._cluster = cluster
        self.world = world
        self._dims = dims
        self._host = host
        self._stopped = False

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._dims)

    def __len__(self) -> int:
        return math.prod(s for _, s in self._dims)

    def __repr__(self) -> str:
        return f"ProcMesh({self.world}, {dict(self._dims)})"

    def spawn(self, name: str, cls: type[Actor], *args: Any, **kwargs: Any) -> ActorMesh:
        """Spawn ``cls(*args, **kwargs)`` as ``name`` on every proc; an `ActorMesh` of them."""
        return runtime.submit(lambda: self._spawn(name, cls, args, kwargs)).get()

    async def _spawn(
        self, name: str, cls: type[Actor], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ActorMesh:
        params, _ = dumps((args, kwargs))
        type_name = actor_type_name(cls)
        actor_class = None
        if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
            actor_class, _ = dumps(cls)
        msg = Spawn(
            actor_type=type_name,
            actor_name=name,
            params=params,
            params_encoding="pickle",
            actor_class=actor_class,
        )
        mb = self._cluster.client.mailbox
        timeout = config.get().spawn_procs_timeout_s
        n = len(self)
        results = await asyncio.gather(
            *(mb.ask(self.world.proc(r).actor("proc"), msg, timeout) for r in range(n)),
            return_exceptions=True,
        )
        for r, res in enumerate(results):
            if isinstance(res, BaseException):
                raise SpawnError(f"spawning {name} on {self.world}[{r}] failed: {res}") from res
            assert isinstance(res, Spawned)
        return ActorMesh(GangId(self.world, name), self._dims, None, cls)

    def stop(self) -> Future[None]:
        """Stop the world's procs; a Future that completes when the world is gone."""
        return runtime.submit(self._stop)

    async def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        client = self._cluster.client
        try:
            await client.stop([self.world.name], config.get().proc_stop_timeout_s)
        except Exception as e:  # noqa: BLE001 - the system may be gone already
            log.debug("stop %s: %s", self.world, e)
        deadline = asyncio.get_running_loop().time() + config.get().proc_stop_timeout_s + 5
        while asyncio.get_running_loop().time() < deadline:
            try:
                state = await client.world_state(self.world.name)
            except Exception:  # noqa: BLE001
                break
            if state.state is None:
                break
            await asyncio.sleep(0.02)
        agent = self._host.agent
        if isinstance(agent, HostAgent):
            await agent.kill_children(1.0)
        await self._host.shutdown("mesh stopped", leave=True)
        if self in self._cluster.meshes:
            self._cluster.meshes.remove(self)


class HostMesh:
    """The calling machine as a mesh of one host."""

    def spawn_procs(self, per_host: dict[str, int] | None = None) -> ProcMesh:
        """Start ``per_host`` procs (one named dimension) as OS processes; a `ProcMesh`."""
        per_host = per_host or {"procs": 1}
        if len(per_host) != 1:
            raise ValueError(f"per_host takes exactly one dimension, got {per_host}")
        ((dim, n),) = per_host.items()
        if n < 1:
            raise ValueError(f"per_host[{dim!r}] must be >= 1, got {n}")
        return runtime.submit(lambda: _spawn_procs(dim, n)).get()


async def _spawn_procs(dim: str, n: int) -> ProcMesh:
    cluster = await _get_cluster()
    # The embedded system and this client hold connections to every proc of every mesh.
    total = n + sum(len(m) for m in cluster.meshes)
    check_open_files(total, f"{total} procs of this_host()")
    k = next(cluster.counter)
    world = WorldId(f"mesh{k}")
    host = await bootstrap_proc(
        WorldId(f"hostmesh{k}").proc(0),
        cluster.system.addr,
        labels={"proc.palatine.dev/role": "host"},
        agent_cls=HostAgent,
        agent_args={"fork_server": cluster.fork_server, "log_dir": str(cluster.logs.path)},
    )
    cluster.hosts.append(host)
    client = cluster.client
    program = f"{sys.executable} -m palatine worker"
    await client.upsert_world(world.name, [n], n, program)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.get().spawn_procs_timeout_s
    while True:
        snap = await client.snapshot([world.name])
        w = snap.worlds.get(world.name)
        if w is not None and w.status == "Live":
            break
        if w is not None:
            dead = [(pid, e) for pid, e in w.procs.items() if e.health != "Alive"]
            if dead:
                pid, e = dead[0]
                tail = ""
                agent = host.agent
                if isinstance(agent, HostAgent):
                    child = agent.children.get(pid)
                    if child is not None and child.tail:
                        tail = "\n" + "\n".join(child.tail[-20:])
                await _abandon(cluster, world, host)
                raise PalatineError(
                    f"proc {pid} failed while starting: {e.reason or e.health}{tail}"
                )
        if loop.time() > deadline:
            await _abandon(cluster, world, host)
            raise PalatineError(
                f"world {world} not Live within {config.get().spawn_procs_timeout_s:g} s: "
                f"{w.status if w else 'unknown'}"
            )
        await asyncio.sleep(0.01)
    mesh = ProcMesh(cluster, world, [(dim, n)], host)
    cluster.meshes.append(mesh)
    return mesh


async def _abandon(cluster: _Cluster, world: WorldId, host: ProcHandle) -> None:
    try:
        await cluster.client.stop([world.name], 1.0)
    except Exception:  # noqa: BLE001
        pass
    agent = host.agent
    if isinstance(agent, HostAgent):
        await agent.kill_children(1.0)
    await host.shutdown("spawn failed", leave=True)


_host_mesh = HostMesh()


def this_host() -> HostMesh:
    """The `HostMesh` of the calling machine."""
    return _host_mesh
