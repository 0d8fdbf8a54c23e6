"""The system's bookkeeping as a sans-IO state machine.

`SystemRegistry` holds worlds, procs, hosts, subscriptions and resolvers. It is mutated
only through its ``handle_*`` methods, each taking one stimulus (a request, a heartbeat,
a timer, a probe result, a returned message, a closed connection) and returning
``(reply, instructions)`` — see `palatine.system.instructions` for what the actor shell
does with them. Time comes from the injected ``clock`` (monotonic seconds), so tests
drive every timeout by advancing a fake clock.

One class, in four parts: the tables and the helpers every part uses; failure
detection (silence: heartbeats and the health tick expire procs silent for
``supervision_update_timeout_s``; death: a host's `ProcExited`; connection: a lost
connection waits ``exit_report_grace_s`` for an exit report, then probes; failed actors
and returned messages; `_declare` is the one place a health failure takes effect); stop
and eviction (``ProcStop`` asks, a stopping set per world, a fallback timer, a
``generation`` per operation so late answers never touch a re-created world); and joins,
upserts and host assignment, snapshots, supervision queries, subscriptions and
resolution.

Bookkeeping errors are replies (`Rejected`), never exceptions.

Each stimulus gets an id, ``<kind>-<n>`` (``join-17``, ``heartbeat-1234``; ``n`` counts
every stimulus), which every instruction it produces carries (``stimulus_id``), and
enters a bounded log of recent stimuli (`stimuli`, the `Stimuli` request, ``palatine
snapshot --stimuli``) with what it decided; frequent stimuli that decide nothing
(`QUIET_STIMULI`) get an id but stay out of the log.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Concatenate, NamedTuple, ParamSpec, assert_never

from palatine.channel.addr import ChannelAddr
from palatine.config import format_seconds
from palatine.ids import HOST_WORLD_PREFIX, ActorId, PortId, ProcId, WorldId
from palatine.protocol.agent import (
    KillProcs,
    ProcStop,
    ProcStopResult,
    SpawnProc,
    SpawnProcResult,
)
from palatine.protocol.supervision import (
    ALIVE,
    CONNECTION_FAILURE,
    DETACHED,
    EXITED,
    EXPIRED,
    MANAGED_BY_SYSTEM,
    MANAGING_SYSTEM,
    PROC_MODES,
    Health,
    ProcRecord,
    ProcSupervisionState,
    RecordKind,
    clock_text,
    expiry_reason,
)
from palatine.protocol.system import (
    AddressChanged,
    Exec,
    FailedActorEntry,
    Join,
    Joined,
    Leave,
    Ok,
    PeerGone,
    ProcAssignment,
    ProcEntry,
    ProcExited,
    ProcFailed,
    RejectCode,
    Rejected,
    Resolve,
    Resolved,
    RespawnProcs,
    Snapshot,
    Stimuli,
    StimulusEntry,
    StimulusLog,
    Stop,
    StopAck,
    Subscribe,
    Subscribed,
    SupervisionUpdate,
    SystemSnapshot,
    SystemStopping,
    Unsubscribe,
    UpsertWorld,
    WorldGone,
    WorldSnapshot,
    WorldState,
    WorldStateReply,
    WorldStatus,
    WorldStatusChanged,
    WorldStatusName,
    WorldSupervisionState,
    WorldUpserted,
    instruction_lines,
    summary_text,
)
from palatine.system.instructions import (
    Ask,
    Bind,
    ExitReportGrace,
    Instruction,
    JoinProbeNeeded,
    Log,
    ManagingStopFallback,
    Probe,
    ProbeAgain,
    ProbeOutcome,
    Send,
    SpawnToken,
    StopFallback,
    StopSystem,
    StopToken,
    Timer,
    Unbind,
)
from palatine.system.worlds import (
    ACTIVE,
    EVICTING,
    STOPPING,
    WorldRecord,
    check_upsert_spec,
    check_world_name,
    execution_id_from_env,
    given_execution_id,
    host_ranks,
    hosts_needed,
    served_name,
)

__all__ = ["PROBE_AGAIN_S", "QUIET_STIMULI", "Result", "SystemRegistry", "agent_of"]

Result = tuple[Any, list[Instruction]]

"""``(reply or None, instructions)``: what every handler returns."""

#: Stimuli that come often and mostly decide nothing (heartbeats, health ticks, queries):
#: they get an id like every stimulus, but enter the log of recent stimuli only when
#: they produce instructions or are rejected, so that they do not flush it.
QUIET_STIMULI = frozenset(
    ("heartbeat", "health-tick", "resolve", "world-state", "snapshot", "stimuli")
)

_P = ParamSpec("_P")
_Handler = Callable[Concatenate["SystemRegistry", _P], Result]


class _Stimulus(NamedTuple):
    """One entry of the registry's log of recent stimuli, kept as cheap as possible: its
    id, subject, reply and instructions are made text only when an operator asks."""

    seq: int  # the stimulus id is ``<kind>-<seq>``
    at: float  # registry clock
    kind: str
    subject: Any  # the stimulus's first argument (a message, a proc id, a token...)
    reply: Any  # None, a Rejected, or the reply's type
    instructions: list[Instruction]


def _stimulus(kind: str) -> Callable[[_Handler[_P]], _Handler[_P]]:
    """Make a ``handle_*`` method a stimulus: it gets the id ``<kind>-<n>`` (``n`` counts
    every stimulus of the registry), every instruction it returns carries that id, and it
    enters the bounded log of recent stimuli (quiet kinds only when they decide
    something): `SystemRegistry._begin` and `SystemRegistry._end`, which the hot handlers
    (heartbeats, `Resolve`) call themselves, skipping ``_end`` when it could keep nothing."""
    quiet = kind in QUIET_STIMULI

    def wrap(fn: _Handler[_P]) -> _Handler[_P]:
        @functools.wraps(fn)
        def handler(self: SystemRegistry, /, *args: _P.args, **kwargs: _P.kwargs) -> Result:
            self._begin(kind)
            result = fn(self, *args, **kwargs)
            return self._end(args[0] if args else next(iter(kwargs.values()), None), result, quiet)

        return handler

    return wrap


def agent_of(proc_id: ProcId) -> ActorId:
    """The proc agent ``P.proc[0]`` that receives the system's messages for ``proc_id``."""
    return ActorId(proc_id, "proc", 0)


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


def _subject_of(x: Any) -> str:
    """What a stimulus concerns, from its first argument: a proc, world or host (or '')."""
    if x is None or isinstance(x, Snapshot | Stimuli):
        return ""
    if isinstance(x, ProcId | WorldId | ActorId | PortId):
        return str(x)
    if isinstance(x, SupervisionUpdate):
        return str(x.state.proc_id)
    if isinstance(x, Ask):
        return str(x.dest.proc)
    if isinstance(x, Stop):
        return "system" if x.worlds is None else ", ".join(str(w) for w in x.worlds)
    if isinstance(x, StopFallback):
        return x.world
    if isinstance(x, ManagingStopFallback):
        return "managing procs"
    for field in ("proc_id", "world_id"):
        value = getattr(x, field, None)
        if value is not None:
            return str(value)
    return type(x).__name__


