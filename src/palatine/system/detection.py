"""Failure detection of the system: heartbeats, silence, exits, connections, returns.

The paths, as a mixin of `SystemRegistry`:

* **silence** — `handle_supervision_update` records arrival times; the health tick
  (`handle_health_tick`) and every query expire procs silent for
  ``supervision_update_timeout_s``; a zombie's later heartbeat is ignored and answered
  with ``ProcStop``;
* **death** — a host's `ProcExited` gives ``Exited`` with code or signal; a rank that
  dies before it joins gets a record of its own;
* **connection** — `handle_connection_lost` waits ``exit_report_grace_s`` for a host's
  report, then probes; a refused probe gives ``ConnectionFailure``;
* **failed actors** and **returned messages**.

`_declare` is the one place a health failure takes effect: resolvers get `PeerGone`,
subscribers get `ProcFailed` (once per incarnation), the world is re-evaluated, and a
failed ``ManagingSystem`` proc shuts the system down. Expected exits (procs told to
stop, worlds being stopped or evicted) are not failures.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from palatine.ids import ActorId, PortId, ProcId
from palatine.protocol.agent import ProcStop
from palatine.protocol.supervision import (
    ALIVE,
    CONNECTION_FAILURE,
    EXITED,
    EXPIRED,
    Health,
    ProcRecord,
    clock_text,
    expiry_reason,
)
from palatine.protocol.system import Ok, ProcExited, SupervisionUpdate
from palatine.system.instructions import (
    ExitReportGrace,
    Instruction,
    Log,
    Probe,
    ProbeAgain,
    ProbeOutcome,
    Send,
    Timer,
)
from palatine.system.state import RegistryState, Result, agent_of
from palatine.system.worlds import (
    ACTIVE,
)

__all__ = ["PROBE_AGAIN_S", "DetectionMixin"]

#: How long after a probe that found a lost connection's address answering it is probed
#: once more (`ProbeAgain`): a dying process has released everything well before.
PROBE_AGAIN_S = 0.1


def _proc_of(dest: Any) -> ProcId | None:
    if isinstance(dest, PortId):
        return dest.actor.proc
    if isinstance(dest, ActorId):
        return dest.proc
    if isinstance(dest, ProcId):
        return dest
    return None


class DetectionMixin(RegistryState):
    """The failure-detection half of `SystemRegistry` (see the module docstring)."""

    def handle_supervision_update(
        self, msg: SupervisionUpdate, arrived_at: float | None = None
    ) -> Result:
        """A heartbeat or failure report (one-way: the reply is always ``None``).

        ``arrived_at`` is when the mailbox server received it (system clock); a backlog
        in the SystemActor therefore never causes a false expiry.
        """
        out: list[Instruction] = []
        state = msg.state
        pid = state.proc_id
        now = self._clock() if arrived_at is None else arrived_at
        rec = self._records.get(pid)
        if rec is None:
            self._tell_unknown(pid, "unknown to the system", now, out)
            return None, out
        if rec.kind == "detached":
            return None, out
        if state.incarnation and rec.incarnation and state.incarnation != rec.incarnation:
            self._tell_unknown(
                pid, f"unknown to the system: {pid} has joined again since", now, out
            )
            return None, out
        if not rec.alive:
            # Sticky health: a zombie's heartbeat is ignored and the zombie told to stop.
            if state.failed_actors:
                rec.add_failed_actors(state.failed_actors)
            told = rec.zombie_told_at
            if told is None or now - told >= self.unknown_proc_stop_interval_s:
                rec.zombie_told_at = now
                at = clock_text(rec.declared_wall) if rec.declared_wall is not None else "?"
                reason = f"declared {rec.health} at {at}: {rec.reason}"
                out.append(
                    Send(agent_of(pid), ProcStop(timeout_s=self.proc_stop_timeout_s, reason=reason))
                )
            return None, out
        lh = rec.last_heartbeat
        if lh is None or now > lh:
            rec.last_heartbeat = now
        rec.loop_lag_s = state.loop_lag_s
        if state.failed_actors and rec.add_failed_actors(state.failed_actors):
            self._actor_failed(rec, out)
        return None, out

    def _tell_unknown(self, pid: ProcId, reason: str, now: float, out: list[Instruction]) -> None:
        told = self._unknown_told.get(pid)
        if told is not None and now - told < self.unknown_proc_stop_interval_s:
            return
        self._unknown_told[pid] = now
        out.append(
            Log(logging.WARNING, f"heartbeat from {pid}, which is {reason}; telling it to stop")
        )
        out.append(Send(agent_of(pid), ProcStop(timeout_s=self.proc_stop_timeout_s, reason=reason)))

    def _actor_failed(self, rec: ProcRecord, out: list[Instruction]) -> None:
        now = self._clock()
        first = rec.failed_at is None
        if first:
            rec.failed_at = now
            rec.declared_wall = self._wall()
        out.append(Log(logging.WARNING, rec.describe()))
        if self._expected(rec) or not first:
            return
        world = self._world_of(rec)
        if rec.kind == "proc" and world is not None:
            world.failed.add(rec.proc_id.rank)
        self._report(rec, out)
        if rec.kind == "proc" and world is not None:
            self._evaluate(world, now, out)
        if rec.kind == "managing":
            self._managing_failed(rec, out)

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
        """First health failure of an Alive record: the one place failures take effect."""
        now = self._clock()
        if health == EXITED:
            rec.set_exit(exit_code, exit_signal, reason, stderr_tail)
        else:
            rec.health = health
            rec.reason = reason
        rec.checking = False
        if rec.failed_at is None:
            rec.failed_at = now
        rec.declared_wall = self._wall()
        out.append(Log(logging.WARNING, rec.describe()))
        self._peer_gone(rec, out)
        self._drop_subscriptions_of(rec.proc_id)
        world = self._world_of(rec)
        if rec.kind == "proc" and world is not None:
            world.failed.add(rec.proc_id.rank)
        self._report(rec, out)
        if rec.kind == "proc" and world is not None:
            self._evaluate(world, now, out)
        if rec.kind == "managing":
            self._managing_failed(rec, out)

    def _managing_failed(self, rec: ProcRecord, out: list[Instruction]) -> None:
        if not self._shutting_down:
            self._begin_shutdown(
                self.proc_stop_timeout_s, f"ManagingSystem proc failed: {rec.describe()}", out
            )

    def _expire(self, now: float, out: list[Instruction]) -> None:
        """Silence path: Alive supervised procs past the timeout become ``Expired``."""
        limit = self.supervision_update_timeout_s
        expired = [
            rec
            for rec in self._records.values()
            if rec.health == ALIVE
            and rec.kind != "detached"
            and rec.last_heartbeat is not None
            and now - rec.last_heartbeat > limit
        ]
        for rec in expired:
            if rec.health != ALIVE or self._records.get(rec.proc_id) is not rec:
                continue
            if self._expected(rec):
                continue
            assert rec.last_heartbeat is not None
            self._declare(rec, EXPIRED, expiry_reason(now - rec.last_heartbeat, limit), out)

    def handle_health_tick(self) -> Result:
        """The periodic health tick (every `health_tick_interval_s`)."""
        out: list[Instruction] = []
        now = self._clock()
        self._expire(now, out)
        for world in list(self._worlds.values()):
            if self._worlds.get(world.name) is not world:
                continue
            self._evaluate(world, now, out)
            if (
                world.phase == ACTIVE
                and world.failing_since is not None
                and now - world.failing_since >= self.world_eviction_timeout_s
            ):
                self._evict(world, now, out)
        if not self._shutting_down:
            for rec in list(self._managing.values()):
                if rec.failed:
                    self._managing_failed(rec, out)
                    break
        if self._unknown_told:
            interval = self.unknown_proc_stop_interval_s
            for pid in [p for p, t in self._unknown_told.items() if now - t >= interval]:
                del self._unknown_told[pid]
        return None, out

    def handle_proc_exited(self, msg: ProcExited, requester: ProcId | None = None) -> Result:
        """A host's exit report: always `Ok`."""
        out: list[Instruction] = []
        pid = msg.proc_id
        rec = self._records.get(pid)
        if rec is None or rec.kind == "detached":
            self._exit_before_join(msg, out)
            return Ok(), out
        if rec.joined and msg.pid and rec.pid and msg.pid != rec.pid:
            out.append(
                Log(
                    logging.DEBUG,
                    f"ignoring exit report of {pid} pid {msg.pid}: it is pid {rec.pid}",
                )
            )
            return Ok(), out
        if rec.alive and not self._expected(rec):
            self._declare(
                rec,
                EXITED,
                msg.reason,
                out,
                exit_code=msg.exit_code,
                exit_signal=msg.exit_signal,
                stderr_tail=msg.stderr_tail,
            )
            return Ok(), out
        # Expected, or more precise information about a proc already declared failed:
        # refine the record without a second report.
        was_alive = rec.alive
        precise = msg.exit_code is not None or msg.exit_signal is not None
        known = rec.exit_code is not None or rec.exit_signal is not None
        if rec.health != EXITED or (precise and not known):
            rec.set_exit(msg.exit_code, msg.exit_signal, msg.reason, msg.stderr_tail)
        elif msg.stderr_tail and not rec.stderr_tail:
            rec.stderr_tail = list(msg.stderr_tail)
        rec.checking = False
        if was_alive:
            rec.left = True
        world = self._world_of(rec)
        if rec.kind == "proc" and world is not None and rec.proc_id.rank in world.failed:
            self._evaluate(world, self._clock(), out)
        self._stop_done(rec, out)
        return Ok(), out

    def _exit_before_join(self, msg: ProcExited, out: list[Instruction]) -> None:
        """A rank that died before it ever joined counts as failed."""
        pid = msg.proc_id
        world = self._worlds.get(pid.world.name)
        if (
            world is None
            or world.size is None
            or world.phase != ACTIVE
            or pid.rank >= world.size
            or pid in self._records
        ):
            out.append(
                Log(logging.DEBUG, f"ignoring exit report of {pid}: no such rank is expected")
            )
            return
        host = self._records.get(msg.host_proc) if msg.host_proc is not None else None
        rec = ProcRecord(
            pid,
            "proc",
            pid=msg.pid,
            host=host.host if host is not None else "",
            host_proc=msg.host_proc,
            joined=False,
        )
        rec.set_exit(msg.exit_code, msg.exit_signal, msg.reason, msg.stderr_tail)
        now = self._clock()
        rec.failed_at = now
        rec.declared_wall = self._wall()
        self._records[pid] = rec
        world.procs[pid.rank] = rec
        world.failed.add(pid.rank)
        out.append(Log(logging.WARNING, f"{rec.describe()} before joining"))
        self._report(rec, out)
        self._evaluate(world, now, out)

    def handle_connection_lost(self, proc_id: ProcId) -> Result:
        """An inbound connection from ``proc_id`` closed without a prior `Leave`.

        Procs with a host wait ``exit_report_grace_s`` for the host's exit report
        (a `Timer`); others are probed at once (a `Probe`).
        """
        out: list[Instruction] = []
        rec = self._records.get(proc_id)
        if rec is None or rec.kind == "detached" or not rec.joined:
            return None, out
        if not rec.alive or rec.left:
            return None, out
        if self._expected(rec):
            self._stop_done(rec, out)
            return None, out
        if rec.checking:
            return None, out
        rec.checking = True
        host = self._records.get(rec.host_proc) if rec.host_proc is not None else None
        if host is not None and host.alive and self.exit_report_grace_s > 0:
            token = ExitReportGrace(proc_id, rec.incarnation)
            out.append(Timer(self.exit_report_grace_s, token))
        else:
            out.append(Probe(proc_id, rec.addr, rec.incarnation, self.liveness_probe_timeout_s))
        return None, out

    def handle_probe_result(self, probe: Probe, outcome: ProbeOutcome) -> Result:
        """Outcome of a liveness `Probe`: refused means ``ConnectionFailure``."""
        out: list[Instruction] = []
        rec = self._records.get(probe.proc_id)
        if rec is None or rec.incarnation != probe.incarnation or rec.addr != probe.addr:
            return None, out
        rec.checking = False
        if not rec.alive:
            return None, out
        if outcome == "connected":
            out.append(
                Log(logging.DEBUG, f"{probe.proc_id}: connection dropped but its address answers")
            )
            if not probe.recheck:  # perhaps a dying process whose listener goes last
                token = ProbeAgain(probe.proc_id, probe.incarnation, probe.addr)
                out.append(Timer(PROBE_AGAIN_S, token))
            return None, out
        host = self._records.get(rec.host_proc) if rec.host_proc is not None else None
        host_lost = host is not None and not host.alive
        if outcome != "refused" and not host_lost:
            return None, out  # no verdict: the silence path decides
        # A timeout while its host is lost is a verdict too: children die with their host.
        if self._expected(rec):
            self._stop_done(rec, out)
            return None, out
        if host is not None and not host.alive:
            on = f" on {host.host}" if host.host else ""
            reason = f"connection lost (its host {host.proc_id}{on} was lost at the same time)"
        else:
            reason = f"connection lost; its address {rec.addr} refuses connections"
        self._declare(rec, CONNECTION_FAILURE, reason, out)
        if rec.kind == "host":
            self._probe_children_of(rec, out)
        return None, out

    def _probe_again(self, token: ProbeAgain, out: list[Instruction]) -> None:
        """The `ProbeAgain` delay has passed: probe that incarnation once more (recheck)."""
        rec = self._records.get(token.proc_id)
        if (
            rec is None
            or rec.incarnation != token.incarnation
            or rec.addr != token.addr
            or not rec.alive
            or rec.checking
        ):
            return
        rec.checking = True
        timeout = self.liveness_probe_timeout_s
        out.append(Probe(rec.proc_id, rec.addr, rec.incarnation, timeout, recheck=True))

    def _probe_children_of(self, host: ProcRecord, out: list[Instruction]) -> None:
        """A lost host took its children with it (parent-death signal): probe each one now.

        Their own connection-lost signals normally arrive too; this makes the verdict
        independent of the order (and of a probe that was inconclusive a moment earlier).
        """
        for child in list(self._records.values()):
            if child.host_proc == host.proc_id and child.alive and not child.checking:
                child.checking = True
                out.append(
                    Probe(
                        child.proc_id, child.addr, child.incarnation, self.liveness_probe_timeout_s
                    )
                )

    def handle_returned(
        self, dest: ActorId | PortId | ProcId, errors: Iterable[str], message: Any = None
    ) -> Result:
        """A message the SystemActor sent came back undeliverable (its undeliverable hook).

        A returned push ends that subscription; ``broken link`` / ``peer gone`` marks
        the destination proc ``ConnectionFailure`` if it was Alive.
        """
        out: list[Instruction] = []
        errors = list(errors)
        if isinstance(dest, PortId):
            for name in list(self._subs):
                subs = self._subs[name]
                if dest in subs:
                    del subs[dest]
                    out.append(
                        Log(logging.INFO, f"subscription of {dest} to {name} ended: push returned")
                    )
                    if not subs:
                        del self._subs[name]
        pid = _proc_of(dest)
        rec = self._records.get(pid) if pid is not None else None
        if rec is None or not rec.supervised or not rec.joined or not rec.alive:
            return None, out
        cause = next((e for e in errors if e.startswith(("broken link", "peer gone"))), None)
        if cause is None:
            return None, out
        if self._expected(rec):
            self._stop_done(rec, out)
            return None, out
        reason = f"connection lost: a message from the system was returned: {cause}"
        self._declare(rec, CONNECTION_FAILURE, reason, out)
        return None, out
