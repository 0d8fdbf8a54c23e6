"""Messages of the ControllerActor, and the instructions its
sans-IO parts return.

* `ControllerMessage` — what the controller handles: from the client (`Attach`,
  `Detach`, `KeepAlive`, `Node`, `DropRefs`, `Send`, `Introspect`), from workers
  (`Status`, `RemoteFunctionFailed`, `FetchResult`, defined with the worker protocol in
  `palatine.protocol.worker` and re-exported here), from the system (``ProcFailed``,
  ``WorldGone``, ``WorldStatusChanged``, ``SystemStopping`` of
  `palatine.protocol.system`), and from itself (timers `CheckSupervision`,
  `CheckWorkerProgress`, and task outcomes `SupervisionResult`, `StallReport`).
* `ClientMessage` — what the controller sends to its one client: `Result`, `Log`,
  `Failure` (and later `DebuggerMessage`); plus the replies `AttachReply` /
  `AttachRejected` and `IntrospectReply`.
* `ControllerParams` / `WorkerProcRecord` — the ControllerActor's spawn parameters.
* Instructions (`SendProbe`, `RequestStacks`, `Warn`, `Fail`, `Schedule`, `LogLine`,
  `QueryWorldState`) — plain structs, never sent: `palatine.tensor.controller.progress` and
  `palatine.tensor.controller.supervision` return them and the actor shell executes them.
  Each carries the ``stimulus_id`` of the stimulus that caused it (`Stimulated`).

Wire invariants:

* Every message subclasses `palatine.wire.codec.Message` (stable ``type_id``); all are
  ``kw_only``; durations end in ``_s``.
* A request that gets a reply (``Attach``, ``Introspect``) has no reply field: its
  reply port is the ``reply_to`` port of an ``ask``, not a struct field: the
  handler's return value is the reply.
* `Result.result` is ``None`` (done, no value), ``Ok(Pickled)`` or
  ``Err(Error(WorkerError))`` — `Ok`/`Err` of `palatine.protocol.worker`, `Error` of this module;
  a fetched value is stored and forwarded as the worker's bytes, never unpickled here.
* `Send.message` is a `Serialized` command: its ``type_id``, ``encoding`` and ``data``
  go into the cast unchanged, so the controller never decodes client commands.
* `DeviceFailure` carries ids as canonical text (``worker[1]``): it is read by humans
  and becomes the attributes of the client's ``DeviceException``. Fields that do not
  apply to a kind are ``None``; ``message`` is always the complete human text.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeAlias, TypeVar

import msgspec

from palatine.ids import ActorId, ProcId, WorldId
from palatine.protocol.system import (
    ProcFailed,
    StimulusEntry,
    SystemStopping,
    WorldGone,
    WorldStatusChanged,
    WorldSupervisionState,
)
from palatine.protocol.worker import (
    DebuggerMessage,
    Err,
    FetchResult,
    Ok,
    Pickled,
    RemoteFunctionFailed,
    Slice,
    Status,
    WorkerError,
    WorkerProgress,
)
from palatine.wire.codec import Message, encode_message, message_type
from palatine.wire.envelope import ENC_MSGPACK, ENC_PICKLE

__all__ = [
    # results and the history's state
    "Deadline",
    "Error",
    "HistorySnapshot",
    # parameters
    "ControllerParams",
    "WorkerProcRecord",
    "CONTROLLER_ACTOR_TYPE",
    # client -> controller
    "Attach",
    "AttachReply",
    "AttachRejected",
    "Detach",
    "KeepAlive",
    "Node",
    "DropRefs",
    "Serialized",
    "Send",
    "Introspect",
    "IntrospectReply",
    "ClientState",
    # worker -> controller (re-exported)
    "Status",
    "RemoteFunctionFailed",
    "FetchResult",
    "DebuggerMessage",
    # self
    "CheckSupervision",
    "CheckWorkerProgress",
    "SupervisionResult",
    "RankStallData",
    "StallReport",
    # controller -> client
    "ResultValue",
    "Result",
    "Results",
    "Batch",
    "LogLevel",
    "Log",
    "FailureKind",
    "FAILURE_KINDS",
    "DeviceFailure",
    "Failure",
    # unions
    "ControllerMessage",
    "ClientMessage",
    # instructions
    "SendProbe",
    "Stimulated",
    "RequestStacks",
    "Warn",
    "Fail",
    "Schedule",
    "LogLine",
    "QueryWorldState",
    "Instruction",
]

CONTROLLER_ACTOR_TYPE = "palatine.tensor.controller.ControllerActor"
"""Registered type name the bootstrap spawns."""


# --------------------------------------------------------------------------- parameters


E = TypeVar("E")


class Error(msgspec.Struct, Generic[E], frozen=True, array_like=True):
    """An error attached to invocation ``seq``, caused by the failure of ``caused_by``."""

    seq: int
    caused_by: int
    error: E


class Deadline(msgspec.Struct):
    """The single stall deadline: ``expected`` seq must be passed by ``due``."""

    expected: int
    due: float
    reported: bool = False


class HistorySnapshot(msgspec.Struct, frozen=True):
    """The History part of the controller's ``Introspect`` reply."""

    max_seq: int | None
    frontiers: list[int]
    progress: list[int]
    min_frontier: int
    min_progress: int
    live_invocations: int
    ref_map_size: int
    pending_drops: int
    deadline: Deadline | None


class WorkerProcRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What the bootstrap's last step-3 snapshot said about worker proc ``rank``.

    Used to name a rank in stall reports (pid, host) and to ask its host for a stack dump
    from outside (``host_proc``) when the worker's own loop does not answer.
    """

    rank: int
    proc_id: ProcId
    pid: int | None = None
    host: str = ""
    addr: str = ""
    host_proc: ProcId | None = None


class ControllerParams(msgspec.Struct, frozen=True, kw_only=True):
    """Spawn parameters of the ControllerActor (msgpack ``Params``).

    ``comm`` names the comm actor of the controller's own proc (``X[0].comm[0]``); the
    actor casts Sends and probes from its own mailbox, which forwards through the comm
    tree below it. ``worker_procs`` **(ours)** carries the proc
    records the bootstrap kept from its last step-3 snapshot, since the actor is spawned
    through its proc agent and cannot see the bootstrap's memory.
    """

    world_size: int
    num_procs_per_host: int = 8
    worker_world: WorldId
    worker_name: str = "worker"
    system_addr: str
    comm: ActorId
    supervision_query_interval_s: float = 2.0
    worker_progress_check_interval_s: float = 10.0
    operation_timeout_s: float = 120.0
    operations_per_worker_progress_request: int = 100
    fail_on_worker_timeout: bool = False
    stall_report_timeout_s: float = 5.0
    client_liveness_timeout_s: float = 30.0
    system_loss_timeout_s: float = 10.0
    worker_procs: list[WorkerProcRecord] = []
    # what a recovery needs to spawn a worker actor on a respawned proc (`Recover`)
    worker_actor_type: str = "palatine.tensor.worker.WorkerActor"
    worker_device_index: int | None = None
    spawn_timeout_s: float = 120.0
    #: The worker world belongs to someone else (an actor proc mesh): stopping stops
    #: only the controller's own world.
    adopted: bool = False


# --------------------------------------------------------------------------- client -> controller


class Attach(Message, kw_only=True):
    """A client asks to attach (an ``ask``); replies `AttachReply` or `AttachRejected`.

    Then the controller sends every Failure queued before the attach, in order.
    """

    client: ActorId


class Recover(Message, kw_only=True):
    """The client asks (an ``ask``) to bring lost ranks back: ``ranks``, or every rank the
    controller knows dead. The controller has the system respawn their procs, spawns a
    worker actor on each, and counts them as having completed every seq so far. Replies
    `Recovered`; a recovery that cannot complete raises (an error reply) within
    ``spawn_timeout_s``."""

    ranks: list[int] | None = None


class Recovered(Message, kw_only=True):
    """Reply to `Recover`: the ranks that run again (a new incarnation each)."""

    ranks: list[int]


class AttachReply(Message, kw_only=True):
    """Accepted attach: what the client needs to build its mesh and keep itself alive."""

    world_size: int
    num_procs_per_host: int
    worker_world: WorldId
    worker_name: str
    controller_actor_id: ActorId
    client_liveness_timeout_s: float


class AttachRejected(Message, kw_only=True):
    """Refused attach: a controller serves one client for its lifetime."""

    message: str


class Detach(Message, kw_only=True):
    """The client is done: the controller stops ``W`` and ``X`` and exits 0."""


class KeepAlive(Message, kw_only=True):
    """Sent by an idle client every ``min(5, client_liveness_timeout / 3)`` s."""


class Node(Message, kw_only=True):
    """Invocation ``seq`` uses refs ``uses`` and defines refs ``defs``.

    ``label`` **(ours)** is a short description of the op (the function's qualified
    name, ≤ 200 chars), kept for error and stall messages.
    """

    seq: int
    defs: list[int] = []
    uses: list[int] = []
    label: str = ""


class DropRefs(Message, kw_only=True):
    """The client no longer holds these refs."""

    refs: list[int]


class Serialized(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An encoded message that is forwarded without decoding (like Monarch's
    ``Serialized``): exactly the ``type_id``, ``encoding`` and ``data`` of a cast."""

    type_id: int
    data: bytes
    encoding: int = ENC_MSGPACK

    @classmethod
    def of(cls, msg: Message) -> Serialized:
        """msgpack-encode a registered message (a worker command)."""
        return cls(type(msg).__palatine_type_id__, encode_message(msg))

    def decode(self) -> Any:
        """Decode by ``type_id`` (tests and tools; the controller never needs this)."""
        if self.encoding == ENC_PICKLE:
            raise TypeError("a pickled payload is decoded by its receiver, not here")
        cls = message_type(self.type_id)
        if cls is None:
            raise TypeError(f"unknown message type id {self.type_id:#x}")
        return msgspec.msgpack.decode(self.data, type=cls)


