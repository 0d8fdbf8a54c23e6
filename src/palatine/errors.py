"""The whole palatine exception hierarchy; every error derives from `PalatineError`.

Each class says who raises it and when. Errors name things humans know (world, rank,
host, pid, exit code or signal, the op that was running), never a bare internal id.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PalatineError",
    "ConfigError",
    "IdParseError",
    "AddrParseError",
    "ChannelError",
    "ChannelClosed",
    "SendError",
    "DeliveryError",
    "CallTimeout",
    "ActorStopping",
    "ActorStopped",
    "PortClosed",
    "SpawnError",
    "RemoteException",
    "DeviceException",
    "PeerGoneError",
    "StuckWorkersException",
    "SystemRequestError",
    "JoinError",
    "StackDumpError",
    "CollectivePeerLost",
    "InfrastructureError",
    "TooManyOpenFiles",
    "ValueTooLarge",
    "SchedulerError",
    "error_text",
    "is_refusal",
    "CoalescingError",
]


class PalatineError(Exception):
    """Root of every palatine error."""


class ConfigError(PalatineError, ValueError):
    """A configuration value (argument or ``PALATINE_*`` variable) cannot be used.

    Raised by `palatine.config` when a value does not parse; the message names the
    variable and the offending text. Role processes print it and exit 2.
    """


class IdParseError(PalatineError, ValueError):
    """Raised by `palatine.ids` parsers for text that is not a valid reference."""


class AddrParseError(PalatineError, ValueError):
    """Raised by `palatine.channel.addr.parse` for text that is not a channel address."""


class ChannelError(PalatineError):
    """Base of channel-level failures."""


class ChannelClosed(ChannelError):
    """We (or the owner) closed the channel, or nothing is served at a local port.

    ``envelope`` carries the message that could not be posted, when there was one.
    """

    def __init__(self, message: str = "channel closed", envelope: Any = None) -> None:
        super().__init__(message)
        self.envelope = envelope


class SendError(ChannelError):
    """Raised by ``Tx.send`` when the message was returned instead of acknowledged."""

    def __init__(self, reason: str, envelope: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.envelope = envelope


class DeliveryError(PalatineError):
    """A request was returned undeliverable; raised at the caller of ``ask``/``call``.

    ``reason`` is the delivery error text (``broken link: …``, ``mailbox error: …``);
    ``envelope`` is the returned envelope when known.
    """

    def __init__(self, reason: str, envelope: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.envelope = envelope


class CallTimeout(PalatineError, TimeoutError):
    """A request/reply deadline passed; names the destination, message type and deadline."""


class ActorStopping(PalatineError):
    """The calling actor stopped while a reply was pending; raised at the caller."""


class ActorAborted(PalatineError):
    """An actor ended failed (it aborted, or a handler failed it): what its
    ``__cleanup__`` receives, with the failure as its message."""


class ActorStopped(PalatineError):
    """A message was sent through a local handle to an actor that has stopped."""


class PortClosed(PalatineError):
    """A receive on a port that was closed (by its owner or by the actor stopping)."""


class SpawnError(PalatineError):
    """Spawning an actor failed (bad name, unknown type, constructor or ``init`` error)."""


class RemoteException(PalatineError):
    """A handler or remote function raised; carries the remote type, message and traceback.

    Raised at the caller of ``call``/``call_one``/``ask`` and, for the client, on
    ``fetch``. ``actor_id`` names where it ran; ``headline`` (client calls) names the
    function, seq, rank, world, proc, pid and host; ``client_traceback`` is where the
    failing call was issued.
    """

    def __init__(
        self,
        type_name: str,
        message: str,
        traceback: str = "",
        actor_id: str = "",
        client_traceback: str = "",
        headline: str = "",
    ) -> None:
        self.type_name = type_name
        # the qualified type when the client knows it (``builtins.ZeroDivisionError``);
        # `type_name` is as given
        self.exc_type = type_name
        self.message = message
        self.traceback = traceback
        self.actor_id = actor_id
        self.client_traceback = client_traceback
        self.headline = headline
        # Set by the client for a remote function's failure (None elsewhere): which
        # invocation failed, the root failure it comes from, and where it ran.
        self.seq: int | None = None
        self.caused_by: int | None = None
        self.function: str | None = None
        self.rank: int | None = None
        self.world: str | None = None
        self.proc_id: str | None = None
        self.host: str | None = None
        self.pid: int | None = None
        self.original: BaseException | None = None
        super().__init__(self._render())

    def _render(self) -> str:
        short = self.type_name.rsplit(".", 1)[-1] if self.headline else self.type_name
        if self.headline:
            text = f"{self.headline}\n{short}: {self.message}"
        else:
            where = f" in {self.actor_id}" if self.actor_id else ""
            text = f"{self.type_name}: {self.message}{where}"
        if self.traceback:
            label = "Worker traceback" if self.headline else "Remote traceback"
            body = self.traceback.rstrip()
            body = body.removeprefix("Traceback (most recent call last):").lstrip("\n")
            text += f"\n{label} (most recent call last):\n" + body
        if self.client_traceback:
            text += "\nIssued at (most recent call last):\n" + self.client_traceback.rstrip()
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (
                self.type_name,
                self.message,
                self.traceback,
                self.actor_id,
                self.client_traceback,
                self.headline,
            ),
        )


class DeviceException(PalatineError):
    """A worker/proc died or became unreachable; names world, rank, host, pid and cause.

    ``kind`` is one of ``proc_failed``, ``actor_failed``, ``world_gone``,
    ``system_lost``, ``controller_lost``, ``stuck``.
    """

    def __init__(self, message: str, kind: str = "proc_failed", **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_device_exception, (type(self), self.message, self.kind, self.details))


def _rebuild_device_exception(
    cls: type[DeviceException], message: str, kind: str, details: dict[str, Any]
) -> DeviceException:
    return cls(message, kind, **details)


class PeerGoneError(DeviceException):
    """A pending call's destination proc was declared dead by the system (``PeerGone``)."""

    def __init__(self, message: str, kind: str = "proc_failed", **details: Any) -> None:
        super().__init__(message, kind, **details)


