"""Shared state of the system's sans-IO core, and the helpers every part of it uses.

`RegistryState` holds the tables (records by proc id, worlds by name, managing procs,
subscriptions, resolvers inside the records) and the configuration. The behaviour is
split by concept: joins, worlds and queries in `palatine.system.registry`, the failure
detection paths in `palatine.system.detection`, stop and eviction in
`palatine.system.stopping`; `SystemRegistry` combines them.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable
from typing import Any

from palatine.ids import ActorId, PortId, ProcId
from palatine.protocol.supervision import (
    EXITED,
    Health,
    ProcRecord,
)
from palatine.protocol.system import (
    PeerGone,
    ProcExited,
    ProcFailed,
    RejectCode,
    Rejected,
    StopAck,
    WorldStatusChanged,
    WorldStatusName,
)
from palatine.system.instructions import (
    Instruction,
    Log,
    ProbeAgain,
    Send,
)
from palatine.system.worlds import (
    ACTIVE,
    STOPPING,
    WorldRecord,
    execution_id_from_env,
    served_name,
)

__all__ = ["RegistryState", "Result", "agent_of"]

Result = tuple[Any, list[Instruction]]
"""``(reply or None, instructions)``: what every handler returns."""


def agent_of(proc_id: ProcId) -> ActorId:
    """The proc agent ``P.proc[0]`` that receives the system's messages for ``proc_id``."""
    return ActorId(proc_id, "proc", 0)


