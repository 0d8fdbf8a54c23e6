"""`ProcMesh`: the procs of one world over named dimensions, and what is spawned on them.

A proc mesh spawns actor meshes on its procs (`ProcMesh.spawn`; the caller owns them and
hears of their failures), tells its owner when a proc dies, respawns dead procs with
their actors (`ProcMesh.respawn`), sets where its output goes (`logging_option`) and
stops its world. `palatine.job.hostmesh` (this machine) and `palatine.job.jobhosts` (a
job's hosts) make them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import cloudpickle

from palatine import config
from palatine.core import runtime
from palatine.core.actor import (
    Actor,
    Context,
    SupervisionEvent,
    _current_cx,
    actor_type_name,
    endpoint,
)
from palatine.core.future import Future
from palatine.core.sender import caller_mailbox, caller_supervision_port
from palatine.core.shape import Extent
from palatine.errors import PalatineError, SpawnError
from palatine.hosting.output import watch_output
from palatine.ids import GangId, ProcId, WorldId
from palatine.job.engine import spawn_tensor_engine
from palatine.mesh.actor_mesh import ActorMesh
from palatine.protocol.agent import Spawn, Spawned
from palatine.system.service import SystemClient
from palatine.wire.codec import dumps

__all__ = ["ProcMesh"]

A = TypeVar("A", bound=Actor)  # the class of the actors a spawn makes

log = logging.getLogger(__name__)


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
        # The actors that set the procs' logging level, and the level set (`logging_option`).
        self._log_levels: list[ActorMesh] = []
        self._log_level: list[int] = []
        self._engine: Any = None  # the DeviceMesh `activate` made (`spawn_tensor_engine`)

    def __reduce__(self) -> tuple[Any, ...]:
        """A proc mesh travels as its world and dimensions: an actor that receives one
        spawns on it (from its own mailbox); stopping stays with the owner."""
        return (_travelled, (self.world, self._dims, self._ranks))

    def slice(self, **sel: int | slice) -> ProcMesh:
        """Some of the procs, by dimension (``procs.slice(gpus=0)``,
        ``procs.slice(gpus=slice(0, 2))``): spawning there puts actors on those procs only."""
        ranks = self._ranks if self._ranks is not None else range(len(self))
        keep = Extent.of(self._dims).select(ranks, **sel)
        view = ProcMesh(self._client, self.world, self._dims, None, self._hosts)
        view._ranks = keep
        view._spawned = self._spawned
        view._log_levels = self._log_levels
        view._log_level = self._log_level
        return view

    def ending(self) -> None:
        """Its procs end now (their process exits): not a failure to report."""
        self._stopped = True

    async def watch_procs(self, owner: Context | None, ranks: list[int] | None = None) -> None:
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
        self,
        stream_to_client: bool = True,
        aggregate_window_sec: float | None = None,
        level: int | None = None,
    ) -> None:
        """Where this mesh's output goes: to this process's console (``[mesh0 2] text``,
        identical lines of several procs within ``aggregate_window_sec`` shown once as
        ``[mesh0 0-3] text``; 0: every line at once), or, with ``stream_to_client``
        False, only to the procs' log files (their directory is named once).

        ``level`` (``logging.INFO``, ...; 0 to 255) is the logging level of the procs'
        forwarded output: their Python root logger is set to it (records below it are
        not emitted, neither shown nor written to the log files) and their log records
        from it up are shown here, INFO ones too (the console shows only WARNING and up
        otherwise). palatine's own loggers keep their level. What the procs print is
        not affected. None leaves all of it as it is."""
        client = self._client
        if client is None:
            raise PalatineError(f"{self} was passed here: its owner sets its logging")
        if level is not None:
            if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 255:
                raise ValueError(f"invalid logging level: {level!r} (an int from 0 to 255)")
            self._set_log_level(level)
        window = aggregate_window_sec
        shown = self._log_level[0] if self._log_level else None
        runtime.submit(
            lambda: watch_output(
                client.proc,
                client.mailbox,
                self.world.name,
                self._hosts,
                stream=stream_to_client,
                window_s=window,
                level=shown,
            )
        ).get(config.get().rpc_timeout_s + 5)

    def _set_log_level(self, level: int) -> None:
        """Set the root logger's level in every proc of the world (`logging_option`)."""
        holder = self._log_levels
        timeout = config.get().rpc_timeout_s + 5
        if not holder:
            procs = [self.world.proc(r) for r in range(len(self))]
            owner = _current_cx.get()
            runtime.submit(
                lambda: spawn_on(procs, self._dims, _LOG_LEVEL_ACTOR, _LogLevel, (), {}, owner)
            ).get(timeout)
            holder.append(ActorMesh(GangId(self.world, _LOG_LEVEL_ACTOR), self._dims, None))
        holder[0].set_level.call(level).get(timeout)
        self._log_level[:] = [level]

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._dims)

    def __len__(self) -> int:
        return math.prod(s for _, s in self._dims)

    def __repr__(self) -> str:
        sel = "" if self._ranks is None else f", ranks={self._ranks}"
        return f"ProcMesh({self.world}, {dict(self._dims)}{sel})"

    def spawn(self, name: str, cls: type[A], *args: Any, **kwargs: Any) -> ActorMesh[A]:
        """Spawn ``cls(*args, **kwargs)`` as ``name`` on every proc; an `ActorMesh` of them.

        The caller owns the mesh: when one of its actors fails, the proc serves on and
        the failure (a `palatine.errors.MeshFailure`) goes to the calling actor's
        ``__supervise__``, or, from a script, to the unhandled-fault hook
        (`palatine.set_unhandled_fault_hook`; by default an ERROR line naming it)."""
        if self._stopped:
            raise SpawnError(f"cannot spawn {name} on {self}: it was stopped")
        owner = _current_cx.get()
        # Pickled here, on the caller's thread: a mesh tensor among the arguments waits
        # for the ops before it (`palatine.job.engine`), which the loop thread cannot.
        params, _ = dumps((args, kwargs))
        mesh = runtime.submit(
            lambda: self._spawn(name, cls, args, kwargs, owner, None, params)
        ).get()
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
        engine = self._live_engine()
        if engine is not None:
            # Its tensor engine's workers live in these procs too: the engine's recovery
            # respawns them and, through `respawned`, this mesh's actors.
            return runtime.submit(lambda: self._recover_engine(engine, ranks))
        return runtime.submit(lambda: self._respawn(client, ranks))

    async def _recover_engine(self, engine: Any, ranks: list[int] | None) -> list[int]:
        recovery = await asyncio.to_thread(engine.recover, ranks)
        return list(recovery.ranks)

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
        await self._respawned(client, ranks)
        return sorted(ranks)

    def respawned(self, ranks: list[int]) -> None:
        """Procs ``ranks`` of this mesh were started again by someone else (its tensor
        engine's recovery, `palatine.job.engine`): wait until they are live and spawn on
        them, as `respawn` does, every actor spawned here before."""
        client = self._client
        if client is None:
            raise PalatineError(f"{self} was passed here: its actors are its owner's")
        # (each of its waits is bounded by the spawn timeout: this one too, with room)
        runtime.submit(lambda: self._respawned(client, ranks)).get(
            2 * config.get().spawn_procs_timeout_s
        )

    async def _respawned(self, client: SystemClient, ranks: list[int]) -> None:
        for r in ranks:
            client.proc.peer_back(self.world.proc(r))
        await wait_live(client, self.world, lambda pid: "")
        await self.watch_procs(self._owner, ranks)
        for name, cls, args, kwargs, owner, spawned_on in list(self._spawned):
            on = [r for r in ranks if spawned_on is None or r in spawned_on]
            if on:
                await self._spawn(name, cls, args, kwargs, owner, on)

    async def _spawn(
        self,
        name: str,
        cls: type[A],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        owner: Context | None = None,
        only: list[int] | None = None,
        params: bytes | None = None,
    ) -> ActorMesh[A]:
        ranks = self._ranks if self._ranks is not None else list(range(len(self)))
        if only is not None:
            ranks = only
        await spawn_on(
            [self.world.proc(r) for r in ranks], self._dims, name, cls, args, kwargs, owner, params
        )
        return ActorMesh(GangId(self.world, name), self._dims, self._ranks, cls)

    def activate(self) -> Any:
        """``with procs.activate():`` torch ops make mesh tensors in these procs, beside
        their actors: the tensor engine of this proc mesh (`spawn_tensor_engine`, made on
        first use and ended with the mesh), activated."""
        engine = self._live_engine()
        if engine is None:
            engine = self._engine = spawn_tensor_engine(self)
        return engine.activate()

    def _live_engine(self) -> Any:
        """This mesh's tensor engine, unless there is none or it was shut down (then it
        is forgotten: `activate` makes a new one, `respawn` restarts the procs alone)."""
        engine = self._engine
        if engine is not None and engine.session.closed:
            self._engine = engine = None
        return engine

    def stop(self) -> Future[None]:
        """Stop the world's procs (and its tensor engine, if it has one); a Future that
        completes when the world is gone."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
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
            except Exception as e:  # noqa: BLE001 - a system that cannot answer has no world to wait for
                log.debug("waiting for %s to end: %s", self.world, e)
                break
            if state.state is None:
                break
            await asyncio.sleep(0.02)
        await release()


async def spawn_on(
    procs: list[ProcId],
    dims: list[tuple[str, int]],
    name: str,
    cls: type[Actor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    owner: Context | None,
    params: bytes | None = None,
) -> None:
    """Spawn ``cls(*args, **kwargs)`` as root actor ``name`` on each of ``procs`` (their
    agents do), owned by ``owner`` (an actor's context; None: this process's client):
    its failures go there. ``params``: the arguments pickled already. Raises `SpawnError`
    naming the first proc that refused."""
    if params is None:
        params, _ = dumps((args, kwargs))
    # The class itself travels: by reference when the procs can import it, by value
    # when they cannot (``__main__``, a local class, a module cloudpickle was told to
    # ship by value).
    msg = Spawn(
        actor_type=actor_type_name(cls),
        actor_name=name,
        params=params,
        params_encoding="pickle",
        actor_class=cloudpickle.dumps(cls),
        dims=dims,
        supervisor=caller_supervision_port(owner),
    )
    mb = owner.mailbox if owner is not None else caller_mailbox()
    timeout = config.get().spawn_procs_timeout_s
    results = await asyncio.gather(
        *(mb.ask(p.actor("proc"), msg, timeout) for p in procs), return_exceptions=True
    )
    for p, res in zip(procs, results, strict=True):
        if isinstance(res, BaseException):
            raise SpawnError(f"spawning {name} on {p} failed: {res}") from res
        assert isinstance(res, Spawned)


_LOG_LEVEL_ACTOR = "palatine_log_level"


class _LogLevel(Actor):
    """Sets its proc's Python logging level (`ProcMesh.logging_option`'s ``level``)."""

    @endpoint
    def set_level(self, level: int) -> None:
        # palatine's own loggers keep the level they have (`Config.log_level`): a program
        # that asks for its INFO records does not get the runtime's as well.
        own = logging.getLogger("palatine")
        if own.level == logging.NOTSET:
            own.setLevel(own.getEffectiveLevel())
        logging.getLogger().setLevel(level)


def _travelled(world: WorldId, dims: list[tuple[str, int]], ranks: list[int] | None) -> ProcMesh:
    """A proc mesh unpickled in another process (`ProcMesh.__reduce__`)."""
    mesh = ProcMesh(None, world, dims, None)
    mesh._ranks = ranks
    return mesh


async def wait_live(client: SystemClient, world: WorldId, tail_of: Callable[[ProcId], str]) -> None:
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


def per_host_dims(
    per_host: dict[str, int] | None, host_dims: tuple[str, ...] = ("hosts",)
) -> list[tuple[str, int]]:
    """``per_host`` checked, as dimensions: at least one, each an int from 1 to 4096, and
    at most 4096 procs per host in all; none named as one of ``host_dims``, the host
    mesh's own (a job's ``hosts``; `this_host()` has none, so there ``{"hosts": 2,
    "gpus": 3}`` is 6 procs of this machine over those two dimensions, as in Monarch)."""
    per_host = per_host if per_host is not None else {"procs": 1}
    if not per_host:
        raise ValueError("per_host names at least one dimension")
    for dim, n in per_host.items():
        if dim in host_dims:
            raise ValueError(f"per_host cannot name {dim!r}: it is the host mesh's dimension")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4096:
            raise ValueError(f"per_host[{dim!r}] must be an int from 1 to 4096, got {n!r}")
    dims = list(per_host.items())
    if math.prod(n for _, n in dims) > 4096:
        raise ValueError(f"per_host asks for more than 4096 procs per host: {per_host}")
    return dims


async def abandon(
    client: SystemClient, world: WorldId, release: Callable[[], Awaitable[None]]
) -> None:
    try:
        await client.stop([world.name], 1.0)
    except Exception as e:  # noqa: BLE001 - abandoning is best effort: its hosts stop the procs too
        log.debug("abandon %s: %s", world, e)
    await release()
