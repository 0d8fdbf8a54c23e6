"""What both ends of a network channel share: error texts, socket options, rate-limited
warnings about bad peers, and the token and TLS context of an end.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from typing import Final

from palatine.channel.addr import ChannelAddr

__all__ = [
    "UNIX_SEND_BUFFER_BYTES",
    "WARN_INTERVAL_S",
    "PeerWarnings",
    "resolve_security",
    "tune_socket",
    "tune_transport",
]

logger = logging.getLogger(__name__)

WARN_INTERVAL_S: Final = 60.0
"""At most one WARNING per peer per this many seconds (bad frames, failed auth)."""

_MAX_WARNED_PEERS: Final = 4096


UNIX_SEND_BUFFER_BYTES: Final = 4 << 20
"""The send buffer asked for on a unix connection.

The kernel caps it at ``net.core.wmem_max`` (often 208 KiB on a stock kernel, where
this only doubles the default; raise the sysctl to get the whole of it) and then
doubles it for its own bookkeeping. The default (about 200 KiB) moves a 64 MiB value in
some 300 steps, each a wake-up of the reader and then of the writer; 4 MiB steps took a
fifth less time for the value and varied less. It bounds the bytes in flight on one
connection; it sets no memory aside."""


def tune_socket(sock: socket.socket) -> None:
    """Nagle's algorithm off on a TCP connection; a larger send buffer on a unix one
    (TCP sizes its buffers itself)."""
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        elif sock.family == socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)
    except OSError:  # pragma: no cover - closed under our feet
        pass


def tune_transport(transport: asyncio.BaseTransport) -> None:
    """`tune_socket` for the socket of an asyncio transport (TLS ones included)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        tune_socket(sock)


class PeerWarnings:
    """One WARNING per peer per `WARN_INTERVAL_S`; the rest at DEBUG.

    A misbehaving peer (garbage frames, a wrong token, a refused certificate) usually
    retries in a loop; this names it in the log once a minute instead of on every try.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def warn(self, where: ChannelAddr, peer_key: str, text: str) -> None:
        """Log ``channel <where>: <text>``, at WARNING unless ``peer_key`` had one lately."""
        now = time.monotonic()
        last = self._last.get(peer_key)
        if last is not None and now - last < WARN_INTERVAL_S:
            logger.debug("channel %s: %s", where, text)
            return
        if len(self._last) > _MAX_WARNED_PEERS:
            self._last.clear()
        self._last[peer_key] = now
        logger.warning("channel %s: %s", where, text)


def resolve_security(
    addr: ChannelAddr,
    token: bytes | None,
    ssl_context: ssl.SSLContext | None,
    *,
    server: bool,
) -> tuple[bytes, ssl.SSLContext | None]:
    """The cluster token and (for ``tls:``) the SSL context of one end of a channel.

    Explicit values win; otherwise the configured token and the ``PALATINE_TLS_*`` files
    (`ConfigError` when they are unusable).
    """
    from palatine.channel import tls
    from palatine.channel.token import resolve_token

    resolved = token if token is not None else resolve_token()
    if addr.transport == "tls" and ssl_context is None:
        ssl_context = tls.server_context() if server else tls.client_context()
    return resolved, ssl_context
