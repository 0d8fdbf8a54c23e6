"""What the system's sans-IO core asks its actor shell to do (the shell's whole contract).

`palatine.system.registry.SystemRegistry` never performs I/O. Each of its handlers
returns ``(reply, instructions)``: the shell sends ``reply`` (if not ``None``) to the
request's ``reply_to`` **first**, then executes the instructions **in order**:

==================  ===========================================================
instruction         what the shell does
==================  ===========================================================
`Send`              ``tell`` ``message`` to ``dest`` (an agent ``P.proc[0]`` or a
                    subscriber's port); a return comes back through
                    ``SystemRegistry.handle_returned``
`Ask`               ``ask`` ``message`` of ``dest`` with deadline ``timeout_s``;
                    feed the outcome to ``SystemRegistry.handle_reply(ask, reply,
                    error)`` (reply, or ``None`` and an error text)
`Probe`             connect to ``addr`` bounded by ``timeout_s``; feed
                    ``SystemRegistry.handle_probe_result(probe, outcome)``
`Timer`             after ``delay_s`` call ``SystemRegistry.handle_timer(token)``
`Bind` / `Unbind`   update the system proc's router
`Log`               log ``text`` at ``level`` on the system's logger
`StopSystem`        the SystemActor stops (terminal); the system proc stops serving
==================  ===========================================================

A `Join` may instead be answered with `JoinProbeNeeded`: the shell probes the address of
the proc already joined under that id and calls ``SystemRegistry.complete_join``.

Every instruction carries ``stimulus_id``: the id of the stimulus (request, heartbeat,
timer, probe result, reply...) whose handling produced it, as ``<kind>-<n>``
(``heartbeat-1234``, ``join-17``), the same id as the stimulus's entry in the registry's
log of recent stimuli (``palatine snapshot --stimuli``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from palatine.channel.addr import ChannelAddr
from palatine.ids import ActorId, PortId, ProcId, WorldId

__all__ = [
    "PROBE_OUTCOMES",
    "Ask",
    "Bind",
    "ExitReportGrace",
    "Instruction",
    "JoinProbeNeeded",
    "Log",
    "ManagingStopFallback",
    "Probe",
    "ProbeAgain",
    "ProbeOutcome",
    "Send",
    "SpawnToken",
    "Stimulated",
    "StopFallback",
    "StopSystem",
    "StopToken",
    "Timer",
    "TimerToken",
    "Unbind",
]

ProbeOutcome = Literal["connected", "refused", "timeout"]
"""Result of a liveness probe: the address accepted a connection, refused it (nothing
listens: the process is gone), or neither within the probe timeout."""

PROBE_OUTCOMES: tuple[str, ...] = ("connected", "refused", "timeout")


class Stimulated(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every instruction: ``stimulus_id`` names the stimulus that caused it.

    The field is keyword-only and required, so no instruction is made without it.
    """

    stimulus_id: str


class Send(Stimulated, frozen=True):
    """One-way message from the SystemActor to ``dest``.

    ``addr``, when given, is where to deliver it instead of wherever ``dest``'s proc is
    bound now: a stop for an old incarnation goes to the address its heartbeat came
    from, never to the rank's replacement.
    """

    dest: ActorId | PortId
    message: Any
    addr: ChannelAddr | None = None


class Ask(Stimulated, frozen=True):
    """Request to a proc agent whose reply (or failure) must be fed back.

    ``token`` is the registry's own bookkeeping; the shell passes the whole `Ask` back.
    """

    dest: ActorId
    message: Any
    timeout_s: float
    token: Any = None


class Probe(Stimulated, frozen=True):
    """Liveness probe: try to connect to ``addr`` of ``proc_id`` (that incarnation),
    parsed once, where the proc's address came in from the wire.

    ``recheck`` marks the one probe sent again after a connection loss whose first probe
    found the address answering (`ProbeAgain`).
    """

    proc_id: ProcId
    addr: ChannelAddr
    incarnation: int | None
    timeout_s: float
    recheck: bool = False


class Timer(Stimulated, frozen=True):
    """Call ``SystemRegistry.handle_timer(token)`` after ``delay_s`` seconds."""

    delay_s: float
    token: Any


class Bind(Stimulated, frozen=True):
    """Route ``proc_id`` to ``addr`` in the system proc's router (parsed once, where the
    address came in from the wire)."""

    proc_id: ProcId
    addr: ChannelAddr


class Unbind(Stimulated, frozen=True):
    """Remove ``target`` (a world: every proc under it) from the system proc's router."""

    target: WorldId | ProcId


class Log(Stimulated, frozen=True):
    """Log ``text`` at ``level`` (a ``logging`` level number)."""

    level: int
    text: str


class StopSystem(Stimulated, frozen=True):
    """The SystemActor is done (shutdown complete, or a ``ManagingSystem`` proc failed and
    everything has stopped)."""

    reason: str


Instruction = Send | Ask | Probe | Timer | Bind | Unbind | Log | StopSystem


class JoinProbeNeeded(msgspec.Struct, frozen=True):
    """Not a reply: a live record already holds this proc id under another incarnation.

    The shell runs ``probe`` and calls ``SystemRegistry.complete_join(join, probe,
    outcome)``, which answers the join (or asks for another probe if the record changed
    meanwhile).
    """

    probe: Probe


# --------------------------------------------------------------------------- timer tokens


class ExitReportGrace(msgspec.Struct, frozen=True):
    """The exit-report grace of a proc whose connection closed has passed."""

    proc_id: ProcId
    incarnation: int | None


class ProbeAgain(msgspec.Struct, frozen=True):
    """Probe once more a proc whose connection closed while its address still answered.

    A process being torn down releases its files in no promised order (Linux releases
    the newest first), so its listening socket can outlive its connections by a few
    milliseconds: the first probe then connects to a dying process.
    """

    proc_id: ProcId
    incarnation: int | None
    addr: ChannelAddr


class StopFallback(msgspec.Struct, frozen=True):
    """The fallback deadline of a world's stop or eviction (``generation`` identifies it)."""

    world: str
    generation: int
    delay_s: float = 0.0


class ManagingStopFallback(msgspec.Struct, frozen=True):
    """The fallback deadline for ``ManagingSystem`` procs told to stop at shutdown."""

    generation: int


TimerToken = ExitReportGrace | ProbeAgain | StopFallback | ManagingStopFallback


# --------------------------------------------------------------------------- ask tokens


class StopToken(msgspec.Struct, frozen=True):
    """A `ProcStop` sent for the stop or eviction of ``world`` (``None``: a managing proc)."""

    world: str | None
    generation: int


class SpawnToken(msgspec.Struct, frozen=True):
    """A `SpawnProc` sent to a host for one world incarnation."""

    world: str
    world_incarnation: int
    host: ProcId
    host_incarnation: int | None
    ranks: tuple[int, ...]
