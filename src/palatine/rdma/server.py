"""The owner proc's buffer server: transfers over a socket, without the owner's actors.

Started by the first buffer a process registers (`ensure_server`): a listening TCP
socket bound at once (so the handle can name its port), and one accept task on the
palatine loop, owned by this module and stopped with the proc (a `runtime.at_exit`
hook, which a worker proc's stop runs). Each accepted connection is served on a worker
thread with blocking, timed socket calls: bytes go straight between the registered
memory and the socket (``sendall`` of a view, ``recv_into`` one), never through the
loop. A job whose procs speak TLS (their channel address is ``tls:``) serves TLS
with the same certificates (`palatine.channel.tls`).

The protocol, per request on a connection (which the reader may reuse): a 4-byte
big-endian length and a msgpack `TransferRequest`; a `TransferReply`; for a ``read``
the bytes follow; for a ``write`` the reader sends the bytes and a second reply
acknowledges them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
import threading
from typing import Literal

import msgspec

from palatine import config
from palatine.core import runtime
from palatine.rdma import registry
from palatine.rdma.memory import region_of

__all__ = ["TransferRequest", "TransferReply", "ensure_server", "send_msg", "recv_msg"]

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
_MAX_HEADER = 1 << 16


class TransferRequest(msgspec.Struct, kw_only=True):
    """Read or write ``length`` bytes of buffer ``buffer_id`` at ``offset``; or drop it."""

    op: Literal["read", "write", "drop"]
    buffer_id: int
    key: str
    offset: int = 0
    length: int = 0


class TransferReply(msgspec.Struct, kw_only=True):
    """``ok``, or why not (``error``; ``kind`` ``value`` for a request the caller got wrong)."""

    ok: bool
    error: str = ""
    kind: str = ""


_encoder = msgspec.msgpack.Encoder()


def send_msg(sock: socket.socket, msg: msgspec.Struct) -> None:
    body = _encoder.encode(msg)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; `ConnectionError` if the peer closes first."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 26))
        if k == 0:
            raise ConnectionResetError("connection closed by the peer")
        got += k


def recv_msg(sock: socket.socket, typ: type[msgspec.Struct]) -> msgspec.Struct:
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > _MAX_HEADER:
        raise ConnectionError(f"rdma: a {n}-byte header is too long")
    body = bytearray(n)
    recv_exact(sock, memoryview(body))
    return msgspec.msgpack.decode(body, type=typ)


def _refuse(sock: socket.socket, error: str, kind: str = "value") -> None:
    send_msg(sock, TransferReply(ok=False, error=error, kind=kind))


def _serve_one(sock: socket.socket, req: TransferRequest) -> None:
    entry = registry.lookup(req.buffer_id, req.key)
    if entry is None:
        _refuse(sock, f"buffer {req.buffer_id} is not registered here (dropped?)")
        if req.op == "write":
            sock.close()  # the bytes that follow have nowhere to go
        return
    if req.op == "drop":
        registry.drop(req.buffer_id)
        send_msg(sock, TransferReply(ok=True))
        return
    cuda = entry.region is None
    size = entry.obj.numel() * entry.obj.element_size() if cuda else entry.region.nbytes  # type: ignore[union-attr]
    if req.offset < 0 or req.length < 0 or req.offset + req.length > size:
        _refuse(
            sock, f"bytes {req.offset}..{req.offset + req.length} are outside a {size}-byte buffer"
        )
        if req.op == "write":
            sock.close()
        return
    if req.op == "read":
        if cuda:
            flat = entry.obj.reshape(-1).view(__import__("torch").uint8)
            region = region_of(
                flat[req.offset : req.offset + req.length], "buffer", for_write=False
            )
            view = region.view()
        else:
            view = entry.region.view()[req.offset : req.offset + req.length]  # type: ignore[union-attr]
        send_msg(sock, TransferReply(ok=True))
        sock.sendall(view)
        return
    if not cuda and not entry.region.writable:  # type: ignore[union-attr]
        _refuse(sock, "the buffer is read-only")
        sock.close()
        return
    send_msg(sock, TransferReply(ok=True))
    if cuda:
        flat = entry.obj.reshape(-1).view(__import__("torch").uint8)
        dest = region_of(flat[req.offset : req.offset + req.length], "buffer", for_write=True)
        recv_exact(sock, dest.view())
        assert dest.finish is not None
        dest.finish()
    else:
        recv_exact(sock, entry.region.view()[req.offset : req.offset + req.length])  # type: ignore[union-attr]
    send_msg(sock, TransferReply(ok=True))


def _serve_conn(sock: socket.socket, tls: ssl.SSLContext | None) -> None:
    """Serve one reader's connection until it closes (a worker thread)."""
    try:
        sock.setblocking(True)
        sock.settimeout(config.get().rdma_timeout_s)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_side=True)
        while True:
            try:
                req = recv_msg(sock, TransferRequest)
            except (ConnectionError, EOFError):
                return
            assert isinstance(req, TransferRequest)
            _serve_one(sock, req)
    except (OSError, ssl.SSLError, msgspec.DecodeError) as e:
        log.debug("rdma server: a connection ended: %s", e)
    finally:
        sock.close()


class _Server:
    """The listening socket and the accept task on the palatine loop."""

    def __init__(self, host: str, tls: bool) -> None:
        self.tls = tls
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.context = None
        if tls:
            from palatine.channel.tls import server_context

            self.context = server_context()
        self.task: asyncio.Task[None] | None = None
        # the connections being served, each by a thread of its own (ended by `stop`)
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        runtime.post(self._start)
        runtime.at_exit(self.stop)

    def _start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self.sock)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="palatine-rdma", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            _serve_conn(conn, self.context)
        finally:
            with self.lock:
                self.conns.discard(conn)

    async def stop(self) -> None:
        """Stop accepting and end every connection (the proc is stopping): each serving
        thread sees its socket shut and returns."""
        if self.task is not None:
            self.task.cancel()
        self.sock.close()
        with self.lock:
            conns, self.conns = list(self.conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


_server: _Server | None = None
_lock = threading.Lock()


def _bind_host() -> tuple[str, bool]:
    """Where to listen and whether to speak TLS: this proc's own channel address when it
    is an IP one, else ``host_ip`` from the config, else loopback."""
    try:
        from palatine.core.actor import context

        addr = getattr(context().proc, "addr", None)
    except (RuntimeError, LookupError):
        addr = None
    if addr is not None and getattr(addr, "transport", "") in ("tcp", "tls"):
        return addr.host, addr.transport == "tls"
    return config.get().host_ip or "127.0.0.1", False


def ensure_server() -> tuple[str, int, bool]:
    """This process's buffer server, started on first use: (host, port, tls)."""
    global _server
    with _lock:
        if _server is None:
            host, tls = _bind_host()
            _server = _Server(host, tls)
        return _server.host, _server.port, _server.tls
