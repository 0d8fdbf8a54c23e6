"""Sans-IO liveness records: one per supervised proc, and the texts that describe failures.

The system keeps a `ProcRecord` per joined proc (workers, hosts, controller,
``ManagingSystem`` procs, and — unsupervised — detached clients), plus records for ranks
that a host reported dead before they ever joined. This module owns:

* the wire structs of supervision state: `ActorFailure` and `ProcSupervisionState`
  (re-exported by `palatine.protocol.system`, which carries them in its messages);
* `ProcRecord`, the mutable bookkeeping behind one ``ProcSupervisionState``; its health
  is *sticky* for an incarnation: once not ``Alive`` it never becomes ``Alive`` again;
* the exact failure texts: ``killed by signal 9 (SIGKILL)``, ``exited with code 3``,
  ``no heartbeat for 20.4 s (timeout 20 s)``, and the one-line "failure in words"
  ``W[3] (pid 812 on node3) was killed by signal 9`` used in world statuses, eviction
  warnings and ``peer gone`` errors.

Nothing here does I/O or reads a clock: times are passed in by the caller.
"""

from __future__ import annotations

import signal
import time
from typing import Literal

import msgspec

from palatine.config import format_seconds
from palatine.ids import ActorId, ProcId

__all__ = [
    "ALIVE",
    "CONNECTION_FAILURE",
    "DETACHED",
    "EXITED",
    "EXPIRED",
    "HEALTH_VALUES",
    "MANAGED_BY_SYSTEM",
    "MANAGING_SYSTEM",
    "PROC_MODES",
    "ActorFailure",
    "Health",
    "ProcMode",
    "ProcRecord",
    "ProcSupervisionState",
    "RecordKind",
    "clock_text",
    "exit_text",
    "expiry_reason",
    "signal_text",
]

Health = Literal["Alive", "Expired", "Exited", "ConnectionFailure"]
"""Health of a proc record."""

ProcMode = Literal["Detached", "ManagedBySystem", "ManagingSystem"]
"""Lifecycle mode declared at ``Join``."""

RecordKind = Literal["proc", "host", "managing", "detached"]
"""Where a record lives: a world's ``procs``, a world's host table, the managing set, or
nowhere (detached clients, only bound and remembered for ``Leave``)."""

ALIVE: Health = "Alive"
EXPIRED: Health = "Expired"
EXITED: Health = "Exited"
CONNECTION_FAILURE: Health = "ConnectionFailure"
HEALTH_VALUES: tuple[str, ...] = (ALIVE, EXPIRED, EXITED, CONNECTION_FAILURE)

DETACHED: ProcMode = "Detached"
MANAGED_BY_SYSTEM: ProcMode = "ManagedBySystem"
MANAGING_SYSTEM: ProcMode = "ManagingSystem"
PROC_MODES: tuple[str, ...] = (DETACHED, MANAGED_BY_SYSTEM, MANAGING_SYSTEM)


class ActorFailure(msgspec.Struct, kw_only=True):
    """A root actor of a proc that ended ``Failed``; ``status`` is its failure display.

    Example ``status``: ``failed: serving worker[1].worker[0]: processing error: …``.
    """

    actor_id: ActorId
    status: str
    message: str = ""
    traceback: str = ""


