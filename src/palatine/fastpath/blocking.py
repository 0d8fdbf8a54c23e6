"""A blocking-style client connection, owned by one thread instead of an event loop.

For threads that must talk to a channel server without any loop (the heartbeat thread
of `palatine.hosting.heartbeat`): `BlockingConn.connect` dials a tcp, unix or tls address, runs
the client side of the token handshake (`palatine.wire.handshake`) and opens a fresh
session with ``Init{session_id, next_seq=0}``; `BlockingConn.send`
and `BlockingConn.read` then move whole frames (`palatine.wire.frames`).

The sockets are non-blocking and every wait goes through a `Waiter`: one selector that
also watches a wake-up socket, so each wait is bounded by a deadline and another thread
can interrupt any of them (connect, TLS handshake, token handshake, waiting for a frame)
by setting the owner's stop event and writing to the wake-up socket. Failures raise
`LinkLost` with a human reason (``fatal`` when retrying cannot help); an interrupted wait
raises `Stopped`.
"""

from __future__ import annotations

import errno
import os
import secrets
import selectors
import socket
import ssl
import threading
import time
from typing import Any, Final

from palatine.channel.addr import ChannelAddr
from palatine.channel.net.sockets import tune_socket
from palatine.channel.spin import MAX_WAIT_S
from palatine.channel.tls import client_context
from palatine.config import format_seconds
from palatine.errors import error_text
from palatine.ids import ActorId
from palatine.wire import frames
from palatine.wire.handshake import ClientHandshake, HandshakeError

__all__ = ["BlockingConn", "LinkLost", "Stopped", "Waiter", "error_text"]

_RECV_BYTES: Final = 65536


class Stopped(Exception):
    """The owner asked the thread to stop (see `Waiter`): unwind at once."""


