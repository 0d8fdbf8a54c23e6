"""Channels: addresses, framing, sessions.

A channel is a one-way, ordered pipe of envelopes from a proc to a served address.
`serve` binds an address and returns its `Rx`; `dial` returns a `Tx` to an address
(a new one per call: the router caches one per destination). Modules:

* `addr` — `ChannelAddr`, `parse`, `any_addr`;
* `base` — the `Tx` / `Rx` interface;
* `local` — ``local:N``, in-process, no framing;
* `net` — ``tcp:``, ``unix:``, ``tls:`` over ``asyncio.Protocol``, with the token
  handshake, sessions, acks and reconnects (`palatine.wire.frames` and
  `palatine.wire.handshake` are its sans-IO halves);
* `spin` — how long a loop polls for the next frame before it sleeps;
* `token`, `tls` — the cluster token and the SSL contexts.
"""

from __future__ import annotations

from palatine.channel.addr import ChannelAddr, any_addr, parse, require_addr
from palatine.channel.base import Rx, Tx, TxStatus
from palatine.errors import AddrParseError

__all__ = ["ChannelAddr", "Rx", "Tx", "TxStatus", "any_addr", "dial", "parse", "serve"]


async def serve(addr: ChannelAddr) -> tuple[ChannelAddr, Rx]:
    """Bind and listen on ``addr``; returns the real address (bound port or name) and Rx.

    ``local:0`` gets a fresh in-process port; ``local:N`` with N ≠ 0 raises
    `AddrParseError`. Bind errors raise `OSError` with the OS message; ``tls:`` without
    the ``PALATINE_TLS_*`` files raises `ConfigError`. Must run on the event loop that
    will use the channel. Text is parsed where it enters (`parse`), not here.
    """
    require_addr(addr, "channel.serve")
    if addr.transport == "local":
        from palatine.channel.local import serve_local

        return serve_local(addr)
    from palatine.channel.net import serve_net

    return await serve_net(addr)


def dial(addr: ChannelAddr) -> Tx:
    """A new Tx to ``addr``; network channels connect lazily, on the first post.

    ``dial(local:N)`` raises `ChannelClosed` at once when nothing is served at N. An
    "any" address (port 0, ``unix:``) cannot be dialed (`AddrParseError`). Must be
    called on the event loop thread.
    """
    require_addr(addr, "channel.dial")
    if addr.transport == "local":
        from palatine.channel.local import dial_local

        return dial_local(addr)
    if addr.is_any:
        raise AddrParseError(f"cannot dial {addr}: it means any port or name (serve it instead)")
    from palatine.channel.net import dial_net

    return dial_net(addr)
