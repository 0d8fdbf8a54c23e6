"""A lossy TCP proxy for tests: cuts connections at random and delays traffic.

`LossyProxy` listens on a loopback port and forwards every accepted connection to an
upstream tcp address. It walks the palatine frame lengths of the client → server
direction (without decoding anything) and, after a random number of frames drawn from
``cut_every`` (50–500 by default), forwards a random part of the following bytes —
so a cut usually lands *inside* a frame — and then aborts both sides. Every chunk, in
both directions, is held for a random delay from ``delay_s``, preserving order. All
randomness comes from one seeded `random.Random`, so a failing run can be replayed.

Used by the channel tests for "10,001 messages through a lossy link arrive exactly once,
in order, under one session".
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
from typing import Self, cast

from palatine.channel.addr import ChannelAddr

__all__ = ["LossyProxy"]

logger = logging.getLogger(__name__)

_u64 = struct.Struct(">Q")


class _Pipe:
    """One direction of one proxied connection: delayed, ordered forwarding."""

    def __init__(self, link: _Link, count_frames: bool) -> None:
        self.link = link
        self.target: asyncio.Transport | None = None
        self.early: list[bytes] = []  # bytes that arrived before the target connected
        self.release_at = 0.0
        self.count_frames = count_frames
        self.header = bytearray()  # a partial 8-byte length prefix
        self.remaining = 0  # body bytes left in the current frame

    def feed(self, data: bytes) -> None:
        """Forward ``data`` after a random delay; cut when the frame budget is spent."""
        link = self.link
        if link.closed:
            return
        if self.count_frames:
            cut_at = self._walk(data)
            if cut_at is not None:
                data = data[: cut_at + link.proxy.rng.randrange(0, 64)]
                self._schedule(data)
                self._schedule(None)
                link.closed_for_input = True
                return
        self._schedule(data)

    def _walk(self, data: bytes) -> int | None:
        """Count frames completed in ``data``; the offset where the budget ran out."""
        link = self.link
        pos = 0
        n = len(data)
        while pos < n:
            if self.remaining:
                step = min(self.remaining, n - pos)
                self.remaining -= step
                pos += step
                if self.remaining == 0:
                    link.frames_left -= 1
                    if link.frames_left <= 0:
                        return pos
                continue
            need = 8 - len(self.header)
            self.header += data[pos : pos + need]
            pos += min(need, n - pos)
            if len(self.header) == 8:
                (self.remaining,) = _u64.unpack(self.header)
                self.header.clear()
                if self.remaining == 0:
                    link.frames_left -= 1
                    if link.frames_left <= 0:
                        return pos
        return None

    def _schedule(self, data: bytes | None) -> None:
        proxy = self.link.proxy
        loop = proxy.loop
        lo, hi = proxy.delay_s
        at = max(self.release_at, loop.time() + proxy.rng.uniform(lo, hi))
        self.release_at = at
        loop.call_at(at, self._release, data)

    def _release(self, data: bytes | None) -> None:
        if data is None:
            self.link.cut()
            return
        if self.link.closed:
            return
        if self.target is None:
            self.early.append(data)
        else:
            self.target.write(data)


class _Link:
    """A proxied connection: the accepted client side and its upstream connection."""

    def __init__(self, proxy: LossyProxy) -> None:
        self.proxy = proxy
        self.up = _Pipe(self, count_frames=True)
        self.down = _Pipe(self, count_frames=False)
        self.client: asyncio.Transport | None = None
        self.server: asyncio.Transport | None = None
        self.closed = False
        self.closed_for_input = False
        lo, hi = proxy.cut_every
        self.frames_left = proxy.rng.randint(lo, hi)

    def cut(self, count: bool = True) -> None:
        """Abort both sides (a simulated network failure; counted unless ``count`` is False)."""
        if self.closed:
            return
        self.closed = True
        if count:
            self.proxy.cuts += 1
        for t in (self.client, self.server):
            if t is not None:
                t.abort()
        self.proxy.links.discard(self)

    def close(self) -> None:
        """Close both sides after flushing (one side closed normally)."""
        if self.closed:
            return
        self.closed = True
        for t in (self.client, self.server):
            if t is not None:
                t.close()
        self.proxy.links.discard(self)


class _ClientSide(asyncio.Protocol):
    def __init__(self, proxy: LossyProxy) -> None:
        self.proxy = proxy
        self.link = _Link(proxy)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        link = self.link
        link.client = cast(asyncio.Transport, transport)
        link.down.target = link.client
        self.proxy.links.add(link)
        task = self.proxy.loop.create_task(self._connect_upstream())
        self.proxy.tasks.add(task)
        task.add_done_callback(self.proxy.tasks.discard)

    async def _connect_upstream(self) -> None:
        link = self.link
        proxy = self.proxy
        try:
            transport, _ = await asyncio.wait_for(
                proxy.loop.create_connection(
                    lambda: _ServerSide(link), proxy.upstream.host, proxy.upstream.port
                ),
                timeout=5.0,
            )
        except (OSError, TimeoutError):
            link.cut()
            return
        if link.closed:
            transport.abort()
            return
        link.server = transport
        link.up.target = link.server
        for chunk in link.up.early:
            link.server.write(chunk)
        link.up.early.clear()

    def data_received(self, data: bytes) -> None:
        if not self.link.closed_for_input:
            self.link.up.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.close()


class _ServerSide(asyncio.Protocol):
    def __init__(self, link: _Link) -> None:
        self.link = link

    def data_received(self, data: bytes) -> None:
        self.link.down.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.close()


class LossyProxy:
    """A TCP proxy that cuts each connection after 50–500 frames and delays chunks.

    ``upstream`` is the tcp address to forward to. ``cut_every`` is the inclusive range
    of client → server frames per connection before the cut; ``delay_s`` the range of
    the per-chunk delay. ``cuts`` counts the connections cut so far.
    """

    def __init__(
        self,
        upstream: ChannelAddr,
        *,
        seed: int = 0,
        cut_every: tuple[int, int] = (50, 500),
        delay_s: tuple[float, float] = (0.0, 0.002),
    ) -> None:
        if upstream.transport != "tcp":
            raise ValueError(f"the lossy proxy forwards tcp only, not {upstream}")
        self.upstream = upstream
        self.rng = random.Random(seed)
        self.cut_every = cut_every
        self.delay_s = delay_s
        self.cuts = 0
        self.links: set[_Link] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.addr: ChannelAddr | None = None
        self._server: asyncio.AbstractServer | None = None
        self.loop = asyncio.get_running_loop()

    async def start(self) -> ChannelAddr:
        """Listen on ``127.0.0.1`` (a free port); returns the address to dial."""
        self._server = await self.loop.create_server(lambda: _ClientSide(self), "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.addr = ChannelAddr.tcp("127.0.0.1", port)
        return self.addr

    async def stop(self) -> None:
        """Stop listening and abort every proxied connection."""
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.cut(count=False)
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=1.0)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
