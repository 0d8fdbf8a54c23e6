"""Typed messages of the system layer.

The proc agent's messages are in `palatine.protocol.agent`.

Every request here is answered on its ``reply_to`` port with the reply named in its
docstring or with `Rejected` (the caller raises `SystemRequestError`). One-way messages
say so. Messages subclass `palatine.wire.codec.Message`, so each has a stable
``type_id`` and is decoded by it; nested value structs are plain msgspec structs.

Wire invariants:

* Ids travel as id structs (`WorldId`, `ProcId`, `ActorId`, `PortId`); addresses travel
  as canonical channel-address text (``"unix:/run/x.sock"``, ``"tcp:127.0.0.1:5000"``),
  so this module does not depend on the channel layer.
* Durations end in ``_s``; times named ``since``, ``system_time`` and
  ``last_heartbeat`` are on the system's clock (``system_time`` is wall-clock seconds).
* Enumerations are ``str`` values. ``Join.mode`` is a plain ``str`` on purpose: an
  unknown mode must reach the system and be answered ``invalid_argument`` instead of
  failing to decode.
* `SystemSnapshot` encodes to JSON as exactly the ``palatine snapshot --json`` document
  (``msgspec.json.encode(snapshot)``): every id in it is text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar, get_args

import msgspec

from palatine.errors import SystemRequestError
from palatine.ids import PortId, ProcId, WorldId
from palatine.protocol.supervision import (
    PROC_MODES,
    ActorFailure,
    Health,
    ProcMode,
    ProcSupervisionState,
)
from palatine.wire.codec import Message

__all__ = [
    # value types
    "RejectCode",
    "REJECT_CODES",
    "Health",
    "ProcMode",
    "PROC_MODES",
    "WorldStatusName",
    "WORLD_STATUSES",
    "AgentStateName",
    "Local",
    "Exec",
    "WorldEnv",
    "WorldStatus",
    "ActorFailure",
    "ProcSupervisionState",
    "WorldSupervisionState",
    "SnapshotFilter",
    "FailedActorEntry",
    "ProcEntry",
    "WorldSnapshot",
    "ProcAssignment",
    "StartedProc",
    "FailedProc",
    "ActorSnapshot",
    "ChildProc",
    "StimulusEntry",
    "instruction_lines",
    "summary_text",
    # replies shared by many requests
    "Ok",
    "Rejected",
    # SystemActor requests and replies
    "Join",
    "Joined",
    "Leave",
    "UpsertWorld",
    "RespawnProcs",
    "WorldUpserted",
    "Snapshot",
    "SystemSnapshot",
    "Stimuli",
    "StimulusLog",
    "Stop",
    "StopAck",
    "SupervisionUpdate",
    "WorldState",
    "WorldStateReply",
    "Resolve",
    "Resolved",
    "ProcExited",
    "Subscribe",
    "Unsubscribe",
    "Subscribed",
    # events to subscribers
    "ProcFailed",
    "WorldStatusChanged",
    "WorldGone",
    "SystemStopping",
    # notices to resolvers
    "PeerGone",
    "AddressChanged",
]

RejectCode = Literal[
    "invalid_argument",
    "not_found",
    "already_exists",
    "conflict",
    "shutting_down",
    "unavailable",
    "internal",
]
"""The codes of `Rejected`."""

REJECT_CODES: tuple[str, ...] = get_args(RejectCode)

WorldStatusName = Literal["AwaitingCreation", "Unhealthy", "Live"]
"""Status strings of a world."""

WORLD_STATUSES: tuple[str, ...] = ("AwaitingCreation", "Unhealthy", "Live")

AgentStateName = Literal["AwaitingJoin", "Joined", "Stopping"]


# --------------------------------------------------------------------------- value types


class Local(msgspec.Struct, frozen=True, tag="Local"):
    """World environment: hosts create the procs inside their own process."""


class Exec(msgspec.Struct, frozen=True, tag="Exec"):
    """World environment: hosts run ``program`` (split like a shell) once per proc."""

    program: str


WorldEnv = Local | Exec


class WorldStatus(msgspec.Struct, kw_only=True):
    """``AwaitingCreation`` | ``Unhealthy(since, reason)`` | ``Live``.

    ``since`` (system clock) is the moment the world entered ``Unhealthy``; it is kept
    while the world stays Unhealthy. ``reason`` is the first failure in words, or
    ``waiting for procs: j/P joined``.
    """

    status: WorldStatusName
    since: float | None = None
    reason: str = ""


class WorldSupervisionState(msgspec.Struct, kw_only=True):
    """A world's status and its **unhealthy** procs only, keyed by rank.

    Ranks that failed before they ever joined are included.
    """

    world_id: WorldId
    status: WorldStatus
    procs: dict[int, ProcSupervisionState] = {}


class SnapshotFilter(msgspec.Struct, kw_only=True):
    """Snapshot filter: no worlds means all; every ``k=v`` must match exactly.

    ``proc_labels`` filters the procs inside each listed world; a world with no
    matching proc is still listed.
    """

    worlds: list[WorldId] = []
    world_labels: dict[str, str] = {}
    proc_labels: dict[str, str] = {}


class FailedActorEntry(msgspec.Struct, kw_only=True):
    """``{"actor_id", "status"}`` in a snapshot's ``failed_actors``."""

    actor_id: str
    status: str


