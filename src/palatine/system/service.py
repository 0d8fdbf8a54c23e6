"""Serving a system and attaching to one.

``await System.serve(addr)`` creates proc ``system[0]`` with the SystemActor and serves
``addr``. ``await System(addr).attach()`` creates a detached client proc ``user[R]``
(agent plus client instance ``user[R].client[0]``) joined to that system; its helpers
raise `SystemRequestError` or `CallTimeout` and never hang.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from palatine import config
from palatine.channel.addr import ChannelAddr, require_addr
from palatine.core.proc import ClientInstance, Proc
from palatine.hosting.agent import DETACHED, ProcHandle, bootstrap_proc
from palatine.ids import SYSTEM_ACTOR, SYSTEM_PROC, PortId, ProcId, WorldId, random_user_proc
from palatine.protocol.system import (
    Exec,
    Local,
    RespawnProcs,
    Snapshot,
    SnapshotFilter,
    Stop,
    StopAck,
    Subscribe,
    Subscribed,
    SystemSnapshot,
    UpsertWorld,
    WorldState,
    WorldStateReply,
    WorldUpserted,
)
from palatine.system.actor import SystemActor, registry_from_config

__all__ = ["System", "SystemHandle", "SystemClient"]

log = logging.getLogger(__name__)


class SystemHandle:
    """A served system: ``addr``, ``stop()``, ``wait()``."""

    def __init__(self, proc: Proc, actor: SystemActor) -> None:
        self.proc = proc
        self.actor = actor
        assert proc.addr is not None
        self.addr: ChannelAddr = proc.addr

    async def stop(self, proc_timeout_s: float = 5.0) -> None:
        """Stop every world (``Stop{None}``) and wait until the system is done."""
        mb = self.proc.mailboxes.get(SYSTEM_ACTOR)
        if mb is not None:
            try:
                await mb.ask(
                    SYSTEM_ACTOR,
                    Stop(worlds=None, proc_timeout_s=proc_timeout_s),
                    proc_timeout_s + 5,
                )
            except Exception as e:  # noqa: BLE001 - stopping anyway
                log.debug("stop request: %s", e)
        try:
            await asyncio.wait_for(self.wait(), proc_timeout_s + 5)
        except TimeoutError:
            log.warning("system did not finish stopping within %.1f s", proc_timeout_s + 5)
        await self.close()

    async def wait(self) -> str:
        """Until the SystemActor is done; returns why."""
        assert self.actor.done is not None
        return await asyncio.shield(self.actor.done)

    async def close(self) -> None:
        await self.proc.stop(1.0)
        await self.proc.close()


class SystemClient:
    """A detached client proc joined to a system: a mailbox plus request helpers."""

    def __init__(
        self, handle: ProcHandle, client: ClientInstance, system_addr: ChannelAddr
    ) -> None:
        self.handle = handle
        self.proc = handle.proc
        self.client = client
        self.mailbox = client.mailbox
        self.system_addr = system_addr

    async def ask(self, msg: Any, timeout_s: float | None = None) -> Any:
        t = config.get().rpc_timeout_s if timeout_s is None else timeout_s
        return await self.mailbox.ask(SYSTEM_ACTOR, msg, t)

    async def snapshot(
        self,
        worlds: list[str] | None = None,
        world_labels: dict[str, str] | None = None,
        proc_labels: dict[str, str] | None = None,
    ) -> SystemSnapshot:
        flt = SnapshotFilter(
            worlds=[WorldId(w) for w in worlds or []],
            world_labels=world_labels or {},
            proc_labels=proc_labels or {},
        )
        return cast(SystemSnapshot, await self.ask(Snapshot(filter=flt)))

    async def upsert_world(
        self,
        world: str,
        shape: list[int],
        num_procs_per_host: int,
        program: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> WorldUpserted:
        env = Exec(program=program) if program else Local()
        upsert = UpsertWorld(
            world_id=WorldId(world),
            shape=shape,
            num_procs_per_host=num_procs_per_host,
            env=env,
            labels=labels or {},
        )
        return cast(WorldUpserted, await self.ask(upsert))

    async def respawn(self, world: str, ranks: list[int]) -> None:
        """Start failed ``ranks`` of ``world`` again (`RespawnProcs`); raises
        `SystemRequestError` when the system refuses."""
        await self.ask(RespawnProcs(world_id=WorldId(world), ranks=ranks))

    async def stop(self, worlds: list[str] | None = None, proc_timeout_s: float = 5.0) -> StopAck:
        ws = [WorldId(w) for w in worlds] if worlds else None
        return cast(StopAck, await self.ask(Stop(worlds=ws, proc_timeout_s=proc_timeout_s)))

    async def world_state(self, world: str) -> WorldStateReply:
        return cast(WorldStateReply, await self.ask(WorldState(world_id=WorldId(world))))

    async def subscribe(self, world: str, port: PortId) -> Subscribed:
        return cast(Subscribed, await self.ask(Subscribe(world_id=WorldId(world), port=port)))

    async def close(self) -> None:
        """Leave and stop the client proc."""
        await self.handle.shutdown("client closed")


def _public_addr(addr: str | ChannelAddr, who: str) -> ChannelAddr:
    """A public entry point's address: a `ChannelAddr`, or text parsed here once."""
    if isinstance(addr, str):
        try:
            return ChannelAddr.parse(addr)
        except ValueError as e:
            raise ValueError(f"{who}: invalid address {addr!r}: {e}") from None
    require_addr(addr, who)
    return addr


class System:
    """``System.serve(addr)`` to run one; ``System(addr).attach()`` to use one."""

    def __init__(self, addr: str | ChannelAddr) -> None:
        """``addr`` is a `ChannelAddr` or its text (``tcp:HOST:PORT``, ``unix:...``),
        parsed here once: a public entry point. Bad text raises `ValueError` naming it;
        anything else, `TypeError`."""
        self.addr = _public_addr(addr, "System")

    @staticmethod
    async def serve(
        addr: str | ChannelAddr,
        supervision_update_timeout_s: float | None = None,
        world_eviction_timeout_s: float | None = None,
    ) -> SystemHandle:
        """Create ``system[0]`` with the SystemActor and serve ``addr`` (a `ChannelAddr`
        or its text, as for ``System(addr)``)."""
        addr = _public_addr(addr, "System.serve")
        proc = Proc(SYSTEM_PROC)
        # Every request acknowledged at once: a system started again at this address is
        # sent again only what this one never received, not requests it already handled.
        await proc.serve(addr, ack_every_n=1)
        actor = SystemActor(
            registry_from_config(supervision_update_timeout_s, world_eviction_timeout_s)
        )
        await proc.spawn_instance("root", actor, internal=True)
        proc.return_sender = SYSTEM_ACTOR
        return SystemHandle(proc, actor)

    async def attach(
        self, timeout_s: float | None = None, proc_id: ProcId | None = None
    ) -> SystemClient:
        """Join as a detached client proc ``user[R]``; bounded by ``timeout_s``."""
        pid = proc_id or random_user_proc()
        t = config.get().join_timeout_s if timeout_s is None else timeout_s
        handle = await bootstrap_proc(pid, self.addr, mode=DETACHED, join_timeout_s=t)
        client = handle.proc.attach("client")
        return SystemClient(handle, client, self.addr)