class StuckWorkersException(DeviceException):
    """Workers made no progress past the operation timeout (``fail_on_worker_timeout``).

    The message names the stuck ranks, the op each is running and their Python stacks.
    """

    def __init__(self, message: str, kind: str = "stuck", **details: Any) -> None:
        super().__init__(message, kind, **details)


class MeshFailure(PalatineError):
    """An actor of a mesh this code owns failed: what ``__supervise__`` receives, and what
    the unhandled-fault hook gets when nobody handles it (Monarch's ``MeshFailure``).

    ``actor_id`` names the actor (``mesh3[1].trainer[0]``), ``rank`` its rank in the
    mesh, ``host`` and ``pid`` where it ran, ``message`` why it failed (its exception),
    ``traceback`` the actor's traceback. Its proc, and the other actors there, serve on.
    """

    def __init__(
        self,
        actor_id: str,
        message: str,
        traceback: str = "",
        rank: int | None = None,
        host: str = "",
        pid: int = 0,
    ) -> None:
        self.actor_id = actor_id
        self.message = message
        self.traceback = traceback
        self.rank = rank
        self.host = host
        self.pid = pid
        where = ", ".join(
            part
            for part in (
                f"rank {rank}" if rank is not None else "",
                f"pid {pid}" if pid else "",
                f"on {host}" if host else "",
            )
            if part
        )
        super().__init__(f"actor {actor_id}{f' ({where})' if where else ''} failed: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            MeshFailure,
            (self.actor_id, self.message, self.traceback, self.rank, self.host, self.pid),
        )


class LostValue(PalatineError):
    """A remote value was lost with a rank that died (and was respawned by a recovery):
    fetching it from that rank, or using it on a mesh that includes the rank, raises
    this. ``ranks`` are the ranks it was lost on; elsewhere it is still valid."""

    def __init__(self, message: str, ranks: Any = ()) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks)


class CoalescingError(PalatineError, RuntimeError):
    """A coalesced block or a compiled function (`palatine.compile`) asked for what a
    recording cannot replay; the message says what and why."""


class RecoveryError(PalatineError):
    """A recovery (`palatine.DeviceMesh.recover`) could not complete: no host left for a
    rank, a proc that did not start again, a timeout. The mesh stays failed."""


class SystemRequestError(PalatineError):
    """The system (or a proc agent) answered a request with ``Rejected{code, message}``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.code, self.message))


class JoinError(PalatineError):
    """Bootstrapping a proc could not join the system (error reply or no answer in time)."""


class StackDumpError(PalatineError):
    """`palatine.hosting.stacks.dump_external` could not get a stack dump; says why per method tried.

    Raised to the host's ``StackDump`` handler, which puts the text in ``StackTrace.error``.
    """


class CollectivePeerLost(PalatineError, RuntimeError):
    """A palatine collective on a worker ended because a member of its group was lost
    (declared by the supervision, or its connection reset or closed): the group is
    abandoned; the next collective runs after a recovery, in a new group."""


class InfrastructureError(PalatineError):
    """A broken worker invariant (duplicate ref or stream, unknown stream / borrow /
    mesh, a rank outside a mesh, an undecodable command, ``__test_panic``, a worker bug).

    Raised inside the worker; it fails the worker actor with its message, which the
    client sees as ``DeviceException(actor_failed)``. Never sent as a user error.
    """


class ValueTooLarge(PalatineError, ValueError):
    """A value over the one-value limit (``PALATINE_MAX_VALUE``, `Config.max_value_bytes`):
    an actor's result or a fetched value. That call fails, naming the size and the limit;
    the proc that made the value and its mesh serve on."""


class TooManyOpenFiles(PalatineError, OSError):
    """The open-files limit (``ulimit -n``) is below what a job needs.

    Raised by `palatine.hosting.limits.check_open_files` before anything is started (by
    ``local_mesh``, ``this_host().spawn_procs`` and ``palatine controller``), instead of
    the job failing later, in another process, with ``EMFILE`` seen nowhere.
    """


class SchedulerError(PalatineError):
    """A scheduler refused or ended a job: ``sbatch`` said no (its words are in the
    message), the job failed or was cancelled before its hosts joined, or they did not
    join within the start timeout. Raised by `palatine.job` at the client."""


def error_text(exc: BaseException) -> str:
    """A short text for an error, for messages that name what failed around it.

    A palatine error's ``message``; the OS's words for an `OSError` (``Connection
    refused``: the caller names the address); ``timed out`` for a bare timeout; else the
    error's text, or its type's name when it has none.
    """
    message = getattr(exc, "message", None)
    if isinstance(message, str) and message:
        return message
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc)
    if not text and isinstance(exc, TimeoutError):
        return "timed out"
    return text or type(exc).__name__


#: Words of a link that failed because the peer refused us (or we refused the peer):
#: the cluster token or a certificate. Retrying cannot help; callers give up at once.
REFUSAL_WORDS = (
    "server rejected connection: authentication failed",
    "server authentication failed",
    "does not accept our certificate",
    "certificate was refused",
)


def is_refusal(text: str) -> bool:
    """Whether an error's text says the peer refused this process's credentials."""
    return any(words in text for words in REFUSAL_WORDS)