class ProcEntry(msgspec.Struct, kw_only=True):
    """One proc in ``palatine snapshot --json``.

    The first eight fields are the public snapshot format, in this order; the others are
    documented additions (null, empty or absent when unknown): ``activity`` is what the proc
    was busy with at its last heartbeat, ``counters`` its running totals, ``resources``
    what it used of its machine then (`palatine.hosting.resources`; empty unless alive).
    """

    labels: dict[str, str]
    addr: str
    pid: int | None
    host: str
    health: Health
    exit_code: int | None
    exit_signal: int | None
    failed_actors: list[FailedActorEntry]
    reason: str | None = None
    host_proc: str | None = None
    last_heartbeat_age_s: float | None = None
    loop_lag_s: float | None = None
    activity: str = ""
    counters: dict[str, float] = {}
    resources: dict[str, float] = {}


class WorldSnapshot(msgspec.Struct, kw_only=True):
    """One world in ``palatine snapshot --json``; ``procs`` is keyed ``"W[r]"``."""

    status: WorldStatusName
    labels: dict[str, str]
    host_procs: list[str]
    procs: dict[str, ProcEntry]


class ProcAssignment(msgspec.Struct, kw_only=True):
    """One proc a host must create: ``local_rank = rank - h·N``."""

    proc_id: ProcId
    rank: int
    local_rank: int


class StartedProc(msgspec.Struct, kw_only=True):
    """A proc a host started (``pid`` is the child's OS pid, the host's own for Local)."""

    proc_id: ProcId
    pid: int


class FailedProc(msgspec.Struct, kw_only=True):
    """A proc a host could not start, e.g. ``cannot execute 'x': No such file or directory``."""

    proc_id: ProcId
    reason: str


class ActorSnapshot(msgspec.Struct, kw_only=True):
    """A live root actor (or child) in a proc's ledger."""

    type_name: str
    status: str
    processed: int = 0
    queued: int = 0
    current_handler: str | None = None
    processing_since: float | None = None
    handlers: dict[int, str] = {}
    children: dict[str, ActorSnapshot] = {}


class ChildProc(msgspec.Struct, kw_only=True):
    """A child process of a host, in the host's `ProcSnapshot`."""

    proc_id: ProcId
    pid: int | None
    state: str
    started_at: float | None = None
    exit: str | None = None


# --------------------------------------------------------------------------- shared replies


class Ok(Message, kw_only=True):
    """Plain acknowledgement (``Leave``, ``ProcExited``, ``Unsubscribe``)."""


class Rejected(Message, kw_only=True):
    """A request was refused; the caller raises ``SystemRequestError(code, message)``."""

    code: RejectCode
    message: str

    def to_error(self) -> SystemRequestError:
        """The exception a caller raises for this reply."""
        return SystemRequestError(self.code, self.message)


# --------------------------------------------------------------------------- SystemActor


class Join(Message, kw_only=True):
    """Register a proc with the system; replies `Joined`.

    ``mode`` is one of `PROC_MODES`; ``host_proc`` is the spawning host (from
    ``PALATINE_HOST_PROC_ID``); ``incarnation`` is random per process start, so a
    restarted proc is told apart from a retried join.

    A **rejoin** (``rejoin``) is the same proc joining a system that restarted at the
    same address: it brings the ``execution_id`` it joined before and, from a host, the
    spec of the world it serves (``world``), so that the new system rebuilds its
    registry from the procs that are still running instead of starting them again.
    """

    proc_id: ProcId
    addr: str
    labels: dict[str, str] = {}
    mode: str = "ManagedBySystem"
    pid: int = 0
    host: str = ""
    host_proc: ProcId | None = None
    incarnation: int = 0
    rejoin: bool = False
    execution_id: str = ""
    world: UpsertWorld | None = None


class Joined(Message, kw_only=True):
    """Reply to `Join`: the execution id, the system's expiry timeout, its wall time."""

    execution_id: str
    supervision_update_timeout_s: float
    system_time: float


