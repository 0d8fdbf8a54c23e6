"""The client actor: where the controller's (and workers') messages for a session arrive.

`ClientActor` lives on the client's proc (``user[R].client_actor[0]``) and runs on the
runtime loop. Each ``Result`` goes to the session's result routing, as does a worker's
direct ``FetchedValue``; ``Log`` goes to the ``palatine`` logger; a ``Failure`` fails
the session with the user-facing exception `device_exception` makes of it. A message to
the controller that comes back undeliverable fails the session too (``controller_lost``,
`palatine.tensor.client.liveness`): what it carried is lost, so the session cannot go
on; that is said once, and what comes back after it is expected, not news.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from palatine.core.actor import Actor, handler
from palatine.errors import DeviceException, StuckWorkersException
from palatine.protocol.controller import DeviceFailure, Failure, Log, Result, Results
from palatine.protocol.worker import FetchedValue
from palatine.tensor.client import results
from palatine.tensor.client.liveness import Watched, controller_unreachable
from palatine.tensor.client.state import job_lost

__all__ = ["Attached", "ClientActor", "device_exception"]

log = logging.getLogger("palatine")

_LEVELS = {"info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}


class Attached(Watched, Protocol):
    """What the client actor needs of its session: its state, `fail`, its controller, and
    where results go."""

    results: results.Results


def device_exception(failure: DeviceFailure) -> DeviceException:
    """The user-facing exception for a controller ``DeviceFailure``: its fields but ``kind``
    and ``message`` (`DeviceFailure.details`) are the exception's attributes."""
    details = failure.details()
    cls = StuckWorkersException if failure.kind == "stuck" else DeviceException
    exc = cls(failure.message, failure.kind, **details)
    for k, v in details.items():
        setattr(exc, k, v)
    return exc


class ClientActor(Actor):
    """Receives the controller's ``Result``, ``Log`` and ``Failure`` for the session."""

    __palatine_name__ = "palatine.tensor.client.ClientActor"

    def __init__(self) -> None:
        self.session: Attached | None = None

    @handler
    def on_result(self, msg: Result) -> None:
        if self.session is not None:
            self.session.results.on_result(msg)

    @handler
    def on_results(self, msg: Results) -> None:
        if self.session is not None:
            routing = self.session.results
            for r in msg.results:
                routing.on_result(r)

    @handler
    def on_fetched_value(self, msg: FetchedValue) -> None:
        if self.session is not None:
            self.session.results.on_fetched_value(msg)

    @handler
    def on_log(self, msg: Log) -> None:
        log.log(
            _LEVELS.get(msg.level, logging.INFO), "%s", msg.message, extra={"details": msg.details}
        )

    @handler
    def on_failure(self, msg: Failure) -> None:
        if self.session is not None:
            self.session.fail(device_exception(msg.failure))

    def handle_undeliverable(self, returned: Any) -> None:
        s = self.session
        if s is None:
            super().handle_undeliverable(returned)
            return
        if s.detached or s.closed:
            return  # the controller going away after Detach is expected
        if returned.dest.actor.proc == s.controller.proc and not job_lost(s.failure):
            controller_unreachable(s, "; ".join(returned.errors or ()) or "returned")
            return
        if s.failure is None:
            super().handle_undeliverable(returned)
