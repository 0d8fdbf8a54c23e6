"""What the parts of a session read of its state: whether it failed, ended or detached.

`palatine.tensor.client.session.Session` keeps these as plain attributes, read on every
remote call. The parts it is made of (outbox, results, keep-alive, the client actor) sit
below it and see it through these protocols, so none of them imports the session.
"""

from __future__ import annotations

from typing import Protocol

from palatine.errors import DeviceException

__all__ = ["JOB_LOST", "FailableState", "SessionState", "job_lost"]

#: The failures after which nothing of the job can be driven: its controller, or the
#: system that supervises it, is gone (no recovery undoes them).
JOB_LOST = frozenset({"controller_lost", "system_lost"})


def job_lost(failure: DeviceException | None) -> bool:
    """Whether ``failure`` is one of `JOB_LOST`."""
    return failure is not None and failure.kind in JOB_LOST


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
