"""The proc agent ``<proc>.proc[0]`` and `bootstrap_proc`.

Every managed proc runs one: it joins the system (retrying transport failures until
``join_timeout``), becomes the proc's supervision coordinator, heartbeats from a thread,
spawns actors by type name, answers snapshots / stack dumps, applies ``PeerGone`` and
``AddressChanged``, and stops the proc on ``ProcStop``. It never fails on a bad
request: every problem is an error reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from typing import Any

import msgspec

from palatine import config
from palatine.channel.addr import ChannelAddr, any_addr
from palatine.core import runtime
from palatine.core.actor import Actor, SupervisionEvent, handler, lookup_actor_type
from palatine.core.comm import CommActor
from palatine.core.proc import ActorStopped, Proc, StopActor
from palatine.core.shape import Extent
from palatine.errors import (
    CallTimeout,
    DeliveryError,
    JoinError,
    SpawnError,
    SystemRequestError,
    is_refusal,
)
from palatine.ids import RESERVED_ACTOR_NAMES, SYSTEM_ACTOR, SYSTEM_WORLD, ActorId, PortId, ProcId
from palatine.protocol.agent import (
    Addr,
    AgentState,
    AgentStateReply,
    LocalAddr,
    ProcSnapshot,
    ProcSnapshotRequest,
    ProcStop,
    ProcStopResult,
    Spawn,
    Spawned,
    StackDump,
    StackTrace,
)
from palatine.protocol.supervision import ActorFailure, ProcSupervisionState
from palatine.protocol.system import (
    AddressChanged,
    AgentStateName,
    Join,
    Joined,
    Leave,
    PeerGone,
    Resolve,
    SupervisionUpdate,
    UpsertWorld,
)
from palatine.wire.codec import loads

__all__ = ["ProcAgent", "ProcHandle", "bootstrap_proc", "DETACHED", "MANAGED"]

log = logging.getLogger(__name__)

MANAGED = "ManagedBySystem"
DETACHED = "Detached"


class ProcAgent(Actor):
    """``<proc>.proc[0]``: join, heartbeat, spawn by name, stop, snapshot, stacks."""

    __palatine_name__ = "palatine.hosting.agent.ProcAgent"

    def __init__(
        self,
        system_addr: ChannelAddr,
        labels: dict[str, str] | None = None,
        mode: str = MANAGED,
        interval_s: float | None = None,
        join_timeout_s: float | None = None,
        host_proc: ProcId | None = None,
        main_proc: bool = False,
    ) -> None:
        cfg = config.get()
        self.system_addr = system_addr
        self.labels = dict(labels or {})
        self.mode = mode
        self.interval_s = cfg.supervision_update_interval_s if interval_s is None else interval_s
        self.join_timeout_s = join_timeout_s if join_timeout_s is not None else cfg.join_timeout_s
        self.host_proc = host_proc
        self.main_proc = main_proc
        self.state: AgentStateName = "AwaitingJoin"
        self.incarnation = random.getrandbits(63)
        self.joined: Joined | None = None
        self.failed_actors: list[ActorFailure] = []
        self.supervisors: dict[str, PortId] = {}  # root actor -> its mesh owner's port
        self.heartbeat: Any = None
        self.stopped = asyncio.Event()
        self.stop_reason = ""
        self._last_tick = time.monotonic()
        self._tick_task: asyncio.Task[None] | None = None
        self._rejoining: asyncio.Task[None] | None = None
        #: the spec of the world this proc brings to a restarted system when it rejoins
        #: (`Join.world`): a host's served world, or a world the proc's owner upserted
        #: for it alone (the controller's)
        self.world_spec: UpsertWorld | None = None
        #: why a restarted system refused this proc's rejoin (it then stops)
        self.refused: str | None = None
        self.leaving = False  # `leave` has begun
        self.rejoins = 0  # rejoins of a restarted system that succeeded

    # ------------------------------------------------------------ join
    @property
    def proc(self) -> Proc:
        return Proc.of(self.cx)

    async def init(self) -> None:
        proc = self.proc
        proc.set_supervision_coordinator(self._root_failed)
        proc.return_sender = self.cx.actor_id
        await self._join()
        self.state = "Joined"
        self._tick_task = asyncio.get_running_loop().create_task(self._tick())
        # A detached client beats too, though the system does not supervise it: the
        # beats' connection tells it when the system restarted, and it rejoins.
        if self.interval_s > 0:
            self._start_heartbeat()

    def _join_msg(self) -> Join:
        assert self.proc.addr is not None
        return Join(
            proc_id=self.proc.proc_id,
            addr=str(self.proc.addr),
            labels=self.labels,
            mode=self.mode,
            pid=os.getpid(),
            host=socket.gethostname(),
            host_proc=self.host_proc,
            incarnation=self.incarnation,
        )

    async def _join(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.join_timeout_s
        rpc = config.get().rpc_timeout_s
        last = "no answer"
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise JoinError(
                    f"no answer from system at {self.system_addr} within {self.join_timeout_s:g} s"
                    f" ({last})"
                )
            try:
                self.joined = await self.cx.mailbox.ask(
                    SYSTEM_ACTOR, self._join_msg(), min(rpc, left)
                )
                return
            except SystemRequestError as e:
                raise JoinError(e.message) from e
            except (DeliveryError, CallTimeout) as e:
                if is_refusal(str(e)):  # credentials, not weather: retrying cannot help
                    raise JoinError(f"system at {self.system_addr} refused this proc: {e}") from e
                last = str(e)
            await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))

    def _state(self) -> ProcSupervisionState:
        """This proc's heartbeat (built on the heartbeat thread, or the loop)."""
        proc = self.proc
        assert proc.addr is not None
        counters = {
            "messages_delivered": float(proc.delivered),
            "bytes_delivered": float(proc.delivered_bytes),
        }
        activity = ""
        try:
            for name, total in list(proc.counters.items()):
                counters[name] = float(total())
            if proc.activity is not None:
                activity = proc.activity()
        except Exception as e:  # noqa: BLE001 - a report must never stop the heartbeat
            log.debug("%s: heartbeat report: %s", proc.proc_id, e)
        return ProcSupervisionState(
            proc_id=proc.proc_id,
            addr=str(proc.addr),
            pid=os.getpid(),
            incarnation=self.incarnation,
            failed_actors=list(self.failed_actors),
            loop_lag_s=max(0.0, time.monotonic() - self._last_tick - 0.1),
            activity=activity,
            counters=counters,
        )

    def _start_heartbeat(self) -> None:
        from palatine.hosting.heartbeat import HeartbeatThread

        loop = asyncio.get_running_loop()
        if self.system_addr.transport == "local":

            def post() -> None:
                loop.call_soon_threadsafe(self._send_update)

            self.heartbeat = HeartbeatThread(
                self.system_addr,
                sender=self.cx.actor_id,
                post_via_loop=post,
                interval_s=self.interval_s,
                on_system_lost=self._system_lost_threadsafe,
            )
        else:
            self.heartbeat = HeartbeatThread(
                self.system_addr,
                sender=self.cx.actor_id,
                make_update=lambda: SupervisionUpdate(state=self._state()),
                interval_s=self.interval_s,
                on_system_lost=self._system_lost_threadsafe,
                on_reconnected=self._reconnected_threadsafe,
                exit_process=self.main_proc,
                keep_dialing=self.mode == DETACHED,
            )
        self.heartbeat.start()

    def _send_update(self) -> None:
        self.cx.mailbox.tell(SYSTEM_ACTOR, SupervisionUpdate(state=self._state()))

    async def _tick(self) -> None:
        while True:
            self._last_tick = time.monotonic()
            await asyncio.sleep(0.1)

    def _system_lost(self) -> None:
        if self.state == "Stopping":
            return
        if self.mode == DETACHED:  # a client: its session hears of the job's fate otherwise
            return
        log.error("%s: system lost; stopping", self.proc.proc_id)
        asyncio.get_running_loop().create_task(
            self._stop_proc(config.get().proc_stop_timeout_s, "system lost")
        )

    # ------------------------------------------------------------ supervision
    def _root_failed(self, event: SupervisionEvent) -> None:
        owner = self.supervisors.pop(event.actor_id, None)
        if owner is not None:
            # A mesh's actor: its failure is its owner's to handle; the proc serves on.
            event = msgspec.structs.replace(event, host=socket.gethostname(), pid=os.getpid())
            self.cx.mailbox.tell(owner, event)
            return
        self.failed_actors.append(
            ActorFailure(
                actor_id=ActorId.parse(event.actor_id),
                status=event.status,
                message=event.message,
                traceback=event.traceback,
            )
        )
        if self.state == "Joined":
            self._send_update()
            self.proc.loop.call_later(0.2, self._send_update)  # retried once

    # ------------------------------------------------------------ a restarted system
    def _reconnected_threadsafe(self) -> None:
        """From the heartbeat thread: a new connection to the system after one was lost."""
        self.proc.loop.call_soon_threadsafe(self._rejoin_soon)

    def _rejoin_soon(self) -> None:
        if self.state != "Joined" or self.leaving:
            return
        if self._rejoining is not None and not self._rejoining.done():
            return
        self._rejoining = self.proc.loop.create_task(self._rejoin())

    async def _rejoin(self) -> None:
        """Join again with this incarnation: a no-op for a system that never went away,
        and for a restarted one the way it learns of this proc (and, from a host, of
        its world). A refusal stops the proc; then the proc's rejoin hooks run."""
        loop = asyncio.get_running_loop()
        hb = self.heartbeat
        bound = hb.settings.system_loss_timeout_s if hb is not None else self.join_timeout_s
        deadline = loop.time() + bound
        rpc = config.get().rpc_timeout_s
        before = self.joined.execution_id if self.joined is not None else ""
        msg = msgspec.structs.replace(
            self._join_msg(), rejoin=True, execution_id=before, world=self.world_spec
        )
        last = "no answer"
        while self.state == "Joined":
            left = deadline - loop.time()
            if left <= 0:
                log.warning(
                    "%s: no answer to its rejoin from the system at %s (%s)",
                    self.proc.proc_id,
                    self.system_addr,
                    last,
                )
                return
            try:
                joined = await self.cx.mailbox.ask(SYSTEM_ACTOR, msg, min(rpc, left))
            except SystemRequestError as e:
                why = f"the system at {self.system_addr} refused its rejoin: {e.message}"
                if self.mode == DETACHED:  # a client: its session hears of the job's fate
                    log.error("%s: %s", self.proc.proc_id, why)
                    return
                log.error("%s: %s; stopping", self.proc.proc_id, why)
                self.refused = why
                await self._stop_proc(config.get().proc_stop_timeout_s, why)
                return
            except (DeliveryError, CallTimeout) as e:
                last = str(e)
                await asyncio.sleep(min(0.2, max(0.0, left)))
                continue
            self.joined = joined
            self.rejoins += 1
            log.info("%s: joined the system at %s again", self.proc.proc_id, self.system_addr)
            for hook in list(self.proc.rejoin_hooks):
                try:
                    hook()
                except Exception:  # noqa: BLE001 - one hook must not keep the others from running
                    log.exception("%s: a rejoin hook failed", self.proc.proc_id)
            return

    def _system_lost_threadsafe(self) -> None:
        """From the heartbeat thread: handle the system's loss on the loop."""
        self.proc.loop.call_soon_threadsafe(self._system_lost)

    # ------------------------------------------------------------ handlers
    @handler
    def on_agent_state(self, msg: AgentState) -> AgentStateReply:
        return AgentStateReply(
            state=self.state, proc_id=self.proc.proc_id, addr=str(self.proc.addr)
        )

    @handler
    def on_local_addr(self, msg: LocalAddr) -> Addr:
        return Addr(addr=str(self.proc.addr))

    @handler
    async def on_spawn(self, msg: Spawn) -> Spawned:
        proc = self.proc
        cls: type[Actor] | None = None
        if msg.actor_class is not None:
            try:
                cls = loads(msg.actor_class)
            except Exception as e:
                raise SpawnError(f"cannot decode actor class for {msg.actor_type}: {e}") from e
        if cls is None:
            cls = lookup_actor_type(msg.actor_type)
        if cls is None:
            raise SpawnError(f"actor type '{msg.actor_type}' is not registered in {proc.proc_id}")
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        try:
            if msg.params_encoding == "pickle":
                if msg.params:
                    args, kwargs = loads(msg.params)
            else:
                ptype = getattr(cls, "Params", None)
                if ptype is not None:
                    args = (msgspec.msgpack.decode(msg.params, type=ptype),)
        except Exception as e:
            raise SpawnError(f"cannot decode params for {msg.actor_type}: {e}") from e
        rank: dict[str, int] = (
            Extent.of(msg.dims).point(proc.proc_id.rank)
            if msg.dims
            else {"procs": proc.proc_id.rank}
        )
        actor_id = await proc.spawn_by_type(
            msg.actor_type, msg.actor_name, args, kwargs, cls=cls, rank=rank
        )
        if msg.supervisor is not None:
            self.supervisors[str(actor_id)] = msg.supervisor
        return Spawned(actor_id=actor_id, rank=proc.proc_id.rank)

    @handler
    async def on_stop_actor(self, msg: StopActor) -> ActorStopped:
        proc = self.proc
        actor_id = proc.proc_id.actor(msg.name)
        inst = proc.roots.get(msg.name)
        if inst is None or msg.name in RESERVED_ACTOR_NAMES:
            return ActorStopped(actor_id=actor_id, status="absent")
        reason = msg.reason or "stopped by its mesh's owner"
        inst.request_stop("drain", reason)
        try:
            await asyncio.wait_for(asyncio.shield(inst.terminal), msg.timeout_s)
        except TimeoutError:
            inst.request_stop("abort", f"{reason}; not stopped within {msg.timeout_s:g} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(inst.terminal), 1.0)
        return ActorStopped(actor_id=actor_id, status=inst.status)

    @handler
    async def on_proc_stop(self, msg: ProcStop) -> None:
        if msg.incarnation and msg.incarnation != self.incarnation:
            log.info(
                "%s: ignoring a stop meant for another incarnation of this proc (%s)",
                self.proc.proc_id,
                msg.reason,
            )
            return
        if self.mode == DETACHED and msg.reason.startswith("unknown to the system"):
            self._rejoin_soon()  # a client the system lost track of joins it again
            return
        env = self.cx.env
        stopped, aborted = await self._stop_actors(msg.timeout_s, msg.reason)
        if env is not None and env.reply_to is not None:
            self.cx.reply(
                env.reply_to,
                ProcStopResult(proc_id=self.proc.proc_id, stopped=stopped, aborted=aborted),
                env,
            )
        await asyncio.sleep(0.05)  # let the reply flush before the proc goes
        self._finish(msg.reason or "stopped by the system")

    async def _stop_actors(
        self, timeout_s: float, reason: str
    ) -> tuple[list[ActorId], list[ActorId]]:
        self.state = "Stopping"
        if self.heartbeat is not None:
            self.heartbeat.stop(timeout_s=0.0)
        if self.main_proc:
            # What this process started for its actors goes first (the proc meshes an
            # actor spawned with `this_host()`), while the system still hears from us.
            await runtime.run_exit_hooks()
        stopped, aborted = await self.proc.stop(timeout_s, skip=self.cx.actor_id)
        return stopped, aborted

    async def _stop_proc(self, timeout_s: float, reason: str) -> None:
        await self._stop_actors(timeout_s, reason)
        self._finish(reason)

    def _finish(self, reason: str) -> None:
        self.stop_reason = reason
        self.stopped.set()

    async def leave(self, reason: str) -> None:
        """A self-initiated stop: tell the system why first (best effort, ≤ 1 s).

        The heartbeat thread is stopped (and joined, briefly) before the `Leave`, so that
        no beat in flight on its own connection reaches the system after it and is taken
        for an unknown proc's (a warning in the job's log, for an observer that left)."""
        self.leaving = True  # no rejoin from now on (a last beat may meet no record)
        heartbeat = self.heartbeat
        if heartbeat is not None:
            await asyncio.to_thread(heartbeat.stop, 0.5)
        leave = Leave(proc_id=self.proc.proc_id, reason=reason, incarnation=self.incarnation)
        try:
            await self.cx.mailbox.ask(SYSTEM_ACTOR, leave, 1.0)
        except Exception as e:  # noqa: BLE001 - best effort
            log.debug("leave failed: %s", e)

    @handler
    def on_snapshot(self, msg: ProcSnapshotRequest) -> ProcSnapshot:
        from palatine.protocol.system import ActorSnapshot as WireSnapshot

        actors = {
            k: msgspec.convert(msgspec.to_builtins(v), WireSnapshot)
            for k, v in self.proc.snapshot().items()
        }
        return ProcSnapshot(
            proc_id=self.proc.proc_id,
            state=self.state,
            pid=os.getpid(),
            host=socket.gethostname(),
            addr=str(self.proc.addr),
            loop_lag_s=max(0.0, time.monotonic() - self._last_tick - 0.1),
            actors=actors,
        )

    @handler
    async def on_stack_dump(self, msg: StackDump) -> StackTrace:
        return self.own_stacks(msg)

    def own_stacks(self, msg: StackDump) -> StackTrace:
        """The Python stacks of this proc's threads (a `StackDump` aimed at this proc)."""
        from palatine.hosting.stacks import dump_threads

        if msg.target is not None and msg.target != self.proc.proc_id:
            return StackTrace(
                proc_id=msg.target, error=f"{self.proc.proc_id} is not the host of {msg.target}"
            )
        try:
            return StackTrace(
                proc_id=self.proc.proc_id, pid=os.getpid(), method="in-process", text=dump_threads()
            )
        except Exception as e:  # noqa: BLE001 - the handler never raises
            return StackTrace(proc_id=self.proc.proc_id, pid=os.getpid(), error=str(e))

    @handler
    def on_peer_gone(self, msg: PeerGone) -> None:
        self.proc.peer_gone(msg)

    @handler
    def on_address_changed(self, msg: AddressChanged) -> None:
        """``msg.proc_id`` joined again (a new incarnation, perhaps after it was gone):
        route to its new address."""
        proc = self.proc
        proc.peer_back(msg.proc_id)
        old = proc.router.binding(msg.proc_id)
        new = ChannelAddr.parse(msg.addr)
        if old is not None and old != new:
            tx = proc.router.drop_tx(old)
            if tx is not None:

                async def close() -> None:
                    for env in await tx.close(0.0):
                        proc.return_envelope(env, f"broken link: peer restarted at {new}")

                proc.loop.create_task(close())
        proc.router.bind(msg.proc_id, new, dynamic=True)

    def handle_undeliverable(self, returned: Any) -> None:
        log.debug("%s: returned: %s", self.cx.actor_id, returned.errors)

    async def on_stop(self, reason: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop(timeout_s=1.0)
        if self._tick_task is not None:
            self._tick_task.cancel()
        rejoining = self._rejoining
        if rejoining is not None and rejoining is not asyncio.current_task():
            rejoining.cancel()


class ProcHandle:
    """What `bootstrap_proc` returns: the proc, its agent and comm actor, its address."""

    def __init__(self, proc: Proc, agent: ProcAgent, addr: ChannelAddr) -> None:
        self.proc = proc
        self.agent = agent
        self.addr = addr
        self.agent_id = proc.proc_id.actor("proc")
        self.comm_id = proc.proc_id.actor("comm")

    async def wait(self) -> str:
        """Until the agent was told to stop (ProcStop, system lost); returns the reason."""
        await self.agent.stopped.wait()
        return self.agent.stop_reason

    async def shutdown(self, reason: str = "stopped", leave: bool = True) -> None:
        """A self-initiated stop: Leave (best effort), stop actors, close the proc."""
        if leave and self.agent.state == "Joined":
            await self.agent.leave(reason)
        if self.agent.state != "Stopping":
            await self.agent._stop_actors(config.get().proc_stop_timeout_s, reason)
        inst = self.proc.instance(self.agent_id)
        if inst is not None:
            inst.request_stop("drain", reason)
            await asyncio.wait([inst.terminal], timeout=2.0)
        await self.proc.close()


async def bootstrap_proc(
    proc_id: ProcId,
    system_addr: ChannelAddr,
    listen_addr: ChannelAddr | None = None,
    supervision_update_interval_s: float | None = None,
    labels: dict[str, str] | None = None,
    mode: str = MANAGED,
    join_timeout_s: float | None = None,
    host_proc: ProcId | None = None,
    main_proc: bool = False,
    agent_cls: type[ProcAgent] = ProcAgent,
    agent_args: dict[str, Any] | None = None,
) -> ProcHandle:
    """Create, serve and join a proc; raises `JoinError` on failure."""
    sys_addr = system_addr
    proc = Proc(proc_id)
    proc.router.bind(SYSTEM_WORLD, sys_addr)
    listen = any_addr(sys_addr.transport, peer=sys_addr) if listen_addr is None else listen_addr
    try:
        bound = await proc.serve(listen)
    except BaseException:  # (the address taken, say, or a stop): the proc holds its router
        await proc.close()
        raise
    agent = agent_cls(
        sys_addr,
        labels,
        mode,
        supervision_update_interval_s,
        join_timeout_s,
        host_proc,
        main_proc,
        **(agent_args or {}),
    )

    async def resolve(target: ProcId) -> ChannelAddr:
        inst = proc.instance(proc_id.actor("proc"))
        if inst is None:
            raise RuntimeError("proc agent is gone")
        loop = asyncio.get_running_loop()
        rpc = config.get().rpc_timeout_s
        deadline = loop.time() + rpc
        while True:
            try:
                reply = await inst.mailbox.ask(SYSTEM_ACTOR, Resolve(proc_id=target), rpc)
                return ChannelAddr.parse(reply.addr)
            except SystemRequestError as e:
                # A restarted system whose procs are still rejoining: ask again.
                if e.code != "unavailable" or loop.time() >= deadline:
                    raise RuntimeError(e.message) from e
            await asyncio.sleep(0.1)

    proc.resolver = resolve
    try:
        await proc.spawn_instance("proc", agent, internal=True)
        await proc.spawn_instance("comm", CommActor(), internal=True)
    except SpawnError as e:
        await proc.close()
        cause = e.__cause__
        if isinstance(cause, JoinError):
            raise cause from None
        raise JoinError(str(e)) from e
    except BaseException:  # cancelled (a stop during the join): release what we hold
        await proc.close()
        raise
    return ProcHandle(proc, agent, bound)