class Send(Message, kw_only=True):
    """Cast ``message`` to the union of the rank slices ``ranks``, once per rank."""

    ranks: list[Slice]
    message: Serialized


class Batch(Message, kw_only=True):
    """**(ours)** Everything one client flush produced, handled as one message.

    The controller handles it exactly as the same messages sent one by one in the order
    ``nodes``, then ``sends``, then ``DropRefs{drop_refs}``. That order is the client's
    own: a flush holds the Nodes of consecutive seqs with their commands (consecutive
    commands for the same ranks merged into one `CommandGroup`), and the drops it takes
    are of refs whose Nodes were sent before or are in the batch, so they go last.
    One message per flush instead of 2-4 per call is what lets one controller serve
    ≥ 20,000 invocations/s.
    """

    nodes: list[Node] = []
    sends: list[Send] = []
    drop_refs: list[int] = []


class Introspect(Message, kw_only=True):
    """Tests and tools ask for the controller's counters; replies `IntrospectReply`."""


ClientState = Literal["waiting", "attached", "detached", "lost"]
"""``waiting`` → ``attached`` → ``detached`` | ``lost`` (never back)."""


class IntrospectReply(Message, kw_only=True):
    """The controller's state as `Introspect` reports it."""

    client_state: ClientState
    client: ActorId | None = None
    history: HistorySnapshot
    reported_procs: list[ProcId] = []
    dead_ranks: list[int] = []
    mesh_failed: bool = False
    stall_report_in_flight: bool = False
    #: the controller's recent stimuli that decided something, oldest first (at most
    #: ``stimulus_log_size``; ``time`` is wall-clock seconds, no ``reply``)
    stimuli: list[StimulusEntry] = []


# --------------------------------------------------------------------------- self


class CheckSupervision(Message, kw_only=True):
    """Timer: poll the system for the worker world's state."""


class CheckWorkerProgress(Message, kw_only=True):
    """Timer: the progress check

    ``at_deadline`` **(ours)**: a one-shot check scheduled for the moment a newly armed
    deadline falls due, so a stall is reported ≈ ``operation_timeout`` after the Node
    whatever the phase of the periodic check; it does not reschedule.
    """

    at_deadline: bool = False


class SupervisionResult(Message, kw_only=True):
    """Outcome of a ``WorldState`` query (``source = "poll"``) or of the ``Subscribe``
    reply (``source = "subscribe"``), posted back to the actor.

    ``error`` set: the query failed (timeout, undeliverable, rejected). ``rebuilding``:
    the system answered, but it restarted and ``W`` has not rejoined it yet (contact,
    with no state). Otherwise ``state`` is the answer, ``None`` meaning the system does
    not know ``W``.
    """

    source: Literal["poll", "subscribe"] = "poll"
    state: WorldSupervisionState | None = None
    error: str | None = None
    rebuilding: bool = False


class RankStallData(msgspec.Struct, kw_only=True):
    """What the stall report collected for one lagging rank within its bound.

    ``progress`` is the worker's `WorkerProgress` answer, ``None`` when it did not answer
    in time (or ``progress_error`` says why it failed). ``stack`` is the stack dump text
    (``stack_method``: ``in-process``, ``py-spy`` or ``faulthandler``), ``None`` with
    ``stack_error`` when unavailable.
    """

    rank: int
    progress: WorkerProgress | None = None
    progress_error: str | None = None
    stack: str | None = None
    stack_method: str = ""
    stack_error: str | None = None


class StallReport(Message, kw_only=True):
    """Outcome of a stall report task, posted back to the actor.

    ``report_id`` echoes `RequestStacks.report_id`; a report whose id is not the one in
    flight is stale and ignored.
    """

    report_id: int
    expected_seq: int
    ranks: list[RankStallData] = []


# --------------------------------------------------------------------------- controller -> client


ResultValue: TypeAlias = Ok[Pickled] | Err[Error[WorkerError]] | None
"""``None`` (done, no value), ``Ok(value)`` or ``Err(Error)``."""


class Result(Message, kw_only=True):
    """The one message per accepted Node ``seq``."""

    seq: int
    result: ResultValue = None


class Results(Message, kw_only=True):
    """**(ours)** Several `Result`s completed by one worker message, in seq order.

    Completions are batched per `Status`: still exactly one `Result`
    per seq, delivered as if each had been sent alone.
    """

    results: list[Result]


