"""Liveness between a client and its controller, both ways.

A client the controller has not heard from for ``client_liveness_timeout`` is lost, and
its worlds are stopped: `Keepalive` beats well within it (every third of it, at most every
5 s), and sends the queued ref drops with each beat, so an idle client still frees what
it dropped.

The other way, a session fails (``controller_lost``, built by `controller_lost`, naming
the controller's proc, and its pid and how it ended where known) on the first of:

* its launcher seeing the controller's process end (a `local_mesh`: its parent, at once);
* the system declaring the controller's proc dead (`watch_controller`);
* a message to the controller coming back undeliverable (the client actor,
  `controller_unreachable`): what the session sent is lost, so it cannot go on. A beat
  is such a message, so even with the system gone too (killed with the controller, or
  restarted without it) a dead controller is found within a beat's interval on a local
  (``unix:``) session, whose messages come back as soon as it ends, and within the
  interval plus ``message_delivery_timeout`` on a network one.

When the launcher watches the controller, the last two wait `LAUNCHER_GRACE_S` for its
word, which says more (the pid, and how the process ended).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final, Protocol

from palatine.errors import DeviceException
from palatine.ids import ActorId, ProcId
from palatine.protocol.controller import KeepAlive
from palatine.tensor.client.outbox import Outbox
from palatine.tensor.client.state import FailableState, SessionState, job_lost

__all__ = [
    "LAUNCHER_GRACE_S",
    "Keepalive",
    "Watched",
    "controller_lost",
    "controller_unreachable",
    "watch_controller",
]


class Keepalive:
    """The beat that keeps the session attached (a timer on the loop), until the session
    ends, detaches, or its controller or system is lost."""

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
            state = self._state
            if state.closed or state.detached or job_lost(state.failure):
                return  # (nobody left to beat to)
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
    launcher_watches_controller: bool
    """The controller's parent runs in this process (a `local_mesh`) and fails the
    session the moment the controller's process ends, naming its pid and how it ended."""
    loop: asyncio.AbstractEventLoop


#: How long the system's word, or a message returned, waits when the controller's
#: launcher is this process, for the launcher's word, which names the exit (it comes
#: within a tenth of a second of it: `palatine.tensor.client.local.ROLES_SETTLE_S`).
LAUNCHER_GRACE_S: Final = 0.5


def controller_unreachable(session: Watched, why: str) -> None:
    """A message to the controller came back (``why``): fail the session
    (``controller_lost``, see `_fail_unless_told`; loop thread)."""
    _fail_unless_told(
        session, lambda: controller_lost(session, f"a message to it was undeliverable: {why}")
    )


def controller_lost(
    session: Watched, reason: str, also: str = "", **details: Any
) -> DeviceException:
    """The session's failure when its controller is gone: ``controller C (P) is gone:
    <reason>`` (where its log is, when known), then ``also`` (what else was found lost),
    kind ``controller_lost``, with ``details`` (pid, host, exit_code, exit_signal) as its
    attributes."""
    proc = session.controller.proc
    where = f" (its log: {session.controller_log})" if session.controller_log else ""
    exc = DeviceException(
        f"controller {session.controller} ({proc}) is gone: {reason}{where}{also}",
        "controller_lost",
        proc_id=str(proc),
        reason=reason,
        **details,
    )
    for k, v in details.items():
        setattr(exc, k, v)
    return exc


def watch_controller(session: Watched, proc: Any, controller_proc: ProcId) -> None:
    """Fail ``session`` (``controller_lost``) when ``controller_proc`` is declared dead,
    unless the session has ended or detached by then (loop thread)."""
    fut = proc.watch(controller_proc)

    def gone(f: asyncio.Future[Any]) -> None:
        if f.cancelled():
            return
        notice = f.result()
        _fail_unless_told(
            session,
            lambda: controller_lost(session, notice.reason, pid=notice.pid, host=notice.host),
        )

    fut.add_done_callback(gone)


def _fail_unless_told(session: Watched, lost: Callable[[], DeviceException]) -> None:
    """Fail ``session`` with ``lost()`` unless it has ended, detached or lost its
    controller or system by then; after `LAUNCHER_GRACE_S` when its launcher watches the
    controller and may yet say how it ended (loop thread)."""

    def fail() -> None:
        if not (session.detached or session.closed or job_lost(session.failure)):
            session.fail(lost())

    if session.launcher_watches_controller:
        session.loop.call_later(LAUNCHER_GRACE_S, fail)
    else:
        fail()
