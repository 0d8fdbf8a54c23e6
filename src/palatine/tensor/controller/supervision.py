"""Supervision of the worker world by the controller, sans-IO.

Two inputs feed one path:

* **push**: the ``Subscribed`` reply (as a `SupervisionResult` with ``source =
  "subscribe"``) and the system's ``ProcFailed`` / ``WorldGone`` /
  ``WorldStatusChanged`` / ``SystemStopping`` events;
* **poll**: every ``supervision_query_interval`` a ``WorldState{W}`` query, whose
  outcome comes back as a `SupervisionResult` (a backstop for a lost notification).

Whichever arrives first, each failed proc is reported **exactly once**: one `DeviceFailure` naming world, rank, proc, host, address, pid and
the cause (exit code, signal, heartbeat silence, lost connection, failed actor), plus
the op the rank had not completed. The world disappearing gives one ``world_gone``
Failure; the system not answering for ``system_loss_timeout`` gives one
``system_lost`` Failure.

Nothing here does I/O or reads a clock: methods take ``now`` and return instructions
(`palatine.protocol.controller`) for the ControllerActor to execute in order. Sending a
`Fail` to the client, or queueing it in `PendingFailures` before attach, and setting
``mesh_failed``, is the shell's part.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from typing import Literal

from palatine.config import format_seconds
from palatine.ids import ActorId, ProcId, WorldId
from palatine.protocol.controller import (
    CheckSupervision,
    ControllerParams,
    DeviceFailure,
    Fail,
    Instruction,
    LogLine,
    QueryWorldState,
    Schedule,
    SupervisionResult,
    WorkerProcRecord,
)
from palatine.protocol.supervision import (
    ALIVE,
    CONNECTION_FAILURE,
    EXITED,
    EXPIRED,
    ActorFailure,
    ProcSupervisionState,
    signal_text,
)
from palatine.protocol.system import (
    ProcFailed,
    SystemStopping,
    WorldGone,
    WorldStatusChanged,
    WorldSupervisionState,
)
from palatine.tensor.controller.history import History
from palatine.tensor.controller.stimuli import Stimuli

__all__ = [
    "MAX_PENDING_FAILURES",
    "MAX_STDERR_LINES",
    "PendingFailures",
    "SupervisionMonitor",
    "proc_failure",
    "is_failed",
]

MAX_PENDING_FAILURES = 1000
"""Failures kept while no client is attached; older ones are dropped and counted."""

MAX_STDERR_LINES = 20
"""Lines of a dead worker's stderr tail quoted in its Failure."""

_SILENT_FOR = re.compile(r"no heartbeat for ([0-9.]+) s")


def is_failed(state: ProcSupervisionState) -> bool:
    """The proc counts as failed: not Alive, or one of its actors failed."""
    return state.health != ALIVE or bool(state.failed_actors)


def _actor_text(actor_id: ActorId) -> str | None:
    """Canonical text of an actor id, or ``None`` for an internal placeholder (``.none[0]``)."""
    return None if actor_id.name in ("none", "unknown") else str(actor_id)


def _actor_error(failure: ActorFailure) -> str:
    """The failed actor's error text: its message, else its status without ``failed: ``."""
    if failure.message:
        return failure.message
    status = failure.status
    return status[len("failed: ") :] if status.startswith("failed: ") else status


