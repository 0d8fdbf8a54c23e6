"""Socket options every channel connection gets (`palatine.channel.net.sockets.tune_socket`)."""

from __future__ import annotations

import socket

from palatine.channel.net.sockets import tune_socket


def test_a_unix_connection_gets_the_large_send_buffer(unix_send_buffer: int) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        default = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        tune_socket(a)
        got = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    assert got == unix_send_buffer, (default, got)


def test_a_tcp_connection_gets_nodelay_and_keeps_its_own_buffers() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    with srv, socket.create_connection(srv.getsockname()) as c:
        default = c.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        tune_socket(c)
        assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert c.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == default  # autotuned
