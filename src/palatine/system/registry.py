"""The system's bookkeeping as a sans-IO state machine.

`SystemRegistry` holds worlds, procs, hosts, subscriptions and resolvers. It is mutated
only through its ``handle_*`` methods, each taking one stimulus (a request, a heartbeat,
a timer, a probe result, a returned message, a closed connection) and returning
``(reply, instructions)`` — see `palatine.system.instructions` for what the actor shell
does with them. Time comes from the injected ``clock`` (monotonic seconds), so tests
drive every timeout by advancing a fake clock.

This module has joins, upserts and host assignment, snapshots and
supervision queries, subscriptions and resolution. Failure detection
is in `palatine.system.detection`, stop and eviction in `palatine.system.stopping`.

Bookkeeping errors are replies (`Rejected`), never exceptions.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from palatine.channel.addr import ChannelAddr
from palatine.ids import HOST_WORLD_PREFIX, ProcId, WorldId
from palatine.protocol.agent import ProcStop, SpawnProc
from palatine.protocol.supervision import (
    DETACHED,
    EXITED,
    MANAGED_BY_SYSTEM,
    MANAGING_SYSTEM,
    PROC_MODES,
    ProcRecord,
    RecordKind,
)
from palatine.protocol.system import (
    AddressChanged,
    FailedActorEntry,
    Join,
    Joined,
    Leave,
    Ok,
    ProcAssignment,
    ProcEntry,
    ProcExited,
    RejectCode,
    Resolve,
    Resolved,
    Snapshot,
    Stop,
    Subscribe,
    Subscribed,
    SupervisionUpdate,
    SystemSnapshot,
    Unsubscribe,
    UpsertWorld,
    WorldSnapshot,
    WorldState,
    WorldStateReply,
    WorldStatus,
    WorldStatusChanged,
    WorldSupervisionState,
    WorldUpserted,
)
from palatine.system.detection import DetectionMixin
from palatine.system.instructions import (
    Ask,
    Bind,
    Instruction,
    JoinProbeNeeded,
    Log,
    Probe,
    ProbeOutcome,
    Send,
    SpawnToken,
    Unbind,
)
from palatine.system.state import Result, agent_of
from palatine.system.stopping import StoppingMixin
from palatine.system.worlds import (
    ACTIVE,
    STOPPING,
    WorldRecord,
    check_upsert_spec,
    check_world_name,
    host_ranks,
    hosts_needed,
    served_name,
)

__all__ = ["Result", "SystemRegistry", "agent_of"]


class SystemRegistry(DetectionMixin, StoppingMixin):
    """Worlds, procs, hosts, supervision, subscriptions, resolution, eviction and stop.

    Every handler returns ``(reply, instructions)``; the reply is ``None`` for one-way
    stimuli. Constructor arguments are those of `RegistryState` (clock injected).

    Shell contract (what to call when):

    * each request ``msg`` from proc ``P``: ``handle(msg, requester=P)`` (a `Join` may
      answer `JoinProbeNeeded`: probe, then `complete_join`); a `SupervisionUpdate`:
      ``handle(msg, arrived_at=t)`` with its arrival time at the mailbox server;
    * every `health_tick_interval_s`: `handle_health_tick`;
    * an inbound connection from ``P`` closed without `Leave`: `handle_connection_lost`;
    * a `Probe` finished: `handle_probe_result`; a `Timer` fired: `handle_timer`;
    * an `Ask` answered or failed: `handle_reply`;
    * a message the SystemActor sent came back: `handle_returned`.
    """

    # Request type -> handler method name (`handle` dispatches on the exact type).
    _HANDLERS: ClassVar[dict[type, str]] = {
        Join: "handle_join",
        Leave: "handle_leave",
        UpsertWorld: "handle_upsert_world",
        Snapshot: "handle_snapshot",
        Stop: "handle_stop",
        WorldState: "handle_world_state",
        Resolve: "handle_resolve",
        ProcExited: "handle_proc_exited",
        Subscribe: "handle_subscribe",
        Unsubscribe: "handle_unsubscribe",
    }

    def handle(
        self,
        msg: Any,
        *,
        requester: ProcId | None = None,
        arrived_at: float | None = None,
    ) -> Result:
        """Handle any SystemActor request by type (``requester`` is the sender's proc).

        A `Join` may be answered with `JoinProbeNeeded` (see `complete_join`).
        """
        if type(msg) is SupervisionUpdate:
            return self.handle_supervision_update(msg, arrived_at=arrived_at)
        name = self._HANDLERS.get(type(msg))
        if name is None:
            text = f"unexpected message {type(msg).__name__}"
            return self._reject(msg, requester, "invalid_argument", text, [])
        result: Result = getattr(self, name)(msg, requester=requester)
        return result

    def handle_join(self, msg: Join, requester: ProcId | None = None) -> Result:
        """`Join`: `Joined`, `Rejected`, or `JoinProbeNeeded`."""
        return self._join(msg, requester, None, None)

    def complete_join(
        self,
        msg: Join,
        probe: Probe,
        outcome: ProbeOutcome,
        requester: ProcId | None = None,
    ) -> Result:
        """Finish a `Join` after the duplicate probe of `JoinProbeNeeded`."""
        return self._join(msg, requester, probe, outcome)

    def _validate_join(self, msg: Join) -> tuple[RejectCode, str] | None:
        pid = msg.proc_id
        name = pid.world.name
        mode = msg.mode
        if mode not in PROC_MODES:
            modes = ", ".join(PROC_MODES)
            return "invalid_argument", f"unknown mode {mode!r} for {pid}: expected one of {modes}"
        if not isinstance(name, str) or not name.isidentifier():
            return "invalid_argument", f"invalid world name {name!r} in a join"
        if name in ("system", "unknown"):
            return "invalid_argument", f"cannot join as {pid}: world name '{name}' is reserved"
        if name == "user" and mode != DETACHED:
            return (
                "invalid_argument",
                f"cannot join as {pid}: world 'user' is reserved for detached clients",
            )
        if name == HOST_WORLD_PREFIX:
            return (
                "invalid_argument",
                f"cannot join as {pid}: a bare 'host' is not a world; host worlds are host<W>",
            )
        is_host = name.startswith(HOST_WORLD_PREFIX)
        if is_host and mode == MANAGED_BY_SYSTEM and check_world_name(served_name(name)):
            served = served_name(name)
            why = f"host world {name} would serve the invalid or reserved world '{served}'"
            return "invalid_argument", f"cannot join as {pid}: {why}"
        if self._shutting_down:
            return "shutting_down", "system is shutting down"
        if mode != DETACHED and not msg.addr:
            return "invalid_argument", f"join of {pid} has no address"
        if msg.addr:
            try:
                addr = ChannelAddr.parse(msg.addr)
            except ValueError as e:
                return "invalid_argument", f"join of {pid}: invalid address {msg.addr!r}: {e}"
            if addr.is_any:
                why = "an 'any' address is for serving; a join gives the address it serves"
                return (
                    "invalid_argument",
                    f"join of {pid}: address {msg.addr!r} cannot be dialed ({why})",
                )
        if mode == MANAGED_BY_SYSTEM:
            wname = served_name(name) if is_host else name
            world = self._worlds.get(wname)
            if world is not None and world.phase != ACTIVE:
                doing = "stopped" if world.phase == STOPPING else "evicted"
                return "conflict", f"cannot join {pid}: world {wname} is being {doing}"
            size = world.size if world is not None and not is_host else None
            if size is not None and pid.rank >= size:
                return (
                    "invalid_argument",
                    f"rank {pid.rank} out of range for world {wname} of size {size}",
                )
        return None

    def _join(
        self,
        msg: Join,
        requester: ProcId | None,
        probe: Probe | None,
        outcome: ProbeOutcome | None,
    ) -> Result:
        out: list[Instruction] = []
        problem = self._validate_join(msg)
        if problem is not None:
            return self._reject(msg, requester, problem[0], problem[1], out)
        pid = msg.proc_id
        old = self._records.get(pid)
        carried: set[ProcId] = set()
        if old is not None and old.joined:
            if old.alive:
                if old.incarnation == msg.incarnation:
                    # A retried join of the same process: answer again, change nothing.
                    if old.addr != msg.addr:
                        old.addr = msg.addr
                        if msg.addr:
                            out.append(Bind(pid, msg.addr))
                    return self._joined(), out
                if probe is None or probe.incarnation != old.incarnation or probe.addr != old.addr:
                    return (
                        JoinProbeNeeded(
                            Probe(pid, old.addr, old.incarnation, self.liveness_probe_timeout_s)
                        ),
                        out,
                    )
                if outcome == "connected":
                    return self._reject(
                        msg,
                        requester,
                        "conflict",
                        f"proc {pid} is already joined from {old.addr} "
                        f"({self._pid_on_host(old)}); stop it first",
                        out,
                    )
                # The old process does not answer: treat it as dead and replace it.
                out.append(
                    Log(logging.INFO, f"{old.who()} does not answer; replaced by a new join")
                )
                carried = old.resolvers
            elif old.incarnation == msg.incarnation:
                return self._reject(
                    msg,
                    requester,
                    "conflict",
                    f"proc {pid} was already declared {old.health} ({old.reason}); "
                    "restart it to join again",
                    out,
                )
        if old is not None:
            self._drop_record(old, out)
        self._add_record(msg, out)
        rec = self._records[pid]
        if carried:
            rec.resolvers = set(carried)
            if old is not None and (old.addr != msg.addr or old.incarnation != msg.incarnation):
                notice = AddressChanged(proc_id=pid, addr=msg.addr, incarnation=msg.incarnation)
                for resolver in sorted(carried):
                    out.append(Send(agent_of(resolver), notice))
        return self._joined(), out

    def _pid_on_host(self, rec: ProcRecord) -> str:
        pid = rec.pid if rec.pid else "?"
        return f"pid {pid} on {rec.host}" if rec.host else f"pid {pid}"

    def _joined(self) -> Joined:
        return Joined(
            execution_id=self.execution_id,
            supervision_update_timeout_s=self.supervision_update_timeout_s,
            system_time=self._wall(),
        )

    def _add_record(self, msg: Join, out: list[Instruction]) -> None:
        now = self._clock()
        pid = msg.proc_id
        name = pid.world.name
        mode = msg.mode
        kind: RecordKind
        if mode == DETACHED:
            kind = "detached"
        elif mode == MANAGING_SYSTEM:
            kind = "managing"
        elif name.startswith(HOST_WORLD_PREFIX):
            kind = "host"
        else:
            kind = "proc"
        rec = ProcRecord(
            pid,
            kind,
            addr=msg.addr,
            labels=msg.labels,
            mode=mode,
            pid=msg.pid or None,
            host=msg.host,
            host_proc=msg.host_proc,
            incarnation=msg.incarnation,
            now=now,
        )
        self._records[pid] = rec
        self._unknown_told.pop(pid, None)
        if msg.addr:  # (a detached client may give none: replies go back on its connection)
            out.append(Bind(pid, msg.addr))
        if kind == "managing":
            self._managing[pid] = rec
        elif kind == "host":
            world = self._world_for(served_name(name))
            world.hosts[pid.rank] = rec
            if world.upserted and world.phase == ACTIVE:
                self._assign(world, rec, out)
        elif kind == "proc":
            world = self._world_for(name)
            world.procs[pid.rank] = rec
            if not world.created:
                world.created = True
                self._push(name, WorldStatusChanged(world=world.world_id, status=world.status), out)
            self._evaluate(world, now, out)

    def handle_leave(self, msg: Leave, requester: ProcId | None = None) -> Result:
        """`Leave`: a graceful exit; `Ok`. While the world is live the proc is ``Exited``."""
        out: list[Instruction] = []
        rec = self._records.get(msg.proc_id)
        if rec is None or not rec.joined:
            return Ok(), out
        if rec.kind == "detached":
            self._forget(rec, f"left: {msg.reason}" if msg.reason else "left the system", out)
            out.append(Unbind(rec.proc_id))
            return Ok(), out
        if self._expected(rec):
            rec.left = True
            self._stop_done(rec, out)
            return Ok(), out
        rec.left = True
        if rec.alive:
            reason = f"left: {msg.reason}" if msg.reason else "left the system"
            self._declare(rec, EXITED, reason, out)
        return Ok(), out

    def handle_upsert_world(self, msg: UpsertWorld, requester: ProcId | None = None) -> Result:
        """`UpsertWorld`: `WorldUpserted` or `Rejected`."""
        out: list[Instruction] = []
        name = msg.world_id.name
        problem = check_world_name(name) or check_upsert_spec(msg)
        if problem is not None:
            return self._reject(msg, requester, "invalid_argument", problem, out)
        if self._shutting_down:
            return self._reject(msg, requester, "shutting_down", "system is shutting down", out)
        world = self._worlds.get(name)
        if world is not None and world.phase != ACTIVE:
            doing = "stopped" if world.phase == STOPPING else "evicted"
            return self._reject(
                msg, requester, "conflict", f"cannot create world {name}: it is being {doing}", out
            )
        if world is not None and world.upserted:
            return self._reject(
                msg,
                requester,
                "already_exists",
                f"cannot create world {name}: already exists (status {world.status})",
                out,
            )
        if world is not None:
            for key, value in msg.labels.items():
                have = world.labels.get(key)
                if have is not None and have != value:
                    return self._reject(
                        msg,
                        requester,
                        "conflict",
                        f"label {key} of world {name} is already '{have}'",
                        out,
                    )
        now = self._clock()
        if world is None:
            world = self._world_for(name)
        self._generation += 1
        world.apply_spec(msg, self._generation)
        size = world.size
        assert size is not None
        for rank in sorted(r for r in world.procs if r >= size):
            rec = world.procs[rank]
            out.append(
                Log(
                    logging.WARNING,
                    f"dropping {rec.proc_id}: rank {rank} out of range "
                    f"for world {name} of size {size}",
                )
            )
            if rec.joined and rec.alive:
                rec.stop_sent = True
                stop = ProcStop(timeout_s=self.proc_stop_timeout_s, reason="rank out of range")
                out.append(Send(agent_of(rec.proc_id), stop))
            self._forget(rec, "rank out of range", out)
            out.append(Unbind(rec.proc_id))
        self._evaluate(world, now, out)
        for rank in sorted(world.hosts):
            self._assign(world, world.hosts[rank], out)
        out.append(
            Log(
                logging.INFO,
                f"world {name} upserted: shape {world.shape}, {size} procs, {world.status}",
            )
        )
        return WorldUpserted(status=world.world_status()), out

    def _assign(self, world: WorldRecord, host: ProcRecord, out: list[Instruction]) -> None:
        """Send host ``host`` its ranks of ``world`` (once per host and world incarnation)."""
        if not host.alive or host.stop_sent or world.size is None or world.env is None:
            return
        key = (host.proc_id.rank, host.incarnation)
        if key in world.assigned:
            return
        world.assigned.add(key)
        nph = world.num_procs_per_host
        ranks = host_ranks(host.proc_id.rank, nph, world.size)
        if not ranks:
            out.append(
                Log(
                    logging.INFO,
                    f"host {host.proc_id} gets no procs of world {world.name}: its "
                    f"{world.size} procs at {nph} per host need only "
                    f"{hosts_needed(nph, world.size)} hosts",
                )
            )
            return
        lo = host.proc_id.rank * nph
        procs = [
            ProcAssignment(proc_id=world.world_id.proc(r), rank=r, local_rank=r - lo) for r in ranks
        ]
        spawn = SpawnProc(
            world_id=world.world_id,
            env=world.env,
            procs=procs,
            world_size=world.size,
            local_world_size=len(ranks),
        )
        token = SpawnToken(
            world.name, world.incarnation, host.proc_id, host.incarnation, tuple(ranks)
        )
        out.append(Ask(agent_of(host.proc_id), spawn, self.rpc_timeout_s, token))

    def handle_snapshot(self, msg: Snapshot, requester: ProcId | None = None) -> Result:
        """`Snapshot`: `SystemSnapshot`; cost linear in listed procs."""
        out: list[Instruction] = []
        now = self._clock()
        self._expire(now, out)
        flt = msg.filter
        if flt.worlds:
            names = sorted({w.name for w in flt.worlds})
        else:
            names = sorted(self._worlds)
        world_labels = flt.world_labels
        proc_labels = flt.proc_labels
        worlds: dict[str, WorldSnapshot] = {}
        for name in names:
            world = self._worlds.get(name)
            if world is None:
                continue
            labels = world.labels
            if world_labels and any(labels.get(k) != v for k, v in world_labels.items()):
                continue
            procs: dict[str, ProcEntry] = {}
            table = world.procs
            for rank in sorted(table):
                rec = table[rank]
                if proc_labels:
                    rl = rec.labels
                    if any(rl.get(k) != v for k, v in proc_labels.items()):
                        continue
                procs[str(rec.proc_id)] = self._entry(rec, now)
            worlds[name] = WorldSnapshot(
                status=world.status,
                labels=dict(labels),
                host_procs=[str(world.hosts[h].proc_id) for h in sorted(world.hosts)],
                procs=procs,
            )
        return SystemSnapshot(execution_id=self.execution_id, worlds=worlds), out

    @staticmethod
    def _entry(rec: ProcRecord, now: float) -> ProcEntry:
        lh = rec.last_heartbeat
        return ProcEntry(
            labels=dict(rec.labels),
            addr=rec.addr,
            pid=rec.pid,
            host=rec.host,
            health=rec.health,
            exit_code=rec.exit_code,
            exit_signal=rec.exit_signal,
            failed_actors=[
                FailedActorEntry(actor_id=str(f.actor_id), status=f.status)
                for f in rec.failed_actors
            ],
            reason=rec.reason or None,
            host_proc=str(rec.host_proc) if rec.host_proc is not None else None,
            last_heartbeat_age_s=round(now - lh, 3) if (lh is not None and rec.joined) else None,
            loop_lag_s=rec.loop_lag_s if rec.joined else None,
        )

    def handle_world_state(self, msg: WorldState, requester: ProcId | None = None) -> Result:
        """`WorldState`: `WorldStateReply` whose state lists only unhealthy procs."""
        out: list[Instruction] = []
        self._expire(self._clock(), out)
        return WorldStateReply(state=self._world_state(msg.world_id.name)), out

    def _world_state(self, name: str) -> WorldSupervisionState | None:
        if name.startswith(HOST_WORLD_PREFIX) and name != HOST_WORLD_PREFIX:
            served = self._worlds.get(served_name(name))
            if served is None or not served.hosts:
                return None
            bad = {r: h for r, h in served.hosts.items() if h.failed}
            if bad:
                first = min(bad.values(), key=lambda h: (h.failed_at or 0.0, h.proc_id.rank))
                status = WorldStatus(
                    status="Unhealthy", since=first.failed_at, reason=first.describe()
                )
            else:
                status = WorldStatus(status="Live", reason=f"{len(served.hosts)} hosts joined")
            procs = {r: bad[r].to_state() for r in sorted(bad)}
            return WorldSupervisionState(world_id=WorldId(name), status=status, procs=procs)
        world = self._worlds.get(name)
        if world is None or not world.created:
            return None
        procs = {r: world.procs[r].to_state() for r in sorted(world.failed)}
        return WorldSupervisionState(
            world_id=world.world_id, status=world.world_status(), procs=procs
        )

    def handle_subscribe(self, msg: Subscribe, requester: ProcId | None = None) -> Result:
        """`Subscribe`: `Subscribed` with the current state; events follow on ``port``."""
        out: list[Instruction] = []
        name = msg.world_id.name
        if not isinstance(name, str) or not name.isidentifier():
            return self._reject(
                msg, requester, "invalid_argument", f"invalid world name {name!r}", out
            )
        self._expire(self._clock(), out)
        self._subs.setdefault(name, {})[msg.port] = None
        return Subscribed(state=self._world_state(name)), out

    def handle_unsubscribe(self, msg: Unsubscribe, requester: ProcId | None = None) -> Result:
        """`Unsubscribe`: `Ok` (also when there was no such subscription)."""
        subs = self._subs.get(msg.world_id.name)
        if subs is not None:
            subs.pop(msg.port, None)
            if not subs:
                del self._subs[msg.world_id.name]
        return Ok(), []

    def handle_resolve(self, msg: Resolve, requester: ProcId | None = None) -> Result:
        """`Resolve`: `Resolved`; the requester becomes a resolver."""
        out: list[Instruction] = []
        pid = msg.proc_id
        rec = self._records.get(pid)
        if rec is None:
            return self._reject(
                msg, requester, "not_found", f"proc {pid} is not known to the system", out
            )
        if not rec.joined or not rec.alive:
            return self._reject(msg, requester, "not_found", f"peer gone: {rec.describe()}", out)
        if requester is not None and requester != pid:
            rec.resolvers.add(requester)
        return Resolved(addr=rec.addr, incarnation=rec.incarnation or 0), out