class Leave(Message, kw_only=True):
    """A graceful exit is coming, so the closed connection that follows is not a failure.

    Replies `Ok`. While the proc's world is live, the record becomes ``Exited`` with
    ``reason``.
    """

    proc_id: ProcId
    reason: str = ""
    # the leaving incarnation (0: unknown): a replaced incarnation's late Leave is not
    # taken as its replacement's
    incarnation: int = 0


class UpsertWorld(Message, kw_only=True):
    """Create world ``world_id``; replies `WorldUpserted`."""

    world_id: WorldId
    shape: list[int]
    num_procs_per_host: int = 1
    env: WorldEnv = Local()
    labels: dict[str, str] = {}


class RespawnProcs(Message, kw_only=True):
    """Start a new incarnation of ``ranks`` of ``world_id``, whose procs failed, on the
    hosts that ran them; replies `Ok` once the hosts are asked (the new procs then join
    like any other, and the world is Live again when they have), or `Rejected` (a rank
    that is alive or unknown, a host that is gone, a world that is not an active
    `Exec` world). Meanwhile the world waits for them instead of being evicted."""

    world_id: WorldId
    ranks: list[int]


class WorldUpserted(Message, kw_only=True):
    """Reply to `UpsertWorld`: the world's status after the upsert."""

    status: WorldStatus


class Snapshot(Message, kw_only=True):
    """List worlds, hosts and procs; replies `SystemSnapshot`."""

    filter: SnapshotFilter = msgspec.field(default_factory=SnapshotFilter)


class SystemSnapshot(Message, kw_only=True):
    """Reply to `Snapshot`; its JSON is the ``palatine snapshot --json`` document."""

    execution_id: str
    worlds: dict[str, WorldSnapshot] = {}

    def rows(self) -> list[tuple[str, str, str, str, str, str, str, str]]:
        """One row per proc for the human table: world, status, proc, health, host, pid,
        addr, reason (a world without procs gets one row with empty proc columns)."""
        out: list[tuple[str, str, str, str, str, str, str, str]] = []
        for name, world in self.worlds.items():
            if not world.procs:
                out.append((name, world.status, "", "", "", "", "", ""))
            for proc, entry in world.procs.items():
                pid = "" if entry.pid is None else str(entry.pid)
                out.append(
                    (
                        name,
                        world.status,
                        proc,
                        entry.health,
                        entry.host,
                        pid,
                        entry.addr,
                        entry.reason or "",
                    )
                )
        return out


class StimulusEntry(msgspec.Struct, kw_only=True):
    """One stimulus the system handled, in `StimulusLog` (every field is text or a number).

    ``stimulus_id`` is ``<kind>-<n>`` (``n`` counts every stimulus since the system
    started) and is carried by every instruction the stimulus produced; ``time`` is
    wall-clock seconds; ``subject`` the world, proc or host it concerns (empty: none);
    ``reply`` the reply's type (``Rejected`` with its code and message; empty for a
    one-way stimulus); ``instructions`` what it decided, one line per instruction
    (``Send ProcStop to w[0].proc[0]``, ``Log WARNING: ...``), at most 20 and then a
    count of the rest.
    """

    stimulus_id: str
    time: float
    kind: str
    subject: str = ""
    reply: str = ""
    instructions: list[str] = []


_I = TypeVar("_I")

#: At most this many instructions are described in one `StimulusEntry`.
_SUMMARY_INSTRUCTIONS = 20
#: A text an instruction carries (a warning, a failure) is cut to this many characters.
_SUMMARY_TEXT = 200


def summary_text(text: str) -> str:
    """``text`` as an instruction's line of a `StimulusEntry` shows it: its first line, cut
    to 200 characters (``...`` marks a cut)."""
    line = text.partition("\n")[0]
    return line if len(line) <= _SUMMARY_TEXT else line[: _SUMMARY_TEXT - 3] + "..."


def instruction_lines(instructions: Sequence[_I], describe: Callable[[_I], str]) -> list[str]:
    """`StimulusEntry.instructions`: one line per instruction (``describe``), at most 20,
    then a count of the rest (``... and 3 more``)."""
    lines = [describe(i) for i in instructions[:_SUMMARY_INSTRUCTIONS]]
    more = len(instructions) - _SUMMARY_INSTRUCTIONS
    if more > 0:
        lines.append(f"... and {more} more")
    return lines


class Stimuli(Message, kw_only=True):
    """The system's recent stimuli (``palatine snapshot --stimuli``); replies
    `StimulusLog`. ``limit``: only the newest ``limit`` (None: all it keeps; >= 1)."""

    limit: int | None = None


