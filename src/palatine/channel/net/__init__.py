"""Network channels: tcp, unix and tls over ``asyncio.Protocol``.

The sending side is `palatine.channel.net.tx` (`NetTx`: sessions, seqs, acks, reconnects,
delivery timeout); the receiving side is `palatine.channel.net.rx` (`NetRx`: listening,
authentication, in-order delivery, back-pressure). What both ends share — error texts,
socket options, rate-limited warnings about bad peers, the token and TLS context of an
end — is in `sockets`, and big writes to a TLS transport go a slice at a time through
`slices`; `rx` also holds each accepted connection; this module holds the two entry
points, `serve_net` and `dial_net`.

Hot-path rules, for both ends: posts are encoded once, coalesced per loop iteration and
written with one call; frames are parsed in place from each read; nothing is logged per
message and no Future or Task is created per post.
"""

from __future__ import annotations

import ssl

from palatine.channel.addr import ChannelAddr
from palatine.channel.net.rx import NetRx
from palatine.channel.net.tx import NetTx

__all__ = ["dial_net", "serve_net"]


async def serve_net(
    addr: ChannelAddr,
    *,
    token: bytes | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[ChannelAddr, NetRx]:
    """Serve a tcp, unix or tls address; returns the bound address and the Rx.

    Bind errors raise `OSError` naming the address with the OS message. ``token`` and
    ``ssl_context`` override the cluster token and the TLS files (tests).
    """
    rx = NetRx(addr, token=token, ssl_context=ssl_context)
    bound = await rx._start()
    return bound, rx


def dial_net(
    addr: ChannelAddr,
    *,
    token: bytes | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> NetTx:
    """A lazily connecting Tx to a tcp, unix or tls address (needs a running loop)."""
    return NetTx(addr, token=token, ssl_context=ssl_context)