class ProcSupervisionState(msgspec.Struct, kw_only=True):
    """Supervision state of one proc: identity, health and liveness.

    Wire invariants: a heartbeat (``SupervisionUpdate``) fills only ``proc_id``, ``addr``,
    ``health = Alive``, ``failed_actors``, ``incarnation``, ``loop_lag_s``, ``activity``,
    ``counters`` and ``resources``; the system
    fills the rest when it reports a record. ``last_heartbeat`` is a time on the system's
    monotonic clock (compare it with ``Joined.system_time`` only through ages), ``None``
    for a rank that never joined.
    """

    proc_id: ProcId
    addr: str = ""
    labels: dict[str, str] = {}
    mode: str = MANAGED_BY_SYSTEM
    pid: int | None = None
    host: str = ""
    host_proc: ProcId | None = None
    incarnation: int = 0
    health: Health = ALIVE
    failed_actors: list[ActorFailure] = []
    exit_code: int | None = None
    exit_signal: int | None = None
    reason: str = ""
    last_heartbeat: float | None = None
    loop_lag_s: float = 0.0
    stderr_tail: list[str] = []
    # what the proc is busy with, as its heartbeat saw it (a tensor worker: its running op)
    activity: str = ""
    # running totals the proc reports with each heartbeat (`palatine.core.proc.Proc.counters`)
    counters: dict[str, float] = {}
    # what it uses of its machine (`palatine.hosting.resources`: cpu_percent, rss_bytes,
    # gpu_util_percent, gpu_mem_bytes), read by its heartbeat thread
    resources: dict[str, float] = {}


