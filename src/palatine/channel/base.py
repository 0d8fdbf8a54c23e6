"""The channel interface: a one-way ordered pipe of envelopes to a served address.

`Tx` is the sending end (one per destination address per proc), `Rx` the serving end.
Implementations: `palatine.channel.local` (in-process) and `palatine.channel.net`
(tcp, unix, tls over `asyncio.Protocol`). Everything here runs on the event loop thread.

Return contract: any envelope that a Tx accepted with `post` and
cannot deliver is handed to its ``on_return(envelope, reason)`` exactly once; ``reason``
is the channel's text (``delivery timeout: …``, ``server rejected connection: …``,
``message of N bytes exceeds max frame size M``, ``channel closed``); the mailbox layer
prefixes the kind (``broken link: ``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from palatine.channel.addr import ChannelAddr
    from palatine.ids import ProcId
    from palatine.wire.envelope import Envelope

__all__ = ["Tx", "Rx", "TxStatus", "ReturnCallback", "EnvelopeHandler", "PeerLostHandler"]

ReturnCallback = Callable[["Envelope", str], None]
EnvelopeHandler = Callable[["Envelope"], None]
# Called with the sender procs seen on an inbound connection that closed.
PeerLostHandler = Callable[["set[ProcId]"], None]


class TxStatus:
    """``Active`` or ``Closed(reason)``."""

    __slots__ = ("closed", "reason")

    def __init__(self, closed: bool = False, reason: str | None = None) -> None:
        self.closed = closed
        self.reason = reason

    def __repr__(self) -> str:
        return f"Closed({self.reason!r})" if self.closed else "Active"


class Tx(abc.ABC):
    """The sending end of a channel."""

    addr: ChannelAddr

    @property
    @abc.abstractmethod
    def status(self) -> TxStatus: ...

    @abc.abstractmethod
    def post(self, env: Envelope, on_return: ReturnCallback | None = None) -> None:
        """Queue ``env`` for delivery; never blocks.

        Raises `ChannelClosed` synchronously only when this Tx is already closed; every
        later failure goes to ``on_return`` exactly once.
        """

    @abc.abstractmethod
    async def send(self, env: Envelope) -> None:
        """Post with "ack now" and complete on the ack; raise `SendError` if returned."""

    @abc.abstractmethod
    def on_closed(self, cb: Callable[[str], None]) -> None:
        """Call ``cb(reason)`` when the Tx closes (at once if already closed)."""

    @abc.abstractmethod
    async def close(self, flush_timeout_s: float = 1.0) -> list[Envelope]:
        """Stop accepting posts, wait up to ``flush_timeout_s`` for acks, close.

        Returns the envelopes still unacknowledged (they are *not* passed to
        ``on_return``).
        """


class Rx(abc.ABC):
    """The serving end of a channel."""

    addr: ChannelAddr

    @abc.abstractmethod
    async def recv(self) -> Envelope:
        """The next delivered envelope; raises `ChannelClosed` after `stop`."""

    @abc.abstractmethod
    def set_handler(
        self, on_envelope: EnvelopeHandler, on_peer_lost: PeerLostHandler | None = None
    ) -> None:
        """Dispatch envelopes synchronously to ``on_envelope`` instead of queueing them.

        Used by the mailbox server (the hot path: no queue hop). ``on_peer_lost`` gets
        the sender procs of an inbound connection that closed (the system's
        "connection lost" signal).
        """

    def acknowledge_every(self, n: int) -> None:  # noqa: B027 - optional: no acks to tune
        """Ack after every ``n`` messages (1: each batch at once), whatever the configured
        ``message_ack_every_n``. A server that may be restarted at its address uses 1:
        its senders resend what was not acknowledged, and a message the old server
        handled must not be handled again by the new one. Channels without acks ignore it.
        """

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop accepting, flush final acks, close every connection."""