def _reply_of(kept: Any) -> str:
    if kept is None:
        return ""
    if isinstance(kept, Rejected):
        return f"Rejected {kept.code}: {kept.message}"
    return str(kept.__name__) if isinstance(kept, type) else type(kept).__name__


def _describe(ins: Instruction) -> str:
    """One instruction in a line of the stimulus log: its type and destination."""
    match ins:
        case Send():
            return f"Send {type(ins.message).__name__} to {ins.dest}"
        case Ask():
            return f"Ask {type(ins.message).__name__} of {ins.dest}"
        case Probe():
            again = " again" if ins.recheck else ""
            return f"Probe{again} {ins.proc_id} at {ins.addr}"
        case Timer():
            return f"Timer {type(ins.token).__name__} in {format_seconds(ins.delay_s)} s"
        case Bind():
            return f"Bind {ins.proc_id} to {ins.addr}"
        case Unbind():
            return f"Unbind {ins.target}"
        case Log():
            return f"Log {logging.getLevelName(ins.level)}: {summary_text(ins.text)}"
        case StopSystem():
            return f"StopSystem: {ins.reason}"
        case _:
            assert_never(ins)


class SystemRegistry:
    """Worlds, procs, hosts, supervision, subscriptions, resolution, eviction and stop.

    Every handler returns ``(reply, instructions)``; the reply is ``None`` for one-way
    stimuli.

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
        rejoin_window_s: how long after its start the system waits for the procs of a
            previous system at its address to rejoin (`Join.rejoin`): meanwhile unknown
            heartbeats are not told to stop, and queries about unknown worlds and procs
            are answered ``unavailable`` instead of "unknown". At its end, the ranks of a
            rebuilt world that did not rejoin are declared ``Expired``. The shell makes it
            the longer of the procs' system-loss timeout (how long they wait for a lost
            system) and ``supervision_update_timeout_s``.
        wall_clock: wall-clock seconds, only for texts humans read (``declared Expired
            at 12:03:04``) and ``Joined.system_time``.
        stimulus_log_size: how many recent stimuli `stimuli` keeps (the newest).

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

    # ------------------------------------------------------------ tables and shared helpers

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
        rejoin_window_s: float = 10.0,
        wall_clock: Callable[[], float] | None = None,
        stimulus_log_size: int = 1000,
    ) -> None:
        self._clock = clock
        self._wall = wall_clock if wall_clock is not None else time.time
        self.supervision_update_timeout_s = supervision_update_timeout_s
        self.world_eviction_timeout_s = world_eviction_timeout_s
        # An execution id of our own making is replaced by the one the first rejoining
        # proc brings (a system restarted by hand, without PALATINE_EXECUTION_ID).
        self._execution_id_made = not execution_id and not given_execution_id()
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
        self.rejoin_window_s = rejoin_window_s
        self._started_at = clock()
        self._rejoin_until: float | None = self._started_at + rejoin_window_s
        self.rejoins = 0  # procs that rejoined after a restart of the system

        self._records: dict[ProcId, ProcRecord] = {}
        # the address of each record in _records that has one, parsed where it came in
        self._addrs: dict[ProcId, ChannelAddr] = {}
        self._worlds: dict[str, WorldRecord] = {}
        self._managing: dict[ProcId, ProcRecord] = {}
        # world name -> subscriber ports (a dict as an insertion-ordered set)
        self._subs: dict[str, dict[PortId, None]] = {}
        # (proc id, incarnation) of a heartbeat the registry has no live record for -> when
        # that incarnation was last told to stop (at most once per interval)
        self._unknown_told: dict[tuple[ProcId, int], float] = {}
        # host -> the respawns (`RespawnProcs`) asked of it and not answered yet: when the
        # host is lost meanwhile, their ranks are started on another host
        self._respawning: dict[ProcId, list[SpawnToken]] = {}
        # failures detected, by kind (``signal``, ``exit``, ``Expired``, ``actor``): metrics
        self.detections: collections.Counter[str] = collections.Counter()
        self._generation = 0
        self._shutting_down = False
        self._starting_shutdown = False
        self._stopped = False
        self._managing_pending: set[ProcId] = set()
        self._managing_generation = 0
        # stimulus ids: ``<kind>-<n>``; the id of the stimulus being handled; the log
        self._seq = 0
        self._kind = ""
        self._sid_text: str | None = None
        # the address of the Join handled last, parsed (None: none that can be dialed):
        # where the shell reaches a joiner it refuses, which has no route yet
        self.join_addr: ChannelAddr | None = None
        self._stimuli: collections.deque[_Stimulus] = collections.deque(
            maxlen=max(1, stimulus_log_size)
        )

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

    @property
    def _sid(self) -> str:
        """The id of the stimulus being handled, made on first use (most decide nothing)."""
        sid = self._sid_text
        if sid is None:
            sid = self._sid_text = f"{self._kind}-{self._seq}"
        return sid

    def _begin(self, kind: str) -> None:
        """A stimulus of ``kind`` begins: it gets the next id (made text on first use)."""
        self._seq += 1
        self._kind = kind
        self._sid_text = None

    def _end(self, subject: Any, result: Result, quiet: bool) -> Result:
        """The stimulus that `_begin` began ends with ``result``, returned as is: it enters
        the log of recent stimuli with its ``subject`` (the handler's first argument) and
        what it decided (a reply's type only, not the reply: snapshots are big), unless it
        is ``quiet`` (`QUIET_STIMULI`) and produced no instruction and no rejection."""
        reply, out = result
        if out or not quiet or type(reply) is Rejected:
            kept = reply if reply is None or type(reply) is Rejected else type(reply)
            self._stimuli.append(
                _Stimulus(self._seq, self._clock(), self._kind, subject, kept, out)
            )
        return result

    def _reject(
        self,
        msg: Any,
        requester: ProcId | None,
        code: RejectCode,
        text: str,
        out: list[Instruction],
    ) -> Result:
        who = f" from {requester}" if requester is not None else ""
        out.append(
            Log(
                logging.WARNING,
                f"rejected {type(msg).__name__}{who}: {code}: {text}",
                stimulus_id=self._sid,
            )
        )
        return Rejected(code=code, message=text), out

    def _awaiting_rejoins(self, now: float) -> bool:
        """Within the rejoin window of a system that may have restarted: it has heard
        rejoins, or nothing yet (queries must not call a proc that is rejoining unknown)."""
        if self._rejoin_until is None or now >= self._rejoin_until:
            return False
        return self.rejoins > 0 or not self._supervises_any()

    def _supervises_any(self) -> bool:
        """Whether any proc but detached clients has joined this system."""
        return any(r.kind != "detached" for r in self._records.values())

    def _not_rejoined(self, what: str, out: list[Instruction]) -> Result:
        """``unavailable``: ``what`` may still rejoin this restarted system; ask again."""
        age = format_seconds(round(self._clock() - self._started_at, 1))
        text = (
            f"{what} has not rejoined the system yet (it started {age} s ago; the procs of "
            f"a system it replaces rejoin within {format_seconds(self.rejoin_window_s)} s)"
        )
        return Rejected(code="unavailable", message=text), out

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
            self._addrs.pop(pid, None)
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
                out.append(Send(port, event, stimulus_id=self._sid))

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
            out.append(Send(agent_of(resolver), notice, stimulus_id=self._sid))
        world = self._world_of(rec) if rec.kind == "proc" else None
        if world is not None:
            world.told_gone.setdefault(rec.proc_id.rank, set()).update(rec.resolvers)
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
            out.append(
                Log(
                    logging.INFO, f"world {world.name} is {status}: {reason}", stimulus_id=self._sid
                )
            )
            event = WorldStatusChanged(world=world.world_id, status=status, reason=reason)
            self._push(world.name, event, out)

    # ------------------------------------------------------------ failure detection: heartbeats, probes, exit reports, health ticks

    def handle_supervision_update(
        self, msg: SupervisionUpdate, arrived_at: float | None = None
    ) -> Result:
        """A heartbeat or failure report (one-way: the reply is always ``None``).

        ``arrived_at`` is when the mailbox server received it (system clock); a backlog
        in the SystemActor therefore never causes a false expiry.

        A stimulus of kind ``heartbeat``, begun and ended by hand (`_stimulus`) on this hot
        path.
        """
        self._begin("heartbeat")
        out: list[Instruction] = []
        self._supervision_update(msg, arrived_at, out)
        if out:  # (else quiet: `_end` would keep nothing; this path skips the call)
            self._end(msg, (None, out), True)
        return None, out

    def _supervision_update(
        self, msg: SupervisionUpdate, arrived_at: float | None, out: list[Instruction]
    ) -> None:
        state = msg.state
        pid = state.proc_id
        now = self._clock() if arrived_at is None else arrived_at
        rec = self._records.get(pid)
        if rec is None:
            if not self._awaiting_rejoins(now):  # (else its rejoin is on the way)
                self._tell_unknown(pid, "unknown to the system", now, out, state)
            return
        if rec.kind == "detached":
            return
        if state.incarnation and rec.incarnation and state.incarnation != rec.incarnation:
            self._tell_unknown(
                pid, f"unknown to the system: {pid} has joined again since", now, out, state
            )
            return
        if not rec.alive:
            # Sticky health: a zombie's heartbeat is ignored and the zombie told to stop.
            if state.failed_actors:
                rec.add_failed_actors(state.failed_actors)
            told = rec.zombie_told_at
            if told is None or now - told >= self.unknown_proc_stop_interval_s:
                rec.zombie_told_at = now
                at = clock_text(rec.declared_wall) if rec.declared_wall is not None else "?"
                reason = f"declared {rec.health} at {at}: {rec.reason}"
                out.append(self._stop_heartbeater(state, reason))
            return
        lh = rec.last_heartbeat
        if lh is None or now > lh:
            rec.last_heartbeat = now
        rec.loop_lag_s = state.loop_lag_s
        rec.activity = state.activity
        if state.counters:
            rec.counters = state.counters
        if state.resources:
            rec.resources = state.resources
        if state.failed_actors and rec.add_failed_actors(state.failed_actors):
            self._actor_failed(rec, out)

    def _tell_unknown(
        self,
        pid: ProcId,
        reason: str,
        now: float,
        out: list[Instruction],
        state: ProcSupervisionState,
    ) -> None:
        key = (pid, state.incarnation)
        told = self._unknown_told.get(key)
        if told is not None and now - told < self.unknown_proc_stop_interval_s:
            return
        self._unknown_told[key] = now
        at = f" at {state.addr}" if state.addr else ""
        out.append(
            Log(
                logging.WARNING,
                f"heartbeat from {pid}{at}, which is {reason}; telling it to stop",
                stimulus_id=self._sid,
            )
        )
        out.append(self._stop_heartbeater(state, reason))

    def _stop_heartbeater(self, state: ProcSupervisionState, reason: str) -> Send:
        """A one-way `ProcStop` for the incarnation that sent heartbeat ``state``.

        It names that incarnation and goes to the address the heartbeat came from, not to
        wherever the proc id is bound now: after a recovery the id is bound to the rank's
        replacement, which a stop meant for the incarnation it replaced must never reach.
        A heartbeat without a usable address is answered through the binding, and the
        incarnation in the stop still keeps any other incarnation from obeying it.
        """
        addr: ChannelAddr | None = None
        if state.addr:
            try:
                addr = ChannelAddr.parse(state.addr)
            except ValueError:
                addr = None
        stop = ProcStop(
            timeout_s=self.proc_stop_timeout_s, reason=reason, incarnation=state.incarnation
        )
        return Send(agent_of(state.proc_id), stop, addr=addr, stimulus_id=self._sid)

    def _actor_failed(self, rec: ProcRecord, out: list[Instruction]) -> None:
        now = self._clock()
        first = rec.failed_at is None
        if first:
            rec.failed_at = now
            rec.declared_wall = self._wall()
            self.detections["actor"] += 1
        out.append(Log(logging.WARNING, rec.describe(), stimulus_id=self._sid))
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
        if health != EXITED:
            self.detections[health] += 1
        else:
            self.detections["signal" if exit_signal else "exit"] += 1
        rec.declared_wall = self._wall()
        out.append(Log(logging.WARNING, rec.describe(), stimulus_id=self._sid))
        self._peer_gone(rec, out)
        self._drop_subscriptions_of(rec.proc_id)
        world = self._world_of(rec)
        if rec.kind == "proc" and world is not None:
            world.failed.add(rec.proc_id.rank)
        self._report(rec, out)
        if rec.kind == "proc" and world is not None:
            self._evaluate(world, now, out)
        if rec.kind == "host" and rec.proc_id in self._respawning:
            self._respawn_elsewhere(rec.proc_id, self._respawning.pop(rec.proc_id), reason, out)
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

    @_stimulus("health-tick")
    def handle_health_tick(self) -> Result:
        """The periodic health tick (every `health_tick_interval_s`)."""
        out: list[Instruction] = []
        now = self._clock()
        self._expire(now, out)
        if self._rejoin_until is not None and now >= self._rejoin_until:
            self._rejoin_until = None
            if self.rejoins:
                self._end_rejoins(now, out)
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
            for key in [k for k, t in self._unknown_told.items() if now - t >= interval]:
                del self._unknown_told[key]
        return None, out

    def _end_rejoins(self, now: float, out: list[Instruction]) -> None:
        """The rejoin window is over: a rank of a rebuilt world that has not rejoined
        (it died while the system was down, say) is ``Expired``, so that its world's
        subscribers hear of it instead of waiting for it forever."""
        limit = format_seconds(self.rejoin_window_s)
        for world in list(self._worlds.values()):
            if not world.rebuilt or world.size is None or world.phase != ACTIVE:
                continue
            for rank in range(world.size):
                if rank in world.procs:
                    continue
                rec = ProcRecord(world.world_id.proc(rank), "proc", joined=False)
                rec.health = EXPIRED
                rec.reason = f"did not rejoin within {limit} s of the system's restart"
                self.detections[EXPIRED] += 1
                self._failed_unjoined(world, rec, rec.describe(), now, out)
            self._evaluate(world, now, out)

    @_stimulus("proc-exited")
    def handle_proc_exited(self, msg: ProcExited, requester: ProcId | None = None) -> Result:
        """A host's exit report: `Ok`, or ``unavailable`` while the world of a proc this
        restarted system does not know yet may still be rebuilt (the host reports again)."""
        out: list[Instruction] = []
        pid = msg.proc_id
        rec = self._records.get(pid)
        if rec is None or rec.kind == "detached":
            world = self._worlds.get(pid.world.name)
            if (world is None or not world.upserted) and self._awaiting_rejoins(self._clock()):
                return self._not_rejoined(f"world {pid.world.name}", out)
            self._exit_before_join(msg, out)
            return Ok(), out
        if rec.joined and msg.pid and rec.pid and msg.pid != rec.pid:
            out.append(
                Log(
                    logging.DEBUG,
                    f"ignoring exit report of {pid} pid {msg.pid}: it is pid {rec.pid}",
                    stimulus_id=self._sid,
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
            or (msg.pid is not None and (pid.rank, msg.pid) in world.replaced)
        ):
            out.append(
                Log(
                    logging.DEBUG,
                    f"ignoring exit report of {pid}: no such rank is expected",
                    stimulus_id=self._sid,
                )
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
        self._failed_unjoined(world, rec, f"{rec.describe()} before joining", now, out)
        self._evaluate(world, now, out)

    def _failed_unjoined(
        self, world: WorldRecord, rec: ProcRecord, text: str, now: float, out: list[Instruction]
    ) -> None:
        """Record a rank that failed without joining (its health set): it counts as
        failed for its world, and its subscribers hear of it once."""
        rec.failed_at = now
        rec.declared_wall = self._wall()
        self._records[rec.proc_id] = rec
        self._addrs.pop(rec.proc_id, None)
        world.procs[rec.proc_id.rank] = rec
        world.failed.add(rec.proc_id.rank)
        out.append(Log(logging.WARNING, text, stimulus_id=self._sid))
        self._report(rec, out)

    @_stimulus("connection-lost")
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
            out.append(Timer(self.exit_report_grace_s, token, stimulus_id=self._sid))
        else:
            out.append(self._probe(rec))
        return None, out

    @_stimulus("probe-result")
    def handle_probe_result(self, probe: Probe, outcome: ProbeOutcome) -> Result:
        """Outcome of a liveness `Probe`: refused means ``ConnectionFailure``."""
        out: list[Instruction] = []
        rec = self._records.get(probe.proc_id)
        if (
            rec is None
            or rec.incarnation != probe.incarnation
            or self._addrs.get(rec.proc_id) != probe.addr
        ):
            return None, out
        rec.checking = False
        if not rec.alive:
            return None, out
        if outcome == "connected":
            out.append(
                Log(
                    logging.DEBUG,
                    f"{probe.proc_id}: connection dropped but its address answers",
                    stimulus_id=self._sid,
                )
            )
            if not probe.recheck:  # perhaps a dying process whose listener goes last
                token = ProbeAgain(probe.proc_id, probe.incarnation, probe.addr)
                out.append(Timer(PROBE_AGAIN_S, token, stimulus_id=self._sid))
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
            or self._addrs.get(rec.proc_id) != token.addr
            or not rec.alive
            or rec.checking
        ):
            return
        rec.checking = True
        out.append(self._probe(rec, recheck=True))

    def _set_addr(self, pid: ProcId, addr: ChannelAddr | None) -> None:
        """``addr`` is the parsed address of ``pid``'s record (None: it has none)."""
        if addr is None:
            self._addrs.pop(pid, None)
        else:
            self._addrs[pid] = addr

    def _probe(self, rec: ProcRecord, recheck: bool = False) -> Probe:
        """A liveness `Probe` of ``rec``'s incarnation at its address (a joined proc that
        is supervised always has one: a join without an address is refused)."""
        addr = self._addrs.get(rec.proc_id)
        assert addr is not None, f"{rec.proc_id} has no address to probe"
        timeout = self.liveness_probe_timeout_s
        return Probe(
            rec.proc_id, addr, rec.incarnation, timeout, recheck=recheck, stimulus_id=self._sid
        )

    def _probe_children_of(self, host: ProcRecord, out: list[Instruction]) -> None:
        """A lost host took its children with it (parent-death signal): probe each one now.

        Their own connection-lost signals normally arrive too; this makes the verdict
        independent of the order (and of a probe that was inconclusive a moment earlier).
        """
        for child in list(self._records.values()):
            if (
                child.host_proc == host.proc_id
                and child.alive
                and not child.checking
                and child.proc_id in self._addrs  # (a detached client may give no address)
            ):
                child.checking = True
                out.append(self._probe(child))

    @_stimulus("returned")
    def handle_returned(
        self,
        dest: ActorId | PortId | ProcId,
        errors: Iterable[str],
        message: Any = None,
        returned_at: ChannelAddr | None = None,
    ) -> Result:
        """A message the SystemActor sent came back undeliverable (its undeliverable hook).

        A returned push ends that subscription; ``broken link`` / ``peer gone`` marks
        the destination proc ``ConnectionFailure`` if it was Alive, unless it came back
        from another address than the proc's now (``returned_at``, where the channel
        failed to deliver it): a message queued for a rank cut off by a partition comes
        back long after its replacement joined elsewhere, and says nothing about it.
        """
        out: list[Instruction] = []
        errors = list(errors)
        if isinstance(dest, PortId):
            for name in list(self._subs):
                subs = self._subs[name]
                if dest in subs:
                    del subs[dest]
                    out.append(
                        Log(
                            logging.INFO,
                            f"subscription of {dest} to {name} ended: push returned",
                            stimulus_id=self._sid,
                        )
                    )
                    if not subs:
                        del self._subs[name]
        pid = _proc_of(dest)
        rec = self._records.get(pid) if pid is not None else None
        if rec is None or not rec.supervised or not rec.joined or not rec.alive:
            return None, out
        if returned_at is not None and pid is not None:
            now_at = self._addrs.get(pid)
            if now_at is not None and now_at != returned_at:
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

    # ------------------------------------------------------------ stop and eviction

    @_stimulus("stop")
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
            out.append(Log(logging.INFO, f"stop: unknown worlds {names}", stimulus_id=self._sid))
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
        stop = ProcStop(timeout_s=proc_timeout_s, reason=reason, incarnation=rec.incarnation or 0)
        out.append(
            Ask(
                agent_of(rec.proc_id),
                stop,
                proc_timeout_s + self.rpc_timeout_s,
                token,
                stimulus_id=self._sid,
            )
        )

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
        out.append(Log(level, f"system shutting down: {reason}", stimulus_id=self._sid))
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
                stop = ProcStop(
                    timeout_s=proc_timeout_s,
                    reason="system is shutting down",
                    incarnation=rec.incarnation or 0,
                )
                out.append(Send(agent_of(pid), stop, stimulus_id=self._sid))
        if self._managing_pending:
            fallback = ManagingStopFallback(self._managing_generation)
            out.append(Timer(self._fallback_delay(proc_timeout_s), fallback, stimulus_id=self._sid))
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
        out.append(
            Log(logging.INFO, f"stopping world {world.name}: {reason}", stimulus_id=self._sid)
        )
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
            out.append(
                Timer(
                    delay, StopFallback(world.name, world.generation, delay), stimulus_id=self._sid
                )
            )
        else:
            self._remove_world(world, out)

    def _evict(self, world: WorldRecord, now: float, out: list[Instruction]) -> None:
        """Evict a world that has had a failed proc for ``world_eviction_timeout_s``."""
        assert world.failing_since is not None
        unhealthy_for = f"unhealthy for {now - world.failing_since:.1f} s ({world.reason})"
        out.append(
            Log(
                logging.WARNING,
                f"evicting world {world.name}: {unhealthy_for}",
                stimulus_id=self._sid,
            )
        )
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
                out.append(
                    Ask(agent_of(host.proc_id), kill, self.rpc_timeout_s, stimulus_id=self._sid)
                )
        if world.pending:
            delay = self._fallback_delay(self.proc_stop_timeout_s)
            out.append(
                Timer(
                    delay, StopFallback(world.name, world.generation, delay), stimulus_id=self._sid
                )
            )
        else:
            self._remove_world(world, out)

    def _stop_done(self, rec: ProcRecord, out: list[Instruction]) -> None:
        """``rec`` answered its stop, or can no longer answer; complete what waits on it."""
        pid = rec.proc_id
        if rec.kind == "managing":
            if pid in self._managing_pending:
                self._managing_pending.discard(pid)
                self._forget(rec, "stopped", out)
                out.append(Unbind(pid, stimulus_id=self._sid))
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
        out.append(Unbind(world.world_id, stimulus_id=self._sid))
        self._push(name, WorldGone(world=world.world_id, reason=gone), out)
        self._subs.pop(name, None)
        if stopped and world.hosts:
            host_world = world.hosts[next(iter(world.hosts))].proc_id.world
            for rank in sorted(world.hosts):
                self._forget(world.hosts[rank], f"world {name} {what}", out)
            out.append(Unbind(host_world, stimulus_id=self._sid))
            self._push(host_world.name, WorldGone(world=host_world, reason=gone), out)
            self._subs.pop(host_world.name, None)
        out.append(Log(logging.INFO, f"world {name} removed: {gone}", stimulus_id=self._sid))
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
                Log(
                    logging.INFO,
                    "system stopped: every world and managed proc has stopped",
                    stimulus_id=self._sid,
                )
            )
            out.append(StopSystem("shutdown complete", stimulus_id=self._sid))

    @_stimulus("reply")
    def handle_reply(self, ask: Ask, reply: Any, error: str | None = None) -> Result:
        """The outcome of an `Ask`: ``reply``, or ``None`` and ``error`` (returned,
        deadline passed, peer gone)."""
        out: list[Instruction] = []
        msg = ask.message
        pid = ask.dest.proc
        if isinstance(msg, ProcStop):
            if isinstance(reply, ProcStopResult):
                aborted = f" ({len(reply.aborted)} aborted)" if reply.aborted else ""
                out.append(
                    Log(logging.INFO, f"{pid}: proc stopped{aborted}", stimulus_id=self._sid)
                )
            else:
                why = error if error is not None else f"unexpected reply {reply!r}"
                out.append(
                    Log(logging.WARNING, f"{pid}: stop not confirmed: {why}", stimulus_id=self._sid)
                )
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
            out.append(Log(logging.WARNING, text, stimulus_id=self._sid))
        return None, out

    def _spawn_reply(self, ask: Ask, reply: Any, error: str | None, out: list[Instruction]) -> None:
        token = ask.token
        if not isinstance(token, SpawnToken):
            return
        pending = self._respawning.get(token.host)
        if pending is not None and token in pending:
            pending.remove(token)
            if not pending:
                del self._respawning[token.host]
            if reply is None:  # the host did not answer: start those ranks elsewhere
                self._respawn_elsewhere(token.host, [token], f"no answer: {error}", out)
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
                Log(
                    logging.WARNING,
                    f"SpawnProc to {token.host} for {world.name} failed: {error}",
                    stimulus_id=self._sid,
                )
            )
            return
        for pid, reason in failures:
            if pid.world != world.world_id or pid in self._records:
                continue
            exit_msg = ProcExited(proc_id=pid, host_proc=token.host, reason=reason)
            self._exit_before_join(exit_msg, out)

    @_stimulus("timer")
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
                    out.append(self._probe(rec))
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
                        stimulus_id=self._sid,
                    )
                )
                self._remove_world(world, out)
        elif (
            isinstance(token, ManagingStopFallback)
            and token.generation == self._managing_generation
            and self._managing_pending
        ):
            silent = ", ".join(str(p) for p in sorted(self._managing_pending))
            out.append(
                Log(
                    logging.WARNING,
                    f"shutdown: no answer from {silent}; forgetting them",
                    stimulus_id=self._sid,
                )
            )
            for pid in sorted(self._managing_pending):
                rec = self._records.get(pid)
                if rec is not None:
                    self._stop_done(rec, out)
            self._managing_pending.clear()
            self._maybe_stop_system(out)
        return None, out

    # ------------------------------------------------------------ joins, worlds, queries and subscriptions

    # Request type -> handler method name (`handle` dispatches on the exact type).
    _HANDLERS: ClassVar[dict[type, str]] = {
        Join: "handle_join",
        Leave: "handle_leave",
        UpsertWorld: "handle_upsert_world",
        RespawnProcs: "handle_respawn_procs",
        Snapshot: "handle_snapshot",
        Stimuli: "handle_stimuli",
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
            return self.handle_supervision_update(msg, arrived_at)
        name = self._HANDLERS.get(type(msg))
        if name is None:
            return self.handle_unexpected(msg, requester=requester)
        result: Result = getattr(self, name)(msg, requester=requester)
        return result

    @_stimulus("stimuli")
    def handle_stimuli(self, msg: Stimuli, requester: ProcId | None = None) -> Result:
        """`Stimuli`: `StimulusLog` of the newest ``limit`` kept stimuli, oldest first."""
        limit = msg.limit
        if limit is not None and (type(limit) is not int or limit < 1):
            text = f"invalid limit {limit!r}: expected a whole number >= 1, or none for all"
            return self._reject(msg, requester, "invalid_argument", text, [])
        return self.stimuli(limit), []

    def stimuli(self, limit: int | None = None) -> StimulusLog:
        """The log of recent stimuli (the newest ``limit``), oldest first."""
        kept = list(self._stimuli)
        if limit is not None:
            kept = kept[-limit:] if limit > 0 else []
        # entries carry the registry's clock; people read wall-clock times
        offset = self._wall() - self._clock()
        entries = []
        for e in kept:
            entries.append(
                StimulusEntry(
                    stimulus_id=f"{e.kind}-{e.seq}",
                    time=round(e.at + offset, 3),
                    kind=e.kind,
                    subject=_subject_of(e.subject),
                    reply=_reply_of(e.reply),
                    instructions=instruction_lines(e.instructions, _describe),
                )
            )
        return StimulusLog(
            execution_id=self.execution_id,
            size=self._stimuli.maxlen or 0,
            handled=self._seq,
            entries=entries,
        )

    @_stimulus("unexpected")
    def handle_unexpected(self, msg: Any, requester: ProcId | None = None) -> Result:
        """A message the system does not serve: `Rejected` ``invalid_argument``."""
        text = f"unexpected message {type(msg).__name__}"
        return self._reject(msg, requester, "invalid_argument", text, [])

    @_stimulus("join")
    def handle_join(self, msg: Join, requester: ProcId | None = None) -> Result:
        """`Join`: `Joined`, `Rejected`, or `JoinProbeNeeded`."""
        return self._join(msg, requester, None, None)

    @_stimulus("join-probed")
    def complete_join(
        self,
        msg: Join,
        probe: Probe,
        outcome: ProbeOutcome,
        requester: ProcId | None = None,
    ) -> Result:
        """Finish a `Join` after the duplicate probe of `JoinProbeNeeded`."""
        return self._join(msg, requester, probe, outcome)

    def _validate_join(self, msg: Join) -> tuple[tuple[RejectCode, str] | None, ChannelAddr | None]:
        """``(problem, addr)``: why the join is refused (None: it is not), and its address,
        parsed here once, where it comes in from the wire, also when the join is refused
        (None: none given, as a detached client may, or none that can be dialed)."""
        pid = msg.proc_id
        name = pid.world.name
        mode = msg.mode
        problem: tuple[RejectCode, str] | None = None
        addr: ChannelAddr | None = None
        bad_addr: ValueError | None = None
        if msg.addr:
            try:
                addr = ChannelAddr.parse(msg.addr)
            except ValueError as e:
                bad_addr = e
        dialable = addr if addr is not None and not addr.is_any else None
        is_host = isinstance(name, str) and name.startswith(HOST_WORLD_PREFIX)
        if mode not in PROC_MODES:
            modes = ", ".join(PROC_MODES)
            problem = (
                "invalid_argument",
                f"unknown mode {mode!r} for {pid}: expected one of {modes}",
            )
        elif not isinstance(name, str) or not name.isidentifier():
            problem = "invalid_argument", f"invalid world name {name!r} in a join"
        elif name in ("system", "unknown"):
            problem = "invalid_argument", f"cannot join as {pid}: world name '{name}' is reserved"
        elif name == "user" and mode != DETACHED:
            why = "world 'user' is reserved for detached clients"
            problem = "invalid_argument", f"cannot join as {pid}: {why}"
        elif name == HOST_WORLD_PREFIX:
            why = "a bare 'host' is not a world; host worlds are host<W>"
            problem = "invalid_argument", f"cannot join as {pid}: {why}"
        elif is_host and mode == MANAGED_BY_SYSTEM and check_world_name(served_name(name)):
            served = served_name(name)
            why = f"host world {name} would serve the invalid or reserved world '{served}'"
            problem = "invalid_argument", f"cannot join as {pid}: {why}"
        elif self._shutting_down:
            problem = "shutting_down", "system is shutting down"
        elif mode != DETACHED and not msg.addr:
            problem = "invalid_argument", f"join of {pid} has no address"
        elif bad_addr is not None:
            text = f"join of {pid}: invalid address {msg.addr!r}: {bad_addr}"
            problem = "invalid_argument", text
        elif addr is not None and dialable is None:
            why = "an 'any' address is for serving; a join gives the address it serves"
            text = f"join of {pid}: address {msg.addr!r} cannot be dialed ({why})"
            problem = "invalid_argument", text
        if problem is not None:
            return problem, dialable
        if mode == MANAGED_BY_SYSTEM:
            wname = served_name(name) if is_host else name
            world = self._worlds.get(wname)
            if world is not None and world.phase != ACTIVE:
                doing = "stopped" if world.phase == STOPPING else "evicted"
                return ("conflict", f"cannot join {pid}: world {wname} is being {doing}"), addr
            size = world.size if world is not None and not is_host else None
            if size is not None and pid.rank >= size:
                text = f"rank {pid.rank} out of range for world {wname} of size {size}"
                return ("invalid_argument", text), addr
        return None, addr

    def _join(
        self,
        msg: Join,
        requester: ProcId | None,
        probe: Probe | None,
        outcome: ProbeOutcome | None,
    ) -> Result:
        out: list[Instruction] = []
        problem, addr = self._validate_join(msg)
        self.join_addr = addr
        if problem is not None:
            return self._reject(msg, requester, problem[0], problem[1], out)
        pid = msg.proc_id
        if msg.rejoin and msg.execution_id and msg.execution_id != self.execution_id:
            if self._execution_id_made and not self._supervises_any():
                out.append(
                    Log(
                        logging.INFO,
                        f"execution {msg.execution_id} goes on: its procs rejoin this system "
                        f"(was {self.execution_id})",
                        stimulus_id=self._sid,
                    )
                )
                self.execution_id = msg.execution_id
                self._execution_id_made = False
            else:
                text = (
                    f"cannot rejoin {pid} of execution {msg.execution_id}: this system runs "
                    f"execution {self.execution_id}"
                )
                return self._reject(msg, requester, "conflict", text, out)
        old = self._records.get(pid)
        carried: set[ProcId] = set()
        if old is not None and old.joined:
            if old.alive:
                if old.incarnation == msg.incarnation:
                    # A retried join of the same process: answer again, change nothing.
                    if old.addr != msg.addr:
                        old.addr = msg.addr
                        self._set_addr(pid, addr)
                        if addr is not None:
                            out.append(Bind(pid, addr, stimulus_id=self._sid))
                    return self._joined(), out
                at = self._addrs.get(pid)  # (none, a detached client's: nothing answers)
                if at is not None and (
                    probe is None or probe.incarnation != old.incarnation or probe.addr != at
                ):
                    return JoinProbeNeeded(self._probe(old)), out
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
                    Log(
                        logging.INFO,
                        f"{old.who()} does not answer; replaced by a new join",
                        stimulus_id=self._sid,
                    )
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
        if msg.rejoin:
            self.rejoins += 1
            if msg.world is not None:
                self._adopt_spec(msg, out)
        self._add_record(msg, addr, out)
        rec = self._records[pid]
        world = self._world_of(rec) if rec.kind == "proc" else None
        told = world.told_gone.pop(pid.rank, set()) if world is not None else set()
        if world is not None and world.replaced:
            # joined: a late report of a replaced pid now meets this record's own pid
            world.replaced = {x for x in world.replaced if x[0] != pid.rank}
        if carried or told:
            rec.resolvers = set(carried) | told
            changed = old is not None and (
                old.addr != msg.addr or old.incarnation != msg.incarnation
            )
            # (those told it was gone hear of the new incarnation in any case)
            notify = (set(carried) if changed else set()) | told
            notice = AddressChanged(proc_id=pid, addr=msg.addr, incarnation=msg.incarnation)
            for resolver in sorted(notify):
                out.append(Send(agent_of(resolver), notice, stimulus_id=self._sid))
        return self._joined(), out

    def _adopt_spec(self, msg: Join, out: list[Instruction]) -> None:
        """A rejoining host brings the spec of the world it serves: a world this system
        does not have yet is rebuilt from it, without asking any host to start procs."""
        spec = msg.world
        assert spec is not None
        name = spec.world_id.name
        problem = check_world_name(name) or check_upsert_spec(spec)
        if problem is not None:
            out.append(
                Log(
                    logging.WARNING,
                    f"rejoin of {msg.proc_id}: ignoring its world spec: {problem}",
                    stimulus_id=self._sid,
                )
            )
            return
        world = self._world_for(name)
        if world.upserted or world.phase != ACTIVE:
            return
        self._generation += 1
        world.apply_spec(spec, self._generation)
        world.rebuilt = True
        out.append(
            Log(
                logging.INFO,
                f"world {name} rebuilt from the rejoin of {msg.proc_id}: shape {world.shape}, "
                f"{world.size} procs",
                stimulus_id=self._sid,
            )
        )
        if not world.procs:
            self._push(name, WorldStatusChanged(world=world.world_id, status=world.status), out)

    def _pid_on_host(self, rec: ProcRecord) -> str:
        pid = rec.pid if rec.pid else "?"
        return f"pid {pid} on {rec.host}" if rec.host else f"pid {pid}"

    def _joined(self) -> Joined:
        return Joined(
            execution_id=self.execution_id,
            supervision_update_timeout_s=self.supervision_update_timeout_s,
            system_time=self._wall(),
        )

    def _add_record(self, msg: Join, addr: ChannelAddr | None, out: list[Instruction]) -> None:
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
        self._set_addr(pid, addr)
        self._records[pid] = rec
        self._unknown_told.pop((pid, msg.incarnation), None)
        if addr is not None:  # (a detached client may give none: replies go back on its connection)
            out.append(Bind(pid, addr, stimulus_id=self._sid))
        if kind == "managing":
            self._managing[pid] = rec
        elif kind == "host":
            world = self._world_for(served_name(name))
            world.hosts[pid.rank] = rec
            if msg.rejoin:  # its procs run already: nothing to start
                world.assigned.add((pid.rank, msg.incarnation))
            if world.upserted and world.phase == ACTIVE:
                self._assign(world, rec, out)
        elif kind == "proc":
            world = self._world_for(name)
            world.procs[pid.rank] = rec
            if not world.created:
                world.created = True
                self._push(name, WorldStatusChanged(world=world.world_id, status=world.status), out)
            self._evaluate(world, now, out)

    @_stimulus("leave")
    def handle_leave(self, msg: Leave, requester: ProcId | None = None) -> Result:
        """`Leave`: a graceful exit; `Ok`. While the world is live the proc is ``Exited``."""
        out: list[Instruction] = []
        rec = self._records.get(msg.proc_id)
        if rec is None or not rec.joined:
            return Ok(), out
        if msg.incarnation and rec.incarnation and msg.incarnation != rec.incarnation:
            # an incarnation replaced since (cut off, recovered elsewhere, now stopping)
            return Ok(), out
        if rec.kind == "detached":
            # a beat already on its way when it left is dropped quietly (no warning, no
            # ProcStop): it is told, as far as `_tell_unknown` knows
            self._unknown_told[(rec.proc_id, rec.incarnation or 0)] = self._clock()
            self._forget(rec, f"left: {msg.reason}" if msg.reason else "left the system", out)
            out.append(Unbind(rec.proc_id, stimulus_id=self._sid))
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

    @_stimulus("upsert-world")
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
                    stimulus_id=self._sid,
                )
            )
            if rec.joined and rec.alive:
                rec.stop_sent = True
                stop = ProcStop(
                    timeout_s=self.proc_stop_timeout_s,
                    reason="rank out of range",
                    incarnation=rec.incarnation or 0,
                )
                out.append(Send(agent_of(rec.proc_id), stop, stimulus_id=self._sid))
            self._forget(rec, "rank out of range", out)
            out.append(Unbind(rec.proc_id, stimulus_id=self._sid))
        self._evaluate(world, now, out)
        for rank in sorted(world.hosts):
            self._assign(world, world.hosts[rank], out)
        out.append(
            Log(
                logging.INFO,
                f"world {name} upserted: shape {world.shape}, {size} procs, {world.status}",
                stimulus_id=self._sid,
            )
        )
        return WorldUpserted(status=world.world_status()), out

    @_stimulus("respawn-procs")
    def handle_respawn_procs(self, msg: RespawnProcs, requester: ProcId | None = None) -> Result:
        """`RespawnProcs`: `Ok` once each rank's host is asked to start it again, or
        `Rejected`. The failed records are dropped first, so the world waits for the new
        incarnations ("waiting for procs", not failing: no eviction) instead of failing.

        A rank whose host is gone moves to the world's live host that runs the fewest of
        its procs (with its local rank kept, so on GPU hosts it shares that device);
        without any live host it is rejected."""
        out: list[Instruction] = []
        name = msg.world_id.name
        world = self._worlds.get(name)
        if world is None or not world.created or world.phase != ACTIVE or world.size is None:
            why = "unknown" if world is None or not world.created else "not active"
            return self._reject(msg, requester, "not_found", f"world {name} is {why}", out)
        if world.env is None or not isinstance(world.env, Exec):
            text = f"world {name} was not started by hosts (Exec): its procs cannot be respawned"
            return self._reject(msg, requester, "invalid_argument", text, out)
        nph = world.num_procs_per_host
        plan: dict[int, list[int]] = {}
        for r in sorted(set(msg.ranks)):
            if not 0 <= r < world.size:
                text = f"rank {r} out of range for world {name} of size {world.size}"
                return self._reject(msg, requester, "invalid_argument", text, out)
            rec = world.procs.get(r)
            if rec is not None and not rec.failed:
                text = f"{rec.proc_id} is alive: only a failed proc is respawned"
                return self._reject(msg, requester, "conflict", text, out)
            host = world.hosts.get(r // nph)
            if host is None or not host.alive or host.stop_sent:
                host = self._least_loaded_host(world, plan)
            if host is None:
                text = (
                    f"the host of {world.world_id.proc(r)} is gone and world {name} has no "
                    "other live host: it cannot be respawned"
                )
                return self._reject(msg, requester, "conflict", text, out)
            plan.setdefault(host.proc_id.rank, []).append(r)
        for host_rank, ranks in plan.items():
            for r in ranks:
                rec = world.procs.get(r)
                if rec is not None:
                    if rec.pid is not None:
                        world.replaced.add((r, rec.pid))
                    self._drop_record(rec, out)  # its resolvers heard of its end already
            self._ask_respawn(world, world.hosts[host_rank], ranks, out)
        out.append(
            Log(logging.INFO, f"respawning {name} ranks {sorted(msg.ranks)}", stimulus_id=self._sid)
        )
        self._evaluate(world, self._clock(), out)
        return Ok(), out

    def _ask_respawn(
        self, world: WorldRecord, host: ProcRecord, ranks: list[int], out: list[Instruction]
    ) -> None:
        """Ask ``host`` to start ``ranks`` of ``world`` again (`SpawnProc`), remembered
        until it answers (`_respawning`)."""
        assert world.size is not None and world.env is not None
        nph = world.num_procs_per_host
        spawn = SpawnProc(
            world_id=world.world_id,
            env=world.env,
            procs=[
                ProcAssignment(proc_id=world.world_id.proc(r), rank=r, local_rank=r % nph)
                for r in ranks
            ],
            world_size=world.size,
            local_world_size=len(host_ranks(host.proc_id.rank, nph, world.size)),
            **self._spec_fields(world),
        )
        token = SpawnToken(
            world.name, world.incarnation, host.proc_id, host.incarnation, tuple(ranks)
        )
        self._respawning.setdefault(host.proc_id, []).append(token)
        out.append(
            Ask(agent_of(host.proc_id), spawn, self.rpc_timeout_s, token, stimulus_id=self._sid)
        )

    def _respawn_elsewhere(
        self, host: ProcId, tokens: list[SpawnToken], why: str, out: list[Instruction]
    ) -> None:
        """``host`` was lost, or did not answer (``why``), with the respawns ``tokens``
        asked of it: each of their ranks that has not joined is asked of the world's
        least loaded other live host instead, or, with none left, fails at once as a rank
        that died before joining, so that a recovery waiting for it ends with that reason
        instead of waiting out its bound."""
        for token in tokens:
            world = self._worlds.get(token.world)
            if world is None or world.incarnation != token.world_incarnation:
                continue
            if world.phase != ACTIVE or world.env is None:
                continue
            ranks = [r for r in token.ranks if world.world_id.proc(r) not in self._records]
            plan: dict[int, list[int]] = {}
            for r in ranks:
                other = self._least_loaded_host(world, plan, exclude=host)
                if other is None:
                    reason = (
                        f"its host {host} was lost before it started ({why}), and world "
                        f"{world.name} has no other live host"
                    )
                    exited = ProcExited(
                        proc_id=world.world_id.proc(r), host_proc=host, reason=reason
                    )
                    self._exit_before_join(exited, out)
                    continue
                plan.setdefault(other.proc_id.rank, []).append(r)
            for host_rank, moved in plan.items():
                target = world.hosts[host_rank]
                text = (
                    f"respawning {world.name} ranks {moved} on {target.proc_id} instead: "
                    f"{host} was lost before it started them"
                )
                out.append(Log(logging.INFO, text, stimulus_id=self._sid))
                self._ask_respawn(world, target, moved, out)

    @staticmethod
    def _spec_fields(world: WorldRecord) -> dict[str, Any]:
        """What a `SpawnProc` carries of the world's spec beyond its size and env, so that
        the host can give it back to a restarted system (`Join.world`)."""
        return {
            "shape": list(world.shape or ()),
            "num_procs_per_host": world.num_procs_per_host,
            "labels": dict(world.labels),
        }

    def _least_loaded_host(
        self, world: WorldRecord, plan: dict[int, list[int]], exclude: ProcId | None = None
    ) -> ProcRecord | None:
        """The world's live host (other than ``exclude``) running (and about to run,
        ``plan``) the fewest of its procs; the lowest rank among equals. None when no
        such host is alive."""
        live = [
            h for h in world.hosts.values() if h.alive and not h.stop_sent and h.proc_id != exclude
        ]
        if not live:
            return None
        load = {h.proc_id: len(plan.get(h.proc_id.rank, ())) for h in live}
        for rec in world.procs.values():
            if rec.alive and rec.host_proc in load:
                load[rec.host_proc] += 1
        return min(live, key=lambda h: (load[h.proc_id], h.proc_id.rank))

    def _assign(self, world: WorldRecord, host: ProcRecord, out: list[Instruction]) -> None:
        """Send host ``host`` its ranks of ``world`` (once per host and world incarnation),
        but for a rank that a respawn moved to another host and that is alive there."""
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
                    stimulus_id=self._sid,
                )
            )
            return
        lo = host.proc_id.rank * nph
        moved = {
            r
            for r in ranks
            if (rec := world.procs.get(r)) is not None
            and rec.alive
            and rec.host_proc is not None
            and rec.host_proc != host.proc_id
        }
        procs = [
            ProcAssignment(proc_id=world.world_id.proc(r), rank=r, local_rank=r - lo)
            for r in ranks
            if r not in moved
        ]
        if not procs:
            return
        spawn = SpawnProc(
            world_id=world.world_id,
            env=world.env,
            procs=procs,
            world_size=world.size,
            local_world_size=len(ranks),
            **self._spec_fields(world),
        )
        asked = tuple(a.rank for a in procs)
        token = SpawnToken(world.name, world.incarnation, host.proc_id, host.incarnation, asked)
        out.append(
            Ask(agent_of(host.proc_id), spawn, self.rpc_timeout_s, token, stimulus_id=self._sid)
        )

    @_stimulus("snapshot")
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
            activity=rec.activity if rec.joined and rec.health == ALIVE else "",
            counters=dict(rec.counters),
            resources=dict(rec.resources) if rec.joined and rec.health == ALIVE else {},
        )

    @_stimulus("world-state")
    def handle_world_state(self, msg: WorldState, requester: ProcId | None = None) -> Result:
        """`WorldState`: `WorldStateReply` whose state lists only unhealthy procs."""
        out: list[Instruction] = []
        now = self._clock()
        self._expire(now, out)
        state = self._world_state(msg.world_id.name)
        if state is None and self._awaiting_rejoins(now):
            return self._not_rejoined(f"world {msg.world_id.name}", out)
        return WorldStateReply(state=state), out

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

    @_stimulus("subscribe")
    def handle_subscribe(self, msg: Subscribe, requester: ProcId | None = None) -> Result:
        """`Subscribe`: `Subscribed` with the current state; events follow on ``port``."""
        out: list[Instruction] = []
        name = msg.world_id.name
        if not isinstance(name, str) or not name.isidentifier():
            return self._reject(
                msg, requester, "invalid_argument", f"invalid world name {name!r}", out
            )
        now = self._clock()
        self._expire(now, out)
        state = self._world_state(name)
        if state is None and self._awaiting_rejoins(now):
            return self._not_rejoined(f"world {name}", out)
        self._subs.setdefault(name, {})[msg.port] = None
        return Subscribed(state=state), out

    @_stimulus("unsubscribe")
    def handle_unsubscribe(self, msg: Unsubscribe, requester: ProcId | None = None) -> Result:
        """`Unsubscribe`: `Ok` (also when there was no such subscription)."""
        subs = self._subs.get(msg.world_id.name)
        if subs is not None:
            subs.pop(msg.port, None)
            if not subs:
                del self._subs[msg.world_id.name]
        return Ok(), []

    def handle_resolve(self, msg: Resolve, requester: ProcId | None = None) -> Result:
        """`Resolve`: `Resolved`; the requester becomes a resolver.

        A stimulus of kind ``resolve``, begun and ended by hand (`_stimulus`) on this hot
        path: a `Resolved` reply decides nothing.
        """
        self._begin("resolve")
        result = self._resolve(msg, requester)
        if type(result[0]) is not Resolved:  # (else quiet and nothing decided: no call)
            self._end(msg, result, True)
        return result

    def _resolve(self, msg: Resolve, requester: ProcId | None) -> Result:
        out: list[Instruction] = []
        pid = msg.proc_id
        rec = self._records.get(pid)
        if rec is None:
            if self._awaiting_rejoins(self._clock()):
                return self._not_rejoined(f"proc {pid}", out)
            return self._reject(
                msg, requester, "not_found", f"proc {pid} is not known to the system", out
            )
        if not rec.joined or not rec.alive:
            return self._reject(msg, requester, "not_found", f"peer gone: {rec.describe()}", out)
        if requester is not None and requester != pid:
            rec.resolvers.add(requester)
        return Resolved(addr=rec.addr, incarnation=rec.incarnation or 0), out