LogLevel = Literal["info", "warn", "error"]
"""Levels of a `Log` (the client maps them to INFO / WARNING / ERROR)."""


class Log(Message, kw_only=True):
    """A line for the client's ``palatine`` logger; ``details`` is structured extra data."""

    level: LogLevel
    message: str
    details: dict[str, Any] | None = None


FailureKind = Literal["proc_failed", "actor_failed", "stuck", "world_gone", "system_lost"]
"""What a `DeviceFailure` is about (the client's ``DeviceException.kind``)."""

FAILURE_KINDS: tuple[str, ...] = (
    "proc_failed",
    "actor_failed",
    "stuck",
    "world_gone",
    "system_lost",
)


class DeviceFailure(msgspec.Struct, frozen=True, kw_only=True):
    """A mesh-level problem not tied to a seq; ``message`` is the human text.

    ``ops`` and ``stacks`` (kind ``stuck``) map a rank to the op it is running and to its
    stack text. ``exit_signal`` is a signal number, as in the system's records.
    """

    kind: FailureKind
    message: str
    world: str | None = None
    rank: int | None = None
    proc_id: str | None = None
    host: str | None = None
    addr: str | None = None
    pid: int | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    reason: str | None = None
    actor_id: str | None = None
    actor_error: str | None = None
    ranks: list[int] | None = None
    expected_seq: int | None = None
    ops: dict[int, str] | None = None
    stacks: dict[int, str] | None = None

    def details(self) -> dict[str, Any]:
        """Every field but ``kind`` and ``message`` (the ``DeviceException`` attributes)."""
        out = msgspec.structs.asdict(self)
        del out["kind"], out["message"]
        return out


class Failure(Message, kw_only=True):
    """A `DeviceFailure` for the client; never sent as a `Result`."""

    failure: DeviceFailure


ControllerMessage: TypeAlias = (
    Attach
    | Detach
    | KeepAlive
    | Node
    | DropRefs
    | Send
    | Batch
    | Introspect
    | Status
    | RemoteFunctionFailed
    | FetchResult
    | DebuggerMessage
    | ProcFailed
    | WorldGone
    | WorldStatusChanged
    | SystemStopping
    | CheckSupervision
    | CheckWorkerProgress
    | SupervisionResult
    | StallReport
)
"""Everything the ControllerActor handles."""

ClientMessage: TypeAlias = Result | Results | Log | Failure | DebuggerMessage
"""Everything the controller sends to its client unasked."""


# --------------------------------------------------------------------------- instructions


class Stimulated(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every instruction: ``stimulus_id`` names the controller's stimulus that
    caused it (``<kind>-<n>``, as in its log of recent stimuli, `IntrospectReply`).

    The field is keyword-only and required, so no instruction is made without it.
    """

    stimulus_id: str


class SendProbe(Stimulated, frozen=True):
    """Cast ``RequestStatus{seq, controller: true}`` to ``ranks`` on the comm path."""

    seq: int
    ranks: tuple[int, ...]


class RequestStacks(Stimulated, frozen=True, kw_only=True):
    """Start the stall report for ``ranks``; post a `StallReport` back.

    For every rank, in parallel and bounded together by ``timeout_s``: a
    ``ProgressQuery`` to the worker actor and a ``StackDump`` from its proc agent (after
    half the bound, from its ``host_proc`` with ``target = W[r]``). Echo ``report_id``
    and ``expected_seq``; data arriving after the bound is left out.
    """

    report_id: int
    expected_seq: int
    ranks: tuple[int, ...]
    timeout_s: float


class Warn(Stimulated, frozen=True):
    """Send ``Log(warn, message, details)`` to the client (and log it at WARNING)."""

    message: str
    details: dict[str, Any] | None = None


class Fail(Stimulated, frozen=True):
    """Send ``Failure(failure)`` to the client, or queue it before attach; set
    ``mesh_failed`` (and log it at ERROR)."""

    failure: DeviceFailure


class Schedule(Stimulated, frozen=True):
    """Post ``timer`` to the actor itself after ``delay_s``."""

    delay_s: float
    timer: CheckWorkerProgress | CheckSupervision


class LogLine(Stimulated, frozen=True):
    """Log ``message`` locally (the controller's own logger) at ``level``."""

    level: Literal["debug", "info", "warning", "error"]
    message: str


class QueryWorldState(Stimulated, frozen=True):
    """Ask the system ``WorldState{W}`` (bounded by the RPC timeout) as a task; post the
    outcome back as `SupervisionResult`."""


Instruction: TypeAlias = (
    SendProbe | RequestStacks | Warn | Fail | Schedule | LogLine | QueryWorldState
)
"""What the sans-IO parts ask the actor shell to do, in order."""
