"""The envelope: what a channel carries from a proc to a port.

Wire invariants:

* An envelope is an array-like msgspec struct; ``data`` is the already-encoded payload
  (msgpack for runtime structs, pickle protocol 5 for user values), so a channel never
  re-encodes it and a receiver never sees a sender's later mutations.
* ``buffers`` are out-of-band pickle buffers. They are **not** part of the encoded
  header: the net framing writes them raw after the header (vectored, no copy) and the
  receiver re-attaches them as memoryviews of the frame body. Local channels pass the
  envelope object itself. They are written after ``post`` returns, so a sender only
  puts memory there that nobody mutates any more (a snapshot, a received frame).
* ``errors`` grows by one delivery-error text each time the envelope is returned; each
  text starts with its kind (``address not routable: …``, ``broken link: …``,
  ``mailbox error: …``, ``multicast error: …``, ``peer gone: …``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from palatine.ids import ActorId, PortId

__all__ = [
    "Envelope",
    "ENC_MSGPACK",
    "ENC_PICKLE",
    "RETURNED_AT",
    "UNKNOWN_SENDER",
]

ENC_MSGPACK = 0
ENC_PICKLE = 1


RETURNED_AT = "returned_at"
"""Header a channel sets on an envelope it returns: the address it failed to reach."""


class Envelope(msgspec.Struct, array_like=True, gc=False):
    """One message in flight. ``type_id`` selects the handler port's payload type."""

    sender: ActorId
    dest: PortId
    type_id: int
    encoding: int
    data: bytes
    reply_to: PortId | None = None
    headers: dict[str, str | int] | None = None
    errors: list[str] | None = None
    # Out-of-band buffers; the net framing moves them outside the msgpack header.
    buffers: list[Any] = []

    def returned(self, error: str) -> Envelope:
        """Record a delivery error on this envelope (in place) and return it."""
        if self.errors is None:
            self.errors = [error]
        else:
            self.errors.append(error)
        return self

    def mark_returned_at(self, addr: str) -> None:
        """Record the address of the channel that could not deliver this envelope (the
        `RETURNED_AT` header), so whoever it comes back to can tell a message lost on the
        way to a proc's old address from one its current address did not take."""
        self.headers = {**(self.headers or {}), RETURNED_AT: addr}

    def returned_at(self) -> str | None:
        """The address `mark_returned_at` recorded (None: not returned by a channel)."""
        at = (self.headers or {}).get(RETURNED_AT)
        return at if isinstance(at, str) else None


UNKNOWN_SENDER = ActorId.parse("unknown[0].unknown[0]")