def signal_text(sig: int) -> str:
    """``killed by signal 9 (SIGKILL)``; an unnamed signal shows only its number."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        return f"killed by signal {sig}"
    return f"killed by signal {sig} ({name})"


def exit_text(exit_code: int | None, exit_signal: int | None, reason: str = "") -> str:
    """The record reason of an ended process: signal, else exit code, else ``reason``."""
    if exit_signal is not None:
        return signal_text(exit_signal)
    if exit_code is not None:
        return f"exited with code {exit_code}"
    return reason or "exited"


def expiry_reason(silent_for_s: float, timeout_s: float) -> str:
    """``no heartbeat for 20.4 s (timeout 20 s)``."""
    return f"no heartbeat for {silent_for_s:.1f} s (timeout {format_seconds(timeout_s)} s)"


def clock_text(wall_time: float) -> str:
    """Local wall-clock time of day, ``12:03:04``, for messages humans read."""
    return time.strftime("%H:%M:%S", time.localtime(wall_time))


class ProcRecord:
    """The system's mutable record of one proc incarnation (or of a rank that never joined).

    ``joined`` is False for a rank a host reported dead before it joined; such a record
    has ``addr == ""`` and no incarnation. ``failed_at`` is the first moment this
    incarnation was unhealthy (failed health or a failed actor); ``reported`` says whether
    ``ProcFailed`` has been pushed for it (at most once per incarnation).
    """

    __slots__ = (
        "_failed_actor_ids",
        "addr",
        "checking",
        "declared_wall",
        "exit_code",
        "exit_signal",
        "failed_actors",
        "failed_at",
        "health",
        "host",
        "host_proc",
        "incarnation",
        "joined",
        "kind",
        "labels",
        "last_heartbeat",
        "left",
        "loop_lag_s",
        "activity",
        "counters",
        "resources",
        "mode",
        "pid",
        "proc_id",
        "reason",
        "reported",
        "resolvers",
        "stderr_tail",
        "stop_sent",
        "zombie_told_at",
    )

    def __init__(
        self,
        proc_id: ProcId,
        kind: RecordKind,
        *,
        addr: str = "",
        labels: dict[str, str] | None = None,
        mode: str = MANAGED_BY_SYSTEM,
        pid: int | None = None,
        host: str = "",
        host_proc: ProcId | None = None,
        incarnation: int | None = None,
        joined: bool = True,
        now: float | None = None,
    ) -> None:
        self.proc_id = proc_id
        self.kind: RecordKind = kind
        self.addr = addr
        self.labels: dict[str, str] = dict(labels) if labels else {}
        self.mode = mode
        self.pid = pid
        self.host = host
        self.host_proc = host_proc
        self.incarnation = incarnation
        self.joined = joined
        self.health: Health = ALIVE
        self.failed_actors: list[ActorFailure] = []
        self._failed_actor_ids: set[ActorId] = set()
        self.exit_code: int | None = None
        self.exit_signal: int | None = None
        self.reason = ""
        self.stderr_tail: list[str] = []
        self.last_heartbeat: float | None = now
        self.loop_lag_s = 0.0
        self.activity = ""  # what its last heartbeat said it was busy with
        self.counters: dict[str, float] = {}  # its running totals, as last reported
        self.resources: dict[str, float] = {}  # its CPU, memory and GPU, as last reported
        self.failed_at: float | None = None
        self.declared_wall: float | None = None
        self.reported = False
        # Procs that resolved this one and must hear PeerGone / AddressChanged.
        self.resolvers: set[ProcId] = set()
        self.stop_sent = False  # told to stop: its exit is expected, not a failure
        self.left = False  # sent Leave: the closed connection that follows is expected
        self.checking = False  # a grace timer or liveness probe is outstanding
        self.zombie_told_at: float | None = None

    def __repr__(self) -> str:
        return f"ProcRecord({self.proc_id}, {self.kind}, {self.health})"

    @property
    def alive(self) -> bool:
        """Health is ``Alive`` (failed actors do not change health)."""
        return self.health == ALIVE

    @property
    def failed(self) -> bool:
        """The proc counts as failed for its world: not Alive, or an actor failed."""
        return self.health != ALIVE or bool(self.failed_actors)

    @property
    def supervised(self) -> bool:
        """Heartbeats, exits and connection losses apply (every mode but Detached)."""
        return self.kind != "detached"

    def who(self) -> str:
        """``W[3] (pid 812 on node3)``; the parenthesis shows what is known."""
        if self.pid and self.host:
            return f"{self.proc_id} (pid {self.pid} on {self.host})"
        if self.pid:
            return f"{self.proc_id} (pid {self.pid})"
        if self.host:
            return f"{self.proc_id} (on {self.host})"
        return str(self.proc_id)

    def describe(self) -> str:
        """The failure in words: ``W[3] (pid 812 on node3) was killed by signal 9``."""
        who = self.who()
        if self.health == EXITED:
            if self.exit_signal is not None:
                return f"{who} was killed by signal {self.exit_signal}"
            if self.exit_code is not None:
                return f"{who} exited with code {self.exit_code}"
            return f"{who} exited: {self.reason}"
        if self.health == EXPIRED:
            return f"{who} stopped sending heartbeats: {self.reason}"
        if self.health == CONNECTION_FAILURE:
            return f"{who} failed: {self.reason}"
        if self.failed_actors:
            first = self.failed_actors[0]
            return f"{who}: actor {first.actor_id} {first.status}"
        return f"{who} is healthy"

    def add_failed_actors(self, failures: list[ActorFailure]) -> bool:
        """Merge reported actor failures (the list only grows); True if any was new."""
        added = False
        for failure in failures:
            if failure.actor_id not in self._failed_actor_ids:
                self._failed_actor_ids.add(failure.actor_id)
                self.failed_actors.append(failure)
                added = True
        return added

    def set_exit(
        self,
        exit_code: int | None,
        exit_signal: int | None,
        reason: str,
        stderr_tail: list[str] | None,
    ) -> None:
        """Record how the process ended (health ``Exited``), refining earlier verdicts."""
        self.health = EXITED
        self.exit_code = exit_code
        self.exit_signal = exit_signal
        self.reason = exit_text(exit_code, exit_signal, reason)
        if stderr_tail:
            self.stderr_tail = list(stderr_tail)

    def to_state(self) -> ProcSupervisionState:
        """The wire form of this record."""
        return ProcSupervisionState(
            proc_id=self.proc_id,
            addr=self.addr,
            labels=dict(self.labels),
            mode=self.mode,
            pid=self.pid,
            host=self.host,
            host_proc=self.host_proc,
            incarnation=self.incarnation or 0,
            health=self.health,
            failed_actors=list(self.failed_actors),
            exit_code=self.exit_code,
            exit_signal=self.exit_signal,
            reason=self.reason,
            last_heartbeat=self.last_heartbeat,
            loop_lag_s=self.loop_lag_s,
            stderr_tail=list(self.stderr_tail),
        )
