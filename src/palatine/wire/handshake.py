"""The connection handshake: mutual HMAC-SHA256 challenge/response (sans-IO).

Every tcp, unix and tls connection authenticates with the cluster token before any
session frame is read::

    server -> Hello{version, nonce_s}
    client -> Auth{version, nonce_c, mac_c}   mac_c = HMAC(token, "palatine/1 client" + nonce_s + nonce_c)
    server -> AuthOk{mac_s} | Reject{reason}  mac_s = HMAC(token, "palatine/1 server" + nonce_c + nonce_s)
    client checks mac_s, then sends Init{session_id, next_seq}

Both sides prove knowledge of the token without revealing it, each over a nonce the
other chose, so neither a replayed ``Auth`` nor a forged ``AuthOk`` passes. The two
state machines here only turn received frames into frames to send (or errors); the
asyncio shell in `palatine.channel.net` and the heartbeat thread's blocking socket drive
them, and the auth timeout is theirs.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Final

from palatine.errors import PalatineError
from palatine.wire.frames import PROTOCOL_VERSION, Auth, AuthOk, Frame, Hello, Reject

__all__ = [
    "AUTH_FAILED",
    "CLIENT_LABEL",
    "NONCE_BYTES",
    "SERVER_AUTH_FAILED",
    "SERVER_LABEL",
    "TOKEN_MISMATCH_HINT",
    "ClientHandshake",
    "HandshakeError",
    "ServerHandshake",
    "client_mac",
    "rejected_reason",
    "server_mac",
    "version_mismatch",
]

NONCE_BYTES: Final = 32
CLIENT_LABEL: Final = b"palatine/1 client"
SERVER_LABEL: Final = b"palatine/1 server"

AUTH_FAILED: Final = "authentication failed"
"""The server's ``Reject`` reason for a wrong client proof (exact text)."""

SERVER_AUTH_FAILED: Final = "server authentication failed (cluster token mismatch?)"
"""Why a client closes when the server's proof is wrong."""

TOKEN_MISMATCH_HINT: Final = " (cluster token mismatch? set PALATINE_CLUSTER_TOKEN on every node)"
"""Appended to a client-side ``authentication failed`` so the fix is in the message."""


class HandshakeError(PalatineError):
    """The handshake failed on the client side.

    ``reason`` is the text returned messages carry (``server rejected connection: …``
    or `SERVER_AUTH_FAILED`). ``fatal`` is True when retrying cannot help (a ``Reject``
    or a wrong server proof: the Tx closes); False for a confused peer (unexpected
    frame), where the connection is dropped and retried.
    """

    def __init__(self, reason: str, *, fatal: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fatal = fatal


def client_mac(token: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    """The client's proof: ``HMAC-SHA256(token, CLIENT_LABEL + nonce_s + nonce_c)``."""
    return hmac.new(token, CLIENT_LABEL + nonce_s + nonce_c, hashlib.sha256).digest()


def server_mac(token: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    """The server's proof: ``HMAC-SHA256(token, SERVER_LABEL + nonce_c + nonce_s)``."""
    return hmac.new(token, SERVER_LABEL + nonce_c + nonce_s, hashlib.sha256).digest()


def version_mismatch(server: int, client: int) -> str:
    """The exact ``Reject`` reason for a client speaking another protocol version."""
    return f"protocol version mismatch: server {server}, client {client}"


def rejected_reason(reason: str) -> str:
    """What a client reports for a server's ``Reject{reason}``."""
    text = f"server rejected connection: {reason}"
    if reason == AUTH_FAILED:
        text += TOKEN_MISMATCH_HINT
    return text


class ServerHandshake:
    """The accepting side: send `hello`, feed the peer's first frame to `receive`.

    States: ``waiting`` (Hello sent) → ``done`` (AuthOk sent) or ``failed`` (Reject
    sent; close the connection after writing it). ``failure`` holds the reason.
    """

    __slots__ = ("_token", "failure", "nonce", "state")

    def __init__(self, token: bytes, nonce: bytes | None = None) -> None:
        if not token:
            raise ValueError("empty cluster token")
        self._token = token
        self.nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
        self.state = "waiting"
        self.failure: str | None = None

    @property
    def done(self) -> bool:
        """True once the client proved the token (session frames may follow)."""
        return self.state == "done"

    def hello(self) -> Hello:
        """The first frame to send on accept."""
        return Hello(PROTOCOL_VERSION, self.nonce)

    def receive(self, frame: Frame) -> AuthOk | Reject:
        """Check the client's ``Auth``; the reply to send (``Reject`` means close)."""
        if self.state != "waiting":
            return self._fail(f"unexpected {type(frame).__name__} frame: handshake is {self.state}")
        if type(frame) is not Auth:
            return self._fail(f"expected Auth, got {type(frame).__name__}")
        if frame.version != PROTOCOL_VERSION:
            return self._fail(version_mismatch(PROTOCOL_VERSION, frame.version))
        if len(frame.nonce) != NONCE_BYTES:
            return self._fail(AUTH_FAILED)
        expected = client_mac(self._token, self.nonce, frame.nonce)
        if not hmac.compare_digest(expected, frame.mac):
            return self._fail(AUTH_FAILED)
        self.state = "done"
        return AuthOk(server_mac(self._token, frame.nonce, self.nonce))

    def _fail(self, reason: str) -> Reject:
        self.state = "failed"
        self.failure = reason
        return Reject(reason)


class ClientHandshake:
    """The dialing side: feed received frames to `receive` until `done`.

    ``receive(Hello)`` returns the ``Auth`` to send; ``receive(AuthOk)`` verifies the
    server and returns None. Any failure raises `HandshakeError`.
    """

    __slots__ = ("_nonce_s", "_token", "nonce", "state")

    def __init__(self, token: bytes, nonce: bytes | None = None) -> None:
        if not token:
            raise ValueError("empty cluster token")
        self._token = token
        self.nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
        self._nonce_s = b""
        self.state = "hello"  # -> "auth" (Auth sent) -> "done"

    @property
    def done(self) -> bool:
        """True once the server proved the token (send ``Init`` next)."""
        return self.state == "done"

    def receive(self, frame: Frame) -> Auth | None:
        """Advance on a frame from the server; raises `HandshakeError` on failure."""
        if type(frame) is Reject:
            self.state = "failed"
            raise HandshakeError(rejected_reason(frame.reason), fatal=True)
        if self.state == "hello" and type(frame) is Hello:
            self._nonce_s = frame.nonce
            self.state = "auth"
            return Auth(
                PROTOCOL_VERSION, self.nonce, client_mac(self._token, frame.nonce, self.nonce)
            )
        if self.state == "auth" and type(frame) is AuthOk:
            expected = server_mac(self._token, self.nonce, self._nonce_s)
            if not hmac.compare_digest(expected, frame.mac):
                self.state = "failed"
                raise HandshakeError(SERVER_AUTH_FAILED, fatal=True)
            self.state = "done"
            return None
        state = self.state
        self.state = "failed"
        raise HandshakeError(
            f"protocol error: unexpected {type(frame).__name__} frame during handshake ({state})",
            fatal=False,
        )