class LinkLost(Exception):
    """The connection failed or ended; ``reason`` says why, ``fatal`` if retrying is futile."""

    def __init__(self, reason: str, *, fatal: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fatal = fatal


class Waiter:
    """Bounded waits on non-blocking sockets that another thread can interrupt.

    ``stop`` is the owner's stop event and ``wake`` the read end of its wake-up socket
    pair: whoever sets the event and writes a byte to the other end interrupts any wait
    (`Stopped`). Use from one thread; `close` releases the selector.
    """

    __slots__ = ("_selector", "_stop", "_wake")

    def __init__(self, stop: threading.Event, wake: socket.socket) -> None:
        self._stop = stop
        self._wake = wake
        self._selector = selectors.DefaultSelector()
        self._selector.register(wake, selectors.EVENT_READ)

    def wait(self, sock: socket.socket | None, events: int, deadline: float) -> bool:
        """Wait until ``sock`` is ready for ``events``; False once ``deadline`` passes.

        With ``sock=None`` it only sleeps until the deadline. Raises `Stopped` when the
        owner stops, whatever it was waiting for.
        """
        selector = self._selector
        if sock is not None:
            selector.register(sock, events)
        try:
            while True:
                if self._stop.is_set():
                    raise Stopped
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    return False
                for key, _ in selector.select(min(timeout, MAX_WAIT_S)):
                    if key.fileobj is self._wake:
                        raise Stopped
                    if sock is not None:
                        return True
        finally:
            if sock is not None:
                selector.unregister(sock)

    def close(self) -> None:
        """Release the selector (the sockets stay the owner's)."""
        self._selector.close()


class BlockingConn:
    """One authenticated connection: its socket, frame parser and session counters.

    ``next_seq`` is the seq of the next message the owner sends on this session,
    ``acked`` the highest seq acknowledged so far and ``ever_acked`` whether any ``Ack``
    has arrived; the owner keeps them up to date.
    """

    __slots__ = ("_waiter", "acked", "ever_acked", "next_seq", "parser", "session_id", "sock")

    def __init__(self, sock: socket.socket, waiter: Waiter) -> None:
        self.sock = sock
        self._waiter = waiter
        self.parser = frames.FrameParser(frames.PREAUTH_MAX_FRAME_BYTES)
        self.session_id = secrets.randbits(64)
        self.next_seq = 0  # the seq of the next message on this session
        self.acked = -1  # highest seq acknowledged
        self.ever_acked = False

    @classmethod
    def connect(
        cls,
        addr: ChannelAddr,
        waiter: Waiter,
        *,
        token: bytes,
        ssl_context: ssl.SSLContext | None,
        max_frame_bytes: int,
        connect_timeout_s: float,
        auth_timeout_s: float,
        limit: float,
        lane: ActorId | None = None,
    ) -> BlockingConn:
        """Dial (``connect_timeout_s``), authenticate (``auth_timeout_s``) and open a fresh
        session (a lane for ``lane``'s replies, if given: `palatine.fastpath.lane`); nothing waits
        past the monotonic time ``limit``."""
        connect_by = min(time.monotonic() + connect_timeout_s, limit)
        sock = _dial(addr, waiter, ssl_context, connect_timeout_s, connect_by)
        conn = cls(sock, waiter)
        try:
            auth_by = min(time.monotonic() + auth_timeout_s, limit)
            conn._handshake(token, max_frame_bytes, auth_timeout_s, auth_by, lane)
        except BaseException:
            conn.close()
            raise
        return conn

    @classmethod
    def connect_configured(cls, addr: ChannelAddr, lane: ActorId | None = None) -> BlockingConn:
        """`connect` with the cluster token and the configured frame limit and timeouts,
        from a thread nobody needs to interrupt (a lane's, or to open a direct session)."""
        from palatine import config
        from palatine.channel.token import resolve_token

        cfg = config.get()
        context = client_context() if addr.transport == "tls" else None
        stop = threading.Event()
        wake_r, wake_w = socket.socketpair()
        waiter = Waiter(stop, wake_r)
        try:
            return cls.connect(
                addr,
                waiter,
                token=resolve_token(),
                ssl_context=context,
                max_frame_bytes=cfg.max_frame_bytes,
                connect_timeout_s=cfg.connect_timeout_s,
                auth_timeout_s=cfg.auth_timeout_s,
                limit=time.monotonic() + cfg.connect_timeout_s + cfg.auth_timeout_s,
                lane=lane,
            )
        finally:
            waiter.close()
            wake_r.close()
            wake_w.close()

    def buffered(self) -> bool:
        """True when TLS has decrypted bytes that a select would not report."""
        return isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0

    def close(self) -> None:
        """Close the socket (idempotent)."""
        try:
            self.sock.close()
        except OSError:
            pass

    def _handshake(
        self,
        token: bytes,
        max_frame_bytes: int,
        auth_timeout_s: float,
        deadline: float,
        lane: ActorId | None = None,
    ) -> None:
        """The client side, then ``Init`` for a brand-new session at seq 0."""
        hs = ClientHandshake(token)
        while not hs.done:
            got = self.read(deadline)
            if not got:
                raise LinkLost(
                    f"handshake timeout: not authenticated within {format_seconds(auth_timeout_s)} s"
                )
            for frame in got:
                try:
                    reply = hs.receive(frame)
                except HandshakeError as exc:
                    raise LinkLost(exc.reason, fatal=exc.fatal) from None
                if reply is not None:
                    self.send(frames.encode_frame(reply), deadline)
                if hs.done:
                    break
        self.parser.limit = max_frame_bytes
        self.send(frames.encode_frame(frames.Init(self.session_id, 0, lane)), deadline)

    # -- I/O -----------------------------------------------------------------------------------

    def send(self, data: bytes, deadline: float) -> None:
        """Write all of ``data`` before ``deadline``; raises `LinkLost` if it cannot."""
        view = memoryview(data)
        sock = self.sock
        wait = self._waiter.wait
        while view:
            try:
                n = sock.send(view)
            except (BlockingIOError, ssl.SSLWantWriteError):
                if not wait(sock, selectors.EVENT_WRITE, deadline):
                    raise LinkLost("send timeout: the system is not reading") from None
                continue
            except ssl.SSLWantReadError:
                if not wait(sock, selectors.EVENT_READ, deadline):
                    raise LinkLost("send timeout: the system is not reading") from None
                continue
            except OSError as exc:
                raise LinkLost(error_text(exc)) from None
            view = view[n:]

    def read(self, deadline: float) -> list[frames.Frame]:
        """The frames that arrive before ``deadline`` ([] if none).

        Raises `LinkLost` on EOF, a socket error or a malformed frame.
        """
        sock = self.sock
        wait = self._waiter.wait
        while True:
            if not self.buffered() and not wait(sock, selectors.EVENT_READ, deadline):
                return []
            try:
                data = sock.recv(_RECV_BYTES)
            except (BlockingIOError, ssl.SSLWantReadError):
                continue
            except ssl.SSLWantWriteError:
                wait(sock, selectors.EVENT_WRITE, deadline)
                continue
            except OSError as exc:
                raise LinkLost(error_text(exc)) from None
            if not data:
                if self.parser.at_boundary:
                    raise LinkLost("connection closed by the system")
                raise LinkLost("connection closed by the system inside a frame")
            try:
                got = self.parser.feed(data)
            except frames.FrameError as exc:
                raise LinkLost(f"protocol error: {exc.reason}") from None
            if got:
                return got


# -- connecting ----------------------------------------------------------------------------


def _dial(
    addr: ChannelAddr,
    waiter: Waiter,
    ssl_context: ssl.SSLContext | None,
    connect_timeout_s: float,
    deadline: float,
) -> socket.socket:
    """A connected (and, for tls, TLS-wrapped) non-blocking socket to ``addr``."""
    if addr.transport == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: Any = addr.sockaddr()
    else:
        try:
            infos = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise LinkLost(f"cannot resolve {addr.host}: {error_text(exc)}") from None
        family, kind, proto, _, target = infos[0]
        sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        err = sock.connect_ex(target)
        if err == errno.EAGAIN and addr.transport == "unix":
            # A unix connect never completes later: the listen backlog is full.
            raise LinkLost("the system's listen backlog is full")
        if err in (errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            if not waiter.wait(sock, selectors.EVENT_WRITE, deadline):
                raise LinkLost(
                    f"connect timeout: no connection within {format_seconds(connect_timeout_s)} s"
                )
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise LinkLost(os.strerror(err))
        tune_socket(sock)
        if ssl_context is not None:
            sock = _tls_handshake(sock, addr, waiter, ssl_context, deadline)
    except BaseException:
        sock.close()
        raise
    return sock


def _tls_handshake(
    raw: socket.socket,
    addr: ChannelAddr,
    waiter: Waiter,
    context: ssl.SSLContext,
    deadline: float,
) -> socket.socket:
    try:
        sock = context.wrap_socket(raw, server_hostname=addr.host, do_handshake_on_connect=False)
    except (OSError, ValueError) as exc:
        raise LinkLost(f"tls: {error_text(exc)}") from None
    while True:
        try:
            sock.do_handshake()
            return sock
        except ssl.SSLWantReadError:
            ready = waiter.wait(sock, selectors.EVENT_READ, deadline)
        except ssl.SSLWantWriteError:
            ready = waiter.wait(sock, selectors.EVENT_WRITE, deadline)
        except ssl.SSLCertVerificationError as exc:
            raise LinkLost(f"tls: {exc.verify_message or error_text(exc)}", fatal=True) from None
        except (OSError, ValueError) as exc:
            raise LinkLost(f"tls: {error_text(exc)}") from None
        if not ready:
            raise LinkLost("tls handshake timeout")