def proc_failure(
    world: WorldId | str,
    rank: int,
    state: ProcSupervisionState,
    *,
    record: WorkerProcRecord | None = None,
    last_op: tuple[int, str] | None = None,
) -> DeviceFailure:
    """The `DeviceFailure` (kind ``proc_failed`` or ``actor_failed``) for one failed proc.

    Texts, e.g. ``worker rank 1 (worker[1], pid 4243 on host node3, addr
    tcp:10.0.0.3:41235) was killed by signal 9 (SIGKILL)``. pid, host and address come
    from the system's record, else from the bootstrap's ``record``. ``last_op`` adds
    ``; last op not completed by this rank: s17 train_step``; a stderr tail, when the
    host reported one, is quoted on the following lines.
    """
    proc_id = str(state.proc_id)
    pid = state.pid or (record.pid if record is not None else None)
    host = state.host or (record.host if record is not None else "")
    addr = state.addr or (record.addr if record is not None else "")
    where = [proc_id]
    if pid and host:
        where.append(f"pid {pid} on host {host}")
    elif pid:
        where.append(f"pid {pid}")
    elif host:
        where.append(f"on host {host}")
    if addr:
        where.append(f"addr {addr}")
    who = f"worker rank {rank} ({', '.join(where)})"

    actor = state.failed_actors[0] if state.failed_actors else None
    actor_id = _actor_text(actor.actor_id) if actor is not None else None
    actor_error = _actor_error(actor) if actor is not None else None
    reason = state.reason
    health = state.health
    if health == EXITED:
        if state.exit_signal is not None:
            text = f"{who} was {signal_text(state.exit_signal)}"
        elif state.exit_code is not None:
            text = f"{who} exited with code {state.exit_code}"
        else:
            text = f"{who} exited: {reason}" if reason else f"{who} exited"
    elif health == EXPIRED:
        m = _SILENT_FOR.search(reason)
        none_for = f" (none for {format_seconds(float(m.group(1)))} s)" if m else ""
        log_hint = f"check the log on host {host}" if host else "check the log on its host"
        text = (
            f"{who} stopped sending heartbeats{none_for}; it may be hung or its host "
            f"unreachable; {log_hint}"
        )
    elif health == CONNECTION_FAILURE:
        if reason.startswith("connection lost"):
            text = f"{who} {reason}"
        else:
            text = f"{who} connection lost: {reason}" if reason else f"{who} connection lost"
    else:
        # Proc alive, actor failed (an infrastructure error in the worker).
        short = ", ".join(
            p for p in (f"pid {pid}" if pid else "", f"host {host}" if host else "") if p
        )
        on = f"worker rank {rank} ({short})" if short else f"worker rank {rank} ({proc_id})"
        name = f"actor {actor_id}" if actor_id else "the worker actor"
        text = f"{name} on {on} failed: {actor_error or reason or 'unknown error'}"
    if health != ALIVE and actor is not None:
        name = f"actor {actor_id}" if actor_id else "its worker actor"
        text += f"; {name} had failed: {actor_error}"
    if last_op is not None:
        seq, label = last_op
        op = f"s{seq} {label}" if label else f"s{seq}"
        text += f"; last op not completed by this rank: {op}"
    tail = [ln for ln in state.stderr_tail if ln.strip()][-MAX_STDERR_LINES:]
    if tail:
        text += f"\nlast stderr lines of {proc_id}:\n" + "\n".join(f"  {ln}" for ln in tail)
    return DeviceFailure(
        kind="proc_failed" if health != ALIVE else "actor_failed",
        message=text,
        world=str(world),
        rank=rank,
        proc_id=proc_id,
        host=host or None,
        addr=addr or None,
        pid=pid or None,
        exit_code=state.exit_code,
        exit_signal=state.exit_signal,
        reason=(reason or (actor.status if actor is not None else "")) or None,
        actor_id=actor_id,
        actor_error=actor_error,
    )


class PendingFailures:
    """Failures detected before the client attached, delivered right after its attach.

    Keeps the newest ``limit`` (≤ 1,000); older ones are dropped and counted.
    """

    def __init__(self, limit: int = MAX_PENDING_FAILURES) -> None:
        self._queue: deque[DeviceFailure] = deque(maxlen=limit)
        self._dropped = 0

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, failure: DeviceFailure) -> None:
        """Queue one failure, dropping the oldest when full."""
        if len(self._queue) == self._queue.maxlen:
            self._dropped += 1
        self._queue.append(failure)

    def drain(self) -> tuple[list[DeviceFailure], int]:
        """Everything queued, in order, and how many older ones were dropped; empties it."""
        out, dropped = list(self._queue), self._dropped
        self._queue.clear()
        self._dropped = 0
        return out, dropped


