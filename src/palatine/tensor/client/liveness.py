"""Liveness between a client and its controller, both ways.

A client the controller has not heard from for ``client_liveness_timeout`` is lost, and
its worlds are stopped: `Keepalive` beats well within it (every third of it, at most every 5 s), and sends the
queued ref drops with each beat, so an idle client still frees what it dropped. The
other way, `watch_controller` fails the session at once (``controller_lost``) when the
system declares the controller's proc dead, instead of leaving fetches to time out.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from palatine.errors import DeviceException
from palatine.ids import ActorId, ProcId
from palatine.protocol.controller import KeepAlive
from palatine.tensor.client.outbox import Outbox
from palatine.tensor.client.state import FailableState, SessionState

__all__ = ["Keepalive", "Watched", "watch_controller"]


class Keepalive:
    """The beat that keeps the session attached (a timer on the loop)."""

    def __init__(
        self,
        state: SessionState,
        outbox: Outbox,
        loop: asyncio.AbstractEventLoop,
        liveness_timeout_s: float,
    ) -> None:
        self._state = state
        self._outbox = outbox
        self._loop = loop
        self._interval = min(5.0, liveness_timeout_s / 3)
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Beat until the session ends or detaches (loop thread)."""

        def beat() -> None:
            if self._state.closed or self._state.detached:
                return
            self._outbox.flush_drops()
            self._outbox.tell(KeepAlive())
            self._timer = self._loop.call_later(self._interval, beat)

        self._timer = self._loop.call_later(self._interval, beat)

    def stop(self) -> None:
        """Stop beating (any thread: the timer is cancelled on the loop)."""
        timer = self._timer
        if timer is not None:
            self._loop.call_soon_threadsafe(timer.cancel)


class Watched(FailableState, Protocol):
    """What `watch_controller` needs of a session: its state, `fail`, and its controller."""

    controller: ActorId
    controller_log: str | None


def watch_controller(session: Watched, proc: Any, controller_proc: ProcId) -> None:
    """Fail ``session`` (``controller_lost``) when ``controller_proc`` is declared dead,
    unless the session has ended or detached by then (loop thread)."""
    fut = proc.watch(controller_proc)

    def gone(f: asyncio.Future[Any]) -> None:
        if f.cancelled() or session.detached or session.closed:
            return
        notice = f.result()
        where = f" (its log: {session.controller_log})" if session.controller_log else ""
        session.fail(
            DeviceException(
                f"controller {session.controller} ({controller_proc}) is gone: {notice.reason}{where}",
                "controller_lost",
                proc_id=str(controller_proc),
                reason=notice.reason,
                pid=notice.pid,
                host=notice.host,
            )
        )

    fut.add_done_callback(gone)
