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
import contextlib
import itertools
import logging
import math
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import cloudpickle

from palatine import config
from palatine.channel import token as token_mod
from palatine.channel.addr import any_addr
from palatine.core import runtime
from palatine.core.actor import Actor, Context, SupervisionEvent, _current_cx, actor_type_name
from palatine.core.future import Future
from palatine.core.sender import caller_mailbox, caller_supervision_port, set_default_client
from palatine.core.shape import Extent
from palatine.errors import PalatineError, SpawnError
from palatine.hosting.agent import ProcHandle, bootstrap_proc
from palatine.hosting.child_env import Handoff
from palatine.hosting.forkserver import ForkServer, fork_server_supported
from palatine.hosting.host import HostAgent
from palatine.hosting.limits import check_open_files
from palatine.hosting.output import flush_output, watch_output
from palatine.ids import GangId, ProcId, WorldId
from palatine.mesh.actor_mesh import ActorMesh
from palatine.output.logs import LogSession
from palatine.protocol.agent import Spawn, Spawned, StartHost, StopHost
from palatine.system.service import System, SystemClient, SystemHandle
from palatine.wire.codec import dumps

__all__ = ["this_host", "HostMesh", "JobHosts", "ProcMesh"]

log = logging.getLogger(__name__)


class _Cluster:
    """The system this process's `this_host()` meshes live in, plus its attached client
    proc: a private embedded system, or, in a process that is itself a proc of a system
    (an actor's worker spawning procs of its own), that system, with world names
    prefixed by this proc's so they cannot collide with anyone else's."""

    def __init__(
        self,
        system: SystemHandle | None,
        system_addr: str,
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
            outer = Handoff.from_env()
            if outer.bootstrap_addr and outer.proc_id:  # a proc of a system already
                me = ProcId.parse(outer.proc_id)
                client = await System(outer.bootstrap_addr).attach()
                _cluster = _Cluster(
                    None,
                    outer.bootstrap_addr,
                    client,
                    fork_server,
                    logs,
                    prefix=f"{me.world.name}_{me.rank}_",
                )
            else:
                token_mod.set_token(token_mod.generate_token())
                system = await System.serve(any_addr("unix"))
                # The job's controller registry (`palatine.job.controllers`), by name: it
                # builds on this module.
                await system.proc.spawn_by_type(CONTROLLER_REGISTRY, "controllers", (), {})
                client = await System(system.addr).attach()
                _cluster = _Cluster(system, str(system.addr), client, fork_server, logs)
            set_default_client(client.client)
            runtime.at_exit(_shutdown)
    return _cluster


async def ensure_cluster() -> None:
    """Make this process's `this_host()` system now (it is made on first use anyway)."""
    await _get_cluster()


async def _shutdown() -> None:
    global _cluster
    c = _cluster
    if c is None:
        return
    _cluster = None
    set_default_client(None)
    for mesh in c.meshes:
        mesh._stopped = True  # (their procs end now: not a failure to report)
    try:
        if c.system is not None:
            await c.system.stop(1.0)
        elif c.meshes:  # nested: stop our worlds in the system we share
            with contextlib.suppress(Exception):
                await c.client.stop([m.world.name for m in c.meshes], 1.0)
        flush_output(c.client.proc)  # the last lines the procs printed
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
    """Procs of one world, over named dimensions (``{"procs": 4}``; a job's hosts give
    ``{"hosts": H, "procs": 4}``): spawn actors on all of them, stop them."""

    def __init__(
        self,
        client: SystemClient | None,
        world: WorldId,
        dims: list[tuple[str, int]],
        release: Callable[[], Awaitable[None]] | None,
        hosts: list[ProcId] | None = None,
    ) -> None:
        self._client = client  # None: a copy that travelled (it spawns, its owner stops)
        self.world = world
        self._dims = dims
        self._release = release  # what stopping gives back once the world is gone: its hosts
        self._hosts = hosts or []  # the hosts its procs run on (their output comes from them)
        self._ranks: list[int] | None = None  # a slice's procs (None: all of them)
        self._stopped = False
        # What was spawned here (shared with slices), to spawn again on respawned procs:
        # (name, class, args, kwargs, owner, ranks or None for all)
        self._spawned: list[tuple[str, type[Actor], tuple[Any, ...], dict[str, Any], Any, Any]] = []
        self._owner: Context | None = None  # who is told of dead procs (`_watch_procs`)

    def __reduce__(self) -> tuple[Any, ...]:
        """A proc mesh travels as its world and dimensions: an actor that receives one
        spawns on it (from its own mailbox); stopping stays with the owner."""
        return (_travelled, (self.world, self._dims, self._ranks))

    def slice(self, **sel: int | slice) -> ProcMesh:
        """Some of the procs, by dimension (``procs.slice(gpus=0)``,
        ``procs.slice(gpus=slice(0, 2))``): spawning there puts actors on those procs only."""
        extent = Extent.of(self._dims)
        for k, v in sel.items():
            if k not in extent.labels:
                raise ValueError(f"unknown dimension {k!r}; this mesh has {list(extent.labels)}")
            size = self.sizes[k]
            if isinstance(v, int) and not 0 <= v < size:
                raise IndexError(f"index {v} out of range for dimension {k!r} of size {size}")
        keep = []
        for r in self._ranks if self._ranks is not None else range(len(self)):
            point = extent.point(r)
            if all(
                point[k] in range(self.sizes[k])[v] if isinstance(v, slice) else point[k] == v
                for k, v in sel.items()
            ):
                keep.append(r)
        view = ProcMesh(self._client, self.world, self._dims, None, self._hosts)
        view._ranks = keep
        view._spawned = self._spawned
        return view

    async def _watch_procs(self, owner: Context | None, ranks: list[int] | None = None) -> None:
        """Tell ``owner`` (an actor's ``__supervise__``, or the script's unhandled-fault
        hook) when a proc of this mesh (of ``ranks``) dies, unless the mesh was being
        stopped. Call on the loop, once the procs are up."""
        client = self._client
        assert client is not None
        self._owner = owner
        port = caller_supervision_port(owner)
        procs = [self.world.proc(r) for r in (range(len(self)) if ranks is None else ranks)]
        # The system tells a proc of another's death once it resolved its address.
        await asyncio.gather(
            *(client.proc.address_of(p.actor("proc")) for p in procs), return_exceptions=True
        )
        for proc in procs:

            def died(fut: asyncio.Future[Any], proc: ProcId = proc) -> None:
                if self._stopped or fut.cancelled():
                    return
                notice = fut.result()
                event = SupervisionEvent(
                    actor_id=str(proc),
                    status="failed",
                    message=f"its proc died: {notice.reason}",
                    host=notice.host,
                    pid=notice.pid or 0,
                )
                client.mailbox.tell(port, event)

            client.proc.watch(proc).add_done_callback(died)

    def logging_option(
        self, stream_to_client: bool = True, aggregate_window_sec: float | None = None
    ) -> None:
        """Where this mesh's output goes: to this process's console (``[mesh0 2] text``,
        identical lines of several procs within ``aggregate_window_sec`` shown once as
        ``[mesh0 0-3] text``; 0: every line at once), or, with ``stream_to_client``
        False, only to the procs' log files (their directory is named once)."""
        client = self._client
        if client is None:
            raise PalatineError(f"{self} was passed here: its owner sets its logging")
        window = aggregate_window_sec
        runtime.submit(
            lambda: watch_output(
                client.proc,
                client.mailbox,
                self.world.name,
                self._hosts,
                stream=stream_to_client,
                window_s=window,
            )
        ).get(config.get().rpc_timeout_s + 5)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._dims)

    def __len__(self) -> int:
        return math.prod(s for _, s in self._dims)

    def __repr__(self) -> str:
        sel = "" if self._ranks is None else f", ranks={self._ranks}"
        return f"ProcMesh({self.world}, {dict(self._dims)}{sel})"

    def spawn(self, name: str, cls: type[Actor], *args: Any, **kwargs: Any) -> ActorMesh:
        """Spawn ``cls(*args, **kwargs)`` as ``name`` on every proc; an `ActorMesh` of them.

        The caller owns the mesh: when one of its actors fails, the proc serves on and
        the failure (a `palatine.errors.MeshFailure`) goes to the calling actor's
        ``__supervise__``, or, from a script, to the unhandled-fault hook
        (`palatine.set_unhandled_fault_hook`; by default an ERROR line naming it)."""
        if self._stopped:
            raise SpawnError(f"cannot spawn {name} on {self}: it was stopped")
        owner = _current_cx.get()
        mesh = runtime.submit(lambda: self._spawn(name, cls, args, kwargs, owner)).get()
        self._spawned.append((name, cls, args, kwargs, owner, self._ranks))
        return mesh

    def respawn(self, ranks: list[int] | None = None) -> Future[list[int]]:
        """Start the procs of this mesh that died (or ``ranks``) again, as new
        incarnations on the hosts that ran them, and spawn on them every actor spawned
        here before, from the same constructor arguments (their state starts afresh).
        Calls to the dead incarnation have failed; calls from now on reach the new one.
        A Future of the ranks started again ([] when none had died); it fails, within the
        spawn timeout, when the system refuses or a proc does not come up."""
        client = self._client
        if client is None or self._release is None or self._ranks is not None:
            raise PalatineError(
                f"{self}: only the process that spawned a whole proc mesh respawns it"
            )
        if self._stopped:
            raise SpawnError(f"cannot respawn procs of {self}: it was stopped")
        return runtime.submit(lambda: self._respawn(client, ranks))

    async def _respawn(self, client: SystemClient, ranks: list[int] | None) -> list[int]:
        if ranks is None:
            snap = await client.snapshot([self.world.name])
            w = snap.worlds.get(self.world.name)
            alive = (
                {ProcId.parse(p).rank for p, e in w.procs.items() if e.health == "Alive"}
                if w
                else set()
            )
            ranks = [r for r in range(len(self)) if r not in alive]
        if not ranks:
            return []
        await client.respawn(self.world.name, ranks)
        for r in ranks:
            client.proc.peer_back(self.world.proc(r))
        await _wait_live(client, self.world, lambda pid: "")
        await self._watch_procs(self._owner, ranks)
        for name, cls, args, kwargs, owner, spawned_on in list(self._spawned):
            on = [r for r in ranks if spawned_on is None or r in spawned_on]
            if on:
                await self._spawn(name, cls, args, kwargs, owner, on)
        return sorted(ranks)

    async def _spawn(
        self,
        name: str,
        cls: type[Actor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        owner: Context | None = None,
        only: list[int] | None = None,
    ) -> ActorMesh:
        params, _ = dumps((args, kwargs))
        type_name = actor_type_name(cls)
        # The class itself travels: by reference when the procs can import it, by value
        # when they cannot (``__main__``, a local class, a module cloudpickle was told to
        # ship by value).
        actor_class = cloudpickle.dumps(cls)
        msg = Spawn(
            actor_type=type_name,
            actor_name=name,
            params=params,
            params_encoding="pickle",
            actor_class=actor_class,
            dims=self._dims,
            supervisor=caller_supervision_port(owner),
        )
        mb = owner.mailbox if owner is not None else caller_mailbox()
        timeout = config.get().spawn_procs_timeout_s
        ranks = self._ranks if self._ranks is not None else list(range(len(self)))
        if only is not None:
            ranks = only
        results = await asyncio.gather(
            *(mb.ask(self.world.proc(r).actor("proc"), msg, timeout) for r in ranks),
            return_exceptions=True,
        )
        for r, res in zip(ranks, results, strict=True):
            if isinstance(res, BaseException):
                raise SpawnError(f"spawning {name} on {self.world}[{r}] failed: {res}") from res
            assert isinstance(res, Spawned)
        return ActorMesh(GangId(self.world, name), self._dims, self._ranks, cls)

    def stop(self) -> Future[None]:
        """Stop the world's procs; a Future that completes when the world is gone."""
        return runtime.submit(self._stop)

    async def _stop(self) -> None:
        if self._stopped:
            return
        client, release = self._client, self._release
        if self._ranks is not None:
            raise PalatineError(f"{self} is a slice: stop the proc mesh it was sliced from")
        if client is None or release is None:
            raise PalatineError(
                f"{self} was passed here: only the process that spawned it stops it"
            )
        self._stopped = True
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
        await release()


def _travelled(world: WorldId, dims: list[tuple[str, int]], ranks: list[int] | None) -> ProcMesh:
    """A proc mesh unpickled in another process (`ProcMesh.__reduce__`)."""
    mesh = ProcMesh(None, world, dims, None)
    mesh._ranks = ranks
    return mesh


async def _wait_live(
    client: SystemClient, world: WorldId, tail_of: Callable[[ProcId], str]
) -> None:
    """Wait (bounded by the spawn timeout) until ``world`` is Live; a `PalatineError`
    naming the first proc that failed while starting (with ``tail_of`` it: its output)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.get().spawn_procs_timeout_s
    while True:
        snap = await client.snapshot([world.name])
        w = snap.worlds.get(world.name)
        if w is not None and w.status == "Live":
            return
        if w is not None:
            dead = [(pid, e) for pid, e in w.procs.items() if e.health != "Alive"]
            if dead:
                pid, e = dead[0]
                raise PalatineError(
                    f"proc {pid} failed while starting: {e.reason or e.health}"
                    f"{tail_of(ProcId.parse(pid))}"
                )
        if loop.time() > deadline:
            raise PalatineError(
                f"world {world} not Live within {config.get().spawn_procs_timeout_s:g} s: "
                f"{w.status if w else 'unknown'}"
            )
        await asyncio.sleep(0.01)


class HostMesh:
    """The calling machine as a mesh of one host."""

    def spawn_procs(self, per_host: dict[str, int] | None = None) -> ProcMesh:
        """Start ``per_host`` procs as OS processes; a `ProcMesh` over its dimensions
        (``{"gpus": 4}``, or several: ``{"replicas": 2, "gpus": 4}`` is 8 procs, row-major)."""
        dims = _per_host_dims(per_host)
        owner = _current_cx.get()
        return runtime.submit(lambda: _spawn_procs(dims, owner)).get()


def _per_host_dims(per_host: dict[str, int] | None) -> list[tuple[str, int]]:
    """``per_host`` checked, as dimensions: at least one, each an int from 1 to 4096, and
    at most 4096 procs per host in all; none named ``hosts`` (a host mesh's own)."""
    per_host = per_host if per_host is not None else {"procs": 1}
    if not per_host:
        raise ValueError("per_host names at least one dimension")
    for dim, n in per_host.items():
        if dim == "hosts":
            raise ValueError("per_host cannot name 'hosts': it is the host mesh's dimension")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4096:
            raise ValueError(f"per_host[{dim!r}] must be an int from 1 to 4096, got {n!r}")
    dims = list(per_host.items())
    if math.prod(n for _, n in dims) > 4096:
        raise ValueError(f"per_host asks for more than 4096 procs per host: {per_host}")
    return dims


async def _spawn_procs(dims: list[tuple[str, int]], owner: Context | None = None) -> ProcMesh:
    n = math.prod(size for _, size in dims)
    cluster = await _get_cluster()
    # The embedded system and this client hold connections to every proc of every mesh.
    total = n + sum(len(m) for m in cluster.meshes)
    check_open_files(total, f"{total} procs of this_host()")
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
        await _wait_live(client, world, tail_of)
        await watch_output(client.proc, client.mailbox, world.name, [host.proc.proc_id])
    except BaseException:
        await _abandon(client, world, release)
        raise
    mesh = ProcMesh(client, world, dims, release, [host.proc.proc_id])
    await mesh._watch_procs(owner)
    cluster.meshes.append(mesh)
    return mesh


async def _abandon(
    client: SystemClient, world: WorldId, release: Callable[[], Awaitable[None]]
) -> None:
    try:
        await client.stop([world.name], 1.0)
    except Exception:  # noqa: BLE001
        pass
    await release()


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
        dims = _per_host_dims(per_host)
        owner = _current_cx.get()
        return runtime.submit(lambda: self._spawn_procs(dims, owner)).get()

    async def _attach(self) -> SystemClient:
        if self._client is None:
            token_mod.set_token(self._token)
            self._client = await System(self.system_addr).attach()
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
            await _wait_live(client, world, lambda pid: "")
            hosts = [host_world.proc(h) for h in range(self.hosts)]
            await watch_output(client.proc, client.mailbox, world.name, hosts)
        except BaseException:
            await _abandon(client, world, release)
            raise
        mesh = ProcMesh(client, world, [("hosts", self.hosts), *dims], release, hosts)
        await mesh._watch_procs(owner)
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


_host_mesh = HostMesh()


def this_host() -> HostMesh:
    """The `HostMesh` of the calling machine."""
    return _host_mesh