class StimulusLog(Message, kw_only=True):
    """Reply to `Stimuli`: recent stimuli, oldest first (newest last).

    The system keeps the newest ``size`` (``PALATINE_STIMULUS_LOG_SIZE``); ``handled``
    counts every stimulus since it started. Heartbeats, health ticks and queries enter
    the log only when they decide something (instructions, or a rejection)."""

    execution_id: str
    size: int
    handled: int
    entries: list[StimulusEntry] = []

    def lines(self) -> list[str]:
        """One line per entry for people: ``12:03:04.250 join-17 w[0]: Joined; Bind ...``."""
        out: list[str] = []
        for e in self.entries:
            clock = time.strftime("%H:%M:%S", time.localtime(e.time))
            ms = int((e.time % 1) * 1000)
            head = f"{clock}.{ms:03d} {e.stimulus_id}"
            if e.subject:
                head += f" {e.subject}"
            said = ([e.reply] if e.reply else []) + e.instructions
            out.append(f"{head}: {'; '.join(said)}" if said else head)
        return out


class Stop(Message, kw_only=True):
    """Stop worlds (``None``: everything, then the system); replies `StopAck` at once."""

    worlds: list[WorldId] | None = None
    proc_timeout_s: float = 5.0


class StopAck(Message, kw_only=True):
    """Reply to `Stop`, sent as soon as the stop is initiated."""

    stopping: list[WorldId] = []
    already_stopping: list[WorldId] = []
    unknown: list[WorldId] = []


class SupervisionUpdate(Message, kw_only=True):
    """Heartbeat or immediate failure report. One-way (acked at channel level)."""

    state: ProcSupervisionState


class WorldState(Message, kw_only=True):
    """Supervision query; replies `WorldStateReply`."""

    world_id: WorldId


class WorldStateReply(Message, kw_only=True):
    """Reply to `WorldState`: ``state`` is ``None`` when the world has no record
    (never upserted, or removed by stop or eviction)."""

    state: WorldSupervisionState | None = None


class Resolve(Message, kw_only=True):
    """Ask for a proc's address; replies `Resolved`.

    Rejected ``not_found`` for an unknown proc (``proc W[9] is not known to the
    system``) and for a proc known dead (``peer gone: W[3] (pid 812 on node3) was
    killed by signal 9``).
    """

    proc_id: ProcId


class Resolved(Message, kw_only=True):
    """Reply to `Resolve`."""

    addr: str
    incarnation: int


class ProcExited(Message, kw_only=True):
    """A host's child ended; replies `Ok`.

    ``pid`` is ``None`` and ``reason`` says why when the program could not be started.
    """

    proc_id: ProcId
    host_proc: ProcId | None = None
    pid: int | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    reason: str = ""
    stderr_tail: list[str] = []


class Subscribe(Message, kw_only=True):
    """Push supervision events of ``world_id`` to ``port``; replies `Subscribed`."""

    world_id: WorldId
    port: PortId


class Unsubscribe(Message, kw_only=True):
    """End a subscription; replies `Ok`."""

    world_id: WorldId
    port: PortId


class Subscribed(Message, kw_only=True):
    """Reply to `Subscribe`: the current state (``None`` if the world has no record), so
    no failure can fall between this reply and the first event."""

    state: WorldSupervisionState | None = None


# --------------------------------------------------------------------------- events


class ProcFailed(Message, kw_only=True):
    """Event: a proc's first transition to unhealthy in its incarnation (once per proc)."""

    world: WorldId
    rank: int
    state: ProcSupervisionState


class WorldStatusChanged(Message, kw_only=True):
    """Event: the world's status changed (``status`` is a `WorldStatusName`)."""

    world: WorldId
    status: WorldStatusName
    reason: str = ""


class WorldGone(Message, kw_only=True):
    """Event: the world was removed; ``reason`` is ``evicted: …`` or ``stopped``.

    It is the last event of the subscription."""

    world: WorldId
    reason: str


class SystemStopping(Message, kw_only=True):
    """Event: ``Stop{None}`` began; everything managed is being stopped."""

    reason: str = ""


# --------------------------------------------------------------------------- to resolvers


class PeerGone(Message, kw_only=True):
    """Notice to a resolver's agent: ``proc_id`` is dead or removed.

    One-way. The resolver closes its Tx to that proc, drops the binding and fails
    pending calls with `PeerGoneError`.
    """

    proc_id: ProcId
    health: Health
    reason: str
    exit_code: int | None = None
    exit_signal: int | None = None
    pid: int | None = None
    host: str = ""


class AddressChanged(Message, kw_only=True):
    """Notice to a resolver's agent: ``proc_id`` re-joined as ``incarnation`` at ``addr``.

    One-way. The resolver rebinds; messages pending on the old Tx are returned.
    """

    proc_id: ProcId
    addr: str
    incarnation: int
