"""The controller's one client (30-controller.md §3.4): attach, detach, liveness, loss.

`ClientLink` is the part of the `ControllerActor` that decides who the client is and how
that relationship ends. The first `Attach` wins and gets the `AttachReply` plus the
Failures queued before it; any later one is rejected with a text that says why. A
`Detach` stops the worker and controller worlds cleanly; a client that stays silent past
``client_liveness_timeout_s`` (checked by a `CheckClient` timer) or whose messages come
back undeliverable is *lost*, and the worlds are stopped with the reason logged. Both
ends go through the system's `Stop`, asked at most once.

The mixin holds no state of its own: it reads and writes the actor's ``client``,
``client_state``, ``exit_reason`` and ``last_client_message_at``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from palatine.actor import handler
from palatine.controller.messages import (
    Attach,
    AttachRejected,
    AttachReply,
    Detach,
    Failure,
    KeepAlive,
    Log,
)
from palatine.ids import SYSTEM_ACTOR, ActorId
from palatine.system.messages import Stop
from palatine.wire.codec import Message
from palatine.wire.envelope import Envelope

if TYPE_CHECKING:
    from palatine.controller.actor import ControllerActor

__all__ = ["CheckClient", "ClientLink", "err_text"]

log = logging.getLogger("palatine.controller.actor")


class CheckClient(Message, kw_only=True):
    """Timer: is the attached client still sending (§3.4)?"""


def err_text(e: BaseException) -> str:
    """A short text for a failed request: its ``message`` if it has one, else ``str``."""
    return str(getattr(e, "message", "") or e) or type(e).__name__


def _short_id(actor: ActorId) -> str:
    """``controller[0].root`` for a root actor (pid 0), else the full text."""
    return f"{actor.proc}.{actor.name}" if actor.pid == 0 else str(actor)


class ClientLink:
    """Attach, detach, keep-alive, the liveness timer and client loss (mixin)."""

    def _client_check_period(self: ControllerActor) -> float:
        return max(0.05, min(1.0, self.params.client_liveness_timeout_s / 4))

    def _from_client(self: ControllerActor, what: str) -> bool:
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
    def on_attach(self: ControllerActor, msg: Attach) -> AttachRejected | None:
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
            self.cx._inst.reply(env.reply_to, reply, env)
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
        self._execute([self.progress.first_check()])
        return None

    @handler
    def on_detach(self: ControllerActor, msg: Detach) -> None:
        """The client is done: stop ``W`` and ``X`` (exit 0, §3.4)."""
        if not self._from_client("Detach"):
            return
        self.client_state = "detached"
        log.info("client %s detached; stopping worlds", self.client)
        self._stop_worlds()

    @handler
    def on_keep_alive(self: ControllerActor, msg: KeepAlive) -> None:
        self._from_client("KeepAlive")

    @handler
    def on_check_client(self: ControllerActor, msg: CheckClient) -> None:
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

    def handle_undeliverable(self: ControllerActor, returned: Envelope) -> None:
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

    def _lose_client(self: ControllerActor, why: str) -> None:
        self.client_state = "lost"
        self.exit_reason = f"client {self.client} lost: {why}"
        log.error(
            "%s; stopping worlds %s and %s", self.exit_reason, self.world, self.cx.actor_id.world
        )
        self._stop_worlds()

    def _stop_worlds(self: ControllerActor) -> None:
        if self._worlds_stop_requested:
            return
        self._worlds_stop_requested = True
        if self.on_stop_worlds is not None:
            self.on_stop_worlds()
        self._spawn(self._stop_worlds_task())

    async def _stop_worlds_task(self: ControllerActor) -> None:
        worlds = [self.world, self.cx.actor_id.world]
        try:
            await self.cx.mailbox.ask(
                SYSTEM_ACTOR, Stop(worlds=worlds, proc_timeout_s=5.0), self._rpc_s
            )
        except Exception as e:  # noqa: BLE001 - logged; the proc stops itself if the system is gone
            log.error(
                "cannot ask the system to stop %s and %s: %s", worlds[0], worlds[1], err_text(e)
            )
