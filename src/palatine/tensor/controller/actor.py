"""The ControllerActor: a shell over sans-IO cores.

It serves one client and owns three cores that never do I/O:

* `History`: dependencies, results and refs of the client's invocations;
* `ProgressMonitor`: the stall deadline, probes, checks and stall reports;
* `SupervisionMonitor`: once-only Failures from polls and pushed system events.

Handlers feed their messages to the cores and execute the returned instructions
(`palatine.protocol.controller.Instruction`, one ``match`` case each). All handlers but
one return without waiting for a remote reply: supervision queries, subscriptions and
the stall report's progress queries and stack dumps (`palatine.tensor.controller.stalls`)
run as tasks of the actor whose outcome is posted back to it as a message.

The one that awaits is `on_recover`: the reply to `Recover` is the outcome of the
recovery (`palatine.tensor.controller.recovery`: kill what is left of the ranks, respawn
their procs, wait until they joined, spawn their workers), every step bounded by the
spawn timeout. While it waits the actor handles no other message, so the cores see a
recovery as one step, and its failure is the error reply the client's recovery raises.
The other handlers catch their own errors; messages from strangers, out-of-range ranks
and bad Sends are dropped with a rate-limited warning.

Client commands (`Send`) and the controller's own probes are cast, undecoded, to the gang
``W.<worker_name>`` through one fan-out tree rooted in this actor's mailbox, so every
worker receives them in send order. A probe of the newest seq waits for the client's
next message, so it never overtakes the Send that executes that seq.

The client: the first `Attach` wins and gets the `AttachReply` plus the Failures queued
before it; any later one is rejected with a text that says why. A `Detach` stops the
worker and controller worlds cleanly; a client that stays silent past
``client_liveness_timeout_s`` (checked by a `CheckClient` timer) or whose messages come
back undeliverable is *lost*, and the worlds are stopped with the reason logged. Both
ends go through the system's `Stop`, asked at most once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, assert_never

from palatine import config
from palatine.core.actor import Actor, handler
from palatine.core.comm import Cast, RankSet, cast_envelope, normalize
from palatine.core.proc import Proc, StopActor
from palatine.errors import SystemRequestError, error_text
from palatine.ids import SYSTEM_ACTOR, ActorId, GangId, PortId
from palatine.protocol.controller import (
    CONTROLLER_ACTOR_TYPE,
    Attach,
    AttachRejected,
    AttachReply,
    Batch,
    CheckSupervision,
    CheckWorkerProgress,
    ClientState,
    ControllerParams,
    DebuggerMessage,
    Detach,
    DeviceFailure,
    DropRefs,
    Fail,
    Failure,
    FetchResult,
    Instruction,
    Introspect,
    IntrospectReply,
    KeepAlive,
    Log,
    LogLine,
    Node,
    QueryWorldState,
    Recover,
    Recovered,
    RemoteFunctionFailed,
    RequestStacks,
    Result,
    Results,
    Schedule,
    Send,
    SendProbe,
    StallReport,
    Status,
    SupervisionResult,
    Warn,
)
from palatine.protocol.system import (
    ProcFailed,
    Stop,
    Subscribe,
    SystemStopping,
    WorldGone,
    WorldState,
    WorldStatusChanged,
)
from palatine.protocol.worker import PeersLost, RequestStatus, Slice
from palatine.tensor.controller.history import History
from palatine.tensor.controller.progress import ProgressMonitor
from palatine.tensor.controller.recovery import recover_ranks
from palatine.tensor.controller.stalls import collect_stall_report
from palatine.tensor.controller.stimuli import Stimuli
from palatine.tensor.controller.supervision import PendingFailures, SupervisionMonitor
from palatine.wire.codec import Message, encode_message
from palatine.wire.envelope import ENC_MSGPACK, Envelope

__all__ = ["ControllerActor"]

log = logging.getLogger(__name__)

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
_DROP_LOG_PERIOD_S = 10.0
#: How long the workers an engine spawned in adopted procs have to stop at its end.
STOP_WORKER_S = 5.0
_RANKSET_CACHE = 1024
_REQUEST_STATUS_TID = RequestStatus.__palatine_type_id__


class CheckClient(Message, kw_only=True):
    """Timer: is the attached client still sending?"""


class ReleaseHeld(Message, kw_only=True):
    """Timer: report the held collective errors whose wait for a lost peer is over."""


def _short_id(actor: ActorId) -> str:
    """``controller[0].root`` for a root actor (pid 0), else the full text."""
    return f"{actor.proc}.{actor.name}" if actor.pid == 0 else str(actor)


class ControllerActor(Actor):
    """Drives the worker world for one client: history, casts, progress, supervision."""

    __palatine_name__ = CONTROLLER_ACTOR_TYPE
    Params = ControllerParams

    def __init__(self, params: ControllerParams) -> None:
        self.params = params
        self.n = params.world_size
        self.world = params.worker_world
        self.gang = GangId(params.worker_world, params.worker_name)
        self.client: ActorId | None = None
        self.client_state: ClientState = "waiting"
        self.exit_reason: str | None = None
        self.pending = PendingFailures()
        self.mesh_failed = False
        self.last_client_message_at = 0.0
        self.history = History(params.world_size)
        self.stall_reports = 0  # stalls found (one report each)
        # the cores' stimulus ids and log of recent stimuli (`Introspect` returns it)
        self.stimuli = Stimuli(config.get().stimulus_log_size)
        self.supervision: SupervisionMonitor | None = None
        self.progress: ProgressMonitor | None = None
        self._records = {p.rank: p for p in params.worker_procs}
        self._fanout = config.get().cast_fanout
        self._rpc_s = config.get().rpc_timeout_s
        self._ranksets: dict[tuple[Any, ...], RankSet] = {}
        self._dropped: dict[str, list[float]] = {}
        self._timers: list[asyncio.TimerHandle] = []
        self._worlds_stop_requested = False
        # Called once the worlds are being stopped: messages to them come back from then on,
        # as expected (the bootstrap quiets its system client's returns with it).
        self.on_stop_worlds: Callable[[], None] | None = None
        # Probes of the newest seq wait until the client's next message (its Send).
        self._settled = True
        self._node_at = 0.0
        self._deferred: list[SendProbe] = []
        self._batching = False  # inside a Batch: settle once, after its last Send
        # Errors of a collective losing its connection to a peer (`WorkerError.peer_lost`),
        # each with the time it is reported after all: held so that the supervision can
        # name the lost peer first (`_fail` drops them: the failure covers them), and the
        # same fault surfaces as the same DeviceException whatever the library raised.
        self._held: list[tuple[float, RemoteFunctionFailed]] = []
        self._peer_loss_grace_s = config.get().peer_loss_grace_s

    # ------------------------------------------------------------------ lifecycle

    async def init(self) -> None:
        """Start supervision at once: first poll, subscription, client timer."""
        now = self._now()
        self.supervision = SupervisionMonitor.from_params(
            self.params, now, self.history, self.stimuli
        )
        self.progress = ProgressMonitor.from_params(
            self.params, self.history, self.supervision.dead_ranks, self.stimuli
        )
        self.cx.spawn_task(self._subscribe())
        # A restarted system has no subscriptions: subscribe again once rejoined.
        Proc.of(self.cx).rejoin_hooks.append(self._subscribe_again)
        self._execute(self.supervision.tick(now))
        self._schedule(self._client_check_period(), CheckClient())
        # reported with the proc's heartbeats (the system's metrics)
        counters = Proc.of(self.cx).counters
        counters["controller_invocations"] = lambda: float(self.history.max_seq or 0)
        counters["controller_stalls"] = lambda: float(self.stall_reports)

    async def on_stop(self, reason: str) -> None:
        """Cancel timers; if the proc stops for lack of the system, say so first."""
        for t in self._timers:
            t.cancel()
        self._timers.clear()
        if self._system_lost() and self.supervision is not None:
            self._execute(self.supervision.system_lost_failure(None))
            await asyncio.sleep(0.05)  # let the Failure reach the channel before the proc closes

    def _system_lost(self) -> bool:
        """The proc stops for want of the system: lost, or it refused the proc's rejoin."""
        agent = Proc.of(self.cx).instance(self.cx.actor_id.proc.actor("proc"))
        if agent is None:
            return False
        hb = getattr(agent.actor, "heartbeat", None)
        return bool(getattr(hb, "lost", False) or getattr(agent.actor, "refused", None))

    # ------------------------------------------------------------------ helpers

    def _now(self) -> float:
        return self.cx.proc.loop.time()

    def _schedule(self, delay_s: float, msg: Any) -> None:
        timers = self._timers
        if len(timers) > 64:
            timers[:] = [t for t in timers if not t.cancelled() and t.when() > self._now()]
        timers.append(self.cx.schedule(delay_s, msg))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self.cx.spawn_task(coro)

    def _post_self(self, msg: Any) -> None:
        self.cx.tell_self(msg)

    def _to_client(self, msg: Any) -> None:
        """Send to the attached client; nothing is sent before attach or after it ended."""
        client = self.client
        if client is not None and self.client_state == "attached":
            self.cx.mailbox.tell(client, msg)

    def _drop(self, kind: str, text: str) -> None:
        """Warn about a dropped message at most once per kind per 10 s (with a count)."""
        now = time.monotonic()
        slot = self._dropped.get(kind)
        if slot is not None and now - slot[0] < _DROP_LOG_PERIOD_S:
            slot[1] += 1
            return
        extra = f" ({int(slot[1])} similar dropped since)" if slot and slot[1] else ""
        self._dropped[kind] = [now, 0]
        log.warning("%s: %s; dropped%s", self.cx.actor_id, text, extra)

    def _worker_ok(self, what: str, rank: int) -> bool:
        """Worker replies count only while a client is attached and name a real rank."""
        if self.client_state in ("detached", "lost"):
            return False  # stragglers while the worlds stop: expected, not worth a warning
        if self.client_state != "attached":
            self._drop(
                f"early-{what}", f"{what} from worker rank {rank} while no client is attached"
            )
            return False
        if not 0 <= rank < self.n:
            self._drop(
                f"rank-{what}",
                f"{what} names rank {rank} outside worker world {self.world} of size {self.n}",
            )
            return False
        return True

    def _results(self, reports: Iterable[tuple[int, Any]]) -> None:
        client = self.client
        if client is None or self.client_state != "attached":
            return
        results = [Result(seq=seq, result=outcome) for seq, outcome in reports]
        if len(results) == 1:
            self.cx.mailbox.tell(client, results[0])
        elif results:
            self.cx.mailbox.tell(client, Results(results=results))

    # ------------------------------------------------------------------ instructions

    def _execute(self, out: Iterable[Instruction]) -> None:
        """Carry out the cores' instructions, in order (one case per `Instruction`)."""
        for ins in out:
            match ins:
                case Schedule():
                    self._schedule(ins.delay_s, ins.timer)
                case SendProbe():
                    self._probe(ins)
                case Fail():
                    self._fail(ins.failure)
                case Warn():
                    if log.isEnabledFor(logging.DEBUG):
                        log.warning("[%s] %s", ins.stimulus_id, ins.message)
                    else:
                        log.warning("%s", ins.message)
                    self._to_client(Log(level="warn", message=ins.message, details=ins.details))
                case LogLine():
                    level = _LEVELS.get(ins.level, logging.INFO)
                    if log.isEnabledFor(logging.DEBUG):
                        log.log(level, "[%s] %s", ins.stimulus_id, ins.message)
                    else:
                        log.log(level, "%s", ins.message)
                case QueryWorldState():
                    self._spawn(self._query_world_state())
                case RequestStacks():
                    self.stall_reports += 1
                    self._spawn(self._stall_report(ins))
                case _:
                    assert_never(ins)

    def _probe(self, probe: SendProbe) -> None:
        """Cast ``RequestStatus{seq, controller: true}``, unless it would overtake a Send.

        A Node is followed by the Send that executes it. A probe of the newest seq cast
        between the two would reach the workers before the command and be answered at
        once ("passed s") although ``s`` has not even started. Such a probe waits until
        the client's next Send or Node has been handled (or one check interval).
        """
        max_seq = self.history.max_seq
        if not self._settled and max_seq is not None and probe.seq >= max_seq:
            self._deferred.append(probe)
            return
        msg = RequestStatus(seq=probe.seq, controller=True)
        self._cast(
            _REQUEST_STATUS_TID, ENC_MSGPACK, encode_message(msg), normalize(probe.ranks, self.n)
        )

    def _settle(self) -> None:
        """The client moved past its last Node: deferred probes may go out now."""
        self._settled = True
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            now = self._now()
            for probe in deferred:
                self._probe(probe)
                if self.progress is not None:
                    self.progress.probe_cast(probe.seq, now)

    def _fail(self, failure: DeviceFailure) -> None:
        self.mesh_failed = True
        log.error("%s", failure.message)
        if self.client_state == "waiting":
            self.pending.push(failure)
        else:
            self._to_client(Failure(failure=failure))
        if failure.kind == "proc_failed" and failure.rank is not None:
            self._tell_peers_lost(failure)
        if self._held:
            for _at, held in self._held:
                log.debug("s%d on rank %d: %s (covered by: %s)", held.seq, held.error.rank,
                          held.error.message, failure.message.splitlines()[0])  # fmt: skip
            self._held.clear()

    def _tell_peers_lost(self, failure: DeviceFailure) -> None:
        """Tell every other live rank that ``failure``'s rank is lost, so that palatine's
        collectives waiting for it end now (`palatine.tensor.worker.peers`)."""
        assert failure.rank is not None
        msg = PeersLost(
            ranks=[failure.rank],
            reason=failure.message.splitlines()[0],
            pids=[failure.pid or 0],
        )
        dead = self.supervision.dead_ranks if self.supervision is not None else set()
        for r in range(self.n):
            if r != failure.rank and r not in dead:
                self.cx.mailbox.tell(self.gang.actor(r), msg)

    @handler
    def on_release_held(self, msg: ReleaseHeld) -> None:
        now = self._now()
        due = [m for at, m in self._held if at <= now]
        self._held = [(at, m) for at, m in self._held if at > now]
        for m in due:
            self._remote_function_failed(m)

    def _cast(self, type_id: int, encoding: int, data: bytes, ranks: RankSet) -> None:
        if not ranks:
            return
        cast = Cast(
            origin=self.cx.actor_id,
            gang=self.gang,
            gang_size=self.n,
            ranks=ranks,
            fanout=self._fanout,
            type_id=type_id,
            encoding=encoding,
            data=data,
        )
        cast_envelope(self.cx.mailbox, cast)

    # ------------------------------------------------------------------ client commands

    @handler
    def on_batch(self, msg: Batch) -> None:
        """A client flush: its Nodes, then its Sends, then its DropRefs (`Batch`)."""
        if not self._from_client("Batch"):
            return
        # Probes of the newest seq wait for the whole batch: its Sends execute its Nodes.
        self._settled = False
        self._batching = True
        try:
            for node in msg.nodes:
                self._node(node)
            for send in msg.sends:
                self._send(send)
        finally:
            self._batching = False
        self._settle()
        if msg.drop_refs:
            self.history.delete_invocations_for_refs(msg.drop_refs)

    @handler
    def on_node(self, msg: Node) -> None:
        if self._from_client("Node"):
            self._node(msg)

    def _node(self, msg: Node) -> None:
        """Record the invocation; eager error Results; arm the deadline, maybe probe."""
        if not self._batching:
            self._settle()
        try:
            reports = self.history.add_invocation(msg.seq, msg.uses, msg.defs, msg.label)
        except ValueError as e:
            self._to_client(Log(level="error", message=str(e)))
            return
        if reports:
            self._results(reports)
        self._settled = False
        now = self._node_at = self._now()
        assert self.progress is not None
        out = self.progress.on_node(now)
        if out:
            self._execute(out)

    @handler
    def on_drop_refs(self, msg: DropRefs) -> None:
        if self._from_client("DropRefs"):
            self.history.delete_invocations_for_refs(msg.refs)

    @handler
    def on_send(self, msg: Send) -> None:
        if self._from_client("Send"):
            self._send(msg)

    def _send(self, msg: Send) -> None:
        """Cast the opaque command to the union of the slices."""
        ranks = self._rank_set(msg.ranks)
        if ranks is not None:
            m = msg.message
            self._cast(m.type_id, m.encoding, m.data, ranks)
        if not self._settled and not self._batching:
            self._settle()

    def _rank_set(self, slices: list[Slice]) -> RankSet | None:
        """The normalized union of ``slices``; None (with a Log) when it is invalid."""
        key = tuple((s.offset, tuple(s.sizes), tuple(s.strides)) for s in slices)
        cached = self._ranksets.get(key)
        if cached is not None:
            return cached
        n = self.n
        try:
            selected: set[int] = set()
            for s in slices:
                selected.update(s.ranks())
        except ValueError as e:
            self._bad_send(f"Send has an invalid slice ({e}); dropped")
            return None
        if not selected:
            self._bad_send("Send selects no rank; dropped")
            return None
        outside = sorted(r for r in selected if not 0 <= r < n)
        if outside:
            self._bad_send(
                f"Send addressed rank {outside[0]} outside worker world {self.world} of size {n}; dropped"
            )
            return None
        ranks = normalize(None if len(selected) == n else selected, n)
        if len(self._ranksets) >= _RANKSET_CACHE:
            self._ranksets.clear()
        self._ranksets[key] = ranks
        return ranks

    def _bad_send(self, text: str) -> None:
        self._drop("bad-send", text)
        self._to_client(Log(level="error", message=text))

    @handler
    def on_introspect(self, msg: Introspect) -> IntrospectReply:
        sup = self.supervision
        return IntrospectReply(
            client_state=self.client_state,
            client=self.client,
            history=self.history.snapshot(),
            reported_procs=sorted(sup.reported_procs) if sup else [],
            dead_ranks=sorted(sup.dead_ranks) if sup else [],
            mesh_failed=self.mesh_failed,
            stall_report_in_flight=bool(self.progress and self.progress.stall_report_in_flight),
            stimuli=self.stimuli.entries(self._now(), time.time()),
        )

    # ------------------------------------------------------------------ recovery

    @handler
    async def on_recover(self, msg: Recover) -> Recovered:
        """Bring lost ranks back (`Recover`; `palatine.tensor.controller.recovery`), then
        count them as having passed every seq so far and watch them again. Awaited: the
        reply is the recovery's outcome, and no other message is handled meanwhile. A
        failure raises (the client's recovery fails with the reason) and leaves the session
        failed."""
        if not self._from_client("Recover"):
            raise RuntimeError("Recover from a stranger")
        supervision = self.supervision
        assert supervision is not None  # (made in init)
        progress = self.progress
        records = await recover_ranks(
            self.cx.mailbox,
            Proc.of(self.cx),
            self.params,
            self.cx.actor_id,
            supervision,
            ranks=msg.ranks,
            stuck=set(progress.stuck) if progress is not None else set(),
            culprits=progress.culprits if progress is not None else (),
        )
        ranks = list(records)
        if not ranks:
            return Recovered(ranks=[])
        # The new incarnations have passed everything issued so far: they never saw it.
        after = (self.history.max_seq or 0) + 1
        reports: list[tuple[int, Any]] = []
        for r in ranks:
            self.history.update_deadline_tracking(r, after)
            reports.extend(self.history.rank_completed(r, after))
        supervision.revive(ranks, records)
        if progress is not None:
            progress.revive(ranks, records)
        self.mesh_failed = supervision.failed or (progress is not None and progress.failed)
        if reports:
            self._results(reports)
        log.info("recovered ranks %s of %s", ranks, self.params.worker_world)
        return Recovered(ranks=ranks)

    # ------------------------------------------------------------------ workers

    @handler
    def on_status(self, msg: Status) -> None:
        """Client barrier: complete seqs. Controller probe: progress tracking only."""
        rank = msg.rank
        if not self._worker_ok("Status", rank):
            return
        if msg.controller:
            self.history.update_deadline_tracking(rank, msg.seq)
            return
        reports = self.history.rank_completed(rank, msg.seq)
        if reports:
            self._results(reports)

    @handler
    def on_remote_function_failed(self, msg: RemoteFunctionFailed) -> None:
        if not self._worker_ok("RemoteFunctionFailed", msg.error.rank):
            return
        if msg.error.peer_lost and not self.mesh_failed:
            self._held.append((self._now() + self._peer_loss_grace_s, msg))
            self._schedule(self._peer_loss_grace_s, ReleaseHeld())
            return
        self._remote_function_failed(msg)

    def _remote_function_failed(self, msg: RemoteFunctionFailed) -> None:
        reports = self.history.propagate_exception(msg.seq, msg.error)
        if reports:
            self._results(reports)

    @handler
    def on_fetch_result(self, msg: FetchResult) -> None:
        if self.client_state != "attached":
            if self.client_state == "waiting":
                self._drop("early-FetchResult", "FetchResult while no client is attached")
            return
        self.history.set_result(msg.seq, msg.value)

    @handler
    def on_debugger_message(self, msg: DebuggerMessage) -> None:
        self._to_client(msg)

    # ------------------------------------------------------------------ progress

    @handler
    def on_check_worker_progress(self, msg: CheckWorkerProgress) -> None:
        if self.client_state != "attached" or self.progress is None:
            return  # no checks without a client; nothing is rescheduled after it ended
        if (
            not self._settled
            and self._now() - self._node_at >= self.params.worker_progress_check_interval_s
        ):
            self._settle()  # a Node without a Send: its probe must not wait forever
        self._execute(
            self.progress.check(
                self._now(),
                client_attached=True,
                mesh_failed=self.mesh_failed,
                one_shot=msg.at_deadline,
            )
        )

    @handler
    def on_stall_report(self, msg: StallReport) -> None:
        if self.progress is not None:
            self._execute(self.progress.finish_stall_report(msg, self._now()))

    async def _stall_report(self, req: RequestStacks) -> None:
        """Collect the lagging ranks' progress and stacks (bounded); post the outcome."""
        report = await collect_stall_report(self.cx.mailbox, self.gang, self._records, req)
        self._post_self(report)

    # ------------------------------------------------------------------ supervision

    def _supervise(self, msg: Any) -> None:
        if self.supervision is not None:
            self._execute(self.supervision.handle(msg, self._now()))

    @handler
    def on_check_supervision(self, msg: CheckSupervision) -> None:
        self._supervise(msg)

    @handler
    def on_supervision_result(self, msg: SupervisionResult) -> None:
        self._supervise(msg)

    @handler
    def on_proc_failed(self, msg: ProcFailed) -> None:
        self._supervise(msg)

    @handler
    def on_world_gone(self, msg: WorldGone) -> None:
        if self.client_state in ("detached", "lost"):
            return  # its own shutdown stops W
        self._supervise(msg)

    @handler
    def on_world_status_changed(self, msg: WorldStatusChanged) -> None:
        self._supervise(msg)

    @handler
    def on_system_stopping(self, msg: SystemStopping) -> None:
        self._supervise(msg)

    def _subscribe_again(self) -> None:
        self.cx.spawn_task(self._subscribe(self.params.system_loss_timeout_s))

    async def _subscribe(self, patience_s: float = 0.0) -> None:
        """Subscribe to the worker world's events; for ``patience_s`` (after a restart of
        the system) ask again while the world has not rejoined it yet."""
        # Events arrive on the ProcFailed handler port; delivery dispatches by type id,
        # so WorldGone & co. reach their own handlers through it.
        port = PortId(self.cx.actor_id, ProcFailed.__palatine_type_id__)
        give_up = self._now() + patience_s
        while True:
            try:
                reply = await self.cx.mailbox.ask(
                    SYSTEM_ACTOR, Subscribe(world_id=self.world, port=port), self._rpc_s
                )
                break
            except SystemRequestError as e:
                if e.code == "unavailable" and self._now() < give_up:
                    await asyncio.sleep(0.1)
                    continue
                self._post_self(SupervisionResult(source="subscribe", error=error_text(e)))
                return
            except Exception as e:  # noqa: BLE001 - fed back; polling still runs
                self._post_self(SupervisionResult(source="subscribe", error=error_text(e)))
                return
        self._post_self(SupervisionResult(source="subscribe", state=reply.state))

    async def _query_world_state(self) -> None:
        try:
            reply = await self.cx.mailbox.ask(
                SYSTEM_ACTOR, WorldState(world_id=self.world), self._rpc_s
            )
        except SystemRequestError as e:
            rebuilding = e.code == "unavailable"  # (a restarted system, W not back yet)
            error = None if rebuilding else error_text(e)
            self._post_self(SupervisionResult(source="poll", error=error, rebuilding=rebuilding))
            return
        except Exception as e:  # noqa: BLE001 - fed back to the monitor
            self._post_self(SupervisionResult(source="poll", error=error_text(e)))
            return
        self._post_self(SupervisionResult(source="poll", state=reply.state))

    # ------------------------------------------------------------ the client

    def _client_check_period(self) -> float:
        return max(0.05, min(1.0, self.params.client_liveness_timeout_s / 4))

    def _from_client(self, what: str) -> bool:
        """Whether the current message comes from the attached client (else drop it)."""
        sender = self.cx.sender
        if self.client_state == "attached" and sender == self.client:
            self.last_client_message_at = self._now()
            return True
        self._drop(
            f"stranger-{what}",
            f"{what} from {sender}, which is not the attached client "
            f"(client {self.client}, state {self.client_state})",
        )
        return False

    @handler
    def on_attach(self, msg: Attach) -> AttachRejected | None:
        """Accept the first client (reply, queued Failures, first check); reject others."""
        me = _short_id(self.cx.actor_id)
        if self.client_state != "waiting":
            if self.client_state == "attached":
                text = (
                    f"controller {me} already has a client attached ({self.client}); "
                    "a controller serves one client for its lifetime"
                )
            else:
                what = "has detached" if self.client_state == "detached" else "was lost"
                text = f"controller {me}: its client {what}; start a new controller"
            log.warning("attach of %s rejected: %s", msg.client, text)
            return AttachRejected(message=text)
        self.client = msg.client
        self.client_state = "attached"
        self.last_client_message_at = self._now()
        env = self.cx.env
        if env is not None and env.reply_to is not None:
            reply = AttachReply(
                world_size=self.n,
                num_procs_per_host=self.params.num_procs_per_host,
                worker_world=self.world,
                worker_name=self.params.worker_name,
                controller_actor_id=self.cx.actor_id,
                client_liveness_timeout_s=self.params.client_liveness_timeout_s,
            )
            self.cx.reply(env.reply_to, reply, env)
        log.info("client %s attached", msg.client)
        failures, dropped = self.pending.drain()
        if dropped:
            self._to_client(
                Log(
                    level="warn",
                    message=f"{dropped} older failures detected before the attach were dropped",
                )
            )
        for f in failures:
            self._to_client(Failure(failure=f))
        assert self.progress is not None
        self._execute([self.progress.first_check(self._now())])
        return None

    @handler
    def on_detach(self, msg: Detach) -> None:
        """The client is done: stop ``W`` and ``X`` (exit 0)."""
        if not self._from_client("Detach"):
            return
        self.client_state = "detached"
        log.info("client %s detached; stopping worlds", self.client)
        self._stop_worlds()

    @handler
    def on_keep_alive(self, msg: KeepAlive) -> None:
        self._from_client("KeepAlive")

    @handler
    def on_check_client(self, msg: CheckClient) -> None:
        if self.client_state == "attached":
            silent = self._now() - self.last_client_message_at
            limit = self.params.client_liveness_timeout_s
            if silent > limit:
                self._lose_client(
                    f"nothing received from it for {silent:.1f} s (limit {limit:g} s)"
                )
                return
        if self.client_state in ("waiting", "attached"):
            self._schedule(self._client_check_period(), CheckClient())

    def handle_undeliverable(self, returned: Envelope) -> None:
        """A message to the client came back: the client is lost. Casts: debug only."""
        if self.client is not None and returned.dest.actor == self.client:
            if self.client_state == "attached":
                errors = "; ".join(returned.errors or ()) or "returned"
                self._lose_client(f"a message to it was returned: {errors}")
            return
        log.debug(
            "%s: returned message to %s: %s",
            self.cx.actor_id,
            returned.dest,
            "; ".join(returned.errors or ()),
        )

    def _lose_client(self, why: str) -> None:
        self.client_state = "lost"
        self.exit_reason = f"client {self.client} lost: {why}"
        log.error(
            "%s; stopping worlds %s and %s", self.exit_reason, self.world, self.cx.actor_id.world
        )
        self._stop_worlds()

    async def _stop_adopted_workers(self) -> None:
        """An adopted world's procs serve on (their owner's actors live there): stop the
        worker actors spawned in them, so that their tensors are freed (the client does
        so at its detach; this is for a client that was lost). Bounded; a proc that
        cannot be reached is logged (it may have died, taking its worker with it)."""
        name = self.params.worker_name
        msg = StopActor(name=name, timeout_s=STOP_WORKER_S, reason="its tensor engine ended")
        replies = await asyncio.gather(
            *(
                self.cx.mailbox.ask(self.world.proc(r).actor("proc"), msg, STOP_WORKER_S + 5)
                for r in range(self.n)
            ),
            return_exceptions=True,
        )
        for r, reply in enumerate(replies):
            if isinstance(reply, BaseException):
                log.info("could not stop %s on %s: %s", name, self.world.proc(r), error_text(reply))

    def _stop_worlds(self) -> None:
        if self._worlds_stop_requested:
            return
        self._worlds_stop_requested = True
        if self.on_stop_worlds is not None:
            self.on_stop_worlds()
        self._spawn(self._stop_worlds_task())

    async def _stop_worlds_task(self) -> None:
        own = self.cx.actor_id.world
        worlds = [own] if self.params.adopted else [self.world, own]
        if self.params.adopted:
            await self._stop_adopted_workers()
        try:
            await self.cx.mailbox.ask(
                SYSTEM_ACTOR, Stop(worlds=worlds, proc_timeout_s=5.0), self._rpc_s
            )
        except Exception as e:  # noqa: BLE001 - logged; the proc stops itself if the system is gone
            log.error(
                "cannot ask the system to stop %s: %s",
                " and ".join(str(w) for w in worlds),
                error_text(e),
            )