class SupervisionMonitor:
    """Turns supervision inputs (polls, subscription events) into once-only Failures.

    The actor shell calls:

    * at ``init``: `tick` (queries at once, schedules the next ``CheckSupervision``) and
      sends ``Subscribe{W, port}``, posting the reply (or its error) as a
      `SupervisionResult` with ``source = "subscribe"``;
    * `handle` for every ``CheckSupervision``, `SupervisionResult`, ``ProcFailed``,
      ``WorldGone``, ``WorldStatusChanged`` and ``SystemStopping``;
    * `system_lost_failure` from ``on_stop`` when the proc stops for lack of the system.

    `dead_ranks` and `reported_procs` only grow and are never replaced, so other parts
    (the progress monitor) can hold them as live views. ``stimuli`` gives the ids the
    instructions carry and keeps the log of recent stimuli (shared with the controller's
    other core; its own if not given).
    """

    def __init__(
        self,
        *,
        worker_world: WorldId,
        system_addr: str,
        world_size: int,
        now: float,
        query_interval_s: float = 2.0,
        system_loss_timeout_s: float = 10.0,
        history: History | None = None,
        procs: Iterable[WorkerProcRecord] = (),
        stimuli: Stimuli | None = None,
    ) -> None:
        self._world = worker_world
        self._stim = stimuli if stimuli is not None else Stimuli()
        self._addr = system_addr
        self._n = world_size
        self._interval_s = query_interval_s
        self._loss_timeout_s = system_loss_timeout_s
        self._history = history
        self._records = {p.rank: p for p in procs}
        self.dead_ranks: set[int] = set()
        self.reported_procs: set[ProcId] = set()
        # (rank, pid) of incarnations a recovery replaced: their late reports are stale
        self._replaced: set[tuple[int, int]] = set()
        self._last_contact = now
        self._query_sent_at: float | None = None
        self._failing_since: float | None = None
        self._world_gone = False
        self._system_lost = False
        self._failures = 0

    @classmethod
    def from_params(
        cls,
        params: ControllerParams,
        now: float,
        history: History | None = None,
        stimuli: Stimuli | None = None,
    ) -> SupervisionMonitor:
        """A monitor configured from the ControllerActor's spawn parameters."""
        return cls(
            worker_world=params.worker_world,
            system_addr=params.system_addr,
            world_size=params.world_size,
            now=now,
            query_interval_s=params.supervision_query_interval_s,
            system_loss_timeout_s=params.system_loss_timeout_s,
            history=history,
            procs=params.worker_procs,
            stimuli=stimuli,
        )

    # ----------------------------------------------------------------- inspection

    @property
    def failed(self) -> bool:
        """At least one Failure was produced (the shell's ``mesh_failed``)."""
        return self._failures > 0

    @property
    def world_gone(self) -> bool:
        """The ``world_gone`` Failure was produced."""
        return self._world_gone

    @property
    def system_lost(self) -> bool:
        """The ``system_lost`` Failure was produced."""
        return self._system_lost

    @property
    def query_pending(self) -> bool:
        """A ``WorldState`` query is out and has not come back."""
        return self._query_sent_at is not None

    # ----------------------------------------------------------------- stimuli

    def handle(
        self,
        msg: CheckSupervision
        | SupervisionResult
        | ProcFailed
        | WorldGone
        | WorldStatusChanged
        | SystemStopping,
        now: float,
    ) -> list[Instruction]:
        """Dispatch one supervision input to its method (each a stimulus of its own kind:
        ``supervision-check``, ``supervision-poll`` / ``supervision-subscribe``,
        ``proc-failed``, ``world-gone``, ``world-status``, ``system-stopping``)."""
        if isinstance(msg, CheckSupervision):
            return self.tick(now)
        if isinstance(msg, SupervisionResult):
            return self.on_result(msg, now)
        if isinstance(msg, ProcFailed):
            return self.on_proc_failed(msg, now)
        if isinstance(msg, WorldGone):
            return self.on_world_gone(msg, now)
        if isinstance(msg, WorldStatusChanged):
            return self.on_world_status_changed(msg, now)
        if isinstance(msg, SystemStopping):
            return self.on_system_stopping(msg, now)
        raise TypeError(f"not a supervision input: {type(msg).__name__}")

    def tick(self, now: float) -> list[Instruction]:
        """``CheckSupervision``: check for system loss, query, reschedule.

        A query still out counts as failing (no new one is sent on top of it), unless it
        has been out for longer than ``system_loss_timeout`` (its outcome was lost).
        """
        st = self._stim
        st.begin("supervision-check")
        out = self._check_system_loss(now)
        sent = self._query_sent_at
        if sent is None or now - sent > self._loss_timeout_s:
            self._query_sent_at = now
            out.append(QueryWorldState(stimulus_id=st.sid))
        out.append(Schedule(self._interval_s, CheckSupervision(), stimulus_id=st.sid))
        return st.done(None, out, now)

    def on_result(self, result: SupervisionResult, now: float) -> list[Instruction]:
        """A ``WorldState`` answer or failure, or the ``Subscribe`` reply."""
        st = self._stim
        st.begin(f"supervision-{result.source}")
        return st.done(self._world, self._on_result(result, now), now)

    def _on_result(self, result: SupervisionResult, now: float) -> list[Instruction]:
        if result.source == "poll":
            self._query_sent_at = None
        if result.rebuilding:  # a restarted system answers: contact, but no state yet
            return self._contact(now)
        if result.error is not None:
            if result.source == "subscribe":
                return [
                    LogLine(
                        "warning",
                        f"cannot subscribe to supervision events of world {self._world} at "
                        f"system {self._addr}: {result.error}; relying on polling every "
                        f"{format_seconds(self._interval_s)} s",
                        stimulus_id=self._stim.sid,
                    )
                ]
            out: list[Instruction] = []
            # Every failing query is a warning until the system is declared lost;
            # after that the client has the failure and the retries go quiet.
            level: Literal["warning", "debug"] = "debug" if self._system_lost else "warning"
            if self._failing_since is None:
                self._failing_since = now
            out.append(
                LogLine(
                    level,
                    f"supervision query for world {self._world} to system {self._addr} "
                    f"failed: {result.error}; retrying every "
                    f"{format_seconds(self._interval_s)} s",
                    stimulus_id=self._stim.sid,
                )
            )
            out.extend(self._check_system_loss(now))
            return out
        out = self._contact(now)
        out.extend(self._on_state(result.state))
        return out

    def on_state(self, state: WorldSupervisionState | None, now: float) -> list[Instruction]:
        """A world state from a poll or the subscription: report new failures by rank.

        ``None`` means the system does not know the world any more. A stimulus of kind
        ``world-state``.
        """
        st = self._stim
        st.begin("world-state")
        return st.done(self._world, self._on_state(state), now)

    def _on_state(self, state: WorldSupervisionState | None) -> list[Instruction]:
        if state is None:
            return self._gone(None)
        if state.world_id != self._world:
            return []
        out: list[Instruction] = []
        for rank, proc in sorted(state.procs.items()):
            out.extend(self._report(rank, proc))
        return out

    def on_proc_failed(self, event: ProcFailed, now: float) -> list[Instruction]:
        """Pushed ``ProcFailed``: the same path as a poll hit."""
        if event.world != self._world:
            return []
        st = self._stim
        st.begin("proc-failed")
        out = self._contact(now)
        out.extend(self._report(event.rank, event.state))
        return st.done(event.state.proc_id, out, now)

    def on_world_gone(self, event: WorldGone, now: float) -> list[Instruction]:
        """Pushed ``WorldGone{W, reason}`` (``evicted: …`` or ``stopped``)."""
        if event.world != self._world:
            return []
        st = self._stim
        st.begin("world-gone")
        out = self._contact(now)
        out.extend(self._gone(event.reason))
        return st.done(event.world, out, now)

    def on_world_status_changed(self, event: WorldStatusChanged, now: float) -> list[Instruction]:
        """Logged at INFO; failures themselves arrive as ``ProcFailed`` / ``WorldGone``."""
        st = self._stim
        st.begin("world-status")
        out = self._contact(now)
        if event.world == self._world:
            why = f": {event.reason}" if event.reason else ""
            text = f"worker world {self._world} is {event.status}{why}"
            out.append(LogLine("info", text, stimulus_id=st.sid))
        return st.done(event.world, out, now)

    def on_system_stopping(self, event: SystemStopping, now: float) -> list[Instruction]:
        """Logged at INFO; the worlds' stop follows as ``WorldGone``."""
        st = self._stim
        st.begin("system-stopping")
        out = self._contact(now)
        why = f": {event.reason}" if event.reason else ""
        out.append(LogLine("info", f"system at {self._addr} is stopping{why}", stimulus_id=st.sid))
        return st.done(None, out, now)

    def system_lost_failure(self, now: float | None = None) -> list[Instruction]:
        """The ``system_lost`` Failure, if not produced yet; else nothing.

        Called by the check below, and by ``on_stop`` when the proc stops itself for lack
        of the system, so the client learns why before the controller goes away. A
        stimulus of kind ``system-lost`` (``now`` None: at the time of the last one).
        """
        st = self._stim
        st.begin("system-lost")
        return st.done(None, self._system_lost_failure(now), now)

    def _system_lost_failure(self, now: float | None) -> list[Instruction]:
        if self._system_lost:
            return []
        self._system_lost = True
        self._failures += 1
        if now is None:
            reason = "the controller proc is stopping: system lost"
        else:
            silent = format_seconds(round(now - self._last_contact, 1))
            reason = f"no supervision query answered for {silent} s"
        failure = DeviceFailure(
            kind="system_lost",
            message=(
                f"lost contact with system at {self._addr}; workers can no longer be supervised"
            ),
            world=str(self._world),
            reason=reason,
        )
        return [Fail(failure, stimulus_id=self._stim.sid)]

    # ----------------------------------------------------------------- internals

    def _contact(self, now: float) -> list[Instruction]:
        """The system answered: reset the loss clock; log the end of a failing streak."""
        self._last_contact = now
        since = self._failing_since
        if since is None:
            return []
        self._failing_since = None
        return [
            LogLine(
                "info",
                f"supervision queries to system {self._addr} answered again after "
                f"{now - since:.1f} s",
                stimulus_id=self._stim.sid,
            )
        ]

    def _check_system_loss(self, now: float) -> list[Instruction]:
        if not self._system_lost and now - self._last_contact > self._loss_timeout_s:
            return self._system_lost_failure(now)
        return []

    def revive(self, ranks: Iterable[int], records: dict[int, WorkerProcRecord]) -> None:
        """``ranks`` run again (a recovery): a new incarnation of each proc, watched anew
        (its failure is reported again), with its new pid and host for reports."""
        for r in ranks:
            self.dead_ranks.discard(r)
            record = records.get(r)
            if record is not None:
                old = self._records.get(r)
                if old is not None and old.pid is not None and old.pid != record.pid:
                    self._replaced.add((r, old.pid))
                self.reported_procs.discard(record.proc_id)
                self._records[r] = record
        if not self.dead_ranks and not self._world_gone and not self._system_lost:
            self._failures = 0

    def mark_ended(self, ranks: Iterable[int]) -> None:
        """The system has ``ranks`` ended (a death not reported here yet, or a stuck rank
        killed for a recovery): count them dead; their own report, if it comes, is still
        turned into a Failure once."""
        self.dead_ranks.update(r for r in ranks if 0 <= r < self._n)

    def record(self, rank: int) -> WorkerProcRecord | None:
        """What is known of rank ``rank``'s current proc (pid, host, its host's proc)."""
        return self._records.get(rank)

    def _report(self, rank: int, state: ProcSupervisionState) -> list[Instruction]:
        """One Failure for a newly failed proc; nothing for a healthy or reported one, nor
        for an incarnation a recovery has replaced (a late report naming its pid)."""
        if not is_failed(state) or state.proc_id in self.reported_procs:
            return []
        if state.pid is not None and (rank, state.pid) in self._replaced:
            return []
        self.reported_procs.add(state.proc_id)
        if 0 <= rank < self._n:
            self.dead_ranks.add(rank)
        self._failures += 1
        failure = proc_failure(
            self._world,
            rank,
            state,
            record=self._records.get(rank),
            last_op=self._last_op(rank),
        )
        return [Fail(failure, stimulus_id=self._stim.sid)]

    def _last_op(self, rank: int) -> tuple[int, str] | None:
        """The first op this rank is not known to have completed (from ``progress``)."""
        h = self._history
        if h is None or h.max_seq is None or not 0 <= rank < h.world_size:
            return None
        return h.op_at_or_after(h.progress(rank))

    def _gone(self, reason: str | None) -> list[Instruction]:
        """The one ``world_gone`` Failure."""
        if self._world_gone:
            return []
        self._world_gone = True
        self._failures += 1
        evicted = reason.startswith("evicted") if reason is not None else bool(self.reported_procs)
        if evicted:
            message = (
                f"worker world {self._world} was stopped by the system (evicted after "
                f"being unhealthy)"
            )
        else:
            message = f"worker world {self._world} was stopped"
        failure = DeviceFailure(
            kind="world_gone",
            message=message,
            world=str(self._world),
            reason=reason,
        )
        return [Fail(failure, stimulus_id=self._stim.sid)]
