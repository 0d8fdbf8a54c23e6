"""What the parts of a session read of its state: whether it failed, ended or detached.

`palatine.tensor.client.session.Session` keeps these as plain attributes, read on every
remote call. The parts it is made of (outbox, results, keep-alive, the client actor) sit
below it and see it through these protocols, so none of them imports the session.
"""

from __future__ import annotations

from typing import Protocol

from palatine.errors import DeviceException

__all__ = ["RECOVERABLE", "FailableState", "SessionState", "lost_for_good"]

#: The kinds of failure a recovery undoes (`palatine.DeviceMesh.recover`): a lost rank,
#: stuck workers. Any other (the controller, the system, the worker world gone) ends the job.
RECOVERABLE = frozenset({"proc_failed", "stuck"})


def lost_for_good(failure: DeviceException | None) -> bool:
    """Whether ``failure`` is one no recovery can undo (`RECOVERABLE`)."""
    return failure is not None and failure.kind not in RECOVERABLE


class SessionState(Protocol):
    """A session's failure and ending, as its parts read them."""

    failure: DeviceException | None
    """The first failure (every later call raises it), until a recovery clears it."""

    closed: bool
    """The session ended (`palatine.tensor.client.shutdown.shutdown_session`)."""

    detached: bool
    """The session told its controller it is leaving (``Detach``)."""


class FailableState(SessionState, Protocol):
    """A session's state, for the parts that may also fail it (the client actor, the
    controller watch)."""

    def fail(self, exc: DeviceException) -> None:
        """Fail the session with ``exc``."""
