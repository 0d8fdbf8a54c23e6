"""Typed messages of the proc agent.

Every proc runs an agent; these are the messages it answers (its state, spawning root
actors, stopping, its ledger, its address, stack dumps) and the ones a host agent answers
for its children (`SpawnProc`, `KillProcs`). The wire invariants of
`palatine.protocol.system` hold here too; requests are answered with the reply named in
their docstring or with `palatine.protocol.system.Rejected`.
"""

from __future__ import annotations

from typing import Literal

from palatine.ids import ActorId, PortId, ProcId, WorldId
from palatine.protocol.system import (
    ActorSnapshot,
    AgentStateName,
    ChildProc,
    FailedProc,
    ProcAssignment,
    StartedProc,
    WorldEnv,
)
from palatine.wire.codec import Message

__all__ = [
    "AgentState",
    "AgentStateReply",
    "Spawn",
    "Spawned",
    "SpawnProc",
    "SpawnProcResult",
    "KillProc",
    "KillProcs",
    "KilledProcs",
    "ProcStop",
    "ProcStopResult",
    "ProcSnapshotRequest",
    "ProcSnapshot",
    "LocalAddr",
    "Addr",
    "StackDump",
    "StackTrace",
    "StartHost",
    "HostStarted",
    "StopHost",
    "WatchOutput",
    "OutputWatched",
    "OutputLines",
    "OutputTaken",
]


class AgentState(Message, kw_only=True):
    """Ask a proc agent for its state; replies `AgentStateReply`."""


class AgentStateReply(Message, kw_only=True):
    """Reply to `AgentState`."""

    state: AgentStateName
    proc_id: ProcId
    addr: str


class Spawn(Message, kw_only=True):
    """Spawn root actor ``actor_name`` of registered type ``actor_type``.

    ``params`` is encoded per ``params_encoding`` (``msgpack``: the class's ``Params``
    struct; ``pickle``: ``(args, kwargs)``); ``actor_class`` optionally ships the class
    (cloudpickled). ``dims`` are the proc mesh's named dimensions, row-major over the
    world's ranks: the actor's `current_rank()` is this proc's coordinates over them
    (none given: ``{"procs": rank}``). Replies `Spawned` or `Rejected`.
    """

    actor_type: str
    actor_name: str
    params: bytes = b""
    params_encoding: Literal["msgpack", "pickle"] = "msgpack"
    actor_class: bytes | None = None
    dims: list[tuple[str, int]] = []
    # The mesh's owner: where this actor's failure is sent (a `SupervisionEvent`),
    # instead of counting against its proc's health. None: the proc's own actor (the
    # tensor engine's workers), whose failure makes the proc failed.
    supervisor: PortId | None = None


class Spawned(Message, kw_only=True):
    """Reply to `Spawn`: ``<proc>.<actor_name>[0]`` and this proc's rank."""

    actor_id: ActorId
    rank: int


class SpawnProc(Message, kw_only=True):
    """System to host: create these procs of ``world_id``.

    Replies `SpawnProcResult`, or `Rejected` when ``world_id`` is the host's own world
    or a proc is not in ``world_id``.
    """

    world_id: WorldId
    env: WorldEnv
    procs: list[ProcAssignment]
    world_size: int
    local_world_size: int
    # The rest of the world's spec, which a host gives back when it rejoins a restarted
    # system (`Join.world`): its shape, procs per host and labels.
    shape: list[int] = []
    num_procs_per_host: int = 0
    labels: dict[str, str] = {}


class SpawnProcResult(Message, kw_only=True):
    """Reply to `SpawnProc`."""

    started: list[StartedProc] = []
    failed: list[FailedProc] = []


class StartHost(Message, kw_only=True):
    """Client to a host: start host ``host_world[r]`` (``r`` the receiver's rank) inside
    the receiver's process, sharing its fork server, so that a world ``W`` upserted for
    host world ``hostW`` gets procs on the same machines. This is how a job's hosts take
    proc meshes for actors after the job started. Replies `HostStarted`."""

    host_world: WorldId


class HostStarted(Message, kw_only=True):
    """Reply to `StartHost`: the new host's proc id and address."""

    host: ProcId
    addr: str


