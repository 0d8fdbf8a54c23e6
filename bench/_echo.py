"""A bare echo over one transport: the cross-node figures' reference, without palatine.

What a 1:1 call costs over unix, tcp or tls is palatine's own work plus what the
transport costs. This program measures the second part alone, so that the cross-node
table can say how much of a gap is the transport's:

* the server is palatine's serving side with nothing of palatine in it: a uvloop loop, a
  buffered protocol that writes back what it reads, and the same idle spin after each
  request (`palatine.channel.spin.LoopSpin`); for tls, palatine's own server context
  (mutual TLS against the CA of ``PALATINE_TLS_*``);
* the client is a lane with nothing of palatine in it: one socket (an `ssl.SSLSocket`
  for tls, with palatine's client context), a write, then non-blocking reads that
  yield the CPU between tries until the reply is in.

``bench/cross_node.py`` starts the server in a node's namespace (``serve``) and measures
round trips from this machine (`median_rtts_us`)::

    python bench/_echo.py serve unix PATH | tcp HOST | tls HOST   # prints its port
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

MESSAGE_BYTES = 200  # about a small call's request
WARM_TRIPS = 2000


class _Echo(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        from palatine.channel.spin import loop_spin

        self._buf = memoryview(bytearray(1 << 16))
        self._spin = loop_spin(asyncio.get_running_loop())
        self._transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buf

    def buffer_updated(self, nbytes: int) -> None:
        self._transport.write(bytes(self._buf[:nbytes]))
        self._spin.poke()


async def _serve(transport: str, where: str) -> None:
    loop = asyncio.get_running_loop()
    if transport == "unix":
        server = await loop.create_unix_server(_Echo, where)
        port = 0
    else:
        from palatine.channel.tls import server_context

        context = server_context() if transport == "tls" else None
        server = await loop.create_server(_Echo, where, 0, ssl=context)
        port = server.sockets[0].getsockname()[1]
    print(port, flush=True)
    async with server:
        await loop.run_in_executor(None, sys.stdin.read)  # until the client closes stdin


def _connect(transport: str, where: str, port: int) -> Any:
    if transport == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(where)
        return sock
    sock = socket.create_connection((where, port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if transport == "tls":
        from palatine.channel.tls import client_context

        sock = client_context().wrap_socket(sock, server_hostname=where)
    return sock


def _round_trips(sock: Any, count: int) -> list[float]:
    """``count`` round trips of one message; the seconds of each."""
    sock.setblocking(False)
    message = b"x" * MESSAGE_BYTES
    not_yet = (BlockingIOError, ssl.SSLWantReadError)
    recv, send, pause, now = sock.recv, sock.send, os.sched_yield, time.perf_counter
    out = []
    for _ in range(count):
        t0 = now()
        if send(message) != MESSAGE_BYTES:  # (a socket buffer holds far more)
            raise ConnectionError("the echo server stopped reading")
        got = 0
        while got < MESSAGE_BYTES:
            try:
                data = recv(65536)
            except not_yet:
                pause()
                continue
            if not data:
                raise ConnectionError("the echo server closed the connection")
            got += len(data)
        out.append(now() - t0)
    return out


def median_rtts_us(
    transport: str,
    where: str,
    reps: int,
    count: int,
    prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> list[float]:
    """``reps`` median round trips (of ``count`` each), in µs, to a bare echo server
    started for ``transport`` at ``where`` (a socket path, or the host to listen on), run
    under ``prefix`` (e.g. a namespace's ``nsenter``) with ``env`` added to this
    environment."""
    server = subprocess.Popen(
        [*prefix, sys.executable, __file__, "serve", transport, where],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline() or "-1")
        if port < 0:
            raise RuntimeError(f"the {transport} echo server did not start")
        sock = _connect(transport, where, port)
        try:
            _round_trips(sock, WARM_TRIPS)
            return [statistics.median(_round_trips(sock, count)) * 1e6 for _ in range(reps)]
        finally:
            sock.close()
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "serve" or sys.argv[2] not in ("unix", "tcp", "tls"):
        sys.exit("usage: _echo.py serve unix PATH | tcp HOST | tls HOST")
    import uvloop

    uvloop.run(_serve(sys.argv[2], sys.argv[3]))
