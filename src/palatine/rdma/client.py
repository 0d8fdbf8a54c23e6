"""The reader's side of the socket backend: requests to an owner proc's buffer server.

Used between hosts, and on one host where the owner's memory cannot be reached
directly (`palatine.rdma.shm.Unreachable`) or the config asks for it
(``rdma_backend="socket"``). Connections are kept, one idle connection per owner
server at most being reused by the next transfer, so a weight sync of many tensors
pays one connect. A closed or refused connection is the owner's death: a
`DeviceException` naming it; a silent one past the timeout a `CallTimeout`.
"""

from __future__ import annotations

import socket
import ssl
import threading

from palatine.errors import CallTimeout, ChannelError
from palatine.rdma.handle import BufferHandle, owner_gone
from palatine.rdma.server import TransferReply, TransferRequest, recv_exact, recv_msg, send_msg

__all__ = ["transfer"]

_idle: dict[tuple[str, int], socket.socket] = {}
_lock = threading.Lock()


def _connect(h: BufferHandle, timeout_s: float, reuse: bool) -> tuple[socket.socket, bool]:
    """A connection to ``h``'s server, and whether it is a kept one (which the server may
    have closed while it was idle)."""
    key = (h.server_host, h.server_port)
    if reuse:
        with _lock:
            sock = _idle.pop(key, None)
        if sock is not None:
            sock.settimeout(timeout_s)
            return sock, True
    raw = socket.create_connection(key, timeout=timeout_s)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not h.tls:
        return raw, False
    from palatine.channel.tls import client_context

    return client_context().wrap_socket(raw, server_hostname=h.server_host), False


def _release(h: BufferHandle, sock: socket.socket) -> None:
    key = (h.server_host, h.server_port)
    with _lock:
        old = _idle.pop(key, None)
        _idle[key] = sock
    if old is not None:
        old.close()


def _check(h: BufferHandle, reply: object, op: str) -> None:
    assert isinstance(reply, TransferReply)
    if not reply.ok:
        raise ValueError(f"rdma {op}: {h.owner}: {reply.error}")


def transfer(
    h: BufferHandle, op: str, offset: int, view: memoryview | None, timeout_s: float
) -> None:
    """``read`` the buffer's bytes at ``offset`` into ``view``, ``write`` ``view`` there, or
    ``drop`` the buffer (``view`` None), through the owner's server."""
    if not h.server_port:
        raise ValueError(f"rdma {op}: the buffer of {h.owner} has no server to reach")
    length = 0 if view is None else len(view)
    req = TransferRequest(op=op, buffer_id=h.buffer_id, key=h.key, offset=offset, length=length)  # type: ignore[arg-type]
    for reuse in (True, False):
        sock: socket.socket | None = None
        answered = kept = False
        try:
            sock, kept = _connect(h, timeout_s, reuse)
            send_msg(sock, req)
            reply = recv_msg(sock, TransferReply)
            answered = True
            _check(h, reply, op)
            if op == "read":
                assert view is not None
                recv_exact(sock, view)
            elif op == "write":
                assert view is not None
                sock.sendall(view)
                _check(h, recv_msg(sock, TransferReply), op)
        except TimeoutError:
            if sock is not None:
                sock.close()
            raise CallTimeout(
                f"rdma {op}: no answer from the buffer's owner {h.owner} within {timeout_s:g} s"
            ) from None
        except ssl.SSLCertVerificationError as e:
            if sock is not None:
                sock.close()
            raise ChannelError(f"rdma {op}: TLS with the buffer's owner {h.owner}: {e}") from None
        except (ConnectionError, ssl.SSLError, OSError) as e:
            if sock is not None:
                sock.close()
            if kept and not answered:
                continue  # the server closed the kept connection while it was idle
            raise owner_gone(h.owner, op, f"{type(e).__name__}: {e}") from None
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        _release(h, sock)
        return