class StopHost(Message, kw_only=True):
    """Client to a host: stop the host of ``host_world`` it started (its children first)
    and have it leave the system. Replies `HostStarted` naming it (an unknown one is a
    `palatine.protocol.system.Rejected`)."""

    host_world: WorldId
    reason: str = ""


class KillProcs(Message, kw_only=True):
    """System to host: terminate this world's children and forget its assignment.

    Replies `KilledProcs`.
    """

    world_id: WorldId
    reason: str = ""


class KillProc(Message, kw_only=True):
    """To a host: SIGKILL its child ``proc_id`` (that incarnation: ``pid``, when given)
    now, before a recovery respawns it. Replies `KilledProcs` once the signal is sent
    (empty when the host runs no such child); the end is reported to the system like
    any other exit."""

    proc_id: ProcId
    pid: int | None = None
    reason: str = ""


class KilledProcs(Message, kw_only=True):
    """Reply to `KillProcs`: the procs that were terminated."""

    proc_ids: list[ProcId] = []


class ProcStop(Message, kw_only=True):
    """Stop this proc: hosts first kill their children; replies `ProcStopResult`,
    then the proc stops. Also sent one-way (no ``reply_to``) to zombies and unknown
    procs.

    ``incarnation`` (0: whichever) names the incarnation to stop: an agent of another
    incarnation of the same proc id ignores it, so a stop meant for a rank's old
    incarnation can never end its replacement.
    """

    timeout_s: float = 5.0
    reason: str = ""
    incarnation: int = 0


class ProcStopResult(Message, kw_only=True):
    """Reply to `ProcStop`: the agent is in neither list; ``comm`` counts as stopped."""

    proc_id: ProcId
    stopped: list[ActorId] = []
    aborted: list[ActorId] = []


class ProcSnapshotRequest(Message, kw_only=True):
    """Ask a proc agent for its ledger; replies `ProcSnapshot`."""


class ProcSnapshot(Message, kw_only=True):
    """Reply to `ProcSnapshotRequest`; a host's snapshot also lists its children."""

    proc_id: ProcId
    state: AgentStateName
    pid: int
    host: str
    addr: str
    loop_lag_s: float = 0.0
    actors: dict[str, ActorSnapshot] = {}
    children: list[ChildProc] | None = None


class LocalAddr(Message, kw_only=True):
    """Ask a proc agent for its bound listen address; replies `Addr`."""


class Addr(Message, kw_only=True):
    """Reply to `LocalAddr`."""

    addr: str


class StackDump(Message, kw_only=True):
    """Dump stacks of this proc, or of host child ``target``; replies `StackTrace`."""

    target: ProcId | None = None
    native: bool = False
    timeout_s: float = 10.0


class StackTrace(Message, kw_only=True):
    """Reply to `StackDump`; problems go in ``error`` (the handler never raises).

    ``method`` is ``in-process``, ``py-spy`` or ``faulthandler``.
    """

    proc_id: ProcId
    pid: int | None = None
    method: str = ""
    text: str = ""
    error: str | None = None


class WatchOutput(Message, kw_only=True):
    """Client to host: send the output of ``world``'s procs on this host to ``sink`` (an
    `palatine.hosting.output.OutputSink`) instead of echoing it on the host's console;
    ``sink`` None: neither (their log files only). At most ``max_bytes`` of lines wait
    for a sink that does not keep up; more are dropped and counted. ``level``: the
    lowest level of the procs' log records sent (None: palatine's default, WARNING and
    up unless its log level is DEBUG). Replies `OutputWatched`."""

    world: str
    sink: ActorId | None = None
    max_bytes: int = 8 << 20
    level: int | None = None


class OutputWatched(Message, kw_only=True):
    """Reply to `WatchOutput`: the host, and where its procs' log files are."""

    host: ProcId
    log_dir: str


class OutputLines(Message, kw_only=True):
    """Host to sink: ``(rank, line)`` of ``world``'s procs, in order per proc; ``dropped``
    lines were left out since the last batch (the sink did not keep up). Replies
    `OutputTaken`: one batch is in flight per sink, which bounds what a host sends."""

    world: str
    host: str
    lines: list[tuple[int, str]]
    dropped: int = 0


class OutputTaken(Message, kw_only=True):
    """Reply to `OutputLines`."""
