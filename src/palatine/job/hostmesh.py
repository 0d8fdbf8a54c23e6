"""Local proc meshes: `this_host()` and `HostMesh.spawn_procs`.

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
from typing import Any, TypeVar

from palatine.channel import sockets
from palatine.channel import token as token_mod
from palatine.channel.addr import ChannelAddr, any_addr
from palatine.core import runtime
from palatine.core.actor import Actor, Context, _current_cx
from palatine.core.sender import caller_mailbox, default_client, set_default_client
from palatine.hosting.agent import ProcHandle, bootstrap_proc
from palatine.hosting.child_env import Handoff
from palatine.hosting.forkserver import ForkServer, fork_server_supported
from palatine.hosting.host import HostAgent
from palatine.hosting.limits import check_open_files, this_host_open_files
from palatine.hosting.output import flush_output, watch_output
from palatine.ids import GangId, ProcId, WorldId
from palatine.job.procmesh import ProcMesh, abandon, per_host_dims, spawn_on, wait_live
from palatine.mesh.actor_mesh import ActorMesh
from palatine.output.logs import LogSession
from palatine.system.service import System, SystemClient, SystemHandle

__all__ = ["this_host", "this_proc", "HostMesh", "ThisProc"]

log = logging.getLogger(__name__)

A = TypeVar("A", bound=Actor)  # the class of the actors a spawn makes


class _Cluster:
    """The system this process's `this_host()` meshes live in, plus its attached client
    proc: a private embedded system, or, in a process that is itself a proc of a system
    (an actor's worker spawning procs of its own), that system, with world names
    prefixed by this proc's so they cannot collide with anyone else's."""

    def __init__(
        self,
        system: SystemHandle | None,
        system_addr: ChannelAddr,
        client: SystemClient,
        fork_server: ForkServer | None,
        logs: LogSession,
        prefix: str = "",
    ) -> None:
        self.system = system  # None: not ours (nested in the system of this proc)
        self.system_addr = system_addr
        self.prefix = prefix
        self.client = client
        # The procs' log files; removed at exit unless a proc failed (palatine.output.logs).
        self.logs = logs
        # One fork server for every mesh of this process (palatine.hosting.forkserver).
        self.fork_server = fork_server
        self.hosts: list[ProcHandle] = []
        self.meshes: list[ProcMesh] = []
        self.counter = itertools.count()


_cluster: _Cluster | None = None
CONTROLLER_REGISTRY = "palatine.job.controllers.ControllerRegistry"
_cluster_lock: asyncio.Lock | None = None


async def _get_cluster() -> _Cluster:
    global _cluster, _cluster_lock
    if _cluster is not None:
        return _cluster
    if _cluster_lock is None:
        _cluster_lock = asyncio.Lock()
    async with _cluster_lock:
        if _cluster is None:
            fork_server = None
            if fork_server_supported():
                # Started first: its imports overlap the system's start-up.
                fork_server = ForkServer()
                fork_server.start()
            logs = LogSession.create("procs")
            sockets.sweep()  # what jobs before this one left, where nobody saw them die
            outer = Handoff.from_env()
            if outer.bootstrap_addr and outer.proc_id:  # a proc of a system already
                me = ProcId.parse(outer.proc_id)
                outer_addr = ChannelAddr.parse(outer.bootstrap_addr)  # (handed over as text)
                client = await System(outer_addr).attach()
                _cluster = _Cluster(
                    None,
                    outer_addr,
                    client,
                    fork_server,
                    logs,
                    prefix=f"{me.world.name}_{me.rank}_",
                )
            else:
                token_mod.private_token()
                system = await System.serve(any_addr("unix"))
                # The job's controller registry (`palatine.job.controllers`), by name: it
                # builds on this module.
                await system.proc.spawn_by_type(CONTROLLER_REGISTRY, "controllers", (), {})
                client = await System(system.addr).attach()
                _cluster = _Cluster(system, system.addr, client, fork_server, logs)
            set_default_client(client.client)
            runtime.at_exit(_shutdown)
    return _cluster


async def ensure_cluster() -> None:
    """Make this process's `this_host()` system now (it is made on first use anyway)."""
    await _get_cluster()


async def warm_procs(timeout_s: float) -> bool:
    """Have the fork server import its warm modules (``fork_server_warm``) now, and wait
    for it, at most ``timeout_s``: the procs of the first `spawn_procs` are then forked
    with them loaded, instead of each importing them (a launcher whose every proc imports
    torch: the import once, not once per proc on shared cores). Whether it is warm."""
    cluster = await _get_cluster()
    server = cluster.fork_server
    if server is None or not server.warm_now():
        return server is not None and server.warmed
    return await server.wait_warmed(timeout_s)


async def _shutdown() -> None:
    global _cluster
    c = _cluster
    if c is None:
        return
    _cluster = None
    set_default_client(None)
    for mesh in c.meshes:
        mesh.ending()
    try:
        if c.system is not None:
            await c.system.stop(1.0)
        elif c.meshes:  # nested: stop our worlds in the system we share
            try:
                await c.client.stop([m.world.name for m in c.meshes], 1.0)
            except Exception as e:  # noqa: BLE001 - best effort: the hosts stop the procs too
                log.debug("stopping the nested meshes' worlds: %s", e)
        flush_output(c.client.proc)  # the last lines the procs printed
    finally:
        for h in c.hosts:
            agent = h.agent
            if isinstance(agent, HostAgent):
                agent.children.kill_now()
        if c.system is None:  # nested: our hosts' procs end before the process does
            for h in c.hosts:
                try:
                    await h.shutdown("its owner's proc is stopping", leave=False)
                except Exception as e:  # noqa: BLE001 - best effort at the proc's end
                    log.debug("stopping host %s: %s", h.proc.proc_id, e)
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


class HostMesh:
    """The calling machine as a mesh of one host."""

    def spawn_procs(self, per_host: dict[str, int] | None = None) -> ProcMesh:
        """Start ``per_host`` procs as OS processes; a `ProcMesh` over its dimensions
        (``{"gpus": 4}``, or several: ``{"replicas": 2, "gpus": 4}`` is 8 procs, row-major).
        This machine's mesh has no dimension of its own, so ``hosts`` may be one of them
        (``{"hosts": 2, "gpus": 3}``: 6 procs here, as if on 2 hosts; Monarch's way of
        trying a multi-host program on one machine)."""
        dims = per_host_dims(per_host, host_dims=())
        owner = _current_cx.get()
        return runtime.submit(lambda: _spawn_procs(dims, owner)).get()


async def _spawn_procs(dims: list[tuple[str, int]], owner: Context | None = None) -> ProcMesh:
    n = math.prod(size for _, size in dims)
    cluster = await _get_cluster()
    # The embedded system and this client hold connections to every proc of every mesh.
    total = n + sum(len(m) for m in cluster.meshes)
    check_open_files(this_host_open_files(total), f"{total} procs of this_host()")
    k = next(cluster.counter)
    world = WorldId(f"{cluster.prefix}mesh{k}")
    host = await bootstrap_proc(
        WorldId(f"host{world.name}").proc(0),  # (the host world of W is hostW)
        cluster.system_addr,
        labels={"proc.palatine.dev/role": "host"},
        agent_cls=HostAgent,
        agent_args={"fork_server": cluster.fork_server, "log_dir": str(cluster.logs.path)},
    )
    cluster.hosts.append(host)
    client = cluster.client
    program = f"{sys.executable} -m palatine worker"
    mesh: ProcMesh | None = None

    async def release() -> None:
        agent = host.agent
        if isinstance(agent, HostAgent):
            await agent.kill_children(1.0)
        await host.shutdown("mesh stopped", leave=True)
        if mesh in cluster.meshes:
            cluster.meshes.remove(mesh)

    def tail_of(pid: ProcId) -> str:
        agent = host.agent
        child = agent.children.get(str(pid)) if isinstance(agent, HostAgent) else None
        return "\n" + "\n".join(child.tail[-20:]) if child is not None and child.tail else ""

    try:
        await client.upsert_world(world.name, [n], n, program)
        await wait_live(client, world, tail_of)
        await watch_output(client.proc, client.mailbox, world.name, [host.proc.proc_id])
    except BaseException:
        await abandon(client, world, release)
        raise
    mesh = ProcMesh(client, world, dims, release, [host.proc.proc_id])
    await mesh.watch_procs(owner)
    cluster.meshes.append(mesh)
    return mesh


_host_mesh = HostMesh()


def this_host() -> HostMesh:
    """The `HostMesh` of the calling machine."""
    return _host_mesh


class ThisProc:
    """The caller's own proc (`this_proc`): it spawns actors into itself."""

    def spawn(self, name: str, cls: type[A], *args: Any, **kwargs: Any) -> ActorMesh[A]:
        """Spawn ``cls(*args, **kwargs)`` as ``name`` in the caller's proc (a script's
        client proc, or the calling actor's proc); an `ActorMesh` of that one actor.

        As with `ProcMesh.spawn`, the caller owns it: its failure goes to the calling
        actor's ``__supervise__`` or, from a script, to the unhandled-fault hook. In a
        script it runs on the palatine loop thread: an endpoint that blocks outside
        palatine's own waits holds the script's palatine calls meanwhile."""
        owner = _current_cx.get()
        return runtime.submit(lambda: _spawn_here(name, cls, args, kwargs, owner)).get()

    def __repr__(self) -> str:
        return "this_proc()"


async def _spawn_here(
    name: str,
    cls: type[A],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    owner: Context | None,
) -> ActorMesh[A]:
    if owner is None and default_client() is None:
        await _get_cluster()  # a script's own proc: the client proc of its this_host() system
    proc = (owner.mailbox if owner is not None else caller_mailbox()).actor_id.proc
    await spawn_on([proc], [], name, cls, args, kwargs, owner)
    # A mesh of that one proc, with no dimensions (Monarch's): a point, at the proc's rank.
    return ActorMesh(GangId(proc.world, name), [], [proc.rank], cls)


_this_proc = ThisProc()


def this_proc() -> ThisProc:
    """The caller's own proc (Monarch's ``this_proc()``): from a script, its client
    proc; inside an actor, the actor's proc. ``this_proc().spawn(name, Cls, ...)``."""
    return _this_proc
