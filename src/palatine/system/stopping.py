"""Stop, eviction and world removal of the system.

A mixin of `SystemRegistry`. A stop or an eviction sends ``ProcStop`` asks (and, for an
eviction, ``KillProcs`` to the hosts), keeps the *stopping set* of the world, and
removes the world when every stop has been answered or has failed, or when the fallback
timer (``proc_timeout + stop_fallback_margin``) fires. Each operation has a
``generation``, so late answers and timers of an earlier one never touch a world
re-created under the same name. ``Stop{None}`` also stops ``ManagingSystem`` procs and
ends with `StopSystem` once no world remains.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from palatine.config import format_seconds
from palatine.ids import ProcId, WorldId
from palatine.protocol.agent import (
    KillProcs,
    ProcStop,
    ProcStopResult,
    SpawnProc,
    SpawnProcResult,
)
from palatine.protocol.supervision import (
    ALIVE,
    EXPIRED,
    ProcRecord,
)
from palatine.protocol.system import ProcExited, Rejected, Stop, StopAck, SystemStopping, WorldGone
from palatine.system.instructions import (
    Ask,
    ExitReportGrace,
    Instruction,
    Log,
    ManagingStopFallback,
    Probe,
    ProbeAgain,
    Send,
    SpawnToken,
    StopFallback,
    StopSystem,
    StopToken,
    Timer,
    Unbind,
)
from palatine.system.state import RegistryState, Result, agent_of
from palatine.system.worlds import (
    ACTIVE,
    EVICTING,
    STOPPING,
    WorldRecord,
)

__all__ = ["StoppingMixin"]


class StoppingMixin(RegistryState):
    """The stop-and-eviction half of `SystemRegistry` (see the module docstring)."""

    def handle_stop(self, msg: Stop, requester: ProcId | None = None) -> Result:
        """`Stop`: `StopAck` at once; completion is tracked after."""
        out: list[Instruction] = []
        t = msg.proc_timeout_s
        if t is None or not (t >= 0 and math.isfinite(t)):
            return self._reject(
                msg,
                requester,
                "invalid_argument",
                f"invalid proc_timeout_s {msg.proc_timeout_s}: expected a finite number >= 0",
                out,
            )
        if msg.worlds is None:
            if self._shutting_down:
                busy = [w.world_id for _, w in sorted(self._worlds.items())]
                return StopAck(already_stopping=busy), out
            ack = self._begin_shutdown(msg.proc_timeout_s, "stop requested", out)
            return ack, out
        stopping: list[WorldId] = []
        already: list[WorldId] = []
        unknown: list[WorldId] = []
        seen: set[str] = set()
        for wid in msg.worlds:
            name = wid.name
            if name in seen:
                continue
            seen.add(name)
            world = self._worlds.get(name)
            if world is None:
                unknown.append(wid)
            elif world.phase != ACTIVE:
                already.append(wid)
            else:
                stopping.append(wid)
        for wid in stopping:
            self._stop_world(
                self._worlds[wid.name], msg.proc_timeout_s, f"world {wid} stopped", out
            )
        if unknown:
            names = ", ".join(str(w) for w in unknown)
            out.append(Log(logging.INFO, f"stop: unknown worlds {names}"))
        return StopAck(stopping=stopping, already_stopping=already, unknown=unknown), out

    def _fallback_delay(self, proc_timeout_s: float) -> float:
        return proc_timeout_s + self.stop_fallback_margin_s

    def _send_stop(
        self,
        rec: ProcRecord,
        proc_timeout_s: float,
        reason: str,
        token: StopToken,
        out: list[Instruction],
    ) -> None:
        rec.stop_sent = True
        stop = ProcStop(timeout_s=proc_timeout_s, reason=reason)
        out.append(Ask(agent_of(rec.proc_id), stop, proc_timeout_s + self.rpc_timeout_s, token))

    def _begin_shutdown(
        self, proc_timeout_s: float, reason: str, out: list[Instruction]
    ) -> StopAck:
        """``Stop{None}``: refuse joins, tell subscribers, stop every world and managing proc."""
        self._shutting_down = True
        # Worlds with nothing to wait for are removed while this runs; the system must
        # not be declared stopped before the managing procs have been told too.
        self._starting_shutdown = True
        # A requested stop is routine (INFO); any other reason (signal, fault) is news.
        level = logging.INFO if reason == "stop requested" else logging.WARNING
        out.append(Log(level, f"system shutting down: {reason}"))
        event = SystemStopping(reason=reason)
        for name in list(self._subs):
            self._push(name, event, out)
        stopping: list[WorldId] = []
        already: list[WorldId] = []
        for name in sorted(self._worlds):
            world = self._worlds.get(name)
            if world is None:
                continue
            if world.phase == ACTIVE:
                stopping.append(world.world_id)
                self._stop_world(world, proc_timeout_s, "system is shutting down", out)
            else:
                already.append(world.world_id)
        self._managing_generation += 1
        token = StopToken(None, self._managing_generation)
        for pid in sorted(self._managing):
            rec = self._managing[pid]
            if rec.stop_sent:
                continue
            if rec.health == ALIVE:
                self._managing_pending.add(pid)
                self._send_stop(rec, proc_timeout_s, "system is shutting down", token, out)
            elif rec.health == EXPIRED:
                # Maybe frozen rather than dead: told to stop, but nobody waits for it.
                rec.stop_sent = True
                stop = ProcStop(timeout_s=proc_timeout_s, reason="system is shutting down")
                out.append(Send(agent_of(pid), stop))
        if self._managing_pending:
            fallback = ManagingStopFallback(self._managing_generation)
            out.append(Timer(self._fallback_delay(proc_timeout_s), fallback))
        self._starting_shutdown = False
        self._maybe_stop_system(out)
        return StopAck(stopping=stopping, already_stopping=already)

    def _stop_world(
        self, world: WorldRecord, proc_timeout_s: float, reason: str, out: list[Instruction]
    ) -> None:
        """Send `ProcStop` to every proc and host of ``world`` and track the answers."""
        world.phase = STOPPING
        world.gone_reason = "stopped"
        self._generation += 1
        world.generation = self._generation
        token = StopToken(world.name, world.generation)
        out.append(Log(logging.INFO, f"stopping world {world.name}: {reason}"))
        for table in (world.procs, world.hosts):
            for rank in sorted(table):
                rec = table[rank]
                # Expired procs may be frozen, not dead: they are asked too, and the
                # fallback timer removes them if they never answer.
                if rec.joined and rec.health in (ALIVE, EXPIRED):
                    world.pending.add(rec.proc_id)
                    self._send_stop(rec, proc_timeout_s, reason, token, out)
        if world.pending:
            delay = self._fallback_delay(proc_timeout_s)
            out.append(Timer(delay, StopFallback(world.name, world.generation, delay)))
        else:
            self._remove_world(world, out)

    def _evict(self, world: WorldRecord, now: float, out: list[Instruction]) -> None:
        """Evict a world that has had a failed proc for ``world_eviction_timeout_s``."""
        assert world.failing_since is not None
        unhealthy_for = f"unhealthy for {now - world.failing_since:.1f} s ({world.reason})"
        out.append(Log(logging.WARNING, f"evicting world {world.name}: {unhealthy_for}"))
        world.phase = EVICTING
        world.gone_reason = f"evicted: {unhealthy_for}"
        self._generation += 1
        world.generation = self._generation
        token = StopToken(world.name, world.generation)
        reason = f"world {world.name} evicted: {world.reason}"
        for rank in sorted(world.procs):
            rec = world.procs[rank]
            if rec.joined and rec.alive:
                world.pending.add(rec.proc_id)
                self._send_stop(rec, self.proc_stop_timeout_s, reason, token, out)
        for rank in sorted(world.hosts):
            host = world.hosts[rank]
            if host.alive:
                kill = KillProcs(world_id=world.world_id, reason=reason)
                out.append(Ask(agent_of(host.proc_id), kill, self.rpc_timeout_s))
        if world.pending:
            delay = self._fallback_delay(self.proc_stop_timeout_s)
            out.append(Timer(delay, StopFallback(world.name, world.generation, delay)))
        else:
            self._remove_world(world, out)

    def _stop_done(self, rec: ProcRecord, out: list[Instruction]) -> None:
        """``rec`` answered its stop, or can no longer answer; complete what waits on it."""
        pid = rec.proc_id
        if rec.kind == "managing":
            if pid in self._managing_pending:
                self._managing_pending.discard(pid)
                self._forget(rec, "stopped", out)
                out.append(Unbind(pid))
                self._maybe_stop_system(out)
            return
        world = self._world_of(rec)
        if world is None or world.phase == ACTIVE or pid not in world.pending:
            return
        world.pending.discard(pid)
        if not world.pending:
            self._remove_world(world, out)

    def _remove_world(self, world: WorldRecord, out: list[Instruction]) -> None:
        """The last step of a stop: drop the procs, unbind, `PeerGone`, `WorldGone`; hosts stay
        after an eviction (the world is listed ``AwaitingCreation`` again)."""
        name = world.name
        stopped = world.phase == STOPPING
        gone = world.gone_reason or "stopped"
        what = "stopped" if stopped else "evicted"
        for rank in sorted(world.procs):
            rec = world.procs[rank]
            self._forget(rec, f"world {name} {what}", out)
        out.append(Unbind(world.world_id))
        self._push(name, WorldGone(world=world.world_id, reason=gone), out)
        self._subs.pop(name, None)
        if stopped and world.hosts:
            host_world = world.hosts[next(iter(world.hosts))].proc_id.world
            for rank in sorted(world.hosts):
                self._forget(world.hosts[rank], f"world {name} {what}", out)
            out.append(Unbind(host_world))
            self._push(host_world.name, WorldGone(world=host_world, reason=gone), out)
            self._subs.pop(host_world.name, None)
        out.append(Log(logging.INFO, f"world {name} removed: {gone}"))
        if world.hosts and not stopped:
            world.reset_to_hosts_only()
            if self._shutting_down:
                # Evicted during a shutdown: its hosts must be stopped too.
                self._stop_world(world, self.proc_stop_timeout_s, "system is shutting down", out)
                return
        elif self._worlds.get(name) is world:
            del self._worlds[name]
        self._maybe_stop_system(out)

    def _maybe_stop_system(self, out: list[Instruction]) -> None:
        if (
            self._shutting_down
            and not self._starting_shutdown
            and not self._stopped
            and not self._managing_pending
            and not any(w.phase != ACTIVE or w.procs or w.hosts for w in self._worlds.values())
        ):
            self._stopped = True
            out.append(
                Log(logging.INFO, "system stopped: every world and managed proc has stopped")
            )
            out.append(StopSystem("shutdown complete"))

    def handle_reply(self, ask: Ask, reply: Any, error: str | None = None) -> Result:
        """The outcome of an `Ask`: ``reply``, or ``None`` and ``error`` (returned,
        deadline passed, peer gone)."""
        out: list[Instruction] = []
        msg = ask.message
        pid = ask.dest.proc
        if isinstance(msg, ProcStop):
            if isinstance(reply, ProcStopResult):
                aborted = f" ({len(reply.aborted)} aborted)" if reply.aborted else ""
                out.append(Log(logging.INFO, f"{pid}: proc stopped{aborted}"))
            else:
                why = error if error is not None else f"unexpected reply {reply!r}"
                out.append(Log(logging.WARNING, f"{pid}: stop not confirmed: {why}"))
            token = ask.token
            rec = self._records.get(pid)
            if isinstance(token, StopToken) and rec is not None:
                if token.world is None:
                    if pid in self._managing_pending:
                        self._stop_done(rec, out)
                else:
                    world = self._worlds.get(token.world)
                    if world is not None and world.generation == token.generation:
                        self._stop_done(rec, out)
        elif isinstance(msg, SpawnProc):
            self._spawn_reply(ask, reply, error, out)
        elif isinstance(msg, KillProcs) and (error is not None or isinstance(reply, Rejected)):
            why = error if error is not None else reply.message
            text = f"{pid}: KillProcs for {msg.world_id} failed: {why}"
            out.append(Log(logging.WARNING, text))
        return None, out

    def _spawn_reply(self, ask: Ask, reply: Any, error: str | None, out: list[Instruction]) -> None:
        token = ask.token
        if not isinstance(token, SpawnToken):
            return
        world = self._worlds.get(token.world)
        if world is None or world.incarnation != token.world_incarnation or world.phase != ACTIVE:
            return
        failures: list[tuple[ProcId, str]] = []
        if isinstance(reply, SpawnProcResult):
            failures = [(f.proc_id, f.reason) for f in reply.failed]
        elif isinstance(reply, Rejected):
            why = f"host {token.host} refused to spawn: {reply.message}"
            failures = [(world.world_id.proc(r), why) for r in token.ranks]
        else:
            out.append(
                Log(logging.WARNING, f"SpawnProc to {token.host} for {world.name} failed: {error}")
            )
            return
        for pid, reason in failures:
            if pid.world != world.world_id or pid in self._records:
                continue
            exit_msg = ProcExited(proc_id=pid, host_proc=token.host, reason=reason)
            self._exit_before_join(exit_msg, out)

    def handle_timer(self, token: Any) -> Result:
        """A `Timer` the shell scheduled has fired."""
        out: list[Instruction] = []
        if isinstance(token, ExitReportGrace):
            rec = self._records.get(token.proc_id)
            if rec is not None and rec.incarnation == token.incarnation and rec.alive:
                if self._expected(rec):
                    rec.checking = False
                    self._stop_done(rec, out)
                else:
                    out.append(
                        Probe(rec.proc_id, rec.addr, rec.incarnation, self.liveness_probe_timeout_s)
                    )
        elif isinstance(token, ProbeAgain):
            self._probe_again(token, out)
        elif isinstance(token, StopFallback):
            world = self._worlds.get(token.world)
            if world is not None and world.generation == token.generation and world.phase != ACTIVE:
                what = "stop" if world.phase == STOPPING else "eviction"
                silent = ", ".join(str(p) for p in sorted(world.pending))
                wait = format_seconds(token.delay_s)
                out.append(
                    Log(
                        logging.WARNING,
                        f"{what} of world {world.name}: no answer from {silent} "
                        f"within the fallback timeout ({wait} s); removing it",
                    )
                )
                self._remove_world(world, out)
        elif (
            isinstance(token, ManagingStopFallback)
            and token.generation == self._managing_generation
            and self._managing_pending
        ):
            silent = ", ".join(str(p) for p in sorted(self._managing_pending))
            out.append(Log(logging.WARNING, f"shutdown: no answer from {silent}; forgetting them"))
            for pid in sorted(self._managing_pending):
                rec = self._records.get(pid)
                if rec is not None:
                    self._stop_done(rec, out)
            self._managing_pending.clear()
            self._maybe_stop_system(out)
        return None, out