class RegistryState(abc.ABC):
    """Tables and settings of the system's core, with the helpers all its parts share.

    Args:
        clock: monotonic seconds; every timeout is measured on it.
        supervision_update_timeout_s: silence after which an Alive proc is ``Expired``.
        world_eviction_timeout_s: how long a world may have a failed proc before eviction.
        execution_id: reported in ``Joined`` and snapshots (default: `execution_id_from_env`).
        health_tick_interval_s: how often the shell must call `handle_health_tick`
            (default ``min(1, supervision_update_timeout_s / 4)``); the registry only
            reports it.
        liveness_probe_timeout_s, exit_report_grace_s, proc_stop_timeout_s,
        stop_fallback_margin_s, rpc_timeout_s: see `palatine.config.Config`.
        unknown_proc_stop_interval_s: at most one ``ProcStop`` per unknown heartbeating
            proc (and per zombie) in this interval.
        wall_clock: wall-clock seconds, only for texts humans read (``declared Expired
            at 12:03:04``) and ``Joined.system_time``.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        supervision_update_timeout_s: float = 20.0,
        world_eviction_timeout_s: float = 10.0,
        *,
        execution_id: str | None = None,
        health_tick_interval_s: float | None = None,
        liveness_probe_timeout_s: float = 1.0,
        exit_report_grace_s: float = 0.5,
        proc_stop_timeout_s: float = 5.0,
        stop_fallback_margin_s: float = 3.0,
        rpc_timeout_s: float = 30.0,
        unknown_proc_stop_interval_s: float = 10.0,
        wall_clock: Callable[[], float] | None = None,
    ) -> None:
        self._clock = clock
        self._wall = wall_clock if wall_clock is not None else time.time
        self.supervision_update_timeout_s = supervision_update_timeout_s
        self.world_eviction_timeout_s = world_eviction_timeout_s
        self.execution_id = execution_id if execution_id else execution_id_from_env()
        self.health_tick_interval_s = (
            health_tick_interval_s
            if health_tick_interval_s is not None
            else min(1.0, supervision_update_timeout_s / 4)
        )
        self.liveness_probe_timeout_s = liveness_probe_timeout_s
        self.exit_report_grace_s = exit_report_grace_s
        self.proc_stop_timeout_s = proc_stop_timeout_s
        self.stop_fallback_margin_s = stop_fallback_margin_s
        self.rpc_timeout_s = rpc_timeout_s
        self.unknown_proc_stop_interval_s = unknown_proc_stop_interval_s

        self._records: dict[ProcId, ProcRecord] = {}
        self._worlds: dict[str, WorldRecord] = {}
        self._managing: dict[ProcId, ProcRecord] = {}
        # world name -> subscriber ports (a dict as an insertion-ordered set)
        self._subs: dict[str, dict[PortId, None]] = {}
        self._unknown_told: dict[ProcId, float] = {}
        self._generation = 0
        self._shutting_down = False
        self._starting_shutdown = False
        self._stopped = False
        self._managing_pending: set[ProcId] = set()
        self._managing_generation = 0

    @property
    def shutting_down(self) -> bool:
        """``Stop{None}`` has begun; joins and upserts are refused."""
        return self._shutting_down

    @property
    def stopped(self) -> bool:
        """`StopSystem` has been issued."""
        return self._stopped

    def record(self, proc_id: ProcId) -> ProcRecord | None:
        """The current record of ``proc_id`` (for the shell's diagnostics and tests)."""
        return self._records.get(proc_id)

    def world(self, name: str) -> WorldRecord | None:
        """The record of world ``name`` (including host-only worlds)."""
        return self._worlds.get(name)

    def subscribers(self, world: str) -> list[PortId]:
        """The ports subscribed to ``world``, in subscription order."""
        return list(self._subs.get(world, ()))

    def _reject(
        self,
        msg: Any,
        requester: ProcId | None,
        code: RejectCode,
        text: str,
        out: list[Instruction],
    ) -> Result:
        who = f" from {requester}" if requester is not None else ""
        out.append(Log(logging.WARNING, f"rejected {type(msg).__name__}{who}: {code}: {text}"))
        return Rejected(code=code, message=text), out

    def _world_for(self, name: str) -> WorldRecord:
        world = self._worlds.get(name)
        if world is None:
            world = self._worlds[name] = WorldRecord(name)
        return world

    def _world_of(self, rec: ProcRecord) -> WorldRecord | None:
        if rec.kind == "proc":
            return self._worlds.get(rec.proc_id.world.name)
        if rec.kind == "host":
            return self._worlds.get(served_name(rec.proc_id.world.name))
        return None

    def _drop_record(self, rec: ProcRecord, out: list[Instruction]) -> None:
        """Remove ``rec`` from every table (its replacement, if any, is added after)."""
        pid = rec.proc_id
        if self._records.get(pid) is rec:
            del self._records[pid]
        if rec.kind == "managing":
            self._managing.pop(pid, None)
            self._managing_pending.discard(pid)
            return
        world = self._world_of(rec)
        if world is None:
            return
        table = world.procs if rec.kind == "proc" else world.hosts
        if table.get(pid.rank) is rec:
            del table[pid.rank]
            if rec.kind == "proc":
                world.failed.discard(pid.rank)
        if rec.kind == "host" and not world.created and not world.hosts:
            del self._worlds[world.name]

    def _push(self, world: str, event: Any, out: list[Instruction]) -> None:
        subs = self._subs.get(world)
        if subs:
            for port in subs:
                out.append(Send(port, event))

    def _drop_subscriptions_of(self, proc_id: ProcId) -> None:
        """The subscriber's proc is gone: end its subscriptions."""
        for name in list(self._subs):
            subs = self._subs[name]
            for port in [p for p in subs if p.actor.proc == proc_id]:
                del subs[port]
            if not subs:
                del self._subs[name]

    def _peer_gone(self, rec: ProcRecord, out: list[Instruction], reason: str = "") -> None:
        """Tell every resolver of ``rec`` that it is gone (once: the set is cleared)."""
        if not rec.resolvers:
            return
        notice = PeerGone(
            proc_id=rec.proc_id,
            health=rec.health if not rec.alive else EXITED,
            reason=rec.reason if not rec.alive else reason,
            exit_code=rec.exit_code,
            exit_signal=rec.exit_signal,
            pid=rec.pid,
            host=rec.host,
        )
        for resolver in sorted(rec.resolvers):
            out.append(Send(agent_of(resolver), notice))
        rec.resolvers = set()

    def _report(self, rec: ProcRecord, out: list[Instruction]) -> None:
        """Push `ProcFailed` once per incarnation (hosts go to ``hostW`` subscribers)."""
        if rec.reported:
            return
        rec.reported = True
        world = rec.proc_id.world
        event = ProcFailed(world=world, rank=rec.proc_id.rank, state=rec.to_state())
        self._push(world.name, event, out)

    def _expected(self, rec: ProcRecord) -> bool:
        """Exits of procs told to stop, or in a world being stopped/evicted, are expected."""
        if rec.stop_sent or rec.left:
            return True
        if rec.kind == "proc":
            world = self._worlds.get(rec.proc_id.world.name)
            return world is not None and world.phase != ACTIVE
        if rec.kind == "host":
            world = self._worlds.get(served_name(rec.proc_id.world.name))
            return world is not None and world.phase == STOPPING
        return False

    def _forget(self, rec: ProcRecord, reason: str, out: list[Instruction]) -> None:
        """Drop ``rec`` for good: resolvers hear `PeerGone`, its subscriptions end."""
        self._peer_gone(rec, out, f"removed: {reason}")
        self._drop_subscriptions_of(rec.proc_id)
        self._drop_record(rec, out)

    def _evaluate(self, world: WorldRecord, now: float, out: list[Instruction]) -> None:
        """Re-derive the world's status and push a change."""
        if world.size is None or world.phase != ACTIVE:
            return
        status: WorldStatusName
        if world.failed:
            first = min(
                (world.procs[r] for r in world.failed),
                key=lambda rec: (rec.failed_at or 0.0, rec.proc_id.rank),
            )
            status, reason, failing = "Unhealthy", first.describe(), True
        else:
            joined = len(world.procs)
            if joined < world.size:
                status, failing = "Unhealthy", False
                reason = f"waiting for procs: {joined}/{world.size} joined"
            else:
                status, reason, failing = "Live", f"all {world.size} procs joined", False
        was_status = world.status
        was_failing = world.failing_since is not None
        if failing and world.failing_since is None:
            world.failing_since = now
        elif not failing:
            world.failing_since = None
        if status == "Unhealthy":
            if was_status != "Unhealthy" or world.since is None:
                world.since = now
        else:
            world.since = None
        world.status = status
        world.reason = reason
        if status != was_status or failing != was_failing:
            out.append(Log(logging.INFO, f"world {world.name} is {status}: {reason}"))
            event = WorldStatusChanged(world=world.world_id, status=status, reason=reason)
            self._push(world.name, event, out)

    # Implemented by the mixins (`DetectionMixin`, `StoppingMixin`); declared here so that
    # every part type-checks on its own.

    @abc.abstractmethod
    def _declare(
        self,
        rec: ProcRecord,
        health: Health,
        reason: str,
        out: list[Instruction],
        *,
        exit_code: int | None = None,
        exit_signal: int | None = None,
        stderr_tail: list[str] | None = None,
    ) -> None:
        """Implemented by the detection / stopping parts of the registry."""

    @abc.abstractmethod
    def _managing_failed(self, rec: ProcRecord, out: list[Instruction]) -> None:
        """Implemented by the detection / stopping parts of the registry."""

    @abc.abstractmethod
    def _expire(self, now: float, out: list[Instruction]) -> None:
        """Implemented by the detection / stopping parts of the registry."""

    @abc.abstractmethod
    def _exit_before_join(self, msg: ProcExited, out: list[Instruction]) -> None:
        """Implemented by the detection / stopping parts of the registry."""

    @abc.abstractmethod
    def _stop_done(self, rec: ProcRecord, out: list[Instruction]) -> None:
        """Implemented by the detection / stopping parts of the registry."""

    @abc.abstractmethod
    def _probe_again(self, token: ProbeAgain, out: list[Instruction]) -> None:
        """Implemented by the detection / stopping parts of the registry."""

    @abc.abstractmethod
    def _begin_shutdown(
        self, proc_timeout_s: float, reason: str, out: list[Instruction]
    ) -> StopAck:
        """Implemented by the detection / stopping parts of the registry."""

    @abc.abstractmethod
    def _evict(self, world: WorldRecord, now: float, out: list[Instruction]) -> None:
        """Implemented by the detection / stopping parts of the registry."""

    @abc.abstractmethod
    def _remove_world(self, world: WorldRecord, out: list[Instruction]) -> None:
        """Implemented by the detection / stopping parts of the registry."""
