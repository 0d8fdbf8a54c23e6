"""Procs: one actor runtime — routing, local delivery, spawn, client instances, stop.

`Proc.post` is the one way an envelope leaves an actor: local delivery when the
destination proc is this one, else the router's Tx (resolving unknown procs through the
system, holding their messages in order meanwhile). Every failure returns the envelope
to its sender: in-process directly, across procs as an `Undeliverable` message.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from palatine.channel.addr import ChannelAddr
from palatine.core.actor import (
    Actor,
    Context,
    SupervisionEvent,
    _warn_undeliverable,
    actor_type_name,
    lookup_actor_type,
)
from palatine.core.instance import UNDELIVERABLE_TID, ActorInstance
from palatine.core.mailbox import Mailbox, Undeliverable
from palatine.core.router import Router
from palatine.errors import ChannelClosed, PeerGoneError, SpawnError
from palatine.ids import RESERVED_ACTOR_NAMES, UNKNOWN_ACTOR, ActorId, PortId, ProcId
from palatine.wire.codec import Message, encode_message
from palatine.wire.envelope import ENC_MSGPACK, Envelope

__all__ = ["Proc", "ClientInstance", "ActorSnapshot", "PeerGoneNotice", "StopActor", "ActorStopped"]

log = logging.getLogger(__name__)

Resolver = Callable[[ProcId], Awaitable[ChannelAddr]]


class ActorSnapshot(msgspec.Struct, kw_only=True):
    """One ledger entry of `Proc.snapshot`."""

    type_name: str
    status: str
    processed: int
    queued: int
    current_handler: str | None
    processing_since: float | None
    handlers: dict[str, str]
    children: dict[str, ActorSnapshot]


class PeerGoneNotice(Protocol):
    """What a proc learns when the system declares another proc dead.

    The system's ``PeerGone`` message has this shape.
    """

    proc_id: ProcId
    reason: str
    exit_code: int | None
    exit_signal: int | None
    pid: int | None
    host: str


class ClientInstance:
    """A mailbox without a task (status ``client``): send, ask and open ports."""

    def __init__(self, proc: Proc, actor_id: ActorId) -> None:
        self.proc = proc
        self.id = actor_id
        self.mailbox = Mailbox(actor_id, proc)
        self.mailbox.bind_handler(UNDELIVERABLE_TID, self._on_undeliverable, "Undeliverable")
        self.closed = False
        # Set by owners that are shutting down: returns are expected then (DEBUG, not WARNING).
        self.quiet_returns = False

    @property
    def status(self) -> str:
        return "stopped" if self.closed else "client"

    def _on_undeliverable(self, payload: Undeliverable, env: Envelope) -> None:
        self.undeliverable(payload.envelope)

    def undeliverable(self, returned: Envelope) -> None:
        if self.mailbox.answered(returned):
            log.debug("%s: an answered request came back: %s", self.id, returned.errors)
            return
        if not self.mailbox.returned(returned):
            if self.quiet_returns:
                log.debug("%s: returned during shutdown: %s", self.id, returned.errors)
            else:
                _warn_undeliverable(self.id, returned)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.mailbox.close("client closed")
            self.proc.mailboxes.pop(self.id, None)


class StopActor(Message, kw_only=True):
    """Stop root actor ``name`` of this proc (its children first): it handles what it has
    queued (``drain``), and is aborted after ``timeout_s``. The proc and its other actors
    serve on. Sent to the proc's agent (`ActorMesh.stop`); replies `ActorStopped` (also for an actor
    already stopped or never there)."""

    name: str
    timeout_s: float = 10.0
    reason: str = ""


class ActorStopped(Message, kw_only=True):
    """Reply to `StopActor`: the actor's final status (``stopped``, ``failed: ...``), or
    ``absent`` when this proc has no such actor."""

    actor_id: ActorId
    status: str


class Proc:
    """One actor runtime: id, router, served address, actor table."""

    @staticmethod
    def of(cx: Context) -> Proc:
        """The whole proc an actor runs in, for the runtime's own actors (the proc agent,
        the system, tensor workers) that reach its router and actor table. An actor's
        context names only the `ProcLink` part, so the actor layer stays below this one."""
        proc = cx.proc
        if not isinstance(proc, Proc):
            raise TypeError(f"actor {cx.actor_id} runs in a {type(proc).__name__}, not a Proc")
        return proc

    def __init__(
        self,
        proc_id: ProcId,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        from palatine import channel

        self.proc_id = proc_id
        self.loop = loop or asyncio.get_running_loop()
        self.router = Router(channel.dial)
        self.resolver = resolver
        self.addr: ChannelAddr | None = None
        self._rx: Any = None
        self._lanes: dict[
            ActorId, Any
        ] = {}  # the served channel's open lanes (`palatine.fastpath.lane`)
        self.mailboxes: dict[ActorId, Mailbox] = {}
        self.roots: dict[str, ActorInstance] = {}
        self.instances: dict[ActorId, ActorInstance] = {}
        self.clients: dict[ActorId, ClientInstance] = {}
        self._names_used: set[str] = set()
        # actors that ended here: why (a call to one says it), by id
        self._stopped: dict[ActorId, str | None] = {}
        self._resolving: dict[ProcId, list[Envelope]] = {}
        self._watches: dict[ProcId, list[asyncio.Future[PeerGoneNotice]]] = {}
        self.gone: dict[ProcId, PeerGoneNotice] = {}
        self.coordinator: Callable[[SupervisionEvent], None] | None = None
        # What this proc reports with its heartbeats (`palatine.hosting.agent`): messages
        # and bytes delivered to its actors, what its actors add (``counters``: name ->
        # a running total), and what it is busy with (``activity``; a tensor worker's op).
        # Read from the heartbeat thread: plain attribute reads.
        self.delivered = 0
        self.delivered_bytes = 0
        self.counters: dict[str, Callable[[], float]] = {}
        self.activity: Callable[[], str] | None = None
        self.on_peer_lost: Callable[[set[ProcId]], None] | None = None
        #: called on the loop once the proc has rejoined a restarted system: what it
        #: asked of the old one (subscriptions, say) is to be asked again
        self.rejoin_hooks: list[Callable[[], None]] = []
        self.return_sender: ActorId = UNKNOWN_ACTOR
        self.stopping = False

    # ------------------------------------------------------------ serving
    async def serve(self, addr: ChannelAddr, *, ack_every_n: int | None = None) -> ChannelAddr:
        """Serve ``addr`` and start the mailbox server; returns the bound address.

        ``ack_every_n`` overrides how often inbound messages are acknowledged
        (`palatine.channel.base.Rx.acknowledge_every`)."""
        from palatine import channel

        bound, rx = await channel.serve(addr)
        if ack_every_n is not None:
            rx.acknowledge_every(ack_every_n)
        rx.set_handler(self._on_inbound, self._peer_lost)
        lanes = getattr(rx, "lanes", None)
        if lanes is not None:
            self._lanes = lanes
        self.addr = bound
        self._rx = rx
        return bound

    def _on_inbound(self, env: Envelope) -> None:
        if env.dest.actor.proc != self.proc_id:
            self.return_envelope(
                env,
                f"address not routable: {env.dest.actor.proc} is not served at {self.addr} "
                f"(this is {self.proc_id})",
            )
            return
        self._deliver_local(env)

    def _peer_lost(self, procs: set[ProcId]) -> None:
        if self.on_peer_lost is not None:
            self.on_peer_lost(procs)

    # ------------------------------------------------------------ posting
    def post(self, env: Envelope) -> None:
        """Route ``env``: local delivery, router Tx, or resolution; failures return it."""
        dest = env.dest.actor
        if dest.proc == self.proc_id:
            self._deliver_local(env)
            return
        if self._lanes:
            lane = self._lanes.get(dest)
            if lane is not None:  # a reply to a calling thread's lane goes back on it
                error = lane.send_back(env)
                if error is not None:
                    self.return_envelope(env, f"broken link: {error}")
                return
        try:
            tx = self.router.tx_for(dest)
            if tx is None:
                self._route_miss(env)
                return
            tx.post(env, self._tx_returned)
        except ChannelClosed as e:
            self.return_envelope(env, f"broken link: {e}")

    def _tx_returned(self, env: Envelope, reason: str) -> None:
        self.return_envelope(env, f"broken link: {reason}")

    async def address_of(self, dest: ActorId) -> ChannelAddr | None:
        """Where ``dest`` is reached: the routing table's binding, else the resolver's
        answer for its proc (bound for later); None when neither knows it."""
        addr = self.router.lookup(dest)
        if addr is None and self.resolver is not None and dest.proc not in self.gone:
            addr = await self._resolve_and_bind(dest.proc)
        return addr

    async def _resolve_and_bind(self, proc: ProcId) -> ChannelAddr:
        assert self.resolver is not None
        addr = await self.resolver(proc)
        self.router.bind(proc, addr, dynamic=True)
        return addr

    def _route_miss(self, env: Envelope) -> None:
        proc = env.dest.actor.proc
        gone = self.gone.get(proc)
        if gone is not None:
            self.return_envelope(env, f"peer gone: {gone.reason}")
            return
        waiting = self._resolving.get(proc)
        if waiting is not None:
            waiting.append(env)
            return
        if self.resolver is None:
            self.return_envelope(
                env, "address not routable: destination not found in routing table"
            )
            return
        self._resolving[proc] = [env]
        self.loop.create_task(self._resolve(proc))

    async def _resolve(self, proc: ProcId) -> None:
        try:
            await self._resolve_and_bind(proc)
        except Exception as e:  # noqa: BLE001 - any failure returns the held messages
            held = self._resolving.pop(proc, [])
            text = str(e)
            kind = "peer gone" if text.startswith("peer gone") else "address not routable"
            text = text.removeprefix("peer gone: ")
            for env in held:
                self.return_envelope(env, f"{kind}: {text}")
            return
        held = self._resolving.pop(proc, [])
        for env in held:
            self.post(env)

    def _deliver_local(self, env: Envelope) -> None:
        self.delivered += 1
        self.delivered_bytes += len(env.data)
        mb = self.mailboxes.get(env.dest.actor)
        err: str | None
        if mb is None:
            if env.dest.actor in self._stopped:
                failure = self._stopped[env.dest.actor]
                err = f"mailbox error: actor {env.dest.actor} is stopped"
                if failure:
                    err += f": it failed: {failure}"
            else:
                err = f"mailbox error: no actor {env.dest.actor} in {self.proc_id}"
        else:
            err = mb.deliver(env)
            if err is None:
                return
        self.return_envelope(env, err)

    def return_envelope(self, env: Envelope, error: str) -> None:
        """Return ``env`` to its sender with ``error`` appended; never loops."""
        env.returned(error)
        if env.type_id == UNDELIVERABLE_TID:
            # A return to an actor that stopped or is stopping, or to a proc the system
            # removed (its world was stopped, as every job's are at its end), has nobody left
            # to tell: routine.
            routine = (
                self.stopping
                or "peer gone: removed: " in error
                or " is stopped" in error
                or " is stopping" in error
            )
            level = logging.DEBUG if routine else logging.WARNING
            log.log(
                level,
                "%s: dropping an undeliverable that could not be returned: %s",
                self.proc_id,
                error,
            )
            return
        sender = env.sender
        reply_to = env.reply_to
        if reply_to is not None and self._lanes and reply_to.actor in self._lanes:
            # A request that came on a lane: its caller reads that lane, not its mailbox.
            dest = reply_to
        elif sender.proc == self.proc_id:
            self._returned_here(env)
            return
        else:
            dest = PortId(sender, UNDELIVERABLE_TID)
        wrapper = Envelope(
            self.return_sender,
            dest,
            UNDELIVERABLE_TID,
            ENC_MSGPACK,
            encode_message(Undeliverable(env)),
        )
        self.post(wrapper)

    def _returned_here(self, env: Envelope) -> None:
        inst = self.instances.get(env.sender)
        if inst is not None:
            inst.undeliverable(env)
            return
        client = self.clients.get(env.sender)
        if client is not None:
            client.undeliverable(env)
            return
        _warn_undeliverable(self.proc_id, env)

    # ------------------------------------------------------------ spawning
    def _claim_name(self, name: str, internal: bool) -> None:
        if not name.isidentifier():
            raise SpawnError(f"invalid actor name {name!r}: names are identifiers")
        if name in RESERVED_ACTOR_NAMES and not internal:
            raise SpawnError(f"actor name {name!r} is reserved for the runtime")
        if name in self._names_used:
            raise SpawnError(f"an actor named '{name}' already exists in {self.proc_id}")
        self._names_used.add(name)

    async def spawn(
        self,
        name: str,
        cls: type[Actor],
        *args: Any,
        _internal: bool = False,
        _rank: dict[str, int] | None = None,
        **kwargs: Any,
    ) -> ActorId:
        """Spawn root actor ``name`` of ``cls``; returns its id once ``init`` completed."""
        if self.stopping:
            raise SpawnError(f"{self.proc_id} is stopping")
        self._claim_name(name, _internal)
        return await self._start_root(name, functools.partial(cls, *args, **kwargs), _rank)

    async def spawn_instance(
        self, name: str, actor: Actor, *, internal: bool = False, rank: dict[str, int] | None = None
    ) -> ActorId:
        """Spawn an already-constructed actor as root ``name`` (runtime actors)."""
        if self.stopping:
            raise SpawnError(f"{self.proc_id} is stopping")
        self._claim_name(name, internal)
        return await self._start_root(name, actor, rank)

    async def _start_root(
        self, name: str, actor: Actor | Callable[[], Actor], rank: dict[str, int] | None
    ) -> ActorId:
        actor_id = self.proc_id.actor(name)
        inst = ActorInstance(self, actor_id, actor, rank=rank)
        try:
            await self._construct(inst)
        except SpawnError:
            self._names_used.discard(name)
            raise
        self.roots[name] = inst
        try:
            await inst.start()
        except Exception as e:
            self._names_used.discard(name)
            self.roots.pop(name, None)
            self.unregister(inst, stopped=False)
            raise SpawnError(inst.failure or str(e)) from e
        return actor_id

    async def spawn_by_type(
        self,
        type_name: str,
        name: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        cls: type[Actor] | None = None,
        rank: dict[str, int] | None = None,
    ) -> ActorId:
        """Spawn by registered type name, or a class shipped by value."""
        if cls is None:
            cls = lookup_actor_type(type_name)
        if cls is None:
            raise SpawnError(f"actor type '{type_name}' is not registered in {self.proc_id}")
        return await self.spawn(name, cls, *args, _rank=rank, **(kwargs or {}))

    async def spawn_child(
        self, parent: ActorInstance, cls: type[Actor], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ActorId:
        root = parent.root
        pid = root.next_child_pid
        root.next_child_pid += 1
        actor_id = parent.id.proc.actor(root.id.name, pid)
        inst = ActorInstance(
            self, actor_id, functools.partial(cls, *args, **kwargs), parent, parent.rank
        )
        await self._construct(inst)
        parent.children[actor_id] = inst
        try:
            await inst.start()
        except Exception as e:
            parent.children.pop(actor_id, None)
            self.unregister(inst, stopped=False)
            raise SpawnError(inst.failure or str(e)) from e
        return actor_id

    async def _construct(self, inst: ActorInstance) -> None:
        """Register ``inst`` and run its constructor (which may wait on replies to its
        own mailbox: it is registered first); a `SpawnError` naming it if that fails."""
        self._register(inst)
        try:
            await inst.construct()
        except Exception as e:
            self.unregister(inst, stopped=False)
            inst.mailbox.close(f"constructor error: {type(e).__name__}: {e}")
            raise SpawnError(
                f"spawning {inst.id}: constructor error: {type(e).__name__}: {e}"
            ) from e

    def _register(self, inst: ActorInstance) -> None:
        self.instances[inst.id] = inst
        self.mailboxes[inst.id] = inst.mailbox

    def unregister(self, inst: ActorInstance, stopped: bool = True) -> None:
        self.instances.pop(inst.id, None)
        self.mailboxes.pop(inst.id, None)
        if stopped:
            self._stopped[inst.id] = inst.failure
        if (
            inst.parent is None
            and self.roots.get(inst.id.name) is inst
            and inst.terminated is False
        ):
            pass

    def attach(self, name: str) -> ClientInstance:
        """A client instance ``<proc>.<name>[0]``: a mailbox with no task."""
        self._claim_name(name, internal=True)
        client = ClientInstance(self, ActorId(self.proc_id, name, 0))
        self.clients[client.id] = client
        self.mailboxes[client.id] = client.mailbox
        return client

    def instance(self, actor_id: ActorId) -> ActorInstance | None:
        return self.instances.get(actor_id)

    # ------------------------------------------------------------ supervision
    def set_supervision_coordinator(self, fn: Callable[[SupervisionEvent], None] | None) -> None:
        self.coordinator = fn

    def root_failed(self, inst: ActorInstance, event: SupervisionEvent) -> None:
        if self.coordinator is not None:
            self.coordinator(event)
        else:
            from palatine.core.supervision_hook import unhandled_fault

            unhandled_fault(event)

    # ------------------------------------------------------------ peers
    def watch(self, proc_id: ProcId) -> asyncio.Future[PeerGoneNotice]:
        """A future completing with the `PeerGoneNotice` when ``proc_id`` is declared dead."""
        fut: asyncio.Future[PeerGoneNotice] = self.loop.create_future()
        gone = self.gone.get(proc_id)
        if gone is not None:
            fut.set_result(gone)
        else:
            self._watches.setdefault(proc_id, []).append(fut)
        return fut

    def peer_back(self, proc_id: ProcId) -> None:
        """``proc_id`` was started again (a new incarnation): route to it once more (its
        address is resolved afresh) and let `watch` watch the new incarnation."""
        self.gone.pop(proc_id, None)

    def peer_gone(self, notice: PeerGoneNotice) -> None:
        """The system declared a proc dead: close its Tx, drop routes, fail calls, watches."""
        proc = notice.proc_id
        self.gone[proc] = notice
        addr = self.router.binding(proc)
        if addr is not None:
            self.router.unbind(proc)
            tx = self.router.drop_tx(addr)
            if tx is not None:
                self.loop.create_task(self._close_gone_tx(tx, notice))
        exc = peer_gone_error(proc, notice)
        for mb in list(self.mailboxes.values()):
            mb.peer_gone(proc, exc)
        for fut in self._watches.pop(proc, []):
            if not fut.done():
                fut.set_result(notice)

    async def _close_gone_tx(self, tx: Any, notice: PeerGoneNotice) -> None:
        for env in await tx.close(0.0):
            self.return_envelope(env, f"peer gone: {notice.reason}")

    # ------------------------------------------------------------ stop / ledger
    async def stop(
        self, timeout_s: float, skip: ActorId | None = None
    ) -> tuple[list[ActorId], list[ActorId]]:
        """Drain-stop every live root but ``skip``; abort stragglers after ``timeout_s``."""
        roots = [i for i in self.roots.values() if i.id != skip and not i.terminated]
        for inst in roots:
            inst.request_stop("drain", f"{self.proc_id} stopping")
        if roots:
            await asyncio.wait([i.terminal for i in roots], timeout=timeout_s)
        aborted_set: set[ActorId] = set()
        stragglers = [i for i in roots if not i.terminated]
        for inst in stragglers:
            aborted_set.add(inst.id)
            inst.request_stop("abort", f"{self.proc_id} stop timed out")
        if stragglers:
            await asyncio.wait([i.terminal for i in stragglers], timeout=1.0)
        stopped = [i.id for i in roots if i.id not in aborted_set and i.state == "stopped"]
        aborted = [i.id for i in roots if i.id in aborted_set or i.state != "stopped"]
        log.info("%s: proc stopped", self.proc_id)
        return stopped, aborted

    async def close(self) -> None:
        """Stop serving and close every Tx (after `stop`)."""
        self.stopping = True
        for c in list(self.clients.values()):
            c.close()
        if self._rx is not None:
            await self._rx.stop()
            self._rx = None
        for tx in self.router.all_tx():
            await tx.close(0.2)

    def snapshot(self) -> dict[str, ActorSnapshot]:
        """The ledger: each live root with its children."""
        return {str(i.id): _snap(i) for i in self.roots.values() if not i.terminated}


def _snap(inst: ActorInstance) -> ActorSnapshot:
    handlers = {
        str(idx): getattr(port, "type_name", type(port).__name__)
        for idx, port in inst.mailbox.ports.items()
        if idx >= 1 << 63
    }
    return ActorSnapshot(
        type_name=actor_type_name(type(inst.actor)),
        status=inst.status,
        processed=inst.processed,
        queued=len(inst.queue),
        current_handler=inst.current_handler,
        processing_since=(
            time.time() - (inst.loop.time() - inst.processing_since)
            if inst.processing_since is not None and inst.state == "processing"
            else None
        ),
        handlers=handlers,
        children={str(c.id): _snap(c) for c in inst.children.values() if not c.terminated},
    )


def peer_gone_error(proc: ProcId, notice: PeerGoneNotice) -> PeerGoneError:
    """A `PeerGoneError` naming world, rank, host, pid and the cause."""
    where = []
    if notice.pid is not None:
        where.append(f"pid {notice.pid}")
    if notice.host:
        where.append(f"on {notice.host}")
    loc = f" ({' '.join(where)})" if where else ""
    return PeerGoneError(
        f"peer gone: {proc}{loc}: {notice.reason}",
        "proc_failed",
        world=proc.world.name,
        rank=proc.rank,
        host=notice.host,
        pid=notice.pid,
        exit_code=notice.exit_code,
        exit_signal=notice.exit_signal,
    )
